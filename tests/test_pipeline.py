"""The Ray batch-generation job (pipeline/, jobs/generate.py), end to end on a local Ray.

A tiny random Llama with a small byte-level BPE tokenizer (trained here on the sample corpus) stands
in for the model: text prompts, a chat template, a 128-token context, milliseconds per step. One
local Ray is shared by the module (``ray_session``); the jobs run in-process (they reuse it) or as
subprocesses that join it with ``--address`` (and one that starts its own local Ray).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from job_specs import job_spec
from tiny_models import save_tiny_text_model

from logitspec import allocator
from logitspec.kernels import skinny
from logitspec.paths import default_cache_dir
from pipeline.errors import ConfigError
from pipeline.io.inputs import open_input, read_columns, row_problem
from pipeline.io.output import OutputStore, read_generations
from pipeline.job.cli import build_parser, config_from_args
from pipeline.job.config import JobConfig
from pipeline.job.pending import scan_ids
from pipeline.replica.worker import row_seed
from pipeline.rows import InputRow, OutputRow
from pipeline.spec import GenerationSpec, engine_config

REPO = pathlib.Path(__file__).resolve().parents[1]
GENERATE = REPO / "jobs" / "generate.py"
BUILD_INDEX = REPO / "jobs" / "build_index.py"

OUTPUT_COLUMNS = ["id", "generation", "finish_reason", "n_prompt_tokens", "n_new_tokens", "steps",
                  "mean_accepted", "accepted_lengths", "retrieval_success", "wall_s", "method", "model",
                  "error"]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path)
    return str(path)


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module; in-process jobs reuse it, subprocess jobs join it by address."""
    ray = pytest.importorskip("ray")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH",
                                                                                        "").split(
        os.pathsep) if p])  # actors import this checkout
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the job does for a local Ray: no starved actors
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _long_prompt() -> str:
    return " ".join(["lorem ipsum dolor sit amet"] * 60)  # far beyond the tiny model's 128 positions


def _mixed_rows() -> list[dict]:
    """20 rows: 14 good text prompts, 1 chat row, 5 bad rows (null, empty, blank, wrong type, too long)."""
    samples = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()]
    rows = [{"id": i, "prompt": s["prompt"], "messages": None} for i, s in enumerate(samples[:14])]
    rows.append({"id": 14, "prompt": None, "messages": [{"role": "user", "content": "Name a colour."}]})
    rows += [{"id": 15, "prompt": None, "messages": None},
             {"id": 16, "prompt": "", "messages": None},
             {"id": 17, "prompt": "   \n", "messages": None},
             {"id": 18, "prompt": 12345, "messages": None},
             {"id": 19, "prompt": _long_prompt(), "messages": None}]
    return rows


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tiny: str, inp, out, **kw) -> JobConfig:
    # fixed budget: the tiny model's cost curve would make the auto budget skip drafting, and the
    # tests below need trees to exercise retrieval
    gen = dict(model=tiny, budget=kw.pop("budget", "fixed"), max_new_tokens=kw.pop("max_new_tokens", 12),
               max_batch_size=kw.pop("max_batch_size", 2),
               temperature=kw.pop("temperature", 0.0), seed=kw.pop("seed", 0), n=kw.pop("num_samples", 1),
               warmup=False, history_tokens=kw.pop("history_tokens", 0), share_history=kw.pop("share_history",
                                                                                              False))
    kw.setdefault("threads_per_actor", 1)
    kw.setdefault("log_interval", 2.0)
    return JobConfig(input=str(inp), output=str(out), gen=job_spec(**gen), **kw)


def _check_exactly_once(out, ids) -> pa.Table:
    table = read_generations(out)
    got = table.column("id").to_pylist()
    assert sorted(got) == sorted(ids), "every input row exactly once"
    assert len(got) == len(set(got))
    assert set(OUTPUT_COLUMNS) <= set(table.column_names)
    return table


def _env_without_ray_address() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p])
    return env


