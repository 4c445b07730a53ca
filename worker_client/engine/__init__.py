"""The reference inference engine of the worker: the Qwen3.5 family in PyTorch.

Dense Qwen3.5, Qwen3.5 MoE and Qwen3-Next (Gated DeltaNet + gated attention,
dense MLP or sparse MoE blocks with a shared expert). Entry points: load_model()
builds a model, default_pool_sizes() sizes the caches, ModelEngine implements
api.Engine for the worker loop (packed prefill, batched decode).
"""
from .api import ChunkWork, Engine, FinishedSequence, FinishReason, SequenceSpec, StepOutput
from .config import LayerType, ModelConfig, MoeConfig, load_config, tiny_config
from .engine import ModelEngine
from .errors import CheckpointError, ConfigError, EngineError, ModelDoesNotFit
from .loading import PRESETS, load_model, load_tokenizer
from .reference import GeneratedSequence, generate_reference
from .sampling import SamplingParams, sample_token
from .sizing import PoolSizes, default_pool_sizes, weight_bytes

__all__ = [
    "CheckpointError", "ChunkWork", "ConfigError", "Engine", "EngineError", "FinishReason",
    "FinishedSequence", "GeneratedSequence", "LayerType", "ModelConfig", "ModelDoesNotFit",
    "ModelEngine", "MoeConfig", "PRESETS", "PoolSizes", "SamplingParams", "SequenceSpec", "StepOutput",
    "default_pool_sizes", "generate_reference", "load_config", "load_model", "load_tokenizer",
    "sample_token", "tiny_config", "weight_bytes",
]
