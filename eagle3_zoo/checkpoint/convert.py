"""Import drafters from any supported format and export them to the SGLang (canonical) or speculators layout.

    drafter = import_drafter("EAGLE3-LLaMA3.1-Instruct-8B/")          # official pytorch_model.bin, read safely
    export_drafter("runs/smollm2_135m/drafter", "speculators", "out/") # vLLM's speculators format
    convert_to_canonical("RedHatAI-speculator/", "canonical/")         # any format -> what SGLang loads
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Protocol

import torch

from eagle3_zoo.checkpoint.check import require_valid_drafter, require_valid_stage
from eagle3_zoo.checkpoint.check_report import CheckReport
from eagle3_zoo.checkpoint.dflash_layouts import DFlashLayout
from eagle3_zoo.checkpoint.folder import drafter_out_dir, replace_with_stage
from eagle3_zoo.checkpoint.formats import CANONICAL_KEYS, extra_candidates, read_config
from eagle3_zoo.checkpoint.layout_base import load_exact_state
from eagle3_zoo.checkpoint.layouts import detect_layout, drafter_config, export_layout, get_layout, is_canonical
from eagle3_zoo.checkpoint.variants import SGLANG_RISK, eagle31_options
from eagle3_zoo.checkpoint.weights import CheckpointError, inside_folder, load_weights
from eagle3_zoo.modeling import CONFIG_NAME, WEIGHTS_NAME, Eagle3Config, Eagle3Drafter, identity_vocab
from eagle3_zoo.util.fileio import recover_replaced_directory, staged_directory
from eagle3_zoo.util.redaction import find_secret, redact_document
from eagle3_zoo.values import layout_names
from eagle3_zoo.values.dtypes import torch_dtype

__all__ = ["CANONICAL_KEYS", "convert_to_canonical", "export_drafter", "extra_files", "import_drafter",
           "tensors_digest"]

log = logging.getLogger(__name__)


def extra_files(drafter_dir: str | Path) -> list[Path]:
    """Recipe, provenance, eval results and plots present in a drafter folder (`formats.EXTRA_FILES`, `EXTRA_GLOBS`).

    Raises:
        OutsideFolderError: one of them is a link leading outside the folder (its content is never copied).
    """
    found = extra_candidates(drafter_dir)
    for path in found:
        inside_folder(drafter_dir, path)
    return found


def canonical_state(state: dict[str, torch.Tensor], fmt: str, source: str) -> dict[str, torch.Tensor]:
    """Rename a checkpoint's keys (layout `fmt`) to canonical names, dropping tensors that are not part of the
    drafter."""
    layout = get_layout(fmt)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        canon = layout.canonical_name(name)
        if canon is None:
            log.info("%s: dropping %s (not part of the drafter; the target's embedding is passed in)", source, name)
            continue
        if canon in out:
            raise ValueError(f"{source}: two tensors map to {canon!r} (one of them is {name!r})")
        out[canon] = tensor
    return out


def tensors_digest(folder: str | Path) -> str:
    """sha256 of a drafter's weights by canonical name (each tensor's name, dtype, shape and bytes, in name order):
    the same for a folder and its export to any layout, so that results measured on one hold for the other.

    Raises:
        CheckpointError: unreadable weights; ValueError: two tensors with the same canonical name.
    """
    folder = Path(folder)
    return state_digest(load_weights(folder), detect_layout(folder).name, str(folder))


def state_digest(state: dict[str, torch.Tensor], fmt: str, source: str) -> str:
    """`tensors_digest` of tensors already read (`state`, keyed by the names of format `fmt`; `source` names them)."""
    import hashlib

    canonical = canonical_state(state, fmt, source)
    digest = hashlib.sha256()
    for name in sorted(canonical):
        tensor = canonical[name].detach().contiguous().cpu()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _vocab_tensors(state: dict[str, torch.Tensor], cfg, source: str) -> None:
    """Fill in / validate d2t and t2d in place so that `load_state_dict` gets exact int64 / bool buffers."""
    from eagle3_zoo.checkpoint.check import vocab_mapping_problems

    if "d2t" not in state and "t2d" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"], state["t2d"] = identity_vocab(cfg.vocab_size)  # full-vocab drafter: identity mapping
        return
    missing = [k for k in ("d2t", "t2d") if k not in state]
    if missing:
        raise ValueError(f"{source}: no {' / '.join(missing)} for a draft vocab of {cfg.draft_vocab_size} < target "
                         f"vocab {cfg.vocab_size}; the draft->target id mapping cannot be recovered")
    # float/int32 d2t with whole values converts losslessly (dtypes are the checker's business, not a reason to fail)
    problems = vocab_mapping_problems(state["d2t"], state["t2d"], cfg.vocab_size, cfg.draft_vocab_size,
                                      check_dtypes=False)
    if problems:
        raise ValueError(f"{source}: invalid vocab mapping: " + "; ".join(p.message for p in problems))
    state["d2t"], state["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)


def import_drafter(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> Eagle3Drafter:
    """Load a drafter from a folder in any supported format (detected automatically).

    Pickle weights are read with `torch.load(weights_only=True)`; the frozen target embedding and other tensors that
    are not part of the drafter are dropped; every other key and shape must match exactly.

    Args:
        path: drafter folder (sglang/SpecForge safetensors, official pytorch_model.bin, or speculators).
        dtype: cast floating weights to this dtype (default: the config's torch_dtype).
        device: where to put the drafter.

    Raises:
        ValueError: unknown keys, wrong shapes, an invalid vocab mapping or a non-canonical variant.
        CheckpointError: truncated/corrupt weights; UnsafeCheckpointError for a pickle with non-tensor objects.
    """
    folder = Path(path)
    fmt = detect_layout(folder).name
    cfg = drafter_config(read_config(folder), fmt, source=str(folder / CONFIG_NAME))
    return drafter_from_state(cfg, fmt, load_weights(folder), folder, dtype, device)


def drafter_from_state(cfg: Eagle3Config, fmt: str, state: dict[str, torch.Tensor], folder: Path,
                       dtype: torch.dtype | None = None, device: str = "cpu") -> Eagle3Drafter:
    """`import_drafter` of a config and tensors already read (`state`: keyed by the names of format `fmt`; `folder`:
    where they were read, named in errors). `state` itself is left as it is.

    Raises:
        ValueError: unknown keys, wrong shapes or an invalid vocab mapping.
    """
    layout = get_layout(fmt)
    if isinstance(layout, DFlashLayout):  # DFlash and DSpark: their own tensor names and vocabulary map
        return layout.drafter_from_state(cfg, state, folder, dtype, device)
    state = canonical_state(state, fmt, str(folder))
    _vocab_tensors(state, cfg, str(folder))
    model = load_exact_state(Eagle3Drafter(cfg), state, folder, f"{fmt} format")
    model.to(device=device, dtype=dtype or torch_dtype(cfg.torch_dtype))
    return model


def _copy_extra(src: Path, dest: Path) -> None:
    """Copy a recipe, provenance or results file with the run's secrets redacted (`eagle3_zoo.util.redaction`: a folder
    written by an older version, or edited by hand, may hold a key); plots byte for byte."""
    if src.suffix in (".yaml", ".json"):
        try:
            text = src.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # not text: copied as it is (`publish` still scans what it stages)
            text = None
        if text is not None and (redacted := redact_document(text, src.suffix)) != text:
            log.warning("%s holds %s: the exported copy has it redacted (***)", src, find_secret(text) or "a secret")
            dest.write_text(redacted, encoding="utf-8")
            return
    shutil.copyfile(src, dest)


def export_drafter(
    drafter_dir: str | Path,
    fmt: str | None,
    out_dir: str | Path,
    num_speculative_tokens: int | None = 3,
    verifier_architectures: list[str] | None = None,
    verifier: str | None = None,
    force: bool = False,
) -> Path:
    """Write a drafter in a written layout (SGLang/canonical, speculators: `layouts.export_layout`), with its recipe,
    provenance and results (their secrets redacted: `eagle3_zoo.util.redaction`).

    The folder is staged next to `out_dir` and renamed into place (`replace_with_stage`): a killed export leaves
    `out_dir` as it was (or absent), never partly written.

    Args:
        drafter_dir: drafter folder in any supported format (usually what training wrote).
        fmt: a written layout's name or alias: "sglang" (alias "canonical"), "speculators", or a registered one; for
            a DFlash folder "dflash" (alias "z-lab") or "speculators" (= "speculators-dflash"); None: "sglang" for
            EAGLE-3, "dflash" for DFlash.
        out_dir: output folder (created; in an existing drafter folder, files with the same names are replaced and
            the others kept).
        num_speculative_tokens: speculators only: the greedy proposal length vLLM uses by default (None: 3 for
            EAGLE-3, block_size - 1 for DFlash).
        verifier_architectures: speculators only: the target's HF classes (default: from its model_type).
        verifier: speculators only: the target's Hub id or local folder (default: the drafter's target, a zoo
            alias mapped to its Hub id).
        force: write into an existing folder that is not a drafter folder too (`--force`).

    Returns:
        `out_dir`.

    Raises:
        ValueError: unknown format, `out_dir` is `drafter_dir`, holds the current directory, or is a folder that is
            not a drafter folder (without `force`).
        InvalidDrafterError: `eagle3-zoo check` finds errors in `drafter_dir` (nothing is written): an export is
            what serving engines load, so a broken drafter is never passed on, not even byte for byte.
    """
    return export_source(_FolderSource(Path(drafter_dir)), fmt, out_dir, num_speculative_tokens,
                         verifier_architectures, verifier, force)


class ExportSource(Protocol):
    """What `export_source` reads of a drafter folder: a path opened once (`eagle3_zoo.checkpoint.opened`) or read
    where needed (`export_drafter`)."""

    path: Path

    def require_valid(self, *, purpose: str) -> CheckReport: ...  # the checks of `eagle3-zoo check`; raises on errors
    def is_canonical(self) -> bool: ...  # exactly what `Eagle3Drafter.save_pretrained` writes
    def write_weights(self, dest: Path) -> None: ...  # the weight file's bytes, as they are (canonical folders)
    def drafter(self) -> Eagle3Drafter: ...  # the drafter, in the config's dtype, on the CPU


class _FolderSource:
    """`ExportSource` of a folder read where each step needs it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def require_valid(self, *, purpose: str) -> CheckReport:
        return require_valid_drafter(self.path, purpose=purpose)

    def is_canonical(self) -> bool:
        return is_canonical(self.path)

    def write_weights(self, dest: Path) -> None:
        shutil.copyfile(inside_folder(self.path, self.path / WEIGHTS_NAME), dest)

    def drafter(self) -> Eagle3Drafter:
        return import_drafter(self.path)


