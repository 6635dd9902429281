"""One tiny ``make-random`` checkpoint per family, built once per test session and shared by the family tables.

``family_checkpoint`` is a session fixture: ``family_checkpoint("qwen3_next")`` is the path of a 4-layer
checkpoint of that family (``mlxcel models make-random --family F``: mlx-lm's own classes, the real
tokenizer files). Import it into a test module to use it (``from tests.family_checkpoints import
family_checkpoint  # noqa: F401``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import pytest

#: one family per mechanism, whose rows of the remote family tables (tests/pipeline/test_families_remote.py,
#: tests/disagg/test_families.py) run real ``mlxcel-server`` processes; the other families' nodes run in
#: ``tests/node_host.py`` (docs/models.md, "Where each family is tested")
SERVER_FAMILIES: dict[str, str] = {
    "qwen3_next": "linear attention (gated delta net state) beside full attention, MoE",
    "deepseek_v3": "MLA (latent KV cache, array masks), dense leading layer, MoE",
    "gemma3_text": "gemma: scaled embedding, sliding-window layers (rotating caches)",
    "kimi_k3": "attention-residual blocks crossing the stage boundary, Kimi Delta Attention, NoPE MLA",
    "gpt_oss": "attention sinks, sliding / full layers, MoE",
}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_random_checkpoint(tmp_path_factory.mktemp(f"family-{family}"), family=family, layers=4)
        return made[family]

    return get


def start_together(clusters: Iterable, start_s: float = 300.0) -> list:
    """``start()`` every cluster (``LocalCluster``, ``DisaggCluster``) at once, each on its own thread, with
    ``start_s`` for each process to listen and be ready (many start at once on a 2-core box); returns them
    started, or stops every one and raises the first failure."""
    from tests.pipeline.cluster import Node

    clusters = list(clusters)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Node, "start_wait_s", start_s)
        patch.setattr(Node, "ready_wait_s", start_s)
        with ThreadPoolExecutor(len(clusters)) as pool:
            futures = [pool.submit(c.start) for c in clusters]
            errors = [f.exception() for f in futures]
    if any(errors):
        for cluster in clusters:
            cluster.stop()
        raise next(e for e in errors if e is not None)
    return clusters
