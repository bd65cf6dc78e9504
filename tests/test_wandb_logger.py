"""`trainer.logger: [wandb]` (Weights & Biases, offline here): the metrics of the TensorBoard log under the same names,
the recipe as its config with the run's secrets redacted, and a one-line refusal naming the extra to install when
wandb is missing."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.cli import main

pytest.importorskip("wandb")

KEY = "sk-wandb-test-key-0123456789"


def _wandb_records(path):
    """The records of an offline run's `run-<id>.wandb` file (wandb 0.31 ships no reader of it): a 7-byte header
    (`:W&B`, magic, version), then LevelDB-log blocks of 32 KiB holding `Record` protobufs, each cut into chunks with
    a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at the end of a block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _tensorboard_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run_dir.glob("logs/version_0/tensorboard/events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def test_wandb_offline_logs_the_tensorboard_metric_names_and_a_redacted_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("E3Z_ENGINE_KEY", KEY)
    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "c.jsonl", n=8)
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(tmp_path, target, data, output_dir=str(run_dir), trainer={
        "max_steps": 3, "checkpoint_every_n_steps": 3, "val_check_interval": 2, "logger": ["tensorboard", "wandb"]})
    recipe["engine"] = {"api_key_env": "E3Z_ENGINE_KEY", "hidden_states_dir": str(tmp_path / "hidden_states")}
    path = write_recipe(tmp_path / "r.yaml", recipe)
    args = ["fit", str(path), f"engine.extra_args=[--api-key,{KEY}]"]
    monkeypatch.setattr(sys, "argv", ["eagle3-zoo", *args])
    assert main(args) == 0

    (run,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")
    records = list(_wandb_records(next(run.glob("run-*.wandb"))))
    logged = {item.key or "/".join(item.nested_key) for r in records if r.HasField("history")
              for item in r.history.item}
    logged -= {"_step", "_runtime", "_timestamp", "trainer/global_step"}  # wandb's own, and Lightning's step axis
    tags = _tensorboard_tags(run_dir)
    assert any(t.startswith("train/acc_") for t in tags) and any(t.startswith("val/") for t in tags)
    assert logged == tags
    (config,) = [{item.key: json.loads(item.value_json) for item in r.config.update} for r in records
                 if r.HasField("config")]
    assert config["engine"]["extra_args"] == ["--api-key", "***"]  # the recipe as hparams.yaml holds it
    assert config["trainer"]["logger"] == ["tensorboard", "wandb"]
    assert not [p for p in run.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]


def test_wandb_missing_is_refused_before_any_work_naming_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    from eagle3_zoo.training.fit import fit_main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    (tmp_path / "empty").mkdir()  # no target in it: refused before it is loaded
    recipe = tiny_recipe(tmp_path, tmp_path / "empty", write_chat_jsonl(tmp_path / "c.jsonl", n=8),
                         trainer={"logger": ["csv", "wandb"]})
    with pytest.raises(ImportError, match=r"trainer.logger lists 'wandb' .* pip install 'eagle3-zoo\[wandb\]'"):
        fit_main(write_recipe(tmp_path / "r.yaml", recipe))
    assert not (tmp_path / "run" / "logs").exists()


def test_the_wandb_key_is_redacted_like_every_other_secret(monkeypatch):
    from eagle3_zoo.util.redaction import redact

    key = "0123456789abcdef-wandb-only"  # registered nowhere else in this process
    monkeypatch.setenv("WANDB_API_KEY", key)
    assert redact(f"wandb login {key}") == "wandb login ***"
