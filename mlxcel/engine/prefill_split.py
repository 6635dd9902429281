"""How a prompt is cut into forward calls: the one rule every path shares (docs/engine.md, "Prompt chunks").

mlx-lm's ``generate_step`` runs all but the last prompt token in chunks of at most ``prefill_step``
tokens (they only fill the cache), then the last token alone, whose logits give the first token.
``generate_tokens`` (one device, ``generate --pp-size N``) and the ``Scheduler`` (the server, one
device or remote pipeline stages) both follow it, so every path runs the same forward calls on the
same shapes. That matters beyond the cache: a kernel's accumulation order depends on the number of
rows it is given (a matrix product over 97 rows against a vector product over 1; on a GPU also
SwitchGLU's sorted expert path, taken from 64 routed rows up), so the last token's logits inside a
97-token chunk differ in their last bits from its logits alone, and on random MoE weights a flipped
near-tie of the router then changes the greedy tokens.
"""

from __future__ import annotations


def prompt_chunk(todo: int, prefill_step: int) -> int:
    """The length of the next forward call over ``todo`` (> 0) prompt tokens still to run: at most
    ``prefill_step`` tokens of those before the last one, and the last one alone."""
    if todo < 1 or prefill_step < 1:
        raise ValueError(f"a prompt chunk needs todo >= 1 and prefill_step >= 1, got {todo} and {prefill_step}")
    return 1 if todo == 1 else min(todo - 1, prefill_step)
