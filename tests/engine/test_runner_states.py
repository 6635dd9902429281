"""A decode slot of a linear-attention model (qwen3_next: ArraysCache layers) takes rows late and gives them back.

A one-row slot keeps the row's own caches; an ArraysCache looks like a merged batch cache (it has
``left_padding``), so the runner must know by itself whether a slot is merged: a second row joining a
one-row slot, and the prefix cache taking a one-row slot's cache, both failed before it did.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.engine.executor import whole_model_runner
from mlxcel.engine.runner import RowSampler
from mlxcel.engine.sampling import SamplingParams
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)

A, B = [5, 17, 90, 3, 42, 7], [7, 7, 1]


def greedy_alone(model, prompt: list[int], n: int) -> list[int]:
    runner = whole_model_runner(model, max_rows=2)
    runner.prepare("x", RowSampler(SamplingParams()))
    out = [runner.prefill("x", mx.array([prompt]), sample=True)[0].token]
    for _ in range(n - 1):
        out.append(runner.decode(0, ["x"], mx.array([[out[-1]]]))[0].token)
    return out


def test_a_row_joins_a_one_row_slot_and_each_row_decodes_as_alone(family_checkpoint):  # noqa: F811
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(family_checkpoint("qwen3_next")).model
    runner = whole_model_runner(model, max_rows=2)
    runner.prepare("a", RowSampler(SamplingParams()))
    a = [runner.prefill("a", mx.array([A]), sample=True)[0].token]
    a.append(runner.decode(0, ["a"], mx.array([[a[-1]]]))[0].token)  # a alone in slot 0: its own caches
    cache, length = runner.take_cache("a")
    assert length == len(A) + 1 and type(cache[0]).__name__ == "ArraysCache"
    runner.prepare("b", RowSampler(SamplingParams()))
    b = [runner.prefill("b", mx.array([B]), sample=True)[0].token]
    for _ in range(3):  # b joins slot 0 beside a
        got = runner.decode(0, ["a", "b"], mx.array([[a[-1]], [b[-1]]]))
        a.append(got[0].token)
        b.append(got[1].token)
    assert runner.take_cache("b")[1] == len(B) + 3
    runner.release("a")
    b.append(runner.decode(0, ["b"], mx.array([[b[-1]]]))[0].token)
    assert a == greedy_alone(model, A, 5) and b == greedy_alone(model, B, 5)
