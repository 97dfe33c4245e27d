"""logitspec.evaluation: LongBench format, prompts, truncation, metrics (against hand-computed values),
dataset scoring, and the local data generator."""

import json
import math
import pathlib
import re

import pytest

from logitspec.evaluation import longbench, metrics, prompts, scoring
from logitspec.evaluation.local_text import module_passage, stdlib_root
from logitspec.evaluation.longbench import Example, LongBenchFormatError
from logitspec.evaluation.make_data import BUILDERS, generate, main
from logitspec.evaluation.synth import Sources, allocate
from logitspec.evaluation.token_count import TokenCounter

REPO = pathlib.Path(__file__).resolve().parents[1]
LONGBENCH_21 = (
    "narrativeqa qasper multifieldqa_en multifieldqa_zh hotpotqa 2wikimqa musique dureader gov_report qmsum "
    "multi_news vcsum trec triviaqa samsum lsht passage_count passage_retrieval_en passage_retrieval_zh lcc "
    "repobench-p"
).split()


def row(**overrides):
    obj = {
        "input": "Who?",
        "context": "Some text.",
        "answers": ["Ann"],
        "length": 3,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "abc",
    }
    obj.update(overrides)
    return obj


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- format


def test_read_round_trip_keeps_fields_and_extras(tmp_path):
    write_lines(tmp_path / "hotpotqa.jsonl", [json.dumps(row(extra_key=7)), "", json.dumps(row(_id="d"))])
    examples = longbench.read_dataset(tmp_path, "hotpotqa")
    assert [e.id for e in examples] == ["abc", "d"]  # the blank line is skipped
    e = examples[0]
    assert (e.name, e.base, e.answers, e.all_classes, e.length) == ("hotpotqa", "hotpotqa", ("Ann",), None, 3)
    assert e.extra == {"extra_key": 7}
    out = tmp_path / "copy"
    longbench.write_dataset(out, "hotpotqa", examples)
    assert longbench.read_dataset(out, "hotpotqa") == examples


def test_list_and_read_directory_with_longbench_e_files(tmp_path):
    write_lines(tmp_path / "qasper_e.jsonl", [json.dumps(row(dataset="qasper"))])
    write_lines(tmp_path / "trec.jsonl", [json.dumps(row(dataset="trec", all_classes=["A", "B"]))])
    write_lines(tmp_path / "notes.jsonl", ["{}"])  # not a dataset name: ignored by listing
    (tmp_path / "README.md").write_text("x")
    assert longbench.list_datasets(tmp_path) == ["qasper_e", "trec"]
    rows = longbench.read_directory(tmp_path)
    assert rows["qasper_e"][0].base == "qasper"
    assert rows["trec"][0].all_classes == ("A", "B")


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(LongBenchFormatError, match="does not exist"):
        longbench.read_dataset(tmp_path / "nope", "hotpotqa")
    with pytest.raises(LongBenchFormatError, match="no file"):
        longbench.read_dataset(tmp_path, "hotpotqa")
    with pytest.raises(LongBenchFormatError, match="no LongBench dataset files"):
        longbench.read_directory(tmp_path)


