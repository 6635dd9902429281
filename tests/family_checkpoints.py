"""One tiny ``make-random`` checkpoint per family, built once per test session, and what the family tables share.

``family_checkpoint`` is a session fixture: ``family_checkpoint("qwen3_next")`` is the path of a 4-layer
checkpoint of that family (``mlxcel models make-random --family F``: mlx-lm's own classes, the real
tokenizer files). Import it into a test module to use it (``from tests.family_checkpoints import
family_checkpoint  # noqa: F401``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import httpx
import pytest

#: the families whose rows of the remote pipeline table (tests/pipeline/test_families_remote.py) run real
#: ``mlxcel-server`` processes: one per slicing mechanism; the other families' stages run in
#: ``tests/node_host.py`` (docs/models.md, "Where each family is tested")
PP_SERVER_FAMILIES: dict[str, str] = {
    "qwen3_next": "linear attention (gated delta net state) beside full attention, MoE",
    "deepseek_v3": "MLA (latent KV cache, array masks), dense leading layer, MoE",
    "gemma3_text": "gemma: scaled embedding, sliding-window layers",
    "kimi_k3": "attention-residual blocks crossing the stage boundary, Kimi Delta Attention, NoPE MLA",
    "gpt_oss": "attention sinks, sliding / full layers, MoE",
}
#: the same for the disaggregated table (tests/disagg/test_families.py): one per cache record kind a handoff
#: carries (docs/disagg.md)
DI_SERVER_FAMILIES: dict[str, str] = {
    "qwen3_next": "ArraysCache (linear-attention state) and KVCache",
    "deepseek_v3": "MLA's latent KVCache",
    "gemma3_text": "RotatingKVCache (sliding windows) and KVCache",
    "deepseek_v32": "CacheList (MLA latents and the lightning indexer's keys)",
}


# gemma-4 E2B/E4B's shape: per-layer inputs (P = 8) and a KV-shared last layer, which reads layer 2's sliding KV
GEMMA4_E2B = {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320, "num_kv_shared_layers": 1,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
              "enable_moe_block": False, "attention_k_eq_v": False}
#: checkpoints of a family in another shape than make-random's: name -> (family, config.json overrides)
VARIANTS: dict[str, tuple[str, dict]] = {"gemma4_text_e2b": ("gemma4_text", GEMMA4_E2B)}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(name)``: the checkpoint of a make-random family, or of one of ``VARIANTS``."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            family, overrides = VARIANTS.get(name, (name, {}))
            made[name] = make_random_checkpoint(tmp_path_factory.mktemp(f"family-{name}"), family=family, layers=4,
                                                overrides=overrides)
        return made[name]

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


def text_of(model_dir: Path, tokens: list[int]) -> str:
    """The text the server's detokenizer makes of ``tokens``."""
    from mlxcel.models.loading import load_checkpoint

    detok = load_checkpoint(model_dir, lazy=True).tokenizer.detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def completion(url: str, prompt: tuple[int, ...], n: int) -> str:
    """The text of ``n`` greedy tokens (no EOS stop) from the OpenAI completions endpoint at ``url``."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def concurrent_completions(url: str, prompts: Iterable[tuple[int, ...]], n: int) -> list[str]:
    """Every prompt at once (batched together on the nodes): the texts, in prompt order."""
    prompts = list(prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: completion(url, p, n), prompts))
