"""The DFlash folder layouts (eagle3_zoo.checkpoint.dflash_layouts): the z-lab layout `DFlashDrafter.save_pretrained`
writes and the speculators layout, registered in the layout registry; conversion both ways (weights bit for bit), the
refusals, `check` (config, the tensors vLLM 0.32's qwen3_dflash loads, the CPU head sizes, the target), the
speculators config against vLLM 0.32's own converter when the engine venv is here, the offline config fixtures of
z-lab's published drafters (`check --config-only`), the zoo entries, `pull` by kind, `publish` and the model card."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_zoo.checkpoint import check_drafter, detect_format, export_drafter, import_drafter
from eagle3_zoo.checkpoint.dflash_check import CPU_ATTENTION_HEAD_SIZES
from eagle3_zoo.checkpoint.dflash_layouts import speculators_dflash_config, zlab_config
from eagle3_zoo.cli import main as cli
from eagle3_zoo.drafters.dflash.config import DFlashConfig
from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.values import layout_names
from tests.hub_fixtures import canonical_dir

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "dflash"


def _vllm_venv() -> Path | None:
    """The engine venv (scripts/setup_engine.sh's .venv-vllm, or the venv of EAGLE3_ZOO_VLLM_PYTHON), if here."""
    python = os.environ.get("EAGLE3_ZOO_VLLM_PYTHON")
    for venv in ([Path(python).absolute().parents[1]] if python else []) + [ROOT / ".venv-vllm"]:
        if glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "vllm")):
            return venv
    return None


VENV = _vllm_venv()
VLLM = Path(glob.glob(str(VENV / "lib" / "python3*" / "site-packages" / "vllm"))[0]) if VENV else Path("/nonexistent")


def _config(**kw) -> DFlashConfig:
    args = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, vocab_size=100,
                num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99, num_hidden_layers=2,
                block_size=4, rope_theta=10000.0, target_name_or_path="tiny-org/tiny-qwen3", target_model_type="qwen3")
    args.update(kw)
    return DFlashConfig(**args)


def _folder(root: Path, name: str = "src", seed: int = 0, **kw) -> tuple[Path, DFlashDrafter]:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(_config(**kw))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()  # every tensor distinct, so a swapped or dropped one shows
        if drafter.d2t is not None:
            drafter.d2t.copy_(torch.arange(drafter.config.draft_vocab_size) * 2 - torch.arange(
                drafter.config.draft_vocab_size))  # draft id i -> target id 2i
    drafter.save_pretrained(root / name)
    return root / name, drafter


def _edit_weights(folder: Path, fn) -> None:
    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(folder: Path, fn) -> None:
    raw = json.loads((folder / "config.json").read_text())
    fn(raw)
    (folder / "config.json").write_text(json.dumps(raw))


# ---- layouts, conversion -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_zlab_folder_round_trips_through_the_speculators_layout_bit_for_bit(tmp_path, draft_vocab_size):
    src, drafter = _folder(tmp_path, draft_vocab_size=draft_vocab_size)
    assert detect_format(src) == "dflash"
    report = check_drafter(src)
    assert report.ok and not report.problems, report
    spec = export_drafter(src, "speculators", tmp_path / "spec", num_speculative_tokens=None)
    assert detect_format(spec) == "speculators-dflash"
    raw = json.loads((spec / "config.json").read_text())
    cfg = drafter.config
    assert raw["speculators_model_type"] == "dflash" and raw["sliding_window_non_causal"] is True
    assert raw["aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's aux id = z-lab target_layer_id + 1
    assert (raw["block_size"], raw["mask_token_id"], raw["draft_vocab_size"]) == (4, 99, cfg.draft_vocab_size)
    assert raw["transformer_layer_config"]["model_type"] == "qwen3"
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # one block: B - 1
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "tiny-org/tiny-qwen3"
    report = check_drafter(spec)
    assert report.ok and not report.problems, report
    back = export_drafter(spec, "z-lab", tmp_path / "back")
    assert detect_format(back) == "dflash"
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for folder in (src, spec, back):
        loaded = import_drafter(folder)
        assert isinstance(loaded, DFlashDrafter) and loaded.config == cfg
        for k, v in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), (folder, k)
    # the default layout of a DFlash drafter is the z-lab one (export and publish without --format)
    assert detect_format(export_drafter(spec, None, tmp_path / "default")) == "dflash"


