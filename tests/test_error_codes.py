"""One error vocabulary: the code table against the docs, the HTTP mapping by class, strict wire reading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlxcel.engine.interface import EngineFailure, EngineUnavailable, FinishEvent, finish_error
from mlxcel.error_codes import ErrorClass, ErrorCode
from mlxcel.pipeline.coordinator import stage_code
from mlxcel.server.errors import error_reply

DOCS = Path(__file__).resolve().parents[1] / "docs"
CLASS_NAMES = {"unavailable": ErrorClass.UNAVAILABLE, "bad input": ErrorClass.BAD_INPUT,
               "cancelled": ErrorClass.CANCELLED, "internal": ErrorClass.INTERNAL}


def _rows(text: str, pattern: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in re.finditer(pattern, text, re.MULTILINE)]


def test_server_docs_list_every_code_with_its_class_and_status():
    text = (DOCS / "server.md").read_text()
    section = text[text.index("### Error codes of the backend"):]
    rows = _rows(section, r"^\| (\d+) \| `(\w+)` \| ([a-z ]+) \| (\d{3})")
    assert {int(v) for v, *_ in rows} == {int(c) for c in ErrorCode}, "docs/server.md misses or invents a code"
    for value, name, klass, status in rows:
        code = ErrorCode(int(value))
        assert (name, CLASS_NAMES[klass], int(status)) == (code.wire_name, code.error_class, code.http_status), value


def test_protocol_docs_list_every_code_by_value():
    text = (DOCS / "protocol.md").read_text()
    section = text[text.index("### 5.1 Status values and error bodies"):]
    section = section[:section.index("\n## ")]
    rows = _rows(section, r"^\| (\d+) \| ([A-Z_]+) \| ")
    assert {(int(v), n) for v, n in rows} >= {(int(c), c.name) for c in ErrorCode}
    assert {int(v) for v, _ in rows} == {int(c) for c in ErrorCode}


def test_pipeline_docs_codes_match_the_enum_and_its_http_status():
    text = (DOCS / "pipeline.md").read_text()
    section = text[text.index("### 4.4 Error codes"):text.index("### 4.5")]
    rows = _rows(section, r"^\| (\d+) \| `(\w+)` \|.*\| ([^|]*) \|$")
    assert len(rows) >= 10
    for value, name, status in rows:
        code = ErrorCode(int(value))
        assert code.wire_name == name
        if status.strip()[:3].isdigit():
            local = stage_code(code)  # a stage's code, as the coordinator reports it
            assert int(status.strip()[:3]) == local.http_status, (name, status)
            assert ("Retry-After" in status) == local.retryable, name
    for stale in ("unknown_request", "no_downstream", "stage_unreachable"):
        assert f"`{stale}`" not in text, f"docs/pipeline.md still names the retired code {stale}"


def test_pipeline_docs_map_every_stage_code_at_the_coordinator():
    """§4.4's table: every value a stage may send, what the coordinator reports and the client's status
    (never 4xx, never 499: issue 21, finding 5)."""
    text = (DOCS / "pipeline.md").read_text()
    section = text[text.index("### 4.4 Error codes"):text.index("### 4.5")]
    rows = _rows(section, r"^\| (\d+) \| `(\w+)`[^|]* \| `(\w+)` \| (\d{3})( \+ `Retry-After`)? \|$")
    assert sorted(int(v) for v, *_ in rows) == sorted(int(c) for c in ErrorCode), "a stage code is not mapped"
    for value, name, reported, status, retry in rows:
        code = ErrorCode(int(value))
        assert (name, reported) == (code.wire_name, stage_code(code).wire_name), value
        assert int(status) == stage_code(code).http_status and bool(retry) == stage_code(code).retryable, value
        assert 500 <= int(status) < 600, value


def test_pipeline_docs_state_the_json_type_of_every_code_field():
    text = (DOCS / "pipeline.md").read_text()
    rows = _rows(text, r"^\| `code` \| ([^|]+) \|")
    assert rows and all(t.strip() == "integer" for t, in rows), rows
    assert "An ERROR's `code` is a JSON integer" in text


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_backend_error_maps_to_http_by_the_class_of_its_code(code: ErrorCode):
    reply = error_reply(finish_error(FinishEvent("error", error="it failed", code=code)))
    assert reply.status == code.http_status
    assert ("Retry-After" in reply.headers) == code.retryable
    body = reply.json()["error"]
    assert body["message"] == "it failed"
    if code.retryable:
        assert body["type"] == "service_unavailable"
    elif code.error_class is ErrorClass.INTERNAL:
        assert body["type"] == "server_error" and body["code"] == "generation_failed"


def test_unavailable_and_timeout_are_503_internal_is_500():
    assert error_reply(EngineFailure("x", ErrorCode.TIMEOUT)).status == 503
    assert error_reply(EngineUnavailable("x")).headers == {"Retry-After": "1"}
    assert error_reply(EngineFailure("x")).status == 500
    assert error_reply(EngineFailure("x", ErrorCode.BAD_REQUEST)).status == 400


def test_a_peer_complaint_about_our_message_is_our_internal_error():
    for code in ErrorCode:
        local = code.as_local()
        if code.error_class in (ErrorClass.UNAVAILABLE, ErrorClass.CANCELLED):
            assert local is code
        else:
            assert local is ErrorCode.INTERNAL


@pytest.mark.parametrize("value", [True, False, "4", 4.0, None, -1, 99, 2**16])
def test_unknown_or_mistyped_wire_values_read_as_unknown(value):
    assert ErrorCode.from_wire(value) is ErrorCode.UNKNOWN


def test_wire_values_are_stable():
    assert {c.name: int(c) for c in ErrorCode} == {
        "UNKNOWN": 0, "INTERNAL": 1, "BAD_REQUEST": 2, "UNAUTHORIZED": 3, "NOT_FOUND": 4, "CONFLICT": 5,
        "OVERLOADED": 6, "TIMEOUT": 7, "UNAVAILABLE": 8, "UNSUPPORTED": 9, "CANCELLED": 10, "BAD_TENSOR": 11,
        "UNREACHABLE": 12, "MISMATCH": 13}


def test_cluster_and_stage_protocols_share_the_one_enum():
    from mlxcel.cluster.wire import ErrorCode as ClusterCode
    from mlxcel.pipeline.protocol import ErrorCode as StageCode

    assert ClusterCode is ErrorCode and StageCode is ErrorCode


# -- every error class of the wire-facing packages carries its code ---------------------------------

CODED_PACKAGES = ("mlxcel.cluster", "mlxcel.bringup", "mlxcel.parallel", "mlxcel.pipeline", "mlxcel.disagg",
                  "mlxcel.engine", "mlxcel.models", "mlxcel.topology")
#: errors that never carry a code, and why: operator lines of the command line and the config files
#: (they end the process before any request exists), and input errors the HTTP layer maps by class
UNCODED = {
    "mlxcel.engine.sampling.SamplingError": "HTTP 400 by class (server/errors.py); wrapped by every codec",
    "mlxcel.engine.prompts.PromptError": "HTTP 400 by class (server/errors.py)",
    "mlxcel.models.errors.ModelError": "an operator line: the checkpoint cannot load",
    "mlxcel.engine.requests.IllegalTransition": "a bug in the scheduler (a transition its table forbids), never an answer",
    "mlxcel.topology.partition.PartitionError": "an operator line: --pp-layers / --memory",
    "mlxcel.topology.cluster_config.ClusterConfigError": "an operator line: the cluster TOML",
    "mlxcel.bringup.beacon.BeaconRejected": "a beacon is dropped, never answered",
    "mlxcel.bringup.beacon.OtherCluster": "a beacon is dropped, never answered",
    "mlxcel.bringup.push._PeerFailed": "private: becomes a BringupFailed line",
    "mlxcel.bringup.push._Abandon": "private: becomes a BringupFailed line",
}


def _error_classes() -> dict[str, type]:
    """Every exception class defined in the packages, by dotted name (importing each module)."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    for package in CODED_PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_error_class_carries_a_class_level_code():
    from mlxcel.error_codes import CodedError

    classes = _error_classes()
    assert {"mlxcel.cluster.errors.PeerUnreachable", "mlxcel.bringup.errors.BringupFailed",
            "mlxcel.parallel.errors.TPError", "mlxcel.parallel.control.ControlError"} <= classes.keys()
    assert not set(UNCODED) - classes.keys(), "UNCODED names a class that is gone"
    uncoded = sorted(name for name, cls in classes.items()
                     if name not in UNCODED and not (issubclass(cls, CodedError) and isinstance(cls.code, ErrorCode)))
    assert not uncoded, f"error classes without an ErrorCode: {uncoded}"


