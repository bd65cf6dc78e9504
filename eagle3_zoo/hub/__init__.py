"""The Hugging Face Hub side: the endpoint probe, pull (download + check + convert), publish (stage + upload), the
model card and the zoo commands. Reading, writing and checking drafter folders is `eagle3_zoo.checkpoint`, below.

    from eagle3_zoo.hub import publish, pull, list_zoo

Names are imported on first use (PEP 562): the CLI registers its subcommands without loading torch/transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "card": ("render_card",),
    "download": ("PullResult", "load_any_drafter", "pull"),
    "endpoint": ("HubUnreachableError",),
    "upload": ("PublishResult", "TokenLeakError", "publish"),
    "zoo": ("list_zoo", "show_zoo"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
