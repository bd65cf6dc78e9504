"""Model cards: `huggingface_hub.ModelCard` rendered from the packaged Jinja template and the files training and
evaluation leave next to the weights (config.json, recipe.yaml, provenance.json, eval_results.json, plots).

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
from eagle3_zoo.hub.convert import extra_files
from eagle3_zoo.hub.formats import load_drafter_config
from eagle3_zoo.hub.variants import eagle31_options, engine_note
from eagle3_zoo.hub.weights import FLOAT_DTYPES, read_infos
from eagle3_zoo.locations import is_hub_id

log = logging.getLogger(__name__)

TEMPLATE = "model_card.md.j2"
_UNSHOWN_SETTINGS = ("eos_token_ids", "drafter", "drafter_weights_sha256")  # local paths and digests
BASE_TAGS = ("eagle3", "speculative-decoding", "draft-model", "eagle3-zoo")
_FORMAT_NOTES = {
    "sglang": ("SGLang / canonical EAGLE-3 layout (`model.safetensors`, `midlayer.*` keys)",
               "vLLM loads this layout too, but reads custom aux layer ids only from the speculators format "
               "(`eagle3-zoo export DIR --format speculators`)."),
    "speculators": ("vLLM speculators format (`speculators_model_type: eagle3`)",
                    "This is vLLM's speculators format: `vllm serve REPO` also works on its own. For SGLang, convert "
                    "it first: `eagle3-zoo pull REPO --convert-to sglang`."),
}


def template_text() -> str:
    """The packaged card template."""
    return resources.files("eagle3_zoo").joinpath("resources", TEMPLATE).read_text(encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        log.warning("%s: not valid JSON (%s); the card leaves it out", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _eval_results(path: Path) -> dict[str, Any]:
    """An `eval` results file, or {} when it was measured on other weights than the folder's (e.g. a rerun of `fit`
    replaced them and kept the old results): its figures would be false on this card."""
    results = _read_json(path)
    recorded = (results.get("settings") or {}).get("drafter_weights_sha256") if isinstance(
        results.get("settings"), dict) else None
    if not results or recorded is None:
        return results
    from eagle3_zoo.hub.weights import weights_digest

    if recorded != weights_digest(path.parent):
        log.warning("%s was measured on other weights than %s holds now (sha256 %s...): left off the card; rerun "
                    "`eagle3-zoo eval` to measure these weights", path, path.parent, recorded[:12])
        return {}
    return results


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: Any, fmt: str = "{:.2f}", suffix: str = "") -> str:
    return fmt.format(value) + suffix if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    return next((mapping[k] for k in keys if mapping.get(k) is not None), None)


def _is_cut(settings: Any) -> bool:
    return isinstance(settings, dict) and bool(settings.get("min_prob"))


def _draft_shape(results: dict[str, Any]) -> str | None:
    """"tree 8/10/60" or "chain 7" from an eval results' settings (None if they do not say)."""
    settings = results.get("settings") if isinstance(results.get("settings"), dict) else {}
    if settings.get("engine"):  # `eval --engine`: measured by the serving engine's own counters
        return f"{settings['engine']} engine, chain {settings.get('num_speculative_tokens')}"
    min_prob = settings.get("min_prob")
    cut = f" cut at draft probability {min_prob:g}" if isinstance(min_prob, (int, float)) and min_prob else ""
    if settings.get("mode") == "chain":
        return f"chain {settings.get('depth')}{cut}"
    if settings.get("mode") == "tree":
        return f"tree {settings.get('depth')}/{settings.get('top_k')}/{settings.get('total_tokens')}{cut}"
    return None


