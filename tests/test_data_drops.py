"""Nothing is dropped silently: every conversation the data stage leaves out is counted in one log line of the stage
that drops it (reader, regeneration, tokenisation), each line once: information while the drops are the few a slice
of real data loses (`readers.EXPECTED_DROP_SHARE`), a warning beyond; a validation split too small to mean anything
is a warning that says how to get a bigger one (information in a demo run, whose small slice is its point)."""

from __future__ import annotations

import json
import logging

import pytest
from training_fixtures import tiny_llama_target, tiny_recipe, write_recipe

from eagle3_zoo.data.prepare import prepare_data
from eagle3_zoo.recipe.sections import load_recipe

LONG = "the quick brown fox jumps over the lazy dog " * 12  # 181 prompt tokens (tiny tokenizer); short ones: 86


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_target()


def _data(path, n_short: int = 12, n_long_prompt: int = 4, n_long_answer: int = 3, n_blank: int = 1):
    records = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"Hello {i}?"},
                                                  {"from": "gpt", "value": "Fine, thanks."}]} for i in range(n_short)]
    records += [{"id": f"p{i}", "conversations": [{"from": "human", "value": LONG},
                                                   {"from": "gpt", "value": "ok"}]} for i in range(n_long_prompt)]
    records += [{"id": f"a{i}", "conversations": [{"from": "human", "value": "Tell me more."},
                                                   {"from": "gpt", "value": LONG}]} for i in range(n_long_answer)]
    records += [{"id": f"b{i}", "conversations": []} for i in range(n_blank)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _levels(caplog, text: str) -> list[str]:
    return [r.levelname for r in caplog.records if text in r.getMessage()]


def test_the_level_of_a_drop_line_is_information_up_to_the_expected_share():
    from eagle3_zoo.data.readers import drop_level

    assert [logging.getLevelName(drop_level(n, 128)) for n in (0, 21, 32, 33, 128)] == [
        "INFO", "INFO", "INFO", "WARNING", "WARNING"]


def test_every_drop_is_counted_once_in_the_log(tiny, tmp_path, caplog):
    model, tok, adapter = tiny
    data = _data(tmp_path / "chat.jsonl")
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))
    caplog.set_level(logging.INFO, logger="eagle3_zoo")
    recipe = load_recipe(path, ["data.max_length=128", "data.overflow=drop", "data.val_fraction=0.1"])
    prepared = prepare_data(recipe, tok, adapter, target_id="tiny", vocab_size=512)
    # the reader: the blank record, once (not an INFO line and then the same counts as a WARNING)
    (reader,) = _lines(caplog, "read 20 records, kept 19, skipped 1 (")
    assert reader.startswith("data sources:")
    assert _levels(caplog, "data sources:") == ["INFO"]  # 1 of 20: what a slice of real data loses
    # tokenisation: one labelled line for both splits, counting the conversations longer than data.max_length
    (tokenised,) = _lines(caplog, "tokenised")
    assert _levels(caplog, "tokenised") == ["WARNING"]  # 7 of 19: more than a slice should lose
    assert "tokenised 19 conversations" in tokenised and "at data.max_length=128" in tokenised
    assert "dropped 7 (too_long: 7)" in tokenised
    assert f"{len(prepared.train)} train + {len(prepared.val)} validation examples" in tokenised
    assert prepared.token_stats.skipped["too_long"] == 7


def test_regeneration_counts_conversations_whose_prompt_leaves_no_room(tiny, tmp_path, caplog):
    model, tok, adapter = tiny
    data = _data(tmp_path / "chat.jsonl", n_long_answer=0, n_blank=0)
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))
    caplog.set_level(logging.INFO, logger="eagle3_zoo")
    recipe = load_recipe(path, ["data.max_length=128", "data.regenerate.enabled=true",
                                "data.regenerate.max_new_tokens=4", "data.regenerate.batch_size=8"])
    prepared = prepare_data(recipe, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert prepared.regenerate["skipped"] == {"prompt_too_long": 4}
    (line,) = _lines(caplog, "regeneration: dropped")
    assert "dropped 4 of 16 conversations whose first prompt already has data.max_length=128 tokens" in line
    assert "raise data.max_length" in line
    assert _levels(caplog, "regeneration: dropped") == ["INFO"]  # 4 of 16 (the smoke run's share: 21 of 128)


def test_a_validation_split_too_small_to_mean_anything_is_a_warning(tiny, tmp_path, caplog):
    model, tok, adapter = tiny
    data = _data(tmp_path / "chat.jsonl", n_short=40, n_long_prompt=0, n_long_answer=0, n_blank=0)
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))
    caplog.set_level(logging.WARNING, logger="eagle3_zoo")
    prepared = prepare_data(load_recipe(path, ["data.val_fraction=0.05"]), tok, adapter, target_id="tiny",
                            vocab_size=512)
    assert len(prepared.val) == 2
    (warning,) = _lines(caplog, "validation set")
    assert "only 2 examples (data.val_fraction=0.05 of 40 conversations)" in warning and "noise" in warning
    assert "data.val_fraction=0.4" in warning and "data.max_samples" in warning and "split: val" in warning
    caplog.clear()
    prepared = prepare_data(load_recipe(path, ["data.val_fraction=0.4"]), tok, adapter, target_id="tiny",
                            vocab_size=512)
    assert len(prepared.val) == 16 and not _lines(caplog, "validation set")
    caplog.clear()
    caplog.set_level(logging.INFO, logger="eagle3_zoo")
    prepare_data(load_recipe(path, ["data.val_fraction=0.05", "demo=true"]), tok, adapter, target_id="tiny",
                 vocab_size=512)  # the quickstart's smoke slice: information, not a warning it cannot act on
    assert _levels(caplog, "validation set") == ["INFO"]
    assert "validation set: 2 examples (data.val_fraction=0.05 of 40 conversations; a demo run" in \
        _lines(caplog, "validation set")[0]
