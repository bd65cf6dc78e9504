"""The one conversation type: data readers, chat validation and benchmark prompts read messages with the same role
table and the same layout."""

from __future__ import annotations

import json

import pytest

from eagle3_zoo.chat.conversation import ROLE_ALIASES, Message, MessageError
from eagle3_zoo.data.readers import read_conversations
from eagle3_zoo.speculative.benchmarks import load_benchmark


def test_benchmark_records_read_roles_as_data_records_do(tmp_path):
    """A benchmark JSONL in ShareGPT layout keeps the user turns the data readers find in the same record (every
    spelling of the role table, case and surrounding spaces included)."""
    spellings = sorted(ROLE_ALIASES)
    turns = [{"from": f" {s.upper()} ", "value": f"text {i}"} for i, s in enumerate(spellings)]
    record = {"id": "r", "conversations": [{"from": "human", "value": "first"}, *turns]}
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (conv,), _ = read_conversations(path)
    users = tuple(m["content"] for m in conv.messages if m["role"] == "user")
    assert users == ("first", *(f"text {i}" for i, s in enumerate(spellings) if ROLE_ALIASES[s] == "user"))
    assert load_benchmark(str(path)).prompts[0].turns == users


def test_read_messages_are_valid_messages_and_round_trip(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "c1", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "ipython", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
        {"role": "model", "content": "Sunny.", "thinking": ""}]}) + "\n")
    (conv,), _ = read_conversations(path)
    parsed = [Message.parse(m, i) for i, m in enumerate(conv.messages)]
    assert [m.as_dict() for m in parsed] == conv.messages
    assert parsed[2].reasoning == "Call the tool." and parsed[2].content == "" and parsed[3].role == "tool"
    assert parsed[4].reasoning is None  # empty reasoning is none


@pytest.mark.parametrize("message, match", [
    ({"role": "user", "content": "a", "reasoning": "b"}, r"message 3 \(user\): reasoning is one str"),
    ({"role": "assistant", "content": "a", "reasoning": "b", "thinking": "c"}, "reasoning is one str"),
    ({"role": "user", "content": "a", "tool_call_id": "x"}, "'tool_call_id' is a str on tool messages only"),
    ({"role": "human", "content": "a"}, r"message 3: role 'human' is not one of"),
])
def test_parse_names_the_message_and_what_is_valid(message, match):
    with pytest.raises(MessageError, match=match):
        Message.parse(message, 3)