def _benchmarks(results: dict[str, Any], label: str | None = None, cut: bool = False) -> list[dict[str, str]]:
    benches = dict(results.get("benchmarks") or {})
    if isinstance(benches, list):  # tolerate [{"name": ..., ...}]
        benches = {str(b.get("name", i)): b for i, b in enumerate(benches) if isinstance(b, dict)}
    if not benches and isinstance(results.get("overall"), dict):  # an engine run reports its pooled counters only
        settings = results.get("settings") if isinstance(results.get("settings"), dict) else {}
        benches = {", ".join(map(str, settings.get("benches") or [])) or "all": results["overall"]}
    if isinstance(results.get("overall"), dict) and len(benches) > 1:
        benches["all (pooled)"] = results["overall"]
    rows = []
    for name, b in benches.items():
        b = b if isinstance(b, dict) else {"tau": b}
        depth = b.get("acceptance_per_depth")
        lossless = b.get("lossless")
        attempts, cycles = b.get("depth_attempts") or [], b.get("cycles")
        # a shape cut at a draft probability drafts in only some cycles: its acceptance counts those alone
        drafted = attempts[0] / cycles if cut and attempts and isinstance(cycles, int) and cycles else None
        rows.append({
            "name": _cell(f"{name} ({label})" if label else name), "requests": _cell(b.get("requests")),
            "tau": _num(b.get("tau")),
            "tau_per_request_mean": _num(b.get("tau_per_request_mean")), "speedup": _num(b.get("speedup"), suffix="x"),
            "tokens_per_s": _num(_first(b, "spec_tokens_per_s", "tokens_per_s"), "{:.1f}"),
            "plain_tokens_per_s": _num(b.get("baseline_tokens_per_s"), "{:.1f}"),
            "drafted": "–" if drafted is None else f"{drafted:.0%}",
            "acceptance_per_depth": ", ".join(_num(x) for x in depth) if isinstance(depth, list) else "–",
            "lossless": "–" if lossless is None else ("yes" if lossless else "NO"),
        })
    return rows


def _plot_caption(png: Path) -> str:
    """Alt text of an `eval` plot, its own for each image: what it shows, for which shape, benchmarks and requests."""
    results = _read_json(png.with_suffix(".json"))
    settings = results.get("settings") if isinstance(results.get("settings"), dict) else {}
    benches = ", ".join(str(b) for b in settings.get("benches") or []) or "the benchmarks"
    if isinstance(results.get("shapes"), list):
        shapes = [e for e in results["shapes"] if isinstance(e, dict)]
        requests = (shapes[0].get("overall") or {}).get("requests") if shapes else None
        count = f", {requests} requests" if requests else ""
        return f"Tau and speedup per draft shape ({', '.join(str(e.get('shape')) for e in shapes)}) on {benches}{count}"
    requests = (results.get("overall") or {}).get("requests") or sum(
        (b or {}).get("requests") or 0 for b in (results.get("benchmarks") or {}).values() if isinstance(b, dict))
    count = f", {requests} requests" if requests else ""
    return f"Acceptance per draft depth, {_draft_shape(results) or 'draft'} on {benches}{count}"


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    return _cell(value) if value else ""


def _training_rows(recipe: dict[str, Any], prov: dict[str, Any]) -> list[tuple[str, str]]:
    get = lambda section, key: (recipe.get(section) or {}).get(key)  # noqa: E731
    if isinstance(prov.get("training"), dict):  # `fit` nests the run's facts under "training"
        prov = {**prov, **prov["training"]}
    data = recipe.get("data") or {}
    sources = ", ".join(str(s.get("path")) for s in data.get("sources") or [] if isinstance(s, dict))
    rows = [
        ("Data", sources and f"{sources} (max {_cell(data.get('max_samples'))} conversations, max length "
                             f"{_cell(data.get('max_length'))} tokens, regenerated: "
                             f"{_cell((data.get('regenerate') or {}).get('enabled'))})"),
        ("Training-time test", get("ttt", "steps") and f"{get('ttt', 'steps')} steps ({get('ttt', 'schedule')})"),
        ("Optimizer", get("optim", "lr") and f"AdamW, lr {get('optim', 'lr')}, warmup {get('optim', 'warmup_steps')}, "
                                             f"{get('optim', 'decay')} decay"),
        ("Steps", _first(prov, "global_step", "steps", "max_steps") or get("trainer", "max_steps")),
        ("Batch", get("trainer", "batch_size") and f"{get('trainer', 'batch_size')} per device x "
                                                  f"{get('trainer', 'devices')} devices x "
                                                  f"{get('trainer', 'accumulate_grad_batches') or 1} accumulation"),
        ("Precision / strategy", get("trainer", "precision") and
         f"{get('trainer', 'precision')} / {get('trainer', 'strategy') or 'auto'}"),
        ("Hardware", _first(prov, "hardware", "device", "accelerator", "devices")),
        ("Training time", _first(prov, "train_time", "wall_time", "duration")
         or _num(_first(prov, "train_time_s", "wall_time_s", "duration_s"), "{:.0f}", " s")),
    ]
    return [(k, _cell(v)) for k, v in rows if v and v != "–"]


