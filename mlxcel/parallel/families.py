"""The families tensor parallelism shards, as data: which dimensions must divide, and how the model is cut.

Each row says, for one ``model_type``, which config.json dimensions N ranks must divide (``Dim``),
who cuts the layers (``shard``: ``"mlx-lm"``, the class's own ``Model.shard(group)``; ``"mlxcel"``,
``mlxcel.parallel.megatron``'s plan over the usual q/k/v/o and gate/up/down names, for the families
whose mlx-lm class has no ``shard()``), where a layer keeps its routed experts (``Experts``; MoE
families only, ``--tp-moe-mode`` decides how they split) and what mlx-lm's ``shard()`` would split
that this runtime keeps replicated (``head``: qwen3_5's untied LM head). Adding a family is one row.
Nothing here imports MLX: the rows are read from config.json before any weight is.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Mapping

Config = Mapping[str, Any]


def text_config(config: Config) -> Config:
    """The text model's fields: ``text_config`` where the checkpoint nests them (qwen3_5, kimi_k3), else config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Dim:
    """One dimension N ranks split: ``get`` reads it (None: the checkpoint has none of it)."""

    name: str  # in refusals: "attention heads"
    phrase: str  # in the model summary: "{} attention heads"
    unit: str  # in the plan's description: "3 of 9 heads"
    get: Callable[[Config], int | None]
    width: Callable[[Config], int | None] | None = None  # input width of the sharded-to-all layer it splits
    repeats: bool = False  # N may also be a multiple of it (mlx-lm repeats the KV heads: qwen3_5)


def key(name: str) -> Callable[[Config], int | None]:
    return lambda c: _int(c.get(name))


def when(test: Callable[[Config], bool], get: Callable[[Config], int | None]) -> Callable[[Config], int | None]:
    return lambda c: get(c) if test(c) else None


def product(*names: str) -> Callable[[Config], int | None]:
    def get(c: Config) -> int | None:
        values = [_int(c.get(n)) for n in names]
        return None if any(v is None for v in values) else prod(values)  # type: ignore[arg-type]
    return get


