"""The reference inference engine of the worker: the Qwen3.5 family in PyTorch.

Dense Qwen3.5, Qwen3.5 MoE and Qwen3-Next (Gated DeltaNet + gated attention,
dense MLP or sparse MoE blocks with a shared expert). Entry points: load_model()
builds a model, default_pool_sizes() sizes the caches, ModelEngine implements
api.Engine for the worker loop (packed prefill, batched decode).
"""

import importlib

from .api import (
    ChunkWork,
    Engine,
    FinishedSequence,
    FinishReason,
    SequenceSpec,
    StepOutput,
    TokenLogprobs,
)
from .config import PRESETS, LayerType, ModelConfig, MoeConfig, load_config, tiny_config
from .errors import CheckpointError, ConfigError, EngineError, ModelDoesNotFit

# Names whose modules import torch, loaded on first use: a worker that runs no model
# (`--model scripted`) or only reads api.py does not pay torch's import.
_TORCH_NAMES = {
    "ModelEngine": ".engine",
    "load_model": ".loading",
    "load_tokenizer": ".loading",
    "GeneratedSequence": ".reference",
    "generate_reference": ".reference",
    "SamplingParams": ".sampling",
    "sample_token": ".sampling",
    "PoolSizes": ".sizing",
    "default_pool_sizes": ".sizing",
    "weight_bytes": ".sizing",
}


def __getattr__(name: str):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "CheckpointError",
    "ChunkWork",
    "ConfigError",
    "Engine",
    "EngineError",
    "FinishReason",
    "FinishedSequence",
    "GeneratedSequence",
    "LayerType",
    "ModelConfig",
    "ModelDoesNotFit",
    "ModelEngine",
    "MoeConfig",
    "PRESETS",
    "PoolSizes",
    "SamplingParams",
    "SequenceSpec",
    "StepOutput",
    "TokenLogprobs",
    "default_pool_sizes",
    "generate_reference",
    "load_config",
    "load_model",
    "load_tokenizer",
    "sample_token",
    "tiny_config",
    "weight_bytes",
]
