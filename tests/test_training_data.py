"""Data glue of training: batching/resume, collation, tokenisation stats, regeneration, the offline feature job."""

from __future__ import annotations

import json

import pytest
import torch
from training_fixtures import tiny_llama_target

from eagle3_zoo.data.cache_keys import KEY_VERSIONS
from eagle3_zoo.data.datamodule import (
    ExampleDataset,
    LengthBucketBatchSampler,
    ResumableDataLoader,
    collate_right_padded,
)
from eagle3_zoo.data.readers import Conversation, DataError, read_conversations
from eagle3_zoo.data.tokenize import supervised_token_counts, tokenize_conversations

LENGTHS = [int(x) for x in torch.randint(5, 60, (41,), generator=torch.Generator().manual_seed(3))]


def test_sampler_is_deterministic_complete_and_shuffled_per_epoch():
    s = LengthBucketBatchSampler(LENGTHS, 4, seed=7, bucket_batches=3)
    e0 = list(s)
    assert e0 == list(LengthBucketBatchSampler(LENGTHS, 4, seed=7, bucket_batches=3))
    assert len(e0) == len(s) == 10 and all(len(b) == 4 for b in e0)
    assert len({i for b in e0 for i in b}) == 40  # no duplicates; one example dropped (drop_last)
    s.set_epoch(1)
    assert list(s) != e0
    assert list(LengthBucketBatchSampler(LENGTHS, 4, seed=8, bucket_batches=3)) != e0


def test_sampler_buckets_by_length():
    def padding(batches):
        return sum(max(LENGTHS[i] for i in b) * len(b) - sum(LENGTHS[i] for i in b) for b in batches)

    bucketed = list(LengthBucketBatchSampler(LENGTHS, 4, seed=0, bucket_batches=10))
    unsorted = list(LengthBucketBatchSampler(LENGTHS, 4, seed=0, bucket_batches=1))
    assert padding(bucketed) < padding(unsorted) / 2


def test_ranks_split_the_same_global_batches_as_one_process():
    one = list(LengthBucketBatchSampler(LENGTHS, 4, seed=1, num_replicas=1))
    ranks = [list(LengthBucketBatchSampler(LENGTHS, 2, seed=1, num_replicas=2, rank=r)) for r in (0, 1)]
    assert [a + b for a, b in zip(*ranks)] == one
    val = [list(LengthBucketBatchSampler(LENGTHS, 4, shuffle=False, drop_last=False, num_replicas=2, rank=r))
           for r in (0, 1)]
    assert len(val[0]) == len(val[1]) == 6 and {i for v in val for b in v for i in b} == set(range(41))


def test_loader_resumes_mid_epoch_exactly():
    examples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long)} for n in LENGTHS]
    ds = ExampleDataset(examples)

    def loader():
        return ResumableDataLoader(ds, LengthBucketBatchSampler(ds.lengths, 3, seed=5), collate_fn=collate_right_padded)

    first = loader()
    it = iter(first)
    seen = [next(it)["input_ids"] for _ in range(4)]
    state = first.state_dict()
    assert state == {"epoch": 0, "consumed": 4, "seed": 5}
    rest = [b["input_ids"] for b in it]
    resumed = loader()
    resumed.load_state_dict(state)
    again = [b["input_ids"] for b in resumed]
    assert len(seen) + len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(rest, again))
    assert resumed.state_dict()["epoch"] == 0
    twice = loader()  # resume, take two more batches, checkpoint again, resume again
    twice.load_state_dict(state)
    it = iter(twice)
    more = [next(it)["input_ids"] for _ in range(2)]
    assert twice.state_dict()["consumed"] == 6
    third = loader()
    third.load_state_dict(twice.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(more + [b["input_ids"] for b in third], again))
    with pytest.raises(ValueError, match="same data.seed"):
        loader().load_state_dict({**state, "seed": 6})


def test_collate_pads_right_and_masks_pads():
    batch = collate_right_padded([
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1]), "aux_hidden": torch.ones(3, 2)},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1]), "aux_hidden": torch.ones(1, 2)},
    ], pad_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["aux_hidden"][1, 1:].abs().sum() == 0


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_target()


