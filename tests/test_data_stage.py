"""The Ray Data stage (pipeline/data_stage.py): read_parquet -> filter -> our stage -> write_parquet on a
local Ray, greedy generations equal to the job's, per-row sampling_params, statistics columns, error
rows or a failed stage naming the row, two actors finishing every row once."""
import dataclasses
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from job_specs import job_spec
from test_pipeline import _cfg, _write_jsonl, ray_session, tiny  # noqa: F401 - fixtures shared

from pipeline.data_stage import OUTPUTS, ProcessorConfig, build_processor
from pipeline.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.ray]
REPO = pathlib.Path(__file__).resolve().parents[1]

PROMPTS = ["The quick brown fox jumps over", "Lorem ipsum dolor sit amet", "Once upon a time there was",
           "A short row", "Tell me about the river", "Another prompt here", "Skip this one", "Last of them"]


def _gen(model, **kw):
    return job_spec(model=model, budget="fixed", max_batch_size=2, max_new_tokens=8, warmup=False, **kw)


def _input(tmp_path) -> str:
    rows = [{"id": i, "prompt": p, "keep": i != 6, "sampling_params": None} for i, p in enumerate(PROMPTS)]
    rows[1]["sampling_params"] = {"max_tokens": 3}
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _run(stage, src, out, blocks: int = 4):
    import ray

    ds = ray.data.read_parquet(src).repartition(blocks).filter(expr="keep")  # blocks for two actors
    stage(ds).write_parquet(str(out))
    return pq.read_table(out).sort_by("id")


def test_the_stage_equals_the_job_row_for_row_on_two_actors(tmp_path, tiny, ray_session):  # noqa: F811
    """read_parquet -> filter -> stage (2 actors, batches of 2, two batches in flight each) ->
    write_parquet, a reference corpus shared by the actors: every kept row once with its input
    columns; greedy text equal to the job's on the same rows; ``sampling_params.max_tokens = 3`` gives
    3 tokens; the statistics columns filled."""
    from pipeline.io.output import read_generations
    from pipeline.job.run import run_job

    src = _input(tmp_path)
    corpus = str(REPO / "data" / "sample_corpus")  # drafts only: the greedy text is the job's without it
    config = ProcessorConfig(gen=_gen(tiny), concurrency=2, batch_size=2, num_cpus=0.5, threads=1,
                             references=(("default", corpus),))
    got = _run(build_processor(config), src, tmp_path / "out")
    assert got.column("id").to_pylist() == [i for i in range(len(PROMPTS)) if i != 6]
    assert set(OUTPUTS) | {"prompt", "keep", "sampling_params"} <= set(got.column_names)
    rows = {r["id"]: r for r in got.to_pylist()}
    assert rows[1]["num_generated_tokens"] == 3 and all(r["error"] is None for r in rows.values())
    assert all(r["steps"] >= 1 and r["mean_accepted"] >= 1 and r["num_input_tokens"] > 0
               and len(r["accepted_lengths"]) == r["steps"] for r in rows.values())

    kept = [(i, p) for i, p in enumerate(PROMPTS) if i != 6]
    rows_in = [{"id": i, "prompt": p, "max_new_tokens": 3 if i == 1 else None} for i, p in kept]
    inp = _write_jsonl(tmp_path / "job.jsonl", rows_in)
    cfg = _cfg(tiny, inp, tmp_path / "job", max_new_tokens=8, request_columns=("max_new_tokens",))
    assert run_job(cfg)["complete"]
    job = {r["id"]: r["generation"] for r in read_generations(tmp_path / "job").to_pylist()}
    assert {i: r["generated_text"] for i, r in rows.items()} == job


def test_a_failed_row_is_an_error_row_or_fails_the_stage_naming_it(tmp_path, tiny, ray_session):  # noqa: F811
    """``sampling_params.n = 2`` brings a row back twice (samples 0 and 1); an empty prompt and a
    fractional ``max_tokens`` are error rows with ``should_continue_on_error``; without it the stage
    fails naming the first such row."""
    import ray

    rows = [{"id": 0, "prompt": "Fine row", "sampling_params": {"n": 2, "max_tokens": None}},
            {"id": 1, "prompt": "   ", "sampling_params": None},
            {"id": 2, "prompt": "Also fine", "sampling_params": {"n": None, "max_tokens": 2.5}}]
    config = ProcessorConfig(gen=_gen(tiny, temperature=0.8), batch_size=4, num_cpus=0.5, threads=1,
                             should_continue_on_error=True)
    got = sorted(build_processor(config)(ray.data.from_items(rows)).take_all(),
                 key=lambda r: (r["id"], r["sample"]))
    assert [(r["id"], r["sample"]) for r in got] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    assert got[0]["generated_text"] and got[0]["generated_text"] != got[1]["generated_text"]
    assert got[2]["error"] == "empty prompt" and got[2]["generated_text"] is None
    assert "max_tokens must be an integer" in got[3]["error"]
    strict = build_processor(dataclasses.replace(config, should_continue_on_error=False))
    with pytest.raises(Exception, match=r"empty prompt") as e:
        strict(ray.data.from_items(rows)).take_all()
    assert '"id": 1' in str(e.value)


def test_the_stage_is_refused_before_any_actor_for_a_bad_config(tiny):  # noqa: F811
    with pytest.raises(ConfigError, match="concurrency"):
        ProcessorConfig(concurrency=(3, 1))
    with pytest.raises(ConfigError, match="logitspec job --tp 2"):
        ProcessorConfig(tp=2)
    with pytest.raises(ConfigError, match="model"):
        build_processor(ProcessorConfig(gen=_gen("/nonexistent/model")))
    with pytest.raises(ConfigError, match="chat template"):
        build_processor(ProcessorConfig(gen=dataclasses.replace(_gen(tiny_without_template()), chat=True)))


def test_the_stage_on_the_embedded_model_equals_the_jobs_generations(tmp_path, ray_session):  # noqa: F811
    """The embedded model through read_parquet -> filter -> stage -> write_parquet, a text row and a
    messages row (the given chat template): the same greedy text as the job's row generator (the
    replica's code without Ray) gives the same rows in this process."""
    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.replica.worker import RowGenerator
    from pipeline.rows import InputRow

    gen = job_spec(model="default", max_new_tokens=6, warmup=False, max_batch_size=2, budget="fixed",
                   chat_template=TEMPLATE)
    rows = [{"id": 0, "prompt": "The capital of France is", "messages": None, "keep": True},
            {"id": 1, "prompt": "Dropped by the filter", "messages": None, "keep": False},
            {"id": 2, "prompt": None, "keep": True,
             "messages": [{"role": "user", "content": "Name a colour."}]}]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    got = _run(build_processor(ProcessorConfig(gen=gen, num_cpus=0.5, threads=2)), str(src), tmp_path / "out")
    model, tok = load_model("default")
    tok.chat_template = TEMPLATE
    kept = [r for r in rows if r["keep"]]
    want, _ = RowGenerator(Engine(model, tok, gen.engine), gen)(
        [InputRow(r["id"], r["messages"] or r["prompt"]) for r in kept])
    assert got.column("id").to_pylist() == [0, 2]
    assert got.column("generated_text").to_pylist() == [w.generation for w in want]
    assert all(r["error"] is None and r["num_generated_tokens"] == 6 and r["steps"] >= 1
               for r in got.to_pylist())


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def tiny_without_template():
    import tempfile

    from tiny_models import save_tiny_text_model

    path = tempfile.mkdtemp(prefix="tiny-no-template-")
    save_tiny_text_model(path, chat_template=False)
    return path
