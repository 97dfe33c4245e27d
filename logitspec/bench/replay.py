"""The engine's time per token with a recorded model's acceptance ("replayed acceptance").

:func:`replay` runs every trace set (the traces of several methods on the same prompts, one
:attr:`~logitspec.bench.trace.Trace.name`) at every batch size through the whole engine on ``model`` (random
weights of a real shape, where the real weights cannot go) with :mod:`logitspec.bench.replay_drafter`'s
hooks, and
reports per method the milliseconds per token and the speed-up over ``ar`` on the same rows. ``ar``
needs no trace: it is the plain engine on the same prompts and token counts.
"""
from __future__ import annotations

import copy
import gc
import statistics
from typing import Any, Callable, Iterable, Sequence

import torch

from logitspec.bench.replay_drafter import REPLAYED, check_fits, replay_config, replay_hooks, replay_plan
from logitspec.bench.trace import Trace, load_traces
from logitspec.engine.engine import Engine
from logitspec.worker.gpu import default_runner

BATCH_SIZES = (1, 8, 32, 64)


def random_like(model, seed: int = 0):
    """A model of ``model``'s class and config (its attention and dtype) with random weights."""
    torch.manual_seed(seed)
    fresh = type(model)(copy.deepcopy(model.config)).to(dtype=model.dtype, device=model.device).eval()
    return fresh


def traced_methods(traces: Iterable[Trace]) -> list[str]:
    """``ar`` (it needs no trace) and every method the traces recorded, sorted."""
    return ["ar", *sorted({t.method for t in traces} - {"ar"})]


def trace_sets(traces: Iterable[Trace]) -> dict[str, dict[str, Trace]]:
    """``{trace name: {method: trace}}``; ValueError if a name has two traces of one method."""
    sets: dict[str, dict[str, Trace]] = {}
    for t in traces:
        if t.method in sets.setdefault(t.name, {}):
            raise ValueError(f"two {t.method} traces of {t.name}")
        sets[t.name][t.method] = t
    return sets


