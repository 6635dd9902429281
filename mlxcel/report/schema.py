"""The rows every benchmark writes: which fields, of which types, per benchmark.

One ``Schema`` per value of a row's ``bench`` field. ``validate_row`` turns a raw row (a JSON
object, or a CSV record of strings) into typed values or raises ``RowError`` with one line that
says what is wrong. Fields a schema does not name are kept as they are (newer benchmarks may add
some); a ``bench`` no schema knows is an error, so nothing is silently left out of a report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping


class RowError(ValueError):
    """A row that does not match its benchmark's schema (message without file and line)."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "int" | "num" | "str" | "bool"
    required: bool = True
    nullable: bool = False
    choices: tuple[str, ...] | None = None
    default: Any = None
    signed: bool = False  # a number that may be negative (a difference of two timings); others must not be


@dataclass(frozen=True)
class Schema:
    bench: str
    table: str  # name of the tidy table (CSV) its rows go to
    fields: tuple[Field, ...]
    variant_field: str | None = None  # a field whose value picks extra fields and another table
    variants: Mapping[str, tuple[str, tuple[Field, ...]]] = field(default_factory=dict)


def _num(name: str, **kw: Any) -> Field:
    return Field(name, "num", **kw)


def _int(name: str, **kw: Any) -> Field:
    return Field(name, "int", **kw)


def _str(name: str, **kw: Any) -> Field:
    return Field(name, "str", **kw)


TP_VARIANTS = ("tp1", "model", "bfloat16", "float32", "one-reduce", "no-reduce")  # bench/tp_bench.py --variants

# bench/decode_bench.py --kv-bits / --prompt-tokens: the KV variant (null: full precision, as every older row) and a label
_DECODE_KV = (
    _int("kv_bits", required=False, nullable=True), _int("kv_group_size", required=False, nullable=True),
    _str("label", required=False, nullable=True),
)
_DECODE_RUN = (
    _int("run"), _str("weights", required=False, nullable=True), _int("prompt_tokens"), _int("generated_tokens"),
    _num("prompt_tps"), _num("decode_tps"), _num("token_latency_p50_ms", nullable=True),
    _num("token_latency_p95_ms", nullable=True), _num("peak_memory_gb"), *_DECODE_KV,
    _int("order", required=False, nullable=True), _int("kv_cache_bytes", required=False, nullable=True),
    _int("kv_cache_alloc_bytes", required=False, nullable=True), _int("kv_cache_positions", required=False, nullable=True),
    _num("load_1m", required=False, nullable=True),
)
_DECODE_SUMMARY = (
    _num("mlxcel_decode_tps"), _num("mlx_lm_decode_tps"), _num("decode_ratio"),
    _num("median_run_ratio"), _num("prompt_ratio"), *_DECODE_KV, _int("prompt_tokens", required=False, nullable=True),
    _num("mlxcel_kv_cache_bytes", required=False, nullable=True), _num("mlx_lm_kv_cache_bytes", required=False, nullable=True),
)

# bench/protection_bench.py: protected (AES-256-GCM) against attribution-only unprotected decode, a row per run
_PROTECTION_RUN = (
    _int("run"), _int("order"), _int("tokens"), _num("tok_s"), _num("per_token_ms_p50"), _num("per_token_ms_p95"),
    _num("frames_per_token"), _num("bytes_per_token"), Field("identical", "bool"), _num("load_1m", nullable=True),
)
_PROTECTION_SUMMARY = (
    _int("runs"), Field("identical", "bool"), _num("protected_tok_s"), _num("protected_tok_s_min"),
    _num("protected_tok_s_max"), _num("unprotected_tok_s"), _num("unprotected_tok_s_min"), _num("unprotected_tok_s_max"),
    _num("ratio"), _num("ratio_median"), _num("ratio_min"), _num("ratio_max"),
    _num("cost_ms_per_token", signed=True), _num("load_1m_max", nullable=True),  # a difference: noise can flip it
)

