"""Reading drafter weight files safely: safetensors headers are validated before any tensor is touched, and pickle
files (official `pytorch_model.bin` releases) are opened with `torch.load(weights_only=True)` only.

A pickle can run arbitrary code when it is unpickled. `weights_only=True` swaps in an unpickler that only rebuilds
tensors and plain containers and refuses every other global, so a file carrying anything else is rejected before
any of its code runs. A file that passes must still be a flat `{name: tensor}` dict.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_zoo.util.fileio import pickle_refusal
from eagle3_zoo.values.dtypes import SAFETENSORS_FLOATS, SAFETENSORS_ITEMSIZE, safetensors_code

if TYPE_CHECKING:  # imported where tensors are read: the config and header checks answer without it
    import torch

SAFETENSORS_NAME = "model.safetensors"
PICKLE_NAME = "pytorch_model.bin"
_INDEX_SUFFIX = ".index.json"

FLOAT_DTYPES = SAFETENSORS_FLOATS


class CheckpointError(ValueError):
    """A weight file that cannot be read: missing, truncated, corrupt, or not a flat tensor dict."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle file holding objects other than tensors; it was refused without running any of its code."""


class OutsideFolderError(CheckpointError):
    """A file of a drafter folder (a link, or a shard index entry) that leads outside the folder; never read."""


def _hf_cache_blobs(folder: Path) -> Path | None:
    """`<repo>/blobs` when `folder` is a snapshot in the Hugging Face cache (`<repo>/snapshots/<revision>`), whose
    files are links into the repo's blobs by design."""
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--", "spaces--")):
        return repo / "blobs"
    return None


def inside_folder(folder: str | Path, path: str | Path) -> Path:
    """`path` (a file of the drafter folder `folder`) with its links resolved, when it stays inside `folder` (or,
    for a snapshot in the Hugging Face cache, inside its repo's blobs).

    Raises:
        OutsideFolderError: it leads elsewhere: its content is never read, copied, exported or published.
    """
    root, real = Path(folder).resolve(), Path(path).resolve()
    blobs = _hf_cache_blobs(root)
    if root in real.parents or (blobs is not None and blobs in real.parents):
        return real
    raise OutsideFolderError(f"{path} leads outside the drafter folder {folder} (to {real}); files are read only "
                             "from inside the folder: copy the file in instead of linking to it")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code: "F32", "I64", "BOOL", ...
    shape: tuple[int, ...]


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (`eagle3_zoo.values.dtypes`)."""
    return safetensors_code(dtype)


def find_weight_files(folder: str | Path) -> tuple[str, list[Path]]:
    """The weight files of a checkpoint folder: ("safetensors" | "pickle", paths), sharded indexes included.

    Raises:
        CheckpointError: when the folder has neither model.safetensors nor pytorch_model.bin (or their indexes).
    """
    folder = Path(folder)
    for kind, name in (("safetensors", SAFETENSORS_NAME), ("pickle", PICKLE_NAME)):
        if (folder / name).is_file():
            inside_folder(folder, folder / name)
            return kind, [folder / name]
        index = folder / (name + _INDEX_SUFFIX)
        if index.is_file():
            inside_folder(folder, index)
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid shard index ({type(e).__name__}: {e}); expected "
                                      '{"weight_map": {"tensor name": "file name", ...}}') from None
            bad = [n for n in names if not isinstance(n, str) or not n or Path(n).is_absolute()
                   or ".." in Path(n).parts]
            if bad:
                raise OutsideFolderError(f"{index}: weight_map names files outside the folder ({bad[0]!r}); a shard "
                                         "index lists file names inside the drafter folder")
            files = [folder / n for n in names]
            for file in files:
                inside_folder(folder, file)
            return kind, files
    raise CheckpointError(
        f"{folder}: no weights found; expected {SAFETENSORS_NAME} (SGLang/speculators) or {PICKLE_NAME} "
        f"(official EAGLE-3 release), or a sharded *{_INDEX_SUFFIX}"
    )


def weights_digest(folder: str | Path) -> str:
    """sha256 over a checkpoint folder's weight files (in order): what `eval` records, so that results can be tied
    to the weights they were measured on."""
    from eagle3_zoo.util.fileio import sha256_file

    _, files = find_weight_files(folder)
    if len(files) == 1:
        return sha256_file(files[0])
    import hashlib

    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header without loading tensor data.

    Checks the 8-byte header length against the file size, the header JSON, every dtype, and that each tensor's
    byte range matches its shape and lies inside the file, so a truncated download is reported as such instead
    of failing later inside a loader.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = _header_length(path, head, size)
        raw = f.read(n)
    return _header_infos(path, raw, size - 8 - n)


def safetensors_header_of(path: str | Path, data: bytes) -> dict[str, TensorInfo]:
    """`read_safetensors_header` of a file's bytes already read (`path` names it in the messages)."""
    path = Path(path)
    n = _header_length(path, data[:8], len(data))
    return _header_infos(path, data[8:8 + n], len(data) - 8 - n)


