"""Control messages of the disaggregated roles, sans-I/O: a type byte and a JSON object (docs/disagg.md §3).

Every field is checked by type and bound on receipt (a boolean is never a number); a message that
fails is a ``MessageRefused`` naming the field, answered or dropped by the service, never executed.
The KV tensors themselves never travel here: they are the handoff stream's raw chunks (``kv_codec``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxcel.cluster.identity import PeerId
from mlxcel.config import MAX_TOKENS_LIMIT, MAX_TOP_LOGPROBS
from mlxcel.disagg.wire import MAX_CONTROL_LEN, MAX_EVENTS_PER_MESSAGE, NONCE_HEX_LEN, MsgType
from mlxcel.engine.interface import EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine import sampling_wire
from mlxcel.engine.sampling import SamplingError, SamplingParams, check_logit_bias
from mlxcel.engine.sampling_wire import PROCESSOR_PARAMS, Param, ParamsFormat, params_from_doc
from mlxcel import strict_json as strict
from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.models.token_ids import TokenIdError, check_token_ids

MAX_TOKEN_ID = 2**32 - 1  # the wire's range; a receiver also bounds ids by its vocabulary (``in_vocab``)
MAX_TEXT = 64 * 1024  # characters of one event's text or an error message


class MessageRefused(CodedError):
    """A control message breaks the format or a bound; the text names the field."""

    code = ErrorCode.BAD_REQUEST


def encode(kind: MsgType, doc: dict[str, Any]) -> bytes:
    return bytes([kind]) + json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode(payload: Any) -> tuple[MsgType, dict[str, Any]]:
    """(type, document) of a control message; ``MessageRefused`` for anything else."""
    view = memoryview(payload).cast("B")
    if not len(view):
        raise MessageRefused("an empty control message")
    if len(view) > MAX_CONTROL_LEN:
        raise MessageRefused(f"a control message of {len(view)} bytes (at most {MAX_CONTROL_LEN})")
    try:
        kind = MsgType(view[0])
    except ValueError:
        raise MessageRefused(f"unknown message type 0x{view[0]:02x}") from None
    try:
        doc = json.loads(bytes(view[1:]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MessageRefused(f"{kind.name}: the body is not JSON") from None
    if not isinstance(doc, dict):
        raise MessageRefused(f"{kind.name}: the body is not a JSON object")
    return kind, doc


# -- field checks ------------------------------------------------------------------------------------


_refused = strict.mapped(lambda exc: MessageRefused(str(exc)))
_num = _refused(strict.number)


@_refused
def _int(doc: dict, key: str, lo: int, hi: int, *, default: Any = strict.ABSENT) -> int:
    return strict.field(doc, key, int, lo=lo, hi=hi, default=default)


@_refused
def _str(doc: dict, key: str, limit: int = MAX_TEXT, *, optional: bool = False) -> str | None:
    return strict.field(doc, key, str, max_chars=limit, optional=optional)


@_refused
def _bool(doc: dict, key: str, default: bool = False) -> bool:
    return strict.field(doc, key, bool, default=default)


@_refused
def _code(doc: dict, key: str = "code", *, optional: bool = False) -> ErrorCode | None:
    """An error code: a JSON integer 0..65535 (an unknown value reads as UNKNOWN); null only if optional."""
    value = strict.field(doc, key, int, lo=0, hi=2**16 - 1, optional=optional)
    return None if value is None else ErrorCode.from_wire(value)


def nonce_of(doc: dict) -> str:
    value = doc.get("nonce")
    if not isinstance(value, str) or len(value) != NONCE_HEX_LEN or any(c not in "0123456789abcdef" for c in value):
        raise MessageRefused(f"nonce must be {NONCE_HEX_LEN} lower-case hex digits")
    return value


def tokens_of(value: Any, key: str, limit: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= limit:
        raise MessageRefused(f"{key} must be a list of 1..{limit} token ids")
    for t in value:
        if not strict.in_range(t, 0, MAX_TOKEN_ID):
            raise MessageRefused(f"{key} holds {t!r}, not a token id")
    return tuple(value)


def in_vocab(ids: Any, vocab_size: int | None, key: str) -> None:
    """``MessageRefused`` (BAD_REQUEST) unless every id is below the receiver's ``vocab_size`` (None: unchecked)."""
    if vocab_size is None:
        return
    try:
        check_token_ids(ids, vocab_size, key)
    except TokenIdError as exc:
        raise MessageRefused(str(exc), exc.code) from None


