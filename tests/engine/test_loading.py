"""Loading: the seeded tiny model, HF checkpoint directories, and the errors a person can act on."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from worker_client.engine.config import tiny_config
from worker_client.engine.engine import ModelEngine
from worker_client.engine.errors import CheckpointError, ConfigError, ModelDoesNotFit
from worker_client.engine.loading import load_model, load_tokenizer
from worker_client.engine.sizing import default_pool_sizes

TINY_TEXT_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids]), torch.arange(len(token_ids))[None])[0]


def test_tiny_model_weights_depend_only_on_the_seed():
    first, again, other = load_model("tiny", seed=1), load_model("tiny", seed=1), load_model("tiny", seed=2)
    assert first.config == tiny_config()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_directory_without_config_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_wrong_model_type_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_TEXT_CONFIG, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="'llama'.*qwen3_5_text"):
        load_model(tmp_path)


def test_composite_checkpoint_with_language_model_prefix_loads(tmp_path):
    source = load_model("tiny", seed=4)
    config = {"model_type": "qwen3_5", "text_config": {**TINY_TEXT_CONFIG}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        (name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)): t.clone()
        for name, t in source.state_dict().items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2)  # ignored: not part of the text model
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.config.eos_token_ids == (1,)
    torch.testing.assert_close(logits(loaded, list(range(2, 30))), logits(source, list(range(2, 30))))


def test_checkpoint_missing_a_tensor_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_TEXT_CONFIG))
    tensors = {k: v.clone() for k, v in load_model("tiny").state_dict().items() if "layers.3.mlp" not in k}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 3 tensors"):
        load_model(tmp_path)


def test_tokenizer_is_exposed_only_when_tokenizer_json_exists(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world").ids == [0, 1]


def test_default_pool_sizes_on_cpu_fit_and_build_an_engine(tiny_model):
    sizes = default_pool_sizes(tiny_model.config, "cpu")
    assert sizes.num_kv_pages > 0 and sizes.num_gdn_slots > 0
    engine = ModelEngine(tiny_model, num_kv_pages=sizes.num_kv_pages, page_size=sizes.page_size,
                         num_gdn_slots=sizes.num_gdn_slots, device="cpu")
    assert engine.num_free_kv_pages() == sizes.num_kv_pages


def test_default_pool_sizes_use_the_page_size_asked_for(tiny_model):
    from worker_client.engine.engine import default_pool_sizes as from_engine_module

    small, large = (from_engine_module(tiny_model.config, "cpu", page_size=n) for n in (8, 32))
    assert (small.page_size, large.page_size) == (8, 32)
    assert small.num_kv_pages == 4 * large.num_kv_pages


def test_pools_larger_than_memory_raise_model_does_not_fit(tiny_model):
    with pytest.raises(ModelDoesNotFit, match="KV pages"):
        ModelEngine(tiny_model, num_kv_pages=10**12, page_size=16, num_gdn_slots=4, device="cpu")


def test_transformers_default_text_and_composite_configs_read_the_same():
    transformers = pytest.importorskip("transformers")
    from worker_client.engine.config import LayerType, ModelConfig

    text = ModelConfig.from_hf_dict(transformers.Qwen3_5TextConfig().to_dict())
    composite = ModelConfig.from_hf_dict(transformers.Qwen3_5Config().to_dict())
    assert text == composite
    assert text.layer_types[:4] == (LayerType.LINEAR_ATTENTION,) * 3 + (LayerType.FULL_ATTENTION,)
    assert text.rotary_dim == text.head_dim // 4


def test_moe_config_without_its_expert_keys_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_TEXT_CONFIG, "model_type": "qwen3_5_moe_text"}))
    with pytest.raises(ConfigError, match="missing the required key 'num_experts'"):
        load_model(tmp_path)