def _provenance_rows(prov: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in prov.items():
        if isinstance(value, dict):
            rows += [(f"{key}.{k}", _cell(v)) for k, v in value.items()]
        else:
            rows.append((key, _cell(value)))
    return rows


def _serve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    from eagle3_zoo.speculative.shapes import spec_from_settings

    spec = spec_from_settings(settings)  # an eagle3-zoo evaluation (its tree size does not count the root)
    if spec is not None:
        return spec.serving_flags()
    # other tools' settings: SGLang-style names, whose draft-token count includes the root
    depth = _first(settings, "depth", "num_steps", "max_depth", "draft_depth")
    chain = settings.get("mode") == "chain" or settings.get("tree") is False
    topk = 1 if chain else _first(settings, "top_k", "topk", "eagle_topk")
    total = depth + 1 if chain and depth else _first(settings, "num_draft_tokens", "tree_size")
    out = {"sglang_num_steps": depth, "sglang_topk": topk, "sglang_num_draft_tokens": total,
           "vllm_num_speculative_tokens": depth}
    return {k: v for k, v in out.items() if v is not None}


def _hub_note(folder: Path, repo_id: str | None) -> str:
    """What a card that is not (yet) on the Hub says above its snippets, which load the drafter from its folder."""
    planned = f", so `{repo_id}`, the repo id it was rendered for, may not exist" if repo_id else ""
    return (f"This card was rendered without an upload (e.g. by `eagle3-zoo publish --dry-run`){planned}. The "
            f"snippets load the drafter from its local folder `{folder}`; once `eagle3-zoo publish DRAFTER --repo-id "
            "YOUR_ORG/NAME` has uploaded it, use that repo id instead.")


def card_variables(drafter_dir: str | Path, repo_id: str | None = None, fmt: str | None = None,
                   published: bool = False) -> dict[str, Any]:
    """The template variables for a drafter folder (everything the card shows, as plain strings and rows).

    The usage snippets name `repo_id` only when `published` (the card goes to that repo with the weights); otherwise
    they load the drafter from `drafter_dir` and the card says so, so no snippet points at a repo that may not exist.
    """
    from eagle3_zoo.hub.zoo import target_hub_id

    folder = Path(drafter_dir)
    cfg, detected = load_drafter_config(folder)
    fmt = fmt or detected
    infos, _, _ = read_infos(folder)
    recipe_path = folder / "recipe.yaml"
    recipe_text = recipe_path.read_text(encoding="utf-8").strip() if recipe_path.is_file() else ""
    recipe = (yaml.safe_load(recipe_text) if recipe_text else None) or {}
    prov = _read_json(folder / "provenance.json")
    results = _eval_results(folder / "eval_results.json")
    # more runs of `eagle3-zoo eval` (other draft shapes) saved as eval_results_<name>.json: rows labelled by shape
    more = [r for r in map(_eval_results, sorted(folder.glob("eval_results_*.json"))) if r]
    benchmarks = _benchmarks(results, _draft_shape(results) if more else None, _is_cut(results.get("settings")))
    for extra in more:
        if isinstance(extra.get("shapes"), list):  # an `eval --shapes` comparison: rows per shape
            for entry in extra["shapes"]:
                if isinstance(entry, dict):
                    benchmarks += _benchmarks(entry, str(entry.get("shape", "more")), "@" in str(entry.get("shape")))
        else:
            benchmarks += _benchmarks(extra, _draft_shape(extra) or "more", _is_cut(extra.get("settings")))
    target = cfg.target_name_or_path or (recipe.get("target") or {}).get("name_or_path")
    hub_target = target_hub_id(target)
    from eagle3_zoo.adapters.embedded import EMBEDDED_WEIGHTS_NOTE, is_embedded_name
    settings = results.get("settings") if isinstance(results.get("settings"), dict) else {}
    temperature = settings.get("temperature")
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
        "format_description": _FORMAT_NOTES.get(fmt, _FORMAT_NOTES["sglang"])[0],
        "eagle31_options": ", ".join(eagle31_options(cfg)) or None,  # tags the card "eagle3.1"
        "usage_note": " ".join(filter(None, (_FORMAT_NOTES.get(fmt, _FORMAT_NOTES["sglang"])[1], engine_note(cfg)))),
        "benchmarks": benchmarks, "protocol": _describe(results.get("protocol")),
        "settings": _describe({k: v for k, v in settings.items() if k not in _UNSHOWN_SETTINGS}),
        "machine": _describe(results.get("machine")),
        "decoding": "greedy, T=0" if temperature in (None, 0, 0.0) else f"lossless sampling, T={temperature}",
        "plots": [{"file": p.name, "alt": _plot_caption(p)} for p in extra_files(folder) if p.suffix == ".png"],
        "speed_note": "" if not any(b["speedup"] != "–" for b in benchmarks) else (
            "Speedup = tokens/s of speculative decoding over plain decoding's on the same requests, on the machine "
            "below, in the same run. Both scale with that machine's load: on a shared machine they are lower and "
            "noisier than on a quiet one."),
        "training": _training_rows(recipe, prov), "provenance": _provenance_rows(prov), "recipe_yaml": recipe_text,
        "target_weights": EMBEDDED_WEIGHTS_NOTE if target and is_embedded_name(target) else None,
        "demo_note": _demo_note(recipe, prov), "show_drafted": any(b.get("drafted", "–") != "–" for b in benchmarks),
        **_serve_settings(settings),
    }
    return {k: v for k, v in variables.items() if v is not None}


