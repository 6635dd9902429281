"""The prefix cache in pipeline mode (docs/pipeline.md §3.12): every stage keeps its slice's KV of
finished sequences, PREPARE's ``prompt`` looks it up, ACK's ``cached`` says how much each stage holds,
and the coordinator has every stage start from the same (the shortest) prefix.

In-process pipelines of the 4-layer tiny llama (layers 0-1 and 2-3) on real transports check the
protocol closely (the ACKs, the re-PREPARE with ``max_cached``, the length of the activations); a
3-process cluster through the real CLI checks the whole path, a restarted stage included. Greedy
output always equals the whole model's without any cache.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.config import DEFAULT_PREFIX_CACHE_MB, MAX_PREFIX_TOKENS
from mlxcel.engine.executor import ExecutorError, LocalExecutor, Step, slice_runner
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from mlxcel.topology.cluster_config import ClusterConfig, ClusterConfigError, load_cluster_config, parse_cluster_config
from mlxcel.pipeline.coordinator import PipelineExecutor
from mlxcel.pipeline.params import params_to_wire
from mlxcel.pipeline.protocol import MsgType, StageMessage
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.stage import StageService
from tests.pipeline.cluster import LocalCluster
from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml
from tests.pipeline.members import (
    COORDINATOR_IP,
    LAYERS,
    MAX_ROWS,
    SECRET,
    STAGE_IPS,
    Peer,
    Pending,
    Tap,
    free_port,
    stage_state,
    start_coordinator,
)
from tests.server.util import metrics

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]

VOCAB = 320
N = 4  # tokens generated per sequence
GREEDY = params_to_wire(SamplingParams(), 0)
_rng = random.Random(14)


def tokens(n: int, low: int = 3, high: int = 250) -> list[int]:
    return [_rng.randrange(low, high) for _ in range(n)]


def config(coordinator: str, stages: list[str], prefix_cache_mb: int | None = None) -> ClusterConfig:
    pipeline: dict[str, Any] = {"max_batch_size": MAX_ROWS}
    if prefix_cache_mb is not None:
        pipeline["prefix_cache_mb"] = prefix_cache_mb
    nodes = [{"id": "coordinator", "role": "coordinator", "address": coordinator}]
    nodes += [{"id": f"stage-{i}", "role": "stage", "address": a, "layers": f"{lo}-{hi - 1}"}
              for i, (a, (lo, hi)) in enumerate(zip(stages, LAYERS))]
    doc = {"cluster": {"name": "prefix-test"}, "pipeline": pipeline,
           "timeouts": {"startup_s": 20, "exchange_s": 10, "heartbeat_s": 0.5}, "nodes": nodes}
    return parse_cluster_config(doc, Path("prefix.toml"))


class Pipeline:
    """Two real stages (each with its own cache size) and a real coordinator; every message a stage or
    the coordinator handles is recorded."""

    def __init__(self, model: Any, facts: Any, stage_mb: tuple[int, int]):
        coordinator = f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}"
        addrs = [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS]
        self.stages: list[StageService] = []
        self.taps: list[Tap] = []
        self.coordinator: PipelineExecutor | None = None
        try:
            for i, ((lo, hi), mb) in enumerate(zip(LAYERS, stage_mb)):
                cfg = config(coordinator, addrs, mb)
                stage = StageService(cfg, f"stage-{i}", slice_runner(model, lo, hi, max_rows=MAX_ROWS), SECRET, facts)
                self.taps.append(Tap(stage._on_message))
                stage._on_message = self.taps[-1]  # type: ignore[method-assign]  # picked up by start()
                stage.start()
                self.stages.append(stage)
            self.coordinator, self.tap = start_coordinator(config(coordinator, addrs), facts)
        except BaseException:
            self.close()
            raise
        self._n = 0

    def generate(self, prompt: list[int], n: int = N) -> tuple[int, list[int], str]:
        """Prepare, prefill what is not cached, decode, release with the tokens (as the scheduler does):
        (cached, generated tokens, request id)."""
        assert self.coordinator is not None
        self._n += 1
        rid = f"seq-{self._n}"
        cached = self.coordinator.prepare(rid, SamplingParams(), 0, prompt)
        out = [self._run(Step("prefill", [rid], [prompt[cached:]]))]
        while len(out) < n:
            out.append(self._run(Step("decode", [rid], [[out[-1]]], slot=0)))
        self.coordinator.release(rid, prompt + out)
        return cached, out, rid

    def _run(self, step: Step) -> int:
        outcome = Pending(self.coordinator, step).result()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome[0].token

    def handled(self, stage: int, mtype: MsgType, rid: str) -> list[StageMessage]:
        """What stage ``stage`` handled of type ``mtype`` for ``rid``, in order (at least one)."""
        return eventually(lambda: [m for _, m, _ in self.taps[stage].seen if m is not None and m.type is mtype
                                   and rid in (m.header.get("request_id"), *m.request_ids)])

    def acks(self, stage: int, rid: str) -> list[int]:
        """The ``cached`` of every ACK stage ``stage`` sent to the PREPAREs of ``rid``, in order."""
        def answered() -> list[int]:
            nonces = [m.nonce for m in self.handled(stage, MsgType.PREPARE, rid)]
            acks = {m.nonce: m.header["cached"] for p, m, _ in self.tap.seen
                    if m is not None and m.type is MsgType.ACK and p == self.stages[stage].node.address}
            return [acks[n] for n in nonces] if all(n in acks for n in nonces) else []

        return eventually(answered)

    def settle(self, rid: str) -> None:
        """Wait until every stage has handled the RELEASE of ``rid`` (fire-and-forget): its KV is stored
        before the runner forgets the sequence."""
        for i, stage in enumerate(self.stages):
            self.handled(i, MsgType.RELEASE, rid)
            eventually(lambda: rid not in stage.runner)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        for s in self.stages:
            s.close()


def eventually(probe: Any, timeout: float = 5.0) -> Any:
    """``probe()`` once it is truthy (taps record a message just after its handler returns)."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, "nothing within the deadline"
        time.sleep(0.005)
    return value


