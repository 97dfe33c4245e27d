"""LongBench complete: LongBench-E length buckets in the sweep report, LongBench v2
(reader, prompt, answer extraction, accuracies as result.py), samsum's stop as pred.py, eval.py's loop sum."""

import json
import math
import pathlib

import pytest

from logitspec.evaluation import longbench, make_data_v2, scoring
from logitspec.evaluation import longbench_v2 as v2
from logitspec.evaluation.longbench import Example, LongBenchFormatError
from logitspec.evaluation.sweep_report import build_report, report_markdown
from logitspec.evaluation.sweep_rows import official_stop_length, stop_strings, sweep_rows

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = [{"name": "ar", "method": "ar", "settings": {}, "baseline": "ar"},
           {"name": "logitspec", "method": "logitspec", "settings": {}, "baseline": "ar"}]


class CharTokenizer:
    """One token per character, BOS id 0 added by encode and skippable by decode (like HF's)."""

    def encode(self, text):
        return [0] + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == 0 else chr(i) for i in ids if not (skip_special_tokens and i == 0))


def _row(name, key_id, config, text, error=None):
    return {"key": f"{name}/{key_id}", "dataset": name, "config": config, "generation": text,
            "token_ids": [1, 2], "n_prompt_tokens": 10, "n_new_tokens": 2, "steps": 2, "prefill_s": 0.1,
            "run_share_s": 0.2, "peak_rss_bytes": None, "error": error}


# ------------------------------------------------------------------------------ exact sum (eval.py's loop)

def _loop_percent(scores):
    total = 0.0
    for s in scores:
        total += s
    return round(100 * total / len(scores), 2)


def test_percent_adds_in_eval_py_loop_order_not_compensated():
    scores = [0.2, 0.125, 0.4, 0.3]
    # the case really differs between a plain loop and compensated summation (Python 3.12+'s sum())
    assert _loop_percent(scores) == 25.63
    assert round(100 * math.fsum(scores) / len(scores), 2) == 25.62
    assert scoring._percent(scores) == 25.63
    assert scoring.score_dataset("hotpotqa", ["blue"] * 4, [["blue"]] * 4) == 100.0


def test_percent_does_not_use_sum(monkeypatch):
    """On this Python sum() may equal the loop; make the module's sum compensated (as 3.12's is)."""
    monkeypatch.setattr(scoring, "sum", math.fsum, raising=False)
    assert scoring._percent([0.2, 0.125, 0.4, 0.3]) == 25.63


# ------------------------------------------------------------------------------------ LongBench-E buckets

def _e_example(i, length, answer="blue"):
    return Example(name="hotpotqa_e", input="q", context="c", answers=(answer,), all_classes=None,
                   length=length, dataset="hotpotqa", language="en", id=str(i))


def test_report_gives_longbench_e_scores_per_length_bucket():
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    data = {"hotpotqa_e": [_e_example(i, n) for i, n in enumerate(lengths)],
            "hotpotqa": [Example(name="hotpotqa", input="q", context="c", answers=("x",), all_classes=None,
                                 length=9000, dataset="hotpotqa", language="en", id="0")]}
    texts = ["blue", "red", "blue", "blue", "red", "red"]  # 0-4k: 1, 0; 4-8k: 1, 1; 8k+: 0, 0
    rows = [_row("hotpotqa_e", i, c, t) for c in ("ar", "logitspec") for i, t in enumerate(texts)]
    rows += [_row("hotpotqa", 0, c, "x") for c in ("ar", "logitspec")]
    report = build_report(rows, data, CONFIGS)
    cell = report["datasets"]["hotpotqa_e"]["logitspec"]
    assert cell["length_scores"] == {"0-4k": 50.0, "4-8k": 100.0, "8k+": 0.0}
    assert cell["length_counts"] == {"0-4k": 2, "4-8k": 2, "8k+": 2}
    assert cell["score"] == 50.0
    # the official scorer_e on the same rows
    expect = scoring.score_examples_by_length(data["hotpotqa_e"], texts)
    assert cell["length_scores"] == expect
    assert "length_scores" not in report["datasets"]["hotpotqa"]["ar"]  # a v1 file: one score
    md = report_markdown(report)
    assert "LongBench-E score by length" in md and "| logitspec | 50.00 | 100.00 | 0.00 |" in md
    json.dumps(report, allow_nan=False)  # valid JSON


def test_longbench_e_empty_bucket_is_null_not_nan():
    data = {"hotpotqa_e": [_e_example(0, 100), _e_example(1, 5000)]}
    rows = [_row("hotpotqa_e", i, "ar", "blue") for i in range(2)]
    report = build_report(rows, data, CONFIGS[:1])
    buckets = report["datasets"]["hotpotqa_e"]["ar"]["length_scores"]
    assert buckets == {"0-4k": 100.0, "4-8k": 100.0, "8k+": None}
    json.dumps(report, allow_nan=False)
    assert "| ar | 100.00 | 100.00 | - |" in report_markdown(report)


# --------------------------------------------------------------------------------------------- samsum

