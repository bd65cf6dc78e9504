"""publish / pull run for real against a loopback Hub (tests/hub_server.py): huggingface_hub's own HTTP client code
creates the repo, uploads in one commit and downloads with snapshot_download. No network beyond 127.0.0.1."""

from __future__ import annotations

import logging

import pytest
import torch
from huggingface_hub import HfApi

from eagle3_zoo.hub import DrafterCheckError, TokenLeakError, import_drafter, load_any_drafter, publish, pull
from eagle3_zoo.hub.cli_commands import main as cli
from tests.hub_fixtures import canonical_dir, edit_weights, official_dir, tiny_target_config
from tests.hub_server import LoopbackHub

SECRET = "hf_LoopbackTestToken0123456789abcdef"  # a fake token; must never reach a file or a log


@pytest.fixture
def hub(monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    caplog.set_level(logging.DEBUG)
    with LoopbackHub() as server:
        yield server


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text


def _drafter_with_extras(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    (src / "recipe.yaml").write_text("target:\n  name_or_path: tiny-org/tiny-llama\n")
    (src / "provenance.json").write_text('{"git_sha": "abc", "hardware": "2 CPU cores"}')
    (src / "eval_results.json").write_text('{"_note": "test data", "benchmarks": {"mtbench": {"tau": 2.5}}}')
    (src / "eval_results.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return src, drafter


@pytest.mark.parametrize("upload_path", ["xet-pipeline", "legacy-commit"])
def test_publish_then_pull_is_byte_identical(tmp_path, hub, monkeypatch, caplog, capsys, upload_path):
    if upload_path == "legacy-commit":  # the code path of installs without hf_xet: create_commit
        monkeypatch.setattr("huggingface_hub.hf_api.is_xet_available", lambda: False)
    src, drafter = _drafter_with_extras(tmp_path)
    result = publish(src, "me/tiny-eagle3", endpoint=hub.url, stage_dir=tmp_path / "stage")
    assert result.commit_url.startswith(hub.url) and not result.dry_run
    assert result.files == ["README.md", "config.json", "eval_results.json", "eval_results.png",
                            "model.safetensors", "provenance.json", "recipe.yaml"]
    repo = hub.repos["me/tiny-eagle3"]
    assert len(repo.branches["main"]) == 2  # the initial commit + exactly one upload commit
    writes = [r for r in hub.requests if r["method"] == "POST"]
    assert writes and all(r["auth"] for r in writes)  # the token was used...
    # create_commit validates README.md's YAML once more than the pipeline does: both client paths really ran
    assert sum(r["path"] == "/api/validate-yaml" for r in writes) == (2 if upload_path == "legacy-commit" else 1)

    pulled = pull("me/tiny-eagle3", endpoint=hub.url, out_dir=tmp_path / "pulled")
    assert pulled.format == "sglang" and pulled.report.ok
    for name in result.files:
        assert (pulled.path / name).read_bytes() == (tmp_path / "stage" / name).read_bytes(), name
        _no_secret((pulled.path / name).read_bytes().decode("latin-1"))  # ...but never written anywhere
    assert torch.equal(import_drafter(pulled.path).lm_head.weight, drafter.lm_head.weight)
    out = capsys.readouterr()
    _no_secret(caplog.text, out.out, out.err)


def test_dry_run_makes_no_request(tmp_path, hub, capsys):
    src, _ = _drafter_with_extras(tmp_path)
    result = publish(src, "me/tiny-eagle3", dry_run=True, endpoint=hub.url, stage_dir=tmp_path / "stage")
    assert result.dry_run and result.commit_url is None
    assert (tmp_path / "stage" / "README.md").is_file() and (tmp_path / "stage" / "model.safetensors").is_file()
    assert cli(["publish", str(src), "--repo-id", "me/other", "--dry-run", "--endpoint", hub.url,
                "--stage-dir", str(tmp_path / "stage2"), "--format", "speculators"]) == 0
    assert "no request made" in capsys.readouterr().out
    assert hub.requests == []


def test_broken_drafter_and_token_leak_are_refused_before_any_request(tmp_path, hub):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s.pop("d2t"))
    with pytest.raises(DrafterCheckError, match="D2T_MISSING"):
        publish(src, "me/broken", endpoint=hub.url)
    leaky, _ = canonical_dir(tmp_path, name="leaky")
    (leaky / "recipe.yaml").write_text(f"hub_token: {SECRET}\n")
    with pytest.raises(TokenLeakError, match="recipe.yaml"):
        publish(leaky, "me/leaky", endpoint=hub.url, stage_dir=tmp_path / "stage")
    assert hub.requests == []


def test_publish_as_pull_request(tmp_path, hub):
    src, _ = canonical_dir(tmp_path)
    result = publish(src, "me/pr-test", create_pr=True, endpoint=hub.url)
    assert result.pr_url and result.stage_dir is None  # temporary stage removed after the upload
    repo = hub.repos["me/pr-test"]
    assert len(repo.branches["main"]) == 1 and "model.safetensors" in repo.branches["refs/pr/1"][-1]["files"]


def test_pull_zoo_entry_official_format_converts(tmp_path, hub):
    _, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter)
    api = HfApi(endpoint=hub.url)  # put an official-layout repo where the zoo says the release lives
    api.create_repo("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    api.upload_folder(repo_id="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", folder_path=official)
    result = pull("eagle3-llama3.1-instruct-8b", endpoint=hub.url, out_dir=tmp_path / "dl",
                  target=tiny_target_config(), convert_to="sglang")
    assert result.repo_id == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and result.format == "official"
    assert result.report.ok and set(result.report.codes) == {"ARCHITECTURE_NONCANONICAL", "EMBED_TOKENS_PRESENT"}
    converted = import_drafter(result.converted_path)
    assert torch.equal(converted.midlayer.self_attn.q_proj.weight, drafter.midlayer.self_attn.q_proj.weight)


def test_pull_reports_target_mismatch_and_cli_exit_code(tmp_path, hub, monkeypatch, capsys):
    src, _ = canonical_dir(tmp_path)
    publish(src, "me/tiny-eagle3", endpoint=hub.url)
    target_dir = tmp_path / "other-target"
    tiny_target_config(vocab_size=128).save_pretrained(target_dir)  # read with AutoConfig, no network
    result = pull("me/tiny-eagle3", endpoint=hub.url, out_dir=tmp_path / "a", target=str(target_dir))
    assert not result.report.ok and "VOCAB_MISMATCH" in result.report.codes
    assert cli(["pull", "me/tiny-eagle3", "--endpoint", hub.url, "--out", str(tmp_path / "b"),
                "--target", str(target_dir)]) == 1
    assert "VOCAB_MISMATCH" in capsys.readouterr().out
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    assert torch.equal(load_any_drafter("me/tiny-eagle3", endpoint=hub.url).d2t, import_drafter(src).d2t)


def test_pull_unpublished_zoo_entry(tmp_path, hub):
    with pytest.raises(ValueError, match="not-yet-published"):
        pull("smollm2-135m-instruct-eagle3", endpoint=hub.url)
    with pytest.raises(ValueError, match="convert_to"):
        pull("me/x", convert_to="gguf", endpoint=hub.url)
    assert hub.requests == []
