"""The generative reward model: it reads the prompt and a response, writes a critique, and ends it with a
line that is parsed into the reward. Two kinds of judge (`--judge-kind`), each a template file the user
edits and a parser:

- verdict: the critique ends with `verdict: correct` or `verdict: wrong` -> 1.0 or 0.0.
- rubric: the template shows the example's own rubric ({rubric}, from the data) and the critique ends
  with `score: N`, an integer from 1 to 10 -> (N - 1) / 9, so 1 -> 0.0 and 10 -> 1.0.

A critique whose final line cannot be read (no verdict; no score, or one that is not an integer from
1 to 10) is a parse failure, counted per step and handled by one of
three rules (`--on-parse-failure`): `fail` scores it 0.0; `retry` judges it once more with sampling
(temperature 1.0) and scores 0.0 if that fails too; `stop` ends the run with the offending critique.
"""
import re
from dataclasses import dataclass, replace

from algorithm import Recipe
from roles import Role
from roles.engine import Completion, Engine, Request
from roles.rollout import sample_seed

VERDICT = re.compile(r"verdict:\s*(correct|wrong)\b")
REWARD = {"correct": 1.0, "wrong": 0.0}
# The score is what follows the last "score:" (any case): "score: 7", "Score: 10/10". Anything else there
# ("score: 7.5", "score: seven", "score: 11") is a parse failure rather than a guess.
SCORE = re.compile(r"\bscore\s*:", re.IGNORECASE)
SCORE_VALUE = re.compile(r"[ \t]*(\d+)(?:\s*/\s*10)?(?![\w/]|[.,]\d)")
JUDGE_KINDS = ("verdict", "rubric")
PARSE_RULES = ("fail", "retry", "stop")


class ParseFailure(RuntimeError):
    pass


def parse_verdict(critique: str) -> float | None:
    """The reward the last verdict line gives, or None when there is none."""
    found = VERDICT.findall(critique)
    return REWARD[found[-1]] if found else None


def parse_rubric_score(critique: str) -> float | None:
    """The reward of the last `score: N` (N an integer, 1 to 10), or None when it is missing or malformed."""
    found = list(SCORE.finditer(critique))
    if not found:
        return None
    value = SCORE_VALUE.match(critique, found[-1].end())
    if value is None or not 1 <= int(value.group(1)) <= 10:
        return None
    return (int(value.group(1)) - 1) / 9


def parser(judge_kind: str):
    """The parser of a judge kind's final line: critique -> reward in [0, 1], or None."""
    return parse_rubric_score if judge_kind == "rubric" else parse_verdict


def fill_template(template: str, prompt: str, response: str, reference: str | None, rubric: str | None = None) -> str:
    return template.format(prompt=prompt, response=response, reference=reference or "", rubric=rubric or "")


class Judge:
    def __init__(self, judge_dir: str, tokenizer, template: str, *, seed: int, max_model_len: int,
                 kv_cache_bytes: int, max_tokens: int, on_parse_failure: str, encode_prompt,
                 judge_kind: str = "verdict", lengths=None, recipe: Recipe = Recipe(), **engine_options):
        """`encode_prompt`: (tokenizer, text) -> the prompt's ids (tasks/dataset.py's: in the chat template
        when the tokenizer has one); `lengths` (a throughput workload's, tasks/longtail.py): (step, sample
        key) -> the length a critique runs to in place of `max_tokens`, end-of-sequence ignored; `recipe`:
        the reward's sources (algorithm.py); `engine_options`: `Engine`'s sleep mode, weights from storage and
        device memory margin."""
        self.tokenizer, self.template, self.seed, self.recipe = tokenizer, template, seed, recipe
        self.encode_prompt, self.lengths = encode_prompt, lengths
        self.judge_kind, self.parse = judge_kind, parser(judge_kind)
        self.max_tokens, self.on_parse_failure = max_tokens, on_parse_failure
        self.engine = Engine(judge_dir, seed=seed, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                             **engine_options)

    def request(self, sample, step: int, retry: bool = False) -> Request:
        """The judge's request for a sample: greedy, or sampled with its own seed on a retry; with
        `lengths`, a critique of the length drawn for it."""
        text = fill_template(self.template, sample.prompt, sample.response, sample.reference, sample.rubric)
        ids = self.encode_prompt(self.tokenizer, text)
        budget = self.lengths(step, sample.key) if self.lengths is not None else self.max_tokens
        if not retry:
            return Request(Role.JUDGE, sample.key, ids, budget, 0.0, ignore_eos=self.lengths is not None, step=step)
        return Request(Role.JUDGE, sample.key, ids, budget, 1.0, sample_seed(self.seed, step, *sample.key),
                       retry=True, ignore_eos=self.lengths is not None, step=step)

    def verdict(self, request: Request, done: Completion, step: int) -> "Verdict":
        """What the critique says of one response; with the retry rule, an unreadable first try
        carries the request that judges it once more (sampled, with the sample's own seed)."""
        critique = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        reward = self.parse(critique)
        if reward is None and self.on_parse_failure == "stop":
            line = "verdict line" if self.judge_kind == "verdict" else "score: N line (1-10)"
            raise ParseFailure(f"the critique has no readable {line} (--on-parse-failure stop): "
                               f"{critique!r}; choose 'fail' or 'retry' to go on past such critiques")
        retry = None
        if reward is None and self.on_parse_failure == "retry" and not request.retry:
            retry = replace(request, temperature=1.0, seed=sample_seed(self.seed, step, *request.key), retry=True,
                            generated=[], logprobs=[], rng_state=None, prefill_tokens=0, versions=[])
        return Verdict(request.key, critique, len(done.token_ids), len(request.prompt_ids), reward or 0.0,
                       reward is None, not request.retry, done.prefill_tokens, retry, self.recipe, request.step)

    def judge(self, samples, step: int) -> int:
        """Judges samples here, to completion (evaluation); returns the first-try parse failures."""
        again, failures = [], 0
        for s, v in zip(samples, self._run([self.request(s, step) for s in samples], step)):
            v.apply(s)
            failures += v.parse_failed
            if v.retry:
                again.append((s, v.retry))
        for (s, _), v in zip(again, self._run([r for _, r in again], step)):
            v.apply(s)
        return failures

    def _run(self, requests: list[Request], step: int) -> list["Verdict"]:
        done = self.engine.run(requests)
        return [self.verdict(r, done[r.id], step) for r in requests]


@dataclass
class Verdict:
    """The judge's reading of one response, made where the critique was written and applied to the
    sample where the step's samples are kept."""
    key: tuple[int, int]
    critique: str
    critique_tokens: int
    judge_prompt_tokens: int
    reward: float
    parse_failed: bool
    first_try: bool
    prefill_tokens: int  # prefilled again because the judge's sequence migrated
    retry: Request | None = None  # the judge tries once more (--on-parse-failure retry)
    recipe: Recipe = Recipe()  # how the verdict and the rule sources make the reward
    step: int = 0  # the RL step of the sample it judges

    def apply(self, sample) -> None:
        """The one place a sample gets its reward: the judge's score with the recipe's rule scores."""
        sample.critique, sample.critique_tokens = self.critique, self.critique_tokens
        sample.judge_prompt_tokens, sample.parse_failed = self.judge_prompt_tokens, self.parse_failed
        sample.scores = self.recipe.scores(sample.response, len(sample.response_ids), sample.reference, self.reward)
        sample.reward = self.recipe.reward(sample.scores)
        if self.first_try:
            sample.prefill_tokens += self.prefill_tokens
