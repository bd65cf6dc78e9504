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

import torch
from safetensors.torch import save_file

from eagle3_zoo.dtypes import torch_dtype
from eagle3_zoo.hub.check import require_valid_drafter
from eagle3_zoo.hub.formats import (
    CANONICAL_KEYS,
    EXPORT_FORMATS,
    canonical_name,
    detect_format,
    drafter_config,
    format_name,
    is_canonical,
    read_config,
    speculators_config,
)
from eagle3_zoo.hub.variants import SGLANG_RISK, eagle31_options
from eagle3_zoo.hub.weights import SAFETENSORS_NAME, load_weights
from eagle3_zoo.modeling import CONFIG_NAME, WEIGHTS_NAME, Eagle3Drafter, identity_vocab
from eagle3_zoo.modeling.io import atomic_write, atomic_write_text

__all__ = ["CANONICAL_KEYS", "convert_to_canonical", "export_drafter", "extra_files", "import_drafter",
           "load_any_drafter"]

log = logging.getLogger(__name__)

# files next to the weights that travel with every export: the resolved recipe, provenance, eval results
EXTRA_FILES = ("recipe.yaml", "provenance.json", "eval_results.json")
EXTRA_GLOBS = ("eval_results_*.json", "*.png")  # more eval runs (other draft shapes), per-depth plots


def extra_files(drafter_dir: str | Path) -> list[Path]:
    """Recipe, provenance, eval results and plots present in a drafter folder."""
    folder = Path(drafter_dir)
    found = [folder / n for n in EXTRA_FILES if (folder / n).is_file()]
    for pattern in EXTRA_GLOBS:
        found += sorted(p for p in folder.glob(pattern) if p.is_file())
    return found


def canonical_state(state: dict[str, torch.Tensor], fmt: str, source: str) -> dict[str, torch.Tensor]:
    """Rename a checkpoint's keys to canonical names, dropping tensors that are not part of the drafter."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        canon = canonical_name(name, fmt)
        if canon is None:
            log.info("%s: dropping %s (not part of the drafter; the target's embedding is passed in)", source, name)
            continue
        if canon in out:
            raise ValueError(f"{source}: two tensors map to {canon!r} (one of them is {name!r})")
        out[canon] = tensor
    return out


def _vocab_tensors(state: dict[str, torch.Tensor], cfg, source: str) -> None:
    """Fill in / validate d2t and t2d in place so that `load_state_dict` gets exact int64 / bool buffers."""
    from eagle3_zoo.hub.check import vocab_mapping_problems

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
    fmt = detect_format(folder)
    cfg = drafter_config(read_config(folder), fmt, source=str(folder / CONFIG_NAME))
    state = canonical_state(load_weights(folder), fmt, str(folder))
    _vocab_tensors(state, cfg, str(folder))
    model = Eagle3Drafter(cfg)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{folder} ({fmt} format): missing keys {missing}, unexpected keys {unexpected}, "
                         f"wrong shapes {wrong}; run `eagle3-zoo check {folder}` for details")
    model.load_state_dict(state)
    model.to(device=device, dtype=dtype or torch_dtype(cfg.torch_dtype))
    return model


def _write_speculators(drafter: Eagle3Drafter, out: Path, num_speculative_tokens: int,
                       verifier_architectures: list[str] | None, verifier: str | None) -> None:
    config = speculators_config(drafter.config, num_speculative_tokens, verifier_architectures, verifier)
    dtype = torch_dtype(drafter.config.torch_dtype)
    tensors = {format_name(k, "speculators"): (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in drafter.state_dict().items()}
    atomic_write(out / SAFETENSORS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")


def export_drafter(
    drafter_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    num_speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
    verifier: str | None = None,
) -> Path:
    """Write a drafter in the SGLang (canonical) or speculators layout, with its recipe, provenance and results.

    Args:
        drafter_dir: drafter folder in any supported format (usually what training wrote).
        fmt: "sglang" (alias "canonical") or "speculators".
        out_dir: output folder (created; existing files with the same names are replaced).
        num_speculative_tokens: speculators only: the greedy proposal length vLLM uses by default.
        verifier_architectures: speculators only: the target's HF classes (default: from its model_type).
        verifier: speculators only: the target's Hub id or local folder (default: the drafter's target, a zoo
            alias mapped to its Hub id).

    Returns:
        `out_dir`.

    Raises:
        ValueError: unknown format, or `out_dir` is `drafter_dir`.
        InvalidDrafterError: `eagle3-zoo check` finds errors in `drafter_dir` (nothing is written): an export is
            what serving engines load, so a broken drafter is never passed on, not even byte for byte.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(EXPORT_FORMATS)}")
    src, out = Path(drafter_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"export target {out} is the drafter folder itself; choose another --out")
    report = require_valid_drafter(src, purpose="export")
    sglang_risk = EXPORT_FORMATS[fmt] == "sglang" and report.config is not None and report.config.eagle31
    for problem in report.warnings:
        if not (sglang_risk and problem.code == "EAGLE31_ENGINES"):  # said once, below, for this export
            log.warning("%s: %s", src, problem)
    if sglang_risk:
        log.warning("%s: exporting an EAGLE-3.1 drafter (%s) in the SGLang layout (which vLLM reads too): %s", src,
                    ", ".join(eagle31_options(report.config)), SGLANG_RISK)
    out.mkdir(parents=True, exist_ok=True)
    if EXPORT_FORMATS[fmt] == "sglang" and is_canonical(src):
        for name in (CONFIG_NAME, WEIGHTS_NAME):  # already canonical: keep the exact bytes
            shutil.copyfile(src / name, out / name)
    elif EXPORT_FORMATS[fmt] == "sglang":
        import_drafter(src).save_pretrained(out)
    else:
        _write_speculators(import_drafter(src), out, num_speculative_tokens, verifier_architectures, verifier)
    for extra in extra_files(src):
        shutil.copyfile(extra, out / extra.name)
    log.info("exported %s -> %s (%s format)", src, out, EXPORT_FORMATS[fmt])
    return out


def convert_to_canonical(path: str | Path, out_dir: str | Path) -> Path:
    """Any supported format -> the canonical SGLang layout (what `Eagle3Drafter.from_pretrained` reads)."""
    return export_drafter(path, "sglang", out_dir)


def load_any_drafter(
    path_or_repo: str | Path, revision: str | None = None, endpoint: str | None = None, dtype: torch.dtype | None = None
) -> Eagle3Drafter:
    """A drafter from a local folder (any format), a Hub repo id or a zoo name; for `drafter.init_from`.

    Hub repos are downloaded with `pull` (snapshot_download) and imported; nothing is executed from them.
    """
    if Path(path_or_repo).is_dir():
        return import_drafter(path_or_repo, dtype=dtype)
    if str(path_or_repo).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"{path_or_repo}: no such drafter folder")
    from eagle3_zoo.hub.download import pull

    return import_drafter(pull(str(path_or_repo), revision=revision, endpoint=endpoint).path, dtype=dtype)

