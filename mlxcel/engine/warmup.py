"""The scheduler's warmup: the tiny requests it runs before serving, and the sink that discards their events.

With a chat template the first prompt is a templated dummy chat: its KV seeds the prefix cache with the
template's preamble, which every chat request shares. Both run through prefill and batched decode, so
the first real request is not slow; their tokens go nowhere and their counts are not traffic.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.prompts import encode_chat, has_chat_template
from mlxcel.engine.sampling import SamplingParams


class Sink:
    """The event stream of a warmup sequence: discards everything."""

    cancelled = False

    def __init__(self, request: EngineRequest):
        self.request = request

    def push(self, event: Any) -> None:
        pass


def warmup_requests(tokenizer: Any) -> list[EngineRequest]:
    """Two short greedy requests of two tokens each, the first the chat template's preamble if there is one."""
    prompts = [template_preamble(tokenizer) or [1, 2, 3, 4], [5, 6, 7]]
    return [EngineRequest(tuple(p), SamplingParams(max_tokens=2), ignore_eos=True) for p in prompts]


def template_preamble(tokenizer: Any) -> list[int] | None:
    """A one-turn dummy chat in the tokenizer's template; None without one, or for a template that needs more."""
    if not has_chat_template(tokenizer):
        return None
    try:
        return encode_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    except Exception:  # a template that needs more than a user turn: no seed, no harm
        return None
