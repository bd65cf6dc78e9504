"""No credential appears in any output, file or error line: with a fake Hub token and a fake API key in the
environment, the commands run end to end through the CLI (regeneration through a loopback server that needs the key,
the server failing with the key quoted in its error, a redirect to another origin, a URL with credentials, fit,
consolidate of a checkpoint whose recipe names the token, check, export, publish --dry-run), and then everything
they printed, logged and wrote is searched for either secret."""

from __future__ import annotations

import logging

import pytest
import torch
from openai_fake import FakeOpenAIServer
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.cli import main

HUB_TOKEN = "hf_FAKEhubTOKEN0123456789abcdefXYZ"
API_KEY = "sk-FAKEapiKEY0123456789abcdefXYZ"


def test_no_secret_in_anything_a_run_prints_logs_or_writes(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setenv("FAKE_API_KEY", API_KEY)
    caplog.set_level(logging.DEBUG)
    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "c.jsonl", n=8)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, target, data, trainer={
        "max_steps": 2, "checkpoint_every_n_steps": 1}))
    printed: list[str] = []

    def run(*argv) -> int:
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        printed.extend([out.out, out.err])
        return code

    with FakeOpenAIServer(generate=lambda prompt, n, stop: [5, 6, 7, *stop[:1]]) as server, FakeOpenAIServer() as other:
        regen = ["data.regenerate.enabled=true", "data.regenerate.backend=openai", f"data.regenerate.base_url="
                 f"{server.url}", "data.regenerate.api_key_env=FAKE_API_KEY", "data.regenerate.max_new_tokens=4",
                 "data.regenerate.retries=0"]
        assert run("prepare", recipe, *regen) == 0
        assert server.headers and all(h["Authorization"] == f"Bearer {API_KEY}" for h in server.headers)  # sent
        server.echo_auth = True  # the server's error quotes the key
        assert run("prepare", recipe, *regen, f"data.cache_dir={tmp_path / 'cache2'}") == 1
        server.echo_auth = False
        server.redirect = (307, other.url + "/v1/completions")  # another origin
        assert run("prepare", recipe, *regen, f"data.cache_dir={tmp_path / 'cache3'}") == 1
        assert other.headers == []
        server.redirect = None
        bad_url = f"data.regenerate.base_url=http://me:{API_KEY}@127.0.0.1:9"
        assert run("prepare", recipe, *regen, bad_url) == 2
        assert run("prepare", recipe, *regen, f"data.regenerate.api_key_env={API_KEY}") == 2  # the key pasted
        run_dir = tmp_path / "run"
        assert run("fit", recipe, *regen, f"output_dir={run_dir}") == 0
    drafter = run_dir / "drafter"
    assert run("consolidate", run_dir / "checkpoints" / "last.ckpt", tmp_path / "consolidated") == 0
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["eagle3_zoo_drafter"]["recipe"] = '{"target": {"name_or_path": "${oc.env:HF_TOKEN}"}}'
    torch.save(ckpt, tmp_path / "crafted.ckpt")
    assert run("consolidate", tmp_path / "crafted.ckpt", tmp_path / "crafted") == 0
    assert run("check", drafter) == 0
    assert run("export", drafter, "--format", "speculators", "--out", tmp_path / "exported") == 0
    assert run("publish", drafter, "--repo-id", "me/drafter", "--dry-run", "--stage-dir", tmp_path / "stage") == 0
    assert run("publish", tmp_path / "crafted", "--repo-id", "me/x", "--dry-run", "--stage-dir", tmp_path / "s2") == 0

    errors = [line for text in printed for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 4, errors  # the four refusals above, one line each
    assert any("bad key Bearer ***" in e for e in errors) and any("another origin" in e for e in errors)
    logged = [f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 30 and (tmp_path / "stage" / "README.md").is_file()
    for secret in (HUB_TOKEN, API_KEY):
        assert not [t for t in printed if secret in t], secret
        assert not [m for m in logged if secret in m], secret
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret


@pytest.mark.parametrize("where", ["base_url", "override"])
def test_a_refused_url_with_credentials_is_never_echoed(tmp_path, capsys, where):
    recipe = tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl"))
    url = f"http://user:{API_KEY}@127.0.0.1:9"
    overrides = ["data.regenerate.backend=openai"]
    if where == "base_url":
        recipe["data"]["regenerate"] = {"backend": "openai", "base_url": url}
    else:
        overrides.append(f"data.regenerate.base_url={url}")
    assert main(["plan", str(write_recipe(tmp_path / "r.yaml", recipe)), *overrides]) == 2
    err = capsys.readouterr().err
    assert API_KEY not in err and "credentials in the URL (user:password@) are refused" in err
