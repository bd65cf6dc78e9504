"""Cache of target-token counts used to build the draft vocabulary, keyed by content fingerprints.

Counting supervised tokens means tokenising the whole training set, so the counts are cached. The key is a
sha256 of (data fingerprint, tokenizer fingerprint, draft vocab size), never a bare file name: changing the
data, a sample cap, the tokenizer or its chat template gives a new key. `build_draft_vocab` (modeling) turns the
counts into the d2t/t2d mapping.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from eagle3_zoo.data.cache_keys import json_sha256, key_version
from eagle3_zoo.data.readers import source_files
from eagle3_zoo.util.fileio import atomic_write_bytes, sha256_file

logger = logging.getLogger(__name__)



def vocab_cache_key(data_fingerprint: str, tokenizer_fingerprint: str, draft_vocab_size: int) -> str:
    """sha256 hex key of a token-count cache entry."""
    return json_sha256({"kind": "draft-vocab-token-counts", "version": key_version("draft_vocab_counts"),
                        "data": data_fingerprint, "tokenizer": tokenizer_fingerprint,
                        "draft_vocab_size": int(draft_vocab_size)}, "draft_vocab_counts")


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's content, hashed once per process for an unchanged (path, size, mtime)."""
    return sha256_file(path)


def fingerprint_sources(sources: Iterable[Any], extra: dict[str, Any] | None = None, *,
                        selection: bool = True) -> str:
    """Fingerprint of data sources: each file's content (sha256 and size) under its location-independent key
    (`source_files`), plus each source's settings. Moving the data, or reinstalling the package that ships
    it, keeps the fingerprint (and every cache keyed by it); editing a file changes it.

    Args:
        sources: recipe data sources (objects or dicts with `path`, `format`, `max_samples`, `split`).
        extra: other settings that change the token stream (e.g. `max_length`, `overflow`, global
            `max_samples`, regeneration settings); JSON-serialisable.
        selection: include the per-source settings that only choose records (`max_samples`, `split`); False for
            caches of per-record results (regenerated answers), which any selection of the records can share.

    Raises:
        DataError: a source path that does not resolve to local files.
    """
    entries = []
    for src in sources:
        get = src.get if isinstance(src, dict) else lambda k, d=None, s=src: getattr(s, k, d)
        files = []
        for file, key in source_files(get("path")):
            st = file.stat()
            files.append({"key": key, "size": st.st_size,
                          "sha256": _file_sha256(str(file.resolve()), st.st_size, st.st_mtime_ns)})
        entry = {"path": str(get("path")), "files": files, "format": get("format", "auto")}
        if selection:
            entry.update(max_samples=get("max_samples"), split=get("split"))
        entries.append(entry)
    return json_sha256({"sources": entries, "extra": extra or {}}, "fingerprint")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer's behaviour: full fast-tokenizer spec (or vocab), special tokens, chat template.

    The name/path is left out on purpose: the same tokenizer loaded from two places must share caches.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    special = getattr(tokenizer, "special_tokens_map", None)
    return json_sha256({"spec": spec, "chat_template": getattr(tokenizer, "chat_template", None),
                        "special_tokens": special if isinstance(special, dict) else None}, "fingerprint")


def _counts_path(cache_dir: str | Path, key: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", key):
        raise ValueError(f"cache key must be a plain token such as vocab_cache_key()'s hex digest, got {key!r}")
    return Path(cache_dir) / "token_counts" / f"{key}.safetensors"


def save_token_counts(cache_dir: str | Path, key: str, counts: torch.Tensor,
                      meta: dict[str, Any] | None = None) -> Path:
    """Store counts over the target vocabulary (1-D, integer, >= 0) atomically; returns the file path."""
    if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise ValueError(f"token counts must be a 1-D integer tensor over the target vocab, got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError("token counts must be >= 0")
    path = _counts_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a single metadata entry keeps the file bytes deterministic (safetensors metadata is an unordered map)
    metadata = {"eagle3-zoo-token-counts": json.dumps({"key": key, "meta": meta or {}}, sort_keys=True)}
    atomic_write_bytes(path, save({"counts": counts.detach().cpu().long().contiguous()}, metadata=metadata))
    return path


def load_token_counts(cache_dir: str | Path, key: str) -> torch.Tensor | None:
    """Cached counts (int64, 1-D) for `key`, or None on a miss. An unreadable entry is logged and ignored."""
    path = _counts_path(cache_dir, key)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            stored_key = json.loads((f.metadata() or {}).get("eagle3-zoo-token-counts", "{}")).get("key")
            counts = f.get_tensor("counts")
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable token-count cache %s (%s); counts will be recomputed", path, e)
        return None
    if stored_key != key:
        logger.warning("ignoring token-count cache %s: it was written for key %s", path, stored_key)
        return None
    if counts.dim() != 1 or counts.dtype != torch.int64:
        logger.warning("ignoring token-count cache %s: unexpected %s %s", path, counts.dtype, tuple(counts.shape))
        return None
    return counts