# ---------------------------------------------------------------------------------------------- no Ray
def test_inputs_all_formats_read_the_same_rows(tmp_path):
    import datasets
    import pyarrow.csv as pcsv

    table = pa.table({"id": ["a", "b", "c"], "prompt": ["one", "", None], "extra": [1, 2, 3]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    _write_jsonl(tmp_path / "t.jsonl", table.to_pylist())
    pcsv.write_csv(table.slice(0, 2), tmp_path / "t.csv")
    (tmp_path / "dir").mkdir()
    pq.write_table(table.slice(0, 2), tmp_path / "dir" / "a.parquet")
    pq.write_table(table.slice(2), tmp_path / "dir" / "b.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "ds"))
    for name in ("t.parquet", "t.arrow", "t.jsonl", "dir", "ds"):
        cfg = JobConfig(input=str(tmp_path / name), output="unused")
        index = scan_ids(open_input(cfg))
        assert index.ids.to_pylist() == ["a", "b", "c"] and index.id_type == pa.string(), name
        assert read_columns(cfg, ["prompt"])["prompt"] == ["one", "", None], name
    csv = JobConfig(input=str(tmp_path / "t.csv"), output="unused")
    assert read_columns(csv, ["prompt"])["prompt"] == ["one", ""]  # CSV: an empty field is an empty prompt
    no_ids = scan_ids(open_input(JobConfig(input=str(tmp_path / "t.parquet"), output="unused",
                                           id_column="row")))
    assert no_ids.ids.to_pylist() == [0, 1, 2] and no_ids.generated_ids and no_ids.id_type == pa.int64()
    limited = scan_ids(open_input(JobConfig(input=str(tmp_path / "dir"), output="unused", limit=1)))
    assert limited.ids.to_pylist() == ["a"]


def test_json_lines_arrow_cannot_type_are_read_row_by_row(tmp_path):
    """A number among text prompts past Arrow's first JSON block: the scan switches to pipeline.io.json_rows
    (the rows already read are not repeated) and the odd row is a problem, not a failed job."""
    import numpy as np

    from pipeline.job.pending import stream_chunks

    rows = [{"id": i, "prompt": f"prompt number {i}"} for i in range(60_000)] + [{"id": 60_000, "prompt": 7}]
    cfg = JobConfig(input=str(_write_jsonl(tmp_path / "in.jsonl", rows)), output="unused")
    index = scan_ids(open_input(cfg))
    assert index.ids.to_pylist() == list(range(60_001))
    chunks = list(stream_chunks(index, cfg, np.ones(len(index), dtype=bool)))
    problems = [p for c in chunks for p in c.problems]
    assert len(problems) == 60_001 and not any(problems[:-1]) and "type int" in problems[-1]


@pytest.mark.parametrize("rows, kwargs, message", [
    ([{"id": 1, "text": "x"}], {}, "column 'prompt' (--prompt-column) not found"),
    ([{"id": 1, "prompt": "x"}], {"corpus_column": "corpus"}, "column 'corpus' (--corpus-column) not found"),
    ([{"id": 1, "prompt": "x"}, {"id": 1, "prompt": "y"}], {}, "duplicated value(s), e.g. 1"),
    ([{"id": 1, "prompt": "x"}, {"id": None, "prompt": "y"}], {}, "has a null at row 1"),
    ([{"id": 1, "prompt": "x"}, {"id": "b", "prompt": "y"}], {}, "mixes integers and strings"),
])
def test_schema_errors_name_the_problem(tmp_path, rows, kwargs, message):
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        cfg = JobConfig(input=str(inp), output="unused", **kwargs)
        scan_ids(open_input(cfg), cfg.corpus_column)
    assert message in str(e.value)


def test_parquet_column_of_wrong_type_is_a_config_error(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "prompt": [1.5, 2.5]}), tmp_path / "in.parquet")
    with pytest.raises(ConfigError, match="'prompt' .* has type double"):
        open_input(JobConfig(input=str(tmp_path / "in.parquet"), output="unused"))


def test_row_problems_and_seeds():
    assert row_problem("hi") is None and row_problem([5, 6]) is None
    assert row_problem(None) == "prompt is null"
    assert row_problem("  ") == "empty prompt" and row_problem([]) == "empty prompt"
    assert "type int" in row_problem(3) and "type dict" in row_problem({"a": 1})
    assert row_problem(None, [{"role": "user", "content": "x"}], True) is None
    assert "malformed" in row_problem(None, [{"role": "user"}], True)
    # a row's seed depends only on (--seed, id): stable across processes, shards, batches
    assert row_seed(0, 7) == row_seed(0, 7) != row_seed(1, 7)
    assert row_seed(0, 7) != row_seed(0, "7") and 0 <= row_seed(123, "x") < 2**63
    # pinned: changing the derivation would make resumed outputs mix two seed schemes
    assert row_seed(0, 7) == 2261305308355864834 and row_seed(0, "a") == 3705219367631438799


def test_config_validation():
    for flags, message in ((["--temperature", "-1"], "--temperature must be >= 0"),
                           (["--temperature", "inf"], "--temperature must be a finite number"),
                           (["--temperature", "0.5", "--top-p", "0"], "--top-p must be in"),
                           (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
                           (["--num-samples", "0", "--temperature", "1"], "--num-samples must be >= 1"),
                           (["--num-samples", "2"], "need --temperature > 0"),
                           (["--tp", "2", "--runner", "compiled"], "--runner compiled is for one model per")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_args(build_parser().parse_args(["--input", "a", "--output", "b", *flags]))
    with pytest.raises(ConfigError, match="unknown method"):
        engine_config(method="medusa")
    with pytest.raises(ConfigError, match="history_tokens"):
        GenerationSpec(history_tokens=-1)
    assert (GenerationSpec().history_source() is None
            and GenerationSpec(history_tokens=50).history_source().max_tokens == 50)
    with pytest.raises(ConfigError, match="actors"):
        JobConfig(input="a", output="b", actors=0)
    with pytest.raises(ConfigError, match="--corpus-column"):
        JobConfig(input="a", output="b", references=(("x", "p"), ("y", "q")))


def _out_row(i, **kw) -> OutputRow:
    return OutputRow(**{"id": i, "sample": 0, "generation": "x", "finish_reason": "length",
                        "n_prompt_tokens": 1,
                        "n_new_tokens": 1, "steps": 1, "mean_accepted": 1.0, "accepted_lengths": [1],
                        "retrieval_success": 0.0, "wall_s": 0.1, "method": "ar", "model": "m", "error": None,
                        "corpus": None, **kw})


def test_part_files_are_atomic_buffered_and_ids_never_written_twice(tmp_path, caplog):
    out = tmp_path / "out"
    store = OutputStore(out, pa.int64(), part_rows=3, part_seconds=3600)
    store.prepare({"model": "m"}, overwrite=False)
    assert store.add([_out_row(1)]) is None and not store.part_files()  # buffered, not due yet
    store.add([_out_row(1)])  # same id again: not taken
    assert store.add([_out_row(2), _out_row(3)]) is not None  # 3 rows: a part
    store.add([_out_row(4)])
    assert store.flush() is not None and store.flush() is None
    assert sorted(pq.read_table(f).num_rows for f in store.part_files()) == [1, 3]
    assert store.write([_out_row(2)]) is None  # already on disk: never written twice
    store.close()
    (out / ".part-dead.parquet.x.tmp").write_bytes(b"half")  # a crashed run's temporary
    (out / "notes.txt").write_text("mine")  # a foreign file: refused, unless allowed; then named, left alone
    refused = r"holds files that are not this job's \(notes.txt\).*--allow-foreign"
    with pytest.raises(ConfigError, match=refused):
        OutputStore(out, pa.int64()).prepare({"model": "m"}, overwrite=False)
    store2 = OutputStore(out, pa.int64(), allow_foreign=True)
    store2.prepare({"model": "m"}, overwrite=False)
    assert f"{out / 'notes.txt'} is not a file of this job" in caplog.text and (out / "notes.txt").exists()
    assert store2.keys() == {(1, 0), (2, 0), (3, 0), (4, 0)} and not list(out.glob(".*.tmp"))
    store2.write([_out_row(2), _out_row(2, sample=1)])  # (2, 0) is on disk: only (2, 1) is written
    assert store2.keys() == {(1, 0), (2, 0), (2, 1), (3, 0), (4, 0)}
    store2.close()
    (out / "notes.txt").unlink()
    assert sorted(read_generations(out).column("id").to_pylist()) == [1, 2, 2, 3, 4]
    with pytest.raises(ConfigError, match="other settings .*model: was 'm', now 'n'"):
        OutputStore(out, pa.int64()).prepare({"model": "n"}, overwrite=False)
    with pytest.raises(ConfigError, match="ids of type int64"):
        OutputStore(out, pa.string()).prepare({"model": "m"}, overwrite=False)
    # a truncated part file (or a foreign one under a part name) is found and named before anything runs
    bad = out / "part-0000000000000000.parquet"
    bad.write_bytes(pq.read_table(store2.part_files()[0]).to_string().encode()[:40])
    with pytest.raises(ConfigError, match=f"cannot read the existing part file {bad}.*delete it"):
        OutputStore(out, pa.int64()).prepare({"model": "m"}, overwrite=False)


def test_disk_full_while_writing_a_part_leaves_no_partial_file(tmp_path):
    """A write that fails (here: the process's file-size limit, as a full disk would) raises a clear
    OSError naming the part; no visible or temporary file is left and the rows stay buffered."""
    script = f"""
import resource, signal, pyarrow as pa, sys
sys.path.insert(0, {str(REPO)!r})
from pipeline.io.output import OutputStore
from pipeline.rows import OutputRow
row = {_out_row(0, generation="y" * 500).as_dict()!r}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = OutputStore({str(tmp_path / "out")!r}, pa.int64())
store.prepare({{"model": "m"}}, overwrite=False)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
store.add([OutputRow(**{{**row, "id": i}}) for i in range(20)])
try:
    store.flush()
except OSError as e:
    print("ERR", e, len(store.pending))
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "ERR" in p.stdout, p.stderr
    assert ("cannot write the part file" in p.stdout and "no partial file" in p.stdout
            and p.stdout.split()[-1] == "20")
    assert not list((tmp_path / "out").glob("part-*")) and not list((tmp_path / "out").glob(".*.tmp"))


def test_output_is_a_dataset_any_reader_opens(tmp_path):
    """Part files sit in --output itself, metadata under ``_`` names: pandas, pyarrow.dataset and
    DuckDB (when installed) read the directory as it is. (Ray Data: test_exactly_once_with_error_rows.)"""
    import pandas as pd
    import pyarrow.dataset as pads

    out = tmp_path / "out"
    store = OutputStore(out, pa.int64(), part_rows=2)
    store.prepare({"model": "m"}, overwrite=False)
    store.add([_out_row(i) for i in range(5)])
    store.flush()
    store.write_summary({"complete": True})
    store.close()
    assert {p.name for p in out.iterdir()} >= {"_job.json", "_summary.json"}  # the lock: removed
    assert sorted(pd.read_parquet(out)["id"]) == list(range(5))
    assert sorted(pads.dataset(out).to_table().column("id").to_pylist()) == list(range(5))
    import duckdb  # a test dependency: the README names DuckDB among the readers

    assert sorted(r[0] for r in duckdb.sql(f"select id from '{out}/*.parquet'").fetchall()) == list(range(5))


def test_old_layout_is_moved_to_the_dataset_layout_on_resume(tmp_path):
    """An output of the earlier layout (generations/part-*.parquet, job.json, summary.json) resumes:
    its rows count as done and its files move to the dataset layout."""
    out = tmp_path / "old"
    (out / "generations").mkdir(parents=True)
    old_schema = OutputStore(out, pa.int64()).schema.remove(1)  # before the sample column existed
    assert "sample" not in old_schema.names
    pq.write_table(pa.Table.from_pylist([_out_row(1).as_dict(), _out_row(2).as_dict()], schema=old_schema),
                   out / "generations" / "part-aaaa.parquet")
    (out / "job.json").write_text(json.dumps({"model": "m"}))
    (out / "summary.json").write_text("{}")
    store = OutputStore(out, pa.int64())
    with pytest.raises(ConfigError, match="other settings"):  # the old job record is still checked
        store.prepare({"model": "n"}, overwrite=False)
    store.prepare({"model": "m"}, overwrite=False)
    assert store.keys() == {(1, 0), (2, 0)}  # their rows are sample 0
    store.write([_out_row(3), _out_row(2)])
    store.close()
    assert not (out / "generations").exists() and not (out / "job.json").exists()
    assert not (out / "summary.json").exists() and (out / "_job.json").exists()
    assert sorted(read_generations(out).column("id").to_pylist()) == [1, 2, 3]


def test_job_record_with_loose_decoding_settings_still_resumes(tmp_path):
    """An output whose ``_job.json`` predates the request type (its decoding settings as loose fields)
    resumes under the same settings; other settings are refused, naming the request."""
    from pipeline.job.plan import job_record, upgrade_record

    out = tmp_path / "out"

    def record(*flags):
        argv = ["--input", "in.jsonl", "--output", str(out), "--seed", "5", "--stop", "END", *flags]
        return job_record(config_from_args(build_parser().parse_args(argv)))

    now = record("--temperature", "0.7", "--num-samples", "3")
    assert now["request"] == {"max_new_tokens": 64, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 5,
                              "stop": ["END"]}  # n is not part of it: raising --num-samples adds samples
    old = {k: v for k, v in now.items() if k != "request"}
    old.update(max_new_tokens=64, temperature=0.7, top_p=1.0, top_k=0, seed=5, stop=["END"])
    store = OutputStore(out, pa.int64())
    store.prepare(old, overwrite=False)  # the earlier version's run
    store.write([_out_row(0)])
    store.close()
    store = OutputStore(out, pa.int64())
    store.prepare(now, overwrite=False, upgrade=upgrade_record)
    assert store.keys() == {(0, 0)}
    store.close()
    with pytest.raises(ConfigError, match="other settings .request.temperature: was 0.7, now 0.8"):
        OutputStore(out, pa.int64()).prepare(record("--temperature", "0.8"), overwrite=False,
                                             upgrade=upgrade_record)
    json.loads((out / "_job.json").read_text())["temperature"]  # the record on disk is left as it was


def test_second_job_on_one_output_refuses_naming_the_first(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(REPO)!r}); "
                               f"from pipeline.io.lock import OutputLock; l = "
                               f"OutputLock(__import__('pathlib').Path("
                               f"{str(tmp_path)!r})); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f'another job is writing to .*"pid": {holder.pid}, "host"'):
            OutputStore(tmp_path, pa.int64()).prepare({"model": "m"}, overwrite=False)
    finally:
        holder.kill()
        holder.wait()
    store = OutputStore(tmp_path, pa.int64())  # the holder died (as a SIGKILLed job would): free again
    store.prepare({"model": "m"}, overwrite=False)
    store.close()


def test_config_errors_exit_fast_without_starting_ray(tmp_path, tiny, capsys):
    from pipeline.job.cli import main

    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hello"}, {"id": 2, "prompt": "world"}])
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    out = str(tmp_path / "out")
    cases = [
        (["--input", str(inp), "--prompt-column", "question"],
         "column 'question' (--prompt-column) not found"),
        (["--input", str(dup)], "duplicated value(s), e.g. 1"),
        (["--input", str(inp), "--model", str(tmp_path / "nope")], "not found"),
        (["--input", str(inp), "--model", str(broken)], "cannot read"),
        (["--input", str(inp), "--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--input", str(inp), "--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--input", str(inp), "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--input", str(tmp_path / "missing.parquet")], "does not exist"),
        (["--input", str(inp), "--reference", str(tmp_path / "no-corpus")], "does not exist"),
    ]
    cases.append((["--input", str(inp), "--messages-column", "chat"], "column 'chat' (--messages-column) "
                                                                      "not found"))
    import ray

    ray_before = ray.is_initialized()
    for args, message in cases:
        t0 = time.perf_counter()
        model = [] if "--model" in args else ["--model", tiny]
        assert main(args + model + ["--output", out, "-q"]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert time.perf_counter() - t0 < 30, args
    assert ray.is_initialized() == ray_before  # no Ray started for a job that cannot run


def test_row_generator_reports_the_engine_run_of_its_batch(tiny):
    """A replica's batch stats carry the stats of the ``Engine.run`` that generated the batch."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.worker import RowGenerator

    model, tok = load_model(tiny)
    spec = job_spec(model=tiny, max_new_tokens=6, max_batch_size=2, budget="fixed", warmup=False)
    rows = [InputRow(i, p) for i, p in enumerate(["Hello there", "Lorem ipsum", _long_prompt()])]
    out, stats = RowGenerator(Engine(model, tok, spec.engine), spec)(rows)
    assert [r.error is None for r in out] == [True, True, False]  # the long prompt: refused before the run
    engine = stats["engine"]
    assert engine["tokens"] == out[0].n_new_tokens + out[1].n_new_tokens > 0
    # decode steps of the batch (a row's steps also count its prefill): both rows shared some of them
    assert max(out[0].steps, out[1].steps) - 1 <= engine["batch_steps"] < out[0].steps + out[1].steps
    assert engine["wall_s"] > 0 and 1.0 <= engine["mean_active"] <= 2.0


def test_history_source_drafts_from_earlier_answers_and_rows_say_so(tiny):
    """``--history-tokens``: a replica's answers become a draft source; a row that repeats an earlier
    prompt drafts from history (its ``accepted_from`` says so) and its generation is unchanged."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.worker import RowGenerator

    model, tok = load_model(tiny)
    rows = [InputRow(i, "Hello there, said the") for i in range(2)]
    outs = {}
    for tokens in (0, 2000):
        spec = job_spec(model=tiny, max_new_tokens=24, max_batch_size=1, budget="fixed", warmup=False,
                              history_tokens=tokens)
        gen = RowGenerator(Engine(model, tok, spec.engine, history=spec.history_source()), spec)
        outs[tokens] = [gen([r])[0][0] for r in rows]  # one row per call: the second sees the first's answer
    plain, hist = outs[0], outs[2000]
    assert [r.generation for r in hist] == [r.generation for r in plain]
    assert all(set(r.accepted_from) == {"context", "siblings", "reference", "history", "guess"} for r in hist)
    assert hist[0].accepted_from["history"] == 0 and hist[1].accepted_from["history"] > 0
    assert plain[1].accepted_from["history"] == 0
    assert hist[1].mean_accepted > plain[1].mean_accepted


def test_shared_history_keeps_the_newest_answers_and_sends_each_replica_the_others():
    from pipeline.replica.history import SharedHistory

    h = SharedHistory(max_tokens=10)
    assert h.for_replica("a") is None
    h.collect("a", [[1, 2, 3], [4, 5, 6]])
    assert h.for_replica("a") is None  # its own answers are in its history already
    assert h.for_replica("b") == [[1, 2, 3], [4, 5, 6]]
    assert h.for_replica("b") is None  # nothing new since
    h.collect("b", [[7, 8, 9]])
    h.collect("a", [[10, 11, 12, 13]])  # 13 tokens held > 10: the oldest answer goes
    assert h.for_replica("a") == [[7, 8, 9]]
    assert h.for_replica("b") == [[10, 11, 12, 13]]
    assert h.for_replica("c") == [[4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]  # a replacement: all that is kept
    h.collect("a", [list(range(30))])  # longer than the budget: its newest tokens only
    assert h.for_replica("b") == [list(range(20, 30))]
    assert h.stats == {"answers_in": 5, "answers_out": 8, "tokens_out": 33}
    with pytest.raises(ValueError):
        SharedHistory(0)
    with pytest.raises(ConfigError, match="--history-tokens"):
        GenerationSpec(share_history=True)


def test_scheduler_carries_answers_between_replicas(ray_session):
    """With a shared history, a replica's results bring its answers to the driver and the next batch
    sent to another replica carries them (fake replicas; results are real Ray objects)."""
    import ray

    from pipeline.replica.history import SharedHistory
    from pipeline.replica.scheduler import Batch, Scheduler

    sent = []

    class Fake:
        concurrent = False

        def __init__(self, name):
            self.name = name

        def ready(self):
            return ray.put({})

        def submit(self, rows, history=None):
            sent.append((self.name, [r["id"] for r in rows], history))
            return ray.put((rows, {"answers": [[r["id"], r["id"] + 100] for r in rows]}))

        def kill(self):
            pass

    batches = [Batch(i, [{"id": i}]) for i in range(4)]
    sched = Scheduler(Fake, 2, batches, lambda *a: None, lambda *a: None, depth=1, history=SharedHistory(100))
    sched._start(), sched._start()
    for slot in sched.slots.values():
        slot.ready = True
    sched._feed()
    assert sent == [("replica-0", [0], None), ("replica-1", [1], None)]
    sched._on_task(next(r for r, n in sched.task_refs.items() if n == "replica-0"))
    sched._feed()
    assert sent[-1] == ("replica-0", [2], None)  # nothing from replica-1 yet
    sched._on_task(next(r for r, n in sched.task_refs.items() if n == "replica-1"))
    sched._feed()
    assert sent[-1] == ("replica-1", [3], [[0, 100]])  # replica-0's answer, not its own
    assert sched.history.stats["answers_in"] == 2


def test_shared_answers_feed_another_generators_history(tiny):
    """Replica B absorbs the answers replica A reported (as the driver forwards them): B's row that
    repeats A's prompt drafts from history; per-task and streaming replicas alike; output unchanged."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.streaming import StreamingRows
    from pipeline.replica.worker import RowGenerator

    model, tok = load_model(tiny)
    spec = job_spec(model=tiny, max_new_tokens=24, max_batch_size=1, budget="fixed", warmup=False,
                          history_tokens=2000, share_history=True)

    def replica():
        return RowGenerator(Engine(model, tok, spec.engine, history=spec.history_source()), spec)

    row = InputRow(0, "Hello there, said the")
    a_rows, a_stats = replica()([row])
    assert [len(a) for a in a_stats["answers"]] == [a_rows[0].n_new_tokens]
    for b in (replica(), StreamingRows(replica())):
        b_rows, b_stats = b([dataclasses.replace(row, id=1)], a_stats["answers"])
        assert b_rows[0].generation == a_rows[0].generation
        assert b_rows[0].accepted_from["history"] > 0 and a_rows[0].accepted_from["history"] == 0
        assert len(b_stats["answers"]) == 1
    assert "answers" not in RowGenerator(Engine(model, tok, spec.engine),
                                         GenerationSpec(model=tiny))([row])[1]


def test_memory_figures_say_where_bytes_live(tmp_path):
    """The replicas' memory figures: arrays located by the kind of mapping holding them, and per node
    the copies of a model and of an index counted from those (a private copy counts, a mapping once)."""
    import numpy as np

    from pipeline.job.summary import memory_section
    from pipeline.replica.resources import array_spans, process_memory, where_bytes_live

    own = np.ones(1 << 18)  # 2 MiB: malloc maps it anonymously
    path = tmp_path / "a.bin"
    path.write_bytes(bytes(1 << 20))
    shared, cow = np.memmap(path, mode="r+"), np.memmap(path, mode="c")  # MAP_SHARED, MAP_PRIVATE of a file
    assert where_bytes_live(array_spans([own, own]))["private"] == own.nbytes  # the same array counts once
    assert where_bytes_live(array_spans([shared]))["shared"] == 1 << 20
    assert where_bytes_live(array_spans([cow]))["file"] == 1 << 20
    assert where_bytes_live([(16, 8, "cuda:0"), (1, 8, "cpu")]) == {"private": 0, "shared": 0, "file": 0,
                                                                    "device": 8, "unknown": 8}
    mem = process_memory()
    assert mem["private_bytes"] >= own.nbytes and mem["Pss"] <= mem["VmRSS"] + (1 << 20)

    def info(name, private, node="n1", ref_private=0):
        ref = {"bytes": 100, "private_bytes": ref_private, "shared_bytes": 100 - ref_private,
               "zero_copy": ref_private == 0}
        return {"name": name, "pid": 1, "node_id": node, "memory": {"VmRSS": 10, "Pss": 5,
                                                                    "private_bytes": 4},
                "model_bytes": 1000, "model_private_bytes": private, "model_device_bytes": 0,
                "model_shared_bytes": 0, "model_file_bytes": 1000 - private, "references": {"notes": ref}}

    meta = {"__meta__": np.frombuffer(json.dumps({"bytes": 100}).encode(), dtype=np.uint8)}
    both_mapped = memory_section({"notes": meta}, [info("a", 0)], [info("a", 0), info("b", 0)])
    assert both_mapped["model_copies"] == 1 and both_mapped["reference_copies_per_node"] == 1
    assert both_mapped["reference_zero_copy"] is True and both_mapped["nodes"]["n1"]["private_bytes"] == 8
    copied = memory_section({"notes": meta}, [info("a", 1000)],
                            [info("a", 1000), info("b", 1000, ref_private=100), info("c", 1000, node="n2"),
                             {"name": "d", "missing": "ActorDiedError: gone"}])
    assert copied["model_copies"] == 3 and copied["nodes"]["n1"]["model_copies"] == 2
    assert (copied["nodes"]["n1"]["reference_copies"] == {"notes": 2}
            and copied["reference_copies_per_node"] == 2)
    assert copied["reference_zero_copy"] is False and copied["nodes_with_replicas"] == 2
    assert copied["replicas_not_measured"] == [{"name": "d", "error": "ActorDiedError: gone"}]


# -------------------------------------------------------------------------------------------- Ray, in-process
@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, tiny, ray_session):
    """The main end-to-end run: 20 mixed rows, 2 actors, 3 rows per task, sampling."""
    from pipeline.job.run import run_job

    d = tmp_path_factory.mktemp("mixed")
    inp = _write_jsonl(d / "in.jsonl", _mixed_rows())
    out = d / "out"
    summary = run_job(_cfg(tiny, inp, out, actors=2, batch_rows=3, messages_column="messages",
                           temperature=0.8, seed=7, part_seconds=3600,  # one part, however slow the box
                           history_tokens=2000, share_history=True))
    return inp, out, summary


def test_a_chat_template_given_to_the_job_is_applied(tmp_path, ray_session):
    """A model whose tokenizer has no chat template, chat rows and ``chat_template`` (the job's
    ``--chat-template``): every row generates, each prompt encoded with the given template."""
    from transformers import AutoTokenizer

    from pipeline.job.run import run_job

    model = tmp_path / "plain"
    save_tiny_text_model(model, chat_template=False)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    chats = [[{"role": "user", "content": f"Name colour {i}."}] for i in range(4)]
    inp = _write_jsonl(tmp_path / "chat.jsonl", [{"id": i, "messages": m} for i, m in enumerate(chats)])
    cfg = _cfg(str(model), inp, tmp_path / "out", messages_column="messages")
    cfg = dataclasses.replace(cfg, gen=dataclasses.replace(cfg.gen, chat_template=template))
    summary = run_job(cfg)
    rows = {r["id"]: r for r in _check_exactly_once(tmp_path / "out", list(range(4))).to_pylist()}
    assert summary["complete"] and all(r["error"] is None and r["n_new_tokens"] > 0 for r in rows.values())
    tok = AutoTokenizer.from_pretrained(str(model))
    text = [tok.apply_chat_template(m, chat_template=template, add_generation_prompt=True, tokenize=False)
            for m in chats]
    want = [len(tok(t).input_ids) for t in text]
    assert [rows[i]["n_prompt_tokens"] for i in range(4)] == want


def test_allow_foreign_files_runs_the_job_and_leaves_the_foreign_file_alone(tiny, tmp_path, ray_session):
    """The input file inside the output directory, allowed with ``allow_foreign_files``: a real run
    writes every row once beside it and leaves it byte for byte (the refusal without it: tests in
    test_job_output.py)."""
    from pipeline.job.run import run_job

    out = tmp_path / "out"
    out.mkdir()
    inp = _write_jsonl(out / "prompts.jsonl", [{"id": i, "prompt": f"Hello number {i}"} for i in range(4)])
    before = inp.read_bytes()
    summary = run_job(_cfg(tiny, inp, out, allow_foreign_files=True))
    assert summary["complete"] and inp.read_bytes() == before
    table = read_generations(out)
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2, 3]
    assert all(e is None for e in table.column("error").to_pylist())


def test_exactly_once_with_error_rows(mixed_run):
    inp, out, summary = mixed_run
    table = _check_exactly_once(out, list(range(20)))
    assert summary["engine"]["shared_history"]["answers_in"] == 15  # every answer reached the driver
    assert summary["output"]["part_files"] == 1  # the rows are buffered: one part for this small job
    import ray.data

    assert sorted(ray.data.read_parquet(str(out)).to_pandas()["id"]) == list(range(20))  # a dataset as it is
    rows = {r["id"]: r for r in table.to_pylist()}
    errors = {i: r["error"] for i, r in rows.items() if r["error"] is not None}
    assert errors[15] == "prompt and messages are both null"
    assert errors[16] == "empty prompt" and errors[17] == "empty prompt"
    assert "type int" in errors[18]
    assert "context is 128" in errors[19]  # found by the engine in the actor
    assert set(errors) == {15, 16, 17, 18, 19}
    for i in range(15):
        r = rows[i]
        assert r["generation"] is not None and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["n_new_tokens"] <= 12 and r["steps"] == len(r["accepted_lengths"])
        assert sum(r["accepted_lengths"]) == r["n_new_tokens"] and r["method"] == "logitspec"
    assert rows[14]["n_prompt_tokens"] > 5  # the chat row went through the chat template
    assert summary["complete"] is True
    assert summary["rows"] == {**summary["rows"], "total": 20, "done_now": 15, "failed_now": 5,
                               "skipped_already_done": 0, "in_output": 20, "missing": 0,
                               "duplicates_in_output": 0}
    assert summary["tokens"]["new_now"] == sum(rows[i]["n_new_tokens"] for i in range(15))
    assert summary["mat"]["now"] == pytest.approx(
        summary["tokens"]["new_now"] / sum(rows[i]["steps"] for i in range(15)))
    # memory, as measured in each replica alive at the end (the 2nd may still be loading when the tiny job
    # ends)
    mem = summary["memory"]
    assert (1 <= len(mem["replicas"]) == len(summary["replicas"]["startup"]) <= 2
            and not mem["replicas_not_measured"])
    for r in mem["replicas"]:
        assert r["model_bytes"] == mem["model_bytes_per_replica"] > 0
        # every parameter byte was found in one of the process's mappings
        assert sum(r[k] for k in ("model_private_bytes", "model_device_bytes", "model_shared_bytes",
                                  "model_file_bytes")) == r["model_bytes"]
        # the tiny model's float32 safetensors stay mapped from the file (no private copy per replica)
        assert r["model_file_bytes"] > 0.9 * r["model_bytes"]
        assert r["private_bytes"] > 0 and r["shared_bytes"] > 0 and r["pss_bytes"] > 0
    (node,) = mem["nodes"].values()  # one local node: its replicas share the page cache's one copy
    assert node["replicas"] == len(mem["replicas"]) and node["private_bytes"] == sum(r["private_bytes"]
                                                                                     for r in mem["replicas"])
    assert mem["model_copies"] == node["model_copies"] == pytest.approx(1.0, abs=0.01)
    assert summary["timing"]["generation_s"] > 0 and summary["timing"]["startup_s"] > 0
    on_disk = json.loads((out / "_summary.json").read_text())
    assert on_disk["rows"] == summary["rows"]


def test_resume_skips_done_rows_and_overwrite_starts_over(tmp_path, tiny, ray_session, mixed_run):
    from pipeline.job.run import run_job

    inp, _, first = mixed_run
    out = tmp_path / "out"
    s1 = run_job(_cfg(tiny, inp, out, limit=8, batch_rows=4, messages_column="messages", temperature=0.8,
                      seed=7))
    assert s1["rows"]["done_now"] == 8 and s1["complete"]
    parts = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    s2 = run_job(_cfg(tiny, inp, out, batch_rows=4, messages_column="messages", temperature=0.8, seed=7))
    assert s2["rows"]["skipped_already_done"] == 8 and s2["rows"]["done_now"] + s2["rows"]["failed_now"] == 12
    assert s2["complete"]
    for name, mtime in parts.items():  # no recompute: the first run's files are untouched
        assert (out / name).stat().st_mtime_ns == mtime
    table = _check_exactly_once(out, list(range(20)))
    # sampling seeds depend on (seed, id) only: 1 actor x 4-row tasks == 2 actors x 3-row tasks
    _, mixed_out, _ = mixed_run
    a = {r["id"]: r["generation"] for r in table.to_pylist()}
    b = {r["id"]: r["generation"] for r in read_generations(mixed_out).to_pylist()}
    assert a == b
    # nothing left: no actor starts at all
    s3 = run_job(_cfg(tiny, inp, out, messages_column="messages", temperature=0.8, seed=7))
    assert s3["rows"]["skipped_already_done"] == 20 and s3["replicas"]["started"] == 0 and s3["complete"]
    # other settings on the same output: refused, naming the difference
    with pytest.raises(ConfigError, match="request.temperature: was 0.8, now 0.0"):
        run_job(_cfg(tiny, inp, out, messages_column="messages", seed=7))
    s4 = run_job(_cfg(tiny, inp, out, messages_column="messages", seed=7, overwrite=True, limit=4))
    assert s4["rows"]["skipped_already_done"] == 0 and s4["rows"]["done_now"] == 4
    _check_exactly_once(out, list(range(4)))


def test_actor_killed_mid_job_is_replaced_and_rows_redone(tmp_path, tiny, ray_session):
    import psutil

    from pipeline.job.run import run_job

    rows = [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox jumps over the lazy dog"}
            for i in range(24)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    killed = []

    def on_event(kind, **info):
        if kind == "batch" and not killed:  # after the first finished batch, SIGKILL the actor's process
            pid = info["pid"]
            title = " ".join(psutil.Process(pid).cmdline())
            assert "EngineWorker" in title, title  # the process titled ray::EngineWorker...
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_job(_cfg(tiny, inp, tmp_path / "out", actors=1, batch_rows=3, max_new_tokens=24),
                      on_event=on_event)
    assert killed
    assert summary["replicas"]["deaths"] == 1 and summary["replicas"]["replacements"] == 1
    assert summary["replicas"]["batches_redone"] >= 1
    assert summary["complete"] and summary["rows"]["failed_now"] == 0
    _check_exactly_once(tmp_path / "out", [r["id"] for r in rows])


def test_replica_killed_after_its_last_batch_job_still_complete(tmp_path, tiny, ray_session, monkeypatch,
                                                                capsys):
    """SIGKILL the only replica right after its last batch, before the job asks the replicas for their
    memory at the end: every row is written, so the job exits 0 with ``complete: true``, each row once,
    and the dead replica is listed as not measured."""
    import functools

    import pipeline.job.run as job
    from pipeline.job.cli import main

    rows = [{"id": i, "prompt": f"Row {i}: the quick brown fox jumps"} for i in range(6)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    batches, killed = [], []

    def on_event(kind, **info):
        if kind == "batch":
            batches.append(info["batch"])
            if len(batches) == 3:  # the last of 3 two-row batches: its rows are written
                os.kill(info["pid"], signal.SIGKILL)
                killed.append(info["name"])

    monkeypatch.setattr(job, "run_job", functools.partial(job.run_job, on_event=on_event))
    out = tmp_path / "out"
    code = main(["--input", str(inp), "--output", str(out), "--model", tiny, "--address", ray_session, "-q",
                 "--batch-rows", "2", "--max-batch-size", "2", "--max-new-tokens", "6", "--no-warmup"])
    assert killed == ["replica-0"] and sorted(batches) == [0, 1, 2]
    assert code == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["complete"] is True and summary["error"] is None
    assert summary["rows"]["done_now"] == 6 and summary["rows"]["missing"] == 0
    assert summary["replicas"]["deaths"] == 0  # it died after the scheduler was done with it
    assert [m["name"] for m in summary["memory"]["replicas_not_measured"]] == ["replica-0"]
    assert summary["memory"]["replicas"] == [] and summary["memory"]["model_copies"] == 0
    _check_exactly_once(out, list(range(6)))


def _reference_job(tmp_path, tiny):
    """Rows whose continuations live in a shared corpus: the corpus holds the model's own greedy
    output for each prompt, so retrieval from the index must find it."""
    from pipeline.job.run import run_job

    prompts = [f"Note {i}: " + s for i, s in enumerate(["the cat sat on the mat",
                                                        "four score and seven years",
                                                         "permission is hereby granted",
                                                         "beautiful is better",
                                                         "in the beginning", "to be or not to be"])]
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "corpus": "notes"}
                                               for i, p in enumerate(prompts)])
    base = run_job(_cfg(tiny, inp, tmp_path / "plain", max_new_tokens=24, corpus_column="corpus"))
    gens = {r["id"]: r["generation"] for r in read_generations(tmp_path / "plain").to_pylist()}
    corpus = tmp_path / "corpus.jsonl"
    _write_jsonl(corpus, [{"text": prompts[i] + gens[i]} for i in range(len(prompts))])
    return inp, corpus, base, gens


