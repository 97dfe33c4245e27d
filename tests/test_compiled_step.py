"""The graph runner's step compiled by inductor (``--runner compiled``, logitspec.worker.gpu.fused):
the same tokens as the uncompiled steps, one compile per bucket, none again for a shape it has seen,
and the SDPA kernel pinned where asked."""
import re

import pytest
import torch
from tiny_models import FAMILIES, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.worker.gpu import GraphRunner
from logitspec.worker.gpu.fused import StepCompiler, sdpa_context

CFG = SpecConfig(method="logitspec", budget="fixed", capacity=8, max_batch_size=2)
GREEDY = Request.make(max_new_tokens=12)
SAMPLED = Request.make(max_new_tokens=12, temperature=0.8, seed=3)


def one_bucket_runner(model, **kw) -> GraphRunner:
    """Every step in one bucket (2 rows x 16 nodes, one key length): one compile per model."""
    return GraphRunner(model, max_rows=2, max_len=256, row_buckets=(2,), node_buckets=(16,), **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_step_gives_the_tokens_of_the_uncompiled_one(family, caplog):
    """Greedy: the engine's tokens through compiled steps equal the eager runner's; sampled: equal to
    the uncompiled graph runner's (the same draws on the device). The whole step compiles as one
    graph (a graph break fails ``fullgraph`` and would leave the step uncompiled, with a warning)
    when first used; rows refilled, a second run and a second sampling setting compile nothing more."""
    model = tiny_model(family)
    prompts = repetitive_prompts(3, seed=4)
    eager = Engine(model, None, CFG).run(prompts, GREEDY).results
    uncompiled = Engine(model, None, CFG, runner=one_bucket_runner(model)).run(prompts, SAMPLED).results
    runner = one_bucket_runner(model, compile=True)
    engine = Engine(model, None, CFG, runner=runner)
    greedy = engine.run(prompts, GREEDY).results
    compiled = runner.counters["compiles"]
    sampled = engine.run(prompts, SAMPLED).results
    assert [r.token_ids for r in greedy] == [r.token_ids for r in eager]
    assert [r.token_ids for r in sampled] == [r.token_ids for r in uncompiled]
    assert max(r.stats["mean_accepted"] for r in greedy) > 1.1  # trees of several nodes were verified
    assert runner.counters["graphs"] == 1 and compiled >= 1 and runner.counters["compiles"] == compiled
    assert runner.counters["uncompiled"] == 0 and runner.counters["replays"] > 20
    assert "not used" not in caplog.text and "compiled" in runner.kind


def test_a_compiled_step_whose_output_differs_is_not_used(caplog):
    """A compiler that gets the step wrong (here a backend that shifts the hidden states) costs the
    speed of that bucket, never tokens: its first real step is checked against the uncompiled step,
    which replaces it, with a warning."""
    model = tiny_model("llama")
    prompts = repetitive_prompts(2, seed=7)
    runner = None

    def wrong(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            for buf in runner._buffers.values():
                buf.hidden.add_(1.0)
            return out
        return run

    runner = one_bucket_runner(model, compile=StepCompiler(backend=wrong))
    got = Engine(model, None, CFG, runner=runner).run(prompts, GREEDY).results
    want = Engine(model, None, CFG).run(prompts, GREEDY).results
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert runner.counters["uncompiled"] == 1 and "differs from the uncompiled step" in caplog.text


def test_the_compiled_runner_is_a_config_choice():
    engine = Engine(tiny_model("llama"), None, SpecConfig(runner="compiled", max_batch_size=2))
    assert isinstance(engine.runner, GraphRunner) and engine.runner.fuser is not None
    assert engine.runner.kind.endswith(":compiled")


def test_a_pinned_sdpa_kernel_is_the_one_that_runs():
    """Pinned to the math kernel, the steps give the same tokens; pinned to one this device lacks
    (memory-efficient attention on CPU), a step fails instead of falling back to another kernel."""
    model = tiny_model("qwen2")
    prompts = repetitive_prompts(2, seed=5)
    want = Engine(model, None, CFG).run(prompts, GREEDY).results
    got = Engine(model, None, CFG, runner=one_bucket_runner(model, sdpa_backend="math")).run(prompts, GREEDY)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want]
    q = torch.randn(1, 2, 4, 8)
    with sdpa_context("efficient")(), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 4, 4))
    pinned = one_bucket_runner(model, sdpa_backend="efficient")
    with pytest.raises(RuntimeError):
        Engine(model, None, CFG, runner=pinned).run(prompts, GREEDY)
    with pytest.raises(ValueError, match="sdpa_backend"):
        one_bucket_runner(model, sdpa_backend="flash")


def test_a_compiled_step_writes_the_kv_slots_in_place():
    """No copy of the KV slots in a compiled step: the code inductor generates for it allocates no
    buffer of a layer's slots' shape (a functionalized ``scatter_``, or an index into the 5-D
    storage inside the step, copies every layer's keys and values on every step), the storage stays
    where it was allocated, and the engine's tokens through it equal the eager runner's."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_model("llama")
    prompts = repetitive_prompts(2, seed=6)
    runner = one_bucket_runner(model, compile=True)
    kv = runner.kv
    storage = (kv.K.data_ptr(), kv.V.data_ptr())
    layer = tuple(kv.K.shape[1:])  # [slots, kv heads, max_len, head dim]
    got, code = run_and_get_code(lambda: Engine(model, None, CFG, runner=runner).run(prompts, GREEDY))
    src = "\n".join(code)
    shapes = {tuple(int(d) for d in m.split(",") if d.strip())
              for m in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", src)}
    assert "def call" in src and runner.counters["compiles"] >= 1 and runner.counters["uncompiled"] == 0
    assert layer not in shapes and tuple(kv.K.shape) not in shapes, sorted(shapes)
    assert (kv.K.data_ptr(), kv.V.data_ptr()) == storage and kv.allocations == 1
    want = Engine(model, None, CFG).run(prompts, GREEDY).results
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want]
