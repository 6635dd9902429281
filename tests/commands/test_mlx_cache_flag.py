"""``--mlx-cache-mb`` bounds MLX's cache of freed buffers once, at configuration; unset, the default bound applies
unless MLX's own is lower."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.cli import build_parser
from mlxcel.commands.serve import serve_config
from mlxcel.config import DEFAULT_MLX_CACHE_MB


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


@pytest.mark.parametrize("own_mb", [64, 1 << 20])
def test_without_the_flag_the_default_applies_unless_mlx_s_own_bound_is_lower(tiny_llama, cache_limit, own_mb):
    mx.set_cache_limit(own_mb << 20)
    serve_config(build_parser().parse_args(["serve", "-m", str(tiny_llama), "--no-warmup"]))
    assert cache_limit() == min(own_mb, DEFAULT_MLX_CACHE_MB) << 20


def test_a_negative_size_is_a_usage_error(tiny_llama, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "-m", str(tiny_llama), "--mlx-cache-mb", "-1"])
    assert exc.value.code == 2 and "--mlx-cache-mb" in capsys.readouterr().err
