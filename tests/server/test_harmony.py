"""gpt-oss's Harmony format at the front, without a server: channels, calls, forcing, the rendered prompt."""

from __future__ import annotations

import json

import pytest
from mlxcel.models.loading import load_checkpoint
from mlxcel.models.random_checkpoint import make_random_checkpoint
from mlxcel.server import harmony as hm
from mlxcel.server import protocol as p
from mlxcel.server import tool_calls as tc
from mlxcel.server.chat_turn import Turn, join_deltas, prepare_turn
from mlxcel.server.errors import InvalidRequest
from tests.server.test_tool_parsing import merged

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
#: an answer after the template's ``<|start|>assistant``: reasoning, a preamble, a call (recipient in the
#: channel), reasoning again, a call (recipient in the role, as the template renders history), the final answer
ANSWER = ('<|channel|>analysis<|message|>plan it<|end|>'
          '<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>'
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city": "Paris"}<|call|>'
          '<|start|>assistant<|channel|>analysis<|message|> and more<|end|>'
          '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
          '{"city": "Rome", "days": 2}<|call|>'
          '<|start|>assistant<|channel|>final<|message|>Done: <b>ok</b><|return|>')


def split(text: str, size: int, opened: str = "assistant", calls: bool = True) -> list:
    """Feed ``text`` in ``size``-character slices; merge adjacent pieces of one kind (calls stay whole)."""
    s = hm.HarmonySplitter(opened, calls=calls)
    return merged([piece for i in range(0, len(text), size) for piece in s.feed(text[i:i + size])] + s.finish())


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_channels_split_the_same_however_the_text_arrives(size):
    head = hm.CALL_HEAD.format(recipient="functions.get_weather")
    assert split(ANSWER, size) == [
        ("reasoning", "plan it"), ("content", "Checking."), ("call", head + '{"city": "Paris"}'),
        ("reasoning", " and more"), ("call", head + '{"city": "Rome", "days": 2}'), ("content", "Done: <b>ok</b>")]


def test_calls_parse_to_their_function_and_bad_ones_are_no_call():
    pieces = [t for kind, t in split(ANSWER, 5) if kind == "call"]
    assert [hm.parse_tool_call(t) for t in pieces] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]
    for bad in ("<|channel|>commentary to=browser.search<|message|>{}", hm.CALL_HEAD.format(
            recipient="functions.f") + "[1, 2]", hm.CALL_HEAD.format(recipient="functions.f") + "{nope"):
        with pytest.raises(ValueError):
            hm.parse_tool_call(bad)
        assert tc.parse_calls(tc.HARMONY, bad, [WEATHER], None) == []


def test_a_forced_call_starts_inside_its_message():
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant" + hm.forced_prefill("get_weather")
    s = hm.HarmonySplitter(hm.opened_tail(prompt))
    assert s.state == "tool"
    pieces = s.feed('{"city": "Os') + s.feed('lo"}') + s.finish()  # <|call|> is an end token: never seen
    [call] = tc.parse_calls(tc.HARMONY, pieces[0][1], [WEATHER], "get_weather")
    assert pieces[0][0] == "call" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # unparsable arguments of a forced call keep the name and the raw text
    s = hm.HarmonySplitter(hm.opened_tail(prompt))
    [(_, text)] = s.feed("xx~") + s.finish()
    [call] = tc.parse_calls(tc.HARMONY, text, [WEATHER], "get_weather")
    assert call["function"] == {"name": "get_weather", "arguments": "xx~"}
    # "required" among several tools: the model names the function
    s = hm.HarmonySplitter(hm.opened_tail("<|start|>assistant" + hm.forced_prefill(None)))
    [(kind, text)] = s.feed('get_time <|constrain|>json<|message|>{}') + s.finish()
    assert kind == "call" and hm.parse_tool_call(text) == {"name": "get_time", "arguments": {}}


