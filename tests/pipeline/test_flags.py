"""Pipeline flags on generate and the server: parsed and validated before any model loads."""

from __future__ import annotations

import pytest

from mlxcel.cli import build_parser, main, server_main
from mlxcel.commands.generate import check_pipeline_flags


def test_generate_pipeline_flags_parse(tmp_path):
    args = build_parser().parse_args(["generate", "-p", "hi", "--pp-size", "2", "--pp-layers", "0-1,2-3",
                                      "--cluster-secret-file", "s.secret"])
    check_pipeline_flags(args)
    assert (args.pp_size, args.pp_layers, args.cluster_secret_file) == (2, "0-1,2-3", "s.secret")
    plain = build_parser().parse_args(["generate", "-p", "hi"])
    check_pipeline_flags(plain)
    assert (plain.pp_size, plain.pp_layers, plain.cluster_secret_file, plain.pp_micro_batch_size) == (1, None, None, 1)
    assert "--pp-micro-batch-size M" in build_parser()._subparsers._group_actions[0].choices["generate"].format_help()


@pytest.mark.parametrize("argv,stages,micro", [
    (["--pp-layers", "0-15,16-31"], 2, 1),  # the reference's command: the ranges name the stage count
    (["--pp-layers", "0-15,16-31", "--pp-micro-batch-size", "4"], 2, 4),
    (["--pp-size", "2", "--pp-micro-batch-size", "4"], 2, 4),
    (["--pp-size", "3", "--pp-layers", "0-0,1-2,3-3"], 3, 1),
    (["--pp-micro-batch-size", "64"], 1, 64),  # accepted without a pipeline, as the reference does; no effect
])
def test_generate_pipeline_flags_fill_in_defaults(argv, stages, micro):
    args = build_parser().parse_args(["generate", "-p", "hi", *argv])
    check_pipeline_flags(args)
    assert (args.pp_size, args.pp_micro_batch_size) == (stages, micro)


def test_micro_batch_bound_is_the_protocols():
    from mlxcel.config import MAX_PP_MICRO_BATCH_SIZE
    from mlxcel.pipeline.protocol import MAX_MICRO_BATCHES

    assert MAX_PP_MICRO_BATCH_SIZE == MAX_MICRO_BATCHES


@pytest.mark.parametrize("argv,message", [
    (["--pp-size", "1", "--pp-layers", "0-1,2-3"], "--pp-layers names 2 stages but --pp-size is 1"),
    (["--pp-size", "3", "--pp-layers", "0-1,2-3"], "--pp-layers names 2 stages but --pp-size is 3"),
    (["--pp-size", "2", "--pp-layers", "0-1,3-5"], "--pp-layers: stage 1 starts at 3 but stage 0 ended at 1 "
                                                   "(ranges must be contiguous)"),
    (["--pp-size", "2", "--pp-layers", "0-1,x"], "--pp-layers: stage 1: 'x' is not a layer range"),
    (["--pp-size", "2", "--pp-micro-batch-size", "0"], "--pp-micro-batch-size must be greater than 0"),
    (["--pp-size", "2", "--pp-micro-batch-size", "-3"], "--pp-micro-batch-size must be greater than 0"),
    (["--pp-layers", "0-1,2-3", "--pp-micro-batch-size", "65"], "--pp-micro-batch-size must be at most 64, got 65"),
])
def test_generate_flag_errors_come_before_loading(tmp_path, capsys, argv, message):
    code = main(["generate", "-m", str(tmp_path / "absent"), "-p", "hi", *argv])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"mlxcel: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--pp-size", "0"], ["--pp-size", "two"], ["--pp-micro-batch-size", "four"]])
def test_generate_numeric_flags_are_positive_integers(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["generate", "-p", "hi", *argv])
    assert info.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["serve", "mlxcel-server"])
@pytest.mark.parametrize("argv,message", [
    (["--node-id", "stage-0"], "--node-id needs --distributed-config (the cluster TOML that defines the node)"),
    (["--distributed-config", "c.toml"], "--distributed-config needs --node-id (which node of the cluster this "
                                         "process is)"),
    (["--distributed-config", "c.toml", "--node-id", " "], "--node-id must not be empty"),
    (["--pp-micro-batch-size", "2"], "--pp-micro-batch-size needs --distributed-config"),
])
def test_server_cluster_flag_errors(tmp_path, capsys, entry, argv, message):
    argv = ["-m", str(tmp_path / "absent"), "--port", "0", *argv]
    code = main(["serve", *argv]) if entry == "serve" else server_main(argv)
    err = capsys.readouterr().err
    assert code == 1 and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mlxcel: error: ")


def test_server_cluster_flags_parse():
    args = build_parser().parse_args(["serve", "--distributed-config", "c.toml", "--node-id", "coordinator",
                                      "--cluster-secret-file", "s", "--pp-micro-batch-size", "4"])
    from mlxcel.commands.serve import check_cluster_flags

    flags = check_cluster_flags(args).cluster
    assert (flags.distributed_config, flags.node_id, flags.cluster_secret_file, flags.pp_micro_batch_size) == (
        "c.toml", "coordinator", "s", 4)
