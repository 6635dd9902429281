"""What the internal chat request refuses after a dialect's translation is that dialect's 400, in its own names."""

from __future__ import annotations

import pytest

from mlxcel.server.agent_turn import translated_request
from mlxcel.server.errors import InvalidRequest
from mlxcel.server.responses_api import NAMES as RESPONSES
from mlxcel.server.anthropic_api import NAMES as MESSAGES


@pytest.mark.parametrize(("names", "field"), [(RESPONSES, "input"), (MESSAGES, "messages")])
def test_no_message_is_a_400_naming_the_dialect_s_field(names, field):
    with pytest.raises(InvalidRequest) as refused:
        translated_request({"model": "m", "messages": [], "max_tokens": 4}, names)
    assert refused.value.param == field and str(refused.value).startswith(f"{field}:")
    assert "messages" not in str(refused.value) or field == "messages"


def test_a_refused_value_is_named_and_none_values_are_left_out():
    with pytest.raises(InvalidRequest) as refused:
        translated_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"},
                           RESPONSES)
    assert refused.value.param == "max_output_tokens"
    req = translated_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": None},
                             RESPONSES)
    assert req.max_tokens is None and req.messages[0].content == "hi"
