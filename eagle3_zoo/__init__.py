"""eagle3-zoo: train, evaluate and publish EAGLE-3 speculative-decoding drafters.

    from eagle3_zoo import DrafterFolder, EvalSettings    # the Python API under `eagle3-zoo check / export / eval`

Names are imported on first use (PEP 562): `import eagle3_zoo` loads no torch.
"""

from __future__ import annotations

from eagle3_zoo.util.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "DrafterFolder": "eagle3_zoo.api",
    "CheckReport": "eagle3_zoo.checkpoint.check_report",
    "InvalidDrafterError": "eagle3_zoo.checkpoint.check_report",
    "EvalSettings": "eagle3_zoo.speculative.evaluation",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
