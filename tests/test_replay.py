"""Acceptance traces: recorded by the real engine, replayed exactly on another (random) model."""
import dataclasses
import json

import pytest
from tiny_models import repetitive_prompts, save_tiny_text_model, tiny_model, write_two_questions

from logitspec import Engine, SpecConfig
from logitspec.bench.replay import REPLAYED, replay, run_once
from logitspec.bench.trace import Trace, TraceRecorder, load_traces
from logitspec.cli import main
from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.gpu import GraphRunner

N_NEW = 20
RECORDED = ("pld", "rest", "lookahead", "logitspec")  # every drafting method records and replays


def record(model, method: str, prompts, batch: int = 2) -> tuple[Trace, list]:
    """A trace of ``method`` on ``prompts`` and the run's results."""
    rec = TraceRecorder()
    engine = Engine(model, None, SpecConfig(method=method, budget="fixed", max_batch_size=batch),
                    step_observer=rec)
    run = engine.run(prompts, max_new_tokens=N_NEW)
    seqs = rec.take(run.results, [f"p{i}" for i in range(len(prompts))])
    return Trace("tiny-llama", method, "repetitive", batch, N_NEW, tuple(seqs), {"note": "test"}), run.results


@pytest.fixture(scope="module")
def recorded():
    model = tiny_model("llama")
    prompts = repetitive_prompts(5, seed=1)
    return {m: record(model, m, prompts) for m in RECORDED}, model, prompts


def test_recording_leaves_output_unchanged_and_trace_round_trips(recorded, tmp_path):
    traces, model, prompts = recorded
    plain = Engine(model, None, SpecConfig(method="ar", max_batch_size=2)).generate(prompts,
                                                                                  max_new_tokens=N_NEW)
    for method, (trace, results) in traces.items():
        assert [r.token_ids for r in results] == [r.token_ids for r in plain], method
        assert trace.mat > 1.05, method  # drafts were accepted, or the replay below proves little
        assert [s.emitted for s in trace.sequences] == [tuple(r.stats["accepted_lengths"]) for r in results]
    trace = traces["logitspec"][0]
    for name in ("t.json.gz", "t.json"):
        assert Trace.load(trace.save(tmp_path / name)) == trace
    assert load_traces(tmp_path) == [trace, trace]
    assert (tmp_path / "t.json.gz").stat().st_size < (tmp_path / "t.json").stat().st_size


def test_malformed_traces_are_refused(recorded):
    trace = recorded[0]["pld"][0]
    obj = trace.to_dict()
    obj["sequences"][0]["last"][0] = 99  # outside its tree
    with pytest.raises(ValueError, match="accepted node 99 outside"):
        Trace.from_dict(obj)
    with pytest.raises(ValueError, match="not a logitspec-trace"):
        Trace.from_dict({"format": "other"})
    obj = trace.to_dict()
    obj["sequences"][0]["emitted"].append(3)  # a forward without a tree
    with pytest.raises(ValueError, match="need steps"):
        Trace.from_dict(obj)


def test_replay_reproduces_recorded_acceptance_on_another_model(recorded):
    traces, _, _ = recorded
    other = tiny_model("qwen2", seed=7)
    for method, (trace, _) in traces.items():
        for batch in (1, 7):  # 7 rows over 5 recorded sequences: two replayed twice
            got = run_once(other, trace, method, batch, EagerRunner(other), warmup_tokens=4)
            n = len(trace.sequences)
            assert got["rows"] == max(batch, n)
            want = [list(trace.sequences[i % n].emitted) for i in range(got["rows"])]
            assert got["accepted_lengths"] == want
            if batch <= n:
                assert got["mat"] == pytest.approx(trace.mat)


def test_replay_through_the_graph_runner(recorded):
    traces, _, _ = recorded
    other = tiny_model("gemma3", seed=3)
    trace = traces["logitspec"][0]
    got = run_once(other, trace, "logitspec", 4, GraphRunner(other, max_rows=4, max_len=128, key_block=16),
                   warmup_tokens=0)
    assert got["accepted_lengths"] == [list(s.emitted) for s in trace.sequences]


def test_ar_replay_is_plain_decoding(recorded):
    traces, _, _ = recorded
    other = tiny_model("qwen2", seed=7)
    trace = traces["pld"][0]
    got = run_once(other, trace, "ar", 2, EagerRunner(other), warmup_tokens=0)
    from logitspec.bench.replay_drafter import replay_plan

    prompts, requests, _ = replay_plan(trace, 2, 96)
    plain = Engine(other, None, SpecConfig(method="ar", max_batch_size=2)).generate(prompts, requests)
    assert got["token_ids"] == [r.token_ids for r in plain]
    assert got["mat"] == 1.0


def test_replay_refuses_a_trace_that_does_not_fit(recorded):
    trace = recorded[0]["logitspec"][0]
    seq = trace.sequences[0]
    long = dataclasses.replace(trace, sequences=(dataclasses.replace(seq, prompt_tokens=5000),))
    other = tiny_model("qwen2", seed=7, max_position_embeddings=256)
    with pytest.raises(ValueError, match="needs 5.* positions .* context is 256"):
        run_once(other, long, "logitspec", 1, EagerRunner(other), warmup_tokens=0)
    # the acceptance override takes only the replay drafter's trees (never a pruned or other tree)
    from logitspec.bench.replay_drafter import recorded_last
    from logitspec.spec_decode.tree import DraftTree

    with pytest.raises(ValueError, match="ReplayDrafter's trees"):
        recorded_last([DraftTree.single(3)])

def test_replay_result_labels_and_speed_ups(recorded):
    traces, _, _ = recorded
    other = tiny_model("llama", seed=9)
    out = replay(other, [t for t, _ in traces.values()], batch_sizes=(2,), warmup_tokens=0,
                 runner_for=lambda m, rows: EagerRunner(m))
    assert out["label"] == REPLAYED
    res = out["traces"]["tiny-llama/repetitive"]
    assert set(res["results"]) == {f"{m}@2" for m in ("ar", *RECORDED)}
    assert res["results"]["ar@2"]["x_ar"] == 1.0
    assert all(r["ms_per_token"] > 0 and r["x_ar"] > 0 for r in res["results"].values())
    assert res["recorded"]["logitspec"]["mat"] == traces["logitspec"][0].mat


def test_trace_commands_record_and_replay(tmp_path, capsys):
    save_tiny_text_model(tmp_path / "m")
    questions = write_two_questions(tmp_path / "question.jsonl")
    out = tmp_path / "traces"
    assert main(["trace", "record", "--model", str(tmp_path / "m"), "--methods", "pld",
                 "--max-new-tokens", "6", "--name", "tiny", "--questions", str(questions),
                 "--out", str(out)]) == 0
    trace = Trace.load(out / "tiny_spec_bench_pld.json.gz")
    assert len(trace.sequences) == 2 and trace.method == "pld"
    assert trace.meta["command"].startswith("logitspec trace record")
    assert main(["trace", "replay", str(out), "--model", str(tmp_path / "m"), "--batch-sizes", "2",
                 "--out", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert REPLAYED in printed and "| 2 | pld |" in printed
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["label"] == REPLAYED
    assert set(result["traces"]["tiny/spec_bench"]["results"]) == {"ar@2", "pld@2"}
