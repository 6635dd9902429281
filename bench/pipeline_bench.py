"""Pipeline benchmark: single process vs in-process stages vs remote stages over the protected transport.

Part 1, one stream: greedy decode of --tokens tokens (EOS disabled, same chat prompt), --runs
interleaved runs of every mode, the order reversed every other run (ABBA):

- ``single``: the whole model in one process (the ``mlxcel generate`` path);
- ``inproc_pp``: the same loop over an in-process chain of --stages stages;
- ``remote_pp``: the process is the coordinator (the server's Scheduler over a PipelineExecutor)
  of --stages stage processes on 127.0.0.3, .4, ...; the last stage samples and returns token ids;
- ``remote_pp_logits``: the same, the last stage returning full logits (the coordinator samples).

Every run of every mode is a fresh process (``python -m bench.pipeline_bench --worker MODE``, one
JSON line on stdout), so that no mode pays for another's memory, threads, compiled kernels or
leftover state. Measured in one process, ``single`` ran at half the speed of a fresh ``mlxcel
generate`` (5.5 against 10.9-12.5 tok/s on the 2-core CPU box) while the coordinator's transport,
timer and scheduler threads lived beside it, which made "remote 1.76x single" out of an unfair
comparison. A worker loads what its mode needs (the coordinator: tokenizer and config only), warms
up over --warmup tokens, then measures one run. The stage processes persist across runs, like a
deployed cluster (they are warmed by a remote worker before the first measured run); only the
coordinator side is fresh each time. No prefix cache anywhere (the stages' ``prefix_cache_mb = 0``,
the single-node server's ``--prefix-cache-mb 0``): persistent stages would otherwise skip the
repeated prompt's prefill that every fresh single process pays. Rows are marked ``fair_comparison``.

Every mode must produce the same tokens from the same prompt (``identical`` in the rows). Every
row records the worker's PID and the CPU-seconds each process spent in the measured run: the
worker's own (``getrusage``) and each stage process's utime+stime from /proc/PID/stat (Linux
only, else empty), so a stage that spins while idle shows up in every mode's rows. Remote rows
carry the frames and bytes on the wire per decoded token (every message of the run: RUN_ENTRY,
ACTIVATION, RUN_RESULT, plus the per-request PREPARE/ACK/RELEASE, AES-GCM framing included).

Per-token timeline, seen from the coordinator side (the stage and coordinator code stay as they
are): a remote token's latency runs from the executor's ``submit`` to its ``done`` callback; an
in-process token's from the forward call that queued its step to the moment the token is read.
Rows carry its p50/p95 (``latency_ms_*``, decode tokens) next to the step time between tokens
(``per_token_ms_*``); --trace also writes ``trace-<mode>.jsonl``, one line per token. Numeric
STATE fields that look like timings (``*_s``, ``*_ms``, ``*_us``, ``*_ns``) and ``steps`` are
recorded per stage as before/after deltas (``stage_state``), so stage-side timings join the rows
as soon as stages report them.

Part 3, ``pipeline_bench protection ...``: protected (AES-256-GCM) against attribution-only unprotected
frames, end-to-end greedy decode of the 2-stage remote pipeline in one process (bench/protection_bench.py).

Part 2, --streams levels: the single-node server and the pipeline coordinator server (the same
stage processes) under N concurrent streaming clients with identical prompts, ABBA per level;
aggregate decode tok/s.

    python -m bench.pipeline_bench -m models/smollm2-135m-instruct --runs 5 --tokens 128 --streams 2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from bench.environment import load_1m as host_load, write_jsonl
from bench.greedy_stream import greedy_tokens_and_gaps
from bench.stats import percentile

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
STAGE_HOSTS = [f"127.0.0.{3 + i}" for i in range(16)]  # stage i on 127.0.0.(3+i) (bench/scaling_bench.py: up to 16)
COORDINATOR_HOST = "127.0.0.2"
REPO = Path(__file__).resolve().parent.parent  # where ``python -m bench.pipeline_bench`` finds this module
MODES = ("single", "inproc_pp", "remote_pp", "remote_pp_logits")
WORKER_TIMEOUT_S = 900
HEARTBEAT_S = 2  # the stages' STATE (and so the coordinator's /metrics of them) is at most this old
_TIMING_SUFFIXES = ("_s", "_ms", "_us", "_ns")
#: environment variables that change what is measured; rows record the ones set
BENCH_ENV = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "CUDA_VISIBLE_DEVICES")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- CPU accounting ------------------------------------------------------------------------------------


def self_cpu_s() -> float:
    """User + system CPU seconds of this process so far, every thread included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of another process from /proc/PID/stat; None where there is no /proc (not Linux)
    or the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_delta(before: list[float | None], after: list[float | None]) -> list[float] | None:
    if not before or any(x is None for x in (*before, *after)):
        return None
    return [round(b - a, 3) for a, b in zip(before, after)]  # type: ignore[operator]


