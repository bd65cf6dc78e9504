"""The rows of a model card, from the JSON files `eval` and `fit` write: one evaluation row per benchmark and draft
shape (the same rows for every export layout of the same weights), the shapes they measured (which serving snippets
may name), the machines and their load, and the compact training and provenance records."""

from __future__ import annotations

import json
import time
from typing import Any

from eagle3_zoo.draft_shapes import TreeSpec, spec_from_settings

PROTOCOL_SHORT = (
    "tau = tokens per target forward pass (accepted draft tokens + the target's bonus token), pooled over the "
    "requests; acceptance per depth is conditional on reaching that depth; speedup = tokens/s of speculative "
    "decoding over plain KV-cache decoding of the same requests, in the same run, batch size 1. The full protocol "
    "is the `protocol` entry of each `eval_results*.json` next to the weights.")


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: Any, fmt: str = "{:.2f}", suffix: str = "") -> str:
    return fmt.format(value) + suffix if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    return next((mapping[k] for k in keys if mapping.get(k) is not None), None)


def _settings(results: dict[str, Any]) -> dict[str, Any]:
    return results.get("settings") if isinstance(results.get("settings"), dict) else {}


def draft_shape(results: dict[str, Any]) -> str | None:
    """"tree 8/10/60" or "chain 7" from an eval results' settings (None if they do not say)."""
    settings = _settings(results)
    if settings.get("engine"):  # `eval --engine`: measured by the serving engine's own counters
        return f"{settings['engine']} engine, chain {settings.get('num_speculative_tokens')}"
    min_prob = settings.get("min_prob")
    cut = f" cut at draft probability {min_prob:g}" if isinstance(min_prob, (int, float)) and min_prob else ""
    if settings.get("mode") == "chain":
        return f"chain {settings.get('depth')}{cut}"
    if settings.get("mode") == "tree":
        return f"tree {settings.get('depth')}/{settings.get('top_k')}/{settings.get('total_tokens')}{cut}"
    return None


def _bench_rows(results: dict[str, Any], label: str | None, cut: bool) -> list[dict[str, str]]:
    benches = dict(results.get("benchmarks") or {})
    if isinstance(benches, list):  # tolerate [{"name": ..., ...}]
        benches = {str(b.get("name", i)): b for i, b in enumerate(benches) if isinstance(b, dict)}
    if not benches and isinstance(results.get("overall"), dict):  # an engine run reports its pooled counters only
        benches = {", ".join(map(str, _settings(results).get("benches") or [])) or "all": results["overall"]}
    if isinstance(results.get("overall"), dict) and len(benches) > 1:
        benches["all (pooled)"] = results["overall"]
    rows = []
    for name, b in benches.items():
        b = b if isinstance(b, dict) else {"tau": b}
        depth, lossless = b.get("acceptance_per_depth"), b.get("lossless")
        attempts, cycles = b.get("depth_attempts") or [], b.get("cycles")
        # a shape cut at a draft probability drafts in only some cycles: its acceptance counts those alone
        drafted = attempts[0] / cycles if cut and attempts and isinstance(cycles, int) and cycles else None
        rows.append({
            "name": _cell(f"{name} ({label})" if label else name), "requests": _cell(b.get("requests")),
            "tau": _num(b.get("tau")), "tau_per_request_mean": _num(b.get("tau_per_request_mean")),
            "speedup": _num(b.get("speedup"), suffix="x"),
            "tokens_per_s": _num(_first(b, "spec_tokens_per_s", "tokens_per_s"), "{:.1f}"),
            "plain_tokens_per_s": _num(b.get("baseline_tokens_per_s"), "{:.1f}"),
            "drafted": "–" if drafted is None else f"{drafted:.0%}",
            "acceptance_per_depth": ", ".join(_num(x) for x in depth) if isinstance(depth, list) else "–",
            "lossless": "–" if lossless is None else ("yes" if lossless else "NO"),
        })
    return rows


