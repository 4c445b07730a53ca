"""A decision vLLM cannot run exactly, forced on a VllmEngine (run in .venv-vllm).

    .venv-vllm/bin/python -m tests.vllm.refusal MODEL_DIR PROMPT_JSON MAX_TOKENS

A first chunk that crosses a block boundary and ends off one (vLLM writes GDN states at
block boundaries on a hybrid model with prefix caching), then, after the refusal, the
chunks a scheduler sends to a requeued sequence. Prints one JSON line: what the refused step reported, the
tokens the sequence then generated, how it finished.
"""

from __future__ import annotations

import json
import sys

from worker_client.engine.api import ChunkWork, SequenceSpec
from worker_client.engine_vllm.engine import VllmEngine
from worker_client.engine_vllm.settings import VllmSettings


def main() -> None:
    model, prompt, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    settings = VllmSettings(
        model=model,
        dtype="bfloat16",
        kv_cache_memory_bytes=256 << 20,
        num_blocks=64,
        max_num_seqs=4,
        max_model_len=1024,
    )
    engine = VllmEngine(settings)
    spec = SequenceSpec(tuple(prompt), max_tokens)
    block = engine.page_size
    refused = engine.step([ChunkWork(7, 0, block + 24, spec)], [])
    held_after_refusal = engine.waiting_ids() + engine.running_ids()
    tokens = []
    out = engine.step([ChunkWork(7, 0, block, spec)], [])
    out = engine.step([ChunkWork(7, block, len(prompt) - block, None)], [])
    finished = []
    while True:
        tokens += [t for s, ids in out.tokens if s == 7 for t in ids]
        finished += [f.reason.value for f in out.finished]
        if not engine.running_ids():
            break
        out = engine.step([], [7])
    print(
        json.dumps(
            {
                "refused_preempted": list(refused.preempted),
                "refused_tokens": list(refused.tokens),
                "held_after_refusal": held_after_refusal,
                "num_refused": engine.num_refused,
                "tokens": tokens,
                "finished": finished,
                "kv_free_pages": engine.kv_free_pages(),
                "total_kv_pages": engine.total_kv_pages,
            }
        )
    )


if __name__ == "__main__":
    main()
