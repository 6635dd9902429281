"""mlxcel plan --layers: given ranges checked against the checkpoint (the Ansible preflight relies on it)."""

from __future__ import annotations

import json

import pytest

from mlxcel.cli import main
from mlxcel.topology.partition import PartitionError, parse_layer_ranges
from tests.pipeline.test_partition import make_checkpoint


def plan(capsys, ckpt, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", "-m", str(ckpt), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_given_layers_are_priced_in_the_contract_shape(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "tiny", [100] * 4, embed=150, norm=10, head=140)
    code, out, err = plan(capsys, ckpt, "--pp-size", "2", "--layers", "0-2,3", "--json")
    assert code == 0, err
    assert json.loads(out)["stages"] == [
        {"stage": 0, "layers": "0-2", "start": 0, "end": 3, "bytes": 450},
        {"stage": 1, "layers": "3-3", "start": 3, "end": 4, "bytes": 250},
    ]


@pytest.mark.parametrize("layers", ["0-2,3", "0-2,3-3", "0 - 2, 3", "0-1,2-4", "0-2,", "1-3,3", "0-2,3-", "0-2,x", "0-3"])
def test_layers_accepted_exactly_when_the_engine_accepts_them(tmp_path, capsys, layers):
    ckpt = make_checkpoint(tmp_path / "tiny", [100] * 4)
    try:
        parse_layer_ranges(layers, 4)
        engine_error = None
    except PartitionError as exc:
        engine_error = str(exc)
    code, _, err = plan(capsys, ckpt, "--pp-size", "2", "--layers", layers, "--json")
    if engine_error is None and len(layers.split(",")) == 2:
        assert code == 0, err
    else:
        assert code == 1 and err.startswith("mlxcel: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,message", [
    (["--pp-size", "3", "--layers", "0-1,2-3"], "--layers names 2 stages but --pp-size is 3"),
    (["--pp-size", "2", "--layers", "0-1,2-4"], "--layers: stage 1 ends at 4 but the model has only 4 layers"),
    (["--pp-size", "2", "--layers", "0-1,2-3", "--memory", "2KiB,1KiB"], "--layers: stage 1 (2-3) needs"),
])
def test_layer_errors_name_the_stage(tmp_path, capsys, argv, message):
    ckpt = make_checkpoint(tmp_path / "tiny", [100] * 4)
    code, out, err = plan(capsys, ckpt, *argv)
    assert code == 1 and out == "" and message in err, err
