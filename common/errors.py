"""Errors shared by every process."""


class ConfigError(ValueError):
    """A setting is out of range; raised before the service starts."""
