"""Native Windows: none of the distributed modes runs there (the reference's first section).

``mlxcel generate`` and ``mlxcel-server`` refuse their distributed flags at start-up, before the model is
resolved, each with an error naming the flag: ``--tp-size`` above 1 and ``--pp-layers`` on both,
``--pp-size`` above 1 on ``generate``; ``--pp-auto``, ``--pp-peer``, ``--distributed-config``, a
``--node-role`` other than the single-node ``hybrid``, ``--peers``, ``--prefill-peers``, ``--decode-peers``
and ``--serving-bind`` on the server. The platform is read through ``native_windows`` alone, so tests
patch that one function.
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

from mlxcel.errors import CLIError

Flag = tuple[str, str, Callable[[object], bool]]  # (attribute, flag, "given" test of its value)


def native_windows() -> bool:
    """True on native Windows (not WSL2, which reports linux)."""
    return sys.platform == "win32"


def _above_one(value: object) -> bool:
    return isinstance(value, int) and value > 1


def _given(value: object) -> bool:
    return value is not None and value is not False


def _distributed_role(value: object) -> bool:
    return value is not None and value != "hybrid"


GENERATE_FLAGS: tuple[Flag, ...] = (("tp_size", "--tp-size", _above_one), ("pp_layers", "--pp-layers", _given),
                                    ("pp_size", "--pp-size", _above_one))
SERVER_FLAGS: tuple[Flag, ...] = (
    ("tp_size", "--tp-size", _above_one), ("pp_layers", "--pp-layers", _given), ("pp_auto", "--pp-auto", _given),
    ("pp_peer", "--pp-peer", _given), ("distributed_config", "--distributed-config", _given),
    ("node_role", "--node-role", _distributed_role), ("peers", "--peers", _given),
    ("prefill_peers", "--prefill-peers", _given), ("decode_peers", "--decode-peers", _given),
    ("serving_bind", "--serving-bind", _given),
)


def check_native_windows(values: Mapping[str, object], flags: tuple[Flag, ...]) -> None:
    """On native Windows, a ``CLIError`` naming the first distributed flag given (``values``: the flags by their
    argparse ``dest``); elsewhere nothing."""
    if not native_windows():
        return
    for attr, flag, given in flags:
        if given(values.get(attr)):
            raise CLIError(f"{flag} is not supported on native Windows: tensor parallelism, pipeline parallelism "
                           "and disaggregated inference do not run there; use Linux, macOS or WSL2")
