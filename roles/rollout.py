"""The policy's side of a step: sample G responses per prompt, and greedy answers for evaluation."""
from dataclasses import dataclass

import numpy as np

from roles.engine import Engine, Request


@dataclass
class Sample:
    prompt_index: int  # position of the prompt in the step's batch
    sample_index: int  # 0..G-1 within its group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # sampling logprob of each response token
    finish_reason: str
    response: str = ""
    reference: str | None = None
    prompt: str = ""
    reward: float = 0.0
    critique: str = ""
    parse_failed: bool = False
    advantage: float = 0.0


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """Each sample's own seed: G requests sharing one seed would return G identical responses, and a
    seed tied to (step, prompt, sample) rather than to a rank makes any placement sample the same."""
    return int(np.random.SeedSequence([seed, step, prompt_index, sample_index]).generate_state(1)[0])


class RolloutEngine:
    def __init__(self, policy_dir: str, tokenizer, *, seed: int, max_model_len: int, kv_cache_bytes: int):
        self.tokenizer = tokenizer
        self.engine = Engine(policy_dir, seed=seed, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)

    def load_weights(self, named_tensors) -> None:
        self.engine.load_weights(named_tensors)

    def sample(self, prompts: list[tuple[int, dict]], *, group_size: int, step: int, seed: int,
               temperature: float, max_tokens: int, progress=None) -> list[Sample]:
        """prompts: (index in the step's batch, {"prompt_ids", "prompt", "reference"})."""
        requests = [Request(f"{step}-{i}-{g}", p["prompt_ids"], max_tokens, temperature,
                            sample_seed(seed, step, i, g))
                    for i, p in prompts for g in range(group_size)]
        done = self.engine.run(requests, progress)
        samples = []
        for i, p in prompts:
            for g in range(group_size):
                c = done[f"{step}-{i}-{g}"]
                samples.append(Sample(i, g, p["prompt_ids"], c.token_ids, c.logprobs, c.finish_reason,
                                      response=self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                      reference=p.get("reference"), prompt=p["prompt"]))
        return samples

    def greedy(self, prompt_ids: list[list[int]], max_tokens: int, progress=None) -> list[str]:
        requests = [Request(f"greedy-{i}", ids, max_tokens, 0.0) for i, ids in enumerate(prompt_ids)]
        done = self.engine.run(requests, progress)
        return [self.tokenizer.decode(done[f"greedy-{i}"].token_ids, skip_special_tokens=True)
                for i in range(len(prompt_ids))]
