"""Counting the host's reads of device values on CPU, where there is no device to wait for.

:class:`DeviceReads` is a torch function mode that treats the tensors it is given (a model's
parameters, a runner's static buffers) as living on a device: every tensor an operation computes
from one of them is on the device too, and a host read of such a tensor (``tolist``, ``item``,
``numpy``, ``int()``, ``bool()``, ``cpu()``, ...) or an operation whose output size depends on device
values (``nonzero``, boolean indexing, ...) is what would make the host wait for a GPU. Values the
host computes itself (draws from a CPU generator, staging arrays) are not counted."""
from __future__ import annotations

import traceback
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# reading a value on the host, or sizing an output by device values: each waits for the device
READS = {"tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__", "cpu",
         "__format__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal",
         "allclose", "bincount"}


class DeviceReads(TorchFunctionMode):
    """Within the block, ``reads`` counts host reads of device tensors by the code line that made them."""

    def __init__(self, *seeds):
        super().__init__()
        self._on_device: dict[int, weakref.ref] = {}
        self.reads: Counter = Counter()
        for group in seeds:
            for t in group:
                self._mark(t)

    def _mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._on_device[id(t)] = weakref.ref(t)

    def _marked(self, t) -> bool:
        ref = self._on_device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        device = any(self._marked(x) for x in inputs)
        name = getattr(func, "__name__", "")
        if device and (name in READS or _bool_index(name, args) or _sized_by_values(name, args, kwargs)
                       or _to_host(name, args, kwargs)):
            frame = traceback.extract_stack(limit=2)[0]
            self.reads[f"{name} {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
        out = func(*args, **kwargs)
        if device:
            for t in tree_flatten(out)[0]:
                self._mark(t)
        return out

    @property
    def total(self) -> int:
        return sum(self.reads.values())


def _sized_by_values(name: str, args, kwargs) -> bool:
    """``where(cond)`` (``nonzero``'s tuple form) and ``repeat_interleave`` with tensor repeats (no
    ``output_size``): their output sizes are device values."""
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    return False


def _to_host(name: str, args, kwargs) -> bool:
    """``tensor.to("cpu")`` (or to a CPU device or tensor): a copy the host waits for."""
    if name != "to":
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any((isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu") for t in targets
               if t is not None and not isinstance(t, torch.dtype))


def _bool_index(name: str, args) -> bool:
    """An index by a boolean tensor (its output's size is the count of True values)."""
    if name not in ("__getitem__", "__setitem__") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
