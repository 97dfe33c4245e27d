"""An evaluation sweep's report: per dataset and configuration the score, speeds, MAT, speed-ups against
the configuration's ``ar`` baseline, peak memory, and whether lossless methods gave ``ar``'s text.
A LongBench-E file's cells also score each length bucket (``length_scores``), a LongBench v2 file's
cells their accuracy by difficulty and length (``v2``).

Input rows are the sweep's output rows (dicts with ``key``, ``dataset``, ``config``, ``generation``,
``token_ids``, ``n_prompt_tokens``, ``n_new_tokens``, ``steps``, ``prefill_s``, ``run_share_s``,
``peak_rss_bytes``, ``error``, optionally ``max_step_gap_s``); no engine or Ray here. Times:
``run_share_s`` is a row's share of the wall time of the ``Engine.run`` it was generated in, so their
sum is the configuration's end-to-end time; ``prefill_s`` sums the prefills; decode time is the
difference.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from .longbench import Example
from .longbench_v2 import ExampleV2, score_v2
from .prompts import resolve_name
from .scoring import LENGTH_BUCKETS, length_bucket, score_examples, score_examples_by_length

__all__ = ["build_report", "report_markdown", "MAX_MISMATCHES"]

MAX_MISMATCHES = 20  # mismatching rows listed in the report


def _ratio(a, b):
    return a / b if a is not None and b else None


def _figures(rows: list[dict], examples: Sequence[Example]) -> dict:
    """One (dataset, configuration) cell from its rows, in ``examples``' order."""
    by_key = {r["key"]: r for r in rows}
    scored = [e for e in examples if f"{e.name}/{e.id}" in by_key]
    ok = [r for r in rows if r["error"] is None]
    preds = [by_key[f"{e.name}/{e.id}"]["generation"] or "" for e in scored]  # an error row scores as ""
    extra = _dataset_scores(scored, preds, [by_key[f"{e.name}/{e.id}"] for e in scored])
    tokens = sum(r["n_new_tokens"] for r in ok)
    e2e_s = sum(r["run_share_s"] for r in ok)
    prefill_s = sum(r["prefill_s"] for r in ok)
    decode_s = e2e_s - prefill_s
    decode_steps = sum(r["steps"] - 1 for r in ok)
    peaks = [r["peak_rss_bytes"] for r in ok if r["peak_rss_bytes"] is not None]
    gaps = [r["max_step_gap_s"] for r in ok if r.get("max_step_gap_s") is not None]  # absent in old rows
    return {
        "rows": len(rows), "errors": len(rows) - len(ok),
        "score": extra.pop("score"),
        **extra,
        "new_tokens": tokens, "prompt_tokens": sum(r["n_prompt_tokens"] for r in ok),
        "e2e_s": e2e_s, "prefill_s": prefill_s, "decode_s": decode_s,
        "tokens_per_s": _ratio(tokens, e2e_s),
        "decode_tokens_per_s": _ratio(tokens - len(ok), decode_s),  # the first token comes from the prefill
        "prefill_tokens_per_s": _ratio(sum(r["n_prompt_tokens"] for r in ok), prefill_s),
        "prefill_share": _ratio(prefill_s, e2e_s),
        "mat": _ratio(tokens - len(ok), decode_steps),
        "decode_step_s": _ratio(decode_s, decode_steps),
        "peak_rss_bytes": max(peaks) if peaks else None,
        "max_step_gap_s": max(gaps) if gaps else None,
    }


def _dataset_scores(scored: list, preds: list[str], rows: list[dict]) -> dict:
    """The cell's ``score`` and, by dataset kind, its breakdown: ``length_scores`` for a LongBench-E
    file (``{"0-4k", "4-8k", "8k+"}`` as ``eval.py --e`` computes them, None for a bucket without rows,
    where ``eval.py`` gives NaN; with ``length_counts``); ``v2`` for LongBench v2 (:func:`score_v2`:
    accuracy overall, by difficulty and by length; ``score`` is the overall accuracy)."""
    if not scored:
        return {"score": None}
    if isinstance(scored[0], ExampleV2):  # pred.py writes no row for a failed query: error rows not scored
        responses = [None if r["error"] is not None else (r["generation"] or "") for r in rows]
        v2 = score_v2(scored, responses)
        return {"score": v2["overall"], "v2": v2}
    out: dict = {"score": score_examples(scored, preds)}
    if resolve_name(scored[0].name)[1]:
        buckets = score_examples_by_length(scored, preds)
        out["length_scores"] = {b: None if math.isnan(v) else v for b, v in buckets.items()}
        out["length_counts"] = {b: sum(length_bucket(e.length) == b for e in scored) for b in LENGTH_BUCKETS}
    return out


