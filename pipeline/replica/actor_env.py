"""The ``runtime_env`` of the Ray actors that run the model (replicas and tensor-parallel ranks)."""
from __future__ import annotations

import os

from logitspec import allocator

from . import faults

# an actor's output goes to log files (and to the driver line by line): no progress bars there, whose
# carriage returns and ANSI escapes garble both (Hugging Face's and transformers' bars, tqdm's)
QUIET_BARS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def actor_runtime_env() -> dict:
    """The driver's ``LOGITSPEC_FAULT`` when set (:mod:`pipeline.replica.faults`), tcmalloc preloaded
    where the machine has it (:mod:`logitspec.allocator`), and progress bars off (unless the driver's
    environment sets those variables itself)."""
    bars = {k: v for k, v in QUIET_BARS.items() if k not in os.environ}
    return {"env_vars": {**bars, **faults.fault_vars(), **allocator.preload_env()}}