def export_source(src: ExportSource, fmt: str | None, out_dir: str | Path, num_speculative_tokens: int | None = 3,
                  verifier_architectures: list[str] | None = None, verifier: str | None = None,
                  force: bool = False) -> Path:
    """`export_drafter` of a drafter folder given as an `ExportSource`. `fmt` None: the default layout of the folder's
    drafter kind (`layout_names.default_layout`); a name is resolved for that kind (`export_layout`)."""
    kind = _source_kind(src.path)
    layout = export_layout(fmt or layout_names.default_layout(kind), kind)
    if num_speculative_tokens is None and layout.kind == "eagle3":
        num_speculative_tokens = 3  # a DFlash layout's default is one block (`speculators_dflash_config`)
    out = Path(out_dir)
    if out.resolve() == src.path.resolve():
        raise ValueError(f"export target {out} is the drafter folder itself; choose another --out")
    out = drafter_out_dir(out, force=force, force_option="--force")
    report = src.require_valid(purpose="export")
    sglang_risk = "sglang" in layout.info.engines and layout.kind == "eagle3" and report.config is not None \
        and report.config.eagle31
    for problem in report.warnings:
        if not (sglang_risk and problem.code == "EAGLE31_ENGINES"):  # said once, below, for this export
            log.warning("%s: %s", src.path, problem)
    if sglang_risk:
        log.warning("%s: exporting an EAGLE-3.1 drafter (%s) in the SGLang layout (which vLLM reads too): %s", src.path,
                    ", ".join(eagle31_options(report.config)), SGLANG_RISK)
    extras = extra_files(src.path)  # links leading outside the folder are refused before anything is written
    with staged_directory(out) as tmp:  # a failed or killed export leaves no partial file in `out`
        recover_replaced_directory(out)  # a replacement cut short: its files are carried over below
        if layout.copies_canonical_bytes and src.is_canonical():  # already canonical: keep the exact bytes
            shutil.copyfile(inside_folder(src.path, src.path / CONFIG_NAME), tmp / CONFIG_NAME)
            src.write_weights(tmp / WEIGHTS_NAME)
        else:
            layout.write(src.drafter(), tmp, num_speculative_tokens=num_speculative_tokens,
                         verifier_architectures=verifier_architectures, verifier=verifier)
        for extra in extras:
            _copy_extra(inside_folder(src.path, extra), tmp / extra.name)
        require_valid_stage(tmp, out, purpose="export")  # what serving engines will load passes the checks too
        replace_with_stage(tmp, out)
    log.debug("exported %s -> %s (%s format)", src.path, out, layout.name)  # the CLI prints it
    return out


def _source_kind(path: Path) -> str | None:
    """The drafter kind of a folder's layout (None: its layout cannot be told; the check then says why)."""
    try:
        return detect_layout(path).kind
    except (OSError, ValueError, CheckpointError):
        return None


def convert_to_canonical(path: str | Path, out_dir: str | Path) -> Path:
    """Any supported format -> the canonical SGLang layout (what `Eagle3Drafter.from_pretrained` reads)."""
    return export_drafter(path, layout_names.CANONICAL, out_dir)
