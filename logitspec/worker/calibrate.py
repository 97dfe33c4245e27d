"""Measure this machine's forward cost t(rows, new tokens per row), store it per model, machine and device.

``logitspec calibrate --model default [--device cuda --dtype bfloat16]`` prints and plots the curve;
engines with ``SpecConfig(budget="auto")`` load the stored curve, or measure a quick one on first
use. The grid depends on the device (:func:`grid_for`): a CPU's forward grows with every token, a
GPU's stays flat to far larger batches and trees, so it is measured there up to 64 rows x 64 nodes.

Every forward runs through the model runner the engine uses (:class:`~logitspec.worker.runner.ModelRunner`:
the eager :class:`~logitspec.worker.eager_runner.EagerRunner`, or on CUDA the graph runner of
:mod:`logitspec.worker.gpu`, whose padded, captured steps cost what the engine pays); the runner is part of
a stored curve's key (:func:`runner_fingerprint`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import platform
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from logitspec import allocator
from logitspec.device import elapsed
from logitspec.kernels import skinny
from logitspec.spec_decode.budget import CostCurve
from logitspec.worker.head import OutputMode
from logitspec.worker.kv_cache import BatchKV, GrowingLayer
from logitspec.worker.masks import StepRow
from logitspec.worker.runner import ModelRunner

log = logging.getLogger("logitspec.worker.calibrate")
TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
BATCH_ROWS = (4, 8, 16, 32)  # batch sizes with a curve of their own (tokens per row)
BATCH_TOKENS = (1, 2, 3, 4, 6, 8)
HEAD_NODES = (1, 2, 4, 8, 16, 32, 64, 128)  # output-layer-only points
SETTLED = 2.0  # a control forward after a measurement within this factor of the curve's: speed held
ATTEMPTS = 3  # measurements of a grid before an unsettled curve is used without being stored


@dataclass(frozen=True)
class Grid:
    """What :func:`measure` times by default on a kind of device."""

    tokens: tuple[int, ...]  # new tokens of one row
    rows: tuple[int, ...]  # batch sizes with a curve of their own
    per_row: tuple[int, ...]  # new tokens per row in those
    max_tokens: int  # batch points with more new tokens in the forward are skipped
    context: int  # cached tokens of row 0 (row r holds 16 r more)
    long_context: int  # a longer cache, for what a node's attention adds per cached column


CONTEXT_CHUNK = 512  # prompt tokens per forward of a measurement's context (the engine's default chunk)
CHAINS = "own"  # what the curves verify (part of a stored curve's key): the model's own continuations
CPU_GRID = Grid(TOKENS, BATCH_ROWS, BATCH_TOKENS, 128, 256, 2048)
# per row up to 6 tokens: extrapolating a batch's cost past 3 tokens a row under-stated it (measured
# 5 rows x 5 tokens: 52-67 ms; from 1-3 tokens: 49 ms)
CPU_QUICK = replace(CPU_GRID, tokens=(1, 2, 4, 8, 16, 32), per_row=(1, 2, 3, 4, 6))
# a GPU's forward stays flat to far more tokens: the batch sizes it runs, trees up to 64 nodes a row
GPU_GRID = Grid((1, 2, 4, 8, 16, 32, 64), (8, 32, 64), (1, 2, 4, 8, 16, 32, 64), 64 * 64, 1024, 8192)


def grid_for(device, quick: bool = False) -> Grid:
    """The default grid of ``device`` (the quick one: what an engine measures on first use)."""
    if torch.device(device).type == "cpu":
        return CPU_QUICK if quick else CPU_GRID
    return GPU_GRID


def rows_for(grid: Grid, max_batch_size: int, limit: int | None = None) -> tuple[int, ...]:
    """The grid's batch sizes an engine of up to ``max_batch_size`` rows needs: those up to the first
    that covers it (the cost model interpolates between measured sizes). ``limit``: the most rows
    the runner holds (its slots); a larger size is measured at ``limit`` rows instead."""
    if max_batch_size <= 1:
        return ()
    cover = next((r for r in grid.rows if r >= max_batch_size), grid.rows[-1])
    rows = [r for r in grid.rows if r <= cover]
    if limit is not None:
        rows = sorted({min(r, limit) for r in rows if min(r, limit) > 1})
    return tuple(rows)


def machine_fingerprint(device) -> str:
    """What the cost depends on besides the model: processor, threads, device, the allocator
    (tcmalloc made a 6-row step 8-12% cheaper here)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    dev = str(device)
    if dev.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(dev))
        dev = f"{name} | CUDA {torch.version.cuda} | torch {torch.__version__}"
    alloc = "tcmalloc" if allocator.loaded() else "system malloc"
    return f"{cpu} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | {dev} | {alloc}"


