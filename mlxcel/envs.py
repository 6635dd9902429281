"""Every ``MLXCEL_*`` environment variable, once: name, parser, default, doc and owner (issue 41).

``Settings`` is the table: each field is one variable (``var`` puts the name, parser, doc and owner in the
field's metadata, the default in the field). ``settings()`` parses the whole table from the process
environment once and caches the typed result; components read their values there (or receive them), never
``os.environ``. A bad value is an ``EnvError`` naming the variable; ``mlxcel serve`` and ``mlxcel generate``
call ``check()`` before anything loads, so it is refused before any checkpoint is read.

``read(environ)`` parses a given mapping (tests, a child's environment); ``reload()`` drops the cache (a test
that changed the environment). ``get(name, environ)`` parses one variable: only for code that runs before the
command line is read and must not fail on another variable (the BLAS load at import). ``take(name)`` reads a
variable handed to this process alone and removes it, so no child inherits it.

Variables marked ``test_only`` are test and rehearsal aids (a slow stage, decode node or warm-up); nothing in
production sets them. ``docs/settings.md`` holds the table ``markdown_table()`` generates (a test compares).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, Callable, Iterator, Mapping

from mlxcel.config import thread_count
from mlxcel.errors import CLIError

Parser = Callable[[str, str], Any]  # (name, raw text) -> value; ValueError naming the variable

MAX_CRYPTO_WORKERS = 64
MAX_CRYPTO_PIPELINE_MIN_LEN = 1 << 40
MAX_INTAKE_WORKERS = 64
MAX_HANDOFF_LANES = 16
MAX_HANDOFF_SPLIT_MIN_BYTES = 1 << 40
MAX_SWITCH_INTERVAL_MS = 100.0
MAX_TEST_DELAY_S = 3600.0
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable with a value its parser refuses (the message names it)."""


@dataclass(frozen=True)
class Variable:
    """One row of the table."""

    name: str
    field: str
    parse: Parser
    default: Any
    doc: str
    owner: str
    secret: bool = False
    test_only: bool = False


# -- parsers: (name, raw) -> value; blank text is the default unless a parser says otherwise ----------------

def switch(name: str, raw: str) -> bool | None:
    """1/0 (also true/false, yes/no, on/off, any case); blank: None (the component's own default)."""
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"{name} must be 1 or 0, got {value!r}")


def number(kind: Callable[[str], float], low: float, high: float, what: str) -> Parser:
    """A number (``kind``: int or float) within ``[low, high]``; blank: None."""

    def parse(name: str, raw: str) -> float | None:
        text = raw.strip()
        if not text:
            return None
        try:
            value = kind(text)
        except ValueError:
            raise EnvError(f"{name} must be {what}, not {text!r}") from None
        if not low <= value <= high:
            raise EnvError(f"{name} must be from {low:g} to {high:g}, not {text}")
        return value

    return parse


def delay(name: str, raw: str) -> float:
    """Seconds, 0 to an hour; blank: 0."""
    value = number(float, 0.0, MAX_TEST_DELAY_S, "a number of seconds")(name, raw)
    return 0.0 if value is None else float(value)


def threads(name: str, raw: str) -> int | None:
    """A thread budget, 1 to ``config.MAX_THREADS``; blank: None."""
    text = raw.strip()
    if not text:
        return None
    try:
        return thread_count(text)
    except argparse.ArgumentTypeError as exc:
        raise EnvError(f"{name}: {exc}") from None


def text(name: str, raw: str) -> str:
    """The value as given (blank included: a component may refuse an empty one itself)."""
    return raw


def stripped(name: str, raw: str) -> str | None:
    """The value without surrounding blanks; blank: None."""
    return raw.strip() or None


def verbose(name: str, raw: str) -> bool:
    """True for 1/true/yes/on (any case), False for anything else (documented: no value is refused)."""
    return raw.strip().lower() in _TRUE


def var(name: str, parse: Parser, doc: str, owner: str, default: Any = None, *, secret: bool = False,
        test_only: bool = False) -> Any:
    """A ``Settings`` field: the variable's default, with its name, parser, doc and owner as metadata."""
    meta = {"env": Variable(name, "", parse, default, doc, owner, secret, test_only)}
    return field(default=default, repr=not secret, metadata=meta)


_CRYPTO = "mlxcel/cluster/aead_pipeline.py"


