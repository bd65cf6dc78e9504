"""Model cards: `huggingface_hub.ModelCard` rendered from the packaged Jinja template and the files training and
evaluation leave next to the weights (config.json, recipe.yaml, provenance.json, eval_results*.json, plots).

The layout follows the drafter cards users know from the Hub (RedHatAI's speculators, lmsys' SpecBundle): metadata
with the target as `base_model`, the training data as Hub `datasets` and no `pipeline_tag` (a draft head cannot run
on its own, so no inference widget), an overview list, serving snippets for the engines that load the shipped
layout and only with draft shapes the card shows acceptance for, the evaluation table with the machine and its
load next to the speeds, and a compact training and provenance record.

Every input is optional and every template variable has a default, so a bare checkpoint still gets a valid card.
`ModelCard.validate()` is never called: it needs the network.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData

import eagle3_zoo
from eagle3_zoo.checkpoint.convert import extra_files, tensors_digest
from eagle3_zoo.checkpoint.layouts import find_layout, load_drafter_config
from eagle3_zoo.checkpoint.variants import eagle31_options, engine_note
from eagle3_zoo.checkpoint.weights import FLOAT_DTYPES, read_infos, weights_digest
from eagle3_zoo.hub import card_rows
from eagle3_zoo.hub.records import (
    EvalRecord,
    EvalSettingsRecord,
    TrainingRecord,
    parse_eval_record,
    parse_training_record,
)
from eagle3_zoo.util.redaction import redact_data, redact_document
from eagle3_zoo.values import layout_names

log = logging.getLogger(__name__)

TEMPLATE = "model_card.md.j2"
BASE_TAGS = ("eagle3", "speculative-decoding", "draft-model", "eagle3-zoo")


def template_text() -> str:
    """The packaged card template."""
    return resources.files("eagle3_zoo").joinpath("resources", TEMPLATE).read_text(encoding="utf-8")


def _read_json(path: Path) -> Any:
    """The decoded JSON of `path`, or None when there is none (no file, or not valid JSON: the card leaves it out)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as e:
        log.warning("%s: not valid JSON (%s); the card leaves it out", path, e)
        return None


class _Weights:
    """The folder's weight digests, computed once: by canonical tensor (any layout) and by file (older results)."""

    def __init__(self, folder: Path):
        self.folder, self._tensors, self._files = folder, None, None

    def matches(self, settings: EvalSettingsRecord) -> bool | None:
        """Whether results with these settings were measured on these weights (None: they do not say)."""
        if settings.drafter_tensors_sha256:
            self._tensors = self._tensors or tensors_digest(self.folder)
            return settings.drafter_tensors_sha256 == self._tensors
        if settings.drafter_weights_sha256:  # results of an older `eval`: the digest of the weight file
            self._files = self._files or weights_digest(self.folder)
            return settings.drafter_weights_sha256 == self._files
        return None


def _eval_results(path: Path, weights: _Weights) -> EvalRecord | None:
    """An `eval` results file, or None when it is empty or was measured on other weights than the folder's (e.g. a
    rerun of `fit` replaced them and kept the old results): its figures would be false on this card."""
    data = _read_json(path)
    if data is None or data == {}:
        return None
    results = parse_eval_record(data, path)
    if weights.matches(results.settings) is False:
        log.warning("%s was measured on other weights than %s holds now: left off the card; rerun `eagle3-zoo eval` "
                    "to measure these weights", path, path.parent)
        return None
    return results


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _usage(engines: tuple[str, ...], measured: list[dict[str, Any]], folder: Path, fmt: str) -> dict[str, Any]:
    """Serving snippets for the engines that load the layout, each with a draft shape the card has rows for."""
    sglang = card_rows.sglang_shape(measured) if "sglang" in engines else None
    vllm = card_rows.vllm_shape(measured) if "vllm" in engines else None
    out: dict[str, Any] = {"show_sglang": "sglang" in engines, "show_vllm": "vllm" in engines}
    if sglang:
        out.update(sglang_flags=sglang["flags"], sglang_shape=sglang["label"])
    if vllm:
        out.update(vllm_num_speculative_tokens=vllm["k"], vllm_shape=vllm["label"])
    layout = find_layout(fmt)  # the draft length an engine given the folder alone serves with (speculators)
    served = layout.served_draft_tokens(folder) if layout is not None else None
    if served is not None:
        same = vllm is not None and vllm["k"] == served
        out["serve_alone"] = (f"`vllm serve` with this repository alone also works: it reads the target from the "
                              f"config and drafts {served} tokens"
                              + (f", the shape *{vllm['label']}* evaluated below." if same else
                                 ", a chain length whose acceptance this card does not show."))
    return out


