"""A bench output directory: ``results.jsonl`` (one record per method x question x turn, written a
unit at a time), ``summary.json``, ``report.md`` and the plots; resuming and re-rendering from it."""
from __future__ import annotations

import json
import pathlib

from . import report
from .methods import REFERENCE
from .questions import task_order

# settings an older summary may lack: the values it ran with
DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "sampling_top_k": 0, "num_samples": 1, "seed": 0}


def write_outputs(summary: dict, out_dir) -> None:
    """Plots, ``summary.json`` and ``report.md`` from a summary (re-runnable on an old summary)."""
    out = pathlib.Path(out_dir)
    summary["plots"] = ["speedup.png", "accept_hist.png"]
    report.plot_speedup(summary, out / "speedup.png")
    report.plot_accept_hist(summary, out / "accept_hist.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report.render_report(summary), encoding="utf-8")


def rerender(out_dir) -> dict:
    """Recompute the summary, report and plots of ``out_dir`` from its ``results.jsonl`` (e.g. after a
    change to the report, or while a run is going or after it died: units are written whole, so the
    records always hold complete units). Metadata come from its ``summary.json`` when there is one."""
    out = pathlib.Path(out_dir)
    path = out / "results.jsonl"
    if not path.is_file():
        raise ValueError(f"no results.jsonl in {out}")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records yet")
    meta = out / "summary.json"
    summary = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {"reference": REFERENCE}
    ref = summary.get("reference", REFERENCE)
    names = (summary.get("settings") or {}).get("methods") or list(dict.fromkeys(r["method"]
                                                                                 for r in records))
    done = [r for r in records if r["method"] == ref and r.get("sample", 0) == 0]  # one per question-turn
    counts: dict[str, int] = {}
    for r in done:
        counts[r["task"]] = counts.get(r["task"], 0) + 1
    expected = summary.get("question_turns_per_task")
    if summary.get("finished") is None or (expected and expected != counts):
        summary["partial"] = (f"{len(done)} of {sum(expected.values()) if expected else '?'} question-turns "
                              f"done (re-rendered from results.jsonl)")
    summary["question_turns_per_task"] = counts
    summary["tasks"] = task_order(counts)
    summary["questions"] = len({r["question_id"] for r in done})
    present = [n for n in names if any(r["method"] == n for r in records)]
    summary["methods"] = report.summarize(records, ref, present)
    write_outputs(summary, out)
    return summary


def resumable(out: pathlib.Path, summary: dict, names: list[str]) -> dict:
    """``{(question_id, turn): {method: [record per sample]}}`` of the complete question-turns in
    ``out``'s results."""
    path = out / "results.jsonl"
    if not path.is_file():
        return {}
    meta = out / "summary.json"
    if meta.is_file():
        old = json.loads(meta.read_text(encoding="utf-8")).get("settings", {})
        for key in ("methods", "max_new_tokens", "max_batch_size", "capacity", "top_k", "temperature",
                    "top_p", "sampling_top_k", "num_samples", "seed"):
            if old.get(key, DEFAULTS.get(key)) != summary["settings"].get(key, DEFAULTS.get(key)):
                raise ValueError(f"cannot resume {out}: its {key} was {old[key]!r}, now "
                                 f"{summary['settings'][key]!r}")
    by_key: dict = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run died
        by_key.setdefault((r["question_id"], r.get("turn", 0)), {}).setdefault(r["method"],
                                                                               {})[r.get("sample", 0)] = r
    n = summary["settings"].get("num_samples", 1)
    return {k: {m: [rs[j] for j in range(n)] for m, rs in v.items()} for k, v in by_key.items()
            if all(len(v.get(m, ())) == n for m in names)}
