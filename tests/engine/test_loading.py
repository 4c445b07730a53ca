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
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "eos_token_id": 1,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}


def logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids]), torch.arange(len(token_ids))[None])[0]


def test_tiny_model_weights_depend_only_on_the_seed():
    first, again, other = (
        load_model("tiny", seed=1),
        load_model("tiny", seed=1),
        load_model("tiny", seed=2),
    )
    assert first.config == tiny_config()
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values())
    )
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
    config = {
        "model_type": "qwen3_5",
        "text_config": {**TINY_TEXT_CONFIG},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        (
            name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)
        ): t.clone()
        for name, t in source.state_dict().items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(
        2
    )  # ignored: not part of the text model
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.config.eos_token_ids == (1,)
    torch.testing.assert_close(
        logits(loaded, list(range(2, 30))), logits(source, list(range(2, 30)))
    )


def test_checkpoint_missing_a_tensor_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_TEXT_CONFIG))
    tensors = {
        k: v.clone() for k, v in load_model("tiny").state_dict().items() if "layers.3.mlp" not in k
    }
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 3 tensors"):
        load_model(tmp_path)


def test_tokenizer_is_exposed_only_when_tokenizer_json_exists(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world").ids == [0, 1]


def test_default_pool_sizes_on_cpu_fit_and_build_an_engine(tiny_model):
    sizes = default_pool_sizes(tiny_model.config, "cpu")
    assert sizes.total_kv_pages > 0 and sizes.total_gdn_slots > 0
    engine = ModelEngine(
        tiny_model,
        total_kv_pages=sizes.total_kv_pages,
        page_size=sizes.page_size,
        total_gdn_slots=sizes.total_gdn_slots,
        device="cpu",
    )
    assert engine.kv_free_pages() == sizes.total_kv_pages


def test_default_pool_sizes_use_the_page_size_asked_for(tiny_model):
    from worker_client.engine.engine import default_pool_sizes as from_engine_module

    small, large = (from_engine_module(tiny_model.config, "cpu", page_size=n) for n in (8, 32))
    assert (small.page_size, large.page_size) == (8, 32)
    assert small.total_kv_pages == 4 * large.total_kv_pages


def test_pools_larger_than_memory_raise_model_does_not_fit(tiny_model):
    with pytest.raises(ModelDoesNotFit, match="KV pages"):
        ModelEngine(
            tiny_model, total_kv_pages=10**12, page_size=16, total_gdn_slots=4, device="cpu"
        )


def test_transformers_default_text_and_composite_configs_read_the_same():
    transformers = pytest.importorskip("transformers")
    from worker_client.engine.config import LayerType, ModelConfig

    text = ModelConfig.from_hf_dict(transformers.Qwen3_5TextConfig().to_dict())
    composite = ModelConfig.from_hf_dict(transformers.Qwen3_5Config().to_dict())
    assert text == composite
    assert text.layer_types[:4] == (LayerType.LINEAR_ATTENTION,) * 3 + (LayerType.FULL_ATTENTION,)
    assert text.rotary_dim == text.head_dim // 4


def test_moe_config_without_its_expert_keys_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_TEXT_CONFIG, "model_type": "qwen3_5_moe_text"})
    )
    with pytest.raises(ConfigError, match="missing the required key 'num_experts'"):
        load_model(tmp_path)


def test_moe_presets_are_seeded_and_of_their_family():
    from worker_client.engine.config import GdnProjection

    moe, next_ = load_model("tiny-moe", seed=1), load_model("tiny-next", seed=1)
    assert moe.config.moe is not None and moe.config.gdn_projection is GdnProjection.SPLIT
    assert next_.config.moe is not None and next_.config.gdn_projection is GdnProjection.FUSED
    again = load_model("tiny-next", seed=1)
    assert all(
        torch.equal(a, b) for a, b in zip(next_.state_dict().values(), again.state_dict().values())
    )


def per_expert_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors as transformers' save_pretrained writes them: one tensor per expert and projection."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for index, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                tensors[f"{prefix}{index}.gate_proj.weight"] = gate.clone()
                tensors[f"{prefix}{index}.up_proj.weight"] = up.clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for index, stacked in enumerate(tensor):
                tensors[f"{prefix}{index}.down_proj.weight"] = stacked.clone()
        else:
            tensors[name] = tensor.clone()
    return tensors


def moe_text_config(model) -> dict:
    moe = model.config.moe
    return {
        **TINY_TEXT_CONFIG,
        "model_type": "qwen3_5_moe_text",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
    }


