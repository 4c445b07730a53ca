"""The Qwen3.5 text model (transformers' Qwen3_5ForCausalLM), state kept outside.

Module and parameter names follow transformers, so `state_dict()` keys are the
tensor names of a HF safetensors checkpoint ("model.layers.0.linear_attn...").
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import GatedAttention
from .config import LayerType, ModelConfig
from .forward_cache import ForwardCache, NoCache
from .gdn import GatedDeltaNet
from .layers import MLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or attention), then the MLP."""

    def __init__(self, config: ModelConfig, layer_type: LayerType) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type is LayerType.LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class TextModel(nn.Module):
    """Embedding, decoder layers and final norm; `model.*` in checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)


class Qwen35ForCausalLM(nn.Module):
    """The causal LM: `forward(input_ids, positions, cache)` returns logits of every token.

    Each layer's state lives in the `ForwardCache` the caller passes, indexed by
    the layer's rank among layers of its type (linear or full attention).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: ForwardCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, vocab] if `last_only`) for tokens [B, T] at `positions` [B, T].

        Without a cache, every row must start at position 0 (a whole sequence).
        """
        cache = NoCache() if cache is None else cache
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, hidden.dtype)
        ranks = {LayerType.LINEAR_ATTENTION: 0, LayerType.FULL_ATTENTION: 0}
        for layer in self.model.layers:
            rank = ranks[layer.layer_type]
            ranks[layer.layer_type] += 1
            normed = layer.input_layernorm(hidden)
            if layer.layer_type is LayerType.LINEAR_ATTENTION:
                mixed, state = layer.linear_attn(normed, cache.gdn_state(rank))
                cache.store_gdn_state(rank, state)
            else:
                attn = layer.self_attn
                query, gate, key, value = attn.project(normed, cos, sin)
                keys, values = cache.keys_values(rank, key, value)
                mixed = attn.attend(query, gate, keys, values, positions)
            hidden = hidden + mixed
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden[:, -1]
        return self.lm_head(self.model.norm(hidden))
