"""``--mlx-cache-mb`` bounds MLX's cache of freed buffers once, at configuration; unset, MLX keeps its own bound."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.cli import build_parser
from mlxcel.commands.serve import serve_config


@pytest.fixture
def cache_limit():
    """MLX's cache limit before the test, restored after it; yields a reader of the current limit."""
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)

    def current() -> int:
        now = mx.set_cache_limit(before)
        mx.set_cache_limit(now)
        return now

    yield current
    mx.set_cache_limit(before)


def test_the_flag_sets_the_limit_in_mebibytes(tiny_llama, cache_limit):
    args = build_parser().parse_args(["serve", "-m", str(tiny_llama), "--mlx-cache-mb", "64", "--no-warmup"])
    serve_config(args)
    assert cache_limit() == 64 << 20


def test_without_the_flag_mlx_keeps_its_own_limit(tiny_llama, cache_limit):
    before = cache_limit()
    serve_config(build_parser().parse_args(["serve", "-m", str(tiny_llama), "--no-warmup"]))
    assert cache_limit() == before


def test_a_negative_size_is_a_usage_error(tiny_llama, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "-m", str(tiny_llama), "--mlx-cache-mb", "-1"])
    assert exc.value.code == 2 and "--mlx-cache-mb" in capsys.readouterr().err
