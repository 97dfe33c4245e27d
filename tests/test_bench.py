"""The benchmark harness: pure aggregation on hand-made records, then end to end on a tiny model."""
from __future__ import annotations

import json
import pathlib
import random
import statistics

import pytest

from logitspec.bench import (
    DEFAULT_QUESTIONS,
    PromptBuilder,
    Question,
    bench,
    load_questions,
    parse_methods,
    rerender,
    select_questions,
)
from logitspec.bench import report as br
from logitspec.bench.methods import _accept_lengths, split_top
from logitspec.bench.questions import TASKS, first_turns
from logitspec.bench.samples import Decoding
from logitspec.config import SpecConfig
from logitspec.sample.params import SamplingParams

REPO_DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def rec(method, qid, task, tokens, wall, *, turn=0, steps=None, accept=None, token_ids=None, **kw):
    r = {"method": method, "question_id": qid, "category": task, "task": task, "turn": turn,
         "new_tokens": tokens, "wall_time": wall}
    if steps is not None:
        r["steps"] = steps
        r["decode_steps"] = steps - 1
    if accept is not None:
        r["accept_lengths"] = accept
    if token_ids is not None:
        r["token_ids"] = token_ids
    r.update(kw)
    return r


# ------------------------------------------------------------------------------------ aggregation
def test_speedup_is_mean_of_per_question_ratios_and_reference_is_exactly_one():
    records = [
        rec("ar", 1, "qa", 10, 2.0), rec("x", 1, "qa", 10, 1.0),  # x: 2x on q1
        rec("ar", 2, "qa", 20, 2.0), rec("x", 2, "qa", 20, 4.0),  # x: 0.5x on q2
        rec("ar", 3, "rag", 30, 3.0), rec("x", 3, "rag", 30, 1.0),  # x: 3x
    ]
    sp = br.speedups(records)
    assert sp["ar"]["mean_ratio"] == {"qa": 1.0, "rag": 1.0, "overall": 1.0}
    assert sp["x"]["mean_ratio"]["qa"] == pytest.approx((2.0 + 0.5) / 2)
    assert sp["x"]["mean_ratio"]["rag"] == pytest.approx(3.0)
    assert sp["x"]["mean_ratio"]["overall"] == pytest.approx((2.0 + 0.5 + 3.0) / 3)
    # ratio of totals: (60 tokens / 6 s) / (60 tokens / 7 s)
    assert sp["x"]["total_ratio"]["overall"] == pytest.approx(7.0 / 6.0)
    # Spec-Bench speed.py: mean speed / mean reference speed = mean(10,5,30) / mean(5,10,10)
    assert sp["x"]["specbench"]["overall"] == pytest.approx((45 / 3) / (25 / 3))


def test_speedup_pairs_turns_and_skips_units_the_reference_lacks():
    records = [
        rec("ar", 1, "mt_bench", 10, 1.0, turn=0), rec("ar", 1, "mt_bench", 10, 1.0, turn=1),
        rec("x", 1, "mt_bench", 10, 0.5, turn=0), rec("x", 1, "mt_bench", 10, 2.0, turn=1),
        rec("x", 9, "mt_bench", 10, 0.001),  # no ar record: ignored
    ]
    assert br.speedups(records)["x"]["mean_ratio"]["mt_bench"] == pytest.approx((2.0 + 0.5) / 2)
    with pytest.raises(ValueError, match="reference"):
        br.speedups([rec("x", 1, "qa", 1, 1.0)])


def test_batched_units_share_one_wall_time():
    # two questions in one generate call of 2 s: unit speed = 30 tokens / 2 s
    records = [
        rec("ar", 1, "qa", 10, 3.0, unit=0, unit_wall_time=3.0), rec("ar", 2, "qa", 20, 3.0, unit=0,
                                                                     unit_wall_time=3.0),
        rec("x", 1, "qa", 10, 2.0, unit=0, unit_wall_time=2.0), rec("x", 2, "qa", 20, 2.0, unit=0,
                                                                    unit_wall_time=2.0),
    ]
    u = br.units(records)
    assert u["x"][0] == {"task": "qa", "tokens": 30, "wall": 2.0, "tps": 15.0}
    assert br.speedups(records)["x"]["mean_ratio"]["overall"] == pytest.approx(1.5)


