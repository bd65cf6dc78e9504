"""`eval --engine vllm` / `check --engine vllm` with a DFlash folder, without vLLM: the folder is recognised by its
config.json (z-lab or speculators layout), served as shipped with method "dflash" and num_speculative_tokens =
block_size - 1, and vLLM's counters are read as for EAGLE-3. (The engine tier serves one:
tests/test_engine_dflash.py.)"""

from __future__ import annotations

import json

import pytest
from openai_fake import FakeOpenAIServer

from eagle3_zoo.speculative import engine_eval
from eagle3_zoo.speculative.engine_eval import dflash_layout

TARGET = "smollm2-135m-instruct"


def _zlab(tmp_path, block_size=4):
    import torch

    from eagle3_zoo.drafters.dflash.config import DFlashConfig
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
                          vocab_size=100, num_target_layers=8, target_layer_ids=(1, 3, 5), mask_token_id=99,
                          num_hidden_layers=1, block_size=block_size, target_name_or_path=TARGET)
    return DFlashDrafter(config).save_pretrained(tmp_path / "zlab")


def _write(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _speculators(zlab, out, **changes):
    """The speculators-layout export of the z-lab folder `zlab`, its config.json edited by `changes`."""
    from eagle3_zoo.checkpoint.layouts import get_layout
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

    out.mkdir(parents=True)
    get_layout("speculators-dflash").write(DFlashDrafter.from_pretrained(zlab), out, verifier="Qwen/Qwen3-8B")
    cfg = json.loads((out / "config.json").read_text())
    return _write(out, {**cfg, **changes})


def test_dflash_folders_are_recognised_by_the_layout_registry(tmp_path):
    zlab = _zlab(tmp_path, block_size=6)
    assert dflash_layout(zlab) == {"layout": "z-lab", "block_size": 6, "target": TARGET}
    assert dflash_layout(_speculators(zlab, tmp_path / "spec")) == {"layout": "speculators", "block_size": 6,
                                                                    "target": TARGET}
    # a speculators folder this package did not write: the target is its verifier
    assert dflash_layout(_speculators(zlab, tmp_path / "theirs", eagle3_zoo={"num_target_layers": 8}))["target"] \
        == "Qwen/Qwen3-8B"
    eagle3 = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}
    assert dflash_layout(_write(tmp_path / "eagle3", eagle3)) is None
    with pytest.raises(FileNotFoundError, match="no config.json"):
        dflash_layout(tmp_path / "missing")
    # what the layouts refuse to read is not served either: a causal speculators drafter, a config without the
    # DFlash fields, sliding-window draft layers (vLLM would serve each as something this package never trained)
    with pytest.raises(ValueError, match=r"sliding_window_non_causal = False"):
        dflash_layout(_speculators(zlab, tmp_path / "causal", sliding_window_non_causal=False))
    with pytest.raises(ValueError, match=r"dflash_config = None; expected an object"):
        dflash_layout(_write(tmp_path / "bad", {"architectures": ["DFlashDraftModel"]}))
    raw = json.loads((zlab / "config.json").read_text())
    with pytest.raises(ValueError, match="use_sliding_window"):
        dflash_layout(_write(tmp_path / "swa", {**raw, "use_sliding_window": True, "sliding_window": 4}))


@pytest.fixture
def recorded(monkeypatch):
    """engine_eval's servers attach to a fake OpenAI server; the arguments each would have been started with are
    recorded."""
    calls = []
    real = engine_eval.VLLMServer

    def fake_server(model, *, url=None, **kwargs):
        calls.append({"model": model, **kwargs})
        return real(model, url=server.url, **{k: v for k, v in kwargs.items() if k != "url"})

    with FakeOpenAIServer() as server:
        server.metrics_text = ('vllm:spec_decode_num_drafts_total{engine="0"} 4\n'
                               'vllm:spec_decode_num_draft_tokens_total{engine="0"} 12\n'
                               'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 5\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 3\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 0\n')
        monkeypatch.setattr(engine_eval, "VLLMServer", fake_server)
        yield calls, server


