"""The evaluation sweep (jobs/eval.py): grid, report, lossless check, and the whole job on real Ray with a
tiny random model over a LongBench-format directory of short rows, then resumed."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from tiny_models import save_tiny_text_model

from logitspec.evaluation import Example, score_examples, write_dataset
from logitspec.evaluation.sweep_report import build_report
from pipeline.errors import ConfigError
from pipeline.sweep.config import EvalConfig, expand_grid, parse_grid

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- grid
def test_grid_expands_per_method_and_rejects_bad_settings():
    grid = parse_grid(["max_batch_size=1,4", "budget=auto,fixed"])
    names = [c.name for c in expand_grid(["ar", "logitspec"], grid, 1)]
    # budget does not apply to ar: two ar configurations, not four
    assert names == ["ar@max_batch_size=1", "ar@max_batch_size=4",
                     "logitspec@budget=auto@max_batch_size=1", "logitspec@budget=fixed@max_batch_size=1",
                     "logitspec@budget=auto@max_batch_size=4", "logitspec@budget=fixed@max_batch_size=4"]
    configs = expand_grid(["logitspec"], grid, 1)
    assert configs[2].baseline.name == "ar@max_batch_size=4"
    assert configs[2].spec_config(1).max_batch_size == 4
    for bad, message in ((["colour=red"], "KEY one of"), (["max_batch_size=x"], "int values"),
                         (["budget=sometimes"], "budget must be")):
        with pytest.raises(ConfigError, match=message):
            expand_grid(["logitspec"], parse_grid(bad), 1)
    with pytest.raises(ConfigError, match="unknown"):
        EvalConfig(data="d", output="o", methods=("ar", "medusa"))


# ---------------------------------------------------------------------------------------------- report
def _example(name, i, answer):
    return Example(name=name, input="q", context="c", answers=(answer,), all_classes=None, length=10,
                   dataset=name, language="en", id=str(i))


def _row(name, i, config, text, ids, steps, share, prefill):
    return {"key": f"{name}/{i}", "dataset": name, "config": config, "generation": text, "token_ids": ids,
            "n_prompt_tokens": 100, "n_new_tokens": len(ids), "steps": steps, "prefill_s": prefill,
            "run_share_s": share, "peak_rss_bytes": 1 << 30, "error": None}


def test_report_scores_speeds_and_flags_a_lossless_mismatch():
    data = {"hotpotqa": [_example("hotpotqa", 0, "blue sky"), _example("hotpotqa", 1, "red")]}
    configs = [{"name": "ar", "method": "ar", "settings": {}, "baseline": "ar"},
               {"name": "logitspec", "method": "logitspec", "settings": {}, "baseline": "ar"}]
    rows = [_row("hotpotqa", 0, "ar", "blue sky", [1, 2, 3, 4, 5], 5, 2.0, 1.0),
            _row("hotpotqa", 1, "ar", "green", [6, 7, 8, 9, 10], 5, 2.0, 1.0),
            _row("hotpotqa", 0, "logitspec", "blue sky", [1, 2, 3, 4, 5], 2, 1.0, 0.5),
            _row("hotpotqa", 1, "logitspec", "green", [6, 7, 8, 9, 10], 3, 1.0, 0.5)]
    report = build_report(rows, data, configs)
    ar, ls = report["datasets"]["hotpotqa"]["ar"], report["datasets"]["hotpotqa"]["logitspec"]
    assert ar["score"] == 50.0  # F1 1 and 0
    assert ar["mat"] == pytest.approx(8 / 8) and ls["mat"] == pytest.approx(8 / 3)
    assert ar["decode_tokens_per_s"] == pytest.approx(8 / 2.0)  # 2 s of decode, 8 tokens after the first two
    # ar: 4 s end to end, 2 of them prefill; logitspec: 2 s, 1 of them prefill (the load changed)
    assert ls["decode_speedup"] == pytest.approx(2.0) and ls["e2e_speedup"] == pytest.approx(2.0)
    # ar's 2 s of prefill + logitspec's 1 s decode
    assert ls["e2e_speedup_same_prefill"] == pytest.approx(4 / 3)
    assert ls["decode_step_s"] == pytest.approx(1.0 / 3)
    assert ar["prefill_tokens_per_s"] == pytest.approx(100.0)
    assert ar["max_step_gap_s"] is None  # rows written before the column existed
    rows[2]["max_step_gap_s"], rows[3]["max_step_gap_s"] = 0.25, 0.5
    assert build_report(rows, data, configs)["datasets"]["hotpotqa"]["logitspec"]["max_step_gap_s"] == 0.5
    assert ls["identical"] and report["lossless"]["all_identical"] and report["lossless"]["all_scores_equal"]
    rows[3] = _row("hotpotqa", 1, "logitspec", "red", [6, 7, 11], 2, 1.0, 0.5)
    report = build_report(rows, data, configs)
    assert not report["lossless"]["all_identical"] and not report["lossless"]["all_scores_equal"]
    assert report["lossless"]["mismatches"] == [{"dataset": "hotpotqa", "config": "logitspec",
                                                 "key": "hotpotqa/1",
                                                  "error": None}]


# ---------------------------------------------------------------------------------------------- the job
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path, max_positions=192)
    return str(path)


@pytest.fixture(scope="module")
def longbench_dir(tmp_path_factory) -> pathlib.Path:
    """Two datasets x 3 short rows; one lcc row is longer than the tiny model's input (middle truncation)."""
    d = tmp_path_factory.mktemp("longbench")
    text = (REPO / "data" / "sample_corpus").rglob("*.txt")
    words = next(iter(sorted(text))).read_text().split()
    rows = {"lcc": [], "hotpotqa": []}
    for i in range(3):
        ctx = " ".join(words[i * 30:i * 30 + (400 if i == 0 else 40)])
        rows["lcc"].append(Example("lcc", "", ctx, (words[i],), None, 40, "lcc", "python", f"c{i}"))
        rows["hotpotqa"].append(Example("hotpotqa", f"What is {words[i]}?", ctx, (words[i + 1],), None, 40,
                                        "hotpotqa", "en", f"h{i}"))
    for name, examples in rows.items():
        write_dataset(d, name, examples)
    return d


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH",
                                                                                        "").split(
        os.pathsep) if p])
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _sweep(tiny, data, out, methods, **kw):
    from pipeline.sweep.run import run_sweep

    # fixed budget: the tiny model's cost curve would make the auto budget skip drafting
    cfg = EvalConfig(data=str(data), output=str(out), model=tiny, methods=methods, grid=("budget=fixed",),
                     max_new_tokens=24, max_batch_size=2, warmup=False, threads_per_actor=1, log_interval=2.0,
                     **kw)
    events = []
    return run_sweep(cfg, on_event=lambda kind, **k: events.append(kind)), events