def _pooled_tau(results: dict[str, Any]) -> float | None:
    overall = results.get("overall") if isinstance(results.get("overall"), dict) else {}
    tau = overall.get("tau", results.get("tau"))
    if tau is None:
        taus = [b.get("tau") for b in (results.get("benchmarks") or {}).values() if isinstance(b, dict)]
        tau = next((t for t in taus if isinstance(t, (int, float))), None)
    return tau if isinstance(tau, (int, float)) else None


def evaluation_rows(evals: dict[str, dict[str, Any]]) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """The table rows of every eval results file (name -> results; labelled by draft shape when there are several
    files) and the shapes they measured: ``{"label", "spec": TreeSpec | None, "engine", "tau"}``."""
    rows: list[dict[str, str]] = []
    measured: list[dict[str, Any]] = []
    for results in evals.values():
        if isinstance(results.get("shapes"), list):  # an `eval --shapes` comparison: rows per shape
            for entry in results["shapes"]:
                if isinstance(entry, dict):
                    label = str(entry.get("shape", "more"))
                    rows += _bench_rows(entry, label, "@" in label)
                    spec = _parse(label)
                    measured.append({"label": label, "spec": spec, "engine": None, "tau": _pooled_tau(entry)})
            continue
        settings = _settings(results)
        label = draft_shape(results)
        rows += _bench_rows(results, label if len(evals) > 1 else None, bool(settings.get("min_prob")))
        engine = settings.get("engine")
        spec = TreeSpec.chain(int(settings["num_speculative_tokens"])) if engine and isinstance(
            settings.get("num_speculative_tokens"), int) else spec_from_settings(settings)
        measured.append({"label": label or "the evaluation", "spec": spec, "engine": engine,
                         "tau": _pooled_tau(results)})
    return rows, measured


def _parse(label: str) -> TreeSpec | None:
    try:
        return TreeSpec.parse(label)
    except ValueError:
        return None


