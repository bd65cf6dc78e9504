"""A drafter folder opened once: its config and weight files read from disk one time, then checked, digested,
loaded and exported from what was read.

    folder = OpenedDrafter.open("runs/smollm2_135m/drafter")
    report = folder.check(target="smollm2-135m-instruct")     # `eagle3-zoo check`
    folder.export("out/", fmt="speculators")                  # `eagle3-zoo export`
    drafter = folder.drafter(dtype=torch.bfloat16)            # `import_drafter`

The path-based functions (`check_drafter`, `export_drafter`, `import_drafter`, `weights_digest`, `tensors_digest`)
give the same answers; each reads the folder again. `eagle3_zoo.api.DrafterFolder` adds the evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check import FolderCheck, check_folder, folder_of
from eagle3_zoo.checkpoint.check_report import CheckReport, InvalidDrafterError
from eagle3_zoo.checkpoint.formats import canonical_keys
from eagle3_zoo.checkpoint.weights import CheckpointError, FolderWeights, TensorInfo, read_weights
from eagle3_zoo.modeling.config import ARCHITECTURE

if TYPE_CHECKING:
    import torch

    from eagle3_zoo.modeling import Eagle3Drafter


class OpenedDrafter:
    """A drafter folder in any supported format, its weight files read once (`open`).

    A broken folder opens too: `check` reports what is wrong with it, as `eagle3-zoo check` does, and the other
    methods refuse it (`InvalidDrafterError`, naming every error). The weight files' bytes and their tensors stay in
    memory while the object lives (about twice the files' size).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = folder_of(path)
        self._weights: FolderWeights | None = None
        self._weights_error: CheckpointError | None = None
        self._check: FolderCheck | None = None
        self._reports: dict[str, CheckReport] = {}

    @classmethod
    def open(cls, path: str | Path) -> OpenedDrafter:
        """Open the drafter folder `path` (or the folder of a file inside it): read its config and, when the config
        is readable, its weight files, once, and run the checks of `eagle3-zoo check` that need no target.

        Never raises for a broken folder (`check` reports it)."""
        folder = cls(path)
        folder._folder_check()
        return folder

    def weights(self) -> FolderWeights:
        """The weight files as read by `open` (`read_weights`).

        Raises:
            CheckpointError: the error reading them met (no weights, a corrupt or unsafe file)."""
        if self._weights is None and self._weights_error is None:
            try:
                self._weights = read_weights(self.path)
            except CheckpointError as e:
                self._weights_error = e
        if self._weights_error is not None:
            raise self._weights_error
        assert self._weights is not None
        return self._weights

    def _tensors(self) -> tuple[dict[str, TensorInfo], dict[str, torch.Tensor] | None]:
        weights = self.weights()
        return weights.infos, weights.state

    def _folder_check(self) -> FolderCheck:
        if self._check is None:
            self._check = check_folder(self.path, self._tensors)
        return self._check

    def check(self, target: Any = None) -> CheckReport:
        """The report of `eagle3-zoo check` (`check_drafter`): the folder's problems, then those against `target`
        (a config, a dict, a local folder, a Hub id or a shipped target's name) when given. The weights are checked
        once whatever the number of targets. Never raises for a broken drafter."""
        if target is None or isinstance(target, (str, Path)):
            key = "" if target is None else f"target:{target}"
            if key not in self._reports:
                self._reports[key] = self._folder_check().against(target)
            report = self._reports[key]
            return CheckReport(report.path, report.format, list(report.problems), report.config)
        return self._folder_check().against(target)

    def require_valid(self, target: Any = None, *, purpose: str = "use") -> CheckReport:
        """`check(target)`, refusing a drafter with errors as `require_valid_drafter` does.

        Raises:
            InvalidDrafterError: one line with every error's code, message and fix, and `purpose` ("evaluate")."""
        report = self.check(target)
        if report.errors:
            raise InvalidDrafterError(report, purpose)
        return report

    @property
    def config(self) -> Any:
        """The drafter's `Eagle3Config` (None when config.json cannot be read: `check` says why)."""
        return self._folder_check().cfg

    @property
    def format(self) -> str | None:
        """"sglang", "official" or "speculators" (None when the folder's format cannot be told)."""
        return self._folder_check().fmt

    def drafter(self, dtype: torch.dtype | None = None, device: str = "cpu") -> Eagle3Drafter:
        """The drafter (`import_drafter`), built from the tensors `open` read; refused when `check` finds errors.

        Raises:
            InvalidDrafterError: the folder's own checks found errors."""
        from eagle3_zoo.checkpoint.convert import drafter_from_state

        self.require_valid(purpose="load")
        checked = self._folder_check()
        return drafter_from_state(checked.cfg, checked.fmt, self.weights().state, self.path, dtype, device)

    @property
    def weights_digest(self) -> str:
        """sha256 of the weight files (`weights_digest`), from the bytes `open` read."""
        return self.weights().sha256

    @property
    def tensors_digest(self) -> str:
        """sha256 of the tensors by canonical name (`tensors_digest`): the same for every layout of these weights."""
        from eagle3_zoo.checkpoint.convert import state_digest

        return state_digest(self.weights().state, self._folder_check().fmt, str(self.path))

    # --- ExportSource (`eagle3_zoo.checkpoint.convert.export_source`) ---

    def is_canonical(self) -> bool:
        """Whether the folder is exactly what `Eagle3Drafter.save_pretrained` writes (`formats.is_canonical`)."""
        checked = self._folder_check()
        try:
            weights = self.weights()
        except CheckpointError:
            return False
        return (checked.fmt == "sglang" and checked.raw.get("architectures") == [ARCHITECTURE]
                and len(weights.files) == 1 and set(weights.infos) == set(canonical_keys(checked.cfg)))

    def write_weights(self, dest: Path) -> None:
        """Write the weight file's bytes as `open` read them (a canonical folder has one file)."""
        Path(dest).write_bytes(self.weights().data[0])

    def export(self, out: str | Path, fmt: str | None = None, *, num_speculative_tokens: int | None = None,
               verifier_architectures: list[str] | None = None, verifier: str | None = None,
               force: bool = False) -> Path:
        """`eagle3-zoo export`: the drafter in a layout of its kind in `out` (None: SGLang/canonical for EAGLE-3,
        dflash for DFlash), from what `open` read (arguments and errors as `export_drafter`).

        Returns:
            `out`, as an absolute path."""
        from eagle3_zoo.checkpoint.convert import export_source

        return export_source(self, fmt, out, num_speculative_tokens, verifier_architectures, verifier, force)