@pytest.fixture(scope="module")
def model(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


@pytest.fixture(scope="module")
def facts(tiny_llama):
    return model_facts(tiny_llama)


def reference(model: Any, prompt: list[int], n: int = N) -> list[int]:
    """The whole model's greedy tokens, with no prefix cache."""
    executor = LocalExecutor(model, max_batch_size=1)
    executor.prepare("ref", SamplingParams(), 0, prompt)
    out = [executor.run(Step("prefill", ["ref"], [prompt]))[0].token]
    while len(out) < n:
        out.append(executor.run(Step("decode", ["ref"], [[out[-1]]], slot=0))[0].token)
    executor.close()
    return out


@pytest.fixture
def pipeline(model, facts) -> Iterator[Pipeline]:
    p = Pipeline(model, facts, (DEFAULT_PREFIX_CACHE_MB, DEFAULT_PREFIX_CACHE_MB))
    yield p
    p.close()


def test_a_repeated_prompt_is_prefilled_only_past_its_cached_prefix(pipeline, model):
    prompt = tokens(40)
    cached, cold, first = pipeline.generate(prompt)
    assert cached == 0 and cold == reference(model, prompt)
    assert [pipeline.acks(i, first) for i in (0, 1)] == [[0], [0]]
    pipeline.settle(first)
    assert all(s.state()["prefix_bytes"] > 0 for s in pipeline.stages)

    cached, warm, again = pipeline.generate(prompt)
    assert cached == len(prompt) - 1  # one token is always left to prefill
    assert [pipeline.acks(i, again) for i in (0, 1)] == [[cached], [cached]]  # one PREPARE each, agreed
    assert warm == cold
    activation = pipeline.handled(1, MsgType.ACTIVATION, again)[0]  # stage 0's prefill of the tail
    assert activation.header["phase"] == "prefill" and activation.tensors["hidden"].shape[1] == 1
    stats = pipeline.coordinator.stats()
    assert (stats["prefix_hits"], stats["prefix_tokens"]) == (1, cached)

    longer = prompt + tokens(7)  # shares the prompt, then the stored entry's generated tokens differ
    cached, out, _ = pipeline.generate(longer)
    assert cached >= len(prompt) and out == reference(model, longer)


def test_a_stage_without_the_prefix_makes_every_stage_start_from_nothing(model, facts):
    p = Pipeline(model, facts, (DEFAULT_PREFIX_CACHE_MB, 0))  # stage 1 keeps no cache
    try:
        prompt = tokens(30)
        _, cold, first = p.generate(prompt)
        p.settle(first)
        assert [s.state()["prefix_bytes"] > 0 for s in p.stages] == [True, False]
        cached, warm, again = p.generate(prompt)
        assert cached == 0 and warm == cold == reference(model, prompt)
        assert p.acks(0, again) == [len(prompt) - 1, 0]  # asked again with max_cached 0
        assert p.handled(0, MsgType.PREPARE, again)[1].header["max_cached"] == 0
        assert p.acks(1, again) == [0]
        assert p.handled(1, MsgType.ACTIVATION, again)[0].tensors["hidden"].shape[1] == len(prompt)
    finally:
        p.close()


def test_stages_holding_different_prefixes_start_from_the_shorter(model, facts):
    """Stage 1's 1 MiB holds 2,048 positions of its two layers (512 B each): a longer sequence is not
    kept there, so it keeps only the short one while stage 0 keeps both."""
    p = Pipeline(model, facts, (DEFAULT_PREFIX_CACHE_MB, 1))
    try:
        shared = tokens(300)
        _, short_out, first = p.generate(shared)
        p.settle(first)
        long_prompt = shared + [short_out[0] ^ 1] + tokens(2100)  # leaves the short entry at len(shared)
        cached, long_out, second = p.generate(long_prompt)
        assert cached == len(shared)
        p.settle(second)
        assert len(p.stages[0].prefix) == 2 and len(p.stages[1].prefix) == 1

        prompt = long_prompt + [long_out[0] ^ 1] + tokens(19)  # leaves the long entry at len(long_prompt)
        cached, out, third = p.generate(prompt)
        assert cached == len(shared)
        assert p.acks(0, third) == [len(long_prompt), len(shared)]  # trimmed to the common length
        assert p.handled(0, MsgType.PREPARE, third)[1].header["max_cached"] == len(shared)
        assert p.acks(1, third) == [len(shared)]
        assert p.handled(1, MsgType.ACTIVATION, third)[0].tensors["hidden"].shape[1] == len(prompt) - len(shared)
        assert out == reference(model, prompt)
    finally:
        p.close()


def test_prefix_cache_off_sends_no_prompt_and_no_tokens(model, facts):
    coordinator = f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}"
    addrs = [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS]
    off = config(coordinator, addrs, 0)
    stages = [StageService(off, f"stage-{i}", slice_runner(model, lo, hi, max_rows=MAX_ROWS), SECRET, facts)
              for i, (lo, hi) in enumerate(LAYERS)]
    taps = [Tap(s._on_message) for s in stages]
    for s, t in zip(stages, taps):
        s._on_message = t  # type: ignore[method-assign]
        s.start()
    try:
        executor, _ = start_coordinator(off, facts)
        try:
            prompt = tokens(20)
            for rid in ("a", "b"):
                assert executor.prepare(rid, SamplingParams(), 0, prompt) == 0
                executor.release(rid, prompt + [5])
            time.sleep(0.2)
            seen = [m for t in taps for _, m, _ in t.seen if m is not None and m.type in (MsgType.PREPARE, MsgType.RELEASE)]
            assert len(seen) == 8 and not any("prompt" in m.header or "tokens" in m.header for m in seen)
        finally:
            executor.close()
    finally:
        for s in stages:
            s.close()