#: the ``params`` object of GENERATE and of a KV handoff (docs/disagg.md §3): the HTTP API's bounds
PARAMS = ParamsFormat({
    "max_tokens": Param(int, bounds={"lo": 1, "hi": 2**31}),
    "temperature": Param(float, 0.0),
    "top_p": Param(float, 1.0),
    "top_k": Param(int, 0, bounds={"lo": 0, "hi": 2**31}),
    "seed": Param(int, None, optional=True, bounds={"lo": -(2**63), "hi": 2**63 - 1}),
    "stop": Param(tuple, [], bounds={"max_chars": MAX_TEXT, "text": "params.stop must be a list of strings"}),
    "logprobs": Param(bool, False),
    **PROCESSOR_PARAMS,
}, unknown="params: unknown field(s) {names}",
    order=("stop", "seed", "max_tokens", "temperature", "top_p", "top_k", "logprobs", *PROCESSOR_PARAMS))


def params_doc(p: SamplingParams) -> dict[str, Any]:
    return sampling_wire.params_doc(p, PARAMS)


@_refused
def params_of(value: Any, vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams from their document, with the same bounds as the HTTP API; ``logit_bias`` ids below the
    receiver's ``vocab_size`` (None: unchecked)."""
    try:
        params = params_from_doc(value, PARAMS)[0]
        check_logit_bias(params.logit_bias, vocab_size)
        return params
    except SamplingError as exc:
        raise MessageRefused(f"params.{exc.param}: {exc}") from None


# -- messages ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Router -> prefill: run this prompt, sample its first token, hand the KV to ``decode_target``."""

    nonce: str
    prompt: tuple[int, ...]
    params: SamplingParams
    top_logprobs: int = 0
    ignore_eos: bool = False
    decode_target: PeerId | None = None
    draws: int = 0  # a resumed request: tokens sampled before (the prompt ends with them); the sampler goes on

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"nonce": self.nonce, "prompt": list(self.prompt), "params": params_doc(self.params),
                               "top_logprobs": self.top_logprobs, "ignore_eos": self.ignore_eos}
        if self.decode_target is not None:
            doc["decode_target"] = str(self.decode_target)
        if self.draws:
            doc["draws"] = self.draws
        return encode(MsgType.GENERATE, doc)

    @classmethod
    def parse(cls, doc: dict, max_prompt: int, vocab_size: int | None = None) -> "Generate":
        """Checked; ``prompt`` ids are bounded by ``vocab_size`` (the prefill node's model) before anything else."""
        nonce, prompt = nonce_of(doc), tokens_of(doc.get("prompt"), "prompt", max_prompt)
        in_vocab(prompt, vocab_size, "prompt")
        target = doc.get("decode_target")
        if target is not None:
            try:
                target = PeerId.parse(target)
            except ValueError:
                raise MessageRefused(f"decode_target must be a numeric ip:port, got {target!r}") from None
        return cls(nonce, prompt, params_of(doc.get("params"), vocab_size),
                   _int(doc, "top_logprobs", 0, MAX_TOP_LOGPROBS, default=0), _bool(doc, "ignore_eos"), target,
                   _int(doc, "draws", 0, MAX_TOKENS_LIMIT, default=0))

    def request(self) -> EngineRequest:
        return EngineRequest(self.prompt, self.params, self.top_logprobs, self.ignore_eos, request_id=self.nonce,
                             draws=self.draws)


