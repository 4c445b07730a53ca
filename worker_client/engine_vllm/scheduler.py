"""vLLM's scheduler, made to run one given plan per step (imports vLLM: load it through
`environment.import_vllm` first).

vLLM's `Scheduler.schedule` decides by itself which requests run and how many tokens each
gets. `PlannedScheduler` narrows it to the plan the engine sets before each step:
- requests outside the plan are hidden from `running` and `waiting` for the call, so they
  are held back (their KV blocks and states stay where they are);
- a planned request's token count is clipped to the plan at the last clip vLLM applies on
  both of its paths (`_reserve_prefill_lookahead`, after chunking, alignment and budgets);
- the output is kept (`last_output`) so that the engine can check what was scheduled
  against the plan; the engine refuses beforehand what vLLM could not run exactly.
Async scheduling (vLLM's overlap of the next schedule with the model) is off: the worker
loop already overlaps the step with its report to the Lattice scheduler.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class PlannedScheduler(Scheduler):
    """A vLLM scheduler that runs `plan`: {request_id: tokens this step}, nothing else."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan: dict[str, int] = {}
        self.last_output = None

    def schedule(self, throttle_prefills: bool = False):
        plan = self.plan
        held_back = [r for r in self.running if r.request_id not in plan]
        self.running = [r for r in self.running if r.request_id in plan]
        waiting = []
        while self.waiting:
            waiting.append(self.waiting.pop_request())
        for request in waiting:
            if request.request_id in plan:
                self.waiting.add_request(request)
        try:
            output = super().schedule(False)
        finally:
            self.running.extend(held_back)
            for request in waiting:
                if request.request_id not in plan:
                    self.waiting.add_request(request)
        self.last_output = output
        return output

    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens,
        num_new_local_computed_tokens=0,
        num_external_computed_tokens=0,
    ):
        # vLLM clips a chunk that ends inside a block to nothing unless the block is wider
        # than its token budget; then it runs it (the next chunk stops at the boundary).
        # The engine plans only such chunks or aligned ones, so a planned chunk inside one
        # block runs as that path runs it.
        split = super()._mamba_block_aligned_split(
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        planned = min(num_new_tokens, self.plan.get(request.request_id, 0))
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        block = self.cache_config.block_size
        if split < planned and start + planned <= (start // block + 1) * block:
            return planned
        return split

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        return min(num_new_tokens, self.plan.get(request.request_id, 0))
