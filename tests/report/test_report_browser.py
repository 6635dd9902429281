"""The report in a real browser: Debian's headless Chromium, driven over the DevTools protocol.

Checks that the page's text shows the key numbers, that every image decodes (naturalWidth > 0),
that nothing logs an error to the console, and that a screenshot comes out. Skips only when no
Chromium binary can be found (scripts/setup.sh installs Debian's ``chromium`` where it can).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    explicit = os.environ.get("MLXCEL_CHROMIUM")
    if explicit:
        return explicit
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


BROWSER = find_browser()
pytestmark = [pytest.mark.skipif(
    BROWSER is None, reason="no Chromium found (apt-get install chromium, or set MLXCEL_CHROMIUM)"), pytest.mark.proc]


class DevTools:
    """A minimal Chrome DevTools protocol client over one page target's websocket."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=20, suppress_origin=True)
        self.events: list[dict[str, Any]] = []
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, event: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(event)
            self.events.append(json.loads(self.ws.recv()))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"]["value"]

    def close(self) -> None:
        self.ws.close()


@contextmanager
def chromium() -> Iterator[DevTools]:
    """Headless Chromium on a fresh profile and a free DevTools port; stopped by PID afterwards."""
    with tempfile.TemporaryDirectory(prefix="mlxcel-chromium-") as profile:
        proc = subprocess.Popen(
            [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--no-first-run",
             "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = None
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 20
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
                time.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            client = DevTools(page["webSocketDebuggerUrl"])
            yield client
        finally:
            if client:
                client.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _console_errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(str(p.get("args")))
        elif method == "Runtime.exceptionThrown":
            out.append(str(p.get("exceptionDetails")))
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(p["entry"].get("text", ""))
    return out


@pytest.mark.timeout(60)
def test_report_renders_in_headless_chromium(fixture_report: Path, tmp_path: Path):
    with chromium() as cdp:
        for domain in ("Page", "Runtime", "Log"):
            cdp.call(f"{domain}.enable")
        cdp.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
        cdp.call("Page.navigate", url=(fixture_report / "index.html").as_uri())
        cdp.wait_for("Page.loadEventFired")
        text = cdp.evaluate("document.body.innerText")
        images = cdp.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        title = cdp.evaluate("document.title")
        shot = cdp.call("Page.captureScreenshot", format="png")["data"]
        errors = _console_errors(cdp.events)

    assert title == "mlxcel benchmark report"
    for needle in ("Single-device decode: mlxcel vs mlx-lm", "14.03", "Cluster frame protection", "278.8 us",
                   "Pipeline", "12.9", "Serving", "133.2", "138.8", "Other hardware.", "1 regression"):
        assert needle in text, needle
    assert len(images) == 6
    assert all(done and w > 0 and h > 0 for done, w, h in images), images
    assert errors == []
    png = base64.b64decode(shot)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1280, 900)
    (tmp_path / "screenshot.png").write_bytes(png)


@pytest.mark.timeout(60)
def test_a_broken_image_is_caught(tmp_path: Path):
    """The check above can fail: a page with an image that does not decode reports naturalWidth 0 and a console error."""
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><title>x</title><img src="data:image/png;base64,AAAA"><img src="missing.png">')
    with chromium() as cdp:
        for domain in ("Page", "Runtime", "Log"):
            cdp.call(f"{domain}.enable")
        cdp.call("Page.navigate", url=page.as_uri())
        cdp.wait_for("Page.loadEventFired")
        widths = cdp.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
        time.sleep(0.2)
        cdp.evaluate("1")  # drain pending events
        errors = _console_errors(cdp.events)
    assert widths == [0, 0]
    assert errors  # the missing file is logged as an error
