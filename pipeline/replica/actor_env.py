"""The ``runtime_env`` of the Ray actors that run the model (replicas and tensor-parallel ranks)."""
from __future__ import annotations

from logitspec import allocator

from . import faults


def actor_runtime_env() -> dict | None:
    """The driver's ``LOGITSPEC_FAULT`` when set (:mod:`pipeline.replica.faults`), and tcmalloc preloaded
    where the machine has it (:mod:`logitspec.allocator`); None when neither."""
    env_vars = {**faults.fault_vars(), **allocator.preload_env()}
    return {"env_vars": env_vars} if env_vars else None
