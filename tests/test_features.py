"""Offline feature store (shards + manifest, crash-safe resume, verification) and the token-count cache."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3_zoo.data.features import MANIFEST, FeatureReader, FeatureStoreError, FeatureWriter, sha256_file
from eagle3_zoo.data.vocab_cache import (
    fingerprint_sources,
    load_token_counts,
    save_token_counts,
    tokenizer_fingerprint,
    vocab_cache_key,
)

H = 8
META = {"target": "tiny-llama", "aux_layer_ids": [2, 3, 5]}


def sample(i: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic sample i (length varies with i)."""
    g = torch.Generator().manual_seed(i)
    t = 3 + i % 5
    return {"input_ids": torch.randint(0, 100, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.5,
            "aux_hidden": torch.randn(t, 3 * H, generator=g, dtype=dtype),
            "final_hidden": torch.randn(t, H, generator=g, dtype=dtype)}


def write_store(out_dir: Path, n: int, shard_size: int = 4, dtype: str = "float32") -> dict:
    with FeatureWriter(out_dir, shard_size, dtype, META) as w:
        for i in range(n):
            w.add(f"s{i}", **sample(i))
    return json.loads((out_dir / MANIFEST).read_text())


def test_round_trip(tmp_path):
    manifest = write_store(tmp_path, 10, shard_size=4)
    assert [s["file"] for s in manifest["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert [len(s["samples"]) for s in manifest["shards"]] == [4, 4, 2]
    assert manifest["complete"] and manifest["dtype"] == "float32" and manifest["hidden_size"] == H
    assert manifest["aux_layer_ids"] == [2, 3, 5] and manifest["meta"] == META
    for shard in manifest["shards"]:
        assert shard["sha256"] == sha256_file(tmp_path / shard["file"])
    reader = FeatureReader(tmp_path, verify="hash")
    assert len(reader) == 10 and reader.sample_ids == [f"s{i}" for i in range(10)]
    for i in (0, 5, 9, -1):
        got, want = reader[i], sample(i % 10)
        assert set(got) == {"input_ids", "loss_mask", "aux_hidden", "final_hidden"}
        assert got["input_ids"].dtype == torch.int64 and got["loss_mask"].dtype == torch.uint8
        torch.testing.assert_close(got["input_ids"], want["input_ids"], rtol=0, atol=0)
        torch.testing.assert_close(got["loss_mask"], want["loss_mask"].to(torch.uint8), rtol=0, atol=0)
        torch.testing.assert_close(got["aux_hidden"], want["aux_hidden"], rtol=0, atol=0)
    assert reader.index_of("s7") == 7 and reader.token_counts[7] == len(sample(7)["input_ids"])
    assert reader.bytes_per_token == pytest.approx(manifest["num_bytes"] / manifest["num_tokens"])
    assert reader.bytes_per_token > 4 * H * 4  # at least the fp32 hidden states
    with pytest.raises(IndexError):
        reader[10]
    clone = pickle.loads(pickle.dumps(reader))  # DataLoader workers receive a pickled copy
    torch.testing.assert_close(clone[3]["final_hidden"], reader[3]["final_hidden"])


def test_store_dtype_and_per_rank_stores(tmp_path):
    for rank in range(2):
        with FeatureWriter(tmp_path / f"rank-{rank}", 2, "bfloat16", META) as w:
            for i in range(3):
                w.add(f"r{rank}-{i}", **sample(i))
    reader = FeatureReader(tmp_path)
    assert len(reader) == 6 and reader.sample_ids[3] == "r1-0" and reader.dtype == "bfloat16"
    assert reader[4]["aux_hidden"].dtype == torch.bfloat16
    torch.testing.assert_close(reader[4]["aux_hidden"], sample(1)["aux_hidden"].bfloat16(), rtol=0, atol=0)


def test_writer_rejects_bad_samples(tmp_path):
    w = FeatureWriter(tmp_path, 4, "float32", META)
    with pytest.raises(ValueError, match="missing tensors"):
        w.add("a", input_ids=torch.arange(3))
    with pytest.raises(ValueError, match="leading length"):
        w.add("a", input_ids=torch.arange(3), loss_mask=torch.ones(4))
    w.add("a", **sample(0))
    with pytest.raises(ValueError, match="added twice"):
        w.add("a", **sample(0))
    with pytest.raises(ValueError, match="trailing shapes"):
        w.add("b", **{**sample(1), "final_hidden": torch.zeros(len(sample(1)["input_ids"]), H + 1)})
    with pytest.raises(FeatureStoreError, match="another FeatureWriter"):
        FeatureWriter(tmp_path, 4, "float32", META)
    w.close()
    with pytest.raises(FeatureStoreError, match="existing store has dtype='float32'"):
        FeatureWriter(tmp_path, 4, "bfloat16", META)


CHILD = """
import sys, time, torch
sys.path.insert(0, {test_dir!r})
from test_features import META, sample
from eagle3_zoo.data.features import FeatureWriter
with FeatureWriter({out!r}, 4, "float32", META) as w:
    for i in range({n}):
        w.add(f"s{{i}}", **sample(i))
        time.sleep(0.05)
"""


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    n = 30
    reference = write_store(tmp_path / "ref", n)
    out = tmp_path / "killed"
    script = CHILD.format(test_dir=str(Path(__file__).parent), out=str(out), n=n)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        manifest_path = out / MANIFEST
        if manifest_path.exists() and len(json.loads(manifest_path.read_text())["shards"]) >= 2:
            break
        time.sleep(0.01)
    assert child.poll() is None, child.stderr.read().decode()
    time.sleep(0.1)  # land the kill mid-shard
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    child.stderr.close()
    partial = json.loads((out / MANIFEST).read_text())
    assert not partial["complete"] and 2 <= len(partial["shards"]) < len(reference["shards"])
    (out / ".shard-00007.safetensors.tmp-999").write_bytes(b"half a shard")  # what a kill mid-write leaves
    (out / "shard-00099.safetensors").write_bytes(b"renamed but not in the manifest")

    with FeatureWriter(out, 4, "float32", META) as w:
        added = [w.add(f"s{i}", **sample(i)) for i in range(n)]
    assert added.count(False) == partial["num_samples"]  # stored samples are skipped, not rewritten
    resumed = json.loads((out / MANIFEST).read_text())
    assert resumed == reference
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".lock", MANIFEST] + [s["file"] for s in reference["shards"]])
    FeatureReader(out, verify="hash")


def test_corrupt_missing_and_incomplete_shards(tmp_path):
    manifest = write_store(tmp_path, 9)
    shard = tmp_path / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    FeatureReader(tmp_path, verify="size")
    with pytest.raises(FeatureStoreError, match=r"shard-00001.safetensors: sha256 .* \(corrupt shard\)"):
        FeatureReader(tmp_path, verify="hash")
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(FeatureStoreError, match=r"shard-00001.safetensors: size \d+ bytes, manifest says"):
        FeatureReader(tmp_path)
    shard.unlink()
    with pytest.raises(FeatureStoreError, match="shard-00001.safetensors: shard listed in the manifest is missing"):
        FeatureReader(tmp_path, verify="none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatureStoreError, match="no manifest.json"):
        FeatureReader(tmp_path / "empty")

    inc = tmp_path / "inc"
    w = FeatureWriter(inc, 2, "float32", META)
    for i in range(5):
        w.add(i, **sample(i))
    w._release()  # the writer dies without close(): two complete shards, one sample lost
    with pytest.raises(FeatureStoreError, match="incomplete store .*4 samples in 2 shards"):
        FeatureReader(inc)
    assert len(FeatureReader(inc, allow_incomplete=True)) == 4


def test_exception_inside_writer_keeps_shard_boundaries(tmp_path):
    with pytest.raises(RuntimeError), FeatureWriter(tmp_path, 4, "float32", META) as w:
        for i in range(6):
            w.add(f"s{i}", **sample(i))
        raise RuntimeError("target forward failed")
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [len(s["samples"]) for s in manifest["shards"]] == [4] and not manifest["complete"]


# ----------------------------------------------------------------------------------------- vocab cache
def test_vocab_cache_key_and_round_trip(tmp_path, caplog):
    key = vocab_cache_key("data", "tok", 32000)
    assert len(key) == 64 and key == vocab_cache_key("data", "tok", 32000)
    assert len({key, vocab_cache_key("data2", "tok", 32000), vocab_cache_key("data", "tok2", 32000),
                vocab_cache_key("data", "tok", 16000)}) == 4
    assert load_token_counts(tmp_path, key) is None
    counts = torch.tensor([0, 5, 2, 9], dtype=torch.int32)
    path = save_token_counts(tmp_path, key, counts, meta={"vocab_size": 4})
    loaded = load_token_counts(tmp_path, key)
    assert loaded.dtype == torch.int64 and loaded.tolist() == [0, 5, 2, 9]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # atomic: no temp file left
    path.write_bytes(b"garbage")
    assert load_token_counts(tmp_path, key) is None and "unreadable token-count cache" in caplog.text
    with pytest.raises(ValueError, match="1-D integer"):
        save_token_counts(tmp_path, key, torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        save_token_counts(tmp_path, key, torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="plain token"):
        load_token_counts(tmp_path, "../escape")


def test_fingerprint_sources(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": []}\n')
    base = fingerprint_sources([{"path": str(f)}])
    assert base == fingerprint_sources([{"path": str(f), "format": "auto"}])
    assert base != fingerprint_sources([{"path": str(f), "max_samples": 10}])
    assert base != fingerprint_sources([{"path": str(f)}], extra={"max_length": 512})
    f.write_text('{"messages": [1]}\n')  # size changes
    assert base != fingerprint_sources([{"path": str(f)}])
    again = fingerprint_sources([{"path": str(f)}])
    f.write_text('{"messages": [2]}\n')  # same size, other content
    os.utime(f, ns=(1, 1))
    edited = fingerprint_sources([{"path": str(f)}])
    assert edited != again
    os.utime(f, ns=(2, 2))  # touched (or reinstalled): same content, same fingerprint
    assert fingerprint_sources([{"path": str(f)}]) == edited
    assert len(fingerprint_sources([{"path": "sharegpt-embedded"}])) == 64


def test_fingerprint_and_ids_survive_moving_the_data(tmp_path, monkeypatch):
    """The same data under another root (a moved checkout, a reinstalled package) keeps every cache key."""
    from eagle3_zoo.data import readers
    from eagle3_zoo.data.readers import read_sources

    for root in ("a", "b"):
        (tmp_path / root / "data" / "sub").mkdir(parents=True)
        (tmp_path / root / "data" / "sub" / "x.jsonl").write_text(
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n' * 2)
    keys = []
    for root in ("a", "b"):
        monkeypatch.chdir(tmp_path / root)
        convs, _ = read_sources([{"path": "data"}])
        keys.append((fingerprint_sources([{"path": "data"}]), [c.uid for c in convs]))
    assert keys[0] == keys[1] and keys[0][1] == ["data/sub/x.jsonl#0", "data/sub/x.jsonl#1"]
    # the embedded file, reinstalled elsewhere (new path, new mtime)
    copy = tmp_path / "b" / "share.json"
    copy.write_text('[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]')
    monkeypatch.setattr(readers, "sharegpt_path", lambda: copy)
    first = (fingerprint_sources([{"path": "sharegpt-embedded"}]), [c.uid for c in read_sources(
        [{"path": "sharegpt-embedded"}])[0]])
    moved = tmp_path / "a" / "elsewhere.json"
    moved.write_bytes(copy.read_bytes())
    monkeypatch.setattr(readers, "sharegpt_path", lambda: moved)
    assert first == (fingerprint_sources([{"path": "sharegpt-embedded"}]), [c.uid for c in read_sources(
        [{"path": "sharegpt-embedded"}])[0]])
    assert first[1] == ["sharegpt-embedded#0"]


class _FakeTokenizer:
    def __init__(self, vocab, template, name="x"):
        self.vocab, self.chat_template, self.name_or_path = vocab, template, name
        self.special_tokens_map = {"eos_token": "</s>"}

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint():
    a = tokenizer_fingerprint(_FakeTokenizer({"a": 0, "b": 1}, "{{ x }}", name="/path/one"))
    assert a == tokenizer_fingerprint(_FakeTokenizer({"b": 1, "a": 0}, "{{ x }}", name="/path/two"))
    assert a != tokenizer_fingerprint(_FakeTokenizer({"a": 0, "b": 2}, "{{ x }}"))
    assert a != tokenizer_fingerprint(_FakeTokenizer({"a": 0, "b": 1}, "{{ y }}"))


def test_tokenizer_fingerprint_fast_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    def make(vocab, template):
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
        tok.chat_template = template
        return tok

    vocab = {"<unk>": 0, "hi": 1, "there": 2}
    a = tokenizer_fingerprint(make(vocab, "t1"))
    assert a == tokenizer_fingerprint(make(vocab, "t1"))
    assert a != tokenizer_fingerprint(make(vocab, "t2"))
    assert a != tokenizer_fingerprint(make({**vocab, "you": 3}, "t1"))


@pytest.mark.parametrize("damage", ["truncated", "missing", "corrupt"])
def test_reopening_drops_damaged_shards_and_rewriting_refills_their_slots(tmp_path, damage):
    reference = write_store(tmp_path / "ref", 14)  # shards of 4, 4, 4, 2
    out = tmp_path / "store"
    write_store(out, 14)
    for index in (1, 3):  # a full shard and the last, partial one
        shard = out / f"shard-0000{index}.safetensors"
        if damage == "truncated":
            shard.write_bytes(shard.read_bytes()[:-50])
        elif damage == "missing":
            shard.unlink()
        else:
            data = bytearray(shard.read_bytes())
            data[-3] ^= 0xFF
            shard.write_bytes(bytes(data))
    options = {"verify": "hash"} if damage == "corrupt" else {}  # size (the default) cannot see a flipped byte
    with FeatureWriter(out, 4, "float32", META, **options) as w:
        on_disk = json.loads((out / MANIFEST).read_text())  # dropped at once: a crash from here resumes the repair
        added = [w.add(f"s{i}", **sample(i)) for i in range(14)]
    assert [i for i, a in enumerate(added) if a] == [4, 5, 6, 7, 12, 13]  # only the damaged shards' samples
    assert json.loads((out / MANIFEST).read_text()) == reference
    files = [s["file"] for s in reference["shards"]]
    assert sorted(p.name for p in out.iterdir()) == sorted([".lock", MANIFEST, *files])
    FeatureReader(out, verify="hash")
    assert [s["file"] for s in w.damaged] == ["shard-00001.safetensors", "shard-00003.safetensors"]
    assert not on_disk["complete"] and [s["file"] for s in on_disk["shards"]] == ["shard-00000.safetensors",
                                                                                  "shard-00002.safetensors"]


def test_reader_says_how_to_redo_a_damaged_shard(tmp_path):
    manifest = write_store(tmp_path, 9)
    shard = tmp_path / manifest["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FeatureStoreError, match=r"\(truncated or replaced\); rerun `eagle3-zoo prepare` with the same "
                                                r"recipe to extract the damaged shards again"):
        FeatureReader(tmp_path)
