"""For each model directory: two GRPO steps on FSDP2 over two ranks, the new weights published through the
storage (the trainer's own parameter names) and reloaded into this rank's vLLM engine after each, whose
greedy output must then equal transformers' from the same weights. Also records how far the steps moved
each kind of parameter, so a test can see that MoE experts train. Then the trained policy is exported as
a Hugging Face directory (export.py): transformers' logits from it against those of the trainer's final
weights, and a vLLM engine started from it (vLLM's own loader) against the reloaded engine, greedily."""
import gc
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import export
from roles.rollout import RolloutEngine
from roles.trainer import PolicyTrainer
from runtime import init_distributed, shutdown_distributed
from storage import ParameterStorage, TrainState
from tasks.dataset import encode_prompt

out, model_dirs = sys.argv[1], sys.argv[2:]
d = init_distributed()
hyper = dict(lr=1e-2, weight_decay=0.0, grad_clip=1.0, temperature=1.0)
prompts = ["12+34=", "999+1=", "5+5=", "70+8="]
results, engines = {}, []
for model_dir in model_dirs:
    tok = AutoTokenizer.from_pretrained(model_dir)
    state = TrainState(d, model_dir, keep_reference=False)
    trainer = PolicyTrainer(state, d.tensors, d.device, micro_batch=4, **hyper)
    storage = ParameterStorage(d, "policy", trainer.weight_shapes())
    engine = RolloutEngine(model_dir, tok, seed=0, max_model_len=128, kv_cache_bytes=16 << 20)

    batch = [{"prompt": p, "prompt_ids": encode_prompt(tok, p)} for p in prompts]
    for step in range(2):
        requests = RolloutEngine.requests(batch, group_size=4, step=step, seed=0, temperature=1.0, max_tokens=12)
        done = engine.engine.run(requests)
        samples = [engine.to_sample(r, done[r.id], batch[r.key[0]]) for r in requests]
        for s in samples:  # half of each group above its mean, half below
            s.advantage = 1.0 if s.sample_index % 2 == 0 else -1.0
        trainer.train_step([samples])
        storage.publish_shards(trainer.weight_rows(), version=step + 1)
        storage.load_into(engine.engine)
    state.save(trainer)
    exported = Path(out) / f"export-{Path(model_dir).name}"
    export.write_model(d, state, model_dir, exported)

    trained = {name: t.clone() for name, t in storage.named_tensors()}
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
    missing, unexpected = plain.load_state_dict(trained, strict=False)  # a tied head follows the embedding
    moved = {}
    for name, p in initial.items():
        kind = "experts" if ".experts." in name else "other"
        moved[kind] = max(moved.get(kind, 0.0), (trained[name] - p).abs().max().item())
    ids = [encode_prompt(tok, p) for p in prompts]
    hf = [tok.decode(plain.generate(torch.tensor([x]), max_new_tokens=12, do_sample=False)[0, len(x):],
                     skip_special_tokens=True) for x in ids]
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        logits_gap = max((loaded(torch.tensor([x])).logits - plain(torch.tensor([x])).logits).abs().max().item()
                         for x in ids)
    from_export = RolloutEngine(str(exported), AutoTokenizer.from_pretrained(exported), seed=0, max_model_len=128,
                                kv_cache_bytes=16 << 20)
    results[model_dir] = {"vllm": engine.greedy(ids, 12), "hf": hf, "moved": moved,
                          "unloaded": sorted(missing), "unexpected": sorted(unexpected), "logits_gap": logits_gap,
                          "vllm_from_export": from_export.greedy(ids, 12),
                          "exported_files": sorted(p.name for p in exported.iterdir())}
    storage.close()
    state.close()
    trainer.close()
    engines += [engine, from_export]  # kept to the end: an engine takes the process group down with it

json.dump(results, open(f"{out}/rank{d.rank}.json", "w"))
del engines, engine
gc.collect()
shutdown_distributed(d)
