"""Configs and recipes that used to pass or end in a traceback: every field the drafter reads is checked (range and
type) so that `check` refuses a config that makes every output NaN; a recipe that is binary or nested too deeply, a
GPU of 0 GB, or a drafter's recipe.yaml that is not a mapping each give one line naming the file and key."""

from __future__ import annotations

import json

import pytest

from eagle3_zoo.checkpoint import check_drafter
from eagle3_zoo.cli import main
from eagle3_zoo.modeling import Eagle3Config
from tests.hub_fixtures import canonical_dir, edit_config
from tests.tiny import tiny_config

CONFIG_FIELDS = [  # config.json key, bad value, what the problem says
    ("rms_norm_eps", -1, "rms_norm_eps=-1; expected a number in (0, 1)"),
    ("rms_norm_eps", 0, "rms_norm_eps=0; expected a number in (0, 1)"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps='1e-5'; expected a number in (0, 1)"),
    ("rope_theta", "x", "rope_theta='x'; expected a number > 0"),
    ("rope_theta", -10000.0, "rope_theta=-10000.0; expected a number > 0"),
    ("rope_scaling", "x", "rope_scaling='x'; expected null or an object of RoPE settings"),
    ("rope_scaling", {"rope_type": 3}, "rope_scaling={'rope_type': 3}; expected null or an object"),
    ("rope_parameters", "x", "rope_parameters = 'x'; expected a JSON object"),
    ("eagle_config", [1], "eagle_config = [1]; expected a JSON object"),
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": "ab"},
     "eagle_config.eagle_aux_hidden_state_layer_ids = 'ab'; expected a list of integer layer ids"),
    ("eagle_aux_hidden_state_layer_ids", [1.5, 2, 3],
     "eagle_aux_hidden_state_layer_ids = [1.5, 2, 3]; expected a list"),
    ("eagle3_zoo", "x", "eagle3_zoo = 'x'; expected a JSON object"),
    ("max_position_embeddings", "x", "max_position_embeddings='x'; expected an integer >= 1"),
    ("num_attention_heads", 0, "num_attention_heads=0; expected an integer >= 1"),
    ("hidden_size", 32.0, "hidden_size=32.0; expected an integer >= 1"),
    ("head_dim", -8, "head_dim=-8; expected an integer >= 1 or null"),
    ("vocab_size", True, "vocab_size=True; expected an integer >= 1"),
]


@pytest.mark.parametrize("key, value, message", CONFIG_FIELDS)
def test_check_refuses_every_bad_field_the_drafter_reads(tmp_path, capsys, key, value, message):
    folder, _ = canonical_dir(tmp_path)
    edit_config(folder, lambda cfg: cfg.__setitem__(key, value))
    report = check_drafter(folder)
    assert report.codes == ["CONFIG_INVALID"] and message in str(report)
    assert str(folder / "config.json") in str(report)
    capsys.readouterr()
    assert main(["check", str(folder)]) == 1 and main(["export", str(folder), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err and not (tmp_path / "o").exists()


def test_a_valid_config_still_round_trips():
    cfg = tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    assert Eagle3Config.from_json_dict(json.loads(json.dumps(cfg.to_json_dict()))) == cfg


@pytest.mark.parametrize("name, content, message", [
    ("binary.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\xff", "<file>: not UTF-8 text (byte 0x89 at offset 0): a recipe is a "
                                                      "YAML file"),
    ("deep.yaml", ("a: " + "[" * 600 + "]" * 600).encode(), "nested too deeply"),
])
def test_a_binary_or_too_deeply_nested_recipe_is_one_problem(tmp_path, capsys, name, content, message):
    (tmp_path / name).write_bytes(content)
    for command in ("plan", "fit", "prepare"):
        assert main([command, str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and message in err and f"{tmp_path / name}: " in err


@pytest.mark.parametrize("value, shown", [("0", "0.0"), ("-1", "-1.0"), (".nan", "nan")])
def test_gpu_memory_must_be_positive(tmp_path, capsys, value, shown):
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    assert main(["plan", str(recipe), f"trainer.gpu_memory_gb={value}"]) == 2
    assert f"trainer.gpu_memory_gb = {shown}: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("content, what", [("- a\n- b\n", "expected a mapping of recipe sections, got a YAML list"),
                                           ("just text\n", "got a YAML str"),
                                           ("a: [1\n", "not valid YAML"), (b"\xff\xfe", "not UTF-8 text")])
def test_a_drafter_recipe_that_is_not_a_mapping_is_named_by_check_and_publish(tmp_path, capsys, content, what):
    folder, _ = canonical_dir(tmp_path)
    path = folder / "recipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    report = check_drafter(folder)
    assert report.ok and report.codes == ["RECIPE_UNREADABLE"] and what in str(report)  # a warning: it still serves
    capsys.readouterr()
    assert main(["publish", str(folder), "--repo-id", "me/x", "--dry-run", "--stage-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and f"{path}: " in lines[0] and what in lines[0]
    assert "fix or remove recipe.yaml" in lines[0] and not (tmp_path / "s").exists()
