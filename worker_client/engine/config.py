"""The model config of a Qwen3.5 text model (transformers' model_type "qwen3_5_text").

`ModelConfig.from_hf_dict` reads the dict of a HF `config.json`, either the text
config itself or a composite config (model_type "qwen3_5") with a `text_config`.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

TEXT_MODEL_TYPE = "qwen3_5_text"
COMPOSITE_MODEL_TYPE = "qwen3_5"


class LayerType(enum.Enum):
    """The token mixer of one decoder layer."""

    LINEAR_ATTENTION = "linear_attention"
    FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Qwen3.5 text model; immutable once read."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[LayerType, ...]
    # Full (gated) attention layers.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet (linear attention) layers.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and at most head_dim")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_full_attention_layers(self) -> int:
        return sum(t is LayerType.FULL_ATTENTION for t in self.layer_types)

    @property
    def num_linear_attention_layers(self) -> int:
        return sum(t is LayerType.LINEAR_ATTENTION for t in self.layer_types)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short causal convolution: q, k and v together."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Read a HF config dict; raises ConfigError for anything but Qwen3.5 text."""
        model_type = raw.get("model_type")
        outer: Mapping[str, Any] = {}
        if model_type == COMPOSITE_MODEL_TYPE or "text_config" in raw:
            outer, raw = raw, raw.get("text_config") or {}
            model_type = raw.get("model_type", TEXT_MODEL_TYPE)
        if model_type != TEXT_MODEL_TYPE:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; this engine runs "
                f"{TEXT_MODEL_TYPE!r} (or {COMPOSITE_MODEL_TYPE!r} with a text_config)"
            )
        try:
            return cls._from_text_dict(raw, outer)
        except KeyError as missing:
            raise ConfigError(f"config is missing the required key {missing}") from None

    @classmethod
    def _from_text_dict(cls, raw: Mapping[str, Any], outer: Mapping[str, Any]) -> ModelConfig:
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported")
        num_layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types") or _default_layer_types(
            num_layers, raw.get("full_attention_interval", 4)
        )
        if len(layer_types) != num_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        try:
            parsed_types = tuple(LayerType(t) for t in layer_types)
        except ValueError as bad:
            raise ConfigError(f"unknown layer type: {bad}") from None
        eos = raw.get("eos_token_id", outer.get("eos_token_id"))
        tie = raw.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            layer_types=parsed_types,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
            ),
            linear_num_key_heads=raw["linear_num_key_heads"],
            linear_num_value_heads=raw["linear_num_value_heads"],
            linear_key_head_dim=raw["linear_key_head_dim"],
            linear_value_head_dim=raw["linear_value_head_dim"],
            linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            eos_token_ids=_as_id_tuple(eos),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
        )


def load_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir/config.json`; raises ConfigError if absent or unsupported."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: a model directory needs a HF config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as bad:
        raise ConfigError(f"{path} is not valid JSON: {bad}") from None
    return ModelConfig.from_hf_dict(raw)


def tiny_config() -> ModelConfig:
    """A small model for CPU tests and demos: 3 Gated DeltaNet layers then 1 attention layer."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        layer_types=(LayerType.LINEAR_ATTENTION,) * 3 + (LayerType.FULL_ATTENTION,),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        eos_token_ids=(1,),
    )


def _default_layer_types(num_layers: int, full_attention_interval: int) -> list[str]:
    # Same rule as transformers: every `interval`-th layer is full attention.
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
