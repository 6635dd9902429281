"""The multi-turn agent benchmark's conversations and summary math (``bench/agent_turns.py`` drives them).

A conversation is what a coding agent resends every turn: a system prompt, tool schemas, then per earlier turn
a user message, the assistant's tool call and the tool's result (seeded pseudo-text), and the new user message.
Turn k's prompt is turn k-1's prompt plus one (call, result, user) step, so from turn 2 on nearly all of it is a
prefix the server has seen. Everything depends only on the ``Shape`` (its seed included), never on the server,
the variant or the clock: every variant gets identical inputs.

Two wires: ``native`` sends OpenAI ``tools``, assistant ``tool_calls`` and ``role: tool`` results (checkpoints whose
chat template knows tools); ``text`` writes the same content as plain messages (the schemas in the system prompt,
the call as the assistant's text, the result as a user message) for checkpoints without a tool format, such as
the default SmolLM2.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

WIRES = ("native", "text")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a pattern and return matching lines.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}}, "required": ["pattern"]}}},
]
_WORDS = ("def return value module import class test error line file path build cache token prefix server "
          "request stream router node config thread lock queue batch tensor layer shape index offset length "
          "bytes frame secret key counter metric prompt decode prefill handoff stage worker result status").split()
_TASKS = ("Find why the cache test fails and fix it.", "Check which module reads the router config.",
          "Run the tests of the stream module.", "Look for the place that computes the offset.",
          "Read the error handling of the server.", "Search where the batch size is set.")


@dataclass(frozen=True)
class Shape:
    """One run's conversations: ``turns`` requests each, every tool result ``result_words`` words long."""

    conversations: int = 4
    turns: int = 8
    system_words: int = 300
    result_words: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_words", "result_words"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"agent_turns: {name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


def _text(rng: random.Random, words: int) -> str:
    """``words`` words of code-review-like pseudo-text, in lines of 12."""
    picked = [rng.choice(_WORDS) for _ in range(words)]
    return "\n".join(" ".join(picked[i:i + 12]) for i in range(0, words, 12))


def system_prompt(shape: Shape) -> str:
    """The agent's instructions: shared by every conversation of the run (as an agent's are)."""
    rng = random.Random(f"system-{shape.seed}")
    return ("You are a coding agent working in a repository. Use the tools to inspect it, then answer briefly.\n"
            "Project notes:\n" + _text(rng, shape.system_words))


def _call(shape: Shape, conv: int, turn: int) -> dict[str, Any]:
    rng = random.Random(f"call-{shape.seed}-{conv}-{turn}")
    tool = TOOLS[rng.randrange(len(TOOLS))]["function"]["name"]
    arg = {"read_file": {"path": f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py", "start_line": 1},
           "run_command": {"command": f"pytest -q tests/test_{rng.choice(_WORDS)}.py"},
           "search_code": {"pattern": f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"}}[tool]
    return {"id": f"call_{shape.seed}_{conv}_{turn}", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arg, sort_keys=True)}}


def _result(shape: Shape, conv: int, turn: int) -> str:
    return _text(random.Random(f"result-{shape.seed}-{conv}-{turn}"), shape.result_words)


def _user(shape: Shape, conv: int, turn: int) -> str:
    head = f"[conversation {conv}] " if turn == 0 else ""
    return head + _TASKS[(conv + turn + shape.seed) % len(_TASKS)]


def turn_messages(shape: Shape, conv: int, turn: int, wire: str) -> list[dict[str, Any]]:
    """The messages of request ``turn`` (0-based) of conversation ``conv``: the system prompt, every earlier
    step (user message, tool call, tool result) and the new user message."""
    if wire not in WIRES:
        raise ValueError(f"agent_turns: unknown wire {wire!r} (one of {', '.join(WIRES)})")
    if not 0 <= conv < shape.conversations or not 0 <= turn < shape.turns:
        raise ValueError(f"agent_turns: no turn {turn} of conversation {conv} in {shape}")
    system = system_prompt(shape)
    if wire == "text":
        system += "\n\nTools (JSON schemas):\n" + json.dumps(TOOLS, sort_keys=True)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for j in range(turn):
        call = _call(shape, conv, j)
        out.append({"role": "user", "content": _user(shape, conv, j)})
        if wire == "native":
            out += [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": _result(shape, conv, j)}]
        else:
            out += [{"role": "assistant", "content": "<tool_call>" + json.dumps(call["function"], sort_keys=True)
                     + "</tool_call>"},
                    {"role": "user", "content": f"Tool result ({call['id']}):\n" + _result(shape, conv, j)}]
    out.append({"role": "user", "content": _user(shape, conv, turn)})
    return out


def request_body(shape: Shape, conv: int, turn: int, wire: str, model: str, max_tokens: int) -> dict[str, Any]:
    """The streamed, greedy, fixed-length chat request of one turn (``ignore_eos``: mlxcel's extension)."""
    body: dict[str, Any] = {"model": model, "messages": turn_messages(shape, conv, turn, wire), "stream": True,
                            "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if wire == "native":
        body.update(tools=TOOLS, tool_choice="none")  # the schemas in the prompt, the answer streamed as text
    return body


def estimated_tokens(shape: Shape, wire: str, count: Callable[[str], int]) -> int:
    """The last turn's prompt length by ``count`` (a tokenizer's length of a text) over its messages' texts."""
    msgs = turn_messages(shape, shape.conversations - 1, shape.turns - 1, wire)
    text = "\n".join(json.dumps(m) if m.get("tool_calls") else str(m["content"]) for m in msgs)
    extra = json.dumps(TOOLS) if wire == "native" else ""
    return count(text + extra) + 8 * len(msgs)  # the template's role markers


# -- summaries ----------------------------------------------------------------------------------------


def _spread(values: Iterable[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the values that are present; Nones where none is."""
    xs = [v for v in values if v is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def repeat_medians(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float | None]]:
    """Per (variant, repeat): the median TTFT of turn 1 and of turns >= 2, decode tok/s, and the prefix
    reuse of turns >= 2 (the turn waves' cached tokens over the tokens their previous turns held)."""
    out: dict[tuple[str, int], dict[str, float | None]] = {}
    for key in dict.fromkeys((r["variant"], r["repeat"]) for r in rows):
        mine = [r for r in rows if (r["variant"], r["repeat"]) == key and not r.get("error")]
        later = [r for r in mine if r["turn"] >= 2]
        waves = {r["turn"]: (r["wave_cached_tokens"], r["wave_reusable_tokens"]) for r in later
                 if r.get("wave_cached_tokens") is not None}
        reusable = sum(w[1] for w in waves.values())
        out[key] = {
            "ttft_turn1_ms": _spread(r["ttft_ms"] for r in mine if r["turn"] == 1)[0],
            "ttft_later_ms": _spread(r["ttft_ms"] for r in later)[0],
            "decode_tps": _spread(r["decode_tps"] for r in mine)[0],
            "reuse": sum(w[0] for w in waves.values()) / reusable if reusable else None,
        }
    return out


def summaries(rows: list[dict[str, Any]], baseline: str, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One summary row per variant (medians over repeats of the per-repeat medians, with min and max; the later
    turns' TTFT over ``baseline``'s in the same repeat) and one ratio row per (numerator, denominator) pair of
    ``pairs`` present in the rows (the numerator's later-turn TTFT over the denominator's, per repeat)."""
    per = repeat_medians(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    out = []
    for v in variants:
        reps = {rep: m for (name, rep), m in per.items() if name == v}
        mine = [r for r in rows if r["variant"] == v]
        vs = [_div(m["ttft_later_ms"], per.get((baseline, rep), {}).get("ttft_later_ms")) for rep, m in reps.items()]
        row = {"mode": "summary", "variant": v, "topology": mine[0]["topology"], "args": mine[0]["args"],
               "repeats": len(reps), "requests": len(mine), "errors": sum(1 for r in mine if r.get("error")),
               "prompt_tokens_max": max((r["prompt_tokens"] or 0) for r in mine), "baseline": baseline}
        for name in ("ttft_turn1_ms", "ttft_later_ms", "decode_tps", "reuse"):
            med, lo, hi = _spread(m[name] for m in reps.values())
            row.update({name: _r(med), f"{name}_min": _r(lo), f"{name}_max": _r(hi)})
        med, lo, hi = _spread(vs)
        row.update(vs_baseline=_r(med), vs_baseline_min=_r(lo), vs_baseline_max=_r(hi))
        out.append(row)
    for num, den in pairs:
        if num not in variants or den not in variants:
            continue
        ratios = [_div(per[(num, rep)]["ttft_later_ms"], per.get((den, rep), {}).get("ttft_later_ms"))
                  for (name, rep) in per if name == num]
        med, lo, hi = _spread(ratios)
        out.append({"mode": "ratio", "variant": num, "denominator": den, "metric": "ttft_later_ms",
                    "repeats": sum(1 for x in ratios if x is not None), "ratio": _r(med), "ratio_min": _r(lo),
                    "ratio_max": _r(hi)})
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
