"""The reference implementation's published numbers, shown beside ours as other hardware.

Source: the reference's documentation (mlxcel-distributed.md), "Threat model and per-frame
protection": the frame table ("Measurements", loopback on one NVIDIA GB10 host, 2026-10-27) and
the end-to-end greedy decode of the two-stage remote pipeline (qwen3-0.6b-4bit, 128 tokens, both
stages and the coordinator in one process over loopback, 5 interleaved runs). Rust, not Python,
on a different machine: context for our numbers, never a baseline for regressions.
"""

from __future__ import annotations

import pandas as pd

HARDWARE = "NVIDIA GB10 (one host, loopback), 2026-10-27"
SOURCE = "reference documentation, 'Threat model and per-frame protection'"

_KIB, _MIB = 1024, 1024 * 1024
_SIZES = (8 * _KIB, 64 * _KIB, _MIB, 2 * _MIB, 16 * _MIB)
_ITERS = (4000, 2000, 400, 200, 60)
# suite -> (mode label, [(p50, p95, p99) in microseconds per size], [one-way GiB/s per size])
_FRAME = {
    "unprotected": ("unprotected (baseline)", [(5.5, 5.6, 6.2), (11.1, 11.2, 12.0), (411, 418, 419),
                                               (1040, 1059, 1096), (16390, 16520, 16620)],
                    [1.38, 5.51, 2.37, 1.87, 0.95]),
    "hmac_sha256": ("candidate 1: HMAC-SHA256", [(12.2, 12.4, 12.9), (64.1, 64.8, 65.3), (1008, 1016, 1025),
                                                 (2115, 2150, 2216), (27220, 27560, 28290)],
                    [0.63, 0.95, 0.97, 0.92, 0.57]),
    "aes_256_gcm": ("candidate 2: AES-256-GCM (chosen)", [(7.4, 7.6, 8.2), (27.4, 27.9, 28.5), (422, 426, 434),
                                                          (926, 944, 954), (17930, 18090, 18380)],
                    [1.02, 2.23, 2.31, 2.10, 0.87]),
    "chacha20_poly1305": ("candidate 2: ChaCha20-Poly1305", [(14.0, 14.4, 14.9), (75.4, 76.2, 76.8),
                                                             (1192, 1204, 1220), (2479, 2489, 2504),
                                                             (30160, 30550, 30650)],
                          [0.56, 0.81, 0.82, 0.79, 0.52]),
}

# the two-stage remote pipeline: (row, runs, median of per-run medians, min, max) in tok/s
PIPELINE_MODEL = "qwen3-0.6b-4bit, 128 tokens, greedy; 2 stages + coordinator in one process over loopback"
_PIPELINE = (
    ("main 4144ecfb: unprotected, array-encoded tensors", 5, 68.3, 65.4, 72.7),
    ("main cfa14e7b: unprotected, array-encoded tensors", 5, 68.7, 60.7, 69.7),
    ("compact tensors, no protection (attribution only)", 5, 138.8, 136.5, 146.7),
    ("compact tensors, AES-256-GCM on every frame (shipped)", 5, 133.2, 122.2, 145.1),
)


def frame_table() -> pd.DataFrame:
    """The published frame table, one row per (suite, payload), with the overhead against unprotected."""
    rows = []
    for suite, (mode, lat, bw) in _FRAME.items():
        for size, iters, (p50, p95, p99), gib in zip(_SIZES, _ITERS, lat, bw):
            base = _FRAME["unprotected"][1][_SIZES.index(size)][0]
            rows.append({"suite": suite, "mode": mode, "payload_bytes": size, "iterations": iters,
                         "p50_us": p50, "p95_us": p95, "p99_us": p99, "one_way_gib_s": gib,
                         "overhead_vs_unprotected": p50 / base, "hardware": HARDWARE})
    return pd.DataFrame(rows)


def pipeline_table() -> pd.DataFrame:
    """The published pipeline decode rows (tok/s): 133.2 protected against 138.8 unprotected."""
    return pd.DataFrame([{"variant": v, "runs": n, "tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi,
                          "model": PIPELINE_MODEL, "hardware": HARDWARE} for v, n, med, lo, hi in _PIPELINE])
