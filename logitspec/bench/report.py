"""Benchmark aggregation, report and plots: pure functions of the records ``logitspec bench`` writes.

One record per method x question x turn (see :mod:`logitspec.bench.run`). A *unit* is one ``generate``
call's worth of prompts (one question-turn at batch size 1); every method runs every unit, so
speedups are ratios measured on the same prompts, side by side.

Speedup of a method = mean over units of (its tokens/s on the unit) / (the reference's tokens/s on the
same unit), per task and overall; the reference (``ar``) is exactly 1.00 by construction. Two other
ratios are kept beside it: the ratio of total tokens / total time, and Spec-Bench's ``speed.py``
definition (mean of per-unit speeds divided by the reference's mean).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable, Sequence

from .questions import TASKS, task_order

TASK_LABELS = {"mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization",
               "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "overall": "Overall"}
TIME_PARTS = ("prefill_s", "draft_s", "pack_s", "forward_s", "verify_s", "commit_s")
SPLIT_COLUMNS = tuple(p[:-2] for p in TIME_PARTS) + ("other",)
HIST_CAP = 12  # accepted lengths >= this share one histogram bin in the report


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _unit_key(r: dict):
    return r["unit"] if "unit" in r else (r["question_id"], r.get("turn", 0))


def units(records: Iterable[dict]) -> dict[str, dict]:
    """Per method, per unit: ``{"task", "tokens", "wall", "tps"}``.

    A unit's wall time is ``unit_wall_time`` when present (one batched call shared by its records),
    else the record's ``wall_time``; its tokens are the sum of its records' ``new_tokens``.
    """
    out: dict[str, dict] = defaultdict(dict)
    for r in records:
        u = out[r["method"]].setdefault(_unit_key(r), {"task": r["task"], "tokens": 0, "wall": 0.0,
                                                       "shared": None})
        u["tokens"] += int(r["new_tokens"])
        if r.get("unit_wall_time") is not None:
            u["shared"] = float(r["unit_wall_time"])
        else:
            u["wall"] += float(r["wall_time"])  # unbatched records of one unit: their times add
    for per_method in out.values():
        for u in per_method.values():
            shared = u.pop("shared")
            if shared is not None:
                u["wall"] = shared
            u["tps"] = u["tokens"] / u["wall"] if u["wall"] > 0 else 0.0
    return dict(out)


def speedups(records: Sequence[dict], reference: str = "ar") -> dict[str, dict[str, dict[str, float | None]]]:
    """``{method: {"mean_ratio"|"total_ratio"|"specbench": {task..., "overall": x}}}``.

    Only units the reference also ran (with non-zero speed) count.
    """
    per = units(records)
    ref = per.get(reference)
    if ref is None:
        raise ValueError(f"no records of the reference method {reference!r}: speedups need it")
    out = {}
    for method, us in per.items():
        groups: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
        for key, u in us.items():
            r = ref.get(key)
            if r is None or r["tps"] <= 0:
                continue
            groups[u["task"]].append((u, r))
            groups["overall"].append((u, r))
        res: dict[str, dict] = {"mean_ratio": {}, "total_ratio": {}, "specbench": {}}
        for task, pairs in groups.items():
            res["mean_ratio"][task] = _mean([u["tps"] / r["tps"] for u, r in pairs])
            tot_u = sum(u["tokens"] for u, _ in pairs) / sum(u["wall"] for u, _ in pairs)
            tot_r = sum(r["tokens"] for _, r in pairs) / sum(r["wall"] for _, r in pairs)
            res["total_ratio"][task] = tot_u / tot_r
            res["specbench"][task] = _mean([u["tps"] for u, _ in pairs]) / _mean([r["tps"] for _, r in pairs])
        out[method] = res
    return out


def accept_histogram(records: Iterable[dict]) -> dict[int, int]:
    """Accepted length -> number of forwards, pooled over records (prefill forwards included)."""
    c: Counter = Counter()
    for r in records:
        c.update(int(a) for a in (r.get("accept_lengths") or ()))
    return dict(sorted(c.items()))


def mat(records: Sequence[dict]) -> float | None:
    """Mean accepted tokens per target forward, pooled: total new tokens / total forwards."""
    rs = [r for r in records if r.get("steps")]
    if not rs:
        return None
    return sum(int(r["new_tokens"]) for r in rs) / sum(int(r["steps"]) for r in rs)


def _weighted(records: Sequence[dict], field: str) -> float | None:
    """Mean of a per-record rate weighted by decode steps (forwards after the prefill)."""
    rs = [r for r in records if r.get(field) is not None and r.get("decode_steps")]
    w = sum(r["decode_steps"] for r in rs)
    return sum(r[field] * r["decode_steps"] for r in rs) / w if w else None


def time_split(records: Sequence[dict]) -> dict[str, float] | None:
    """Share of wall time in each engine phase (plus ``other``); None when a method reports none."""
    rs = [r for r in records if all(r.get(p) is not None for p in TIME_PARTS)]
    wall = sum(float(r["wall_time"]) for r in rs)
    if not rs or wall <= 0:
        return None
    split = {p[:-2]: sum(float(r[p]) for r in rs) / wall for p in TIME_PARTS}
    split["other"] = 1.0 - sum(split.values())
    return split


def _key(r: dict) -> tuple:
    return r["question_id"], r.get("turn", 0), r.get("sample", 0)


def lossless(records: Sequence[dict], reference: str = "ar") -> dict[str, float | None]:
    """Per method, the fraction of question-turns (and samples) whose tokens equal the reference's;
    None for a method whose records say they are not comparable (``same_as_ar`` None: HF sampling)."""
    ref = {_key(r): r.get("token_ids") for r in records if r["method"] == reference}
    by_method: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        key = _key(r)
        if "same_as_ar" in r and r["same_as_ar"] is None:
            continue
        if "token_ids" in r and ref.get(key) is not None:
            by_method[r["method"]].append(list(r["token_ids"]) == list(ref[key]))
        elif "same_as_ar" in r and r["same_as_ar"] is not None:
            by_method[r["method"]].append(bool(r["same_as_ar"]))
    return {m: (sum(v) / len(v) if v else None) for m, v in by_method.items()}


def summarize(records: Sequence[dict], reference: str = "ar", methods: Sequence[str] | None = None) -> dict:
    """The ``methods`` part of ``summary.json``: per method speedups, MAT, rates and time split."""
    records = list(records)
    if methods is None:
        methods = list(dict.fromkeys(r["method"] for r in records))
    sp = speedups(records, reference)
    same = lossless(records, reference)
    tasks = task_order(r["task"] for r in records)
    out = {}
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        by_task = {t: [r for r in rs if r["task"] == t] for t in tasks}
        by_task = {t: v for t, v in by_task.items() if v}
        tree = _weighted(rs, "mean_tree_size")
        drafts = tree is not None and tree > 0  # methods that never draft have no retrieval rate
        wall = sum(u["wall"] for u in units(rs)[m].values())
        tokens = sum(int(r["new_tokens"]) for r in rs)
        out[m] = {
            "speedup": sp.get(m, {}).get("mean_ratio", {}),
            "speedup_total": sp.get(m, {}).get("total_ratio", {}),
            "speedup_specbench": sp.get(m, {}).get("specbench", {}),
            "mat": {**{t: mat(v) for t, v in by_task.items()}, "overall": mat(rs)},
            "tokens_per_s": {**{t: _tps(v, m) for t, v in by_task.items()}, "overall": tokens / wall if wall
                             else None},
            "retrieval_success": _weighted(rs, "retrieval_success") if drafts else None,
            "mean_tree_size": tree,
            "lossless": same.get(m),
            "accept_hist": {str(k): v for k, v in accept_histogram(rs).items()} or None,
            "accepted_from": accepted_from(rs),
            "time_split": time_split(rs),
            "question_turns": len(rs),
            "new_tokens": tokens,
            "wall_time": wall,
        }
    return out


def _sources_table(ms: dict) -> list[str]:
    """Report lines: per method, the share of its accepted draft tokens each source supplied."""
    sources = {m: v["accepted_from"] for m, v in ms.items() if v.get("accepted_from")
               and any(v["accepted_from"].values())}
    if not sources:
        return []
    names = list(next(iter(sources.values())))
    lines = ["", "## Accepted draft tokens by source (share of the method's accepted draft tokens)", "",
             "| Method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for m, a in sources.items():
        total = sum(a.values())
        lines.append(f"| `{m}` | " + " | ".join(f"{a[k] / total:.1%}" for k in names) + " |")
    return lines


def accepted_from(records: Sequence[dict]) -> dict[str, int] | None:
    """Accepted draft tokens summed by source (context, reference, history, guess); None for records
    without it (HF baselines, results written before it existed)."""
    rows = [r["accepted_from"] for r in records if r.get("accepted_from")]
    if not rows:
        return None
    return {k: sum(int(a.get(k, 0)) for a in rows) for k in rows[0]}


def _tps(records: Sequence[dict], method: str) -> float | None:
    us = units(records).get(method, {})
    wall = sum(u["wall"] for u in us.values())
    return sum(u["tokens"] for u in us.values()) / wall if wall else None


# ---------------------------------------------------------------------------------------- report
def _f(x, fmt="{:.2f}", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _run_lines(summary: dict, tasks: list) -> list[str]:
    """The report's title and what was run: command, code, machine, time and load, questions, settings."""
    s = summary.get("settings", {})
    lines = [f"# Spec-Bench: {summary.get('model', {}).get('name', '?')}", ""]
    if summary.get("partial"):
        lines += [f"**Partial run: {summary['partial']}.**", ""]
    if summary.get("command"):
        lines += ["Command:", "", "```", summary["command"], "```", ""]
    if summary.get("code"):
        lines += [f"Code: {summary['code']}.", ""]
    mach = summary.get("machine", {})
    if mach:
        lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in mach.items() if v not in (None, ""))
                     + ".")
        lines.append("")
    if summary.get("started"):
        load = summary.get("load_average") or {}
        lines += [f"Run: {summary['started']} to {summary.get('finished', '?')}; 1/5/15-min load average "
                  f"{load.get('start')} at the start, {load.get('end')} at the end.", ""]
    counts = summary.get("question_turns_per_task", {})
    lines.append(
        f"{summary.get('questions', '?')} questions, {sum(counts.values()) if counts else '?'} "
        f"question-turns ("
        + ", ".join(f"{TASK_LABELS.get(t, t)} {counts.get(t, '?')}" for t in tasks)
        + f"), {s.get('decoding', 'greedy')}, max_new_tokens {s.get('max_new_tokens', '?')}, "
        f"batch size {s.get('max_batch_size', 1)}, reference `{summary.get('reference', 'ar')}`. "
        "All methods ran in one process on the same prompts, interleaved per question after a warm-up.")
    lines.append("")
    return lines