@dataclass(frozen=True)
class Settings:
    """The parsed environment: one typed field per ``MLXCEL_*`` variable (None: unset, the component decides)."""

    # compute threads and the BLAS (read before the command line)
    threads: int | None = var("MLXCEL_THREADS", threads, "thread budget of the process when --threads is not given "
                              "(1 to 256); unset: every core but one", "mlxcel/threads.py")
    blas: str | None = var("MLXCEL_BLAS", stripped, "`reference` keeps MLX's reference BLAS instead of loading "
                           "OpenBLAS (other values are ignored)", "mlxcel/blas.py")
    blas_dir: str | None = var("MLXCEL_BLAS_DIR", stripped, "directory of another OpenBLAS to load "
                               "(libopenblas.so.0 in it, or in its lib/ or usr/lib/)", "mlxcel/blas.py")
    switch_interval_ms: float | None = var(
        "MLXCEL_SWITCH_INTERVAL_MS", number(float, 0.01, MAX_SWITCH_INTERVAL_MS, "a number of milliseconds"),
        "GIL switch interval of a prefill or decode node (0.01 to 100 ms); unset: 0.5 ms", "mlxcel/threads.py")
    # the authenticated transport
    crypto_workers: int | None = var(
        "MLXCEL_CRYPTO_WORKERS", number(int, 0, MAX_CRYPTO_WORKERS, "a whole number"),
        "AES-GCM helper threads per transport (0 to 64); unset: 2 on 4+ usable cores, else 0", _CRYPTO)
    crypto_pipeline_min_len: int | None = var(
        "MLXCEL_CRYPTO_PIPELINE_MIN_LEN", number(int, 0, MAX_CRYPTO_PIPELINE_MIN_LEN, "a whole number"),
        "smallest message (bytes, 0 to 2^40) the crypto helpers take; unset: 4 MiB", _CRYPTO)
    cluster_secret_file: str | None = var("MLXCEL_CLUSTER_SECRET_FILE", text, "file holding the cluster secret "
                                          "(after --cluster-secret-file)", "mlxcel/cluster/secret.py")
    cluster_secret: str | None = var("MLXCEL_CLUSTER_SECRET", text, "the cluster secret itself (prefer the "
                                     "_FILE variable; both set is an error)", "mlxcel/cluster/secret.py",
                                     secret=True)
    # the OpenAI port
    api_key_file: str | None = var("MLXCEL_API_KEY_FILE", text, "file of accepted API keys (after --api-key-file)",
                                   "mlxcel/server/access.py")
    api_key: str | None = var("MLXCEL_API_KEY", text, "accepted API keys themselves (prefer the _FILE variable; "
                              "both set is an error)", "mlxcel/server/access.py", secret=True)
    node_standby_fds: str | None = var("MLXCEL_NODE_STANDBY_FDS", text, "internal: `<go fd>,<warm fd>` the node "
                                       "supervisor gives its warm standby (removed on read)",
                                       "mlxcel/commands/standby.py")
    # the scheduler
    batch_tails: bool | None = var("MLXCEL_BATCH_TAILS", switch, "1/0: prompt tails ride the decode steps; unset: "
                                   "where scheduling is asynchronous", "mlxcel/engine/scheduler.py")
    async_sched: bool | None = var("MLXCEL_ASYNC_SCHED", switch, "1/0: plan step N+1 while step N runs; unset: on "
                                   "a GPU", "mlxcel/engine/executor.py")
    layer_overlap: bool | None = var("MLXCEL_LAYER_OVERLAP", switch, "1/0: a pipeline stage queues each layer of "
                                     "a decode step as it is built; unset: on a CPU", "mlxcel/engine/executor.py")
    step_trace: str | None = var("MLXCEL_STEP_TRACE", stripped, "JSONL file the scheduler thread's per-pass "
                                 "timeline is appended to; unset: off", "mlxcel/engine/steptrace.py")
    # disaggregated prefill/decode
    decode_allowlist: str | None = var("MLXCEL_DECODE_ALLOWLIST", text, "prefill: the decode nodes (host:port, "
                                       "comma-separated) a KV cache may go to; unset: any router-chosen one",
                                       "mlxcel/disagg/allowlist.py")
    router_stats_verbose: bool = var("MLXCEL_ROUTER_STATS_VERBOSE", verbose, "router: 1/true/yes/on shows node "
                                     "addresses in /stats (else redacted)", "mlxcel/entrypoints/router.py", False)
    handoff_copy: bool | None = var("MLXCEL_HANDOFF_COPY", switch, "decode: 1 receives handoffs into numpy "
                                    "buffers copied at import; unset or 0: into MLX memory", "mlxcel/disagg/kv_cache.py")
    handoff_staging: bool | None = var("MLXCEL_HANDOFF_STAGING", switch, "1/0: handoffs through page-locked host "
                                       "buffers; unset: on CUDA only", "mlxcel/disagg/host_staging.py")
    handoff_intake_workers: int | None = var(
        "MLXCEL_HANDOFF_INTAKE_WORKERS", number(int, 0, MAX_INTAKE_WORKERS, "a whole number"),
        "decode: threads feeding handoff parts to their decoders (0 to 64); unset: a quarter of 4+ cores, at "
        "most 4", "mlxcel/disagg/intake.py")
    handoff_lanes: int | None = var(
        "MLXCEL_HANDOFF_LANES", number(int, 1, MAX_HANDOFF_LANES, "a whole number"),
        "prefill: connections to one decode node handoffs spread over (1 to 16); unset: a quarter of 4+ cores, "
        "at most 4", "mlxcel/disagg/lanes.py")
    handoff_split_min_bytes: int | None = var(
        "MLXCEL_HANDOFF_SPLIT_MIN_BYTES", number(int, 1, MAX_HANDOFF_SPLIT_MIN_BYTES, "a whole number"),
        "prefill: a handoff of at least this many tensor bytes is split over every lane (1 to 2^40); unset: "
        "16777216 (16 MiB)", "mlxcel/disagg/lanes.py")
    # test and rehearsal aids
    test_stage_step_delay_s: float = var("MLXCEL_TEST_STAGE_STEP_DELAY_S", delay, "a pipeline stage "
                                         "sleeps this long before every step", "mlxcel/entrypoints/stage.py", 0.0,
                                         test_only=True)
    test_decode_step_delay_s: float = var("MLXCEL_TEST_DECODE_STEP_DELAY_S", delay, "a decode node "
                                          "sleeps this long before every decode step", "mlxcel/disagg/decode.py",
                                          0.0, test_only=True)
    test_warmup_delay_s: float = var("MLXCEL_TEST_WARMUP_DELAY_S", delay, "the server sleeps this long "
                                     "before its warm-up (a slow load)", "mlxcel/server/runtime.py", 0.0,
                                     test_only=True)


