"""Handoff bytes and time of the reference engine: a hybrid model (GDN + attention) beside
an attention-only model of the same size, at the same prompt lengths (the figures of
docs/disaggregation.md, "The worker side").

For each preset and prompt length: prefill one sequence on a ModelEngine, export it,
serve it on a HandoffServer and fetch it over loopback gRPC (CRC32C checked), import it
into a second engine. Prints bytes moved (attention KV, GDN states), the GDN share, and
the export, fetch and import times (wall clock, and the process's CPU time from /proc
for the whole handoff).

    .venv/bin/python -m bench.handoff --presets tiny small --prompt-lens 64 1024 4096

The attention-only model: the preset's config with every layer full attention (so the
same layers, widths and heads).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time

import torch

from bench.harness.tables import load_note, ms, print_table
from worker_client.engine.api import ChunkWork, SequenceSpec, StateKind
from worker_client.engine.config import LayerType
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import PRESETS, random_model
from worker_client.handoff_channel import HandoffServer, OfferBook, fetch_sequence

PAGE_SIZE = 16


def _engine(model, max_tokens: int) -> ModelEngine:
    pages = math.ceil(max_tokens / PAGE_SIZE) + 1
    return ModelEngine(
        model, total_kv_pages=pages, page_size=PAGE_SIZE, total_gdn_slots=1, device="cpu"
    )


def _handoff(model, prompt_len: int, address: str, offers: OfferBook) -> dict[str, float]:
    rng = random.Random(prompt_len)
    prompt = tuple(rng.randrange(2, model.config.vocab_size) for _ in range(prompt_len))
    spec = SequenceSpec(prompt, max_new_tokens=4, ignore_eos=True)
    sender, receiver = _engine(model, prompt_len + 2), _engine(model, prompt_len + 2)
    out = sender.step([ChunkWork(1, 0, prompt_len, spec)], [])
    first = out.tokens[0][1][0]
    cpu_started = time.process_time()
    started = time.perf_counter()
    chunks = sender.export_sequence(1)
    exported = time.perf_counter()
    offers.offer(1, 1, chunks)
    fetched = fetch_sequence(address, 1, 1, 0, timeout_seconds=120)
    arrived = time.perf_counter()
    receiver_spec = dataclasses.replace(spec, prompt_token_ids=(*prompt, first), max_new_tokens=3)
    receiver.import_sequence(1, receiver_spec, fetched.chunks)
    imported = time.perf_counter()
    cpu_seconds = time.process_time() - cpu_started
    offers.withdraw([1])
    kv = sum(len(c.data) for c in fetched.chunks if c.kind is StateKind.ATTENTION_KV)
    return {
        "kv_bytes": kv,
        "gdn_bytes": fetched.num_bytes - kv,
        "bytes": fetched.num_bytes,
        "export": exported - started,
        "fetch": arrived - exported,
        "import": imported - arrived,
        "cpu": cpu_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny"], choices=sorted(PRESETS))
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[64, 1024, 4096])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    offers = OfferBook()
    server = HandoffServer(offers, host="127.0.0.1")
    server.start()
    address = f"127.0.0.1:{server.port}"
    print(f"handoff over loopback gRPC {load_note()}")
    try:
        for preset in args.presets:
            hybrid = PRESETS[preset]()
            attention = dataclasses.replace(
                hybrid, layer_types=(LayerType.FULL_ATTENTION,) * len(hybrid.layer_types)
            )
            models = {
                "hybrid": random_model(hybrid, 0),
                "attention-only": random_model(attention, 0),
            }
            rows = []
            for prompt_len in args.prompt_lens:
                h = _handoff(models["hybrid"], prompt_len, address, offers)
                a = _handoff(models["attention-only"], prompt_len, address, offers)
                rows.append(
                    [
                        prompt_len,
                        f"{h['bytes'] / 1e6:.3f}",
                        f"{a['bytes'] / 1e6:.3f}",
                        f"{h['gdn_bytes'] / h['bytes']:.3f}",
                        f"{h['bytes'] / a['bytes']:.2f}",
                        f"{ms(h['export'])} / {ms(h['fetch'])} / {ms(h['import'])}",
                        f"{ms(a['export'])} / {ms(a['fetch'])} / {ms(a['import'])}",
                        f"{ms(h['cpu'])} / {ms(a['cpu'])}",
                    ]
                )
            num_gdn = hybrid.num_linear_attention_layers
            print(
                f"\n{preset}: {len(hybrid.layer_types)} layers, hybrid {num_gdn} GDN + "
                f"{len(hybrid.layer_types) - num_gdn} attention; attention-only all attention"
            )
            print_table(
                [
                    "prompt tokens",
                    "hybrid MB",
                    "attention-only MB",
                    "GDN share",
                    "hybrid / attention-only",
                    "hybrid ms export / fetch / import",
                    "attention-only ms",
                    "CPU ms hybrid / attention-only",
                ],
                rows,
            )
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
