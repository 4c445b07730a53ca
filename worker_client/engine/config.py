"""The model config of the Qwen3.5 family's text models, dense and mixture-of-experts.

`ModelConfig.from_hf_dict` reads the dict of a HF `config.json`: a text config
("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next") or a composite
(vision-language) config ("qwen3_5", "qwen3_5_moe") with a `text_config`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError

TEXT_MODEL_TYPE = "qwen3_5_text"
MOE_TEXT_MODEL_TYPE = "qwen3_5_moe_text"
NEXT_MODEL_TYPE = "qwen3_next"
# Composite (vision-language) model types and the text model type they wrap.
COMPOSITE_MODEL_TYPES = {"qwen3_5": TEXT_MODEL_TYPE, "qwen3_5_moe": MOE_TEXT_MODEL_TYPE}
SUPPORTED_MODEL_TYPES = (TEXT_MODEL_TYPE, MOE_TEXT_MODEL_TYPE, NEXT_MODEL_TYPE)


class LayerType(enum.Enum):
    """The token mixer of one decoder layer."""

    LINEAR_ATTENTION = "linear_attention"
    FULL_ATTENTION = "full_attention"


class GdnProjection(enum.Enum):
    """How a Gated DeltaNet layer's input projections are stored."""

    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5, dense and MoE).
    SPLIT = "split"
    # in_proj_qkvz and in_proj_ba, rows grouped by key head (Qwen3-Next).
    FUSED = "fused"


@dataclass(frozen=True)
class MoeConfig:
    """Sparse mixture-of-experts feed-forward blocks with a gated shared expert."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    # Rescale each token's top-k routing weights to sum to 1 (Qwen3.5 MoE always does).
    norm_topk_prob: bool = True
    # Layers that keep the dense MLP instead (Qwen3-Next's mlp_only_layers / decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                f"[1, num_experts {self.num_experts}]"
            )
        if min(self.moe_intermediate_size, self.shared_expert_intermediate_size) < 1:
            raise ConfigError(
                "moe_intermediate_size and shared_expert_intermediate_size must be >= 1"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Qwen3.5-family text model; immutable once read."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLP; 0 when every layer is a MoE block
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
    moe: MoeConfig | None = None  # None: a dense MLP in every layer
    gdn_projection: GdnProjection = GdnProjection.SPLIT

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and at most head_dim")
        if self.intermediate_size < 1 and not all(
            self.is_moe_layer(i) for i in range(self.num_hidden_layers)
        ):
            raise ConfigError("intermediate_size must be >= 1 when a layer has a dense MLP")

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

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` has a sparse MoE block (else the dense MLP)."""
        return self.moe is not None and layer_index not in self.moe.dense_layers

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Read a HF config dict; raises ConfigError for anything but the supported text models."""
        model_type = raw.get("model_type")
        outer: Mapping[str, Any] = {}
        if model_type in COMPOSITE_MODEL_TYPES or "text_config" in raw:
            outer, raw = raw, raw.get("text_config") or {}
            model_type = raw.get(
                "model_type", COMPOSITE_MODEL_TYPES.get(model_type, TEXT_MODEL_TYPE)
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; this engine runs "
                f"{', '.join(map(repr, SUPPORTED_MODEL_TYPES))} (or "
                f"{' / '.join(map(repr, COMPOSITE_MODEL_TYPES))} with a text_config)"
            )
        try:
            return cls._from_text_dict(model_type, raw, outer)
        except KeyError as missing:
            raise ConfigError(f"config is missing the required key {missing}") from None

    @classmethod
    def _from_text_dict(
        cls, model_type: str, raw: Mapping[str, Any], outer: Mapping[str, Any]
    ) -> ModelConfig:
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
        moe = _moe_config(model_type, raw, num_layers)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"] if _needs_dense_mlp(moe) else 0,
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
            moe=moe,
            gdn_projection=GdnProjection.FUSED
            if model_type == NEXT_MODEL_TYPE
            else GdnProjection.SPLIT,
        )


def _moe_config(model_type: str, raw: Mapping[str, Any], num_layers: int) -> MoeConfig | None:
    """The MoE blocks as transformers builds them for `model_type`; None for a dense model."""
    if model_type == TEXT_MODEL_TYPE:
        return None
    if model_type == MOE_TEXT_MODEL_TYPE:
        # Qwen3_5MoeDecoderLayer: a sparse block in every layer; the router always renormalises.
        dense_layers: tuple[int, ...] = ()
        norm_topk_prob = True
    else:
        # Qwen3NextDecoderLayer: sparse where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        if raw["num_experts"] <= 0:
            return None
        step = raw.get("decoder_sparse_step", 1)
        mlp_only = set(raw.get("mlp_only_layers") or ())
        dense_layers = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
        norm_topk_prob = bool(raw.get("norm_topk_prob", True))
    return MoeConfig(
        num_experts=raw["num_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        shared_expert_intermediate_size=raw["shared_expert_intermediate_size"],
        norm_topk_prob=norm_topk_prob,
        dense_layers=dense_layers,
    )


def _needs_dense_mlp(moe: MoeConfig | None) -> bool:
    return moe is None or len(moe.dense_layers) > 0


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


def small_config() -> ModelConfig:
    """A 35M-parameter model for CPU benchmarks: 8 layers (6 Gated DeltaNet, 2 attention),
    hidden 512, whose long prompts cost many decode steps, as a real model's do (on one CPU
    thread a 512-token chunk costs ~0.75 s, 18 decode steps of 4 sequences; tiny_config's
    ~45 ms, near the stack's own per-step cost)."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        layer_types=((LayerType.LINEAR_ATTENTION,) * 3 + (LayerType.FULL_ATTENTION,)) * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    )


def tiny_moe_config() -> ModelConfig:
    """tiny_config() as a Qwen3.5 MoE: 8 experts, top-2, and a shared expert in every layer."""
    return _with_moe(tiny_config(), GdnProjection.SPLIT)


def tiny_next_config() -> ModelConfig:
    """tiny_config() as a Qwen3-Next: fused GDN projections, 8 experts, top-2, a shared expert."""
    return _with_moe(tiny_config(), GdnProjection.FUSED)


def _with_moe(config: ModelConfig, gdn_projection: GdnProjection) -> ModelConfig:
    moe = MoeConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    return replace(config, intermediate_size=0, moe=moe, gdn_projection=gdn_projection)


# `--model` names of random-weight models (weights fully determined by the seed).
PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_config,  # dense Qwen3.5 (qwen3_5_text)
    "tiny-moe": tiny_moe_config,  # Qwen3.5 MoE (qwen3_5_moe_text)
    "tiny-next": tiny_next_config,  # Qwen3-Next (qwen3_next)
    "small": small_config,  # dense Qwen3.5, 35M parameters: CPU benchmarks
}


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
