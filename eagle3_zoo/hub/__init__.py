"""Hub and model zoo: export/import formats, compatibility checks, model cards, publish, pull, the zoo registry.

    from eagle3_zoo.hub import check_drafter, export_drafter, import_drafter, publish, pull, list_zoo

Names are imported on first use (PEP 562): the CLI registers its subcommands without loading torch/transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "card": ("render_card",),
    "check": ("CheckReport", "DrafterCheckError", "InvalidDrafterError", "Problem", "check_drafter",
              "require_valid_drafter", "vocab_mapping_problems"),
    "convert": ("convert_to_canonical", "export_drafter", "import_drafter", "load_any_drafter"),
    "formats": ("CANONICAL_KEYS", "EXPORT_FORMATS", "FORMATS", "detect_format"),
    "live": ("LiveCheckResult", "live_check"),
    "upload": ("PublishResult", "TokenLeakError", "publish"),
    "download": ("PullResult", "pull"),
    "weights": ("CheckpointError", "UnsafeCheckpointError"),
    "zoo": ("ZooEntry", "list_zoo", "show_zoo"),
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
