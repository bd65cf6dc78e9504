"""Export/import of drafter formats: canonical (SGLang), speculators (vLLM), official pytorch_model.bin, SpecForge."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from eagle3_zoo.checkpoint import convert_to_canonical, detect_format, export_drafter, import_drafter
from eagle3_zoo.checkpoint.formats import CANONICAL_KEYS
from eagle3_zoo.checkpoint.layouts import is_canonical
from eagle3_zoo.hub import load_any_drafter
from eagle3_zoo.modeling import Eagle3Drafter
from tests.hub_fixtures import canonical_dir, edit_config, official_dir, specforge_dir, step_logits


def assert_same_weights(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def test_canonical_speculators_canonical_round_trip(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    (src / "recipe.yaml").write_text("target:\n  name_or_path: tiny-org/tiny-llama\n")
    (src / "eval_results.json").write_text("{}")
    (src / "eval_results.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    assert detect_format(spec) == "speculators"
    assert {"recipe.yaml", "eval_results.json", "eval_results.png"} <= {p.name for p in spec.iterdir()}
    back = convert_to_canonical(spec, tmp_path / "back")
    assert is_canonical(back)
    again = Eagle3Drafter.from_pretrained(back)
    assert_same_weights(drafter, again)
    assert again.config.aux_layer_ids == drafter.config.aux_layer_ids
    assert again.config.target_name_or_path == drafter.config.target_name_or_path
    torch.testing.assert_close(step_logits(again), step_logits(drafter), rtol=0, atol=0)


def test_speculators_config_schema_and_keys(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "spec", num_speculative_tokens=4)
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["norm_before_residual"] is False  # vLLM defaults it to True when absent
    assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 32
    # speculators/vLLM count HF hidden-state indices = our internal ids (SGLang's field would be 1, 3, 4)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4}]
    assert sc["verifier"] == {"name_or_path": "tiny-org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    layer = LlamaConfig(**cfg["transformer_layer_config"])  # a valid LlamaConfig dict
    assert (layer.hidden_size, layer.vocab_size, layer.num_hidden_layers, layer.head_dim) == (32, 96, 1, 8)
    assert cfg["transformer_layer_config"]["rope_theta"] == 10000.0
    with safe_open(str(spec / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight"} <= keys
    assert not any(k.startswith("midlayer.") or "embed_tokens" in k for k in keys)
    assert len(keys) == len(CANONICAL_KEYS)


def test_speculators_export_needs_target_name(tmp_path):
    src, _ = canonical_dir(tmp_path, target_name_or_path=None)
    with pytest.raises(ValueError, match="target_name_or_path"):
        export_drafter(src, "speculators", tmp_path / "spec")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_official_bin_to_canonical_exact(tmp_path, dtype):
    _, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter, dtype=dtype)
    assert detect_format(official) == "official"
    imported = import_drafter(official)
    assert imported.config.rope_theta == 10000.0  # no rope setting in the official config
    reference = Eagle3Drafter(imported.config)
    reference.load_state_dict(drafter.state_dict())
    reference.to(dtype)
    assert_same_weights(imported, reference)  # embed_tokens.weight dropped, rest bit-exact
    out = convert_to_canonical(official, tmp_path / "canon")
    assert is_canonical(out)
    assert_same_weights(Eagle3Drafter.from_pretrained(out), reference)
    if dtype == torch.float32:
        torch.testing.assert_close(step_logits(imported), step_logits(drafter), rtol=0, atol=0)


def test_specforge_prefix_and_embedding_dropped(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    sf = specforge_dir(tmp_path, src)
    assert detect_format(sf) == "sglang" and not is_canonical(sf)
    imported = import_drafter(sf)
    assert_same_weights(imported, drafter)
    torch.testing.assert_close(step_logits(imported), step_logits(drafter), rtol=0, atol=0)
    assert is_canonical(export_drafter(sf, "sglang", tmp_path / "canon"))


def test_canonical_export_copies_bytes(tmp_path):
    src, _ = canonical_dir(tmp_path)
    out = export_drafter(src, "canonical", tmp_path / "out")
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    with pytest.raises(ValueError, match="unknown export format"):
        export_drafter(src, "gguf", tmp_path / "x")
    with pytest.raises(ValueError, match="drafter folder itself"):
        export_drafter(src, "sglang", src)


def test_non_canonical_speculators_variant_refused(tmp_path):
    src, _ = canonical_dir(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    edit_config(spec, lambda c: c.update(norm_before_residual=True))
    with pytest.raises(ValueError, match="norm_before_residual=true"):
        import_drafter(spec)


def test_import_rejects_unknown_keys_and_bad_vocab(tmp_path):
    from tests.hub_fixtures import edit_weights

    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s.__setitem__("midlayer.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected keys \\['midlayer.extra.weight'\\]"):
        import_drafter(src)
    src2, _ = canonical_dir(tmp_path, name="c2")
    edit_weights(src2, lambda s: s.__setitem__("d2t", s["d2t"] + 1000))
    with pytest.raises(ValueError, match="outside the target vocab"):
        import_drafter(src2)


def test_float_d2t_with_whole_values_is_converted(tmp_path):
    from tests.hub_fixtures import edit_weights

    src, drafter = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s.__setitem__("d2t", s["d2t"].float()))
    imported = import_drafter(src)
    assert imported.d2t.dtype == torch.int64 and torch.equal(imported.d2t, drafter.d2t)


def test_load_any_drafter_local_folder(tmp_path):
    _, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter)
    assert_same_weights(load_any_drafter(official, dtype=torch.float32), drafter)
