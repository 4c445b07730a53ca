"""The reference inference engine of the worker: Qwen3.5 (Gated DeltaNet + gated attention) in PyTorch.

Entry points: load_model() builds a model, default_pool_sizes() sizes the
caches, ModelEngine implements api.Engine for the worker loop.
"""
from .api import ChunkWork, Engine, FinishedSequence, FinishReason, SequenceSpec, StepOutput
from .config import LayerType, ModelConfig, load_config, tiny_config
from .engine import ModelEngine
from .errors import CheckpointError, ConfigError, EngineError, ModelDoesNotFit
from .loading import load_model, load_tokenizer
from .reference import GeneratedSequence, generate_reference
from .sampling import SamplingParams, sample_token
from .sizing import PoolSizes, default_pool_sizes

__all__ = [
    "CheckpointError", "ChunkWork", "ConfigError", "Engine", "EngineError", "FinishReason",
    "FinishedSequence", "GeneratedSequence", "LayerType", "ModelConfig", "ModelDoesNotFit",
    "ModelEngine", "PoolSizes", "SamplingParams", "SequenceSpec", "StepOutput",
    "default_pool_sizes", "generate_reference", "load_config", "load_model", "load_tokenizer",
    "sample_token", "tiny_config",
]
