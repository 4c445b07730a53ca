"""Errors the engine raises, each with a message a person can act on."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by worker_client.engine."""


class ConfigError(EngineError):
    """A model config is missing, malformed or describes an unsupported model."""


class CheckpointError(EngineError):
    """A checkpoint's tensors do not match the model its config describes."""


class ModelDoesNotFit(EngineError):
    """The requested KV pages and GDN slots do not fit in the device's memory."""