def kernel_fingerprint(model, head=None) -> str:
    """What the cost depends on in the code: attention kernel, linear and norm modules, output-layer
    screen (its passes, the int8 pass, and its scores kept in the pass's dtype), KV-cache layer, the
    compiled CPU kernels' sources."""
    attn = getattr(model.config, "_attn_implementation", None)
    linears = sorted({type(m).__name__ for m in model.modules()
                      if isinstance(m, torch.nn.Linear) or type(m).__name__ == "MergedPart"})
    norms = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
    screen = getattr(head, "screen", None)
    int8 = "+int8-held" if screen is not None and screen.int8.enabled else ""  # not in the measured forwards
    if screen is not None:
        screen = f"{screen.kind}:{'+'.join(screen.passes)}{int8}:scores=pass-dtype"
    return (f"attn={attn}|linears={','.join(linears)}|norms={','.join(norms)}|screen={screen}"
            f"|cache={GrowingLayer.__name__}|chains={CHAINS}|kernels={skinny.sources_digest()}")


def runner_fingerprint(runner) -> str:
    """Which runner a curve's forwards went through (its ``kind``: "eager", or the graph runner with
    its attention and capture), part of a stored curve's key: an eager curve never serves the graph
    runner, or the other way round."""
    return str(getattr(runner, "kind", type(runner).__name__))


def curve_path(model, cache_dir=None, head=None, runner: str = "eager") -> pathlib.Path | None:
    """Where the curve of this model on this machine, kernels and runner (:func:`runner_fingerprint`)
    is stored (None for unnamed in-memory models)."""
    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return None
    from logitspec.paths import default_cache_dir

    p = next(model.parameters())
    key = (f"{name}|{p.dtype}|{machine_fingerprint(p.device)}|{kernel_fingerprint(model, head)}"
           f"|runner={runner}")
    slug = pathlib.Path(name).name.replace(os.sep, "_")[:40]
    root = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "calibration" / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


