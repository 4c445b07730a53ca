"""Shared factories for the engine tests: a tiny transformers checkpoint and our model loaded from it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker_client.engine.loading import load_model
from worker_client.engine.model import Qwen35ForCausalLM


@dataclass(frozen=True)
class HfCheckpoint:
    """A tiny Qwen3.5 checkpoint written by transformers and the transformers model that wrote it."""

    path: Path
    reference: torch.nn.Module


def build_hf_checkpoint(path: Path, *, tie_word_embeddings: bool = False, seed: int = 0) -> HfCheckpoint:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,  # 3 linear_attention + 1 full_attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        eos_token_id=1,
        tie_word_embeddings=tie_word_embeddings,
    )
    reference = transformers.Qwen3_5ForCausalLM(config).eval()
    # transformers initialises norms to their identity; perturb every weight so
    # that a swapped or misread tensor changes the logits.
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight") or "A_log" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    reference.save_pretrained(path)
    return HfCheckpoint(path=path, reference=reference)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> HfCheckpoint:
    return build_hf_checkpoint(tmp_path_factory.mktemp("qwen35_tiny"))


@pytest.fixture(scope="session")
def loaded_model(hf_checkpoint: HfCheckpoint) -> Qwen35ForCausalLM:
    return load_model(hf_checkpoint.path, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model() -> Qwen35ForCausalLM:
    return load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