def test_reference_index_is_shared_zero_copy_and_lossless(tmp_path, tiny, ray_session):
    from pipeline.job.run import run_job

    inp, corpus, base, gens = _reference_job(tmp_path, tiny)
    with_ref = run_job(_cfg(tiny, inp, tmp_path / "ref", max_new_tokens=24, corpus_column="corpus", actors=2,
                            references=(("notes", f"{corpus}#text"),)))
    table = read_generations(tmp_path / "ref")
    got = {r["id"]: r["generation"] for r in table.to_pylist()}
    diff = {i: (gens[i], got[i]) for i in gens if got[i] != gens[i]}
    assert not diff, f"greedy output changed with the index (row: (without, with)): {diff}"
    mat_plain = base["mat"]["per_corpus_now"]["notes"]["mat"]
    mat_ref = with_ref["mat"]["per_corpus_now"]["notes"]["mat"]
    assert mat_ref > mat_plain + 0.5, (mat_plain, mat_ref)
    assert with_ref["mat"]["per_corpus_now"]["notes"]["reference"] is True
    mem = with_ref["memory"]
    assert mem["reference_zero_copy"] is True and len(mem["replicas"]) >= 1
    size = mem["reference_indexes"]["notes"]["bytes"]
    # each actor's arrays lie in the object store's shared mapping, none in private memory
    for r in mem["replicas"]:
        assert r["reference_zero_copy"] is True
        assert r["references"]["notes"] == {"bytes": size, "private_bytes": 0, "shared_bytes": size,
                                            "zero_copy": True}
    assert mem["reference_indexes"]["notes"]["documents"] == 6 and mem["reference_copies_per_node"] == 1
    assert [n["reference_copies"] for n in mem["nodes"].values()] == [{"notes": 1}]
    # the same index prebuilt to disk by jobs/build_index.py: the job loads the same arrays
    import numpy as np
    from transformers import AutoTokenizer

    from pipeline.io.reference import prepare_reference, split_meta

    sys.path.insert(0, str(BUILD_INDEX.parent))
    try:
        import build_index
    finally:
        sys.path.remove(str(BUILD_INDEX.parent))
    idx = tmp_path / "notes.npz"
    assert build_index.main(["--corpus", f"{corpus}#text", "--output", str(idx), "--model", tiny]) == 0
    tok = AutoTokenizer.from_pretrained(tiny)
    built, meta = split_meta(prepare_reference("notes", f"{corpus}#text", tok))
    loaded, meta2 = split_meta(prepare_reference("notes", str(idx), tok))
    assert meta2["prebuilt"] and meta2["documents"] == 6 and sorted(built) == sorted(loaded)
    assert all(np.array_equal(built[k], loaded[k]) for k in built)
    other = type("OtherTokenizer", (), {"__len__": lambda self: 7, "__call__": lambda self, t, **k: type(
        "Enc", (), {"input_ids": [1, 2]})()})()
    with pytest.raises(ConfigError, match="built with another tokenizer"):
        prepare_reference("notes", str(idx), other)
    # a reference naming no corpus of the input is a typo, caught before Ray work starts
    with pytest.raises(ConfigError, match="--reference 'nots' names no corpus"):
        run_job(_cfg(tiny, inp, tmp_path / "typo", corpus_column="corpus", references=(("nots", str(idx)),)))
    assert not (tmp_path / "typo").exists()


