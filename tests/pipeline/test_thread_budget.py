"""The thread budget (--threads, MLXCEL_THREADS) and OpenBLAS's idle timeout: set before the library loads,
applied at run time, bad values refused with a message that names the flag or variable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxcel import config
from mlxcel.blas import apply_thread_budget, blas_in_use, blas_threads, set_blas_threads
from mlxcel.cli import build_parser, server_main
from mlxcel.threads import blas_environment, env_budget

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

needs_openblas = pytest.mark.skipif(not blas_in_use().startswith("openblas"),
                                    reason="needs the preloaded OpenBLAS (scripts/setup.sh)")


def test_the_idle_timeout_is_short_unless_the_environment_sets_one():
    assert blas_environment({}) == {"OPENBLAS_THREAD_TIMEOUT": str(config.BLAS_THREAD_TIMEOUT_LOG2)}
    assert blas_environment({"OPENBLAS_THREAD_TIMEOUT": "28"}) == {}
    assert blas_environment({"GOTO_THREAD_TIMEOUT": "26"}) == {}


def test_mlxcel_threads_becomes_openblas_num_threads_before_the_load():
    env = {"OPENBLAS_THREAD_TIMEOUT": "20", "OPENBLAS_NUM_THREADS": "8"}
    assert blas_environment({**env, "MLXCEL_THREADS": "3"}) == {"OPENBLAS_NUM_THREADS": "3"}
    assert blas_environment({**env, "MLXCEL_THREADS": " "}) == {}  # unset: OpenBLAS's own choice stands
    assert blas_environment({**env, "MLXCEL_THREADS": "lots"}) == {}  # left for the server to refuse


@pytest.mark.parametrize("value,message", [
    ("0", "MLXCEL_THREADS: must be a positive integer, got 0"),
    ("two", "MLXCEL_THREADS: expected a positive integer, got 'two'"),
    (str(config.MAX_THREADS + 1), f"MLXCEL_THREADS: must be at most {config.MAX_THREADS}"),
])
def test_a_bad_mlxcel_threads_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        env_budget({"MLXCEL_THREADS": value})


@pytest.mark.parametrize("value", ["0", "-1", "x", str(config.MAX_THREADS + 1)])
def test_the_threads_flag_is_bounded(capsys, value):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--threads", value])
    assert info.value.code == 2 and "--threads" in capsys.readouterr().err


def test_the_server_refuses_a_bad_mlxcel_threads_before_listening(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("MLXCEL_THREADS", "many")
    code = server_main(["-m", str(tiny_llama), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err == "mlxcel: error: MLXCEL_THREADS: expected a positive integer, got 'many'\n"


@needs_openblas
def test_the_budget_reaches_openblas_at_run_time():
    before = blas_threads()
    try:
        assert set_blas_threads(1) == blas_threads() == 1
        assert apply_thread_budget(None, {}) == 1  # nothing asked: unchanged
        assert apply_thread_budget(None, {"MLXCEL_THREADS": "2"}) == 2
        assert apply_thread_budget(1, {"MLXCEL_THREADS": "2"}) == 1  # the flag wins
        with pytest.raises(ValueError, match="1 to"):
            set_blas_threads(0)
    finally:
        set_blas_threads(before)


@needs_openblas
def test_mlxcel_threads_sets_the_count_openblas_starts_with():
    code = ("import os, mlxcel; from mlxcel.blas import blas_threads; "
            "print(blas_threads(), os.environ['OPENBLAS_THREAD_TIMEOUT'])")
    env = {"MLXCEL_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", str(config.BLAS_THREAD_TIMEOUT_LOG2)]