def sglang_shape(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """SGLang's flags for the measured shape (our decoder, no draft-probability cut: SGLang has none) with the
    highest tau."""
    ok = [m for m in measured if m["spec"] is not None and not m["engine"] and not m["spec"].min_prob and m["tau"]]
    if not ok:
        return None
    best = max(ok, key=lambda m: m["tau"])
    f = best["spec"].serving_flags()
    flags = (f"--speculative-num-steps {f['sglang_num_steps']} --speculative-eagle-topk {f['sglang_topk']} "
             f"--speculative-num-draft-tokens {f['sglang_num_draft_tokens']}")
    return {"label": best["label"], "flags": flags}


def vllm_shape(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM drafts chains: the measured chain (ours or vLLM's own, uncut) with the highest tau, as its length."""
    ok = [m for m in measured if m["spec"] is not None and m["spec"].is_chain and not m["spec"].min_prob and m["tau"]]
    if not ok:
        return None
    best = max(ok, key=lambda m: m["tau"])
    return {"label": best["label"], "k": min(best["spec"].depth, best["spec"].total_tokens)}


_UNSHOWN_SETTINGS = ("eos_token_ids", "drafter", "drafter_weights_sha256", "drafter_tensors_sha256", "benches",
                     "drafter_dir_served", "target_dir_served", "server_url", "baseline_url", "greedy_only_reason")


def settings_lines(evals: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The settings of each evaluation (``{"label", "text"}``), to reproduce it (not the local paths and digests it
    recorded)."""
    lines = []
    for results in evals.values():
        shown = {k: v for k, v in _settings(results).items() if k not in _UNSHOWN_SETTINGS and v is not None}
        if shown:
            label = draft_shape(results) or ("shape comparison" if results.get("shapes") else "evaluation")
            lines.append({"label": label, "text": "; ".join(f"{k}: {_cell(v)}" for k, v in shown.items())})
    return lines


def decoding(settings: Any) -> str:
    temperature = settings.get("temperature") if isinstance(settings, dict) else None
    return "greedy, T=0" if temperature in (None, 0, 0.0) else f"lossless sampling, T={temperature}"


def _load(load: Any) -> str | None:
    if not isinstance(load, dict):
        return None
    start, end = (load.get(k) for k in ("start", "end"))
    if not (isinstance(start, list) and isinstance(end, list) and start and end):
        return None
    return f"{start[0]:.2f} at the start, {end[0]:.2f} at the end"


def machines(evals: dict[str, dict[str, Any]]) -> list[str]:
    """One line per distinct machine of the evaluations, with the load average (1 minute) during each run."""
    lines: dict[str, list[str]] = {}
    for results in evals.values():
        m = results.get("machine") if isinstance(results.get("machine"), dict) else {}
        if not m:
            continue
        where = m.get("gpu") or m.get("processor") or m.get("platform") or "unknown machine"
        threads = f", {m['torch_threads']} torch threads" if m.get("torch_threads") and not m.get("gpu") else ""
        cores = f", {m['cpu_count']} cores" if m.get("cpu_count") else ""
        what = f"{where} ({m.get('device', 'cpu')}{cores}{threads})"
        label = draft_shape(results) or ("shape comparison" if results.get("shapes") else "evaluation")
        lines.setdefault(what, []).append(f"{label}: {_load(m.get('load_average')) or 'not recorded'}")
    return [f"{what}; load average (1 min) during each run: {'; '.join(loads)}" for what, loads in lines.items()]


def plot_caption(results: dict[str, Any]) -> str:
    """Alt text of an `eval` plot, its own for each image: what it shows, for which shape, benchmarks and requests."""
    settings = _settings(results)
    benches = ", ".join(str(b) for b in settings.get("benches") or []) or "the benchmarks"
    if isinstance(results.get("shapes"), list):
        shapes = [e for e in results["shapes"] if isinstance(e, dict)]
        requests = (shapes[0].get("overall") or {}).get("requests") if shapes else None
        count = f", {requests} requests" if requests else ""
        return f"Tau and speedup per draft shape ({', '.join(str(e.get('shape')) for e in shapes)}) on {benches}{count}"
    requests = (results.get("overall") or {}).get("requests") or sum(
        (b or {}).get("requests") or 0 for b in (results.get("benchmarks") or {}).values() if isinstance(b, dict))
    count = f", {requests} requests" if requests else ""
    return f"Acceptance per draft depth, {draft_shape(results) or 'draft'} on {benches}{count}"


def duration(seconds: Any) -> str | None:
    """"74 s", "3 min 24 s", "2 h 05 min"."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return None
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def data_line(recipe: dict[str, Any], prov: dict[str, Any]) -> str | None:
    """The training data in words: the sources (with their Hub ids), the selection and the regeneration."""
    from eagle3_zoo.zoo_registry import dataset_hub_id

    data = recipe.get("data") or {}
    sources = [str(s.get("path")) for s in data.get("sources") or [] if isinstance(s, dict)]
    if not sources:
        return None
    named = ", ".join(f"`{s}` ([{h}](https://huggingface.co/datasets/{h}))" if (h := dataset_hub_id(s)) and h != s
                      else f"[{s}](https://huggingface.co/datasets/{s})" if h else f"`{s.split('/')[-1]}`"
                      for s in sources)
    regenerated = (data.get("regenerate") or {}).get("enabled")
    limit = f", at most {data['max_samples']:,} conversations" if isinstance(data.get("max_samples"), int) else ""
    answers = "; assistant turns regenerated by the target itself" if regenerated else ""
    return f"{named}{limit}, at most {data.get('max_length')} tokens each{answers}"


def training_rows(recipe: dict[str, Any], prov: dict[str, Any]) -> list[tuple[str, str]]:
    get = lambda section, key: (recipe.get(section) or {}).get(key)  # noqa: E731
    record = {**prov, **prov["training"]} if isinstance(prov.get("training"), dict) else prov
    metrics = record.get("final_metrics") if isinstance(record.get("final_metrics"), dict) else {}
    val = ", ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in sorted(metrics.items())
                    if k.startswith("val/") and k.split("/", 1)[1] in ("loss", "acc_0", "acc_1", "acc_2", "tau"))
    rows = [
        ("Data", data_line(recipe, prov)),
        ("Training-time test", get("ttt", "steps") and f"{get('ttt', 'steps')} steps ({get('ttt', 'schedule')})"),
        ("Optimizer", get("optim", "lr") and f"AdamW, lr {get('optim', 'lr')}, warmup {get('optim', 'warmup_steps')}, "
                                             f"{get('optim', 'decay')} decay"),
        ("Steps", _first(record, "global_step", "steps", "max_steps") or get("trainer", "max_steps")),
        ("Epochs", record.get("epochs")),
        ("Batch", get("trainer", "batch_size") and f"{get('trainer', 'batch_size')} per device x "
                                                  f"{get('trainer', 'devices')} devices x "
                                                  f"{get('trainer', 'accumulate_grad_batches') or 1} accumulation"),
        ("Precision / strategy", get("trainer", "precision") and
         f"{get('trainer', 'precision')} / {get('trainer', 'strategy') or 'auto'}"),
        ("Hardware", _first(record, "hardware", "device", "accelerator", "devices")),
        ("Training time", _first(record, "train_time", "wall_time", "duration")
         or duration(_first(record, "train_time_s", "wall_time_s", "duration_s"))),
        ("Final validation", val or None),
    ]
    return [(k, _cell(v)) for k, v in rows if v is not None and v != "" and v != "–"]


def provenance_rows(prov: dict[str, Any]) -> list[tuple[str, str]]:
    """A few lines of `provenance.json` (the file itself travels with the weights): when, which code, which target
    and data; not its raw JSON, and not the recipe again (shown above)."""
    git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
    packages = prov.get("packages") if isinstance(prov.get("packages"), dict) else {}
    if not packages and isinstance(prov.get("versions"), dict):
        packages = prov["versions"]
    created = prov.get("created_unix")
    rows = [
        ("Created", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(created)) if isinstance(created, int) else None),
        ("Code", git.get("sha") and f"commit {str(git['sha'])[:10]}" + (" with uncommitted changes" if git.get("dirty")
                                                                        else "")),
        ("Software", ", ".join(f"{k} {v}" for k, v in packages.items() if v) or None),
        ("Python", prov.get("python")),
        ("Target", _target_line(prov.get("target"))),
        ("Data", _data_counts(prov.get("data"))),
    ]
    return [(k, _cell(v)) for k, v in rows if v]


def _target_line(target: Any) -> str | None:
    if isinstance(target, str):
        return target
    if not isinstance(target, dict) or not target.get("name_or_path"):
        return None
    shape = ", ".join(w.format(target[k]) for k, w in (("num_hidden_layers", "{} layers"), ("hidden_size", "hidden {}"),
                                                       ("vocab_size", "vocab {}")) if target.get(k))
    return f"{target['name_or_path']} ({target.get('model_type') or '?'}, {target.get('dtype') or '?'}; {shape})"


def _data_counts(data: Any) -> str | None:
    if not isinstance(data, dict) or "train_examples" not in data:
        return None
    token = data.get("tokenization") if isinstance(data.get("tokenization"), dict) else {}
    dropped = {**(data.get("skipped_by_reader") or {}), **((data.get("regeneration") or {}).get("skipped") or {}),
               **(token.get("skipped") or {})}
    parts = [f"{data.get('conversations_read', '?'):,} conversations read" if isinstance(
        data.get("conversations_read"), int) else None,
             f"{data['train_examples']:,} train / {data.get('val_examples', 0):,} validation examples",
             f"{data['train_tokens']:,} tokens ({data.get('train_supervised_tokens', 0):,} supervised)"
             if isinstance(data.get("train_tokens"), int) else None,
             f"draft vocabulary covers {data['draft_vocab_coverage']:.1%} of supervised tokens"
             if isinstance(data.get("draft_vocab_coverage"), (int, float)) else None,
             ("dropped: " + ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in sorted(dropped.items())))
             if dropped else None]
    return "; ".join(p for p in parts if p)