def test_mat_histogram_rates_time_split_and_lossless():
    records = [
        rec("ar", 1, "qa", 3, 1.0, steps=3, accept=[1, 1, 1], token_ids=[5, 6, 7], mean_tree_size=0.0,
            retrieval_success=0.0, prefill_s=0.1, draft_s=0.0, pack_s=0.0, forward_s=0.8, verify_s=0.05,
            commit_s=0.05),
        rec("x", 1, "qa", 3, 1.0, steps=2, accept=[1, 2], token_ids=[5, 6, 7], mean_tree_size=4.0,
            retrieval_success=1.0, prefill_s=0.1, draft_s=0.1, pack_s=0.0, forward_s=0.6, verify_s=0.1,
            commit_s=0.0),
        rec("ar", 2, "rag", 4, 1.0, steps=4, accept=[1, 1, 1, 1], token_ids=[1, 2, 3, 4], mean_tree_size=0.0,
            retrieval_success=0.0, prefill_s=0.1, draft_s=0.0, pack_s=0.0, forward_s=0.8, verify_s=0.05,
            commit_s=0.05),
        rec("x", 2, "rag", 4, 1.0, steps=2, accept=[1, 3], token_ids=[1, 2, 3, 9], mean_tree_size=2.0,
            retrieval_success=0.0, prefill_s=0.1, draft_s=0.1, pack_s=0.0, forward_s=0.6, verify_s=0.1,
            commit_s=0.0),
        rec("hf", 1, "qa", 3, 1.0, steps=3, token_ids=[5, 6, 7]),
        rec("hf", 2, "rag", 4, 1.0, steps=4, token_ids=[1, 2, 3, 4]),
    ]
    s = br.summarize(records)
    assert list(s) == ["ar", "x", "hf"]
    assert s["ar"]["mat"] == {"qa": 1.0, "rag": 1.0, "overall": 1.0}
    assert s["x"]["mat"] == {"qa": 1.5, "rag": 2.0, "overall": 7 / 4}
    assert s["hf"]["mat"]["overall"] == 1.0 and s["hf"]["accept_hist"] is None
    assert s["x"]["accept_hist"] == {"1": 2, "2": 1, "3": 1}
    assert br.accept_histogram(records) == {1: 9, 2: 1, 3: 1}
    # weighted by decode steps (1 each for x): (1.0 + 0.0) / 2 and (4 + 2) / 2
    assert s["x"]["retrieval_success"] == pytest.approx(0.5)
    assert s["x"]["mean_tree_size"] == pytest.approx(3.0)
    assert s["ar"]["retrieval_success"] is None  # never drafts: no retrieval rate
    assert s["x"]["lossless"] == 0.5 and s["ar"]["lossless"] == 1.0 and s["hf"]["lossless"] == 1.0
    ts = s["x"]["time_split"]
    assert ts["forward"] == pytest.approx(0.6) and ts["other"] == pytest.approx(0.1)
    assert s["hf"]["time_split"] is None
    assert s["x"]["tokens_per_s"]["overall"] == pytest.approx(3.5)
    assert s["x"]["question_turns"] == 2 and s["x"]["new_tokens"] == 7


