"""Target adapters: one module per model family, registered by Hugging Face ``model_type``.

Every module in this package is imported here, so a new family is one file with ``@register_adapter(...)`` (plus
its recipe and test) and needs no edit to this file.
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
from eagle3_zoo.adapters.capture import (
    AuxHiddenCapture,
    cache_kwargs,
    capture_aux_hidden,
    output_cache,
    target_logits,
)
from eagle3_zoo.adapters.chat import ChatFormat, TemplateMappingError, build_chat_example
from eagle3_zoo.adapters.embedded import EMBEDDED_NAMES, embedded_target_dir, load_embedded_tokenizer
from eagle3_zoo.adapters.loading import load_target, load_target_heads

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

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
