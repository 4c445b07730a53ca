"""The fourth outside probe's measurable findings, on this checkout and (with --before)
another: what a worker says about its cache and its step times, and a refused body.

1. Resume-point flood: a worker of 64 KV pages of 16 tokens (64 blocks at most) sends six
   reports of 450,000 random block hashes while another worker polls SelectBatch every
   5 ms: the scheduler's memory growth and the other worker's worst SelectBatch.
2. Step-time liar: two workers whose steps really take 20 ms + 50 us a prefill token +
   0.5 ms a decode (they sleep it), one reporting `last_step_us` = 1 (then 4294967295),
   serve 60 requests of 512-token prompts under --tpot-target-ms 100 --ttft-target-ms
   2000: each worker's admissions and worst real step.
3. A 10.8 MB completion body through urllib and the `openai` client against a gateway
   (this checkout's code only, in-process): what each client reads, and how fast.

    .venv/bin/python -m bench.probe_hardening [--before /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness.processes import Scheduler, checkouts, start_scheduler
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

RPC_TIMEOUT = 60.0
NUM_FLOOD_REPORTS = 6
FLOOD_HASHES = 450_000
PROMPT_LEN = 512
NUM_REQUESTS = 60
MAX_NEW_TOKENS = 16


def _stub(scheduler: Scheduler) -> pb_grpc.SchedulerStub:
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    return pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler.target, options=options))


# ------------------------------------------------------------------ 1. the flood


def flood(root: Path) -> dict:
    scheduler = start_scheduler(root=root)
    try:
        stub = _stub(scheduler)
        stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id="flood",
                total_kv_pages=64,
                page_size=16,
                total_gdn_slots=8,
                cache_block_tokens=16,
            ),
            timeout=RPC_TIMEOUT,
        )
        stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id="other", total_kv_pages=1000, page_size=16, total_gdn_slots=8
            ),
            timeout=RPC_TIMEOUT,
        )
        rng = random.Random(0)
        floods = []  # built before the clock starts: building them takes this process's CPU
        for index in range(NUM_FLOOD_REPORTS):
            request = pb.SelectBatchRequest(worker_id="flood", kv_free_pages=64, gdn_free_slots=8)
            request.cache.added.extend(rng.getrandbits(64) for _ in range(FLOOD_HASHES))
            request.cache.reset = index == 0
            floods.append(request)
        # The other worker polls from a process of its own (not behind this one's GIL).
        context = multiprocessing.get_context("spawn")
        done, results = context.Event(), context.Queue()
        poller = context.Process(target=_poll, args=(scheduler.target, done, results))
        poller.start()
        results.get(timeout=60)  # it is polling
        before = scheduler.proc.rss_bytes()
        refused, flood_seconds = [], []
        for request in floods:
            started = time.perf_counter()
            try:
                stub.SelectBatch(request, timeout=RPC_TIMEOUT)
            except grpc.RpcError as err:
                refused.append(f"{err.code().name}: {err.details()[:90]}")
            flood_seconds.append(time.perf_counter() - started)
        time.sleep(0.2)
        done.set()
        latencies = results.get(timeout=60)
        poller.join(10)
        points = scheduler.samples("lattice_scheduler_worker_resume_points")
        return {
            "rss_growth_mb": (scheduler.proc.rss_bytes() - before) / 1e6,
            "other_worst_ms": max(latencies) * 1000,
            "other_calls": len(latencies),
            "flood_report_worst_ms": max(flood_seconds) * 1000,
            "resume_points": sum(points.values()),
            "refused": len(refused),
            "first_refusal": refused[0] if refused else "",
        }
    finally:
        scheduler.proc.stop()


def _poll(target: str, done, results) -> None:
    """Another worker's SelectBatch every 5 ms until `done`; puts "ready", then the
    latencies (seconds) of the calls while the flood was on."""
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(target))
    other = pb.SelectBatchRequest(worker_id="other", kv_free_pages=1000, gdn_free_slots=8)
    for _ in range(20):  # warm: the first calls build the channel
        stub.SelectBatch(other, timeout=RPC_TIMEOUT)
    results.put("ready")
    latencies = []
    while not done.is_set():
        started = time.perf_counter()
        stub.SelectBatch(other, timeout=RPC_TIMEOUT)
        latencies.append(time.perf_counter() - started)
        time.sleep(0.005)
    results.put(latencies)


# ------------------------------------------------------------- 2. step-time liar


def real_step_seconds(num_prefill_tokens: int, num_decodes: int) -> float:
    return (20.0 + 0.05 * num_prefill_tokens + 0.5 * num_decodes) / 1000.0


@dataclass
class _Held:
    prompt_len: int
    max_new_tokens: int
    prefilled: int = 0
    generated: int = 0


@dataclass
class SimWorker:
    """A worker over the wire whose steps really take `real_step_seconds` (it sleeps it)
    and that reports `claim_us` as each step's time (None: the truth)."""

    stub: pb_grpc.SchedulerStub
    worker_id: str
    claim_us: int | None
    held: dict[int, _Held] = field(default_factory=dict)
    admitted: int = 0
    steps: list[float] = field(default_factory=list)  # real seconds of each step with work

    def run(self, stop: threading.Event) -> None:
        self.stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id=self.worker_id,
                total_kv_pages=100_000,
                page_size=16,
                total_gdn_slots=64,
                max_batch_size=64,
            ),
            timeout=RPC_TIMEOUT,
        )
        tokens: dict[int, list[int]] = {}
        offsets: dict[int, int] = {}
        finished: list[pb.FinishedSequence] = []
        last_step_us = 0
        while not stop.is_set():
            request = pb.SelectBatchRequest(
                worker_id=self.worker_id,
                waiting=[s for s, h in self.held.items() if h.prefilled < h.prompt_len],
                running=[s for s, h in self.held.items() if h.prefilled >= h.prompt_len],
                kv_free_pages=100_000,
                gdn_free_slots=64 - len(self.held),
                finished=finished,
                tokens=[
                    pb.TokenUpdate(seq_id=s, token_ids=t, offset=offsets[s])
                    for s, t in tokens.items()
                ],
                last_step_us=last_step_us,
                idle_wait_ms=50,
            )
            decision = self.stub.SelectBatch(request, timeout=RPC_TIMEOUT)
            for s, t in tokens.items():
                offsets[s] += len(t)
            tokens, finished, last_step_us = {}, [], 0
            for seq_id in (*decision.evict, *decision.preempt):
                self.held.pop(seq_id, None)
            num_prefill = 0
            for chunk in decision.prefill:
                if chunk.HasField("spec"):
                    self.held[chunk.seq_id] = _Held(
                        len(chunk.spec.prompt_token_ids), chunk.spec.max_new_tokens
                    )
                    offsets[chunk.seq_id] = 0
                    self.admitted += 1
                held = self.held[chunk.seq_id]
                held.prefilled = chunk.chunk_start + chunk.chunk_len
                num_prefill += chunk.chunk_len
                if held.prefilled >= held.prompt_len:
                    self._token(chunk.seq_id, tokens, finished)
            for seq_id in decision.decode:
                if seq_id in self.held:
                    self._token(seq_id, tokens, finished)
            if num_prefill or decision.decode:
                seconds = real_step_seconds(num_prefill, len(decision.decode))
                time.sleep(seconds)
                self.steps.append(seconds)
                last_step_us = self.claim_us if self.claim_us else round(seconds * 1e6)

    def _token(self, seq_id: int, tokens: dict, finished: list) -> None:
        held = self.held[seq_id]
        held.generated += 1
        tokens.setdefault(seq_id, []).append(7)
        if held.generated >= held.max_new_tokens:
            del self.held[seq_id]
            finished.append(
                pb.FinishedSequence(
                    seq_id=seq_id,
                    reason=pb.FINISH_REASON_MAX_LENGTH,
                    generated_tokens=held.generated,
                )
            )


