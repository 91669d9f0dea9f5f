"""The generative reward model: it reads the prompt and a response, writes a critique, and ends with a
verdict line, which is parsed into the reward (correct -> 1.0, wrong -> 0.0).

A judge output with no readable verdict is a parse failure, counted per step and handled by one of
three rules (`--on-parse-failure`): `fail` scores it 0.0; `retry` judges it once more with sampling
(temperature 1.0) and scores 0.0 if that fails too; `stop` ends the run with the offending output.
"""
import re

import numpy as np

from roles.engine import Completion, Engine, Request

VERDICT = re.compile(r"verdict:\s*(correct|wrong)\b")
REWARD = {"correct": 1.0, "wrong": 0.0}
PARSE_RULES = ("fail", "retry", "stop")


class ParseFailure(RuntimeError):
    pass


def parse_verdict(critique: str) -> float | None:
    """The reward the last verdict line gives, or None when there is none."""
    found = VERDICT.findall(critique)
    return REWARD[found[-1]] if found else None


def fill_template(template: str, prompt: str, response: str, reference: str | None) -> str:
    return template.format(prompt=prompt, response=response, reference=reference or "")


class GenRM:
    def __init__(self, genrm_dir: str, tokenizer, template: str, *, seed: int, max_model_len: int,
                 kv_cache_bytes: int, max_tokens: int, on_parse_failure: str):
        self.tokenizer, self.template, self.seed = tokenizer, template, seed
        self.max_tokens, self.on_parse_failure = max_tokens, on_parse_failure
        self.engine = Engine(genrm_dir, seed=seed, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)

    def request(self, sample, step: int, retry: bool = False) -> Request:
        """The judge's request for a sample: greedy, or sampled with its own seed on a retry."""
        ids = self.tokenizer.encode(fill_template(self.template, sample.prompt, sample.response, sample.reference))
        rid = f"j/{sample.prompt_index}/{sample.sample_index}"
        if not retry:
            return Request(rid, ids, self.max_tokens, 0.0)
        seed = int(np.random.SeedSequence([self.seed, step, *sample.key]).generate_state(1)[0])
        return Request(rid + "/retry", ids, self.max_tokens, 1.0, seed)

    def score(self, sample, request: Request, done: Completion) -> bool:
        """Sets the sample's critique and reward; False when the verdict is unreadable and the rule
        asks for another try (the caller then judges `self.request(sample, step, retry=True)`)."""
        sample.critique = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        sample.critique_tokens = len(done.token_ids)
        reward = parse_verdict(sample.critique)
        sample.parse_failed, sample.reward = reward is None, reward or 0.0
        if reward is None and self.on_parse_failure == "stop":
            raise ParseFailure(f"the judge's output has no verdict line (--on-parse-failure stop): "
                               f"{sample.critique!r}; choose 'fail' or 'retry' to go on past such outputs")
        return not (reward is None and self.on_parse_failure == "retry" and not request.id.endswith("/retry"))

    def judge(self, samples, step: int, progress=None) -> int:
        """Judges samples here, to completion (evaluation); returns the first-try parse failures."""
        requests = [self.request(s, step) for s in samples]
        done = self.engine.run(requests, progress)
        again = [s for s, r in zip(samples, requests) if not self.score(s, r, done[r.id])]
        failures = sum(s.parse_failed for s in samples)
        if again:
            retries = [self.request(s, step, retry=True) for s in again]
            done = self.engine.run(retries)
            for s, r in zip(again, retries):
                self.score(s, r, done[r.id])
        return failures