def _compare(cell: dict, base: dict, rows: list[dict], base_rows: list[dict], mismatches: list) -> None:
    """Speed-ups of ``cell`` against its baseline, and whether every row gave the baseline's tokens."""
    cell["decode_speedup"] = _ratio(cell["decode_tokens_per_s"], base["decode_tokens_per_s"])
    cell["e2e_speedup"] = _ratio(cell["tokens_per_s"], base["tokens_per_s"])
    # the prefill is the same work for every method (same prompts, same forward): with the baseline's
    # prefill time, the end-to-end speed-up free of the load's change between the two prefills
    if cell["decode_s"] > 0 and base["tokens_per_s"]:
        cell["e2e_speedup_same_prefill"] = (base["e2e_s"] / (base["prefill_s"] + cell["decode_s"])
                                            * _ratio(cell["new_tokens"], base["new_tokens"]))
    base_by_key = {r["key"]: r for r in base_rows}
    same = 0
    for r in rows:
        b = base_by_key.get(r["key"])
        equal = (b is not None and r["error"] is None and b["error"] is None
                 and list(r["token_ids"]) == list(b["token_ids"]) and r["generation"] == b["generation"])
        same += equal
        if not equal and len(mismatches) < MAX_MISMATCHES:
            mismatches.append({"dataset": r["dataset"], "config": r["config"], "key": r["key"],
                               "error": (r["error"] or (b or {}).get("error")
                                         or (None if b else "no baseline row"))})
    cell["identical_rows"] = same
    cell["identical"] = same == len(rows) == len(base_rows)
    cell["same_score"] = cell["score"] == base["score"]


