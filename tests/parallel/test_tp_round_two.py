"""Tensor parallelism for the families of issue 43's round two: the table follows mlx-lm's ``shard()``
hooks, each new row's dimensions are named when they do not divide, families without a cut are refused
by name, and tp 2 gives tp 1's greedy tokens for deepseek_v2 and mistral4 (MLA + MoE; tiny checkpoints
built here from mlx-lm's own classes, the tokenizer of a ``make-random`` checkpoint), iquestloopcoder and
longcat_flash_ngram: all four in one group of two ring rank processes (``tests/parallel/tp_greedy.py``;
``mlxcel generate --tp-size 2`` with its follower runs each way of cutting in test_tp_families.py, mlx-lm's
``shard()`` with experts as these).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import FAMILIES, REFUSED
from mlxcel.parallel.plan import check_shardable

#: the rows this round added (tests/parallel/test_tp_families.py runs the others from make-random checkpoints)
ROUND_TWO = ("deepseek_v2", "glm4_moe_lite", "mistral4", "kimi_k25", "deepseek_v41", "exaone_moe", "step3p5",
             "longcat_flash", "minimax_m3_vl", "iquestloopcoder", "longcat_flash_ngram")
MLA = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
       "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
       "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
       "norm_topk_prob": True, "rope_scaling": {"type": "yarn", "factor": 1.0, "mscale_all_dim": 0,
                                                "original_max_position_embeddings": 2048}}


def _sharding_modules() -> dict[str, bool]:
    """Every mlx_lm.models module -> whether it defines a ``shard()`` (read from its source: importing
    every module would run their optional-dependency probes, olmo's exits)."""
    import mlx_lm.models as models

    return {f.stem: "    def shard(" in f.read_text() for f in Path(models.__path__[0]).glob("*.py")
            if not f.stem.startswith("_")}


def test_the_table_follows_mlx_lms_shard_hooks():
    """An mlx-lm upgrade that gives a class shard() fails here until the family has a row or a refusal."""
    hooks = _sharding_modules()
    with_shard = {name for name, has in hooks.items() if has}
    assert with_shard - set(FAMILIES) - set(REFUSED) == set()
    for name in ROUND_TWO:  # (a family may inherit its shard(): qwen3_5_moe; the rows of this round do not)
        assert hooks[name] and FAMILIES[name].shard == "mlx-lm", name
    assert not hooks["llama4"]
    assert set(ROUND_TWO) <= set(FAMILIES) and not set(REFUSED) & set(FAMILIES)


def test_a_family_without_a_cut_is_refused_by_name():
    with pytest.raises(ShardRefusal) as err:
        check_shardable({"model_type": "llama4", "num_attention_heads": 4}, 2, "m")
    assert str(err.value).startswith("m: model family 'llama4' is not supported by tensor parallelism: its mlx-lm "
                                     "class has no shard()")


@pytest.mark.parametrize("config,size,named", [
    ({"model_type": "deepseek_v41", "num_attention_heads": 8, "o_groups": 6, "n_routed_experts": 4,
      "moe_intermediate_size": 32}, 4, "output groups (6)"),
    ({"model_type": "step3p5", "num_attention_heads": 8, "num_attention_groups": 4, "intermediate_size": 64,
      "attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 6}, "moe_num_experts": 4,
      "moe_intermediate_size": 32}, 4, "sliding attention heads (6)"),
    ({"model_type": "minimax_m3_vl", "text_config": {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "index_n_heads": 2, "num_local_experts": 4,
                                                     "intermediate_size": 32}}, 4, "indexer heads (2)"),
    ({"model_type": "longcat_flash", "num_attention_heads": 8, "ffn_hidden_size": 66, "n_routed_experts": 4,
      "expert_ffn_hidden_size": 32}, 4, "intermediate size (66)"),
    ({"model_type": "mistral4", "num_attention_heads": 6, "n_routed_experts": 4, "moe_intermediate_size": 32},
     4, "attention heads (6)"),
])
def test_each_new_rows_dimension_is_named(config, size, named):
    with pytest.raises(ShardRefusal, match=re.escape(f"does not shard across {size} ranks: {named} is not divisible")):
        check_shardable(config, size, "m")


def test_a_new_rows_plan_describes_its_share():
    plan = check_shardable({"model_type": "deepseek_v41", "num_attention_heads": 8, "o_groups": 4,
                            "n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 1}, 2)
    assert plan.describe() == ("deepseek_v41 over 2 ranks: 4 of 8 heads, 2 of 4 output groups, 16 of 32 shared "
                               "expert columns, 2 of 4 experts per rank")


# --------------------------------------------------------------------------- tp 2 == tp 1, real ranks


def tiny_checkpoint(out: Path, family: str) -> Path:
    """A 2-layer MLA + MoE checkpoint of ``family`` (layer 0 dense, layer 1 MoE) from mlx-lm's class, with
    the tokenizer files of a make-random deepseek_v3 checkpoint."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    base = make_random_checkpoint(out / "base", family="deepseek_v3", layers=2)
    config = {**json.loads((base / "config.json").read_text()), **MLA, "model_type": family}
    if family == "mistral4":  # its rope and llama-4 attention scaling come in rope_parameters
        config["rope_parameters"] = {**MLA["rope_scaling"], "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1}
    return write_checkpoint(config, out / family, base)


def write_checkpoint(config: dict, path: Path, base: Path) -> Path:
    """mlx-lm's model of ``config`` with random weights (seed 1) at ``path``, with ``base``'s tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(1)
    model = model_cls(args_cls.from_dict(config))
    path.mkdir()
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, path / f.name)
    return path


def generate(model: Path, *flags: str) -> subprocess.CompletedProcess:
    """``mlxcel generate``: a process of its own with ``--tp-size`` (rank 0, which starts its follower), else in
    this process (tp 1's reference text)."""
    from tests.cli_in_process import run_mlxcel

    argv = ["generate", "-m", str(model), "-p", "hello world", "-n", "5", "--temp", "0", "--raw", *flags]
    if "--tp-size" in flags:
        out = subprocess.run([sys.executable, "-m", "mlxcel", *argv], capture_output=True, text=True, timeout=240)
    else:
        out = run_mlxcel(*argv)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def loop_checkpoint(out: Path) -> Path:
    """A 2-layer iquestloopcoder checkpoint (llama's fields and its loop, a window of 4) from mlx-lm's class,
    with the tokenizer files of a make-random llama checkpoint."""
    from mlxcel.commands.support import family_config
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    base = make_random_checkpoint(out / "base", layers=2)
    config = {**family_config("iquestloopcoder"), "num_hidden_layers": 2}
    return write_checkpoint(config, out / "iquestloopcoder", base)


#: (family, --tp-moe-mode) of the rows run at tp 2 in one group of rank processes
GROUPED = [("deepseek_v2", "expert_parallel"), ("mistral4", "within_expert"), ("iquestloopcoder", None),
           ("longcat_flash_ngram", "within_expert")]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """family -> (its tiny checkpoint, the plan line and tp 2 greedy tokens from one group of two ranks)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint
    from tests.parallel.tp_greedy import run_group

    made = {}
    for family, _ in GROUPED:
        out = tmp_path_factory.mktemp(family)
        made[family] = (loop_checkpoint(out) if family == "iquestloopcoder" else
                        make_random_checkpoint(out / family, family=family, layers=2)
                        if family == "longcat_flash_ngram" else tiny_checkpoint(out, family))
    rows = run_group([(made[f], m) for f, m in GROUPED], tmp_path_factory.mktemp("tp-group"))
    return {f: (made[f], row) for (f, _), row in zip(GROUPED, rows)}


@pytest.mark.proc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", [f for f, _ in GROUPED])
def test_tp_2_gives_tp_1s_greedy_tokens(grouped, family):
    """mlx-lm's shard() on MLA + MoE; iquestloopcoder's layers (both passes) and each layer's loop gate by
    heads; longcat_flash_ngram as longcat_flash, its n-gram tables whole on each rank. The prompt and answer
    (11 tokens) run past iquestloopcoder's loop window of 4."""
    from tests.parallel.tp_greedy import N, PROMPT, greedy

    model, got = grouped[family]
    assert f"{family} over 2 ranks: 2 of 4 heads" in got["plan"], got["plan"]
    assert got["tokens"] == greedy(model) and len(got["tokens"]) == N and len(PROMPT) + N > 4
