"""Target adapters: one module per model family, registered by Hugging Face ``model_type``.

Every module in this package is imported here, so a new family is one file with ``@register_adapter(...)`` (plus
its recipe and test) and needs no edit to this file.

The registry (`available_adapters`, `get_adapter`, the adapters' declarations) imports no torch or transformers, so
that a recipe is validated in a second; the names that work on models and tokenizers (`load_target`,
`capture_aux_hidden`, ...) are imported from their modules on first use.
"""

import importlib
import pkgutil

from eagle3_zoo.adapters.base import (
    TargetAdapter,
    UnknownAdapterError,
    adapter_for,
    available_adapters,
    get_adapter,
    register_adapter,
)
from eagle3_zoo.chat.formats import ChatFormat, TemplateMappingError, build_chat_example
from eagle3_zoo.util.lazy import lazy_exports
from eagle3_zoo.values.locations import EMBEDDED_NAMES

# the modules that import torch/transformers at the top, and the names this package re-exports from them
_HEAVY = {"capture": ("AuxHiddenCapture", "cache_kwargs", "capture_aux_hidden", "output_cache", "target_logits"),
          "embedded": ("embedded_target_dir", "load_embedded_tokenizer"),
          "loading": ("load_target", "load_target_heads")}
_LAZY = {name: module for module, names in _HEAVY.items() for name in names}

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name not in _HEAVY:
        importlib.import_module(f"{__name__}.{_module.name}")

# `eagle3_zoo.adapters.load_target` and the other names of `_LAZY`: imported on first use (PEP 562), then found
# directly (and what monkeypatch saves and restores)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "EMBEDDED_NAMES",
    "AuxHiddenCapture",
    "ChatFormat",
    "TargetAdapter",
    "TemplateMappingError",
    "UnknownAdapterError",
    "adapter_for",
    "available_adapters",
    "build_chat_example",
    "cache_kwargs",
    "capture_aux_hidden",
    "embedded_target_dir",
    "get_adapter",
    "load_embedded_tokenizer",
    "load_target",
    "load_target_heads",
    "output_cache",
    "register_adapter",
    "target_logits",
]
