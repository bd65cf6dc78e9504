"""GPU behaviour checked on a CPU: operations that would make the host wait for the GPU, tensors copied between
devices, and operations that mix devices (which CUDA refuses), seen by `TorchDispatchMode`s.

`SyncCounter` counts, on a CPU run, the operations that wait for the GPU when the same code runs on CUDA. A CPU
run never waits, so the count is by kind of operation:
- `item`: a device value read on the host (`.item()`, `bool()`, `int()`, `float()` of a tensor, Python `if`);
- `nonzero`, `masked_select`, `unique`, ...: an output whose size depends on the data;
- `bool index`: indexing (or index-assigning) with a bool mask, which runs `nonzero` inside;
- `repeat_interleave`: with tensor repeats and no `output_size`;
- `host tensor`: `torch.tensor(...)` / `as_tensor` of Python data, a blocking host-to-device copy on a GPU;
- `to host`: `.tolist()`, `.cpu()`, `.numpy()` (invisible to a dispatch mode on a CPU tensor, hence patched).

Each event keeps the innermost frame outside torch, so a failing budget says where the new wait is.

`DeviceMoves` records the copies between devices (run a model on the `meta` device: a host tensor it still holds
shows up as a copy from `cpu`). `MixedDevices` raises where one operation gets tensors on two devices, as CUDA does
(with `FakeTensorMode`, tensors can live on a fake `cuda` device on a machine without one).
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DATA_DEPENDENT = {aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
                   aten._unique2.default: "unique", aten.unique_dim.default: "unique",
                   aten.unique_consecutive.default: "unique", aten.bincount.default: "bincount"}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_TORCH = str(Path(torch.__file__).parent)


def _where() -> str:
    """The innermost caller outside torch and this file, as `eagle3_zoo/...py:line (function)` (or the path after
    site-packages for a library)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if name.startswith(_TORCH) or name == __file__:
            continue
        for marker in ("/site-packages/", "/work/"):
            if marker in name:
                name = name.split(marker, 1)[1]
        if "/eagle3_zoo/" in f"/{name}":
            name = "eagle3_zoo/" + f"/{name}".split("/eagle3_zoo/", 1)[1]
        return f"{name}:{frame.lineno} ({frame.name})"
    return "?"


class SyncCounter(TorchDispatchMode):
    """`with SyncCounter() as c: ...` then `c.counts` (kind -> n) and `c.events` ((kind, where) in order).

    `host_tensors`: tensors that stay on the host when the same code runs on a GPU (Adam's step counters): reading
    one waits for nothing, so it is not counted."""

    supports_higher_order_operators = True  # FlexAttention runs as one; passed through like any other op

    def __init__(self, host_tensors: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._host = {id(t) for t in host_tensors}

    @property
    def counts(self) -> Counter:
        return Counter(kind for kind, _ in self.events)

    def record(self, kind: str) -> None:
        self.events.append((kind, _where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if id(args[0]) not in self._host:
                self.record("item")
        elif func in _DATA_DEPENDENT:
            self.record(_DATA_DEPENDENT[func])
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.record("repeat_interleave")
        elif func in _INDEX and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                    for i in (args[1] or ()) if i is not None):
            self.record("bool index")
        elif func is aten.lift_fresh.default:
            self.record("host tensor")
        return func(*args, **kwargs)


@contextmanager
def counting_host_reads(counter: SyncCounter):
    """Patch `Tensor.tolist/.cpu/.numpy` to record `to host` while the block runs (a dispatch mode does not see
    them on CPU tensors, which already live on the host)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def wrap(name):
        def method(self, *args, **kwargs):
            counter.record("to host")
            return originals[name](self, *args, **kwargs)
        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, wrap(name))
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


class DeviceMoves(TorchDispatchMode):
    """Records `(from, to, where)` for every copy between devices (`.to(device)`, `copy_` across devices)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default and out.device != args[0].device:
            self.moves.append((args[0].device.type, out.device.type, _where()))
        elif func is aten.copy_.default and args[1].device != args[0].device and args[1].dim() > 0:
            self.moves.append((args[1].device.type, args[0].device.type, _where()))
        return out


class MixedDevices(TorchDispatchMode):
    """Raises `RuntimeError` where one operation gets tensors on different devices (copies excepted, and 0-d CPU
    scalars, which CUDA kernels accept), as CUDA kernels do; fake tensors' devices count as real."""

    _MOVES = {aten._to_copy.default, aten.copy_.default, aten.lift_fresh.default, aten.detach.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._MOVES:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise RuntimeError(f"{func} got tensors on {sorted(map(str, devices))} at {_where()}")
        return func(*args, **kwargs)
