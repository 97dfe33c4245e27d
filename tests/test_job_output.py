"""The output directory as a user meets it: foreign files and unwritable paths refused before anything is
written, ``--dry-run`` catching the same and naming the rows it rejects, the lock removed at the end and a
stale one taken over."""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_models import save_tiny_text_model

from pipeline.errors import ConfigError
from pipeline.io.lock import LOCK_FILE, OutputLock
from pipeline.io.output import OutputStore
from pipeline.rows import OutputRow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path)
    return str(path)


def _jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _snapshot(root: pathlib.Path) -> dict:
    return {f.name: f.stat().st_mtime_ns for f in root.iterdir()}


def _no_ray(monkeypatch):
    import pipeline.job.run

    def no_ray(cfg):
        raise AssertionError("this job must be refused before Ray starts")

    monkeypatch.setattr(pipeline.job.run, "connect_ray", no_ray)


@pytest.mark.parametrize("dry", [False, True])
def test_foreign_part_file_is_refused_before_anything_is_written(tmp_path, tiny, capsys, monkeypatch, dry):
    from pipeline.job.cli import main

    _no_ray(monkeypatch)
    inp = _jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "Hello"} for i in range(3)])
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"x": [1, 2], "text": ["a", "b"]}), out / "part-0001.parquet")
    before = _snapshot(out)
    argv = ["--input", str(inp), "--output", str(out), "--model", tiny, "-q"] + (["--dry-run"] if dry else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out / 'part-0001.parquet'} was not written by this job (no column id" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _snapshot(out) == before  # no _job.json, no _job.lock
    if not dry:  # --overwrite does not delete a file that is not this job's either
        assert main(argv + ["--overwrite"]) == 2 and _snapshot(out) == before


@pytest.mark.parametrize("dry", [False, True])
def test_an_output_holding_the_input_file_is_refused_unless_foreign_files_are_allowed(tmp_path, tiny, capsys,
                                                                                       monkeypatch, dry):
    """The input file inside --output: readers of the output dataset would trip on it, so the job says so
    and stops before anything is written; --allow-foreign-files lets it run (the file left alone)."""
    from pipeline.job.cli import main

    out = tmp_path / "out"
    out.mkdir()
    inp = _jsonl(out / "prompts.jsonl", [{"id": i, "prompt": "Hello"} for i in range(3)])
    before = _snapshot(out)
    argv = ["--input", str(inp), "--output", str(out), "--model", tiny, "-q", "--dry-run"] if dry else \
        ["--input", str(inp), "--output", str(out), "--model", tiny, "-q"]
    _no_ray(monkeypatch)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out} holds files that are not this job's (prompts.jsonl)" in err
    assert "--allow-foreign-files" in err
    assert len(err.strip().splitlines()) == 1 and _snapshot(out) == before
    if dry:  # allowed: the plan goes through (nothing written by a dry run)
        assert main(argv + ["--allow-foreign-files"]) == 0 and _snapshot(out) == before