def card_variables(drafter_dir: str | Path, repo_id: str | None = None, fmt: str | None = None,
                   published: bool = False) -> dict[str, Any]:
    """The template variables for a drafter folder (everything the card shows, as plain strings and rows).

    The usage snippets name `repo_id` only when `published` (the card goes to that repo with the weights); otherwise
    they load the drafter from `drafter_dir` and the card says so, so no snippet points at a repo that may not exist.
    """
    from eagle3_zoo.adapters.embedded import EMBEDDED_WEIGHTS_NOTE, is_embedded_name
    from eagle3_zoo.values.zoo_registry import target_hub_id

    folder = Path(drafter_dir)
    cfg, detected = load_drafter_config(folder)
    fmt = fmt or detected
    infos, _, _ = read_infos(folder)
    from eagle3_zoo.checkpoint.check import recipe_file_problem

    if problem := recipe_file_problem(folder):
        raise ValueError(f"{problem}: the model card shows the recipe; fix or remove recipe.yaml")
    recipe_path = folder / "recipe.yaml"
    recipe_text = recipe_path.read_text(encoding="utf-8").strip() if recipe_path.is_file() else ""
    recipe_text = redact_document(recipe_text, ".yaml").strip() if recipe_text else ""  # the card shows it
    recipe = (yaml.safe_load(recipe_text) if recipe_text else None) or {}  # data: `${...}` stays literal text
    prov_json = redact_data(_read_json(folder / "provenance.json"))
    prov = parse_training_record({} if prov_json is None else prov_json, folder / "provenance.json")
    weights = _Weights(folder)
    evals = {p.stem: r for p in sorted(folder.glob("eval_results*.json")) if (r := _eval_results(p, weights))}
    rows, measured = card_rows.evaluation_rows(evals)
    target = cfg.target_name_or_path or (recipe.get("target") or {}).get("name_or_path")
    hub_target = target_hub_id(target)
    first = next(iter(evals.values()), None)
    aux = cfg.aux_layer_ids
    variables = {
        "model_name": (repo_id or folder.name).split("/")[-1], "repo_id": repo_id or "ORG/NAME",
        "draft_model": repo_id if published and repo_id else str(folder),
        "hub_note": None if published and repo_id else _hub_note(folder, repo_id),
        "target": target, "target_serve": hub_target or target, "target_family": cfg.target_model_type,
        "target_url": f"https://huggingface.co/{hub_target}" if hub_target else "",
        "eagle3_zoo_version": eagle3_zoo.__version__, "hidden_size": cfg.hidden_size, "torch_dtype": cfg.torch_dtype,
        "num_parameters": _count(sum(_numel(i.shape) for i in infos.values() if i.dtype in FLOAT_DTYPES)),
        "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": cfg.vocab_size,
        "aux_layers": f"HF hidden-state indices {list(aux)} (SGLang eagle_config: {[i - 1 for i in aux]})"
        if aux else None,
        "format_description": layout_names.card_info(fmt).description,
        "eagle31_options": ", ".join(eagle31_options(cfg)) or None,  # tags the card "eagle3.1"
        "engine_note": engine_note(cfg),  # which engines serve an EAGLE-3.1 drafter as trained
        "benchmarks": rows, "show_drafted": any(b.get("drafted", "–") != "–" for b in rows),
        "decoding": card_rows.decoding(first.settings.temperature if first else None),
        "protocol": card_rows.PROTOCOL_SHORT if rows else None,
        "machines": card_rows.machines(evals) or None, "settings": card_rows.settings_lines(evals) or None,
        "plots": [{"file": p.name, "alt": card_rows.plot_caption(evals[p.stem])} for p in extra_files(folder)
                  if p.suffix == ".png" and p.stem in evals],  # a plot only next to the rows of its results
        "training": card_rows.training_rows(recipe, prov),
        "provenance": card_rows.provenance_rows(prov), "recipe_yaml": recipe_text,
        "datasets_note": card_rows.data_line(recipe),
        "target_weights": EMBEDDED_WEIGHTS_NOTE if target and is_embedded_name(target) else None,
        "demo_note": _demo_note(recipe, prov),
        **_usage(layout_names.card_info(fmt).engines, measured, folder, fmt),
    }
    return {k: v for k, v in variables.items() if v is not None}


