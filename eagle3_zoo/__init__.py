"""eagle3-zoo: train, evaluate and publish EAGLE-3 speculative-decoding drafters.

    from eagle3_zoo import DrafterFolder, EvalSettings    # the Python API under `eagle3-zoo check / export / eval`

Names are imported on first use (PEP 562): `import eagle3_zoo` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DrafterFolder": "eagle3_zoo.api",
    "CheckReport": "eagle3_zoo.checkpoint.check_report",
    "InvalidDrafterError": "eagle3_zoo.checkpoint.check_report",
    "EvalSettings": "eagle3_zoo.speculative.evaluation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
