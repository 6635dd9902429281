"""The fixed binary header of the per-token messages: RUN_ENTRY, ACTIVATION, RUN_RESULT.

Every decoded token crosses N + 1 of these, so their header is binary (docs/pipeline.md §3.4):
no JSON text to build or parse, and every field has one type by construction. The rarer commands
and replies keep their JSON header. This module maps between the binary header and the same
field dict that ``protocol.decode`` returns for every message, so callers see one shape.

Step header (all integers big-endian), after the 5-byte envelope::

    0      8    nonce (64 bits; in the field dict: 16 lowercase hex digits)
    8      1    phase: 0 = prefill, 1 = decode
    9      1    flags: bit 0 = sample; the other bits are 0
    10     1    micro_batch, 0 to 63
    11     1    R, the number of rows, 1 to 255
    12          R request ids: u8 length L (1 to 128), then L bytes of UTF-8
    then, RUN_ENTRY and ACTIVATION: one tensor descriptor (below)
    then, RUN_RESULT: u8 result kind
          0 = nothing (a prompt chunk that does not sample)
          1 = tokens: R x u32 token ids; u8 L (0/1) then R x f32 log-probabilities (NaN: the row
              did not ask); u8 T (0/1) then per row u8 k (0-20) and k x (u32 token, f32 logprob)
          2 = logits: one tensor descriptor (float32 [R, vocab])

    tensor descriptor: u8 dtype (1 int32, 2 uint32, 3 float32, 4 float16, 5 bfloat16),
                       u8 rank r (1 to 3), r x u32 dimensions

The tensor's bytes follow the header, little-endian, row-major, exactly as many as it claims.
"""

from __future__ import annotations

import math
import struct
from typing import Any


from mlxcel.error_codes import CodedError, ErrorCode

FIXED = struct.Struct(">8sBBBB")
DESCRIPTOR = struct.Struct(">BB")
DIM = struct.Struct(">I")
PHASES = ("prefill", "decode")
SAMPLE_FLAG = 0x01
DTYPE_CODES = {"int32": 1, "uint32": 2, "float32": 3, "float16": 4, "bfloat16": 5}
DTYPE_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}
RESULT_NONE, RESULT_TOKENS, RESULT_LOGITS = 0, 1, 2
MAX_ROWS = 255
MAX_ID_BYTES = 128
MAX_TOP = 20


class StepFormatError(CodedError, ValueError):
    """The binary header is malformed; ``code`` is the stage protocol's answer to it."""

    def __init__(self, code: ErrorCode, message: str, header: dict[str, Any] | None = None):
        super().__init__(message, code)
        self.header = header  # the fields decoded before the failure, once the request ids are known


# -- encoding ---------------------------------------------------------------------------------------


def encode_header(mtype_name: str, header: dict[str, Any], tensor: tuple[str, tuple[int, ...]] | None) -> bytes:
    """The binary header of a step message from its field dict (``tensor``: wire dtype and shape)."""
    rids = header["request_ids"]
    phase = header.get("phase", "decode")
    micro_batch, sample = header.get("micro_batch", 0), header.get("sample", True)
    if type(micro_batch) is not int or type(sample) is not bool:  # noqa: E721 - true is not 1, 1 is not true
        raise TypeError("micro_batch must be an integer and sample a boolean")
    nonce = bytes.fromhex(header["nonce"])
    if len(nonce) != 8:
        raise ValueError(f"a step's nonce is 16 hex digits, not {header['nonce']!r}")
    parts = [FIXED.pack(nonce, PHASES.index(phase) if phase in PHASES else int(phase),
                        SAMPLE_FLAG if sample else 0, micro_batch, len(rids))]
    for rid in rids:
        raw = rid.encode()
        parts.append(bytes([len(raw)]) + raw)
    if mtype_name == "RUN_RESULT":
        parts.append(_encode_result(header, len(rids), tensor))
    elif tensor is not None:
        parts.append(_descriptor(*tensor))
    return b"".join(parts)


def _descriptor(dtype: str, shape: tuple[int, ...]) -> bytes:
    return DESCRIPTOR.pack(DTYPE_CODES[dtype], len(shape)) + b"".join(DIM.pack(d) for d in shape)


def _encode_result(header: dict[str, Any], rows: int, tensor: tuple[str, tuple[int, ...]] | None) -> bytes:
    if tensor is not None:
        return bytes([RESULT_LOGITS]) + _descriptor(*tensor)
    tokens = header.get("tokens")
    if tokens is None:
        return bytes([RESULT_NONE])
    if any(type(t) is not int for t in tokens):  # noqa: E721
        raise TypeError("token ids must be integers")
    out = [bytes([RESULT_TOKENS]), struct.pack(f">{rows}I", *tokens)]
    lps = header.get("logprobs")
    if lps is None:
        out.append(b"\x00")
    else:
        out.append(b"\x01" + struct.pack(f">{rows}f", *(math.nan if lp is None else lp for lp in lps)))
    tops = header.get("top_logprobs")
    if tops is None:
        out.append(b"\x00")
    else:
        out.append(b"\x01")
        for top in tops:
            out.append(bytes([len(top)]) + b"".join(struct.pack(">If", int(t), float(lp)) for t, lp in top))
    return b"".join(out)