def shared_variables(folder: Path, repo_id: str | None, published: bool) -> dict[str, Any]:
    """The variables every kind's card shows alike: names, snippet target, the evaluation rows measured on these very
    weights, the training and provenance records and the recipe (another kind's card module adds its own)."""
    from eagle3_zoo.checkpoint.check import recipe_file_problem

    if problem := recipe_file_problem(folder):
        raise ValueError(f"{problem}: the model card shows the recipe; fix or remove recipe.yaml")
    infos, _, _ = read_infos(folder)
    recipe_path = folder / "recipe.yaml"
    recipe_text = recipe_path.read_text(encoding="utf-8").strip() if recipe_path.is_file() else ""
    recipe_text = redact_document(recipe_text, ".yaml").strip() if recipe_text else ""  # the card shows it
    recipe = (yaml.safe_load(recipe_text) if recipe_text else None) or {}
    prov_json = redact_data(_read_json(folder / "provenance.json"))
    prov = parse_training_record({} if prov_json is None else prov_json, folder / "provenance.json")
    evals = {p.stem: r for p in sorted(folder.glob("eval_results*.json")) if (r := _eval_results(p, _Weights(folder)))}
    rows, _ = card_rows.evaluation_rows(evals)
    first = next(iter(evals.values()), None)
    return {
        "model_name": (repo_id or folder.name).split("/")[-1], "repo_id": repo_id or "ORG/NAME",
        "draft_model": repo_id if published and repo_id else str(folder),
        "hub_note": None if published and repo_id else _hub_note(folder, repo_id),
        "recipe_target": (recipe.get("target") or {}).get("name_or_path"),
        "eagle3_zoo_version": eagle3_zoo.__version__,
        "num_parameters": _count(sum(_numel(i.shape) for i in infos.values() if i.dtype in FLOAT_DTYPES)),
        "benchmarks": rows, "decoding": card_rows.decoding(first.settings.temperature if first else None),
        "machines": card_rows.machines(evals) or None,
        "training": card_rows.training_rows(recipe, prov), "provenance": card_rows.provenance_rows(prov),
        "recipe_yaml": recipe_text, "datasets_note": card_rows.data_line(recipe),
        "demo_note": _demo_note(recipe, prov),
    }


def _hub_note(folder: Path, repo_id: str | None) -> str:
    """What a card that is not (yet) on the Hub says above its snippets, which load the drafter from its folder."""
    planned = f", so `{repo_id}`, the repo id it was rendered for, may not exist" if repo_id else ""
    return (f"This card was rendered without an upload (e.g. by `eagle3-zoo publish --dry-run`){planned}. The "
            f"snippets load the drafter from its local folder `{folder}`; once `eagle3-zoo publish DRAFTER --repo-id "
            "YOUR_ORG/NAME` has uploaded it, use that repo id instead.")


