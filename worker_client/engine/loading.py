"""Build a model: the seeded tiny model, or a HF Qwen3.5 checkpoint directory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .checkpoint import read_checkpoint
from .config import PRESETS, ModelConfig, load_config
from .errors import CheckpointError
from .model import Qwen35ForCausalLM


def load_model(
    source: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Qwen35ForCausalLM:
    """Return an eval-mode model on `device` in `dtype`.

    `source` is a preset name (PRESETS: "tiny", "tiny-moe", "tiny-next", "small"; random
    weights fully determined by `seed`) or a directory with config.json and
    *.safetensors as transformers writes them. Raises ConfigError /
    CheckpointError with the reason.
    """
    if str(source) in PRESETS:
        model = random_model(PRESETS[str(source)](), seed)
        return model.to(device=device, dtype=dtype).eval()
    model_dir = Path(source)
    config = load_config(model_dir)
    return _load_checkpoint(model_dir, config, torch.device(device), dtype).eval()


def random_model(config: ModelConfig, seed: int) -> Qwen35ForCausalLM:
    """A CPU fp32 model whose weights depend only on (config, seed)."""
    model = Qwen35ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(_random_init(name, param, generator))
    return model


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """A `tokenizers.Tokenizer` from model_dir/tokenizer.json; None if absent or not installed."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(path))


def _random_init(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(param.shape, generator=generator) * std

    if name.endswith("linear_attn.norm.weight"):  # gated norm: the weight is the scale
        return 1.0 + normal(0.1)
    if name.endswith("norm.weight"):  # zero-centred norms: the weight is an offset from 1
        return normal(0.1)
    if name.endswith("A_log"):
        return torch.empty(param.shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("conv1d.weight"):
        return normal(0.3)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    return normal(1.0 / math.sqrt(param.shape[-1]))


def _load_checkpoint(
    model_dir: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> Qwen35ForCausalLM:
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    tensors = read_checkpoint(model_dir, expected, device, dtype)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name in optional:
        tensors.pop(name, None)
    missing = sorted(set(expected) - set(tensors) - optional)
    if missing:
        raise CheckpointError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
