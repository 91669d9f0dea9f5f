"""bench/gpu_check.py's checks that need no CUDA (trainer, publish, train shift) over a gloo group of two
ranks, with vLLM made unimportable: what the GPU check runs, but for the device copy and CUDA IPC."""
import sys

sys.modules["vllm"] = None  # from here on, any import of vllm fails

import json  # noqa: E402
from argparse import Namespace  # noqa: E402

from bench import gpu_check  # noqa: E402
from runtime import init_distributed, shutdown_distributed  # noqa: E402

model_dir, out = sys.argv[1:3]
d = init_distributed()
checks = gpu_check.run(d, model_dir, Namespace(samples=4, prompt_tokens=5, response_tokens=7,
                                               micro_batch=2))
lines = [gpu_check.summary(name, check) for name, check in checks.items()]
json.dump({"checks": checks, "lines": lines, "engine_imported": "roles.engine" in sys.modules},
          open(f"{out}/rank{d.rank}.json", "w"))
shutdown_distributed(d)
