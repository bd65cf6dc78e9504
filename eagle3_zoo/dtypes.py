"""Floating-point dtype names used in configs, recipes and feature stores, and their torch dtypes: one map for the
package. Importing this module does not import torch."""

from __future__ import annotations

from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: Any, what: str = "dtype") -> str:
    """The name of a torch dtype or dtype name (`torch.bfloat16` -> "bfloat16").

    Raises:
        ValueError: not one of `DTYPE_NAMES`, naming `what` it was for.
    """
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown {what} {dtype!r}; valid: {', '.join(DTYPE_NAMES)}")
    return name


def torch_dtype(name: Any, what: str = "dtype") -> Any:
    """The torch dtype of a name in `DTYPE_NAMES` (or of a torch dtype, returned as is)."""
    import torch

    return getattr(torch, dtype_name(name, what))
