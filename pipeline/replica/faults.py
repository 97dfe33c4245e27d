"""Test-only fault injection: with ``LOGITSPEC_FAULT`` set, a replica's process SIGKILLs itself at a
chosen point, as the OOM killer or a lost node would, or its forwards run out of memory on chosen
shapes. Nothing happens when the variable is unset.

The driver forwards the variable to the actors it starts (:func:`fault_vars`, in
:func:`pipeline.replica.actor_env.actor_runtime_env`); forms:

    load:N:DIR   the first N replica processes to load the model kill themselves there (while loading)
    row:ID       a process given the row ID (in a batch) kills itself, every time
    slow:S       every batch takes S seconds more (paces a job, so a test can act while it runs)
    oom:R:T      a forward over more than R rows, or reaching past T positions in a row, raises
                 MemoryError (:class:`OutOfMemoryAt`, the engine's model runner)

``DIR`` counts the kills so far (one file each), so ``N`` holds across the replacement processes.
"""
from __future__ import annotations

import os
import pathlib
import signal
import tempfile
import time

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
    kind, _, arg = os.environ.get(ENV, "").partition(":")
    if kind == "row" and any(str(r.id) == arg for r in rows):
        _die()
    if kind == "slow":
        time.sleep(float(arg))


class OutOfMemoryAt:
    """A model runner that raises ``MemoryError``, as an allocator would, on a forward over more than
    ``rows`` rows or reaching past ``tokens`` positions in a row; otherwise the runner it wraps. The
    ``oom:ROWS:TOKENS`` fault, and a seam for tests (``Engine(runner=OutOfMemoryAt(...))``)."""

    def __init__(self, runner, rows: int, tokens: int):
        self.runner, self.rows, self.tokens = runner, rows, tokens

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _check(self, rows: int, positions: int) -> None:
        if rows > self.rows or positions > self.tokens:
            raise MemoryError(f"test fault: a forward of {rows} rows reaching {positions} positions (this "
                              f"replica fits {self.rows} rows, {self.tokens} positions)")

    def step(self, rows, kv, *args, **kwargs):
        self._check(len(rows), max(r.prefix_len + int(r.depths.max()) + 1 for r in rows))
        return self.runner.step(rows, kv, *args, **kwargs)

    def prefill(self, tokens, *args, **kwargs):
        self._check(1, len(tokens))
        return self.runner.prefill(tokens, *args, **kwargs)

    def prefill_rows(self, prompts, *args, **kwargs):
        self._check(len(prompts), max(len(p) for p in prompts))
        return self.runner.prefill_rows(prompts, *args, **kwargs)

    def extend(self, row, tokens, *args, **kwargs):
        self._check(1, getattr(row, "columns", 0) + len(tokens))
        return self.runner.extend(row, tokens, *args, **kwargs)


def runner_for(model, config):
    """The model runner a replica's engine gets: None (the engine's default) unless ``LOGITSPEC_FAULT``
    is ``oom:ROWS:TOKENS``, then the runner ``config.runner`` names wrapped in :class:`OutOfMemoryAt`."""
    kind, _, rest = os.environ.get(ENV, "").partition(":")
    if kind != "oom":
        return None
    from logitspec.worker.gpu import runner_for as configured_runner

    rows, _, tokens = rest.partition(":")
    return OutOfMemoryAt(configured_runner(model, config), int(rows), int(tokens))