@pytest.mark.parametrize("name,content,line", [
    ("in.jsonl", b'{"id": 0, "prompt": "Hello"}\n{"id": 1, "prompt": "caf\xe9 au lait"}\n', 2),
    ("in.csv", b"id,prompt\n0,Hello\n1,ok\n2,na\xefve\n", 4),
])
def test_text_input_that_is_not_utf8_is_refused_naming_the_line(tmp_path, tiny, capsys, monkeypatch, name,
                                                                content, line):
    """Latin-1 bytes in a JSONL or CSV input: refused before anything starts, naming the line (Arrow's JSON
    reader would pass them on silently, its CSV reader would type the column as binary)."""
    from pipeline.job.cli import main

    _no_ray(monkeypatch)
    inp = tmp_path / name
    inp.write_bytes(content)
    assert main(["--input", str(inp), "--output", str(tmp_path / "out"), "--model", tiny, "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{inp}:{line}: not UTF-8" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dry", [False, True])
def test_output_that_cannot_be_made_is_refused(tmp_path, tiny, capsys, monkeypatch, dry):
    from pipeline.job.cli import main

    _no_ray(monkeypatch)
    inp = _jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hello"}])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    argv = ["--input", str(inp), "--output", str(blocker / "out"), "--model", tiny, "-q"]
    assert main(argv + (["--dry-run"] if dry else [])) == 2
    assert f"cannot be made: {blocker} is not a directory" in capsys.readouterr().err
    assert blocker.read_text() == "not a directory\n"


def test_unwritable_output_is_refused(tmp_path, monkeypatch):
    import os

    root = tmp_path / "ro"
    root.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if pathlib.Path(p) == root else real(p, mode))
    store = OutputStore(root / "out", pa.int64())
    for check in (lambda: store.inspect({"model": "m"}), lambda: store.prepare({"model": "m"}, False)):
        with pytest.raises(ConfigError, match=f"is not writable \\({root}: permission denied"):
            check()
    assert list(root.iterdir()) == []


def test_dry_run_names_the_rows_it_rejects(tmp_path, tiny, capsys, monkeypatch):
    from pipeline.job.cli import main

    _no_ray(monkeypatch)
    rows = [{"id": i, "prompt": "Hello" if i % 3 else ""} for i in range(40)]
    inp = _jsonl(tmp_path / "in.jsonl", rows)
    argv = ["--input", str(inp), "--output", str(tmp_path / "out"), "--model", tiny, "-q", "--dry-run"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    rejected = plan["rejected_rows"]
    assert rejected["count"] == 14 == plan["rejected_before_generation"]
    assert [r["id"] for r in rejected["first"]] == list(range(0, 30, 3))
    assert all("empty" in r["reason"] for r in rejected["first"])
    assert not (tmp_path / "out").exists()


def test_lock_is_removed_at_the_end_and_a_stale_one_taken_over(tmp_path, caplog):
    store = OutputStore(tmp_path, pa.int64())
    store.prepare({"model": "m"}, overwrite=False)
    assert (tmp_path / LOCK_FILE).exists()
    store.close()
    assert not (tmp_path / LOCK_FILE).exists()
    stale = {"pid": 999999999, "host": "gone", "started": "2026-01-01T00:00:00+0000"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale) + "\n")  # left by a SIGKILLed job
    with caplog.at_level(logging.INFO, logger="pipeline.io.lock"):
        lock = OutputLock(tmp_path)
    assert "taking over" in caplog.text and "999999999" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] != 999999999
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_start_up_warning_only_for_replicas_waiting_to_be_placed():
    from pipeline.replica.scheduler import unplaced

    assert unplaced([True, True]) is None  # every replica is loading the model: nothing to warn about
    assert unplaced([True, False]) == "1 of 2 replica(s) not placed yet"
    assert unplaced([None]) == "1 replica(s) (loading or not placed yet)"  # it cannot tell: warn as before


def test_progress_says_the_model_is_loading_until_generation_starts():
    from pipeline.job.progress import Progress

    p = Progress(30, 0, 30, interval=10)
    assert p.line().startswith("rows 0/30")  # before replicas start (never logged then)
    p.starting(2)
    assert p.line() == "loading the model on 2 replica(s) ... (0 s)"
    p.t_gen = p.t_load
    assert p.line().startswith("rows 0/30 (this run 0/30")


def test_summary_file_is_rounded_and_the_run_ends_with_lines_for_people(tmp_path):
    from pipeline.job.cli import run_summary

    summary = {"complete": True, "rows": {"total": 30, "missing": 0, "done_now": 28, "failed_now": 2,
                                          "skipped_already_done": 0, "failed_in_output": 2},
               "tokens": {"new_now": 1792, "per_s": 8.98765, "in_output": 1792}, "rows_per_s": 0.1401234,
               "mat": {"now": 1.376923, "output": 1.376923},
               "timing": {"startup_s": 38.81, "generation_s": 199.34, "total_s": 238.15, "x_s": None},
               "error": None, "output": {"dir": str(tmp_path), "part_files": 1, "parts_written_now": 1},
               "memory": {"rss_bytes": 123456789}}
    store = OutputStore(tmp_path, pa.int64())
    on_disk = json.loads(store.write_summary(summary).read_text())
    assert on_disk["tokens"]["per_s"] == 8.99 and on_disk["mat"]["now"] == 1.38
    assert on_disk["timing"]["total_s"] == 238.0 and on_disk["memory"]["rss_bytes"] == 123456789
    assert list(on_disk)[:5] == ["complete", "rows", "tokens", "rows_per_s", "mat"]
    text = run_summary(summary, as_json=False)
    assert text.splitlines() == [
        "done: 30 of 30 rows in the output (28 generated now, 2 failed now, 0 already done; "
        "2 error rows in all)",
        "1792 new tokens at 9.0 tokens/s, MAT 1.38 (tokens per target forward)",
        "time: startup 39 s, generation 199 s, total 238 s",
        f"output: {tmp_path} (1 part file(s); pandas.read_parquet({str(tmp_path)!r})); "
        f"summary: {tmp_path}/_summary.json"]
    assert json.loads(run_summary(summary, as_json=True))["mat"]["now"] == 1.376923  # --json


