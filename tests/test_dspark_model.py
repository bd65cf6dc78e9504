"""The DSpark drafter (eagle3_zoo.drafters.dspark): its config, the `config.json` and weights in the layout vLLM
0.32's `qwen3_dspark.py` loads (a mirror of its `load_weights`, checked against the vLLM source when an engine venv
is present), the Markov and confidence heads by hand, and the saved folder read back."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.drafters.dspark.config import DSparkConfig
from eagle3_zoo.drafters.dspark.model import DSparkDrafter
from tests.test_dflash_model import _load_like_vllm, _vllm_parameters, _vllm_source


def _config(**kw) -> DSparkConfig:
    args = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=100,
                num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99, num_hidden_layers=2,
                block_size=4, rope_theta=10000.0, markov_rank=8, head_dim=32)
    args.update(kw)
    return DSparkConfig(**args)


def _random(cfg: DSparkConfig, seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    drafter = DSparkDrafter(cfg).double()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return drafter


# ---- vLLM 0.32 Qwen3DSparkForCausalLM (tp 1): the DFlash parameters plus the heads ----

def _vllm_dspark_parameters(cfg: DSparkConfig, file_has_confidence: bool = True) -> dict[str, tuple[int, ...]]:
    """The parameters a DSpark file fills in vLLM 0.32's `Qwen3DSparkForCausalLM`: `Qwen3DSparkModel` builds
    `markov_head` (`nn.Embedding(vocab_size, markov_rank)`, `ParallelLMHead(draft_vocab_size, markov_rank)`) always
    and `confidence_head.proj` (`ReplicatedLinear(hidden_size [+ markov_rank], 1, bias=True)`) when
    `enable_confidence_head`; its loader drops the confidence head when the file has none."""
    out = _vllm_parameters(cfg)
    out["model.markov_head.markov_w1.weight"] = (cfg.vocab_size, cfg.markov_rank)
    out["model.markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, cfg.markov_rank)
    if cfg.enable_confidence_head and file_has_confidence:
        inp = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        out["model.confidence_head.proj.weight"] = (1, inp)
        out["model.confidence_head.proj.bias"] = (1,)
    return out


HEADS = [dict(), dict(confidence_head_with_markov=False), dict(enable_confidence_head=False),
         dict(draft_vocab_size=40)]


@pytest.mark.parametrize("kw", HEADS)
def test_state_dict_is_what_vllm_qwen3_dspark_loads(kw):
    cfg = _config(**kw)
    state = DSparkDrafter(cfg).state_dict()
    assert _load_like_vllm(state) == _vllm_dspark_parameters(cfg)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: s for k, (s, _) in cfg.parameter_shapes().items()} \
        | ({"d2t": (40,)} if cfg.reduced_vocab else {})
    assert not any("rotary" in n or "embed_tokens" in n or "mask" in n for n in state)


def test_config_json_is_what_vllm_qwen3_dspark_reads_and_round_trips():
    cfg = _config(draft_vocab_size=40)
    d = cfg.to_json_dict()
    assert d["architectures"] == ["Qwen3DSparkModel"] and d["model_type"] == "qwen3"
    assert d["markov_rank"] == 8 and d["markov_head_type"] == "vanilla"
    assert d["enable_confidence_head"] is True and d["confidence_head_with_markov"] is True
    assert d["sample_from_anchor"] is True and "sample_from_anchor" not in d["dflash_config"]
    assert d["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3, 5]}  # vLLM aux ids 2, 4, 6
    assert d["block_size"] == 4 and cfg.num_draft == 4  # vLLM: num_speculative_tokens = block_size
    assert d["layer_types"] == ["full_attention"] * 2
    back = DSparkConfig.from_json_dict(json.loads(json.dumps(d)))
    assert back == cfg and back.extra == {}


@pytest.mark.parametrize("change, message", [
    ({"sample_from_anchor": False}, "sample_from_anchor"),
    ({"markov_head_type": "gated"}, "markov_head_type"),
    ({"markov_rank": 0}, "markov_rank"),
    ({"enable_confidence_head": "yes"}, "enable_confidence_head"),
])
def test_config_refusals_name_the_key(change, message):
    d = _config().to_json_dict() | change
    with pytest.raises(ValueError, match=message):
        DSparkConfig.from_json_dict(d)
    d = _config().to_json_dict()
    del d["markov_rank"]
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig.from_json_dict(d)


def test_markov_and_confidence_heads_by_hand():
    cfg = _config()
    drafter = _random(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.double)
    hidden = torch.randn(3, cfg.hidden_size, dtype=torch.double)
    prev = torch.tensor([5, 0, 98])
    logits, e = drafter.logits(hidden, prev, head)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    torch.testing.assert_close(e, w1[prev])
    torch.testing.assert_close(logits, (hidden @ head.T + w1[prev] @ w2.T).float())
    p = drafter.confidence_head.proj
    want = (torch.cat([hidden, w1[prev]], -1) @ p.weight.T + p.bias).squeeze(-1).float()
    torch.testing.assert_close(drafter.confidence_logits(hidden, e), want)
    no_markov = _random(_config(confidence_head_with_markov=False))
    p = no_markov.confidence_head.proj
    torch.testing.assert_close(no_markov.confidence_logits(hidden, e), (hidden @ p.weight.T + p.bias).squeeze(-1)
                               .float())
    with pytest.raises(ValueError, match="no confidence head"):
        _random(_config(enable_confidence_head=False)).confidence_logits(hidden, e)


def test_the_backbone_is_dflash_and_every_slot_is_a_prediction():
    """The DSpark backbone is DFlash's (same weights -> same slot states), and its block drafts B tokens."""
    cfg = _config()
    dspark = _random(cfg)
    dflash = DFlashDrafter(cfg).double()
    dflash.load_state_dict({k: v for k, v in dspark.state_dict().items() if not k.split(".")[0].endswith("_head")})
    aux = torch.randn(1, 7, 3 * 64, dtype=torch.double)
    embed = torch.randn(100, 64, dtype=torch.double)
    torch.testing.assert_close(dspark.draft_block(aux, torch.tensor([3]), embed),
                               dflash.draft_block(aux, torch.tensor([3]), embed))
    assert dspark.sample_from_anchor and not dflash.sample_from_anchor
    assert cfg.num_draft == cfg.block_size
    with pytest.raises(TypeError, match="DSparkConfig"):
        DSparkDrafter(dflash.config.__class__.__mro__[1](**{k: getattr(cfg, k) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "num_target_layers", "target_layer_ids", "mask_token_id")}))