def test_unknown_dataset_names(tmp_path):
    with pytest.raises(prompts.UnknownDatasetError, match="unknown dataset 'squad'"):
        longbench.read_dataset(tmp_path, "squad")
    with pytest.raises(prompts.UnknownDatasetError):
        prompts.resolve_name("narrativeqa_e")  # narrativeqa is not in LongBench-E
    assert prompts.resolve_name("repobench-p_e") == ("repobench-p", True)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "Expecting property name"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"input": "x"}), "missing keys"),
        (json.dumps(row(answers="Ann")), "'answers' must be a list of strings"),
        (json.dumps(row(answers=[])), "'answers' is empty"),
        (json.dumps(row(length="12")), "'length' must be a non-negative integer"),
        (json.dumps(row(all_classes=[1])), "'all_classes' must be a list of strings"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    write_lines(tmp_path / "hotpotqa.jsonl", [json.dumps(row()), line])
    with pytest.raises(
        LongBenchFormatError, match=re.escape("hotpotqa.jsonl:2: ") + ".*" + re.escape(message)
    ):
        longbench.read_dataset(tmp_path, "hotpotqa")


# --------------------------------------------------------------------------------------------- prompts


def test_config_covers_the_21_datasets_with_longbench_settings():
    assert prompts.dataset_names("longbench") == tuple(LONGBENCH_21)
    assert prompts.dataset_names("logitspec") == ("kv_retrieval",)
    assert len(prompts.longbench_e_names()) == 13
    maxlen = {n: prompts.dataset_spec(n).max_new_tokens for n in LONGBENCH_21}
    assert maxlen["gov_report"] == maxlen["qmsum"] == maxlen["multi_news"] == maxlen["vcsum"] == 512
    assert maxlen["narrativeqa"] == maxlen["qasper"] == maxlen["dureader"] == maxlen["samsum"] == 128
    assert maxlen["hotpotqa"] == maxlen["triviaqa"] == maxlen["passage_count"] == 32
    assert maxlen["lcc"] == maxlen["trec"] == maxlen["multifieldqa_en"] == 64
    assert {n for n in LONGBENCH_21 if prompts.dataset_spec(n).first_line} == {
        "trec",
        "triviaqa",
        "samsum",
        "lsht",
    }
    no_chat = {n for n in LONGBENCH_21 if not prompts.dataset_spec(n).chat}
    assert no_chat == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert prompts.dataset_spec("qasper_e") == prompts.dataset_spec("qasper")
    for name in prompts.dataset_names():
        spec = prompts.dataset_spec(name)
        assert "{context}" in spec.prompt and spec.metric in metrics.METRICS


def test_format_prompt_fills_context_and_input_verbatim():
    assert (
        prompts.format_prompt("lcc", "x = {1}\n", "")
        == "Please complete the code given below. \nx = {1}\nNext line of code:\n"
    )
    text = prompts.format_prompt("hotpotqa", "Passage 1:\nT\nbody", "Q?")
    assert text.startswith("Answer the question based on the given passages.")
    assert text.endswith("\n\nQuestion: Q?\nAnswer:")
    assert prompts.format_prompt("repobench-p", "A", "B").endswith("\nAB" + "Next line of code:\n")


def test_config_file_is_package_data():
    import fnmatch
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch("longbench_config.json", pat) for pat in data.get("logitspec.evaluation", []))


class CharTokenizer:
    """One token per character, with a BOS id 0 that encode adds and decode can skip (like HF's)."""

    def encode(self, text):
        return [0] + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == 0 else chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_truncate_middle_keeps_first_and_last_half():
    tok = CharTokenizer()
    # "abcdefghij" encodes to 11 ids with BOS; max 6 -> half 3: [BOS, a, b] + [h, i, j]; BOS skipped
    assert prompts.truncate_middle("abcdefghij", tok, 6) == "abhij"
    assert prompts.truncate_middle("abcdefghij", tok, 7) == "abhij"  # int(7 / 2) == 3, as pred.py
    assert prompts.truncate_middle("abcdefghij", tok, 11) == "abcdefghij"  # fits with its BOS
    assert prompts.truncate_middle("abcdefghij", tok, 10) == "abcdfghij"  # [BOS, a-d] + [f-j]
    with pytest.raises(ValueError):
        prompts.truncate_middle("abc", tok, 1)
    built = prompts.build_prompt("lcc", "x" * 100, "", tok, 20)
    assert built == "Please co" + " of code:\n"  # BOS + 9 characters, then the last 10


# --------------------------------------------------------------------------------------------- metrics


def test_qa_f1_score_hand_computed():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]; overlap 2:
    # P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert metrics.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert metrics.normalize_answer("The  Cat, sat! An") == "cat sat"
    # "cat cat" vs "cat": overlap counted with multiplicity 1: P = 1/2, R = 1, F1 = 2/3
    assert metrics.qa_f1_score("cat cat", "cat") == pytest.approx(2 / 3)
    assert metrics.qa_f1_score("Paris.", "paris") == 1.0
    assert metrics.qa_f1_score("dog", "cat") == 0.0
    assert metrics.qa_f1_score("", "cat") == 0.0
    assert metrics.qa_f1_score("the", "a") == 0.0  # both normalize to nothing


