"""Pipeline benchmark: single process vs in-process stages vs remote stages over the protected transport.

Part 1, one stream: greedy decode of --tokens tokens (EOS disabled, same chat prompt), --runs
interleaved runs of every mode, the order reversed every other run (ABBA):

- ``single``: the whole model in this process (the ``mlxcel generate`` path);
- ``inproc_pp``: the same loop over an in-process chain of --stages stages;
- ``remote_pp``: this process is the coordinator (the server's Scheduler over a PipelineExecutor)
  of --stages stage processes on 127.0.0.3, .4, ...; the last stage samples and returns token ids;
- ``remote_pp_logits``: the same, the last stage returning full logits (the coordinator samples).

Every mode must produce the same tokens (``identical`` in the rows). Remote rows carry the frames
and bytes on the wire per decoded token (every message of the run: RUN_ENTRY, ACTIVATION,
RUN_RESULT, plus the per-request PREPARE/ACK/RELEASE, AES-GCM framing included).

Part 2, --streams levels: the single-node server and the pipeline coordinator server (the same
stage processes) under N concurrent streaming clients with identical prompts, ABBA per level;
aggregate decode tok/s.

    python -m bench.pipeline_bench -m models/smollm2-135m-instruct --runs 5 --tokens 128 --streams 2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

import mlxcel  # noqa: F401  (before mlx.core: picks up OpenBLAS, see mlxcel/blas.py)
from bench.environment import write_jsonl
from bench.stats import percentile

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
STAGE_HOSTS = ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
COORDINATOR_HOST = "127.0.0.2"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- in-process modes ---------------------------------------------------------------------------


def timed_tokens(forward: Callable, model: Any, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the seconds between consecutive tokens (the decode part)."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.sampling import SamplingParams, make_sampler

    out, gaps, last = [], [], None
    for token, _ in generate_tokens(forward, prompt, make_cache(model), make_sampler(SamplingParams()), tokens):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        out.append(token)
    return out, gaps


# -- remote stages --------------------------------------------------------------------------------


class StageCluster:
    """Stage processes started through the CLI, and the TOML the coordinator side uses."""

    def __init__(self, model_dir: Path, stages: int, workdir: Path, devices: list[str] | None = None,
                 threads: int | None = None):
        self.model_dir = model_dir
        self.threads = threads  # OPENBLAS_NUM_THREADS per stage process (stages sharing one host's cores)
        self.devices = devices  # CUDA_VISIBLE_DEVICES per stage process (one GPU each), if given
        self.secret = workdir / "cluster.secret"
        self.secret.write_text(os.urandom(32).hex() + "\n")
        self.secret.chmod(0o600)
        self.coordinator = f"{COORDINATOR_HOST}:{free_port(COORDINATOR_HOST)}"
        self.addrs = [f"{h}:{free_port(h)}" for h in STAGE_HOSTS[:stages]]
        self.toml = workdir / "cluster.toml"
        nodes = f'[[nodes]]\nid = "coordinator"\nrole = "coordinator"\naddress = "{self.coordinator}"\n'
        for i, a in enumerate(self.addrs):
            nodes += f'\n[[nodes]]\nid = "stage-{i}"\nrole = "stage"\naddress = "{a}"\n'
        self.toml.write_text(f'[cluster]\npipeline_parallel_size = {stages}\nsecret_file = "cluster.secret"\n\n'
                             f'[pipeline]\nmax_batch_size = 8\n\n[timeouts]\nheartbeat_s = 30\nexchange_s = 120\n\n{nodes}')
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        for i, host in enumerate(STAGE_HOSTS[: len(self.addrs)]):
            cmd = [sys.executable, "-m", "mlxcel", "serve", "-m", str(self.model_dir), "--distributed-config",
                   str(self.toml), "--node-id", f"stage-{i}", "--host", host, "--port", "0", "--log-level", "warning"]
            env = dict(os.environ)
            if self.threads:
                env["OPENBLAS_NUM_THREADS"] = str(self.threads)
            if self.devices:
                env["CUDA_VISIBLE_DEVICES"] = self.devices[i % len(self.devices)]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


class RemoteDriver:
    """This process as the coordinator: the server's Scheduler over a PipelineExecutor."""

    def __init__(self, cluster: StageCluster, tokenizer: Any, micro_batch: int | None = None):
        from mlxcel.cluster.secret import load_secret
        from mlxcel.engine.scheduler import Scheduler
        from mlxcel.pipeline.cluster_config import load_cluster_config
        from mlxcel.pipeline.coordinator import PipelineExecutor
        from mlxcel.pipeline.runtime import model_facts, resolve_layers

        facts = model_facts(cluster.model_dir)
        config = resolve_layers(load_cluster_config(cluster.toml), cluster.model_dir, facts.num_layers)
        self.executor = PipelineExecutor(config, load_secret(cluster.secret), facts, max_batch_size=8,
                                         micro_batch_size=micro_batch)
        self.executor.start(timeout=300)
        self.stage0 = config.stages[0].address
        self.engine = Scheduler(self.executor, tokenizer, context_length=8192, parallel=8, warmup=False).start()
        self.loop = asyncio.new_event_loop()

    def wire(self) -> tuple[int, int]:
        """Frames and bytes sent so far by the coordinator and every stage but the last, plus received."""
        from mlxcel.pipeline.protocol import MsgType

        frames = self.executor.outbox.frames + self.executor.received_frames
        nbytes = self.executor.outbox.bytes + self.executor.received_bytes
        for stage in self.executor.cluster.stages[:-1]:
            state = self.executor.command(stage.address, MsgType.GET_STATE, {}).header
            frames += state["sent_frames"]
            nbytes += state["sent_bytes"]
        return frames, nbytes

    def run(self, prompt: list[int], tokens: int, logits: bool) -> tuple[list[int], list[float], float, float]:
        from mlxcel.engine.interface import EngineRequest, TokenEvent
        from mlxcel.engine.sampling import SamplingParams

        self.executor.return_logits = logits
        before = self.wire()

        async def go() -> tuple[list[int], list[float]]:
            stream = self.engine.submit(EngineRequest(tuple(prompt), SamplingParams(max_tokens=tokens), ignore_eos=True))
            out, gaps, last = [], [], None
            async for event in stream:
                if isinstance(event, TokenEvent):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    out.append(event.token)
            return out, gaps

        out, gaps = self.loop.run_until_complete(go())
        time.sleep(0.2)  # let the release round trip land in the counters
        after = self.wire()
        n = max(len(out), 1)
        return out, gaps, (after[0] - before[0]) / n, (after[1] - before[1]) / n

    def close(self) -> None:
        self.engine.close()
        self.loop.close()


