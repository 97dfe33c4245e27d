"""The graph runner's static path on CPU (logitspec.worker.gpu): slots, buckets, device-built masks, the
commit, and lossless decoding against HF generate and the eager EagerRunner."""
import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, VOCAB, hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.sample.acceptance import greedy_accept
from logitspec.spec_decode.tree import DraftTree
from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.gpu import GraphRunner, SlotKV, bucket, greedy_chains
from logitspec.worker.kv_cache import BatchKV
from logitspec.worker.masks import StepRow

N_NEW = 14


def test_buckets():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket(9, (1, 2, 4, 8))


def _filled_slots(layers=2, slots=3, heads=2, max_len=12, dim=4):
    kv = SlotKV(layers, slots, max_len)
    kv.allocate(heads, dim, torch.float32)
    # each entry holds its own (layer, slot, column): moves are easy to read
    lay = torch.arange(layers)[:, None, None, None, None] * 1000
    slot = torch.arange(slots)[None, :, None, None, None] * 100
    col = torch.arange(max_len)[None, None, None, :, None]
    kv.K.copy_((lay + slot + col).expand_as(kv.K).float())
    kv.V.copy_(-kv.K)
    return kv


def test_commit_moves_the_accepted_nodes_on_all_layers():
    kv = _filled_slots()
    kv.lengths = [3, 5, 0]
    kv.commit_paths([[0, 2, 5], [0], [0, 1]])  # row 0: nodes 2 and 5 move to depths 1 and 2
    assert kv.lengths == [6, 6, 2]
    for layer in range(2):
        base = layer * 1000
        assert kv.K[layer, 0, 0, :7, 0].tolist() == [base + c for c in (0, 1, 2, 3, 5, 8, 6)]
        assert kv.K[layer, 1, 1, :6, 0].tolist() == [base + 100 + c for c in range(6)]  # nothing moved
        assert torch.equal(kv.V, -kv.K)
    # the engine's convention: columns = the longest row's length + node index
    kv.lengths = [3, 5, 0]
    kv.K.zero_()
    kv.K[:, 0, :, 3 + 2] = 9.0  # row 0's node 2 sits at column lengths[0] + 2
    kv.commit([[5 + 0, 5 + 2], [5], [5]])
    assert kv.K[0, 0, 0, 4, 0].item() == 9.0 and kv.lengths == [5, 6, 1]


def test_keep_rows_compacts_the_slots():
    kv = _filled_slots()
    kv.lengths = [4, 6, 5]
    order = kv.keep_rows([2, 1])
    assert order == [2, 1] and kv.lengths == [5, 6]
    assert kv.K[1, 0, 0, :5, 0].tolist() == [1200 + c for c in range(5)]  # slot 2 moved to slot 0
    assert kv.keep_rows([1]) == [1] and kv.lengths == [6]
    assert kv.K[0, 0, 1, :6, 0].tolist() == [100 + c for c in range(6)]


