"""Load a frozen target (model, tokenizer, adapter), optionally with a merged PEFT LoRA."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.errors import HTTPError as HubHTTPError  # its HTTP client's base error: transport and status
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from eagle3_zoo.adapters.base import TargetAdapter, adapter_for
from eagle3_zoo.adapters.embedded import EMBEDDED_NAMES, embedded_target_dir, is_embedded_name
from eagle3_zoo.util.fileio import pickle_refusal

logger = logging.getLogger(__name__)

HUB_PROBE_TIMEOUT_S = 5.0
"""One request asks the Hub whether a repo exists; a Hub that does not answer in this time counts as unreachable
(transformers' own download would retry for ~25 s before failing)."""
_WHAT_TO_PASS = ("pass a local folder with config.json, a Hub repo id such as 'Qwen/Qwen2.5-7B-Instruct', or "
                 f"{' / '.join(repr(n) for n in EMBEDDED_NAMES)} for the embedded SmolLM2-135M-Instruct")


class TargetNotFoundError(FileNotFoundError):
    """The target is neither a local model folder nor a repo the Hub (or the local Hub cache) has."""


class UnsafeTargetFileError(ValueError):
    """A pickle weight file of a target or LoRA adapter holding objects that are not plain tensors: the safe loader
    (`torch.load(weights_only=True)`, what transformers and peft use) refused it before any of its code ran."""


def resolve_target(name_or_path: str | os.PathLike) -> tuple[str | Path, bool]:
    """Where a target is read from, checked before any download: ``(path or repo id, local_files_only)``.

    A Hub id is looked up in the local Hugging Face cache and, unless ``HF_HUB_OFFLINE`` is set, with one request to
    the Hub (no retries). A cached target is read from the cache when the Hub is offline or unreachable.

    Raises:
        TargetNotFoundError: a file, a folder without config.json, a name that is no Hub id, a repo the Hub does not
            have, or a Hub that is offline/unreachable while the cache lacks the repo. One line with what to pass.
    """
    if is_embedded_name(name_or_path):
        return embedded_target_dir(), False
    name, local = str(name_or_path), Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise TargetNotFoundError(f"target {name!r} is a folder without config.json; {_WHAT_TO_PASS}")
        return local, False
    if local.exists():
        raise TargetNotFoundError(f"target {name!r} is a file, not a model folder; {_WHAT_TO_PASS}")
    try:
        huggingface_hub.utils.validate_repo_id(name)
    except HFValidationError:
        raise TargetNotFoundError(f"target {name!r} is neither a local folder nor a Hub repo id; "
                                  f"{_WHAT_TO_PASS}") from None
    return name, _hub_repo_is_local_only(name)


def _hub_repo_is_local_only(repo_id: str) -> bool:
    """Whether Hub repo `repo_id` must be read from the cache only; raises when neither the Hub nor the cache has it."""
    cached = isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str)
    if huggingface_hub.is_offline_mode():
        if cached:
            return True
        raise TargetNotFoundError(f"target {repo_id!r} is neither a local folder nor in the Hugging Face cache, and "
                                  f"HF_HUB_OFFLINE is set so the Hub is not asked; {_WHAT_TO_PASS}")
    api = huggingface_hub.HfApi()
    error = _ask_hub(api, repo_id)
    if error is None or isinstance(error, GatedRepoError):
        return False  # it exists (a gated repo: the download says how to get access)
    if isinstance(error, RepositoryNotFoundError):
        raise TargetNotFoundError(f"target {repo_id!r} is neither a local folder nor a repo on the Hub "
                                  f"({api.endpoint}; a private repo needs a token: `hf auth login`); {_WHAT_TO_PASS}")
    if not isinstance(error, (HubHTTPError, OSError)):
        raise error  # not a network condition
    cause = f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"
    if cached:
        logger.warning("the Hub (%s) is unreachable (%s); reading %s from the local cache", api.endpoint, cause,
                       repo_id)
        return True
    raise TargetNotFoundError(f"target {repo_id!r} is neither a local folder nor reachable on the Hub ({api.endpoint}: "
                              f"{cause}; this machine may be offline) and it is not in the Hugging Face cache; "
                              f"{_WHAT_TO_PASS}")