def test_per_expert_and_stacked_expert_checkpoints_load_the_same_weights(tmp_path):
    source = load_model("tiny-moe", seed=5)
    for layout, tensors in (
        ("stacked", {k: v.clone() for k, v in source.state_dict().items()}),
        ("per_expert", per_expert_tensors(source)),
    ):
        (tmp_path / layout).mkdir()
        (tmp_path / layout / "config.json").write_text(json.dumps(moe_text_config(source)))
        save_file(tensors, tmp_path / layout / "model.safetensors")
        loaded = load_model(tmp_path / layout)
        assert loaded.config == source.config
        assert all(
            torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items()
        ), layout


def test_composite_moe_checkpoint_with_language_model_prefix_loads(tmp_path):
    source = load_model("tiny-moe", seed=6)
    text_config = moe_text_config(source)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5_moe", "text_config": text_config})
    )
    tensors = {
        (k if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
        for k, v in per_expert_tensors(source).items()
    }
    tensors["model.visual.blocks.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(2)  # ignored
    save_file(tensors, tmp_path / "model.safetensors")
    torch.testing.assert_close(
        logits(load_model(tmp_path), list(range(2, 30))),
        logits(source, list(range(2, 30))),
        rtol=0,
        atol=0,
    )


def test_checkpoint_missing_an_expert_is_a_checkpoint_error_naming_it(tmp_path):
    source = load_model("tiny-moe")
    (tmp_path / "config.json").write_text(json.dumps(moe_text_config(source)))
    tensors = per_expert_tensors(source)
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"lacks 1 expert tensors.*layers\.2\.mlp\.experts\.6\.up_proj"
    ):
        load_model(tmp_path)


def test_expert_beyond_the_configs_count_is_a_checkpoint_error(tmp_path):
    source = load_model("tiny-moe")
    (tmp_path / "config.json").write_text(json.dumps({**moe_text_config(source), "num_experts": 6}))
    save_file(per_expert_tensors(source), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="expert 6, config.json has 6 experts"):
        load_model(tmp_path)


def test_transformers_default_moe_configs_read_as_transformers_builds_the_layers():
    transformers = pytest.importorskip("transformers")
    from worker_client.engine.config import GdnProjection, ModelConfig

    text = ModelConfig.from_hf_dict(transformers.Qwen3_5MoeTextConfig().to_dict())
    assert text == ModelConfig.from_hf_dict(transformers.Qwen3_5MoeConfig().to_dict())
    assert (
        text.moe.num_experts == 256
        and text.moe.num_experts_per_tok == 8
        and text.moe.dense_layers == ()
    )
    assert text.intermediate_size == 0 and text.gdn_projection is GdnProjection.SPLIT
    next_ = ModelConfig.from_hf_dict(
        transformers.Qwen3NextConfig(
            decoder_sparse_step=2, mlp_only_layers=[5], norm_topk_prob=False
        ).to_dict()
    )
    assert next_.gdn_projection is GdnProjection.FUSED and next_.moe.norm_topk_prob is False
    assert [i for i in range(8) if next_.is_moe_layer(i)] == [1, 3, 7]
    dense = ModelConfig.from_hf_dict(transformers.Qwen3NextConfig(num_experts=0).to_dict())
    assert dense.moe is None and dense.intermediate_size == 5632


@pytest.mark.slow
def test_weight_bytes_count_every_expert_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    from worker_client.engine.config import ModelConfig
    from worker_client.engine.sizing import weight_bytes

    for config_class, model_class in (
        (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    ):
        hf_config = config_class()
        with torch.device("meta"):
            expected = sum(p.numel() for p in model_class(hf_config).parameters())  # 35B and 80B
        assert (
            weight_bytes(ModelConfig.from_hf_dict(hf_config.to_dict()), torch.bfloat16)
            == 2 * expected
        )


def test_default_pool_sizes_before_loading_leave_room_for_the_expert_weights(monkeypatch):
    from dataclasses import replace

    from worker_client.engine import sizing
    from worker_client.engine.config import MoeConfig, tiny_config

    gib = 1 << 30
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 40 * gib)
    moe = replace(
        tiny_config(), intermediate_size=0, moe=MoeConfig(64, 4, 256, 64)
    )  # 64 experts of 256 x 64
    weights = sizing.weight_bytes(moe, torch.bfloat16)
    assert weights > 4 * 64 * 3 * 256 * 64 * 2  # the experts of 4 layers alone, 2 bytes each
    loaded = sizing.default_pool_sizes(moe, "cuda")
    before = sizing.default_pool_sizes(moe, "cuda", weights_on_device=False)
    assert loaded.total_gdn_slots == before.total_gdn_slots == 256
    page_bytes = sizing.kv_page_bytes(moe, 16, torch.bfloat16)
    assert abs((loaded.total_kv_pages - before.total_kv_pages) - 0.9 * weights / page_bytes) <= 1
    monkeypatch.setattr(sizing, "available_bytes", lambda device: weights)
    with pytest.raises(ModelDoesNotFit, match="after 0.02 GiB of weights"):
        sizing.default_pool_sizes(moe, "cuda", weights_on_device=False)