def test_add_rows_copies_prefilled_rows_into_slots():
    model = tiny_model("llama")
    runner = GraphRunner(model, max_rows=4, max_len=64, key_block=16)
    with torch.inference_mode():
        row, last = runner.prefill([5, 6, 7, 8, 9], chunk=3)
        kv = runner.new_kv()
        kv.add_rows([(row, 0, 2)])
        direct = runner.prefill_slot([5, 6, 7, 8, 9], chunk=2)
    assert kv.lengths == [5, 5, 5]
    src = next(iter(row._layers())).keys[0, :, :5]
    assert torch.allclose(kv.K[0, 0, :, :5], src) and torch.allclose(kv.K[0, 1, :, :5], src)
    assert torch.allclose(kv.K[:, 2, :, :5], kv.K[:, 0, :, :5], atol=1e-5)
    assert torch.allclose(direct.scores, last.scores, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_greedy_equals_generate(family):
    prompts = repetitive_prompts(3, seed=2)
    refs = [hf_greedy(tiny_model(family), p, N_NEW) for p in prompts]
    runner = GraphRunner(tiny_model(family), max_rows=4, max_len=96, key_block=16)
    with torch.inference_mode():
        got = greedy_chains(runner, prompts, N_NEW, chunk=8)  # chunked prefill into the slots
    assert got == refs
    # 3 rows ran as the 4-row bucket; key lengths grew through 16-column buckets
    assert {(r, t) for r, t, _ in runner.buckets} == {(4, 1)}
    assert len(runner.buckets) > 1


def _random_tree(rng, root: int, truth: list[int], n: int) -> DraftTree:
    """A tree of ``n`` nodes: a chain mostly following ``truth`` (the greedy continuation) with
    random branches between its nodes, so accepted paths skip node indices."""
    tokens, parents, end, depth = [root], [-1], 0, 0
    for i in range(1, n):
        if rng.random() < 0.5 and depth < len(truth):
            tokens.append(truth[depth] if rng.random() < 0.85 else int(rng.integers(VOCAB)))
            parents.append(end)
            end, depth = i, depth + 1
        else:
            tokens.append(int(rng.integers(VOCAB)))
            parents.append(int(rng.integers(0, i)))
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


def _tree_run(family, attention="sdpa", steps_max=40, seed=0):
    """Tree steps through the runner and through the eager EagerRunner side by side: per step
    the max node-logit difference, the accepted paths of both; the final tokens and the references."""
    rng = np.random.default_rng(seed)
    prompts = repetitive_prompts(3, seed=3)
    refs = [hf_greedy(tiny_model(family), p, N_NEW + 8) for p in prompts]
    runner = GraphRunner(tiny_model(family), max_rows=4, max_len=128, key_block=16, attention=attention,
                         flex_block=16)
    eager = EagerRunner(tiny_model(family))
    diffs, same_paths = [], True
    with torch.inference_mode():
        kv = runner.new_kv()
        out = [[int(runner.prefill_slot(p).argmax[0])] for p in prompts]
        ekv = BatchKV()
        ekv.add_rows([(eager.prefill(p, 512)[0], 0, 1) for p in prompts])
        for _ in range(steps_max):
            if min(len(o) for o in out) >= N_NEW:
                break
            trees = [_random_tree(rng, o[-1], ref[len(o):], int(rng.integers(1, 12)))
                     for o, ref in zip(out, refs)]
            fwd = runner([StepRow.from_tree(kv.lengths[b], t) for b, t in enumerate(trees)], kv,
                         all_logits=True)
            cols = ekv.columns  # before the forward appends the step's columns
            efwd = eager([StepRow.from_tree(ekv.lengths[b], t) for b, t in enumerate(trees)], ekv,
                         all_logits=True)
            diffs.append((fwd.nodes.scores - efwd.nodes.scores).abs().max().item())
            paths, epaths = [], []
            for b, t in enumerate(trees):
                path, bonus = greedy_accept(t, fwd.logits[b].argmax.tolist())
                epath, ebonus = greedy_accept(t, efwd.logits[b].argmax.tolist())
                same_paths &= (path, bonus) == (epath, ebonus)
                out[b] += [int(t.tokens[n]) for n in path[1:]] + [bonus]
                paths.append(path)
                epaths.append(epath)
            kv.commit_paths(paths)
            ekv.commit([[cols + n for n in p] for p in epaths])
    return [o[:N_NEW] for o in out], [r[:N_NEW] for r in refs], diffs, same_paths, runner


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_steps_match_the_eager_forward(family):
    got, refs, diffs, same_paths, runner = _tree_run(family)
    assert got == refs
    assert same_paths
    assert max(diffs) < 1e-4, diffs
    assert any(t > 4 for _, t, _ in runner.buckets)  # trees padded to node buckets past a few nodes


def test_flex_attention_path(family="gemma3"):
    """flex attention (eager on CPU) with the block mask from the buffers: the same tokens and
    logits as the eager forward (Gemma 3: its sliding layers' blocks start at the window)."""
    got, refs, diffs, same_paths, runner = _tree_run(family, attention="flex", steps_max=6, seed=1)
    assert same_paths
    assert max(diffs) < 1e-4, diffs
    assert all(k == runner.kv.max_len for _, _, k in runner.buckets)  # one key length: the blocks do the rest


def test_flex_blocks_cover_every_visible_column():
    """The block lists the flex path writes skip no column the mask rule shows (sliding kinds
    start at their window's first block), and end at each row's last node."""
    from logitspec.worker.gpu.step import FlexMasks, StepBuffers, visible

    buf = StepBuffers(3, 4, torch.device("cpu"))
    rows = [StepRow.chain(37, [1, 2, 3]), StepRow.chain(5, [4])]
    buf.fill(rows, [37, 5])
    flex = FlexMasks(buf, 64, {"full_attention": None, "sliding_attention": 6}, block=8)
    for kind, bm in flex.update().items():
        blocks = bm.to_dense()[:, 0, 0]  # [R, 8]: the kv blocks each row reads
        seen = visible(buf, torch.arange(3)[:, None, None], buf.node[None, :, None],
                       torch.arange(64)[None, None, :], flex.windows[kind])  # [R, T, 64]
        needed = seen.any(1).view(3, 8, 8).any(-1)  # [R, 8]
        assert not (needed & ~blocks.bool()).any(), kind
    assert blocks[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]  # row 0, window 6: columns 32..40
    assert blocks[2].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]  # a pad row: its nodes' own columns


