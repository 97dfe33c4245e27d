"""Test-only fault injection: with ``LOGITSPEC_FAULT`` set, a replica's process SIGKILLs itself at a
chosen point, as the OOM killer or a lost node would. Nothing happens when the variable is unset.

The driver forwards the variable to the actors it starts (:func:`actor_runtime_env`); forms:

    load:N:DIR   the first N replica processes to load the model kill themselves there (while loading)
    row:ID       a process given the row ID (in a batch) kills itself, every time

``DIR`` counts the kills so far (one file each), so ``N`` holds across the replacement processes.
"""
from __future__ import annotations

import os
import pathlib
import signal
import tempfile

from logitspec import allocator

ENV = "LOGITSPEC_FAULT"


def actor_runtime_env() -> dict | None:
    """The ``runtime_env`` of a replica's actors: the driver's ``LOGITSPEC_FAULT`` when set, and
    tcmalloc preloaded where the machine has it (:mod:`logitspec.allocator`); None when neither."""
    env_vars = {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}
    env_vars.update(allocator.preload_env())
    return {"env_vars": env_vars} if env_vars else None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_load() -> None:
    """Called by a replica process while it loads the model."""
    kind, _, rest = os.environ.get(ENV, "").partition(":")
    if kind != "load":
        return
    times, _, directory = rest.partition(":")
    d = pathlib.Path(directory)
    if len(list(d.glob("kill-*"))) < int(times):
        tempfile.mkstemp(prefix="kill-", dir=d)
        _die()


def at_batch(rows: list[dict]) -> None:
    """Called by a replica process before it generates ``rows``."""
    kind, _, row_id = os.environ.get(ENV, "").partition(":")
    if kind == "row" and any(str(r["id"]) == row_id for r in rows):
        _die()