def _ask_hub(api: huggingface_hub.HfApi, repo_id: str) -> BaseException | None:
    """The error of one `model_info` request for `repo_id` (None: the repo exists), awaited `HUB_PROBE_TIMEOUT_S`
    seconds at most: the client's timeout does not cover a DNS lookup that hangs, so the request runs in a daemon
    thread that is left behind if it does not answer."""
    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            api.model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
            outcome["error"] = None
        except Exception as e:  # returned to the caller, which tells a missing repo from no answer
            outcome["error"] = e

    thread = threading.Thread(target=ask, name="eagle3-zoo-target-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    return outcome["error"] if "error" in outcome else TimeoutError(f"no answer within {HUB_PROBE_TIMEOUT_S:g} s")


def load_target(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    lora_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, Any, TargetAdapter]:
    """Load a target through ``AutoModelForCausalLM``/``AutoTokenizer``, frozen and in eval mode.

    Args:
        name_or_path: Hub id or local directory, or ``"smollm2-135m-instruct"``/``"embedded"`` for the embedded
            SmolLM2 (converted from its GGUF once, then read from the cache).
        dtype: Weight dtype (``torch.bfloat16``, ``"bfloat16"``...; ``"auto"`` keeps the checkpoint's). A checkpoint
            quantised in a format the adapter declares (`TargetAdapter.quantized_formats`, e.g. gpt-oss MXFP4) is
            dequantised on load.
        lora_path: Optional PEFT LoRA adapter directory; it is merged into the weights (``merge_and_unload``), so
            features come from the fine-tuned target at plain-model speed.
        trust_remote_code: Passed to transformers.
        device: Where the model is placed.

    Returns:
        ``(model, tokenizer, adapter)`` with every parameter ``requires_grad=False``.

    Raises:
        TargetNotFoundError: `name_or_path` is neither a local model folder nor a repo the Hub or its cache has
            (see `resolve_target`; fast when offline or the Hub is unreachable).
        UnknownAdapterError: the config's ``model_type`` has no adapter (checked before any weight is read).
        ValueError: the checkpoint lacks weights of the model (they would silently stay random).
        UnsafeTargetFileError: a pickle weight file of the target or the LoRA holds objects that are not plain
            tensors (refused unrun; the message names the file).
    """
    torch_dtype = _torch_dtype(dtype)
    path, kwargs, config, adapter = _target_config(name_or_path, trust_remote_code)
    dequantize = _dequantize_kwargs(config, adapter)
    # weights go straight to `device` (a rank's GPU), never through a full copy in host memory
    with _refused_pickles_named(path, "target"):
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch_dtype, output_loading_info=True, device_map=str(torch.device(device)),
            **dequantize, **kwargs
        )
    _check_loading_info(info, adapter, path)
    if dequantize:  # transformers 5.17 dequantises MXFP4 to bf16 whatever dtype is asked (exact: FP4 x 2^k fits bf16)
        model = model.to(torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if lora_path is not None:
        model = _merge_lora(model, lora_path)
    model.requires_grad_(False)
    model.eval()
    return model.to(device), tokenizer, adapter


def load_target_heads(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, Any, TargetAdapter]:
    """The target's input embedding, final norm and lm_head (and config, tokenizer, adapter) without its layers:
    what training on stored or streamed features needs. Only those tensors are read from the checkpoint's safetensors
    files (`safe_open`, keys chosen through the adapter's attribute paths and the index json); everything else of the
    returned model stays on the meta device, so it cannot run a forward.

    A checkpoint whose decoder is FP8 block-quantised (DeepSeek-V3/R1: float8_e4m3fn linear weights with
    `weight_scale_inv` block scales; embedding, norms and lm_head in bf16) is read the same way: nothing quantised is
    read, so nothing is dequantised. Only a head tensor that is itself quantised is refused.

    Raises:
        TargetNotFoundError, UnknownAdapterError: as `load_target`.
        ValueError: a bad dtype, a head tensor stored quantised (FP8), or a checkpoint without safetensors files or
            one of the tensors.
    """
    torch_dtype = _torch_dtype(dtype)
    path, kwargs, config, adapter = _target_config(name_or_path, trust_remote_code, allow_fp8=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = {id(m): name for name, m in model.named_modules()}
    embed, norm, head = adapter.embed_tokens(model), adapter.final_norm(model), adapter.lm_head(model)
    tied = head.weight is embed.weight
    modules = (embed, norm) if tied else (embed, norm, head)
    wanted = {f"{names[id(module)]}.{name}": (module, name) for module in modules
              for name, _ in module.named_parameters(recurse=False)}
    files, names = _checkpoint_files(path, list(wanted), kwargs["local_files_only"])
    for key, file in files.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            _refuse_quantised_head(path, key, f.get_slice(key).get_dtype(), names)
            tensor = f.get_tensor(key)
        module, name = wanted[key]
        if torch_dtype != "auto" and tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    if tied:
        head.weight = embed.weight
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model.requires_grad_(False)
    model.eval()
    return model, tokenizer, adapter


def _checkpoint_files(path: str | Path, keys: list[str], local_only: bool) -> tuple[dict[str, str], set[str]]:
    """Which local safetensors file holds each of `keys` (`model.safetensors.index.json`, else `model.safetensors`),
    and every tensor name of the checkpoint; from a Hub repo only the index and the files holding `keys` are
    fetched."""
    def fetch(name: str) -> str | None:
        if Path(path).is_dir():
            file = Path(path) / name
            return str(file) if file.is_file() else None
        try:
            return huggingface_hub.hf_hub_download(str(path), name, local_files_only=local_only)
        except huggingface_hub.errors.EntryNotFoundError:
            return None

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    elif (single := fetch("model.safetensors")) is not None:
        with safe_open(single, framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise ValueError(f"target {path}: no model.safetensors(.index.json) to read the embedding, norm and lm_head "
                         "from; offline training reads them from safetensors files")
    missing = [k for k in keys if k not in weight_map]
    if missing:
        raise ValueError(f"target {path}: the safetensors index has no {missing}; expected the tensors of the "
                         "adapter's embedding, final norm and lm_head")
    return {k: fetch(weight_map[k]) for k in keys}, set(weight_map)


def _refuse_quantised_head(path: str | Path, key: str, code: str, names: set[str]) -> None:
    """Refuse a head tensor stored quantised (an FP8 dtype, or with block scales next to it): reading it would
    need dequantising, which the heads-only load does not do."""
    scale = next((n for n in (f"{key}_scale_inv", f"{key.removesuffix('.weight')}.weight_scale_inv") if n in names),
                 None)
    if code.startswith("F8") or scale:
        raise ValueError(f"target {path}: {key} is stored quantised ({code}{f', block scales {scale}' if scale else ''}"
                         "); the heads-only load reads the embedding, final norm and lm_head as stored and does not "
                         "dequantise them: use a checkpoint that keeps them in bf16/fp16/fp32 (DeepSeek-V3's official "
                         "FP8 checkpoint does)")


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype != "auto" else dtype
    if not (isinstance(torch_dtype, torch.dtype) or torch_dtype == "auto"):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16') or 'auto'")
    return torch_dtype



def _target_config(name_or_path: str | os.PathLike, trust_remote_code: bool,
                   allow_fp8: bool = False) -> tuple[Any, dict[str, Any], Any, TargetAdapter]:
    """`(path, from_pretrained kwargs, config, adapter)` of a target, before any weight is read (resolved fast and
    offline-aware by `resolve_target`; FP8 checkpoints refused unless `allow_fp8`: a loader that reads no FP8
    tensor)."""
    path, local_only = resolve_target(name_or_path)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": local_only}
    config = AutoConfig.from_pretrained(path, **kwargs)
    adapter = adapter_for(config)
    if not allow_fp8:
        _refuse_fp8(config, name_or_path)
    return path, kwargs, config, adapter

def _refuse_fp8(config: Any, name_or_path: str | os.PathLike) -> None:
    """FP8 block-quantised checkpoints (DeepSeek-V3/R1's) are not dequantised in-process: refuse before any weight
    is read, saying what works instead."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(method).lower() == "fp8":
        raise ValueError(
            f"target {str(name_or_path)!r} is an FP8 block-quantised checkpoint (quantization_config.quant_method = "
            "fp8); eagle3-zoo does not dequantise its decoder in-process (a 671B DeepSeek-V3 does not fit one process "
            "anyway): serve it with an inference engine (the recipe's engine: section) and take the hidden states "
            "from there (data.features_backend: vllm; training then reads only the target's bf16 embedding, norm and "
            "lm_head), regenerate through an OpenAI-compatible server, or point target.name_or_path at a bf16 copy")


def _dequantize_kwargs(config: Any, adapter: TargetAdapter) -> dict[str, Any]:
    """For a checkpoint quantised in one of the adapter's `quantized_formats` (gpt-oss: MXFP4 experts), the
    ``from_pretrained`` arguments that dequantise it while loading, whatever kernels the machine has: the frozen
    target then runs the plain (bf16/fp32) forward its features are defined by, on any device."""
    quant = getattr(config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
    if not isinstance(quant, dict) or str(quant.get("quant_method")).lower() not in adapter.quantized_formats:
        return {}
    from transformers.quantizers.auto import AutoQuantizationConfig

    return {"quantization_config": AutoQuantizationConfig.from_dict({**quant, "dequantize": True})}


def _check_loading_info(info: dict[str, Any], adapter: TargetAdapter, path: str | os.PathLike) -> None:
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        raise ValueError(
            f"target checkpoint {path} does not provide {len(missing)} weights {missing[:8]} and has "
            f"{len(mismatched)} of the wrong shape {mismatched[:8]}; they would stay randomly initialised"
        )
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not adapter.ignored_on_load(k))
    if unexpected:
        logger.warning("target checkpoint %s has %d unused weights, e.g. %s", path, len(unexpected), unexpected[:8])


def _merge_lora(model: PreTrainedModel, lora_path: str | os.PathLike) -> PreTrainedModel:
    from peft import PeftModel  # peft is only needed for LoRA targets

    logger.info("merging LoRA adapter %s into the target", lora_path)
    with _refused_pickles_named(lora_path, "LoRA adapter"):
        return PeftModel.from_pretrained(model, str(lora_path)).merge_and_unload()


_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth")  # what transformers and peft read with torch.load


@contextlib.contextmanager
def _refused_pickles_named(where: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn the safe loader's refusal of a pickle weight file (torch's `UnpicklingError`, which names no file and
    advises loading it unsafely) into an `UnsafeTargetFileError` naming the file.

    transformers and peft do not say which file they were reading: the pickle files of `where` (a folder, or a Hub
    repo's cached snapshot) are opened again with the same safe loader, and the first one it refuses is named."""
    try:
        yield
    except pickle.UnpicklingError as e:
        if "weights_only" not in str(e) and "GLOBAL" not in str(e):
            raise  # not the safe loader's refusal: a damaged file, reported as it is
        found = _refused_pickle_file(where)
        file, refusal = found if found else (Path(where), pickle_refusal(e))
        raise UnsafeTargetFileError(
            f"{file}: {refusal}. A {what} weight file must hold plain tensors only; one holding other objects is "
            "refused for safety (unpickling it could run any code it carries). If you trust its source, convert the "
            f"{what} to safetensors (`save_pretrained` in transformers or peft writes safetensors) and use the "
            "converted folder") from None


def _refused_pickle_file(where: str | os.PathLike) -> tuple[Path, str] | None:
    """The first pickle file of `where` that `torch.load(weights_only=True)` refuses, and what it refused."""
    folder = Path(where)
    if not folder.is_dir():  # a Hub id: the files transformers just downloaded, from the cache
        try:
            folder = Path(huggingface_hub.snapshot_download(str(where), allow_patterns=list(_PICKLE_GLOBS),
                                                            local_files_only=True))
        except Exception:  # not cached (or not a repo id): nothing to name
            return None
    for file in sorted({f for pattern in _PICKLE_GLOBS for f in folder.glob(pattern) if f.is_file()}):
        for mmap in (True, False):  # mmap: only the pickle is read, not the tensors; legacy (non-zip) files cannot
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
                break
            except pickle.UnpicklingError as e:
                return file, pickle_refusal(e)
            except Exception:  # not a zip file (mmap), or damaged: not the refused one
                continue
    return None


class ShardedLoadUnsupported(ValueError):
    """The target cannot be read shard by shard (no safetensors files, a LoRA to merge, or parameter names that
    transformers renames/fuses on load); the caller loads it whole instead."""


def target_weight_files(path: str | os.PathLike, local_only: bool = False) -> dict[str, Path]:
    """`{tensor name: safetensors file}` of a target folder or Hub repo (only the file headers are read).

    Raises:
        ShardedLoadUnsupported: the target has no `*.safetensors` files.
    """
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():  # a Hub id: the safetensors files only, from the cache or the Hub
        folder = Path(huggingface_hub.snapshot_download(str(path), allow_patterns=["*.safetensors", "*.json"],
                                                        local_files_only=local_only))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ShardedLoadUnsupported(f"target {path} has no *.safetensors files")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load_target_skeleton(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, Any, TargetAdapter]:
    """The frozen target with its decoder layers' parameters on the meta device: only the embedding, final norm,
    lm_head (and anything else outside the decoder layers) are read, so no process holds the whole target.

    FSDP then shards the layers and each rank reads only its own slices (`eagle3_zoo.training.strategies.
    load_target_shards`, from `model.eagle3_weight_files`). Buffers are built as usual (e.g. rotary frequencies).

    Returns:
        ``(model, tokenizer, adapter)`` as `load_target` (on the CPU, every parameter ``requires_grad=False``).

    Raises:
        ShardedLoadUnsupported: no safetensors files, or a parameter whose name is not in them (transformers converts
            the checkpoint on load for that model, e.g. fused MoE experts): load it whole with `load_target`.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open

    path, kwargs, config, adapter = _target_config(name_or_path, trust_remote_code)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    if torch_dtype == "auto":
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    files = target_weight_files(path, kwargs["local_files_only"])
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    # init_empty_weights keeps from_config from tying: a tied lm_head (Llama-3.2-1B/3B, Qwen2.5 <= 3B, SmolLM2) would
    # stay a separate meta parameter that no file stores under its name
    model.tie_weights()
    aliases: dict[int, list[str]] = {}  # tied weights: one parameter under several names
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    unreadable = [names[0] for names in aliases.values() if not any(n in files for n in names)]
    if unreadable:
        raise ShardedLoadUnsupported(f"target {path}: {len(unreadable)} parameters are not stored under their own "
                                     f"names in the safetensors files (e.g. {unreadable[:3]})")
    layers = {id(p) for p in adapter.decoder_layers(model).parameters()}
    for pid, names in aliases.items():
        if pid in layers:
            continue
        key = next(n for n in names if n in files)
        with safe_open(files[key], "pt") as f:
            value = torch.nn.Parameter(f.get_tensor(key).to(torch_dtype), requires_grad=False)
        for name in names:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value)
    model.requires_grad_(False)
    model.eval()
    model.eagle3_weight_files = files
    return model, AutoTokenizer.from_pretrained(path, **kwargs), adapter