def liar(root: Path, claim_us: int) -> dict:
    scheduler = start_scheduler("--tpot-target-ms", "100", "--ttft-target-ms", "2000", root=root)
    try:
        stub = _stub(scheduler)
        workers = [SimWorker(stub, "honest", None), SimWorker(stub, "liar", claim_us)]
        stop = threading.Event()
        threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
            time.sleep(0.3)  # both registered and polling before the requests come
        # A few steps each, to learn from, before the queue fills.
        warm = [
            stub.Submit(
                pb.SubmitRequest(prompt_token_ids=[5] * 64, max_new_tokens=8), timeout=RPC_TIMEOUT
            ).seq_id
            for _ in range(4)
        ]
        _wait_finished(stub, warm, 30)
        admitted_before = {w.worker_id: w.admitted for w in workers}
        ids = [
            stub.Submit(
                pb.SubmitRequest(
                    prompt_token_ids=[(i * 7 + j) % 500 + 2 for j in range(PROMPT_LEN)],
                    max_new_tokens=MAX_NEW_TOKENS,
                ),
                timeout=RPC_TIMEOUT,
            ).seq_id
            for i in range(NUM_REQUESTS)
        ]
        _wait_finished(stub, ids, 120)
        budgets = scheduler.samples("lattice_scheduler_worker_token_budget")
        refused = scheduler.samples("lattice_scheduler_step_times_refused_total")
        stop.set()
        for thread in threads:
            thread.join(10)
        out = {}
        for w in workers:
            out[w.worker_id] = {
                "admitted": w.admitted - admitted_before[w.worker_id],
                "worst_step_ms": max(w.steps) * 1000 if w.steps else 0.0,
                "budget": budgets.get((("worker_id", w.worker_id),), 0.0),
            }
        out["refused_claims"] = sum(refused.values())
        return out
    finally:
        scheduler.proc.stop()