@torch.inference_mode()
def measure(target: ModelRunner, tokens=None, context: int | None = None, reps: int = 3, warmup: int = 1,
            batch_rows=None, batch_tokens=None, agree: Callable[[float], float] = float) -> CostCurve:
    """Fastest time over ``reps`` (machine noise only adds time: a median of few reps took one
    slow forward for the cost of its size) of one step of the runner ``target`` (decoder + greedy output layer
    for every node, the device's work included) adding n tokens to a ``context``-token cache, for
    each n in ``tokens``; then, for each b in ``batch_rows``, b rows (caches of different lengths
    from ``context`` on) adding n tokens each, for n in ``batch_tokens``. Caches are rolled back
    after each forward; every forward verifies chains of the model's own continuation
    (:func:`own_continuations`). Arguments left None come from the device's :func:`grid_for`.
    A control forward after the grid checks the machine's speed held (within ``SETTLED``); if not,
    the grid is measured again (up to ``ATTEMPTS`` times, each point's fastest kept) and a curve that
    never settles has ``settled = False`` (:func:`load_or_measure` does not store it). ``agree``: the
    speed change every process of a tensor-parallel group acts on (rank 0's), so that all measure the
    grid again or none do (their forwards are collective)."""
    g = grid_for(target.device)
    tokens = g.tokens if tokens is None else tokens
    context = g.context if context is None else context
    batch_rows = g.rows if batch_rows is None else batch_rows
    batch_tokens = g.per_row if batch_tokens is None else batch_tokens
    screen = target.head.screen
    if screen is not None:  # the screen's pass choice settled first: its timing trials are not costs
        for n in {*tokens, *(b * n for b in batch_rows for n in batch_tokens), *HEAD_NODES}:
            screen.settle(n, target.device)
    with screen.int8.holding() if screen is not None else contextlib.nullcontext():  # (see Int8Race)
        curve = None
        for attempt in range(1, ATTEMPTS + 1):
            got = _measure(target, tokens, context, reps, warmup, batch_rows, batch_tokens, g)
            curve = got if curve is None else lowest(curve, got)
            # a control forward after the whole grid: a curve measured while the machine ran far
            # slower or faster than now (another job's burst: 15x seen here) would misprice every node
            control = measure_rows(target, 1, tokens[:1], context, max(reps, 3), 0, own_chains=True)
            drift = agree(control.seconds[0] / curve.seconds[0])
            settled = 1 / SETTLED <= drift <= SETTLED
            if settled:
                break
            log.warning("the machine's speed changed while the cost curve was measured (a %d-token forward: "
                        "%.1f ms in the curve, %.1f ms after it; attempt %d of %d)%s", tokens[0],
                        curve.seconds[0] * 1e3, control.seconds[0] * 1e3, attempt, ATTEMPTS,
                        ": measuring again, keeping each point's fastest" if attempt < ATTEMPTS else
                        ": keeping each point's fastest, not stored")
    out = curve.monotone()
    out.settled = settled
    return out


def lowest(a: CostCurve, b: CostCurve) -> CostCurve:
    """Each point's faster time of two measurements of one grid (noise only adds time)."""
    def low(x: CostCurve, y: CostCurve) -> CostCurve:
        return CostCurve(x.tokens, [min(p, q) for p, q in zip(x.seconds, y.seconds)])

    head = low(a.head, b.head).to_dict() if a.head is not None and b.head is not None else None
    low_one = low(a, b)
    return CostCurve(low_one.tokens, low_one.seconds, {r: low(c, b.batches[r]) for r, c in a.batches.items()},
                     head, a.context)


def _measure(target, tokens, context, reps, warmup, batch_rows, batch_tokens, g) -> CostCurve:
    """:func:`measure`'s timings, its arguments resolved (``g``: the device's grid), before
    :meth:`~logitspec.spec_decode.budget.CostCurve.monotone`."""
    batches = {}
    # every curve verifies chains of the model's own continuation (a drafted chain that reads like
    # text): on arbitrary chains the screen's rescoring made drafted steps look far dearer than the
    # engine's (see own_continuations); what the curve still gets wrong, the
    # engine corrects from the steps it times (logitspec.spec_decode.feedback)
    one = measure_rows(target, 1, tokens, context, reps, warmup, own_chains=True)
    for b in batch_rows:
        sizes = [n for n in batch_tokens if b * n <= g.max_tokens]
        batches[b] = measure_rows(target, b, sizes, context, reps, warmup, own_chains=True)
    head = None
    if batch_rows and target.head.fast:  # the output layer's own cost, for per-row node counts
        head = measure_head(target, [n for n in HEAD_NODES if n <= g.max_tokens], reps, warmup)
    return CostCurve(one.tokens, one.seconds, batches, head.to_dict() if head else None,
                     measure_columns(target, context, g.long_context, reps, warmup, at_low=one))


