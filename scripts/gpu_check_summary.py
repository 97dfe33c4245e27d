"""``summary.json`` of the device check (scripts/gpu_check.py; docs/gpu.md, "The device check"): what
passed, per-part times and errors, and the step figures from the parts' JSON files. Written after
every part, so a check stopped by its time limit still leaves the summary of what it finished."""
from __future__ import annotations

import json
import pathlib
import time

# every part whose file the summary reads
READS = ("lossless", "device_paths", "graph_lossless", "hf_graph", "ar_steps", "prefill_8k", "graph_timing",
         "compiled_timing", "replay")
# the summary's figures, always present (None: not measured in this run)
SUMMARY_KEYS = ("ar_ms_b1", "ar_ms_b32", "hf_graph_ms_b1", "tree16_x_b1", "tree16_x_b8", "tree8_x_b32",
                "tree4_x_b64", "prefill_8k_s", "sampled_x_greedy_b1", "sampled_x_greedy_b32",
                "lossless_equal", "lossless_total", "replay")
# the replayed-acceptance part writes replay.json with a "replay" entry (per trace set and method@rows: ms
# per token, speed-up over ar, MAT); a run without it says why
REPLAY_PENDING = "the replay part did not run or wrote nothing (see parts.replay)"
CUDA_ONLY = ("kernels_per_step", "graph_host_waits_per_step", "kernels_per_step_compiled")  # the profiler's


def read_parts(out: pathlib.Path) -> dict:
    """Each part's JSON document in ``out`` (None where the part wrote none)."""
    return {n: json.loads((out / f"{n}.json").read_text()) if (out / f"{n}.json").exists() else None
            for n in READS}


def _ar_ms(ar: dict | None, mode: str, rows: int):
    return ((ar or {}).get(mode) or {}).get(str(rows), {}).get("ms")


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def step_figures(read: dict) -> dict:
    """The step figures: our ``ar`` step (ms, greedy) at 1 and 32 rows and sampled over greedy, the
    HF static-cache graph step, tree steps over one node per row (same rows), the 8k-token prefill
    (the engine's way), graph-mode lossless counts, the replay, captures on repeated shapes and the
    graph runner's host waits per step."""
    ar, hf, timing = read["ar_steps"], read["hf_graph"], read["graph_timing"]
    goals = (timing or {}).get("goals", {})
    cases = [c for c in (read["graph_lossless"] or {}).get("cases", []) if not c.get("skipped")]
    keys = {"ar_ms_b1": _ar_ms(ar, "greedy", 1), "ar_ms_b32": _ar_ms(ar, "greedy", 32),
            "hf_graph_ms_b1": (hf or {}).get("ms", {}).get("1"),
            "hf_graph_ms_b32": (hf or {}).get("ms", {}).get("32"),
            **{k: goals.get(k) for k in ("tree16_x_b1", "tree16_x_b8", "tree8_x_b32", "tree4_x_b64")},
            "prefill_8k_s": (read["prefill_8k"] or {}).get("engine_s"),
            "sampled_x_greedy_b1": _ratio(_ar_ms(ar, "sampled", 1), _ar_ms(ar, "greedy", 1)),
            "sampled_x_greedy_b32": _ratio(_ar_ms(ar, "sampled", 32), _ar_ms(ar, "greedy", 32)),
            "lossless_equal": sum(c["equal"] for c in cases) if read["graph_lossless"] else None,
            "lossless_total": sum(c["of"] for c in cases) if read["graph_lossless"] else None,
            "replay": (read["replay"] or {}).get("replay"),
            "replay_note": None if read["replay"] else REPLAY_PENDING}
    timed = [c for mode in ("greedy", "sampled") for c in ((ar or {}).get(mode) or {}).values()
             if "error" not in c]  # a case that raised has no figures
    attentions = {**((timing or {}).get("attention") or {}),
                  **((read["compiled_timing"] or {}).get("attention") or {})}
    repeats = [a[k]["captures"] for a in attentions.values() for k in ("repeat", "timed") if k in a]
    counted = [c["timed_run"]["captures"] for c in timed] + repeats
    keys["captures_after_start"] = sum(counted) if counted else None
    waits = [c["host_waits"]["per_step"] for c in timed if "host_waits" in c]
    keys["graph_host_waits_per_step"] = max(waits) if waits else None
    kernels = {a: got.get("kernels_per_step") for a, got in attentions.items()}
    keys["kernels_per_step"] = kernels.get("flex") or kernels.get("sdpa")
    keys["attention"] = "flex" if kernels.get("flex") else ("sdpa" if attentions else None)
    compiled = next((a for label, a in attentions.items() if label.endswith("_compiled")), {})
    keys["kernels_per_step_compiled"] = compiled.get("kernels_per_step")
    keys["compiled_ms_b1"] = (compiled.get("ms") or {}).get("1x1")
    keys["compiled_ms_b32"] = (compiled.get("ms") or {}).get("32x1")
    variant = (ar or {}).get("variant") or {}
    keys["ar_variant"] = {"attention": variant.get("attention"), "ms_b1": _ar_ms(variant, "greedy", 1),
                          "ms_b32": _ar_ms(variant, "greedy", 32)} if variant else None
    keys["runs"] = figure_runs(read)
    return keys


