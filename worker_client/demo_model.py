"""A demo checkpoint directory made here, seeded, from nothing downloaded: the tiny
Qwen3.5-architecture model with random weights plus a small byte-level BPE tokenizer
(trained on text written below) and a ChatML chat template.

    python -m worker_client.demo_model DIR [--seed N]

`write_tokenizer_files` needs only `tokenizers`; `write_demo_checkpoint` also needs torch
and safetensors (the worker's dependencies). The model's answers are noise; the point is
a checkpoint that the workers load and the gateway tokenizes exactly as a real one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Special tokens first, so their ids are fixed: the tiny model's EOS id is 1.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")
EOS_TOKEN = "<|im_end|>"
# ChatML, the format of the Qwen family's chat templates.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Training text: English, some accented and CJK text and emoji, so that the merges join
# common ASCII words while most multi-byte characters stay split across byte tokens.
_CORPUS = [
    "The scheduler admits sequences from the head of the queue while capacity remains.",
    "Every worker reports what it holds and what it has free, once per iteration.",
    "A prompt is prefilled in chunks; then the sequence decodes one token at a time.",
    "Hello, world! How are you today? The weather is fine and the queue is short.",
    "Gated DeltaNet layers keep a recurrent state; attention layers keep a paged cache.",
    "Café, naïve, résumé, Zürich, São Paulo, Kraków: accents are two bytes in UTF-8.",
    "日本語のテキストは三バイトの文字です。東京、大阪、京都。",
    "中文文本也是三个字节。北京、上海、广州。你好，世界！",
    "Emoji take four bytes: 🚀 🙂 🎉 ✨ and they often split across tokens.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = < > ( ) [ ] { }",
]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens; the same
    every time (the corpus is fixed and BPE training is deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, token
    return tokenizer


def write_tokenizer_files(model_dir: Path, tokenizer) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template), as
    transformers reads them."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# The tiny model with heads wide enough for vLLM's CPU kernels (`--wide`).
WIDE_SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)


def write_demo_checkpoint(model_dir: Path, seed: int = 0, wide: bool = False) -> None:
    """config.json, generation_config.json and model.safetensors of the tiny model with
    weights from `seed`, plus the tokenizer files; `wide`: WIDE_SIZES (for vLLM)."""
    import dataclasses

    from safetensors.torch import save_file

    from worker_client.engine.config import tiny_config
    from worker_client.engine.loading import random_model

    config = tiny_config()
    if wide:
        config = dataclasses.replace(config, **WIDE_SIZES)
    write_tokenizer_files(model_dir, build_tokenizer(config.vocab_size))
    model = random_model(config, seed)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(model_dir / "model.safetensors"))
    hf_config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": len(config.layer_types),
        "layer_types": [t.value for t in config.layer_types],
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": list(config.eos_token_ids),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        "torch_dtype": "float32",
    }
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(config.eos_token_ids), "pad_token_id": 0}, indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="weights seed")
    parser.add_argument(
        "--wide", action="store_true", help="heads wide enough for vLLM's CPU kernels"
    )
    args = parser.parse_args(argv)
    if (args.model_dir / "config.json").is_file():
        print(f"demo model: {args.model_dir} already holds a checkpoint; left as it is")
        return 0
    write_demo_checkpoint(args.model_dir, args.seed, wide=args.wide)
    print(
        f"demo model: wrote the tiny model (seed {args.seed}) with its tokenizer to "
        f"{args.model_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
