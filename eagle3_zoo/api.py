"""The Python API of a drafter folder: check it, export it, evaluate it; what `eagle3-zoo check`, `export` and `eval`
call. The folder is opened once: its config and weight files are read one time, and the checks, the digests, the
drafter and the export are made from what was read.

    from eagle3_zoo import DrafterFolder, EvalSettings

    folder = DrafterFolder.open("runs/smollm2_135m/drafter")
    print(folder.check(target="smollm2-135m-instruct"))             # a CheckReport, as `eagle3-zoo check` prints it
    folder.export("out/speculators", fmt="speculators")               # as `eagle3-zoo export`
    results = folder.evaluate(settings=EvalSettings(benches=("mtbench",), limit=8, spread=True),
                              out="eval_results.json")                # as `eagle3-zoo eval` (its options' defaults
                                                                      # per device are the CLI's: see docs/commands.md)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.opened import OpenedDrafter

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.speculative.evaluation import EvalSettings
    from eagle3_zoo.values.draft_shapes import TreeSpec

log = logging.getLogger(__name__)


class DrafterFolder(OpenedDrafter):
    """A drafter folder in any supported format, opened once (`open`): `check`, `export`, `drafter`, the weights'
    digests (`OpenedDrafter`), and `evaluate`."""

    def eval_target(self, target: str | None = None) -> str:
        """The target an evaluation of this drafter decodes with: `target`, else the one its config names; the
        drafter checked on its own and, when the target's config is at hand without the network (a local folder, a
        config shipped in the package), against it, before any target loads.

        Raises:
            InvalidDrafterError: either check found errors (every code named).
            ValueError: no `target` and the config names none.
        """
        report = self.require_valid(purpose="evaluate")
        name = target or report.config.target_name_or_path
        if not name:
            raise ValueError(f"{self.path}: the drafter config names no target (eagle3_zoo.target_name_or_path); "
                             f"pass --target")
        offline = _target_checked_offline(str(name))
        if offline:
            self.require_valid(offline, purpose=f"evaluate with target {name}")
        return str(name)

    def evaluate(self, target: str | None = None, settings: EvalSettings | None = None, *,
                 shapes: Sequence[TreeSpec | str] | None = None, device: str | None = None,
                 dtype: str | torch.dtype = "float32", out: str | os.PathLike | None = None,
                 plot: str | os.PathLike | None = None, progress: bool = True) -> dict[str, Any]:
        """Real speculative decoding of this drafter with its target (`eagle3-zoo eval`): `eval_target`, the target
        loaded, the drafter checked against the loaded target's config, then `speculative.evaluate` (one shape) or
        `speculative.evaluate_shapes` (`shapes`). The results' settings record the drafter's path and the digests of
        its weights (`weights_digest`, `tensors_digest`), which tie the results to these weights.

        Args:
            target: hub id, local folder or shipped name (default: the drafter's `target_name_or_path`).
            settings: what to decode and how (default: `EvalSettings()`, the GPU defaults of `eval`).
            shapes: compare these draft shapes on the same requests instead of the shape of `settings`.
            device: default cuda when available, else cpu.
            dtype: of the target and the drafter.
            out, plot, progress: as `speculative.evaluate`.

        Returns:
            `EvalResults` (or `ShapesResults` with `shapes`).

        Raises:
            InvalidDrafterError: the drafter fails its checks (alone, or against the target).
            ValueError: as `eval_target` and `speculative.evaluate`.
        """
        import torch

        from eagle3_zoo.adapters import load_target
        from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate, evaluate_shapes
        from eagle3_zoo.values.dtypes import torch_dtype

        target_name = self.eval_target(target)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch_dtype(dtype)
        target_model, tokenizer, adapter = load_target(target_name, dtype=dtype, device=device)
        self.require_valid(target_model.config, purpose=f"evaluate with target {target_name}")
        drafter = self.drafter(dtype=dtype, device=device).eval()  # any format `check` accepts
        common: dict[str, Any] = dict(
            adapter=adapter, out=out, plot=plot, progress=progress,
            # the weights' digests tie the results to these weights (the file's, and the tensors' whatever their
            # layout): the model card leaves out results of other weights
            extra_settings={"drafter": str(self.path.resolve()), "target": target_name,
                            "drafter_weights_sha256": self.weights_digest,
                            "drafter_tensors_sha256": self.tensors_digest},
        )
        settings = settings or EvalSettings()
        if shapes:
            return evaluate_shapes(drafter, target_model, tokenizer, shapes, settings, **common)
        return evaluate(drafter, target_model, tokenizer, settings, **common)


def _target_checked_offline(name: str) -> str | None:
    """`name` when its config can be read without the network (a local folder, a config shipped in the package)."""
    from eagle3_zoo.adapters.shipped import shipped_target_config

    return name if Path(name).expanduser().is_dir() or shipped_target_config(name) is not None else None
