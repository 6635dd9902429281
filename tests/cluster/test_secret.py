"""Secret sources, precedence, validation, and that the value never leaks."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import tomllib
from pathlib import Path

import pytest

from mlxcel.cluster.errors import SecretError
from mlxcel.cluster.secret import TOML_FIELD, ClusterSecret, load_secret, secret_file_of

VALUE = "0123456789abcdef0123456789abcdef"


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _toml_secret_file(tmp_path: Path, body: str) -> Path | None:
    """What the cluster config loader hands load_secret: secret_file_of over the parsed [cluster] table."""
    p = tmp_path / "cluster" / "cluster.toml"
    p.parent.mkdir(exist_ok=True)
    p.write_text(body)
    return secret_file_of(tomllib.loads(p.read_text())["cluster"], p)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {name: _write(tmp_path / f"{name}.secret", f"{name}-{VALUE}\n") for name in ("cli", "envfile", "toml")}


def test_precedence_cli_first(files, tmp_path):
    toml = _toml_secret_file(tmp_path, f'[cluster]\nsecret_file = "{files["toml"]}"\n')
    env = {"MLXCEL_CLUSTER_SECRET_FILE": str(files["envfile"])}
    s = load_secret(files["cli"], env=env, toml_secret_file=toml)
    assert s.reveal() == f"cli-{VALUE}".encode() and s.source == "--cluster-secret-file"
    assert s.path == files["cli"].resolve()


def test_precedence_env_file_then_env_value_then_toml(files, tmp_path):
    toml = _toml_secret_file(tmp_path, f'[cluster]\nsecret_file = "{files["toml"]}"\n')
    assert load_secret(env={"MLXCEL_CLUSTER_SECRET_FILE": str(files["envfile"])}, toml_secret_file=toml).reveal() == f"envfile-{VALUE}".encode()
    s = load_secret(env={"MLXCEL_CLUSTER_SECRET": "v-" + VALUE}, toml_secret_file=toml)
    assert s.reveal() == ("v-" + VALUE).encode() and s.path is None and s.source == "MLXCEL_CLUSTER_SECRET"
    s = load_secret(env={}, toml_secret_file=toml)
    assert s.reveal() == f"toml-{VALUE}".encode() and s.source == TOML_FIELD


def test_both_environment_variables_is_an_error(files):
    env = {"MLXCEL_CLUSTER_SECRET_FILE": str(files["envfile"]), "MLXCEL_CLUSTER_SECRET": VALUE}
    with pytest.raises(SecretError, match="both MLXCEL_CLUSTER_SECRET_FILE and MLXCEL_CLUSTER_SECRET are set"):
        load_secret(env=env)
    with pytest.raises(SecretError):
        load_secret(files["cli"], env=env)


def test_toml_relative_path_resolves_against_the_toml_directory(tmp_path):
    secret_file = _toml_secret_file(tmp_path, '[cluster]\nsecret_file = "keys/cluster.secret"\n')
    toml_dir = tmp_path / "cluster"
    (toml_dir / "keys").mkdir()
    _write(toml_dir / "keys" / "cluster.secret", VALUE + "\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a cwd-relative lookup would miss it
    try:
        s = load_secret(env={}, toml_secret_file=secret_file)
    finally:
        os.chdir(cwd)
    assert s.reveal() == VALUE.encode() and s.path == (toml_dir / "keys" / "cluster.secret").resolve()


def test_toml_must_not_carry_the_value(tmp_path):
    with pytest.raises(SecretError, match="never goes into the TOML") as info:
        _toml_secret_file(tmp_path, f'[cluster]\nsecret = "{VALUE}"\n')
    assert VALUE not in str(info.value)


def test_trims_exactly_one_trailing_newline(tmp_path):
    assert load_secret(_write(tmp_path / "a", VALUE + "\n"), env={}).reveal() == VALUE.encode()
    assert load_secret(_write(tmp_path / "b", VALUE + "\n\n"), env={}).reveal() == (VALUE + "\n").encode()
    assert load_secret(_write(tmp_path / "c", VALUE), env={}).reveal() == VALUE.encode()


def test_minimum_length_after_trimming(tmp_path):
    ok = "x" * 16
    assert load_secret(_write(tmp_path / "ok", ok + "\n"), env={}).reveal() == ok.encode()
    with pytest.raises(SecretError, match="at least 16 bytes after trimming one trailing newline") as info:
        load_secret(_write(tmp_path / "short", "y" * 15 + "\n"), env={})
    assert "yyyy" not in str(info.value)
    with pytest.raises(SecretError, match="at least 16 bytes"):
        load_secret(env={"MLXCEL_CLUSTER_SECRET": "z" * 10})


def test_missing_secret_names_every_source():
    with pytest.raises(SecretError) as info:
        load_secret(env={})
    text = str(info.value)
    for source in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE", "MLXCEL_CLUSTER_SECRET=", "secret_file", "[cluster]", "cluster TOML"):
        assert source in text
    assert load_secret(env={}, required=False) is None


def test_unreadable_file(tmp_path):
    with pytest.raises(SecretError, match="cannot read the cluster secret file .* \\(from --cluster-secret-file\\)"):
        load_secret(tmp_path / "absent", env={})


def test_warns_when_group_or_world_readable(tmp_path, caplog):
    for mode in (0o640, 0o604):
        caplog.clear()
        path = _write(tmp_path / f"s{mode:o}", VALUE + "\n", mode)
        with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
            load_secret(path, env={})
        assert any("group- or world-readable" in r.getMessage() for r in caplog.records)
        assert all(VALUE not in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        load_secret(_write(tmp_path / "private", VALUE + "\n", 0o600), env={})
    assert not caplog.records


def test_repr_str_format_never_show_the_value():
    s = ClusterSecret(VALUE.encode(), source="test")
    for text in (repr(s), str(s), f"{s}", f"{s!r}", "%s" % s, repr([s]), repr({"k": s})):
        assert VALUE not in text and "<redacted>" in text


def test_cannot_be_pickled_and_copies_are_the_same_object():
    s = ClusterSecret(VALUE.encode())
    with pytest.raises(TypeError):
        pickle.dumps(s)
    assert copy.copy(s) is s and copy.deepcopy(s) is s


def test_equality_is_by_value_and_unhashable():
    assert ClusterSecret(VALUE.encode()) == ClusterSecret(VALUE.encode())
    assert ClusterSecret(VALUE.encode()) != ClusterSecret(b"other-value-0123456789")
    with pytest.raises(TypeError):
        hash(ClusterSecret(VALUE.encode()))
