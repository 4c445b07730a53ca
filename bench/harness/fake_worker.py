"""A worker that speaks the wire protocol from the benchmark's own process (grpc.aio): fake
reports at the rate a benchmark asks for, no model behind them; and what its clients
share (channels, a burst of Submits)."""

from __future__ import annotations

import asyncio
import time

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client.convert import PendingReport

PROMPT = list(range(1, 17))
RPC_TIMEOUT = 30.0


class FakeWorker:
    """A worker speaking the wire protocol from this process: unary calls or one session.

    `worker_form`: its reports are built as the project's worker builds them
    (worker_client.convert.PendingReport: packed tokens with offsets, and a running list
    left out when unchanged, each only where the scheduler's registration allows it);
    otherwise one TokenUpdate per sequence without offsets, the running list in full."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        worker_id: str,
        session: bool,
        metadata=(),
        worker_form: bool = False,
    ) -> None:
        self.stub = pb_grpc.SchedulerStub(channel)
        self.worker_id = worker_id
        self.session = session
        self._metadata = metadata
        self._call = None
        self.running: list[int] = []
        self._pending = PendingReport() if worker_form else None

    async def register(self, max_batch_size: int, slots: int) -> None:
        settings = await self.stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id=self.worker_id,
                total_kv_pages=1_000_000,
                page_size=16,
                total_gdn_slots=slots,
                max_batch_size=max_batch_size,
            ),
            timeout=RPC_TIMEOUT,
            metadata=self._metadata,
        )
        if self._pending is not None:
            self._pending.packed_tokens = settings.accepts_token_runs
            self._pending.running_unchanged = settings.accepts_running_unchanged

    async def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if not self.session:
            decision = await self.stub.SelectBatch(
                request, timeout=RPC_TIMEOUT + 5, metadata=self._metadata
            )
        else:
            if self._call is None:
                self._call = self.stub.WorkerSession(metadata=self._metadata)
            await self._call.write(request)
            decision = await self._call.read()
        if self._pending is not None:
            self._pending.delivered(decision.iteration)
        return decision

    def report(
        self,
        slots: int,
        tokens: bool = True,
        idle_wait_ms: int = 0,
    ) -> pb.SelectBatchRequest:
        """What it holds (running, one new token each when `tokens`), and free slots."""
        if self._pending is not None:
            if tokens:
                self._pending.tokens.update((s, [7]) for s in self.running)
            return self._pending.request(
                self.worker_id,
                waiting=(),
                running=self.running,
                kv_free_pages=1_000_000,
                gdn_free_slots=max(0, slots - len(self.running)),
                draining=False,
                idle_wait_seconds=idle_wait_ms / 1000,
            )
        return pb.SelectBatchRequest(
            worker_id=self.worker_id,
            running=self.running,
            kv_free_pages=1_000_000,
            gdn_free_slots=max(0, slots - len(self.running)),
            idle_wait_ms=idle_wait_ms,
            tokens=[pb.TokenUpdate(seq_id=s, token_ids=[7]) for s in self.running]
            if tokens
            else [],
        )

    async def admit(self, slots: int) -> None:
        """One call that fills its batch from the queue."""
        decision = await self.select(self.report(slots, tokens=False))
        admitted = [c.seq_id for c in decision.prefill if c.HasField("spec")]
        if self._pending is not None:
            for seq_id in admitted:
                self._pending.admitted(seq_id)
        self.running += admitted

    async def close(self) -> None:
        if self._call is not None:
            await self._call.done_writing()
            self._call.cancel()


async def iterate_for(
    workers: list[FakeWorker],
    seconds: float,
    slots: int,
    tokens: bool = True,
    step_seconds: float = 0.0,
) -> list[float]:
    """Every worker reports and reads its decision, then spends `step_seconds` on its step
    (0: back to back, the scheduler saturated); each round trip's seconds."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def one(worker: FakeWorker) -> None:
        while time.perf_counter() < end:
            started = time.perf_counter()
            await worker.select(worker.report(slots, tokens))
            latencies.append(time.perf_counter() - started)
            if step_seconds:
                await asyncio.sleep(step_seconds)

    await asyncio.gather(*(one(w) for w in workers))
    return latencies


def channels(target: str, count: int) -> list[grpc.aio.Channel]:
    return [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]


async def submit_many(stub, count: int, max_new_tokens: int = 3000, metadata=()) -> list[int]:
    """Submit `count` sequences of PROMPT, 200 at a time; their ids."""
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens)
    ids = []
    for start in range(0, count, 200):
        answers = await asyncio.gather(
            *(
                stub.Submit(request, timeout=RPC_TIMEOUT, metadata=metadata)
                for _ in range(min(200, count - start))
            )
        )
        ids += [a.seq_id for a in answers]
    return ids


async def close_all(workers=(), chans=(), calls=()) -> None:
    """Cancel the open calls, end the workers' sessions, close the channels."""
    for call in calls:
        call.cancel()
    for worker in workers:
        await worker.close()
    for channel in chans:
        await channel.close()
