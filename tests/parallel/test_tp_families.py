"""Every family tensor parallelism shards, one row each: tp 2 gives tp 1's greedy tokens.

Each row is a tiny ``mlxcel models make-random`` checkpoint (mlx-lm's own classes, the real tokenizer
files) and the ``--tp-moe-mode`` values that apply to it: none for a dense family, both for a
mixture-of-experts one (whole experts per rank, and every expert's width split). Adding a family is one
row here and one in ``mlxcel.parallel.families.FAMILIES``.

- Every row runs in one group of two rank processes (``tests/parallel/tp_greedy.py``: the ring backend on
  loopback, joined once; each checkpoint cut by ``apply_plan`` as a follower cuts it): its plan line, and
  its greedy tokens equal the whole model's in this process.
- gemma-4 E2B's shape (per-layer inputs, a KV-shared layer) runs in that group too.
- One row per way of cutting (``REAL``: mlx-lm's ``shard()``, mlxcel's own plan, the gated delta net with
  its head kept whole, and each MoE mode) also runs the whole real path: ``mlxcel generate`` as rank 0,
  its follower a second process, printing tp 1's greedy text.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.config import RANDOM_FAMILIES, TP_MOE_MODES
from mlxcel.parallel.families import FAMILIES
from tests.family_checkpoints import family_checkpoint  # noqa: F401
from tests.cli_in_process import run_mlxcel
from tests.parallel.tp_greedy import greedy, run_group

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]

CLI = [sys.executable, "-m", "mlxcel"]
DENSE: tuple[str | None, ...] = (None,)
MOE: tuple[str | None, ...] = TP_MOE_MODES
#: family (model_type) -> the --tp-moe-mode values its tiny checkpoint runs under
TABLE: dict[str, tuple[str | None, ...]] = {
    "llama": DENSE, "qwen2": DENSE, "qwen3": DENSE, "ministral3": DENSE,  # mlx-lm's shard()
    "gemma3_text": DENSE, "ernie4_5": DENSE, "hunyuan_v1_dense": DENSE,  # mlxcel's own plan
    "gemma4_text": MOE,  # mlxcel's own plan; the tiny one has gemma-4-26B-A4B's MoE block beside each MLP
    "qwen3_5": DENSE,  # gated delta net + attention, mlx-lm's shard(), the LM head kept replicated
    "qwen3_5_moe": MOE, "qwen3_moe": MOE, "deepseek_v3": MOE, "deepseek_v32": MOE, "glm4_moe": MOE,
    "gpt_oss": MOE, "minimax": MOE, "kimi_k3": MOE,
}
N = 6  # tokens
ROWS = [(f, m) for f, modes in sorted(TABLE.items()) for m in modes]
#: one row per way of cutting, run through ``mlxcel generate --tp-size 2`` as well
REAL = [("llama", None), ("gemma3_text", None), ("qwen3_5", None), ("qwen3_moe", "within_expert"),
        ("gemma4_text", "expert_parallel")]


def test_table_is_every_tp_family():
    """A family sharded but untested here fails (mistral loads as llama: no checkpoint of its own)."""
    from tests.parallel.test_tp_round_two import ROUND_TWO  # tiny checkpoints of their own, built there

    assert set(TABLE) == set(FAMILIES) - {"mistral", *ROUND_TWO}
    assert set(TABLE) <= set(RANDOM_FAMILIES)


_checkpoints: dict[str, Path] = {}
_single: dict[str, str] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    def get(family: str) -> Path:
        if family not in _checkpoints:
            _checkpoints[family] = make_random_checkpoint(tmp_path_factory.mktemp(family), family=family, layers=4)
        return _checkpoints[family]

    yield get
    _checkpoints.clear()
    _single.clear()


def generate(model: Path, *flags: str) -> subprocess.CompletedProcess:
    """``mlxcel generate``: as a process of its own with ``--tp-size`` (rank 0, which starts its follower), else
    in this process (tp 1's reference text)."""
    argv = ["generate", "-m", str(model), "-p", "hello world", "-n", str(N), "--temp", "0", "--raw", *flags]
    if "--tp-size" in flags:
        out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=240)
    else:
        out = run_mlxcel(*argv)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_real_rows_cover_each_way_of_cutting():
    """A real-process row for mlx-lm's shard() and mlxcel's own plan, each dense and with experts, the gated
    delta net with its head kept whole, and each MoE mode."""
    assert set(REAL) <= set(ROWS)
    kinds = {(FAMILIES[f].shard, m is not None) for f, m in ROWS}
    assert {(FAMILIES[f].shard, m is not None) for f, m in REAL} == kinds
    assert {m for _, m in REAL} == {None, *MOE} and any(FAMILIES[f].head for f, _ in REAL)


def expect_plan(line: str, family: str, mode: str | None) -> None:
    assert f"{family} over 2 ranks" in line, line
    if mode == "expert_parallel":
        assert "2 of 4 experts per rank" in line, line
    elif mode == "within_expert":
        assert "all 4 experts" in line, line


@pytest.fixture(scope="module")
def grouped(checkpoint, family_checkpoint, tmp_path_factory) -> dict[tuple[str, str | None], dict]:  # noqa: F811
    """Every row's (and gemma-4 E2B's, as ``("gemma4_text_e2b", None)``) plan line and tp 2 greedy tokens,
    from one group of two rank processes."""
    jobs = [(checkpoint(f), m) for f, m in ROWS] + [(family_checkpoint("gemma4_text_e2b"), None)]
    rows = run_group(jobs, tmp_path_factory.mktemp("tp-group"))
    return dict(zip([*ROWS, ("gemma4_text_e2b", None)], rows))


@pytest.mark.parametrize("family,mode", ROWS)
def test_tp_2_gives_tp_1s_greedy_tokens(checkpoint, grouped, family, mode):
    got = grouped[(family, mode)]
    expect_plan(got["plan"], family, mode)
    assert got["tokens"] == greedy(checkpoint(family)) and len(got["tokens"]) == N


@pytest.mark.parametrize("family,mode", REAL)
def test_tp_2_prints_tp_1s_greedy_text(checkpoint, family, mode):
    model = checkpoint(family)
    if family not in _single:
        _single[family] = generate(model).stdout
    flags = ["--tp-size", "2", "--tp-timeout", "120"] + (["--tp-moe-mode", mode] if mode else [])
    sharded = generate(model, *flags)
    assert "ring backend" in sharded.stderr
    expect_plan(sharded.stderr, family, mode)
    assert sharded.stdout == _single[family] and len(sharded.stdout) > 1


def test_gemma4_with_per_layer_inputs_and_kv_shared_layers(grouped, family_checkpoint):  # noqa: F811
    """gemma-4 E2B/E4B's shape (``VARIANTS["gemma4_text_e2b"]``, the pipeline and handoff tables' row too):
    per-layer inputs stay replicated, the KV-shared last layer has no k/v projection to cut and reads
    layer 2's (sharded) sliding KV. (mlxcel's own plan through ``mlxcel generate``: the gemma3_text row.)"""
    got = grouped[("gemma4_text_e2b", None)]
    assert got["plan"] == "gemma4_text over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 64 of 128 MLP columns per rank"
    assert got["tokens"] == greedy(family_checkpoint("gemma4_text_e2b")) and len(got["tokens"]) == N
