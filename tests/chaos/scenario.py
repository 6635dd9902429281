"""The chaos run both chaos modules share: 4 streams of bounded load for about 40 s (or one round of the
actions) while a loop kills, freezes or restarts a random node (``test_chaos_pipeline.py``,
``test_chaos_disagg.py``).

Counted (``tests/chaos/harness.py``): requests started, completed (whole, and equal to the undisturbed
run, greedy, token for token), resumed and held (/metrics), failed with a clean error, hung (must be 0)
and silently truncated (must be 0). The counts and the seconds from each kill to serving again go to
``$MLXCEL_CHAOS_OUT/<name>.json`` when set (docs/benchmarks.md records a run). The two clusters live in
two modules so that their minute of chaos each runs on its own test worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.chaos.harness import ACTIONS, Chaos, Counts, Load, Target
from tests.server.util import metrics

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 80, 81, 82, 83]]
MAX_TOKENS = 24
DURATION_S = float(os.environ.get("MLXCEL_CHAOS_SECONDS", "40"))  # about 8 actions at the 5 s interval


@pytest.fixture
def patient_starts(monkeypatch):
    """A node started again under load on a shared 2-core box may take minutes to print its URL."""
    from tests.pipeline.cluster import Node

    monkeypatch.setattr(Node, "start_wait_s", 240.0)
    monkeypatch.setattr(Node, "ready_wait_s", 240.0)


def undisturbed(url: str) -> list[str]:
    """The greedy text of every prompt before any chaos: what every completion must equal."""
    out = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def reroutes(url: str) -> tuple[int, int, int]:
    """The front end's resumed requests, (a router's) failovers and (a coordinator's) held requests so far."""
    m = metrics(url)
    return (int(m["mlxcel_resumed_requests_total"]), int(m.get("router_failovers", 0)),
            int(m.get("mlxcel_requests_held_total", 0)))


def run_chaos(name: str, url: str, targets: list[Target], healthy, tmp_path: Path,
              actions: tuple[str, ...] = ACTIONS, seed: int = 25, *, one_round: bool = False) -> Counts:
    """``one_round``: exactly one round of ``actions``, 2.5 s (+-50%) apart, unless MLXCEL_CHAOS_SECONDS is set
    (a benchmark run: that long at least, 5 s apart, as without it)."""
    expected = undisturbed(url)
    before = reroutes(url)
    load = Load(url, PROMPTS, expected, max_tokens=MAX_TOKENS, pause_s=0.5).start()
    short = one_round and "MLXCEL_CHAOS_SECONDS" not in os.environ
    try:
        Chaos(targets, healthy, load.counts, duration=0.0 if short else DURATION_S, interval=2.5 if short else 5.0,
              actions=actions, seed=seed).run()
    finally:
        counts = load.stop()
    counts.resumed, counts.failovers, counts.held = (a - b for a, b in zip(reroutes(url), before))
    summary = counts.summary()
    out = Path(os.environ.get("MLXCEL_CHAOS_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nchaos {name}: {json.dumps(summary)}")
    assert counts.hung == 0, counts.problems
    assert counts.truncated == 0, counts.problems
    assert counts.events, "the chaos loop did nothing"
    assert counts.completed + counts.failed_clean == counts.started
    return counts


