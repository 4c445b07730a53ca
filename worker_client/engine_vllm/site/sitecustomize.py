"""Run at the start of each Python process whose path has this folder (set by
`worker_client.engine_vllm.serve` for vLLM's engine-core process): torchvision's missing
operators defined before anything imports it (environment.py says why)."""

from worker_client.engine_vllm.environment import define_missing_torchvision_ops

define_missing_torchvision_ops()
