"""The per-row logits processors hook (mlxcel.engine.logits): mlx-lm's processors, each row its own."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxcel.engine.logits import PENALTY_CONTEXT
from mlxcel.engine.runner import RowSampler, sample_rows
from mlxcel.engine.sampling import MAX_LOGIT_BIAS, SamplingError, SamplingParams

V = 64


def logits_seq(steps: int, rows: int = 1, seed: int = 0) -> list[mx.array]:
    mx.random.seed(seed)
    return [mx.random.normal((rows, V)) for _ in range(steps)]


def run(row: RowSampler, seq: list[mx.array]) -> list[int]:
    return [sample_rows(x, [row])[0].token for x in seq]


def mlx_lm_greedy(seq: list[mx.array], context: list[int], **kw) -> list[int]:
    """What mlx-lm's generate_step does: its processors over prompt + generated tokens, then argmax."""
    processors = make_logits_processors(**kw)
    tokens, out = list(context), []
    for x in seq:
        x = x + 0  # mlx-lm's presence penalty writes into the array it is given
        for proc in processors:
            x = proc(mx.array(tokens), x)
        out.append(int(mx.argmax(x, axis=-1).item()))
        tokens.append(out[-1])
    return out


def test_logit_bias_plus_100_forces_a_token_greedy():
    seq = logits_seq(4)
    plain = run(RowSampler(SamplingParams()), seq)
    target = next(t for t in range(V) if t not in plain)
    assert run(RowSampler(SamplingParams(logit_bias=((target, 100.0),))), seq) == [target] * 4


def test_logit_bias_minus_100_bans_the_greedy_token():
    seq = logits_seq(3)
    plain = run(RowSampler(SamplingParams()), seq)
    banned = run(RowSampler(SamplingParams(logit_bias=((plain[0], -100.0),))), seq)
    assert plain[0] not in banned


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.8},
    {"presence_penalty": 0.7, "frequency_penalty": 0.9, "repetition_penalty": 1.3, "logit_bias": {3: 2.0}},
])
def test_penalties_equal_mlx_lm_processors_over_prompt_and_output(kw):
    # logits that favour a few tokens at every step, so repeats happen and penalties bite
    seq = [x + mx.array([4.0 if t < 4 else 0.0 for t in range(V)]) for x in logits_seq(30, seed=1)]
    prompt = [1, 2, 5, 7] * 8  # longer than the window: only its last PENALTY_CONTEXT tokens count
    params = SamplingParams(**{**kw, "logit_bias": tuple(sorted(kw.get("logit_bias", {}).items()))})
    ours = run(RowSampler(params, context=prompt), seq)
    ref_kw = {k: v for k, v in kw.items()}
    ref_kw.update(repetition_context_size=PENALTY_CONTEXT, presence_context_size=PENALTY_CONTEXT,
                  frequency_context_size=PENALTY_CONTEXT)
    assert ours == mlx_lm_greedy(seq, prompt, **ref_kw)
    assert ours != run(RowSampler(SamplingParams(), context=prompt), seq)


def test_batched_rows_each_keep_their_own_processors():
    seq = [x + mx.array([3.0 if t < 3 else 0.0 for t in range(V)]) for x in logits_seq(12, rows=3, seed=2)]
    params = [SamplingParams(presence_penalty=2.0), SamplingParams(), SamplingParams(logit_bias=((9, 100.0),))]
    batch = [RowSampler(p, context=[1, 2]) for p in params]
    together = [[s.token for s in sample_rows(x, batch)] for x in seq]
    for i, p in enumerate(params):
        alone = run(RowSampler(p, context=[1, 2]), [x[i : i + 1] for x in seq])
        assert [step[i] for step in together] == alone


def test_min_p_one_keeps_only_the_top_token():
    seq = logits_seq(6, seed=3)
    greedy = run(RowSampler(SamplingParams()), seq)
    hot = RowSampler(SamplingParams(temperature=2.0, min_p=1.0, seed=5))
    assert run(hot, seq) == greedy


def test_logprobs_are_those_of_the_processed_logits():
    x = logits_seq(1)[0]
    row = RowSampler(SamplingParams(logprobs=True, logit_bias=((7, 100.0),)))
    got = sample_rows(x, [row])[0]
    assert got.token == 7 and got.logprob == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("kw,param", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"), ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((2, 1.0), (1, 1.0))}, "logit_bias"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))}, "logit_bias"),
])
def test_bad_values_are_refused_naming_the_field(kw, param):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**kw)
    assert err.value.param == param


def test_a_token_id_outside_the_logits_is_refused_before_indexing():
    row = RowSampler(SamplingParams(logit_bias=((V + 5, 1.0),)))
    with pytest.raises(IndexError, match="outside the model's vocabulary"):
        sample_rows(logits_seq(1)[0], [row])
