"""`lattice-worker`: the reference worker process (a real model, driven by the scheduler);
`lattice-worker profile`: time its engine's steps for `lattice-scheduler simulate`.

Exit codes: 0 left cleanly; 1 the scheduler could not be reached or refused a call; 2 a bad
flag or a model that cannot be loaded; 3 superseded: another process registered the same
--worker-id after this one (restarting it would only take the id back: give each worker
its own id).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace

log = logging.getLogger("lattice_worker")


EXIT_SUPERSEDED = 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        return _profile(argv[1:])
    from common.cli_values import OneLineParser, target

    parser = OneLineParser(
        prog="lattice-worker",
        epilog="`lattice-worker profile --help`: time the engine's steps for the simulator.",
        description="Reference worker: runs a Qwen3.5-architecture model (GDN + attention) "
        "with a paged KV cache and a GDN state pool, as the scheduler decides. "
        "SIGTERM drains (finishes what it holds, takes nothing new) and exits; "
        "a second SIGTERM or SIGINT leaves at once (held sequences are requeued).",
    )
    parser.add_argument(
        "--scheduler",
        type=target,
        default=os.environ.get("LATTICE_SCHEDULER_TARGET", "127.0.0.1:50051"),
        help="scheduler address HOST:PORT, or replicas HOST:PORT,HOST:PORT or "
        "dns:///NAME:PORT: the worker talks to one and moves to the next "
        "when it is unavailable (env LATTICE_SCHEDULER_TARGET)",
    )
    parser.add_argument("--worker-id", required=True, help="unique name of this worker")
    from common.credentials import add_client_arguments

    add_client_arguments(parser)
    parser.add_argument(
        "--model",
        required=True,
        help="a Hugging Face checkpoint directory (config.json + "
        "*.safetensors); 'tiny', 'tiny-moe' or 'tiny-next' (small Qwen3.5, "
        "Qwen3.5 MoE or Qwen3-Next models with seeded random weights, for "
        "trying things out), or 'small' (a 35M-parameter Qwen3.5 with seeded "
        "random weights, for CPU benchmarks); or 'scripted' (no model: "
        "worker_client.testing.ScriptedEngine, for load-testing a scheduler)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        help="scripted model only: simulated GPU time per step with work, in "
        "milliseconds (default 0), so that faults can land mid-run",
    )
    from worker_client.engines import ENGINES

    parser.add_argument(
        "--engine",
        default="reference",
        choices=tuple(ENGINES),
        help="; ".join(f"{e.name}: {e.help}" for e in ENGINES.values()),
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on CUDA, float32 on CPU (vllm: bfloat16)",
    )
    _add_vllm_arguments(parser)
    parser.add_argument(
        "--kv-pages", type=int, help="KV-cache pages (default: sized for the device)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--gdn-slots", type=int, help="GDN state slots (default: sized for the device)"
    )
    parser.add_argument(
        "--cache-block-tokens",
        type=int,
        help="tokens per prefix-cache block, a multiple of --page-size "
        "(default: 4 pages; the scripted model keeps a cache only "
        "with this flag)",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        help="most cached blocks no running sequence uses (their pages count "
        "as free and are reclaimed least recently used first; default: "
        "as many as the free pages hold)",
    )
    parser.add_argument(
        "--snapshot-slots",
        type=int,
        help="GDN state snapshots the prefix cache keeps, one per resume point "
        "(default: sized for the device: CPU 4 per GDN slot, CUDA a tenth "
        "of the free memory)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="keep no prefix cache (every prompt is computed from token 0)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=0,
        help="most sequences at once (0: the scheduler's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed of the tiny models")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: torch's choice); give each of "
        "several workers on one host its share of the cores",
    )
    parser.add_argument(
        "--no-session",
        action="store_true",
        help="one unary SelectBatch call per iteration instead of one "
        "WorkerSession stream (for schedulers without sessions)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="wait for each decision before stepping, instead of reporting for "
        "the next step while the engine runs this one",
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    parser.add_argument(
        "--step-log",
        metavar="PATH",
        help="append a JSON line per decision and per engine step to PATH: when each "
        "was asked for, answered, started and ended, the chunks it carried and the first "
        "tokens it made (worker_client/step_log.py)",
    )
    _add_handoff_arguments(parser)
    args = parser.parse_args(argv)

    from common.logs import configure

    configure(args.log_format, "INFO")
    for name in ("page_size", "kv_pages", "gdn_slots", "threads", "cache_block_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("prefix_cache_blocks", "snapshot_slots"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if args.cache_block_tokens is not None and args.cache_block_tokens % args.page_size:
        parser.error(
            f"--cache-block-tokens must be a multiple of --page-size "
            f"({args.page_size}), got {args.cache_block_tokens}"
        )
    if args.step_ms is not None:
        if args.model != "scripted":
            parser.error(
                f"--step-ms simulates step time of the scripted model only; "
                f"--model {args.model} runs a real model, drop --step-ms"
            )
        if args.step_ms < 0:
            parser.error(f"--step-ms must not be negative, got {args.step_ms:g}")
    _check_handoff_arguments(parser, args)
    if args.engine == "vllm":
        _check_vllm_arguments(parser, args)
    else:
        for name in VLLM_ONLY:
            if getattr(args, name) not in (None, "auto", 1):
                parser.error(f"--{name.replace('_', '-')} is a vLLM setting: add --engine vllm")
    from common.credentials import client_args_credentials
    from common.errors import ConfigError

    try:
        credentials = client_args_credentials(args)
    except ConfigError as err:
        print(f"lattice-worker: {err}", file=sys.stderr)
        return 2
    try:
        engine = _build_engine(args)
    except KeyboardInterrupt:  # a Ctrl-C while the model loads
        print("lattice-worker: interrupted while loading the model", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one clear line, not a traceback
        print(f"lattice-worker: {err}", file=sys.stderr)
        return 2
    if args.role != "both" and not getattr(engine, "can_hand_off", False):
        print(
            f"lattice-worker: --role {args.role}: this engine cannot hand sequences to a "
            f"peer (only the reference engine with a model can); run it with --role both",
            file=sys.stderr,
        )
        return 2
    return _run(args, engine, credentials)


def _add_handoff_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    group.add_argument(
        "--role",
        default="both",
        choices=("both", "prefill", "decode"),
        help="both: prompts and decodes (the default, as before roles); prefill: prompts "
        "only, each sequence handed to a decode worker after its first token; decode: "
        "decodes only, sequences arrive by handoff",
    )
    group.add_argument(
        "--handoff-port",
        type=int,
        help="serve the handoff channel (peers fetch sequences from it) on this port, "
        "0: any free one; needed by --role prefill",
    )
    group.add_argument(
        "--handoff-host",
        default="127.0.0.1",
        help="the host peers reach the handoff channel at (registered as "
        "handoff_address HOST:PORT; the channel listens on every interface)",
    )
    group.add_argument(
        "--transfer-gb-per-s",
        type=float,
        help="how fast this worker moves a sequence to a peer, in GB/s (1e9 bytes); the "
        "scheduler weighs handoffs with it; needed by --role prefill and decode",
    )
    group.add_argument(
        "--handoff-token",
        default=os.environ.get("LATTICE_HANDOFF_TOKEN") or None,
        help="bearer token of the handoff channel, sent to peers and required from them "
        "(env LATTICE_HANDOFF_TOKEN; default: --token); every worker of a fleet uses the same",
    )
    group.add_argument(
        "--handoff-tls-cert",
        metavar="FILE",
        help="serve the handoff channel with TLS: this certificate (PEM); peers check it "
        "against their --tls-ca",
    )
    group.add_argument(
        "--handoff-tls-key", metavar="FILE", help="private key of --handoff-tls-cert"
    )


def _check_handoff_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.handoff_port is not None and not 0 <= args.handoff_port <= 65535:
        parser.error(f"--handoff-port must be 0..65535, got {args.handoff_port}")
    rate = args.transfer_gb_per_s
    if rate is not None and not (rate > 0 and rate != float("inf")):
        parser.error(f"--transfer-gb-per-s must be a positive number, got {rate:g}")
    if bool(args.handoff_tls_cert) != bool(args.handoff_tls_key):
        parser.error("--handoff-tls-cert and --handoff-tls-key go together: give both or neither")
    if args.role == "prefill" and args.handoff_port is None:
        parser.error("--role prefill serves its sequences to peers: give --handoff-port")
    if args.role != "both" and rate is None:
        parser.error(
            f"--role {args.role} needs --transfer-gb-per-s (the scheduler hands nothing off "
            f"without a rate)"
        )


def _handoffs(args: argparse.Namespace, engine, credentials):
    """(the HandoffAgent, its server or None, the address it registers) for these flags;
    (None, None, "") for a worker of role both without a handoff channel."""
    if args.role == "both" and args.handoff_port is None:
        return None, None, ""

    from common.credentials import server_credentials
    from worker_client.handoff_channel import HandoffServer, OfferBook, fetch_sequence
    from worker_client.handoffs import HandoffAgent, max_transfer_bytes

    token = args.handoff_token or args.token
    server, address, offers = None, "", None
    if args.handoff_port is not None:
        offers = OfferBook()
        server = HandoffServer(
            offers,
            port=args.handoff_port,
            credentials=server_credentials(args.handoff_tls_cert or "", args.handoff_tls_key or ""),
            token=token,
        )
        address = f"{args.handoff_host}:{server.port}"

    def fetch(order, timeout_seconds):
        return fetch_sequence(
            order.peer_address,
            order.transfer_id,
            order.seq_id,
            order.cached_tokens,
            timeout_seconds=timeout_seconds,
            credentials=credentials,
            token=token,
            max_bytes=max_transfer_bytes(engine, order),
        )

    return HandoffAgent(engine, offers, fetch), server, address


# Flags of the vLLM engine only, and flags of the reference engine only.
VLLM_ONLY = (
    "max_model_len",
    "kv_cache_gib",
    "gpu_memory_utilization",
    "num_blocks",
    "block_size",
    "tensor_parallel_size",
    "cuda_graphs",
)
REFERENCE_ONLY = ("kv_pages", "cache_block_tokens", "prefix_cache_blocks", "snapshot_slots")


def _add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM (--engine vllm)")
    group.add_argument("--max-model-len", type=int, help="vLLM's max_model_len")
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        help="memory for vLLM's KV and GDN state pool, in GiB (default on CPU: 1)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="instead of --kv-cache-gib: the fraction of GPU memory vLLM may use",
    )
    group.add_argument(
        "--num-blocks", type=int, help="blocks in vLLM's pool, overriding its memory sizing"
    )
    group.add_argument(
        "--block-size",
        type=int,
        help="tokens per vLLM block (with prefix caching on a hybrid model vLLM picks it)",
    )
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per worker")
    group.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="run vLLM with CUDA graphs (auto: on CUDA) or eagerly",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="the most tokens vLLM runs in one step (a decision over it is refused)",
    )


def _check_vllm_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from worker_client.engine.config import PRESETS

    if args.model in (*PRESETS, "scripted"):
        parser.error(f"--engine vllm runs a checkpoint directory, not --model {args.model}")
    for name in (*REFERENCE_ONLY, "step_ms"):
        if getattr(args, name) is not None:
            parser.error(
                f"--{name.replace('_', '-')} is a reference-engine setting; vLLM sizes its "
                f"own pool (--kv-cache-gib, --num-blocks, --block-size)"
            )
    for name in ("max_model_len", "num_blocks", "block_size", "tensor_parallel_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _build_engine(args: argparse.Namespace):
    from worker_client.engines import ENGINES

    return ENGINES[getattr(args, "engine", "reference")].build(args)


def _run(args: argparse.Namespace, engine, credentials) -> int:
    from common.signals import SignalThread
    from common.targets import TargetError, expand
    from worker_client.client import SchedulerClient
    from worker_client.loop import WorkerLoop
    from worker_client.resources import WorkerResources, WorkerRole
    from worker_client.step_log import StepLog

    try:
        targets = expand(args.scheduler)  # a dns:/// name: each of its addresses
    except TargetError as err:
        print(f"lattice-worker: --scheduler: {err}", file=sys.stderr)
        return 2
    stop, drain = threading.Event(), threading.Event()
    client = SchedulerClient(
        ",".join(targets),
        credentials=credentials,
        token=args.token,
        session=not args.no_session,
        stop=stop,
    )
    try:
        agent, handoff_server, handoff_address = _handoffs(args, engine, credentials)
    except Exception as err:  # noqa: BLE001 - one clear line (a port taken, a bad PEM)
        print(f"lattice-worker: handoff channel: {err}", file=sys.stderr)
        return 2
    resources = replace(
        WorkerResources.of(args.worker_id, engine, args.max_batch_size),
        role=WorkerRole(args.role),
        transfer_bytes_per_second=(args.transfer_gb_per_s or 0.0) * 1e9,
        handoff_address=handoff_address,
        # A worker of role both registers as before roles: nothing of handoffs.
        handoff_bytes_per_token=engine.handoff_bytes_per_token if args.role != "both" else 0.0,
        handoff_fixed_bytes=engine.handoff_fixed_bytes if args.role != "both" else 0.0,
    )
    step_log = StepLog(args.step_log, args.worker_id) if args.step_log else None
    loop = WorkerLoop(
        engine,
        client,
        resources,
        overlap=not args.no_overlap,
        handoffs=agent,
        step_log=step_log,
    )
    if handoff_server is not None:
        handoff_server.start()
        log.info(
            "handoff channel serving",
            extra={"worker_id": args.worker_id, "handoff_address": handoff_address},
        )

    def on_signal(signum):  # on the signal thread, not in a handler (common/signals.py)
        if signum == signal.SIGTERM and not drain.is_set() and loop.stats.registrations:
            log.info(
                "draining: finishing held sequences, taking nothing new",
                extra={"worker_id": args.worker_id},
            )
            drain.set()
        elif signum == signal.SIGTERM and not drain.is_set():
            # Not registered yet (the scheduler is not answering): nothing to finish.
            log.info("stopping: not registered, nothing held", extra={"worker_id": args.worker_id})
            drain.set()
            stop.set()
        else:
            log.info("stopping now", extra={"worker_id": args.worker_id})
            stop.set()

    # Kept until the process returns: a second SIGTERM or SIGINT while it leaves is
    # acted on (stop at once), not the default's exit code or traceback.
    with SignalThread((signal.SIGTERM, signal.SIGINT), on_signal):
        try:
            return _serve(args, engine, client, loop, stop, drain)
        finally:
            if handoff_server is not None:
                handoff_server.stop()
            if step_log is not None:
                step_log.close()


def _serve(
    args: argparse.Namespace, engine, client, loop, stop: threading.Event, drain: threading.Event
) -> int:
    """Run the loop until it leaves; its exit code."""
    from worker_client.client import SchedulerCallError, Superseded

    try:
        stats = loop.run(stop, drain)
    except Superseded as err:
        print(
            f"lattice-worker: another process registered --worker-id {args.worker_id!r} "
            f"after this one, so this one stops (two workers must not share an id; "
            f"scheduler said: {err})",
            file=sys.stderr,
        )
        return EXIT_SUPERSEDED
    except SchedulerCallError as err:
        print(f"lattice-worker: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(
        f"lattice-worker {args.worker_id}: {stats.iterations} iterations, "
        f"{stats.generated_tokens} tokens generated, {stats.finished} sequences finished, "
        f"{stats.preempted} preempted",
        flush=True,
    )
    if loop.handoffs is not None:
        print(
            f"lattice-worker {args.worker_id}: {stats.prefill_tokens} prompt tokens computed, "
            f"{loop.handoffs.num_sent_offers} sequences offered to peers, "
            f"{loop.handoffs.num_imported} imported from peers",
            flush=True,
        )
    step_stats = getattr(engine, "stats", None)
    if step_stats is not None:
        print(f"lattice-worker {args.worker_id}: {step_stats.line()}", flush=True)
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        print(f"lattice-worker {args.worker_id}: {cache.stats_line()}", flush=True)
    return 0


def _profile(argv: list[str]) -> int:
    from common.cli_values import OneLineParser
    from worker_client.engine.config import PRESETS

    parser = OneLineParser(
        prog="lattice-worker profile",
        description="Time the reference engine's steps over a grid of (prefill tokens, decode "
        "batch, context length) and write the step table that `lattice-scheduler "
        "simulate --step-table FILE` reads; then time held-out steps off the grid "
        "and print how well the table predicts them.",
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help=f"{', '.join(map(repr, PRESETS))} (seeded random weights) or a Hugging Face "
        "checkpoint directory",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--out", required=True, help="the step table to write (JSON)")
    parser.add_argument(
        "--prefill-tokens",
        type=_int_list,
        metavar="N,N,...",
        help="grid axis: prefill tokens of a step (default per device)",
    )
    parser.add_argument(
        "--decode-batch",
        type=_int_list,
        metavar="N,N,...",
        help="grid axis: decoding sequences of a step (default per device)",
    )
    parser.add_argument(
        "--context-lens",
        type=_int_list,
        metavar="N,N,...",
        help="grid axis: tokens already cached per sequence (default per device)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed steps per point; the shortest counts (default 5)",
    )
    parser.add_argument(
        "--clock",
        default="auto",
        choices=("auto", "wall", "cpu"),
        help="what a step's time is: wall time, or the process's CPU time "
        "(not inflated by other processes; exact for one torch thread); "
        "auto: cpu on a CPU with --threads 1, wall otherwise",
    )
    parser.add_argument(
        "--held-out",
        type=int,
        default=24,
        help="random off-grid steps to check the table against (0: none)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--seed", type=int, default=0, help="weights and held-out steps")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    args = parser.parse_args(argv)
    for name in ("repeats", "page_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.held_out < 0:
        parser.error(f"--held-out must not be negative, got {args.held_out}")
    try:
        return _run_profile(args)
    except Exception as err:  # noqa: BLE001 - one clear line, not a traceback
        print(f"lattice-worker profile: {err}", file=sys.stderr)
        return 2


def _run_profile(args: argparse.Namespace) -> int:
    import dataclasses

    from common import extras

    extras.require("worker", "lattice-worker profile")
    import torch

    from common import step_table
    from worker_client import profiling
    from worker_client.engine.engine import ModelEngine, default_pool_sizes
    from worker_client.engine.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    dtype = getattr(
        torch,
        args.dtype if args.dtype != "auto" else "bfloat16" if args.device == "cuda" else "float32",
    )
    default = profiling.DEFAULT_GRIDS[args.device]
    grid = profiling.Grid(
        args.prefill_tokens or default.prefill_tokens,
        args.decode_batch or default.decode_batch,
        args.context_lens or default.context_len,
    )
    model = load_model(args.model, device=args.device, dtype=dtype, seed=args.seed)
    pages_per_sequence = -(-grid.max_tokens_per_sequence // args.page_size)
    engine = ModelEngine(
        model,
        total_kv_pages=grid.max_sequences * pages_per_sequence,
        page_size=args.page_size,
        total_gdn_slots=grid.max_sequences,
        device=args.device,
        max_batch_size=grid.max_sequences,
    )
    # What a worker would run with on this device: the simulator's default pools.
    pools = default_pool_sizes(model.config, args.device, page_size=args.page_size, dtype=dtype)
    clock = profiling.pick_clock(args.clock, engine.device)
    meta = profiling.machine_meta(str(args.model), engine.device, dtype, args.repeats, clock)
    meta.update(
        page_size=args.page_size,
        total_kv_pages=pools.total_kv_pages,
        total_gdn_slots=pools.total_gdn_slots,
    )
    print(
        f"profiling {args.model} on {meta['device_name']} ({dtype}, {meta['threads']} threads): "
        f"{len(grid.prefill_tokens)} x {len(grid.decode_batch)} x {len(grid.context_len)} "
        f"grid points, best of {args.repeats} on the {clock} clock",
        flush=True,
    )
    table = profiling.measure_table(
        engine,
        grid,
        repeats=args.repeats,
        clock=clock,
        meta=meta,
        on_point=profiling.progress_printer("profile"),
    )
    if args.held_out:
        points = profiling.held_out_points(
            engine,
            table,
            grid,
            count=args.held_out,
            repeats=args.repeats,
            clock=clock,
            seed=args.seed,
        )
        table = dataclasses.replace(table, held_out=points)
        print(profiling.format_held_out(points))
        summary = step_table.summarize_errors(points)
        print(
            f"held-out accuracy over {summary['num_points']} steps: median |error| "
            f"{summary['median_abs_error'] * 100:.1f}%, "
            f"p90 {summary['p90_abs_error'] * 100:.1f}%, "
            f"max {summary['max_abs_error'] * 100:.1f}%, mean signed "
            f"{summary['mean_error'] * 100:+.1f}%"
        )
    step_table.save(table, args.out)
    print(f"extra per chunk: {table.extra_chunk_seconds * 1000:.2f} ms; wrote {args.out}")
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
