"""Floating-point dtype names used in configs, recipes and feature stores, and their torch dtypes: one map for the
package. Importing this module does not import torch."""

from __future__ import annotations

from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# safetensors header dtype codes (those a drafter can hold): bytes per element, and the code of each torch dtype name
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                        "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
SAFETENSORS_FLOATS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_SAFETENSORS_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


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


def safetensors_code(dtype: Any) -> str:
    """The safetensors header code of a torch dtype (`torch.bfloat16` -> "BF16"); other dtypes by their name."""
    name = str(dtype).removeprefix("torch.")
    return _SAFETENSORS_CODES.get(name, str(dtype))