def test_sweep_end_to_end_scores_both_methods_checks_lossless_and_resumes(tiny, longbench_dir, ray_session,
                                                                          tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "sweep"
    report, events = _sweep(tiny, longbench_dir, out, ("ar", "logitspec"))
    assert "ready" in events and "batch" in events  # generated through the scheduler's replicas
    table = pq.read_table(out / "rows").to_pylist()
    assert len(table) == 2 * 3 * 2 and all(r["error"] is None for r in table)
    assert any(r["truncated"] for r in table if r["key"] == "lcc/c0")  # the long row was cut to fit
    ls = "logitspec@budget=fixed"
    for ds in ("lcc", "hotpotqa"):
        cells = report["datasets"][ds]
        assert set(cells) == {"ar", ls}
        for name, cell in cells.items():
            mine = sorted((r for r in table if r["dataset"] == ds and r["config"] == name),
                          key=lambda r: r["key"])
            examples = [json.loads(line) for line in (longbench_dir / f"{ds}.jsonl").read_text().splitlines()]
            exs = [Example(ds, e["input"], e["context"], tuple(e["answers"]), None, e["length"], ds,
                           e["language"], e["_id"]) for e in examples]
            # the dataset's metric
            assert cell["score"] == score_examples(exs, [r["generation"] for r in mine])
            assert cell["rows"] == 3 and cell["errors"] == 0 and cell["tokens_per_s"] > 0
            assert cell["peak_rss_bytes"] > 0 and cell["mat"] >= 1 and cell["max_step_gap_s"] > 0
        # one shared prefix cache: ar (the first configuration) prefilled the rows, logitspec reused them
        assert cells["ar"]["prefill_tokens_per_s"] > 0
        cached = {c: sum(r["cached_prompt_tokens"] for r in table if r["dataset"] == ds and r["config"] == c)
                  for c in ("ar", ls)}
        prompt = sum(r["n_prompt_tokens"] for r in table if r["dataset"] == ds and r["config"] == ls)
        assert cached["ar"] == 0 and cached[ls] > 0.5 * prompt, (cached, prompt)
        assert cells[ls]["identical"] and cells[ls]["same_score"] and cells[ls]["decode_speedup"] > 0
        assert cells[ls]["mat"] > 1  # the drafts were verified, some accepted
    assert report["lossless"]["all_identical"] and report["lossless"]["all_scores_equal"]
    md = (out / "report.md").read_text()
    assert "every lossless configuration gave its `ar` baseline's tokens" in md and "## lcc" in md
    assert (out / "report.png").stat().st_size > 1000
    parts = sorted(p.name for p in (out / "rows").glob("part-*.parquet"))

    again, events = _sweep(tiny, longbench_dir, out, ("ar", "logitspec"))
    assert events == [] and again["run"]["pairs_generated_now"] == 0  # nothing recomputed, no replica started
    assert sorted(p.name for p in (out / "rows").glob("part-*.parquet")) == parts
    assert again["datasets"] == report["datasets"]

    more, _ = _sweep(tiny, longbench_dir, out, ("ar", "pld", "logitspec"))
    assert more["run"]["pairs_generated_now"] == 6  # only the new method's rows
    assert more["datasets"]["lcc"]["pld"]["identical"] and more["lossless"]["all_identical"]


def test_cli_refuses_bad_data_before_ray(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, str(REPO / "jobs" / "eval.py"), "--data", str(tmp_path / "none"),
                          "--output", str(tmp_path / "o")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert res.returncode == 2 and "does not exist" in res.stderr
