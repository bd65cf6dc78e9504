"""Recipe schema: shipped recipes, overrides, and one clear message per problem, all reported at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from eagle3_zoo.adapters import available_adapters
from eagle3_zoo.recipe import sections as recipe_mod
from eagle3_zoo.recipe.sections import (
    Recipe,
    RecipeError,
    load_recipe,
    save_resolved_recipe,
    validate_against_target,
    validate_recipe,
)

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(RECIPES_DIR.rglob("*.yaml"))  # recursive: a recipe in a subfolder is tested too


def test_recipes_are_found():
    names = {p.name for p in SHIPPED}
    assert {"smollm2_135m.yaml", "llama3_8b.yaml", "llama3_70b.yaml", "qwen25_7b.yaml", "deepseek_v3.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_shipped_recipe_loads_and_validates(path):
    text = path.read_text()
    assert text.startswith("#"), "each recipe starts with a comment header"
    assert f"eagle3-zoo fit recipes/{path.relative_to(RECIPES_DIR)}" in text, "header shows the launch command"
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    validate_recipe(r, source=str(path))


def test_embedded_recipe_values():
    r = load_recipe(RECIPES_DIR / "smollm2_135m.yaml")
    assert r.target.name_or_path == "smollm2-135m-instruct"
    assert r.data.sources[0].path == "sharegpt-embedded" and r.data.sources[0].format == "auto"
    assert r.trainer.precision == "32-true" and r.target.dtype == "float32"


def test_defaults_are_valid():
    validate_recipe(Recipe())
    assert Recipe().ttt.steps == 7 and Recipe().ttt.step_weight_decay == 0.8


def test_overrides_apply():
    r = load_recipe(RECIPES_DIR / "smollm2_135m.yaml", [
        "trainer.max_steps=2000", "optim.lr=1e-3", "trainer.logger=[csv,tensorboard]",
        "data.sources=[{path: sharegpt-embedded, max_samples: 10}]", "drafter.aux_layer_ids=[2,15,27]",
        "ttt.step_weights=[1,1,1,1,1,1,1]"])
    assert r.trainer.max_steps == 2000
    assert r.optim.lr == pytest.approx(1e-3) and isinstance(r.optim.lr, float)
    assert r.trainer.logger == ["csv", "tensorboard"]
    assert r.data.sources[0].max_samples == 10
    assert r.drafter.aux_layer_ids == [2, 15, 27]
    assert r.ttt.step_weights == [1.0] * 7


def test_override_problems_name_the_override(tmp_path):
    with pytest.raises(RecipeError) as exc:
        load_recipe(RECIPES_DIR / "smollm2_135m.yaml", ["trainer.max_stepz=3", "optim.lr=fast", "nokey"])
    text = str(exc.value)
    assert "override 'trainer.max_stepz=3': trainer.max_stepz: unknown key; did you mean 'trainer.max_steps'" in text
    assert "override 'optim.lr=fast': optim.lr = 'fast': expected a number" in text
    assert "override 'nokey'" in text and "key=value" in text
    assert len(exc.value.problems) == 3


def _base(tmp_path: Path) -> dict:
    return {"target": {"family": "llama"}, "data": {"sources": [{"path": "sharegpt-embedded"}]},
            "trainer": {"max_steps": 100}, "output_dir": str(tmp_path / "out")}


def _set(d: dict, dotted: str, value):
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


# (case id, dotted key -> bad value, key named in the message, expected fragment)
BAD_CASES = [
    ("typo", {"trainer.max_step": 5}, "trainer.max_step", "did you mean 'trainer.max_steps'"),
    ("misplaced", {"trainer.lr": 5}, "trainer.lr", "did you mean 'optim.lr'"),
    ("wrong_type", {"trainer.batch_size": "four"}, "trainer.batch_size", "expected an integer"),
    ("bool_not_int", {"trainer.num_nodes": True}, "trainer.num_nodes", "expected an integer"),
    ("unknown_family", {"target.family": "qwen25"}, "target.family",
     "available: auto, " + ", ".join(available_adapters())),
    ("unknown_strategy", {"trainer.strategy": "fsdb"}, "trainer.strategy", "did you mean 'fsdp'"),
    ("unknown_precision", {"trainer.precision": "bf16"}, "trainer.precision", "one of 32-true, bf16-mixed"),
    ("unknown_logger", {"trainer.logger": ["csv", "mlflow"]}, "trainer.logger[1]", "one of csv, tensorboard, wandb"),
    ("unknown_dtype", {"target.dtype": "fp16"}, "target.dtype", "one of float32, bfloat16, float16"),
    ("draft_vocab_zero", {"drafter.draft_vocab_size": 0}, "drafter.draft_vocab_size", "must be > 0"),
    ("ttt_steps_zero", {"ttt.steps": 0}, "ttt.steps", "must be >= 1"),
    ("step_weights_len", {"ttt.step_weights": [1.0, 0.5]}, "ttt.step_weights", "has 2 entries but ttt.steps = 7"),
    ("aux_two", {"drafter.aux_layer_ids": [2, 15]}, "drafter.aux_layer_ids", "expected 1 or 3 layer ids"),
    ("aux_negative", {"drafter.aux_layer_ids": [-1, 3, 5]}, "drafter.aux_layer_ids", "must be >= 0"),
    ("aux_order", {"drafter.aux_layer_ids": [2, 2, 5]}, "drafter.aux_layer_ids", "strictly increasing"),
    ("aux_scalar", {"drafter.aux_layer_ids": 3}, "drafter.aux_layer_ids", "expected a list of integers or null"),
    ("lr_zero", {"optim.lr": 0.0}, "optim.lr", "must be > 0"),
    ("betas", {"optim.betas": [0.9]}, "optim.betas", "two AdamW betas"),
    ("warmup", {"optim.warmup_steps": 500}, "optim.warmup_steps", "exceeds trainer.max_steps (100)"),
    ("no_length", {"trainer.max_steps": None, "trainer.max_epochs": None}, "trainer.max_steps",
     "set trainer.max_steps"),
    ("val_fraction", {"data.val_fraction": 1.5}, "data.val_fraction", "in [0, 1)"),
    ("missing_data", {"data.sources": [{"path": "no/such/file.jsonl"}]}, "data.sources[0].path", "data file not found"),
    ("source_no_path", {"data.sources": [{"format": "sharegpt"}]}, "data.sources[0].path", "required key missing"),
    ("bad_format", {"data.sources": [{"path": "sharegpt-embedded", "format": "csv"}]}, "data.sources[0].format",
     "one of auto, sharegpt, messages, jsonl"),
    ("devices", {"trainer.devices": 0}, "trainer.devices", "a count >= 1"),
    ("multinode_auto", {"trainer.num_nodes": 2}, "trainer.strategy", "multi-node training needs"),
    ("kv_heads", {"drafter.num_attention_heads": 9, "drafter.num_key_value_heads": 2}, "drafter.num_key_value_heads",
     "must divide num_attention_heads (9)"),
    ("missing_init", {"drafter.init_from": "./no/such/drafter"}, "drafter.init_from", "local path does not exist"),
    ("section_not_mapping", {"ttt": 7}, "ttt", "expected a mapping of TTTConfig fields"),
    ("unknown_loss", {"loss.name": "kl"}, "loss.name", "one of lk_hybrid, neg_log_alpha, soft_ce, tv"),
    ("unknown_loss_doc", {"loss.name": "soft-ce"}, "loss.name = 'soft-ce'",
     "did you mean 'soft_ce'?; to add a loss see docs/contributing/adding-a-loss.md"),
    ("lk_eta", {"loss.lk_eta": 0.0}, "loss.lk_eta", "must be > 0"),
    ("loss_param_rule", {"loss.name": "lk_hybrid", "loss.params.eta": 0.0}, "loss.params.eta = 0.0", "must be > 0"),
    ("loss_param_type", {"loss.name": "lk_hybrid", "loss.params.eta": "big"}, "loss.params.eta", "expected a number"),
    ("loss_param_unknown", {"loss.name": "lk_hybrid", "loss.params.etta": 1.0}, "loss.params.etta",
     "did you mean 'loss.params.eta'? (the parameters of loss 'lk_hybrid')"),
    ("loss_param_of_another_loss", {"loss.name": "tv", "loss.params.eta": 1.0}, "loss.params.eta",
     "loss 'tv' has no parameters (see docs/contributing/adding-a-loss.md)"),
    ("loss_params_not_mapping", {"loss.params": 3}, "loss.params", "expected a mapping"),
    ("lk_eta_and_params", {"loss.name": "lk_hybrid", "loss.lk_eta": 2.0, "loss.params.eta": 4.0}, "loss.lk_eta",
     "older spelling of loss.params.eta, which says 4.0: give only loss.params.eta"),
    ("fc_norm_not_bool", {"drafter.fc_norm": "yes"}, "drafter.fc_norm", "expected true or false"),
    ("precondition_fc_norm", {"optim.precondition_fc": True, "drafter.fc_norm": True}, "optim.precondition_fc",
     "cannot be combined with drafter.fc_norm"),
    # path kinds ({tmp}/afile is a file, {tmp}/adir a directory)
    ("cache_dir_file", {"data.cache_dir": "{tmp}/afile"}, "data.cache_dir = '{tmp}/afile'",
     "is a file; expected a directory"),
    ("cache_dir_under_file", {"data.cache_dir": "{tmp}/afile/cache"}, "data.cache_dir",
     "cannot be created: '{tmp}/afile' is a file; expected a directory"),
    ("features_dir_file", {"data.features_dir": "{tmp}/afile"}, "data.features_dir = '{tmp}/afile'",
     "is a file; expected a directory of feature shards"),
    ("regenerate_output_dir", {"data.regenerate.output": "{tmp}/adir"}, "data.regenerate.output = '{tmp}/adir'",
     "is a directory; expected a JSONL file path"),
    ("regenerate_output_under_file", {"data.regenerate.output": "{tmp}/afile/regen.jsonl"},
     "data.regenerate.output", "cannot be created: '{tmp}/afile' is a file"),
    ("target_file", {"target.name_or_path": "{tmp}/afile"}, "target.name_or_path = '{tmp}/afile'",
     "is a file; expected a local model folder with config.json, a Hub repo id 'org/name' or the embedded target "
     "('smollm2-135m-instruct' or 'embedded')"),
]


@pytest.mark.parametrize("updates,key,fragment", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_recipe_names_the_key(tmp_path, updates, key, fragment):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    key, fragment = key.replace("{tmp}", str(tmp_path)), fragment.replace("{tmp}", str(tmp_path))
    cfg = _base(tmp_path)
    for dotted, value in updates.items():
        _set(cfg, dotted, value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert isinstance(exc.value, ValueError)
    assert len(exc.value.problems) == 1, str(exc.value)
    line = str(exc.value.problems[0])
    assert line.startswith(f"{path}: {key}"), line
    assert fragment in line, line


def test_hub_ids_are_not_checked_as_paths(tmp_path):
    cfg = _base(tmp_path)
    cfg["data"]["sources"] = [{"path": "org/dataset"}, {"path": "sharegpt-embedded"}]
    cfg["drafter"] = {"init_from": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert load_recipe(path).data.sources[0].path == "org/dataset"


def test_path_kinds_accept_what_is_expected(tmp_path):
    """Existing folders/files of the right kind and paths still to be created pass; a read-only cache is not judged
    (a store prepared elsewhere is only read)."""
    cfg = _base(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "regen.jsonl").write_text("")
    cfg["data"].update(cache_dir=str(tmp_path / "cache"), features_dir=str(tmp_path / "new" / "features"),
                       regenerate={"output": str(tmp_path / "regen.jsonl")})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "cache").chmod(0o500)
    try:
        assert load_recipe(path).data.cache_dir == str(tmp_path / "cache")
    finally:
        (tmp_path / "cache").chmod(0o700)


def test_output_dir_not_writable(tmp_path, monkeypatch):
    cfg = _base(tmp_path)
    cfg["output_dir"] = str(tmp_path / "ro" / "run")
    (tmp_path / "ro").mkdir()
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    real_access = os.access
    monkeypatch.setattr(recipe_mod.os, "access", lambda p, mode: Path(p) != tmp_path / "ro" and real_access(p, mode))
    with pytest.raises(RecipeError, match=r"output_dir = .*not writable: no write permission on .*ro'"):
        load_recipe(path)


def test_output_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = _base(tmp_path)
    cfg["output_dir"] = str(tmp_path / "afile" / "run")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RecipeError, match="output_dir .*cannot be created: .* is a file"):
        load_recipe(path)


def test_yaml_syntax_error_has_line_number(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("target:\n  family: llama\ntrainer:\n  logger: [csv\n  max_steps: 3\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert f"{path}:5:" in str(exc.value) and "YAML syntax error at line 5" in str(exc.value)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match="empty recipe file"):
        load_recipe(path)


def test_interpolation_error(tmp_path):
    path = tmp_path / "interp.yaml"
    path.write_text("output_dir: runs/${nope}\n")
    with pytest.raises(RecipeError, match=f"{path}: output_dir: Interpolation key 'nope' not found"):
        load_recipe(path)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_all_problems_reported_at_once(tmp_path):
    cfg = _base(tmp_path)
    _set(cfg, "target.famly", "llama")
    _set(cfg, "trainer.strategy", "fsdb")
    _set(cfg, "drafter.draft_vocab_size", -5)
    _set(cfg, "ttt.steps", 3)
    _set(cfg, "ttt.step_weights", [1.0])
    _set(cfg, "data.max_length", "long")
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    keys = sorted(p.key for p in exc.value.problems)
    assert keys == ["data.max_length", "drafter.draft_vocab_size", "target.famly", "trainer.strategy",
                    "ttt.step_weights"]
    assert "invalid recipe (5 problems)" in str(exc.value)
    assert all(str(path) in str(p) for p in exc.value.problems)


def test_type_error_suppresses_dependent_checks(tmp_path):
    cfg = _base(tmp_path)
    _set(cfg, "ttt.steps", "seven")  # with steps unreadable, the length check of step_weights is moot
    _set(cfg, "ttt.step_weights", [1.0, 1.0])
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert [p.key for p in exc.value.problems] == ["ttt.steps"]


def test_family_comes_from_the_adapter_registry(tmp_path, monkeypatch):
    import eagle3_zoo.adapters as adapters

    monkeypatch.setattr(adapters, "available_adapters", lambda: ["llama", "mixtral"], raising=False)
    cfg = _base(tmp_path)
    _set(cfg, "target.family", "mixtral")
    path = tmp_path / "fam.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert load_recipe(path).target.family == "mixtral"


def test_validate_against_target():
    r = Recipe()
    r.drafter.aux_layer_ids = [2, 15, 27]
    validate_against_target(r.drafter, num_layers=30, vocab_size=49152, hidden_size=576)
    r.drafter.draft_vocab_size = 60000
    r.drafter.aux_layer_ids = [2, 15, 30]
    r.drafter.hidden_size = 512
    with pytest.raises(RecipeError) as exc:
        validate_against_target(r.drafter, num_layers=30, vocab_size=49152, hidden_size=576)
    text = str(exc.value)
    assert "drafter.draft_vocab_size = 60000: exceeds the target vocabulary (49152)" in text
    assert "drafter.aux_layer_ids = [2, 15, 30]: out of range for a 30-layer target (valid 0..29)" in text
    assert "drafter.hidden_size = 512: must equal the target hidden size (576)" in text


def test_save_resolved_recipe_round_trip(tmp_path):
    src = tmp_path / "interp.yaml"
    cfg = _base(tmp_path)
    cfg["output_dir"] = str(tmp_path) + "/runs/${target.family}"
    src.write_text(yaml.safe_dump(cfg))
    r = load_recipe(src, ["trainer.max_steps=123"])
    assert r.output_dir == f"{tmp_path}/runs/llama"
    out = save_resolved_recipe(r, tmp_path / "run" / "recipe.yaml")
    assert "${" not in out.read_text()
    assert [p.name for p in out.parent.iterdir()] == ["recipe.yaml"]  # no temp file left behind
    assert load_recipe(out) == r


def _ruled_fields(cls=Recipe, prefix=""):
    """(dotted key, section path, field name) of every field with a `> 0` rule, nested sections included."""
    import dataclasses

    for f in dataclasses.fields(cls):
        tp = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _ruled_fields(tp, f"{prefix}{f.name}.")
        elif f.metadata.get("check") is recipe_mod.GT0:
            yield prefix + f.name


RULED = list(_ruled_fields())


def test_rules_sit_on_their_fields():
    """Each `> 0` rule declared on a field is applied to that key, in every section (nested ones too)."""
    assert {"drafter.draft_vocab_size", "optim.lr", "trainer.tau_eval.num_prompts",
            "data.regenerate.batch_size"} <= set(RULED)
    for key in RULED:
        r = Recipe()
        *parents, leaf = key.split(".")
        section = r
        for p in parents:
            section = getattr(section, p)
        setattr(section, leaf, 0)
        with pytest.raises(RecipeError) as exc:
            validate_recipe(r)
        assert [(p.key, p.message) for p in exc.value.problems] == [(key, "must be > 0")], key


def test_recipe_module_does_not_import_torch():
    """The recipe (and the embedded names that adapters and data import from it) loads without torch."""
    import subprocess
    import sys

    code = "import sys, eagle3_zoo.recipe.sections; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0
