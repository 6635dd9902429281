"""Every family that slices, as a remote 2-stage pipeline of ``mlxcel-server`` processes: the in-process tokens.

One row per family that ``model_slice.FAMILIES`` slices and ``make-random`` builds. Each family's
cluster is a coordinator and two stage processes (``tests.pipeline.cluster.LocalCluster``: every node
``python -m mlxcel serve --distributed-config``, on its own 127.0.0.x identity, protected transport),
split by the engine's own plan. Processes are started once per family for the whole module, and
the families' clusters start two at a time side by side (each process loads only its checkpoint;
what costs is the interpreter, MLX and transformers' import), so the whole table starts 3 processes
per family and no more. Each row: greedy completions of two prompts, few tokens, equal the text of an
in-process pipeline of the same split (``InProcessPipeline``, what ``mlxcel generate --pp-size 2``
runs).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxcel.config import RANDOM_FAMILIES
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)
from tests.pipeline.cluster import LocalCluster, Node

pytestmark = [pytest.mark.timeout(900), pytest.mark.proc]

PROMPTS = ([1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51])
N = 4
AT_ONCE = 2  # families whose clusters start side by side
START_WAIT_S = 300.0  # a process's first line, while others start beside it on a loaded machine


def sliced_families() -> list[str]:
    """The make-random families whose mlx-lm module has a pipeline slice (model_slice.FAMILIES)."""
    from mlx_lm.utils import MODEL_REMAPPING

    from mlxcel.engine.model_slice import FAMILIES

    return [f for f in RANDOM_FAMILIES if MODEL_REMAPPING.get(f, f) in FAMILIES]


FAMILIES = sliced_families()


@pytest.fixture(scope="module")
def clusters(tmp_path_factory, family_checkpoint):  # noqa: F811
    made = {f: LocalCluster(tmp_path_factory.mktemp(f"pp-{f}"), family_checkpoint(f)) for f in FAMILIES}
    errors: dict[str, BaseException] = {}

    def start(family: str) -> None:
        try:
            made[family].start()
        except BaseException as exc:  # noqa: BLE001 - reported by the family's own test
            errors[family] = exc

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Node, "start_wait_s", START_WAIT_S)
        patch.setattr(Node, "ready_wait_s", START_WAIT_S)
        try:
            with ThreadPoolExecutor(AT_ONCE) as pool:
                list(pool.map(start, FAMILIES))
            yield made, errors
        finally:
            for cluster in made.values():
                cluster.stop()


def in_process_text(path: Path, prompt: list[int], n: int) -> str:
    """Greedy text of ``n`` tokens (no EOS stop) from an in-process pipeline of the engine's 2-stage split."""
    from mlxcel.engine.generate import generate_tokens
    from mlxcel.engine.sampling import SamplingParams, make_sampler
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.pipeline.inprocess import InProcessPipeline, stage_ranges

    loaded = load_checkpoint(path)
    pipe = InProcessPipeline(loaded.model, stage_ranges(path, len(loaded.model.layers), 2, None))
    sampler = make_sampler(SamplingParams())
    tokens = [t for t, _ in generate_tokens(lambda x, c: pipe(x, cache=c), prompt, pipe.make_cache(), sampler, n)]
    detok = loaded.tokenizer.detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def remote_text(url: str, prompt: list[int], n: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n
    return r.json()["choices"][0]["text"]


def test_every_random_family_slices_or_is_named_here():
    """A make-random family without a slice is refused by name on every pipeline surface; none is today."""
    assert FAMILIES == list(RANDOM_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_remote_two_stage_pipeline_gives_the_in_process_tokens(family, clusters, family_checkpoint):  # noqa: F811
    made, errors = clusters
    if family in errors:
        raise errors[family]
    cluster = made[family]
    path = family_checkpoint(family)
    for prompt in PROMPTS:
        assert remote_text(cluster.url, prompt, N) == in_process_text(path, prompt, N)
