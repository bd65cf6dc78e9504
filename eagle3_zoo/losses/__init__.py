"""Per-position TTT losses: one module per loss, registered by name (`@register_loss("tv")`) with its own parameters
dataclass, selected by a recipe's `loss.name` and `loss.params`.

Every module in this package but `base` (the registry) and `chunk` (the shared tensor pass) is imported here, so a
new loss is one file plus its test and needs no edit elsewhere (docs/contributing/adding-a-loss.md). Importing this
package imports no torch: recipe validation reads the registry.
"""

import importlib
import pkgutil

from eagle3_zoo.losses.base import (
    GUIDE,
    Loss,
    NoParams,
    UnknownLossError,
    available_losses,
    get_loss,
    make_loss,
    params_problems,
    register_loss,
    unknown_loss_message,
)

_FRAMEWORK = ("base", "chunk")  # not losses: the registry and the softmax pass every loss shares (torch)

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name not in _FRAMEWORK:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["GUIDE", "Loss", "NoParams", "UnknownLossError", "available_losses", "get_loss", "make_loss",
           "params_problems", "register_loss", "unknown_loss_message"]