def test_report_numbers_come_from_the_summary(tmp_path):
    records = [rec("ar", 1, "qa", 10, 2.0, steps=10, accept=[1] * 10, token_ids=list(range(10))),
               rec("logitspec", 1, "qa", 10, 1.6, steps=4, accept=[1, 3, 3, 3], token_ids=list(range(10)),
                   mean_tree_size=12.0, retrieval_success=0.75)]
    summary = {"model": {"name": "tiny"}, "methods": br.summarize(records), "tasks": ["qa"],
               "question_turns_per_task": {"qa": 1}, "questions": 1, "settings": {"max_new_tokens": 10},
               "command": "logitspec bench --x", "machine": {"cpu": "test cpu"},
               "method_configs": {"logitspec": {"config": {}, "cost_curve": {"tokens": [1, 8],
                                                                             "seconds": [0.2, 0.45]}}}}
    md = br.render_report(summary)
    assert "| `ar` | 1.00x | 1.00x | 1.00 | 5.00 |" in md
    assert "| `logitspec` | 1.25x | 1.25x | 2.50 | 6.25 |" in md
    assert "- `logitspec`: n=1: 0.200, n=8: 0.450" in md
    assert "75.0%" in md and "12.0" in md and "logitspec bench --x" in md and "test cpu" in md
    br.plot_speedup(summary, tmp_path / "s.png")
    br.plot_accept_hist(summary, tmp_path / "h.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "h.png").stat().st_size > 1000


# -------------------------------------------------------------------------- questions and methods
def _write_questions(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_questions_groups_tasks_and_takes_first_n(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": ["a", "b"] if c == "writing" else ["a"]}
            for i, c in enumerate(["qa", "writing", "qa", "roleplay", "rag", "qa"])]
    p = _write_questions(tmp_path / "q.jsonl", rows)
    qs = load_questions(p, per_task=2)
    assert [(q.question_id, q.task) for q in qs] == [(1, "mt_bench"), (3, "mt_bench"), (0, "qa"), (2, "qa"),
                                                     (4, "rag")]
    assert [q.question_id for q in load_questions(p, categories=["roleplay", "rag"])] == [3, 4]
    assert [q.question_id for q in load_questions(p, categories=["mt_bench"])] == [1, 3]
    with pytest.raises(ValueError, match="unknown categories"):
        load_questions(p, categories=["nope"])
    with pytest.raises(ValueError, match="not found"):
        load_questions(tmp_path / "missing.jsonl")


def test_a_jobs_prompt_rows_read_as_one_turn_questions_of_their_task(tmp_path):
    demo = load_questions(REPO_DATA / "demo" / "prompts.jsonl", per_task=1)
    rows = [json.loads(line) for line in (REPO_DATA / "demo" / "prompts.jsonl").read_text().splitlines()]
    tasks = sorted({r["task"] for r in rows})
    assert sorted(q.task for q in demo) == tasks and len(tasks) == 4
    first = next(r for r in rows if r["task"] == demo[0].task)
    assert demo[0].question_id == first["id"] and demo[0].turns == (first["prompt"],)
    p = _write_questions(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": 3}])
    with pytest.raises(ValueError, match="p.jsonl:2: neither a Spec-Bench row nor a job's prompt row"):
        load_questions(p)
    untasked = _write_questions(tmp_path / "q.jsonl", [{"id": 1, "prompt": "x"}])
    assert [q.task for q in load_questions(untasked)] == ["prompts"]


def test_first_turns_are_the_first_questions_of_each_task_cut_to_length(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"question {i}", "again"]}
            for i, c in enumerate(["qa", "writing", "qa", "rag"])]
    p = _write_questions(tmp_path / "q.jsonl", rows)
    assert first_turns(p, per_task=1) == ["question 1", "question 0", "question 3"]
    assert first_turns(p, per_task=2, max_chars=5) == ["quest"] * 4


@pytest.mark.skipif(not DEFAULT_QUESTIONS.is_file(), reason="Spec-Bench data not beside the repository")
def test_spec_bench_file_has_six_tasks_of_eighty():
    qs = load_questions()
    assert len(qs) == 480
    counts = {}
    for q in qs:
        counts[q.task] = counts.get(q.task, 0) + 1
    assert counts == {t: 80 for t in TASKS}
    assert all(len(q.turns) == 2 for q in qs if q.task == "mt_bench")
    assert len(select_questions(qs, per_task=3)) == 18


def test_parse_methods_variants_and_reference():
    specs = parse_methods("pld,logitspec@capacity=8@rank_limits=(4,16),hf-pld@prompt_lookup_num_tokens=4")
    assert [s.name for s in specs] == ["ar", "pld", "logitspec@capacity=8@rank_limits=(4,16)",
                                       "hf-pld@prompt_lookup_num_tokens=4"]
    assert specs[2].base == "logitspec" and specs[2].overrides == {"capacity": 8, "rank_limits": (4, 16)}
    assert specs[3].is_hf and specs[3].overrides == {"prompt_lookup_num_tokens": 4}
    assert split_top("a,b@x=(1,2),c", ",") == ["a", "b@x=(1,2)", "c"]
    assert parse_methods("logitspec@history=500")[1].overrides == {"history": 500}  # an engine option
    for bad, msg in [("nope", "unknown method"), ("logitspec@capcity=8", "not a SpecConfig field"),
                     ("logitspec@8", "key=value"), ("ar,pld,pld", "twice")]:
        with pytest.raises(ValueError, match=msg):
            parse_methods(bad)


class _FakeTok:
    def __init__(self, chat):
        self.chat_template = "{{ messages }}" if chat else None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def test_prompt_builder_second_turn_sees_the_reference_answer():
    seen = []

    def encode(prompt, apply_chat_template=False):
        seen.append((prompt, apply_chat_template))
        return [1]

    q = Question(81, "writing", ("Write.", "Shorter."))
    PromptBuilder(_FakeTok(chat=True), encode)(q, 1, [[1, 2, 3]])
    assert seen[-1] == ([{"role": "user", "content": "Write."}, {"role": "assistant", "content": "abc"},
                         {"role": "user", "content": "Shorter."}], True)
    raw = PromptBuilder(_FakeTok(chat=False), encode)
    raw(q, 0, [])
    assert seen[-1] == ("Write.", False)
    raw(q, 1, [[1, 2]])
    assert seen[-1] == ("Write.\n\nab\n\nShorter.", False)
    ids = PromptBuilder(None, lambda p, apply_chat_template=False: p)
    assert ids(Question(1, "writing", ((5, 6), (7,))), 1, [[8, 9]]) == [5, 6, 8, 9, 7]


def test_hf_accept_lengths_from_forward_positions():
    # prompt of 13; prefill then plain steps, then a forward starting at 24 that emits 6 tokens
    starts = [0] + list(range(13, 25)) + [30]
    acc = _accept_lengths(starts, 13, 20)
    assert sum(acc) == 20 and acc[:12] == [1] * 12 and acc[12] == 6 and acc[13] == 2
    assert _accept_lengths([0, None], 13, 2) is None


# ------------------------------------------------------------------------------- end to end (tiny)
# (one_thread: tests/conftest.py)


def _tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _tiny_questions():
    rng = random.Random(0)
    qs = []
    for i, cat in enumerate(["writing", "translation", "qa"]):
        base = [rng.randrange(3, 64) for _ in range(5)]
        turns = [tuple(base * 3)] + ([tuple(rng.randrange(3, 64) for _ in range(4))] if cat == "writing"
                                     else [])
        qs.append(Question(100 + i, cat, tuple(turns)))
    return qs


def test_end_to_end_on_a_tiny_model_with_token_id_prompts(tmp_path, one_thread):
    summary = bench((_tiny_model(), None), _tiny_questions(), tmp_path, methods="pld,logitspec,hf,hf-pld",
                    max_new_tokens=12, warmup_tokens=4, progress=False, model_name="tiny-llama")
    for f in ("results.jsonl", "summary.json", "report.md", "speedup.png", "accept_hist.png"):
        assert (tmp_path / f).is_file(), f
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 5 * 4  # 5 methods (ar added) x 4 question-turns
    assert {"question_id", "category", "new_tokens", "wall_time", "accept_lengths"} <= set(records[0])
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["methods"].keys() == summary["methods"].keys() == {"ar", "pld", "logitspec", "hf",
                                                                      "hf-pld"}
    ar = on_disk["methods"]["ar"]
    assert set(ar["speedup"]) == {"mt_bench", "translation", "qa", "overall"}
    assert all(v == 1.0 for v in ar["speedup"].values()) and ar["mat"]["overall"] == 1.0
    assert ar["lossless"] == 1.0
    # the engine's methods are lossless on this model; HF's greedy decoding agrees with ours
    for m in ("pld", "logitspec", "hf", "hf-pld"):
        assert on_disk["methods"][m]["lossless"] == 1.0, m
    assert on_disk["methods"]["hf"]["mat"]["overall"] == 1.0  # counted forwards, not typed in
    # turn 2 sees the reference's turn-1 answer, the same prompt for every method
    t2 = [r for r in records if r["turn"] == 1]
    ans = next(r for r in records if r["method"] == "ar" and r["turn"] == 0 and r["question_id"] == 100)
    assert len({r["prompt_tokens"] for r in t2}) == 1
    assert t2[0]["prompt_tokens"] == 15 + len(ans["token_ids"]) + 4
    # interleaving: each unit rotates which method goes first
    assert len({r["method"] for r in records if r["order"] == 0}) > 1
    md = (tmp_path / "report.md").read_text()
    assert "| `ar` | 1.00x | 1.00x | 1.00x | 1.00x | 1.00 |" in md
    assert summary["method_configs"]["logitspec"]["config"]["method"] == "logitspec"
    assert summary["method_configs"]["hf-pld"]["generate"]["prompt_lookup_num_tokens"] == 10
    # the auto budget's cost curve, as the engine loaded or measured it, is in the summary and the report
    curve = summary["method_configs"]["logitspec"]["cost_curve"]
    assert curve["tokens"][0] == 1 and min(curve["seconds"]) > 0
    assert "cost_curve" in summary["method_configs"]["pld"]  # every drafting method is budgeted
    assert "cost_curve" not in summary["method_configs"]["ar"]
    # ... with what it decided from: the first nodes it verified and the guard's steps of each mode
    evidence = summary["method_configs"]["logitspec"]["budget_evidence"]
    assert sum(k["tested"] for k in evidence["first_nodes"].values()) > 0
    assert sum(c["draft"]["steps"] + c["plain"]["steps"] for c in evidence["speed"].values()) > 0
    assert "budget_evidence" not in summary["method_configs"]["ar"]
    assert "## Forward cost curves used by the auto draft budget" in md
    assert "| `pld` | auto |" in md and "| `ar` | - |" in md and "| `hf` | - |" in md  # each one's budget
    # re-rendering from the records gives the same numbers; a cut-short file renders as partial
    assert rerender(tmp_path)["methods"] == on_disk["methods"] and "Partial" not in md
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:5]) + "\n")  # the first unit only
    part = rerender(tmp_path)
    assert (part["partial"].startswith("1 of 4 question-turns")
            and part["question_turns_per_task"] == {"mt_bench": 1})
    assert "**Partial run: 1 of 4" in (tmp_path / "report.md").read_text()