def _header_length(path: Path, head: bytes, size: int) -> int:
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated ({size} bytes); a safetensors file starts with an 8-byte "
                              "header length")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise CheckpointError(f"{path}: truncated or corrupt: the header claims {n} bytes but the file has "
                              f"only {size - 8} after the length field")
    return n


def _header_infos(path: Path, raw: bytes, data_size: int) -> dict[str, TensorInfo]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON object is expected)")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos[name] = _tensor_info(path, name, entry, data_size)
    return infos


def _tensor_info(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt header entry for {name!r} ({e!r})") from e
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not 0 <= begin <= end or end - begin != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
        raise CheckpointError(f"{path}: corrupt header: tensor {name!r} ({dtype}, shape {list(shape)}) has byte "
                              f"range [{begin}, {end})")
    if end > data_size:
        raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file holds only "
                              f"{data_size} data bytes (incomplete download?)")
    return TensorInfo(dtype, shape)


def load_safetensors(path: str | Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load tensors (all, or only `keys`) from a header-validated safetensors file."""
    from safetensors import safe_open

    infos = read_safetensors_header(path)
    wanted = list(infos) if keys is None else [k for k in keys if k in infos]
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in wanted}


def load_pickle_weights(path: str | Path, data: bytes | None = None) -> dict[str, torch.Tensor]:
    """Load a `pytorch_model.bin` (or its bytes `data`, already read) with the restricted unpickler; anything but a
    flat tensor dict is refused.

    Raises:
        UnsafeCheckpointError: the file holds non-tensor objects (never executed).
        CheckpointError: the file is truncated or not a PyTorch checkpoint.
    """
    import torch

    path = Path(path)
    try:
        obj = torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # keep torch's diagnosis (which global was refused), drop its advice to retry with weights_only=False
        raise UnsafeCheckpointError(f"{path}: {pickle_refusal(e)}; a drafter checkpoint holds tensors only") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read PyTorch checkpoint (truncated or corrupt?): {e}") from e
    if not isinstance(obj, dict):
        raise UnsafeCheckpointError(f"{path}: refused: expected a {{name: tensor}} dict, got {type(obj).__name__}")
    bad = sorted(str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if bad:
        raise UnsafeCheckpointError(f"{path}: refused: entries {bad[:5]} are not tensors; a drafter checkpoint is "
                                    "a flat {name: tensor} dict")
    return obj


def read_infos(folder: str | Path) -> tuple[dict[str, TensorInfo], str, list[Path]]:
    """Names, dtypes and shapes of every tensor in a checkpoint folder (safetensors: header only)."""
    kind, files = find_weight_files(folder)
    infos: dict[str, TensorInfo] = {}
    for path in files:
        if kind == "safetensors":
            infos.update(read_safetensors_header(path))
        else:
            state = load_pickle_weights(path)
            infos.update({k: TensorInfo(st_dtype(v.dtype), tuple(v.shape)) for k, v in state.items()})
    return infos, kind, files


def load_weights(folder: str | Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors (or only `keys`) of a checkpoint folder, read with the safe readers above."""
    kind, files = find_weight_files(folder)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if kind == "safetensors":
            state.update(load_safetensors(path, keys))
        else:
            part = load_pickle_weights(path)
            state.update(part if keys is None else {k: v for k, v in part.items() if k in keys})
    return state


@dataclass(frozen=True)
class FolderWeights:
    """Every weight file of a checkpoint folder, each read from disk once (`read_weights`): the bytes, the tensors
    parsed from them, the header infos and the digest `weights_digest` computes. The tensors are shared with
    whoever asks for them: treat them as read-only."""

    kind: str  # "safetensors" | "pickle"
    files: list[Path]
    data: list[bytes]  # each file's bytes, in `files` order
    infos: dict[str, TensorInfo]
    state: dict[str, torch.Tensor]  # by the names in the files
    sha256: str  # = weights_digest(folder)


def read_weights(folder: str | Path) -> FolderWeights:
    """Read the weight files of `folder` once each, validated as `read_infos` and `load_weights` validate them (a
    safetensors header before its tensors, a pickle with the restricted unpickler).

    Raises:
        CheckpointError: no weights, a truncated or corrupt file; UnsafeCheckpointError: a pickle holding more than
            tensors; OutsideFolderError: a weight file leading outside the folder.
    """
    kind, files = find_weight_files(folder)
    data, digests, infos, state = [], [], {}, {}
    for path in files:
        raw = path.read_bytes()
        data.append(raw)
        digests.append(hashlib.sha256(raw).hexdigest())
        if kind == "safetensors":
            infos.update(safetensors_header_of(path, raw))
            from safetensors import SafetensorError
            from safetensors.torch import load

            try:
                state.update(load(raw))
            except SafetensorError as e:
                raise CheckpointError(f"{path}: cannot read safetensors data: {e}") from e
        else:
            part = load_pickle_weights(path, raw)
            infos.update({k: TensorInfo(st_dtype(v.dtype), tuple(v.shape)) for k, v in part.items()})
            state.update(part)
    digest = digests[0] if len(files) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return FolderWeights(kind, files, data, infos, state, digest)
