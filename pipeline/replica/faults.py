"""Test-only fault injection: with ``LOGITSPEC_FAULT`` set, a replica's process SIGKILLs itself at a
chosen point, as the OOM killer or a lost node would, or its forwards run out of memory on chosen
shapes. Nothing happens when the variable is unset.

The driver forwards the variable to the actors it starts (:func:`fault_vars`, in
:func:`pipeline.replica.actor_env.actor_runtime_env`); forms:

    load:N:DIR   the first N replica processes to load the model kill themselves there (while loading)
    row:ID       a process given the row ID (in a batch) kills itself, every time
    slow:S       every batch takes S seconds more (paces a job, so a test can act while it runs)
    oom:R:T[:AT] a forward over more than R rows, or reaching past T positions in a row, raises
                 MemoryError (:class:`OutOfMemoryAt`, the engine's model runner), before it runs, after
                 it ran (AT = after), or from inside it at decoder layer N (AT = layer:N)
    chaos:S:DIR  a seeded schedule of all of these over a whole job (:func:`chaos`): before each batch,
                 a draw from S, the batch's first row id and how often that batch was seen picks
                 nothing, a SIGKILL, a hang (SIGSTOP: a replica that never answers), a slow batch, or
                 an out-of-memory error a few decode steps later (:class:`ChaosRunner`)

Forms join with ``+`` (``slow:1.5+chaos:S:DIR``: a paced job under a chaos schedule). ``DIR`` counts the
kills so far (one file each), so ``N`` holds across the replacement processes; under ``chaos`` it holds one
file per fault injected (``kill-*``, ``hang-*``, ``slow-*``, ``oom-*``), which also bounds each kind
(:data:`CHAOS`).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import random
import signal
import tempfile
import time

ENV = "LOGITSPEC_FAULT"


def fault_vars() -> dict:
    """The driver's ``LOGITSPEC_FAULT`` for an actor's environment (empty when unset)."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


def _forms() -> list[tuple[str, str]]:
    """``LOGITSPEC_FAULT``'s forms as (kind, the rest) pairs (none when unset)."""
    forms = [f.partition(":") for f in os.environ.get(ENV, "").split("+") if f]
    return [(kind, rest) for kind, _, rest in forms]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_load() -> None:
    """Called by a replica process while it loads the model."""
    for kind, rest in _forms():
        if kind != "load":
            continue
        times, _, directory = rest.partition(":")
        d = pathlib.Path(directory)
        if len(list(d.glob("kill-*"))) < int(times):
            tempfile.mkstemp(prefix="kill-", dir=d)
            _die()


def at_batch(rows: list) -> None:
    """Called by a replica process before it generates ``rows``."""
    for kind, arg in _forms():
        if kind == "row" and any(str(r.id) == arg for r in rows):
            _die()
        if kind == "slow":
            time.sleep(float(arg))
        if kind == "chaos" and rows:
            seed, _, directory = arg.partition(":")
            chaos(rows[0].id, int(seed), pathlib.Path(directory))


# chaos: kind -> (probability per batch, most injected over the job); a slow batch takes CHAOS_SLOW_S more
CHAOS = {"kill": (0.08, 3), "hang": (0.04, 1), "oom": (0.12, 4), "slow": (0.12, 1000)}
CHAOS_SLOW_S = 1.0
# [decode step (ChaosRunner's count) at which a forward runs out of memory, the directory to record it in]
_OOM_AT: list = []


def _batch_key(first_id) -> str:
    """A batch's name in the schedule and its files: a hash of its first row id."""
    return hashlib.sha1(repr(first_id).encode()).hexdigest()[:12]


def chaos_draw(seed: int, first_id, seen: int) -> tuple[str | None, int]:
    """The fault the schedule ``seed`` gives a batch whose first row is ``first_id``, drawn for the
    ``seen``-th time (a batch redone draws again): its kind (or None) and, for ``oom``, in how many
    decode steps."""
    rng = random.Random(f"{seed}:{_batch_key(first_id)}:{seen}")
    draw, edge = rng.random(), 0.0
    for kind, (p, _) in CHAOS.items():
        edge += p
        if draw < edge:
            return kind, rng.randint(1, 4)
    return None, 0


def chaos(first_id, seed: int, directory: pathlib.Path) -> str | None:
    """Inject the fault :func:`chaos_draw` gives a batch whose first row is ``first_id`` (recorded in
    ``directory``, where each kind's count is bounded); returns its kind, or None (a kill or a hang
    does not return)."""
    key = _batch_key(first_id)
    seen = len(list(directory.glob(f"seen-{key}-*")))
    tempfile.mkstemp(prefix=f"seen-{key}-", dir=directory)
    kind, steps = chaos_draw(seed, first_id, seen)
    if kind is None or len(list(directory.glob(f"{kind}-*"))) >= CHAOS[kind][1]:
        return None
    tempfile.mkstemp(prefix=f"{kind}-", dir=directory)
    if kind == "kill":
        _die()
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops answering
    elif kind == "slow":
        time.sleep(CHAOS_SLOW_S)
    else:
        _OOM_AT[:] = [ChaosRunner.steps + steps, directory]
    return kind


