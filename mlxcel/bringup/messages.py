"""Assignment protocol version 2: message kinds, their fields, encoding and strict decoding.

Every message is one CONTROL frame on the ``assignment`` channel whose payload is a UTF-8 JSON
object of at most 64 KiB: ``{"protocol": 2, "msg": <kind>, <the kind's fields>}``. The version is
read first, so a message of any other version (of any shape) is reported as an "assignment
protocol mismatch"; after it every field of the kind must be present with its type, and no other
field may be. docs/bringup.md §3 is the table.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from mlxcel import strict_json as strict

from .errors import AssignmentProtocolError, ProtocolMismatch
from .wire import ASSIGNMENT_PROTOCOL_VERSION, MAX_ASSIGNMENT_MESSAGE, MAX_REASON_LEN, MAX_STAGES


class Msg(str, enum.Enum):
    """Message kinds; the arrow is the direction (C coordinator, P peer)."""

    QUERY = "query"  # C -> P: who are you
    INFO = "info"  # P -> C: this peer's mlxcel version and memory
    OFFER = "offer"  # C -> P: a stage, its layers and the whole cluster TOML
    ACCEPTED = "accepted"  # P -> C: every check passed
    REFUSED = "refused"  # P -> C: a check failed (reason, fatal)
    COMMIT = "commit"  # C -> P: every peer accepted; prepare
    COMMITTED = "committed"  # P -> C: prepared (the cluster TOML is staged)
    COMMIT_FAILED = "commit_failed"  # P -> C: could not prepare (reason)
    ACTIVATE = "activate"  # C -> P: every peer committed; write the TOML and start the stage
    ABORT = "abort"  # C -> P: the bring-up failed (the failure summary); back to waiting
    STANDBY = "standby"  # C -> P: the bring-up succeeded without this peer; wait as a spare (stages)


class _Layers:
    """Marker type: a [start, end) pair of non-negative integers, start < end."""


class _Memory:
    """Marker type: a list of 1..MAX_STAGES positive integers (bytes per stage)."""


class _Reason:
    """Marker type: a string of at most MAX_REASON_LEN characters."""


FIELDS: dict[Msg, dict[str, type]] = {
    Msg.QUERY: {},
    Msg.INFO: {"mlxcel": str, "memory": int},
    Msg.OFFER: {
        "mlxcel": str, "cluster": str, "model_identity": str, "stage": int, "stages": int,
        "node_id": str, "layers": _Layers, "memory": _Memory, "coordinator": str, "toml": str,
    },
    Msg.ACCEPTED: {"node_id": str},
    Msg.REFUSED: {"reason": _Reason, "fatal": bool},
    Msg.COMMIT: {},
    Msg.COMMITTED: {},
    Msg.COMMIT_FAILED: {"reason": _Reason},
    Msg.ACTIVATE: {},
    Msg.ABORT: {"reason": _Reason},
    Msg.STANDBY: {"stages": int},
}


@dataclass(frozen=True)
class Message:
    """A decoded message: its kind and its fields (exactly the kind's)."""

    kind: Msg
    fields: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def _valid(expected: type, value: Any) -> bool:
    if expected is int:
        return strict.in_range(value, 0)
    if expected is bool:
        return isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    if expected is _Reason:
        return strict.is_string(value, max_chars=MAX_REASON_LEN)
    if expected is _Layers:
        return (isinstance(value, list) and len(value) == 2 and all(strict.in_range(v, 0) for v in value)
                and value[0] < value[1])
    if expected is _Memory:
        return isinstance(value, list) and 1 <= len(value) <= MAX_STAGES and all(strict.in_range(v, 1) for v in value)
    raise AssertionError(expected)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REASON_LEN else text[: MAX_REASON_LEN - 3] + "..."


def encode(kind: Msg, **fields: Any) -> bytes:
    """The payload of one message; refuses missing, extra or mistyped fields (a local bug)."""
    kind = Msg(kind)
    spec = FIELDS[kind]
    for key in ("reason",):
        if key in fields and isinstance(fields[key], str):
            fields[key] = _cut(fields[key])
    if set(fields) != set(spec) or not all(_valid(spec[k], fields[k]) for k in spec):
        raise ValueError(f"{kind.value}: fields {sorted(fields)} do not match {sorted(spec)}")
    body = {"protocol": ASSIGNMENT_PROTOCOL_VERSION, "msg": kind.value, **fields}
    raw = json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
    if len(raw) > MAX_ASSIGNMENT_MESSAGE:
        raise ValueError(f"{kind.value} message of {len(raw)} bytes exceeds {MAX_ASSIGNMENT_MESSAGE}")
    return raw


def decode(payload: bytes | bytearray | memoryview) -> Message:
    """Parse and check one message: the version first, then the kind, then its exact fields."""
    raw = bytes(payload)
    if len(raw) > MAX_ASSIGNMENT_MESSAGE:
        raise AssignmentProtocolError(f"assignment message of {len(raw)} bytes exceeds {MAX_ASSIGNMENT_MESSAGE}")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AssignmentProtocolError("assignment message is not a UTF-8 JSON object") from None
    if not isinstance(doc, dict):
        raise AssignmentProtocolError("assignment message is not a JSON object")
    version = doc.get("protocol")
    if version != ASSIGNMENT_PROTOCOL_VERSION or not strict.is_int(version):
        raise ProtocolMismatch(version, ASSIGNMENT_PROTOCOL_VERSION)
    try:
        kind = Msg(doc.get("msg"))
    except ValueError:
        raise AssignmentProtocolError(f"unknown assignment message kind {doc.get('msg')!r}") from None
    spec = FIELDS[kind]
    fields = {k: v for k, v in doc.items() if k not in ("protocol", "msg")}
    extra, missing = strict.unknown_keys(fields, spec), strict.unknown_keys(spec, fields)
    if extra or missing:
        raise AssignmentProtocolError(f"{kind.value} message: missing {missing}, unknown {extra}")
    bad = [k for k in spec if not _valid(spec[k], fields[k])]
    if bad:
        raise AssignmentProtocolError(f"{kind.value} message: bad value for {', '.join(bad)}")
    return Message(kind, fields)
