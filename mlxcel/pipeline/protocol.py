"""The stage protocol's messages: a type byte, a header, raw tensor bytes (docs/pipeline.md §3).

    offset 0   u8       message type (``MsgType``)
    offset 1   u32 BE   H, the header length
    offset 5   H bytes  header: the step messages (RUN_ENTRY, ACTIVATION, RUN_RESULT) a fixed binary
                        layout (``step_codec``); every other message a UTF-8 JSON object
    offset 5+H          tensors, back to back, little-endian, row-major (JSON messages: in the order of
                        header["tensors"]: [{"name", "dtype", "shape"}]; step messages: at most one,
                        described in the binary header)

Sans-I/O: ``encode`` returns bytes, ``decode`` checks the envelope and every tensor's dtype, rank
and byte count against the payload before anything is allocated; shape bounds that depend on the
model are checked by the receiver (``check_hidden``, ``check_ids``). Both sides see one shape: a
field dict per message, whatever its header's encoding.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxcel import strict_json as strict
from mlxcel.cluster.exchanges import new_nonce  # noqa: F401 - the one nonce generator
from mlxcel.config import MAX_ACTIVATION_TOKENS
from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.models.token_ids import TokenIdError, check_token_ids
from mlxcel.pipeline import step_codec

ENVELOPE = struct.Struct(">BI")
MAX_HEADER_LEN = 1 << 20
MAX_MICRO_BATCHES = 64  # micro-batch numbers 0..63 (a coordinator uses one per stage)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int32", "uint32")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4}
_NUMPY = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int32": "<i4", "uint32": "<u4"}


class MsgType(enum.IntEnum):
    """Stage protocol message types (byte 0 of every payload)."""

    PREPARE = 1  # coordinator -> every stage: a new sequence (sampling parameters for the last)
    RUN_ENTRY = 2  # coordinator -> first stage: token ids of one step
    ACTIVATION = 3  # stage i -> stage i+1: hidden states of one step
    RUN_RESULT = 4  # last stage -> coordinator: sampled tokens (or logits) of one step
    CANCEL = 5  # coordinator -> every stage: stop a sequence now and free it
    RELEASE = 6  # coordinator -> every stage: free a finished sequence
    BEGIN_DRAIN = 7  # coordinator -> stage: accept no new sequence
    SHUTDOWN = 8  # coordinator -> stage: exit after answering
    GET_STATE = 9  # coordinator -> stage: report identity, layers and load
    RELOCATE = 10  # coordinator -> stage: another stage now listens at another address (a spare took it over)
    ACK = 16  # stage -> coordinator: a command succeeded
    STATE = 17  # stage -> coordinator: the answer to GET_STATE
    ERROR = 18  # stage -> owner: a command or a step failed (code, message)


STEPS = frozenset({MsgType.RUN_ENTRY, MsgType.ACTIVATION, MsgType.RUN_RESULT})  # binary headers
STEP_TENSOR = {MsgType.RUN_ENTRY: "input_ids", MsgType.ACTIVATION: "hidden", MsgType.RUN_RESULT: "logits"}
COMMANDS = frozenset({MsgType.PREPARE, MsgType.RUN_ENTRY, MsgType.CANCEL, MsgType.RELEASE,
                      MsgType.BEGIN_DRAIN, MsgType.SHUTDOWN, MsgType.GET_STATE, MsgType.RELOCATE})
REPLIES = frozenset({MsgType.ACK, MsgType.STATE, MsgType.ERROR})


class ProtocolError(CodedError):
    """A message that breaks the stage protocol; ``code`` says how.

    ``partial`` is the message without its tensors when the envelope and header decoded but a tensor
    broke the bounds, so the receiver can still authorize it and answer its owner with its nonce.
    """

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message, code)
        self.partial: StageMessage | None = None


@dataclass
class StageMessage:
    """A decoded message: its type, header fields and tensors (numpy views of the payload)."""

    type: MsgType
    header: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    received: float = 0.0  # time.perf_counter() when decoded (a stage's per-step timing)

    @property
    def nonce(self) -> str:
        return str(self.header.get("nonce", ""))

    @property
    def request_ids(self) -> list[str]:
        """The header's request ids; empty unless they are a list of strings (bounds: ``check_ids``)."""
        rids = self.header.get("request_ids")
        return list(rids) if isinstance(rids, list) and all(isinstance(r, str) for r in rids) else []