def test_warm_up_runs_on_a_prompt_that_is_never_measured(tmp_path, one_thread, monkeypatch):
    """The engines carry learned state from call to call: the warm-up must not see a measured prompt."""
    from logitspec.bench import methods
    from logitspec.bench.questions import warmup_question

    calls = []
    for cls in (methods.EngineRunner, methods.HFRunner):
        def spy(self, prompts, max_new_tokens, seeds=None, _run=cls.run):
            calls.append([tuple(p) for p in prompts])
            return _run(self, prompts, max_new_tokens, seeds)
        monkeypatch.setattr(cls, "run", spy)
    summary = bench((_tiny_model(), None), _tiny_questions(), tmp_path, methods="logitspec,hf",
                    max_new_tokens=6, warmup_tokens=4, progress=False)
    assert set(summary["warmup_wall_s"]) == {"ar", "logitspec", "hf"}
    warm, measured = calls[:3], calls[3:]
    assert len(measured) == 3 * 4  # 3 methods x 4 question-turns, after the warm-up
    assert {p for c in warm for p in c} == {warmup_question(None, 64).turns[0]}
    assert not {p for c in warm for p in c} & {p for c in measured for p in c}


def test_resume_keeps_complete_units(tmp_path, one_thread):
    model, qs = _tiny_model(), _tiny_questions()
    kw = dict(methods="ar,pld", max_new_tokens=6, progress=False, warmup=False)
    bench((model, None), qs, tmp_path, **kw)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    # the run "died" after two units, in the middle of writing a third
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    s = bench((model, None), qs, tmp_path, resume=True, **kw)
    again = (tmp_path / "results.jsonl").read_text().splitlines()
    assert again[:4] == lines[:4] and len(again) == len(lines) == 8
    assert s["resumed"]["kept_question_turns"] == 2 and s["methods"]["pld"]["lossless"] == 1.0
    with pytest.raises(ValueError, match="cannot resume"):
        bench((model, None), qs, tmp_path, resume=True, **{**kw, "max_new_tokens": 7})