def test_the_registry_names_both_layouts_and_each_kind_writes_only_its_own(tmp_path):
    assert layout_names.layout_names("dflash") == ("dflash", "speculators-dflash")
    assert layout_names.export_names("dflash") == {
        "dflash": "dflash", "z-lab": "dflash", "zlab": "dflash", "speculators-dflash": "speculators-dflash",
        "dflash-speculators": "speculators-dflash", "speculators": "speculators-dflash"}
    assert "speculators" not in layout_names.export_names("eagle3").values() or \
        layout_names.export_names("eagle3")["speculators"] == "speculators"
    src, _ = _folder(tmp_path)
    with pytest.raises(ValueError, match="'sglang' is a layout of eagle3 drafters; a dflash drafter is written as one "
                                         "of: dflash, z-lab, zlab, speculators-dflash"):
        export_drafter(src, "sglang", tmp_path / "x")
    eagle, _ = canonical_dir(tmp_path)
    with pytest.raises(ValueError, match="'dflash' is a layout of dflash drafters; a eagle3 drafter is written as"):
        export_drafter(eagle, "dflash", tmp_path / "y")


def test_speculators_config_is_what_vllms_converter_turns_into_the_zlab_fields():
    """vLLM 0.32's `update_dflash` (transformers_utils/configs/speculators/algos.py, a module without imports) run on
    our speculators config gives the z-lab fields of the same drafter; skipped without the engine venv."""
    algos = VLLM / "transformers_utils" / "configs" / "speculators" / "algos.py"
    if not algos.is_file():
        pytest.skip(f"no vLLM source at {algos}")
    spec = importlib.util.spec_from_file_location("vllm_speculators_algos", algos)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = _config(target_layer_ids=(0, 4, 7))
    raw = speculators_dflash_config(cfg)
    pre = dict(raw["transformer_layer_config"])
    module.SUPPORTED_SPECULATORS_TYPES["dflash"](config_dict=raw, pre_trained_config=pre)
    assert pre["architectures"] == ["DFlashDraftModel"]
    assert pre["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [0, 4, 7], "sample_from_anchor": False,
                                    "causal": False}
    assert pre["eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]
    assert DFlashConfig.from_json_dict(zlab_config(raw)) == cfg


def test_the_speculators_export_refuses_what_it_cannot_represent(tmp_path):
    with pytest.raises(ValueError, match="no target_name_or_path; pass --verifier"):
        speculators_dflash_config(_config(target_name_or_path=None))
    with pytest.raises(ValueError, match=r"keys \['my_option'\] have no place in the speculators layout"):
        speculators_dflash_config(_config(extra={"my_option": 1}))
    with pytest.raises(ValueError, match="num_speculative_tokens=4; a DFlash block of block_size=4 drafts 1..3"):
        speculators_dflash_config(_config(), num_speculative_tokens=4)
    src, _ = _folder(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    for key, value in (("sliding_window_non_causal", False), ("sample_from_anchor", True)):
        bad = export_drafter(spec, "speculators", tmp_path / f"bad-{key}")
        _edit_config(bad, lambda raw, k=key, v=value: raw.update({k: v}))
        report = check_drafter(bad)
        assert report.codes == ["CONFIG_INVALID"], report
        assert f"config.json: {key} = {value!r}" in report.errors[0].message
        with pytest.raises(ValueError, match=f"refusing to export an invalid drafter: CONFIG_INVALID: .*{key}"):
            export_drafter(bad, "dflash", tmp_path / f"out-{key}")
    zlab = export_drafter(src, "dflash", tmp_path / "swa")
    _edit_config(zlab, lambda raw: raw.update(use_sliding_window=True, sliding_window=8))
    assert "sliding-window draft layers" in check_drafter(zlab).errors[0].message
    _edit_config(zlab, lambda raw: raw.update(use_sliding_window=False, dflash_config={
        **raw["dflash_config"], "use_swa": True}))
    assert "dflash_config has use_swa" in check_drafter(zlab).errors[0].message


# ---- check -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("edit", "code", "words"), [
    (lambda s: s.update(mask_hidden=torch.zeros(64)), "WEIGHT_UNEXPECTED", "mask_hidden is not a tensor vLLM"),
    (lambda s: s.update({"layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(16)}), "WEIGHT_UNEXPECTED",
     "RoPE frequencies"),
    (lambda s: s.update({"embed_tokens.weight": torch.zeros(100, 64)}), "WEIGHT_UNEXPECTED",
     "vLLM would load in place of the target's"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(100, 64)}), "WEIGHT_UNEXPECTED",
     "lm_head and d2t only with a reduced draft vocabulary"),
    (lambda s: s.pop("layers.1.mlp.up_proj.weight"), "WEIGHTS_MISSING_KEYS", "missing layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"fc.weight": torch.zeros(64, 128)}), "WEIGHT_SHAPE",
     "fc.weight has shape (64, 128), expected (64, 192)"),
])
def test_check_names_the_file_and_key_of_every_tensor_vllm_would_not_load(tmp_path, edit, code, words):
    src, _ = _folder(tmp_path)
    _edit_weights(src, edit)
    report = check_drafter(src)
    assert report.codes == [code], report
    assert words in report.errors[0].message and str(src / "model.safetensors") in report.errors[0].message


