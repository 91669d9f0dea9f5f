"""The generative reward model: it reads the prompt and a response, writes a critique, and ends with a
verdict line, which is parsed into the reward (correct -> 1.0, wrong -> 0.0).

A judge output with no readable verdict is a parse failure, counted per step and handled by one of
three rules (`--on-parse-failure`): `fail` scores it 0.0; `retry` judges it once more with sampling
(temperature 1.0) and scores 0.0 if that fails too; `stop` ends the run with the offending output.
"""
import re

import numpy as np

from roles.engine import Engine, Request

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
                 kv_cache_bytes: int):
        self.tokenizer, self.template = tokenizer, template
        self.engine = Engine(genrm_dir, seed=seed, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)

    def judge(self, samples, *, max_tokens: int, on_parse_failure: str, seed: int, progress=None) -> int:
        """Sets `reward`, `critique` and `parse_failed` on every sample; returns the parse failures."""
        prompts = [self.tokenizer.encode(fill_template(self.template, s.prompt, s.response, s.reference))
                   for s in samples]
        critiques = self._run(prompts, list(range(len(samples))), max_tokens, 0.0, seed, progress)
        failed = [i for i, c in enumerate(critiques) if parse_verdict(c) is None]
        if failed and on_parse_failure == "retry":
            again = self._run([prompts[i] for i in failed], failed, max_tokens, 1.0, seed, None)
            for i, c in zip(failed, again):
                critiques[i] = c
        for s, critique in zip(samples, critiques):
            reward = parse_verdict(critique)
            s.critique, s.parse_failed, s.reward = critique, reward is None, reward or 0.0
        n_failed = sum(s.parse_failed for s in samples)
        if n_failed and on_parse_failure == "stop":
            bad = next(s for s in samples if s.parse_failed)
            raise ParseFailure(f"the judge's output has no verdict line (--on-parse-failure stop): "
                               f"{bad.critique!r}; choose 'fail' or 'retry' to go on past such outputs")
        return len(failed)

    def _run(self, prompt_ids, keys, max_tokens, temperature, seed, progress) -> list[str]:
        requests = [Request(f"judge-{k}", ids, max_tokens, temperature,
                            int(np.random.SeedSequence([seed, k]).generate_state(1)[0]) if temperature else None)
                    for k, ids in zip(keys, prompt_ids)]
        done = self.engine.run(requests, progress)
        return [self.tokenizer.decode(done[r.id].token_ids, skip_special_tokens=True) for r in requests]