# -- server level -----------------------------------------------------------------------------------


def launch_server(args: list[str], host: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port(host)
    proc = subprocess.Popen([sys.executable, "-m", "mlxcel", "serve", *args, "--host", host, "--port", str(port),
                             "--log-level", "warning", "--served-model-name", "bench"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {args} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server {args} not ready")


async def load_level(url: str, streams: int, tokens: int, prompts: list[str]) -> tuple[float, int]:
    """N concurrent streaming chats of `tokens` tokens each; (wall seconds, tokens received)."""
    import httpx

    async def one(client: httpx.AsyncClient, text: str) -> int:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        n = 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"usage":{' in line.replace(" ", ""):
                    import json

                    usage = json.loads(line[6:]).get("usage") or {}
                    n = usage.get("completion_tokens", n)
        return n

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, prompts[i]) for i in range(streams)))
        return time.perf_counter() - start, sum(counts)


# -- main ---------------------------------------------------------------------------------------------


def summarize(rows: list[dict], key: str = "tok_s") -> dict[str, tuple[float, float, float]]:
    out: dict[str, tuple[float, float, float]] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        xs = [r[key] for r in rows if r["mode"] == mode]
        out[mode] = (statistics.median(xs), min(xs), max(xs))
    return out


def single_stream(args: argparse.Namespace, cluster: StageCluster, loaded: Any, prompt: list[int]) -> list[dict]:
    from mlxcel.pipeline.inprocess import InProcessPipeline, stage_ranges

    model = loaded.model
    ranges = stage_ranges(args.model, loaded.num_layers, args.stages, None)
    pipe = InProcessPipeline(model, ranges)
    remote = RemoteDriver(cluster, loaded.tokenizer)
    modes: dict[str, Callable[[], tuple]] = {
        "single": lambda: (*timed_tokens(lambda x, c: model(x, cache=c), model, prompt, args.tokens), None, None),
        "inproc_pp": lambda: (*timed_tokens(pipe, pipe, prompt, args.tokens), None, None),
        "remote_pp": lambda: remote.run(prompt, args.tokens, logits=False),
        "remote_pp_logits": lambda: remote.run(prompt, args.tokens, logits=True),
    }
    modes = {k: v for k, v in modes.items() if k in args.modes}
    for name, fn in modes.items():  # warm every path once (kernels, connections)
        fn()
    rows, reference = [], None
    try:
        for run in range(args.runs):
            order = list(modes) if run % 2 == 0 else list(reversed(modes))
            for position, name in enumerate(order):
                tokens, gaps, frames, nbytes = modes[name]()
                reference = reference or tokens
                rows.append({
                    "bench": "pipeline", "mode": name, "stages": 1 if name == "single" else args.stages,
                    "streams": 1, "run": run, "order": position, "tokens": len(tokens),
                    "tok_s": len(gaps) / sum(gaps), "per_token_ms_p50": percentile(gaps, 50) * 1e3,
                    "per_token_ms_p95": percentile(gaps, 95) * 1e3, "frames_per_token": frames,
                    "bytes_per_token": nbytes, "return": "logits" if name.endswith("logits") else "token",
                    "identical": tokens == reference, "model": Path(args.model).name,
                })
                print(f"run {run} {name:>17}: {rows[-1]['tok_s']:6.2f} tok/s"
                      + (f", {frames:.2f} frames/token, {nbytes:.0f} B/token" if frames is not None else ""), flush=True)
    finally:
        remote.close()
    return rows


def server_levels(args: argparse.Namespace, cluster: StageCluster) -> list[dict]:
    single, single_url = launch_server(["-m", args.model, "--parallel", "8"], "127.0.0.1")
    coord, coord_url = launch_server(["-m", args.model, "--parallel", "8", "--distributed-config", str(cluster.toml),
                                      "--node-id", "coordinator"], COORDINATOR_HOST)
    servers = {"server_single": single_url, "server_remote_pp": coord_url}
    rows = []
    try:
        for url in servers.values():  # warm both
            asyncio.run(load_level(url, 2, 8, ["warm up", "warm up too"]))
        for level, streams in enumerate(args.streams):
            prompts = [f"{DEFAULT_PROMPT} (reader {i})" for i in range(streams)]
            for rnd in range(args.rounds):
                order = list(servers) if (rnd + level) % 2 == 0 else list(reversed(servers))
                for position, name in enumerate(order):
                    wall, n = asyncio.run(load_level(servers[name], streams, args.server_tokens, prompts))
                    rows.append({"bench": "pipeline", "mode": name, "stages": 1 if name == "server_single" else args.stages,
                                 "streams": streams, "run": rnd, "order": position, "tokens": n, "tok_s": n / wall,
                                 "per_token_ms_p50": None, "frames_per_token": None, "bytes_per_token": None,
                                 "return": "token", "identical": None, "model": Path(args.model).name})
                    print(f"{streams} streams round {rnd} {name:>17}: {n / wall:6.2f} tok/s aggregate", flush=True)
    finally:
        for proc in (coord, single):
            proc.terminate()
            proc.wait(30)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeline_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", type=lambda s: s.split(","), default=["single", "inproc_pp", "remote_pp", "remote_pp_logits"])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x], default=[2, 4, 8],
                   help="server concurrency levels (empty to skip part 2)")
    p.add_argument("--server-tokens", type=int, default=64, help="tokens per request in part 2")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds per concurrency level")
    p.add_argument("--stage-devices", type=lambda s: s.split(","), default=None,
                   help="CUDA_VISIBLE_DEVICES of each stage process, e.g. 0,1 for one GPU per stage")
    p.add_argument("--stage-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS of each stage process (stages that share one host's cores)")
    p.add_argument("--label", default=None, help="free-form label recorded in every row (e.g. h200-x2)")
    p.add_argument("--quick", action="store_true", help="2 runs of 16 tokens, streams 2, 16 tokens (smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.tokens, args.streams, args.server_tokens, args.rounds = 2, 16, [2], 16, 1
    return args


def main(argv: list[str] | None = None) -> int:
    from mlxcel.engine.prompts import encode_chat
    from mlxcel.models.loading import load_checkpoint

    args = parse_args(argv)
    loaded = load_checkpoint(args.model)
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": DEFAULT_PROMPT}])
    with tempfile.TemporaryDirectory(prefix="mlxcel-pipeline-bench-") as tmp:
        cluster = StageCluster(Path(args.model), args.stages, Path(tmp), args.stage_devices, args.stage_threads)
        cluster.start()
        try:
            rows = single_stream(args, cluster, loaded, prompt) if args.runs else []
            if args.streams:
                rows += server_levels(args, cluster)
        finally:
            cluster.stop()
    for row in rows:
        row["label"] = args.label
        row["stage_devices"] = ",".join(args.stage_devices) if args.stage_devices else None
        row["stage_threads"] = args.stage_threads
    path = write_jsonl(args.out / "pipeline_bench.jsonl", rows)
    print(f"\nrows: {path}")
    one = summarize([r for r in rows if r["streams"] == 1])
    base = one.get("single", (0, 0, 0))[0]
    for mode, (med, lo, hi) in one.items():
        ratio = f" = {med / base:.3f}x single" if base else ""
        print(f"{mode:>17}: median {med:6.2f} tok/s (runs {lo:.2f}-{hi:.2f}){ratio}")
    print(f"identical tokens across modes: {all(r['identical'] for r in rows if r['streams'] == 1)}")
    for streams in args.streams:
        level = summarize([r for r in rows if r["streams"] == streams])
        if "server_single" in level and "server_remote_pp" in level:
            ratio = level["server_remote_pp"][0] / level["server_single"][0]
            print(f"{streams} streams: single {level['server_single'][0]:.2f}, 2-stage {level['server_remote_pp'][0]:.2f} "
                  f"tok/s aggregate = {ratio:.3f}x")
    mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