def test_check_of_a_reduced_vocabulary_reads_d2t(tmp_path):
    src, _ = _folder(tmp_path, draft_vocab_size=40)
    _edit_weights(src, lambda s: s.update(t2d=torch.ones(100, dtype=torch.bool)))
    report = check_drafter(src)
    assert report.ok and report.codes == ["WEIGHT_IGNORED"], report  # vLLM skips t2d
    _edit_weights(src, lambda s: s.pop("t2d"))
    _edit_weights(src, lambda s: s.update(d2t=s["d2t"].float()))
    assert check_drafter(src).codes == ["D2T_DTYPE"]
    _edit_weights(src, lambda s: s.update(d2t=torch.full((40,), 90, dtype=torch.int64)))
    report = check_drafter(src)
    assert report.codes == ["D2T_OUT_OF_RANGE"] and "30 draft ids map outside" in report.errors[0].message


@pytest.mark.parametrize(("edit", "code", "words"), [
    (lambda r: r.update(block_size=1), "CONFIG_INVALID", "block_size=1; expected an integer >= 2"),
    (lambda r: r["dflash_config"].update(mask_token_id=100), "CONFIG_INVALID",
     "mask_token_id=100; expected an id in 0..vocab_size-1=99"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 8]), "CONFIG_INVALID",
     "expected distinct decoder-layer ids in 0..num_target_layers-1=7"),
    (lambda r: r.update(architectures=["Qwen3ForCausalLM"]), "ARCHITECTURE", "['DFlashDraftModel'] only"),
    (lambda r: r.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "AUX_IDS_CONFLICT",
     "as hidden-state indices (= target_layer_id + 1 = [2, 4, 6])"),
    (lambda r: r.update(head_dim=None, num_attention_heads=3, num_key_value_heads=3), "HEAD_DIM",
     "hidden_size=64 is not a multiple of num_attention_heads=3"),
])
def test_check_names_what_is_valid_in_the_config(tmp_path, edit, code, words):
    src, _ = _folder(tmp_path)
    _edit_config(src, edit)
    report = check_drafter(src, config_only=True)
    assert code in report.codes and not report.ok, report
    message = next(p.message for p in report.problems if p.code == code)
    assert words in message and str(src / "config.json") in message, message