# -- the worker: one mode, one run, in a fresh process ----------------------------------------------


class Timeline:
    """Submit and result times of the steps of one run (perf_counter seconds)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []  # {"kind", "t_submit", "t_done"} of every sampling step

    def add(self, kind: str, t_submit: float, t_done: float) -> None:
        self.steps.append({"kind": kind, "t_submit": t_submit, "t_done": t_done})


def timed_tokens(forward: Callable, model: Any, prompt: list[int], tokens: int,
                 timeline: Timeline | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and the seconds between consecutive tokens (the decode part); with a timeline,
    when each token's step was queued (its forward call) and when the token was read."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.sampling import SamplingParams, make_sampler

    submits: list[float] = []

    def timed_forward(x: Any, cache: Any) -> Any:
        submits.append(time.perf_counter())
        return forward(x, cache)

    out, gaps, done, last = [], [], [], None
    for token, _ in generate_tokens(timed_forward, prompt, make_cache(model), make_sampler(SamplingParams()), tokens):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        done.append(now)
        out.append(token)
    if timeline is not None:  # the last len(out) forward calls are the sampling steps, in order
        for i, (t0, t1) in enumerate(zip(submits[len(submits) - len(out):], done)):
            timeline.add("prefill" if i == 0 else "decode", t0, t1)
    return out, gaps


class RemoteDriver:
    """This process as the coordinator: the server's Scheduler over a PipelineExecutor."""

    def __init__(self, model_dir: Path, cluster_toml: Path, secret: Path, tokenizer: Any,
                 micro_batch: int | None = None):
        from mlxcel.cluster.secret import load_secret
        from mlxcel.engine.scheduler import Scheduler
        from mlxcel.topology.cluster_config import load_cluster_config
        from mlxcel.pipeline.coordinator import PipelineExecutor
        from mlxcel.models.facts import model_facts
        from mlxcel.topology.distributed import resolve_layers

        facts = model_facts(model_dir)
        config = resolve_layers(load_cluster_config(cluster_toml), model_dir, facts.num_layers)
        self.executor = PipelineExecutor(config, load_secret(secret), facts, max_batch_size=8,
                                         micro_batch_size=micro_batch)
        self.executor.start(timeout=300)
        self.timeline: Timeline | None = None
        self._wrap_submit()
        self.engine = Scheduler(self.executor, tokenizer, context_length=8192, parallel=8, warmup=False).start()
        self.loop = asyncio.new_event_loop()

    def _wrap_submit(self) -> None:
        """Timestamp every sampling step at submit and at its done callback (the coordinator's view)."""
        submit = self.executor.submit

        def timed_submit(step: Any, done: Callable) -> None:
            t0, timeline = time.perf_counter(), self.timeline

            def timed_done(s: Any, outcome: Any) -> None:
                if timeline is not None and step.sample:
                    timeline.add(step.kind, t0, time.perf_counter())
                done(s, outcome)

            submit(step, timed_done)

        self.executor.submit = timed_submit  # type: ignore[method-assign]

    def states(self) -> list[dict[str, Any]]:
        from mlxcel.pipeline.protocol import MsgType

        return [self.executor.command(s.address, MsgType.GET_STATE, {}).header for s in self.executor.cluster.stages]

    def wire(self, states: list[dict[str, Any]]) -> tuple[int, int]:
        """Frames and bytes sent so far by the coordinator and every stage but the last, plus received."""
        frames = self.executor.outbox.frames + self.executor.received_frames
        nbytes = self.executor.outbox.bytes + self.executor.received_bytes
        for state in states[:-1]:
            frames += state["sent_frames"]
            nbytes += state["sent_bytes"]
        return frames, nbytes

    def generate(self, prompt: list[int], tokens: int, logits: bool) -> tuple[list[int], list[float]]:
        self.executor.return_logits = logits
        return greedy_tokens_and_gaps(self.engine, self.loop, prompt, tokens)

    def close(self) -> None:
        self.engine.close()
        self.loop.close()