def head_dim(c: Config) -> int | None:
    heads, hidden = _int(c.get("num_attention_heads")), _int(c.get("hidden_size"))
    hd = _int(c.get("head_dim"))
    return hd or (hidden // heads if heads and hidden else None)


def _attn_width(c: Config) -> int | None:
    heads, hd = _int(c.get("num_attention_heads")), head_dim(c)
    return heads * hd if heads and hd else None


HEADS = Dim("attention heads", "{} attention heads", "heads", key("num_attention_heads"), _attn_width)
KV_HEADS = Dim("KV heads", "{} KV heads", "KV heads", lambda c: _int(c.get("num_key_value_heads"))
               or _int(c.get("num_attention_heads")))
INTERMEDIATE = Dim("intermediate size", "intermediate size {}", "MLP columns", key("intermediate_size"),
                   key("intermediate_size"))
MLA_HEADS = Dim("attention heads", "{} attention heads", "heads", key("num_attention_heads"),
                product("num_attention_heads", "v_head_dim"))  # MLA: the latent KV is replicated


def dense_layers(c: Config) -> bool:
    """deepseek/glm/kimi: the first ``first_k_dense_replace`` layers have a dense MLP."""
    return (_int(c.get("first_k_dense_replace")) or 0) > 0 or (_int(c.get("moe_layer_freq")) or 1) > 1


def shared_dim(count: str) -> Dim:
    """The shared experts' MLP: ``count`` experts of ``moe_intermediate_size`` each, one MLP."""
    get = when(lambda c: (_int(c.get(count)) or 0) > 0, product("moe_intermediate_size", count))
    return Dim("shared expert width", "shared expert width {}", "shared expert columns", get, get)


@dataclass(frozen=True)
class Experts:
    """Where a MoE layer keeps its routed experts and which config keys say how many and how wide."""

    count: str  # config key: routed experts
    width: str  # config key: each expert's intermediate size
    block: str  # attribute of a decoder layer holding the MoE block
    switch: str  # attribute of that block holding the routed experts (a SwitchGLU)
    enabled: str | None = None  # config key that must be true for the experts to exist (gemma4's enable_moe_block)

    def experts(self, c: Config) -> int | None:
        if self.enabled is not None and not c.get(self.enabled):
            return None
        return _int(c.get(self.count)) or None


@dataclass(frozen=True)
class TPFamily:
    covers: str
    shard: str  # "mlx-lm" (the class's shard()) or "mlxcel" (mlxcel.parallel.megatron)
    dims: tuple[Dim, ...]
    experts: Experts | None = None
    head: tuple[str, str] | None = None  # (module path, attribute): an LM head mlx-lm splits by vocabulary
    linear_reduces: bool = True  # every all-reduce is a sharded-to-all linear layer (--tp-reduce-dtype applies)


DENSE = (HEADS, KV_HEADS, INTERMEDIATE)
_QWEN3_5_MOE = Experts("num_experts", "moe_intermediate_size", "mlp", "switch_mlp")
_QWEN3_5 = (HEADS, Dim("KV heads", "{} KV heads", "KV heads", KV_HEADS.get, repeats=True),
            Dim("linear attention key heads", "{} linear key heads", "linear key heads", key("linear_num_key_heads")),
            Dim("linear attention value heads", "{} linear value heads", "linear value heads",
                key("linear_num_value_heads"), product("linear_num_value_heads", "linear_value_head_dim")),
            Dim("intermediate size", "intermediate size {}", "MLP columns",
                when(lambda c: not c.get("num_experts"), key("intermediate_size")),
                when(lambda c: not c.get("num_experts"), key("intermediate_size"))),
            Dim("shared expert width", "shared expert width {}", "shared expert columns",
                when(lambda c: bool(c.get("num_experts")), key("shared_expert_intermediate_size")),
                when(lambda c: bool(c.get("num_experts")), key("shared_expert_intermediate_size"))))
_DEEPSEEK = (MLA_HEADS, Dim("intermediate size", "intermediate size {}", "MLP columns",
                            when(dense_layers, key("intermediate_size")), when(dense_layers, key("intermediate_size"))),
             shared_dim("n_shared_experts"))
_DEEPSEEK_EXPERTS = Experts("n_routed_experts", "moe_intermediate_size", "mlp", "switch_mlp")
_QWEN3_MOE_DENSE = Dim("intermediate size", "intermediate size {}", "MLP columns",
                       when(lambda c: bool(c.get("mlp_only_layers")) or (_int(c.get("decoder_sparse_step")) or 1) > 1,
                            key("intermediate_size")), key("intermediate_size"))
_KIMI_LINEAR = Dim("linear attention heads", "{} linear attention heads", "linear heads",
                   lambda c: _int((c.get("linear_attn_config") or {}).get("num_heads")))
_GEMMA4_GLOBAL_KV = Dim("global KV heads", "{} global KV heads", "global KV heads",
                        when(lambda c: bool(c.get("attention_k_eq_v")), key("num_global_key_value_heads")))

#: model_type -> how it shards; ``--help``, docs/tp.md and docs/models.md name these
FAMILIES: dict[str, TPFamily] = {
    "llama": TPFamily("Llama 2/3, SmolLM2", "mlx-lm", DENSE),
    "mistral": TPFamily("Mistral, as llama", "mlx-lm", DENSE),
    "qwen2": TPFamily("Qwen 2/2.5", "mlx-lm", DENSE),
    "qwen3": TPFamily("Qwen 3", "mlx-lm", DENSE),
    "ministral3": TPFamily("Ministral 3", "mlx-lm", DENSE),
    "gemma3_text": TPFamily("Gemma 3 text", "mlxcel", DENSE),
    "gemma4_text": TPFamily("Gemma 4 text, with or without its MoE block", "mlxcel", (*DENSE, _GEMMA4_GLOBAL_KV),
                            Experts("num_experts", "moe_intermediate_size", "experts", "switch_glu",
                                    "enable_moe_block")),
    "ernie4_5": TPFamily("ERNIE 4.5 dense", "mlxcel", DENSE),
    "hunyuan_v1_dense": TPFamily("Hunyuan v1 Dense", "mlxcel", DENSE),
    "qwen3_5": TPFamily("Qwen 3.5 text (gated delta net + attention)", "mlx-lm", _QWEN3_5, _QWEN3_5_MOE,
                        head=("language_model", "lm_head"), linear_reduces=False),
    "qwen3_5_moe": TPFamily("Qwen 3.5 MoE", "mlx-lm", _QWEN3_5, _QWEN3_5_MOE, head=("language_model", "lm_head"),
                            linear_reduces=False),
    "qwen3_moe": TPFamily("Qwen 3 MoE", "mlx-lm", (HEADS, KV_HEADS, _QWEN3_MOE_DENSE),
                          Experts("num_experts", "moe_intermediate_size", "mlp", "switch_mlp"), linear_reduces=False),
    "deepseek_v3": TPFamily("DeepSeek V3 (MLA + MoE)", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS, linear_reduces=False),
    "deepseek_v32": TPFamily("DeepSeek V3.2", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS, linear_reduces=False),
    "glm4_moe": TPFamily("GLM-4.5 MoE", "mlx-lm", (HEADS, KV_HEADS, *_DEEPSEEK[1:]), _DEEPSEEK_EXPERTS,
                         linear_reduces=False),
    "gpt_oss": TPFamily("gpt-oss", "mlx-lm", (HEADS, KV_HEADS),
                        Experts("num_local_experts", "intermediate_size", "mlp", "experts"), linear_reduces=False),
    "minimax": TPFamily("MiniMax M2", "mlx-lm", (HEADS, KV_HEADS),
                        Experts("num_local_experts", "intermediate_size", "block_sparse_moe", "switch_mlp"),
                        linear_reduces=False),
    # issue 43: the other families whose mlx-lm class has shard()
    "deepseek_v2": TPFamily("DeepSeek V2 / V2.5 (MLA + MoE)", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS, linear_reduces=False),
    "glm4_moe_lite": TPFamily("GLM-4.7-Flash (MLA + MoE)", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS, linear_reduces=False),
    "mistral4": TPFamily("Mistral 4 (MLA + MoE)", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS, linear_reduces=False),
    "kimi_k25": TPFamily("Kimi K2.5 text (DeepSeek V3 inside)", "mlx-lm", _DEEPSEEK, _DEEPSEEK_EXPERTS,
                         linear_reduces=False),
    "deepseek_v41": TPFamily("DeepSeek V4.1 (compressed attention + MoE)", "mlx-lm",
                             (HEADS, Dim("output groups", "{} output groups", "output groups", key("o_groups")),
                              shared_dim("n_shared_experts")),
                             Experts("n_routed_experts", "moe_intermediate_size", "mlp.experts", "switch_mlp"),
                             linear_reduces=False),
    "exaone_moe": TPFamily("EXAONE MoE", "mlx-lm", (HEADS, KV_HEADS, INTERMEDIATE, shared_dim("num_shared_experts")),
                           Experts("num_experts", "moe_intermediate_size", "mlp", "switch_mlp"), linear_reduces=False),
    "step3p5": TPFamily("Step 3.5 (sliding + full attention, MoE)", "mlx-lm",
                        (HEADS, Dim("KV heads", "{} KV heads", "KV heads", key("num_attention_groups")),
                         Dim("sliding attention heads", "{} sliding heads", "sliding heads",
                             lambda c: _int((c.get("attention_other_setting") or {}).get("num_attention_heads"))),
                         Dim("sliding KV heads", "{} sliding KV heads", "sliding KV heads",
                             lambda c: _int((c.get("attention_other_setting") or {}).get("num_attention_groups"))),
                         INTERMEDIATE, Dim("shared expert width", "shared expert width {}", "shared expert columns",
                                           key("share_expert_dim"), key("share_expert_dim"))),
                        Experts("moe_num_experts", "moe_intermediate_size", "mlp", "switch_mlp"), linear_reduces=False),
    "longcat_flash": TPFamily("LongCat Flash (MLA, dense and zero experts)", "mlx-lm",
                              (MLA_HEADS, Dim("intermediate size", "intermediate size {}", "MLP columns",
                                              key("ffn_hidden_size"), key("ffn_hidden_size"))),
                              Experts("n_routed_experts", "expert_ffn_hidden_size", "mlp", "switch_mlp"),
                              linear_reduces=False),
    # longcat_flash's shard() (its n-gram embedding tables stay whole on every rank, as in mlx-lm)
    "longcat_flash_ngram": TPFamily("LongCat Flash N-gram (MLA, dense and zero experts)", "mlx-lm",
                                    (MLA_HEADS, Dim("intermediate size", "intermediate size {}", "MLP columns",
                                                    key("ffn_hidden_size"), key("ffn_hidden_size"))),
                                    Experts("n_routed_experts", "expert_ffn_hidden_size", "mlp", "switch_mlp"),
                                    linear_reduces=False),
    # both passes run the same sharded layers; each layer's loop gate keeps its ranks' heads
    "iquestloopcoder": TPFamily("IQuest Loop Coder (layers run twice)", "mlx-lm", (HEADS, KV_HEADS, INTERMEDIATE)),
    "minimax_m3_vl": TPFamily("MiniMax M3 text", "mlx-lm", (HEADS, KV_HEADS, Dim(
                                  "indexer heads", "{} indexer heads", "indexer heads", key("index_n_heads"))),
                              Experts("num_local_experts", "intermediate_size", "block_sparse_moe", "switch_mlp"),
                              linear_reduces=False),
    "kimi_k3": TPFamily("Kimi K3 (KDA + MLA + MoE)", "mlx-lm",
                        (MLA_HEADS, _KIMI_LINEAR, *_DEEPSEEK[1:2], shared_dim("num_shared_experts")),
                        Experts("num_experts", "moe_intermediate_size", "mlp", "switch_mlp"), linear_reduces=False),
}
FAMILIES_HELP = ", ".join(FAMILIES)

#: families mlx-lm runs whose tensor parallelism is refused, and why (the refusal names the reason)
REFUSED: dict[str, str] = {
    "llama4": "its mlx-lm class has no shard(), and its chunked attention with a shared expert beside routed "
              "experts in every other layer is not the plain q/k/v/o + gate/up/down layout mlxcel's own plan cuts",
    "muse_spark": "not a decoder mlxcel loads",
}


def is_moe(family: TPFamily, config: Config) -> bool:
    """This checkpoint has routed experts (qwen3_5 and gemma4_text may or may not)."""
    return family.experts is not None and bool(family.experts.experts(text_config(config)))
