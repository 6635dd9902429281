"""Summarise a scheduler step trace (``MLXCEL_STEP_TRACE=FILE.jsonl``, mlxcel/engine/steptrace.py).

    python -m bench.step_trace FILE.jsonl [--skip-s 1.0] [--json]

Prints each phase's share of the scheduler thread's wall time (idle, build, device, sample, detok,
emit, lock, other) and of its busy time (the wall time less idle), the decode steps per second and the rows per decode step; ``--json`` prints the
same as one JSON object (for rows). ``--skip-s`` drops the first seconds (the first requests' compile).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlxcel.engine.steptrace import OFF_PHASES, PHASES

ALL_PHASES = (*PHASES, "other")


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's lines (a line cut short by a killed process is skipped)."""
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def summarise(lines: list[dict[str, Any]], skip_s: float = 0.0) -> dict[str, Any]:
    """Shares of wall time per phase, steps and rows, over the lines after ``skip_s``."""
    lines = [ln for ln in lines if ln["t"] >= skip_s]
    wall = sum(ln["wall_ms"] for ln in lines)
    totals = {p: sum(ln.get(p, 0.0) for ln in lines) for p in ALL_PHASES}
    busy = wall - totals["idle"]
    decode = [rows for ln in lines for kind, rows in ln["applied"] if kind == "decode"]
    span_s = (lines[-1]["t"] + lines[-1]["wall_ms"] / 1000 - lines[0]["t"]) if lines else 0.0
    return {
        "passes": len(lines), "wall_ms": round(wall, 1), "span_s": round(span_s, 3),
        "share": {p: round(totals[p] / wall, 4) if wall else 0.0 for p in ALL_PHASES},
        # of the time the thread had work (idle left out: a server waiting for requests)
        "busy_share": {p: round(totals[p] / busy, 4) if busy else 0.0 for p in ALL_PHASES if p != "idle"},
        "ms": {p: round(v, 1) for p, v in totals.items()},
        "off_thread_ms": {p: round(sum(ln.get(p, 0.0) for ln in lines), 1) for p in OFF_PHASES},
        "decode_steps": len(decode), "decode_steps_per_s": round(len(decode) / span_s, 2) if span_s else None,
        "rows_per_decode_step": round(sum(decode) / len(decode), 2) if decode else None,
        "prefill_steps": sum(1 for ln in lines for kind, _ in ln["applied"] if kind == "prefill"),
        "host_ms_per_decode_step": round((wall - totals["idle"] - totals["device"]) / len(decode), 3) if decode else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    head = (f"{s['passes']} passes over {s['span_s']} s: {s['decode_steps']} decode steps "
            f"({s['decode_steps_per_s']}/s, {s['rows_per_decode_step']} rows each), {s['prefill_steps']} prefill steps; "
            f"host {s['host_ms_per_decode_step']} ms per decode step")
    body = "\n".join(f"  {p:<7} {100 * s['share'][p]:5.1f}%  {s['ms'][p]:10.1f} ms"
                     + (f"  ({100 * s['busy_share'][p]:5.1f}% of busy)" if p in s["busy_share"] else "")
                     for p in ALL_PHASES)
    off = ", ".join(f"{p} {v} ms" for p, v in s["off_thread_ms"].items())
    return head + "\n" + body + f"\n  emitter thread: {off}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="step_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--skip-s", type=float, default=0.0, help="drop lines in the first seconds (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    lines = load(args.trace)
    if not lines:
        print(f"step_trace: no lines in {args.trace}", file=sys.stderr)
        return 1
    s = summarise(lines, args.skip_s)
    print(json.dumps(s) if args.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
