"""The engines a worker can drive, in one place: each name with how it is built from the
command line and the help `lattice-worker --help` prints for it.

Read by the command line (`--engine`'s choices and help, and the build) and by
docs/serving.md. A new engine is one entry here plus its package: an implementation of
`worker_client.engine.api.Engine`, imported only when it is chosen.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from worker_client.engine.api import Engine

log = logging.getLogger("lattice_worker")


@dataclass(frozen=True)
class EngineEntry:
    """One engine `--engine` may name."""

    name: str
    build: Callable[[argparse.Namespace], Engine]  # from the parsed flags; raises on a bad setup
    help: str  # one clause, as --help lists it


def build_reference(args: argparse.Namespace) -> Engine:
    """The reference engine (or the scripted one, `--model scripted`)."""
    if args.model == "scripted":
        from worker_client.testing import ScriptedEngine

        # The scripted model keeps a prefix cache only when asked (--cache-block-tokens).
        return ScriptedEngine(
            total_kv_pages=args.kv_pages or 4096,
            page_size=args.page_size,
            total_gdn_slots=args.gdn_slots or 64,
            step_seconds=(args.step_ms or 0.0) / 1000.0,
            cache_block_tokens=(0 if args.no_prefix_cache else args.cache_block_tokens or 0),
            total_snapshot_slots=(64 if args.snapshot_slots is None else args.snapshot_slots),
            max_cached_blocks=args.prefix_cache_blocks,
        )
    from common import extras

    extras.require("worker", f"--model {args.model}")
    import torch

    from worker_client.engine.engine import ModelEngine, default_pool_sizes

    if args.threads:
        torch.set_num_threads(args.threads)
    from worker_client.engine.loading import load_model

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device == "cuda" else "float32"
    model = load_model(args.model, device=device, dtype=getattr(torch, dtype_name), seed=args.seed)
    prefix_cache = not args.no_prefix_cache
    pools = default_pool_sizes(
        model.config, device, page_size=args.page_size, prefix_cache=prefix_cache
    )
    from worker_client.engine.sizing import DEFAULT_CACHE_BLOCK_PAGES

    block_tokens = args.cache_block_tokens or DEFAULT_CACHE_BLOCK_PAGES * args.page_size
    engine = ModelEngine(
        model,
        total_kv_pages=args.kv_pages or pools.total_kv_pages,
        page_size=args.page_size,
        total_gdn_slots=args.gdn_slots or pools.total_gdn_slots,
        device=device,
        cache_block_tokens=block_tokens if prefix_cache else 0,
        total_snapshot_slots=(
            pools.total_snapshot_slots if args.snapshot_slots is None else args.snapshot_slots
        ),
        max_cached_blocks=args.prefix_cache_blocks,
    )
    log.info(
        "engine ready",
        extra={
            "worker_id": args.worker_id,
            "model": str(args.model),
            "device": device,
            "dtype": dtype_name,
            "kv_pages": engine.total_kv_pages,
            "page_size": engine.page_size,
            "gdn_slots": engine.total_gdn_slots,
            "cache_block_tokens": engine.cache_block_tokens,
            "snapshot_slots": engine.total_snapshot_slots,
        },
    )
    return engine


def build_vllm(args: argparse.Namespace) -> Engine:
    """vLLM, in-process and step by step (worker_client/engine_vllm/)."""
    from worker_client.engine_vllm.environment import (
        check_version,
        installed_vllm_version,
        set_omp_threads,
    )

    check_version(installed_vllm_version())  # before the slow imports: one line if wrong
    set_omp_threads()  # before torch is imported (the CUDA check below imports it)
    from worker_client.engine_vllm.engine import VllmEngine
    from worker_client.engine_vllm.settings import VllmSettings

    cuda = _cuda_available()
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and cuda)
    dtype = args.dtype if args.dtype != "auto" else "bfloat16"  # vLLM's CPU GDN kernel: bf16
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    if kv_bytes is None and args.gpu_memory_utilization is None and not cuda:
        kv_bytes = 2**30  # CPU: vLLM's default takes a share of the host's memory
    settings = VllmSettings(
        model=args.model,
        dtype=dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        prefix_caching=not args.no_prefix_cache,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=not graphs,
        max_num_seqs=args.gdn_slots or 64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    engine = VllmEngine(settings)
    log.info(
        "engine ready",
        extra={
            "worker_id": args.worker_id,
            "engine": "vllm",
            "model": str(args.model),
            "dtype": dtype,
            "cuda_graphs": graphs,
            "kv_pages": engine.total_kv_pages,
            "page_size": engine.page_size,
            "gdn_slots": engine.total_gdn_slots,
            "cache_block_tokens": engine.cache_block_tokens,
            # OpenMP's threads and CPUs for the model (environment.omp_settings)
            "omp_threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "omp_places": os.environ.get("OMP_PLACES", "default"),
        },
    )
    return engine


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


ENGINES: dict[str, EngineEntry] = {
    entry.name: entry
    for entry in (
        EngineEntry(
            "reference",
            build_reference,
            "the project's PyTorch engine (the default; --model tiny, a checkpoint "
            "directory or scripted)",
        ),
        EngineEntry(
            "vllm",
            build_vllm,
            "vLLM 0.32, stepped as the scheduler decides (a checkpoint directory; "
            "set up with scripts/setup.sh --engine vllm, run from .venv-vllm)",
        ),
    )
}
