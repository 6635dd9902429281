"""``FlagSet``: the base of every feature's frozen flags dataclass (vLLM's ``EngineArgs`` pattern).

A feature's flags are one frozen dataclass whose fields are named after their argparse ``dest``; it adds
its own arguments to a parser (``add_arguments``), builds itself from the parsed values
(``from_cli_args(vars(namespace))``, in ``mlxcel/commands/``) and checks itself once per start
(``check``). Code past ``mlxcel/commands/`` reads typed fields, never the namespace.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, TypeVar

F = TypeVar("F", bound="FlagSet")


class FlagSet:
    """Mixin of a frozen dataclass of flags; a field absent from the parsed values keeps its default."""

    @classmethod
    def from_cli_args(cls: type[F], parsed: Mapping[str, Any]) -> F:
        """The flags of ``parsed`` (``vars(namespace)``) that name this dataclass's fields."""
        return cls(**{f.name: parsed[f.name] for f in fields(cls) if f.init and f.name in parsed})  # type: ignore[arg-type]