# -- the stage's checks of the new fields, sent by a peer at the coordinator's address ---------------


@pytest.fixture(scope="module")
def bare(model, facts) -> Iterator[tuple[Peer, StageService]]:
    """Stage 0 alone, commanded by a Peer at the coordinator's address."""
    coordinator = f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}"
    addrs = [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS]
    stage = StageService(config(coordinator, addrs), "stage-0", slice_runner(model, *LAYERS[0], max_rows=MAX_ROWS),
                         SECRET, facts)
    stage.start()
    peer = Peer(coordinator)
    yield peer, stage
    peer.close()
    stage.close()


def answer(bare: tuple[Peer, StageService], mtype: MsgType, header: dict) -> StageMessage:
    peer, stage = bare
    nonce = os.urandom(8).hex()
    peer.send(stage.node.address, mtype, {**header, "nonce": nonce})
    return peer.wait_for(lambda p, m: m.nonce == nonce)[1]


BAD_LISTS = [
    ([1, True, 3, 4, 5], "prompt"),  # true is not token 1
    ([1, 2, -1, 4, 5], "prompt"),
    ([1, 2, VOCAB, 4, 5], "prompt"),
    ([1, 2, 3.0, 4, 5], "prompt"),
    ("1 2 3 4 5", "array of token ids"),
    ({"0": 1}, "array of token ids"),
    ([1] * (MAX_PREFIX_TOKENS + 1), f"at most {MAX_PREFIX_TOKENS}"),
]


@pytest.mark.parametrize("value,says", BAD_LISTS, ids=["true", "negative", "vocab", "float", "string", "object", "long"])
def test_a_bad_prompt_or_tokens_list_is_refused(bare, value, says):
    refused = answer(bare, MsgType.PREPARE, {"request_id": "bad-prompt", "params": GREEDY, "prompt": value})
    assert refused.type is MsgType.ERROR and refused.header["code"] == ErrorCode.BAD_REQUEST
    assert says in refused.header["message"] and "bad-prompt" not in bare[1].runner

    ack = answer(bare, MsgType.PREPARE, {"request_id": "kept", "params": GREEDY})
    assert ack.type is MsgType.ACK and ack.header["cached"] == 0
    refused = answer(bare, MsgType.RELEASE, {"request_id": "kept", "tokens": value})
    assert refused.type is MsgType.ERROR and refused.header["code"] == ErrorCode.BAD_REQUEST
    says_tokens = says.replace("prompt", "tokens")
    assert says_tokens in refused.header["message"]
    assert "kept" in bare[1].runner  # a refused RELEASE changes nothing
    answer(bare, MsgType.CANCEL, {"request_id": "kept"})


