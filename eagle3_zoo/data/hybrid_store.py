"""The feature store a hybrid run (`data.mode: hybrid`) writes while its first pass streams from the engine.

Every sample the first pass reads is stored (`FeatureWriter`, one part per rank: `part-<rank>` under the store
directory, the layout of `eagle3-zoo prepare`), cast to the store dtype; that cast copy is what training uses. When a
later pass begins, the ranks fetch their share of the samples no part holds, close their parts and merge the
manifest (`finish`); every pass after reads the complete store through a `FeatureReader` (shard hashes checked
once). A marker file tells an unfinished hybrid store from an unfinished `prepare` store, so neither job writes into
the other's parts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


class HybridStore:
    """The feature store a hybrid run writes on its first pass and reads afterwards (see the module docstring).

    Args:
        directory: the store (`eagle3_zoo.data.feature_job.features_dir_for`); this rank writes `part-<rank>` in it.
        examples: every example the store must hold (train and validation).
        shard_size, dtype, meta: as the offline feature job's (`FeatureWriter`).
    """

    def __init__(self, directory: Path, examples: list[dict[str, Any]], *, shard_size: int, dtype: str,
                 meta: dict[str, Any]) -> None:
        from eagle3_zoo.data.ranks import distributed

        self.directory, self.examples = Path(directory), {str(ex["id"]): ex for ex in examples}
        self.samples = list(self.examples)
        self.shard_size, self.dtype, self.meta = shard_size, dtype, meta
        self.rank, self.world = 0, 1
        if distributed():
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.reader: Any = None
        self._writer: Any = None

    def complete(self) -> bool:
        """Whether the store holds every sample in complete, size-checked shards (then `open` reads it)."""
        from eagle3_zoo.data.feature_job import _is_complete

        return _is_complete(self.directory, set(self.samples))

    def add(self, sample_id: str, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Store `sample` (once) and return it as stored: its floating tensors in the store dtype."""
        from eagle3_zoo.values.dtypes import torch_dtype

        if self._writer is None:
            self._writer = self._open_part()
        cast = {k: v.to(torch_dtype(self.dtype)) if v.is_floating_point() else v for k, v in sample.items()}
        if sample_id not in self._writer:
            self._writer.add(sample_id, **cast)
        return cast

    def finish(self, fetch: Any) -> None:
        """Complete the store: every rank fetches (`fetch(example)`, which stores it) its share of the samples no
        part holds, closes its part, and the parts' manifests are merged; then `open`. Collective."""
        from eagle3_zoo.data.feature_job import HYBRID_MARKER, merge_parts
        from eagle3_zoo.data.ranks import data_barrier

        if self._writer is not None:
            self._writer.suspend()
            self._writer = None
        data_barrier()
        missing = sorted(set(self.samples) - self.stored())[self.rank :: self.world]
        if missing:
            logger.info("%s: fetching %d sample(s) the first pass did not read, to complete the store",
                        self.directory, len(missing))
        for sid in missing:
            fetch(self.examples[sid])
        self._close_part()
        data_barrier()
        merge_parts(self.directory, self.world)
        data_barrier()
        if self.rank == 0:
            (self.directory / HYBRID_MARKER).unlink(missing_ok=True)  # complete: any job may read it now
        self.open()

    def stored(self) -> set[str]:
        """The sample ids the parts' completed shards hold."""
        from eagle3_zoo.data.features import MANIFEST

        ids: set[str] = set()
        for manifest in self.directory.glob(f"part-*/{MANIFEST}"):
            ids.update(sid for shard in json.loads(manifest.read_text())["shards"] for sid in shard["samples"])
        return ids

    def _close_part(self) -> None:
        (self._writer or self._open_part()).close()
        self._writer = None

    def _open_part(self) -> Any:
        from eagle3_zoo.data.feature_job import HYBRID_MARKER, part_name
        from eagle3_zoo.data.features import MANIFEST, FeatureStoreError, FeatureWriter

        marker = self.directory / HYBRID_MARKER
        if not marker.exists() and any(self.directory.glob(f"part-*/{MANIFEST}")):
            raise FeatureStoreError(f"{self.directory}: holds an unfinished store of the offline feature job "
                                    "(eagle3-zoo prepare); finish it with prepare (or data.mode=offline), or point "
                                    "data.features_dir elsewhere")
        self.directory.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return FeatureWriter(self.directory / part_name(self.rank), self.shard_size, self.dtype, meta=self.meta)

    def open(self) -> Any:
        """The `FeatureReader` of the complete store (every shard's sha256 checked once)."""
        from eagle3_zoo.data.features import FeatureReader

        if self.reader is None:
            self.reader = FeatureReader(self.directory, verify="hash")
        return self.reader

    def suspend(self) -> None:
        """Write what this rank queued as a shard and leave the store incomplete (the run stops, or fails)."""
        if self._writer is not None:
            self._writer.suspend()
            self._writer = None
