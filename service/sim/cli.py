"""`lattice-scheduler simulate`: the subcommand's flags and what it prints and writes."""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = """\
Simulate the scheduler's own core (the same Scheduler and policy objects `serve` runs,
and the workers' WorkerLoop) on a virtual clock, against simulated workers whose step
times come from a cost model: a Vidur operator profile (--profile) or a step table from
`lattice-worker profile` (--step-table). Requests come from a trace at a given rate.

  lattice-scheduler simulate --trace sharegpt --qps 8 --num-requests 2000 --workers 4
  lattice-scheduler simulate --qps 2,4,8,16 --compare fifo,budget --plot cmp.png
  lattice-scheduler simulate --find-capacity --slo-ttft-p99 2 --slo-tpot-p99 0.1

The policy flags are serve's (same names, defaults and --config file). See
docs/simulation.md."""

DEFAULT_PLOT = "simulate-compare.png"


def add_parser(sub) -> None:
    """Add the `simulate` subcommand to the lattice-scheduler parser."""
    from service import settings  # light: no grpc import
    from service.sim.routing import ROUTINGS
    from service.sim.transfer import DEFAULT_MODEL_SHAPE, MODEL_SHAPES

    p = sub.add_parser(
        "simulate",
        help="trace-driven simulation of a policy on a virtual clock (no GPU, no network)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    work = p.add_argument_group("workload")
    work.add_argument(
        "--trace",
        default="sharegpt",
        help="a shipped trace (sharegpt, splitwise_conv, splitwise_code, "
        "mooncake_conversation, mooncake_synthetic), a CSV file "
        "(num_prefill_tokens, num_decode_tokens[, arrived_at]) or a "
        "Mooncake FILE.jsonl[.gz] (timestamp, input_length, "
        "output_length, hash_ids: prompts share prefixes) (default sharegpt)",
    )
    work.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        metavar="N",
        help="tokens per block of a Mooncake trace's hash ids: scales every "
        "prompt by N/512 and keeps the reuse pattern (default 512)",
    )
    work.add_argument(
        "--qps",
        type=_qps_list,
        metavar="Q[,Q...]",
        help="mean arrival rate(s), requests per second; a list runs each "
        "(with --find-capacity: where the search starts, default 1)",
    )
    work.add_argument(
        "--num-requests",
        type=int,
        default=1000,
        metavar="N",
        help="requests per run (default 1000)",
    )
    work.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="poisson: exponential gaps; trace: the trace's own arrival times "
        "scaled to --qps (default poisson)",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of arrivals and lengths: the same seed, the same output",
    )
    fleet = p.add_argument_group("workers and cost model")
    fleet.add_argument("--workers", type=int, default=1, metavar="W", help="(default 1)")
    fleet.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="pull",
        help="pull: one queue, workers take work when they ask (this "
        "scheduler); the others: a queue per worker, each request routed "
        "on arrival, as gateways do: round-robin, least-loaded, kv-router "
        "(NVIDIA Dynamo's cost), prefix-load (llm-d's scorers), "
        "cache-aware (SGLang's router) (default pull)",
    )
    fleet.add_argument(
        "--worker-speeds",
        type=_speed_list,
        default=(),
        metavar="S[,S...]",
        help="each worker's speed relative to the cost model, one per worker "
        "(0.5: its steps take twice as long): a mixed fleet (default all 1)",
    )
    fleet.add_argument(
        "--profile",
        metavar="NAME|DIR",
        help="Vidur operator profile: a shipped one (a30-qwen2-7b, the "
        "default) or a directory with attention.csv, mlp.csv and "
        "model.toml or config.json",
    )
    fleet.add_argument(
        "--step-table",
        metavar="FILE",
        help="a step-time table from `lattice-worker profile` instead",
    )
    fleet.add_argument(
        "--kv-pages",
        type=int,
        metavar="N",
        help="KV pages per worker (default: what fits beside the weights in the "
        "profile's device memory, or the step table's engine)",
    )
    fleet.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    fleet.add_argument(
        "--gdn-slots",
        type=int,
        metavar="N",
        help="GDN state slots per worker (default 256, or the step table's)",
    )
    fleet.add_argument(
        "--cache-block-tokens",
        type=int,
        metavar="N",
        help="tokens per block of each worker's prefix cache, a multiple of "
        "--page-size; 0: no cache (default: --block-tokens for a Mooncake "
        "trace, 0 for a CSV trace, whose prompts share nothing)",
    )
    fleet.add_argument(
        "--gdn-snapshot-slots",
        type=int,
        metavar="N",
        help="model a hybrid model: a resume point needs one of N GDN state "
        "snapshots per worker (default: a model without GDN layers, "
        "every cached block is a resume point)",
    )
    split = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    split.add_argument(
        "--roles",
        metavar="NPMD|search",
        help="N prefill-only and M decode-only workers (e.g. 2P6D; N+M = --workers; "
        "with --find-capacity a list, 'colocated' among them: colocated,3P5D): "
        "each long prompt runs on a prefill worker and is handed off, by the core's "
        "rule, to the decode workers, which keep short ones co-located; 'search' (with "
        "--find-capacity): co-located and every split with N < M, side by side "
        "(default: every worker runs both)",
    )
    split.add_argument(
        "--transfer-gb-per-s",
        type=float,
        default=12.5,
        metavar="R",
        help="handoff bandwidth, GB/s (default 12.5: a 100 Gb/s link)",
    )
    split.add_argument(
        "--transfer-latency-ms",
        type=float,
        default=1.0,
        metavar="MS",
        help="fixed cost of one handoff (default 1)",
    )
    split.add_argument(
        "--handoff-model",
        choices=sorted(MODEL_SHAPES),
        default=DEFAULT_MODEL_SHAPE,
        help="whose shapes size a handoff: attention layers x tokens x KV bytes + GDN "
        f"layers x state bytes (default {DEFAULT_MODEL_SHAPE})",
    )
    # --handoff-min-tokens is a scheduler setting (service/settings.py): the same flag,
    # the same meaning, in `serve` and here.
    split.add_argument(
        "--handoff-max-share",
        type=float,
        default=0.5,
        metavar="F",
        help="a handoff pays when its transfer costs at most this share of the "
        "decode-seconds its prefill would delay on a decode worker (default 0.5)",
    )
    split.add_argument(
        "--handoff-max-prefill-wait-s",
        type=float,
        default=2.0,
        metavar="S",
        help="prompts stay co-located while the prefill workers have more than this "
        "many seconds of prefill waiting each (default 2)",
    )
    modes = p.add_argument_group("modes and output")
    modes.add_argument(
        "--find-capacity",
        action="store_true",
        help="search the highest QPS that meets --slo-ttft-p99 and "
        "--slo-tpot-p99, printing each step",
    )
    modes.add_argument(
        "--saturation",
        action="store_true",
        help="the fleet's steady-state completion rate: --num-requests N over "
        "the difference of the makespans of N and 2N requests arriving "
        "at 1,000 QPS; with --find-capacity, printed beside each capacity "
        "(a capacity above it only held because the run was too short)",
    )
    modes.add_argument(
        "--capacity-tolerance",
        type=float,
        default=0.05,
        metavar="F",
        help="--find-capacity bisects until the highest passing and lowest "
        "failing rates are within this fraction of each other (default "
        "0.05: the capacity found is within 5%% below the edge)",
    )
    modes.add_argument("--slo-ttft-p99", type=float, metavar="S", help="seconds")
    modes.add_argument("--slo-tpot-p99", type=float, metavar="S", help="seconds")
    modes.add_argument(
        "--compare",
        type=_name_list,
        metavar="POLICY[,POLICY...]",
        help="run each policy (instead of --policy) and show them side by "
        "side, with a plot of TTFT p99 and TPOT p99 against QPS",
    )
    modes.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        metavar="FILE.png",
        help=f"where --compare writes its plot (default {DEFAULT_PLOT})",
    )
    modes.add_argument(
        "--json",
        metavar="FILE",
        help="write every run's figures, one object per run, as a JSON array",
    )
    modes.add_argument("--no-progress", action="store_true", help="no progress bar")
    policy = p.add_argument_group("scheduler settings (as `serve` takes them)")
    settings.add_arguments(policy, scheduler_only=True)


