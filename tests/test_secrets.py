"""The redaction layer (`eagle3_zoo.util.redaction`) and recipes as data: every secret a run is given (the engine key
named by `engine.api_key_env`, an `--api-key` in `engine.extra_args`, the Hub token, URL credentials) is redacted in
everything the commands write, print and log, and a value from `${oc.env:VAR}` stays that text in every artefact
while the run itself gets the value. The acceptance test drives fit, a refused second fit, consolidate, export,
publish --dry-run, serve --print-command, plan and fit --print-config through the CLI on a tiny target and then
searches every file (checkpoints byte for byte), everything printed and every log record for each secret."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
import yaml
from training_fixtures import save_tiny_target, tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.cli import error_line, main
from eagle3_zoo.recipe.sections import (
    load_recipe,
    recipe_identity_dict,
    recipe_to_dict,
    resolved_recipe_yaml,
    save_resolved_recipe,
)
from eagle3_zoo.util import redaction
from eagle3_zoo.util.redaction import find_secret, redact, redact_data, register, register_recipe

ENGINE_KEY = "ek-FAKEengineKEY0123456789abcdef"  # in $E3Z_ENGINE_KEY, named by engine.api_key_env
ARG_KEY = "ak-FAKEargKEY0123456789abcdef"  # engine.extra_args=[--api-key,ARG_KEY]
HUB_TOKEN = "hf_FAKEhubTOKEN0123456789abcdefQQ"  # $HF_TOKEN
URL_PASSWORD = "pw-FAKEurlPASSWORD0123456789"  # http://me:URL_PASSWORD@... in engine.extra_args
ENV_VALUE = "env-FAKEprivateVALUE0123456789"  # $E3Z_SOME_VAR, named by the recipe as ${oc.env:E3Z_SOME_VAR}
SECRETS = (ENGINE_KEY, ARG_KEY, HUB_TOKEN, URL_PASSWORD)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch, tmp_path):
    """An empty registry and no Hub token but the test's own (none from this machine's `hf auth login`)."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(redaction, "_values", {})
    monkeypatch.setattr(redaction, "_variables", {})
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-home" / "token"))
    monkeypatch.setattr(hub_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-hf-home" / "stored_tokens"))
    for name in redaction.HUB_TOKEN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_redact_each_kind_of_secret(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("E3Z_ENGINE_KEY", ENGINE_KEY)
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    cached, stored = "hf_CACHEDloginTOKEN0123456789", "hf_STOREDnamedTOKEN0123456789"
    (tmp_path / "token").write_text(cached + "\n")
    (tmp_path / "stored_tokens").write_text(f"[work]\nhf_token = {stored}\n")
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(hub_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    register_recipe({"engine": {"api_key_env": "E3Z_ENGINE_KEY", "extra_args": ["--api-key", ARG_KEY]},
                     "data": {"sources": [{"path": f"https://me:{URL_PASSWORD}@data.example/x.jsonl"}]}})
    text = f"engine {ENGINE_KEY}, arg {ARG_KEY}, hub {HUB_TOKEN}, login {cached}, stored {stored}, pw {URL_PASSWORD}"
    assert redact(text) == "engine ***, arg ***, hub ***, login ***, stored ***, pw ***"
    # by their form, whatever the registry knows
    assert redact("GET http://user:pass@10.0.0.5:8000/v1 ok") == "GET http://***@10.0.0.5:8000/v1 ok"
    assert redact("vllm serve m --api-key k-1234 --port 8000") == "vllm serve m --api-key *** --port 8000"
    assert redact("--api-key=k-1234 --hf-token hf_1234 --token=t-1234") == "--api-key=*** --hf-token *** --token=***"
    assert redact("override 'engine.extra_args=[--api-key,k-1234]'") == "override 'engine.extra_args=[--api-key,***]'"
    assert redact("['--api-key', 'k-1234', '--port']") == "['--api-key', '***', '--port']"
    assert redact("--tokenizer t --api-key *** --max-num-seqs 4") == "--tokenizer t --api-key *** --max-num-seqs 4"
    # structured: the item after a key flag whatever its length, keys and tuples too
    assert redact_data({"args": ["--api-key", "k", 3, "--token=t"], ENGINE_KEY: ("x", ARG_KEY)}) == {
        "args": ["--api-key", "***", 3, "--token=***"], "***": ("x", "***")}
    register("abc", "a short value")  # 1-3 characters would match everywhere in free text
    assert redact("abc 123") == "abc 123"
    # what a secret is, never its value
    assert find_secret(f"x {ENGINE_KEY} y".encode()) == "the key in $E3Z_ENGINE_KEY (engine.api_key_env)"
    assert find_secret(HUB_TOKEN) == "the Hub token ($HF_TOKEN)" and find_secret("nothing here") is None
    monkeypatch.setenv("E3Z_ENGINE_KEY", "ek-ROTATEDkey0123")  # a variable is read when text is redacted
    assert redact("ek-ROTATEDkey0123") == "***"


def test_log_records_error_lines_and_printed_output_are_redacted(caplog, capsys):
    register(ARG_KEY, "the --api-key value in engine.extra_args")
    redaction.install_log_redaction()
    caplog.set_level(logging.INFO)
    logging.getLogger("eagle3_zoo.test").info("the server answered %s", ARG_KEY)
    try:
        raise RuntimeError(f"bad key {ARG_KEY}")
    except RuntimeError:
        logging.getLogger("eagle3_zoo.test").exception("failed")
    assert "the server answered ***" in caplog.text and "bad key ***" in caplog.text
    assert ARG_KEY not in caplog.text
    assert error_line(ValueError(f"refused {ARG_KEY}")) == "error: refused ***"
    assert error_line(ConnectionError(f"refused {ARG_KEY}")) == "error: ConnectionError: refused ***"
    stream = redaction.RedactingStream(sys.stdout)
    print(f"key {ARG_KEY}", file=stream)
    assert capsys.readouterr().out == "key ***\n"


def _recipe_with_env(tmp_path, **sections) -> dict:
    (tmp_path / "target").mkdir(exist_ok=True)  # read by the run, not by loading its recipe
    recipe = tiny_recipe(tmp_path, tmp_path / "target", tmp_path / "c.jsonl", **sections)
    recipe["data"]["chat_template_kwargs"] = {"note": "${oc.env:E3Z_SOME_VAR}",
                                              "again": "${data.chat_template_kwargs.note}"}
    recipe["trainer"]["max_steps"] = "${oc.decode:${oc.env:E3Z_STEPS}}"
    recipe["engine"] = {"extra_args": ["--api-key", ARG_KEY, "--max-num-seqs", "4"]}
    return recipe


def test_env_interpolations_stay_text_in_what_is_written_and_the_run_gets_the_values(tmp_path, monkeypatch):
    monkeypatch.setenv("E3Z_SOME_VAR", ENV_VALUE)
    monkeypatch.setenv("E3Z_STEPS", "7")
    write_chat_jsonl(tmp_path / "c.jsonl")
    path = write_recipe(tmp_path / "r.yaml", _recipe_with_env(tmp_path))
    recipe = load_recipe(path)
    assert recipe.trainer.max_steps == 7  # the run gets the values
    assert recipe.data.chat_template_kwargs == {"note": ENV_VALUE, "again": ENV_VALUE}
    plain = recipe_to_dict(recipe)
    assert plain["trainer"]["max_steps"] == "${oc.decode:${oc.env:E3Z_STEPS}}"
    assert plain["data"]["chat_template_kwargs"] == {"note": "${oc.env:E3Z_SOME_VAR}",
                                                     "again": "${data.chat_template_kwargs.note}"}
    assert plain["engine"]["extra_args"] == ["--api-key", "***", "--max-num-seqs", "4"]
    saved = save_resolved_recipe(recipe, tmp_path / "saved" / "recipe.yaml")
    text = saved.read_text()
    assert ENV_VALUE not in text and ARG_KEY not in text and "${oc.env:E3Z_SOME_VAR}" in text
    reloaded = load_recipe(saved, [f"engine.extra_args=[--api-key,{ARG_KEY},--max-num-seqs,'4']"])
    assert reloaded == recipe  # resolved again when loaded: the same run
    recipe.trainer.max_steps = 9  # changed after loading: the run's own value, written as it is
    assert recipe_to_dict(recipe)["trainer"]["max_steps"] == 9
    shown = resolved_recipe_yaml(recipe)  # fit --print-config: the values this process runs with, no secret
    assert ENV_VALUE in shown and ARG_KEY not in shown and "- '***'" in shown


def test_the_run_identity_sees_a_changed_env_value_without_holding_it(tmp_path, monkeypatch):
    from eagle3_zoo.training.rundir.resume import identity_differences, run_identity

    write_chat_jsonl(tmp_path / "c.jsonl")
    path = write_recipe(tmp_path / "r.yaml", _recipe_with_env(tmp_path))
    monkeypatch.setenv("E3Z_STEPS", "7")

    def identity(value: str, *overrides: str) -> dict[str, str]:
        monkeypatch.setenv("E3Z_SOME_VAR", value)
        return run_identity(recipe_identity_dict(load_recipe(path, list(overrides))), data_fingerprint="f",
                            d2t=torch.zeros(4, dtype=torch.long), target={}, world_size=1)

    first = identity(ENV_VALUE)
    assert identity(ENV_VALUE) == first  # the same run resumes
    assert ENV_VALUE not in repr(first) and ARG_KEY not in repr(first)
    other = identity("another-value-0123")
    diffs = identity_differences(first, other)
    assert [d.split(":")[0] for d in diffs] == ["data.chat_template_kwargs.again", "data.chat_template_kwargs.note"]
    assert "another-value-0123" not in repr(other)
    rotated = identity(ENV_VALUE, "engine.extra_args=[--api-key,ak-ROTATED0123,--max-num-seqs,'4']")
    assert identity_differences(first, rotated) == []  # a rotated key trains the same drafter


def test_export_redacts_and_publish_refuses_a_folder_holding_any_known_secret(tmp_path, monkeypatch):
    from eagle3_zoo.checkpoint.convert import export_drafter
    from eagle3_zoo.hub import TokenLeakError, publish
    from tests.hub_fixtures import canonical_dir

    monkeypatch.setenv("E3Z_ENGINE_KEY", ENGINE_KEY)
    src, _ = canonical_dir(tmp_path)
    (src / "recipe.yaml").write_text(yaml.safe_dump({  # as an older version wrote it
        "engine": {"api_key_env": "E3Z_ENGINE_KEY", "extra_args": ["--api-key", ARG_KEY]},
        "data": {"chat_template_kwargs": {"note": "${oc.env:E3Z_SOME_VAR}"}}}))
    (src / "provenance.json").write_text(json.dumps({"data": {"url": f"http://me:{URL_PASSWORD}@h/x"},
                                                     "target": {"note": ENGINE_KEY}}))
    out = export_drafter(src, "sglang", tmp_path / "exported")
    recipe, provenance = yaml.safe_load((out / "recipe.yaml").read_text()), json.loads((out / "provenance.json")
                                                                                        .read_text())
    assert recipe["engine"] == {"api_key_env": "E3Z_ENGINE_KEY", "extra_args": ["--api-key", "***"]}
    assert recipe["data"]["chat_template_kwargs"]["note"] == "${oc.env:E3Z_SOME_VAR}"
    assert provenance == {"data": {"url": "http://***@h/x"}, "target": {"note": "***"}}
    with pytest.raises(TokenLeakError, match=r"recipe.yaml of .* contains the value of `--api-key` in engine.extra_"):
        publish(src, "me/leaky", dry_run=True, stage_dir=tmp_path / "stage")
    assert not (tmp_path / "stage").exists()
    (src / "recipe.yaml").unlink()
    with pytest.raises(TokenLeakError, match=r"provenance.json of .* contains the credentials of a URL"):
        publish(src, "me/leaky", dry_run=True, stage_dir=tmp_path / "stage")
    (src / "provenance.json").write_text(json.dumps({"target": {"note": ENGINE_KEY}}))
    with pytest.raises(TokenLeakError, match=r"provenance.json of .* contains the key in \$E3Z_ENGINE_KEY"):
        publish(src, "me/leaky", dry_run=True, stage_dir=tmp_path / "stage")
    (src / "provenance.json").unlink()
    with pytest.raises(TokenLeakError, match=r"staged README.md contains the key in \$E3Z_ENGINE_KEY"):
        publish(src, "me/leaky", dry_run=True, stage_dir=tmp_path / "stage", license=ENGINE_KEY)  # in the card
    assert not (tmp_path / "stage").exists()


def test_no_secret_and_no_env_value_in_anything_the_commands_write_print_or_log(tmp_path, monkeypatch, capsys,
                                                                                 caplog):
    """The acceptance test of the redaction layer (see the module docstring)."""
    from eagle3_zoo.training.rundir.lock import RUN_HOLDER, hold_run_directory

    monkeypatch.setenv("E3Z_ENGINE_KEY", ENGINE_KEY)
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setenv("E3Z_SOME_VAR", ENV_VALUE)
    caplog.set_level(logging.DEBUG)
    target = save_tiny_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "c.jsonl", n=8)
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(tmp_path, target, data, output_dir=str(run_dir), trainer={
        "max_steps": 2, "checkpoint_every_n_steps": 1, "val_check_interval": None, "logger": ["csv", "tensorboard"]})
    recipe["data"]["chat_template_kwargs"] = {"note": "${oc.env:E3Z_SOME_VAR}"}
    recipe["engine"] = {"api_key_env": "E3Z_ENGINE_KEY", "hidden_states_dir": str(tmp_path / "hidden_states"),
                        "platform": "cpu"}
    path = write_recipe(tmp_path / "r.yaml", recipe)
    args = f"engine.extra_args=[--api-key,{ARG_KEY},'--download-url=http://me:{URL_PASSWORD}@10.0.0.9:9/m']"
    printed: list[str] = []

    def run(*argv) -> int:
        argv = [str(a) for a in argv]
        monkeypatch.setattr(sys, "argv", ["eagle3-zoo", *argv])  # what the run-lock holder file records
        code = main(argv)
        out = capsys.readouterr()
        printed.extend([out.out, out.err])
        return code

    assert run("fit", path, args) == 0
    drafter = run_dir / "drafter"
    with hold_run_directory(run_dir):  # a second run while this one holds the directory is refused
        monkeypatch.setattr(sys, "argv", ["eagle3-zoo", "fit", str(path), args])
        holder = (run_dir / RUN_HOLDER).read_text()
        assert run("fit", path, args) == 2
    assert "is in use by another run" in printed[-1] and "--api-key,***" in printed[-1] and "--api-key,***" in holder
    assert run("fit", path, args) == 0  # resumes: the same settings, whatever the secrets look like now
    assert "resuming from" in caplog.text
    assert run("consolidate", run_dir / "checkpoints" / "last.ckpt", tmp_path / "consolidated") == 0
    assert run("export", drafter, "--format", "speculators", "--out", tmp_path / "exported") == 0
    assert run("publish", drafter, "--repo-id", "me/drafter", "--dry-run", "--stage-dir", tmp_path / "stage") == 0
    assert run("serve", path, args, "--print-command") == 0
    served = printed[-2]
    assert "--api-key ***" in served and "http://***@10.0.0.9:9/m" in served  # the command, its secrets redacted
    assert run("plan", path, args) in (0, 1)  # 1: a phase does not fit (no GPU memory given); the table is printed
    assert run("fit", path, args, "--print-config") == 0
    shown = printed[-2]
    assert "E3Z_ENGINE_KEY" in shown and ENV_VALUE in shown  # print-config shows the values the run would use

    written = drafter / "recipe.yaml"
    assert yaml.safe_load(written.read_text())["engine"]["extra_args"] == [
        "--api-key", "***", "--download-url=http://***@10.0.0.9:9/m"]
    hparams = sorted(run_dir.glob("logs/version_*/hparams.yaml"))
    provenance = json.loads((drafter / "provenance.json").read_text())
    for text in (written.read_text(), hparams[0].read_text(), json.dumps(provenance["recipe"]),
                 (tmp_path / "stage" / "README.md").read_text()):
        assert "${oc.env:E3Z_SOME_VAR}" in text  # the recipe as data: the interpolation, not the value
    files = [p for root in (run_dir, tmp_path / "consolidated", tmp_path / "exported", tmp_path / "stage")
             for p in root.rglob("*") if p.is_file()]
    checkpoint = (run_dir / "checkpoints" / "last.ckpt").read_bytes()  # holds the recipe (identity, drafter record)
    assert b"${oc.env:E3Z_SOME_VAR}" in checkpoint and b"E3Z_ENGINE_KEY" in checkpoint and b"--api-key" in checkpoint
    assert any("events.out.tfevents" in p.name for p in files)
    logged = [f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records]
    for secret in (*SECRETS, ENV_VALUE):
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret
        assert secret not in holder, secret
        assert not [m for m in logged if secret in m], secret
        assert not [t for t in printed if secret in t and not (secret == ENV_VALUE and t == shown)], secret