def event_doc(ev: TokenEvent) -> list:
    return [ev.token, ev.text, ev.logprob, [list(p) for p in ev.top_logprobs]]


def event_of(item: Any) -> TokenEvent:
    if not isinstance(item, list) or len(item) != 4:
        raise MessageRefused("an event must be [token, text, logprob, top_logprobs]")
    token, text, logprob, top = item
    if not strict.in_range(token, 0, MAX_TOKEN_ID):
        raise MessageRefused(f"event token {token!r} is not a token id")
    if not strict.is_string(text, max_chars=MAX_TEXT):
        raise MessageRefused("event text must be a string")
    lp = None if logprob is None else _num(logprob, "logprob")
    if not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS:
        raise MessageRefused(f"top_logprobs must be a list of at most {MAX_TOP_LOGPROBS} pairs")
    pairs = []
    for pair in top:
        if not isinstance(pair, list) or len(pair) != 2 or not strict.is_int(pair[0]):
            raise MessageRefused("a top_logprobs entry must be [token, logprob]")
        pairs.append((pair[0], _num(pair[1], "top_logprobs")))
    return TokenEvent(token, text, lp, tuple(pairs))


@dataclass(frozen=True)
class Tokens:
    """Decode -> router: the next events of a request, in order."""

    nonce: str
    events: tuple[TokenEvent, ...]

    def encode(self) -> bytes:
        return encode(MsgType.TOKENS, {"nonce": self.nonce, "events": [event_doc(e) for e in self.events]})

    @classmethod
    def parse(cls, doc: dict) -> "Tokens":
        events = doc.get("events")
        if not isinstance(events, list) or not 1 <= len(events) <= MAX_EVENTS_PER_MESSAGE:
            raise MessageRefused(f"events must be a list of 1..{MAX_EVENTS_PER_MESSAGE} events")
        return cls(nonce_of(doc), tuple(event_of(e) for e in events))


FINISH_REASONS = ("stop", "length", "error")


@dataclass(frozen=True)
class Finish:
    """Decode -> router: the request ended (as the decode node's scheduler ended it)."""

    nonce: str
    event: FinishEvent

    def encode(self) -> bytes:
        e = self.event
        return encode(MsgType.FINISH, {"nonce": self.nonce, "reason": e.finish_reason, "text": e.text,
                                       "prompt_tokens": e.prompt_tokens, "completion_tokens": e.completion_tokens,
                                       "error": e.error, "code": int(e.code) if e.code is not None else None})

    @classmethod
    def parse(cls, doc: dict) -> "Finish":
        reason = doc.get("reason")
        if reason not in FINISH_REASONS:
            raise MessageRefused(f"reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}")
        error = _str(doc, "error", optional=True)
        return cls(nonce_of(doc), FinishEvent(reason, _str(doc, "text") or "", _int(doc, "prompt_tokens", 0, 2**31),
                                              _int(doc, "completion_tokens", 0, 2**31), error,
                                              _code(doc, optional=True)))


@dataclass(frozen=True)
class Error:
    """Prefill or decode -> router: the request failed there (``node`` names the failing hop's address
    when it is another one, e.g. an unreachable decode target)."""

    nonce: str
    code: ErrorCode
    message: str
    node: str | None = None

    def encode(self) -> bytes:
        doc = {"nonce": self.nonce, "code": int(self.code), "message": self.message[:MAX_TEXT]}
        if self.node is not None:
            doc["node"] = self.node
        return encode(MsgType.ERROR, doc)

    @classmethod
    def parse(cls, doc: dict) -> "Error":
        return cls(nonce_of(doc), _code(doc), _str(doc, "message") or "",  # type: ignore[arg-type]
                   _str(doc, "node", 64, optional=True))


