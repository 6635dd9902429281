"""Every family that slices, as a remote 2-stage pipeline across processes: the in-process pipeline's tokens.

One row per family that ``model_slice.FAMILIES`` slices and ``make-random`` builds. Each family has
its own cluster TOML (a coordinator and two stages, each on its own 127.0.0.x identity, protected
transport, the engine's own 2-stage split). Processes are grouped, not started per family: one
process hosts stage 0 of every family and another stage 1 (``tests/pipeline/stage_host.py``: the
``StageService`` over ``load_stage_runner`` that the ``stage`` role of ``mlxcel-server`` builds), and
each family's coordinator is the ``PipelineExecutor`` under a ``Scheduler`` that the coordinator role
serves, in this process. So the whole table starts 2 processes. Each row: two concurrent greedy
requests (batched into one decode micro-batch on the stages) give the token ids of an in-process
pipeline of the same split (``InProcessPipeline``, what ``mlxcel generate --pp-size 2`` runs).

``test_a_hybrid_family_through_mlxcel_server_processes`` runs one family, qwen3_next (linear
attention and MoE), as three ``mlxcel-server`` processes through the CLI and the OpenAI API.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel.config import RANDOM_FAMILIES
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)
from tests.pipeline.cluster import COORDINATOR_HOST, STAGE_HOSTS, LocalCluster, Node, free_port, write_secret
from tests.pipeline.stage_host_util import first_line, stop
from tests.engine.fakes import collect_tokens

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]

PROMPTS = ((1, 40, 41, 42, 43, 44, 45, 46), (1, 50, 51))
N = 4
HOST_START_S = 400.0  # the two hosts load every family's stages (a loaded 2-core box is slow)


def sliced_families() -> list[str]:
    """The make-random families whose mlx-lm module has a pipeline slice (model_slice.FAMILIES)."""
    from mlx_lm.utils import MODEL_REMAPPING

    from mlxcel.engine.model_slice import FAMILIES

    return [f for f in RANDOM_FAMILIES if MODEL_REMAPPING.get(f, f) in FAMILIES]


FAMILIES = sliced_families()


def test_every_random_family_slices():
    """A make-random family without a slice would be refused by name on every pipeline surface; none is today."""
    assert FAMILIES == list(RANDOM_FAMILIES)


def ranges(path: Path) -> list[tuple[int, int]]:
    from mlxcel.pipeline.inprocess import stage_ranges

    return stage_ranges(path, 4, 2, None)


def write_toml(tmp: Path, model_dir: Path) -> Path:
    """A cluster TOML of ``model_dir`` on fresh ports; its first line names the checkpoint for the stage host."""
    secret = write_secret(tmp)
    stages = "".join(f'\n[[nodes]]\nid = "stage-{i}"\nrole = "stage"\naddress = "{STAGE_HOSTS[i]}:'
                     f'{free_port(STAGE_HOSTS[i])}"\nlayers = "{lo}-{hi - 1}"\n'
                     for i, (lo, hi) in enumerate(ranges(model_dir)))
    toml = tmp / "cluster.toml"
    toml.write_text(f'# model_dir = {model_dir}\n[cluster]\nname = "family-table"\npipeline_parallel_size = 2\n'
                    f'secret_file = "{secret.name}"\n\n[pipeline]\nmax_batch_size = 4\n\n[timeouts]\n'
                    f'heartbeat_s = 0.5\nexchange_s = 60\nstartup_s = 60\n\n[[nodes]]\nid = "coordinator"\n'
                    f'role = "coordinator"\naddress = "{COORDINATOR_HOST}:{free_port(COORDINATOR_HOST)}"\n{stages}')
    return toml


@pytest.fixture(scope="module")
def tomls(tmp_path_factory, family_checkpoint):  # noqa: F811
    """Every family's cluster TOML, its stages served by two host processes (stage 0s, stage 1s)."""
    made = {f: write_toml(tmp_path_factory.mktemp(f"pp-{f}"), family_checkpoint(f)) for f in FAMILIES}
    hosts = [subprocess.Popen([sys.executable, "-m", "tests.pipeline.stage_host", f"stage-{i}",
                               *map(str, made.values())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        for host in hosts:
            line = first_line(host, HOST_START_S)
            assert line == f"ready {len(made)}", f"a stage host did not start: {line!r}"
        yield made
    finally:
        for host in hosts:
            stop(host)


def remote_tokens(toml: Path, model_dir: Path) -> list[list[int]]:
    """Both prompts at once through the coordinator role's engine: a Scheduler over a PipelineExecutor."""
    from mlxcel.cluster.secret import load_secret
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.facts import model_facts
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.pipeline.coordinator import PipelineExecutor
    from mlxcel.topology.cluster_config import load_cluster_config

    cluster = load_cluster_config(toml)
    executor = PipelineExecutor(cluster, load_secret(toml_secret_file=cluster.secret_file, env={}),
                                model_facts(model_dir), max_batch_size=4)
    executor.start()
    sched = Scheduler(executor, load_checkpoint(model_dir, lazy=True).tokenizer, context_length=2048, parallel=2,
                      warmup=False)

    async def both() -> list[list[int]]:
        streams = [sched.submit(EngineRequest(p, SamplingParams(max_tokens=N), ignore_eos=True, request_id=f"r{i}"))
                   for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*(collect_tokens(s) for s in streams)))

    try:
        sched.start().wait_ready()
        return asyncio.run(both())
    finally:
        sched.close()
        executor.close()


def in_process_tokens(model_dir: Path, prompt: tuple[int, ...], n: int = N, whole: bool = False) -> list[int]:
    """Greedy token ids (no EOS stop) of an in-process pipeline of the same 2-stage split (``whole``: of the
    whole mlx-lm model on one device)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.generate import generate_tokens
    from mlxcel.engine.sampling import make_sampler
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.pipeline.inprocess import InProcessPipeline

    loaded = load_checkpoint(model_dir)
    model = loaded.model if whole else InProcessPipeline(loaded.model, ranges(model_dir))
    cache = make_prompt_cache(model)
    sampler = make_sampler(SamplingParams())
    return [t for t, _ in generate_tokens(lambda x, c: model(x, cache=c), list(prompt), cache, sampler, n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_remote_two_stage_pipeline_gives_the_in_process_tokens(family, tomls, family_checkpoint):  # noqa: F811
    path = family_checkpoint(family)
    in_process = [in_process_tokens(path, p) for p in PROMPTS]
    assert remote_tokens(tomls[family], path) == in_process
    assert in_process == [in_process_tokens(path, p, whole=True) for p in PROMPTS]  # and one device's


def text_of(model_dir: Path, tokens: list[int]) -> str:
    from mlxcel.models.loading import load_checkpoint

    detok = load_checkpoint(model_dir, lazy=True).tokenizer.detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def test_a_hybrid_family_through_mlxcel_server_processes(tmp_path, family_checkpoint, monkeypatch):  # noqa: F811
    path = family_checkpoint("qwen3_next")
    monkeypatch.setattr(Node, "start_wait_s", 180.0)  # three processes starting on a loaded 2-core box
    monkeypatch.setattr(Node, "ready_wait_s", 180.0)
    cluster = LocalCluster(tmp_path, path).start()
    try:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": list(prompt), "max_tokens": N, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text_of(path, in_process_tokens(path, prompt))
    finally:
        cluster.stop()
