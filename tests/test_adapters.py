"""Target adapters on a tiny random model of every registered family: registry, hidden-state capture (full sequence,
KV cache, tree-verification masks), hook hygiene, chunked draft-vocab logits."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3_zoo.adapters import (
    TargetAdapter,
    UnknownAdapterError,
    adapter_for,
    available_adapters,
    cache_kwargs,
    capture_aux_hidden,
    get_adapter,
    output_cache,
    register_adapter,
    target_logits,
)
from eagle3_zoo.adapters import base as adapters_base

FAMILIES = available_adapters()  # every registered family; a new adapter module is tested with no edit here
EXACT = {"atol": 0.0, "rtol": 0.0}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    adapter = get_adapter(request.param)
    torch.manual_seed(0)
    config = adapter.tiny_config()
    config.initializer_range = 0.2  # larger random weights: layers change the residual stream visibly
    model = AutoModelForCausalLM.from_config(config).eval()
    model.requires_grad_(False)
    return model, adapter


def _ids(model, batch=2, length=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


def _pre_hook_counts(model, adapter):
    return [len(layer._forward_pre_hooks) for layer in adapter.decoder_layers(model)]


def test_registry_lists_families_and_resolves_models(tiny):
    model, adapter = tiny
    assert adapter.model_type in available_adapters() == sorted(available_adapters())
    assert type(adapter_for(model)) is type(adapter)
    assert type(adapter_for(model.config)) is type(adapter)
    assert type(adapter_for({"model_type": adapter.model_type})) is type(adapter)
    assert adapter.decoder_layer_cls(model).__name__ == adapter.decoder_layer_class
    assert adapter.embed_tokens(model) is model.get_input_embeddings()
    assert adapter.lm_head(model) is model.get_output_embeddings()
    assert len(adapter.decoder_layers(model)) == model.config.num_hidden_layers


def test_unknown_model_type_error_names_families_and_how_to_add_one():
    with pytest.raises(UnknownAdapterError) as err:
        get_adapter("toyformer")
    message = str(err.value)
    assert "unknown target model_type 'toyformer'" in message
    assert f"available: {', '.join(available_adapters())}." in message
    assert "@register_adapter('toyformer')" in message and "recipe" in message and "test" in message
    assert message.endswith("See docs/contributing/adding-a-family.md")  # the page exists: tests/test_docs.py
    with pytest.raises(UnknownAdapterError):
        adapter_for({"hidden_size": 8})


def test_register_adapter_adds_a_family_and_rejects_a_second_class(monkeypatch):
    monkeypatch.setattr(adapters_base, "_REGISTRY", dict(adapters_base._REGISTRY))

    @register_adapter("toy")
    class ToyAdapter(TargetAdapter):
        decoder_layer_class = "ToyLayer"

    assert isinstance(get_adapter("toy"), ToyAdapter) and ToyAdapter.model_type == "toy"
    with pytest.raises(ValueError, match="already registered"):

        @register_adapter("llama")
        class OtherLlama(TargetAdapter):
            pass


def test_default_aux_layers_follow_the_internal_convention():
    llama = get_adapter("llama")
    assert llama.aux_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M
    assert llama.aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B
    assert get_adapter("deepseek_v3").aux_layer_ids(61) == (2, 30, 58)
    for shallow in (2, 3):  # the one rule (modeling.config) refuses what SGLang cannot name: id 0 = the embeddings
        with pytest.raises(ValueError, match="need >= 4 decoder layers.*pass explicit ids"):
            llama.aux_layer_ids(shallow)


def test_decoder_layer_cls_rejects_a_model_of_another_family(tiny):
    model, adapter = tiny
    declared = adapter.decoder_layer_cls(model)
    layer = adapter.decoder_layers(model)[0]
    original = type(layer)
    layer.__class__ = type(f"FSDP{original.__name__}", (original,), {})  # what FSDP2's fully_shard does
    try:
        assert adapter.decoder_layer_cls(model) is declared
    finally:
        layer.__class__ = original
    other = get_adapter("qwen2" if adapter.model_type != "qwen2" else "llama")
    with pytest.raises(ValueError, match="declares decoder layers"):
        other.decoder_layer_cls(model)


@pytest.mark.parametrize("layer_ids", [(1, 2, 3), (0, 2, 2), None])
def test_capture_equals_output_hidden_states(tiny, layer_ids):
    model, adapter = tiny
    ids = _ids(model)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one row
    expected_ids = layer_ids or adapter.aux_layer_ids(model.config.num_hidden_layers)
    with torch.no_grad(), capture_aux_hidden(model, adapter, layer_ids) as cap:
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for k, layer_id in enumerate(expected_ids):
        torch.testing.assert_close(cap.hidden_states[k], out.hidden_states[layer_id], **EXACT)
    torch.testing.assert_close(cap.aux_hidden, torch.cat([out.hidden_states[i] for i in expected_ids], -1), **EXACT)
    assert cap.aux_hidden.shape == (2, 12, 3 * model.config.hidden_size)


def test_forward_features_equals_reference_forward(tiny):
    model, adapter = tiny
    ids = _ids(model)
    with torch.no_grad():
        aux, final, outputs = adapter.forward_features(model, ids, layer_ids=(1, 2, 3))
        ref = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(aux, torch.cat([ref.hidden_states[i] for i in (1, 2, 3)], -1), **EXACT)
    torch.testing.assert_close(final, ref.hidden_states[-1], **EXACT)  # post final norm
    torch.testing.assert_close(target_logits(model, adapter, final), ref.logits, **EXACT)
    assert output_cache(outputs) is None or output_cache(outputs).get_seq_length() == 12


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # HF's own name, on purpose
def test_capture_with_kv_cache_incremental_decoding(tiny):
    model, adapter = tiny
    ids = _ids(model, length=10)
    layer_ids = (1, 2, 3)
    with torch.no_grad():
        full_aux, _, _ = adapter.forward_features(model, ids, layer_ids=layer_ids)
        _, _, prefix_out = adapter.forward_features(model, ids[:, :6], layer_ids=layer_ids, use_cache=True)
        cache = output_cache(prefix_out)
        assert cache.get_seq_length() == 6
        for start, stop in [(6, 7), (7, 10)]:  # one token, then three at once
            with capture_aux_hidden(model, adapter, layer_ids) as cap:
                out = model.model(
                    input_ids=ids[:, start:stop], past_key_values=cache, use_cache=True, output_hidden_states=True
                )
            cache = output_cache(out)
            torch.testing.assert_close(
                cap.aux_hidden, torch.cat([out.hidden_states[i] for i in layer_ids], -1), **EXACT
            )
            # and the cached path gives the features of the full-sequence forward (up to matmul reassociation)
            torch.testing.assert_close(cap.aux_hidden, full_aux[:, start:stop], atol=1e-4, rtol=1e-4)
    assert _pre_hook_counts(model, adapter) == [0] * model.config.num_hidden_layers


def test_capture_with_4d_float_mask_and_position_ids_tree_verification(tiny):
    model, adapter = tiny
    ids = _ids(model, batch=1, length=9)
    past, layer_ids = 5, (1, 2, 3)
    # tree over 4 nodes: 0 is the root, 1 and 2 are children of 0, 3 is a child of 1
    parents = [-1, 0, 0, 1]
    depth = torch.tensor([0, 1, 1, 2])
    visible = torch.ones(4, past + 4, dtype=torch.bool)
    visible[:, past:] = False
    for node, parent in enumerate(parents):
        chain = node
        while chain != -1:
            visible[node, past + chain] = True
            chain = parents[chain]
    dtype = model.dtype
    mask4d = torch.zeros(1, 1, 4, past + 4, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    tree_tokens = ids[:, past : past + 4]
    with torch.no_grad():
        _, _, prefix_out = adapter.forward_features(model, ids[:, :past], use_cache=True, layer_ids=layer_ids)
        cache = output_cache(prefix_out)
        chain_cache, hf_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        aux, _, _ = adapter.forward_features(
            model,
            tree_tokens,
            attention_mask=mask4d,
            layer_ids=layer_ids,
            position_ids=(past + depth).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
        with capture_aux_hidden(model, adapter, layer_ids) as cap:
            out = model.model(
                input_ids=tree_tokens,
                attention_mask=mask4d,
                position_ids=(past + depth).unsqueeze(0),
                **cache_kwargs(model.model, {"past_key_values": hf_cache}),
                output_hidden_states=True,
            )
        # path 0 -> 1 -> 3 run as a plain chain must see the same features as those tree nodes
        path = [0, 1, 3]
        chain_aux, _, _ = adapter.forward_features(
            model, tree_tokens[:, path], layer_ids=layer_ids, past_key_values=chain_cache, use_cache=True
        )
    torch.testing.assert_close(cap.aux_hidden, torch.cat([out.hidden_states[i] for i in layer_ids], -1), **EXACT)
    torch.testing.assert_close(aux, cap.aux_hidden, **EXACT)
    torch.testing.assert_close(aux[:, path], chain_aux, atol=1e-4, rtol=1e-4)


def test_hooks_leave_no_state_even_after_an_exception(tiny):
    model, adapter = tiny
    layers = adapter.decoder_layers(model)
    post_hooks = [len(layer._forward_hooks) for layer in layers]
    with torch.no_grad(), capture_aux_hidden(model, adapter, (1, 2, 3)):
        assert _pre_hook_counts(model, adapter)[1:] == [1, 1, 1]
        model.model(input_ids=_ids(model))
    assert all(len(layer._forward_pre_hooks) == 0 for layer in layers)
    with pytest.raises(RuntimeError, match="boom"):
        with capture_aux_hidden(model, adapter, (1, 2, 3)):
            raise RuntimeError("boom")
    assert all(len(layer._forward_pre_hooks) == 0 for layer in layers)
    assert [len(layer._forward_hooks) for layer in layers] == post_hooks
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())


def test_capture_rejects_bad_layer_ids_and_reports_missing_forward(tiny):
    model, adapter = tiny
    with pytest.raises(ValueError, match="out of range"):
        with capture_aux_hidden(model, adapter, (1, 2, model.config.num_hidden_layers)):
            pass
    with capture_aux_hidden(model, adapter, (1, 2, 3)) as cap:
        pass
    with pytest.raises(RuntimeError, match="no hidden state was captured"):
        cap.aux_hidden


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_chunked_draft_vocab_logits_equal_full_logits_sliced(tiny, chunk_size):
    model, adapter = tiny
    with torch.no_grad():
        _, final, _ = adapter.forward_features(model, _ids(model))
        full = model.lm_head(final)
        full64 = final.double() @ model.lm_head.weight.double().T
    vocab = model.config.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:100]] = True
    ids = torch.tensor([7, 3, vocab - 1, 0])
    sub = target_logits(model, adapter, final, vocab_ids=t2d, chunk_size=chunk_size)
    sub_ids = target_logits(model, adapter, final, vocab_ids=ids, chunk_size=chunk_size)
    chunked_full = target_logits(model, adapter, final, chunk_size=chunk_size)
    assert sub.shape == (2, 12, 100) and sub_ids.shape == (2, 12, 4) and not sub.requires_grad
    # BLAS picks kernels (summation orders) by matrix shape, so other row/column counts round differently in the last
    # bits: compare to fp32 rounding (observed max |diff| ~2e-6) and against an fp64 reference, which catches any
    # wrong row or position.
    for got, want, want64 in [
        (sub, full[..., t2d], full64[..., t2d]),
        (sub_ids, full[..., ids], full64[..., ids]),
        (chunked_full, full, full64),
    ]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), want64, atol=1e-5, rtol=1e-5)
    if chunk_size >= final.shape[1]:  # one chunk: literally the target's lm_head call
        torch.testing.assert_close(chunked_full, full, **EXACT)


def test_target_logits_validates_inputs(tiny):
    model, adapter = tiny
    final = torch.zeros(1, 2, model.config.hidden_size)
    with pytest.raises(ValueError, match="vocab mask has shape"):
        target_logits(model, adapter, final, vocab_ids=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocab ids must lie"):
        target_logits(model, adapter, final, vocab_ids=torch.tensor([model.config.vocab_size]))
    with pytest.raises(ValueError, match="chunk_size"):
        target_logits(model, adapter, final, chunk_size=0)