def measure_columns(target: ModelRunner, low: int, high: int, reps: int, warmup: int, nodes: int = 16,
                    at_low: CostCurve | None = None) -> dict | None:
    """What a node's attention adds per cached column it reads: the growth of one row's cost per
    node (``nodes`` new tokens against one) from ``low`` to ``high`` cached tokens, over the growth
    of the columns read (:meth:`~logitspec.worker.runner.ModelRunner.read_columns`); None where the
    model's context or windows leave no difference to measure. ``at_low``: one row's curve already
    measured at ``low`` cached tokens with 1 and ``nodes`` tokens among its points (else measured)."""
    high = min(high, target.max_context - nodes - 1)
    gained = target.read_columns(high) - target.read_columns(low)
    if gained <= 0:
        return None
    if at_low is None or not {1, nodes} <= set(at_low.tokens):
        at_low = measure_rows(target, 1, (1, nodes), low, reps, warmup, own_chains=True)
    at_high = measure_rows(target, 1, (1, nodes), high, reps, warmup, own_chains=True)
    per_node = [(c(nodes) - c(1)) / (nodes - 1) for c in (at_low, at_high)]
    return {"per_column": max(0.0, (per_node[1] - per_node[0]) / gained), "columns": target.read_columns(low)}


def measure_head(target: ModelRunner, nodes, reps: int, warmup: int) -> CostCurve:
    """Fastest time of the output layer alone (greedy: the screen where the engine uses it) over n
    nodes' hidden states, for each n in ``nodes``."""
    hidden = target.head.hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(nodes), hidden, generator=gen).to(target.device, target.dtype)  # [N, H]
    times = {n: [] for n in nodes}
    for rep in range(warmup + reps):
        for n in nodes:
            dt = elapsed(lambda: target.head.output(x[:n], OutputMode.GREEDY), target.device)
            if rep >= warmup:
                times[n].append(dt)
    return CostCurve(list(nodes), [min(times[n]) for n in nodes])


def measure_rows(target: ModelRunner, rows: int, tokens, context: int, reps: int, warmup: int,
                 own_chains: bool = False) -> CostCurve:
    """Fastest step time of ``rows`` rows (row r caching ``context + 16 r`` tokens) adding n tokens
    each, for each n in ``tokens`` (interleaved over ``warmup + reps`` rounds): chains of arbitrary
    tokens, or (``own_chains``) of the model's own continuation (:func:`own_continuations`)."""
    vocab = target.vocab_size
    lengths = [min(context + 16 * r, target.max_context - max(tokens) - 1) for r in range(rows)]
    kv = batch_cache(target, [(7 * i + 3) % vocab for i in range(max(lengths))], lengths)
    chains = (own_continuations(target, kv, max(tokens)) if own_chains
              else [[(5 * i + 1 + r) % vocab for i in range(max(tokens))] for r in range(rows)])
    times = {n: [] for n in tokens}
    for rep in range(warmup + reps):
        for n in tokens:  # interleaved, so machine noise hits all sizes alike
            step = [StepRow.chain(kv.lengths[r], chains[r][:n]) for r in range(rows)]
            dt = elapsed(lambda: target.step(step, kv, OutputMode.GREEDY), target.device)
            kv.commit([[] for _ in range(rows)])  # drop the new columns
            if rep >= warmup:
                times[n].append(dt)
    return CostCurve(list(tokens), [min(times[n]) for n in tokens])


def batch_cache(target: ModelRunner, tokens: list[int], lengths: list[int]):
    """The runner's batch cache of ``len(lengths)`` rows, row r committing the first ``lengths[r]`` of
    ``tokens``: one prefill (in the engine's chunks: a long context in one chunk is a large
    transient) copied to every row, since the cost depends on the cached lengths, not the tokens.
    The eager cache repeats the prefilled row in place; another runner's storage (the graph
    runner's slots) takes copies of it."""
    row, _ = target.prefill(tokens, chunk=CONTEXT_CHUNK)
    kv = target.new_batch(len(lengths))
    if isinstance(kv, BatchKV):
        row.repeat_row(lengths)
        return row
    kv.add_rows([(row, 0, len(lengths))])
    kv.truncate(lengths)
    return kv


