"""Malformed data and recipes through `fit_main`: each gives its own clear error (naming the file/record or the
recipe key) or a counted skip in provenance.json; nothing fails with an unrelated traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_fixtures import save_tiny_target, tiny_recipe, write_recipe

from eagle3_zoo.cli import main
from eagle3_zoo.data.readers import DataError
from eagle3_zoo.recipe.sections import RecipeError
from eagle3_zoo.training.fit import fit_main


def _rec(q="What is the capital of France?", a="The capital of France is Paris.", **extra):
    return json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}], **extra})


GOOD = [_rec(q=f"Hello, how are you today? {i}") for i in range(6)]
LATIN1 = GOOD[0].replace("Paris", "Par\udce9s")  # written as the raw byte 0xe9 (Latin-1 "é"), not UTF-8
DEEP = '{"conversations": ' + "[" * 20_000 + "]" * 20_000 + "}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    return tmp, save_tiny_target(tmp / "target")


# name -> (data lines or None for the good data, overrides, expected exception or None, message regex or skip check)
CASES = {
    "broken_json_line": (GOOD[:2] + ['{"conversations": [}'] + GOOD[2:], [], DataError,
                         r"data.jsonl: record 2 \(line 3\): invalid JSON"),
    "broken_json_line_skipped": (GOOD[:2] + ['{"conversations": [}'] + GOOD[2:], ["data.on_error=skip"], None,
                                 ("skipped_by_reader", {"broken_json": 1})),
    "non_utf8_line": (GOOD[:3] + [LATIN1] + GOOD[3:], [], DataError,
                      r"data.jsonl: record 3 \(line 4\): not UTF-8 text: byte 0xe9 at column \d+.*\[invalid_utf8\]"),
    "non_utf8_line_skipped": (GOOD[:3] + [LATIN1] + GOOD[3:], ["data.on_error=skip"], None,
                              ("skipped_by_reader", {"invalid_utf8": 1})),
    "deeply_nested_record": (GOOD + [DEEP], [], DataError,
                             r"data.jsonl: record 6 \(line 7\): nested deeper than the JSON decoder allows"),
    "deeply_nested_record_skipped": (GOOD + [DEEP], ["data.on_error=skip"], None,
                                     ("skipped_by_reader", {"too_deeply_nested": 1})),
    "lone_surrogate_escape": (GOOD + [_rec(a="half an emoji \ud83d")], [], DataError,  # json.dumps escapes it
                              r"record 6 \(line 7\): turn 1: content holds the lone surrogate escape \\ud83d"),
    "missing_keys": (GOOD + [json.dumps({"id": 7, "text": "hi"})], [], DataError,
                     r"record 6 \(line 7\): no 'conversations' or 'messages' key"),
    "empty_file": ([], [], DataError, r"data.jsonl: file is empty"),
    "no_assistant_turn": (GOOD + [json.dumps({"conversations": [{"from": "human", "value": "hi"}]})], [], DataError,
                          r"record 6 .*no assistant turn"),
    "no_user_turn_skipped": (GOOD + [json.dumps({"conversations": [{"from": "gpt", "value": "hi"}]})],
                             ["data.on_error=skip"], None, ("skipped_by_reader", {"no_user_turn": 1})),
    "unknown_role": (GOOD + [json.dumps({"conversations": [{"from": "robot", "value": "hi"}]})], [], DataError,
                     r"record 6 .*unknown role 'robot'"),
    "non_string_content": (GOOD + [json.dumps({"conversations": [{"from": "human", "value": 42}]})], [], DataError,
                           r"record 6 .*content is int, not a string"),
    "empty_reply_skipped": (GOOD + [_rec(a="   ")], ["data.on_error=skip"], None,
                            ("tokenization", {"no_supervised_tokens": 1})),
    "sequence_too_short": (None, ["data.max_length=2"], DataError, r"no usable training example.*too_short: 6"),
    "recipe_typo": (None, ["trainer.max_stpes=3"], RecipeError,
                    r"trainer.max_stpes: unknown key; did you mean 'trainer.max_steps'"),
    "wrong_type": (None, ["trainer.batch_size=two"], RecipeError, r"trainer.batch_size = 'two': expected an integer"),
    "bad_override_syntax": (None, ["trainer.max_steps"], RecipeError, r"an override must look like key=value"),
    "unknown_family": (None, ["target.family=qwen25"], RecipeError,
                       r"target.family = 'qwen25': unknown adapter family.*did you mean 'qwen2'\?; to add one see "
                       r"docs/contributing/adding-a-family.md"),
    "family_mismatch": (None, ["target.family=qwen2"], ValueError, r"target.family = 'qwen2' but .* is a 'llama'"),
    "unknown_strategy": (None, ["trainer.strategy=horovod"], RecipeError,
                         r"trainer.strategy = 'horovod': expected one of auto, ddp, fsdp"),
    "draft_vocab_larger_than_target": (None, ["drafter.draft_vocab_size=100000"], RecipeError,
                                       r"drafter.draft_vocab_size = 100000: exceeds the target vocabulary \(512\)"),
    "aux_layer_out_of_range": (None, ["drafter.aux_layer_ids=[1,2,9]"], RecipeError,
                               r"drafter.aux_layer_ids = \[1, 2, 9\]: out of range for a 4-layer target"),
    "missing_data_file": (None, ["data.sources=[{path: /nonexistent/chat.jsonl}]"], RecipeError,
                          r"data.sources\[0\].path = '/nonexistent/chat.jsonl': data file not found"),
    "missing_target": (None, ["target.name_or_path=/nonexistent/model"], RecipeError,
                       r"target.name_or_path = '/nonexistent/model': local path does not exist"),
    "target_is_a_file": (None, ["target.name_or_path={tmp}/data.jsonl"], RecipeError,
                         r"target.name_or_path = .*data.jsonl': is a file; expected a local model folder with "
                         r"config.json, a Hub repo id"),
    "cache_dir_is_a_file": (None, ["data.cache_dir={tmp}/data.jsonl"], RecipeError,
                            r"data.cache_dir = .*data.jsonl': is a file; expected a directory"),
    "features_dir_is_a_file": (None, ["data.features_dir={tmp}/data.jsonl"], RecipeError,
                               r"data.features_dir = .*data.jsonl': is a file; expected a directory"),
    "regenerate_output_is_a_directory": (None, ["data.regenerate.output={tmp}"], RecipeError,
                                         r"data.regenerate.output = .*': is a directory; expected a JSONL file"),
    "unknown_hub_target_offline": (None, ["target.name_or_path=no-such-org/no-such-model"], FileNotFoundError,
                                   r"target 'no-such-org/no-such-model' is neither a local folder nor in the Hugging "
                                   r"Face cache, and HF_HUB_OFFLINE is set"),
    "unwritable_output_dir": (None, ["output_dir={tmp}/data.jsonl/run"], RecipeError,
                              r"output_dir = .*data.jsonl/run': cannot be created: .* is a file"),
    "warmup_longer_than_run": (None, ["optim.warmup_steps=50"], RecipeError,
                               r"optim.warmup_steps = 50: exceeds trainer.max_steps \(1\)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(env, tmp_path, monkeypatch, name):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1: never the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    tmp_target = env[1]
    lines, overrides, error, expected = CASES[name]
    data = tmp_path / "data.jsonl"
    text = "".join(line + "\n" for line in (GOOD if lines is None else lines))
    data.write_text(text, encoding="utf-8", errors="surrogateescape")  # "\udce9" -> the single byte 0xe9
    recipe = tiny_recipe(tmp_path, tmp_target, data, trainer={"max_steps": 1, "checkpoint_every_n_steps": None,
                                                              "val_check_interval": None, "logger": []},
                         optim={"warmup_steps": 0}, data={"val_fraction": 0.0, "on_error": "raise"})
    path = write_recipe(tmp_path / "recipe.yaml", recipe)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    if error is not None:
        with pytest.raises(error, match=expected):
            fit_main(path, overrides)
        return
    out = fit_main(path, overrides)
    prov = json.loads((out / "provenance.json").read_text())["data"]
    section, counts = expected
    skipped = prov[section] if section == "skipped_by_reader" else prov[section]["skipped"]
    assert skipped == counts
    assert (out / "model.safetensors").is_file()


def test_cli_exit_code_and_message_for_bad_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1,\n")
    assert main(["fit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid recipe") and "YAML syntax error" in err
    assert main(["fit", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err


def test_unknown_strategy_from_the_builder_lists_valid_ones():
    from eagle3_zoo.training.strategies import build_strategy

    with pytest.raises(ValueError, match="valid: auto, ddp, fsdp"):
        build_strategy("horovod")


def test_nothing_written_for_a_rejected_recipe(env, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in GOOD))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, env[1], data))
    with pytest.raises(RecipeError):
        fit_main(recipe, ["drafter.draft_vocab_size=100000"])
    assert not Path(tmp_path / "run").exists()


def test_provenance_records_the_git_state_at_the_start_of_the_run(env, tmp_path, monkeypatch):
    """A commit made while a run trains is not the code it ran: provenance keeps the state `fit` started from."""
    from eagle3_zoo.training import fit as fit_module

    # the checkout as `fit` finds it, and as it is when the drafter is written (a commit landed meanwhile)
    monkeypatch.setattr(fit_module, "git_info", lambda *a: {"sha": "a" * 40, "dirty": True}, raising=False)
    monkeypatch.setattr("eagle3_zoo.training.rundir.outputs.git_info", lambda *a: {"sha": "b" * 40, "dirty": False})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in GOOD))
    recipe = tiny_recipe(tmp_path, env[1], data, trainer={"max_steps": 1, "checkpoint_every_n_steps": None,
                                                           "val_check_interval": None, "logger": []},
                         optim={"warmup_steps": 0}, data={"val_fraction": 0.0})
    out = fit_main(write_recipe(tmp_path / "recipe.yaml", recipe))
    assert json.loads((out / "provenance.json").read_text())["git"] == {"sha": "a" * 40, "dirty": True}
