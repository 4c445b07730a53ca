"""`simulate --roles`: the transfer model from the flags, the handoff sizes printed side
by side, and `--roles search`: capacity at the SLO of co-located and of every split."""

from __future__ import annotations

import argparse
from dataclasses import replace

from service.core import SchedulerConfig
from service.core.decide.handoff import HandoffSettings
from service.sim import experiments, report
from service.sim.transfer import MODEL_SHAPES, Roles, TransferModel
from service.sim.workload import make_requests

# Prompt lengths the handoff-size table shows beside the trace's mean.
_TABLE_PROMPTS = (1024, 4096, 8192)
# What the hybrid handoff model is compared with: its attention-only counterpart.
_ATTENTION_ONLY = {"qwen3-next-80b": "qwen3-next-80b-attention"}


def transfer_model(args: argparse.Namespace, min_uncached_tokens: int) -> TransferModel:
    """The transfer model of the flags; `min_uncached_tokens`: the scheduler setting
    handoff_min_tokens, which the simulated rule shares with the core's."""
    if not args.transfer_gb_per_s > 0 or args.transfer_latency_ms < 0:
        raise ValueError("--transfer-gb-per-s must be above 0, --transfer-latency-ms not below")
    return TransferModel(
        bytes_per_second=args.transfer_gb_per_s * 1e9,
        shape=MODEL_SHAPES[args.handoff_model],
        shape_name=args.handoff_model,
        rule=HandoffSettings(
            min_uncached_tokens=min_uncached_tokens,
            max_transfer_share=args.handoff_max_share,
            latency_seconds=args.transfer_latency_ms / 1000.0,
            max_prefill_wait_seconds=args.handoff_max_prefill_wait_s,
        ),
    )


def print_handoff_bytes(setup: experiments.Setup, config: SchedulerConfig) -> None:
    """Bytes and transfer time of one handoff, the model against its attention-only
    counterpart, at a few prompt lengths and the trace's mean (as the runs cut it)."""
    transfer = setup.transfer
    requests = make_requests(
        setup.trace,
        num_requests=setup.num_requests,
        qps=1.0,
        arrivals=setup.arrivals,
        seed=setup.seed,
        max_seq_len=config.max_seq_len,
    )
    mean = round(sum(r.prompt_len for r in requests) / len(requests))
    names = [transfer.shape_name]
    if transfer.shape_name in _ATTENTION_ONLY:
        names.append(_ATTENTION_ONLY[transfer.shape_name])
    rows = [
        ["prompt tokens", *(f"{n} MB" for n in names), *(f"{n} ms" for n in names), "GDN share"]
    ]
    for prompt in (*_TABLE_PROMPTS, mean):
        sizes = [MODEL_SHAPES[n].handoff_bytes(prompt + 1) for n in names]
        rows.append(
            [
                f"{prompt}" + (" (trace mean)" if prompt == mean else ""),
                *(f"{b / 1e6:.1f}" for b in sizes),
                *(f"{transfer.seconds(b) * 1000:.1f}" for b in sizes),
                f"{MODEL_SHAPES[names[0]].gdn_share(prompt + 1):.3f}",
            ]
        )
    print(
        f"handoff sizes at {transfer.bytes_per_second / 1e9:g} GB/s + "
        f"{transfer.rule.latency_seconds * 1000:g} ms:"
    )
    print(report.format_table(rows), end="\n\n", flush=True)


def split_search(args: argparse.Namespace, setup: experiments.Setup, config: SchedulerConfig):
    """Capacity at the SLO of co-located and of each split with fewer prefill workers
    than decode workers (--roles search), or of those listed (--roles colocated,3P5D;
    the ratio needs colocated first); a table of each."""
    slo = experiments.Slo(args.slo_ttft_p99, args.slo_tpot_p99)
    start = args.qps[0] if args.qps else 1.0
    fleets: list[Roles | None] = (
        [None, *Roles.splits(setup.num_workers)]
        if args.roles == "search"
        else [
            None if text == "colocated" else Roles.parse(text, setup.num_workers)
            for text in args.roles.split(",")
        ]
    )
    objects, results = [], []
    rows = [["split", "capacity QPS", "x co-located", "probes", "TTFT p99 s", "TPOT p99 ms"]]
    rows[0] += ["handed off", "GB moved", "transfer ms mean"]
    colocated = 0.0
    for roles in fleets:
        name = roles.name if roles else "co-located"
        fleet = replace(setup, roles=roles)
        capacity = experiments.find_capacity_shown(
            f"{config.policy}, {name}",
            lambda qps, fleet=fleet: experiments.simulate(fleet, config, qps),
            slo,
            start_qps=start,
            tolerance=args.capacity_tolerance,
            detail=_handoffs,
        )
        if roles is None:
            colocated = capacity.capacity_qps
        ratio = capacity.capacity_qps / colocated if colocated else 0.0
        versus = f" ({ratio:.2f}x co-located)" if colocated else ""
        print(f"  capacity: {capacity.capacity_qps:.3f} QPS{versus}", flush=True)
        at = [run for run in capacity.runs if run.result.qps == capacity.capacity_qps]
        counts = at[0].outcome.handoffs if at else None
        rows.append(
            [
                name,
                f"{capacity.capacity_qps:.3f}",
                f"{ratio:.2f}" if colocated else "-",
                str(len(capacity.runs)),
                f"{at[0].result.ttft_p99:.3f}" if at else "-",
                f"{at[0].result.tpot_p99 * 1000:.1f}" if at else "-",
                f"{counts.num_handoffs}/{setup.num_requests}" if counts else "-",
                f"{counts.num_bytes / 1e9:.1f}" if counts else "-",
                (
                    f"{counts.transfer_seconds / counts.num_handoffs * 1000:.1f}"
                    if counts and counts.num_handoffs
                    else "-"
                ),
            ]
        )
        for run in capacity.runs:
            results.append(run.result)
            objects.append(
                {
                    **run.result.to_json(),
                    "roles": name,
                    "capacity_qps": capacity.capacity_qps,
                    "handoffs": vars(run.outcome.handoffs) if run.outcome.handoffs else None,
                }
            )
    print()
    print(report.format_table(rows))
    return objects, results


def _handoffs(run: experiments.Run) -> str:
    counts = run.outcome.handoffs
    if counts is None:
        return "co-located"
    return f"{counts.num_handoffs} handed off, {counts.num_bytes / 1e9:.1f} GB"