def stage_state_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage: ``steps`` and every timing-like numeric STATE field, after minus before, and the
    bytes its prefix cache holds afterwards (0: off, as this benchmark asks)."""
    out = []
    for b, a in zip(before, after):
        rec: dict[str, Any] = {"node_id": a.get("node_id"), "prefix_bytes": a.get("prefix_bytes")}
        for key, value in a.items():
            if (key == "steps" or key.endswith(_TIMING_SUFFIXES)) and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and isinstance(b.get(key), (int, float)):
                rec[key] = value - b[key]
        out.append(rec)
    return out


def worker(args: argparse.Namespace, out: TextIO, commands: TextIO | None = None) -> int:
    """Warm up, then measure one run of ``args.worker``; print its result as one JSON line to ``out``.

    With ``commands`` (``--serve-runs``), the process stays: it measures one more run for every
    "run" line read there (no new warm-up: the earlier runs warmed it), until "exit" or EOF.
    """
    import mlxcel  # noqa: F401  (before mlx.core: picks up OpenBLAS, see mlxcel/blas.py)
    from mlxcel.engine.prompts import encode_chat
    from mlxcel.models.loading import load_checkpoint

    mode, remote = args.worker, args.worker.startswith("remote_")
    t_start = time.perf_counter()
    loaded = load_checkpoint(args.model, lazy=remote)  # the coordinator holds no layers: tokenizer and config
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": args.prompt}])
    driver = None
    if remote:
        driver = RemoteDriver(Path(args.model), args.cluster / "cluster.toml", args.cluster / "cluster.secret",
                              loaded.tokenizer)
        remote_driver, logits = driver, mode.endswith("logits")

        def run(n: int, tl: Timeline | None) -> tuple[list[int], list[float]]:
            remote_driver.timeline = tl
            return remote_driver.generate(prompt, n, logits)
    else:
        model = loaded.model
        if mode == "single":
            forward, cache_of = (lambda x, c: model(x, cache=c)), model
        else:
            from mlxcel.pipeline.inprocess import InProcessPipeline, stage_ranges

            cache_of = InProcessPipeline(model, stage_ranges(args.model, loaded.num_layers, args.stages, None))
            forward = cache_of

        def run(n: int, tl: Timeline | None) -> tuple[list[int], list[float]]:
            return timed_tokens(forward, cache_of, prompt, n, tl)
    try:
        if args.warmup:
            run(args.warmup, None)
        load_s = time.perf_counter() - t_start
        for index in itertools.count():
            out.write(json.dumps({**measure(args, run, driver, prompt), "load_s": load_s, "worker_run": index}) + "\n")
            out.flush()
            if commands is None or commands.readline().strip() != "run":
                break
    finally:
        if driver:
            driver.close()
    return 0


def measure(args: argparse.Namespace, run: Callable, driver: "RemoteDriver | None", prompt: list[int]) -> dict[str, Any]:
    """One measured run of ``run`` (tokens, gaps, CPU, per-token timeline, wire and stage deltas)."""
    timeline = Timeline()
    states = driver.states() if driver else []
    wire0 = driver.wire(states) if driver else None
    stage0 = [proc_cpu_s(p) for p in args.stage_pids]
    load_1m = host_load()  # how busy the host was
    cpu0, wall0 = self_cpu_s(), time.perf_counter()
    tokens, gaps = run(args.tokens, timeline)
    wall, cpu = time.perf_counter() - wall0, self_cpu_s() - cpu0
    stage1 = [proc_cpu_s(p) for p in args.stage_pids]
    # compile_step: always False since MLXCEL_COMPILE_STEP was removed (issue 41); kept for the report schema
    result: dict[str, Any] = {"pid": os.getpid(), "mode": args.worker, "compile_step": False,
                              "prompt_tokens": len(prompt), "tokens": tokens, "gaps_s": gaps, "wall_s": wall,
                              "cpu_s_worker": cpu, "cpu_s_stage": cpu_delta(stage0, stage1), "load_1m": load_1m,
                              "steps": [{**s, "t_submit": s["t_submit"] - wall0, "t_done": s["t_done"] - wall0}
                                        for s in timeline.steps]}
    if driver:
        time.sleep(0.2)  # let the release round trip land in the counters
        after = driver.states()
        wire1 = driver.wire(after)
        n = max(len(tokens), 1)
        result.update(frames_per_token=(wire1[0] - wire0[0]) / n, bytes_per_token=(wire1[1] - wire0[1]) / n,
                      stage_state=stage_state_delta(states, after))
    return result


def worker_main(args: argparse.Namespace) -> int:
    """Keep stdout for the one JSON line: anything else printed (by us or by libraries) goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return worker(args, out, sys.stdin if args.serve_runs else None)


