"""The chaos harness: a bounded load of streams against a cluster while a loop breaks its nodes.

``Load`` runs ``streams`` client threads, each sending greedy completions one after another (even
threads stream SSE, odd ones do not) and sorting every outcome:

- **completed**: 200, the whole answer (``finish_reason`` "length", ``max_tokens`` tokens), and its
  text equals the undisturbed run's (``expected``);
- **failed_clean**: an HTTP error with the OpenAI error body (503 + ``Retry-After`` for an unavailable
  backend), or an SSE ``error`` event before ``[DONE]``;
- **hung**: no answer within ``hang_s`` (must be 0);
- **truncated**: anything else: a 200 whose text differs from the undisturbed run's (a token missing
  or twice), a stream without its finish or ``[DONE]`` (must be 0).

``Chaos`` picks a random node every ``interval`` (jittered) and kills it (SIGKILL, then starts it again
with the same command line at once, as a supervisor would), freezes it (SIGSTOP, SIGCONT after 1.5-3 s)
restarts it (SIGTERM, then starts it again) or, for targets with a ``link`` (hosts in network namespaces,
``tests/chaos/netns.py``), cuts its link (down for 2.5-3 s, then up); for each action it records the
seconds until the cluster serves with every node again (``healthy()``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

ACTIONS = ("kill", "freeze", "restart")
LINK_CUT = "cut"  # for targets with a link
FREEZE_S = (1.5, 3.0)
#: a cut outlasts the router's probe deadline (mlxcel.disagg.wire.PROBE_TIMEOUT_S, 2 s; probes every 0.3 s in the
#: chaos cluster), so the cluster must count the node out, resume its streams elsewhere and take it back
CUT_S = (2.5, 3.0)


@dataclass
class Counts:
    started: int = 0
    completed: int = 0
    failed_clean: int = 0
    hung: int = 0
    truncated: int = 0
    resumed: int = 0  # from the server's /metrics (mlxcel_resumed_requests_total) after the run
    failovers: int = 0  # router only (/metrics router_failovers): attempts sent again before their first token
    held: int = 0  # coordinator only (/metrics mlxcel_requests_held_total): new requests that waited for a stage
    problems: list[str] = field(default_factory=list)  # what each truncated/hung request looked like
    events: list[dict] = field(default_factory=list)  # chaos actions: node, action, seconds to serving again

    def summary(self) -> dict:
        out = asdict(self)
        out["completed_pct"] = round(100.0 * self.completed / max(self.started, 1), 2)
        healed = [e["to_serving_s"] for e in self.events if e.get("to_serving_s") is not None]
        out["to_serving_s_max"] = max(healed) if healed else None
        out["to_serving_s_mean"] = round(sum(healed) / len(healed), 2) if healed else None
        return out


class Load:
    """``streams`` client threads sending ``prompts`` in turn until ``stop()``."""

    def __init__(self, url: str, prompts: list[list[int]], expected: list[str], *, max_tokens: int,
                 streams: int = 4, hang_s: float = 90.0, pause_s: float = 0.2):
        self.url, self.prompts, self.expected = url, prompts, expected
        self.pause_s = pause_s  # between two requests of one stream: bounded load
        self.max_tokens, self.streams, self.hang_s = max_tokens, streams, hang_s
        self.counts = Counts()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(streams)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 120.0) -> Counts:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            self.counts.hung += sum(t.is_alive() for t in self._threads)
        return self.counts

    def _worker(self, index: int) -> None:
        n = index
        while not self._stop.is_set():
            k = n % len(self.prompts)
            n += 1
            with self._lock:
                self.counts.started += 1
            outcome, detail = self._one(self.prompts[k], self.expected[k], stream=index % 2 == 0)
            with self._lock:
                setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
                if outcome in ("hung", "truncated"):
                    self.counts.problems.append(detail)
            time.sleep(self.pause_s if outcome != "failed_clean" else 1.0)  # a client backs off after a 503

    def _one(self, prompt: list[int], expected: str, *, stream: bool) -> tuple[str, str]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        timeout = httpx.Timeout(self.hang_s, connect=10.0)
        try:
            if stream:
                return self._streamed(body, expected, timeout)
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            return "hung", f"no answer within {self.hang_s}s ({type(exc).__name__})"
        except httpx.TransportError as exc:
            return "truncated", f"the connection broke: {exc!r}"
        if r.status_code != 200:
            return _error(r.status_code, r.headers, r.text)
        doc = r.json()
        choice = doc["choices"][0]
        if (choice["finish_reason"], choice["text"], doc["usage"]["completion_tokens"]) == (
                "length", expected, self.max_tokens):
            return "completed", ""
        return "truncated", f"200 with {choice['finish_reason']!r}, {doc['usage']['completion_tokens']} tokens, " \
                            f"text {choice['text']!r} (expected {expected!r})"

    def _streamed(self, body: dict, expected: str, timeout: httpx.Timeout) -> tuple[str, str]:
        text, reasons, done = "", [], False
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return _error(r.status_code, r.headers, r.text)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "failed_clean", ""
                choice = chunk["choices"][0]
                text += choice.get("text") or ""
                if choice.get("finish_reason"):
                    reasons.append(choice["finish_reason"])
        if done and reasons == ["length"] and text == expected:
            return "completed", ""
        return "truncated", f"stream: done={done} reasons={reasons} text {text!r} (expected {expected!r})"


def _error(status: int, headers: httpx.Headers, text: str) -> tuple[str, str]:
    """A clean error: the OpenAI error body, and Retry-After on a 503."""
    try:
        clean = "error" in json.loads(text) and (status != 503 or "retry-after" in headers)
    except ValueError:
        clean = False
    return ("failed_clean", "") if clean else ("truncated", f"HTTP {status} without a clean error body: {text[:200]}")


@dataclass
class Target:
    """One node the chaos may break: its pid now, how to start it again, its name."""

    name: str
    pid: Callable[[], int]
    start: Callable[[], None]  # the same command line again; returns once it listens
    stop: Callable[[int], None]  # send a signal and wait for the exit
    link: Callable[[bool], None] | None = None  # take its network link down (False) or up (True)


class Chaos:
    """Every ``interval`` (+-50%) seconds, one action on one random target, for ``duration`` seconds and at
    least one round of ``actions``; the actions come in rounds of all of them in a random order (so a short
    run still does each). Each action waits until the cluster is whole again."""

    def __init__(self, targets: list[Target], healthy: Callable[[], bool], counts: Counts, *,
                 duration: float = 60.0, interval: float = 5.0, actions: tuple[str, ...] = ACTIONS, seed: int = 25):
        if LINK_CUT in actions and not all(t.link for t in targets):
            raise ValueError("link cuts need a link on every target")
        self.targets, self.healthy, self.counts = targets, healthy, counts
        self.duration, self.interval, self.actions = duration, interval, actions
        self.rng = random.Random(seed)

    def run(self) -> None:
        end = time.monotonic() + self.duration
        actions: list[str] = []
        while time.monotonic() < end or len(self.counts.events) < len(self.actions):
            time.sleep(self.interval * self.rng.uniform(0.5, 1.5))
            actions = actions or self.rng.sample(self.actions, len(self.actions))
            target, action = self.rng.choice(self.targets), actions.pop(0)
            event = {"node": target.name, "action": action, "at_s": round(time.monotonic() - end + self.duration, 1)}
            self.counts.events.append({**event, **getattr(self, f"_{action}")(target)})

    def _kill(self, target: Target) -> dict:
        t0 = time.monotonic()
        target.stop(signal.SIGKILL)
        return {**self._start(target), "to_serving_s": self._until_healthy(t0)}

    def _restart(self, target: Target) -> dict:
        t0 = time.monotonic()
        target.stop(signal.SIGTERM)
        return {**self._start(target), "to_serving_s": self._until_healthy(t0)}

    @staticmethod
    def _start(target: Target, tries: int = 3) -> dict:
        """Start it again, as a supervisor would: up to ``tries`` times (a loaded box can outlast one wait)."""
        for attempt in range(1, tries + 1):
            try:
                target.start()
                return {"starts": attempt}
            except RuntimeError:
                if attempt == tries:
                    raise
        return {}

    def _freeze(self, target: Target) -> dict:
        pid = target.pid()
        return self._outage(lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT), "frozen_s",
                            FREEZE_S)

    def _cut(self, target: Target) -> dict:
        assert target.link is not None
        link = target.link
        return self._outage(lambda: link(False), lambda: link(True), "cut_s", CUT_S)

    def _outage(self, begin: Callable[[], None], end: Callable[[], None], name: str,
                span: tuple[float, float]) -> dict:
        """``begin()``, ``span`` seconds (drawn), ``end()`` (also on failure): the outage's length as ``name``,
        whether the cluster counted the node out (``seen_down``: not ``healthy()`` at the outage's end or at
        the first look after it), then the heal time."""
        seconds = self.rng.uniform(*span)
        t0 = time.monotonic()
        begin()
        try:
            time.sleep(seconds)
            seen_down = not self.healthy()
        finally:
            end()
        seen_down = seen_down or not self.healthy()
        return {name: round(seconds, 2), "seen_down": seen_down, "to_serving_s": self._until_healthy(t0)}

    def _until_healthy(self, t0: float, timeout: float = 240.0) -> float | None:
        """Seconds from ``t0`` until ``healthy()``; None if it is not within ``timeout`` from now."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return round(time.monotonic() - t0, 2)
            time.sleep(0.1)
        return None
