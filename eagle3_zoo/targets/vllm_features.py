"""Aux + final hidden states of token sequences, computed by a vLLM server (the `vllm` feature backend).

The server runs the target with the `extract_hidden_states` speculative method and our CPU-safe hidden-states
connector (`vllm_plugins/eagle3_zoo_hs_connector.py`); each ``/v1/completions`` request (prompt = the sample's token
ids, one generated token) makes the connector write a safetensors file with ``hidden_states [T, len(ids), H]``,
whose path comes back in ``kv_transfer_params.hidden_states_path``.

Layer ids: vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` are HF ``hidden_states`` indices (id k = the
residual stream entering decoder layer k), which is our internal convention, so the recipe's aux ids are
passed unchanged. The final hidden state is requested as id N (= the number of decoder layers): vLLM captures the
residual stream after the last layer, *before* the final norm, so the target's final RMSNorm is applied here
(our feature stores hold the post-norm final state, as HF's ``hidden_states[N]``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.targets.openai_client import ServerError
from eagle3_zoo.targets.server import VLLMServer, resolve_model_dir

PLUGIN_DIR = Path(__file__).with_name("vllm_plugins")
CONNECTOR = "CPUHiddenStatesConnector"
CONNECTOR_MODULE = "eagle3_zoo_hs_connector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own: asynchronous CUDA copies (GPU builds)


def hidden_states_configs(aux_layer_ids: Sequence[int], num_layers: int, storage: str | os.PathLike,
                          connector: str = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's ``--speculative-config`` and ``--kv-transfer-config`` for extracting `aux_layer_ids` + the last state,
    with our CPU-safe connector (`connector` "cpu") or vLLM's stock one ("stock", for GPU builds)."""
    ids = [int(i) for i in aux_layer_ids] + [int(num_layers)]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE} if connector == "cpu" else \
        {"kv_connector": STOCK_CONNECTOR}
    kv.update(kv_role="kv_producer", kv_connector_extra_config={"shared_storage_path": str(storage)})
    return spec, kv


def request_hidden_states(client: Any, model: str, ids: Sequence[int], request_id: str | None = None) -> str:
    """Ask a hidden-states server for the states of the token ids `ids` (one completion of one token); the path of
    the safetensors file its connector wrote, as the server names it.

    Raises:
        ServerError: the server failed (after the client's retries) or its answer names no file.
    """
    payload = {"model": model, "prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0.0,
               "kv_transfer_params": {}}
    if request_id:
        payload["request_id"] = request_id  # vLLM names the file after it (`cmpl-<id>-0-<suffix>.safetensors`)
    out = client.post("/v1/completions", payload)
    path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise ServerError(f"{client.base_url}: the completion carries no kv_transfer_params.hidden_states_path (is "
                          "the server running vLLM's extract_hidden_states method with a hidden-states connector?)")
    return str(path)


def read_hidden_states(path: str | os.PathLike, ids: Sequence[int], layers: int) -> torch.Tensor:
    """The `[T, layers, H]` states of a connector's file for the prompt `ids`, read once: the file (and its lock)
    are deleted, nothing is kept on disk.

    Raises:
        ServerError: the file holds other tokens than `ids`, or another number of layers than `layers`.
    """
    data = _read_locked(str(path))
    hs, got = data["hidden_states"], data["token_ids"].tolist()
    if got != [int(i) for i in ids]:
        raise ServerError(f"{path}: hidden states of {len(got)} tokens for a prompt of {len(ids)} tokens (another "
                          "request's file?)")
    if hs.dim() != 3 or hs.shape[1] != layers:
        raise ServerError(f"{path}: hidden states of shape {list(hs.shape)}, expected [{len(ids)}, {layers}, H]: the "
                          "server extracts other layers than this run's aux layers + the last one (start it with "
                          "`eagle3-zoo serve RECIPE` for this recipe)")
    return hs


