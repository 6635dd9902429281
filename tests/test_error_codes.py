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
