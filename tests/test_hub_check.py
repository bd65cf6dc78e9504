"""The compatibility checker: one problem (own code, message and fix) per way a drafter silently fails."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3_zoo.checkpoint import UnsafeCheckpointError, check_drafter, export_drafter, import_drafter
from tests.hub_fixtures import (
    canonical_dir,
    edit_config,
    edit_weights,
    official_dir,
    specforge_dir,
    tiny_target_config,
)


def codes(report) -> set[str]:
    return set(report.codes)


def only(report, code: str):
    found = [p for p in report.problems if p.code == code]
    assert len(found) == 1, report
    assert found[0].message and found[0].fix
    return found[0]


def test_clean_drafter_has_no_problems(tmp_path):
    src, _ = canonical_dir(tmp_path)
    report = check_drafter(src, target_config=tiny_target_config())
    assert report.ok and report.problems == [], report
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    assert check_drafter(spec, tiny_target_config()).problems == []
    assert check_drafter(src / "model.safetensors").ok  # a file inside the folder works too


def test_missing_d2t(tmp_path):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s.pop("d2t"))
    p = only(check_drafter(src), "D2T_MISSING")
    assert p.severity == "error" and "tau close to 1" in p.message


def test_float_d2t(tmp_path):
    src, _ = canonical_dir(tmp_path)
    edit_weights(src, lambda s: s.__setitem__("d2t", s["d2t"].float()))
    report = check_drafter(src)
    assert "torch.float32" in only(report, "D2T_DTYPE").message
    assert codes(report) == {"D2T_DTYPE"}


def test_d2t_outside_vocab(tmp_path):
    src, _ = canonical_dir(tmp_path)

    def shift(state):
        state["d2t"][-1] += 40  # last draft id now maps past the 96-token vocab

    edit_weights(src, shift)
    p = only(check_drafter(src), "D2T_OUT_OF_RANGE")
    assert "d2t[63]=" in p.message and "0..95" in p.message


def test_d2t_t2d_disagree(tmp_path):
    src, _ = canonical_dir(tmp_path)

    def flip(state):
        t2d = state["t2d"].clone()
        first, free = int(t2d.nonzero()[0]), int((~t2d).nonzero()[0])
        t2d[first], t2d[free] = False, True
        state["t2d"] = t2d

    edit_weights(src, flip)
    assert "D2T_T2D_MISMATCH" in codes(check_drafter(src))


def test_wrong_architectures(tmp_path):
    src, _ = canonical_dir(tmp_path)
    edit_config(src, lambda c: c.update(architectures=["Qwen2ForCausalLM"]))
    assert only(check_drafter(src), "ARCHITECTURE").severity == "error"
    edit_config(src, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    report = check_drafter(src)
    assert report.ok and only(report, "ARCHITECTURE_NONCANONICAL").severity == "warning"


def test_unreadable_config_or_missing_weights_stop_the_check(tmp_path):
    """One problem (its own code) for each way the config cannot be read or translated; the architecture is
    still judged when only the translation fails."""
    src, _ = canonical_dir(tmp_path)
    (src / "model.safetensors").rename(tmp_path / "weights")
    assert codes(check_drafter(src)) == {"WEIGHTS_MISSING"}
    (tmp_path / "weights").rename(src / "model.safetensors")
    config = (src / "config.json").read_text()
    edit_config(src, lambda c: c.update(speculators_model_type="eagle"))
    assert "only 'eagle3'" in only(check_drafter(src), "CONFIG_INVALID").message
    (src / "config.json").write_text(config)
    edit_config(src, lambda c: (c.pop("hidden_size"), c.update(architectures=["Qwen2ForCausalLM"])))
    report = check_drafter(src)
    assert codes(report) == {"ARCHITECTURE", "CONFIG_INVALID"} and report.config is None
    assert "missing required keys ['hidden_size']" in only(report, "CONFIG_INVALID").message
    (src / "config.json").write_text("{not json")
    assert "not valid JSON" in only(check_drafter(src), "CONFIG_INVALID").message
    (src / "config.json").unlink()
    assert codes(check_drafter(src)) == {"CONFIG_MISSING"}


def test_hidden_size_mismatch(tmp_path):
    src, _ = canonical_dir(tmp_path)
    report = check_drafter(src, target_config=tiny_target_config(hidden_size=48, num_attention_heads=4))
    assert "target's hidden size is 48" in only(report, "HIDDEN_SIZE_MISMATCH").message
    assert "EMBED_SIZE_MISMATCH" in codes(report) and not report.ok


def test_vocab_mismatch(tmp_path):
    src, _ = canonical_dir(tmp_path)
    report = check_drafter(src, target_config=tiny_target_config(vocab_size=128).to_dict())  # a dict works too
    assert "vocab is 128" in only(report, "VOCAB_MISMATCH").message


def test_aux_layer_out_of_range(tmp_path):
    src, _ = canonical_dir(tmp_path)  # aux (2, 4, 5)
    report = check_drafter(src, target_config=tiny_target_config(num_hidden_layers=5))
    p = only(report, "AUX_LAYER_OUT_OF_RANGE")
    assert "[5]" in p.message and "0..4" in p.message and "stored as [1, 3, 4]" in p.message


def test_aux_layer_off_by_one_convention(tmp_path):
    # trained on the default HF indices (2, 4, 5) of an 8-layer target, but written into SGLang's field unshifted:
    # eagle_config holds [2, 4, 5], which SGLang reads as outputs of layers 2, 4, 5 = HF indices (3, 5, 6)
    src, _ = canonical_dir(tmp_path, aux_layer_ids=(3, 5, 6))
    p = only(check_drafter(src, target_config=tiny_target_config()), "AUX_LAYER_CONVENTION")
    assert "HF indices stored in SGLang's field" in p.message and "[1, 3, 4]" in p.fix
    # the reverse mistake in the speculators format: SGLang's [1, 3, 4] stored in vLLM's HF-index field
    src2, _ = canonical_dir(tmp_path, name="c2", aux_layer_ids=(1, 3, 4))
    spec = export_drafter(src2, "speculators", tmp_path / "spec")
    p = only(check_drafter(spec, target_config=tiny_target_config()), "AUX_LAYER_CONVENTION")
    assert "SGLang indices stored in vLLM's field" in p.message
    # custom (non-default) ids in the canonical layout: eagle3-zoo also writes vLLM's top-level field ...
    src3, _ = canonical_dir(tmp_path, name="c3", aux_layer_ids=(1, 4, 6))
    assert check_drafter(src3, tiny_target_config()).problems == []
    # ... a drafter from another tool with only eagle_config: upstream vLLM ignores it and feeds the defaults
    edit_config(src3, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    assert only(check_drafter(src3, tiny_target_config()), "VLLM_AUX_IDS_IGNORED").severity == "warning"


def test_unknown_and_missing_keys(tmp_path):
    src, _ = canonical_dir(tmp_path)

    def rename(state):  # a speculators-named tensor in the SGLang layout: SGLang would silently skip it
        state["layers.0.mlp.down_proj.weight"] = state.pop("midlayer.mlp.down_proj.weight")
        state["extra_head.weight"] = torch.zeros(3)

    edit_weights(src, rename)
    report = check_drafter(src)
    assert "layers.0.mlp.down_proj.weight" in only(report, "UNKNOWN_KEYS").message
    assert "midlayer.mlp.down_proj.weight" in only(report, "MISSING_KEYS").message


def test_shape_mismatch(tmp_path):
    src, _ = canonical_dir(tmp_path)
    edit_config(src, lambda c: c.update(intermediate_size=80))
    assert "midlayer.mlp.gate_proj.weight" in only(check_drafter(src), "SHAPE_MISMATCH").message


def test_truncated_and_corrupt_safetensors(tmp_path):
    src, _ = canonical_dir(tmp_path)
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    truncated = only(check_drafter(src), "CORRUPT_WEIGHTS").message
    assert "truncated" in truncated
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    corrupt = only(check_drafter(src), "CORRUPT_WEIGHTS").message
    assert "not JSON" in corrupt and corrupt != truncated
    path.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    report = check_drafter(src, target_config=tiny_target_config(vocab_size=128))
    assert "header claims" in only(report, "CORRUPT_WEIGHTS").message
    assert "VOCAB_MISMATCH" in codes(report)  # config-level problems come all at once, weights readable or not


class _Payload:
    """Unpickling this runs open(marker, "w"): proof that a loader executed code from the file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_code_is_refused_never_executed(tmp_path):
    _, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter)
    marker = tmp_path / "pwned"
    state = torch.load(official / "pytorch_model.bin", weights_only=True)
    state["payload"] = _Payload(str(marker))
    torch.save(state, official / "pytorch_model.bin")

    report = check_drafter(official)
    assert "refused" in only(report, "UNSAFE_PICKLE").message
    with pytest.raises(UnsafeCheckpointError):
        import_drafter(official)
    assert not marker.exists()
    # control: an unrestricted load of the same file does run the payload (so the test above can fail)
    torch.load(official / "pytorch_model.bin", weights_only=False)
    assert marker.exists()
    os.remove(marker)