@pytest.mark.parametrize("value", [True, False, -1, 2.0, "3", MAX_PREFIX_TOKENS + 1])
def test_a_bad_max_cached_is_refused(bare, value):
    refused = answer(bare, MsgType.PREPARE, {"request_id": "capped", "params": GREEDY, "prompt": [1, 2, 3, 4, 5, 6],
                                             "max_cached": value})
    assert refused.type is MsgType.ERROR and refused.header["code"] == ErrorCode.BAD_REQUEST
    assert "max_cached" in refused.header["message"]


# -- the coordinator's check of ACK's cached, against scripted stages --------------------------------


@pytest.mark.parametrize("cached", [True, -1, 6, 2.5, "3", None])  # null is not absent (docs/pipeline.md §4.2)
def test_the_coordinator_refuses_a_bad_cached_count(facts, cached):
    coordinator = f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}"
    addrs = [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS]
    cfg = config(coordinator, addrs)

    def scripted(i: int):
        def reply(me: Peer, sender: Any, m: StageMessage) -> None:
            if m.type is MsgType.GET_STATE:
                me.send(sender, MsgType.STATE, {"nonce": m.nonce, **stage_state(cfg, i, facts)})
            elif m.type is MsgType.PREPARE:
                me.send(sender, MsgType.ACK, {"nonce": m.nonce, "cached": cached if i == 1 else 0})
        return reply

    stages = [Peer(a, answer=scripted(i)) for i, a in enumerate(addrs)]
    try:
        executor, _ = start_coordinator(cfg, facts)
        try:
            with pytest.raises(ExecutorError) as failed:
                executor.prepare("r", SamplingParams(), 0, [1, 2, 3, 4, 5, 6])  # at most 5 can be cached
            assert failed.value.code is ErrorCode.INTERNAL and "stage-1" in str(failed.value)
            assert "cached must be an integer from 0 to 5" in str(failed.value)
        finally:
            executor.close()
    finally:
        for s in stages:
            s.close()


# -- the TOML key -------------------------------------------------------------------------------------


TOML = """
[cluster]
name = "c"
[pipeline]
{line}
""" + COORDINATOR_AND_STAGE_0


def test_prefix_cache_mb_in_the_cluster_toml(tmp_path):
    def load(line: str) -> ClusterConfig:
        return load_cluster_config(write_toml(tmp_path, TOML.format(line=line)))

    assert load("").prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB
    assert load("prefix_cache_mb = 0").prefix_cache_mb == 0
    assert load("prefix_cache_mb = 64").with_layers([(0, 4)]).prefix_cache_mb == 64
    for bad in ("-1", "true", "1.5", '"64"'):
        with pytest.raises(ClusterConfigError, match=r"prefix_cache_mb under \[pipeline\] must be an integer >= 0"):
            load(f"prefix_cache_mb = {bad}")


# -- a cluster of processes through the real CLI ------------------------------------------------------


def completion(url: str, prompt: list[int], n: int = 6) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def hits(url: str) -> tuple[float, float]:
    m = metrics(url)
    return m["mlxcel_prefix_cache_hits_total"], m["mlxcel_prefix_cache_reused_tokens_total"]


def test_a_cluster_reuses_a_prompt_and_survives_a_stage_restart(tmp_path, tiny_llama):
    from tests.server.test_batching import reference_text

    c = LocalCluster(tmp_path, tiny_llama).start()
    try:
        prompt = tokens(60)
        before = hits(c.url)
        cold = completion(c.url, prompt)
        assert cold == reference_text(tiny_llama, prompt, 6)
        assert hits(c.url) == before
        assert completion(c.url, prompt) == cold
        after = hits(c.url)
        assert after == (before[0] + 1, before[1] + len(prompt) - 1)  # every stage held all but the last token

        c.stages[1].stop(signal.SIGKILL)
        c.start_stage(1)  # its cache is empty now
        deadline = time.monotonic() + 30
        while c.coordinator.health().status_code != 200:
            assert time.monotonic() < deadline, c.coordinator.health().text
            time.sleep(0.2)
        assert completion(c.url, prompt) == cold
        assert hits(c.url) == after  # stage 0 still held it, stage 1 did not: nothing reused
        assert completion(c.url, prompt) == cold
        assert hits(c.url)[0] == after[0] + 1  # both hold it again
    finally:
        c.stop()