def test_samsum_rows_have_no_stop_string_and_a_leading_newline_scores_the_next_line():
    assert stop_strings("samsum") == stop_strings("samsum_e") == ()
    ex = Example(name="samsum", input="Dialogue: A: hi\nSummary: ", context="ctx",
                 answers=("Ann greets Bob.",), all_classes=None, length=5, dataset="samsum", language="en",
                 id="0")
    (row,) = sweep_rows({"samsum": [ex]}, CharTokenizer(), 10_000)
    assert row.stop == () and row.max_new_tokens == 128
    # a generation that begins with a newline: the official run goes on to the next line and scores it
    generation = "\nAnn greets Bob.\nDialogue: B: hello"
    assert scoring.score_prediction("samsum", generation, ex.answers) == pytest.approx(1.0)
    # with the old stop string "\n" the engine's text was "" (the stop string is dropped): score 0
    assert scoring.score_prediction("samsum", "", ex.answers) == 0.0


def test_official_stop_length_is_the_newline_token_after_the_first():
    nl, eos = 108, 1
    # pred.py: eos_token_id=[eos, nl], min_length=context+1: the stop counts from the second new token
    assert official_stop_length([nl, 5, 6, nl, 7], {nl, eos}) == 4  # the leading newline is kept as text
    assert official_stop_length([5, nl, 6], {nl, eos}) == 2  # the stop token itself is returned
    assert official_stop_length([5, 6, eos, 7], [nl, eos]) == 3
    assert official_stop_length([5, 6], {nl}) == 2
    assert official_stop_length([], {nl}) == 0


# ------------------------------------------------------------------------------------------ LongBench v2

def _v2_obj(i, answer="B", difficulty="easy", length="short", **kw):
    obj = {"_id": f"id{i}", "domain": "Single-Document QA", "sub_domain": "Academic",
           "difficulty": difficulty, "length": length, "question": " Which one? ", "choice_A": " one ",
           "choice_B": "two",
           "choice_C": "three", "choice_D": "four", "answer": answer, "context": "\n The text. \n"}
    obj.update(kw)
    return obj


def test_v2_extract_answer_as_pred_py():
    assert v2.extract_answer("The correct answer is (C)") == "C"
    assert v2.extract_answer("**The correct answer is (B)**") == "B"  # '*' removed first
    assert v2.extract_answer("The correct answer is D.") == "D"
    # the parenthesised form first, anywhere in the response
    assert v2.extract_answer("The correct answer is A, not (B). The correct answer is (B)") == "B"
    assert v2.extract_answer("the correct answer is (A)") is None  # case-sensitive, as pred.py
    assert v2.extract_answer("The correct answer is (E)") is None
    assert v2.extract_answer("Answer: A") is None


def test_v2_prompt_is_the_0shot_template_with_stripped_fields():
    e = v2.example_v2_from_json(_v2_obj(0), "longbench_v2")
    prompt = v2.format_v2_prompt(e)
    assert prompt == ("Please read the following text and answer the question below.\n\n<text>\nThe text.\n"
                      "</text>\n\nWhat is the correct answer to this question: Which one?\n"
                      "Choices:\n(A) one\n"
                      "(B) two\n(C) three\n(D) four\n\nFormat your response as follows: "
                      "\"The correct answer is (insert answer here)\".")
    no_context = v2.format_v2_prompt(e, "0shot_no_context")
    assert no_context.startswith("What is the correct answer to this question: ")
    with pytest.raises(ValueError, match="unknown LongBench v2 template"):
        v2.format_v2_prompt(e, "cot")


def test_v2_truncation_keeps_head_and_tail_decoded_once():
    tok = CharTokenizer()
    # "abcdefghij" + BOS = 11 ids; max 5: ids[:2] + ids[-3:] (Python's -5 // 2 == -3), BOS skipped
    assert v2.truncate_v2("abcdefghij", tok, 5) == "a" + "hij"
    assert v2.truncate_v2("abcdefghij", tok, 11) == "abcdefghij"


def test_v2_scores_as_result_py():
    objs = [_v2_obj(0, "A", "easy", "short"), _v2_obj(1, "B", "hard", "short"),
            _v2_obj(2, "C", "hard", "medium"), _v2_obj(3, "D", "hard", "long"),
            _v2_obj(4, "A", "easy", "long"), _v2_obj(5, "A", "hard", "long")]
    examples = [v2.example_v2_from_json(o, "longbench_v2") for o in objs]
    responses = ["The correct answer is (A)", "The correct answer is B", "I think (C)",
                 "The correct answer is (D)", "The correct answer is (B)", ""]
    s = v2.score_v2(examples, responses)
    # row 5's empty response is not written by pred.py, so not scored; 5 rows, 3 right
    assert s["rows"] == 5 and s["unanswered"] == 1 and s["no_choice"] == 1
    assert s["overall"] == round(100 * 3 / 5, 1) == 60.0
    assert (s["easy"], s["hard"]) == (50.0, round(100 * 2 / 3, 1))  # 66.7
    assert (s["short"], s["medium"], s["long"]) == (100.0, 0.0, 50.0)
    assert s["counts"] == {"easy": 2, "hard": 3, "short": 2, "medium": 1, "long": 2}
    assert v2.score_v2(examples[:1], ["The correct answer is (A)"])["medium"] is None


