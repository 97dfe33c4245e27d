"""The run report of a generation job's output directory (pipeline/job/report/), on hand-made output."""
from __future__ import annotations

import importlib
import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.job.report import (
    PLOTS,
    PLOTS_DIR,
    REPORT_FILE,
    break_even_acceptance,
    budget_sentence,
    main,
    pct,
    sig,
    write_report,
)

ORIGINS = ("context", "siblings", "reference", "history", "guess")


def schema(extra=()) -> pa.Schema:
    """The job's row schema (pipeline.rows.OutputRow.schema, int ids) plus ``extra`` fields."""
    return pa.schema([
        ("id", pa.int64()), ("sample", pa.int32()), ("generation", pa.string()),
        ("finish_reason", pa.string()),
        ("n_prompt_tokens", pa.int32()), ("n_new_tokens", pa.int32()), ("steps", pa.int32()),
        ("mean_accepted", pa.float64()), ("accepted_lengths", pa.list_(pa.int32())),
        ("retrieval_success", pa.float64()), ("wall_s", pa.float64()), ("method", pa.string()),
        ("model", pa.string()), ("error", pa.string()), ("corpus", pa.string()),
        ("accepted_from", pa.struct([(n, pa.int32()) for n in ORIGINS])), *extra])


def row(i, lengths, origins=None, replica=None, finished_at=None, retrieval=0.5, error=None):
    ok = error is None
    r = {"id": i, "sample": 0, "n_prompt_tokens": 5, "method": "logitspec", "model": "default",
         "error": error, "corpus": None}
    if ok:
        r.update(generation="text", finish_reason="length", n_new_tokens=sum(lengths), steps=len(lengths),
                 mean_accepted=sum(lengths) / len(lengths), accepted_lengths=lengths,
                 retrieval_success=retrieval, wall_s=1.0,
                 accepted_from={**dict.fromkeys(ORIGINS, 0), **(origins or {})})
    if finished_at is not None:
        r["replica"], r["finished_at"] = replica, finished_at
    return r


# 4 generated rows (48 tokens in 36 forwards: MAT 1.33; 12 accepted draft tokens) and one error row
ROWS = [
    row(0, [1, 1, 2, 1, 1, 2, 1, 1], {"context": 2}, "replica-0", 1000.0),
    row(1, [1, 3, 2, 2, 2, 2, 2, 2, 2, 2], {"context": 6, "reference": 4}, "replica-0", 1002.0),
    row(2, [1] * 12, None, "replica-1", 1001.0, retrieval=0.0),
    row(3, [1] * 6, None, "replica-1", 1003.0, retrieval=0.0),
    row(4, None, replica=None, finished_at=1003.5,
        error="ValueError: prompt of 9000 tokens does not fit the model's context of 8192"),
]