# -- remote stages --------------------------------------------------------------------------------


class StageCluster:
    """Stage processes started through the CLI, and the TOML the coordinator side uses."""

    def __init__(self, model_dir: Path, stages: int, workdir: Path, devices: list[str] | None = None,
                 threads: int | None = None, env: dict[str, str] | None = None):
        self.model_dir = model_dir
        self.env = env or {}  # extra environment of the stage processes only (a stage-side lever)
        self.workdir = workdir
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
                             f'[pipeline]\nmax_batch_size = 8\nprefix_cache_mb = 0\n\n[timeouts]\nheartbeat_s = {HEARTBEAT_S}\nexchange_s = 120\n\n{nodes}')
        self.procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        for i, host in enumerate(STAGE_HOSTS[: len(self.addrs)]):
            cmd = [sys.executable, "-m", "mlxcel", "serve", "-m", str(self.model_dir), "--distributed-config",
                   str(self.toml), "--node-id", f"stage-{i}", "--host", host, "--port", "0", "--log-level", "warning"]
            env = {**os.environ, **self.env}
            if self.threads:
                env["OPENBLAS_NUM_THREADS"] = str(self.threads)
            if self.devices:
                env["CUDA_VISIBLE_DEVICES"] = self.devices[i % len(self.devices)]
            log = open(self.toml.parent / f"stage-{i}.log", "wb")  # noqa: SIM115 - the child holds it
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env))
            log.close()
        time.sleep(3)  # a stage that cannot even import or load fails in seconds: say so now, not after a timeout
        if any(p.poll() is not None for p in self.procs):
            raise RuntimeError(f"a stage process exited at start:\n{self.log_tails()}")

    def log_tails(self, chars: int = 1500) -> str:
        """The end of every stage's stderr, for an error message."""
        out = []
        for i in range(len(self.addrs)):
            path = self.toml.parent / f"stage-{i}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            out.append(f"--- stage-{i} (exit {self.procs[i].poll()}):\n{text[-chars:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- the parent: one worker process per run and mode ------------------------------------------------


class WorkerError(RuntimeError):
    """A worker process failed or printed no result."""


def worker_command(args: argparse.Namespace, mode: str, cluster: StageCluster | None, *, tokens: int,
                   warmup: int) -> list[str]:
    cmd = [sys.executable, "-m", "bench.pipeline_bench", "--worker", mode, "-m", str(Path(args.model).resolve()),
           "--stages", str(args.stages), "--tokens", str(tokens), "--warmup", str(warmup), "--prompt", args.prompt]
    if cluster is not None:
        cmd += ["--cluster", str(cluster.workdir), "--stage-pids", ",".join(map(str, cluster.pids))]
    return cmd


def run_worker(args: argparse.Namespace, mode: str, cluster: StageCluster | None, *, tokens: int,
               warmup: int) -> dict[str, Any]:
    """One fresh worker process; its result plus ``cpu_s_worker_total`` (its whole life: imports,
    load, warm-up and run)."""
    cmd = worker_command(args, mode, cluster, tokens=tokens, warmup=warmup)
    cpu0 = children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, cwd=REPO)
    cpu = children_cpu_s() - cpu0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        stages = f"\n{cluster.log_tails()}" if cluster is not None else ""
        raise WorkerError(f"worker {mode} exited with {proc.returncode}: {proc.stderr[-3000:]}{stages}")
    return {**json.loads(lines[-1]), "cpu_s_worker_total": cpu}


class ReusedWorkers:
    """``--reuse-workers``: one worker process per mode, kept for every run of that mode (loaded once).

    The runs of the modes still alternate (ABBA) and no two modes share a process; what is given up
    is only the fresh process per run, which on a GPU host costs 10-20 s of start-up per run
    (imports, CUDA context, checkpoint load). Rows say ``worker_reused``.
    """

    def __init__(self, args: argparse.Namespace, cluster: StageCluster | None):
        self.args, self.cluster = args, cluster
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Any] = {}

    def run(self, mode: str) -> dict[str, Any]:
        proc = self.procs.get(mode)
        if proc is None:
            cmd = worker_command(self.args, mode, self.cluster, tokens=self.args.tokens, warmup=self.args.warmup)
            self.logs[mode] = tempfile.TemporaryFile()
            proc = self.procs[mode] = subprocess.Popen(cmd + ["--serve-runs"], stdin=subprocess.PIPE,
                                                       stdout=subprocess.PIPE, stderr=self.logs[mode], text=True, cwd=REPO)
        else:
            proc.stdin.write("run\n")
            proc.stdin.flush()
        line = proc.stdout.readline()
        while line and not line.startswith("{"):
            line = proc.stdout.readline()
        if not line:
            self.logs[mode].seek(0)
            stages = f"\n{self.cluster.log_tails()}" if self.cluster is not None else ""
            raise WorkerError(f"worker {mode} exited with {proc.wait()}: "
                              f"{self.logs[mode].read()[-3000:].decode(errors='replace')}{stages}")
        return {**json.loads(line), "cpu_s_worker_total": None}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.stdin.write("exit\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ms_percentile(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else p * 1e3


def row_of(args: argparse.Namespace, name: str, run: int, position: int, res: dict[str, Any],
           reference: list[int]) -> dict[str, Any]:
    """The benchmark row of one worker's result."""
    gaps, stage_cpu = res["gaps_s"], res.get("cpu_s_stage")
    latencies = [s["t_done"] - s["t_submit"] for s in res["steps"] if s["kind"] == "decode"]
    return {
        "bench": "pipeline", "mode": name, "stages": 1 if name == "single" else args.stages, "streams": 1,
        "run": run, "order": position, "tokens": len(res["tokens"]), "prompt_tokens": res["prompt_tokens"],
        "tok_s": len(gaps) / sum(gaps), "per_token_ms_p50": ms_percentile(gaps, 50),
        "per_token_ms_p95": ms_percentile(gaps, 95), "latency_ms_p50": ms_percentile(latencies, 50),
        "latency_ms_p95": ms_percentile(latencies, 95), "frames_per_token": res.get("frames_per_token"),
        "bytes_per_token": res.get("bytes_per_token"), "return": "logits" if name.endswith("logits") else "token",
        "identical": res["tokens"] == reference, "model": Path(args.model).name, "fair_comparison": True,
        "worker_pid": res["pid"], "wall_s": res["wall_s"], "cpu_s_worker": round(res["cpu_s_worker"], 3),
        "cpu_s_worker_total": None if res["cpu_s_worker_total"] is None else round(res["cpu_s_worker_total"], 3), "cpu_s_stage": stage_cpu,
        "cpu_s_stages": round(sum(stage_cpu), 3) if stage_cpu else None, "stage_state": res.get("stage_state"),
        "load_1m": res.get("load_1m"), "compile_step": res.get("compile_step"),
        "bench_env": {k: os.environ[k] for k in BENCH_ENV if k in os.environ},
        "worker_reused": res.get("worker_run", 0) > 0, "worker_run": res.get("worker_run", 0),
    }


def trace_lines(name: str, run: int, res: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"mode": name, "run": run, "token": i, "kind": s["kind"], "pid": res["pid"],
             "t_submit": round(s["t_submit"], 6), "t_done": round(s["t_done"], 6),
             "ms": round((s["t_done"] - s["t_submit"]) * 1e3, 3)} for i, s in enumerate(res["steps"])]