# -- decoding ---------------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked reads from the header bytes; every overrun is a bad_request."""

    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, n: int, what: str) -> memoryview:
        if self.at + n > len(self.data):
            raise StepFormatError(ErrorCode.BAD_REQUEST, f"the step header ends inside {what}")
        out = self.data[self.at: self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, what))

    def byte(self, what: str) -> int:
        return self.take(1, what)[0]


def decode_header(mtype_name: str, data: memoryview) -> tuple[dict[str, Any], tuple[str, list[int]] | None]:
    """(field dict, tensor descriptor or None) from a step header; raises ``StepFormatError``.

    The fields are checked as far as a stage can without knowing the model (phase, flags,
    micro-batch, request ids); shapes against the model are the receiver's (``check_ids``...).
    The ids are read before the fixed fields are judged, so the refusal of a bad phase, flag or
    micro-batch, or of an id twice, carries them (``StepFormatError.header``) and can reach their owner.
    """
    r = _Reader(data)
    nonce, phase, flags, micro_batch, rows = r.unpack(FIXED, "the fixed fields")
    # from here on the nonce is known: a refusal can be answered to the sender of a command with it
    header: dict[str, Any] = {"nonce": bytes(nonce).hex(), "request_ids": []}
    try:
        rids = [_request_id(r) for _ in range(rows)]
        header["request_ids"] = rids  # known from here on: a refusal reaches their owner at once (§4.5)
        _check_fixed(phase, flags, micro_batch, rows)
        if len(set(rids)) != rows:
            raise StepFormatError(ErrorCode.BAD_REQUEST, "a request id appears twice in one step")
        header.update(phase=PHASES[phase], micro_batch=micro_batch, sample=bool(flags & SAMPLE_FLAG))
        tensor = _decode_result(r, header, rows) if mtype_name == "RUN_RESULT" else _read_descriptor(r)
        if r.at != len(data):
            raise StepFormatError(ErrorCode.BAD_REQUEST, f"{len(data) - r.at} bytes after the step header's fields")
    except StepFormatError as exc:
        exc.header = header
        raise
    return header, tensor


def _check_fixed(phase: int, flags: int, micro_batch: int, rows: int) -> None:
    if phase >= len(PHASES):
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"phase must be 0 (prefill) or 1 (decode), got {phase}")
    if flags & ~SAMPLE_FLAG:
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"unknown flag bits {flags:#04x}")
    if micro_batch >= 64:
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"micro_batch must be 0 to 63, got {micro_batch}")
    if rows == 0:
        raise StepFormatError(ErrorCode.BAD_REQUEST, "a step names at least one request id")


def _request_id(r: _Reader) -> str:
    n = r.byte("a request id's length")
    if not 1 <= n <= MAX_ID_BYTES:
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"a request id has 1 to {MAX_ID_BYTES} bytes, not {n}")
    try:
        return str(r.take(n, "a request id"), "utf-8")
    except UnicodeDecodeError:
        raise StepFormatError(ErrorCode.BAD_REQUEST, "a request id is not UTF-8") from None


def _read_descriptor(r: _Reader) -> tuple[str, list[int]]:
    code, rank = r.unpack(DESCRIPTOR, "the tensor descriptor")
    if code not in DTYPE_BY_CODE:
        raise StepFormatError(ErrorCode.BAD_TENSOR, f"tensor dtype code {code} is not accepted "
                                                    "(compressed or quantized activations are refused)")
    if not 1 <= rank <= 3:
        raise StepFormatError(ErrorCode.BAD_TENSOR, f"tensor rank must be 1 to 3, got {rank}")
    dims = [r.unpack(DIM, "the tensor's dimensions")[0] for _ in range(rank)]
    return DTYPE_BY_CODE[code], dims


def _decode_result(r: _Reader, header: dict[str, Any], rows: int) -> tuple[str, list[int]] | None:
    kind = r.byte("the result kind")
    header["tokens"] = header["logprobs"] = header["top_logprobs"] = None
    if kind == RESULT_NONE:
        return None
    if kind == RESULT_LOGITS:
        return _read_descriptor(r)
    if kind != RESULT_TOKENS:
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"unknown result kind {kind}")
    header["tokens"] = list(struct.unpack(f">{rows}I", r.take(4 * rows, "the tokens")))
    if _flag(r, "the logprobs flag"):
        values = struct.unpack(f">{rows}f", r.take(4 * rows, "the logprobs"))
        header["logprobs"] = [None if math.isnan(v) else v for v in values]
    if _flag(r, "the top_logprobs flag"):
        tops = []
        for _ in range(rows):
            k = r.byte("a top_logprobs count")
            if k > MAX_TOP:
                raise StepFormatError(ErrorCode.BAD_REQUEST, f"at most {MAX_TOP} top_logprobs per row, got {k}")
            pairs = struct.unpack(">" + "If" * k, r.take(8 * k, "the top_logprobs"))
            tops.append([[pairs[i], pairs[i + 1]] for i in range(0, 2 * k, 2)])
        header["top_logprobs"] = tops
    return None


def _flag(r: _Reader, what: str) -> bool:
    value = r.byte(what)
    if value > 1:
        raise StepFormatError(ErrorCode.BAD_REQUEST, f"{what} must be 0 or 1, got {value}")
    return value == 1
