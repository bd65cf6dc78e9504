"""`check --target` against a zoo/recipe target works offline (the package ships their configs); an unknown target
is one line at once instead of the Hub client's retries."""

from __future__ import annotations

import time

from eagle3_zoo.checkpoint.check_target import resolve_target_config
from eagle3_zoo.cli import main
from tests.hub_fixtures import canonical_dir


def test_zoo_targets_resolve_offline_from_shipped_configs(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = resolve_target_config("meta-llama/Llama-3.1-8B-Instruct")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4096, 32, 128256)
    embedded = resolve_target_config("smollm2-135m-instruct")  # no GGUF conversion needed for a config
    assert (embedded.hidden_size, embedded.vocab_size) == (576, 49152)


def test_check_against_a_zoo_target_offline_and_an_unknown_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src, _ = canonical_dir(tmp_path)
    assert main(["check", str(src), "--target", "Qwen/Qwen2.5-7B-Instruct"]) == 1  # a tiny drafter does not fit it
    out = capsys.readouterr().out
    assert "HIDDEN_SIZE_MISMATCH" in out or "VOCAB_MISMATCH" in out
    start = time.monotonic()
    assert main(["check", str(src), "--target", "nobody/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 5 and "nobody/no-such-model" in err and len(err.strip().splitlines()) == 1
