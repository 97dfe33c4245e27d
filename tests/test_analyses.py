"""The paper's analyses: counting on hand-made traces (no model), and the command on a tiny model."""
import json

import numpy as np
from tiny_models import save_tiny_text_model, write_two_questions

from logitspec.bench.analyses import (
    RETRIEVAL_VARIANTS,
    Trace,
    first_k_over,
    guesses_of,
    next_next_ranks,
    retrieval_flags,
    retrieval_report,
    topk_report,
    topk_shares,
)


def test_next_next_rank_counts_the_entries_above_the_true_token():
    logits = np.array([[5, 4, 3, 2, 1], [1, 2, 3, 4, 5], [0, 0, 0, 0, 0]], dtype=np.float32)
    # row 0 chose token 0; the next-next token 4 has 4 entries above it; row 1 chose 4, next-next 3: one above
    assert next_next_ranks(logits, [0, 4, 3]).tolist() == [5, 2]
    assert next_next_ranks(logits, [0, 0]).tolist() == [1]  # the next-next token repeats x1: rank 1
    assert len(next_next_ranks(logits, [0])) == 0


def test_topk_shares_are_cumulative_and_ignore_ranks_beyond_k_max():
    s = topk_shares([1, 2, 5, 200], k_max=5)
    assert s.tolist() == [0.25, 0.5, 0.5, 0.5, 0.75]
    assert first_k_over(s, 0.5) == 5 and first_k_over(s, 0.9) is None
    assert np.isnan(topk_shares([], 3)).all()


def test_retrieval_with_and_without_next_next_guidance():
    prompt, output = [1, 2, 3, 4], [1, 2, 9, 7]
    # step 2: root 9 was never seen, but the guess 3 was (followed by 4): only guided LogitSpec retrieves
    flags = retrieval_flags(prompt, output, [[], [], [3], []])
    assert flags["logitspec"] == [True, True, True, False]
    assert flags["logitspec_no_guesses"] == [True, True, False, False]
    assert flags["pld"] == [True, True, False, False]
    assert flags["rest_context"] == [False, True, False, False]  # REST needs a 2-token suffix match


def test_reports_group_by_task():
    top = np.array([[1, 3, 2], [2, 1, 3], [9, 3, 2], [7, 2, 1]])
    tr = Trace("qa", 1, [1, 2, 3, 4], [1, 2, 9, 7], np.array([2, 1, 50]), top)
    assert guesses_of(tr, 2) == [[3, 2], [1, 3], [3, 2], [2, 1]]
    rep = topk_report([tr, Trace("rag", 2, [5], [5, 5], np.array([1]), top[:2])])
    assert rep["qa"]["steps"] == 3 and rep["all"]["steps"] == 4
    assert rep["qa"]["shares"][0] == round(1 / 3, 4) and rep["all"]["shares"][1] == 0.75
    r = retrieval_report([tr])
    assert r["qa"]["steps"] == 4 and set(RETRIEVAL_VARIANTS) <= set(r["all"])
    assert r["all"]["logitspec"] >= r["all"]["logitspec_no_guesses"]


def test_analyses_command_writes_both_tables(tmp_path, capsys):
    from logitspec.cli import main

    save_tiny_text_model(tmp_path / "m")
    questions = write_two_questions(tmp_path / "question.jsonl")
    out = tmp_path / "out"
    assert main(["analyses", "all", "--model", str(tmp_path / "m"), "--questions", str(questions),
                 "--max-new-tokens", "6", "--out", str(out)]) == 0
    topk = json.loads((out / "topk.json").read_text())
    retrieval = json.loads((out / "retrieval.json").read_text())
    assert topk["settings"]["command"].startswith("logitspec analyses all --model ")
    assert topk["settings"]["questions"] == 2 and set(topk["tasks"]) == {"qa", "rag", "all"}
    shares = topk["tasks"]["all"]["shares"]
    assert len(shares) == 100 and shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 1
    assert set(RETRIEVAL_VARIANTS) <= set(retrieval["tasks"]["all"])
    assert retrieval["settings"]["logitspec"]["top_k"] == 64
    assert "top60" in capsys.readouterr().out
