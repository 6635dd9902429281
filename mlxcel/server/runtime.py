"""What a server holds while it runs: its configuration, readiness, and the engine once loaded.

The model loads and warms up on a background thread after the socket is
bound, so /health can answer 503 meanwhile; a load failure is fatal.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mlxcel import envs
from mlxcel.config import DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_QUEUE, DEFAULT_PARALLEL, DEFAULT_PREFIX_CACHE_MB
from mlxcel.engine.interface import Engine, EngineUnavailable
from mlxcel.models.facts import context_length

log = logging.getLogger("mlxcel.server")

# Test and rehearsal aid: hold readiness this many seconds after warmup (simulates a slow warmup).


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    served_model_name: str
    parallel: int = DEFAULT_PARALLEL
    max_batch_size: int = DEFAULT_PARALLEL
    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout: float | None = None
    warmup: bool = True
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB
    lazy_weights: bool = False  # a pipeline coordinator holds no layers: never read the weights
    kv_bits: int | None = None  # --kv-bits: quantized KV cache (mlxcel.engine.kv_quant); None = full precision
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE

    def apply_kv_bits(self, model: Any) -> None:
        """Make ``model`` build quantized KV caches where --kv-bits asks (``KVBitsError``, a CLIError: refused)."""
        from mlxcel.engine.kv_quant import kv_quant, use_kv_bits

        use_kv_bits(model, kv_quant(self.kv_bits, self.kv_group_size))



EngineFactory = Callable[[Any, Any, int, ServerConfig], Engine]


def local_engine(model: Any, tokenizer: Any, ctx: int, config: ServerConfig) -> Engine:
    """The default backend: continuous batching on this host."""
    from mlxcel.engine.scheduler import local_scheduler

    engine = local_scheduler(model, tokenizer, context_length=ctx, parallel=config.parallel,
                             max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                             warmup=config.warmup, prefix_cache_bytes=config.prefix_cache_mb << 20)
    engine.start().wait_ready()
    return engine


class ServerRuntime:
    """Readiness state machine: loading -> warming -> ready, or failed; closed at shutdown."""

    def __init__(self, config: ServerConfig, engine_factory: EngineFactory = local_engine):
        self.config = config
        self._factory = engine_factory
        self.state = "loading"
        self.error: str | None = None
        self.engine: Engine | None = None
        # temperature/top_p/top_k the checkpoint recommends, for requests that name none
        self.sampling_defaults: dict[str, float | int] = {}
        self.created = int(time.time())
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def require_engine(self) -> Engine:
        if self.state != "ready" or self.engine is None:
            raise EngineUnavailable(f"the model is not ready yet ({self.state}); retry shortly")
        return self.engine

    def start_loading(self, on_fatal: Callable[[str], None]) -> None:
        self._thread = threading.Thread(target=self._load, args=(on_fatal,), name="mlxcel-load", daemon=True)
        self._thread.start()

    def _load(self, on_fatal: Callable[[str], None]) -> None:
        from mlxcel.cluster.errors import ClusterError
        from mlxcel.engine.executor import ExecutorError
        from mlxcel.errors import CLIError
        from mlxcel.models.errors import ModelError
        from mlxcel.models.loading import load_checkpoint

        start = time.perf_counter()
        try:
            loaded = load_checkpoint(self.config.model, lazy=self.config.lazy_weights)
            self.config.apply_kv_bits(loaded.model)
            self.sampling_defaults = loaded.sampling_defaults()
            self._describe(loaded)
            self.state = "warming" if self.config.warmup else "starting"
            self.engine = self._factory(loaded.model, loaded.tokenizer, context_length(loaded.config), self.config)
        except (ModelError, ExecutorError, ClusterError, CLIError) as exc:
            self._fail(str(exc), on_fatal)
            return
        except Exception as exc:  # anything else a broken checkpoint raises: still one line, still fatal
            self._fail(f"{self.config.model}: cannot load checkpoint: {exc}", on_fatal)
            return
        delay = envs.settings().test_warmup_delay_s  # test only: a slow load
        if delay and self.config.warmup:
            time.sleep(delay)
        self.state = "ready"
        log.info("model %s ready in %.1fs", self.config.served_model_name, time.perf_counter() - start)

    def _describe(self, loaded: Any) -> None:
        """One line saying what is being served and how: family, weights, device, BLAS, sampling."""
        import mlx.core as mx

        from mlxcel.blas import blas_in_use

        log.info("model %s: %s, %d layers | weights: %s | device: %s | blas: %s | default sampling: %s",
                 self.config.served_model_name, loaded.model_type, loaded.num_layers, loaded.describe_weights(),
                 mx.default_device(), blas_in_use(), self.sampling_defaults or "OpenAI's (temperature 1, top_p 1)")

    def _fail(self, message: str, on_fatal: Callable[[str], None]) -> None:
        self.state = "failed"
        self.error = message.strip().splitlines()[0] if message.strip() else "cannot load the model"
        on_fatal(self.error)

    def close(self) -> None:
        self.state = "closed"
        if self.engine is not None:
            self.engine.close()