def test_repeated_shapes_build_nothing():
    runner = GraphRunner(tiny_model("qwen2"), max_rows=4, max_len=64, key_block=32)
    prompts = repetitive_prompts(2, seed=4)
    with torch.inference_mode():
        kv = runner.new_kv()
        roots = [int(runner.prefill_slot(p).argmax[0]) for p in prompts]

        def step(n):
            rows = [StepRow.chain(kv.lengths[b], [roots[b]] * n) for b in range(2)]
            return runner(rows, kv, all_logits=True)

        step(3)  # warm-up: bucket (2 rows, 4 nodes)
        before, allocs = dict(runner.counters), runner.kv.allocations
        for n in (3, 4, 2, 4):  # the same buckets (nodes 3, 4 -> 4; 2 -> 2 is new)
            step(n)
    assert runner.counters["graphs"] == before["graphs"] + 1  # only the 2-node bucket
    assert runner.counters["allocations"] == before["allocations"] + 1
    assert runner.kv.allocations == allocs == 1
    assert runner.counters["replays"] == before["replays"] + 4


@pytest.mark.parametrize("method", ["ar", "logitspec"])
def test_engine_through_the_graph_runner(method):
    """The whole engine (drafting, acceptance by `decide`, the session's admissions and releases)
    with the graph runner as its model runner: the same tokens as with the eager runner."""
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(5, seed=5)
    config = SpecConfig(method=method, budget="fixed", max_batch_size=3)
    lengths = [N_NEW, 9, N_NEW, 5, 11]  # rows finish at different steps: slots are released and refilled
    requests = [Request(max_new_tokens=n) for n in lengths]
    plain = Engine(tiny_model("gemma3"), None, config).run(prompts, requests).results
    runner = GraphRunner(model, max_rows=3, max_len=128, key_block=16)
    got = Engine(model, None, config, runner=runner).run(prompts, requests).results
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert runner.counters["replays"] > 0 and len(runner.buckets) > 1
    if method == "logitspec":
        assert max(r.stats["mean_accepted"] for r in got) > 1.2


def test_default_runner_is_eager_off_cuda():
    from logitspec.worker.gpu import default_runner

    assert isinstance(default_runner(tiny_model("llama"), max_rows=2), EagerRunner)


def test_the_step_compiles_as_one_graph_without_recompiling():
    """The CPU-side evidence that a step is capturable: dynamo traces the whole step (masks from the
    buffers, the decoder, the slot writes) as one graph (``fullgraph``), and new inputs in the
    same bucket replay it without a recompile (the backend is called once: one compile in all), with
    the eager step's output."""
    import torch._dynamo

    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    runner = GraphRunner(tiny_model("llama"), max_rows=2, max_len=64, key_block=32)
    prompts = repetitive_prompts(2, seed=6)
    with torch.inference_mode():
        kv = runner.new_batch()
        roots = [int(runner.prefill_slot(p).argmax[0]) for p in prompts]
        rows = lambda toks: [StepRow.chain(kv.lengths[b], toks[b]) for b in range(2)]  # noqa: E731
        fn, hidden = runner.prepare(rows([[roots[0]] * 3, [roots[1], 5]]), kv)
        torch._dynamo.reset()  # no earlier test's compiled code for this function
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=counting_backend)
        for toks in ([[roots[0]] * 3, [roots[1], 5]], [[7, 8, 9], [roots[1]] * 4]):
            fn_again, _ = runner.prepare(rows(toks), kv)  # the same bucket's buffers, refilled
            assert fn_again.__code__ is fn.__code__
            fn()
            want = hidden.clone()
            compiled()
            assert torch.allclose(hidden, want, atol=1e-6)
    assert len(compiles) == 1


