"""bench/agent_turns.py: the growing conversations (deterministic, identical across variants), the variant syntax,
the summary math, and one real run against a tiny single-node server whose second turn reuses the first's prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import agent_conv as conv
from bench.agent_turns import main, parse_variant, prompt_sha256, with_cache_size
from mlxcel.models.random_checkpoint import make_random_checkpoint
from mlxcel.report.schema import validate_row

SHAPE = conv.Shape(conversations=3, turns=4, system_words=40, result_words=50, seed=7)


@pytest.mark.parametrize("wire", conv.WIRES)
def test_every_turn_extends_the_previous_one(wire: str) -> None:
    for c in range(SHAPE.conversations):
        turns = [conv.turn_messages(SHAPE, c, t, wire) for t in range(SHAPE.turns)]
        for before, after in zip(turns, turns[1:]):
            assert after[:len(before)] == before  # the whole earlier prompt is a prefix of the next
            assert len(after) == len(before) + 3  # one step: the tool call, its result, the new user message
        assert turns[0][0]["role"] == "system" and [m["role"] for m in turns[0]] == ["system", "user"]


def test_the_conversations_are_deterministic_and_distinct() -> None:
    again = conv.Shape(conversations=3, turns=4, system_words=40, result_words=50, seed=7)
    a = conv.request_body(SHAPE, 1, 3, "native", "m", 8)
    assert a == conv.request_body(again, 1, 3, "native", "m", 8)
    assert prompt_sha256(a) == prompt_sha256(conv.request_body(again, 1, 3, "native", "other", 16))
    other = conv.turn_messages(SHAPE, 2, 3, "native")
    assert other[0] == a["messages"][0] and other[1:] != a["messages"][1:]  # shared system prompt only
    reseeded = conv.turn_messages(conv.Shape(3, 4, 40, 50, seed=8), 1, 3, "native")
    assert reseeded != a["messages"]
    result = a["messages"][3]
    assert result["role"] == "tool" and len(result["content"].split()) == 50
    call = a["messages"][2]["tool_calls"][0]
    assert result["tool_call_id"] == call["id"] and json.loads(call["function"]["arguments"])
    assert (a["tools"], a["tool_choice"], a["ignore_eos"], a["temperature"]) == (conv.TOOLS, "none", True, 0)


def test_the_text_wire_carries_the_schemas_and_no_tool_fields() -> None:
    body = conv.request_body(SHAPE, 0, 2, "text", "m", 8)
    assert "tools" not in body and all(m["role"] in ("system", "user", "assistant") for m in body["messages"])
    assert json.dumps(conv.TOOLS, sort_keys=True) in body["messages"][0]["content"]
    assert body["messages"][2]["content"].startswith("<tool_call>")


@pytest.mark.parametrize("bad, words", [
    (lambda: conv.Shape(conversations=0), "conversations"), (lambda: conv.Shape(turns=0), "turns"),
    (lambda: conv.turn_messages(SHAPE, 3, 0, "text"), "no turn"), (lambda: conv.turn_messages(SHAPE, 0, 0, "x"), "wire"),
])
def test_bad_shapes_are_refused(bad, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        bad()


def test_variants_name_topologies_and_role_arguments() -> None:
    v = parse_variant("prefix-kv8=2p1d;all:--kv-bits 8;router:--route-policy prefix")
    assert (v.name, v.topology) == ("prefix-kv8", "2p1d")
    assert v.role("router") == ["--kv-bits", "8", "--route-policy", "prefix"] and v.role("prefill") == ["--kv-bits", "8"]
    assert parse_variant("p=pp2").role("stage") == [] and parse_variant("s=single").topology == "single"
    for bad, words in (("x", "NAME=TOPOLOGY"), ("x=ring", "topology"), ("x=2p1d;gpu:--y", "ROLE"),
                       ("x=2p1d-warp", "option")):
        with pytest.raises(ValueError, match=words):
            parse_variant(bad)


def test_a_prefix_cache_size_reaches_the_roles_that_keep_one_and_no_other() -> None:
    sized = with_cache_size(parse_variant("p=2p1d;prefill:--kv-bits 8;router:--route-policy prefix"), 16000)
    assert sized.role("prefill") == ["--kv-bits", "8", "--prefix-cache-mb", "16000"]
    assert sized.role("server") == sized.role("coordinator") == ["--prefix-cache-mb", "16000"]
    assert sized.role("router") == ["--route-policy", "prefix"] and sized.role("decode") == sized.role("stage") == []
    assert with_cache_size(parse_variant("s=single"), None).role("server") == []


def turn(variant: str, rep: int, c: int, t: int, ttft: float, cached: int | None = 0, reusable: int = 0) -> dict:
    return {"variant": variant, "topology": "single" if variant == "single" else "2p1d", "args": "", "repeat": rep,
            "conversation": c, "turn": t, "ttft_ms": ttft, "decode_tps": 10.0, "prompt_tokens": 100 * t,
            "wave_cached_tokens": cached, "wave_reusable_tokens": reusable, "error": ""}


def test_the_summary_holds_later_turns_against_the_single_node_and_pairs_the_policies() -> None:
    rows = []
    for rep, scale in ((0, 1.0), (1, 2.0)):
        for variant, later in (("single", 10.0), ("prefix", 12.0), ("round-robin", 48.0)):
            for c in range(2):
                rows.append(turn(variant, rep, c, 1, 100.0 * scale))
                rows += [turn(variant, rep, c, t, later * scale + c, cached=150, reusable=200) for t in (2, 3)]
    by = {(s["mode"], s["variant"]): s for s in conv.summaries(rows, "single", [("round-robin", "prefix"), ("a", "b")])}
    single, prefix = by[("summary", "single")], by[("summary", "prefix")]
    assert (single["ttft_turn1_ms"], single["ttft_turn1_ms_min"], single["ttft_turn1_ms_max"]) == (150.0, 100.0, 200.0)
    assert (single["ttft_later_ms"], single["ttft_later_ms_min"], single["ttft_later_ms_max"]) == (15.5, 10.5, 20.5)
    assert single["vs_baseline"] == 1.0 and single["reuse"] == 0.75  # two waves of 150 cached over 200 reusable
    assert prefix["vs_baseline"] == pytest.approx((12.5 / 10.5 + 24.5 / 20.5) / 2, abs=1e-3)  # paired per repeat
    assert (prefix["vs_baseline_min"], prefix["vs_baseline_max"]) == (round(12.5 / 10.5, 3), round(24.5 / 20.5, 3))
    ratio = by[("ratio", "round-robin")]
    assert (ratio["denominator"], ratio["repeats"]) == ("prefix", 2)
    assert ratio["ratio"] == pytest.approx((48.5 / 12.5 + 96.5 / 24.5) / 2, abs=1e-3)
    assert ("ratio", "a") not in by  # a pair whose variants did not run gives no row


def test_failed_requests_and_missing_metrics_leave_gaps_not_zeros() -> None:
    rows = [turn("single", 0, 0, 1, 100.0), turn("single", 0, 0, 2, 10.0, cached=None, reusable=90),
            {**turn("single", 0, 1, 2, 0.0), "ttft_ms": None, "error": "HTTP 500"}]
    (s,) = conv.summaries(rows, "single", [])
    assert (s["ttft_later_ms"], s["reuse"], s["errors"]) == (10.0, None, 1)


@pytest.mark.timeout(120)
@pytest.mark.proc
def test_a_real_run_reuses_the_prefix_from_turn_two(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    model = make_random_checkpoint(tmp_path_factory.mktemp("agent-tools"), family="llama", layers=2, template="qwen3")
    assert main(["-m", str(model), "--variant", "single=single", "--conversations", "2", "--turns", "2",
                 "--system-words", "24", "--result-words", "24", "--max-tokens", "3", "--repeats", "1",
                 "--common-args", "--parallel 2", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "agent_turns.jsonl").read_text().splitlines()]
    turns = [r for r in rows if r["mode"] == "turn"]
    assert len(turns) == 4 and {r["wire"] for r in turns} == {"native"} and not any(r["error"] for r in turns)
    second = [r for r in turns if r["turn"] == 2]
    assert all(r["prompt_tokens"] > r["reusable_tokens"] > 0 for r in second)
    assert second[0]["wave_cached_tokens"] > 0 and second[0]["wave_reusable_tokens"] == sum(
        r["prompt_tokens"] for r in turns if r["turn"] == 1)
    assert all(r["completion_tokens"] == 3 and r["ttft_ms"] > 0 for r in turns)
    (summary,) = [r for r in rows if r["mode"] == "summary"]
    assert summary["vs_baseline"] == 1.0 and 0 < summary["reuse"] <= 1
    for r in rows:
        validate_row(r)


@pytest.fixture
def metrics_server():
    """A loopback HTTP server whose /metrics answers the text put in ``pages[port]``."""
    import http.server
    import threading

    pages: dict[int, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = pages[self.server.server_address[1]].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    servers = []

    def start(text: str) -> str:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        pages[srv.server_address[1]] = text
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_prefix_counters_sum_over_processes_and_say_when_they_were_not_measured(metrics_server) -> None:
    import asyncio

    import httpx

    from bench.agent_turns import prefix_counters

    a = metrics_server("mlxcel_prefix_cache_hits_total 2.0\nmlxcel_prefix_cache_reused_tokens_total 300.0\n")
    b = metrics_server("# a comment\nmlxcel_prefix_cache_hits_total 1\nmlxcel_prefix_cache_reused_tokens_total 50\n")
    bare = metrics_server("mlxcel_requests_total 4\n")  # a process that does not export the counters

    async def read(urls: list[str]):
        async with httpx.AsyncClient() as client:
            return await prefix_counters(client, urls)

    assert asyncio.run(read([a, b])) == (3.0, 350.0)
    assert asyncio.run(read([a, bare])) is None  # not measured, not "nothing reused"
    assert asyncio.run(read([a, "http://127.0.0.1:9"])) is None  # a process that does not answer
    # a prefill node has no prefix-cache lines on /metrics but reports them on /health (docs/disagg.md §8);
    # this stand-in serves the same JSON on every path
    prefill = metrics_server('{"ready": true, "prefix_hits": 4, "prefix_tokens": 256}')
    assert asyncio.run(read([a, prefill])) == (6.0, 556.0)


def test_a_waves_order_rotates_so_round_robin_cannot_pin_a_conversation_to_a_node() -> None:
    from bench.agent_turns import wave_order

    # a round-robin router over 2 nodes gives the k-th request of a wave node k % 2 (its cursor starts even)
    nodes = {c: [] for c in range(4)}
    for turn in range(4):
        for position, c in enumerate(wave_order(4, turn)):
            nodes[c].append(position % 2)
    assert all(sorted(wave_order(4, t)) == [0, 1, 2, 3] for t in range(4))  # each conversation once a wave
    assert all(len(set(n)) == 2 for n in nodes.values()), nodes  # every conversation meets both nodes


@pytest.mark.proc  # the rows' environment asks git for the commit
def test_a_run_stopped_early_keeps_the_variants_it_finished(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each (variant, repeat)'s rows reach the file when it ends: a deadline that kills the run keeps them."""
    import bench.agent_turns as at

    def run_variant(v, args, work):
        if v.name == "b":
            raise KeyboardInterrupt  # the deadline's kill, as the second variant runs
        return [{"conversation": 0, "turn": 1, "ttft_ms": 5.0, "error": ""}], "http://127.0.0.1:1"

    monkeypatch.setattr(at, "run_variant", run_variant)
    monkeypatch.setattr(at, "check_length", lambda args: None)
    with pytest.raises(KeyboardInterrupt):
        main(["--variant", "a=single", "--variant", "b=single", "--repeats", "1", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "agent_turns.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["turn"], r["ttft_ms"]) for r in rows] == [("a", 1, 5.0)]
