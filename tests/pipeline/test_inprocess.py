"""In-process pipeline parallelism through the real CLI (``mlxcel.cli.main`` in the test's process): the same
greedy output as one device.

``mlxcel generate --pp-size N`` / ``--pp-layers`` chain N model slices in one process; the text it
prints must be byte-identical to the whole model's, for tiny llama and qwen3 checkpoints and the
default model, with automatic and explicit splits.
"""

from __future__ import annotations

import pytest

from tests.cli_in_process import run_mlxcel as mlxcel
from tests.commands.test_cli import assert_one_line_error


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


# --pp-micro-batch-size: the prompt in chunks, software-pipelined through the stages (docs/pipeline.md §2.5)

LONG_PROMPT = "hello there, a longer prompt for the chunks to split into many pieces"


@pytest.fixture(scope="module")
def varied_llama(tmp_path_factory):
    """A random llama whose greedy text varies (seed 0 repeats one token, which would prove little)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("varied-llama"), family="llama", layers=4, seed=1)


def prompted(model, *flags: str) -> str:
    result = mlxcel("generate", "-m", str(model), "-p", LONG_PROMPT, "--raw", "-n", "12", *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("flags", [
    ("--pp-size", "2", "--pp-micro-batch-size", "4"),
    ("--pp-layers", "0-0,1-3", "--pp-micro-batch-size", "3"),  # no --pp-size: the ranges name 2 stages
    ("--pp-size", "4", "--pp-micro-batch-size", "64"),  # more chunks than prompt tokens: one token each
])
def test_micro_batched_prefill_equals_single_device(varied_llama, flags):
    single = prompted(varied_llama)
    assert len(set(single)) > 3  # not one repeated character
    assert prompted(varied_llama, *flags) == single


def test_micro_batches_are_reported(tiny_llama):
    result = mlxcel("generate", "-m", str(tiny_llama), "-p", "hi", "-n", "2", "--pp-size", "2",
                    "--pp-micro-batch-size", "4")
    assert "pipeline: stage 0 layers 0-1, stage 1 layers 2-3 (in process, prompt in 4 micro-batches)" in result.stderr


@pytest.mark.parametrize("flags", [
    ("--pp-size", "2", "--pp-micro-batch-size", "4"),
    ("--pp-layers", "0-15,16-31", "--pp-micro-batch-size", "4"),
])
def test_the_references_commands_run_as_written(tmp_path_factory, flags):
    """docs of the reference, "In-process CLI path", on a 32-layer checkpoint (-n shortened from 100)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = make_random_checkpoint(tmp_path_factory.mktemp("llama-32"), family="llama", layers=32, seed=1)
    one = mlxcel("generate", "-m", str(model), "-p", "Hello", "-n", "8")
    piped = mlxcel("generate", "-m", str(model), *flags, "-p", "Hello", "-n", "8")
    assert one.returncode == piped.returncode == 0, piped.stderr
    assert piped.stdout == one.stdout
    assert "stage 0 layers 0-15, stage 1 layers 16-31" in piped.stderr


@pytest.mark.slow
def test_default_model_micro_batched_prefill(default_model):
    prompt = "Name the capital of France, then explain in one sentence why it is the capital."
    one = mlxcel("generate", "-m", str(default_model), "-p", prompt, "-n", "8")
    two = mlxcel("generate", "-m", str(default_model), "-p", prompt, "-n", "8", "--pp-size", "2",
                 "--pp-micro-batch-size", "4")
    assert one.returncode == two.returncode == 0, two.stderr
    assert two.stdout == one.stdout
