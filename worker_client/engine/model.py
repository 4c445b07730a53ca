"""The Qwen3.5-family text model (transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and
Qwen3NextForCausalLM), state kept outside.

Module and parameter names follow transformers, so `state_dict()` keys are the
tensor names of a HF safetensors checkpoint ("model.layers.0.linear_attn...");
see loading.py for the per-expert tensors of MoE checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import GatedAttention
from .batch import PackedBatch
from .config import LayerType, ModelConfig
from .forward_cache import ForwardCache, NoCache
from .gdn import GatedDeltaNet
from .layers import MLP, RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or attention), then the MLP or MoE block."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        if config.is_moe_layer(layer_index):
            assert config.moe is not None
            self.mlp: nn.Module = SparseMoeBlock(config.hidden_size, config.moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class TextModel(nn.Module):
    """Embedding, decoder layers and final norm; `model.*` in checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)


class Qwen35ForCausalLM(nn.Module):
    """The causal LM over packed tokens of several sequences (`forward_packed`).

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
        """Logits [B, T, vocab] (or [B, vocab] if `last_only`) for rows of equal length [B, T] at `positions`.

        Without a cache, every row must start at position 0 (a whole sequence).
        """
        batch = PackedBatch.rectangular(positions)
        logits = self.forward_packed(input_ids.reshape(-1), batch, cache, last_only)
        return logits if last_only else logits.unflatten(0, tuple(positions.shape))

    def forward_packed(
        self,
        token_ids: torch.Tensor,
        batch: PackedBatch,
        cache: ForwardCache | None = None,
        last_only: bool = False,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [num_tokens, vocab] (or [num_rows, vocab], each row's last, if `last_only`;
        or [len(logit_index), vocab], those packed tokens', if `logit_index` is given).

        `token_ids` [num_tokens] are the rows' tokens end to end, as `batch` describes.
        """
        cache = NoCache(batch) if cache is None else cache
        hidden = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary_emb.cos_sin(batch.positions, hidden.dtype)
        ranks = {LayerType.LINEAR_ATTENTION: 0, LayerType.FULL_ATTENTION: 0}
        for layer in self.model.layers:
            rank = ranks[layer.layer_type]
            ranks[layer.layer_type] += 1
            normed = layer.input_layernorm(hidden)
            if layer.layer_type is LayerType.LINEAR_ATTENTION:
                mixed, state = layer.linear_attn(normed, cache.gdn_state(rank), batch)
                cache.store_gdn_state(rank, state)
            else:
                mixed = layer.self_attn(normed, cos, sin, batch, cache, rank)
            hidden = hidden + mixed
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if logit_index is not None:
            hidden = hidden[logit_index]
        elif last_only:
            hidden = batch.last_tokens(hidden)
        return self.lm_head(self.model.norm(hidden))