def test_qa_f1_zh_score_hand_computed():
    # jieba: 北京/是/中国/的/首都 and 中国/的/首都/是/北京: same bag of 5 words -> 1.0
    assert metrics.qa_f1_zh_score("北京是中国的首都", "中国的首都是北京") == 1.0
    # 首都/是/北京 (3 words) vs the 5 above: overlap 3, P = 1, R = 3/5, F1 = 0.75
    assert metrics.qa_f1_zh_score("首都是北京", "中国的首都是北京") == pytest.approx(0.75)
    # the full stop is normalized to nothing and dropped: 北京 vs 北京 -> 1.0
    assert metrics.qa_f1_zh_score("北京。", "北京") == 1.0
    assert metrics.qa_f1_zh_score("", "北京") == 0.0


def test_rouge_score_hand_computed():
    # rouge's ROUGE-L counts unique words: hyp {the, cat, sat, on, mat} = 5, ref {the, cat, is, on, mat} = 5;
    # union LCS words {the, cat, on, mat} = 4: P = R = 4/5, F = 2PR / (P + R + 1e-8) ~ 0.8
    assert metrics.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(
        0.8, abs=1e-7
    )
    # 4 and 4 words, LCS police-the-gunman = 3: P = R = 3/4
    assert metrics.rouge_score("police killed the gunman", "police kill the gunman") == pytest.approx(
        0.75, abs=1e-7
    )
    # two sentences each (split at '.'): hyp words 5, ref words {the, dog, ran, a, cat, sat} = 6,
    # union LCS: {the, dog, ran} + {cat, sat} = 5: P = 1, R = 5/6, F = 10/11
    assert metrics.rouge_score("the cat sat. the dog ran.", "the dog ran. a cat sat.") == pytest.approx(
        10 / 11, abs=1e-7
    )
    # no lower-casing: The != the, so LCS 1 of 2 words: 0.5
    assert metrics.rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-7)
    assert metrics.rouge_score("", "the cat") == 0.0  # rouge raises on an empty hypothesis
    assert metrics.rouge_score("...", "the cat") == 0.0  # nothing but sentence dots
    assert metrics.rouge_score("dog", "cat") == 0.0


def test_rouge_zh_score_hand_computed():
    # jieba words, LCS 中国-的-首都 = 3 of 5 on both sides: 0.6
    assert metrics.rouge_zh_score("北京是中国的首都", "中国的首都是北京") == pytest.approx(0.6, abs=1e-7)
    assert metrics.rouge_zh_score("", "北京") == 0.0


def test_classification_score_hand_computed():
    classes = ["Location", "Person", "Number"]
    assert metrics.classification_score("Location", "Location", all_classes=classes) == 1.0
    # two class names found, one of them right: 1/2
    assert metrics.classification_score("Location or Person", "Person", all_classes=classes) == 0.5
    assert metrics.classification_score("Number", "Person", all_classes=classes) == 0.0
    assert metrics.classification_score("", "Person", all_classes=classes) == 0.0
    # "Human" is part of the truth "Human being": dropped, leaving 1 of 1
    assert (
        metrics.classification_score("Human being", "Human being", all_classes=["Human", "Human being"])
        == 1.0
    )
    # LongBench's skip: found [Hu, Human, Human being]; dropping "Hu" moves "Human" into its slot, so
    # "Human" is never checked and stays: 1/2 (a fixed rule would give 1.0)
    quirk = metrics.classification_score(
        "Human being", "Human being", all_classes=["Hu", "Human", "Human being"]
    )
    assert quirk == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        metrics.classification_score("x", "y", all_classes=None)


def test_retrieval_and_count_scores_hand_computed():
    assert metrics.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert metrics.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 3") == 0.5  # numbers [3, 12]
    assert metrics.retrieval_score("Paragraph 30", "Paragraph 3") == 0.0  # whole numbers only
    assert metrics.retrieval_score("I do not know", "Paragraph 3") == 0.0
    assert metrics.retrieval_zh_score("段落3", "段落3") == 1.0
    assert metrics.retrieval_zh_score("第3段和段落5", "段落3") == 0.5
    with pytest.raises(ValueError, match="no paragraph number"):
        metrics.retrieval_score("3", "3")
    assert metrics.count_score("12", "12") == 1.0
    assert metrics.count_score("12 unique of 30 paragraphs", "12") == 0.5  # numbers [12, 30]
    assert metrics.count_score("", "12") == 0.0