def test_a_dflash_folder_is_served_with_method_dflash_and_block_size_minus_one(tmp_path, recorded):
    calls, server = recorded
    folder = _zlab(tmp_path)
    res = engine_eval.evaluate_in_vllm(folder, max_new_tokens=4, baseline=False, work_dir=tmp_path / "work",
                                       prompts={"a": [5, 6, 7], "b": [8, 9]})
    assert calls[0]["speculative_config"] == {"method": "dflash", "model": str(folder.resolve()),
                                              "num_speculative_tokens": 3}
    assert not (tmp_path / "work" / "drafter").exists()  # served as shipped, nothing exported
    s, o = res["settings"], res["overall"]
    assert (s["method"], s["num_speculative_tokens"], s["block_size"], s["drafter_format_served"]) == \
        ("dflash", 3, 4, "dflash-z-lab")
    assert [c["prompt"] for c in server.completions] == [[5, 6, 7], [8, 9]]  # exactly the token-id prompts
    assert [r["id"] for r in res["requests"]] == ["a", "b"] and all("token_ids" in r for r in res["requests"])
    # the counters as the fake server reports them (no difference before/after: it serves constant text)
    assert o["requests"] == 2 and o["drafts"] == 0


def test_a_dflash_folder_refuses_another_draft_length(tmp_path, recorded):
    calls, _ = recorded
    with pytest.raises(ValueError, match=r"block_size 4 drafts 3 tokens.*num_speculative_tokens=5 given"):
        engine_eval.evaluate_in_vllm(_zlab(tmp_path), num_speculative_tokens=5, baseline=False,
                                     work_dir=tmp_path / "work", prompts={"a": [5]})
    assert calls == []  # refused before any server
    engine_eval.evaluate_in_vllm(_zlab(tmp_path / "again"), num_speculative_tokens=3, max_new_tokens=2,
                                 baseline=False, work_dir=tmp_path / "work", prompts={"a": [5]})
    assert calls[0]["speculative_config"]["num_speculative_tokens"] == 3


def test_engine_compare_decodes_a_dflash_folder_with_our_decoder_on_the_engines_prompts(tmp_path):
    """`eval --engine vllm --engine-compare` with a DFlash folder: our DFlashGenerator on exactly the prompt ids the
    engine was sent, lossless against plain decoding (a random one-layer drafter on the embedded SmolLM2)."""
    import torch

    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.drafters.dflash.config import DFlashConfig
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter

    model, tok, _ = load_target(TARGET, dtype=torch.float32)
    torch.manual_seed(0)
    config = DFlashConfig.from_target_config(model.config, mask_token_id=16, num_hidden_layers=1, block_size=3)
    folder = DFlashDrafter(config).save_pretrained(tmp_path / "zlab")
    prompts = [tok("Hello there, how are")["input_ids"], tok("One, two, three,")["input_ids"]]
    engine = {"settings": {"method": "dflash", "drafter_format_served": "dflash-z-lab",
                           "drafter_dir_served": str(folder), "target": TARGET, "eos_token_ids": [2],
                           "temperature": 0.0},
              "requests": [{"id": f"r{i}", "prompt_ids": p} for i, p in enumerate(prompts)]}
    ours = engine_eval.compare_with_our_decoder(engine, "mtbench", max_new_tokens=6, limit=None, spread=False)
    assert ours["mode"] == "dflash block 3" and ours["requests"] == 2 and ours["lossless"] is True
    assert ours["cycles"] >= 1 and len(ours["acceptance_per_depth"]) >= 1
    engine["settings"]["drafter_format_served"] = "dflash-speculators"
    with pytest.raises(ValueError, match="z-lab layout"):
        engine_eval.compare_with_our_decoder(engine, "mtbench", max_new_tokens=6, limit=None, spread=False)
