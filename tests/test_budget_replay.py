"""Replayed greedy acceptance at equal fixed budgets (logitspec.bench.budget_replay): hand-made traces
whose accepted paths are known, the replay against the real engine, LogitSpec's tree holding PLD's."""
import numpy as np
import pytest

from logitspec.bench.analyses import Trace, guesses_of
from logitspec.bench.budget_replay import budget_report, mat_table, not_below, replay_greedy
from logitspec.config import SpecConfig
from logitspec.spec_decode.drafters import make_drafter


def _trace(prompt, output, task="qa", top=None):
    top = np.asarray(top if top is not None else [[t, 0] for t in output])
    return Trace(task, 0, list(prompt), list(output), np.zeros(max(len(output) - 1, 0), dtype=np.int64), top)


def test_a_copied_span_is_accepted_in_chains_of_the_budget():
    """The output copies 10 tokens of the prompt: PLD with N = 4 drafts 4 of them (all accepted) and
    the bonus follows; the last step has room for 3 drafts and a bonus: 1 prefill + 2 steps."""
    span = list(range(10, 21))  # 11 tokens
    prompt = [1, 2, 3] + span + [4, 5, 6, 7, 1, 2, 3]
    cfg = SpecConfig(method="pld", budget="fixed", pld_max_tokens=4)
    drafter = make_drafter(cfg)
    r = replay_greedy(drafter, prompt + [span[0]], span[1:], [[]] * 10, 4, cfg.max_ngram, cfg.min_ngram)
    # prefill: span[1]; step 1: drafts span[2..5] (accepted), bonus span[6]; step 2: span[7..9], span[10]
    assert r.tokens == 10 and r.forwards == 3
    assert r.accepted == {"context": 7, "guess": 0} and r.nodes == 7 and r.retrieved == 2


def test_a_right_guess_is_accepted_and_counted_as_a_guess():
    """Nothing to retrieve; the next-next token is each step's first guess: LogitSpec accepts the
    guess (one drafted token a step), PLD nothing."""
    output = [50, 51, 52, 53, 54, 55, 56]
    top = [[tok, nxt] for tok, nxt in zip(output, output[1:] + [0])]
    tr = _trace([1, 2, 3], output, top=top)
    rep = budget_report([tr], [4], methods=("pld", "logitspec"))
    assert rep["pld"]["4"]["all"]["mat"] == 1.0
    ls = rep["logitspec"]["4"]["all"]
    assert ls["guess_share"] == 1.0 and ls["mat"] == pytest.approx(7 / 4)  # 1 + 3 steps of 2
    assert guesses_of(tr, 1)[0] == [51]


def test_replay_equals_the_engines_fixed_budget_decoding():
    """The replayed MAT of a greedy trace is the engine's own at budget="fixed" (one row)."""
    from tiny_models import repetitive_prompts, tiny_model

    from logitspec.bench.analyses import greedy_traces
    from logitspec.bench.questions import Question
    from logitspec.engine.engine import Engine

    model = tiny_model("llama")
    prompts = repetitive_prompts(3, seed=3)
    qs = [Question(i, "qa", (tuple(p),)) for i, p in enumerate(prompts)]
    traces = greedy_traces(model, None, qs, 24)
    rep = budget_report(traces, [6], methods=("pld", "logitspec"))
    for method in ("pld", "logitspec"):
        cfg = SpecConfig(method=method, budget="fixed", capacity=6, pld_max_tokens=6, max_batch_size=1)
        res = Engine(model, None, cfg).generate([list(t.prompt) for t in traces], max_new_tokens=24)
        assert [r.token_ids for r in res] == [t.output for t in traces]
        tokens = sum(len(r.token_ids) for r in res)
        forwards = sum(r.stats["steps"] for r in res)
        assert rep[method]["6"]["all"]["mat"] == pytest.approx(tokens / forwards, abs=1e-3), method


def test_logitspec_is_never_below_pld_at_equal_budget():
    """LogitSpec's tree holds PLD's chain at any N, so its replayed MAT is at least PLD's on every
    task (random repetitive traces, guesses random)."""
    rng = np.random.default_rng(0)
    traces = []
    for task in ("a", "b", "c"):
        for _ in range(3):
            vocab = rng.integers(5, 40)
            prompt = rng.integers(0, vocab, 60).tolist()
            output = rng.integers(0, vocab, 40).tolist()
            top = np.stack([output, rng.integers(0, vocab, 40)], 1)
            traces.append(_trace(prompt, output, task, top))
    rep = budget_report(traces, [2, 8, 32], methods=("pld", "logitspec"))
    assert not_below(rep, "logitspec", "pld") == {"2": [], "8": [], "32": []}
    table = mat_table(rep)
    assert table.count("\n| `") == 6 and "guess share" in table