# bench/structured_bench.py: one server with and without a JSON schema (response_format), same prompts, ABBA
_STRUCTURED_LEVEL = (
    _int("round"), _int("order"), _int("requests"), _int("errors"), _str("error_sample", required=False, nullable=True),
    _int("output_tokens"), _int("tokens_min"), _int("tokens_max"), _num("wall_s"), _num("agg_tps", nullable=True),
    _num("itl_p50_ms", nullable=True), _num("itl_mean_ms", nullable=True), _num("ttft_p50_ms", nullable=True),
    _str("prompts_sha256"), _num("load_1m", nullable=True), _num("load_5m", required=False, nullable=True),
)
_STRUCTURED_SUMMARY = (
    _int("rounds"), Field("same_tokens", "bool"), _num("plain_tps"), _num("schema_tps"), _num("plain_itl_ms"),
    _num("schema_itl_ms"), _num("tps_ratio"), _num("tps_ratio_min"), _num("tps_ratio_max"), _num("itl_ratio"),
    _num("itl_ratio_min"), _num("itl_ratio_max"), _num("cost_pct", signed=True),  # noise can make it negative
    _num("load_1m_max", nullable=True),
)

# bench/agent_turns.py: growing multi-turn agent conversations per topology variant (ABBA over repeats); a row per
# request, a summary per variant, a ratio per pair of variants (mlxcel/report/agent.py)
_AGENT_TURN = (
    _str("variant"), _str("topology"), _str("args", nullable=True), _int("repeat"), _int("order"), _int("conversation"),
    _int("turn"), _int("seed"), _int("system_words"), _int("result_words"), _str("prompt_sha256"),
    _int("reusable_tokens"), _int("wave_reusable_tokens"), _int("wave_cached_tokens", nullable=True),
    _int("wave_hits", nullable=True), _num("ttft_ms", nullable=True), _num("e2e_ms", nullable=True),
    _int("prompt_tokens", nullable=True), _int("completion_tokens", nullable=True),
    _int("cached_tokens", required=False, nullable=True), _num("decode_tps", nullable=True),
    _str("error", required=False, nullable=True), _num("load_1m", required=False, nullable=True),
    _str("run"), _str("model_dir", required=False, nullable=True),
)
_AGENT_SPREADS = tuple(_num(f"{m}{s}", nullable=True) for m in ("ttft_turn1_ms", "ttft_later_ms", "decode_tps", "reuse",
                                                                  "vs_baseline") for s in ("", "_min", "_max"))
_AGENT_SUMMARY = (
    _str("variant"), _str("topology"), _str("args", nullable=True), _int("repeats"), _int("requests"), _int("errors"),
    _int("prompt_tokens_max"), _str("baseline"), *_AGENT_SPREADS, _str("run"),
)
_AGENT_RATIO = (
    _str("variant"), _str("denominator"), _str("metric"), _int("repeats"), _num("ratio", nullable=True),
    _num("ratio_min", nullable=True), _num("ratio_max", nullable=True), _str("run"),
)

