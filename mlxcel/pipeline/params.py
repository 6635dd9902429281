"""Sequence fields on the wire (docs/pipeline.md §3.5): PREPARE's ``params`` object, and the prefix
cache's token lists (PREPARE ``prompt``, RELEASE ``tokens``) and counts (``max_cached``, ACK ``cached``)."""

from __future__ import annotations

from typing import Any, Sequence

from mlxcel import strict_json as strict
from mlxcel.config import MAX_PREFIX_TOKENS, MAX_TOP_LOGPROBS
from mlxcel.engine.sampling import SamplingParams, check_logit_bias
from mlxcel.engine.logits import context_of, replayed
from mlxcel.engine.sampling_wire import (PROCESSOR_PARAMS, Param, ParamsFormat, context_from_doc, params_doc,
                                         params_from_doc, replay_from_doc)
from mlxcel.models.token_ids import check_token_ids

_FROM_TO = "{name} must be an integer from {lo} to {hi}"

_NUMBER = {"text": "{name} must be a number"}
#: PREPARE's ``params`` (docs/pipeline.md §3.5): what the last stage samples with; ``max_tokens`` and stop
#: strings stay with the coordinator
PREPARE_PARAMS = ParamsFormat({
    "temperature": Param(float, 0.0, bounds=_NUMBER),
    "top_p": Param(float, 1.0, bounds=_NUMBER),
    "top_k": Param(int, 0, bounds={"text": "{name} must be an integer"}),
    "seed": Param(int, None, optional=True, bounds={"text": "{name} must be an integer or null"}),
    "logprobs": Param(bool, False, bounds={"text": "{name} must be a boolean"}),
    "top_logprobs": Param(int, 0, bounds={"lo": 0, "hi": MAX_TOP_LOGPROBS, "text": _FROM_TO}),
    **PROCESSOR_PARAMS,
    "context": Param(list, [], read=context_from_doc),
    "replay": Param(list, [], read=replay_from_doc),
})


def params_to_wire(params: SamplingParams, top_logprobs: int, prompt: Sequence[int] = (), draws: int = 0) -> dict[str, Any]:
    """What the last stage needs to sample: stop strings and max_tokens stay with the coordinator; ``context``
    is the prompt's tail the penalties look back over (empty when no penalty applies); ``replay``, the ``draws``
    tokens the prompt ends with (generated before a resume), for a grammar (empty without one)."""
    context = list(context_of(prompt)) if params.processed else []
    replay = list(replayed(params, prompt, draws))
    return params_doc(params, PREPARE_PARAMS, top_logprobs=top_logprobs, context=context, replay=replay)


def params_from_wire(raw: Any, vocab_size: int | None = None) -> tuple[SamplingParams, int, tuple[int, ...]]:
    """Validate and rebuild: (params, top_logprobs, context); ``logit_bias``, ``context`` and ``replay`` ids must
    be below ``vocab_size`` (None: unchecked). Raises SamplingError or ValueError (a ``FieldError``) on bad values.
    ``replay`` is ``replay_from_wire``'s."""
    return params_and_replay(raw, vocab_size)[:3]


def params_and_replay(raw: Any, vocab_size: int | None = None) -> tuple[SamplingParams, int, tuple[int, ...],
                                                                        tuple[int, ...]]:
    """``params_from_wire``'s three and the tokens a grammar replays (``replay``: empty without a grammar)."""
    params, extra = params_from_doc(raw, PREPARE_PARAMS)
    check_logit_bias(params.logit_bias, vocab_size)
    if vocab_size is not None:
        check_token_ids(list(extra["context"]), vocab_size, "context")
        check_token_ids(list(extra["replay"]), vocab_size, "replay")
    if extra["replay"] and not params.constrained:
        raise ValueError("replay needs a grammar")
    return params, extra["top_logprobs"], extra["context"], extra["replay"]


def tokens_from_wire(raw: Any, name: str, vocab_size: int) -> list[int] | None:
    """A token list (PREPARE ``prompt``, RELEASE ``tokens``): absent/null, or at most ``MAX_PREFIX_TOKENS``
    integers in [0, vocab_size); raises TypeError / ValueError (``true`` is not token 1)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise TypeError(f"{name} must be an array of token ids")
    if len(raw) > MAX_PREFIX_TOKENS:
        raise ValueError(f"{name} holds {len(raw)} token ids; at most {MAX_PREFIX_TOKENS}")
    check_token_ids(raw, vocab_size, name)  # a TokenIdError is a ValueError
    return raw


def count_from_wire(raw: Any, name: str, most: int) -> int:
    """A token count (PREPARE ``max_cached``, ACK ``cached``): an integer from 0 to ``most`` (else ValueError)."""
    return strict.integer(raw, name, 0, most, text=_FROM_TO + ", got {value!r}")