def how_it_ran(kind: str | None, counters: dict | None) -> dict | None:
    """What a figure's steps were, from its runner's kind and counters: captured in CUDA graphs,
    compiled, and how many steps fell back (built uncaptured, compiled steps not used, flex
    attention buckets that attend with SDPA)."""
    if kind is None:
        return None
    c = counters or {}
    return {"runner": kind, "captured": ":cuda-graphs" in kind, "compiled": ":compiled" in kind,
            "fell_back": {k: c.get(k, 0) for k in ("uncaptured", "uncompiled", "flex_fallbacks")}}


def figure_runs(read: dict) -> dict:
    """Per summary figure, how its steps ran (:func:`how_it_ran`; None where the figure's part did
    not run)."""
    ar, timing, compiled = read["ar_steps"] or {}, read["graph_timing"] or {}, read["compiled_timing"] or {}
    first = (timing.get("attention") or {}).get(timing.get("engine_attention")) or {}
    comp = next(iter((compiled.get("attention") or {}).values()), {})
    ar_run = how_it_ran(ar.get("runner"), ar.get("counters"))
    tree_run = how_it_ran(first.get("runner"), first.get("counters"))
    hf = read["hf_graph"]
    return {**{k: ar_run for k in ("ar_ms_b1", "ar_ms_b32", "sampled_x_greedy_b1", "sampled_x_greedy_b32")},
            **{k: tree_run for k in ("tree16_x_b1", "tree16_x_b8", "tree8_x_b32", "tree4_x_b64")},
            **{k: how_it_ran(comp.get("runner"), comp.get("counters"))
               for k in ("compiled_ms_b1", "compiled_ms_b32")},
            "hf_graph_ms_b1": {"runner": "HF forward over a StaticCache", "captured": hf.get("captured")}
            if hf else None,
            "prefill_8k_s": {"runner": "eager prefill (causal chunks), copied into a slot", "captured": False}
            if read["prefill_8k"] else None}


def case_errors(read: dict) -> dict:
    """The errors of the cases behind the summary's figures that raised ({figure: error})."""
    ar, out = read["ar_steps"] or {}, {}
    for key, mode, rows in (("ar_ms_b1", "greedy", 1), ("ar_ms_b32", "greedy", 32),
                            ("sampled_x_greedy_b1", "sampled", 1), ("sampled_x_greedy_b32", "sampled", 32)):
        error = ((ar.get(mode) or {}).get(str(rows)) or {}).get("error")
        if error:
            out[key] = error
    prefill = read["prefill_8k"] or {}
    if prefill.get("engine_s_error"):
        out["prefill_8k_s"] = prefill["engine_s_error"]
    return out


