"""Test-only fault injection: with ``LOGITSPEC_FAULT`` set, a replica's process SIGKILLs itself at a
chosen point, as the OOM killer or a lost node would. Nothing happens when the variable is unset.

The driver forwards the variable to the actors it starts (:func:`fault_vars`, in
:func:`pipeline.replica.actor_env.actor_runtime_env`); forms:

    load:N:DIR   the first N replica processes to load the model kill themselves there (while loading)
    row:ID       a process given the row ID (in a batch) kills itself, every time

``DIR`` counts the kills so far (one file each), so ``N`` holds across the replacement processes.
"""
from __future__ import annotations

import os
import pathlib
import signal
import tempfile

ENV = "LOGITSPEC_FAULT"


def fault_vars() -> dict:
    """The driver's ``LOGITSPEC_FAULT`` for an actor's environment (empty when unset)."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


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


def at_batch(rows: list) -> None:
    """Called by a replica process before it generates ``rows``."""
    kind, _, row_id = os.environ.get(ENV, "").partition(":")
    if kind == "row" and any(str(r.id) == row_id for r in rows):
        _die()