def _hist_lines(ms: dict) -> list[str]:
    """The accepted-tokens-per-forward table, for methods that recorded the histogram."""
    lines: list[str] = []
    hists = {m: v["accept_hist"] for m, v in ms.items() if v.get("accept_hist")}
    if hists:
        top = min(HIST_CAP, max(int(k) for h in hists.values() for k in h))
        labels = [str(i) for i in range(1, top)] + [f"{top}+" if top == HIST_CAP else str(top)]
        lines += ["", "## Accepted tokens per forward (share of forwards, prefill included)", "",
                  "| Method | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for m, h in hists.items():
            total = sum(h.values())
            shares = [h.get(str(i), 0) / total for i in range(1, top)]
            shares.append(sum(n for k, n in h.items() if int(k) >= top) / total)
            lines.append(f"| `{m}` | " + " | ".join(_f(x, "{:.1%}") for x in shares) + " |")
    return lines


def _curve_lines(summary: dict) -> list[str]:
    """The forward cost curves the auto draft budget used, per method."""
    lines: list[str] = []
    curves = {m: c["cost_curve"] for m, c in (summary.get("method_configs") or {}).items()
              if c.get("cost_curve")}
    if curves:
        lines += ["", "## Forward cost curves used by the auto draft budget", "",
                  "Seconds per forward adding n tokens, as the engine loaded or measured them "
                  "(`method_configs` in summary.json holds every method's full configuration).", ""]
        for m, c in curves.items():
            lines.append(f"- `{m}`: " + ", ".join(f"n={n}: {t:.3f}" for n, t in zip(c["tokens"],
                                                                                    c["seconds"])))
    return lines


def render_report(summary: dict) -> str:
    """The paper-style Markdown report of a ``summary.json`` dict; every number comes from it."""
    ms = summary["methods"]
    tasks = summary.get("tasks") or [t for t in TASKS if any(t in v["speedup"] for v in ms.values())]
    cols = list(tasks) + ["overall"]
    s = summary.get("settings", {})
    lines = _run_lines(summary, tasks)
    head = "| Method | " + " | ".join(TASK_LABELS.get(c, c) for c in cols) + " | MAT | tok/s |"
    sep = "|---" * (len(cols) + 3) + "|"
    lines += ["## Speedup (mean over question-turns of tokens/s ÷ the reference's) and MAT", "", head, sep]
    for m, v in ms.items():
        lines.append(f"| `{m}` | " + " | ".join(_f(v["speedup"].get(c), "{:.2f}x") for c in cols)
                     + f" | {_f(v['mat'].get('overall'))} | {_f(v['tokens_per_s'].get('overall'))} |")
    lines += ["", "## Mean accepted tokens per target forward (MAT)", "",
              "| Method | " + " | ".join(TASK_LABELS.get(c, c) for c in cols) + " |", "|---" * (len(cols) + 1)
              + "|"]
    for m, v in ms.items():
        lines.append(f"| `{m}` | " + " | ".join(_f(v["mat"].get(c)) for c in cols) + " |")
    lines += ["", "## Details", "",
              "Speedup (totals) = total tokens / total time relative to the reference's; Spec-Bench = its "
              "`speed.py` (mean speed / reference mean speed). " + _lossless_note(s) + " Time split = "
                                                                                       "share of "
              "wall time (engine methods only).", "",
              "| Method | draft budget | speedup (totals) | speedup (Spec-Bench) | retrieval success | "
              "mean tree size | lossless "
              "| " + " | ".join(SPLIT_COLUMNS) + " |", "|---" * (7 + len(SPLIT_COLUMNS)) + "|"]
    for m, v in ms.items():
        ts = v.get("time_split") or {}
        lines.append(
            f"| `{m}` | {budget_of(summary, m)} | {_f(v['speedup_total'].get('overall'), '{:.2f}x')} | "
            f"{_f(v['speedup_specbench'].get('overall'), '{:.2f}x')} | "
            f"{_f(v['retrieval_success'], '{:.1%}')} | {_f(v['mean_tree_size'], '{:.1f}')} | "
            f"{_f(v['lossless'], '{:.0%}')} | "
            + " | ".join(_f(ts.get(p), "{:.1%}") for p in SPLIT_COLUMNS)
            + " |")
    lines += _sources_table(ms)
    lines += _hist_lines(ms) + _curve_lines(summary)
    plots = summary.get("plots") or []
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    lines.append("")
    return "\n".join(lines)


def budget_of(summary: dict, method: str) -> str:
    """Which draft budget a method ran under: ``auto`` or ``fixed (N)`` for the budgeted methods, the
    method's own fixed shape for lookahead, ``-`` for plain decoding and the HF baselines."""
    cfg = ((summary.get("method_configs") or {}).get(method) or {}).get("config")
    if not cfg or cfg.get("method") == "ar":
        return "-"
    if cfg.get("method") == "lookahead":
        return "fixed shape"
    size = {"pld": cfg.get("pld_max_tokens"), "rest": cfg.get("rest_num_draft")}.get(cfg["method"],
                                                                                    cfg.get("capacity"))
    return "auto" if cfg.get("budget") == "auto" else f"fixed ({size})"


def _lossless_note(settings: dict) -> str:
    if not settings.get("temperature"):
        return "Lossless = share of question-turns whose tokens equal the reference's."
    return ("Sampled: lossless = share of samples whose tokens equal the reference's from the same seed (the "
            "engine draws one uniform per emitted token, so its methods agree up to float rounding at a "
            "draw's edge); it is no test of the distribution (tests/test_engine_sampling.py is), and HF's "
            "draws are its own (–).")


# ----------------------------------------------------------------------------------------- plots
def plot_speedup(summary: dict, path) -> None:
    """Grouped bars: speedup per task (and overall) per method, with the 1.0 line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ms = summary["methods"]
    cols = list(summary.get("tasks") or TASKS) + ["overall"]
    fig = Figure(figsize=(max(6.0, 1.3 * len(cols)), 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(ms))
    for i, (m, v) in enumerate(ms.items()):
        ys = [v["speedup"].get(c) or 0.0 for c in cols]
        ax.bar([j + (i - (len(ms) - 1) / 2) * width for j in range(len(cols))], ys, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cols)), [TASK_LABELS.get(c, c) for c in cols])
    ax.set_ylabel("speedup vs " + summary.get("reference", "ar"))
    ax.set_title(f"Spec-Bench speedup: {summary.get('model', {}).get('name', '')}")
    ax.legend(fontsize="small", ncols=min(len(ms), 5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_accept_hist(summary: dict, path) -> None:
    """Grouped bars: share of forwards accepting 1, 2, ... tokens, per method that reports it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hists = {m: v["accept_hist"] for m, v in summary["methods"].items() if v.get("accept_hist")}
    fig = Figure(figsize=(7.0, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = max([int(k) for h in hists.values() for k in h] or [1])
    width = 0.8 / max(1, len(hists))
    for i, (m, h) in enumerate(hists.items()):
        total = sum(h.values())
        ax.bar([x + (i - (len(hists) - 1) / 2) * width for x in range(1, top + 1)],
               [h.get(str(x), 0) / total for x in range(1, top + 1)], width, label=m)
    ax.set_xlabel("tokens accepted per target forward")
    ax.set_ylabel("share of forwards")
    ax.set_xticks(range(1, top + 1))
    ax.set_title("Acceptance-length histogram")
    if hists:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