def _conv(i, messages, source="data.jsonl"):
    return Conversation(id=f"c{i}", source=source, index=i, messages=messages)


def _chat(q, a):
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def test_tokenize_counts_every_skip_reason(tiny):
    _, tok, adapter = tiny
    convs = [_conv(0, _chat("Hello, how are you today?", "The capital of France is Paris.")),
             _conv(1, _chat("Thanks!", "   ")),  # empty reply: nothing supervised
             _conv(2, _chat("Say goodbye in French. " * 40, "Au revoir!"))]
    n0 = tokenize_conversations(convs[:1], tok, adapter, max_length=1000)[0][0]["input_ids"].numel()
    limit = n0 + 5
    examples, stats = tokenize_conversations(convs, tok, adapter, max_length=limit, overflow="drop", on_error="skip")
    assert [e["id"] for e in examples] == [convs[0].uid]
    assert dict(stats.skipped) == {"no_supervised_tokens": 1, "too_long": 1} and stats.kept == 1
    _, stats = tokenize_conversations(convs[:1], tok, adapter, max_length=2)
    assert dict(stats.skipped) == {"too_short": 1}
    examples, stats = tokenize_conversations(convs[2:], tok, adapter, max_length=limit)
    assert stats.truncated == 1 and examples == [] and dict(stats.skipped) == {"no_supervised_tokens": 1}
    bad = [_conv(7, [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}])]
    with pytest.raises(DataError, match=r"data.jsonl: record 7: cannot build"):
        tokenize_conversations(bad, tok, adapter, max_length=limit)
    kept = tokenize_conversations(convs[:1], tok, adapter, max_length=limit)[0]
    counts = supervised_token_counts(kept, 512)
    assert counts.sum() == kept[0]["loss_mask"].sum() > 0
    assert counts[kept[0]["input_ids"][kept[0]["loss_mask"].bool()]].min() > 0


