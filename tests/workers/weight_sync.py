"""One GRPO step on FSDP2 over two ranks, its gradient checked against the same step taken by a plain
model on one process; then the new weights go through the storage into each rank's vLLM engine, whose
greedy output must equal transformers' greedy output from the trainer's weights."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from algorithm import Algorithm, grpo_advantages
from roles.engine import Request
from roles.rollout import RolloutEngine
from roles.trainer import PolicyTrainer, grpo_loss_sum, pack
from runtime import init_distributed, shutdown_distributed
from storage import ParameterStorage, TrainState

policy, out = sys.argv[1], sys.argv[2]
d = init_distributed()
tok = AutoTokenizer.from_pretrained(policy)
hyper = dict(lr=1e-3, weight_decay=0.01, grad_clip=1.0, temperature=1.0)
trainer = PolicyTrainer(TrainState(d, policy, keep_reference=False), d.tensors, d.device, micro_batch=2, **hyper)
storage = ParameterStorage(d, "policy", trainer.weight_shapes())
engine = RolloutEngine(policy, tok, seed=0, max_model_len=128, kv_cache_bytes=32 << 20)

prompts = ["12+34=", "999+1=", "5+5=", "1234+4321=", "70+8="]
batch = [{"prompt": p, "prompt_ids": tok(p).input_ids} for p in prompts]
requests = RolloutEngine.requests(batch, group_size=4, step=0, seed=0, temperature=1.0, max_tokens=12)
done = engine.engine.run(requests)
samples = [engine.to_sample(r, done[r.id], batch[r.key[0]]) for r in requests]
rewards = torch.tensor([float(len(s.response_ids) % 3 == 0) for s in samples]).view(len(prompts), 4)
for s, a in zip(samples, grpo_advantages(rewards).flatten().tolist()):
    s.advantage = a

# The same step on one process, whole batch at once: the reference the sharded step must equal.
plain = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
optimizer = torch.optim.AdamW(plain.parameters(), lr=hyper["lr"], betas=(0.9, 0.99),
                              weight_decay=hyper["weight_decay"])
packed = pack(samples, torch.device("cpu"))
# The textbook computation: a log-softmax over the whole vocabulary at every position.
logits = plain(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"]).logits[:, :-1]
logp = torch.log_softmax(logits, dim=-1).gather(-1, packed["input_ids"][:, 1:, None]).squeeze(-1)
logprob_gap = ((logp - packed["old_logp"]).abs() * packed["mask"]).max().item()
advantages = torch.tensor([s.advantage for s in samples])
loss = grpo_loss_sum(logp, packed["old_logp"], advantages, packed["mask"], Algorithm().clip_eps)
(loss / packed["mask"].sum()).backward()
torch.nn.utils.clip_grad_norm_(plain.parameters(), hyper["grad_clip"])
optimizer.step()

trainer.train_step([samples])
# Gradients, not weights: Adam's first step is lr * sign(grad), which turns float noise in a
# near-zero gradient into a full-size difference.
sharded = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
grad_gap = (sum((sharded[n] - p.grad).norm() ** 2 for n, p in plain.named_parameters())
            / sum(p.grad.norm() ** 2 for p in plain.parameters())).sqrt().item()
trained = dict(trainer.full_weights())
initial = dict(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).named_parameters())
moved = max((trained[n] - p).abs().max().item() for n, p in initial.items())
plain.load_state_dict(trained, strict=False)  # the tied head follows the embedding

storage.publish(trainer.full_weights(), version=1)
storage.load_into(engine.engine)
ids = [tok(p).input_ids for p in prompts]
vllm_greedy = engine.engine.run([Request("rollout", (i, 0), x, 16, 0.0) for i, x in enumerate(ids)])
vllm_tokens = [vllm_greedy[f"rollout/0/{i}/0"].token_ids for i in range(len(ids))]
hf_tokens = [plain.generate(torch.tensor([x]), max_new_tokens=16, do_sample=False)[0, len(x):].tolist()
             for x in ids]
json.dump({"logprob_gap": logprob_gap, "grad_gap": grad_gap, "moved": moved,
           "vllm": vllm_tokens, "hf": hf_tokens}, open(f"{out}/rank{d.rank}.json", "w"))
storage.close()
del engine
shutdown_distributed(d)
