"""Conversation readers: formats, role normalisation, bad records (raise/skip), the embedded ShareGPT, splits."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from eagle3_zoo.data import readers
from eagle3_zoo.data.readers import (
    Conversation,
    DataError,
    ReadStats,
    iter_conversations,
    read_conversations,
    read_sources,
    sharegpt_path,
    split_train_val,
)

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "user", "value": "q"},
                                  {"from": "chatgpt", "value": "r"}, {"from": "human", "value": "q2"},
                                  {"from": "bard", "value": "r2"}]},
]
MESSAGES = [
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                  {"role": "model", "content": "y"}]},
]


def _write_json(path, records):
    path.write_text(json.dumps(records, indent=2))
    return path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("writer", [_write_json, _write_jsonl], ids=["json", "jsonl"])
@pytest.mark.parametrize("records,fmt", [(SHAREGPT, "auto"), (SHAREGPT, "sharegpt"), (MESSAGES, "auto"),
                                         (MESSAGES, "messages")])
def test_formats_round_trip(tmp_path, writer, records, fmt):
    path = writer(tmp_path / "data.txt", records)
    convs, stats = read_conversations(path, format=fmt)
    assert stats.read == stats.kept == 2 and not stats.skipped
    assert [c.index for c in convs] == [0, 1] and all(c.source == str(path) for c in convs)
    roles = [[m["role"] for m in c.messages] for c in convs]
    if records is SHAREGPT:
        assert [c.id for c in convs] == ["a", "b"]
        assert roles == [["user", "assistant"], ["system", "user", "assistant", "user", "assistant"]]
        assert convs[1].messages[2] == {"role": "assistant", "content": "r"}
    else:
        assert [c.id for c in convs] == ["data.txt:0", "data.txt:1"]
        assert roles == [["user", "assistant"], ["system", "user", "assistant"]]


def test_jsonl_format_forces_line_reading_and_gzip(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n\n" for r in SHAREGPT + MESSAGES)  # blank lines are ignored
    convs, _ = read_conversations(path, format="jsonl")
    assert len(convs) == 4 and convs[3].messages[-1]["content"] == "y"


@pytest.mark.parametrize("raw_roles,expected", [
    (["gpt", "human", "gpt"], ["user", "assistant"]),
    (["system", "gpt", "human", "gpt"], ["system", "user", "assistant"]),
    (["bing", "system", "human", "model"], ["system", "user", "assistant"]),
    (["Human", "GPT"], ["user", "assistant"]),
])
def test_leading_non_user_turns_dropped(tmp_path, raw_roles, expected):
    rec = {"conversations": [{"from": r, "value": f"t{i}"} for i, r in enumerate(raw_roles)]}
    convs, _ = read_conversations(_write_json(tmp_path / "d.json", [rec]))
    assert [m["role"] for m in convs[0].messages] == expected


BAD = [
    ("unknown_role", {"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}),
    ("non_string_content", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [1]}]}),
    ("missing_key", {"id": "x", "turns": []}),
    ("missing_key", {"conversations": [{"from": "human"}, {"from": "gpt", "value": "b"}]}),
    ("empty_conversation", {"conversations": []}),
    ("no_assistant_turn", {"conversations": [{"from": "human", "value": "a"}]}),
    ("no_user_turn", {"conversations": [{"from": "gpt", "value": "a"}]}),
    ("empty_user_turn", {"conversations": [{"from": "human", "value": " \n"}, {"from": "gpt", "value": "a"}]}),
    ("empty_user_turn", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": ""},
                                      {"role": "assistant", "content": "a"}]}),
    ("not_an_object", ["a list"]),
    ("lone_surrogate", {"conversations": [{"from": "human", "value": "half an emoji \ud83d"},  # written as an escape
                                          {"from": "gpt", "value": "b"}]}),
]


@pytest.mark.parametrize("reason,bad", BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD)])
@pytest.mark.parametrize("writer", [_write_json, _write_jsonl], ids=["json", "jsonl"])
def test_bad_records(tmp_path, caplog, writer, reason, bad):
    path = writer(tmp_path / "d.json", [SHAREGPT[0], bad, SHAREGPT[1]])
    with pytest.raises(DataError) as exc:
        read_conversations(path)
    msg = str(exc.value)
    assert str(path) in msg and "record 1 (line " in msg and f"[{reason}]" in msg and "on_error=skip" in msg
    if writer is _write_jsonl:
        assert "(line 2)" in msg
    with caplog.at_level(logging.INFO, logger="eagle3_zoo.data.readers"):
        convs, stats = read_conversations(path, on_error="skip")
    assert [c.index for c in convs] == [0, 2]
    assert stats.read == 3 and stats.kept == 2 and stats.skipped == {reason: 1}
    assert f"{reason}: 1" in caplog.text  # logged, never silent


def test_broken_jsonl_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(SHAREGPT[0]) + "\n{not json\n" + json.dumps(SHAREGPT[1]) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: record 1 \(line 2\): invalid JSON.*\[broken_json\]"):
        read_conversations(path)
    convs, stats = read_conversations(path, on_error="skip")
    assert len(convs) == 2 and stats.skipped == {"broken_json": 1}


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(DataError, match="empty.json: file is empty"):
        read_conversations(tmp_path / "empty.json", on_error="skip")
    with pytest.raises(DataError, match="nope.json: data file not found"):
        read_conversations(tmp_path / "nope.json")
    with pytest.raises(DataError, match="Hub datasets are not downloaded"):
        read_sources([{"path": "org/some-dataset"}])
    with pytest.raises(ValueError, match="unknown data format 'csv'"):
        read_conversations(tmp_path / "empty.json", format="csv")


def test_truncated_json_list(tmp_path):
    text = json.dumps(SHAREGPT + MESSAGES, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"role": "system"')])  # cut inside the 4th record
    with pytest.raises(DataError, match="truncated after 3 complete records"):
        read_conversations(path)
    convs, stats = read_conversations(path, on_error="skip")
    assert len(convs) == 3 and stats.truncated_files == [str(path)]


def test_syntax_error_inside_json_list_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"conversations": []},\n {"conversations": [}\n' + json.dumps(SHAREGPT) * 3 + "]\n")
    with pytest.raises(DataError, match=r"bad.json: record 1 \(line 3\): invalid JSON"):
        read_conversations(path, on_error="skip")


def _bytes_file(path, pieces, writer):
    """A JSON list or JSONL file of `pieces` (bytes, one record each) with one record per line."""
    body = b"[\n" + b",\n".join(pieces) + b"\n]\n" if writer == "json" else b"".join(p + b"\n" for p in pieces)
    (gzip.open if path.suffix == ".gz" else open)(path, "wb").write(body)
    return path


@pytest.mark.parametrize("name,writer,line", [("d.jsonl", "jsonl", 2), ("d.json", "json", 3),
                                              ("d.jsonl.gz", "jsonl", 2)])
def test_non_utf8_bytes_are_one_bad_record(tmp_path, monkeypatch, name, writer, line):
    good = [json.dumps(r).encode() for r in SHAREGPT]
    bad = good[0].replace(b"hello", b"hel\xff\xfelo")  # Latin-1 bytes where UTF-8 is due
    path = _bytes_file(tmp_path / name, [good[0], bad, good[1]], writer)
    column = bad.index(b"\xff") + 1
    where = f"column {column}" if writer == "jsonl" else f"line {line}, column {column}"
    with pytest.raises(DataError, match=rf"{name}: record 1 \(line {line}\): not UTF-8 text: byte 0xff at {where} "
                       r".*\[invalid_utf8\]; set data.on_error=skip"):
        read_conversations(path)
    monkeypatch.setattr(readers, "_CHUNK", 16)  # the bad bytes straddle buffer refills too
    convs, stats = read_conversations(path, on_error="skip")
    assert [c.index for c in convs] == [0, 2] and stats.skipped == {"invalid_utf8": 1}
    assert convs[0].messages[1]["content"] == "hello"


def test_non_utf8_bytes_between_json_list_records_name_the_line(tmp_path):
    good = [json.dumps(r).encode() for r in SHAREGPT]
    path = _bytes_file(tmp_path / "d.json", [good[0], b"\xff" + good[1]], "json")
    with pytest.raises(DataError, match=r"d.json: record 1 \(line 3\): not UTF-8 text: byte 0xff at line 3"):
        read_conversations(path, on_error="skip")  # a list cannot be re-synchronised after a syntax error


@pytest.mark.parametrize("writer", ["jsonl", "json"])
def test_deeply_nested_record_is_one_bad_record(tmp_path, monkeypatch, writer):
    deep = b'{"conversations": ' + b"[" * 50_000 + b'"]"' + b"]" * 50_000 + b"}"  # the "]" string must not count
    good = [json.dumps(r).encode() for r in SHAREGPT]
    path = _bytes_file(tmp_path / f"d.{writer}", [good[0], deep, good[1]], writer)
    with pytest.raises(DataError, match=r"record 1 \(line \d\): nested deeper than the JSON decoder allows.*"
                       r"\[too_deeply_nested\]"):
        read_conversations(path)
    monkeypatch.setattr(readers, "_CHUNK", 4096)  # the nested record spans many buffer refills
    convs, stats = read_conversations(path, on_error="skip")
    assert [c.index for c in convs] == [0, 2] and stats.skipped == {"too_deeply_nested": 1}
    assert [c.id for c in convs] == ["a", "b"]


def test_streaming_across_small_chunks(tmp_path, monkeypatch):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "q" * (i * 37 % 300 + 1)},
                                                {"from": "gpt", "value": "é\n\"x\"" * (i % 50 + 1)}]}
               for i in range(60)]
    path = _write_json(tmp_path / "d.json", records)
    monkeypatch.setattr(readers, "_CHUNK", 64)  # force records to straddle buffer refills
    convs, _ = read_conversations(path)
    assert [c.messages[1]["content"] for c in convs] == [r["conversations"][1]["value"] for r in records]
    assert len(list(iter_conversations(path, max_samples=7))) == 7


def test_embedded_sharegpt_prefix_is_fast_and_lazy():
    path = sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    stats = ReadStats()
    convs = list(iter_conversations(path, on_error="skip", max_samples=100, stats=stats))
    assert len(convs) == 100 and stats.kept == 100 and not stats.truncated_files  # stopped before the end
    assert convs[0].messages[0]["role"] == "user" and convs[0].id == "QWJhYvA_0"


def test_embedded_sharegpt_full_read_warns_once(caplog):
    readers._warned_truncated.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3_zoo.data.readers"):
        convs, stats = read_sources([{"path": "sharegpt-embedded"}], on_error="skip")
    assert stats.read == 17_671  # complete records before the cut
    assert stats.skipped["empty_conversation"] == 126
    assert stats.kept == len(convs) == stats.read - stats.num_skipped
    assert len(stats.truncated_files) == 1
    assert caplog.text.count("truncated after 17,671 complete records") == 1
    assert all(c.messages[0]["role"] in ("user", "system") for c in convs)
    assert len({c.uid for c in convs}) == len(convs)


def test_read_sources_caps_splits_and_directories(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    _write_jsonl(d / "a.jsonl", SHAREGPT * 3)
    _write_json(d / "b.json", MESSAGES * 3)
    (d / "notes.txt").write_text("ignored")
    val = _write_json(tmp_path / "val.json", MESSAGES)
    convs, stats = read_sources([{"path": str(d), "max_samples": 8}, {"path": str(val), "split": "val"}])
    assert len(convs) == 10 and stats.kept == 10
    assert [c.split for c in convs] == [None] * 8 + ["val", "val"]
    assert sum(c.source.endswith("b.json") for c in convs) == 2  # per-source cap spans its files
    convs, _ = read_sources([{"path": str(d)}, {"path": str(val)}], max_samples=5)
    assert len(convs) == 5


def _convs(n, split=None):
    return [Conversation(id=str(i), source="s", index=i, messages=[], split=split) for i in range(n)]


def test_split_train_val_deterministic():
    convs = _convs(100)
    train, val = split_train_val(convs, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert {c.uid for c in train} | {c.uid for c in val} == {c.uid for c in convs}
    assert not {c.uid for c in train} & {c.uid for c in val}
    assert split_train_val(convs, 0.1, seed=3) == (train, val)
    assert split_train_val(convs, 0.1, seed=4)[1] != val
    assert split_train_val(_convs(5), 0.01, seed=0)[1] != []  # at least one validation sample
    assert split_train_val(convs, 0.0, seed=0) == (train_sorted := split_train_val(convs, 0.0, seed=0)[0], [])
    assert len(train_sorted) == 100
    pinned = _convs(3, split="val") + _convs(4, split="train")
    train, val = split_train_val(pinned, 0.5, seed=0)
    assert [c.split for c in val] == ["val"] * 3 and [c.split for c in train] == ["train"] * 4
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(convs, 1.0, seed=0)


def test_reasoning_tool_calls_and_tool_turns_are_kept(tmp_path):
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    record = {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "abcDEF123", "name": "f"},
        {"role": "assistant", "content": "a", "thinking": "more"},
    ]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(record) + "\n")
    conv, = read_conversations(path)[0]
    assert conv.messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning": "think", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "abcDEF123", "name": "f"},
        {"role": "assistant", "content": "a", "reasoning": "more"},
    ]
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": "f()"}]}
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"tool_calls must be a list of objects \[bad_tool_calls\]"):
        read_conversations(path)


def test_tool_definitions_and_ipython_turns_are_kept(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    turns = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
             {"role": "ipython", "content": "42"}, {"role": "assistant", "content": "a"}]
    records = [{"messages": turns, "tools": tools}, {"messages": turns, "tools": json.dumps(tools)},
               {"messages": turns, "tools": []}, {"messages": turns}]
    path = _write_jsonl(tmp_path / "t.jsonl", records)
    convs, _ = read_conversations(path)
    assert [c.tools for c in convs] == [tools, tools, None, None]
    assert convs[0].messages[2] == {"role": "tool", "content": "42"}
    for bad, match in [("not json", r"'tools' is a string but not JSON"),
                       ({"name": "f"}, r"'tools': tools must be a list"),
                       ([{"type": "function"}], r"'tools': tools\[0\] needs a function name")]:
        _write_jsonl(path, [{"messages": turns, "tools": bad}])
        with pytest.raises(DataError, match=rf"record 0 \(line 1\): {match}.*\[bad_tools\]"):
            read_conversations(path)
    _, stats = read_conversations(path, on_error="skip")
    assert dict(stats.skipped) == {"bad_tools": 1}
