"""Where a remote stage's extra compute comes from on one GPU: two evaluations, or two processes.

The remote pipeline's stages each spend about twice what their half of the model costs alone on the GPU
(docs/benchmarks.md, H200 2026-12-02). This probe takes the pipeline's machinery away (no transport, no
AES, no scheduler) and times one greedy token, batch 1, of the same checkpoint in five ways:

- ``whole_async``: one process, the whole model, the next step queued with ``mx.async_eval`` before the
  current token is read (mlx-lm's generate loop; what the single-device rows run);
- ``whole_sync``: one process, the whole model, each step built, evaluated and read before the next;
- ``split_1proc``: one process, the two halves evaluated one after the other, the hidden state through
  host bytes in between (a stage's step, twice, with no second process);
- ``split_2proc``: two processes, a half each, the hidden state and the token through OS pipes (a remote
  pipeline of two stages on one GPU, without its transport);
- ``split_2proc_spin``: as ``split_2proc``, every receiver polling its pipe instead of sleeping in ``recv``;
- ``split_2proc_runner``: as ``split_2proc``, each half through a stage's own ``SliceRunner`` (its slot
  bookkeeping; the last half samples with a ``RowSampler``, greedy, with the log-probability a stage returns).

Per mode: tok/s and the per-token p50; for the split modes also each half's compute (input bytes to
evaluated output) p50; and whether its tokens are the first run's (every mode computes the same greedy tokens). Rows: --out (JSONL with the environment).

    python -m bench.gpu.pingpong_probe -m /tmp/models/q06-bf16 --tokens 128 --out bench/results/pingpong.jsonl
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

from bench.environment import write_jsonl

MODES = ("whole_async", "whole_sync", "split_1proc", "split_2proc", "split_2proc_spin", "split_2proc_runner")


def _load(model_dir: str) -> Any:
    import mlxcel  # noqa: F401  (BLAS and MLX set-up)
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(model_dir, tokenizer=False).model


class Half:
    """One half of the model as a stage runs it: bytes in, evaluated output, bytes out."""

    def __init__(self, model: Any, start: int, end: int, prompt: list[int], runner: bool = False) -> None:
        import mlx.core as mx

        from mlxcel.engine.executor import slice_runner
        from mlxcel.engine.model_slice import ModelSlice
        from mlxcel.engine.runner import RowSampler
        from mlxcel.engine.sampling import SamplingParams

        self.piece = ModelSlice(model, start, end)
        self.runner = slice_runner(model, start, end, max_rows=1) if runner else None
        if self.runner is not None:
            self.runner.prepare("r", RowSampler(SamplingParams(temperature=0.0)) if end == len(model.model.layers)
                                else None)
        self.first = start == 0
        self.last = end == len(model.model.layers)
        self.cache = self.piece.make_cache()
        self.dtype = model.model.embed_tokens.weight.dtype
        self.compute: list[float] = []
        self._mx = mx
        self.prompt = prompt

    def prefill(self, hidden: bytes | None) -> bytes:
        mx = self._mx
        x = mx.array([self.prompt], dtype=mx.int32) if self.first else self._from_bytes(hidden, len(self.prompt))
        if self.runner is not None:
            return self._emit(self.runner.prefill("r", x, sample=True), time.perf_counter(), keep=False)
        return self._finish(self.piece(x, self.cache), time.perf_counter(), keep=False)

    def step(self, data: bytes) -> bytes:
        mx = self._mx
        t0 = time.perf_counter()
        x = mx.array([[int.from_bytes(data, "little")]], dtype=mx.int32) if self.first else self._from_bytes(data, 1)
        if self.runner is not None:
            return self._emit(self.runner.decode(0, ["r"], x), t0)
        return self._finish(self.piece(x, self.cache), t0)

    def _emit(self, out: Any, t0: float, keep: bool = True) -> bytes:
        """A runner's output as bytes: the sampled token (last half) or the evaluated hidden state."""
        data = int(out[0].token).to_bytes(4, "little") if self.last else self._hidden_bytes(out)
        return self._timed(data, t0, keep)

    def _from_bytes(self, data: bytes, n: int) -> Any:
        import numpy as np

        mx = self._mx
        flat = np.frombuffer(data, dtype=np.uint16)
        return mx.array(flat).view(mx.bfloat16).reshape(1, n, -1).astype(self.dtype) if self.dtype == mx.bfloat16 \
            else mx.array(np.frombuffer(data, dtype=np.float32)).reshape(1, n, -1)

    def _finish(self, out: Any, t0: float, keep: bool = True) -> bytes:
        """A plain half's output as bytes: the greedy token (last half) or the evaluated hidden state."""
        mx = self._mx
        if self.last:
            tok = mx.argmax(out[:, -1, :], axis=-1)
            mx.eval(tok)
            return self._timed(int(tok.item()).to_bytes(4, "little"), t0, keep)
        return self._timed(self._hidden_bytes(out), t0, keep)

    def _hidden_bytes(self, out: Any) -> bytes:
        """The hidden state evaluated and copied out as the wire carries it (bfloat16's 16 bits, or float32)."""
        import numpy as np

        mx = self._mx
        out = out.astype(mx.bfloat16) if self.dtype == mx.bfloat16 else out.astype(mx.float32)
        mx.eval(out)
        return np.array(out.view(mx.uint16) if self.dtype == mx.bfloat16 else out, copy=False).tobytes()

    def _timed(self, data: bytes, t0: float, keep: bool) -> bytes:
        if keep:
            self.compute.append(time.perf_counter() - t0)
        return data