def single_stream(args: argparse.Namespace, cluster: StageCluster | None) -> tuple[list[dict], list[dict]]:
    """ABBA runs of every mode, each in a fresh worker (or one per mode, ``--reuse-workers``); (rows, trace lines)."""
    modes = [m for m in MODES if m in args.modes]
    if cluster is not None and args.warmup and any(m.startswith("remote_") for m in modes) and not args.reuse_workers:
        run_worker(args, "remote_pp", cluster, tokens=max(args.warmup, 2), warmup=0)  # the stages' own warm-up
    rows: list[dict] = []
    traces: list[dict] = []
    pool = ReusedWorkers(args, cluster) if args.reuse_workers else None
    try:
        return _abba(args, modes, cluster, pool, rows, traces)
    finally:
        if pool is not None:
            pool.close()


def _abba(args: argparse.Namespace, modes: list[str], cluster: StageCluster | None, pool: ReusedWorkers | None,
          rows: list[dict], traces: list[dict]) -> tuple[list[dict], list[dict]]:
    reference: list[int] | None = None
    for run in range(args.runs):
        order = modes if run % 2 == 0 else modes[::-1]
        for position, name in enumerate(order):
            res = pool.run(name) if pool is not None else run_worker(args, name, cluster, tokens=args.tokens,
                                                                     warmup=args.warmup)
            reference = reference or res["tokens"]
            rows.append(row_of(args, name, run, position, res, reference))
            traces += trace_lines(name, run, res)
            r = rows[-1]
            wire = f", {r['frames_per_token']:.2f} frames/token, {r['bytes_per_token']:.0f} B/token" \
                if r["frames_per_token"] is not None else ""
            stages = f", stages {r['cpu_s_stage']}" if r["cpu_s_stage"] is not None else ""
            print(f"run {run} {name:>17}: {r['tok_s']:6.2f} tok/s, latency p50 {r['latency_ms_p50'] or 0:.1f} ms"
                  f"{wire}; CPU-s worker {r['cpu_s_worker']:.2f}{stages} (pid {r['worker_pid']}, load {r['load_1m'] or 0:.1f})",
                  flush=True)
    return rows, traces