def _demo_note(recipe: dict[str, Any], prov: TrainingRecord) -> str | None:
    """What a card of a smoke/demo run (`demo: true` in its recipe) says first."""
    if not recipe.get("demo"):
        return None
    steps, tokens = prov.steps, prov.data.train_supervised_tokens if prov.data else None
    how = f" ({steps} steps on {tokens:,} supervised tokens)" if tokens is not None and steps is not None else ""
    return (f"a demo drafter: trained by a short smoke configuration{how} to show that the pipeline works end to "
            "end. It is not meant for serving; train the full recipe for a useful drafter.")


def card_metadata(recipe_text: str, target: str | None, family: str | None, fmt: str | None, license: str,
                  tags: tuple[str, ...] = (), eagle31: bool = False) -> ModelCardData:
    """The card's YAML metadata: the target as base_model, Hub dataset ids, library and tags; no pipeline_tag."""
    from eagle3_zoo.values.zoo_registry import dataset_hub_id, target_hub_id

    recipe = (yaml.safe_load(recipe_text) if recipe_text else None) or {}
    sources = [s.get("path") for s in (recipe.get("data") or {}).get("sources") or [] if isinstance(s, dict)]
    datasets = list(dict.fromkeys(d for d in map(dataset_hub_id, map(str, sources)) if d))
    layout = layout_names.card_info(fmt)  # what the card says of the layout: its engines and tags
    return ModelCardData(
        base_model=target_hub_id(target), library_name="eagle3-zoo", license=license, datasets=datasets or None,
        tags=list(dict.fromkeys([*BASE_TAGS, *(["eagle3.1"] if eagle31 else []), *([family] if family else []),
                                 *layout.engines, *layout.card_tags, *tags])),
    )


def render_card(
    drafter_dir: str | Path,
    repo_id: str | None = None,
    fmt: str | None = None,
    license: str = "apache-2.0",
    tags: tuple[str, ...] = (),
    published: bool = False,
    **overrides: Any,
) -> ModelCard:
    """Render the model card of a drafter folder.

    Args:
        drafter_dir: drafter folder (any format), with optional recipe.yaml / provenance.json / eval_results*.json.
        repo_id: the Hub repo the card describes (used in the usage snippets when `published`).
        fmt: the published layout ("sglang", "speculators" or a registered one; default: detected).
        license: license of the drafter weights (YAML metadata).
        tags: extra tags besides eagle3 / speculative-decoding / draft-model / eagle3-zoo / the target family / the
            engines that load the layout.
        published: the card is uploaded to `repo_id` with the weights (a real publish). Otherwise the snippets load
            the drafter from `drafter_dir` and a note says it is not published.
        overrides: template variables to override (e.g. `license_note`).

    Returns:
        A `huggingface_hub.ModelCard`; `card.save(path)` writes README.md, `ModelCard.load(path)` parses it back.
    """
    fmt = fmt or load_drafter_config(drafter_dir)[1]
    layout = find_layout(fmt)
    if layout is not None and layout.kind not in ("eagle3", "dflash"):
        raise ValueError(f"{drafter_dir}: a {layout.kind} drafter ({layout.name} layout); its model card is not "
                         "written yet (the EAGLE-3 and DFlash cards would describe another drafter): publish it "
                         "without this package's card, or evaluate it with `eagle3-zoo eval DRAFTER_DIR`")
    if layout is not None and layout.kind == "dflash":
        from eagle3_zoo.hub.card_dflash import render_dflash_card

        shared = shared_variables(Path(drafter_dir), repo_id, published)
        return render_dflash_card(drafter_dir, fmt, shared, license, tags, **overrides)
    variables = {**card_variables(drafter_dir, repo_id, fmt, published), **overrides}
    data = card_metadata(variables.get("recipe_yaml", ""), variables.get("target"), variables.get("target_family"),
                         fmt, license, tags, eagle31=bool(variables.get("eagle31_options")))
    return ModelCard.from_template(data, template_str=template_text(), **variables)
