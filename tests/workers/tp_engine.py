"""Engines of `tp` ranks (vLLM tensor parallel under the external launcher) loaded from the storage: for each
model directory, a storage holding its checkpoint, an engine started with dummy weights that loads them from
there (full-shaped tensors; each rank's weight loaders cut its share), and its greedy answers and sampled
tokens, written per rank with transformers' greedy answers."""
import gc
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from roles import Role
from roles.engine import Request
from roles.rollout import RolloutEngine
from runtime import init_distributed, shutdown_distributed
from storage import checkpoint_storage
from tasks.dataset import encode_prompt

out, tp, model_dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
d = init_distributed()
prompts = ["12+34=", "999+1=", "5+5=", "70+8="]
results, kept = {}, []
for model_dir in model_dirs:
    tok = AutoTokenizer.from_pretrained(model_dir)
    storage = checkpoint_storage(d, Role.ROLLOUT, model_dir, torch.float32)
    engine = RolloutEngine(model_dir, tok, seed=0, max_model_len=128, kv_cache_bytes=16 << 20, from_storage=True,
                           tensor_parallel=tp)
    dummy = engine.greedy([encode_prompt(tok, p) for p in prompts], 12)
    storage.load_into(engine.engine)
    ids = [encode_prompt(tok, p) for p in prompts]
    sampled = engine.engine.run([Request(Role.ROLLOUT, (i, 0), x, 12, 1.0, seed=100 + i) for i, x in enumerate(ids)])
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = [tok.decode(plain.generate(torch.tensor([x]), max_new_tokens=12, do_sample=False)[0, len(x):],
                     skip_special_tokens=True) for x in ids]
    results[model_dir] = {"vllm": engine.greedy(ids, 12), "hf": hf, "dummy": dummy,
                          "sampled": [sampled[r].token_ids for r in sorted(sampled)]}
    kept += [engine, storage]  # kept to the end: an engine takes the process group down with it

json.dump(results, open(f"{out}/tp{tp}-rank{d.rank}.json", "w"))
del kept, engine, storage
gc.collect()
shutdown_distributed(d)