def _wait_finished(stub, seq_ids: list[int], timeout_seconds: float) -> None:
    deadline = time.monotonic() + timeout_seconds
    for seq_id in seq_ids:
        while True:
            info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT)
            if info.state == pb.SEQUENCE_STATE_FINISHED:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"seq_id {seq_id} not finished in {timeout_seconds} s")
            time.sleep(0.05)


# ---------------------------------------------------------------- 3. big body


def big_body() -> dict:
    """This checkout's gateway in-process (the fake scheduler of its tests)."""
    import shutil
    import tempfile
    import urllib.error
    import urllib.request

    import openai

    from tests.gateway.inprocess import MODEL, InProcessGateway, write_model

    model_dir = Path(tempfile.mkdtemp(prefix="probe-model-"))
    gateway = InProcessGateway(write_model(model_dir))
    body = json.dumps({"model": MODEL, "prompt": "word " * 2_160_000, "max_tokens": 1})
    out = {"body_mb": len(body) / 1e6}
    try:
        started = time.perf_counter()
        try:
            urllib.request.urlopen(
                urllib.request.Request(
                    gateway.base_url + "/v1/completions",
                    data=body.encode(),
                    headers={"content-type": "application/json"},
                ),
                timeout=30,
            )
            out["urllib"] = "200?"
        except urllib.error.HTTPError as err:
            out["urllib"] = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            out["urllib"] = f"network error: {getattr(err, 'reason', err)}"
        out["urllib_seconds"] = time.perf_counter() - started
        client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="x", max_retries=0)
        started = time.perf_counter()
        try:
            client.completions.create(model=MODEL, prompt="word " * 2_160_000, max_tokens=1)
            out["openai"] = "200?"
        except openai.APIStatusError as err:
            out["openai"] = f"HTTP {err.status_code}"
        except openai.APIConnectionError as err:
            out["openai"] = f"network error: {err.__cause__ or err}"
        out["openai_seconds"] = time.perf_counter() - started
    finally:
        gateway.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="another checkout (e.g. main) to measure first")
    parser.add_argument(
        "--only", choices=["flood", "liar", "body"], action="append", help="these parts only"
    )
    args = parser.parse_args()
    parts = set(args.only or ["flood", "liar", "body"])
    for label, root in checkouts(args.before):
        print(f"== {label} ({root})", flush=True)
        if "flood" in parts:
            print("flood:", json.dumps(flood(root), indent=None), flush=True)
        if "liar" in parts:
            for claim in (1, 2**32 - 1):
                print(f"liar claiming {claim} us:", json.dumps(liar(root, claim)), flush=True)
    if "body" in parts:
        print("== this checkout's gateway")
        print("body:", json.dumps(big_body()), flush=True)


if __name__ == "__main__":
    main()