def test_pickle_with_plain_non_tensor_values_is_refused(tmp_path):
    _, drafter = canonical_dir(tmp_path)
    official = official_dir(tmp_path, drafter)
    state = torch.load(official / "pytorch_model.bin", weights_only=True)
    state["step"] = 12  # allowed by weights_only, but not a tensor
    torch.save(state, official / "pytorch_model.bin")
    assert "not tensors" in only(check_drafter(official), "UNSAFE_PICKLE").message


def test_official_and_specforge_checkpoints_warn_but_pass(tmp_path):
    src, drafter = canonical_dir(tmp_path)
    official = check_drafter(official_dir(tmp_path, drafter), tiny_target_config())
    assert official.ok and codes(official) == {"ARCHITECTURE_NONCANONICAL", "EMBED_TOKENS_PRESENT"}
    sf = check_drafter(specforge_dir(tmp_path, src), tiny_target_config())
    assert sf.ok and codes(sf) == {"PREFIXED_KEYS", "EMBED_TOKENS_PRESENT"}


def test_rope_and_speculators_fields(tmp_path):
    src, _ = canonical_dir(tmp_path)
    target = tiny_target_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert "500000" in only(check_drafter(src, target), "ROPE_THETA_MISMATCH").message
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    edit_config(spec, lambda c: (c.pop("norm_before_residual"), c["speculators_config"].pop("verifier")))
    report = check_drafter(spec)
    assert {"NORM_BEFORE_RESIDUAL_MISSING", "SPECULATORS_CONFIG"} <= codes(report) and not report.ok
    edit_config(spec, lambda c: c.update(norm_before_residual=True))
    assert "norm_before_residual=true" in only(check_drafter(spec), "NON_CANONICAL_VARIANT").message