def write_traces(out_dir: Path, traces: list[dict], started: str) -> list[Path]:
    """Append the per-token lines to ``trace-<mode>.jsonl`` (one file per mode); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for mode in dict.fromkeys(t["mode"] for t in traces):
        path = out_dir / f"trace-{mode}.jsonl"
        with path.open("a", encoding="utf-8") as fh:
            for t in traces:
                if t["mode"] == mode:
                    fh.write(json.dumps({**t, "bench_started": started}) + "\n")
        paths.append(path)
    return paths


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


def stage_overlapped(url: str) -> int | None:
    """The stages' steps built ahead since they started, from the coordinator's /metrics once a heartbeat has
    brought their STATE (None if it does not say)."""
    import httpx

    time.sleep(HEARTBEAT_S + 0.5)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("mlxcel_pipeline_stage_overlapped_steps_total "):
            return int(float(line.split()[1]))
    return None


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
                    usage = json.loads(line[6:]).get("usage") or {}
                    n = usage.get("completion_tokens", n)
        return n

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, prompts[i]) for i in range(streams)))
        return time.perf_counter() - start, sum(counts)


def server_levels(args: argparse.Namespace, cluster: StageCluster) -> list[dict]:
    single, single_url = launch_server(["-m", args.model, "--parallel", "8", "--prefix-cache-mb", "0"], "127.0.0.1")
    coord, coord_url = launch_server(["-m", args.model, "--parallel", "8", "--distributed-config", str(cluster.toml),
                                      "--node-id", "coordinator"], COORDINATOR_HOST)
    servers = {"server_single": single_url, "server_remote_pp": coord_url}
    rows = []
    try:
        for level, streams in enumerate(args.streams):
            # warm both at this level's batch size: a GPU compiles its batched kernels (4-bit on the CUDA
            # backend: NVRTC, minutes) on first use of a shape, which a 2-stream warm-up does not reach
            for url in servers.values():
                asyncio.run(load_level(url, streams, 8, [f"warm up {i}" for i in range(streams)]))
            prompts = [f"{args.prompt} (reader {i})" for i in range(streams)]
            for rnd in range(args.rounds):
                order = list(servers) if (rnd + level) % 2 == 0 else list(reversed(servers))
                for position, name in enumerate(order):
                    wall, n = asyncio.run(load_level(servers[name], streams, args.server_tokens, prompts))
                    rows.append({"bench": "pipeline", "mode": name, "stages": 1 if name == "server_single" else args.stages,
                                 "streams": streams, "run": rnd, "order": position, "tokens": n, "tok_s": n / wall,
                                 "per_token_ms_p50": None, "frames_per_token": None, "bytes_per_token": None,
                                 "return": "token", "identical": None, "model": Path(args.model).name,
                                 "fair_comparison": True})  # both are deployed servers, warmed alike
                    if name == "server_remote_pp":  # steps the stages built ahead so far (docs/pipeline.md §3.13)
                        rows[-1]["stage_overlapped_steps"] = stage_overlapped(coord_url)
                    print(f"{streams} streams round {rnd} {name:>17}: {n / wall:6.2f} tok/s aggregate", flush=True)
    finally:
        for proc in (coord, single):
            proc.terminate()
            proc.wait(30)
    return rows


# -- main ---------------------------------------------------------------------------------------------


def summarize(rows: list[dict], key: str = "tok_s") -> dict[str, tuple[float, float, float]]:
    out: dict[str, tuple[float, float, float]] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        xs = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None]
        if xs:
            out[mode] = (statistics.median(xs), min(xs), max(xs))
    return out


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}")
    return modes


def _pids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeline_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="models/smollm2-135m-instruct")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=8, help="tokens each worker generates before its measured run")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (chat template applied)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x], default=[2, 4, 8],
                   help="server concurrency levels (empty to skip part 2)")
    p.add_argument("--server-tokens", type=int, default=64, help="tokens per request in part 2")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds per concurrency level")
    p.add_argument("--stage-devices", type=lambda s: s.split(","), default=None,
                   help="CUDA_VISIBLE_DEVICES of each stage process, e.g. 0,1 for one GPU per stage")
    p.add_argument("--stage-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS of each stage process (stages that share one host's cores)")
    p.add_argument("--stage-env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the stage processes only (repeatable; recorded in the rows), "
                        "e.g. MLXCEL_HANDOFF_COPY=1")
    p.add_argument("--label", default=None, help="free-form label recorded in every row (e.g. h200-x2)")
    p.add_argument("--trace", action="store_true", help="also write trace-<mode>.jsonl: one line per token")
    p.add_argument("--reuse-workers", action="store_true",
                   help="one worker process per mode for all its runs (loaded and warmed once), not one per run")
    p.add_argument("--quick", action="store_true", help="2 runs of 16 tokens, streams 2, 16 tokens (smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench/results") / time.strftime("%Y-%m-%d"))
    internal = p.add_argument_group("worker (internal: one mode, one run, started by the benchmark itself)")
    internal.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    internal.add_argument("--cluster", type=Path, default=None, help=argparse.SUPPRESS)
    internal.add_argument("--stage-pids", type=_pids, default=[], help=argparse.SUPPRESS)
    internal.add_argument("--serve-runs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.tokens, args.streams, args.server_tokens, args.rounds = 2, 16, [2], 16, 1
    if args.worker and args.worker.startswith("remote_") and args.cluster is None:
        p.error(f"--worker {args.worker} needs --cluster")
    if not args.worker and args.tokens < 2:
        p.error("--tokens must be at least 2 (a rate needs two tokens)")
    return args


def print_summary(rows: list[dict], args: argparse.Namespace) -> None:
    one = [r for r in rows if r["streams"] == 1]
    tps = summarize(one)
    base = tps.get("single", (0, 0, 0))[0]
    for mode, (med, lo, hi) in tps.items():
        ratio = f" = {med / base:.3f}x single" if base else ""
        mine = [r for r in one if r["mode"] == mode]
        cpu = statistics.median(r["cpu_s_worker"] for r in mine)
        stages = [r["cpu_s_stages"] for r in mine if r["cpu_s_stages"] is not None]
        extra = f", stages {statistics.median(stages):.2f}" if stages else ""
        print(f"{mode:>17}: median {med:6.2f} tok/s (runs {lo:.2f}-{hi:.2f}){ratio}; CPU-s worker {cpu:.2f}{extra}")
    print(f"identical tokens across modes: {all(r['identical'] for r in one)}; "
          f"distinct worker processes: {len({r['worker_pid'] for r in one})} of {len(one)}")
    for streams in args.streams:
        level = summarize([r for r in rows if r["streams"] == streams])
        if "server_single" in level and "server_remote_pp" in level:
            ratio = level["server_remote_pp"][0] / level["server_single"][0]
            print(f"{streams} streams: single {level['server_single'][0]:.2f}, 2-stage {level['server_remote_pp'][0]:.2f} "
                  f"tok/s aggregate = {ratio:.3f}x")


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["protection"]:  # part 3: protected against unprotected decode (bench/protection_bench.py)
        from bench.protection_bench import main as protection_main

        return protection_main(argv[1:])
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    needs_stages = bool(args.streams) or (args.runs and any(m.startswith("remote_") for m in args.modes))
    traces: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mlxcel-pipeline-bench-") as tmp:
        cluster = StageCluster(Path(args.model), args.stages, Path(tmp), args.stage_devices, args.stage_threads,
                               dict(args.stage_env)) if needs_stages else None
        try:
            if cluster is not None:
                cluster.start()
            rows, traces = single_stream(args, cluster) if args.runs else ([], [])
            if args.streams and cluster is not None:
                rows += server_levels(args, cluster)
        finally:
            if cluster is not None:
                cluster.stop()
    for row in rows:
        row["label"] = args.label
        row["stage_devices"] = ",".join(args.stage_devices) if args.stage_devices else None
        row["stage_threads"] = args.stage_threads
        row["stage_env"] = dict(args.stage_env) or None
        row["bench_started"] = started
    path = write_jsonl(args.out / "pipeline_bench.jsonl", rows)
    print(f"\nrows: {path}")
    if args.trace and traces:
        print("trace: " + ", ".join(map(str, write_traces(args.out, traces, started))))
    print_summary(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