def null_reasons(summary: dict) -> dict:
    """Why each figure of the summary is None: the part that makes it did not run, failed, or skipped
    it (the figure's reason beside it, ``nulls``)."""
    made_by = {"ar_ms_b1": "ar_steps", "ar_ms_b32": "ar_steps", "hf_graph_ms_b1": "hf_graph",
               "prefill_8k_s": "prefill_8k", "sampled_x_greedy_b1": "ar_steps",
               "sampled_x_greedy_b32": "ar_steps", "lossless_equal": "graph_lossless",
               "lossless_total": "graph_lossless", "replay": "replay", "captures_after_start": "graph_timing",
               "kernels_per_step": "graph_timing", "graph_host_waits_per_step": "ar_steps",
               **{k: "compiled_timing" for k in ("kernels_per_step_compiled", "compiled_ms_b1",
                                                 "compiled_ms_b32")},
               **{k: "graph_timing" for k in ("tree16_x_b1", "tree16_x_b8", "tree8_x_b32", "tree4_x_b64")}}
    parts, out = summary.get("parts", {}), {}
    cuda = str((summary.get("environment") or {}).get("device", "")).startswith("cuda")
    for key, part in made_by.items():
        if summary.get(key) is not None:
            continue
        got = parts.get(part)
        if got is None:
            out[key] = f"the {part} part did not run (--parts)"
        elif got.get("error"):
            out[key] = f"the {part} part failed: {str(got['error'])[:200]}"
        elif key in CUDA_ONLY and not cuda:
            out[key] = "counted on CUDA only"
        elif summary.get("case_errors", {}).get(key):
            out[key] = f"its case failed: {summary['case_errors'][key]}"
        else:
            out[key] = f"the {part} part ran out of time or skipped it (its JSON lists what it skipped)"
    return out


def write(summary: dict, out: pathlib.Path, start: float) -> dict:
    """Fill ``summary`` (environment and per-part outcomes already in it) from the parts' files and
    write ``summary.json``; the summary."""
    read = read_parts(out)
    lossless, paths = read["lossless"], read["device_paths"]
    graph = {}  # graph mode: lossless, and the graph runner's step goals per attention
    if read["graph_lossless"] is not None:
        cases = read["graph_lossless"]["cases"]
        graph.update(lossless_ok=read["graph_lossless"]["ok"], lossless_equal=sum(c["equal"] for c in cases),
                     lossless_total=sum(c["of"] for c in cases),
                     lossless_skipped=sum(bool(c.get("skipped")) for c in cases))
    for part in ("graph_timing", "compiled_timing"):  # SDPA's goals, then each variant's by its label
        doc = read[part] or {}
        graph.update(doc.get("goals") or {})
        graph.update({k.removeprefix("goals_"): v for k, v in doc.items() if k.startswith("goals_")})
    summary["graph"] = graph or None
    summary.update(step_figures(read))
    summary["case_errors"] = case_errors(read)
    cases = lossless["cases"] if lossless else []
    ran = summary["parts"]  # a part not asked for (--parts) is neither passed nor failed: None
    summary["lossless_ok"] = (bool(cases) and all(c["ok"] for c in cases)) if "lossless" in ran else None
    summary["sampling_ok"] = (bool(paths) and paths["sampling"]["ok"]) if "device_paths" in ran else None
    summary["host_waits_per_step"] = paths["host_waits"].get("waits_per_step") if paths else None
    summary["failed_cases"] = [{k: c[k] for k in ("family", "dtype", "method", "batch", "budget")}
                               for c in cases if not c["ok"]]
    summary["part_errors"] = [k for k, v in summary["parts"].items() if v["error"]]
    summary["nulls"] = null_reasons(summary)
    summary["wall_s"] = round(time.time() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def summarise(summary: dict, out: pathlib.Path, start: float) -> int:
    """The final ``summary.json`` and a line of it on stdout; the exit status (0: every lossless case
    passed, eager and graph, and no part failed)."""
    summary = write(summary, out, start)
    keys = ("lossless_ok", "sampling_ok", "host_waits_per_step", "failed_cases", "part_errors", "wall_s",
            *SUMMARY_KEYS[:-1], "captures_after_start", "graph_host_waits_per_step", "kernels_per_step",
            "attention", "compiled_ms_b1", "compiled_ms_b32", "kernels_per_step_compiled", "ar_variant",
            "nulls")
    print(json.dumps({k: summary[k] for k in keys}), flush=True)
    graph_ok = (summary["graph"] or {}).get("lossless_ok", "graph_lossless" not in summary["parts"])
    passed = all(v is not False for v in (summary["lossless_ok"], summary["sampling_ok"], graph_ok))
    return 0 if passed and not summary["part_errors"] else 1