def test_v2_reader_json_array_and_jsonl_and_clean_refusals(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "longbench_v2.json").write_text(json.dumps([_v2_obj(0), _v2_obj(1, "C")]))
    v1 = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "hotpotqa",
          "language": "en", "all_classes": None, "_id": "x"}
    (d / "hotpotqa.jsonl").write_text(json.dumps(v1) + "\n")
    (d / "meta.json").write_text("{}")
    assert longbench.list_datasets(d) == ["hotpotqa", "longbench_v2"]
    data = longbench.read_directory(d)
    assert [e.answer for e in data["longbench_v2"]] == ["B", "C"]
    assert data["longbench_v2"][0].choices == (" one ", "two", "three", "four")
    v2.write_v2_dataset(tmp_path / "out", "longbench_v2_part", data["longbench_v2"])
    again = longbench.read_directory(tmp_path / "out")["longbench_v2_part"]
    assert again == [e.__class__(**{**e.__dict__, "name": "longbench_v2_part"}) for e in data["longbench_v2"]]
    (d / "longbench_v2.json").write_text(json.dumps([_v2_obj(0), _v2_obj(1, "E")]))
    with pytest.raises(LongBenchFormatError, match=r"longbench_v2\.json: item 1: 'answer' must be one of A"):
        longbench.read_directory(d)
    (d / "longbench_v2.json").write_text(json.dumps([_v2_obj(0, length=12000)]))
    with pytest.raises(LongBenchFormatError, match="'length' must be a string"):
        longbench.read_dataset(d, "longbench_v2")
    (d / "longbench_v2.jsonl").write_text(json.dumps(_v2_obj(0)) + "\n")
    with pytest.raises(LongBenchFormatError, match="both"):
        longbench.read_dataset(d, "longbench_v2")


def test_v2_sweep_rows_and_report():
    kinds = [("A", "easy", "short"), ("B", "hard", "long"), ("C", "hard", "long")]
    examples = [v2.example_v2_from_json(_v2_obj(i, a, d, n), "longbench_v2")
                for i, (a, d, n) in enumerate(kinds)]
    rows = sweep_rows({"longbench_v2": examples}, CharTokenizer(), 10_000, chat_template=True)
    assert [r.key for r in rows] == ["longbench_v2/id0", "longbench_v2/id1", "longbench_v2/id2"]
    assert rows[0].prompt == v2.format_v2_prompt(examples[0]) and rows[0].chat and rows[0].stop == ()
    assert rows[0].max_new_tokens == 128 and not rows[0].truncated
    cut = sweep_rows({"longbench_v2": examples}, CharTokenizer(), 10_000, max_length=40)[0]
    assert cut.truncated and len(cut.prompt) == 39  # 40 ids with BOS, BOS skipped
    out = [_row("longbench_v2", "id0", c, "The correct answer is (A)") for c in ("ar", "logitspec")]
    out += [_row("longbench_v2", "id1", c, "The correct answer is (B)") for c in ("ar", "logitspec")]
    out += [_row("longbench_v2", "id2", "ar", "The correct answer is (D)"),
            _row("longbench_v2", "id2", "logitspec", None, error="RuntimeError: boom")]
    report = build_report(out, {"longbench_v2": examples}, CONFIGS)
    ar, ls = report["datasets"]["longbench_v2"]["ar"], report["datasets"]["longbench_v2"]["logitspec"]
    assert ar["score"] == ar["v2"]["overall"] == round(100 * 2 / 3, 1)
    assert (ar["v2"]["easy"], ar["v2"]["hard"], ar["v2"]["long"]) == (100.0, 50.0, 50.0)
    assert ar["v2"]["medium"] is None
    # the error row is not scored (pred.py writes no row for a failed query)
    assert ls["v2"]["unanswered"] == 1 and ls["score"] == 100.0
    md = report_markdown(report)
    assert "LongBench v2 accuracy" in md and "| ar | 66.7 | 100.0 | 50.0 | 100.0 | - | 50.0 | 0 | 0 |" in md
    json.dumps(report, allow_nan=False)


def test_shipped_v2_sample_reads_and_matches_its_source(tmp_path):
    d = REPO / "data" / "longbench_v2_local"
    data = longbench.read_directory(d)
    assert list(data) == ["longbench_v2"]
    rows = data["longbench_v2"]
    assert len(rows) >= 10 and len({e.id for e in rows}) == len(rows)
    assert {e.answer for e in rows} >= {"A", "B", "C", "D"}  # the right choice is not always in one place
    assert {e.difficulty for e in rows} == {"easy", "hard"}
    for e in rows:
        assert len(set(e.choices)) == 4
        right = e.choices["ABCD".index(e.answer)]
        assert right == e.extra["source_answer"].strip()
    # the generator gives the same file again
    again = make_data_v2.generate(REPO / "data" / "longbench_local", tmp_path)
    assert (tmp_path / "longbench_v2.jsonl").read_bytes() == (d / "longbench_v2.jsonl").read_bytes()
    assert again == rows