def run(args: argparse.Namespace) -> int:
    from service.core import ConfigError
    from service.sim.simulator import SimulationStalled
    from service.sim.vidur import ProfileError
    from service.sim.workload import WorkloadError

    try:
        return _run(args)
    except (ConfigError, ProfileError, WorkloadError, ValueError) as err:
        print(f"lattice-scheduler simulate: {err}", file=sys.stderr)
        return 2
    except SimulationStalled as err:
        print(f"lattice-scheduler simulate: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from common import extras
    from service import settings
    from service.sim import experiments, report
    from service.sim.costs import load_cost_source
    from service.sim.disagg_cli import print_handoff_bytes, split_search, transfer_model
    from service.sim.simulator import WorkerShape
    from service.sim.transfer import Roles
    from service.sim.workload import load_trace

    _check_flags(args)
    if args.compare:  # before the runs, not after them
        extras.require("sim", "simulate --compare (its plot)")
    base = settings.resolve(args, os.environ).scheduler
    policies = args.compare or [base.policy]
    configs = [experiments.with_policy(base, policy) for policy in policies]
    cost = load_cost_source(
        profile=args.profile, step_table_path=args.step_table, page_size=args.page_size
    )
    kv_pages = args.kv_pages or cost.default_kv_pages
    if kv_pages is None:
        raise ValueError(
            f"the cost model {cost.name} does not say how much memory a worker has: give --kv-pages"
        )
    trace = load_trace(args.trace, block_tokens=args.block_tokens)
    cache_block_tokens = (
        args.cache_block_tokens if args.cache_block_tokens is not None else trace.block_tokens
    )
    if cache_block_tokens % args.page_size:
        raise ValueError(
            f"--cache-block-tokens must be a multiple of --page-size "
            f"({args.page_size}), got {cache_block_tokens}"
            + (
                ""
                if args.cache_block_tokens is not None
                else " (from --block-tokens: give --cache-block-tokens)"
            )
        )
    worker = WorkerShape(
        kv_pages,
        args.page_size,
        args.gdn_slots or cost.default_gdn_slots,
        cache_block_tokens=cache_block_tokens,
        snapshot_slots=args.gdn_snapshot_slots,
    )
    setup = experiments.Setup(
        trace,
        cost,
        worker,
        args.workers,
        args.num_requests,
        args.arrivals,
        args.seed,
        args.routing,
        progress=not args.no_progress,
        worker_speeds=tuple(args.worker_speeds),
        roles=Roles.parse(args.roles, args.workers) if _one_split(args.roles) else None,
        transfer=transfer_model(args, base.handoff_min_tokens),
    )
    _print_header(setup, configs, cost)
    bound = _print_bound(setup, configs[0])
    if args.roles:
        print_handoff_bytes(setup, configs[0])

    if args.roles and args.find_capacity:
        objects, results = split_search(args, setup, configs[0])
    elif args.find_capacity:
        objects, results = _capacity(args, setup, configs)
        objects = [{**o, **bound} for o in objects]
    elif args.saturation:
        objects, results = _saturation(setup, configs), []
    else:
        runs = [experiments.simulate(setup, config, qps) for config in configs for qps in args.qps]
        for run in runs:
            experiments.warn_failed(run)
        results = [run.result for run in runs]
        objects = [{**r.to_json(), **bound} for r in results]
        print(report.results_table(results))
        for run in runs:
            if run.outcome.handoffs is not None:
                print(f"{run.result.qps:g} QPS, {setup.roles.name}: {run.outcome.handoffs}")
        print(
            f"\n{len(runs)} run(s), {sum(r.wall_seconds for r in runs):.1f} s wall "
            f"({', '.join(f'{r.wall_seconds:.1f}' for r in runs)})"
        )
    if args.compare:
        report.plot_comparison(
            args.plot,
            results,
            slo_ttft_p99=args.slo_ttft_p99,
            slo_tpot_p99=args.slo_tpot_p99,
            title=f"{trace.name}, {setup.num_workers} worker(s), {cost.name}",
        )
        print(f"plot: {args.plot}")
    if args.json:
        report.write_json(args.json, objects)
        print(f"json: {args.json}")
    return 0


def _capacity(args, setup, configs):
    from service.sim import experiments, report

    slo = experiments.Slo(args.slo_ttft_p99, args.slo_tpot_p99)
    start = args.qps[0] if args.qps else 1.0
    objects, results, summary = (
        [],
        [],
        [
            [
                "policy",
                "routing",
                "capacity QPS",
                "probes",
                "TTFT p99 s",
                "TPOT p99 ms",
                "out tok/s",
                "hit rate",
                "max share/mean",
                "saturation req/s",
            ]
        ],
    )
    for config in configs:
        capacity = experiments.find_capacity_shown(
            f"{config.policy}, {setup.routing}",
            lambda qps, config=config: experiments.simulate(setup, config, qps),
            slo,
            start_qps=start,
            tolerance=args.capacity_tolerance,
        )
        print(f"  capacity: {capacity.capacity_qps:.3f} QPS")
        rate = experiments.saturation(setup, config).requests_per_second
        above = capacity.capacity_qps > rate
        print(
            f"  saturation: {rate:.3f} requests/s"
            + (
                " -- the capacity is ABOVE it: the probes were too short for the queue to "
                "grow; give more --num-requests"
                if above
                else ""
            ),
            flush=True,
        )
        at = [run.result for run in capacity.runs if run.result.qps == capacity.capacity_qps]
        summary.append(
            [
                config.policy,
                setup.routing,
                f"{capacity.capacity_qps:.3f}",
                str(len(capacity.runs)),
                f"{at[0].ttft_p99:.3f}" if at else "-",
                f"{at[0].tpot_p99 * 1000:.1f}" if at else "-",
                f"{at[0].output_tokens_per_s:.0f}" if at else "-",
                f"{at[0].prefix_hit_rate:.3f}" if at else "-",
                f"{at[0].max_share_over_mean:.2f}" if at else "-",
                f"{rate:.3f}" + (" (capacity above it!)" if above else ""),
            ]
        )
        for run in capacity.runs:
            results.append(run.result)
            objects.append(
                {
                    **run.result.to_json(),
                    "capacity_qps": capacity.capacity_qps,
                    "saturation_requests_per_s": rate,
                }
            )
    print()
    print(report.format_table(summary))
    return objects, results


def _saturation(setup, configs):
    from service.sim import experiments, report

    n = setup.num_requests
    summary = [["policy", "routing", f"makespan {n} s", f"makespan {2 * n} s", "saturation req/s"]]
    objects = []
    for config in configs:
        found = experiments.saturation(setup, config)
        small, large = (run.outcome.end_seconds for run in found.runs)
        summary.append(
            [
                config.policy,
                setup.routing,
                f"{small:.1f}",
                f"{large:.1f}",
                f"{found.requests_per_second:.3f}",
            ]
        )
        objects.append(
            {
                "policy": config.policy,
                "routing": setup.routing,
                "num_requests": n,
                "qps": experiments.SATURATION_QPS,
                "makespan_s": [small, large],
                "saturation_requests_per_s": found.requests_per_second,
            }
        )
    print(report.format_table(summary))
    return objects


def _one_split(roles: str | None) -> bool:
    return bool(roles) and roles not in ("search", "colocated") and "," not in roles


def _check_flags(args: argparse.Namespace) -> None:
    if args.profile and args.step_table:
        raise ValueError("give --profile or --step-table, not both")
    for name in ("workers", "num_requests", "page_size", "kv_pages", "gdn_slots", "block_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("cache_block_tokens", "gdn_snapshot_slots"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if args.roles and not _one_split(args.roles) and not args.find_capacity:
        raise ValueError(f"--roles {args.roles} needs --find-capacity (and SLOs)")
    if args.roles and args.routing != "pull":
        raise ValueError("--roles needs --routing pull: one queue per role")
    if args.roles and args.compare:
        raise ValueError("--roles runs one policy: give --policy, not --compare")
    if args.find_capacity:
        if args.slo_ttft_p99 is None or args.slo_tpot_p99 is None:
            raise ValueError("--find-capacity needs --slo-ttft-p99 S and --slo-tpot-p99 S")
        if args.slo_ttft_p99 <= 0 or args.slo_tpot_p99 <= 0:
            raise ValueError("--slo-ttft-p99 and --slo-tpot-p99 must be above 0 seconds")
        if not 0 < args.capacity_tolerance < 1:
            raise ValueError(
                f"--capacity-tolerance must be between 0 and 1, got {args.capacity_tolerance:g}"
            )
        if args.qps and len(args.qps) > 1:
            raise ValueError("--find-capacity takes one --qps (where the search starts)")
    elif not args.qps and not args.saturation:
        raise ValueError("give --qps Q[,Q...] (or --find-capacity with SLOs, or --saturation)")


def _print_header(setup, configs, cost) -> None:
    from dataclasses import asdict

    w = setup.worker
    print(
        f"trace {setup.trace.name} ({len(setup.trace.rows)} rows): {setup.num_requests} "
        f"requests, {setup.arrivals} arrivals, seed {setup.seed}"
    )
    if setup.trace.has_prefixes:
        print(
            f"trace blocks of {setup.trace.block_tokens} tokens (Mooncake's 512 scaled by "
            f"{setup.trace.block_tokens / 512:g})"
        )
    cache = (
        "no prefix cache"
        if not w.cache_block_tokens
        else f"a prefix cache in blocks of {w.cache_block_tokens} tokens"
        + ("" if w.snapshot_slots is None else f", {w.snapshot_slots} GDN snapshot slots")
    )
    print(
        f"cost model {cost.name}; {setup.num_workers} worker(s), routing {setup.routing}, "
        f"each {w.total_kv_pages} KV pages of {w.page_size} tokens, {w.total_gdn_slots} GDN "
        f"slots, {cache}"
    )
    for config in configs:
        settings = ", ".join(f"{k} {v}" for k, v in asdict(config).items() if k != "policy")
        print(f"policy {config.policy}: {settings}")
    print(flush=True)


def _print_bound(setup, config) -> dict:
    """Print (and return for the JSON) the hit rate one worker with the fleet's whole KV
    memory as cache would reach on these requests; {} without a cache."""
    from service.sim.bound import hit_rate_bound
    from service.sim.workload import make_requests

    w = setup.worker
    if not w.cache_block_tokens:
        return {}
    requests = make_requests(
        setup.trace,
        num_requests=setup.num_requests,
        qps=1.0,
        arrivals=setup.arrivals,
        seed=setup.seed,
        max_seq_len=config.max_seq_len,
    )
    num_blocks = setup.num_workers * w.total_kv_pages * w.page_size // w.cache_block_tokens
    bound = hit_rate_bound(requests, block_tokens=w.cache_block_tokens, num_blocks=num_blocks)
    same_cache = hit_rate_bound(
        requests, block_tokens=w.cache_block_tokens, num_blocks=num_blocks, cache_generated=True
    )
    print(
        f"prefix hit rate bound: {bound:.3f} (one worker caching in the whole fleet's "
        f"{num_blocks} blocks, LRU, these {len(requests)} requests in order); "
        f"{same_cache:.3f} with the workers' cache rule (their generated blocks cached "
        f"too, never reused here)\n",
        flush=True,
    )
    return {"prefix_hit_rate_bound": bound, "prefix_hit_rate_bound_workers_cache": same_cache}


def _qps_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"every QPS must be above 0, got {text!r}")
    return values


def _speed_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None


def _name_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("an empty list")
    return names