def test_a_tree_beyond_the_node_buckets_runs_without_a_graph_and_equals_generate(caplog):
    """Nodes beyond the largest bucket never crash: that step runs in its exact shape without a graph
    (logged once), and decoding stays lossless."""
    model = tiny_model("llama")
    runner = GraphRunner(model, max_rows=2, max_len=96, key_block=32, node_buckets=(1, 2, 4))
    prompts = repetitive_prompts(2, seed=8)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]

    def tree(b, root, step):  # 6 nodes: the greedy continuation's first tokens, then a branch
        chain = refs[b][step:step + 4] or [1]
        return DraftTree(np.array([root] + chain + [3]), np.array([-1] + list(range(len(chain))) + [0]))

    with torch.inference_mode():
        got = greedy_chains(runner, prompts, N_NEW, tree=tree)
    assert got == refs
    assert any(T > 4 for _, T, _ in runner.buckets)  # an exact, unbucketed shape ran
    assert caplog.text.count("beyond the largest node bucket") == 1


def test_a_capture_that_fails_falls_back_to_running_without_a_graph(caplog):
    """A step whose CUDA-graph capture raises runs uncaptured, with one warning, never a crash (the
    capture itself is the seam; on CPU it is made to fail)."""
    class FailingCapture(GraphRunner):
        def _capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_model("qwen2")
    runner = FailingCapture(model, max_rows=2, max_len=64, key_block=32)
    runner.capture = True  # as on CUDA
    prompts = repetitive_prompts(2, seed=9)
    with torch.inference_mode():
        got = greedy_chains(runner, prompts, 8)
    assert got == [hf_greedy(model, p, 8) for p in prompts]
    assert runner.counters["uncaptured"] == runner.counters["graphs"] > 0 and runner.counters["captures"] == 0
    assert caplog.text.count("capturing the step") == 1


@pytest.mark.parametrize("choice,kind", [("auto", EagerRunner), ("eager", EagerRunner),
                                         ("graph", GraphRunner)])
def test_the_runner_a_config_names(choice, kind):
    engine = Engine(tiny_model("llama"), None, SpecConfig(runner=choice, max_batch_size=2))
    assert type(engine.runner) is kind  # on CPU auto is the eager runner, graph the uncaptured static path


@pytest.mark.parametrize("method", ["logitspec", "lookahead"])
def test_the_papers_configuration_and_lookaheads_shape_run_through_the_graph_runner(method):
    """``SpecConfig.paper()`` (up to 64 drafted nodes and the root) and lookahead's fixed shape through
    the graph runner: lossless against HF generate (65-node steps: the test below)."""
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(3, seed=10)
    cfg = (SpecConfig.paper(method=method, runner="graph", max_batch_size=2) if method == "logitspec"
           else SpecConfig(method=method, runner="graph", max_batch_size=2))
    engine = Engine(model, None, cfg)
    assert isinstance(engine.runner, GraphRunner)
    got = engine.generate(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in got] == [hf_greedy(model, p, N_NEW) for p in prompts]


def test_a_65_node_tree_runs_beyond_the_largest_bucket():
    """Trees of 65 nodes (the paper's 64 drafted and the root), beyond the 64-node bucket: their steps
    run in their exact shape, without a graph, and decode as HF generate does."""
    prompts = repetitive_prompts(2, seed=14)
    refs = [hf_greedy(tiny_model("llama"), p, N_NEW + 66) for p in prompts]
    rng = np.random.default_rng(3)
    runner = GraphRunner(tiny_model("llama"), max_rows=2, max_len=256, key_block=16)

    def tree(b, root, step):
        done = len(prompts[b])  # the tokens decoded so far follow the reference: the truth after root
        return _random_tree(rng, root, refs[b][runner.kv.lengths[b] - done + 1:], 65)
    with torch.inference_mode():
        got = greedy_chains(runner, prompts, N_NEW, tree=tree)
    assert got == [r[:N_NEW] for r in refs]
    assert {t for _, t, _ in runner.buckets} == {65}


@pytest.mark.parametrize("method", ["ar", "logitspec"])
def test_every_step_shape_is_built_at_start_up_and_none_after(method):
    """A graph runner with flex attention (the engine's on CUDA: steps keyed on rows and nodes alone)
    builds every (row bucket, node bucket) the configuration can use when the engine is made; a
    whole run then builds nothing more (on CUDA: captures nothing), and stays lossless."""
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(4, seed=11)
    cfg = SpecConfig(method=method, budget="fixed", capacity=8, max_batch_size=3)
    runner = GraphRunner(model, max_rows=3, max_len=256, attention="flex")
    engine = Engine(model, None, cfg, runner=runner)
    assert runner.started
    rows = (1, 2, 3)  # the row buckets below 3 slots, and 3
    nodes = (1,) if method == "ar" else (1, 2, 4, 8, 16)  # 8 drafted and the root: up to the 16 bucket
    assert runner.start_up["graphs"] == len(rows) * len(nodes) == runner.counters["graphs"]
    built = runner.counters["graphs"]
    lengths = (N_NEW, 5, 9, 7)  # rows end at different steps: the batch shrinks and refills
    got = engine.run(prompts, [Request(max_new_tokens=n) for n in lengths]).results
    assert [r.token_ids for r in got] == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    assert runner.counters["replays"] > 0
    assert runner.counters["graphs"] == built and runner.counters["built_after_start"] == 0
    if method != "ar":
        assert max(r.stats["mean_accepted"] for r in got) > 1.2  # trees of several nodes ran


