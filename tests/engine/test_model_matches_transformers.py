"""Our model's logits equal transformers' Qwen3_5ForCausalLM on the same checkpoint (fp32)."""
from __future__ import annotations

import torch

from worker_client.engine.loading import load_model

from .conftest import build_hf_checkpoint

RTOL, ATOL = 1e-4, 1e-5


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