def test_polars_reads_the_parts_with_a_glob(tmp_path):
    """polars (2.x) reads a directory only when every file under it, hidden or not, is Parquet; the job's
    record and summary sit beside the parts (as pandas, pyarrow, DuckDB and Ray Data expect), so polars
    reads ``OUT/*.parquet``, as its own error message suggests."""
    pl = pytest.importorskip("polars")
    store = OutputStore(tmp_path, pa.int64())
    store.prepare({"model": "m"}, overwrite=False)
    store.write([OutputRow(id=i, generation="x", n_new_tokens=1, steps=1) for i in range(3)])
    store.write_summary({"complete": True})
    store.close()
    assert sorted(pl.read_parquet(f"{tmp_path}/*.parquet")["id"].to_list()) == [0, 1, 2]
    assert pl.scan_parquet(f"{tmp_path}/*.parquet").select(pl.len()).collect().item() == 3
    with pytest.raises(Exception, match="glob pattern"):
        pl.read_parquet(tmp_path)


def test_model_column_names_the_resolved_model_and_a_hash_of_its_files(tmp_path, tiny):
    import shutil

    from test_pipeline import _cfg

    from pipeline.io.model import model_label
    from pipeline.job.plan import make_plan
    from pipeline.replica.worker import error_rows
    from pipeline.rows import InputRow

    copy = tmp_path / "my-model"
    shutil.copytree(tiny, copy)
    label = model_label(copy)
    assert re.fullmatch(r"my-model \(sha256:[0-9a-f]{8}\)", label)
    assert model_label(pathlib.Path(tiny)).endswith(label[-18:])  # a copy hashes the same
    weights = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_label(copy) != label  # other weights, another hash
    inp = _jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hello"}])
    plan = make_plan(_cfg(str(copy), inp, tmp_path / "out"), dry_run=True)
    assert plan.cfg.gen.model_label == model_label(copy)
    [row] = error_rows(InputRow(1, None), "x", plan.cfg.gen)
    assert row.model == model_label(copy)


def _kept_job(tmp_path, tiny, keep: str):
    """Plan a job over rows with extra columns and write its rows as the replicas would (no Ray)."""
    from test_pipeline import _cfg

    from pipeline.job.plan import make_plan
    from pipeline.job.run import row_batches
    from pipeline.replica.worker import error_rows

    rows = [{"id": i, "prompt": "Hello" if i else "", "topic": f"t{i}", "score": i / 2, "corpus": "x"}
            for i in range(4)]
    tmp_path.mkdir(exist_ok=True)
    inp = _jsonl(tmp_path / "in.jsonl", rows)
    plan = make_plan(dataclasses.replace(_cfg(tiny, inp, tmp_path / "out"), keep_columns=keep))
    for batch in row_batches(plan.cfg, plan, plan.store.add):  # row 0 is rejected on the way
        plan.store.add([r for row in batch for r in error_rows(row, "stand-in", plan.cfg.gen)])
    plan.store.flush()
    plan.store.close()
    return pq.read_table(tmp_path / "out")


def test_keep_columns_carries_input_columns_into_the_output(tmp_path, tiny):
    table = _kept_job(tmp_path, tiny, "all")  # the default: all but the id and output-named ones (corpus)
    extra = [c for c in table.column_names if c not in OutputRow.names()]
    assert extra == ["prompt", "topic", "score"]
    got = sorted(zip(*(table.column(c).to_pylist() for c in ("id", "prompt", "topic", "score"))))
    assert got == [(i, "Hello" if i else "", f"t{i}", i / 2) for i in range(4)]
    assert table.schema.field("score").type == pa.float64()
    table = _kept_job(tmp_path / "b", tiny, "topic")
    assert [c for c in table.column_names if c not in OutputRow.names()] == ["topic"]
    table = _kept_job(tmp_path / "c", tiny, "none")
    assert table.column_names == OutputRow.names()


@pytest.mark.parametrize("keep, message", [("corpus", "--keep-columns: 'corpus' is also an output column"),
                                           ("topic,nope", "--keep-columns: no column 'nope' in the input")])
def test_keep_columns_refuses_a_clash_or_a_missing_column(tmp_path, tiny, capsys, monkeypatch, keep, message):
    from pipeline.job.cli import main

    _no_ray(monkeypatch)
    inp = _jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Hello", "topic": "a", "corpus": "x"}])
    out = tmp_path / "out"
    argv = ["--input", str(inp), "--output", str(out), "--model", tiny, "-q", "--keep-columns", keep]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
