"""What docs/disagg.md states about control-message fields is what ``mlxcel.disagg.messages`` does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlxcel.disagg import messages as m
from mlxcel.engine.sampling import SamplingParams

DOC = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"
NONCE = "0123456789abcdef"


def section(title: str) -> str:
    return DOC.read_text().split(title, 1)[1].split("\n## ", 1)[0]


def generate_fields() -> tuple[list[str], dict[str, object]]:
    """(required names, {optional name: its default}) from the "GENERATE fields" paragraph."""
    text = " ".join(section("## 3. Control messages").split("**GENERATE fields.**", 1)[1].split("\n\n", 1)[0].split())
    required = re.findall(r"`([\w.]+)`", re.search(r"Required: (.*?)\. Optional", text).group(1))
    optional = re.search(r"Optional, with the value a missing one takes: (.*?)\. `decode_target`", text).group(1)
    defaults = {name: json.loads(value) for name, value in re.findall(r"`([\w.]+)` (\S+?)(?:,|$)", optional)}
    return required, defaults


def put(doc: dict, name: str, value: object = ...) -> dict:
    """A copy of ``doc`` with the dotted field ``name`` removed (value ...) or set."""
    doc = json.loads(json.dumps(doc))
    *outer, last = name.split(".")
    target = doc
    for key in outer:
        target = target[key]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return doc


def minimal() -> dict:
    return {"nonce": NONCE, "prompt": [1, 2], "params": {"max_tokens": 3}}


def test_every_code_field_states_its_json_type():
    text = section("## 3. Control messages")
    rows = [line for line in text.splitlines() if line.startswith("| `0x")]
    with_code = [row for row in rows if "`code`" in row]
    assert {row.split("|")[2].strip() for row in with_code} == {"FINISH", "ERROR"}
    for row in with_code:
        assert re.search(r"`code`: a JSON integer 0\.\.65535", row), row


def test_the_documented_required_generate_fields_are_required():
    required, _ = generate_fields()
    assert required == ["nonce", "prompt", "params", "params.max_tokens"]
    m.Generate.parse(minimal(), 8)
    for name in required:
        with pytest.raises(m.MessageRefused):
            m.Generate.parse(put(minimal(), name), 8)


def test_the_documented_defaults_are_what_a_missing_field_takes():
    _, defaults = generate_fields()
    assert set(defaults) == {"params.temperature", "params.top_p", "params.top_k", "params.seed", "params.stop",
                             "params.logprobs", "params.min_p", "params.repetition_penalty", "params.presence_penalty",
                             "params.frequency_penalty", "params.logit_bias", "params.grammar", "top_logprobs",
                             "ignore_eos"}
    gen = m.Generate.parse(minimal(), 8)
    assert gen.decode_target is None and m.Generate.parse({**minimal(), "decode_target": None}, 8).decode_target is None
    for name, value in defaults.items():
        assert m.Generate.parse(put(minimal(), name, value), 8) == gen, name
    assert gen.params == SamplingParams(max_tokens=3)


@pytest.mark.parametrize("name", ["params.temperature", "params.top_p", "params.top_k", "params.stop",
                                  "params.logprobs", "params.min_p", "params.repetition_penalty",
                                  "params.presence_penalty", "params.frequency_penalty", "params.logit_bias",
                                  "top_logprobs", "ignore_eos"])
def test_null_is_no_missing_field_outside_seed_and_decode_target(name):
    with pytest.raises(m.MessageRefused):
        m.Generate.parse(put(minimal(), name, None), 8)