# ---------------------------------------------------------------------------------------------- subprocesses
def _run_until_parts(cmd: list, env: dict, out: pathlib.Path, more_than: int, sig: int) -> int:
    """Start the job, send ``sig`` once the output holds more than ``more_than`` part files; its exit code."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(list(out.glob("part-*.parquet"))) <= more_than:
            assert proc.poll() is None, "the job ended before it could be stopped"
            time.sleep(0.2)
        proc.send_signal(sig)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def _ids_on_disk(out: pathlib.Path) -> list:
    return [i for p in out.glob("part-*.parquet") for i in pq.read_table(p).column("id").to_pylist()]


def test_driver_sigterm_then_sigkill_then_resume_joins_cluster_by_address(tmp_path, tiny, ray_session):
    """A `jobs/generate.py` joined to the running Ray by --address: SIGTERM after its first part file
    (exit 130, its buffered rows written, a summary saying incomplete), then a rerun SIGKILLed after its
    next part (only complete files, no summary), then a rerun that finishes every row exactly once."""
    rows = [{"id": i, "prompt": f"Line {i}: four score and seven years ago"} for i in range(20)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    cmd = [sys.executable, str(GENERATE), "--input", str(inp), "--output", str(out), "--model", tiny,
           "--address", ray_session, "--max-new-tokens", "40", "--batch-rows", "2", "--max-batch-size", "1",
           "--threads-per-actor", "1", "--no-warmup", "--part-rows", "4"]
    env = _env_without_ray_address()
    assert _run_until_parts(cmd, env, out, 0, signal.SIGTERM) == 130
    summary = json.loads((out / "_summary.json").read_text())
    after_term = _ids_on_disk(out)
    assert not summary["complete"] and "SIGTERM" in summary["error"]
    # the buffer was flushed
    assert len(after_term) == len(set(after_term)) == summary["rows"]["done_now"] > 0
    n_parts = len(list(out.glob("part-*.parquet")))
    assert _run_until_parts(cmd, env, out, n_parts, signal.SIGKILL) == -signal.SIGKILL
    n_done = len(_ids_on_disk(out))
    assert len(after_term) < n_done < 20 and not (out / "_summary.json").exists()
    p = subprocess.run(cmd + ["-q"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"]["skipped_already_done"] == n_done and summary["complete"]
    _check_exactly_once(out, list(range(20)))


def test_disk_full_in_a_job_fails_clearly_and_the_rerun_completes(tmp_path, tiny, ray_session):
    """The driver may not write files over 3,000 bytes (RLIMIT_FSIZE, as a full disk): the job exits 1
    naming the part file it could not write, leaves no part or temporary file; the rerun completes."""
    import resource

    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Row {i} says hello"} for i in range(6)])
    out = tmp_path / "out"
    cmd = [sys.executable, str(GENERATE), "--input", str(inp), "--output", str(out), "--model", tiny,
           "--address", ray_session, "--max-new-tokens", "8", "--part-rows", "2", "--threads-per-actor", "1",
           "--no-warmup", "-q"]
    env = _env_without_ray_address()

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write returns EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))

    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=small_disk)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "cannot write the part file" in p.stderr and "no partial file is left" in p.stderr
    assert not list(out.glob("part-*")) and not list(out.glob(".*"))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "_summary.json").read_text())["complete"]
    _check_exactly_once(out, list(range(6)))


def test_job_starts_its_own_local_ray_without_an_address(tmp_path, tiny):
    """`python jobs/generate.py` with no address and no $RAY_ADDRESS starts (and stops) a local Ray; the
    actor gets as many torch threads as the CPUs Ray gives it; the job writes nothing outside --output
    (HOME and the working directory are empty directories here; the model cache and Ray's temp dir aside)."""
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["Hello there", "Lorem ipsum dolor", ""])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {**_env_without_ray_address(), "HOME": str(home), "LOGITSPEC_CACHE": str(tmp_path / "cache")}
    # this process's kernel build, copied: a new cache would compile it again (a minute)
    built = skinny.build_dir()
    if built.is_dir():
        shutil.copytree(built, tmp_path / "cache" / built.relative_to(default_cache_dir()))
    p = subprocess.run([sys.executable, str(GENERATE), "--input", str(tmp_path / "in.parquet"), "--output",
                        str(tmp_path / "out"), "--model", tiny, "--max-new-tokens", "6", "--json"],
                       capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    brief = json.loads(p.stdout)  # --json; without it a few lines of text (test_job_output.py)
    # no Ray token-auth warning (RAY_AUTH_MODE set for a local Ray), no progress bar escapes from the actor
    assert "Token authentication" not in p.stderr and "\x1b[" not in p.stderr
    assert brief["complete"] and brief["rows"]["done_now"] == 2 and brief["rows"]["failed_now"] == 1
    assert "rows 3/3" in p.stderr  # progress in the driver log
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert summary["ray"]["started_here"] is True and summary["timing"]["ray_init_s"] > 0
    cpus = summary["config"]["cpus_per_actor"] or (os.cpu_count() or 1)
    assert [r["threads"] for r in summary["replicas"]["startup"]] == [max(1, int(cpus))]
    # the actor runs on tcmalloc where this machine has it (logitspec.allocator)
    assert [r["tcmalloc"] for r in summary["replicas"]["startup"]] == [allocator.library() is not None]
    _check_exactly_once(tmp_path / "out", [0, 1, 2])
    # Ray >= 2.5x turns on token auth for a new local cluster and keeps its token in ~/.ray/auth_token
    # (created once, reused by later local clusters): Ray's own file, the only one outside --output
    ray_token = {str(home / ".ray"), str(home / ".ray" / "auth_token")}
    # the run report's plots: matplotlib keeps its font cache under ~/.cache/matplotlib (~/.config too)
    mpl = (home / ".cache", home / ".config")
    outside = {str(f) for f in home.rglob("*") if not any(f == d or d in f.parents for d in mpl)}
    assert outside <= ray_token and [str(f) for f in cwd.rglob("*")] == []


def test_dry_run_plans_without_ray_and_writes_nothing(tmp_path, tiny, capsys, monkeypatch):
    import pipeline.job.run
    from pipeline.job.cli import build_parser, config_from_args, main
    from pipeline.job.plan import job_record

    def no_ray(cfg):
        raise AssertionError("--dry-run must not start or join Ray")

    monkeypatch.setattr(pipeline.job.run, "connect_ray", no_ray)

    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "Hello" if i != 3 else ""}
                                               for i in range(10)])
    out = tmp_path / "out"
    argv = ["--input", str(inp), "--output", str(out), "--model", tiny, "--batch-rows", "3", "--part-rows",
            "4"]
    store = OutputStore(out, pa.int64())  # an earlier run of this job wrote rows 0 and 1
    store.prepare(job_record(config_from_args(build_parser().parse_args(argv))), overwrite=False)
    store.write([_out_row(0), _out_row(1)])
    store.close()
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert main(argv + ["--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rows"] == 10 and plan["already_done"] == 2 and plan["to_generate"] == 7
    assert (plan["rejected_before_generation"] == 1 and plan["batches"] == 3
            and plan["part_files_at_least"] == 2)
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before


def test_remote_code_is_refused_unless_asked(tmp_path, tiny):
    import shutil

    from pipeline.io.model import check_model

    model = tmp_path / "custom"
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="custom-tiny", auto_map={"AutoConfig": "custom_config.CustomConfig"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "custom_config.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ConfigError, match="trust_remote_code"):
        check_model(str(model))


@pytest.mark.slow
def test_quick_start_on_the_embedded_model(tmp_path, ray_session):
    """The README quick start (``make demo``'s input), on 3 of its rows and 8 new tokens: the embedded
    default model."""
    from pipeline.job.run import run_job

    summary = run_job(JobConfig(input=str(REPO / "data" / "demo" / "prompts.jsonl"),
                                output=str(tmp_path / "out"), gen=job_spec(max_new_tokens=8), limit=3))
    assert summary["complete"] and summary["rows"]["done_now"] == 3
    table = read_generations(tmp_path / "out")
    assert all(g for g in table.column("generation").to_pylist())
    models = table.column("model").to_pylist()  # the resolved model and its hash, not "default"
    assert all(re.fullmatch(r"gemma3-270m \(sha256:[0-9a-f]{8}\)", m) for m in models), models


# ---------------------------------------------------------------------------------------------- fault matrix
def _fault_job(tmp_path, tiny, ray_session, monkeypatch, capsys, fault: str, n_rows: int, *flags: str,
               prompts: dict | None = None):
    """``jobs/generate.py``'s main on ``n_rows`` rows (``prompts``: some rows' own prompts) with
    ``LOGITSPEC_FAULT`` (pipeline.replica.faults) set: (summary, output table)."""
    from pipeline.job.cli import main

    monkeypatch.setenv("LOGITSPEC_FAULT", fault)
    rows = [{"id": i, "prompt": (prompts or {}).get(i, f"Row {i}: the quick brown fox jumps")}
            for i in range(n_rows)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    code = main(["--input", str(inp), "--output", str(out), "--model", tiny, "--address", ray_session, "-q",
                 "--max-batch-size", "2", "--max-new-tokens", "4", "--no-warmup", "--threads-per-actor", "1",
                 *flags])
    err = capsys.readouterr().err[-3000:]
    assert code == 0, err
    summary = json.loads((out / "_summary.json").read_text())
    return summary, _check_exactly_once(out, list(range(n_rows)))


def test_truncate_middle_cuts_longbench_rows_to_fit_and_the_output_says_so(tmp_path, tiny, ray_session):
    """``--truncate middle`` on the LongBench-format rows of data/longbench_local (about 3.8k tokens each,
    a 128-token model): every row generated from its cut prompt (124 tokens: the context less 4 new), the
    ``truncated`` column true, a short row untouched; the choice is part of the job's record."""
    from test_truncate import longbench_prompts

    from pipeline.job.cli import main

    prompts = longbench_prompts() + ["A short prompt"]
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out"
    argv = ["--input", str(inp), "--output", str(out), "--model", tiny, "--address", ray_session, "-q",
            "--max-new-tokens", "4", "--no-warmup", "--threads-per-actor", "1", "--truncate", "middle"]
    assert main(argv) == 0
    table = _check_exactly_once(out, list(range(len(prompts)))).sort_by("id").to_pylist()
    assert all(r["error"] is None for r in table)
    assert [r["truncated"] for r in table] == [True] * (len(prompts) - 1) + [False]
    assert all(r["n_prompt_tokens"] == 124 for r in table[:-1]) and table[-1]["n_prompt_tokens"] < 124
    assert json.loads((out / "_job.json").read_text())["truncate"] == "middle"


def _fault_free(tiny: str, n_rows: int, prompts: dict | None = None, max_new_tokens: int = 4) -> list[str]:
    """The greedy generations of :func:`_fault_job`'s rows without faults, Ray or batching (the job's row
    generator in this process)."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.worker import RowGenerator
    from pipeline.rows import InputRow

    model, tok = load_model(tiny)
    gen = job_spec(model=tiny, max_new_tokens=max_new_tokens)
    rows = [InputRow(i, (prompts or {}).get(i, f"Row {i}: the quick brown fox jumps")) for i in range(n_rows)]
    return [r.generation for r in RowGenerator(Engine(model, tok, gen.engine), gen)(rows)[0]]


@pytest.mark.parametrize("at, runner", [("before", "eager"), ("after", "graph"), ("layer:1", "eager")])
def test_out_of_memory_in_a_replica_splits_batches_and_the_job_goes_on(tmp_path, tiny, ray_session,
                                                                        monkeypatch, capsys, at, runner):
    """``oom:1:48[:AT]``: the replica's forwards over more than one row, or past 48 positions, raise
    MemoryError (at its model-runner seam: before the forward, after it wrote its KV, or from decoder
    layer 1's hook; the eager and the graph runner). Every 2-row batch is split and its rows run alone,
    each equal to its fault-free generation; the one long row does not fit alone and becomes an error
    row naming its size; the replica stays alive (no death, no replacement), exit 0, complete, every
    row once, the splits counted in the summary."""
    long = " ".join(["the lighthouse keeper counted his telescopes"] * 3)
    summary, table = _fault_job(tmp_path, tiny, ray_session, monkeypatch, capsys, f"oom:1:48:{at}", 6,
                                "--budget", "fixed", "--runner", runner, prompts={4: long})
    assert summary["complete"] and summary["replicas"]["deaths"] == 0 and summary["replicas"]["started"] == 1
    errors = dict(zip(table.column("id").to_pylist(), table.column("error").to_pylist()))
    assert [i for i, e in errors.items() if e] == [4]
    assert errors[4].startswith("out of memory: the prompt's") and "MiB of KV cache" in errors[4]
    assert summary["engine"]["out_of_memory_splits"] >= 3  # each 2-row batch, counted by the replica
    got = dict(zip(table.column("id").to_pylist(), table.column("generation").to_pylist()))
    want = _fault_free(tiny, 6, {4: long})
    assert [got[i] for i in (0, 1, 2, 3, 5)] == [want[i] for i in (0, 1, 2, 3, 5)]


CHAOS_SEED = 10  # its schedule over 24 rows in batches of 2 holds a kill, a hang, two OOMs and a slow batch


@pytest.mark.slow
def test_a_job_under_a_seeded_chaos_schedule_finishes_with_every_row_once(tmp_path, tiny, ray_session,
                                                                          monkeypatch, capsys):
    """``chaos:SEED:DIR`` over 24 rows on 2 replicas: SIGKILLs, a hang (SIGSTOP, found by the batch
    timeout), out-of-memory errors a few decode steps into a batch (after the step's writes), a slow
    batch, as the seeded schedule draws them. The job finishes (exit 0, complete), every row once,
    every greedy row equal to the fault-free generation, the summary's deaths equal to the kills and
    hangs injected and its out-of-memory splits to those that fired (a split whose replica died before
    reporting is not counted), the driver's and every replica process's resident memory flat through
    the run (sampled as each task came back: ``_summary.json["memory"]["through_run"]``)."""
    from pipeline.replica.faults import chaos_draw

    planned = [chaos_draw(CHAOS_SEED, i, 0)[0] for i in range(0, 24, 2)]
    assert {"kill", "hang", "oom"} <= set(planned)  # the seed exercises what the test claims
    faults = tmp_path / "faults"
    faults.mkdir()
    summary, table = _fault_job(tmp_path, tiny, ray_session, monkeypatch, capsys,
                                f"chaos:{CHAOS_SEED}:{faults}", 24, "--actors", "2", "--batch-rows", "2",
                                "--batch-timeout", "8", "--max-replacements", "12", "--budget", "fixed")
    injected = {k: len(list(faults.glob(f"{k}-*"))) for k in ("kill", "hang", "oom", "slow", "fired-oom")}
    assert injected["kill"] >= 1 and injected["hang"] == 1 and injected["oom"] >= 1, injected
    assert summary["complete"] and summary["replicas"]["deaths"] == injected["kill"] + injected["hang"]
    assert summary["replicas"]["batches_redone"] >= summary["replicas"]["deaths"]
    assert summary["engine"]["out_of_memory_splits"] <= injected["fired-oom"]
    assert injected["fired-oom"] == 0 or summary["engine"]["out_of_memory_splits"] >= 1
    rows = table.sort_by("id").to_pylist()
    assert all(r["error"] is None for r in rows)
    assert [r["generation"] for r in rows] == _fault_free(tiny, 24)
    through = summary["memory"]["through_run"]
    assert through["driver"]["samples"] == 12  # one a batch written (a batch that died returned nothing)
    assert through["driver"]["max_bytes"] - through["driver"]["first_bytes"] < 200 * 2**20
    procs = through["replica_processes"]
    assert sum(p["samples"] for p in procs) == through["driver"]["samples"]
    assert len(procs) >= 2 and all(p["max_bytes"] - p["first_bytes"] < 64 * 2**20 for p in procs), procs


@pytest.mark.slow
def test_actor_killed_twice_in_a_row_while_loading_the_model(tmp_path, tiny, ray_session, monkeypatch,
                                                             capsys):
    """The first two replica processes are SIGKILLed while they load the model (as an OOM kill would):
    each is replaced, the third runs the job; exit 0, complete, every row once. (An ``__init__`` that
    raises still fails the job after two attempts: test_config_errors... / the scheduler's rule.)"""
    kills = tmp_path / "kills"
    kills.mkdir()
    summary, table = _fault_job(tmp_path, tiny, ray_session, monkeypatch, capsys, f"load:2:{kills}", 4,
                                "--batch-rows", "2")
    assert len(list(kills.iterdir())) == 2
    assert summary["complete"] is True and summary["rows"]["failed_now"] == 0
    assert summary["replicas"]["deaths"] == 2 and summary["replicas"]["started"] == 3
    assert table.column("error").null_count == 4


@pytest.mark.slow
def test_row_that_kills_its_actor_every_time_becomes_an_error_row(tmp_path, tiny, ray_session, monkeypatch,
                                                                  capsys):
    """Row 2 SIGKILLs any process it is given: its batch is redone, split into single rows after its
    second death, and the row itself becomes an error row after it killed ``max_row_attempts`` (2)
    processes; the other rows are generated; exit 0, complete, every row once."""
    summary, table = _fault_job(tmp_path, tiny, ray_session, monkeypatch, capsys, "row:2", 5, "--batch-rows",
                                "2")
    rows = {r["id"]: r for r in table.to_pylist()}
    assert "the worker process died 2 times while generating this row" in rows[2]["error"]
    assert all(rows[i]["error"] is None and rows[i]["generation"] for i in (0, 1, 3, 4))
    assert summary["complete"] is True and summary["rows"]["failed_now"] == 1
    assert summary["replicas"]["deaths"] == 4  # batch [2, 3] twice, then row 2 alone twice


# ---------------------------------------------------------------------------------------------- --num-samples
def test_samples_have_their_own_stable_seeds(tiny):
    """A row's samples are sequences of their own: sample s of a row is the same whichever other samples
    (or rows) share its batch, and whether it shares its row's prefill (``n=``) or is generated alone (a
    resume); sample 0 keeps the seed of a one-sample row; samples differ under sampling."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.worker import RowGenerator

    assert row_seed(0, 7, 0) == row_seed(0, 7) and len({row_seed(0, 7, s) for s in range(4)}) == 4
    model, tok = load_model(tiny)
    spec = job_spec(model=tiny, max_new_tokens=8, max_batch_size=4, temperature=0.8, top_p=0.95, seed=3,
                          warmup=False)
    gen = RowGenerator(Engine(model, tok, spec.engine), spec)
    row = InputRow("a", "Hello there")
    four, stats = gen([dataclasses.replace(row, samples=(0, 1, 2, 3)), InputRow("b", "Lorem ipsum")])
    assert [(r.id, r.sample) for r in four] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    assert stats["engine"]["prefills"] == 2, "one prefill per row, shared by its samples"
    text = {r.sample: r.generation for r in four if r.id == "a"}
    assert len(set(text.values())) > 1, "samples of one prompt differ under sampling"
    one, _ = gen([row])  # no samples given: sample 0 only, as before samples existed
    later, _ = gen([dataclasses.replace(row, samples=(2,))])  # a resume that only lacks sample 2
    assert [r.sample for r in one] == [0] and one[0].generation == text[0]
    assert later[0].generation == text[2]


def test_request_columns_give_rows_their_own_settings_each_as_decoded_alone(tmp_path, tiny):
    """``--request-columns max_new_tokens,seed``: a row's own values replace the job's (a null keeps the
    job's); each row's samples equal decoding it alone with its settings, in one batch and in a streaming
    session; a bad value makes that row an error row before any replica sees it."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.job.pending import chunk_rows, pending, stream_chunks
    from pipeline.replica.streaming import StreamingRows
    from pipeline.replica.worker import RowGenerator

    none = {"max_new_tokens": None, "seed": None, "temperature": None, "top_p": None}
    rows = [{"id": 0, "prompt": "Hello there", **none, "max_new_tokens": 3},
            {"id": 1, "prompt": "Lorem ipsum dolor", **none, "seed": 9, "top_p": 0.9},
            {"id": 2, "prompt": "Once upon a time", **none, "max_new_tokens": 5, "seed": 4, "temperature": 0},
            {"id": 3, "prompt": "A bad row", **none, "max_new_tokens": 0},
            {"id": 4, "prompt": "The job's settings", **none},
            {"id": 5, "prompt": "Another bad row", **none, "temperature": -1.0}]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = _cfg(tiny, inp, tmp_path / "out", max_new_tokens=12, temperature=0.8, seed=3, num_samples=2,
               max_batch_size=4, request_columns=("max_new_tokens", "seed", "temperature", "top_p"))
    data = scan_ids(open_input(cfg))
    todo = pending(data, None, cfg.num_samples)
    got = [x for c in stream_chunks(data, cfg, todo.todo) for x in chunk_rows(c, cfg, None, {})]
    assert [p for _, p in got[:3]] == [None] * 3 and got[4][1] is None
    assert "--request-columns: max_new_tokens must be >= 1" in got[3][1]
    assert "--request-columns: temperature must be >= 0" in got[5][1]
    inputs = [r for r, p in got if p is None]
    job = cfg.request
    assert [r.request for r in inputs] == [job.with_(max_new_tokens=3), job.with_(seed=9, top_p=0.9),
                                           job.with_(max_new_tokens=5, seed=4, temperature=0), None]
    model, tok = load_model(tiny)
    batch, _ = RowGenerator(Engine(model, tok, cfg.gen.engine), cfg.gen)(inputs)
    stream, _ = StreamingRows(RowGenerator(Engine(model, tok, cfg.gen.engine), cfg.gen))(inputs)
    assert [(r.id, r.sample) for r in batch] == [(i, s) for i in (0, 1, 2, 4) for s in (0, 1)]
    for k, r in enumerate(inputs):
        own = dataclasses.replace(cfg.gen, request=r.request or job)
        alone, _ = RowGenerator(Engine(model, tok, own.engine),
                                own)([dataclasses.replace(r, request=None)])
        mine = batch[2 * k:2 * k + 2]
        assert [x.generation for x in mine] == [x.generation for x in stream[2 * k:2 * k + 2]] \
            == [x.generation for x in alone], r.id
        assert all(x.error is None and x.n_new_tokens <= own.request.max_new_tokens for x in mine)
    assert max(x.n_new_tokens for x in batch[6:]) > 5  # the job's 12 where the row sets none


def test_pending_keys_per_sample():
    """Which (id, sample) pairs a resume still has to do: whole rows, and the missing samples of rows
    partly written; keys of other ids or samples beyond --num-samples do not count."""
    from pipeline.job.pending import InputIndex, pending

    index = InputIndex(None, pa.array([10, 11, 12]), pa.int64(), False)
    written = pa.table({"id": pa.array([10, 10, 11, 99, 12, 12], pa.int64()),
                        "sample": pa.array([0, 1, 1, 0, 0, 5], pa.int32())})
    p = pending(index, written, 2)
    assert p.todo.tolist() == [False, True, True] and p.missing == {11: [0], 12: [1]}
    assert (p.done, p.rows, p.keys) == (4, 2, 2)
    assert pending(index, None, 3).keys == 9
    own = InputIndex(None, pa.array([10, 11, 12]), pa.int64(), False, samples=np.array([1, 3, 2]))
    p = pending(own, written, 2)  # rows' own counts: 10 wants 1 sample, 11 wants 3, 12 wants 2
    assert p.todo.tolist() == [False, True, True] and p.missing == {11: [0, 2], 12: [1]}
    assert (p.done, p.rows, p.keys) == (3, 2, 3) and pending(own, None, 2).keys == 6


def test_num_samples_exactly_once_per_sample_across_a_resume(tmp_path, tiny, ray_session):
    """``--num-samples``: a first run (2 rows x 2 samples), then a resume with 3 samples per row over 4
    rows: it adds sample 2 to the first rows and all samples to the others; each (id, sample) once, the
    first run's samples untouched, the samples of a row distinct under sampling."""
    from pipeline.job.run import run_job

    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Row {i}: the quick brown fox"}
                                               for i in range(4)])
    out = tmp_path / "out"
    kw = dict(temperature=0.8, seed=5, batch_rows=2, max_new_tokens=6)
    s1 = run_job(_cfg(tiny, inp, out, limit=2, num_samples=2, **kw))
    assert s1["complete"] and s1["rows"]["total"] == 4 and s1["rows"]["done_now"] == 4
    first = {(r["id"], r["sample"]): r["generation"] for r in read_generations(out).to_pylist()}
    s2 = run_job(_cfg(tiny, inp, out, num_samples=3, **kw))
    assert s2["complete"] and s2["rows"]["skipped_already_done"] == 4 and s2["rows"]["done_now"] == 8
    table = read_generations(out)
    keys = list(zip(table.column("id").to_pylist(), table.column("sample").to_pylist()))
    assert sorted(keys) == [(i, s) for i in range(4) for s in range(3)], "every (id, sample) exactly once"
    got = {(r["id"], r["sample"]): r["generation"] for r in table.to_pylist()}
    assert all(got[k] == v for k, v in first.items())
    assert all(len({got[(i, s)] for s in range(3)}) > 1 for i in range(4))


# ----------------------------------------------------------------------------------------- streaming replicas
def _mixed_length_rows(tiny: str, n: int = 16) -> list[dict]:
    """Rows whose answers have very different lengths: short prompts run to --max-new-tokens, long ones
    (near the tiny model's 128-token context) stop after a few tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    filler = tok("the cat sat on the mat and the dog ran " * 30).input_ids
    rows = []
    for i in range(n):
        prompt = f"Row {i}: the quick brown fox" if i % 3 == 0 else tok.decode(filler[:112 + i % 5])
        rows.append({"id": i, "prompt": prompt})
    return rows


def test_streaming_replica_keeps_slots_full_with_identical_outputs(tmp_path, tiny, ray_session):
    """One actor, batch 4, 4-row tasks of mixed-length rows: the streaming replica (one engine session
    across tasks) decodes more rows per forward than task by task (``--no-stream``), as the tasks'
    real engine stats say, and both give every row once with the engine's own greedy generations."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.job.run import run_job

    rows = _mixed_length_rows(tiny)
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    kw = dict(max_batch_size=4, batch_rows=4, max_new_tokens=40)
    stream = run_job(_cfg(tiny, inp, tmp_path / "stream", **kw))
    per_task = run_job(_cfg(tiny, inp, tmp_path / "tasks", stream=False, **kw))
    got = {}
    for name, summary in (("stream", stream), ("tasks", per_task)):
        assert summary["complete"] and summary["rows"]["failed_now"] == 0
        got[name] = {r["id"]: r["generation"] for r in _check_exactly_once(tmp_path / name,
                                                                           list(range(16))).to_pylist()}
    assert stream["engine"]["stream"] and not per_task["engine"]["stream"]
    assert stream["engine"]["occupancy"] > per_task["engine"]["occupancy"] + 0.1, (stream["engine"],
                                                                                   per_task["engine"])
    assert stream["engine"]["batch_steps"] < per_task["engine"]["batch_steps"]
    model, tok = load_model(tiny)
    gen = _cfg(tiny, inp, tmp_path / "x", **kw).gen
    direct = Engine(model, tok, gen.engine).generate([r["prompt"] for r in rows], max_new_tokens=40)
    assert got["stream"] == got["tasks"] == {r["id"]: d.text for r, d in zip(rows, direct)}
    assert len({len(d.token_ids) for d in direct}) > 3  # the lengths did vary


def test_streaming_replica_samples_equal_the_per_task_path(tmp_path, tiny, ray_session):
    """``--num-samples 3 --temperature 0.8``: the streaming replica's samples are the per-task path's
    (:class:`pipeline.replica.worker.RowGenerator` on the same rows) for every (id, sample), each once."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.job.run import run_job
    from pipeline.replica.worker import RowGenerator

    rows = _mixed_length_rows(tiny, 9)
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = _cfg(tiny, inp, tmp_path / "out", max_batch_size=4, batch_rows=2, max_new_tokens=24,
               temperature=0.8, seed=3, num_samples=3)
    summary = run_job(cfg)
    assert summary["complete"] and summary["rows"]["total"] == 27 and summary["rows"]["done_now"] == 27
    table = read_generations(tmp_path / "out")
    got = {(r["id"], r["sample"]): r["generation"] for r in table.to_pylist()}
    assert len(got) == table.num_rows == 27
    model, tok = load_model(tiny)
    per_task, _ = RowGenerator(Engine(model, tok, cfg.gen.engine), cfg.gen)(
        [InputRow(r["id"], r["prompt"], samples=(0, 1, 2)) for r in rows])
    assert got == {(r.id, r.sample): r.generation for r in per_task}
    assert len(set(got.values())) > 20  # samples differ


def test_deaths_on_a_concurrent_replica_count_for_every_batch_and_suspects_run_alone():
    """The scheduler's rules for replicas whose tasks share one session (no Ray: fake replicas, the
    scheduler's own feed and death handling): a death counts against every batch in flight; a batch
    that saw a death, and each row split off a batch, is sent only to a replica with nothing in
    flight and nothing joins it; a sequential replica keeps the old rule (the oldest batch only)."""
    import itertools

    from pipeline.replica.scheduler import Batch, Scheduler

    class Fake:
        def __init__(self, name, concurrent):
            self.name, self.concurrent, self.refs = name, concurrent, itertools.count()

        def ready(self):
            return (self.name, "ready")

        def submit(self, rows, history=None):
            return (self.name, next(self.refs))

        def kill(self):
            pass

    def run(concurrent: bool):
        failed = []
        batches = [Batch(0, [{"id": 0}, {"id": 1}]), Batch(1, [{"id": 2}, {"id": 3}]), Batch(2, [{"id": 4}])]
        sched = Scheduler(lambda name: Fake(name, concurrent), 1, batches, lambda *a: None,
                          lambda rows, why: failed.extend(r["id"] for r in rows))
        sched._start()
        (name, slot), = sched.slots.items()
        slot.ready = True
        sched._feed()
        assert [b.key for _, b in slot.inflight] == [0, 1]  # two batches in flight, as before
        sched._lost(name, RuntimeError("killed"))
        return sched, failed

    sched, _ = run(concurrent=False)
    assert [(b.key, b.deaths) for b in sched.queue] == [(0, 1), (1, 0)]  # the running one only
    sched, failed = run(concurrent=True)
    assert [(b.key, b.deaths) for b in sched.queue] == [(0, 1), (1, 1)]  # both were running
    (name, slot), = sched.slots.items()  # the replacement
    slot.ready = True
    sched._feed()
    assert [b.key for _, b in slot.inflight] == [0]  # a suspect runs alone ...
    slot.inflight.clear()
    sched.task_refs.clear()
    sched._feed()
    assert [b.key for _, b in slot.inflight] == [1]  # ... and the next suspect too
    sched._lost(name, RuntimeError("killed again"))  # batch 1 died alone: its second death, split
    assert [(b.rows[0]["id"], b.alone) for b in sched.queue][:2] == [(2, True), (3, True)]
    for _ in range(2):  # row 2 kills every replica it is alone on: an error row after 2 deaths
        (name, slot), = sched.slots.items()
        slot.ready = True
        sched._feed()
        assert [b.rows for _, b in slot.inflight] == [[{"id": 2}]]
        sched._lost(name, RuntimeError("killed by row 2"))
    assert failed == [2]
    (name, slot), = sched.slots.items()
    slot.ready = True
    sched._feed()
    assert [b.rows for _, b in slot.inflight] == [[{"id": 3}]]  # row 3 alone


def test_shipped_synthetic_prompts_are_current_and_readable():
    """data/synthetic/prompts.jsonl is what its generator builds, and the job's reader takes both its
    plain-text and its chat-messages column."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_prompts", REPO / "data" / "synthetic"
                                                  / "make_prompts.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    path = REPO / "data" / "synthetic" / "prompts.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == make.rows()
    for column in (None, "messages"):
        cfg = JobConfig(input=str(path), output="unused", messages_column=column)
        assert len(scan_ids(open_input(cfg)).ids) == len(make.rows()) == 21


def test_request_columns_refuse_values_of_the_wrong_type(tmp_path, tiny):
    """A --request-columns value of the wrong type (text, a bool, a fraction where an integer is due, a
    sample count out of range, a stop that is not text) makes its row an error row naming the column;
    numbers of either kind are temperatures; a stop is a string or a list of strings."""
    from pipeline.job.pending import row_requests

    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": "x"}])
    cfg = _cfg(tiny, inp, tmp_path / "out", temperature=0.8, request_columns=("temperature", "top_k"))
    t = pa.table({"temperature": pa.array(["hot", None, None]), "top_k": pa.array([None, True, None])})
    got = row_requests(t, cfg)
    assert "temperature must be a number" in got[0][1] and "top_k must be an integer" in got[1][1]
    assert got[2] == (None, None)
    floats = pa.table({"temperature": pa.array([0.5, 1]), "top_k": pa.array([3, None])})
    assert [r for r, _ in row_requests(floats, cfg)] == [cfg.request.with_(temperature=0.5, top_k=3),
                                                        cfg.request.with_(temperature=1.0)]
    own = _cfg(tiny, inp, tmp_path / "out", request_columns=("n", "stop"))
    t = pa.table({"n": pa.array([0, 2000, 2, None]), "stop": pa.array([None, None, [""], ["\n", "."]])})
    got = row_requests(t, own)
    assert "n must be an integer from 1 to 1024" in got[0][1] and "n must be" in got[1][1]
    assert "stop strings must be non-empty" in got[2][1]
    assert got[3] == (own.request.with_(stop=("\n", ".")), None)


def test_a_silent_replica_is_given_up_after_the_batch_timeout_and_an_unplaced_one_after_the_start_timeout():
    """The driver never waits forever (no Ray: fake replicas that never answer, the scheduler's own
    checks): a replica with work in flight that returns nothing for ``batch_timeout_s`` is killed and
    replaced, its batches go back to the queue and the death log says why; replicas that never become
    ready fail the job after ``start_timeout_s``, naming the reason."""
    import itertools

    import pytest

    from pipeline.replica.scheduler import Batch, JobFailed, Scheduler

    class Silent:
        refs = itertools.count()
        killed = []

        def __init__(self, name):
            self.name = name

        def ready(self):
            return (self.name, "ready")

        def submit(self, rows, history=None):
            return (self.name, next(self.refs))

        def kill(self):
            self.killed.append(self.name)

    now = [0.0]  # the scheduler's clock, moved by the test: no wall-clock margin to lose under load
    clock = lambda: now[0]  # noqa: E731
    batches = [Batch(0, [InputRow(0, "a")]), Batch(1, [InputRow(1, "b")])]
    sched = Scheduler(Silent, 1, batches, lambda *a: None, lambda *a: None, batch_timeout_s=5.0, clock=clock)
    sched._start()
    (name, slot), = sched.slots.items()
    slot.ready, slot.info = True, {"node_id": "n1"}
    sched._feed()
    now[0] = 4.9
    sched._check_timeouts()
    assert name in sched.slots  # not silent for long yet
    now[0] = 5.1
    sched._check_timeouts()
    assert name not in sched.slots and Silent.killed == [name] and len(sched.slots) == 1  # replaced
    assert [b.key for b in sched.queue] == [0, 1]
    lost = sched.stats.death_log[0]
    assert lost["node_id"] == "n1" and lost["rows_redone"] == [0, 1] and "no result from" in lost["error"]
    assert "--batch-timeout" in lost["error"]

    now[0] = 0.0
    never = Scheduler(Silent, 1, [Batch(0, [InputRow(0, "a")])], lambda *a: None, lambda *a: None,
                      start_timeout_s=5.0, clock=clock)
    never._start()
    now[0] = 5.1
    never._check_timeouts()  # the first replica given up, a second one started
    now[0] = 10.2
    with pytest.raises(JobFailed, match="not ready .* after it was started .*--start-timeout"):
        never._check_timeouts()
