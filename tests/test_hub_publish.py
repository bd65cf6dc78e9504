"""publish / pull run for real against a loopback Hub (tests/hub_server.py): huggingface_hub's own HTTP client code
creates the repo, uploads in one commit and downloads with snapshot_download. No network beyond 127.0.0.1."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from huggingface_hub import HfApi

from eagle3_zoo.checkpoint import DrafterCheckError, import_drafter
from eagle3_zoo.cli import main as cli
from eagle3_zoo.hub import TokenLeakError, load_any_drafter, publish, pull
from eagle3_zoo.hub.endpoint import HubUnreachableError
from eagle3_zoo.hub.zoo import find_zoo
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter, build_draft_vocab, default_aux_layer_ids
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
    assert '"model": "me/tiny-eagle3"' in (pulled.path / "README.md").read_text()  # the card's snippets: it exists
    out = capsys.readouterr()
    _no_secret(caplog.text, out.out, out.err)


def test_dry_run_makes_no_request(tmp_path, hub, capsys):
    src, _ = _drafter_with_extras(tmp_path)
    result = publish(src, "me/tiny-eagle3", dry_run=True, endpoint=hub.url, stage_dir=tmp_path / "stage")
    assert result.dry_run and result.commit_url is None
    assert (tmp_path / "stage" / "README.md").is_file() and (tmp_path / "stage" / "model.safetensors").is_file()
    card = (tmp_path / "stage" / "README.md").read_text()  # no repo was created: the snippets load the staged folder
    assert f'"model": "{tmp_path / "stage"}"' in card and "path me/tiny-eagle3" not in card
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


def test_pull_a_published_qwen3_zoo_drafter_and_check_it_against_the_shipped_target_config(tmp_path, hub, capsys):
    # a drafter shaped like AngelSlim/Qwen3-1.7B_eagle3 (full target width and vocab; one KV head, small MLP and draft
    # vocab so the files stay ~60 MB), in EAGLE's own layout, where the zoo says the release lives
    cfg = Eagle3Config(hidden_size=2048, target_hidden_size=2048, num_attention_heads=16, num_key_value_heads=1,
                       head_dim=128, intermediate_size=64, vocab_size=151936, draft_vocab_size=256, rope_theta=1e6,
                       max_position_embeddings=40960, aux_layer_ids=default_aux_layer_ids(28),
                       target_name_or_path="Qwen/Qwen3-1.7B", target_model_type="qwen3")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(*build_draft_vocab(torch.randint(0, 50, (cfg.vocab_size,)), cfg.draft_vocab_size))
    folder = official_dir(tmp_path, drafter, dtype=torch.bfloat16, embedding=False)
    repo = find_zoo("angelslim-qwen3-1.7b-eagle3").repo_id
    HfApi(endpoint=hub.url).create_repo(repo)
    HfApi(endpoint=hub.url).upload_folder(repo_id=repo, folder_path=folder)
    out = tmp_path / "pulled"
    # the target config comes from the package (Qwen/Qwen3-1.7B ships), never from the Hub
    assert cli(["pull", "angelslim-qwen3-1.7b-eagle3", "--endpoint", hub.url, "--out", str(out),
                "--target", "Qwen/Qwen3-1.7B"]) == 0
    printed = capsys.readouterr().out
    assert f"pulled {repo} (official format)" in printed and "0 error(s)" in printed
    assert not any("Qwen/Qwen3-1.7B" in r["path"] for r in hub.requests), \
        "the target config was fetched from the Hub"
    # the same drafter against a Qwen3 target of another width fails the check with the size problem
    assert cli(["check", str(out), "--target", "Qwen/Qwen2.5-7B-Instruct"]) == 1
    assert "HIDDEN_SIZE_MISMATCH" in capsys.readouterr().out


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


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """Temporary folders (publish's default stage) go here, so a test can see what a failure leaves behind."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _closed_port_url() -> str:
    import socket

    with socket.socket() as sock:  # bound then closed: connecting is refused at once, like a machine with no network
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_dry_run_scans_for_the_token_and_leaves_no_staged_copy(tmp_path, hub, temp_root):
    src, _ = canonical_dir(tmp_path)
    # a run whose data path held the token: the card shows provenance values, so the staged README would carry it
    (src / "provenance.json").write_text(json.dumps({"data": {"path": f"/home/me/{SECRET}/chat.jsonl"}}))
    # refused before staging: the folder's own provenance.json holds it (the stage would have it redacted)
    with pytest.raises(TokenLeakError, match=r"provenance.json of .* contains the Hub token"):
        publish(src, "me/leaky", dry_run=True, stage_dir=tmp_path / "stage")
    assert not (tmp_path / "stage").exists()  # the staged files holding the token are gone (and the new folder)
    with pytest.raises(TokenLeakError):
        publish(src, "me/leaky", dry_run=True)
    assert list(temp_root.iterdir()) == []
    assert hub.requests == []


@pytest.mark.parametrize("repo_id", ["me/bad name", "a/b/c", "no-namespace", "me/x--y", "-me/x"])
def test_dry_run_checks_the_repo_id_like_the_real_publish(tmp_path, hub, temp_root, capsys, repo_id):
    src, _ = canonical_dir(tmp_path)
    with pytest.raises(ValueError, match=r"--repo-id .* is not a Hub repo id .* expected ORG/NAME"):
        publish(src, repo_id, dry_run=True)
    assert cli(["publish", str(src), f"--repo-id={repo_id}", "--dry-run"]) == 2
    assert "expected ORG/NAME" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected ORG/NAME"):
        publish(src, repo_id, endpoint=hub.url)
    assert hub.requests == [] and list(temp_root.iterdir()) == []


def test_publish_without_network_fails_fast_in_one_line_and_cleans_up(tmp_path, temp_root, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    src, _ = canonical_dir(tmp_path)
    url = _closed_port_url()
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match=rf"Hub endpoint {url} is not reachable .*--endpoint"):
        publish(src, "me/tiny-eagle3", endpoint=url)
    assert cli(["publish", str(src), "--repo-id", "me/tiny-eagle3", "--endpoint", url]) == 1  # not bad input
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err.startswith(f"error: HubUnreachableError: Hub endpoint {url} is not reachable")
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and SECRET not in err
    assert list(temp_root.iterdir()) == []  # every failed publish removed its temporary stage


def test_publish_to_a_silent_endpoint_gives_up_after_the_probe_timeout(tmp_path, temp_root, monkeypatch):
    import socket
    import threading

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr("eagle3_zoo.hub.endpoint.PROBE_TIMEOUT_S", 0.5)
    src, _ = canonical_dir(tmp_path)
    with socket.socket() as silent:  # accepts connections (backlog) and never answers: a blackholed proxy
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        outcome = {}

        def run():
            try:
                publish(src, "me/tiny-eagle3", endpoint=url)
            except Exception as e:  # noqa: BLE001 -- the test inspects whatever came back
                outcome["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "publish still waiting for a silent endpoint after 10 s"
    assert isinstance(outcome.get("error"), HubUnreachableError), outcome
    assert url in str(outcome["error"])


def test_pull_of_an_unknown_name_says_what_it_is_not(tmp_path, hub, capsys):
    with pytest.raises(ValueError, match=r"'eagle3-llama3.1-instruct' is neither a known zoo name \(did you mean "
                                         r"eagle3-llama3.1-instruct-8b.*\) nor a repo id on the Hub: no repo"):
        pull("eagle3-llama3.1-instruct", endpoint=hub.url, out_dir=tmp_path / "a")
    url = _closed_port_url()
    with pytest.raises(HubUnreachableError, match=r"'me/nothing-here' is neither a known zoo name .* nor a reachable "
                                                  rf"repo id: Hub endpoint {url} is not reachable"):
        pull("me/nothing-here", endpoint=url, out_dir=tmp_path / "b")
    assert cli(["pull", "nonexistent-zoo-thing", "--endpoint", url, "--out", str(tmp_path / "c")]) == 1  # no network
    err = capsys.readouterr().err
    assert "neither a known zoo name" in err and url in err and len(err.strip().splitlines()) == 1


def test_pull_without_network_uses_the_copy_downloaded_before(tmp_path, hub):
    src, _ = canonical_dir(tmp_path)
    publish(src, "me/tiny-eagle3", endpoint=hub.url)
    first = pull("me/tiny-eagle3", endpoint=hub.url, out_dir=tmp_path / "dl")
    again = pull("me/tiny-eagle3", endpoint=_closed_port_url(), out_dir=tmp_path / "dl")
    assert again.path == first.path and again.report.ok


def test_pull_does_not_convert_a_drafter_that_fails_the_check(tmp_path, hub, capsys):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s["d2t"].__setitem__(-1, 500))  # maps past the 96-token vocab
    api = HfApi(endpoint=hub.url)  # publish would refuse it: upload it the way another tool might
    api.create_repo("me/broken")
    api.upload_folder(repo_id="me/broken", folder_path=src)
    result = pull("me/broken", endpoint=hub.url, out_dir=tmp_path / "dl", convert_to="sglang")
    assert "D2T_OUT_OF_RANGE" in result.report.codes and result.converted_path is None
    assert not (tmp_path / "dl" / "sglang").exists()
    assert cli(["pull", "me/broken", "--endpoint", hub.url, "--out", str(tmp_path / "dl2"),
                "--convert-to", "speculators"]) == 1
    assert "not converted to speculators" in capsys.readouterr().out


def test_publish_without_a_token_says_how_to_log_in_before_staging(tmp_path, hub, monkeypatch, capsys):
    import huggingface_hub

    src, _ = _drafter_with_extras(tmp_path)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no cached `hf auth login` either
    stage = tmp_path / "stage"
    assert cli(["publish", str(src), "--repo-id", "org/d", "--endpoint", hub.url, "--stage-dir", str(stage)]) == 2
    err = capsys.readouterr().err
    assert "hf auth login" in err and "HF_TOKEN" in err and len(err.strip().splitlines()) == 1
    assert not stage.exists() and hub.requests == []  # nothing staged, nothing sent
    assert cli(["publish", str(src), "--repo-id", "org/d", "--dry-run", "--stage-dir", str(stage)]) == 0  # needs none


def test_stage_dir_refuses_a_folder_publish_did_not_stage_and_replaces_an_earlier_stage(tmp_path, capsys):
    """`--stage-dir` into an unrelated non-empty folder is refused, naming --force (the old refusal did not say how
    to force; an earlier stage was refused too, and the quickstart had to delete it first); an earlier stage is
    replaced whole; --force keeps the folder's own files (staged with it) and a failed forced stage removes only
    what it added. Fails without `stage_destination` (no --force, earlier stage refused)."""
    src, _ = _drafter_with_extras(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    args = ["publish", str(src), "--repo-id", "me/tiny-eagle3", "--dry-run", "--stage-dir"]
    assert cli([*args, str(notes)]) == 2
    err = capsys.readouterr().err
    assert f"{notes} exists and is not a drafter folder (no config.json)" in err and "--force" in err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    for folder in (src, src.parent):  # the drafter folder itself, or a folder holding it
        with pytest.raises(ValueError, match="staging would replace it"):
            publish(src, "me/tiny-eagle3", dry_run=True, stage_dir=folder)
    with pytest.raises(ValueError, match="a drafter folder that publish did not stage .* --force"):
        publish(canonical_dir(tmp_path, name="other")[0], "me/x", dry_run=True, stage_dir=src)

    stage = tmp_path / "stage"
    assert cli([*args, str(stage)]) == 0
    (stage / "stale.json").write_text("{}")  # what an older stage held: never uploaded with the new one
    assert cli([*args, str(stage)]) == 0  # an earlier stage is replaced
    assert not (stage / "stale.json").exists() and (stage / "README.md").is_file()

    assert cli([*args, str(notes), "--force"]) == 0
    assert (notes / "todo.txt").read_text() == "mine" and (notes / "model.safetensors").is_file()
    assert "todo.txt" in capsys.readouterr().out  # listed: it would be uploaded with the stage
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "todo.txt").write_text("mine")
    from eagle3_zoo.util.redaction import register

    register(SECRET, "a test secret")
    with pytest.raises(TokenLeakError, match="staged README.md"):  # found once staged (in the card)
        publish(src, "me/tiny-eagle3", dry_run=True, stage_dir=forced, force=True, license=SECRET)
    assert [p.name for p in forced.iterdir()] == ["todo.txt"]  # a failed forced stage removes only what it added