def _variables() -> tuple[Variable, ...]:
    out = []
    for f in fields(Settings):
        v: Variable = f.metadata["env"]
        out.append(Variable(v.name, f.name, v.parse, v.default, v.doc, v.owner, v.secret, v.test_only))
    return tuple(out)


VARIABLES: tuple[Variable, ...] = _variables()
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def _parse(v: Variable, environ: Mapping[str, str]) -> Any:
    raw = environ.get(v.name)
    if raw is None:
        return v.default
    value = v.parse(v.name, raw)
    return v.default if value is None else value


def read(environ: Mapping[str, str]) -> Settings:
    """Every variable of ``environ`` parsed; ``EnvError`` names the first bad one (in table order)."""
    return Settings(**{v.field: _parse(v, environ) for v in VARIABLES})


@cache
def settings() -> Settings:
    """The process environment's settings, parsed once (``reload`` reparses)."""
    return read(os.environ)


def reload() -> None:
    """Drop the cached settings: the next ``settings()`` parses the environment again (tests; a process that
    changed its own environment)."""
    settings.cache_clear()


def check() -> Settings:
    """The settings, or ``CLIError`` naming the first bad variable: what ``mlxcel serve`` and ``mlxcel generate``
    call before anything loads (``mlxcel: error: MLXCEL_ASYNC_SCHED must be 1 or 0, got 'later'``)."""
    try:
        return settings()
    except EnvError as exc:
        raise CLIError(str(exc)) from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One variable parsed (``EnvError`` if bad); KeyError for a name not in the table."""
    return _parse(BY_NAME[name], os.environ if environ is None else environ)


def take(name: str) -> str | None:
    """A variable handed to this process alone: its text, removed from the environment (no child inherits it)."""
    BY_NAME[name]  # noqa: B018 - only table variables
    return os.environ.pop(name, None)


def _rows() -> Iterator[str]:
    for v in VARIABLES:
        default = "unset" if v.default is None else f"`{v.default!r}`" if not isinstance(v.default, str) else v.default
        flags = ", ".join(x for x, on in (("secret", v.secret), ("test only", v.test_only)) if on)
        yield f"| `{v.name}` | {v.doc}{f' ({flags})' if flags else ''} | {default} | `{v.owner}` |"


def markdown_table() -> str:
    """The table for docs/settings.md (a test compares the file's copy)."""
    head = "| variable | meaning | default | read by |\n|---|---|---|---|"
    return "\n".join([head, *_rows()]) + "\n"