def test_a_step_built_after_start_up_is_counted():
    """The counter that proves "nothing after start-up" counts: an SDPA runner keys steps on the key
    length too, so a longer context builds a new step after start-up."""
    model = tiny_model("llama")
    runner = GraphRunner(model, max_rows=2, max_len=128, key_block=16)
    runner.capture_all(2, 4)
    assert runner.start_up["graphs"] == 0 and runner.started
    with torch.inference_mode():
        greedy_chains(runner, repetitive_prompts(2, seed=12), 8)
    assert runner.counters["built_after_start"] == runner.counters["graphs"] > 0


def test_a_step_flex_attention_cannot_run_attends_with_sdpa(monkeypatch, caplog):
    """Where flex attention has no kernel for a step (on CUDA: inductor finds no configuration and
    raises), that bucket attends with SDPA over the whole slot from then on, logged once: the run
    finishes with the eager runner's tokens, and only the failing buckets fell back."""
    from logitspec.worker.gpu import step as step_module

    def no_kernel_past_4_nodes(device):
        def run(query, key, value, **kw):
            if query.shape[2] > 4:
                raise RuntimeError("NoValidChoicesError: no kernel for this query block")
            return torch.nn.attention.flex_attention.flex_attention(query, key, value, **kw)
        return run

    monkeypatch.setattr(step_module, "flex", no_kernel_past_4_nodes)
    model = tiny_model("llama")
    prompts = repetitive_prompts(3, seed=13)
    cfg = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    runner = GraphRunner(model, max_rows=2, max_len=256, attention="flex")
    got = Engine(model, None, cfg, runner=runner).run(prompts, Request(max_new_tokens=N_NEW)).results
    assert [r.token_ids for r in got] == [hf_greedy(model, p, N_NEW) for p in prompts]
    fell_back = {key for key in runner._buffers if key not in runner._flex}
    assert fell_back and all(T > 4 for _, T in fell_back)
    assert runner.counters["flex_fallbacks"] == len(fell_back)
    assert any((R, T) in runner._flex for R, T in runner._buffers if T <= 4)  # the others kept flex
    assert caplog.text.count("attend with SDPA") == 1


def test_a_tensor_parallel_ranks_step_that_cannot_run_raises_instead_of_falling_back_alone(monkeypatch):
    """A rank of a group (``sharded_head``) never runs a step otherwise than its peers: where flex
    attention has no kernel, the error ends the step (the group is replaced) instead of this rank
    attending with SDPA alone; nothing is counted as a fallback."""
    from logitspec.worker.gpu import step as step_module

    def no_kernel(device):
        def run(query, key, value, **kw):
            raise RuntimeError("NoValidChoicesError: no kernel for this query block")
        return run

    monkeypatch.setattr(step_module, "flex", no_kernel)
    model = tiny_model("llama")
    runner = GraphRunner(model, max_rows=2, max_len=256, attention="flex", sharded_head=True)
    assert runner.startup_s == float("inf")  # no rank-local clock decides which steps it builds
    with pytest.raises(RuntimeError, match="NoValidChoicesError"), torch.inference_mode():
        greedy_chains(runner, repetitive_prompts(2, seed=13), 4)
    assert runner.counters["flex_fallbacks"] == 0 and runner.counters["uncaptured"] == 0


def test_start_up_time_is_bounded_and_the_rest_is_built_when_first_used(caplog):
    """With no start-up time, capture_all builds one bucket and says so; the others are built when a
    step first needs them (counted after start-up), and the tokens are the same."""
    model = tiny_model("llama")
    cfg = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
    runner = GraphRunner(model, max_rows=2, max_len=256, attention="flex", startup_s=0.0)
    engine = Engine(model, None, cfg, runner=runner)
    assert runner.start_up["graphs"] == 1 and "start-up time (0 s) spent after 1 of 10" in caplog.text
    prompts = repetitive_prompts(2, seed=15)
    got = engine.generate(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in got] == [hf_greedy(model, p, N_NEW) for p in prompts]
    assert runner.counters["built_after_start"] > 0