SCHEMAS: dict[str, Schema] = {s.bench: s for s in (
    Schema("decode", "decode", (_str("impl"), _str("model")), variant_field="impl", variants={
        "mlxcel": ("decode", _DECODE_RUN),
        "mlx-lm": ("decode", _DECODE_RUN),
        "summary": ("decode_recorded_summary", _DECODE_SUMMARY),
    }),
    Schema("frame_bench", "frame", (
        _str("mode"), _str("suite"), _int("payload_bytes"), _int("iterations"), _num("p50_us"), _num("p95_us"),
        _num("p99_us"), _num("mean_us"), _num("one_way_gib_s"), _int("chunk_len", required=False, nullable=True),
        _str("remote", required=False, nullable=True), Field("quick", "bool", required=False, default=False),
    )),
    Schema("serve", "serve", (
        _str("server"), _str("url", required=False, nullable=True), _int("concurrency"), _int("requests"),
        _int("errors"), _str("error_sample", required=False, nullable=True), _int("max_tokens"),
        _int("output_tokens"), _num("wall_s"), _num("ttft_p50_ms", nullable=True), _num("ttft_p95_ms", nullable=True),
        _num("itl_p50_ms", nullable=True), _num("itl_p95_ms", nullable=True), _num("req_tps_mean", nullable=True),
        _num("agg_tps", nullable=True), _str("arrival", required=False, choices=("herd", "staggered"), default="herd"),
        _int("round", required=False, default=0), _int("order", required=False, nullable=True),
        _str("model_dir", required=False, nullable=True), _str("run", required=False, nullable=True),
        _str("prompt_tag", required=False, nullable=True), _str("prompts_sha256", required=False, nullable=True),
    )),
    Schema("pipeline", "pipeline", (
        _str("mode"), _int("stages"), _int("streams"), _int("run"), _int("order"), _int("tokens"), _num("tok_s"),
        _num("per_token_ms_p50", nullable=True), _num("per_token_ms_p95", required=False, nullable=True),
        _num("frames_per_token", nullable=True), _num("bytes_per_token", nullable=True),
        _str("return", choices=("token", "logits")), Field("identical", "bool", nullable=True), _str("model"),
        _str("label", required=False, nullable=True), _str("stage_devices", required=False, nullable=True),
        _int("stage_threads", required=False, nullable=True),
        # true only where a ratio between this run's modes is fair: every mode ran in a fresh process, or
        # the baseline is the deployed single-node server (see tables.pipeline_summary's vs_baseline)
        Field("fair_comparison", "bool", required=False, nullable=True, default=False),
        # per run (bench/pipeline_bench.py workers): the fresh process, CPU-seconds per process in the
        # measured run (cpu_s_stage, a list per stage, is kept as it is) and per-token submit->result latency
        _int("worker_pid", required=False, nullable=True), _int("prompt_tokens", required=False, nullable=True),
        _num("wall_s", required=False, nullable=True), _num("cpu_s_worker", required=False, nullable=True),
        _num("cpu_s_worker_total", required=False, nullable=True), _num("cpu_s_stages", required=False, nullable=True),
        _num("latency_ms_p50", required=False, nullable=True), _num("latency_ms_p95", required=False, nullable=True),
    )),
    Schema("pipeline_protection", "pipeline_protection", (
        _str("mode"), _str("model"), _int("stages"), _int("tokens_requested"), _str("label", required=False, nullable=True),
    ), variant_field="mode", variants={
        "protected": ("pipeline_protection", _PROTECTION_RUN),
        "unprotected": ("pipeline_protection", _PROTECTION_RUN),
        "summary": ("pipeline_protection_summary", _PROTECTION_SUMMARY),
    }),
    Schema("structured_output", "structured_output", (
        _str("mode"), _str("model"), _int("concurrency"), _int("max_tokens"), _str("label", required=False, nullable=True),
    ), variant_field="mode", variants={
        "plain": ("structured_output", _STRUCTURED_LEVEL),
        "json_schema": ("structured_output", _STRUCTURED_LEVEL),
        "summary": ("structured_output_summary", _STRUCTURED_SUMMARY),
    }),
    Schema("agent_turns", "agent_turns", (
        _str("mode"), _str("label", required=False, nullable=True), _str("model"), _int("conversations"), _int("turns"),
        _int("max_tokens"), _str("wire", choices=("native", "text")),
    ), variant_field="mode", variants={
        "turn": ("agent_turns", _AGENT_TURN), "summary": ("agent_summary", _AGENT_SUMMARY),
        "ratio": ("agent_ratio", _AGENT_RATIO),
    }),
    # bench/kv_bits_quality.py: --kv-bits against full precision, one row per prompt and bits, then a summary
    Schema("kv_bits_quality", "kv_bits_quality", (
        _str("kind", choices=("prompt", "summary")), _str("model"), _int("bits"), _int("group_size"), _int("tokens"),
        _num("agree"), _num("top1_agree"), _num("max_logit_err"), _num("mean_logit_err"),
    ), variant_field="kind", variants={
        "prompt": ("kv_bits_quality", (_int("prompt"), _int("agree_prefix"), _num("logit_range"))),
        "summary": ("kv_bits_quality_summary", (_int("prompts"), _int("identical_texts"), _num("kv_bytes_per_token"),
                                                 _num("kv_bytes_per_token_full"))),
    }),
    # bench/tp_bench.py: one fresh-process decode measurement; "shape" (the config's dims) is kept as it is
    Schema("tp_bench", "tp", (
        _str("impl", choices=("mlxcel", "mlx-lm")), _str("model"), _str("model_name"), _str("backend"), _int("tp"),
        _int("tp_compared"), _int("batch"), _int("round"), _int("order"), _int("warmup"), _int("steps"),
        _num("decode_tok_s"), _num("step_ms_p50"), _num("step_ms_p95"), _num("wall_s"),
        _int("cpus", required=False, nullable=True),
        # rows before --variants compared tp 1 (tp = 1) with tp N (the model's dtype) and have neither
        _str("variant", required=False, nullable=True, choices=TP_VARIANTS),
        _str("compared", required=False, nullable=True), _str("tokens_sha256", required=False, nullable=True),
        _str("invocation", required=False, nullable=True),  # the run's start: its rows' env dates differ
    )),
    # bench/bringup_bench.py: launch of a 2-stage pipeline to its first token
    Schema("bringup", "bringup", (
        _str("mode", choices=("static", "mdns", "toml")), _int("round"), _num("ready_s"), _num("first_token_s"),
        _str("model"),
    )),
    # bench/prefix_ttft.py: TTFT of a long new prefix (cold) and of the same prefix again (warm)
    Schema("prefix_ttft", "prefix_ttft", (
        _str("label", required=False, default=""), _int("run"), _int("prefix_tokens"), _int("prompt_tokens"),
        _num("cold_ttft_s"), _num("warm_ttft_s"), _int("warm_reused_tokens"), Field("warm_hit", "bool"),
    )),
    # docs/benchmarks.md "BLAS on Linux CPUs": mlxcel generate per BLAS and thread count (validated; no section)
    Schema("blas_generate", "blas_generate", (
        _str("set"), _str("blas"), _str("config"), _str("library"), _int("threads"), _int("run"),
        _int("prompt_tokens"), _int("decode_tokens"), _num("prompt_tok_s", nullable=True),
        _num("decode_tok_s", nullable=True), _num("wall_s"), _int("rc"), _num("load1", required=False, nullable=True),
        _str("procedure", required=False, nullable=True),
    )),
    # bench/heal_bench.py: a node killed under a supervisor, until the cluster serves again (validated; no section)
    Schema("heal", "heal", (
        _str("node"), Field("cold", "bool"), _num("serving_s"), _num("node_ready_s"), _num("last_heal_s", nullable=True),
        _int("restarts"), Field("from_standby", "bool", nullable=True),
    )),
    # bench/gpu/moe_probe.py and step_probe.py: one H200 probe each (docs/benchmarks.md "H200, 2026-12-02";
    # validated; no section): the MoE block's share of a stage step, a step's graph build against its evaluation
    Schema("moe_probe", "moe_probe", (
        _str("label"), _str("model"), Field("compiled", "bool"), _int("steps"), _num("full_ms_p50"),
        _num("no_moe_ms_p50"), _num("fixed_routing_ms_p50"),
        # by difference of two timings: noise can make either negative (docs/benchmarks.md says so)
        _num("experts_ms", signed=True), _num("routing_ms", signed=True), _num("experts_fraction", signed=True),
        _num("routing_fraction", signed=True),
    )),
    Schema("step_probe", "step_probe", (
        _str("label"), _str("model"), _str("variant"), _int("round"), _int("steps"), _num("build_ms_p50"),
        _num("step_ms_p50"),
    )),
    # bench/gpu/pingpong_probe.py: one token as the whole model, or as two halves in one process or in two
    Schema("pingpong_probe", "pingpong_probe", (
        _str("label", nullable=True), _str("model"), _str("mode"), _int("round"), _int("tokens"),
        Field("same_tokens", "bool"), _num("tok_s", nullable=True), _num("token_ms_p50", nullable=True),
        _num("half0_compute_ms_p50", nullable=True), _num("half1_compute_ms_p50", nullable=True),
    )),
    # bench/gil_bench.py: a protected bulk stream beside GIL-holding threads, per switch interval and frame size
    Schema("gil_stream", "gil_stream", (
        _int("busy_threads"), _num("switch_interval_ms"), _int("frame_kib"), _int("message_kib"), _int("mib"),
        _int("repeats"), _num("p50_ms"), _num("min_ms"), _num("max_ms"), _num("gib_s"),
        _num("load_1m", required=False, nullable=True),
    )),
    # bench/gpu/managed_probe.py: the host reading and writing KV in MLX's CUDA managed memory, per path
    Schema("managed_probe", "managed_probe", (
        _str("variant"), _int("mib"), _int("rounds"), _num("median_s"), _num("min_s"), _num("max_s"), _num("gib_s"),
        _int("cuda_runtime"), _str("label", required=False, nullable=True),
    )),
    # bench/gpu/prefill_probe.py: a prompt chunk's and a decode step's host cost by shape
    Schema("prefill_probe", "prefill_probe", (
        _str("label"), _str("kind"), _int("round"), _int("tokens", required=False), _int("rows", required=False),
        _int("context", required=False), _num("queue_ms"), _num("total_ms"),
    )),
    # bench/disagg_bench.py (the report's "Disaggregated" section, mlxcel/report/disagg.py); load_1m, the
    # host's 1-minute load average at the row, is absent from rows written before 2026-12-02
    Schema("disagg_frames", "disagg_frames", (
        _str("run"), _str("suite"), _str("dtype"), _int("prompt_tokens"), _int("tensor_bytes"), _int("repeats"),
        _num("p50_ms"), _num("p95_ms"), _num("gib_s"), _num("vs_unprotected"), _str("model_dir"),
        _int("cpus", required=False, nullable=True), _num("load_1m", required=False, nullable=True),
    )),
    Schema("disagg_handoff", "disagg_handoff", (
        _str("run"), _str("topology"), _int("repeat"), _int("order"), _int("target_prompt_tokens"),
        _int("prompt_tokens"), _int("completion_tokens"), _num("ttft_ms"), _num("e2e_ms"), _str("model_dir"),
        *(f(name, required=False, nullable=True) for f, name in (  # only where a handoff happened
            (_int, "handoffs"), (_int, "handoff_bytes"), (_num, "handoff_ms"), (_num, "handoff_gib_s"),
            (_num, "bytes_per_prompt_token"), (_num, "prefill_ms"))),
        _num("load_1m", required=False, nullable=True),
    )),
    Schema("disagg_stage", "disagg_stage", (  # bench/handoff_stages.py: one step of a KV handoff alone
        _str("run"), _str("shape"), _int("prompt_tokens"), _int("tensor_bytes"), _str("stage"), _int("repeats"),
        _num("p50_ms"), _num("min_ms"), _num("p95_ms"), _num("gib_s"), _str("model_dir", required=False, nullable=True),
        _int("cpus", required=False, nullable=True), _num("load_1m", required=False, nullable=True),
        _str("heap", required=False, nullable=True),  # keep (the decode node's, mlxcel/disagg/heap.py) or plain
    )),
    Schema("disagg_e2e", "disagg_e2e", (  # bench/handoff_stages.py: a whole KV handoff in one process
        _str("run"), _str("shape"), _int("prompt_tokens"), _int("tensor_bytes"), _str("suite"), _int("repeats"),
        _num("p50_ms"), _num("min_ms"), _num("p95_ms"), _num("gib_s"), _num("stream_p50_ms"), _num("stream_gib_s"),
        _num("export_p50_ms"), _num("import_p50_ms"), _int("crypto_workers", required=False, nullable=True),
        _int("intake_workers", required=False, nullable=True), _str("model_dir", required=False, nullable=True),
        _int("cpus", required=False, nullable=True), _num("load_1m", required=False, nullable=True),
        _str("heap", required=False, nullable=True),
    )),
    Schema("serve_ratio", "serve_ratio", (  # bench/serve_bench.py: a server's aggregate over the baseline's
        _str("run"), _str("server"), _str("baseline"), _int("concurrency"), _num("agg_tps_mean", nullable=True),
        _num("ratio_mean", nullable=True), _num("ratio_min", nullable=True), _num("ratio_max", nullable=True),
        _num("gpu_util_mean", required=False, nullable=True),
        _num("gpu_mem_max_mib", required=False, nullable=True),
    )),
    # bench/scaling_bench.py (the report's "How cost grows" section, mlxcel/report/scaling.py)
    Schema("scaling_pipeline", "scaling_pipeline", (
        _int("stages"), _int("streams"), _int("round"), _int("tokens"), _int("errors"), _num("wall_s"),
        _num("tok_s", nullable=True), _num("ms_per_token", nullable=True), _num("ttft_ms", nullable=True),
        _num("cpu_s_coordinator", nullable=True), _num("cpu_s_stages", nullable=True), _int("rss_bytes"),
        _int("processes"), _str("model"), _num("load_1m", nullable=True), _str("label", required=False, nullable=True),
    )),
    Schema("scaling_bringup", "scaling_bringup", (
        _int("peers"), _int("round"), _num("ready_s"), _num("first_token_s"), _num("push_s", nullable=True),
        *(_int(n, nullable=True) for n in ("sent_bytes", "received_bytes", "sent_frames", "received_frames",
                                          "wire_bytes", "coordinator_rss_bytes")),
        _int("peer_rss_bytes"), _int("peer_rss_waiting_bytes"), _str("model"), _num("load_1m", nullable=True),
        _str("label", required=False, nullable=True),
    )),
    Schema("scaling_router", "scaling_router", (
        _int("prefill_nodes"), _int("decode_nodes"), _int("nodes"), _int("round"), _int("requests"), _int("max_tokens"),
        _num("wall_s"), _num("router_cpu_s"), _num("router_idle_cpu_s_per_s"),
        _num("router_cpu_s_per_request", signed=True),  # idle probes subtracted: noise can take it below 0
        _num("router_cpu_s_per_request_raw"), _num("ttft_ms_p50", nullable=True),
        _num("added_ms_p50", nullable=True, signed=True), _num("added_ms_p95", nullable=True, signed=True),
        _str("model"), _num("load_1m", nullable=True), _str("label", required=False, nullable=True),
    )),
    Schema("disagg_serve", "disagg_serve", (
        _str("run"), _str("topology"), _str("server"), _int("round"), _int("order"), _int("concurrency"),
        _int("requests"), _int("errors"), _str("error_sample", required=False, nullable=True), _int("max_tokens"),
        _int("output_tokens"), _num("wall_s"), _num("ttft_p50_ms", nullable=True), _num("ttft_p95_ms", nullable=True),
        _num("itl_p50_ms", nullable=True), _num("itl_p95_ms", nullable=True), _num("req_tps_mean", nullable=True),
        _num("agg_tps", nullable=True), _str("arrival", required=False, choices=("herd", "staggered"), default="herd"),
        _str("model_dir", required=False, nullable=True), _str("prompts_sha256", required=False, nullable=True),
        *(f(name, required=False, nullable=True) for f, name in (
            (_int, "handoffs"), (_int, "handoff_bytes"), (_int, "handoff_bytes_mean"), (_num, "handoff_ms_mean"))),
        _str("prompt", required=False, choices=("short", "long"), default="short"),
        _int("long_tokens", required=False, nullable=True), _num("load_1m", required=False, nullable=True),
    )),
)}

