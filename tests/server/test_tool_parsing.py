"""The text side of tool calls and reasoning, without a model: splitting at markers, parsing calls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mlx_lm.tool_parsers import glm47, json_tools, kimi_k2, minimax_m2, qwen3_coder

from mlxcel.server import protocol as p
from mlxcel.server import tool_calls as tc
from mlxcel.server.chat_turn import Turn, join_deltas
from mlxcel.server.errors import InvalidRequest, Unsupported
from mlxcel.server.reasoning import Markers, MarkerSplitter, opens_in_reasoning

THINK = ("<think>", "</think>")
TOOL = ("<tool_call>", "</tool_call>")
JSON = tc.ToolFormat("json_tools", json_tools.parse_tool_call, *TOOL)
GLM = tc.ToolFormat("glm47", glm47.parse_tool_call, *TOOL)
KIMI = tc.ToolFormat("kimi_k2", kimi_k2.parse_tool_call, kimi_k2.tool_call_start, kimi_k2.tool_call_end)
CODER = tc.ToolFormat("qwen3_coder", qwen3_coder.parse_tool_call, qwen3_coder.tool_call_start,
                      qwen3_coder.tool_call_end)
MINIMAX = tc.ToolFormat("minimax_m2", minimax_m2.parse_tool_call, minimax_m2.tool_call_start,
                        minimax_m2.tool_call_end)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TEXT = ('<think>plan it</think>Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')


def split_all(text: str, pieces: int, **kw) -> list:
    """Feed ``text`` in ``pieces``-character slices; merge adjacent pieces of one kind."""
    s = MarkerSplitter(Markers(think=THINK, tool=TOOL), **kw)
    out = []
    for i in range(0, len(text), pieces):
        out += s.feed(text[i:i + pieces])
    out += s.finish()
    return merged(out)


def merged(pieces: list) -> list:
    """Adjacent pieces of one kind joined (calls stay whole): what a split is compared by."""
    out: list = []
    for kind, t in pieces:
        if out and out[-1][0] == kind != "call":
            out[-1] = (kind, out[-1][1] + t)
        else:
            out.append((kind, t))
    return out


@pytest.mark.parametrize("pieces", [1, 2, 3, 7, 1000])
def test_markers_split_the_same_however_the_text_arrives(pieces):
    assert split_all(TEXT, pieces) == [
        ("reasoning", "plan it"), ("content", "Sure. "),
        ("call", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),
        ("call", '\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n')]


def test_a_partial_marker_is_held_back_then_released_as_text():
    s = MarkerSplitter(Markers(think=THINK, tool=TOOL))
    assert s.feed("a <thi") == [("content", "a ")]
    assert s.feed("s is no marker") == [("content", "<this is no marker")]
    assert s.feed("<tool_") == [] and s.finish() == [("content", "<tool_")]


def test_prompt_opened_reasoning_and_unterminated_call():
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_in_reasoning("<think>\n\n</think>\n\n", THINK) and not opens_in_reasoning("x", None)
    assert split_all("hmm</think>ok", 4, state="reasoning") == [("reasoning", "hmm"), ("content", "ok")]
    assert split_all('{"a": 1', 3, state="tool", call_prefix='\n{"name": "f", "arguments": ') == [
        ("call", '\n{"name": "f", "arguments": {"a": 1')]
    # with tools off the call markers are text
    s = MarkerSplitter(Markers(think=THINK))
    assert s.feed("<tool_call>x</tool_call>") + s.finish() == [("content", "<tool_call>x</tool_call>")]


@pytest.mark.parametrize("fmt, text, want", [
    (JSON, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', {"city": "Paris"}),
    (GLM, "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3"
          "</arg_value>", {"city": "Paris", "days": 3}),
    (KIMI, '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
           '<|tool_call_end|>', {"city": "Paris"}),
])
def test_family_parsers_give_openai_calls(fmt, text, want):
    [call] = tc.parse_calls(fmt, text, TOOLS, None)
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == want
    assert call["id"] == ("functions.get_weather:0" if fmt is KIMI else call["id"]) and call["id"]


def test_unparsable_text_is_no_call_unless_forced():
    assert tc.parse_calls(JSON, "{not json", TOOLS, None) == []
    [call] = tc.parse_calls(JSON, '\n{"name": "get_weather", "arguments": xx~', TOOLS, "get_weather")
    assert call["function"] == {"name": "get_weather", "arguments": "xx~"}


def test_deltas_join_to_the_whole_message_and_parallel_false_keeps_one_call():
    turn = Turn(prompt=[1], markers=Markers(think=THINK, tool=TOOL), fmt=JSON, tools=TOOLS)
    for parallel, n in ((True, 2), (False, 1)):
        turn.parallel = parallel
        out = turn.output()
        deltas = [d for ch in TEXT for d in out.feed(ch)] + out.finish()
        msg = join_deltas(deltas)
        assert msg.content == "Sure. " and msg.reasoning_content == msg.reasoning == "plan it"
        assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Paris", "Rome"][:n]
        assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
        heads = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
        assert [h.index for h in heads] == list(range(n)) and all(h.type == "function" for h in heads)


def test_bad_tool_fields_and_conversations():
    with pytest.raises(InvalidRequest) as e:
        tc.check_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequest) as e:
        tc.check_tools(TOOLS * 2, "auto")
    assert e.value.param == "tools[1].function.name"
    issued = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    tc.check_conversation([issued, {"role": "tool", "tool_call_id": "c1", "content": "x"}])
    for bad in ({"role": "tool", "content": "x"}, {"role": "tool", "tool_call_id": "c2", "content": "x"}):
        with pytest.raises(InvalidRequest) as e:
            tc.check_conversation([issued, bad])
        assert e.value.param == "messages[1].tool_call_id"


def test_harmony_is_read_by_channels_and_toolless_templates_are_refused_by_name():
    harmony = SimpleNamespace(chat_template="<|start|>{{ m }}<|channel|>final<|message|>", tool_parser=None)
    assert tc.require_format(harmony, "tools") is tc.HARMONY
    with pytest.raises(Unsupported, match="knows no tools") as e:
        tc.require_format(SimpleNamespace(chat_template="{{ m }}", tool_parser=None), "messages[1].tool_calls")
    assert e.value.param == "messages[1].tool_calls"


def test_forced_openings_match_what_the_parsers_read():
    """A forced call's opening followed by well-formed arguments parses to the forced name."""
    rest = {"json_tools": ' {"city": "Oslo"}}\n', "glm47": "<arg_key>city</arg_key><arg_value>Oslo</arg_value>",
            "kimi_k2": '{"city": "Oslo"}<|tool_call_end|>', "harmony": '{"city": "Oslo"}',
            "qwen3_coder": "<parameter=city>\nOslo\n</parameter>\n</function>\n",
            "minimax_m2": '<parameter name="city">Oslo</parameter>\n</invoke>\n'}
    for fmt in (JSON, GLM, KIMI, CODER, MINIMAX, tc.HARMONY):
        text = tc.forced_opening(fmt, "get_weather")[len(fmt.start):] + rest[fmt.family]
        [call] = tc.parse_calls(fmt, text, TOOLS, None)
        assert call["function"]["name"] == "get_weather", fmt.family
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    with pytest.raises(Unsupported):
        tc.forced_opening(tc.ToolFormat("mistral", json_tools.parse_tool_call, "[TOOL_CALLS]", ""), "f")


def test_assistant_messages_hide_absent_fields():
    assert p.dump(p.AssistantMessage(content="x")) == {"role": "assistant", "content": "x"}


def test_a_template_error_is_a_prompt_error():
    from jinja2 import TemplateError

    from mlxcel.engine.prompts import PromptError, render_chat

    def refuse(*_a, **_k):
        raise TemplateError("Conversation roles must alternate")

    with pytest.raises(PromptError, match="roles must alternate"):
        render_chat(SimpleNamespace(chat_template="x", apply_chat_template=refuse), [{"role": "user", "content": "a"}])