def test_text_outside_the_format_is_content_and_nothing_is_lost():
    assert split("no channels here", 3) == [("content", "no channels here")]  # a dangling header, at finish
    long = "x" * (hm.MAX_HEADER + 10)
    s = hm.HarmonySplitter("assistant")
    assert s.feed(long) == [("content", long)] and s.state == "content"  # streamed once past the bound
    for size in (1, 5, 1000):  # a marker after an overlong header is text, whether it came at once or not
        assert split(long + "<|channel|>final<|message|>hi<|end|>", size) == [
            ("content", long + "<|channel|>final<|message|>hi")]
    assert split("<|channel|>analysis<|message|>unfinished", 4) == [("reasoning", "unfinished")]
    assert split("hmm", 1, opened="assistant<|channel|>analysis<|message|>") == [("reasoning", "hmm")]
    # with calls off (no tools, tool_choice none) a message to a function is plain content
    assert split('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>', 2,
                 calls=False) == [("content", "{}")]


def test_harmony_deltas_join_to_the_whole_message():
    turn = Turn(prompt=[1], fmt=tc.HARMONY, tools=[WEATHER], harmony="assistant")
    turn.markers = turn.markers.__class__(tool=("", "<|call|>"))
    assert not turn.plain
    for parallel, n in ((True, 2), (False, 1)):
        turn.parallel = parallel
        out = turn.output()
        deltas = [d for ch in ANSWER for d in out.feed(ch)] + out.finish()
        msg = join_deltas(deltas)
        assert msg.content == "Checking.Done: <b>ok</b>" and msg.reasoning_content == "plan it and more"
        assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Paris", "Rome"][:n]
        whole = turn.output()
        assert join_deltas(whole.feed(ANSWER) + whole.finish()).model_dump(exclude={"tool_calls"}) == \
            msg.model_dump(exclude={"tool_calls"})
        assert out.finish_reason("stop") == "tool_calls"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("gpt-oss-tok"), layers=1, template="gpt_oss")
    return load_checkpoint(path).tokenizer  # as the server loads it: eos ids from config.json


def request(**kw) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(model="m", messages=kw.pop("messages", [{"role": "user", "content": "hi"}]),
                                   **kw)


def test_the_tiny_gpt_oss_checkpoint_stops_at_return_and_call(tokenizer):
    ids = {tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<|return|>", "<|call|>")}
    assert ids <= set(tokenizer.eos_token_ids) and tokenizer.tool_parser is None
    assert hm.is_harmony(tokenizer) and tc.require_format(tokenizer, "tools") is tc.HARMONY


def test_prompts_render_tools_force_calls_and_carry_results(tokenizer):
    text = tokenizer.decode
    named = prepare_turn(tokenizer, request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    rendered = text(named.prompt)
    assert "namespace functions {\n\n// Weather of a city\ntype get_weather = (_: {\ncity: string,\ndays?: number," \
           in rendered
    assert rendered.endswith("<|start|>assistant" + hm.forced_prefill("get_weather"))
    assert named.forced == "get_weather" and named.output()._split.state == "tool"
    anyone = prepare_turn(tokenizer, request(tools=[WEATHER, TIME], tool_choice="required"))
    assert text(anyone.prompt).endswith("<|start|>assistant<|channel|>commentary to=functions.")
    auto = prepare_turn(tokenizer, request(tools=[WEATHER], reasoning_effort="high", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]))
    assert text(auto.prompt).endswith("<|start|>assistant") and "Reasoning: high" in text(auto.prompt)
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n" in text(auto.prompt)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    trip = prepare_turn(tokenizer, request(tools=[WEATHER], tool_choice="none", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]))
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"{\\"temp_c\\": 21}"<|end|><|start|>assistant') in text(trip.prompt)
    assert trip.markers.tool is None  # tool_choice none: a message to a function would be content


def test_a_structured_answer_is_the_final_channel(tokenizer):
    """response_format's grammar constrains the body, so the answer starts inside the final channel."""
    turn = prepare_turn(tokenizer, request(response_format={"type": "json_object"}))
    assert tokenizer.decode(turn.prompt).endswith("<|start|>assistant" + hm.FINAL)
    out = turn.output()
    assert out.feed('{"a": 1}') == [p.Delta(content='{"a": 1}')]  # streamed at once, not held as a header


def test_bad_harmony_requests_are_400s(tokenizer):
    with pytest.raises(InvalidRequest) as e:
        prepare_turn(tokenizer, request(tools=[WEATHER], tool_choice={"type": "function",
                                                                      "function": {"name": "nope"}}))
    assert e.value.param == "tool_choice"