def test_sampled_run_records_every_sample_with_shared_seeds(tmp_path, one_thread):
    """Two samples per question-turn, seeded alike for every method: the engine's methods draw the
    same tokens as ``ar`` (one uniform per emitted token), HF's draws are not compared; resumable.
    The fixed budget always verifies its drafts: on a random model's samples the auto budget rightly
    learns to verify almost none, and whether any is accepted would rest on this machine's timings."""
    model, qs = _tiny_model(), _tiny_questions()
    fixed = "logitspec@budget=fixed"
    kw = dict(methods=f"{fixed},hf,logitspec@history=2000", max_new_tokens=8, warmup_tokens=4, progress=False,
              decoding=Decoding(SamplingParams(0.9, 0.95), num_samples=2, seed=3))
    summary = bench((model, None), qs, tmp_path, **kw)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 4 * 2  # methods x question-turns x samples
    hist = summary["methods"]["logitspec@history=2000"]
    assert hist["lossless"] == 1.0 and summary["methods"][fixed]["accepted_from"]["history"] == 0
    assert set(hist["accepted_from"]) == {"context", "siblings", "reference", "history", "guess"}
    assert summary["methods"]["hf"]["accepted_from"] is None
    ar = [r for r in records if r["method"] == "ar"]
    assert [r["sample"] for r in ar] == [0, 1] * 4
    # other seeds, other draws
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(ar[::2], ar[1::2]))
    ms = summary["methods"]
    assert ms[fixed]["lossless"] == 1.0 and ms["hf"]["lossless"] is None
    assert ms["ar"]["speedup"]["overall"] == 1.0 and ms[fixed]["mat"]["overall"] > 1.0
    # the second turn sees sample 0's first-turn answer, the same prompt for every method and sample
    assert len({r["prompt_tokens"] for r in records if r["turn"] == 1}) == 1
    md = (tmp_path / "report.md").read_text()
    assert "sampled (temperature 0.9, top-p 0.95), 2 sample(s) per prompt, seed 3" in md
    assert "no test of the distribution" in md
    assert "## Accepted draft tokens by source" in md and f"| `{fixed}` |" in md.split("by source")[1]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:8]) + "\n")  # the first unit only
    again = bench((model, None), qs, tmp_path, resume=True, **kw)
    assert again["resumed"]["kept_question_turns"] == 1
    assert (tmp_path / "results.jsonl").read_text().splitlines()[:8] == lines[:8]
    resumed = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    # same seeds
    assert [r["token_ids"] for r in resumed if r["method"] == "ar"] == [r["token_ids"] for r in ar]
    with pytest.raises(ValueError, match="cannot resume"):
        other = Decoding(SamplingParams(0.9, 0.95, 0), 2, seed=4)
        bench((model, None), qs, tmp_path, resume=True, **{**kw, "decoding": other})


