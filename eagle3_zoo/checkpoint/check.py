"""Static compatibility checker: will this drafter load in SGLang / vLLM and feed them what it was trained on?

The failure users hit most is silent: a drafter that loads and then accepts almost nothing (tau close to 1). Its
causes are visible in the files: SGLang skips checkpoint keys it does not know (the layer keeps random weights), both
loaders treat a missing d2t as the identity map, vLLM defaults `norm_before_residual` to true for speculators
configs, aux layer ids stored in the other engine's convention feed the drafter the wrong layers. Every problem is
reported once with the fix. Besides the config, the safetensors header and d2t/t2d, the floating-point weights are
read once to find NaN/Inf (a diverged run writes a drafter that loads fine and proposes garbage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_zoo.checkpoint.check_report import CheckReport, InvalidDrafterError, Problem
from eagle3_zoo.checkpoint.dflash_check import (
    dflash_config_problems,
    dflash_d2t_problems,
    dflash_target_problems,
    dflash_weight_problems,
)
from eagle3_zoo.checkpoint.dflash_layouts import DFlashLayout
from eagle3_zoo.checkpoint.formats import (
    NonCanonicalDrafterError,
    canonical_keys,
    expected_shapes,
    extra_candidates,
    read_config,
)
from eagle3_zoo.checkpoint.layouts import Layout, detect_layout, drafter_config
from eagle3_zoo.checkpoint.weights import (
    FLOAT_DTYPES,
    CheckpointError,
    OutsideFolderError,
    TensorInfo,
    UnsafeCheckpointError,
    find_weight_files,
    inside_folder,
    load_weights,
    read_infos,
    st_dtype,
)
from eagle3_zoo.modeling import Eagle3Config

if TYPE_CHECKING:  # imported where tensors are read: a missing or invalid config is reported without it
    import torch

def require_valid_drafter(path_or_dir: str | Path, target_config: Any = None, *, purpose: str = "use") -> CheckReport:
    """Run the checks of `eagle3-zoo check` and refuse a drafter with errors: the gate of eval, export and publish.

    A drafter that fails here would otherwise end in a traceback deep in decoding or be copied as it is; warnings
    (serving-engine quirks) do not block and stay in the returned report for the caller to show.

    Args:
        path_or_dir: the drafter folder (any supported format), or a file inside it.
        target_config: optional target config to check sizes, vocab and aux layers against (see `check_drafter`).
        purpose: what the caller is about to do, for the message ("evaluate", "export", "publish").

    Raises:
        InvalidDrafterError: a `DrafterCheckError` (ValueError) naming the folder and every error code.
    """
    report = check_drafter(path_or_dir, target_config)
    if report.errors:
        raise InvalidDrafterError(report, purpose)
    return report


def require_valid_stage(staged: str | Path, destination: str | Path, purpose: str = "write") -> None:
    """`require_valid_drafter` for a folder staged for `destination` (the message names the destination): what a
    command is about to write must pass the checks too.

    Raises:
        InvalidDrafterError: the staged folder has errors (nothing has replaced `destination` yet).
    """
    report = check_drafter(staged)
    if report.errors:
        report.path = str(destination)
        raise InvalidDrafterError(report, purpose)


def vocab_mapping_problems(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int,
                           check_dtypes: bool = True) -> list[Problem]:
    """Problems of a (d2t, t2d) pair: dtypes, every `i + d2t[i]` inside the target vocab and marked in t2d."""
    import torch

    out: list[Problem] = []
    resave = "re-save it with `eagle3-zoo export DIR --format sglang --out NEW` (converts whole-number values)"
    if check_dtypes and d2t.dtype != torch.int64:
        out.append(Problem("D2T_DTYPE", f"d2t has dtype {d2t.dtype}, expected torch.int64: SGLang adds it to an "
                           "int64 arange and vLLM copies it into a LongTensor parameter (float offsets turn into float "
                           "ids or fail to load)", resave))
    if check_dtypes and t2d.dtype != torch.bool:
        out.append(Problem("T2D_DTYPE", f"t2d has dtype {t2d.dtype}, expected torch.bool", resave, "warning"))
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        return out + [Problem("VOCAB_MAP_SHAPE", f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                              f"draft_vocab_size={draft_vocab_size} / vocab_size={vocab_size}",
                              "rebuild the mapping for this config (eagle3_zoo.modeling.build_draft_vocab)")]
    if d2t.is_floating_point() and not torch.equal(d2t, d2t.round()):
        return out + [Problem("D2T_NOT_INTEGER", "d2t holds non-integer offsets (rounded by a low-precision save?)",
                              "rebuild d2t from the draft vocabulary; the ids cannot be recovered")]
    if not (t2d == t2d.to(torch.bool)).all():
        out.append(Problem("T2D_NOT_BOOLEAN", "t2d holds values other than 0/1", "rebuild t2d from d2t"))
    targets = torch.arange(draft_vocab_size) + d2t.to(torch.int64)
    bad = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
    if len(bad):
        ex = ", ".join(f"d2t[{i}]={int(d2t[i])} -> {int(targets[i])}" for i in bad[:3].tolist())
        out.append(Problem("D2T_OUT_OF_RANGE", f"{len(bad)} draft ids map outside the target vocab 0..{vocab_size - 1}"
                           f" ({ex}): engines index out of bounds or propose wrong tokens",
                           "rebuild d2t for this target's vocabulary (it may belong to another target)"))
        return out
    marked = t2d.to(torch.bool)
    if int(marked.sum()) != draft_vocab_size:
        out.append(Problem("T2D_COUNT", f"t2d marks {int(marked.sum())} target ids, expected draft_vocab_size="
                           f"{draft_vocab_size}", "rebuild t2d from d2t (t2d[i + d2t[i]] = True)"))
    if not marked[targets].all():
        out.append(Problem("D2T_T2D_MISMATCH", f"{int((~marked[targets]).sum())} ids i + d2t[i] are not marked in "
                           "t2d: the two halves of the mapping disagree", "rebuild t2d from d2t"))
    if targets.unique().numel() != draft_vocab_size:
        out.append(Problem("D2T_DUPLICATE", "several draft ids map to the same target id (wasted draft slots)",
                           "rebuild the draft vocabulary (build_draft_vocab keeps distinct ids)", "warning"))
    return out


def check_drafter(path_or_dir: str | Path, target_config: Any = None, *, config_only: bool = False) -> CheckReport:
    """Check a drafter folder (any supported format) for problems SGLang, vLLM or eagle3-zoo would hit.

    Args:
        path_or_dir: the drafter folder, or a file inside it.
        target_config: optional target config (a transformers `PretrainedConfig`, a dict, a local folder or a Hub id;
            see `resolve_target_config`) to check hidden/vocab sizes, aux layers and RoPE against.
        config_only: check config.json alone, no weights (a published drafter's config before its download, an
            offline fixture); a folder whose layout is told by its weights alone still needs them.

    Returns:
        A `CheckReport`; `report.ok` is False when any error was found. Never raises for a broken checkpoint.
    """
    return check_folder(folder_of(path_or_dir), config_only=config_only).against(target_config)


def folder_of(path_or_dir: str | Path) -> Path:
    """The drafter folder of a path naming it or a file inside it."""
    folder = Path(path_or_dir)
    return folder.parent if folder.is_file() else folder


TensorReader = Callable[[], "tuple[dict[str, TensorInfo], dict[str, torch.Tensor] | None]"]


@dataclass
class FolderCheck:
    """The checks of one folder that need no target (`report`), and what they read to check it against a target.

    `raw`, `fmt`, `cfg` and `layout` are None when the config could not be read (the report says why): no target is
    checked then, as `check_drafter` does."""

    report: CheckReport
    raw: dict[str, Any] | None = None
    fmt: str | None = None
    cfg: Eagle3Config | None = None
    layout: Layout | None = None

    def against(self, target_config: Any = None) -> CheckReport:
        """The report, with the problems against `target_config` appended (a new report; None: the folder's own)."""
        if target_config is None or self.cfg is None:
            return replace(self.report, problems=list(self.report.problems))
        from eagle3_zoo.checkpoint.check_target import resolve_target_config, target_problems

        report = replace(self.report, problems=list(self.report.problems))
        if isinstance(self.layout, DFlashLayout):  # DFlash and DSpark
            dflash_target_problems(self.cfg, resolve_target_config(target_config), report)
        else:
            target_problems(self.raw, self.layout, self.cfg, resolve_target_config(target_config), report)
        return report


def check_folder(folder: Path, tensors: TensorReader | None = None, config_only: bool = False) -> FolderCheck:
    """The checks of `check_drafter` that need no target config, on `folder`.

    `tensors`: returns the weights' infos and, when already in memory, their tensors (keyed by the names in the
    files); it raises `CheckpointError` for unreadable weights. Default: the safetensors headers (tensors read
    one at a time where a check needs them) or the pickle loaded once. `config_only`: no weight is read.
    """
    report = CheckReport(str(folder))
    try:
        raw = read_config(folder)
        layout = detect_layout(folder)
        report.format = fmt = layout.name
        if isinstance(layout, DFlashLayout):  # DFlash and DSpark
            return _dflash_folder(folder, raw, layout, report, tensors or (lambda: _tensor_infos(folder)), config_only)
        layout.architecture_problems(raw, report)  # reported even when the config cannot be translated
        report.config = cfg = drafter_config(raw, fmt, source=str(folder / "config.json"))
    except FileNotFoundError as e:
        report.add("CONFIG_MISSING", str(e), "point at the folder holding config.json and the weights")
        return FolderCheck(report)
    except OutsideFolderError as e:
        report.add("FILE_OUTSIDE_FOLDER", str(e), _OUTSIDE_FIX)
        return FolderCheck(report)
    except CheckpointError as e:
        report.add("WEIGHTS_MISSING", str(e), "download the weights too (model.safetensors or pytorch_model.bin)")
        return FolderCheck(report)
    except NonCanonicalDrafterError as e:
        report.add("NON_CANONICAL_VARIANT", str(e), "serve it with vLLM as is, or train a canonical EAGLE-3 drafter")
        return FolderCheck(report)
    except ValueError as e:
        report.add("CONFIG_INVALID", str(e), "fix config.json (compare with an `eagle3-zoo export` output)")
        return FolderCheck(report)
    layout.config_problems(raw, report)
    _folder_file_problems(folder, report)
    _eagle31_problems(raw, layout, cfg, report)
    if not config_only:
        _weight_problems(folder, layout, cfg, report, tensors or (lambda: _tensor_infos(folder)))
    return FolderCheck(report, raw, fmt, cfg, layout)


def _dflash_folder(folder: Path, raw: dict[str, Any], layout: Layout, report: CheckReport, tensors: TensorReader,
                   config_only: bool) -> FolderCheck:
    """`check_folder` of a DFlash or DSpark folder (`eagle3_zoo.checkpoint.dflash_check`)."""
    cfg = dflash_config_problems(raw, layout, str(folder / "config.json"), report)
    if cfg is None:
        return FolderCheck(report)
    report.config = cfg
    _folder_file_problems(folder, report)
    if config_only:
        return FolderCheck(report, raw, layout.name, cfg, layout)
    try:
        kind = find_weight_files(folder)[0]
        infos, state = tensors()
    except UnsafeCheckpointError as e:
        report.add("UNSAFE_PICKLE", str(e), "use a safetensors copy from a trusted source; never unpickle it")
        return FolderCheck(report, raw, layout.name, cfg, layout)
    except CheckpointError as e:
        report.add("WEIGHTS_MISSING", str(e), "download the weights too (model.safetensors), or check config.json "
                   "alone with `eagle3-zoo check DIR --config-only`")
        return FolderCheck(report, raw, layout.name, cfg, layout)
    before = len(report.errors)
    dflash_weight_problems(folder, cfg, infos, kind, report, layout)
    if len(report.errors) == before:
        if cfg.reduced_vocab:
            dflash_d2t_problems(cfg, lambda n: state[n] if state is not None else load_weights(folder, [n])[n], report)
        _finite_problems(folder, infos, report, state)
    return FolderCheck(report, raw, layout.name, cfg, layout)


_OUTSIDE_FIX = "copy the file into the folder instead of linking to it (or remove the link)"


def _folder_file_problems(folder: Path, report: CheckReport) -> None:
    """The files export and publish copy besides the weights: none may lead outside the folder, and recipe.yaml (the
    model card shows it) must be a YAML mapping."""
    for path in extra_candidates(folder):
        try:
            inside_folder(folder, path)
        except OutsideFolderError as e:
            report.add("FILE_OUTSIDE_FOLDER", str(e), _OUTSIDE_FIX)
    if (problem := recipe_file_problem(folder)) is not None:
        report.add("RECIPE_UNREADABLE", problem, "fix or remove recipe.yaml (a YAML mapping of recipe sections, as "
                   "`fit` writes it)", "warning")


def recipe_file_problem(folder: str | Path) -> str | None:
    """Why a drafter folder's recipe.yaml cannot be read as a recipe (as data: nothing in it is resolved), else
    None (also when there is none)."""
    import yaml

    path = Path(folder) / "recipe.yaml"
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text (byte offset {e.start})"
    except (yaml.YAMLError, RecursionError) as e:
        return f"{path}: not valid YAML ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if data is not None and not isinstance(data, dict):
        return f"{path}: expected a mapping of recipe sections, got a YAML {type(data).__name__}"
    return None


def _weight_problems(folder: Path, layout: Layout, cfg: Eagle3Config, report: CheckReport,
                     tensors: TensorReader) -> None:
    try:
        infos, state = tensors()
    except UnsafeCheckpointError as e:
        report.add("UNSAFE_PICKLE", str(e), "use a safetensors copy from a trusted source; never unpickle it")
        return
    except CheckpointError as e:
        report.add("CORRUPT_WEIGHTS", str(e), "download the file again (compare its size with the Hub's)")
        return
    canon = _key_problems(infos, layout, cfg, report)
    _vocab_problems(folder, canon, cfg, report, state)
    _finite_problems(folder, infos, report, state)


def _finite_problems(folder: Path, infos: dict[str, TensorInfo], report: CheckReport,
                     state: dict[str, torch.Tensor] | None) -> None:
    """NaN/Inf in any floating-point weight (a run that diverged): such a drafter proposes garbage or crashes."""
    import torch

    bad: list[str] = []
    for name, info in infos.items():
        if not info.dtype.startswith(("F", "BF")):  # safetensors dtype names: F16, BF16, F32, F64, F8_*
            continue
        tensor = state[name] if state is not None else load_weights(folder, [name])[name]
        if not bool(torch.isfinite(tensor.float() if tensor.dtype.itemsize == 1 else tensor).all()):
            bad.append(name)
    if bad:
        report.add("NONFINITE_WEIGHTS", f"{len(bad)} weight tensor(s) hold NaN or Inf values: {', '.join(bad[:6])}"
                   f"{' ...' if len(bad) > 6 else ''}",
                   "the run that wrote it diverged: retrain (lower optim.lr, keep optim.grad_clip) or use an earlier "
                   "checkpoint")


def _tensor_infos(folder: Path) -> tuple[dict[str, TensorInfo], dict[str, torch.Tensor] | None]:
    """Names/dtypes/shapes; a pickle has no header, so it is loaded (safely) once and its tensors returned too."""
    if find_weight_files(folder)[0] != "pickle":
        return read_infos(folder)[0], None
    state = load_weights(folder)
    return {k: TensorInfo(st_dtype(v.dtype), tuple(v.shape)) for k, v in state.items()}, state


def _eagle31_problems(raw: dict[str, Any], layout: Layout, cfg: Eagle3Config, report: CheckReport) -> None:
    """EAGLE-3.1 options: which engines serve them as trained (a warning: such a folder is checked, evaluated and
    published like any other), and the SpecForge spelling of norm_output that meant something else."""
    from eagle3_zoo.checkpoint import variants

    note = variants.engine_note(cfg)
    if note is None:
        return
    report.add("EAGLE31_ENGINES", note, "serve it with vLLM (or an SGLang that reads fc_norm and norm_output); "
               "`eagle3-zoo check DIR --engine vllm` runs it in vLLM here", "warning")
    if cfg.norm_output and layout.norm_output_ambiguous and "eagle3_zoo" not in raw:
        report.add("NORM_OUTPUT_MEANING", f"norm_output=true in a checkpoint not written by eagle3-zoo: "
                   f"{variants.SPECFORGE_NORM_OUTPUT}", "if it came from SpecForge before PR #879, set norm_output to "
                   "false (its training fed back the pre-norm state); `eagle3-zoo eval` shows which reading accepts",
                   "warning")


def _key_problems(infos: dict[str, TensorInfo], layout: Layout, cfg: Eagle3Config,
                  report: CheckReport) -> dict[str, str]:
    """Check names, shapes and dtypes; return {canonical name: name in the file}."""
    canon: dict[str, str] = {}
    for name in infos:
        c = layout.canonical_name(name)
        if c is None:
            if name.endswith("embed_tokens.weight"):
                report.add("EMBED_TOKENS_PRESENT", f"{name} {list(infos[name].shape)} is a copy of the target's frozen "
                           "embedding: eagle3-zoo drops it; vLLM uses it instead of the target's",
                           "export to drop it (the target's embedding is shared at serve time)", "warning")
            continue
        canon[c] = name
    prefixed = sorted(n for n in canon.values() if n.startswith("model."))
    if prefixed:
        report.add("PREFIXED_KEYS", f"{len(prefixed)} keys carry a 'model.' prefix (e.g. {prefixed[0]}): SGLang strips "
                   "it, vLLM adds its own and fails on 'model.model.*'", "export with --format sglang to drop it",
                   "warning")
    keys = canonical_keys(cfg)
    unknown = sorted(canon[c] for c in canon if c not in keys)
    if unknown:
        report.add("UNKNOWN_KEYS", f"keys the loaders do not map: {unknown[:6]}{' ...' if len(unknown) > 6 else ''}: "
                   "SGLang silently skips them (the layer keeps random weights, tau close to 1), vLLM refuses to load",
                   "rename them to the canonical keys (`eagle3-zoo export` does for known formats) or drop them")
    missing = [k for k in keys if k not in canon and k not in ("d2t", "t2d")]
    if missing:
        report.add("MISSING_KEYS", f"missing {missing}: the loaders keep random weights there (tau close to 1)",
                   "this checkpoint is incomplete; get the full one")
    shapes = expected_shapes(cfg)
    wrong = [f"{canon[k]}: {list(infos[canon[k]].shape)} (config implies {list(shapes[k])})"
             for k in shapes if k in canon and infos[canon[k]].shape != shapes[k]]
    if wrong:
        report.add("SHAPE_MISMATCH", "tensor shapes disagree with config.json: " + "; ".join(wrong[:4]),
                   "make config.json describe these weights (hidden/intermediate sizes, heads, vocab sizes)")
    not_float = [canon[k] for k in keys if k in canon and k not in ("d2t", "t2d")
                 and infos[canon[k]].dtype not in FLOAT_DTYPES]
    if not_float:
        report.add("WEIGHT_DTYPE", f"weights with non-float dtypes: {not_float}", "save the weights in float")
    return canon


def _vocab_problems(folder: Path, canon: dict[str, str], cfg: Eagle3Config, report: CheckReport,
                    state: dict[str, torch.Tensor] | None) -> None:
    if "d2t" not in canon:
        full = cfg.draft_vocab_size == cfg.vocab_size
        report.add("D2T_MISSING", "no d2t: SGLang and vLLM then take draft ids as target ids" + (
            "" if full else f", but the draft vocab ({cfg.draft_vocab_size}) is a subset of the target's "
            f"({cfg.vocab_size}): nearly every proposal is a wrong token (tau close to 1)"),
            "add the d2t saved at training time (int64 offsets, target_id = i + d2t[i])",
            "warning" if full else "error")
    if "t2d" not in canon:
        report.add("T2D_MISSING", "no t2d (bool mask of draft tokens over the target vocab): engines do not need "
                   "it, but eagle3-zoo import/training and this check do", "add t2d (t2d[i + d2t[i]] = True)",
                   "warning")
    if "d2t" in canon and "t2d" in canon:
        tensors = state if state is not None else load_weights(folder, keys=[canon["d2t"], canon["t2d"]])
        report.problems += vocab_mapping_problems(tensors[canon["d2t"]], tensors[canon["t2d"]], cfg.vocab_size,
                                                  cfg.draft_vocab_size)