def encode(mtype: MsgType, header: dict[str, Any], tensors: dict[str, tuple[str, np.ndarray]] | None = None) -> bytes:
    """One message: ``tensors`` maps name -> (wire dtype, array); a step message carries at most one."""
    arrays = [(name, dtype, np.ascontiguousarray(array, dtype=_NUMPY[dtype]))
              for name, (dtype, array) in (tensors or {}).items()]
    if mtype in STEPS:
        if len(arrays) > 1:
            raise ValueError(f"a {mtype.name} carries at most one tensor")
        tensor = (arrays[0][1], arrays[0][2].shape) if arrays else None
        body = step_codec.encode_header(mtype.name, header, tensor)
    else:
        if arrays:
            header = {**header, "tensors": [{"name": n, "dtype": d, "shape": list(a.shape)} for n, d, a in arrays]}
        body = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([ENVELOPE.pack(int(mtype), len(body)), body, *(memoryview(a).cast("B") for _, _, a in arrays)])


def decode(payload: memoryview | bytes) -> StageMessage:
    """Parse one message; raises ``ProtocolError`` (nothing is allocated from claimed sizes)."""
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
    if len(view) < ENVELOPE.size:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "message shorter than its 5-byte envelope")
    mtype_raw, hlen = ENVELOPE.unpack_from(view)
    try:
        mtype = MsgType(mtype_raw)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown message type {mtype_raw}") from None
    if hlen > MAX_HEADER_LEN or ENVELOPE.size + hlen > len(view):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header length {hlen} runs past the message")
    raw = view[ENVELOPE.size: ENVELOPE.size + hlen]
    header, specs = _step_header(mtype, raw) if mtype in STEPS else _json_header(raw)
    msg = StageMessage(mtype, header)
    try:
        _tensors(msg, specs, view[ENVELOPE.size + hlen:])
    except ProtocolError as exc:
        msg.tensors.clear()
        msg.dtypes.clear()
        exc.partial = msg
        raise
    return msg


def _json_header(raw: memoryview) -> tuple[dict[str, Any], Any]:
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep, an integer too long
        raise ProtocolError(ErrorCode.BAD_REQUEST, "header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "header is not a JSON object")
    return header, header.pop("tensors", [])


def _step_header(mtype: MsgType, raw: memoryview) -> tuple[dict[str, Any], list]:
    try:
        header, tensor = step_codec.decode_header(mtype.name, raw)
    except step_codec.StepFormatError as exc:
        refused = ProtocolError(exc.code, str(exc))
        if exc.header is not None:  # the ids decoded: the receiver can still answer their owner
            refused.partial = StageMessage(mtype, exc.header)
        raise refused from None
    specs = [] if tensor is None else [{"name": STEP_TENSOR[mtype], "dtype": tensor[0], "shape": tensor[1]}]
    return header, specs


def _tensors(msg: StageMessage, specs: Any, data: memoryview) -> None:
    if not isinstance(specs, list) or len(specs) > 4:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "tensors must be a list of at most 4 descriptors")
    offset = 0
    for spec in specs:
        name, dtype, shape = _spec(spec)
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * _ITEMSIZE[dtype]
        if offset + nbytes > len(data):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {name} claims {nbytes} bytes; {len(data) - offset} remain")
        arr = np.frombuffer(data[offset: offset + nbytes], dtype=_NUMPY[dtype]).reshape(shape)
        msg.tensors[name], msg.dtypes[name] = arr, dtype
        offset += nbytes
    if offset != len(data):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{len(data) - offset} bytes after the last tensor")


def _spec(spec: Any) -> tuple[str, str, list[int]]:
    if not isinstance(spec, dict):
        raise ProtocolError(ErrorCode.BAD_TENSOR, "a tensor descriptor must be an object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise ProtocolError(ErrorCode.BAD_TENSOR, "a tensor descriptor needs a name")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {name}: dtype {dtype!r} is not accepted "
                            f"(compressed or quantized activations are refused)")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 3
            or not all(strict.in_range(d, 1, MAX_ACTIVATION_TOKENS << 6) for d in shape)):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor {name}: shape must be 1 to 3 positive dimensions")
    return name, dtype, shape


def check_ids(msg: StageMessage, *, max_rows: int, vocab_size: int | None = None) -> np.ndarray:
    """The token ids of a RUN_ENTRY: int32/uint32 [rows, n], rows == len(request_ids) <= max_rows, every id
    in [0, vocab_size) (bad_tensor)."""
    ids = msg.tensors.get("input_ids")
    if ids is None or msg.dtypes.get("input_ids") not in INT_DTYPES or ids.ndim != 2:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "input_ids must be an int32 or uint32 tensor [rows, n]")
    _check_rows(msg, ids.shape[0], ids.shape[1], max_rows)
    if vocab_size is not None:  # before MLX's embedding gather, which does not bound-check
        try:
            check_token_ids(ids, vocab_size, "input_ids", ErrorCode.BAD_TENSOR)
        except TokenIdError as exc:
            raise ProtocolError(exc.code, str(exc)) from None
    return ids


