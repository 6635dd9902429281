"""Every family through router -> prefill -> decode: the handoff continues exactly like one node.

One row per family (``RANDOM_FAMILIES``: a tiny ``make-random`` checkpoint each) and the record kinds
its layers' caches travel as (which says the family's cache types: MLA's latent KVCache, sliding
windows, linear-attention state). For each, a router, a prefill node and a decode node run in this
process as the role processes run them (``RouterEngine``, ``PrefillService``, ``DecodeService``) on
real transports over loopback, each on its own 127.0.0.x identity, with the cluster handshake and
AES-GCM; two concurrent greedy requests (batched together on the decode node) give the tokens a
single node's scheduler gives. The same across processes, grouped rather than started per family:
one process hosts every family's decode node and another every family's prefill node
(``tests/disagg/role_host.py``: the services the prefill and decode roles of ``mlxcel-server`` build),
and each family's router engine runs in this process, so the table starts 2 processes.
``test_a_linear_attention_cluster`` runs the three role processes of ``mlxcel-server`` once, on
qwen3_next, through the CLI and the OpenAI API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.config import RANDOM_FAMILIES
from mlxcel.disagg.wire import CacheKind
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.disagg.cluster import DisaggCluster
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)
from tests.pipeline.cluster import Node, free_port
from tests.engine.fakes import collect_tokens

pytestmark = pytest.mark.proc  # the last test starts the three role processes (tests/proc_marker.py)

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
}
PROMPTS = (tuple(range(40, 58)), (1, 50, 51, 52, 53))  # 18 tokens: past the windows of 4
N = 5
SECRET = ClusterSecret(b"disagg-family-table-secret-0123456789abcdef")
ROUTER_IP, PREFILL_IP, DECODE_IP = "127.0.0.70", "127.0.0.71", "127.0.0.72"
HOST_IPS = {"router": "127.0.0.73", "prefill": "127.0.0.74", "decode": "127.0.0.75"}
HOST_START_S = 400.0  # each host loads every family's checkpoint (a loaded 2-core box is slow)


def test_the_table_is_every_random_family():
    assert set(TABLE) == set(RANDOM_FAMILIES)


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
def role_services(path) -> Iterator[tuple]:
    """Decode, prefill and router services of ``path`` in this process, on real transports; yields
    (router, prefill, decode)."""
    from mlxcel.disagg.allowlist import Allowlist
    from mlxcel.disagg.decode import DecodeService
    from mlxcel.disagg.flags import NodeConfig
    from mlxcel.disagg.prefill import PrefillService
    from mlxcel.disagg.router import RouterEngine
    from mlxcel.models.identity import model_identity
    from mlxcel.models.loading import load_checkpoint

    binds = [PeerId.parse(f"{ip}:{free_port(ip)}") for ip in (ROUTER_IP, PREFILL_IP, DECODE_IP)]
    router_at, prefill_at, decode_at = binds
    identity = model_identity(path)
    sizes = dict(identity=identity, context_length=2048, parallel=2, max_batch_size=2, max_queue=2, warmup=False)
    started: list = []
    try:
        decode = DecodeService(NodeConfig("decode", decode_at, (), (), SECRET), *_loaded(load_checkpoint(path)),
                               **sizes)
        decode.start()
        started.append(decode)
        prefill = PrefillService(NodeConfig("prefill", prefill_at, (), (decode_at,), SECRET),
                                 *_loaded(load_checkpoint(path)), allowlist=Allowlist(None), **sizes)
        prefill.start()
        started.append(prefill)
        router = RouterEngine(NodeConfig("router", router_at, (prefill_at,), (decode_at,), SECRET,
                                         probe_interval_s=0.3), load_checkpoint(path).tokenizer,
                              context_length=2048, identity=identity).start()
        started.append(router)
        yield router, prefill, decode
    finally:
        for service in reversed(started):
            service.close()


def _loaded(checkpoint) -> tuple:
    return checkpoint.model, checkpoint.tokenizer


@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_router_prefill_decode_continue_exactly_like_one_node(family, family_checkpoint):  # noqa: F811
    path = family_checkpoint(family)
    reference = single_node(path)
    with role_services(path) as (router, prefill, decode):
        assert [spec.kind for spec in decode.layout.layers] == TABLE[family]
        assert prefill.layout == decode.layout and decode.layout.unsupported is None
        got = asyncio.run(both(router))
        assert got == reference
        assert router.counters["handoffs"] == 2 and decode.counters["handoffs"] == 2
        assert router.counters["handoff_bytes"] > 2 * decode.layout.nbytes(len(PROMPTS[1]))


@pytest.fixture(scope="module")
def hosted(tmp_path_factory, family_checkpoint):  # noqa: F811
    """Every family's decode node in one process and its prefill node in another; yields family -> (prefill,
    decode) addresses, and the secret."""
    from mlxcel.cluster.secret import load_secret
    from tests.pipeline.cluster import write_secret
    from tests.pipeline.stage_host_util import first_line, stop

    tmp = tmp_path_factory.mktemp("role-hosts")
    secret_file = write_secret(tmp)
    nodes = {f: {r: f"{HOST_IPS[r]}:{free_port(HOST_IPS[r])}" for r in ("prefill", "decode")} for f in TABLE}
    hosts = []
    try:
        for role in ("decode", "prefill"):
            spec = {"role": role, "secret_file": str(secret_file), "nodes": [
                {"model": str(family_checkpoint(f)), "bind": addrs[role], "decode_peers": [addrs["decode"]]}
                for f, addrs in nodes.items()]}
            (tmp / f"{role}.json").write_text(json.dumps(spec))
            hosts.append(subprocess.Popen([sys.executable, "-m", "tests.disagg.role_host", str(tmp / f"{role}.json")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for host in hosts:
            line = first_line(host, HOST_START_S)
            assert line == f"ready {len(nodes)}", f"a role host did not start: {line!r}"
        yield nodes, load_secret(secret_file, env={})
    finally:
        for host in hosts:
            stop(host)


@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_prefill_and_decode_processes_continue_exactly_like_one_node(family, hosted, family_checkpoint):  # noqa: F811
    from mlxcel.disagg.flags import NodeConfig
    from mlxcel.disagg.router import RouterEngine
    from mlxcel.models.identity import model_identity
    from mlxcel.models.loading import load_checkpoint

    nodes, secret = hosted
    path = family_checkpoint(family)
    prefill, decode = PeerId.parse(nodes[family]["prefill"]), PeerId.parse(nodes[family]["decode"])
    bind = PeerId.parse(f"{HOST_IPS['router']}:{free_port(HOST_IPS['router'])}")
    router = RouterEngine(NodeConfig("router", bind, (prefill,), (decode,), secret, probe_interval_s=0.3),
                          load_checkpoint(path, lazy=True).tokenizer, context_length=2048,
                          identity=model_identity(path)).start()
    try:
        assert asyncio.run(both(router)) == single_node(path)
        assert router.counters["handoffs"] == 2
    finally:
        router.close()


def test_a_linear_attention_cluster_of_role_processes_answers_like_one_node(tmp_path, family_checkpoint,  # noqa: F811
                                                                            monkeypatch):
    """qwen3_next, whose linear-attention state was refused before, through the three role processes."""
    path = family_checkpoint("qwen3_next")
    monkeypatch.setattr(Node, "start_wait_s", 180.0)  # three processes starting on a loaded 2-core box
    monkeypatch.setattr(Node, "ready_wait_s", 180.0)
    from tests.server.test_batching import reference_text

    cluster = DisaggCluster(tmp_path, path).start()
    try:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": list(prompt), "max_tokens": N, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference_text(path, list(prompt), N)
        assert cluster.stats()["metrics"]["router_handoffs"] == len(PROMPTS)
    finally:
        cluster.stop()
