"""The prepared device check (scripts/gpu_check.sh) runs on CPU at tiny sizes and writes the JSON the
GPU run will write; importing the engine pulls in neither Ray nor DeepSpeed (the GPU machine has neither)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from logitspec.spec_decode.budget import CostCurve

ROWS, NODES = (1, 8, 32, 64), (1, 4, 8, 16)  # the tiny plan's: the 8B shape's rows, nodes up to 16
sys.path.insert(0, str(REPO / "scripts"))  # the check's modules (gpu_check, gpu_check_summary)


def test_importing_the_engine_needs_no_ray_or_deepspeed():
    code = ("import sys, logitspec, logitspec.engine.engine, logitspec.worker.calibrate, "
            "logitspec.worker.eager_runner; "
            "print(sorted(m for m in ('ray', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(1400)  # the check's own limits (run timeout 1300 s) rule, not the suite's 900 s
def test_gpu_check_on_cpu_writes_its_json(tmp_path):
    # the script's own 450 s limit is sized for the H200; a shared 2-core CI box runs the CPU form slower
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1", "GPU_CHECK_TIMEOUT": "1200"}
    # every part in this one process (the CPU default; a process per part, as on a GPU:
    # test_a_part_that_fails_in_its_process_is_recorded_and_the_others_still_run)
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path), "--tiny",
                          "--device", "cpu", "--budget-s", "1000", "--parts", "all"],
                         cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lossless_ok"] and summary["sampling_ok"] and summary["failed_cases"] == []
    assert all(p["error"] is None for p in summary["parts"].values()), summary["parts"]
    assert summary["environment"]["ray_or_deepspeed_imported"] == []
    assert (tmp_path / "log.txt").is_file()

    cases = json.loads((tmp_path / "lossless.json").read_text())["cases"]
    seen = {(c["family"], c["dtype"], c["method"], c["batch"], c["budget"]) for c in cases}
    for family in ("llama", "qwen2", "gemma3"):
        for dtype in ("float32", "bfloat16"):
            for method in ("ar", "pld", "logitspec"):
                assert {(family, dtype, method, 1, "fixed"), (family, dtype, method, 2, "fixed")} <= seen
            assert (family, dtype, "logitspec", 2, "auto") in seen
    assert all(c["equal"] + len(c["partings"]) == c["of"] for c in cases)
    assert all("vs_generate" in c for c in cases if c["dtype"] == "bfloat16")

    # the graph runner's CPU form; its time budget may skip cases and points on a loaded box (recorded)
    graph = json.loads((tmp_path / "graph_lossless.json").read_text())
    ran = [c for c in graph["cases"] if not c.get("skipped")]
    assert graph["ok"] and summary["graph"]["lossless_ok"]
    assert {c["family"] for c in graph["cases"]} == {"llama", "qwen2", "gemma3"}
    assert all(c["equal"] == c["of"] == 3 and c["counters"]["replays"] > 0 for c in ran)
    sdpa = json.loads((tmp_path / "graph_timing.json").read_text())["attention"]["sdpa"]
    points = set(sdpa["ms"]) | {f"{b}x{n}" for b, n in sdpa["skipped"]}
    assert points == {f"{b}x{n}" for b in ROWS for n in NODES}
    _check_graph_parts(tmp_path, summary, sdpa["skipped"])
    assert sdpa["repeat"] == {"graphs": 0, "captures": 0, "allocations": 0, "compiles": 0,
                              "cuda_allocations_per_step": None}
    timing = json.loads((tmp_path / "graph_timing.json").read_text())["attention"]
    assert set(timing) == {"sdpa", "sdpa_math"} and "sdpa=math" in timing["sdpa_math"]["runner"]
    compiled = json.loads((tmp_path / "compiled_timing.json").read_text())["attention"]["sdpa_compiled"]
    if compiled["ms"]:  # each bucket compiled when built, then replayed: no compile on the repeat
        assert compiled["timed"]["compiles"] == compiled["repeat"]["compiles"] == 0
        assert compiled["counters"]["compiles"] >= len(compiled["first_call_s"])
        assert compiled["counters"]["uncompiled"] == 0 and summary["compiled_ms_b1"] > 0

    paths = json.loads((tmp_path / "device_paths.json").read_text())
    assert paths["sampling"]["ok"] and paths["host_waits"]["measured"] is False  # CUDA only

    for shape in ("llama3-8b", "qwen2.5-7b"):
        doc = json.loads((tmp_path / f"curve_{shape}.json").read_text())
        assert {int(b) for b in doc["rows"]} == set(ROWS) and doc["skipped_rows"] == []
        for r in doc["rows"].values():
            assert r["nodes_per_row"] == list(NODES) and len(r["ms"]) == 4 and r["x_plain"][0] == 1.0
        curve = CostCurve(**doc["cost_curve"])
        assert sorted(curve.batches) == [8, 32, 64] and curve.step(8, 4) > 0
        assert all({"acceptance", "mat", "tokens_per_row", "1", "64"} <= set(p) for p in doc["prediction"])
        assert any("forward" in line for line in doc["host_profile_ar@1"])  # the host's time by function
        steps = doc["engine_steps"]
        assert sorted(steps) == ["ar@1", "ar@64", "logitspec@1", "logitspec@64"]
        assert all(v["ms_per_step"] > 0
                   and set(v["split_ms"]) == {"draft", "pack", "forward", "verify", "commit"}
                   for v in steps.values())


def _check_graph_parts(out, summary, timing_skipped):
    """The decode-step parts ran in their CPU form, and the summary has every key the check promises
    with a value (CPU timings of the tiny stand-in), but for what the time budget skipped."""
    from gpu_check_summary import SUMMARY_KEYS

    assert set(SUMMARY_KEYS) <= set(summary)
    replay = json.loads((out / "replay.json").read_text())
    drafting = ["logitspec", "lookahead", "pld", "rest"]  # the methods of docs/results/traces
    assert replay["label"] == "replayed acceptance" and replay["methods"] == ["ar", *drafting]
    rows = {1, 8} - set(replay["skipped"])
    assert 1 in rows and summary["replay"] == replay["replay"] and summary["replay_note"] is None
    assert set(replay["replay"]) == {"gemma3-270m/spec_bench", "gemma3-270m/longbench"}  # docs/results/traces
    for name, got in replay["replay"].items():
        recorded = replay["traces"][name]["recorded"]
        assert set(got) == {f"{m}@{b}" for m in replay["methods"] for b in rows}
        for b in rows:
            assert got[f"ar@{b}"]["x_ar"] == 1.0 and got[f"ar@{b}"]["mat"] == 1.0
            assert all(got[f"{m}@{b}"]["x_ar"] > 0 for m in drafting)
        for m in drafting:  # at 1 row every recorded sequence once: the recorded MAT exactly
            assert abs(got[f"{m}@1"]["mat"] - recorded[m]["mat"]) < 1e-3
    hf = json.loads((out / "hf_graph.json").read_text())
    assert hf["captured"] is False and set(hf["ms"]) == {"1", "32"} and summary["hf_graph_ms_b1"] > 0
    ar = json.loads((out / "ar_steps.json").read_text())
    ran = {(b, mode) for mode in ("greedy", "sampled") for b in ar[mode]}
    assert ran | {(str(b), mode) for b, mode in ar["skipped"]} == {(str(b), m) for b in ROWS
                                                                    for m in ("greedy", "sampled")}
    for mode in ("greedy", "sampled"):
        for case in ar[mode].values():
            assert case["ms"] > 0 and case["steady_steps"] >= 3 and "host_waits" not in case  # CUDA only
            assert case["timed_run"]["graphs"] == case["timed_run"]["allocations"] == 0  # shapes seen before
            assert case["timed_run"]["replays"] > 0
    # the engine's own runner (SDPA off CUDA), then the other attention as the variant; every figure
    # says how its steps ran (uncaptured on CPU, nothing fell back)
    assert ar["attention"] == "sdpa" and ar["variant"]["attention"] == "flex" and "graph:sdpa" in ar["runner"]
    assert summary["ar_variant"]["attention"] == "flex"
    runs = summary["runs"]
    assert runs["ar_ms_b1"]["runner"] == ar["runner"] and runs["ar_ms_b1"]["captured"] is False
    assert runs["ar_ms_b1"]["fell_back"] == {"uncaptured": 0, "uncompiled": 0, "flex_fallbacks": 0}
    assert runs["tree16_x_b1"]["runner"].startswith("graph:sdpa")
    assert runs["hf_graph_ms_b1"]["captured"] is False
    prefill = json.loads((out / "prefill_8k.json").read_text())
    assert prefill["tokens"] == 256
    assert min(prefill[k] for k in ("engine_s", "slot_chunked_s", "slot_whole_s")) > 0
    assert summary["prefill_8k_s"] == prefill["engine_s"]
    assert summary["lossless_equal"] == summary["lossless_total"] > 0
    assert summary["captures_after_start"] == 0
    assert summary["graph_host_waits_per_step"] is None  # counted on CUDA only
    assert summary["nulls"]["kernels_per_step"] == "counted on CUDA only"
    assert set(summary["nulls"]) <= {"kernels_per_step", "graph_host_waits_per_step", "replay",
                                     "kernels_per_step_compiled", "compiled_ms_b32"}
    if not ar["skipped"]:
        assert all(summary[k] > 0 for k in ("ar_ms_b1", "ar_ms_b32", "sampled_x_greedy_b1",
                                            "sampled_x_greedy_b32"))
    if not timing_skipped:
        assert all(summary[k] > 0 for k in ("tree16_x_b1", "tree16_x_b8", "tree8_x_b32", "tree4_x_b64"))


def test_the_default_parts_are_the_graph_runners_by_worth_and_all_adds_the_eager_ones():
    import gpu_check

    plan = gpu_check.plan_for(gpu_check.argparse.Namespace(tiny=True, device="cpu"))
    assert gpu_check.part_names(plan) == ["graph_lossless", "ar_steps", "graph_timing", "replay",
                                          "prefill_8k", "hf_graph", "compiled_timing"]
    assert gpu_check.part_names(plan, "lossless,ar_steps") == ["lossless", "ar_steps"]
    assert {"lossless", "device_paths", "curve_llama3-8b", "curve_qwen2.5-7b", "ar_steps"} <= set(
        gpu_check.part_names(plan, "all"))


def test_a_part_that_fails_in_its_process_is_recorded_and_the_others_still_run(tmp_path):
    """Off CPU each part runs in its own process (a CUDA fault is sticky; ``--isolate`` here): each
    leaves its outcome in a part file gathered into the summary (none left over); one part asks for a
    shape that does not exist: it is recorded with its error, the part after it still runs, exit 1."""
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path),
                          "--tiny", "--device", "cpu", "--isolate", "--parts",
                          "curve_no-such-shape,device_paths"],
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 1
    assert not list(tmp_path.glob("*.part.json"))
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert "no-such-shape" in parts["curve_no-such-shape"]["error"] and parts["device_paths"]["error"] is None
    assert json.loads((tmp_path / "device_paths.json").read_text())["sampling"]["ok"]


def test_a_figure_whose_case_raised_is_null_with_its_error(tmp_path):
    """A case that raises is recorded in its part's JSON and the summary's figure is null with that
    error as its reason; the figures of the part's other cases stay."""
    import gpu_check_summary

    ar = {"attention": "flex", "runner": "graph:flex:cuda-graphs:flex_block=128",
          "counters": {"uncaptured": 0, "uncompiled": 0, "flex_fallbacks": 1},
          "greedy": {"1": {"ms": 6.5, "timed_run": {"captures": 0}},
                     "32": {"error": "RuntimeError: no kernel"}},
          "sampled": {}, "skipped": []}
    (tmp_path / "ar_steps.json").write_text(json.dumps(ar))
    ran = {"environment": {"device": "cuda"}, "parts": {"ar_steps": {"error": None}}}
    summary = gpu_check_summary.write(ran, tmp_path, 0.0)
    assert summary["ar_ms_b1"] == 6.5 and summary["ar_ms_b32"] is None
    assert summary["nulls"]["ar_ms_b32"] == "its case failed: RuntimeError: no kernel"
    assert summary["runs"]["ar_ms_b1"] == {"runner": ar["runner"], "captured": True, "compiled": False,
                                           "fell_back": ar["counters"]}
