"""Chat templates (and the marker tokens they need) for tiny random checkpoints, by tool-call family.

Each is a small template in the shape of a real family's, enough for mlx-lm to infer the same tool parser
and think markers as from the real one: ``plain`` (no tools), ``qwen3`` (JSON calls in ``<tool_call>``,
``mlx_lm.tool_parsers.json_tools``; ``<think>`` opened by the generation prompt unless ``enable_thinking``
is false), ``glm47`` (``<arg_key>``/``<arg_value>`` calls, ``glm47``), ``kimi_k2`` (sectioned calls with
their own ids, ``kimi_k2``), ``qwen3_coder`` (XML calls ``<tool_call>\n<function=NAME>\n<parameter=K>``,
``qwen3_coder``), ``minimax_m2`` (``<minimax:tool_call>`` with ``<invoke name=..>``, ``minimax_m2``;
``<think>`` always opened), ``gpt_oss`` (Harmony: channels, tools as a TypeScript namespace, calls to
``functions.NAME``; no mlx-lm parser, read by ``mlxcel.server.harmony``). The markers are special tokens of
the tiny tokenizer, as in the real ones; ``STOPS`` are a template's end-of-answer tokens beyond ``<|im_end|>``.
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

_NL = "{{ '\\n' }}"  # a newline beside a block tag, which transformers' trim_blocks would drop

QWEN3_CODER = _TOOLS_SYSTEM + (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}{%- set tc = tc.function %}<tool_call>\n<function={{ tc.name }}>" + _NL +
    "{%- for k, v in tc.arguments|items %}<parameter={{ k }}>" + _NL +
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>" + _NL +
    "{%- endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>" + _NL +
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>\n<|im_end|>"
    + _NL + "{%- else %}" + _TURNS + "{%- endif %}{%- endfor %}" + _GEN
)

MINIMAX_M2 = _TOOLS_SYSTEM + (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- if m.tool_calls %}<minimax:tool_call>" + _NL + "{%- for tc in m.tool_calls %}{%- set tc = tc.function %}"
    '<invoke name="{{ tc.name }}">' + _NL + '{%- for k, v in tc.arguments|items %}<parameter name="{{ k }}">'
    "{{ v if v is string else v | tojson }}</parameter>" + _NL + "{%- endfor %}</invoke>" + _NL + "{%- endfor %}"
    "</minimax:tool_call>{%- endif %}<|im_end|>" + _NL +
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<response>{{ m.content }}</response><|im_end|>" + _NL +
    "{%- else %}" + _TURNS + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>" + _NL + "{%- endif %}"
)

_TS_TYPE = (
    "{%- macro ts_type(spec) -%}{%- if spec.type in ('integer', 'number') -%}number"
    "{%- elif spec.type in ('string', 'boolean') -%}{{ spec.type }}{%- elif spec.type == 'array' -%}any[]"
    "{%- else -%}any{%- endif -%}{%- endmacro -%}"
)

#: gpt-oss's shape: a system message (reasoning effort, the valid channels), a developer message with the
#: tools as ``namespace functions``, calls as ``<|start|>assistant to=functions.NAME<|channel|>commentary json
#: <|message|>ARGS<|call|>`` (one per assistant message), results as ``<|start|>functions.NAME to=assistant
#: <|channel|>commentary<|message|>"JSON"<|end|>``, and the answer opened by ``<|start|>assistant``.
#: ``harmony_channel`` (a test hook, not in the real template) opens a channel in the generation prompt.
GPT_OSS = _TS_TYPE + (
    "<|start|>system<|message|>You are a tiny random model.\n"
    "Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}" + _NL + "Calls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- if messages[0].role in ('system', 'developer') %}{%- set dev = messages[0].content %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set dev = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- if dev or tools %}<|start|>developer<|message|>{%- if dev %}# Instructions\n\n{{ dev }}" + _NL * 2 +
    "{%- endif %}{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {{ '{' }}" + _NL * 2 +
    "{%- for t in tools %}{%- set f = t.function %}"
    "// {{ f.description }}\ntype {{ f.name }} = {% if f.parameters and f.parameters.properties %}(_: {{ '{' }}" + _NL +
    "{%- for k, v in f.parameters.properties.items() %}{{ k }}{{ '' if k in (f.parameters.required or []) else '?' }}"
    ": {{ ts_type(v) }}," + _NL + "{%- endfor %}}) => any;" + _NL * 2 + "{%- else %}() => any;" + _NL * 2 +
    "{%- endif %}{%- endfor %}"
    "} // namespace functions{%- endif %}<|end|>{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in turns %}"
    "{%- if m.role == 'assistant' and '<|channel|>' in (m.content or '') %}"
    "{{- raise_exception('pass the analysis in thinking, not <|channel|> tags in content') }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{%- set tc = m.tool_calls[0].function %}"
    "{%- if m.content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content }}<|end|>{%- endif %}"
    "<|start|>assistant to=functions.{{ tc.name }}<|channel|>commentary json<|message|>{{ tc.arguments | tojson }}"
    "<|call|>{%- set last.name = tc.name %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}{%- set last.name = none %}"
    "{%- elif m.role == 'tool' %}{%- if last.name is none %}"
    "{{- raise_exception('a tool message follows no assistant tool call') }}{%- endif %}"
    "<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{%- else %}<|start|>user<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant"
    "{%- if harmony_channel is defined %}<|channel|>{{ harmony_channel }}<|message|>{%- endif %}{%- endif %}"
)

#: name -> (chat template, the special tokens it adds to the tiny tokenizer beyond the three base ones)
TEMPLATES: dict[str, tuple[str, list[str]]] = {
    "plain": (PLAIN, []),
    "qwen3": (QWEN3, ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]),
    "glm47": (GLM47, ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]),
    "kimi_k2": (KIMI_K2, ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                          "<|tool_call_argument_begin|>", "<|tool_call_end|>"]),
    "qwen3_coder": (QWEN3_CODER, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "minimax_m2": (MINIMAX_M2, ["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"]),
    "gpt_oss": (GPT_OSS, ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                          "<|return|>"]),
}

#: name -> the tokens beyond ``<|im_end|>`` that end an answer (gpt-oss: ``<|return|>`` and ``<|call|>``)
STOPS: dict[str, list[str]] = {"gpt_oss": ["<|return|>", "<|call|>"]}