def test_decoding_needs_a_temperature_for_sampling_options(tmp_path):
    from logitspec.cli import main

    with pytest.raises(ValueError, match="temperature > 0"):
        Decoding(num_samples=2)
    with pytest.raises(ValueError, match="top_p"):
        Decoding(SamplingParams(temperature=1.0, top_p=0.0))
    assert main(["bench", "--top-k", "8", "--out", str(tmp_path)]) == 2  # before any model or questions load
    assert Decoding(SamplingParams(0.8, 0.95, 0), 4, 0).seeds(2, 3) == [8, 12, 16]


def test_batched_run_and_cli(tmp_path, one_thread):
    """``--max-batch-size 2`` through the CLI on a saved tiny model with a token-id questions file."""
    from logitspec.cli import main

    model_dir = tmp_path / "tiny"
    _tiny_model().save_pretrained(model_dir)
    rows = [{"question_id": q.question_id, "category": q.category, "turns": [list(t) for t in q.turns]}
            for q in _tiny_questions()] + [{"question_id": 200, "category": "qa",
                                            "turns": [[5, 6, 7, 5, 6, 7]]}]
    qfile = _write_questions(tmp_path / "q.jsonl", rows)
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dir), "--questions", str(qfile), "--methods",
               "ar,logitspec@capacity=4",
               "--max-new-tokens", "8", "--max-batch-size", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["max_batch_size"] == 2
    assert "--max-batch-size 2" in summary["command"] and "logitspec@capacity=4" in summary["command"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    qa = [r for r in records if r["task"] == "qa" and r["method"] == "ar"]
    assert len(qa) == 2 and qa[0]["unit"] == qa[1]["unit"] and qa[0]["batch"] == 2
    assert summary["methods"]["ar"]["speedup"]["overall"] == 1.0
    assert summary["methods"]["logitspec@capacity=4"]["lossless"] == 1.0
    assert main(["bench", "--model", str(model_dir), "--questions", str(tmp_path / "none.jsonl"),
                 "--out", str(out)]) == 2  # a clear error, not a traceback


def test_longbench_rows_are_tasks_of_the_same_run(tmp_path, one_thread):
    """``--data spec_bench,longbench``: the shipped LongBench-format rows join the Spec-Bench questions
    in one run, each data set a task, prompts as the evaluation sweep builds them, answers at most
    the data set's own length; unknown sets and a missing directory fail before the model loads."""
    from tiny_models import save_tiny_text_model

    from logitspec.bench.longbench_set import LONGBENCH_DIR
    from logitspec.cli import main
    from logitspec.evaluation.longbench import read_directory
    from logitspec.evaluation.prompts import dataset_spec

    model_dir = tmp_path / "tiny"
    save_tiny_text_model(model_dir, max_positions=512)
    qfile = _write_questions(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa",
                                                     "turns": ["Name three colours of the rainbow."]}])
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dir), "--questions", str(qfile),
               "--data", "spec_bench,longbench", "--per-task", "1", "--methods", "ar,pld",
               "--max-new-tokens", "40", "--out", str(out), "--no-progress", "--no-warmup"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    datasets = sorted(read_directory(LONGBENCH_DIR))
    assert summary["tasks"] == ["qa", *datasets]
    assert summary["settings"]["data"] == ["spec_bench", "longbench"]
    assert "--data spec_bench,longbench" in summary["command"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"qa", *datasets}
    for r in records:
        own = 40 if r["task"] == "qa" else min(40, dataset_spec(r["task"]).max_new_tokens)
        assert 1 <= r["new_tokens"] <= own and r["prompt_tokens"] <= 512 - own
    assert summary["methods"]["pld"]["lossless"] == 1.0
    assert summary["methods"]["ar"]["speedup"]["overall"] == 1.0
    assert set(summary["methods"]["pld"]["speedup"]) >= set(datasets)
    assert main(["bench", "--data", "longbench,nope", "--out", str(out)]) == 2
    assert main(["bench", "--data", "longbench", "--longbench-dir", str(tmp_path / "none"), "--out",
                 str(out)]) == 2


