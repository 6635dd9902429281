"""Prometheus metrics: request outcomes and latencies from the HTTP side, engine gauges read at scrape time.

Each app gets its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: they double the exposition for nothing we use
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_ENGINE_GAUGES = {
    "waiting": ("mlxcel_queue_depth", "Requests queued, not yet admitted to the batch"),
    "running": ("mlxcel_running_sequences", "Sequences admitted to the engine (prefilling or decoding)"),
    "decoding": ("mlxcel_batch_size", "Rows in the most recent decode step"),
    "parallel": ("mlxcel_parallel_slots", "Configured concurrent sequences (--parallel)"),
    "max_batch_size": ("mlxcel_max_batch_size", "Configured rows per decode step (--max-batch-size)"),
    "prefix_bytes": ("mlxcel_prefix_cache_bytes", "Bytes of KV cache kept for prefix reuse"),
    "inflight_steps": ("mlxcel_inflight_steps", "Steps (prefill chunks or decode micro-batches) in flight now"),
    "micro_batch_size": ("mlxcel_micro_batch_size", "Rows per decode micro-batch"),
    "pipeline_depth": ("mlxcel_pipeline_depth", "Steps that may be in flight at once (pipeline stages)"),
    "stages_down": ("mlxcel_pipeline_stages_down", "Pipeline stages that do not answer now"),
    "held": ("mlxcel_held_requests", "New requests held now: a pipeline stage (or, on a router, every node of a "
                                     "role) is down, they start once it is back (at most --resume-timeout)"),
}
_ENGINE_COUNTERS = {
    "decode_steps": ("mlxcel_decode_steps", "Batched decode steps run"),
    "decode_rows": ("mlxcel_decode_rows", "Sequence-steps decoded (sum of batch sizes over steps)"),
    "shared_steps": ("mlxcel_decode_shared_steps", "Decode steps that served two or more sequences"),
    "prefix_hits": ("mlxcel_prefix_cache_hits", "Prompts that started from a cached prefix"),
    "prefix_tokens": ("mlxcel_prefix_cache_reused_tokens", "Prompt tokens taken from the prefix cache, not prefilled"),
    "overlapped_steps": ("mlxcel_overlapped_steps", "Steps submitted while another was in flight (micro-batching)"),
    "failed_steps": ("mlxcel_failed_steps", "Steps that failed (their requests ended with an error or were resumed)"),
    "resumed": ("mlxcel_resumed_requests", "Requests resumed after a node failure: prompt + tokens prefilled again, "
                                           "the stream continued"),
    "resume_failed": ("mlxcel_resume_failed_requests", "Requests that waited to resume after a node failure and "
                                                       "failed (503): bounds spent or no node took them"),
    "holds": ("mlxcel_requests_held", "New requests held because a pipeline stage was down when they arrived"),
    "hold_failed": ("mlxcel_hold_failed_requests", "Held requests that failed (503): no stage back within "
                                                   "--resume-timeout"),
    "wire_frames": ("mlxcel_pipeline_frames", "Cluster frames the coordinator sent and received for pipeline steps"),
    "wire_bytes": ("mlxcel_pipeline_wire_bytes", "Payload bytes the coordinator sent and received for pipeline steps"),
    "stage_overlapped": ("mlxcel_pipeline_stage_overlapped_steps", "Steps the pipeline stages built while an earlier "
                                                                  "one still ran on the device (their last STATE)"),
}
#: a router's metrics (docs/disagg.md §8): gauges under their /router/stats names, only where the engine reports them
_ROUTER_GAUGES = {
    "router_requests": "Requests the router accepted",
    "router_completed": "Requests that finished without an error",
    "router_failed": "Requests that ended with an error",
    "router_cancelled": "Requests whose client went away",
    "router_failovers": "Attempts dispatched again to other nodes",
    "router_unavailable": "Requests refused at once because no prefill or decode node was up",
    "router_dropped_frames": "Result frames dropped (unknown sender, unassigned request, malformed)",
    "router_handoffs": "KV handoffs the prefill nodes reported",
    "router_handoff_bytes": "Bytes of every KV handoff stream",
    "router_handoff_seconds": "Seconds of every KV handoff stream",
    "router_handoff_bytes_last": "Bytes of the last KV handoff stream",
    "router_handoff_seconds_last": "Seconds of the last KV handoff stream",
    "router_handoff_seconds_max": "Seconds of the slowest KV handoff stream",
    "router_prefill_seconds": "Seconds from GENERATE received to first token, summed over handoffs",
    "router_resumed": "Resumed attempts dispatched: a request's prompt plus its streamed tokens prefilled again",
    "router_resume_failed": "Requests that could not be resumed within --resume-timeout (503)",
    "router_early_first": "First tokens the prefill nodes sent early (relayed before the KV handoff arrived)",
    "router_held": "New requests held now: no prefill or no decode node is up (at most --resume-timeout each)",
    "router_holds": "New requests ever held because no prefill or no decode node was up",
    "router_hold_failed": "Held requests that failed (503): no node of a role up within --resume-timeout",
    "router_prefix_hits": "Requests sent to a prefill node expected to hold a prefix of their prompt (--route-policy "
                          "prefix)",
    "router_prefix_misses": "Requests whose prompt no prefill node up was expected to hold a prefix of (--route-policy "
                            "prefix)",
    "router_prefix_tokens": "Prompt tokens the prefill nodes picked were expected to hold (prefix blocks matched x 64)",
    "router_prefill_up": "Prefill nodes up now",
    "router_decode_up": "Decode nodes up now",
    "router_in_flight": "Requests in flight now",
}


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, float] | None]):
        self._stats = stats

    def collect(self):
        stats = self._stats() or {}
        for key, (name, doc) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for name, doc in _ROUTER_GAUGES.items():
            if name in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[name]))


class ServerMetrics:
    """The metrics one server exposes on /metrics."""

    def __init__(self, engine_stats: Callable[[], dict[str, float] | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxcel_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mlxcel_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.completion_tokens = Counter("mlxcel_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("mlxcel_time_to_first_token_seconds", "Time from request to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mlxcel_inter_token_latency_seconds", "Time between consecutive tokens of a stream",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mlxcel_request_duration_seconds", "Time from request to last token",
                             buckets=_TTFT_BUCKETS, registry=r)
        self.finished = Counter("mlxcel_finished_requests", "Generations ended, by finish reason",
                                ["reason"], registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