def _demo_note(recipe: dict[str, Any], prov: dict[str, Any]) -> str | None:
    """What a card of a smoke/demo run (`demo: true` in its recipe) says first."""
    if not recipe.get("demo"):
        return None
    training, data = prov.get("training") or {}, prov.get("data") or {}
    steps, tokens = training.get("global_step"), data.get("train_supervised_tokens")
    how = f" ({steps} steps on {tokens:,} supervised tokens)" if isinstance(tokens, int) and steps is not None else ""
    return (f"a demo drafter: trained by a short smoke configuration{how} to show that the pipeline works end to "
            "end. It is not meant for serving; train the full recipe for a useful drafter.")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _datasets(recipe_text: str) -> list[str]:
    recipe = (yaml.safe_load(recipe_text) if recipe_text else None) or {}
    paths = [str(s.get("path")) for s in (recipe.get("data") or {}).get("sources") or [] if isinstance(s, dict)]
    return [p for p in paths if is_hub_id(p)]


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
        drafter_dir: drafter folder (any format), with optional recipe.yaml / provenance.json / eval_results.json.
        repo_id: the Hub repo the card describes (used in the usage snippets when `published`).
        fmt: the published format ("sglang" or "speculators"; default: detected).
        license: license of the drafter weights (YAML metadata).
        tags: extra tags besides eagle3 / speculative-decoding / draft-model / eagle3-zoo / the target family.
        published: the card is uploaded to `repo_id` with the weights (a real publish). Otherwise the snippets load
            the drafter from `drafter_dir` and a note says it is not published.
        overrides: template variables to override (e.g. `license_note`, `sglang_topk`).

    Returns:
        A `huggingface_hub.ModelCard`; `card.save(path)` writes README.md, `ModelCard.load(path)` parses it back.
    """
    variables = {**card_variables(drafter_dir, repo_id, fmt, published), **overrides}
    family = variables.get("target_family")
    from eagle3_zoo.hub.zoo import target_hub_id

    data = ModelCardData(
        base_model=target_hub_id(variables.get("target")),
        library_name="eagle3-zoo",
        tags=list(dict.fromkeys([*BASE_TAGS, *(["eagle3.1"] if variables.get("eagle31_options") else []),
                                 *([family] if family else []), *tags])),
        datasets=_datasets(variables.get("recipe_yaml", "")) or None,
        license=license,
        pipeline_tag="text-generation",
    )
    return ModelCard.from_template(data, template_str=template_text(), **variables)
