"""Every family through router -> prefill -> decode: the handoff continues exactly like one node.

One row per family (``RANDOM_FAMILIES``: a tiny ``make-random`` checkpoint each) and the record kinds
its layers' caches travel as (which says the family's cache types: MLA's latent KVCache, sliding
windows, linear-attention state). Two concurrent greedy requests (batched together on the decode
node) give the tokens a single node's scheduler gives, three ways:

- in this process, every family: a router, a prefill node and a decode node as the role processes
  build them (``RouterEngine``, ``PrefillService``, ``DecodeService``) on real transports over
  loopback, each on its own 127.0.0.x identity, with the cluster handshake and AES-GCM;
- across processes, the representative families (``DI_SERVER_FAMILIES``: one per cache record
  kind): three ``mlxcel-server`` processes each (decode, prefill, router), every family's started at
  once, asked through the OpenAI API;
- across processes, the other families, grouped rather than started per family: one process hosts
  every such family's decode node and another its prefill node (``tests/node_host.py``: each node's
  ``mlxcel-server`` command line through the same parsing, preflight and role loading, the prefix
  cache included, without the /health port and signals), and the router is the engine the router
  role's own factory builds from its command line, in this process: 2 processes in all.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.config import RANDOM_FAMILIES
from mlxcel.disagg.wire import CacheKind
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.disagg.cluster import DisaggCluster, wait_for
from tests.disagg.cluster import FAST
from tests.family_checkpoints import (DI_SERVER_FAMILIES, VARIANTS, concurrent_completions,  # noqa: F401
                                      family_checkpoint, start_together, text_of)
from tests.node_host import node_hosts, server_args
from tests.pipeline.cluster import free_port, write_secret
from tests.engine.fakes import collect_tokens

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]  # hosts and mlxcel-server processes (tests/proc_marker.py)

KV, ROT, ARR, LIST = CacheKind.KV, CacheKind.ROTATING, CacheKind.ARRAYS, CacheKind.LIST
# family -> the record kind of each of its 4 layers' caches
TABLE: dict[str, list[CacheKind]] = {
    "llama": [KV] * 4,
    "qwen2": [KV] * 4,
    "qwen3": [KV] * 4,
    "qwen3_moe": [KV] * 4,
    "mixtral": [KV] * 4,
    "phi3": [KV] * 4,
    "gemma3_text": [ROT, KV, ROT, KV],
    "deepseek_v3": [KV] * 4,  # MLA: one head of latents (kv_lora_rank) and rope keys
    "gpt_oss": [ROT, KV, ROT, KV],
    "glm4_moe": [KV] * 4,
    "qwen3_next": [ARR, KV, ARR, KV],  # gated delta net state (conv + recurrent arrays) / full attention
    "gemma4_text": [ROT, KV, ROT, KV],
    "qwen3_5": [ARR, KV, ARR, KV],
    "ernie4_5": [KV] * 4,
    "hunyuan_v1_dense": [KV] * 4,
    "ministral3": [ROT, KV, ROT, KV],
    "minimax": [KV] * 4,
    "qwen3_5_moe": [ARR, KV, ARR, KV],
    "ernie4_5_moe": [KV] * 4,
    "deepseek_v32": [LIST] * 4,  # MLA latents and the lightning indexer's keys
    "kimi_k3": [ARR, KV, ARR, KV],  # Kimi Delta Attention state / NoPE MLA
    # gemma-4 E2B's shape (tests/family_checkpoints.py VARIANTS): per-layer inputs; the KV-shared last layer
    # owns no cache, it reads layer 2's sliding window
    "gemma4_text_e2b": [ROT, KV, ROT],
}
PROMPTS = (tuple(range(40, 58)), (1, 50, 51, 52, 53))  # 18 tokens: past the windows of 4
N = 5
SECRET = ClusterSecret(b"disagg-family-table-secret-0123456789abcdef")
ROUTER_IP, PREFILL_IP, DECODE_IP = "127.0.0.70", "127.0.0.71", "127.0.0.72"
HOST_IPS = {"router": "127.0.0.73", "prefill": "127.0.0.74", "decode": "127.0.0.75"}
HOSTED = [f for f in RANDOM_FAMILIES if f not in DI_SERVER_FAMILIES]


def test_the_table_is_every_random_family():
    assert set(TABLE) == set(RANDOM_FAMILIES) | set(VARIANTS)


def greedy(prompt: tuple[int, ...], rid: str) -> EngineRequest:
    return EngineRequest(prompt, SamplingParams(max_tokens=N), ignore_eos=True, request_id=rid)


async def both(engine) -> list[list[int]]:
    streams = [engine.submit(greedy(p, f"r{i}")) for i, p in enumerate(PROMPTS)]
    return list(await asyncio.gather(*(collect_tokens(s) for s in streams)))


def single_node(path) -> list[list[int]]:
    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(path)
    sched = Scheduler(LocalExecutor(loaded.model, max_batch_size=2), loaded.tokenizer, context_length=2048,
                      parallel=2, warmup=False).start()
    try:
        return asyncio.run(both(sched))
    finally:
        sched.close()


@contextlib.contextmanager
def role_services(path, staging: bool | None = None) -> Iterator[tuple]:
    """Decode, prefill and router services of ``path`` in this process, on real transports; yields
    (router, prefill, decode). ``staging``: their ``MLXCEL_HANDOFF_STAGING``."""
    from mlxcel.disagg.allowlist import Allowlist
    from mlxcel.disagg.decode import DecodeService
    from mlxcel.disagg.flags import NodeConfig
    from mlxcel.disagg.prefill import PrefillService
    from mlxcel.disagg.router_engine import RouterEngine
    from mlxcel.models.identity import model_identity
    from mlxcel.models.loading import load_checkpoint

    binds = [PeerId.parse(f"{ip}:{free_port(ip)}") for ip in (ROUTER_IP, PREFILL_IP, DECODE_IP)]
    router_at, prefill_at, decode_at = binds
    identity = model_identity(path)
    sizes = dict(identity=identity, context_length=2048, parallel=2, max_batch_size=2, max_queue=2, warmup=False)
    started: list = []
    try:
        decode = DecodeService(NodeConfig("decode", decode_at, (), (), handoff_staging=staging),
                               *_loaded(load_checkpoint(path)), secret=SECRET, **sizes)
        decode.start()
        started.append(decode)
        prefill = PrefillService(NodeConfig("prefill", prefill_at, (), (decode_at,), handoff_staging=staging),
                                 *_loaded(load_checkpoint(path)), allowlist=Allowlist(None), secret=SECRET, **sizes)
        prefill.start()
        started.append(prefill)
        router = RouterEngine(NodeConfig("router", router_at, (prefill_at,), (decode_at,), probe_interval_s=0.3),
                              load_checkpoint(path).tokenizer, secret=SECRET, context_length=2048,
                              identity=identity).start()
        started.append(router)
        yield router, prefill, decode
    finally:
        for service in reversed(started):
            service.close()


def _loaded(checkpoint) -> tuple:
    return checkpoint.model, checkpoint.tokenizer


@pytest.mark.parametrize("family", [*RANDOM_FAMILIES, *VARIANTS])
def test_router_prefill_decode_continue_exactly_like_one_node(family, family_checkpoint):  # noqa: F811
    path = family_checkpoint(family)
    reference = single_node(path)
    with role_services(path) as (router, prefill, decode):
        assert [spec.kind for spec in decode.layout.layers] == TABLE[family]
        assert prefill.layout == decode.layout and decode.layout.unsupported is None
        got = asyncio.run(both(router))
        assert got == reference
        assert decode.counters["handoffs"] == 2
        wait_for(lambda: router.counters["handoffs"] == 2, what="both handoffs counted (a HANDED_OFF may follow the FINISH)")
        assert router.counters["handoff_bytes"] > 2 * decode.layout.nbytes(len(PROMPTS[1]))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_staged_handoffs_continue_exactly_like_one_node_and_give_their_buffers_back(family, family_checkpoint):  # noqa: F811
    """MLXCEL_HANDOFF_STAGING=1 (the CUDA default, here over the memory backend): the prefill node seals from
    a staged copy, the decode node receives into the pool and imports by copy; the tokens are one node's."""
    path = family_checkpoint(family)
    reference = single_node(path)
    with role_services(path, staging=True) as (router, prefill, decode):
        assert prefill.staging is not None and prefill.staging is decode.staging  # one pool per process
        got = asyncio.run(both(router))
        assert got == reference and decode.counters["handoffs"] == 2
        wait_for(lambda: prefill.staging.in_use == 0, what="every staging buffer given back")
        assert prefill.staging.held > 0  # the handoffs did go through it


