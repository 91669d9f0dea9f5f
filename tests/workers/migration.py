"""Sequences cut mid-generation and resumed on another engine, once or several times, end exactly as
the same sequences generated without a cut: greedy and sampled (each request its own seed)."""
import json
import sys

from roles.engine import Engine, Request
from runtime import init_distributed, shutdown_distributed
from transformers import AutoTokenizer

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
json.dump(results, open(f"{out}/rank{d.rank}.json", "w"), indent=1)
for engine in engines:
    engine.close()
shutdown_distributed(d)
