"""Sequences cut mid-generation and resumed on another engine, once or several times, end exactly as
the same sequences generated without a cut: greedy and sampled (each request its own seed). Resumed
under newer weights (a partial rollout), a greedy sequence keeps the tokens the old weights chose and
goes on as the new weights continue that prefix, each stretch marked with its version. And more seeded
prompts at once than an engine step's token budget holds all run to their end."""
import json
import sys

import torch

from roles.engine import Engine, Request
from runtime import init_distributed, shutdown_distributed
from transformers import AutoModelForCausalLM, AutoTokenizer

policy, out = sys.argv[1], sys.argv[2]
d = init_distributed()
tok = AutoTokenizer.from_pretrained(policy)
engines = [Engine(policy, seed=0, max_model_len=128, kv_cache_bytes=16 << 20) for _ in range(2)]
prompts = ["12+34=", "999+1=", "5+5=", "1234+4321=", "70+8=", "4071+389="]


def requests():
    return [Request("rollout", (i, g), tok(p).input_ids, 40, t, seed=1000 + i)
            for i, p in enumerate(prompts) for g, t in enumerate((0.0, 1.0))]


whole = engines[0].run(requests())
results = {}
for cuts in ([3], [1, 5, 9], [2, 2, 2, 2]):
    moving, here = requests(), 0
    engines[here].add(moving)
    done = {}
    for n_steps in cuts:
        for _ in range(n_steps):
            done.update((r.id, c) for r, c in engines[here].step())
        moving = engines[here].export()
        here = 1 - here
        engines[here].add(moving)
    done.update(engines[here].run([]))
    results[str(cuts)] = {
        "same_tokens": all(done[k].token_ids == whole[k].token_ids for k in whole),
        "logprob_gap": max(max((abs(a - b) for a, b in zip(done[k].logprobs, whole[k].logprobs)), default=0)
                           for k in whole),
        "prefilled_again": sum(c.prefill_tokens for c in done.values()),
        "finish_reasons": sorted(c.finish_reason for c in done.values()),
    }
results["lengths"] = sorted(len(c.token_ids) for c in whole.values())

greedy = [r for r in requests() if r.temperature == 0.0]
model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
with torch.no_grad():
    engines[1].load_weights([(name, p * 1.5) for name, p in model.named_parameters()])
engines[1].version = 1
engines[0].add(greedy)
for _ in range(3):
    engines[0].step()
moving = engines[0].export()
resumed = engines[1].run(moving)
again = engines[1].run([Request("rollout", r.key, r.prompt_ids + r.generated, 40 - len(r.generated), 0.0, step=1)
                        for r in moving])
results["across_versions"] = {
    "kept_old_tokens": all(resumed[r.id].token_ids[:len(r.generated)] == whole[r.id].token_ids[:len(r.generated)]
                           for r in moving),
    "new_weights_go_on": all(resumed[r.id].token_ids[len(r.generated):] == again[f"rollout/1/{r.key[0]}/{r.key[1]}"].token_ids
                             for r in moving),
    "changed": any(resumed[r.id].token_ids != whole[r.id].token_ids for r in moving),
    "versions": sorted({str(resumed[r.id].versions) for r in moving}),
    "logprobs_per_token": all(len(c.logprobs) == len(c.token_ids) for c in resumed.values()),
}
# More seeded prompts at once than one engine step's token budget holds (an eval of many sampled answers):
# each is prefilled whole (on CPU no prompt is split over engine steps), and every one runs to its end.
overfull = [Request("rollout", (i, 0), tok("1234+4321=").input_ids * 4, 8, 1.0, seed=2000 + i,
                    ignore_eos=True) for i in range(120)]
assert sum(len(r.prompt_ids) for r in overfull) > 4096
roomy = Engine(policy, seed=0, max_model_len=128, kv_cache_bytes=64 << 20)  # room for them all at once
results["overfull_finished"] = sum(len(c.token_ids) == 8 for c in roomy.run(overfull).values())
roomy.close()
json.dump(results, open(f"{out}/rank{d.rank}.json", "w"), indent=1)
for engine in engines:
    engine.close()
shutdown_distributed(d)
