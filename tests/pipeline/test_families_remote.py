"""Every family that slices, as a remote 2-stage pipeline across processes: the in-process pipeline's tokens.

One row per family that ``model_slice.FAMILIES`` slices and ``make-random`` builds. Each family has
its own cluster TOML (a coordinator and two stages, each on its own 127.0.0.x identity, protected
transport, the engine's own 2-stage split), and every node is an ``mlxcel-server`` command line of
that TOML (``-m DIR --distributed-config TOML --node-id ID``). Each row: two concurrent greedy requests
(batched into one decode micro-batch on the stages) give the token ids of an in-process pipeline of
the same split (``InProcessPipeline``, what ``mlxcel generate --pp-size 2`` runs), and one device's;
the hosted rows also compare the first token's float log-probability, bit for bit.

- The representative families (``PP_SERVER_FAMILIES``: one per slicing mechanism) run as real
  processes: three ``mlxcel-server`` processes each, every family's cluster started at once, asked
  through the OpenAI API (the texts of those tokens).
- The other families' stages run grouped, not started per family: one process hosts stage 0 of each
  and another stage 1 (``tests/node_host.py``: the same flag parsing, preflight and role loading as
  ``mlxcel-server``, without its /health port and signals), and each family's coordinator is the
  engine the coordinator role's own factory builds from its command line, in this process. So those
  rows start 2 processes in all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mlxcel.config import RANDOM_FAMILIES
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.family_checkpoints import (PP_SERVER_FAMILIES, concurrent_completions, family_checkpoint,  # noqa: F401
                                      start_together, text_of)
from tests.node_host import node_hosts, server_args
from tests.pipeline.cluster import COORDINATOR_HOST, STAGE_HOSTS, LocalCluster, free_port, write_secret
from tests.engine.fakes import collect_scored

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]

PROMPTS = ((1, 40, 41, 42, 43, 44, 45, 46), (1, 50, 51))
N = 4
COORDINATOR_FLAGS = ("--parallel", "4", "--no-warmup")


def sliced_families() -> list[str]:
    """The make-random families whose mlx-lm module has a pipeline slice (model_slice.FAMILIES)."""
    from mlx_lm.utils import MODEL_REMAPPING

    from mlxcel.engine.model_slice import FAMILIES

    return [f for f in RANDOM_FAMILIES if MODEL_REMAPPING.get(f, f) in FAMILIES]


FAMILIES = sliced_families()
# and gemma4_text's E2B shape, whose per-layer inputs cross the boundary beside h, one multimodal wrapper
# (make-random's in-process kimi_k25: a stage loads language_model.model.layers.N of its own layers), and
# nemotron_h (a stage loads backbone.layers.N and holds the caches of its own layers, its MLP / MoE ones none)
HOSTED = [f for f in FAMILIES if f not in PP_SERVER_FAMILIES] + ["gemma4_text_e2b", "kimi_k25", "nemotron_h"]


def test_every_random_family_slices():
    """A make-random family without a slice would be refused by name on every pipeline surface; none is today."""
    assert FAMILIES == list(RANDOM_FAMILIES)


def ranges(path: Path) -> list[tuple[int, int]]:
    from mlxcel.pipeline.inprocess import stage_ranges

    return stage_ranges(path, 4, 2, None)


def write_toml(tmp: Path, model_dir: Path) -> Path:
    """A cluster TOML of ``model_dir``'s 2-stage split on fresh ports."""
    secret = write_secret(tmp)
    stages = "".join(f'\n[[nodes]]\nid = "stage-{i}"\nrole = "stage"\naddress = "{STAGE_HOSTS[i]}:'
                     f'{free_port(STAGE_HOSTS[i])}"\nlayers = "{lo}-{hi - 1}"\n'
                     for i, (lo, hi) in enumerate(ranges(model_dir)))
    toml = tmp / "cluster.toml"
    toml.write_text(f'[cluster]\nname = "family-table"\npipeline_parallel_size = 2\n'
                    f'secret_file = "{secret.name}"\n\n[pipeline]\nmax_batch_size = 4\n\n[timeouts]\n'
                    f'heartbeat_s = 0.5\nexchange_s = 60\nstartup_s = 60\n\n[[nodes]]\nid = "coordinator"\n'
                    f'role = "coordinator"\naddress = "{COORDINATOR_HOST}:{free_port(COORDINATOR_HOST)}"\n{stages}')
    return toml


def command_line(model_dir: Path, toml: Path, node_id: str, *flags: str) -> list[str]:
    """The ``mlxcel-server`` command line of one node of ``toml``."""
    return ["-m", str(model_dir), "--distributed-config", str(toml), "--node-id", node_id, *flags]