class ChaosRunner:
    """The ``chaos`` fault's model runner: the one it wraps, but the decode step :func:`chaos` armed
    raises ``MemoryError`` after the wrapped step ran (its KV and slot writes done, as an allocator
    failing late would leave them)."""

    steps = 0  # decode steps run in this process

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, *args, **kwargs):
        out = self.runner.step(*args, **kwargs)
        ChaosRunner.steps += 1
        if _OOM_AT and ChaosRunner.steps >= _OOM_AT[0]:
            tempfile.mkstemp(prefix="fired-oom-", dir=_OOM_AT[1])
            _OOM_AT.clear()
            raise MemoryError(f"test fault: chaos out of memory at decode step {ChaosRunner.steps}")
        return out


class OutOfMemoryAt:
    """A model runner that raises ``MemoryError``, as an allocator would, on a forward over more than
    ``rows`` rows or reaching past ``tokens`` positions in a row; otherwise the runner it wraps. ``at``:
    where the error comes from, ``before`` the wrapped forward runs, ``after`` it ran (its KV, slot and
    cache writes done), or ``layer:N`` from inside it, a forward hook on decoder layer N (the layers
    below it wrote their KV). ``steps_only``: prefills never fail, so the fault comes in a decode step,
    with rows mid-generation. The ``oom:ROWS:TOKENS[:AT]`` fault, and a seam for tests
    (``Engine(runner=OutOfMemoryAt(...))``), around the eager runner or the graph runner."""

    def __init__(self, runner, rows: int, tokens: int, at: str = "before", steps_only: bool = False):
        kind, _, layer = at.partition(":")
        if kind not in ("before", "after", "layer") or (kind == "layer") != layer.isdigit():
            raise ValueError(f"at: before, after or layer:N, got {at!r}")
        self.runner, self.rows, self.tokens, self.at, self.steps_only = runner, rows, tokens, at, steps_only

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _check(self, rows: int, positions: int) -> None:
        if rows > self.rows or positions > self.tokens:
            raise MemoryError(f"test fault: a forward of {rows} rows reaching {positions} positions (this "
                              f"replica fits {self.rows} rows, {self.tokens} positions)")

    def _guarded(self, rows: int, positions: int, call, step: bool = False):
        """``call()`` (the wrapped forward), with the fault where ``at`` puts it when the shape is over."""
        if self.steps_only and not step:
            return call()
        try:
            self._check(rows, positions)
        except MemoryError as e:
            if self.at == "before":
                raise
            fault = e
        else:
            return call()
        if self.at == "after":
            call()
            raise fault
        layer = self.runner.model.get_decoder().layers[int(self.at.partition(":")[2])]

        def fail(module, args, output):
            raise fault
        hook = layer.register_forward_hook(fail)
        try:
            return call()
        finally:
            hook.remove()

    def step(self, rows, kv, *args, **kwargs):
        return self._guarded(len(rows), max(r.prefix_len + int(r.depths.max()) + 1 for r in rows),
                             lambda: self.runner.step(rows, kv, *args, **kwargs), step=True)

    def prefill(self, tokens, *args, **kwargs):
        return self._guarded(1, len(tokens), lambda: self.runner.prefill(tokens, *args, **kwargs))

    def prefill_rows(self, prompts, *args, **kwargs):
        return self._guarded(len(prompts), max(len(p) for p in prompts),
                             lambda: self.runner.prefill_rows(prompts, *args, **kwargs))

    def extend(self, row, tokens, *args, **kwargs):
        return self._guarded(1, getattr(row, "columns", 0) + len(tokens),
                             lambda: self.runner.extend(row, tokens, *args, **kwargs))


def runner_for(model, config):
    """The model runner a replica's engine gets: None (the engine's default) unless ``LOGITSPEC_FAULT``
    is ``oom:ROWS:TOKENS[:AT]`` or ``chaos:...``, then the runner ``config.runner`` names wrapped in
    :class:`OutOfMemoryAt` or :class:`ChaosRunner`."""
    kind, rest = next(((k, r) for k, r in _forms() if k in ("oom", "chaos")), (None, ""))
    if kind is None:
        return None
    from logitspec.worker.gpu import runner_for as configured_runner

    if kind == "chaos":
        return ChaosRunner(configured_runner(model, config))
    rows, tokens, *at = rest.split(":", 2)
    return OutOfMemoryAt(configured_runner(model, config), int(rows), int(tokens), at[0] if at else "before")
