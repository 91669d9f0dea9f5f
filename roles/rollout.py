"""The policy's side of a step: G sampled responses per prompt, and greedy answers for evaluation."""
from dataclasses import dataclass, field

import numpy as np

from roles import Role
from roles.engine import Completion, Engine, Request


@dataclass
class Sample:
    prompt_index: int  # position of the prompt among the step's prompts
    sample_index: int  # 0..G-1 within its group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # sampling logprob of each response token
    finish_reason: str
    response: str = ""
    reference: str | None = None
    prompt: str = ""
    rubric: str | None = None  # the rubric judge's criteria for this prompt
    reward: float = 0.0  # what the update uses: the sources' scores, weighed by --reward (algorithm.py)
    scores: dict[str, float] = field(default_factory=dict)  # each reward source's score
    critique: str = ""
    parse_failed: bool = False
    advantage: float = 0.0
    prefill_tokens: int = 0  # prefilled again because the sequence migrated
    critique_tokens: int = 0
    judge_prompt_tokens: int = 0  # the judge's prompt: its template filled with the prompt and response
    version: int = 0  # the policy weights' version that sampled its first token: the one its staleness counts
    # (index of the first token, version) per stretch of tokens that one version sampled (Request.versions)
    versions: list[tuple[int, int]] = field(default_factory=list)
    pi_old: list[float] | None = None  # rollout correction: logprobs of the weights an update starts from
    dropped: bool = False  # --filter-groups: its group's rewards are all equal, so the update leaves it out
    step: int = 0  # the step whose prompts it answers (an update may train groups of two steps: --updates ready)

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt_index, self.sample_index

    @property
    def id(self) -> tuple[int, int, int]:
        """(step, prompt, sample): unique within a run, as its requests' ids are."""
        return self.step, self.prompt_index, self.sample_index

    @property
    def group(self) -> tuple[int, int]:
        """(step, prompt): its group, unique within a run."""
        return self.step, self.prompt_index


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """Each sample's own seed: G requests sharing one seed would return G identical responses, and a
    seed tied to (step, prompt, sample) rather than to a rank makes any placement sample the same."""
    return int(np.random.SeedSequence([seed, step, prompt_index, sample_index]).generate_state(1)[0])


def eval_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sampled answer `sample_index` to held-out prompt `prompt_index` (--eval-samples): the
    same at every evaluation, so avg@k moves with the weights and not with the draw, and a stream of its
    own (spawn_key), apart from the training samples' seeds."""
    entropy = np.random.SeedSequence([seed, prompt_index, sample_index], spawn_key=(1,))
    return int(entropy.generate_state(1)[0])


class RolloutEngine:
    def __init__(self, policy_dir: str, tokenizer, *, seed: int, max_model_len: int, kv_cache_bytes: int,
                 **engine_options):
        """`engine_options`: `Engine`'s sleep mode, weights from storage and device memory margin."""
        self.tokenizer = tokenizer
        self.engine = Engine(policy_dir, seed=seed, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                             **engine_options)

    @staticmethod
    def requests(prompts: list[dict], *, group_size: int, step: int, seed: int, temperature: float,
                 max_tokens: int, lengths=None) -> list[Request]:
        """One request per sample of the step, in (prompt, sample) order. `lengths` (a throughput
        workload's, tasks/longtail.py): (step, sample key) -> the length each runs to in place of
        `max_tokens`, end-of-sequence ignored."""
        def budget(key):
            return lengths(step, key) if lengths is not None else max_tokens
        return [Request(Role.ROLLOUT, (i, g), record["prompt_ids"], budget((i, g)), temperature,
                        sample_seed(seed, step, i, g), ignore_eos=lengths is not None, step=step)
                for i, record in enumerate(prompts) for g in range(group_size)]

    def to_sample(self, request: Request, done: Completion, record: dict) -> Sample:
        return Sample(*request.key, request.prompt_ids, done.token_ids, done.logprobs, done.finish_reason,
                      response=self.tokenizer.decode(done.token_ids, skip_special_tokens=True),
                      reference=record.get("reference"), prompt=record["prompt"], rubric=record.get("rubric"),
                      prefill_tokens=done.prefill_tokens, version=done.versions[0][1], versions=done.versions,
                      step=request.step)

    def sample(self, prompts: list[tuple[int, list[int]]], k: int, temperature: float, max_tokens: int,
               seed: int) -> list[list[str]]:
        """`k` answers at `temperature` to each (held-out index, prompt ids), each with its `eval_seed`."""
        requests = [Request(Role.ROLLOUT, (i, g), ids, max_tokens, temperature, eval_seed(seed, i, g))
                    for i, ids in prompts for g in range(k)]
        done = self.engine.run(requests)
        texts = [self.tokenizer.decode(done[r.id].token_ids, skip_special_tokens=True) for r in requests]
        return [texts[j:j + k] for j in range(0, len(texts), k)]

    def greedy(self, prompt_ids: list[list[int]], max_tokens: int) -> list[str]:
        requests = [Request(Role.ROLLOUT, (i, 0), ids, max_tokens, 0.0) for i, ids in enumerate(prompt_ids)]
        done = self.engine.run(requests)
        return [self.tokenizer.decode(done[r.id].token_ids, skip_special_tokens=True) for r in requests]
