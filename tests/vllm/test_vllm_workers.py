"""A scheduler and two vLLM workers (`lattice-worker --engine vllm`) on a tiny seeded
Qwen3.5: greedy tokens equal plain vLLM's `LLM.generate` on the same checkpoint and dtype,
with prompts the scheduler chunks, with preemptions, with prefix caching, through the
`openai` client and the gateway, and after a worker is killed mid-generation. vLLM never
ran a step other than decided (the workers log each refusal; there are none).

The workers share one module-scoped stack (a vLLM engine takes tens of seconds to start
here); the kill comes last. Pools are small on purpose: 8 KV pages of 256 tokens and 8 GDN
slots per worker, so that the scheduler preempts.
"""

from __future__ import annotations

import json
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.conftest import generate

from .conftest import PlainVllm, VllmStack, run_in_vllm

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
# 56 usable blocks: 8 GDN slots of 3 GDN layers x 2 blocks (vLLM's align mode), 8 KV pages.
WORKER_FLAGS = ("--num-blocks", "57", "--gdn-slots", "8", "--max-model-len", "1024")
REFUSED = "cannot run the decision"
MESSAGES = [{"role": "user", "content": "Hello, how is the queue today?"}]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lengths]


# Past one chunk (the scheduler's chunk_size is 256) and ending just short of a block
# boundary, so that decoding needs a new page while the pool is full: preemptions.
CHUNKED = _prompts(1, [505, 300, 250, 510, 700, 253, 509, 420, 506, 255, 600, 508])
# Two turns: the second is the first's prompt, its answer, then new tokens.
CONVERSATIONS = [
    [first, rest] for first, rest in zip(_prompts(2, [520, 530, 600]), _prompts(3, [20, 40, 30]))
]
KILLED = _prompts(4, [300, 400, 280, 520, 350, 610])
# Sampled with a seed, each prompt past one chunk: vLLM samples a token after each partial
# chunk too, drops it, and rewinds the generator.
SEEDED = _prompts(6, [300, 520])
SAMPLING = dict(temperature=0.7, seed=1234)
REFUSED_PROMPT = _prompts(5, [300])[0]


@pytest.fixture(scope="module")
def chat_prompt_ids(vllm_checkpoint) -> list[int]:
    return vllm_checkpoint.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )["input_ids"]


@pytest.fixture(scope="module")
def ready(vllm_checkpoint, chat_prompt_ids, vllm_logs):
    """The stack, and plain vLLM's answers (one `LLM.generate` per round of turns),
    computed while the workers start."""
    groups = {
        "chunked": [[p] for p in CHUNKED],
        "conversations": CONVERSATIONS,
        "killed": [[p] for p in KILLED],
        "chat": [[chat_prompt_ids]],
    }
    plain_run = PlainVllm(vllm_checkpoint.path, [c for g in groups.values() for c in g], MAX_TOKENS)
    # Alone, as the refusal test's engine runs it (in bfloat16 a batch's makeup can flip a
    # greedy tie: plain vLLM's own answers differ between batches).
    alone_run = PlainVllm(vllm_checkpoint.path, [[REFUSED_PROMPT]], MAX_TOKENS)
    # Each prompt in one chunk, nothing sampled and dropped: without prefix caching (with
    # it, vLLM splits a hybrid model's prompt at its 256-token blocks, and plain vLLM
    # 0.32 on a CPU dies on a seeded prompt just as the worker did).
    seeded_run = PlainVllm(
        vllm_checkpoint.path, [[p] for p in SEEDED], MAX_TOKENS, prefix_caching=False, **SAMPLING
    )
    stack = VllmStack(
        vllm_logs,
        chunk_size=256,
        max_num_batched_tokens=512,
        prefill_reserve_pages=0,
        lease_ttl_ms=2000,
    )
    try:
        for worker_id in ("vllm-1", "vllm-2"):
            stack.add_worker(worker_id, vllm_checkpoint.path, *WORKER_FLAGS)
        answers = iter(plain_run.answers())
        plain = {name: [next(answers) for _ in group] for name, group in groups.items()}
        plain["refused"] = alone_run.answers()
        plain["seeded"] = seeded_run.answers()
        stack.wait_registered(2)
        yield stack, plain
    finally:
        stack.close()


def _generate_all(stack: VllmStack, prompts, **fields) -> list[tuple[int, list[int], list]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(lambda p: generate(stack.stub, p, MAX_TOKENS, timeout=300, **fields), prompts)
        )


def _sample(stack: VllmStack, name: str, **labels) -> float:
    return stack.registry.get_sample_value(name, labels or None) or 0.0


def assert_equal_to_plain_vllm(model, prompts, results, answers) -> int:
    """Each sequence's tokens equal plain vLLM's answer, or, for a sequence requeued after
    g tokens (preempted, or its worker lost), the first g of them followed by plain vLLM's
    answer to the resumed prompt (prompt + those g tokens): the resumed request vLLM
    itself would run. (A resume recomputes the g tokens in a prefill; in bfloat16 that
    is not bit-equal to the decode steps that made them, and greedy ties can flip: vLLM's
    own preemptions recompute the same way.) Returns how many resumed differently."""
    differ = {}
    for i, (_, tokens, _) in enumerate(results):
        if tokens != answers[i]:
            first = next((k for k, (a, b) in enumerate(zip(tokens, answers[i])) if a != b), 0)
            differ[i] = first
    if not differ:
        return 0
    resumes = [(i, g) for i, first in differ.items() for g in range(1, first + 1)]
    resumed = PlainVllm(
        model, [[prompts[i] + results[i][1][:g]] for i, g in resumes], MAX_TOKENS
    ).answers()
    for i in differ:
        tokens = results[i][1]
        assert any(
            tokens[g:] == answer[0][: MAX_TOKENS - g]
            for (j, g), answer in zip(resumes, resumed)
            if j == i
        ), f"prompt {i}: {tokens} is neither plain vLLM's {answers[i]} nor a resume of it"
    return len(differ)