def test_throughput_table_from_engine_runs(one_thread, monkeypatch):
    from logitspec.bench import throughput
    from logitspec.engine.engine import Engine

    seen, counts = [], []

    real_run = Engine.run

    def spy(self, prompts, request=None, **kw):
        seen.append([tuple(p) for p in prompts])
        counts.append(kw.get("n", getattr(request, "n", 1)))  # samples per prompt: a field or the request's
        return real_run(self, prompts, request, **kw)

    monkeypatch.setattr(Engine, "run", spy)
    prompts = [list(q.turns[0]) for q in _tiny_questions()]
    table = throughput.run(_tiny_model(), None, prompts, ["ar", "pld"], [1, 2], max_new_tokens=6, rounds=2)
    # 4 engines warm up on a prompt that is not measured, then 2 rounds of all prompts each
    assert len(seen) == 4 + 8 and all(c == seen[0] and not set(c) & set(map(tuple, prompts))
                                      for c in seen[:4])
    assert all(c == [tuple(p) for p in prompts] for c in seen[4:])
    assert list(table) == ["ar@1", "pld@1", "ar@2", "pld@2"]
    for key, row in table.items():
        assert len(row["rounds"]) == 2 and row["tokens_per_s"] > 0, key
        assert row["same_as_ar"] is True, key  # lossless at every batch size
    assert table["ar@1"]["vs_ar"] == 1.0 and table["ar@2"]["mat"] == 1.0
    assert table["pld@2"]["vs_ar"] == pytest.approx(table["pld@2"]["tokens_per_s"]
                                                    / table["ar@2"]["tokens_per_s"])
    ratios = [x / a for x, a in zip(table["pld@2"]["rounds"], table["ar@2"]["rounds"])]
    assert table["pld@2"]["vs_ar_paired"] == pytest.approx(statistics.median(ratios))
    assert table["ar@2"]["vs_ar_paired"] == 1.0
    assert "| 2 | pld |" in throughput.render(table)
    sampled = throughput.run(_tiny_model(), None, prompts, ["ar", "pld"], [2], max_new_tokens=6, rounds=1,
                             decoding=Decoding(SamplingParams(temperature=0.8), num_samples=2))
    assert len(seen[-1]) == len(prompts) and counts[-1] == 2  # a prompt's samples share its prefill (n=2)
    assert sampled["pld@2"]["same_as_ar"] is True and len(sampled["pld@2"]["token_ids"]) == 2 * len(prompts)
    variant = "logitspec@capacity=4"  # a SpecConfig variant, named as in bench
    table = throughput.run(_tiny_model(), None, prompts, ["ar", variant], [2], max_new_tokens=6, rounds=1,
                           configs={variant: SpecConfig(method="logitspec", capacity=4)})
    assert table[f"{variant}@2"]["method"] == variant and table[f"{variant}@2"]["same_as_ar"] is True