def own_continuations(target: ModelRunner, kv, n: int) -> list[list[int]]:
    """Per row of ``kv``, a chain of ``n`` tokens: an arbitrary first token, then what the model
    decodes greedily after it. A measured step verifies these, as the engine's steps verify drafts
    that read like text: on arbitrary token chains the screen's bound leaves thousands of candidate
    tokens a node to rescore (25k at 8 nodes of one row, against 6 on its own continuation), and the
    curve measured 1.9x one token's cost for 8 nodes where the engine's steps pay 1.0-1.2x. ``kv``
    is left as it was."""
    start = list(kv.lengths)
    chains = [[(1 + r) % target.vocab_size] for r in range(kv.rows)]
    for _ in range(n - 1):
        cols = kv.columns  # where the step's one new column per row lands
        step = [StepRow.chain(kv.lengths[r], c[-1:]) for r, c in enumerate(chains)]
        out = target.step(step, kv, OutputMode.GREEDY)
        kv.commit([[cols]] * kv.rows)
        for c, t in zip(chains, out.nodes.argmax.tolist()):
            c.append(int(t))
    kv.truncate(start)
    return chains


def load_or_measure(target: ModelRunner, max_batch_size: int = 1, quick: bool = True,
                    fresh: bool = False) -> CostCurve:
    """The stored curve of this model, machine, kernels and runner if it has the batch sizes this
    engine runs (:func:`rows_for`), else a measurement of them through ``target`` (stored if it
    settled: :func:`measure`). A runner with fixed storage (``max_rows`` slots) measures batch sizes
    up to its slots only. ``fresh``: measure even where a curve is stored (it replaces it)."""
    grid = grid_for(target.device, quick)
    rows = rows_for(grid, max_batch_size)
    fits = rows_for(grid, max_batch_size, getattr(target, "max_rows", None))
    path = curve_path(target.model, head=target.head, runner=runner_fingerprint(target))
    if path is not None and path.exists() and not fresh:
        try:
            d = json.loads(path.read_text())
            covered = _covers(d, grid, rows) or _covers(d, grid, fits)
            if covered and (not rows or not target.head.fast or "head" in d):
                return curve_from_doc(d)
        except (OSError, ValueError, KeyError):
            log.warning("ignoring unreadable calibration %s", path)
    t0 = time.perf_counter()
    curve = measure(target, tokens=grid.tokens, reps=3 if quick else 5, batch_rows=fits,
                    batch_tokens=grid.per_row)
    log.info("measured forward cost curve in %.1f s: %s", time.perf_counter() - t0, curve.to_dict())
    if path is not None and curve.settled:
        save(curve, path, target)
    return curve


def curve_from_doc(doc: dict) -> CostCurve:
    """The curve of a stored calibration document (:func:`save`'s)."""
    curve = CostCurve(doc["tokens"], doc["seconds"], doc.get("batches"), doc.get("head"), doc.get("context"))
    return curve.monotone()


def _covers(doc: dict, grid: Grid, rows) -> bool:
    """Whether a stored curve has every batch size in ``rows`` with the grid's tokens per row, and
    the cost per cached column (None where it could not be measured)."""
    batches = doc.get("batches") or {}
    def has(b: int) -> bool:
        want = {n for n in grid.per_row if b * n <= grid.max_tokens}
        return str(b) in batches and want <= set(batches[str(b)]["tokens"])

    return "context" in doc and all(has(b) for b in rows)


def save(curve: CostCurve, path: pathlib.Path, target: ModelRunner) -> None:
    """Write ``curve`` with what it was measured on, the runner included (atomically); ``context`` is
    written even when None, so a reader can tell a curve measured without a column cost from an
    older one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**curve.to_dict(), "context": curve.context, "model": target.model.config._name_or_path,
           "dtype": str(target.dtype), "machine": machine_fingerprint(target.device),
           "kernels": kernel_fingerprint(target.model, target.head), "runner": runner_fingerprint(target)}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
