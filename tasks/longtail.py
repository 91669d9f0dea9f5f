"""`--workload longtail`: a throughput workload. The built-in task's prompts and models, but each
response and each critique is generated to a length drawn for it, log-normal with the 99th percentile
at the token budget (`--max-response-tokens`, `--max-critique-tokens`) and the median a tenth of it:
the shape of RL rollouts' long tail that Laminar reports (Sheng et al., arXiv 2510.12633: p99 about
10x the median), the shape sim/ is calibrated on. End-of-sequence is ignored so a sequence runs to its
drawn length. The lengths are not the model's, so rewards under this workload mean nothing: it
measures how a placement copes with a tail, and every run of it says so.
"""
import math

import numpy as np

P99_OVER_MEDIAN = 10.0
SIGMA = math.log(P99_OVER_MEDIAN) / 2.3263  # 2.3263: the standard normal's 99th percentile
RESPONSE, CRITIQUE = 0, 1
LABEL = "workload longtail: a throughput workload (lengths drawn, end-of-sequence ignored); its rewards mean nothing"


def length(seed: int, step: int, key: tuple[int, int], kind: int, budget: int) -> int:
    """The drawn length of one sample's response (kind RESPONSE) or critique (CRITIQUE): a function of
    the run's seed, the step and the sample alone, so every placement and every rerun draws the same."""
    z = np.random.default_rng([seed, step, *key, kind]).standard_normal()
    return int(min(budget, max(1, round(budget / P99_OVER_MEDIAN * math.exp(SIGMA * z)))))


def lengths(workload: str, seed: int, kind: int, budget: int):
    """What RolloutEngine.requests and Judge take as `lengths`: under this workload, (step, sample key) ->
    the drawn `length` of `kind`; under any other (`--workload task`), None, so that each sequence ends
    where its model ends it. The caller hands it over, so that roles/ knows no workload."""
    if workload != "longtail":
        return None
    return lambda step, key: length(seed, step, key, kind, budget)
