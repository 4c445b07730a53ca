"""A tiny Qwen3.5 checkpoint saved by transformers, with a real BPE tokenizer beside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker_client.demo_model import build_tokenizer, write_tokenizer_files

EOS_TOKEN_ID = 1  # "<|im_end|>" in build_tokenizer's vocabulary


@dataclass(frozen=True)
class Checkpoint:
    """The directory, and transformers' own model and tokenizer loaded from it."""

    path: Path
    model: torch.nn.Module
    tokenizer: object  # transformers.PreTrainedTokenizerFast

    def greedy_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy continuation (EOS included when it comes)."""
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=EOS_TOKEN_ID,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            )
        return out[0, len(prompt_ids) :].tolist()

    def greedy_text(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        return self.tokenizer.decode(
            self.greedy_ids(prompt_ids, max_new_tokens), skip_special_tokens=True
        )


# The layers' sizes of the tiny checkpoint; vLLM's CPU kernels want wider heads
# (tests/vllm: VLLM_SIZES).
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def build_checkpoint(path: Path, seed: int = 0, sizes: dict | None = None) -> Checkpoint:
    """3 GDN layers and 1 attention layer, seeded; `sizes` overrides TINY_SIZES."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
        tie_word_embeddings=False,
        **{**TINY_SIZES, **(sizes or {})},
    )
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts norms at identity: make every weight matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "A_log" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
        # EOS's logit is then always 0, below the best of the other 511 random logits: greedy
        # runs never end on their own, so that a test can cancel or cut one mid-answer.
        model.lm_head.weight[EOS_TOKEN_ID].zero_()
    model.save_pretrained(path)
    write_tokenizer_files(path, build_tokenizer(config.vocab_size))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return Checkpoint(path, model, tokenizer)