def test_regeneration_batched_equals_single_and_resumes(tiny, tmp_path):
    from eagle3_zoo.data.regenerate import regenerate_conversations

    model, tok, adapter = tiny
    convs = [_conv(i, [{"role": "user", "content": q}, {"role": "assistant", "content": "old"},
                       {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "old"}])
             for i, q in enumerate(["Hello", "What is the capital of France? Explain in one sentence.", "Thanks!"])]
    kw = dict(max_new_tokens=6, temperature=0.0)
    single, _ = regenerate_conversations(convs, model, tok, adapter, tmp_path / "one.jsonl", batch_size=1, **kw)
    batched, stats = regenerate_conversations(convs, model, tok, adapter, tmp_path / "b.jsonl", batch_size=3, **kw)
    assert [c.messages for c in single] == [c.messages for c in batched]
    assert [c.uid for c in batched] == [c.uid for c in convs]  # input order, although batched by prompt length
    assert stats.generated == 3 and stats.turns == 6
    first, fstats = regenerate_conversations(convs, model, tok, adapter, tmp_path / "first.jsonl", batch_size=3,
                                             max_turns=1, **kw)
    assert fstats.turns == 3
    assert [c.messages for c in first] == [c.messages[:2] for c in batched]  # same first answer, rest dropped
    assert all(m["content"] != "old" for c in batched for m in c.messages if m["role"] == "assistant")
    # a killed run: two complete lines and a torn third one
    lines = (tmp_path / "b.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "r.jsonl").write_text(lines[0] + lines[1] + lines[2][:17])
    resumed, stats = regenerate_conversations(convs, model, tok, adapter, tmp_path / "r.jsonl", batch_size=3, **kw)
    assert stats.reused == 2 and stats.generated == 1
    assert [c.messages for c in resumed] == [c.messages for c in batched]
    assert (tmp_path / "r.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    reread, rstats = read_conversations(tmp_path / "r.jsonl")
    # the file holds batches in prompt-length order; the records are the same
    assert sorted(json.dumps(c.messages) for c in reread) == sorted(json.dumps(c.messages) for c in batched)
    assert rstats.kept == 3


def test_feature_job_resumes_to_the_same_store(tiny, tmp_path):
    from eagle3_zoo.data.feature_job import write_features
    from eagle3_zoo.data.features import FeatureReader

    model, tok, adapter = tiny
    g = torch.Generator().manual_seed(0)
    examples = [{"id": f"s{i}", "input_ids": torch.randint(512, (int(n),), generator=g),
                 "loss_mask": torch.ones(int(n), dtype=torch.long)} for i, n in enumerate(torch.randint(4, 30, (11,)))]
    kw = dict(aux_layer_ids=(1, 2, 3), batch_size=2, shard_size=3, dtype="float32", meta={"k": 1})
    whole = write_features(examples, model, adapter, tmp_path / "whole", **kw)

    calls = {"n": 0}
    real = adapter.forward_features

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # like a kill between two batches
        return real(*args, **kwargs)

    adapter.forward_features = crashing
    try:
        with pytest.raises(KeyboardInterrupt):
            write_features(examples, model, adapter, tmp_path / "resumed", **kw)
    finally:
        del adapter.forward_features

    def manifests(d):
        return {p.parent.name: json.loads(p.read_text()) for p in sorted(d.glob("part-*/manifest.json"))}

    partial = manifests(tmp_path / "resumed")
    # one batch per part (shard_size // batch_size): parts 0-2 done, the fourth not written
    assert sorted(partial) == ["part-00000", "part-00001", "part-00002"]
    assert all(m["complete"] and len(m["shards"]) == 1 for m in partial.values())
    write_features(examples, model, adapter, tmp_path / "resumed", **kw)
    assert manifests(whole) == manifests(tmp_path / "resumed") and len(manifests(whole)) == 6
    assert (whole / "manifest.json").read_bytes() == (tmp_path / "resumed" / "manifest.json").read_bytes()
    reader = FeatureReader(tmp_path / "resumed", verify="hash")
    assert sorted(reader.sample_ids) == sorted(e["id"] for e in examples)
    sample = reader[reader.index_of("s3")]
    assert torch.equal(sample["input_ids"], examples[3]["input_ids"])
    assert sample["aux_hidden"].shape == (examples[3]["input_ids"].numel(), 3 * 64)


def test_prepare_data_regenerates_caches_and_counts(tiny, tmp_path, monkeypatch):
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.data.prepare import prepare_data
    from eagle3_zoo.recipe.sections import load_recipe

    model, tok, adapter = tiny
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=6)
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))  # target dir unused here
    recipe = load_recipe(path, ["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=5",
                                "data.regenerate.batch_size=4", "data.val_fraction=0.34"])
    first = prepare_data(recipe, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert first.regenerate["generated"] == 6 and first.regenerate["turns"] == 6
    assert (len(first.train), len(first.val)) == (4, 2)
    assert int(first.counts.sum()) == sum(int(e["loss_mask"].sum()) for e in first.train)
    again = prepare_data(recipe, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert again.regenerate["reused"] == 6 and again.regenerate["generated"] == 0
    # what the data holds is counted on a rerun too (it used to read "generated: 0, turns: 0" from a cache)
    assert again.regenerate["conversations"] == first.regenerate["conversations"] == 6
    assert again.regenerate["answer_turns"] == first.regenerate["answer_turns"] == first.regenerate["turns"]
    assert [e["id"] for e in again.train] == [e["id"] for e in first.train]
    # the held-out conversations behind the val examples, with the target's answers, fresh and from the cache
    for prepared in (first, again):
        assert [c.uid for c in prepared.val_conversations] == [e["id"] for e in first.val]
    originals = {c["conversations"][1]["value"] for c in (json.loads(line) for line in open(data))}
    assert all(c.messages[-1]["role"] == "assistant" and c.messages[-1]["content"] not in originals
               for c in again.val_conversations)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again.train, first.train))
    assert (tmp_path / "cache" / "tokens").is_dir() and (tmp_path / "cache" / "token_counts").is_dir()
    plain = prepare_data(load_recipe(path), tok, adapter, target_id="tiny", vocab_size=512)
    assert plain.fingerprint != first.fingerprint  # regeneration settings are part of the data key
    from eagle3_zoo.data import prepare

    monkeypatch.setitem(KEY_VERSIONS, "token_stream", KEY_VERSIONS["token_stream"] + 1)  # new reading/tokenising rules
    assert prepare.data_fingerprint(recipe.data, tok, "tiny", "answers") != first.fingerprint