ENV_FIELDS = (_str("host"), _str("date"), _str("git_commit", nullable=True))

# frame_bench.py's CSV has no "bench" column: these columns identify it
FRAME_CSV_COLUMNS = frozenset({"mode", "suite", "payload_bytes", "iterations", "p50_us", "one_way_gib_s"})


def known_benches() -> str:
    return ", ".join(sorted(SCHEMAS))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def _coerce(f: Field, value: Any, from_text: bool) -> Any:
    """One field's value in its type; raises RowError naming the field."""
    if _missing(value) and not (f.kind == "str" and value == "" and not from_text):
        if f.nullable:
            return None
        raise RowError(f"field {f.name!r} is empty")
    try:
        if f.kind == "str":
            if not isinstance(value, str):
                raise TypeError
            out: Any = value
        elif f.kind == "bool":
            out = _bool(value, from_text)
        elif f.kind == "int":
            out = _int_value(value, from_text)
        else:
            out = _num_value(value, from_text)
    except (TypeError, ValueError):
        raise RowError(f"field {f.name!r}: expected {_KIND_WORDS[f.kind]}, got {value!r}") from None
    if f.choices and out not in f.choices:
        raise RowError(f"field {f.name!r}: {out!r} is not one of {', '.join(f.choices)}")
    if f.kind in ("int", "num") and out < 0 and not f.signed:
        raise RowError(f"field {f.name!r}: negative value {out!r}")
    return out


