"""Shared factories for the engine tests: tiny transformers checkpoints of each family and our
model loaded from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker_client.engine.loading import load_model
from worker_client.engine.model import Qwen35ForCausalLM

from .tolerance import Float64Transformers

# The shapes every tiny test checkpoint shares: 3 linear_attention layers then 1 full_attention.
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    eos_token_id=1,
)
_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
# model_type -> (config class, model class, config keys) in transformers.
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=128)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _MOE),
    # Layer 0 keeps a dense MLP (mlp_only_layers), so both kinds of feed-forward run.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(_MOE, intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=True),
    ),
}


@dataclass(frozen=True)
class HfCheckpoint:
    """A tiny checkpoint written by transformers and the transformers model that wrote it."""

    path: Path
    reference: torch.nn.Module


def build_hf_checkpoint(
    path: Path,
    *,
    model_type: str = "qwen3_5_text",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **overrides,
) -> HfCheckpoint:
    transformers = pytest.importorskip("transformers")
    config_class, model_class, family_keys = FAMILIES[model_type]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        **{**_COMMON, **family_keys, **overrides}, tie_word_embeddings=tie_word_embeddings
    )
    reference = getattr(transformers, model_class)(config).eval()
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


@dataclass(frozen=True)
class FamilyModels:
    """One tiny checkpoint of a family: transformers' model in float32 and float64, ours loaded from the files."""

    model_type: str
    checkpoint: HfCheckpoint
    hf64: Float64Transformers
    ours: Qwen35ForCausalLM  # float32, as served
    ours64: Qwen35ForCausalLM  # float64: the engine's exact reference


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request, tmp_path_factory: pytest.TempPathFactory) -> FamilyModels:
    checkpoint = build_hf_checkpoint(
        tmp_path_factory.mktemp(request.param), model_type=request.param
    )
    return FamilyModels(
        model_type=request.param,
        checkpoint=checkpoint,
        hf64=Float64Transformers(checkpoint.reference),
        ours=load_model(checkpoint.path, dtype=torch.float32),
        ours64=load_model(checkpoint.path, dtype=torch.float64),
    )
