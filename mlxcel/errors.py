"""Errors shared by the command-line entry points (``mlxcel``, ``mlxcel-server``)."""


class CLIError(Exception):
    """An error already phrased for the operator: printed as one line, exit status 1."""
