"""Drafter folders: their layouts (SGLang/canonical, official EAGLE-3, speculators: `layouts`), weights read safely,
import and export between layouts, the static checks of `eagle3-zoo check` (and against a target's config), and the
writer of the canonical folder a run leaves behind. No network: `eagle3_zoo.hub` downloads and publishes on top of it.

    from eagle3_zoo.checkpoint import check_drafter, export_drafter, import_drafter

Names are imported on first use (PEP 562): the CLI registers its subcommands without loading torch/transformers.
"""

from __future__ import annotations

from eagle3_zoo.util.lazy import lazy_exports

_EXPORTS = {
    "check": ("check_drafter", "require_valid_drafter", "vocab_mapping_problems"),
    "check_report": ("CheckReport", "DrafterCheckError", "InvalidDrafterError", "Problem"),
    "convert": ("convert_to_canonical", "export_drafter", "import_drafter"),
    "formats": ("CANONICAL_KEYS", "EXPORT_FORMATS", "FORMATS"),
    "layouts": ("Layout", "detect_format", "detect_layout", "get_layout", "register"),
    "opened": ("OpenedDrafter",),
    "weights": ("CheckpointError", "UnsafeCheckpointError"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)
