"""The CLI: one clear line on stderr and a non-zero exit for bad input; stats after generation.

The happy paths and one refusal run ``python -m mlxcel`` as a process of its own (the entry point's exit
status and streams); the other refusals run the same ``mlxcel.cli.main`` in this process
(``tests/cli_in_process.py``), without a fresh interpreter's imports each.
"""

import json
import shutil
import subprocess
import sys

import pytest

from tests.cli_in_process import run_mlxcel

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)


def mlxcel(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "mlxcel", *args], capture_output=True, text=True,
                          input=stdin, timeout=120)


def assert_one_line_error(result, fragment):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert any(fragment in line for line in lines), result.stderr
    assert result.stdout == ""


def test_generate_streams_text_then_stats(tiny_llama):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "hello", "-n", "4")
    assert result.returncode == 0, result.stderr
    assert "weights: float32" in result.stderr
    assert "decode: 4 tokens" in result.stderr
    assert "prompt:" in result.stderr and "peak memory:" in result.stderr


def test_raw_prompt_from_stdin(tiny_llama):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "-", "--raw", "-n", "2", stdin="abc")
    assert result.returncode == 0, result.stderr
    assert "prompt: 3 tokens" in result.stderr


def test_missing_model_dir(tmp_path):
    assert_one_line_error(mlxcel("generate", "-m", str(tmp_path / "nope"), "-p", "hi"), "no such model directory")


def test_not_a_checkpoint(tmp_path):
    assert_one_line_error(run_mlxcel("generate", "-m", str(tmp_path), "-p", "hi"), "not a checkpoint (no config.json)")


def test_unknown_architecture(tmp_path, tiny_llama):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "transmogrifier"
    (bad / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_mlxcel("generate", "-m", str(bad), "-p", "hi"), "unknown architecture 'transmogrifier'")


def test_empty_prompt(tiny_llama):
    assert_one_line_error(run_mlxcel("generate", "-m", str(tiny_llama), "-p", "  "), "prompt must not be empty")


@pytest.mark.parametrize("n", ["0", "-3", "many"])
def test_bad_token_count(tiny_llama, n):
    assert_one_line_error(run_mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "-n", n), "--max-tokens")


def test_bad_temperature(tiny_llama):
    assert_one_line_error(run_mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "--temp", "9"), "temperature")


def test_models_info_shows_identity(tiny_llama):
    from mlxcel.models.identity import model_identity

    result = run_mlxcel("models", "info", str(tiny_llama))
    assert result.returncode == 0, result.stderr
    assert f"identity:    {model_identity(tiny_llama)}" in result.stdout
    assert "layers:      4" in result.stdout
