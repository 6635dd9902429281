"""Read a GGUF file's header (metadata keys and tensor infos) without its tensor data.

MLX's `mx.load` reads the data but fails on tensor types it cannot represent, without
saying which tensor or type. Reading the header first lets the importer refuse an
unsupported file with a clear message before loading anything heavy.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlxcel.models.errors import ModelError

MAGIC = b"GGUF"

# ggml_type ids -> names, as llama.cpp spells them (ggml.h).
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}

# GGUF metadata value types: struct format of the fixed-size ones; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's name, shape (GGUF order: fastest axis first) and ggml type."""

    name: str
    shape: tuple[int, ...]
    type_id: int

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.type_id, f"type {self.type_id}")


@dataclass(frozen=True)
class GGUFHeader:
    """Scalar and string metadata (arrays are skipped) plus every tensor's info."""

    version: int
    metadata: dict[str, object]
    tensors: list[TensorInfo]

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


def _read(f: BinaryIO, fmt: str) -> object:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    data = f.read(length)
    if len(data) != length:
        raise EOFError("truncated GGUF string")
    return data.decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int) -> object:
    """Read one metadata value; arrays are skipped and returned as None."""
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_string(f)
    if vtype == _ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if item_type in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
        else:
            for _ in range(count):
                _read_value(f, item_type)
        return None
    raise ValueError(f"unknown GGUF metadata value type {vtype}")


def _read_tensor_info(f: BinaryIO) -> TensorInfo:
    name = _read_string(f)
    n_dims = _read(f, "<I")
    shape = tuple(_read(f, "<Q") for _ in range(n_dims))
    type_id = _read(f, "<I")
    _read(f, "<Q")  # data offset
    return TensorInfo(name, shape, type_id)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path`; raise ModelError if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ModelError(f"{path} is not a GGUF file (bad magic)")
            version = _read(f, "<I")
            if version not in (2, 3):
                raise ModelError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _read_string(f)
                metadata[key] = _read_value(f, _read(f, "<I"))
            tensors = [_read_tensor_info(f) for _ in range(n_tensors)]
    except (EOFError, ValueError, struct.error) as exc:
        raise ModelError(f"{path}: malformed GGUF header: {exc}") from exc
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return GGUFHeader(version, metadata, tensors)
