"""Reading a checkpoint of `fit` that may come from anywhere (`eagle3-zoo consolidate`): as data, safely, and with
one-line errors that name the damaged file.

- The drafter record's JSON entries (config, recipe, provenance) are parsed as JSON objects, nothing resolved.
- A sharded (DCP) checkpoint's `.metadata` is a pickle that torch reads with the plain unpickler, which runs any
  code a crafted file carries. It is read here by an unpickler that rebuilds only DCP's metadata classes, torch
  sizes and dtypes (`_MetadataUnpickler`), and every shard file the drafter's tensors live in is checked (present,
  as long as the metadata says) before DCP reads it; DCP's own failure (a `CheckpointException`, a BaseException)
  becomes the project's `UnreadableCheckpointError`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from eagle3_zoo.util.fileio import pickle_refusal

DRAFTER_INFO_KEY = "eagle3_zoo_drafter"
"""Checkpoint entry with what `consolidate_checkpoint` needs besides the weights: the drafter config, its fc
preconditioning scale (not a checkpointed buffer), the resolved recipe, and the provenance known at the start."""


class UnreadableCheckpointError(ValueError):
    """A checkpoint whose header torch cannot load (truncated, foreign pickle, not a torch file); `error_type` and
    `first_line` say what torch said. The message names the file that failed (a sharded checkpoint's meta.pt)."""

    def __init__(self, file: Path, cause: BaseException):
        import pickle

        self.error_type = type(cause).__name__
        self.first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else self.error_type
        if isinstance(cause, pickle.UnpicklingError) and "weights_only" in str(cause):
            self.first_line = pickle_refusal(cause)  # never pass on torch's advice to load it unsafely
        super().__init__(f"{file} is not a readable checkpoint ({self.error_type}: {self.first_line})")


def read_checkpoint_header(checkpoint: Path, key: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The header of a Lightning checkpoint of `fit` (a file, or a sharded checkpoint's directory, whose `meta.pt`
    holds everything but the weights and optimizer states) and its entry `key` (None where it has no such dict).

    A file is memory-mapped: only the pickled header is read, not the tensors (a 70B drafter's optimizer state is
    large); its `state_dict` entry stays lazy until used.

    Raises:
        UnreadableCheckpointError: torch cannot load it (`weights_only`: a foreign pickle is refused, never run).
    """
    sharded = checkpoint.is_dir()
    file = checkpoint / "meta.pt" if sharded else checkpoint
    try:
        header = torch.load(file, map_location="cpu", weights_only=True, mmap=not sharded)
    except Exception as e:  # truncated zip, foreign pickle (weights_only refuses it), not a torch file at all
        raise UnreadableCheckpointError(file, e) from None
    header = header if isinstance(header, dict) else {}
    entry = header.get(key)
    return header, entry if isinstance(entry, dict) else None


def info_json(info: dict[str, Any], key: str, checkpoint: Path) -> dict[str, Any]:
    """The JSON object a checkpoint's drafter record holds under `key` (config, recipe, provenance), read as data.

    Raises:
        ValueError: not a string holding a JSON object (naming the checkpoint and the entry).
    """
    text = info.get(key)
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{checkpoint}: its {DRAFTER_INFO_KEY}.{key} is not valid JSON ({e.msg} at line {e.lineno} "
                         f"column {e.colno}): the checkpoint is damaged; consolidate another one") from None
    if not isinstance(value, dict):
        got = f"JSON {type(value).__name__}" if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{checkpoint}: its {DRAFTER_INFO_KEY}.{key} is not a JSON object (got {got}): the "
                         "checkpoint is damaged; consolidate another one")
    return value


_DCP = "torch.distributed.checkpoint."
_METADATA_CLASSES = {
    f"{_DCP}metadata": {"Metadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata and nothing else: any other global is refused before it could run."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (
                module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused: it holds a reference to {module}.{name}, which DCP metadata never "
                                     "holds (nothing in it was run)")


def _safe_reader(checkpoint: Path) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(checkpoint / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(checkpoint))


def read_sharded_metadata(checkpoint: Path) -> Any:
    """The DCP metadata of a sharded checkpoint directory, read safely (`_MetadataUnpickler`).

    Raises:
        UnreadableCheckpointError: truncated, foreign or crafted (naming the file).
    """
    try:
        return _safe_reader(checkpoint).read_metadata()
    except Exception as e:  # truncated, foreign or crafted .metadata
        raise UnreadableCheckpointError(checkpoint / ".metadata", e) from None


def sharded_state(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` of a sharded (DCP) checkpoint directory, read in this one process.

    Raises:
        UnreadableCheckpointError: the metadata is unreadable or refused, or DCP cannot read the shards.
        ValueError: a shard file the tensors live in is missing or shorter than the metadata says.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _safe_reader(checkpoint)
    metadata = read_sharded_metadata(checkpoint)
    needed: dict[str, int] = {}
    for index, where in metadata.storage_data.items():
        if index.fqn.startswith(prefix):
            needed[where.relative_path] = max(needed.get(where.relative_path, 0), where.offset + where.length)
    for name, size in sorted(needed.items()):
        file = checkpoint / name
        if not file.is_file():
            raise ValueError(f"{file} is missing: the sharded checkpoint {checkpoint} is incomplete (copy it again, or "
                             "consolidate an earlier checkpoint)")
        if file.stat().st_size < size:
            raise ValueError(f"{file} is truncated ({file.stat().st_size} bytes, its metadata needs {size}): the "
                             f"sharded checkpoint {checkpoint} is damaged (copy it again, or consolidate an earlier "
                             "checkpoint)")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and hasattr(m, "properties")}  # tensors only: no pickled object is loaded
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointException as e:  # a BaseException: converted here so that it is one line like the others
        cause = next((f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()), e)
        raise UnreadableCheckpointError(checkpoint, cause) from None
    return state