@dataclass(frozen=True)
class HandedOff:
    """Prefill -> router: the KV left for the decode node: its size and how long the stream took."""

    nonce: str
    nbytes: int
    seconds: float
    decode: str = ""
    prefill_seconds: float = 0.0

    def encode(self) -> bytes:
        return encode(MsgType.HANDED_OFF, {"nonce": self.nonce, "bytes": self.nbytes, "seconds": self.seconds,
                                           "decode": self.decode, "prefill_seconds": self.prefill_seconds})

    @classmethod
    def parse(cls, doc: dict) -> "HandedOff":
        return cls(nonce_of(doc), _int(doc, "bytes", 0, 2**62), _num(doc.get("seconds"), "seconds"),
                   _str(doc, "decode", 64) or "", _num(doc.get("prefill_seconds", 0.0), "prefill_seconds"))


def cancel(nonce: str) -> bytes:
    return encode(MsgType.CANCEL, {"nonce": nonce})


@dataclass(frozen=True)
class Progress:
    """Prefill or decode -> router: the request is still being worked on (queued, prefilling)."""

    nonce: str

    def encode(self) -> bytes:
        return encode(MsgType.PROGRESS, {"nonce": self.nonce})


@dataclass
class HandoffMeta:
    """The request document inside a KV handoff header (prefill -> decode)."""

    nonce: str
    router: PeerId
    params: SamplingParams
    first: TokenEvent
    top_logprobs: int = 0
    ignore_eos: bool = False
    draws: int = 0  # random draws the prefill's sampler made (the decode sampler skips them)
    extra: dict[str, Any] = field(default_factory=dict)
    # with a grammar: the tokens generated so far (the prompt's tail and ``first``), which the decode node's
    # matcher replays; sent only with a grammar
    generated: int = 0

    def doc(self) -> dict[str, Any]:
        doc = {"nonce": self.nonce, "router": str(self.router), "params": params_doc(self.params),
               "first": event_doc(self.first), "top_logprobs": self.top_logprobs, "ignore_eos": self.ignore_eos,
               "draws": self.draws, **self.extra}
        if self.params.constrained:
            doc["generated"] = self.generated
        return doc

    @classmethod
    def parse(cls, doc: dict, vocab_size: int | None = None) -> "HandoffMeta":
        """Checked; ``first``'s ids are bounded by ``vocab_size`` (the decode node's model: it feeds the model)."""
        try:
            router = PeerId.parse(doc.get("router"))  # type: ignore[arg-type]
        except ValueError:
            raise MessageRefused("router must be a numeric ip:port") from None
        first = event_of(doc.get("first"))
        in_vocab((first.token, *(t for t, _ in first.top_logprobs)), vocab_size, "first")
        params = params_of(doc.get("params"), vocab_size)
        generated = _int(doc, "generated", 1, MAX_TOKENS_LIMIT + 1) if params.constrained else 0
        if not params.constrained and "generated" in doc:
            raise MessageRefused("generated is sent only with a grammar")
        return cls(nonce_of(doc), router, params, first,
                   _int(doc, "top_logprobs", 0, MAX_TOP_LOGPROBS, default=0), _bool(doc, "ignore_eos"),
                   _int(doc, "draws", 0, MAX_TOKENS_LIMIT + 1), generated=generated)


def reply_to(doc: dict) -> tuple[str, PeerId] | None:
    """(nonce, router) of a *readable* handoff request document (a valid ``nonce`` and ``router``, whatever
    its other fields hold): where a refusal of the handoff is answered. None for an unreadable one."""
    try:
        return nonce_of(doc), PeerId.parse(doc.get("router"))  # type: ignore[arg-type]
    except (MessageRefused, ValueError):
        return None


def state_doc(**fields: Any) -> bytes:
    return encode(MsgType.STATE, fields)


__all__ = ["Error", "Finish", "Generate", "HandedOff", "HandoffMeta", "MessageRefused", "Progress", "Tokens", "cancel",
           "decode", "encode", "reply_to", "state_doc"]