def test_check_warns_of_a_head_size_vllms_cpu_attention_does_not_run(tmp_path):
    src, _ = _folder(tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    report = check_drafter(src)
    assert report.ok and report.codes == ["CPU_HEAD_DIM"], report
    assert "head_dim=16: vLLM 0.32's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, " \
           "256, 512 only" in report.warnings[0].message


def test_the_cpu_head_sizes_are_vllms():
    source = VLLM / "v1" / "attention" / "backends" / "cpu_attn.py"
    if not source.is_file():
        pytest.skip(f"no vLLM source at {source}")
    text = source.read_text()
    listed = re.search(r"def get_supported_head_sizes\(cls\) -> list\[int\]:\s+return \[([0-9, ]+)\]", text)
    assert listed is not None, f"{source}: get_supported_head_sizes not found"
    assert tuple(int(x) for x in listed.group(1).split(",")) == CPU_ATTENTION_HEAD_SIZES


def test_check_against_a_target_names_width_vocab_and_depth(tmp_path):
    src, _ = _folder(tmp_path)
    good = {"hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 8}
    assert check_drafter(src, good).ok
    report = check_drafter(src, {"hidden_size": 32, "vocab_size": 50, "num_hidden_layers": 4})
    assert report.codes == ["TARGET_HIDDEN_SIZE", "TARGET_WIDTH", "TARGET_VOCAB", "TARGET_LAYERS",
                            "TARGET_LAYER_IDS"], report
    assert "target_layer_ids [5] are outside the target's decoder layers 0..3" in str(report)


# ---- offline fixtures of published drafters, the zoo, pull ---------------------------------------------------------


@pytest.mark.parametrize(("fixture", "target", "other"), [
    ("z-lab--Qwen3-8B-DFlash-b16", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct"),
    ("z-lab--LLaMA3.1-8B-Instruct-DFlash-UltraChat", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B"),
])
def test_published_drafter_configs_check_offline(fixture, target, other, monkeypatch, capsys):
    """Config-only checks of z-lab drafter configs (tests/fixtures/dflash/README.md says which values are documented
    and which assumed: they are not verbatim copies), against the shipped target configs (no network)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = FIXTURES / fixture
    report = check_drafter(folder, target, config_only=True)
    assert report.format == "dflash" and report.ok and not report.problems, report
    assert report.config.torch_dtype == "bfloat16"  # z-lab writes transformers 5's `dtype`
    assert {"TARGET_LAYERS", "TARGET_VOCAB"} <= set(check_drafter(folder, other, config_only=True).codes)
    assert cli(["check", str(folder), "--config-only", "--target", target]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert cli(["check", str(folder)]) == 1  # without --config-only the weights are required
    assert "WEIGHTS_MISSING" in capsys.readouterr().out
    # the speculators layout carries everything these configs say
    cfg = report.config
    assert DFlashConfig.from_json_dict(zlab_config(speculators_dflash_config(cfg, verifier=target))) == cfg


def test_the_zoo_lists_the_published_dflash_drafters_by_kind():
    from eagle3_zoo.hub.zoo import find_zoo
    from eagle3_zoo.values.zoo_registry import ZooRegistryError, read_registry

    for repo in ("z-lab/Qwen3-8B-DFlash-b16", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"):
        entry = find_zoo(repo)
        assert entry is not None and (entry.kind, entry.format, entry.status) == ("dflash", "dflash", "published")
        assert (FIXTURES / repo.replace("/", "--") / "config.json").is_file()
    bad = ("drafters:\n- {name: a, repo_id: org/a, target: org/t, family: qwen3, format: sglang, recipe: null, "
           "status: published, verified: false, source: here, kind: dflash}\n")
    with pytest.raises(ZooRegistryError, match="drafters\\[0\\].kind = 'dflash': format 'sglang' is a layout of "
                                               "eagle3 drafters; formats of dflash drafters: dflash, "
                                               "speculators-dflash"):
        read_registry(bad)


@pytest.fixture
def hub(monkeypatch):
    from tests.hub_server import LoopbackHub

    monkeypatch.setenv("HF_TOKEN", "hf_LoopbackTestToken0123456789abcdef")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    with LoopbackHub() as server:
        yield server


def test_publish_and_pull_a_dflash_drafter_checked_by_its_zoo_kind(tmp_path, hub):
    from huggingface_hub import HfApi

    from eagle3_zoo.hub import publish, pull

    src, drafter = _folder(tmp_path)
    repo = "z-lab/Qwen3-8B-DFlash-b16"  # where the zoo says the release lives
    publish(src, repo, endpoint=hub.url, fmt="speculators")
    result = pull("dflash-qwen3-8b-b16", endpoint=hub.url, out_dir=tmp_path / "dl", convert_to="z-lab")
    assert result.format == "speculators-dflash" and result.report.ok, result.report
    assert result.converted_path == tmp_path / "dl" / "dflash"
    assert (result.converted_path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    card = (result.path / "README.md").read_text()
    assert '"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 3' in card
    # an EAGLE-3 folder where the zoo lists a DFlash drafter is refused by kind
    eagle, _ = canonical_dir(tmp_path)
    other = "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    HfApi(endpoint=hub.url).create_repo(other)
    HfApi(endpoint=hub.url).upload_folder(repo_id=other, folder_path=eagle)
    result = pull(other, endpoint=hub.url, out_dir=tmp_path / "dl2")
    assert "ZOO_KIND_MISMATCH" in result.report.codes and not result.report.ok
    assert "as a dflash drafter (dflash layout), but the download is a eagle3 drafter folder (sglang layout)" in \
        str(result.report)


# ---- card, CLI -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "engines_tags", "sglang"), [
    ("dflash", ["vllm", "sglang"], True), ("speculators", ["vllm", "speculators"], False)])
def test_the_card_names_the_kind_the_method_and_no_unmeasured_figure(tmp_path, fmt, engines_tags, sglang):
    from huggingface_hub import ModelCard

    from eagle3_zoo.hub.upload import stage

    src, _ = _folder(tmp_path)
    (src / "eval_results.json").write_text(json.dumps({  # measured on other weights: left off the card
        "settings": {"drafter_tensors_sha256": "0" * 64}, "benchmarks": {"mtbench": {"tau": 9.9}}}))
    files = stage(src, tmp_path / "stage", repo_id="org/tiny-dflash", fmt=fmt, published=True)
    assert set(files) >= {"README.md", "config.json", "model.safetensors"}
    card = ModelCard.load(tmp_path / "stage" / "README.md")
    assert card.data.tags == ["dflash", "speculative-decoding", "draft-model", "eagle3-zoo", "qwen3", *engines_tags]
    assert "eagle3" not in card.data.tags
    text = card.text
    assert "**Drafter kind:** DFlash (block drafter)" in text
    assert ("--speculative-config '{\"method\": \"dflash\", \"model\": \"org/tiny-dflash\", "
            "\"num_speculative_tokens\": 3}'") in text
    assert "without it vLLM serves the folder as a plain draft model" in text
    assert ("--speculative-algorithm DFLASH" in text) is sglang
    assert "9.9" not in text and "this card states no acceptance length or speedup" in text
    assert "trained by eagle3-zoo" not in text  # no training record next to these weights


def test_cli_export_writes_the_kinds_layouts(tmp_path, capsys):
    src, _ = _folder(tmp_path)
    assert cli(["export", str(src), "--out", str(tmp_path / "a")]) == 0
    assert detect_format(tmp_path / "a") == "dflash" and "(dflash format)" in capsys.readouterr().out
    assert cli(["export", str(src), "--format", "speculators", "--out", str(tmp_path / "b"),
                "--num-speculative-tokens", "2"]) == 0
    raw = json.loads((tmp_path / "b" / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert cli(["check", str(tmp_path / "b")]) == 0
    assert cli(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "c")]) == 2
    assert "a dflash drafter is written as one of" in capsys.readouterr().err


_VLLM_READS = """
import json, sys
from transformers import AutoConfig
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
zlab, spec = sys.argv[1:3]
z = AutoConfig.from_pretrained(zlab)
s = SpeculatorsConfig.from_pretrained(spec)
print(json.dumps({"zlab": [z.architectures, z.dflash_config, z.layer_types],
                  "spec": [s.architectures, s.dflash_config, s.eagle_aux_hidden_state_layer_ids],
                  "method": SpeculatorsConfig.extract_vllm_speculative_config(json.load(open(spec + "/config.json")))}))
"""


@pytest.mark.engine
def test_vllm_reads_both_layouts_as_the_same_bidirectional_drafter(tmp_path):
    """vLLM 0.32's own config readers (the engine venv's python; no model is built) on both layouts."""
    if VENV is None:
        pytest.skip("no engine venv (.venv-vllm or EAGLE3_ZOO_VLLM_PYTHON)")
    src, _ = _folder(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", _VLLM_READS, str(src), str(spec)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["zlab"] == [["DFlashDraftModel"], {"mask_token_id": 99, "target_layer_ids": [1, 3, 5]},
                           ["full_attention", "full_attention"]]
    assert got["spec"] == [["DFlashDraftModel"], {"mask_token_id": 99, "target_layer_ids": [1, 3, 5],
                                                  "sample_from_anchor": False, "causal": False}, [2, 4, 6]]
    assert got["method"] == {"method": "dflash", "num_speculative_tokens": 3}