def build_report(rows: Sequence[Mapping], data: Mapping[str, Sequence[Example]], configs: Sequence[Mapping],
                 lossless: bool = True) -> dict:
    """The report dict. ``configs``: ``{"name", "method", "settings", "baseline"}`` in sweep order;
    ``lossless``: greedy decoding, so every method must give its baseline's tokens (checked)."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        grouped.setdefault((r["dataset"], r["config"]), []).append(dict(r))
    names = [c["name"] for c in configs]
    datasets: dict[str, dict] = {}
    mismatches: list = []
    for ds, examples in data.items():
        cells = {n: _figures(grouped.get((ds, n), []), examples) for n in names}
        for c in configs:
            if c["name"] != c["baseline"] and c["baseline"] in cells:
                _compare(cells[c["name"]], cells[c["baseline"]], grouped.get((ds, c["name"]), []),
                         grouped.get((ds, c["baseline"]), []), mismatches)
        datasets[ds] = cells
    overall = {n: _figures([r for (_, c), rs in grouped.items() if c == n for r in rs], []) for n in names}
    for c in configs:
        o = overall[c["name"]]
        scores = [datasets[ds][c["name"]]["score"] for ds in datasets]
        o["score"] = round(sum(scores) / len(scores), 2) if scores and None not in scores else None
        base = overall.get(c["baseline"])
        if c["name"] != c["baseline"] and base is not None:
            o["decode_speedup"] = _ratio(o["decode_tokens_per_s"], base["decode_tokens_per_s"])
            o["e2e_speedup"] = _ratio(o["tokens_per_s"], base["tokens_per_s"])
    compared = [cell for cells in datasets.values() for n, cell in cells.items() if "identical" in cell]
    check = {"greedy": lossless, "compared_cells": len(compared),
             "all_identical": bool(compared) and all(c["identical"] for c in compared),
             "all_scores_equal": bool(compared) and all(c["same_score"] for c in compared),
             "mismatches": mismatches}
    return {"configs": list(configs), "datasets": datasets, "overall": overall, "lossless": check}


def _fmt(v, digits=2, scale=1.0, suffix=""):
    return "-" if v is None else f"{v * scale:.{digits}f}{suffix}"


def _breakdown(cells: dict) -> str:
    """A LongBench-E dataset's scores by length bucket, or a LongBench v2 file's accuracies, per
    configuration ("" for other datasets)."""
    first = next((c for c in cells.values() if "length_scores" in c or "v2" in c), {})
    if "length_scores" in first:
        counts = first["length_counts"]
        head = ("\nLongBench-E score by length (`eval.py --e`; rows per bucket: "
                + ", ".join(f"{b} {n}" for b, n in counts.items()) + ")\n\n"
                "| configuration | " + " | ".join(LENGTH_BUCKETS) + " |\n"
                + "|---" * (1 + len(LENGTH_BUCKETS)) + "|\n")
        lines = [f"| {n} | " + " | ".join(_fmt(c.get("length_scores", {}).get(b)) for b in LENGTH_BUCKETS)
                 + " |" for n, c in cells.items()]
        return head + "\n".join(lines) + "\n"
    if "v2" in first:
        groups = ("overall", "easy", "hard", "short", "medium", "long")
        counts = first["v2"]["counts"]
        head = ("\nLongBench v2 accuracy (`result.py`; rows: "
                + ", ".join(f"{g} {counts[g]}" for g in groups[1:]) + ")\n\n"
                "| configuration | " + " | ".join(groups) + " | unanswered | no choice found |\n"
                + "|---" * (3 + len(groups)) + "|\n")
        lines = []
        for n, c in cells.items():
            v2 = c.get("v2") or {}
            lines.append(f"| {n} | " + " | ".join(_fmt(v2.get(g), 1) for g in groups)
                         + f" | {v2.get('unanswered', '-')} | {v2.get('no_choice', '-')} |")
        return head + "\n".join(lines) + "\n"
    return ""


def report_markdown(report: dict, title: str = "Evaluation sweep") -> str:
    """The report as markdown: one table per dataset and one overall, then the lossless check."""
    head = ("| configuration | score | rows (errors) | tok/s | decode tok/s | prefill tok/s | prefill share "
            "| MAT | decode step ms | longest step gap s | decode x | end-to-end x | (same prefill) | peak "
            "RSS GiB "
            "| identical to ar |\n" + "|---" * 15 + "|\n")

    def table(cells: dict) -> str:
        lines = []
        for name, c in cells.items():
            ident = "-" if "identical" not in c else ("yes" if c["identical"]
                                                      else f"NO ({c['identical_rows']})")
            lines.append(f"| {name} | {_fmt(c['score'])} | {c['rows']} ({c['errors']}) | "
                         f"{_fmt(c['tokens_per_s'], 1)} | {_fmt(c['decode_tokens_per_s'], 1)} | "
                         f"{_fmt(c['prefill_tokens_per_s'], 0)} | {_fmt(c['prefill_share'], 0, 100, '%')} | "
                         f"{_fmt(c['mat'])} | {_fmt(c['decode_step_s'], 0, 1000)} | "
                         f"{_fmt(c.get('max_step_gap_s'), 1)} | "
                         f"{_fmt(c.get('decode_speedup'), 2, 1, 'x')} | "
                         f"{_fmt(c.get('e2e_speedup'), 2, 1, 'x')} | "
                         f"{_fmt(c.get('e2e_speedup_same_prefill'), 2, 1, 'x')} | "
                         f"{_fmt(c['peak_rss_bytes'], 2, 2**-30)} | "
                         f"{ident} |")
        return head + "\n".join(lines) + "\n"

    parts = [f"# {title}\n"]
    for ds, cells in report["datasets"].items():
        parts.append(f"## {ds}\n\n{table(cells)}{_breakdown(cells)}")
    parts.append(f"## All datasets (score: mean of the datasets' scores)\n\n{table(report['overall'])}")
    check = report["lossless"]
    verdict = ("every lossless configuration gave its `ar` baseline's tokens on every row and the same scores"
               if check["all_identical"] and check["all_scores_equal"] else
               f"MISMATCH: identical text {check['all_identical']}, equal scores "
               f"{check['all_scores_equal']}; "
               f"first rows: {check['mismatches'][:5]}")
    if not check["compared_cells"]:
        verdict = "nothing to compare (no `ar` baseline in the sweep)"
    parts.append(f"## Lossless check (greedy: {check['greedy']})\n\n{verdict}.\n")
    return "\n".join(parts)
