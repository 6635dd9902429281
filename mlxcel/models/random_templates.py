"""Chat templates (and the marker tokens they need) for tiny random checkpoints, by tool-call family.

Each is a small template in the shape of a real family's, enough for mlx-lm to infer the same tool parser
and think markers as from the real one: ``plain`` (no tools), ``qwen3`` (JSON calls in ``<tool_call>``,
``mlx_lm.tool_parsers.json_tools``; ``<think>`` opened by the generation prompt unless ``enable_thinking``
is false), ``glm47`` (``<arg_key>``/``<arg_value>`` calls, ``glm47``), ``kimi_k2`` (sectioned calls with
their own ids, ``kimi_k2``). The markers are special tokens of the tiny tokenizer, as in the real ones.
"""

from __future__ import annotations

_TURNS = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
_GEN = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOOLS_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
)

QWEN3 = _TOOLS_SYSTEM + (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}{%- set tool_call = tool_call.function %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}" + _TURNS + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{%- endif %}"
)

GLM47 = _TOOLS_SYSTEM + (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{%- if tc.function.arguments is mapping %}{%- for k, v in tc.function.arguments.items() %}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson }}</arg_value>{%- endfor %}"
    "{%- else %}{{ tc.function.arguments }}{%- endif %}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>observation\n{{ m.content }}<|im_end|>\n"
    "{%- else %}" + _TURNS + "{%- endif %}{%- endfor %}" + _GEN
)

KIMI_K2 = _TOOLS_SYSTEM + (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{%- for tc in m.tool_calls %}<|tool_call_begin|>"
    "{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}<|tool_call_end|>"
    "{%- endfor %}<|tool_calls_section_end|>{%- endif %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>\n"
    "{%- else %}" + _TURNS + "{%- endif %}{%- endfor %}" + _GEN
)

#: name -> (chat template, the special tokens it adds to the tiny tokenizer beyond the three base ones)
TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "plain": (PLAIN, []),
    "qwen3": (QWEN3, ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]),
    "glm47": (GLM47, ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]),
    "kimi_k2": (KIMI_K2, ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                          "<|tool_call_argument_begin|>", "<|tool_call_end|>"]),
}