_KIND_WORDS = {"int": "an integer", "num": "a finite number", "str": "a string", "bool": "true or false"}


def _bool(value: Any, from_text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if from_text and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError


def _int_value(value: Any, from_text: bool) -> int:
    if from_text and isinstance(value, str):
        value = float(value) if any(c in value for c in ".eE") else int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError
    if isinstance(value, float) and not value.is_integer():
        raise ValueError
    return int(value)


def _num_value(value: Any, from_text: bool) -> float:
    if from_text and isinstance(value, str):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError
    return float(value)


def _apply(fields: tuple[Field, ...], raw: Mapping[str, Any], out: dict[str, Any], from_text: bool) -> None:
    for f in fields:
        if f.name in raw:
            out[f.name] = _coerce(f, raw[f.name], from_text)
        elif f.required:
            raise RowError(f"missing field {f.name!r}")
        else:
            out[f.name] = f.default


def validate_env(env: Any) -> dict[str, Any]:
    """The environment record of a JSONL row (bench/environment.py), checked for what reports use."""
    if not isinstance(env, dict):
        raise RowError("field 'env' must be an object (the benchmark environment)")
    checked = dict(env)
    try:
        _apply(ENV_FIELDS, env, checked, from_text=False)
    except RowError as exc:
        raise RowError(f"env: {exc}") from None
    return checked


def validate_row(raw: Mapping[str, Any], *, from_text: bool = False) -> tuple[str, dict[str, Any]]:
    """(table name, typed row) for one raw row; ``from_text``: values are CSV strings."""
    bench = raw.get("bench")
    if not isinstance(bench, str) or not bench:
        raise RowError("no 'bench' field: cannot tell which benchmark wrote this row")
    schema = SCHEMAS.get(bench)
    if schema is None:
        raise RowError(f"unknown benchmark {bench!r} (known: {known_benches()})")
    out: dict[str, Any] = {k: v for k, v in raw.items() if k != "env"}
    _apply(schema.fields, raw, out, from_text)
    table = schema.table
    if schema.variant_field:
        value = out[schema.variant_field]
        if value not in schema.variants:
            raise RowError(f"field {schema.variant_field!r}: {value!r} is not one of {', '.join(schema.variants)}")
        table, extra = schema.variants[value]
        _apply(extra, raw, out, from_text)
    return table, out
