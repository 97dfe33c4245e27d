"""Greedy steps decided inside the graph runner's step (``GraphRunner(decide_top=)``): the output layer
over every node, the argmax, the accepted path and the last node's top tokens computed with the forward
(:func:`logitspec.sample.acceptance.greedy_decision`), read by acceptance in the step's one transfer.
The same tokens as the eager runner for every method and family, sampled steps on the plain path."""
import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.sample.acceptance import decide, greedy_decision
from logitspec.sample.node_logits import NodeLogits
from logitspec.sample.params import SamplingParams
from logitspec.spec_decode.tree import DraftTree
from logitspec.worker.gpu import GraphRunner
from logitspec.worker.masks import StepRow, pack

N_NEW = 14


def decided_runner(model, config, **kw) -> GraphRunner:
    return GraphRunner(model, max_rows=config.max_batch_size, max_len=256, decide_top=config.top_k + 1, **kw)


def test_the_decision_equals_decide_on_the_same_scores():
    """greedy_decision over every node of a [B, T] batch gives decide's last node, bonus token, top
    tokens and per-node choices (decide reads the selected nodes' scores; here pads hold noise)."""
    rng = np.random.default_rng(0)
    trees = [DraftTree(np.array([5, 1, 2, 3]), np.array([-1, 0, 1, 0])), DraftTree.single(7),
             DraftTree(np.array([4, 2, 2]), np.array([-1, 0, 0]))]
    rows = [StepRow.from_tree(10 + b, t) for b, t in enumerate(trees)]
    packed = pack(rows, 12, {"full_attention": None}, torch.float32, torch.device("cpu"))
    B, T = packed.ids.shape
    scores = torch.tensor(rng.normal(size=(B * T, 9)), dtype=torch.float32)
    scores[0, 1] = scores[1, 2] = scores[2, 0] = 50.0  # row 0 accepts its chain 0 -> 1 -> 2
    select = torch.tensor([b * T + i for b, t in enumerate(trees) for i in range(len(t))])
    sizes = [len(t) for t in trees]
    starts = torch.tensor(np.cumsum([0] + sizes[:-1]))
    spans = [(int(a), int(a) + n) for a, n in zip(starts, sizes)]
    want = decide(NodeLogits(scores[select], exact=True), packed, select, starts, SamplingParams(), None, 3,
                  spans, outputs=True)
    top4 = lambda at: torch.topk(scores[at], 4).indices  # noqa: E731
    got = greedy_decision(scores.argmax(-1).view(B, T), packed, 4, top4)  # [B, 2 + 4 + T]
    assert got[:, 0].tolist() == want.last == [2, 0, 0] and got[:, 1].tolist() == want.bonus
    assert got[:, 2:6].tolist() == want.top
    outs = [row[:n] for row, n in zip(got[:, 6:].tolist(), sizes)]
    assert outs == [o[:n] for o, n in zip(want.outputs, sizes)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["ar", "pld", "logitspec", "lookahead"])
def test_decided_steps_give_the_eager_runners_tokens(family, method):
    """Greedy, rows finishing at different steps (slots released and refilled): the same tokens as
    the eager runner, every step decided inside the step."""
    prompts = repetitive_prompts(4, seed=21)
    config = SpecConfig(method=method, budget="fixed", capacity=8, max_batch_size=3)
    requests = [Request(max_new_tokens=n) for n in (N_NEW, 9, N_NEW, 6)]
    want = Engine(tiny_model(family), None, config).run(prompts, requests).results
    model = tiny_model(family)
    runner = decided_runner(model, config)
    got = Engine(model, None, config, runner=runner).run(prompts, requests).results
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert runner.counters["decided"] == runner.counters["replays"] > 0
    if method in ("pld", "logitspec"):
        assert max(r.stats["mean_accepted"] for r in got) > 1.0  # drafted tokens were accepted in the step
    assert "decide=" in runner.kind


def test_a_decided_step_computes_no_node_logits_outside_the_step():
    """Acceptance and logitspec's guesses read the decision alone: after the step, the output layer
    never runs again over its nodes (it did, once a step, for nothing)."""
    model = tiny_model("llama")
    cfg = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    runner = decided_runner(model, cfg)
    after_steps, output = [], runner.head.output

    def counted(h, mode=None, **kw):  # the step's own calls ask for EXACT rows; acceptance's would not
        after_steps.append(mode is not None and mode.name != "EXACT")
        return output(h, mode, **kw) if mode is not None else output(h, **kw)
    runner.head.output = counted
    engine = Engine(model, None, cfg, runner=runner)
    got = engine.generate(repetitive_prompts(2, seed=5), max_new_tokens=N_NEW)
    assert runner.counters["decided"] > 5 and all(len(r.token_ids) == N_NEW for r in got)
    steps = runner.counters["decided"]
    assert sum(after_steps) <= 2 < steps, (sum(after_steps), steps)  # the two prompts' prefills only


def test_sampled_steps_take_the_plain_path():
    """Sampled rows are not decided in the step (their draws are acceptance's): the tokens equal the
    same runner's without decisions, and no step was decided."""
    prompts = repetitive_prompts(3, seed=22)
    config = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    sampled = Request.make(max_new_tokens=12, temperature=0.8, seed=5)
    model = tiny_model("qwen2")
    plain_runner = GraphRunner(model, max_rows=2, max_len=256)
    plain = Engine(model, None, config, runner=plain_runner).run(prompts, sampled)
    runner = decided_runner(model, config)
    got = Engine(model, None, config, runner=runner).run(prompts, sampled)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
    assert runner.counters["decided"] == 0 and runner.counters["replays"] > 0


def test_a_compiled_decided_step_gives_the_same_tokens():
    """The output layer, the argmax and the acceptance compiled with the decoder into one step: the
    eager runner's tokens, nothing left uncompiled."""
    model = tiny_model("llama")
    prompts = repetitive_prompts(2, seed=23)
    config = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    runner = GraphRunner(model, max_rows=2, max_len=256, row_buckets=(2,), node_buckets=(16,),
                         decide_top=config.top_k + 1, compile=True)
    got = Engine(model, None, config, runner=runner).run(prompts, Request(max_new_tokens=N_NEW)).results
    want = Engine(tiny_model("llama"), None, config).run(prompts, Request(max_new_tokens=N_NEW)).results
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert runner.counters["uncompiled"] == 0 and runner.counters["compiles"] >= 1
    assert runner.counters["decided"] > 0


def test_decided_buckets_are_built_at_start_up():
    """With flex attention every bucket is built twice at start-up (plain and decided), none after."""
    model = tiny_model("gemma3")
    config = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    runner = GraphRunner(model, max_rows=2, max_len=256, attention="flex", decide_top=config.top_k + 1)
    engine = Engine(model, None, config, runner=runner)
    shapes = 2 * 5  # rows 1, 2 x nodes 1, 2, 4, 8, 16
    assert runner.start_up["graphs"] == 2 * shapes
    got = engine.run(repetitive_prompts(3, seed=24), Request(max_new_tokens=10)).results
    assert runner.counters["built_after_start"] == 0 and runner.counters["decided"] > 0
    assert all(len(r.token_ids) == 10 for r in got)

