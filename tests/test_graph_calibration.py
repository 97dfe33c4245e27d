"""The auto budget's cost curve measured through the runner the engine uses: the
graph runner's padded static steps (eager on CPU), its curve stored under a key of its own."""
import json
from dataclasses import replace

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.worker import calibrate
from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.gpu import GraphRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def small_grid(monkeypatch):
    """The quick CPU grid, smaller (its batch sizes kept): what an engine measures on first use."""
    small = replace(calibrate.CPU_QUICK, tokens=(1, 2, 4), per_row=(1, 2))
    monkeypatch.setattr(calibrate, "CPU_QUICK", small)


def _named(family="llama", name="tiny-graph-curve"):
    model = tiny_model(family)
    model.config._name_or_path = name
    return model


def test_measuring_through_the_graph_runner_takes_its_static_steps():
    runner = GraphRunner(_named(), max_rows=4, max_len=128, key_block=16)
    curve = calibrate.measure(runner, tokens=(1, 2, 4), context=12, reps=1, warmup=0, batch_rows=(2, 4),
                              batch_tokens=(1, 2))
    assert curve.tokens == [1, 2, 4] and sorted(curve.batches) == [2, 4]
    assert curve.batches[4].tokens == [1, 2] and all(s > 0 for s in curve.batches[4].seconds)
    assert curve.head is not None
    # the steps ran over the slots in the row and node buckets the engine's steps use, not eagerly
    assert runner.counters["replays"] > 0
    assert {(r, t) for r, t, _ in runner.buckets} >= {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2)}


def test_the_runner_is_part_of_the_stored_curves_key():
    model = _named()
    eager, graph = EagerRunner(model), GraphRunner(model, max_rows=2, max_len=64)
    assert calibrate.runner_fingerprint(eager) == "eager"
    assert calibrate.runner_fingerprint(graph) == "graph:sdpa:uncaptured:key_block=256"
    flex = GraphRunner(model, max_rows=2, max_len=128, attention="flex")
    assert calibrate.runner_fingerprint(flex).startswith("graph:flex:")
    paths = {calibrate.curve_path(model, head=eager.head, runner=calibrate.runner_fingerprint(r))
             for r in (eager, graph, flex)}
    assert len(paths) == 3


def test_rows_beyond_the_runners_slots_are_measured_at_its_slots():
    grid = calibrate.grid_for("cuda")  # batch sizes 8, 32, 64
    assert calibrate.rows_for(grid, 4, limit=4) == (4,)
    assert calibrate.rows_for(grid, 40, limit=40) == (8, 32, 40)
    assert calibrate.rows_for(grid, 64, limit=64) == (8, 32, 64)
    assert calibrate.rows_for(grid, 1, limit=1) == ()


def test_load_or_measure_stores_the_graph_curve_apart(tmp_path, monkeypatch, small_grid):
    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path))
    # this test counts what is stored: a 1-rep curve of a tiny model's sub-millisecond forwards may
    # fail the speed control by jitter alone (the control has a test of its own)
    monkeypatch.setattr(calibrate, "SETTLED", float("inf"))
    model = _named("qwen2")
    runner = GraphRunner(model, max_rows=3, max_len=384, key_block=64)
    measured = []
    real = calibrate.measure

    def counting(target, **k):
        measured.append((calibrate.runner_fingerprint(target), k["batch_rows"]))
        return real(target, **{**k, "reps": 1})

    monkeypatch.setattr(calibrate, "measure", counting)
    curve = calibrate.load_or_measure(runner, 3)  # the CPU grid's 4 rows do not fit 3 slots: 3 rows
    assert sorted(curve.batches) == [3]
    calibrate.load_or_measure(runner, 3)  # stored
    assert measured == [(runner.kind, (3,))]
    stored = [json.loads(p.read_text()) for p in (tmp_path / "calibration").glob("*.json")]
    assert [d["runner"] for d in stored] == [runner.kind] and "3" in stored[0]["batches"]
    calibrate.load_or_measure(EagerRunner(model), 3)  # the eager runner's curve is its own
    assert measured[-1] == ("eager", (4,))
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_the_engine_measures_its_curve_through_the_graph_runner_before_the_rows(tmp_path, monkeypatch,
                                                                               small_grid):
    """With the auto budget, an engine over the graph runner measures its curve when a session opens
    (the measurement takes the runner's one slot storage, which the session's rows then hold), and
    decodes as the eager engine does."""
    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path))
    prompts = repetitive_prompts(3, seed=5)
    config = SpecConfig(method="logitspec", budget="auto", max_batch_size=3)
    runner = GraphRunner(_named("gemma3"), max_rows=3, max_len=384, key_block=64)
    engine = Engine(runner.model, None, config, runner=runner)
    assert engine.policy.cost_curve is None
    session = engine.open()
    assert engine.policy.cost_curve is not None and runner.kv.rows == 0
    stored = [json.loads(p.read_text()) for p in (tmp_path / "calibration").glob("*.json")]
    assert [d["runner"] for d in stored] == [runner.kind]
    for p in prompts:
        session.submit(p)
    with torch.inference_mode():
        got = sorted(session.drain(), key=lambda r: r.request_id)
    plain = Engine(tiny_model("gemma3"), None, SpecConfig(method="ar", max_batch_size=3)).run(prompts)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain.results]


def test_calibrate_cli_measures_through_the_runner_asked_for(tmp_path, monkeypatch, capsys):
    from logitspec.cli import main

    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    assert main(["calibrate", "--model", str(model_dir), "--context", "16", "--reps", "1",
                 "--runner", "graph"]) == 0
    out = capsys.readouterr().out
    assert "runner: graph:sdpa:uncaptured" in out and "\n32 rows:\n" in out
    stored = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["runner"].startswith("graph:sdpa")