def test_cluster_errors_answer_their_class_code():
    """What a failing request handler answers (docs/protocol.md §5.1), from the class codes alone."""
    from mlxcel.cluster import errors as ce
    from mlxcel.cluster.rpc import error_for

    assert error_for(ce.RequestError(ErrorCode.NOT_FOUND, "no such sequence")) == (ErrorCode.NOT_FOUND, "no such sequence")
    assert error_for(ce.RequestFailed("x failed", ErrorCode.OVERLOADED, "full")) == (ErrorCode.OVERLOADED, "full")
    assert error_for(ce.RequestTimeout("late"))[0] is ErrorCode.TIMEOUT
    assert error_for(ce.HandshakeTimeout("late"))[0] is ErrorCode.TIMEOUT
    assert error_for(TimeoutError("late"))[0] is ErrorCode.TIMEOUT
    for exc in (ce.PeerUnreachable("gone"), ce.ConnectionLost("lost"), ce.ServerAtCapacity("full"), KeyError("k")):
        assert error_for(exc) == (ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def test_bringup_tp_and_control_errors_carry_codes():
    from mlxcel.bringup.errors import AssignmentTimeout, BringupError, ProtocolMismatch
    from mlxcel.error_codes import code_of
    from mlxcel.parallel.control import ControlError, decode
    from mlxcel.parallel.errors import HostfileError, ShardRefusal, TPError

    assert code_of(BringupError("x")) is ErrorCode.INTERNAL and code_of(AssignmentTimeout("x")) is ErrorCode.TIMEOUT
    assert code_of(ProtocolMismatch(1, 2)) is ErrorCode.MISMATCH
    assert [code_of(e("x")) for e in (TPError, ShardRefusal, HostfileError)] == [
        ErrorCode.INTERNAL, ErrorCode.UNSUPPORTED, ErrorCode.BAD_REQUEST]
    with pytest.raises(ControlError) as refused:
        decode(b'{"op":"ready","rank":true}')
    assert refused.value.code is ErrorCode.BAD_REQUEST and isinstance(refused.value, ValueError)
    assert ControlError("x", ErrorCode.UNAUTHORIZED).code is ErrorCode.UNAUTHORIZED  # overridable per instance
