"""Offline feature store: precomputed target features in safetensors shards with a verified manifest.

Layout of a store directory:

    manifest.json               # written atomically after every completed shard
    shard-00000.safetensors     # samples 0..S-1 in the order they were added
    shard-00001.safetensors
    .lock                       # held (flock) by the one writer of this directory

Inside a shard, sample j (0-based position in the shard) has one tensor per field under the key `{j}.{field}`,
e.g. `0.input_ids [T] int64`, `0.loss_mask [T] uint8`, `0.aux_hidden [T, 3H]`, `0.final_hidden [T, H]`
(floating fields in the store dtype). The shard's safetensors metadata (key "eagle3-zoo-features" -> JSON with
`sample_ids`) repeats its sample ids, so a shard is self-describing. The manifest lists the completed shards:
file, sample ids, token counts, byte size, sha256.

Crash safety: a shard is written to a temp file in the same directory, fsynced and renamed; the manifest is
replaced the same way afterwards. A killed writer loses at most the shard it was filling. Reopening the
directory removes temp files and shards the manifest does not list, and skips samples already stored, so a
rerun over the same ordered inputs reproduces the same shard boundaries, files and manifest.

Damage after the fact (a truncated copy, a shard deleted or overwritten): reopening the directory also checks every
listed shard against the manifest (`verify`: size, or sha256) and drops the damaged ones; their samples are no
longer stored, so a rerun adds them again and they land in the freed shard slots: the store ends up as an undamaged
run would have written it.
"""

from __future__ import annotations

import json
import logging
from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from eagle3_zoo.data.readers import DataError
from eagle3_zoo.util.fileio import atomic_write, atomic_write_bytes, exclusive_lock, sha256_file  # noqa: F401
from eagle3_zoo.values.dtypes import dtype_name, torch_dtype

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "eagle3-zoo-features"
VERSION = 1
REQUIRED_FIELDS = ("input_ids", "loss_mask")
VERIFY_MODES = ("hash", "size", "none")
# a shard that fails its manifest check is redone by the feature job (`prepare` verifies hashes, `fit` sizes)
REDO_HINT = "rerun `eagle3-zoo prepare` with the same recipe to extract the damaged shards again"


class FeatureStoreError(DataError):
    """A feature store is missing, inconsistent or corrupt; the message names the directory and shard."""


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _shard_index(name: str) -> int:
    return int(name.removeprefix("shard-").removesuffix(".safetensors"))


