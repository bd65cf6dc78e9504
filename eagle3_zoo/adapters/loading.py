"""Load a frozen target (model, tokenizer, adapter), optionally with a merged PEFT LoRA."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from eagle3_zoo.adapters.base import TargetAdapter, adapter_for
from eagle3_zoo.adapters.embedded import embedded_target_dir, is_embedded_name

logger = logging.getLogger(__name__)


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
        dtype: Weight dtype (``torch.bfloat16``, ``"bfloat16"``...; ``"auto"`` keeps the checkpoint's).
        lora_path: Optional PEFT LoRA adapter directory; it is merged into the weights (``merge_and_unload``), so
            features come from the fine-tuned target at plain-model speed.
        trust_remote_code: Passed to transformers.
        device: Where the model is placed.

    Returns:
        ``(model, tokenizer, adapter)`` with every parameter ``requires_grad=False``.

    Raises:
        UnknownAdapterError: the config's ``model_type`` has no adapter (checked before any weight is read).
        ValueError: the checkpoint lacks weights of the model (they would silently stay random).
    """
    path = embedded_target_dir() if is_embedded_name(name_or_path) else name_or_path
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype != "auto" else dtype
    if not (isinstance(torch_dtype, torch.dtype) or torch_dtype == "auto"):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16') or 'auto'")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    adapter = adapter_for(config)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    _check_loading_info(info, adapter, path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if lora_path is not None:
        model = _merge_lora(model, lora_path)
    model.requires_grad_(False)
    model.eval()
    return model.to(device), tokenizer, adapter


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
    return PeftModel.from_pretrained(model, str(lora_path)).merge_and_unload()
