"""Aux + final hidden states of token sequences, computed by a vLLM server (the `vllm` feature backend).

The server runs the target with the `extract_hidden_states` speculative method and our hidden-states connector
(`vllm_plugins/eagle3_zoo_hs_connector.py`); each ``/v1/completions`` request (prompt = the sample's token ids, one
generated token) makes the connector write a safetensors file with ``hidden_states [T, len(ids), H]``, whose path
comes back in ``kv_transfer_params.hidden_states_path``. The answer can arrive before the file is written: the
connector writes under a temporary name and renames, so the reader waits (up to ``engine.timeout``) for the final name
to appear and never sees half a file, on this node or another one sharing the directory, with or without `flock`.

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
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.targets.engine import (  # noqa: F401  (re-exported: the connector's names, as before)
    CONNECTOR,
    CONNECTOR_MODULE,
    GPU_CONNECTOR,
    PLUGIN_DIR,
    hidden_states_configs,
    plugin_pythonpath,
)
from eagle3_zoo.targets.openai_client import BadAnswerError
from eagle3_zoo.targets.server import VLLMServer, resolve_model_dir

logger = logging.getLogger(__name__)


def request_hidden_states(client: Any, model: str, ids: Sequence[int], request_id: str | None = None) -> str:
    """Ask a hidden-states server for the states of the token ids `ids` (one completion of one token); the path of
    the safetensors file its connector wrote, as the server names it (check it with `answered_file` before using it).

    Raises:
        ServerError: the server failed (after the client's retries); BadAnswerError: its answer names no file.
    """
    payload = {"model": model, "prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0.0,
               "kv_transfer_params": {}}
    if request_id:
        payload["request_id"] = request_id  # vLLM names the file after it (`cmpl-<id>-0-<suffix>.safetensors`)
    out = client.post("/v1/completions", payload)
    params = out.get("kv_transfer_params")
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if not isinstance(path, str) or not path:
        found = "no kv_transfer_params" if params is None else f"kv_transfer_params {client.scrub(repr(params))[:120]}"
        raise BadAnswerError(f"{client.base_url}: the completion carries no kv_transfer_params.hidden_states_path "
                             f"string ({found}; is the server running vLLM's extract_hidden_states method with a "
                             "hidden-states connector?)")
    return path


def answered_file(path: str, storage: str | os.PathLike, request_id: str | None = None, server: str = "") -> Path:
    """The local file a hidden-states answer names (`path`, the server's own view of it), checked before anything
    reads or deletes it: a plain file name (no directory part of ours, no ``.``/``..``, no NUL byte) of a connector
    file (``cmpl-<request id>-...safetensors``) of this request (`request_id`; None: any completion's), inside
    `storage`. The file itself is checked when it is read (`read_hidden_states`).

    Raises:
        BadAnswerError: the answer names something else (the server's fault: nothing is read or deleted).
    """
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    prefix = f"cmpl-{request_id}-" if request_id else "cmpl-"
    problem = ("a path with a NUL byte" if "\0" in path else "no file name" if name in ("", ".", "..")
               else f"a file that is not a connector file of this request (expected {prefix}*.safetensors)"
               if not (name.startswith(prefix) and name.endswith(".safetensors")) else None)
    if problem:
        raise BadAnswerError(f"{server or 'the engine server'} answered with hidden_states_path {path!r}: {problem}; "
                             "nothing was read or deleted")
    return Path(storage) / name


def read_hidden_states(path: str | os.PathLike, ids: Sequence[int], layers: int, hidden_size: int | None = None, *,
                       server: str = "", lock_timeout: float = 600.0, keep: bool = False) -> torch.Tensor:
    """The `[T, layers, H]` states of a connector's file for the prompt `ids`, read once and checked in full: a
    regular file, safetensors with ``hidden_states`` (floating point, `[len(ids), layers, hidden_size]`, finite) and
    ``token_ids`` (exactly `ids`). The file (and its lock) are then deleted, unless `keep` (a check ahead of the
    read); a file that fails a check is deleted too (it is this request's, named as `answered_file` checks).
    `lock_timeout`: seconds to wait for the connector to finish writing it (its name to appear, or its lock).

    Raises:
        BadAnswerError: the file is missing, unreadable or holds something else (names `server` and the file).
    """
    path = str(path)
    where = f"{server + ': ' if server else ''}hidden-states file {path}"
    try:
        data = _read_locked(path, lock_timeout, where)
        hs = _checked_states(data, [int(i) for i in ids], layers, hidden_size, where)
    except BaseException:
        _remove(path)
        raise
    if not keep:
        _remove(path)
    return hs


def _checked_states(data: dict[str, torch.Tensor], ids: list[int], layers: int, hidden_size: int | None,
                    where: str) -> torch.Tensor:
    missing = [k for k in ("hidden_states", "token_ids") if k not in data]
    if missing:
        raise BadAnswerError(f"{where}: no {' and no '.join(missing)} tensor (keys: {', '.join(sorted(data)) or 'none'}"
                             "); is the server's connector vLLM's hidden-states connector?")
    hs, tok = data["hidden_states"], data["token_ids"]
    if tok.dtype.is_floating_point or tok.dtype == torch.bool or tok.dim() != 1:
        raise BadAnswerError(f"{where}: token_ids of dtype {str(tok.dtype).removeprefix('torch.')} and shape "
                             f"{list(tok.shape)}; expected a 1-D integer tensor")
    got = tok.tolist()
    if got != ids:
        raise BadAnswerError(f"{where}: hidden states of {len(got)} tokens "
                             f"{'(other tokens) ' if len(got) == len(ids) else ''}for a prompt of {len(ids)} tokens "
                             "(another request's file?)")
    if not hs.dtype.is_floating_point:
        raise BadAnswerError(f"{where}: hidden states of dtype {str(hs.dtype).removeprefix('torch.')}; expected a "
                             "floating-point tensor (the target's activations)")
    if hs.dim() != 3 or hs.shape[1] != layers or hs.shape[0] != len(ids) or \
            (hidden_size is not None and hs.shape[2] != hidden_size):
        raise BadAnswerError(f"{where}: hidden states of shape {list(hs.shape)}, expected [{len(ids)}, {layers}, "
                             f"{hidden_size or 'H'}] (tokens, this run's aux layers + the last one, the target's "
                             "hidden size): is the server serving this recipe's target with its layers (start it with "
                             "`eagle3-zoo serve RECIPE`)?")
    if not bool(torch.isfinite(hs).all()):
        bad = int((~torch.isfinite(hs)).sum())
        raise BadAnswerError(f"{where}: {bad} of {hs.numel()} hidden-state values are NaN or infinite (a fault of the "
                             "server's model or hardware)")
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
        self.hidden_size = int(config["hidden_size"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self._own_storage = storage is None
        self.storage = Path(storage or tempfile.mkdtemp(prefix="eagle3-zoo-hs-"))
        spec, kv = hidden_states_configs(self.aux_layer_ids, self.num_layers, self.storage)
        env = {"PYTHONPATH": plugin_pythonpath()}
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
        request_id = f"e3zx-{uuid.uuid4().hex[:12]}"
        where = self.client.base_url
        path = answered_file(request_hidden_states(self.client, self.model_name, ids, request_id), self.storage,
                             request_id, where)
        hs = read_hidden_states(path, ids, len(self.aux_layer_ids) + 1, self.hidden_size, server=where).float()
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


def wait_for_lock(path: str, deadline: float, timeout: float, where: str) -> None:
    """Wait until a connector that writes in place with vLLM's lock files releases its lock on `path`
    (``<path>.lock``, held LOCK_EX until the file is complete), polling so that signals are handled meanwhile. No lock
    file (our connectors hand files over by rename), or a filesystem whose `flock` fails, is nothing to wait for.

    Raises:
        BadAnswerError: still locked at `deadline` (`time.monotonic()`; after `timeout` seconds): a server that died or
            hangs while writing it.
    """
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BadAnswerError(f"{where}: its connector still holds the file's lock after {timeout:g} s "
                                         "(engine.timeout): a server that died or hangs while writing it") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
            except OSError:  # no flock here (Lustre without -o flock: ENOSYS): the file's name is the signal
                return
    finally:
        os.close(fd)


def wait_for_file(path: str, deadline: float, timeout: float, where: str) -> os.stat_result:
    """The `lstat` of `path` once its name exists: the connector renames a complete file to it, and on a filesystem
    shared between nodes the name can show up on this node some time after the answer (attribute caches). Polled
    until `deadline` (`time.monotonic()`), so that signals are handled meanwhile.

    Raises:
        BadAnswerError: no such file at `deadline` (after `timeout` seconds), or it cannot be stat'ed.
    """
    delay = 0.005
    while True:
        try:
            return os.lstat(path)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise BadAnswerError(f"{where}: no such file after {timeout:g} s (engine.timeout): is "
                                     "engine.hidden_states_dir the directory the server's connector writes to, as "
                                     "this machine sees it, and is the server alive?") from None
        except OSError as e:
            raise BadAnswerError(f"{where}: cannot be read ({e.strerror or e})") from None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _read_locked(path: str, timeout: float, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    deadline = time.monotonic() + timeout
    wait_for_lock(path, deadline, timeout, where)
    st = wait_for_file(path, deadline, timeout, where)
    if not stat.S_ISREG(st.st_mode):
        raise BadAnswerError(f"{where}: not a regular file (a directory or a link)")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise BadAnswerError(f"{where}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def _remove(path: str) -> None:
    """Delete a connector file and its lock, when they are regular files (gone already: nothing to do; a directory
    or a link by that name is left alone)."""
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.remove(p)


def discard_hidden_states(path: str | os.PathLike, timeout: float = 600.0) -> None:
    """Delete a connector's file (and its lock) that nobody reads, once the connector has written it (a
    hidden-states server writes one for every completion, e.g. one that answers the regeneration); `path` as
    `answered_file` checked it. A file that has not appeared after `timeout` seconds, or one that is not a regular
    file, is left alone (with a warning)."""
    path = str(path)
    where = f"hidden-states file {path}"
    try:
        deadline = time.monotonic() + timeout
        wait_for_lock(path, deadline, timeout, where)
        if not stat.S_ISREG(wait_for_file(path, deadline, timeout, where).st_mode):
            raise BadAnswerError(f"{where}: not a regular file")
    except (BadAnswerError, OSError) as e:
        logger.warning("not deleted: %s", e)
        return
    _remove(path)


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
