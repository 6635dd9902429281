"""bench/profile_summary.py reads py-spy's raw format (plain or gzipped) and attributes one thread's samples."""

from __future__ import annotations

import gzip

import pytest

from bench.profile_summary import main, summarise

RAW = """thread (7): mlxcel-scheduler;run (s.py:1);submit (e.py:2);async_eval (libmlx.so) 6
thread (7): mlxcel-scheduler;run (s.py:1);release (r.py:3);mlx::core::Event::wait (libmlx.so) 3
thread (7): mlxcel-scheduler;run (s.py:1) 1
thread (1): MainThread;serve (u.py:9) 5
"""


def test_shares_are_of_the_chosen_threads_samples(tmp_path):
    path = tmp_path / "prof.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write(RAW)
    got = summarise(path, "scheduler", 10, ("Event::wait",))
    assert got["samples"] == 10 and got["threads"]["thread (1): MainThread"] == 5
    inclusive = {frame: pct for pct, frame in got["inclusive_pct"]}
    assert inclusive["run (s.py:1)"] == 100.0 and inclusive["submit (e.py:2)"] == 60.0
    assert dict((f, p) for p, f in got["self_pct"])["async_eval (libmlx.so)"] == 60.0
    assert got["device_wait_pct"] == [(30.0, "run:1 <- release:3")]


def test_a_missing_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "none.txt")])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err