def write_output(path, rows, extra=(), summary=True):
    path.mkdir(parents=True, exist_ok=True)
    s = schema(extra)
    pq.write_table(pa.Table.from_pylist(rows[:2], schema=s), path / "part-aaaa.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:], schema=s), path / "part-bbbb.parquet")
    job = {"model": "default", "method": "logitspec", "max_new_tokens": 16}
    (path / "_job.json").write_text(json.dumps(job))
    if summary:
        (path / "_summary.json").write_text(json.dumps({
            "complete": True, "rows": {"total": 5, "num_samples": 1, "missing": 0},
            "tokens": {"per_s": 12.0423, "in_output": 48}, "timing": {"generation_s": 4.0, "total_s": 31.234},
            "engine": {"mean_active": 2.0},
            "config": {"gen": {"method": "logitspec", "budget": "auto", "max_batch_size": 4}},
            "replicas": {"startup": [{"name": "replica-0", "device": "cpu", "threads": 1, "ready_s": 20.5},
                                     {"name": "replica-1", "device": "cpu", "threads": 1, "ready_s": 21.0}]},
            "model_path": "/cache/models/gemma3-270m", "error": None}))
    return path


def _plots_ok(out):
    for name in PLOTS.values():
        data = (out / PLOTS_DIR / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name


def test_report_counts_mat_replicas_and_plots(tmp_path):
    extra = [("replica", pa.string()), ("finished_at", pa.float64())]
    out = write_output(tmp_path / "out", ROWS, extra=extra)
    path = write_report(out)
    assert path == out / REPORT_FILE
    md = path.read_text()
    assert "| model | default (gemma3-270m) |" in md
    assert "| rows | 5 (4 generated, 1 error rows); 5 of 5 input keys done |" in md
    assert "| samples | 1 per input row |" in md
    assert "| wall time | 4.00 s generating, 31.2 s in all |" in md
    assert "| tokens/s | 12.0 (" in md
    assert "| new tokens | 48 |" in md
    assert "| MAT | 1.33 new tokens per target forward |" in md
    # step-weighted: rows 0 and 1 (7 + 9 decode steps) at 0.5, rows 2 and 3 (11 + 5) at 0
    assert "| retrieval success | 25% of decoding steps found a draft |" in md
    assert "| errors | 1 |" in md
    assert "prompt of 9000 tokens does not fit" in md and "(1 row(s))" in md
    # 11 of the 32 decode steps accepted drafts (2 in row 0, 9 in row 1)
    assert ("**What the budget did:** drafts accepted on 34.4% of steps (MAT 1.33; retrieval found a draft "
            "on 25% of steps), at batch 2 on this CPU") in md
    assert "| context | 8 | 16.7% |" in md and "| reference | 4 | 8.33% |" in md
    assert "| one per target forward | 36 | 75% |" in md
    assert "| replica-0 | 2 | 0 | 30 |" in md and "| replica-1 | 2 | 0 | 18 |" in md
    assert "| (none) | 1 | 1 | 0 | - | - |" in md  # the error row no replica made
    assert "Tokens/s over time, in 1.00 s bins" in md and "no finish time" not in md
    assert "`verified_steps`" in md and "`engine.break_even`" in md  # named as missing
    for name in PLOTS.values():
        assert f"]({PLOTS_DIR}/{name})" in md
    _plots_ok(out)
    # the report's files start with "_": Parquet readers of the directory still read just the rows
    assert ds.dataset(out, format="parquet").to_table().num_rows == 5
    assert not list(out.glob(".*.tmp")) and not list((out / PLOTS_DIR).glob(".*.tmp"))


def test_report_without_times_replicas_or_summary(tmp_path):
    out = write_output(tmp_path / "out", [{k: v for k, v in r.items() if k not in ("replica", "finished_at")}
                                          for r in ROWS], summary=False)
    md = write_report(out).read_text()
    assert "no finish time" in md and "cumulative new tokens by row order" in md
    assert "| wall time | not recorded (no `_summary.json`) |" in md
    assert "| MAT | 1.33 new tokens per target forward |" in md
    assert "no `replica` column" in md
    assert "- `finished_at` per row" in md and "- `replica` (string" in md
    _plots_ok(out)
    assert write_report(out) == out / REPORT_FILE  # rewritten in place


def test_report_when_budget_decoded_plainly(tmp_path):
    rows = [row(i, [1] * 9, None, retrieval=0.125) for i in range(4)]
    out = write_output(tmp_path / "out", rows)
    md = write_report(out).read_text()
    assert ("**What the budget did:** decoded plainly: drafts accepted on 0 of 32 steps "
            "(MAT 1.00; retrieval found a draft on 12.5% of steps), at batch 2 on this CPU") in md
    assert "No draft token was accepted" not in md  # in the plot, not the text
    _plots_ok(out)


@pytest.mark.parametrize("make, match", [
    (lambda p: p.mkdir(), "holds no part files"),
    (lambda p: (p.mkdir(), (p / "_job.json").write_text("{}")), "holds no rows yet: no part files"),
    (lambda p: None, "is not a directory"),
    (lambda p: (p.mkdir(), pq.write_table(pa.table({"id": [1], "text": ["x"]}), p / "part-0001.parquet")),
     r"part-0001\.parquet is not a part file of a generation job: no column 'n_new_tokens'"),
    (lambda p: (p.mkdir(), (p / "data.parquet").write_bytes(b"not parquet at all")),
     r"data\.parquet is not a readable"),
])
def test_empty_or_foreign_directory_is_refused_by_name(tmp_path, make, match):
    out = tmp_path / "foreign"
    make(out)
    with pytest.raises(ValueError, match=match) as e:
        write_report(out)
    assert str(out) in str(e.value)
    assert not (out / REPORT_FILE).exists() and not (out / PLOTS_DIR).exists()


def test_command_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "holds no part files" in capsys.readouterr().err
    out = write_output(tmp_path / "out", ROWS[:4])
    assert main([str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / REPORT_FILE)


def test_budget_sentence():
    plain = {"method": "logitspec", "decode_steps": 120, "verified_steps": 0, "accepted_steps": 0,
             "mean_accepted": 1.0, "batch": 8, "break_even": 0.7, "device": "cpu"}
    pays = "at batch 8 on this CPU a draft token must be accepted 70% of the time to pay"
    assert budget_sentence(plain) == f"decoded plainly: drafts verified on 0 of 120 steps (MAT 1.00): {pays}"
    drafted = {**plain, "verified_steps": 15, "accepted_steps": 9, "mean_accepted": 1.0712}
    assert budget_sentence(drafted) == \
        f"drafts verified on 12.5% of steps, accepted on 7.5% (MAT 1.07): {pays}"
    # without the fields the rows lack today: accepted steps only, no break-even clause
    today = {"method": "logitspec", "decode_steps": 200, "verified_steps": None, "accepted_steps": 24,
             "mean_accepted": 1.38, "retrieval_success": 0.3, "batch": 8, "device": "cpu"}
    assert budget_sentence(today) == ("drafts accepted on 12% of steps (MAT 1.38; retrieval found a draft on "
                                      "30% of steps), at batch 8 on this CPU")
    none = {**today, "accepted_steps": 0, "mean_accepted": 1.0, "retrieval_success": 0.08, "batch": 7.5}
    assert budget_sentence(none) == ("decoded plainly: drafts accepted on 0 of 200 steps (MAT 1.00; "
                                     "retrieval found a draft on 8% of steps), at batch 7.50 on this CPU")
    assert budget_sentence({**plain, "break_even": 1.25, "device": "cuda:0"}).endswith(
        "at batch 8 on this GPU no acceptance rate pays for a draft token (a 2-token forward costs 2.25x a "
        "1-token one)")
    assert budget_sentence({"method": "ar", "mean_accepted": 1.0}) == \
        "method ar: plain decoding, no drafts (MAT 1.00)"
    assert "nothing to say" in budget_sentence({"method": "logitspec", "decode_steps": 0})


def test_break_even_from_a_cost_curve():
    class Curve:  # 8 rows: 1 token each 100 ms, 2 tokens each 170 ms
        def step(self, rows, per_row):
            return {1: 0.100, 2: 0.170}[per_row] * rows / 8

    assert break_even_acceptance(Curve(), 8) == pytest.approx(0.7)


def test_numbers_are_rounded():
    assert [sig(x) for x in (1.007, 0.08123, 12345.6, 70.0, 9.996, 0, None)] == \
        ["1.01", "0.0812", "12,300", "70.0", "10.0", "0", "-"]
    assert [pct(x) for x in (0.7, 0.125, 0.0812, 1 / 3)] == ["70%", "12.5%", "8.12%", "33.3%"]


def test_rows_in_the_jobs_own_schema(tmp_path):
    """The job's current row schema (wherever the pipeline keeps it) holds every column the report needs."""
    for module, name in (("pipeline.rows", "OutputRow.schema"), ("pipeline.io.output", "output_schema")):
        try:
            output_schema = importlib.import_module(module)
            for part in name.split("."):
                output_schema = getattr(output_schema, part)
            break
        except (ImportError, AttributeError):
            continue
    else:
        pytest.skip("no pipeline module exports the output rows' schema")
    s = output_schema(pa.string())
    rows = [{**{k: v for k, v in r.items() if k in s.names}, "id": f"row-{r['id']}"} for r in ROWS]
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=s), out / "part-0.parquet")
    md = write_report(out).read_text()
    assert "| rows | 5 (4 generated, 1 error rows) |" in md
    assert "| MAT | 1.33 new tokens per target forward |" in md
