"""The DSpark folder layout (`dspark`, eagle3_zoo.checkpoint.dflash_layouts.DSparkLayout): what
`DSparkDrafter.save_pretrained` writes and vLLM 0.32's qwen3_dspark loads, registered in the layout registry, told
apart from the z-lab DFlash layout (both carry a `dflash_config`), read back exactly, exported in its own layout only,
and checked by `eagle3-zoo check`: the config keys vLLM reads, the tensors it loads (the heads' included), the CPU
head sizes, the CPU build's refusal of DSpark, the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_zoo.checkpoint import check_drafter, detect_format, export_drafter, import_drafter
from eagle3_zoo.cli import main as cli
from eagle3_zoo.drafters.dspark.config import DSparkConfig
from eagle3_zoo.drafters.dspark.model import DSparkDrafter
from eagle3_zoo.values import layout_names


def _config(**kw) -> DSparkConfig:
    args = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, vocab_size=100,
                num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99, num_hidden_layers=2,
                block_size=4, rope_theta=10000.0, markov_rank=8, target_name_or_path="tiny-org/tiny-qwen3",
                target_model_type="qwen3")
    args.update(kw)
    return DSparkConfig(**args)


def _folder(root: Path, name: str = "src", **kw) -> tuple[Path, DSparkDrafter]:
    torch.manual_seed(0)
    drafter = DSparkDrafter(_config(**kw))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
        if drafter.d2t is not None:
            drafter.d2t.copy_(torch.arange(drafter.config.draft_vocab_size))  # draft id i -> target id 2i
    drafter.save_pretrained(root / name)
    return root / name, drafter


def _edit(folder: Path, config=None, weights=None) -> Path:
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        state = load_file(str(folder / "model.safetensors"))
        weights(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kw", [{}, {"draft_vocab_size": 40}, {"enable_confidence_head": False}])
def test_a_dspark_folder_is_its_own_layout_read_back_exactly_and_exported_in_it(tmp_path, kw):
    folder, drafter = _folder(tmp_path, **kw)
    assert detect_format(folder) == "dspark"
    back = import_drafter(folder)
    assert type(back) is DSparkDrafter and back.config == drafter.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
    report = check_drafter(folder)
    assert report.ok and not report.errors, report.problems
    out = export_drafter(folder, None, tmp_path / "out")  # the kind's default layout: its own
    assert detect_format(out) == "dspark"
    assert load_file(str(out / "model.safetensors")).keys() == load_file(str(folder / "model.safetensors")).keys()
    with pytest.raises(ValueError, match="a dspark drafter is written as one of: dspark"):
        export_drafter(folder, "speculators", tmp_path / "spec")
    with pytest.raises(ValueError, match="dspark drafter is written as one of"):
        export_drafter(folder, "dflash", tmp_path / "zlab")


def test_the_registry_names_the_dspark_layout_of_the_dspark_kind():
    info = layout_names.info("dspark")
    assert info.kind == "dspark" and info.writable and info.engines == ("vllm",)
    assert layout_names.layout_names("dspark") == ("dspark",) and layout_names.default_layout("dspark") == "dspark"


def test_the_zlab_dflash_layout_does_not_claim_a_dspark_folder(tmp_path):
    """A DSpark config carries the z-lab `dflash_config`: read as DFlash its heads would be unexpected tensors and
    vLLM's DFlash proposer would serve a drafter whose slot 0 is a prediction."""
    from eagle3_zoo.checkpoint.layouts import get_layout

    folder, _ = _folder(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    assert "dflash_config" in raw
    assert not get_layout("dflash").claims(raw, "config.json") and get_layout("dspark").claims(raw, "config.json")


def test_check_says_the_cpu_build_refuses_dspark_and_warns_of_the_head_size(tmp_path):
    folder, _ = _folder(tmp_path)  # head_dim 32: one vLLM's CPU attention supports
    codes = {p.code for p in check_drafter(folder).warnings}
    assert "CPU_ENGINE" in codes and "CPU_HEAD_DIM" not in codes
    odd, _ = _folder(tmp_path, "odd", hidden_size=60, num_attention_heads=2, head_dim=30)
    warning = next(p for p in check_drafter(odd).warnings if p.code == "CPU_HEAD_DIM")
    assert "head_dim=30" in warning.message


@pytest.mark.parametrize("edit, code, words", [
    (dict(weights=lambda s: s.pop("markov_head.markov_w1.weight")), "WEIGHTS_MISSING_KEYS",
     "markov_head.markov_w1.weight"),
    (dict(weights=lambda s: s.pop("confidence_head.proj.bias")), "WEIGHTS_MISSING_KEYS", "qwen3_dspark"),
    (dict(weights=lambda s: s.update({"markov_head.markov_w2.weight": torch.zeros(100, 4)})), "WEIGHT_SHAPE",
     "markov_head.markov_w2.weight has shape (100, 4), expected (100, 8)"),
    (dict(weights=lambda s: s.update({"markov_head.gate.weight": torch.zeros(8)})), "WEIGHT_UNEXPECTED",
     "markov_head.gate.weight is not a tensor vLLM 0.32's qwen3_dspark loads"),
    (dict(config=lambda r: r.update(architectures=["Qwen3DSparkForCausalLM"])), None, None),
    (dict(config=lambda r: r.pop("enable_confidence_head")), "DSPARK_FIELD_MISSING", "enable_confidence_head"),
    (dict(config=lambda r: r.update(model_type="llama")), "MODEL_TYPE", "Qwen3"),
    (dict(config=lambda r: r.update(sample_from_anchor=False)), "CONFIG_INVALID", "sample_from_anchor"),
    (dict(config=lambda r: r.pop("markov_rank")), "CONFIG_INVALID", "markov_rank"),
])
def test_check_names_what_vllms_dspark_loader_would_refuse(tmp_path, edit, code, words):
    folder = _edit(_folder(tmp_path)[0], **edit)
    if code is None:  # an architecture no layout claims as DSpark: read as a DFlash folder, its heads unexpected
        report = check_drafter(folder)
        assert report.format == "dflash" and "WEIGHT_UNEXPECTED" in {p.code for p in report.errors}
        return
    report = check_drafter(folder)
    found = [p for p in report.errors if p.code == code]
    assert found and words in found[0].message, report.problems


def test_a_mask_embedding_is_what_vllms_dspark_loader_skips(tmp_path):
    folder = _edit(_folder(tmp_path)[0], weights=lambda s: s.update({"mask_embedding": torch.zeros(64)}))
    report = check_drafter(folder)
    assert not report.errors and "WEIGHT_IGNORED" in {p.code for p in report.warnings}
    bad = _edit(_folder(tmp_path, "bad")[0], weights=lambda s: s.update({"embed_tokens.weight": torch.zeros(100, 64)}))
    problem = next(p for p in check_drafter(bad).errors if p.code == "WEIGHT_UNEXPECTED")
    assert "markov_head.markov_w1, markov_head.markov_w2, confidence_head.proj" in problem.fix


def test_check_against_a_target_names_width_vocab_and_depth(tmp_path, capsys):
    folder, _ = _folder(tmp_path)
    good = {"hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 8}
    assert not check_drafter(folder, good).errors
    codes = {p.code for p in check_drafter(folder, {**good, "vocab_size": 101, "num_hidden_layers": 4}).errors}
    assert {"TARGET_VOCAB", "TARGET_LAYERS", "TARGET_LAYER_IDS"} <= codes
    assert cli(["check", str(folder)]) == 0
    assert "vLLM 0.32's CPU build refuses DSpark" in capsys.readouterr().out


def test_no_model_card_of_another_drafter_is_rendered_for_a_dspark_folder(tmp_path):
    from eagle3_zoo.hub.card import render_card

    folder, _ = _folder(tmp_path)
    with pytest.raises(ValueError, match="a dspark drafter .* its model card is not written yet"):
        render_card(folder)
