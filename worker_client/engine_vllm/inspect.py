"""vLLM's model-inspection subprocess, after `environment.load_torchvision` (see there).

python -m worker_client.engine_vllm.inspect   (vLLM starts it; it reads stdin)
"""

from __future__ import annotations

import importlib

from .environment import load_torchvision

if __name__ == "__main__":
    load_torchvision()
    importlib.import_module("vllm.model_executor.models.registry")._run()