def test_code_sim_score_hand_computed():
    # first line without a backtick, '#' or '//', after leading newlines
    assert metrics.first_code_line("\n```python\n# note\n    return x\n```") == "    return x"
    assert metrics.first_code_line("# only comments\n// here") == ""
    assert metrics.code_sim_score("\n```python\n    return x\n```", "    return x") == 1.0
    # "return y" vs "return x": matching block "return " = 7 chars of 8 + 8: 100 * 14/16 = 87.5 -> 88
    assert metrics.fuzz_ratio("return y", "return x") == 88
    # "abcdefgh" vs "abcdeXYZ": 5 of 8 + 8: 62.5 -> 62 (Python rounds halves to even, like fuzzywuzzy)
    assert metrics.fuzz_ratio("abcdefgh", "abcdeXYZ") == 62
    # difflib, not the longest common subsequence: "aba" vs "bca" match 1 char (2/6 -> 33), where an
    # LCS-based ratio (python-Levenshtein, rapidfuzz) would find "ba" (4/6 -> 67)
    assert metrics.fuzz_ratio("aba", "bca") == 33
    assert metrics.code_sim_score("", "") == 1.0  # fuzzywuzzy: equal strings score 100 first
    assert metrics.code_sim_score("", "x = 1") == 0.0
    assert metrics.code_sim_score("  return x\n", "    return x") == 0.91  # 2 * 10 / 22 = 90.9 -> 91


# --------------------------------------------------------------------------------------------- scoring


def test_row_score_first_line_rule_and_best_answer():
    classes = ["Location", "Person"]
    assert (
        scoring.score_prediction("trec", "\nLocation\nPerson", ["Location"], classes) == 1.0
    )  # first line only
    assert scoring.score_prediction("lcc", "x = 1\ny = 2", ["x = 1"]) == 1.0
    # hotpotqa: best of the answers: "cat" gives 2/3, "the cat sat" gives 1.0
    assert scoring.score_prediction("hotpotqa", "cat sat", ["cat", "the cat sat"]) == 1.0
    assert scoring.metric_for("qasper_e") is metrics.qa_f1_score


def test_dataset_score_is_rounded_percent_mean():
    # rows 1, 0.5, 0 -> 100 * 1.5 / 3 = 50.0; rows 1, 0, 0 -> 33.333... -> 33.33
    assert scoring.score_dataset("passage_count", ["3", "3 or 4", "5"], [["3"], ["3"], ["3"]]) == 50.0
    assert scoring.score_dataset("passage_count", ["3", "4", "5"], [["3"]] * 3) == 33.33
    with pytest.raises(ValueError):
        scoring.score_dataset("passage_count", [], [])
    with pytest.raises(ValueError, match="2 predictions for 1 answer lists"):
        scoring.score_dataset("passage_count", ["3", "3"], [["3"]])


def test_length_buckets():
    assert [scoring.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
    ]
    got = scoring.score_dataset_by_length("passage_count", ["3", "4", "3"], [["3"]] * 3, [100, 200, 5000])
    assert got["0-4k"] == 50.0 and got["4-8k"] == 100.0 and math.isnan(got["8k+"])


def test_score_examples_uses_each_rows_classes():
    def ex(answer, classes, length):
        return Example("trec_e", "q", "c", (answer,), classes, length, "trec", "en", answer)

    rows = [ex("Location", ("Location", "Person"), 10), ex("Person", ("Location", "Person"), 9000)]
    assert scoring.score_examples(rows, ["Location", "Location"]) == 50.0
    assert scoring.score_examples_by_length(rows, ["Location", "Person"]) == {
        "0-4k": 100.0,
        "4-8k": pytest.approx(math.nan, nan_ok=True),
        "8k+": 100.0,
    }
    with pytest.raises(ValueError, match="1 examples but 2 predictions"):
        scoring.score_examples(rows[:1], ["a", "b"])


# ------------------------------------------------------------------------------------------ generator


def test_allocate_water_fills():
    assert allocate([10, 100, 100], 110) == [10, 50, 50]
    assert allocate([10, 100], 50, weights=[1, 2]) == [10, 20]  # 10 + 2 * 20 = 50
    assert allocate([5, 5], 100) == [5, 5]


