"""In-process pipeline parallelism through the real CLI: the same greedy output as one device.

``mlxcel generate --pp-size N`` / ``--pp-layers`` chain N model slices in one process; the text it
prints must be byte-identical to the whole model's, for tiny llama and qwen3 checkpoints and the
default model, with automatic and explicit splits.
"""

from __future__ import annotations

import pytest

from tests.engine.test_cli import assert_one_line_error, mlxcel


_single: dict[str, str] = {}


def generated(model, *flags: str, n: int = 24) -> str:
    result = mlxcel("generate", "-m", str(model), "-p", "hello there", "--raw", "-n", str(n), *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


def single_device(model) -> str:
    if str(model) not in _single:
        _single[str(model)] = generated(model)
    return _single[str(model)]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("flags", [("--pp-size", "2"), ("--pp-size", "4"), ("--pp-size", "3", "--pp-layers", "0-0,1-2,3-3")])
def test_inprocess_pipeline_equals_single_device(request, family, flags):
    model = request.getfixturevalue(family)
    assert generated(model, *flags) == single_device(model)


def test_pipeline_split_is_reported(tiny_llama):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "-n", "2", "--pp-size", "2")
    assert "pipeline: stage 0 layers 0-1, stage 1 layers 2-3 (in process)" in result.stderr


def test_ranges_are_checked_against_the_model(tiny_llama):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "--pp-size", "2", "--pp-layers", "0-1,2-9")
    assert_one_line_error(result, "the model has only 4 layers")


def test_secret_source_errors_are_one_line(tiny_llama, tmp_path):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "--pp-size", "2",
                    "--cluster-secret-file", str(tmp_path / "missing"))
    assert_one_line_error(result, "cannot read the cluster secret file")


@pytest.mark.slow
def test_default_model_two_stages_in_process(default_model):
    one = mlxcel("generate", "-m", str(default_model), "-p", "What is the capital of France?", "-n", "12")
    two = mlxcel("generate", "-m", str(default_model), "-p", "What is the capital of France?", "-n", "12",
                 "--pp-size", "2")
    assert one.returncode == two.returncode == 0
    assert two.stdout == one.stdout
    assert "Paris" in one.stdout