def split_states(hs: torch.Tensor, final_norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`(aux_hidden [T, (L-1) * H], final_hidden [T, H])` of `[T, L, H]` states: the last layer is vLLM's residual
    stream before the final norm, so `final_norm` (the target's) is applied to it."""
    aux = hs[:, :-1].reshape(hs.shape[0], -1)
    return aux, final_norm(hs[:, -1])


class VLLMFeatureExtractor:
    """A vLLM server that returns `(aux_hidden [T, len(aux)*H], final_hidden [T, H])` for token-id sequences.

    Args:
        model: the target folder (or the embedded target's name).
        aux_layer_ids: HF hidden-state indices (our internal convention).
        python: the engine's python (default: `EAGLE3_ZOO_VLLM_PYTHON` / `.venv-vllm`).
        storage: where the connector writes its files (default: a temporary directory, removed on exit).
        server_kwargs: more `VLLMServer` arguments (dtype, kv_cache_gib, log_path, startup_timeout, max_model_len).
    """

    def __init__(self, model: str | os.PathLike, aux_layer_ids: Sequence[int], *, python: str | None = None,
                 storage: str | os.PathLike | None = None, **server_kwargs: Any) -> None:
        self.model_dir = resolve_model_dir(model)
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.num_layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self._own_storage = storage is None
        self.storage = Path(storage or tempfile.mkdtemp(prefix="eagle3-zoo-hs-"))
        spec, kv = hidden_states_configs(self.aux_layer_ids, self.num_layers, self.storage)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))}
        self.server = VLLMServer(self.model_dir, speculative_config=spec, kv_transfer_config=kv, python=python,
                                 env=env, **server_kwargs)
        self.norm_weight: torch.Tensor | None = None

    def start(self) -> VLLMFeatureExtractor:
        """Start the server (done by the first `features` call; a store with nothing left to extract starts none)."""
        if self.norm_weight is None:
            self.norm_weight = _final_norm_weight(Path(self.model_dir))
            self.server.start()
            self.client = self.server.client()
            self.model_name = self.client.models()[0]
        return self

    def __enter__(self) -> VLLMFeatureExtractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.norm_weight = None
        if self._own_storage:
            shutil.rmtree(self.storage, ignore_errors=True)

    def features(self, input_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(aux_hidden [T, len(aux)*H], final_hidden [T, H])` in float32 for one sequence.

        Raises:
            ServerError: the server failed, or returned states for other tokens than those sent.
        """
        self.start()
        ids = [int(i) for i in (input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
        path = request_hidden_states(self.client, self.model_name, ids)
        hs = read_hidden_states(self.storage / Path(path).name, ids, len(self.aux_layer_ids) + 1).float()
        return split_states(hs, lambda x: _rms_norm(x, self.norm_weight, self.eps))

    def batch(self, sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded `(aux [B, T, len(aux)*H], final [B, T, H])` for `write_features`' `features_fn`."""
        pairs = [self.features(s) for s in sequences]
        width = max(a.shape[0] for a, _ in pairs)
        aux = torch.zeros(len(pairs), width, pairs[0][0].shape[1])
        final = torch.zeros(len(pairs), width, pairs[0][1].shape[1])
        for i, (a, f) in enumerate(pairs):
            aux[i, : a.shape[0]], final[i, : f.shape[0]] = a, f
        return aux, final


def _read_locked(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is complete
            data = load_file(path)
    else:
        data = load_file(path)
    for p in (path, lock):  # read once: the store keeps its own copy
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)
    return data


def discard_hidden_states(path: str | os.PathLike) -> None:
    """Delete a connector's file (and its lock) that nobody reads, once the connector has finished writing it (a
    hidden-states server writes one for every completion, e.g. one that answers the regeneration)."""
    path = str(path)
    lock = path + ".lock"
    with contextlib.suppress(FileNotFoundError), open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is complete
    for p in (path, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


def _final_norm_weight(model_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if "model.norm.weight" in f.keys():
                return f.get_tensor("model.norm.weight").float()
    raise FileNotFoundError(f"{model_dir}: no model.norm.weight in its safetensors files (the final norm is "
                            "applied to vLLM's last hidden state)")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight
