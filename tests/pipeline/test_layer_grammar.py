"""One layer-range grammar (``partition.parse_range``): every surface accepts and refuses the same texts.

The surfaces: ``mlxcel generate --pp-layers`` (flag check, then the ranges the in-process pipeline
uses), the cluster TOML's ``[[nodes]] layers`` and ``mlxcel plan --layers``. Each gets the same
one-range text for a 4-layer model, so an accepted text must mean the same layers everywhere and a
refused one must be refused everywhere for the same reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.cli import build_parser, main
from mlxcel.commands.generate import check_pipeline_flags
from mlxcel.errors import CLIError
from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from mlxcel.pipeline.inprocess import stage_ranges
from mlxcel.topology.partition import PartitionError
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml
from tests.pipeline.test_partition import make_checkpoint

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

LAYERS = 4
ACCEPTED = ["0-3", " 0 - 3 ", "0 -3", "00-03", "0\t-\t3"]
REFUSED = {  # text -> the reason every surface gives
    "": "empty", "   ": "empty",
    "3-0": "reversed", "0-3-3": "not a layer range", "0--3": "not a layer range", "0-": "not a layer range",
    "-3": "not a layer range", "+0-3": "not a layer range", "0 3": "not a layer range", "0..3": "not a layer range",
    "0.0-3": "not a layer range", "0x0-3": "not a layer range", "a-b": "not a layer range",
    "0\u20103": "not a layer range",  # a Unicode hyphen
    "\u0660-\u0663": "not a layer range",  # Arabic-Indic digits: int() reads them, the grammar does not
}

TOML = """[cluster]
pipeline_parallel_size = 1
""" + COORDINATOR_AND_STAGE_0 + "layers = {layers}\n"


def via_flags(text: str) -> None:
    check_pipeline_flags(build_parser().parse_args(["generate", "-p", "hi", f"--pp-layers={text}"]))


def via_generate(text: str) -> tuple[int, int]:
    (only,) = stage_ranges(None, LAYERS, 1, text)
    return only


def via_toml(text: str, tmp_path: Path) -> tuple[int, int] | None:
    path = write_toml(tmp_path, TOML.format(layers=json.dumps(text)))  # a TOML basic string, escapes and all
    config = load_cluster_config(path)
    config.check_layers(LAYERS)
    return config.stages[0].layers


def via_plan(text: str, ckpt: Path, capsys) -> tuple[int, int]:
    code = main(["plan", "-m", str(ckpt), "--pp-size", "1", f"--layers={text}", "--json"])
    out, err = capsys.readouterr()
    if code != 0:
        raise CLIError(err.strip())
    (stage,) = json.loads(out)["stages"]
    return stage["start"], stage["end"]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "tiny", [100] * LAYERS)


@pytest.mark.parametrize("text", ACCEPTED)
def test_every_surface_accepts_the_same_text_as_the_same_layers(text, tmp_path, ckpt, capsys):
    via_flags(text)
    assert via_generate(text) == via_toml(text, tmp_path) == via_plan(text, ckpt, capsys) == (0, LAYERS)


@pytest.mark.parametrize("text, reason", sorted(REFUSED.items()))
def test_every_surface_refuses_the_same_text_for_the_same_reason(text, reason, tmp_path, ckpt, capsys):
    surfaces = {
        "--pp-layers flag": (lambda: via_flags(text), CLIError),
        "generate --pp-layers": (lambda: via_generate(text), PartitionError),
        "cluster TOML layers": (lambda: via_toml(text, tmp_path), ClusterConfigError),
        "plan --layers": (lambda: via_plan(text, ckpt, capsys), CLIError),
    }
    for name, (call, error) in surfaces.items():
        with pytest.raises(error) as info:
            call()
        message = str(info.value)
        assert reason in message and "\n" not in message, f"{name}: {message}"


def test_a_toml_range_that_is_not_a_string_is_refused(tmp_path):
    path = write_toml(tmp_path, TOML.format(layers="3"))
    with pytest.raises(ClusterConfigError, match=r"stage-0\): layers: 3 is not a layer range"):
        load_cluster_config(path)