@pytest.mark.parametrize("kw", [dict(), dict(draft_vocab_size=40)])
def test_the_saved_folder_reads_back_and_is_what_vllm_loads(tmp_path, kw):
    from safetensors.torch import load_file

    cfg = _config(torch_dtype="bfloat16", **kw)
    drafter = _random(cfg).float()
    drafter.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert _load_like_vllm(saved) == _vllm_dspark_parameters(cfg)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    back = DSparkDrafter.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(back, DSparkDrafter) and back.config == cfg
    for name, t in drafter.state_dict().items():
        want = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        torch.testing.assert_close(back.state_dict()[name], want)
    # a DFlash folder is not a DSpark one
    DFlashDrafter(DSparkConfig.__mro__[1](**{k: getattr(cfg, k) for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
        "num_target_layers", "target_layer_ids", "mask_token_id")})).save_pretrained(tmp_path / "dflash")
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkDrafter.from_pretrained(tmp_path / "dflash")


def _class_body(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _self_assigns(cls: ast.ClassDef) -> dict[str, ast.AST]:
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    out = {}
    for n in ast.walk(init):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and n.value:
                out.setdefault(t.attr, n.value)
    return out


def test_the_vllm_mirror_matches_vllm_032_qwen3_dspark_source():
    """The mirror above (and the config keys written) against vLLM 0.32's `qwen3_dspark.py`, its DSpark proposer
    and config code, read with `ast` and text (vLLM is not imported). Skipped without an engine venv."""
    dflash = _vllm_source()
    if dflash is None:
        pytest.skip("no vLLM source (.venv-vllm or EAGLE3_ZOO_VLLM_PYTHON)")
    assert "(0, 32, " in (dflash.parents[2] / "_version.py").read_text()
    path = dflash.parent / "qwen3_dspark.py"
    source = path.read_text()
    tree = ast.parse(source)
    markov = _self_assigns(_class_body(tree, "DSparkMarkovHead"))
    assert ast.unparse(markov["markov_w1"]) == "nn.Embedding(vocab_size, markov_rank)"
    assert ast.unparse(markov["markov_w2"]).startswith("ParallelLMHead(draft_vocab_size, markov_rank")
    conf = _self_assigns(_class_body(tree, "DSparkConfidenceHead"))
    assert ast.unparse(conf["proj"]).startswith("ReplicatedLinear(input_dim, 1,")
    assert "torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden" in source
    model = _self_assigns(_class_body(tree, "Qwen3DSparkModel"))
    assert "config.markov_rank" in ast.unparse(model["markov_head"])
    model_src = ast.unparse(_class_body(tree, "Qwen3DSparkModel"))
    for key in ("'enable_confidence_head', False", "'confidence_head_with_markov', False"):
        assert key in model_src, key
    assert "input_dim += config.markov_rank" in model_src and "bias=True" in model_src
    top = _class_body(tree, "Qwen3DSparkForCausalLM")
    assert [b.id for b in top.bases] == ["DFlashQwen3ForCausalLM"]
    assert {"lm_head", "draft_id_to_target_id", "model"} <= set(_self_assigns(top))
    load = ast.unparse(next(n for n in top.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights"))
    assert "name = name.replace('d2t', 'draft_id_to_target_id')" in load and "name = 'model.' + name" in load
    assert "self.model.confidence_head is None or not includes_confidence_head" in load
    vllm = path.parents[2]
    assert '"Qwen3DSparkModel": ("qwen3_dspark", "Qwen3DSparkForCausalLM")' in \
        (vllm / "model_executor/models/registry.py").read_text()
    speculator = (vllm / "v1/worker/gpu/spec_decode/dspark/speculator.py").read_text()
    assert '"sample_from_anchor", True' in speculator  # absent = anchor-as-first-prediction
    assert "prev = draft_sampled_i" in speculator and "logits_i = base_logits[:, i] + bias" in speculator
    dflash_spec = (vllm / "v1/worker/gpu/spec_decode/dflash/speculator.py").read_text()
    assert 'if dflash_config.get("sample_from_anchor", False):' in dflash_spec  # why it is written at top level
    spec_config = (vllm / "config/speculative.py").read_text()
    assert '"Qwen3DSparkModel" in self.draft_model_config.architectures' in spec_config
    assert 'block_size = getattr(hf_config, "block_size", None)' in spec_config
    utils = (vllm / "v1/worker/gpu/spec_decode/utils.py").read_text()
    assert 'if "mask_token_id" in dflash_config:' in utils
