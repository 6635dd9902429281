"""Flags' defaults and bounds: one source of truth for the CLI, the server, the cluster TOML and the docs.

Plain constants and argparse ``type=`` helpers only (environment variables are read in mlxcel/envs.py); nothing
here imports MLX or any other mlxcel module, so every layer can import it.
"""

from __future__ import annotations

import argparse
from typing import Callable

# Checkpoints
DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"

# Server
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_PARALLEL = 4  # concurrent sequences holding a KV cache
DEFAULT_MAX_QUEUE = 64  # requests waiting beyond --parallel before 503
DEFAULT_PREFIX_CACHE_MB = 256  # MiB of KV cache kept for shared prompt prefixes (0 = off)
#: --kv-bits: the widths mlx-lm's QuantizedKVCache packs exactly (32 // bits values per uint32); --kv-group-size:
#: the group sizes mx.quantize accepts (mlxcel.engine.kv_quant, docs/models.md)
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64
# MiB of freed device buffers MLX may keep for reuse (or MLX's own bound where lower): unbounded, the server at 32
# streams on an H200 grew to the whole GPU and failed allocations; bounded, it served faster (docs/benchmarks.md)
DEFAULT_MLX_CACHE_MB = 4096
PREFILL_STEP = 512  # prompt tokens per prefill chunk (server and generate); bounds the stall a long prompt causes others

# Requests (the CLI, the HTTP server and the stage protocol check the same bounds)
DEFAULT_MAX_TOKENS = 256  # tokens generated when a request or `generate -n` names no limit
MAX_TOKENS_LIMIT = 1 << 20  # most tokens one request may ask for
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # most alternatives reported per token (OpenAI's bound)

# Pipeline parallelism (cluster TOML and flags)
DEFAULT_PP_SIZE = 1  # 1 = no pipeline
DEFAULT_PP_MAX_BATCH = 8  # most rows a stage accepts in one activation
DEFAULT_PP_MICRO_BATCH_SIZE = 1  # `generate --pp-micro-batch-size`: prompt chunks in flight (1 = no overlap)
# its bound, for `generate`, the server and the TOML's micro_batch_size: the stage protocol's micro-batch numbers
# 0..63 (protocol.MAX_MICRO_BATCHES)
MAX_PP_MICRO_BATCH_SIZE = 64
MAX_ACTIVATION_TOKENS = 2**20  # bound on n in a [rows, n, width] hidden-state activation
MAX_PREFIX_TOKENS = 2**16  # most token ids in PREPARE's prompt / RELEASE's tokens (the JSON fits 1 MiB)
DEFAULT_STARTUP_S = 60.0  # coordinator waits this long for every stage at start-up
DEFAULT_EXCHANGE_S = 30.0  # absolute deadline of one exchange, RunEntry -> RunResult
DEFAULT_HEARTBEAT_S = 2.0  # coordinator probes each stage this often
DEFAULT_CLUSTER_NAME = "mlxcel-cluster"
# Bounds of the cluster TOML's [transport] keys (mlxcel/topology/transport_table.py; their defaults are the
# transport's, mlxcel/cluster/wire.py: 512 connections, 64 pending handshakes, 8 per source, 5 s, 5 attempts, 0.1 s)
MAX_TRANSPORT_CONNECTIONS = 65536  # max_connections, max_pending_handshakes, max_pending_handshakes_per_ip
MAX_HANDSHAKE_TIMEOUT_S = 300.0  # handshake_timeout_s
MAX_RECONNECT_ATTEMPTS = 100  # max_reconnect_attempts (reconnect_base_delay_s: at most the 5 s maximum delay)
# Resuming a request whose node failed mid-stream (``--max-resumes``, ``--resume-timeout``; the pipeline
# coordinator and the disaggregated router; mlxcel/engine/resume.py, docs/pipeline.md §5.6, docs/disagg.md §6)
DEFAULT_MAX_RESUMES = 3  # resumes per request; 0 = a node failure fails the request (503), as before
MAX_RESUMES = 16  # its bound: each resume re-prefills prompt + generated, so more only multiplies the work
DEFAULT_RESUME_TIMEOUT_S = 30.0  # one resume waits this long for a node to take the request again
MAX_RESUME_TIMEOUT_S = 600.0  # its bound


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def udp_port(text: str) -> int:
    """argparse type: a UDP port to send to or listen on, 1 to 65535 (port 0 cannot carry a datagram)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a UDP port, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a UDP port (1-65535), got {value}")
    return value


def check_micro_batch_size(size: object) -> int:
    """``--pp-micro-batch-size`` (both binaries) and the TOML's ``micro_batch_size``: 1 to MAX_PP_MICRO_BATCH_SIZE;
    ValueError with the flag's text (the reference's below 1) otherwise."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(f"--pp-micro-batch-size must be an integer, got {size!r}")
    if size < 1:
        raise ValueError("--pp-micro-batch-size must be greater than 0")
    if size > MAX_PP_MICRO_BATCH_SIZE:
        raise ValueError(f"--pp-micro-batch-size must be at most {MAX_PP_MICRO_BATCH_SIZE}, got {size}")
    return size


def seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def count_up_to(limit: int, unit: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from 0 to ``limit`` (``unit`` names what it counts in the error)."""

    def parse(text: str) -> int:
        value = non_negative_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit}{unit}, got {value}")
        return value

    return parse


def seconds_up_to(limit: float) -> Callable[[str], float]:
    """An argparse type: seconds above 0 and at most ``limit``."""

    def parse(text: str) -> float:
        value = seconds(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit:g} seconds, got {text}")
        return value

    return parse


resume_count = count_up_to(MAX_RESUMES)  # --max-resumes
resume_seconds = seconds_up_to(MAX_RESUME_TIMEOUT_S)  # --resume-timeout


# Node supervisor (``mlxcel node``, the pidfile mode of the Ansible role)
DEFAULT_NODE_READY_TIMEOUT_S = 180.0  # a (re)started node loads its checkpoint before its readiness URL says 200
DEFAULT_NODE_STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
# restarts of a node that died (``mlxcel node supervise``; the node TOML's [restart]; docs/deploy.md "Supervision")
DEFAULT_NODE_RESTART_POLICY = "on-failure"  # or "never"
DEFAULT_NODE_RESTART_BACKOFF_S = 0.5  # the first restart's delay; it doubles with each quick failure in a row
DEFAULT_NODE_RESTART_BACKOFF_MAX_S = 30.0  # the delay never grows past this
DEFAULT_NODE_RESTART_LIMIT = 5  # restarts in a row, each run shorter than reset_s, before the supervisor gives up
# a run at least this long resets the delay and the count (systemd's StartLimitIntervalSec is 10 s by default too):
# a node that dies on its own within seconds of its start is a crash loop; one killed every 20 s is not
DEFAULT_NODE_RESTART_RESET_S = 10.0
DEFAULT_NODE_RESTART_STANDBY = True  # keep a warm mlxcel-server (imports done, nothing read or bound) for the restart
#: set by the supervisor on its standby: "<go fd>,<warm fd>" (mlxcel/commands/standby.py)
ENV_NODE_STANDBY_FDS = "MLXCEL_NODE_STANDBY_FDS"

# Stopping a server (SIGINT/SIGTERM): requests in flight may finish for this long, new ones are refused.
# Keep it below the supervisor's stop grace (DEFAULT_NODE_STOP_GRACE_S), or the drain is cut by SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 5.0

# Compute threads (``--threads``, ``MLXCEL_THREADS``; mlxcel/threads.py)
#: the families ``mlxcel models make-random`` builds (mlx-lm model_type names; mlxcel/models/random_checkpoint.py)
RANDOM_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma3_text", "deepseek_v3", "gpt_oss",
                   "glm4_moe", "qwen3_next", "gemma4_text", "qwen3_5", "ernie4_5", "hunyuan_v1_dense", "ministral3",
                   "minimax", "qwen3_5_moe", "ernie4_5_moe", "deepseek_v32", "kimi_k3")
#: the OpenAI port's API keys from the environment (a file of keys, or the keys themselves); see docs/server.md
ENV_KEY_FILE = "MLXCEL_API_KEY_FILE"
ENV_KEY = "MLXCEL_API_KEY"
THREADS_ENV = "MLXCEL_THREADS"  # the budget before the flags are read (applied when OpenBLAS loads)
MAX_THREADS = 256  # bound on a thread budget
# An idle OpenBLAS worker spins (sched_yield) for 2**N TSC cycles before it sleeps. OpenBLAS's own
# N = 28 (~0.1 s at 2.6 GHz) outlasts a pipeline stage's wait for its peers, so a waiting stage spun
# a whole core; N = 20 (~0.4 ms) still covers the gaps between the matrix products of one step.
# OPENBLAS_THREAD_TIMEOUT in the environment overrides it (OpenBLAS clamps it to 4..30).
BLAS_THREAD_TIMEOUT_LOG2 = 20


def thread_count(text: str) -> int:
    """argparse type: a thread budget, 1 to MAX_THREADS."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_THREADS}, got {value}")
    return value


# Tensor parallelism (``--tp-*``; mlxcel/parallel/, docs/tp.md)
DEFAULT_TP_SIZE = 1  # 1 = off
TP_BACKENDS = ("auto", "ring", "nccl", "jaccl")
TP_VOCAB_MODES = ("replicated", "vocab_parallel")  # --tp-embedding-mode, --tp-lm-head-mode (only replicated runs)
DEFAULT_TP_VOCAB_MODE = "replicated"
TP_MOE_MODES = ("expert_parallel", "within_expert")
DEFAULT_TP_MOE_MODE = "expert_parallel"
# --tp-reduce-dtype: the dtype of the partial sums every all-reduce carries ("model": the model's own
# dtype, no cast; measurements in docs/tp.md, "Fewer or smaller collectives")
TP_REDUCE_DTYPES = ("model", "bfloat16", "float32")
DEFAULT_TP_REDUCE_DTYPE = "model"
DEFAULT_TP_TIMEOUT_S = 30.0  # a rank silent this long, or a step this slow, ends every rank
DEFAULT_TP_HOSTFILE_PORT = 32323  # mlx.launch's default --starting-port
TP_MIN_JOIN_S = 60.0  # every rank joins (hello, then the MLX group) within max(this, 4 x --tp-timeout)
TP_STOP_GRACE_S = 5.0  # local followers told to stop get this long before SIGKILL
TP_MAX_HOSTS = 1024  # hosts in a --tp-hostfile
TP_MAX_ROWS = 4096  # bound on rows (and ranks) in a control message
TP_MAX_STEP_TOKENS = 1 << 20  # token ids in one step message
TP_MAX_CONTROL_TEXT = 1024  # UTF-8 bytes of a control message's text field (rid, identity, reason)
