"""``mlxcel generate --tp-size N`` over the ring backend on loopback: the same greedy text as one device."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_in_process import run_mlxcel

CLI = [sys.executable, "-m", "mlxcel"]
PROMPT = "The quick brown fox"

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]


def generate(model, *flags: str, n: int = 16) -> subprocess.CompletedProcess:
    """``mlxcel generate``: a process of its own with ``--tp-size`` (rank 0, which starts its followers), else
    in this process (one device's reference text, without a fresh interpreter's imports)."""
    argv = ["generate", "-m", str(model), "-p", PROMPT, "-n", str(n), "--temp", "0", *flags]
    if "--tp-size" in flags:
        out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=150)
    else:
        out = run_mlxcel(*argv)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("fixture,size", [("tiny_6_3", 3), ("tiny_llama", 2), ("tiny_qwen3", 2)])
def test_greedy_text_equals_one_device(request, fixture, size):
    model = request.getfixturevalue(fixture)
    single = generate(model)
    sharded = generate(model, "--tp-size", str(size))
    assert sharded.stdout == single.stdout and len(single.stdout) > 1
    assert f"over {size} ranks" in sharded.stderr and "ring backend" in sharded.stderr


def test_default_model_at_tp_3(default_model):
    single = generate(default_model, n=8)
    assert generate(default_model, "--tp-size", "3", n=8).stdout == single.stdout
