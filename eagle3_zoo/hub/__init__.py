"""The Hugging Face Hub side: the endpoint probe, pull (download + check + convert), publish (stage + upload), the
model card and the zoo commands. Reading, writing and checking drafter folders is `eagle3_zoo.checkpoint`, below.

    from eagle3_zoo.hub import publish, pull, list_zoo

Names are imported on first use (PEP 562): the CLI registers its subcommands without loading torch/transformers.
"""

from __future__ import annotations

from eagle3_zoo.util.lazy import lazy_exports

_EXPORTS = {
    "card": ("render_card",),
    "download": ("PullResult", "load_any_drafter", "pull"),
    "endpoint": ("HubUnreachableError",),
    "upload": ("PublishResult", "TokenLeakError", "publish"),
    "zoo": ("list_zoo", "show_zoo"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)
