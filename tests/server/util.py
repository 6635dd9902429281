"""Helpers for server tests: a real server subprocess, SSE and /metrics parsing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
CLI = [sys.executable, "-m", "mlxcel"]
_URL = re.compile(r"serving \S+ on (http://[\d.]+:\d+)")


class ServerProcess:
    """One ``mlxcel serve`` subprocess; ``url`` once it listens, stderr kept in ``lines``."""

    def __init__(self, model: Path, *flags: str, env: dict | None = None):
        cmd = [*CLI, "serve", "-m", str(model), "--port", "0",
               "--served-model-name", MODEL, "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._listening.wait(60):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _URL.search(line)
            if m:
                self.url = m.group(1)
                self._listening.set()
        self._listening.set()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not ready:\n" + "".join(self.lines))

    def stop(self) -> int:
        return stop_process(self.proc)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    """Send ``sig`` (SIGINT: a clean shutdown), wait 15 s, then kill; the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v",...}': value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body into JSON payloads, with the literal '[DONE]' kept as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat_body(content: str = "hello", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def chat_reference(model_dir, messages: list[dict], n: int) -> str:
    """Single-device greedy chat reply (stops at EOS, at most ``n`` tokens) from the engine core, in this process:
    what a single-node server answers, without starting one."""
    return chat_reference_reply(model_dir, messages, n)[0]


def chat_reference_reply(model_dir, messages: list[dict], n: int) -> tuple[str, str]:
    """``chat_reference``'s text and its finish reason ("stop" at EOS, else "length")."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.prompts import encode_chat
    from mlxcel.engine.sampling import SamplingParams, make_sampler
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir)
    model, eos, detok = loaded.model, set(loaded.tokenizer.eos_token_ids), loaded.tokenizer.detokenizer
    prompt = encode_chat(loaded.tokenizer, messages)
    reason = "length"
    for t, _ in generate_tokens(lambda x, c: model(x, cache=c), prompt, make_cache(model),
                                make_sampler(SamplingParams()), n):
        if t in eos:
            reason = "stop"
            break
        detok.add_token(t)
    detok.finalize()
    return detok.text, reason