def _check_verify(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {verify!r}; valid: {', '.join(VERIFY_MODES)}")
    return verify


class FeatureWriter:
    """Write samples into shards of `shard_size_samples`; resumes an interrupted store in `out_dir`.

    Use as a context manager: a clean exit flushes the last partial shard and marks the store complete; an
    exception leaves the pending samples unwritten, so a rerun reproduces the same shard boundaries.

        with FeatureWriter(out_dir, 256, "bfloat16", meta={"target": ..., "aux_layer_ids": [2, 15, 27]}) as w:
            for sample_id, example in dataset:
                if sample_id in w:          # stored by an earlier run: skip the target forward too
                    continue
                w.add(sample_id, input_ids=..., loss_mask=..., aux_hidden=..., final_hidden=...)
    """

    def __init__(self, out_dir: str | Path, shard_size_samples: int = 256, dtype: str | torch.dtype = "bfloat16",
                 meta: dict[str, Any] | None = None, verify: str = "size"):
        if shard_size_samples <= 0:
            raise ValueError(f"shard_size_samples must be > 0, got {shard_size_samples}")
        _check_verify(verify)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size_samples
        self.dtype = dtype_name(dtype, "features dtype")
        self.meta = json.loads(json.dumps(meta or {}))  # normalised; fails early if not JSON-serialisable
        self._lock = self._acquire_lock()
        self._pending: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._fields: dict[str, list[int]] | None = None  # field -> trailing shape, fixed by the first sample
        self._free_slots: list[int] = []  # indices of dropped damaged shards, refilled first
        try:
            self.manifest = self._load_or_create_manifest()
            self.damaged = self._drop_damaged(verify)
        except BaseException:
            self._release()
            raise
        self._done = {sid for shard in self.manifest["shards"] for sid in shard["samples"]}
        self._cleanup()

    # ----------------------------------------------------------------------------------------- setup
    def _acquire_lock(self) -> Any:
        lock = exclusive_lock(self.out_dir / ".lock", blocking=False)
        try:
            lock.__enter__()
        except BlockingIOError:
            raise FeatureStoreError(f"{self.out_dir}: another FeatureWriter is writing this directory") from None
        return lock

    def _load_or_create_manifest(self) -> dict[str, Any]:
        path = self.out_dir / MANIFEST
        if not path.exists():
            return {"format": FORMAT, "version": VERSION, "dtype": self.dtype, "shard_size_samples": self.shard_size,
                    "hidden_size": None, "aux_layer_ids": self.meta.get("aux_layer_ids"), "fields": None,
                    "meta": self.meta, "complete": False, "num_samples": 0, "num_tokens": 0, "num_bytes": 0,
                    "shards": []}
        manifest = _read_manifest(self.out_dir)
        for key, mine in (("dtype", self.dtype), ("shard_size_samples", self.shard_size), ("meta", self.meta)):
            if manifest[key] != mine:
                raise FeatureStoreError(f"{self.out_dir}: existing store has {key}={manifest[key]!r}, this writer "
                                        f"{mine!r}; resume with the same settings or use a new directory")
        if manifest["fields"]:
            self._fields = manifest["fields"]
        logger.info("%s: resuming, %d samples in %d shards already stored", self.out_dir, manifest["num_samples"],
                    len(manifest["shards"]))
        return manifest

    def _drop_damaged(self, verify: str) -> list[dict[str, Any]]:
        """Drop listed shards that fail the manifest check (`damaged` keeps their entries and `problem`)."""
        damaged = [{**shard, "problem": problem} for shard in self.manifest["shards"]
                   if (problem := shard_problem(self.out_dir / shard["file"], shard, verify))]
        if not damaged:
            return []
        for shard in damaged:
            logger.warning("%s; its %d samples are extracted again", shard["problem"], len(shard["samples"]))
            (self.out_dir / shard["file"]).unlink(missing_ok=True)
        dropped = {shard["file"] for shard in damaged}
        self.manifest["shards"] = [s for s in self.manifest["shards"] if s["file"] not in dropped]
        self._free_slots = sorted(_shard_index(name) for name in dropped)
        self._write_manifest(complete=False)  # on disk at once: a crash from here on resumes the repair
        return damaged

    def _cleanup(self) -> None:
        """Remove what a killed writer left behind: temp files and shards written but not yet in the manifest."""
        listed = {s["file"] for s in self.manifest["shards"]}
        for p in self.out_dir.iterdir():
            stale_tmp = p.name.startswith(".") and ".tmp" in p.name
            orphan = p.name.startswith("shard-") and p.name.endswith(".safetensors") and p.name not in listed
            if stale_tmp or orphan:
                logger.warning("%s: removing %s left by an interrupted writer", self.out_dir, p.name)
                p.unlink()

    # ------------------------------------------------------------------------------------------ write
    def __contains__(self, sample_id: object) -> bool:
        """True if `sample_id` is already stored in a completed shard."""
        return str(sample_id) in self._done

    def add(self, sample_id: str | int, **tensors: torch.Tensor) -> bool:
        """Queue one sample; a full queue becomes a shard. Returns False if the sample was already stored.

        Args:
            sample_id: unique id of the sample (stored as a string).
            **tensors: at least `input_ids [T]` and `loss_mask [T]`; usually `aux_hidden [T, 3H]` and
                `final_hidden [T, H]`. All share the leading length T; floating tensors are cast to the store
                dtype, `input_ids` to int64, `loss_mask` to uint8.
        """
        if self._lock is None:
            raise RuntimeError(f"{self.out_dir}: this FeatureWriter is closed")
        sid = str(sample_id)
        if sid in self._done:
            return False
        if any(sid == queued for queued, _ in self._pending):
            raise ValueError(f"sample id {sid!r} added twice")
        self._pending.append((sid, self._prepare(sid, tensors)))
        if len(self._pending) >= self.shard_size:
            self._flush()
        return True

    def _prepare(self, sid: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [f for f in REQUIRED_FIELDS if f not in tensors]
        if missing:
            raise ValueError(f"sample {sid!r}: missing tensors {missing}")
        length = tensors["input_ids"].shape[0] if tensors["input_ids"].dim() == 1 else -1
        out = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != length or length <= 0:
                raise ValueError(f"sample {sid!r}: {name} must be a tensor with leading length T = len(input_ids) "
                                 f"> 0 (input_ids must be 1-D); got shape {getattr(t, 'shape', type(t))}")
            if name == "input_ids":
                t = t.long()
            elif name == "loss_mask":
                t = t.to(torch.uint8)
            elif t.is_floating_point():
                t = t.to(torch_dtype(self.dtype))
            out[name] = t.detach().cpu().contiguous()
        fields = {name: list(t.shape[1:]) for name, t in out.items()}
        if self._fields is None:
            self._fields = fields
        elif fields != self._fields:
            raise ValueError(f"sample {sid!r}: fields/trailing shapes {fields} differ from the store's {self._fields}")
        return out

    def _flush(self) -> None:
        if not self._pending:
            return
        # a redone shard takes its old slot: samples come back in the order they were first added, so a damaged
        # shard's samples refill it exactly and the shard list ends up as an undamaged run's
        index = self._free_slots.pop(0) if self._free_slots else len(self.manifest["shards"])
        name = _shard_name(index)
        tensors = {f"{j}.{field}": t for j, (_, sample) in enumerate(self._pending) for field, t in sample.items()}
        sample_ids = [sid for sid, _ in self._pending]
        # One metadata entry only: safetensors stores metadata in a Rust HashMap whose order varies per process,
        # so several entries would make identical shards hash differently across runs.
        meta = {FORMAT: json.dumps({"sample_ids": sample_ids, "version": VERSION})}
        atomic_write(self.out_dir / name, lambda tmp: save_file(tensors, tmp, metadata=meta))
        digest, size = sha256_file(self.out_dir / name), (self.out_dir / name).stat().st_size
        tokens = [int(sample["input_ids"].shape[0]) for _, sample in self._pending]
        self.manifest["shards"].append({"file": name, "samples": sample_ids, "num_tokens": tokens, "bytes": size,
                                        "sha256": digest})
        self.manifest["shards"].sort(key=lambda shard: shard["file"])
        self._done.update(sample_ids)
        self._pending.clear()
        self._write_manifest(complete=False)

    def _write_manifest(self, complete: bool) -> None:
        m = self.manifest
        m["fields"] = self._fields
        if self._fields and "final_hidden" in self._fields:
            m["hidden_size"] = self._fields["final_hidden"][-1]
        m["num_samples"] = sum(len(s["samples"]) for s in m["shards"])
        m["num_tokens"] = sum(sum(s["num_tokens"]) for s in m["shards"])
        m["num_bytes"] = sum(s["bytes"] for s in m["shards"])
        m["complete"] = complete
        atomic_write_bytes(self.out_dir / MANIFEST, json.dumps(m, indent=1).encode())

    def close(self) -> dict[str, Any]:
        """Write the last partial shard, mark the store complete, release the lock; returns the manifest."""
        self._flush()
        self._write_manifest(complete=True)
        self._release()
        return self.manifest

    def suspend(self) -> dict[str, Any]:
        """Write the queued samples as a shard and release the lock, leaving the store incomplete (a later writer of
        the same directory resumes it); returns the manifest."""
        self._flush()
        self._release()
        return self.manifest

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise FeatureStoreError(f"{directory}: no {MANIFEST} (not a feature store, or its writer never finished "
                                "a shard)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FeatureStoreError(f"{path}: corrupt manifest ({e.msg} at line {e.lineno})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise FeatureStoreError(f"{path}: not an {FORMAT} v{VERSION} manifest")
    return manifest


class FeatureReader(Dataset):
    """Map-style dataset over a feature store (or a directory of per-rank stores), checked against the manifest.

    Args:
        path: a store directory, or a directory whose immediate subdirectories are stores (one per rank of a
            distributed feature job; read in sorted order).
        verify: "hash" (sha256 of every shard, reads all data), "size" (file sizes), or "none".
        allow_incomplete: accept a store whose writer did not finish (its completed shards are valid).

    Raises:
        FeatureStoreError: missing manifest or shard, size or hash mismatch (naming the shard), incomplete store.
    """

    def __init__(self, path: str | Path, verify: str = "size", allow_incomplete: bool = False):
        _check_verify(verify)
        root = Path(path)
        if not root.is_dir():
            raise FeatureStoreError(f"{root}: feature store directory not found")
        stores = [root] if (root / MANIFEST).exists() else sorted(p for p in root.iterdir() if (p / MANIFEST).exists())
        if not stores:
            raise FeatureStoreError(f"{root}: no {MANIFEST} here or in its subdirectories")
        self.manifests = [_read_manifest(d) for d in stores]
        self._shards: list[tuple[Path, list[str]]] = []  # (file, sample ids)
        self._entries: list[tuple[Path, dict[str, Any]]] = []  # (file, its manifest entry)
        self.token_counts: list[int] = []
        for directory, manifest in zip(stores, self.manifests):
            if not manifest["complete"] and not allow_incomplete:
                raise FeatureStoreError(f"{directory}: incomplete store ({manifest['num_samples']} samples in "
                                        f"{len(manifest['shards'])} shards; its writer did not finish): rerun the "
                                        "feature job to resume it, or pass allow_incomplete=True")
            for shard in manifest["shards"]:
                file = directory / shard["file"]
                _verify_shard(file, shard, verify)
                self._shards.append((file, shard["samples"]))
                self._entries.append((file, shard))
                self.token_counts += shard["num_tokens"]
        first = self.manifests[0]
        for directory, manifest in zip(stores, self.manifests):  # per-rank stores must agree to be concatenated
            for key in ("dtype", "fields", "aux_layer_ids"):
                if manifest[key] != first[key] and manifest["shards"]:
                    raise FeatureStoreError(f"{directory}: {key}={manifest[key]!r} differs from {stores[0]}'s "
                                            f"{first[key]!r}")
        self.dtype: str = first["dtype"]
        self.hidden_size: int | None = first["hidden_size"]
        self.aux_layer_ids: list[int] | None = first["aux_layer_ids"]
        self.meta: dict[str, Any] = first["meta"]
        self.fields: list[str] = list(first["fields"] or {})
        self.sample_ids = [sid for _, ids in self._shards for sid in ids]
        self._starts = [0]
        for _, ids in self._shards:
            self._starts.append(self._starts[-1] + len(ids))
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}
        self._num_bytes = sum(m["num_bytes"] for m in self.manifests)
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def hash_problems(self, rank: int = 0, world_size: int = 1) -> tuple[list[str], int, int]:
        """Check the sha256 of shards rank, rank + world_size, ... against the manifest: a shard rewritten at the
        same size (flipped bits, other floats) passes the size check and would be trained on.

        Returns:
            (one message per corrupt shard, shards hashed, bytes hashed).
        """
        share = self._entries[rank::world_size]
        problems = [p for file, shard in share if (p := shard_problem(file, shard, "hash"))]
        return problems, len(share), sum(int(shard["bytes"]) for _, shard in share)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """The stored tensors of sample `index` (input_ids, loss_mask, aux_hidden, final_hidden, ...)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        index %= len(self)
        shard = bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        handle = self._handle(shard)
        return {field: handle.get_tensor(f"{local}.{field}") for field in self.fields}

    def _handle(self, shard: int) -> Any:
        # Shards are memory-mapped lazily; handles are per process (dropped when pickled to DataLoader workers).
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self._shards[shard][0]), framework="pt")
        return self._handles[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def index_of(self, sample_id: str | int) -> int:
        """Dataset index of a sample id."""
        return self._index[str(sample_id)]

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def bytes_per_token(self) -> float:
        """Shard bytes per stored token (disk cost of the features; ~ (4H * dtype size) + ids and mask)."""
        return self._num_bytes / max(self.num_tokens, 1)


def shard_problem(file: Path, shard: dict[str, Any], verify: str) -> str | None:
    """Why `file` does not hold the manifest entry `shard` (missing; `verify` "size" or "hash" mismatch), else None."""
    if not file.is_file():
        return f"{file}: shard listed in the manifest is missing"
    if verify == "none":
        return None
    size = file.stat().st_size
    if size != shard["bytes"]:
        return f"{file}: size {size} bytes, manifest says {shard['bytes']} (truncated or replaced)"
    if verify == "hash" and (digest := sha256_file(file)) != shard["sha256"]:
        return f"{file}: sha256 {digest[:16]}... does not match the manifest's {shard['sha256'][:16]}... " \
               "(corrupt shard)"
    return None


def _verify_shard(file: Path, shard: dict[str, Any], verify: str) -> None:
    if problem := shard_problem(file, shard, verify):
        raise FeatureStoreError(f"{problem}; {REDO_HINT}")
