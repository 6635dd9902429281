"""Errors about checkpoints: missing, malformed, unsupported. One clear line each."""


class ModelError(Exception):
    """A checkpoint cannot be used: the message says which one and why."""