def run_once(model, trace: Trace, method: str, batch_size: int, runner, seed: int = 0,
             max_prompt_tokens: int | None = None, warmup_tokens: int | None = 16) -> dict[str, Any]:
    """One replayed run of ``method`` (``ar``: the plain engine) on ``trace``'s rows at ``batch_size``:
    ms per token (decoding: the run's wall time less its prefills; and end to end), MAT, the rows'
    tokens and emitted counts per forward."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompts, requests, seqs = replay_plan(trace, batch_size, vocab, seed, max_prompt_tokens)
    config = replay_config(method, batch_size)
    engine = Engine(model, None, config, runner=runner,
                    **replay_hooks(None if method == "ar" else trace, config, prompts, seqs).kwargs())
    check_fits(trace, engine.max_context, max_prompt_tokens)
    if warmup_tokens != 0:  # captures, kernels and caches: not measured (None: the whole run once)
        n = min(batch_size, len(prompts))
        engine.run(prompts[:n], [r.with_(max_new_tokens=min(warmup_tokens or r.max_new_tokens,
                                                             r.max_new_tokens)) for r in requests[:n]])
    run = engine.run(prompts, requests)
    tokens = sum(len(r.token_ids) for r in run.results)
    prefill = sum(r.stats["prefill_s"] for r in run.results)
    lengths = [r.stats["accepted_lengths"] for r in run.results]
    return {"ms_per_token": 1000 * max(run.stats["wall_s"] - prefill, 0.0) / tokens,
            "e2e_ms_per_token": 1000 * run.stats["wall_s"] / tokens, "prefill_s": prefill,
            "wall_s": run.stats["wall_s"], "tokens": tokens, "rows": len(prompts),
            "mat": tokens / sum(len(x) for x in lengths), "accepted_lengths": lengths,
            "token_ids": [r.token_ids for r in run.results]}


def replay(model, traces: Sequence[Trace] | Sequence[str] | str, methods: Sequence[str] | None = None,
           batch_sizes: Sequence[int] = BATCH_SIZES, rounds: int = 1, seed: int = 0,
           max_prompt_tokens: int | None = None, warmup_tokens: int | None = 16,
           runner_for: Callable[[Any, int], Any] | None = None, details: bool = False) -> dict[str, Any]:
    """Replayed acceptance of every trace set at every batch size (see the module).

    ``traces``: :class:`Trace` objects, or trace files / directories. ``methods``: default ``ar`` and
    every method the traces recorded (a set without a trace of a method has no row for it).
    ``rounds``: measured runs per (set, batch size, method), the median kept. ``max_prompt_tokens``:
    cut the replayed prompts (their attention costs less than the recorded ones').
    ``runner_for(model, rows)``: the model runner shared by the methods at one batch size (default
    :func:`~logitspec.worker.gpu.default_runner`: the graph runner on CUDA). ``details``: keep each run's
    per-row emitted counts and token ids.

    Returns ``{"label": "replayed acceptance", "methods", "batch_sizes", "model", "traces": {name:
    {"recorded": {method: {"mat", "batch_size", "sequences"}}, "results": {"<method>@<batch>":
    {"ms_per_token", "e2e_ms_per_token", "x_ar", "x_ar_e2e", "mat", "tokens", "rows", ...}}}}}``;
    ``x_ar``: ``ar``'s decoding ms per token over the method's (> 1: faster than ``ar``).
    """
    loaded = load_traces(traces) if isinstance(traces, str) or (traces and isinstance(traces[0], str)) \
        else list(traces)
    methods = list(methods) if methods is not None else traced_methods(loaded)
    runner_for = runner_for or (lambda m, rows: default_runner(m, rows))
    out: dict[str, Any] = {"label": REPLAYED, "methods": list(methods), "batch_sizes": list(batch_sizes),
                           "model": {"class": type(model).__name__,
                                     "parameters": sum(p.numel() for p in model.parameters()),
                                     "dtype": str(model.dtype).replace("torch.", ""),
                                     "device": str(model.device)},
                           "traces": {}}
    for name, by_method in trace_sets(loaded).items():
        base = next(iter(by_method.values()))  # ar's rows: any trace of the set (same prompts and lengths)
        results: dict[str, dict] = {}
        for b in batch_sizes:
            runner = runner_for(model, b)
            for m in methods:
                trace = base if m == "ar" else by_method.get(m)
                if trace is None:
                    continue
                runs = [run_once(model, trace, m, b, runner, seed, max_prompt_tokens,
                                 warmup_tokens if r == 0 else 0) for r in range(rounds)]
                row = dict(runs[-1], method=m, batch_size=b,
                           ms_per_token=statistics.median(x["ms_per_token"] for x in runs),
                           e2e_ms_per_token=statistics.median(x["e2e_ms_per_token"] for x in runs))
                if not details:
                    row.pop("accepted_lengths")
                    row.pop("token_ids")
                results[f"{m}@{b}"] = row
            _speed_ups(results, b)
            del runner
            _release(model)
        out["traces"][name] = {"recorded": {m: {"mat": t.mat, "batch_size": t.batch_size,
                                                "sequences": len(t.sequences), "meta": t.meta}
                                            for m, t in by_method.items()}, "results": results}
    return out


def _release(model) -> None:
    """Free the last batch size's runner (engines hold it in reference cycles) before the next one's
    slots are allocated."""
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _speed_ups(results: dict[str, dict], b: int) -> None:
    """Add ``x_ar`` and ``x_ar_e2e`` to the rows of batch size ``b`` (None without an ``ar`` row)."""
    ar = results.get(f"ar@{b}")
    for row in (r for r in results.values() if r["batch_size"] == b):
        row["x_ar"] = ar["ms_per_token"] / row["ms_per_token"] if ar and row["ms_per_token"] else None
        row["x_ar_e2e"] = ar["e2e_ms_per_token"] / row["e2e_ms_per_token"] if ar else None


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a :func:`replay` result, one per trace set."""
    lines = []
    for name, t in result["traces"].items():
        rec = ", ".join(f"{m} MAT {r['mat']:.2f} (recorded at batch {r['batch_size']})"
                        for m, r in t["recorded"].items())
        lines += [f"### {name}: {REPLAYED} ({rec})", "",
                  "| batch | method | ms/token (decoding) | vs ar | ms/token (end to end) | vs ar | MAT |",
                  "|---|---|---|---|---|---|---|"]
        for row in t["results"].values():
            x = f"{row['x_ar']:.2f}x" if row["x_ar"] else "-"
            xe = f"{row['x_ar_e2e']:.2f}x" if row["x_ar_e2e"] else "-"
            lines.append(f"| {row['batch_size']} | {row['method']} | {row['ms_per_token']:.2f} | {x} | "
                         f"{row['e2e_ms_per_token']:.2f} | {xe} | {row['mat']:.2f} |")
        lines.append("")
    return "\n".join(lines)

