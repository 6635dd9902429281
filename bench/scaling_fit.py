"""The scaling benchmark's arithmetic: least-squares fits with their spread, and what they predict.

``fit(xs, ys, degree)`` (mlxcel/report/fits.py, shared with the report) is ordinary least squares
of a polynomial with the standard error of every coefficient (from the residual variance,
n - degree - 1 degrees of freedom; None where there are no degrees of freedom left).
``predict_hosts`` turns the per-unit costs measured on loopback into ms/token, bring-up time and
bytes, and router load for a cluster of H hosts on a network described by ``Network`` (10 GbE by
default), and names the first limit (docs/benchmarks.md, "How cost grows").
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from mlxcel.report.fits import Fit, fit  # noqa: F401  (re-exported: the bench's fits)

PUSH_OFFER_WINDOW_S = 50.0  # mlxcel.bringup.wire: PUSH_WINDOW_S - OFFER_MARGIN_S


@dataclass(frozen=True)
class Network:
    """The network a prediction assumes: one-way latency per hop and bandwidth per link."""

    name: str = "10GbE"
    latency_ms: float = 0.05  # one-way, host to host through one switch, kernel TCP (a loopback hop has ~0.01)
    gbit_s: float = 10.0

    def wire_ms(self, nbytes: float) -> float:
        """One message of ``nbytes`` on this link: latency plus serialization."""
        return self.latency_ms + nbytes * 8 / (self.gbit_s * 1e9) * 1e3


@dataclass(frozen=True)
class Costs:
    """Per-unit costs from the fits (milliseconds and seconds as named)."""

    single_ms: float  # ms/token of the whole model at 1 stream (the pipeline fit's intercept + one hop)
    hop_ms: float  # loopback ms/token per added stage (the pipeline fit's slope)
    hop_bytes: float  # bytes on the wire per hop per token (hidden x dtype + framing)
    bringup_s0: float  # bring-up seconds, fixed part
    bringup_s_per_peer: float
    bringup_bytes: Fit  # bytes vs peers (degree 2: every offer carries the whole plan)
    push_s0: float  # the push alone (reach, offer, commit, activate), fixed part
    push_s_per_peer: float
    router_cpu_s_per_request: float  # router CPU per request (idle probes subtracted), at the largest topology
    router_cpu_s_per_node_s: float  # router CPU per second per node (health probes), from the idle rate
    router_added_ms_p95: float
    coord_cpu_s_per_token0: float = 0.0  # the coordinator's CPU per token at --streams streams: fixed part
    coord_cpu_s_per_token_per_stage: float = 0.0  # ... and per stage
    loopback_latency_ms: float = 0.01


def _router_load(costs: Costs, hosts: int, streams: int, request_tokens: int) -> dict[str, float]:
    """hosts/2 decode nodes of ``streams`` streams, each request ``request_tokens`` x single ms long, against one
    router core less what its health probes take."""
    probe_cores = costs.router_cpu_s_per_node_s * hosts
    per_request = costs.router_cpu_s_per_request
    capacity = max(1 - probe_cores, 0.0) / per_request if per_request > 0 else math.inf
    demand = max(hosts // 2, 1) * streams * 1e3 / (request_tokens * costs.single_ms)
    return {"router_probe_cores": probe_cores, "router_max_rps": capacity, "router_demand_rps": demand}


def predict_hosts(costs: Costs, hosts: int, network: Network = Network(), streams: int = 8,
                  request_tokens: int = 256) -> dict[str, Any]:
    """What the loopback costs predict for ``hosts`` hosts on ``network``.

    Pipeline (one stage per host): ms/token at 1 stream = single + hosts x hop, a hop being the loopback
    hop less loopback latency plus ``network.wire_ms(hop_bytes)``; ``streams`` streams keep at most
    ``streams`` tokens in flight, so tok/s = min(streams, hosts) / (ms/token). Bring-up: the linear time
    and push fits and the quadratic bytes fit at ``hosts`` peers. Router: ``_router_load``. Coordinator:
    its CPU per token (fit over the stages) x tok/s, in cores. Each limit is the share of its budget used
    (1.0: the limit): the coordinator's one core (one GIL), the router's one core, the 50 s in which the
    push must reach and offer every peer; the first limit is the largest share. ``hop_share`` (hop time
    over compute time per token) is the latency cost, not a limit.
    """
    hop = max(costs.hop_ms - costs.loopback_latency_ms, 0.0) + network.wire_ms(costs.hop_bytes)
    ms_token = costs.single_ms + hosts * hop
    tok_s_n = min(streams, hosts) * 1e3 / ms_token
    push_s = costs.push_s0 + costs.push_s_per_peer * hosts
    bringup_bytes = costs.bringup_bytes.at(hosts)
    router = _router_load(costs, hosts, streams, request_tokens)
    coord_cores = (costs.coord_cpu_s_per_token0 + costs.coord_cpu_s_per_token_per_stage * hosts) * tok_s_n
    capacity = router["router_max_rps"]
    limits = {"coordinator CPU": coord_cores,
              "router CPU": router["router_demand_rps"] / capacity if capacity else math.inf,
              "bring-up fan-out": push_s / PUSH_OFFER_WINDOW_S}
    return {"hosts": hosts, "network": network.name, "hop_ms": hop, "ms_per_token_1": ms_token,
            "tok_s_1": 1e3 / ms_token, f"tok_s_{streams}": tok_s_n,
            "bringup_s": costs.bringup_s0 + costs.bringup_s_per_peer * hosts, "bringup_bytes": bringup_bytes,
            "bringup_wire_s": bringup_bytes * 8 / (network.gbit_s * 1e9), "push_s": push_s, **router,
            "coordinator_cores": coord_cores, "hop_share": hosts * hop / max(costs.single_ms, 1e-9),
            "router_added_ms_p95": costs.router_added_ms_p95, "limit_ratios": limits,
            "first_limit": max(limits, key=lambda k: limits[k]), "assumptions": asdict(network)}


# -- from rows to costs ---------------------------------------------------------------------------


def _of(rows: list[dict[str, Any]], bench: str, **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("bench") == bench and all(r.get(k) == v for k, v in match.items())]


def _xy(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def fits_of(rows: list[dict[str, Any]]) -> dict[str, Fit]:
    """Every fit the rows allow: ``ms_per_token`` vs stages (S >= 2: the single node is the S=1 baseline,
    not a pipeline), the coordinator's CPU per token vs stages (the concurrent level), ``ready_s`` and
    ``push_s`` vs peers (linear), ``wire_bytes`` vs peers (quadratic), router CPU per request and added
    p95 vs nodes (linear)."""
    specs = [("pipeline_ms_per_token", [r for r in _of(rows, "scaling_pipeline", streams=1) if r["stages"] >= 2],
              "stages", "ms_per_token", 1),
             ("coordinator_cpu_s_per_token", [{**r, "cpu_per_token": r["cpu_s_coordinator"] / r["tokens"]}
                                              for r in rows if r.get("bench") == "scaling_pipeline" and r["stages"] >= 2
                                              and r["streams"] > 1 and r.get("cpu_s_coordinator") is not None
                                              and r.get("tokens")], "stages", "cpu_per_token", 1),
             ("bringup_ready_s", _of(rows, "scaling_bringup"), "peers", "ready_s", 1),
             ("bringup_push_s", _of(rows, "scaling_bringup"), "peers", "push_s", 1),
             ("bringup_wire_bytes", _of(rows, "scaling_bringup"), "peers", "wire_bytes", 2),
             ("router_cpu_s_per_request", _of(rows, "scaling_router"), "nodes", "router_cpu_s_per_request", 1),
             ("router_added_ms_p95", _of(rows, "scaling_router"), "nodes", "added_ms_p95", 1),
             ("router_idle_cpu_s_per_s", _of(rows, "scaling_router"), "nodes", "router_idle_cpu_s_per_s", 1)]
    out = {}
    for name, subset, x, y, degree in specs:
        xs, ys = _xy(subset, x, y)
        if len(set(xs)) > degree:
            out[name] = fit(xs, ys, degree)
    return out


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def costs_of(rows: list[dict[str, Any]], fits: dict[str, Fit], hop_bytes: float) -> Costs | None:
    """The per-unit costs a prediction needs, or None until every mode has a fit."""
    need = ("pipeline_ms_per_token", "bringup_ready_s", "bringup_push_s", "bringup_wire_bytes",
            "router_cpu_s_per_request", "router_idle_cpu_s_per_s")
    if any(n not in fits for n in need):
        return None
    single = _median([r["ms_per_token"] for r in _of(rows, "scaling_pipeline", streams=1, stages=1)])
    pipe = fits["pipeline_ms_per_token"]
    widest = max(r["nodes"] for r in _of(rows, "scaling_router"))
    coord = fits.get("coordinator_cpu_s_per_token")
    return Costs(single_ms=single if single is not None else pipe.at(1), hop_ms=pipe.slope, hop_bytes=hop_bytes,
                 bringup_s0=fits["bringup_ready_s"].intercept, bringup_s_per_peer=fits["bringup_ready_s"].slope,
                 bringup_bytes=fits["bringup_wire_bytes"], push_s0=fits["bringup_push_s"].intercept,
                 push_s_per_peer=fits["bringup_push_s"].slope,
                 router_cpu_s_per_request=fits["router_cpu_s_per_request"].at(widest),
                 router_cpu_s_per_node_s=max(fits["router_idle_cpu_s_per_s"].slope, 0.0),
                 router_added_ms_p95=_median([r["added_ms_p95"] for r in _of(rows, "scaling_router",
                                                                               nodes=widest)]) or 0.0,
                 coord_cpu_s_per_token0=coord.intercept if coord else 0.0,
                 coord_cpu_s_per_token_per_stage=coord.slope if coord else 0.0)


def activation_bytes(hidden: int, dtype_bytes: int = 2, framing: int = 64) -> float:
    """Bytes one token's activation puts on a hop: hidden x dtype plus frame header, GCM tag and message header
    (about 64 bytes, docs/protocol.md)."""
    return hidden * dtype_bytes + framing


def fit_file(path: Path, hidden: int = 3584, dtype_bytes: int = 2, hosts: Sequence[int] = (16, 64),
             **override: float) -> dict[str, Any]:
    """Fit the rows of ``path``, predict ``hosts`` on 10 GbE with activations of ``hidden`` x ``dtype_bytes``
    (Qwen2.5-7B in bfloat16 by default), and write ``scaling_fit.json`` beside it; returns what it wrote.
    ``override`` replaces measured costs by name (``single_ms=7.2, hop_ms=6.3``: another device's step and hop)."""
    data = Path(path).read_bytes()
    text = (gzip.decompress(data) if str(path).endswith(".gz") else data).decode()  # bench.pack_results gzips
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    fits = fits_of(rows)
    costs = costs_of(rows, fits, activation_bytes(hidden, dtype_bytes))
    if costs is not None and override:
        costs = replace(costs, **override)
    out = {"rows": str(path), "fits": {k: f.row(k) for k, f in fits.items()},
           "assumed_model": {"hidden": hidden, "dtype_bytes": dtype_bytes}, "overrides": override or None,
           "costs": asdict(costs) if costs else None,
           "predictions": [predict_hosts(costs, h) for h in hosts] if costs else None,
           "missing": None if costs else "a prediction needs pipeline, bringup and router rows (2+ sizes each)"}
    (Path(path).parent / "scaling_fit.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out
