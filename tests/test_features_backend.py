"""The feature job with another backend behind `write_features(features_fn=...)` (the `vllm` backend's entry
point), and the vLLM hidden-states request that the backend sends (layer-id convention)."""

from __future__ import annotations

import json

import torch

from eagle3_zoo.data.feature_job import write_features
from eagle3_zoo.data.features import FeatureReader
from eagle3_zoo.targets.vllm_features import CONNECTOR, CONNECTOR_MODULE, PLUGIN_DIR, hidden_states_configs


def _tiny():
    from transformers import LlamaForCausalLM

    from eagle3_zoo.adapters import get_adapter

    adapter = get_adapter("llama")
    torch.manual_seed(0)
    return LlamaForCausalLM(adapter.tiny_config()).eval().requires_grad_(False), adapter


def test_features_fn_writes_the_same_store_as_the_in_process_forward(tmp_path):
    model, adapter = _tiny()
    g = torch.Generator().manual_seed(0)
    examples = [{"id": f"s{i}", "input_ids": torch.randint(512, (int(n),), generator=g),
                 "loss_mask": torch.ones(int(n), dtype=torch.long)} for i, n in enumerate(torch.randint(4, 30, (7,)))]
    kw = dict(aux_layer_ids=(1, 2, 3), batch_size=3, shard_size=4, dtype="float32", meta={"k": 1})
    hf = write_features(examples, model, adapter, tmp_path / "hf", **kw)
    calls = []

    def one_by_one(sequences):
        """What the vllm backend returns: per-sequence states (no padding in the forward), right-padded."""
        calls.append(len(sequences))
        outs = [adapter.forward_features(model, s.unsqueeze(0), layer_ids=(1, 2, 3), use_cache=False)[:2]
                for s in sequences]
        width = max(s.numel() for s in sequences)
        aux = torch.zeros(len(sequences), width, outs[0][0].shape[-1])
        final = torch.zeros(len(sequences), width, outs[0][1].shape[-1])
        for i, (a, f) in enumerate(outs):
            aux[i, : a.shape[1]], final[i, : f.shape[1]] = a[0], f[0]
        return aux, final

    served = write_features(examples, None, adapter, tmp_path / "fn", features_fn=one_by_one, **kw)
    assert calls == [3, 3, 1]
    a, b = FeatureReader(hf), FeatureReader(served)
    assert sorted(a.sample_ids) == sorted(b.sample_ids)
    for sid in a.sample_ids:
        x, y = a[a.index_of(sid)], b[b.index_of(sid)]
        assert torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(x["aux_hidden"], y["aux_hidden"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x["final_hidden"], y["final_hidden"], rtol=1e-5, atol=1e-5)
    assert json.loads((served / "manifest.json").read_text())["complete"]


def test_vllm_hidden_states_request_uses_hf_indices_plus_the_last_layer(tmp_path):
    spec, kv = hidden_states_configs((2, 15, 27), 30, tmp_path)
    # vLLM reads these ids as HF hidden_states indices = our internal ids, unchanged; 30 = the last state
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    assert kv["kv_connector"] == CONNECTOR and kv["kv_connector_module_path"] == CONNECTOR_MODULE
    # no lock files: the connector hands each file over by renaming it complete
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path), "use_synchronization_lock": False}
    assert (PLUGIN_DIR / f"{CONNECTOR_MODULE}.py").is_file()  # what the server imports through PYTHONPATH
