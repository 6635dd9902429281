"""Native Windows (the reference's first section): the distributed flags are refused at start-up, before the
model is resolved, each with an error naming the flag; the platform is patched in-process
(``mlxcel.commands.windows.native_windows``)."""

from __future__ import annotations

import pytest

from tests.commands.test_reference_rows import error_of



@pytest.fixture
def native_windows(monkeypatch):
    monkeypatch.setattr("mlxcel.commands.windows.native_windows", lambda: True)


WINDOWS_GENERATE = [(["--tp-size", "2"], "--tp-size"), (["--pp-layers", "0-1,2-3"], "--pp-layers"),
                    (["--pp-size", "2"], "--pp-size")]
WINDOWS_SERVER = [(["--tp-size", "2"], "--tp-size"), (["--pp-layers", "0-1,2-3"], "--pp-layers"),
                  (["--pp-auto", "2"], "--pp-auto"), (["--pp-peer"], "--pp-peer"),
                  (["--distributed-config", "c.toml"], "--distributed-config"),
                  (["--node-role", "prefill"], "--node-role"), (["--peers", "127.0.0.3:1"], "--peers"),
                  (["--prefill-peers", "127.0.0.3:1"], "--prefill-peers"),
                  (["--decode-peers", "127.0.0.3:1"], "--decode-peers"),
                  (["--serving-bind", "127.0.0.3:1"], "--serving-bind")]


def windows_message(flag: str) -> str:
    return (f"{flag} is not supported on native Windows: tensor parallelism, pipeline parallelism and disaggregated "
            "inference do not run there; use Linux, macOS or WSL2")


@pytest.mark.parametrize("argv,flag", WINDOWS_GENERATE)
def test_native_windows_refuses_generate_flags_before_the_model(tmp_path, capsys, native_windows, argv, flag):
    got = error_of(capsys, "generate", "-m", str(tmp_path / "absent"), "-p", "x", *argv)
    assert got == windows_message(flag)


@pytest.mark.parametrize("argv,flag", WINDOWS_SERVER)
def test_native_windows_refuses_server_flags_before_the_model(tmp_path, capsys, native_windows, argv, flag):
    got = error_of(capsys, "serve", "-m", str(tmp_path / "absent"), "--port", "0", *argv)
    assert got == windows_message(flag)


def test_native_windows_keeps_single_node_use(tmp_path, capsys, native_windows):
    """No distributed flag (or --tp-size 1, --pp-size 1, --node-role hybrid): the next check speaks."""
    for argv in (["generate", "-p", "x", "--tp-size", "1", "--pp-size", "1"],
                 ["serve", "--port", "0", "--node-role", "hybrid"]):
        got = error_of(capsys, argv[0], "-m", str(tmp_path / "absent"), *argv[1:])
        assert "Windows" not in got


def test_other_platforms_are_not_refused(tmp_path, capsys):
    got = error_of(capsys, "serve", "-m", str(tmp_path / "absent"), "--port", "0", "--pp-layers", "0-1,2-3")
    assert "Windows" not in got