def check_hidden(msg: StageMessage, *, max_rows: int, width: int) -> np.ndarray:
    """The hidden states of an ACTIVATION: float [rows, n, width], n <= 2^20, rows <= max_rows."""
    hidden = msg.tensors.get("hidden")
    if hidden is None or msg.dtypes.get("hidden") not in FLOAT_DTYPES or hidden.ndim != 3:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "hidden must be a float tensor [rows, n, width]")
    if hidden.shape[2] != width:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"hidden width {hidden.shape[2]} is not the model's {width}")
    _check_rows(msg, hidden.shape[0], hidden.shape[1], max_rows)
    return hidden


def _check_rows(msg: StageMessage, rows: int, n: int, max_rows: int) -> None:
    if not strict.in_range(msg.header.get("micro_batch", 0), 0, MAX_MICRO_BATCHES - 1):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"micro_batch must be an integer from 0 to {MAX_MICRO_BATCHES - 1}")
    if not isinstance(msg.header.get("sample", True), bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "sample must be true or false")
    rids = check_request_ids(msg)
    if rows != len(rids):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{rows} tensor rows for {len(rids)} request ids")
    if not 1 <= rows <= max_rows:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{rows} rows; a stage accepts 1 to {max_rows}")
    if not 1 <= n <= MAX_ACTIVATION_TOKENS:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{n} positions; at most {MAX_ACTIVATION_TOKENS}")
    phase = msg.header.get("phase")
    if phase == "decode" and n != 1:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "a decode step carries one position per row")
    if phase == "prefill" and rows != 1:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "a prefill step carries one row")
    if phase not in ("prefill", "decode"):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"phase must be prefill or decode, got {phase!r}")


# -- strict JSON types: booleans are neither integers nor numbers (docs/pipeline.md §3.2) -------------


def is_request_id(value: Any) -> bool:
    """A string of 1 to 128 UTF-8 bytes: the bound a step header's u8 length can carry (§3.4.1); a lone
    surrogate (JSON "\ud800") has no UTF-8 form."""
    return strict.is_string(value, min_len=1, max_bytes=step_codec.MAX_ID_BYTES)


def check_request_ids(msg: StageMessage) -> list[str]:
    """A step's ``request_ids``: 1 or more distinct strings of 1 to 128 UTF-8 bytes (else bad_request)."""
    rids = msg.header.get("request_ids")
    if not isinstance(rids, list) or not rids or not all(is_request_id(r) for r in rids):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "request_ids must be a list of 1 or more request id strings "
                                                   "of 1 to 128 UTF-8 bytes")
    if len(set(rids)) != len(rids):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request id appears twice in one step")
    return rids


#: STATE fields that are integers, and the minimum of each
STATE_INTEGERS = {"stage": 0, "num_layers": 1, "hidden_size": 1, "vocab_size": 1, "sequences": 0, "steps": 0,
                  "overlapped": 0, "sent_frames": 0, "sent_bytes": 0, "prefix_bytes": 0}


#: STATE fields that are non-negative numbers: seconds the stage spent per part of its steps, since start
STATE_SECONDS = ("read_s", "queue_s", "compute_s", "send_s")


def check_state(header: dict[str, Any]) -> None:
    """A STATE's typed fields (ValueError otherwise): integers are integers, layers two of them."""
    for name, low in STATE_INTEGERS.items():
        if name in header:
            strict.integer(header[name], name, low, text="STATE field {name} must be an integer >= {lo}")
    for name in STATE_SECONDS:
        if name in header and not (strict.is_number(header[name]) and header[name] >= 0):
            raise ValueError(f"STATE field {name} must be a number >= 0")
    layers = header.get("layers")
    if not (isinstance(layers, list) and len(layers) == 2 and all(strict.in_range(v, 0) for v in layers)):
        raise ValueError("STATE field layers must be [start, end], two integers")
    strict.field(header, "draining", bool, default=False, text="STATE field {name} must be true or false")


def wire_dtype(mx_dtype: Any) -> str:
    """The wire name of an MLX float dtype."""
    name = str(mx_dtype).rsplit(".", 1)[-1]
    if name not in FLOAT_DTYPES:
        raise ValueError(f"activations travel as {', '.join(FLOAT_DTYPES)}, not {name}")
    return name
