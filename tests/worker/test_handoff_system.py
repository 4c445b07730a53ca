"""The whole handoff path on loopback: the real scheduler (roles, SEND and RECEIVE, results
applied), one prefill worker and two decode workers with the reference engine on the tiny
Qwen3.5 and Qwen3-Next models, each with its handoff channel. Greedy outputs equal a co-located worker's;
the prompts are computed on the prefill worker."""

from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from tests.worker.conftest import generate, start_scheduler
from worker_client.client import RetryPolicy, SchedulerClient
from worker_client.handoff_channel import HandoffServer, OfferBook, fetch_sequence
from worker_client.handoffs import HandoffAgent
from worker_client.loop import WorkerLoop
from worker_client.resources import WorkerResources, WorkerRole

torch = pytest.importorskip("torch")
from worker_client.engine.engine import ModelEngine  # noqa: E402
from worker_client.engine.loading import load_model  # noqa: E402

pytestmark = pytest.mark.slow  # three engines and a scheduler: tens of seconds

# The scheduler keeps prompts under 1,024 tokens to compute co-located (its rule's
# min_uncached_tokens): these are all long enough to go to the prefill worker.
NUM_PROMPTS = 4
SPLIT = {
    "prefill-0": WorkerRole.PREFILL,
    "decode-0": WorkerRole.DECODE,
    "decode-1": WorkerRole.DECODE,
}
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["tiny", "tiny-next"])  # Qwen3.5, Qwen3-Next
def model(request):
    return load_model(request.param, device="cpu", dtype=torch.float32, seed=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(1030, 1100))] for _ in range(4)]


def _fetch(order, timeout_seconds):
    return fetch_sequence(
        order.peer_address,
        order.transfer_id,
        order.seq_id,
        order.cached_tokens,
        timeout_seconds=timeout_seconds,
    )


class Worker:
    """A worker loop of `role` on its own thread, with a handoff channel."""

    def __init__(
        self, model, port: int, worker_id: str, role: WorkerRole, *, channel_up: bool = True
    ) -> None:
        """`channel_up` False: the handoff channel is registered but gone (its server
        stopped), as after a sender's crash that its lease has not yet noticed."""
        self.engine = ModelEngine(
            model, total_kv_pages=512, page_size=16, total_gdn_slots=8, device="cpu"
        )
        self.offers = OfferBook()
        self.server = HandoffServer(self.offers, host="127.0.0.1")
        self.server.start()
        if not channel_up:
            self.server.stop(0)
        self.agent = HandoffAgent(self.engine, self.offers, _fetch)
        resources = dataclasses.replace(
            WorkerResources.of(worker_id, self.engine),
            role=role,
            transfer_bytes_per_second=1e9 if role is not WorkerRole.BOTH else 0.0,
            handoff_address=f"127.0.0.1:{self.server.port}" if role is not WorkerRole.BOTH else "",
        )
        self.client = SchedulerClient(
            f"127.0.0.1:{port}", call_timeout_seconds=5.0, retry=RetryPolicy(total_seconds=5.0)
        )
        self.loop = WorkerLoop(
            self.engine,
            self.client,
            resources,
            idle_sleep_seconds=0.002,
            overlap=True,  # as lattice-worker runs them, prefill workers too
            handoffs=self.agent if role is not WorkerRole.BOTH else None,
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(20)
        self.client.close()
        self.server.stop(0)


def _prefill_tokens_metric(registry) -> dict[str, float]:
    """lattice_scheduler_worker_prefill_tokens_total per worker, every source added up."""
    totals: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "lattice_scheduler_worker_prefill_tokens_total":
                worker_id = sample.labels["worker_id"]
                totals[worker_id] = totals.get(worker_id, 0.0) + sample.value
    return totals


def _run(
    model, roles: dict[str, WorkerRole], channels_down: frozenset[str] = frozenset()
) -> tuple[list[list[int]], dict[str, Worker], dict]:
    """Every prompt through a scheduler with workers of `roles`: outputs, workers and the
    scheduler's prompt tokens computed per worker."""
    scheduler = start_scheduler()
    workers = {
        name: Worker(model, scheduler.port, name, role, channel_up=name not in channels_down)
        for name, role in roles.items()
    }
    channel = grpc.insecure_channel(f"127.0.0.1:{scheduler.port}")
    stub = pb_grpc.SchedulerStub(channel)
    sampling = pb.SamplingParams(ignore_eos=True)
    try:
        with ThreadPoolExecutor(NUM_PROMPTS) as pool:
            results = list(
                pool.map(
                    lambda p: generate(stub, p, MAX_NEW_TOKENS, timeout=120.0, sampling=sampling),
                    _prompts(),
                )
            )
        # Read while the workers are registered: a worker's series go when it leaves.
        metric = _prefill_tokens_metric(scheduler.registry)
    finally:
        channel.close()
        for worker in workers.values():
            worker.close()
        scheduler.stop(0)
    return [tokens for _, tokens, _ in results], workers, metric


def test_one_prefill_and_two_decode_workers_give_the_co_located_tokens(model):
    colocated, _, _ = _run(model, {"both-0": WorkerRole.BOTH})
    split, workers, metric = _run(model, SPLIT)
    assert split == colocated
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in split)

    imported = {name: w.agent.num_imported for name, w in workers.items()}
    assert imported["prefill-0"] == 0
    assert imported["decode-0"] + imported["decode-1"] == NUM_PROMPTS
    prefill_tokens = {name: w.loop.stats.prefill_tokens for name, w in workers.items()}
    share = prefill_tokens["prefill-0"] / sum(prefill_tokens.values())
    print(f"prompt tokens computed per worker: {prefill_tokens}, prefill share {share:.3f}")
    print(f"lattice_scheduler_worker_prefill_tokens_total: {metric}")
    assert share >= 0.9
    assert metric.get("prefill-0", 0) / sum(metric.values()) >= 0.9


def test_a_sender_whose_channel_is_gone_decodes_its_sequences_itself(model):
    colocated, _, _ = _run(model, {"both-0": WorkerRole.BOTH})
    split, workers, _ = _run(model, SPLIT, channels_down=frozenset({"prefill-0"}))
    # Every handoff failed (SENDER_UNREACHABLE): the sender kept each sequence and
    # decoded it; nothing lost, no token twice.
    assert split == colocated
    assert sum(w.agent.num_imported for w in workers.values()) == 0