def test_token_stream_key_follows_the_regenerated_answers_not_their_file(tiny, tmp_path):
    """Regenerated answers moved to another file (or produced with another batch size) keep the token/feature
    caches; an answer that changed in the file does not reuse the stale cache."""
    import shutil

    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.data.prepare import prepare_data, regenerated_path
    from eagle3_zoo.recipe.sections import load_recipe

    model, tok, adapter = tiny
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=4)
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))
    regen = ["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=5", "data.regenerate.batch_size=4"]
    first = prepare_data(load_recipe(path, regen), tok, adapter, target=model, target_id="tiny", vocab_size=512)
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(regenerated_path(load_recipe(path, regen).data, tok, "tiny"), moved)
    elsewhere = load_recipe(path, [*regen, f"data.regenerate.output={moved}", "data.regenerate.batch_size=2"])
    again = prepare_data(elsewhere, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert again.regenerate["reused"] == 4 and again.fingerprint == first.fingerprint
    records = [json.loads(line) for line in moved.read_text().splitlines()]
    assert "edited answer" not in json.dumps(records)
    records[0]["messages"][-1]["content"] = "edited answer"
    moved.write_text("".join(json.dumps(r) + "\n" for r in records))
    edited = prepare_data(elsewhere, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert edited.regenerate["reused"] == 4 and edited.fingerprint != first.fingerprint
    assert any("edited answer" in tok.decode(e["input_ids"]) for e in edited.train + edited.val)


def test_regenerated_conversations_keep_their_location_free_key(tiny, tmp_path):
    """The same records read from another place (another checkout or virtual environment: same `source_key`, other
    `source` path) give the same regenerated conversations, uids and answers digest, so the token-stream and feature
    caches keyed by that digest are reused instead of being built again."""
    from dataclasses import replace

    from eagle3_zoo.data.prepare import answers_digest
    from eagle3_zoo.data.regenerate import regenerate_conversations

    model, tok, adapter = tiny
    here = [replace(_conv(i, [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}]),
                    source="/checkout-a/.venv/data.json", source_key="sharegpt-embedded")
            for i, q in enumerate(["Hello", "Name a colour."])]
    moved = [replace(c, source="/checkout-b/.venv/data.json") for c in here]
    kw = dict(max_new_tokens=4, temperature=0.0, batch_size=2)
    a, _ = regenerate_conversations(here, model, tok, adapter, tmp_path / "answers.jsonl", **kw)
    b, stats = regenerate_conversations(moved, model, tok, adapter, tmp_path / "answers.jsonl", **kw)
    assert stats.reused == 2 and stats.generated == 0
    assert [c.uid for c in a] == [c.uid for c in b] == ["sharegpt-embedded#0", "sharegpt-embedded#1"]
    assert answers_digest(a) == answers_digest(b)


def test_regenerated_answers_are_shared_by_every_selection_of_the_records(tiny, tmp_path):
    """Growing max_samples (or another split / batch size) reuses the answers already generated; another
    generation setting, target or source file does not."""
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.data.prepare import prepare_data, regenerated_path
    from eagle3_zoo.recipe.sections import load_recipe

    model, tok, adapter = tiny
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=6)
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data))
    regen = ["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=5", "data.regenerate.batch_size=4"]
    small = load_recipe(path, [*regen, "data.max_samples=4"])
    first = prepare_data(small, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert (first.regenerate["generated"], first.regenerate["reused"]) == (4, 0)
    grown = load_recipe(path, [*regen, "data.max_samples=6", "data.val_fraction=0.5", "data.regenerate.batch_size=2"])
    assert regenerated_path(grown.data, tok, "tiny") == regenerated_path(small.data, tok, "tiny")
    second = prepare_data(grown, tok, adapter, target=model, target_id="tiny", vocab_size=512)
    assert (second.regenerate["generated"], second.regenerate["reused"]) == (2, 4)
    assert second.fingerprint != first.fingerprint  # the token stream differs, so the token caches do too
    lines = regenerated_path(grown.data, tok, "tiny").read_text().splitlines()
    assert len(lines) == 6 and len({json.loads(line)["id"] for line in lines}) == 6  # 4 kept as they were + 2 new
    for change in ("data.regenerate.max_new_tokens=6", "data.max_length=100", "data.regenerate.max_turns=1",
                   "data.regenerate.temperature=0.7"):
        assert regenerated_path(load_recipe(path, [*regen, change]).data, tok, "tiny") != regenerated_path(
            small.data, tok, "tiny"), change
    assert regenerated_path(small.data, tok, "other") != regenerated_path(small.data, tok, "tiny")
    before = regenerated_path(small.data, tok, "tiny")
    with open(data, "a") as f:
        f.write(open(data).readline())  # an edited source file
    assert regenerated_path(small.data, tok, "tiny") != before


def test_reading_rules_version_keys_the_token_stream_not_the_regenerated_answers(tiny, tmp_path, monkeypatch):
    """A change to which conversations are read (the "token_stream" key version) must not throw away the answers already
    generated (hours of target time), which are keyed per conversation; a change to how an answer is produced
    (the "regeneration" key version) must."""
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.data import prepare
    from eagle3_zoo.recipe.sections import load_recipe

    _, tok, _ = tiny
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=4)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, data)),
                         ["data.regenerate.enabled=true"])
    tokens = prepare.data_fingerprint(recipe.data, tok, "tiny", "digest")
    answers = prepare.regeneration_key(recipe.data, tok, "tiny")
    monkeypatch.setitem(KEY_VERSIONS, "token_stream", KEY_VERSIONS["token_stream"] + 1)
    assert prepare.data_fingerprint(recipe.data, tok, "tiny", "digest") != tokens
    assert prepare.regeneration_key(recipe.data, tok, "tiny") == answers
    monkeypatch.setitem(KEY_VERSIONS, "regeneration", KEY_VERSIONS["regeneration"] + 1)
    assert prepare.regeneration_key(recipe.data, tok, "tiny") != answers


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_definitions_reach_tokenisation_regeneration_and_the_answers_key(tiny, tmp_path, monkeypatch):
    from eagle3_zoo.data import regenerate
    from eagle3_zoo.data.prepare import answers_digest

    model, tok, adapter = tiny
    messages = _chat("What is the capital of France?", "The capital of France is Paris.")
    plain, tooled = _conv(0, messages), Conversation(id="c0", source="data.jsonl", index=0, messages=messages,
                                                     tools=TOOLS)
    (with_tools,), _ = tokenize_conversations([tooled], tok, adapter, max_length=1000)
    (without,), _ = tokenize_conversations([plain], tok, adapter, max_length=1000)
    assert with_tools["input_ids"].tolist() == tok.apply_chat_template(messages, tools=TOOLS)["input_ids"]
    assert with_tools["input_ids"].numel() > without["input_ids"].numel()
    assert with_tools["loss_mask"].sum() == without["loss_mask"].sum() > 0  # the definitions are prompt
    assert answers_digest([tooled]) != answers_digest([plain])
    prompts = []
    monkeypatch.setattr(regenerate, "generate_replies", lambda model, p, **kw: prompts.extend(p) or [[]] * len(p))
    regenerate.regenerate_conversations([tooled], model, tok, adapter, tmp_path / "r.jsonl", max_new_tokens=2)
    assert "Current weather of a city." in tok.decode(prompts[0])
