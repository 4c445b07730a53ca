"""Our model's logits equal transformers' Qwen3_5ForCausalLM on the same checkpoint (fp32)."""
from __future__ import annotations

import torch

from worker_client.engine.api import SequenceSpec
from worker_client.engine.loading import load_model

from .conftest import build_hf_checkpoint
from .factories import PagedPools, make_engine, random_prompt, run_to_completion

RTOL, ATOL = 1e-4, 1e-4
# Splitting a prompt into chunks reorders fp32 sums in the delta rule: transformers
# itself, fed the same 150 tokens in these uneven chunks through its own cache,
# moves logits (|x| up to ~5) by up to 5.8e-5 from its one-chunk forward.
CHUNKED_ATOL = 2e-4


def reference_logits(reference: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0]


def test_full_prompt_logits_match_transformers_across_gdn_chunk_boundaries(hf_checkpoint, loaded_model):
    prompt = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ours = loaded_model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
    torch.testing.assert_close(ours, reference_logits(hf_checkpoint.reference, prompt), rtol=RTOL, atol=ATOL)


def test_tied_embeddings_checkpoint_logits_match_transformers(tmp_path):
    checkpoint = build_hf_checkpoint(tmp_path, tie_word_embeddings=True, seed=3)
    model = load_model(checkpoint.path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = list(range(2, 40))
    with torch.no_grad():
        ours = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
    torch.testing.assert_close(ours, reference_logits(checkpoint.reference, prompt), rtol=RTOL, atol=ATOL)


def test_uneven_chunked_prefill_then_decode_through_pages_matches_transformers(hf_checkpoint, loaded_model):
    # 150 tokens in chunks that straddle the GDN chunk size (64) and many 4-token pages.
    prompt = list(random_prompt(150, seed=2))
    chunk_lengths = [5, 1, 7, 64, 3, 70]
    pools = PagedPools(loaded_model, num_pages=64, page_size=4, num_slots=2)
    slot = pools.state_pool.acquire()
    logits, start = [], 0
    with torch.no_grad():
        for length in chunk_lengths:
            positions = torch.arange(start, start + length)[None]
            cache = pools.forward_cache([0], [slot], positions)
            logits.append(loaded_model(torch.tensor([prompt[start : start + length]]), positions, cache)[0])
            start += length
        torch.testing.assert_close(
            torch.cat(logits), reference_logits(hf_checkpoint.reference, prompt), rtol=RTOL, atol=CHUNKED_ATOL
        )
        sequence = prompt + [int(logits[-1][-1].argmax())]
        for _ in range(6):  # single-token decode steps
            positions = torch.tensor([[len(sequence) - 1]])
            cache = pools.forward_cache([0], [slot], positions)
            step_logits = loaded_model(torch.tensor([[sequence[-1]]]), positions, cache, last_only=True)[0]
            expected = reference_logits(hf_checkpoint.reference, sequence)[-1]
            torch.testing.assert_close(step_logits, expected, rtol=RTOL, atol=CHUNKED_ATOL)
            sequence.append(int(step_logits.argmax()))


def test_engine_greedy_tokens_match_transformers_argmax(hf_checkpoint, loaded_model):
    prompt = random_prompt(70, seed=4)
    engine = make_engine(loaded_model, page_size=4)
    spec = SequenceSpec(prompt_token_ids=prompt, max_new_tokens=8)
    generated = run_to_completion(engine, seq_id=3, spec=spec, chunk_lengths=[5, 1, 7, 57])
    expected, sequence = [], list(prompt)
    for _ in range(8):
        token = int(reference_logits(hf_checkpoint.reference, sequence)[-1].argmax())
        expected.append(token)
        sequence.append(token)
        if token == 1:  # EOS of the test checkpoint
            break
    assert generated == expected