def _recv(conn: Any, spin: bool) -> bytes:
    if spin:
        while not conn.poll(0):
            pass
    return conn.recv_bytes()


def _stage_process(model_dir: str, start: int, end: int, prompt: list[int], inbox: Any, outbox: Any,
                   report: Any, spin: bool, runner: bool) -> None:
    half = Half(_load(model_dir), start, end, prompt, runner)
    report.send("ready")
    first = _recv(inbox, spin)  # b"" to prefill, then one message per token
    outbox.send_bytes(half.prefill(first if first else None))
    while True:
        data = _recv(inbox, spin)
        if data == b"stop":
            if not half.last:
                outbox.send_bytes(b"stop")
            break
        outbox.send_bytes(half.step(data))
    report.send(half.compute)


def run_whole(model: Any, prompt: list[int], tokens: int, use_async: bool, seen: list[int]) -> list[float]:
    import mlx.core as mx

    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)

    def forward(x: Any) -> Any:
        return mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)

    y = forward(mx.array([prompt], dtype=mx.int32))
    mx.eval(y)
    times, last = [], time.perf_counter()
    for _ in range(tokens):
        if use_async:
            nxt = forward(y.reshape(1, 1))
            mx.async_eval(nxt)
            seen.append(y.item())
            y = nxt
        else:
            seen.append(y.item())
            y = forward(mx.array([[seen[-1]]], dtype=mx.int32))
            mx.eval(y)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def run_split_1proc(model: Any, prompt: list[int], tokens: int,
                    seen: list[int]) -> tuple[list[float], list[float], list[float]]:
    n = len(model.model.layers)
    a, b = Half(model, 0, n // 2, prompt), Half(model, n // 2, n, prompt)
    tok = b.prefill(a.prefill(None))
    times, last = [], time.perf_counter()
    for _ in range(tokens):
        seen.append(int.from_bytes(tok, "little"))
        tok = b.step(a.step(tok))
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times, a.compute, b.compute


def run_split_2proc(model_dir: str, n: int, prompt: list[int], tokens: int, spin: bool, seen: list[int],
                    runner: bool = False) -> tuple[list, list, list]:
    ctx = mp.get_context("spawn")
    to_a, a_in = ctx.Pipe()
    a_out, b_in = ctx.Pipe()
    b_out, from_b = ctx.Pipe()
    rep_a, rep_a_child = ctx.Pipe()
    rep_b, rep_b_child = ctx.Pipe()
    procs = [ctx.Process(target=_stage_process, args=(model_dir, 0, n // 2, prompt, a_in, a_out, rep_a_child, spin, runner)),
             ctx.Process(target=_stage_process, args=(model_dir, n // 2, n, prompt, b_in, b_out, rep_b_child, spin, runner))]
    for p in procs:
        p.start()
    try:
        rep_a.recv(), rep_b.recv()
        to_a.send_bytes(b"")
        tok = _recv(from_b, spin)
        times, last = [], time.perf_counter()
        for _ in range(tokens):
            seen.append(int.from_bytes(tok, "little"))
            to_a.send_bytes(tok)
            tok = _recv(from_b, spin)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        to_a.send_bytes(b"stop")  # stage 0 passes it on to stage 1
        compute_a = rep_a.recv() if rep_a.poll(60) else []
        compute_b = rep_b.recv() if rep_b.poll(60) else []
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join()
    return times, compute_a, compute_b


def _ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e3, 4) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="passes over the modes, order reversed every other")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", type=Path, default=Path("bench/results/pingpong_probe.jsonl"))
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s): {', '.join(sorted(unknown))} (known: {', '.join(MODES)})")

    model = _load(args.model)
    n = len(model.model.layers)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(args.prompt)]
    rows = []
    reference: list[int] = []  # the first run's tokens: every mode must give the same
    for rnd in range(args.rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            ca: list[float] = []
            cb: list[float] = []
            seen: list[int] = []
            if mode.startswith("whole"):
                times = run_whole(model, prompt, args.tokens, mode == "whole_async", seen)
            elif mode == "split_1proc":
                times, ca, cb = run_split_1proc(model, prompt, args.tokens, seen)
            else:
                times, ca, cb = run_split_2proc(args.model, n, prompt, args.tokens, mode.endswith("spin"), seen,
                                                mode.endswith("runner"))
            reference = reference or seen
            row = {"bench": "pingpong_probe", "model": Path(args.model).name, "label": args.label, "round": rnd,
                   "mode": mode, "tokens": len(times), "same_tokens": seen == reference,
                   "tok_s": round(len(times) / sum(times), 2) if times else None,
                   "token_ms_p50": _ms(times), "half0_compute_ms_p50": _ms(ca), "half1_compute_ms_p50": _ms(cb)}
            rows.append(row)
            print(f"round {rnd} {mode:>17}: {row['tok_s']} tok/s, token p50 {row['token_ms_p50']} ms, "
                  f"halves {row['half0_compute_ms_p50']} / {row['half1_compute_ms_p50']} ms, "
                  f"same tokens {row['same_tokens']}", flush=True)
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
