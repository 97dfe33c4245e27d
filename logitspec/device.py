"""Host-to-device transfers that do not wait for the device, timing of work on a device, and whether an
error says the device (or the host) ran out of memory.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory synchronises the stream; the
step sends its small host-built arrays (tokens, positions, tree structure, cache indices) from
pinned memory instead, so the host never waits for the GPU except where the acceptance walk needs
the target's tokens.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory", "cannot allocate memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says memory ran out: ``MemoryError``, CUDA's ``OutOfMemoryError``, or an allocator's
    ``RuntimeError`` (torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in OOM_MESSAGES)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``: sharing its memory on CPU, else copied from pinned host
    memory without waiting (the caching host allocator keeps the pinned block until the copy is done)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, including the device work it queues."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def fastest(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    """The fastest of ``reps`` :func:`elapsed` timings of ``fn()``, after one untimed call (warm-up)."""
    fn()
    return min(elapsed(fn, device) for _ in range(reps))
