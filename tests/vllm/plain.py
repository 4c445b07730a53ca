"""Plain vLLM's answers, for the tests to compare with (run in .venv-vllm).

    .venv-vllm/bin/python -m tests.vllm.plain < request.json > answers.json

The request: {"model": DIR, "max_tokens": N, "conversations": [[turn, ...], ...]} where
each turn is a list of token ids; a conversation's prompt k is its prompt k-1, the answer
to it, then turn k. Greedy, unless the request says {"temperature": T, "seed": S}: then
every prompt is sampled at T from a generator seeded with S. The answers: one list of
token ids per turn, per conversation. Each round of turns runs as one `LLM.generate`
call, vLLM's own scheduler deciding.
"""

from __future__ import annotations

import json
import sys

from worker_client.engine_vllm.environment import import_vllm


def main() -> None:
    request = json.load(sys.stdin)
    vllm = import_vllm()
    llm = vllm.LLM(
        model=request["model"],
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=request.get("prefix_caching", True),
        kv_cache_memory_bytes=256 << 20,
        max_model_len=request.get("max_model_len", 2048),
        seed=0,
    )
    params = vllm.SamplingParams(
        temperature=request.get("temperature", 0.0),
        seed=request.get("seed"),
        max_tokens=request["max_tokens"],
    )
    conversations = request["conversations"]
    prompts = [[] for _ in conversations]
    answers = [[] for _ in conversations]
    for k in range(max(len(c) for c in conversations)):
        live = [i for i, c in enumerate(conversations) if k < len(c)]
        for i in live:
            previous = answers[i][-1] if answers[i] else []
            prompts[i] = prompts[i] + previous + conversations[i][k]
        outputs = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in live], params, use_tqdm=False
        )
        for i, output in zip(live, outputs):
            answers[i].append(list(output.outputs[0].token_ids))
    json.dump({"answers": answers}, sys.stdout)


if __name__ == "__main__":
    main()