TOKENS = 900
CHARS = TokenCounter(name="chars/4")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    sources = Sources(seed=3, corpus_dir=REPO / "data" / "sample_corpus")
    generate(out, tokens=TOKENS, per_dataset=2, counter=CHARS, seed=3, sources=sources)
    return out, longbench.read_directory(out)


def test_generated_set_is_valid_longbench_format(generated):
    out, rows = generated
    assert sorted(rows) == sorted(BUILDERS)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokens"] == TOKENS and meta["tokens_by"] == "chars/4"
    for name, examples in rows.items():
        assert len(examples) == 2 and len({e.id for e in examples}) == 2
        for e in examples:
            assert e.dataset == name and e.length > 0 and e.extra["tokens_by"] == "chars/4"
            assert 0.75 * TOKENS <= e.extra["tokens"] <= 1.05 * TOKENS, (name, e.extra["tokens"])
            # a perfect prediction gets full marks under the dataset's own metric
            assert scoring.score_prediction(name, e.answers[0], e.answers, e.all_classes) == 1.0


def _stdlib_file(label):
    return stdlib_root() / re.match(r"stdlib:(\S+)", label).group(1)


def test_lcc_answer_is_the_true_next_line(generated):
    for e in generated[1]["lcc"]:
        source = _stdlib_file(e.extra["source"]).read_text(encoding="utf-8")
        assert e.context.endswith("\n") and source.startswith(e.context + e.answers[0])
        assert metrics.first_code_line(e.answers[0]) == e.answers[0] and e.answers[0].strip()


def _paragraphs(context):
    return re.split(r"\n\nParagraph \d+: ", context.removeprefix("Paragraph 1: "))


def test_passage_retrieval_paragraph_is_the_summarized_module(generated):
    for e in generated[1]["passage_retrieval_en"]:
        k = int(e.answers[0].removeprefix("Paragraph "))
        name = e.extra["source"].split()[0].removeprefix("stdlib:")
        path = stdlib_root() / (name.replace(".", "/") + ".py")
        path = path if path.exists() else path.with_suffix("") / "__init__.py"
        passage = module_passage(path)
        assert passage.summary == e.input and e.input not in e.context
        assert passage.text.startswith(_paragraphs(e.context)[k - 1])


def test_passage_count_answer_is_the_number_of_unique_paragraphs(generated):
    for e in generated[1]["passage_count"]:
        paragraphs = _paragraphs(e.context)
        assert len(set(paragraphs)) == int(e.answers[0]) < len(paragraphs)


def test_hotpotqa_fact_is_planted_once_in_the_middle(generated):
    for e in generated[1]["hotpotqa"]:
        sentence = re.search(r"planted in passage \d+: '(.*?)';", e.extra["source"]).group(1)
        assert sentence in e.context and e.answers[0] in sentence
        assert e.context.lower().count(e.answers[0].lower()) == 1
        passages = re.split(r"(?:^|\n)Passage \d+:\n", e.context)[1:]
        planted = next(i for i, p in enumerate(passages) if sentence in p)
        assert len(passages) // 3 <= planted <= (2 * len(passages) - 1) // 3


def test_kv_retrieval_answer_is_the_keys_value(generated):
    for e in generated[1]["kv_retrieval"]:
        assert json.loads(e.context)[e.input] == e.answers[0]


def test_generation_is_deterministic(tmp_path):
    args = [
        "--tokens",
        "600",
        "--per-dataset",
        "1",
        "--tokenizer",
        "none",
        "--seed",
        "5",
        "--datasets",
        "kv_retrieval,lcc",
    ]
    assert main(["--out", str(tmp_path / "a"), *args]) == 0
    assert main(["--out", str(tmp_path / "b"), *args]) == 0
    for name in ("kv_retrieval.jsonl", "lcc.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert main(["--out", str(tmp_path / "c"), "--tokenizer", "none", "--datasets", "squad"]) == 2


def test_shipped_local_set_reads_and_answers_check():
    rows = longbench.read_directory(REPO / "data" / "longbench_local")
    assert sorted(rows) == sorted(BUILDERS)
    for e in rows["kv_retrieval"]:
        assert json.loads(e.context)[e.input] == e.answers[0]
    for e in rows["passage_count"]:
        assert len(set(_paragraphs(e.context))) == int(e.answers[0])
    for e in rows["lcc"]:
        assert _stdlib_file(e.extra["source"]).name.endswith(".py") and e.context.endswith("\n")