def command_line(path, role: str, bind: str, secret_file, *flags: str) -> list[str]:
    """The ``mlxcel-server`` command line of one disaggregated node of ``path``."""
    return ["-m", str(path), "--node-role", role, "--serving-bind", bind, "--cluster-secret-file", str(secret_file),
            *flags]


@pytest.fixture(scope="module")
def hosted(tmp_path_factory, family_checkpoint):  # noqa: F811
    """Every hosted family's decode node in one node host and its prefill node in another; yields family ->
    (prefill, decode) addresses, and the secret file."""
    tmp = tmp_path_factory.mktemp("role-hosts")
    secret_file = write_secret(tmp)
    nodes = {f: {r: f"{HOST_IPS[r]}:{free_port(HOST_IPS[r])}" for r in ("prefill", "decode")} for f in HOSTED}
    groups = [[command_line(family_checkpoint(f), "decode", addrs["decode"], secret_file, *FAST)
               for f, addrs in nodes.items()],
              [command_line(family_checkpoint(f), "prefill", addrs["prefill"], secret_file, "--decode-peers",
                            addrs["decode"], *FAST) for f, addrs in nodes.items()]]
    with node_hosts(tmp, groups):
        yield nodes, secret_file


@pytest.mark.parametrize("family", HOSTED)
def test_prefill_and_decode_processes_continue_exactly_like_one_node(family, hosted, family_checkpoint):  # noqa: F811
    from mlxcel.commands.serve import as_flags, process_secret, server_config
    from mlxcel.disagg.flags import node_config
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.entrypoints.router import router_factory

    nodes, secret_file = hosted
    path = family_checkpoint(family)
    bind = f"{HOST_IPS['router']}:{free_port(HOST_IPS['router'])}"
    args = server_args(command_line(path, "router", bind, secret_file, "--prefill-peers", nodes[family]["prefill"],
                                    "--decode-peers", nodes[family]["decode"], "--probe-interval", "0.3"))
    flags = as_flags(args)
    router = router_factory(node_config(flags.disagg, None), process_secret(flags, "router", None))(None, load_checkpoint(path, lazy=True).tokenizer, 2048,
                                                     server_config(args))
    try:
        # tokens come only from the decode node, which decodes only KV handed to it; the router's own handoff
        # counter is not asserted: a HANDED_OFF that reaches it after the decode node's FINISH is not counted
        assert asyncio.run(both(router)) == single_node(path)
    finally:
        router.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, family_checkpoint):  # noqa: F811
    """Every representative family as three ``mlxcel-server`` processes (decode, prefill, router), all
    families' clusters started at once."""
    clusters = start_together(DisaggCluster(tmp_path_factory.mktemp(f"di-server-{f}"), family_checkpoint(f))
                              for f in DI_SERVER_FAMILIES)
    try:
        yield dict(zip(DI_SERVER_FAMILIES, clusters))
    finally:
        for cluster in clusters:
            cluster.stop()


@pytest.mark.parametrize("family", DI_SERVER_FAMILIES)
def test_mlxcel_server_role_processes_answer_like_one_node(family, servers, family_checkpoint):  # noqa: F811
    path, cluster = family_checkpoint(family), servers[family]
    assert concurrent_completions(cluster.url, PROMPTS, N) == [text_of(path, t) for t in single_node(path)]
    assert cluster.decodes[0].state()["handoffs"] == len(PROMPTS)
