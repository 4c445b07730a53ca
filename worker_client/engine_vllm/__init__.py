"""A worker engine that drives vLLM step by step (`lattice-worker --engine vllm`).

vLLM runs in-process (one `EngineCore`, no engine subprocess); a subclass of vLLM's own
scheduler (`PlannedScheduler`) makes it run exactly the step the Lattice scheduler
decided, and `VllmEngine` implements `worker_client.engine.api.Engine` over it. Nothing
here is imported unless `--engine vllm` is chosen: vLLM lives in its own environment
(`.venv-vllm`, made by `scripts/setup.sh --engine vllm`).

The hooks used are private to vLLM and change between releases, so the adapter runs only
on the one version it was written against (SUPPORTED_VLLM_VERSION) and checks after every
step that what vLLM ran is what was decided.
"""

SUPPORTED_VLLM_VERSION = "0.32.0"