def test_chunked_and_preempted_sequences_equal_plain_vllm(ready, vllm_checkpoint):
    stack, plain = ready
    results = _generate_all(stack, CHUNKED)
    answers = [a[0] for a in plain["chunked"]]
    assert_equal_to_plain_vllm(vllm_checkpoint.path, CHUNKED, results, answers)
    assert _sample(stack, "lattice_scheduler_requeues_total", reason="preempted") > 0
    assert _sample(stack, "lattice_scheduler_prefill_tokens_total", source="computed") > 0
    assert REFUSED not in stack.worker_logs()


def test_follow_up_turns_resume_from_vllms_prefix_cache_with_equal_tokens(ready):
    stack, plain = ready
    first_turns = _generate_all(stack, [c[0] for c in CONVERSATIONS])
    for i, (_, tokens, _) in enumerate(first_turns):
        assert tokens == plain["conversations"][i][0]
    follow_ups = [c[0] + first[1] + c[1] for c, first in zip(CONVERSATIONS, first_turns)]
    results = _generate_all(stack, follow_ups)
    for i, (seq_id, tokens, _) in enumerate(results):
        assert tokens == plain["conversations"][i][1], f"conversation {i}"
        info = stack.stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=10)
        assert info.cached_tokens > 0 and info.cached_tokens % 256 == 0, f"conversation {i}"
    assert _sample(stack, "lattice_scheduler_prefill_tokens_total", source="cached") > 0
    assert REFUSED not in stack.worker_logs()


def test_seeded_sampling_of_chunked_prompts_equals_plain_vllms_in_one_chunk(ready):
    """The scheduler chunks these prompts at 256 tokens; vLLM samples a token after each
    partial chunk and drops it, then rewinds the request's generator by the CUDA
    generator's offset, which a CPU generator has not: the worker died on it. The worker
    now puts such a generator's state back after sampling (generators.py), so the chunked
    sequences sample what plain vLLM samples from one chunk with the same seed."""
    stack, plain = ready
    results = _generate_all(stack, SEEDED, sampling=pb.SamplingParams(**SAMPLING))
    for i, (_, tokens, events) in enumerate(results):
        assert tokens == plain["seeded"][i][0], f"prompt {i}"
        assert events[-1].finish_reason, f"prompt {i}"
    assert all(w.alive() for w in stack.workers.values())
    assert REFUSED not in stack.worker_logs()


def test_openai_client_chat_streaming_and_stop_through_the_gateway(ready, vllm_checkpoint):
    openai = pytest.importorskip("openai")
    stack, plain = ready
    base_url = stack.start_gateway(vllm_checkpoint.path)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = vllm_checkpoint.path.name
    expected = vllm_checkpoint.tokenizer.decode(plain["chat"][0][0], skip_special_tokens=True)
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    stop = next(
        expected[i : i + 2]
        for i in range(1, len(expected) - 1)
        if expected[i : i + 2].isprintable() and "\ufffd" not in expected[i : i + 2]
    )
    stopped = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].message.content == expected[: expected.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_a_vllm_worker_killed_mid_generation_loses_nothing(ready, vllm_checkpoint):
    stack, plain = ready
    killer = threading.Thread(target=_kill_when_busy, args=(stack, "vllm-1"))
    killer.start()
    results = _generate_all(stack, KILLED)
    killer.join(60)
    assert stack.workers["vllm-1"].popen.returncode == -signal.SIGKILL
    answers = [a[0] for a in plain["killed"]]
    assert_equal_to_plain_vllm(vllm_checkpoint.path, KILLED, results, answers)
    for i, (_, tokens, events) in enumerate(results):
        assert len(tokens) == MAX_TOKENS, f"prompt {i}"
        assert sum(1 for e in events if e.finish_reason) == 1, f"prompt {i} finished once"
    assert _sample(stack, "lattice_scheduler_requeues_total", reason="lease_expired") > 0
    assert REFUSED not in stack.workers["vllm-2"].log_text()


def _kill_when_busy(stack: VllmStack, worker_id: str) -> None:
    wait_until(
        lambda: {w.worker_id: w for w in stack.stub.GetStatus(pb.GetStatusRequest()).workers},
        f"{worker_id} to hold two",
        120,
        done=lambda status: worker_id in status and status[worker_id].num_assigned >= 2,
        every_seconds=0.01,
    )
    stack.workers[worker_id].kill()


def test_a_decision_vllm_cannot_run_exactly_is_refused_and_the_sequence_finishes(
    ready, vllm_checkpoint
):
    """A first chunk crossing a block boundary off the boundaries: refused in one
    line, nothing held, handed back as preempted; given the chunks a requeue brings, the
    sequence finishes with plain vLLM's tokens."""
    _, plain = ready
    out = run_in_vllm(
        "tests.vllm.refusal",
        str(vllm_checkpoint.path),
        json.dumps(REFUSED_PROMPT),
        str(MAX_TOKENS),
    )
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report["refused_preempted"] == [7]
    assert report["refused_tokens"] == [] and report["held_after_refusal"] == []
    assert report["num_refused"] == 1
    refusals = [line for line in out.splitlines() if REFUSED in line]
    assert len(refusals) == 1 and "block boundaries" in refusals[0], refusals
    assert report["tokens"] == plain["refused"][0][0]
    assert report["finished"] == ["max_length"]
    assert report["kv_free_pages"] == report["total_kv_pages"]
