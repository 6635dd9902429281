"""Constrained decoding: a grammar that masks the tokens a row may sample next (llguidance).

A request's constraint travels as **grammar text** (``SamplingParams.grammar``): llguidance's grammar
(a ``TopLevelGrammar`` JSON, or a Lark grammar with ``%json`` schemas), at most ``MAX_GRAMMAR_BYTES``. The
front builds it (``json_grammar`` from ``response_format``, ``tool_call_grammar`` for a forced call) and
checks it against its vocabulary; every node that samples compiles it again (``check``) and refuses one
that is oversize or does not compile. The matcher itself never travels: ``GrammarMask`` rebuilds it from
the text and the tokens the request generated so far (``replay``), so a handoff or a resume goes on in
the same state.

The vocabulary (every token as bytes, and the EOS ids the engine stops on) is built once per model and
process from its tokenizer (``register`` at load; a node loaded without a tokenizer reads it from the
checkpoint directory the first time a grammar comes). Each step, ``GrammarMask`` computes the row's
bitmask (one bit per token, int32 words) and sets the logits of the tokens it forbids to -inf; once the
grammar is complete only EOS is allowed, so the request ends with finish_reason ``stop``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.models.vocab_source import register, source_of  # noqa: F401 - register: the loaders' entry

MAX_GRAMMAR_BYTES = 64 * 1024  # the grammar text's bound, on every wire and at the front
#: JSON as the model writes it under a grammar: no free whitespace (a random model would loop in it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(CodedError, ValueError):
    """A grammar is oversize, does not compile or refuses the tokens replayed into it; the message says why.
    Bad input from whoever sent it: ``bad_request`` on the wire, HTTP 400 at the front."""

    code = ErrorCode.BAD_REQUEST


def check_text(text: Any, name: str = "grammar") -> str:
    """``text`` if it is a non-empty string of at most ``MAX_GRAMMAR_BYTES`` UTF-8 bytes; else ``GrammarError``."""
    if not isinstance(text, str) or not text:
        raise GrammarError(f"{name} must be a non-empty string (llguidance grammar text)")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{name} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    return text


def check(text: Any, vocab_size: int | None = None, name: str = "grammar", source: Any = None) -> str:
    """Bound and compile ``text`` against the vocabulary (``source``'s: a TokenizerWrapper; None: the
    registered one); ``GrammarError`` naming what llguidance refused (an unsupported keyword, a syntax error)."""
    import llguidance

    check_text(text, name)
    vocab = _vocabulary(source) if source is not None else vocabulary(vocab_size)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, vocab)
    if failed:
        raise GrammarError(f"{name} does not compile: {messages[0] if messages else 'invalid grammar'}")
    if messages:  # llguidance compiles around some keywords it does not implement: refuse rather than guess
        raise GrammarError(f"{name} is not supported: {'; '.join(messages)}")
    return text


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON matching ``schema`` (None: any JSON object, OpenAI's ``json_object``)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                         defaults=JSON_OPTIONS)


def tool_call_grammar(calls: Sequence[tuple[str, str]], suffix: str = "") -> str:
    """A Lark grammar: one of ``calls`` ((text before the arguments, the parameters schema as JSON)), the
    arguments a JSON value matching the schema, then ``suffix`` (what closes the call in the family's form)."""
    rules = []
    for i, (head, schema) in enumerate(calls):
        obj = json.loads(schema)
        body = json.dumps({**obj, "x-guidance": JSON_OPTIONS} if isinstance(obj, dict) else obj)
        head_part = f"{json.dumps(head)} " if head else ""
        tail = f" {json.dumps(suffix)}" if suffix else ""
        rules.append(f"call{i}: {head_part}args{i}{tail}\nargs{i}: %json {body}")
    start = "start: " + " | ".join(f"call{i}" for i in range(len(calls)))
    return "\n".join([start, *rules]) + "\n"


@functools.lru_cache(maxsize=4)
def _vocabulary(source: Any) -> Any:
    import llguidance
    import llguidance.hf

    wrapper = source
    if isinstance(source, (str, Path)):
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        wrapper = load_tokenizer(Path(source))
    hf = getattr(wrapper, "_tokenizer", wrapper)
    eos = sorted(set(getattr(wrapper, "eos_token_ids", None) or [hf.eos_token_id]))
    # the logits may be wider than the tokenizer (padded embeddings): ``allowed`` forbids the extra ids
    return llguidance.hf.from_tokenizer(hf, eos_token=eos)


def vocabulary(vocab_size: int | None = None) -> Any:
    """The llguidance tokenizer of this process's model (cached); ``GrammarError`` when none is registered."""
    source = source_of(vocab_size)
    if source is None:
        raise GrammarError("this node has no vocabulary to compile a grammar with")
    return _vocabulary(str(source) if isinstance(source, Path) else source)


def check_replay(text: str, replay: Sequence[int], vocab_size: int | None = None) -> None:
    """``GrammarError`` unless ``text`` compiles here and accepts ``replay`` (what a receiver checks on arrival,
    before it takes anything more of the request)."""
    GrammarMask(text, replay, vocab_size)


class GrammarMask:
    """One row's grammar state: forbids what the grammar does not allow next, advanced by each sampled token."""

    def __init__(self, text: str, replay: Sequence[int] = (), vocab_size: int | None = None):
        import llguidance

        self.tokenizer = vocabulary(vocab_size)
        self.matcher = llguidance.LLMatcher(self.tokenizer, check(text, vocab_size))
        if self.matcher.is_error():
            raise GrammarError(f"grammar does not compile: {self.matcher.get_error()}")
        if replay and not self.matcher.consume_tokens(list(replay)):
            raise GrammarError(f"the {len(replay)} replayed token(s) do not match the grammar")
        words = (self.tokenizer.vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)
        self._pending: list[mx.array] = []

    def observe(self, token: mx.array) -> None:
        """The token just sampled (lazy): consumed before the next mask is computed."""
        self._pending.append(token)

    def _advance(self) -> None:
        if not self._pending:
            return
        mx.eval(self._pending)
        for token in self._pending:
            if not self.matcher.is_error():
                self.matcher.consume_token(int(token.item()))
        self._pending.clear()

    def allowed(self, width: int) -> np.ndarray:
        """The tokens allowed next as a bool vector of ``width`` (the logits' width): the bitmask unpacked."""
        self._advance()
        if self.matcher.is_error():  # cannot happen when every token was sampled under the mask: end the row
            self._bits[:] = 0
            eos = self.tokenizer.eos_token
            self._bits.view(np.uint32)[eos // 32] |= np.uint32(1 << (eos % 32))
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        if bits.size >= width:
            return bits[:width]
        return np.concatenate([bits, np.zeros(width - bits.size, dtype=bool)])

    def __call__(self, logits: mx.array) -> mx.array:
        """Row logits [1, V] with every token the grammar forbids next at -inf."""
        allowed = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
