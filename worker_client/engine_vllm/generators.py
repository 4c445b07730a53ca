"""Seeded sampling on a CPU: the draws of a dropped sample taken back the CPU's way.

After a chunk that ends short of its prompt, vLLM 0.32 still samples a token for the
request, drops it, and then rewinds the request's seeded generator, so that how a prompt is
chunked does not change what it samples: `gen.set_offset(gen.get_offset() - 4)` in
`GPUModelRunner._bookkeeping_sync`. That offset is the CUDA generator's (Philox: 4 per
draw). A CPU generator (Mersenne Twister) has no offset and raises `RuntimeError: CPU
Generator does not use offset`, which killed the worker on the first seeded prompt that the
scheduler chunked.

`keep_dropped_draws` does the rewind with the CPU generator's whole state: the model
runner's `_sample` saves the state of each generator whose sample will be dropped
(`discard_request_mask`, set for this step before sampling) and puts it back after
sampling, and `_bookkeeping_sync` runs with those generators out of its sight, so that its
offset rewind does not run for them. Generators on a CUDA device are left to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The model runner's parts this relies on (vLLM 0.32.0's GPUModelRunner, which the CPU
# runner subclasses); a runner without them is refused at start, not at the first seed.
_RUNNER_PARTS = ("_sample", "_bookkeeping_sync", "discard_request_mask", "input_batch")


def keep_dropped_draws(worker: Any) -> bool:
    """Install the CPU rewind on this vLLM worker's model runner (module docstring).

    Called in the model's process through `collective_rpc`, with vLLM's worker (or its
    wrapper). True when installed. False where there is nothing to mend: a runner off the
    CPU (CUDA generators have the offset), or one without `_bookkeeping_sync` (vLLM's V2
    runner, its default where Triton is installed, seeds draws by position and keeps no
    generator per request)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cpu" or not hasattr(runner, "_bookkeeping_sync"):
        return False
    missing = [part for part in _RUNNER_PARTS if not hasattr(runner, part)]
    if missing:
        raise RuntimeError(
            f"vLLM's model runner ({type(runner).__name__}) lacks {', '.join(missing)}: "
            "the CPU rewind of seeded samples was written against vLLM 0.32.0's"
        )
    runner._sample = _restoring_states(runner, runner._sample)
    runner._bookkeeping_sync = _hiding_generators(runner, runner._bookkeeping_sync)
    return True


def _dropped_cpu_generators(runner: Any) -> dict[int, Any]:
    """{batch index: generator} of this step's requests whose sample is dropped."""
    generators = runner.input_batch.generators
    if not generators:  # no seeded request in the batch: most steps
        return {}
    mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {
        int(i): generators[int(i)]
        for i in mask.nonzero()[0]
        if int(i) in generators and generators[int(i)].device.type == "cpu"
    }


def _restoring_states(runner: Any, sample: Callable) -> Callable:
    def _sample(*args: Any, **kwargs: Any) -> Any:
        saved = [(g, g.get_state()) for g in _dropped_cpu_generators(runner).values()]
        try:
            return sample(*args, **kwargs)
        finally:
            for generator, state in saved:
                generator.set_state(state)

    return _sample


def _hiding_generators(runner: Any, bookkeeping: Callable) -> Callable:
    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        hidden = {i: generators.pop(i) for i in _dropped_cpu_generators(runner)}
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            generators.update(hidden)

    return _bookkeeping_sync
