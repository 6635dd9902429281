"""Turn user input into token ids: chat template by default, raw text on request."""

from __future__ import annotations

from typing import Any, Sequence

from mlxcel.models.errors import ModelError


class PromptError(ValueError):
    """The prompt cannot be encoded (empty, no chat template, bad messages)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The checkpoint's chat template over ``messages`` (and ``tools``), ending with the assistant prompt."""
    if not messages:
        raise PromptError("messages must not be empty")
    if not has_chat_template(tokenizer):
        raise ModelError("this checkpoint has no chat template; send a raw prompt instead (--raw, /v1/completions)")
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = list(tools)
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
    except TemplateError as exc:  # e.g. a template's raise_exception() on a message order it refuses
        raise PromptError(f"the chat template refused these messages: {exc}") from None


def encode_chat(tokenizer: Any, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None, prefill: str = "") -> list[int]:
    """Apply the checkpoint's chat template (with the assistant prompt), append ``prefill``, tokenize."""
    text = render_chat(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    return encode_raw(tokenizer, text + prefill, add_special_tokens=False)


def encode_raw(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Tokenize text as is."""
    if not text:
        raise PromptError("prompt must not be empty")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise PromptError("prompt encodes to no tokens")
    return list(ids)


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = True) -> list[int]:
    """A single user prompt, through the chat template unless ``chat`` is False."""
    if not prompt or not prompt.strip():
        raise PromptError("prompt must not be empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return encode_raw(tokenizer, prompt)