def test_calibrate_cli_stores_prints_and_plots_the_curve(tmp_path, one_thread, monkeypatch, capsys):
    from logitspec.cli import main

    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    _tiny_model().save_pretrained(model_dir)
    rc = main(["calibrate", "--model", str(model_dir), "--context", "16", "--reps", "1",
               "--plot", str(tmp_path / "cost.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| new tokens | forward ms | x one token |" in out and "\n4 rows:\n" in out
    stored = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(stored) == 1 and f"stored: {stored[0]}" in out
    assert json.loads(stored[0].read_text())["tokens"][0] == 1
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------ the embedded model
@pytest.mark.slow
def test_quick_run_on_the_embedded_model(tmp_path):
    from logitspec.cli import main

    if not DEFAULT_QUESTIONS.is_file():
        pytest.skip("Spec-Bench data not beside the repository")
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"ar", "logitspec", "hf"}
    assert summary["methods"]["ar"]["speedup"]["overall"] == 1.0
    assert summary["methods"]["ar"]["mat"]["overall"] == 1.0
    assert summary["methods"]["logitspec"]["lossless"] == 1.0
    assert summary["question_turns_per_task"]["mt_bench"] == 2 and len(summary["tasks"]) == 6
    for f in ("results.jsonl", "report.md", "speedup.png", "accept_hist.png"):
        assert (out / f).is_file()


def test_engine_methods_through_the_graph_runner_are_lossless_and_the_runner_recorded(tmp_path, one_thread):
    """``@runner=graph`` variants (on CPU the static path without capture), 65-node paper-size trees and
    lookahead's fixed shape among them: every output equals ``ar``'s, and the summary names the runner."""
    methods = "pld@runner=graph,logitspec@runner=graph@budget=fixed@capacity=64,lookahead@runner=graph"
    summary = bench((_tiny_model(), None), _tiny_questions(), tmp_path, methods=methods, max_new_tokens=8,
                    warmup_tokens=4, progress=False)
    for name in methods.split(","):
        assert summary["methods"][name]["lossless"] == 1.0, name
        described = summary["method_configs"][name]
        assert described["config"]["runner"] == "graph" and described["runner"].startswith("graph:sdpa:")
    assert summary["method_configs"]["ar"]["runner"] == "eager"