@pytest.fixture(scope="module")
def tomls(tmp_path_factory, family_checkpoint):  # noqa: F811
    """The hosted families' cluster TOMLs, their stages served by two node hosts (stage 0s, stage 1s)."""
    made = {f: write_toml(tmp_path_factory.mktemp(f"pp-{f}"), family_checkpoint(f)) for f in HOSTED}
    groups = [[command_line(family_checkpoint(f), toml, f"stage-{i}") for f, toml in made.items()] for i in range(2)]
    with node_hosts(tmp_path_factory.mktemp("pp-hosts"), groups):
        yield made


Scored = list[tuple[int, float | None]]  # greedy tokens, each with its log-probability


def tokens_of(rows: list[Scored]) -> list[list[int]]:
    return [[t for t, _ in row] for row in rows]


def remote_tokens(toml: Path, model_dir: Path) -> list[Scored]:
    """Both prompts at once through the engine the coordinator role builds from its command line (a
    Scheduler over a PipelineExecutor): greedy tokens with their log-probabilities."""
    from mlxcel.commands.serve import cluster_node, process_secret, server_config
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.entrypoints.coordinator import coordinator_factory

    args = server_args(command_line(model_dir, toml, "coordinator", *COORDINATOR_FLAGS))
    server = server_config(args)
    tokenizer = load_checkpoint(model_dir, lazy=True).tokenizer
    dist = cluster_node(args, server.model)
    engine = coordinator_factory(dist, process_secret(args, "coordinator", dist))(None, tokenizer, 2048, server)

    async def both() -> list[Scored]:
        streams = [engine.submit(EngineRequest(p, SamplingParams(max_tokens=N, logprobs=True), ignore_eos=True,
                                               request_id=f"r{i}")) for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*(collect_scored(s) for s in streams)))

    try:
        return asyncio.run(both())
    finally:
        engine.close()


def in_process_tokens(model_dir: Path, prompt: tuple[int, ...], n: int = N, whole: bool = False) -> list[int]:
    """Greedy token ids (no EOS stop) of an in-process pipeline of the same 2-stage split (``whole``: of the
    whole mlx-lm model on one device)."""
    return [t for t, _ in in_process_scored(model_dir, prompt, n, whole)]


def in_process_scored(model_dir: Path, prompt: tuple[int, ...], n: int = N, whole: bool = False) -> Scored:
    """``in_process_tokens`` with each token's log-probability."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.generate import generate_tokens
    from mlxcel.engine.sampling import make_sampler
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.pipeline.inprocess import InProcessPipeline

    loaded = load_checkpoint(model_dir)
    model = loaded.model if whole else InProcessPipeline(loaded.model, ranges(model_dir))
    cache = make_prompt_cache(model)
    sampler = make_sampler(SamplingParams())
    return [(t, float(lp[t].item())) for t, lp in generate_tokens(lambda x, c: model(x, cache=c), list(prompt), cache,
                                                                 sampler, n)]


@pytest.mark.parametrize("family", HOSTED)
def test_a_remote_two_stage_pipeline_gives_the_in_process_tokens(family, tomls, family_checkpoint):  # noqa: F811
    """The same tokens, and the first token (the prompt's forward calls) with the same float log-probability,
    bit for bit: every path cuts the prompt alike (mlxcel/engine/prefill_split.py; before, the remote
    path ran the last prompt token inside its chunk and its first log-probability differed in the last
    bits, which on random MoE weights parted the greedy tokens). Later log-probabilities are not compared
    exactly: the remote stages decode both prompts as one micro-batch (a padded, masked batch from the step
    the second joins, which depends on timing), the in-process pipeline each alone."""
    path = family_checkpoint(family)
    in_process = [in_process_scored(path, p) for p in PROMPTS]
    remote = remote_tokens(tomls[family], path)
    assert [r[0] for r in remote] == [r[0] for r in in_process]  # the first token's logprob, bit for bit
    assert tokens_of(remote) == tokens_of(in_process)
    assert in_process == [in_process_scored(path, p, whole=True) for p in PROMPTS]  # and one device's, bit for bit


@pytest.fixture(scope="module")
def servers(tmp_path_factory, family_checkpoint):  # noqa: F811
    """Every representative family as three ``mlxcel-server`` processes (two stages, a coordinator), all
    families' clusters started at once."""
    clusters = start_together(LocalCluster(tmp_path_factory.mktemp(f"pp-server-{f}"), family_checkpoint(f),
                                           coordinator_flags=COORDINATOR_FLAGS) for f in PP_SERVER_FAMILIES)
    try:
        yield dict(zip(PP_SERVER_FAMILIES, clusters))
    finally:
        for cluster in clusters:
            cluster.stop()


@pytest.mark.parametrize("family", PP_SERVER_FAMILIES)
def test_mlxcel_server_processes_give_the_in_process_tokens(family, servers, family_checkpoint):  # noqa: F811
    path = family_checkpoint(family)
    in_process = [in_process_tokens(path, p) for p in PROMPTS]
    assert concurrent_completions(servers[family].url, PROMPTS, N) == [text_of(path, tokens) for tokens in in_process]
    assert in_process == [in_process_tokens(path, p, whole=True) for p in PROMPTS]  # and one device's
