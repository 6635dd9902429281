"""The one bound on token ids that arrive from the wire: integers in ``[0, vocab_size)``.

Wire formats allow ids up to 2^32-1 (u32), but the embedding table has ``vocab_size`` rows and MLX
does not bound-check its gathers: an id at or above it reads out of bounds (wrong tokens, a stall)
or kills the process (SIGSEGV). Every place an id enters a process from the wire (stage RUN_ENTRY,
PREPARE and RELEASE; prefill GENERATE; decode handoff; the tensor-parallel control channel) calls
``check_token_ids`` with its model's vocabulary before MLX sees the ids; the caller names the field
and the documented error code. No MLX and no I/O here.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from mlxcel.error_codes import CodedError, ErrorCode


class TokenIdError(CodedError, ValueError):
    """A token id outside ``[0, vocab_size)`` (or not an integer); the text names the field and the bound."""


def check_token_ids(ids: Iterable[Any] | np.ndarray, vocab_size: int, field: str,
                    code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
    """Raise ``TokenIdError`` (``code``) unless every id is an integer in ``[0, vocab_size)``.

    ``ids``: an integer numpy array (checked by its min and max), or any iterable of Python ints
    (``True`` is not token 1).
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TokenIdError(f"`{field}` must hold integer token ids, not {ids.dtype}", code)
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            bad = low if low < 0 else high
            if low < 0 or high >= vocab_size:
                raise TokenIdError(_out_of_range(bad, field, vocab_size), code)
        return
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TokenIdError(f"`{field}` holds {t!r}, not an integer token id", code)
        if not 0 <= t < vocab_size:
            raise TokenIdError(_out_of_range(t, field, vocab_size), code)


def _out_of_range(token: int, field: str, vocab_size: int) -> str:
    return f"token id {token} in `{field}` is out of range [0, {vocab_size})"


def config_vocab_size(config: dict[str, Any]) -> int:
    """The vocabulary (embedding rows) of a checkpoint's config.json (a VLM's ``text_config``)."""
    text = config.get("text_config") or config
    return int(text["vocab_size"])


def model_vocab_size(model: Any) -> int:
    """The vocabulary of a loaded mlx-lm model (its ``args``, a VLM's text config)."""
    model_args = model.args
    text = getattr(model_args, "text_config", None)
    if isinstance(text, dict) and "vocab_size" in text:
        return int(text["vocab_size"])
    return int(getattr(text, "vocab_size", None) or model_args.vocab_size)
