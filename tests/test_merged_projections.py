"""Query/key/value and gate/up projections merged at load (logitspec.models.merged_projections):
the same outputs, no second copy of a weight, one GEMM per group in a compiled step, lossless through
every runner."""
import re

import pytest
import torch
from test_compiled_step import CFG, GREEDY, one_bucket_runner
from tiny_models import FAMILIES, repetitive_prompts, tiny_model

from logitspec import Engine
from logitspec.models.merged_projections import MergedPart, merge_projections
from logitspec.worker.gpu import GraphRunner
from logitspec.worker.gpu.fused import graphs_compiled

LAYERS = {"llama": 2, "qwen2": 2, "gemma3": 4}


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_projections_give_the_models_outputs_with_the_same_weights(family):
    """Two groups per layer merged; the logits equal the unmerged model's (to GEMM rounding: one
    product of the concatenated weights sums in the same order per column); the parameters are the
    same numbers, counted once (the parts' weights are views of the merged matrix, not copies)."""
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    before = {n: p.clone() for n, p in model.named_parameters()}
    count = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        want = model(ids).logits
        assert merge_projections(model) == 2 * LAYERS[family]
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == count
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, MergedPart)
    assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(attn.k_proj.weight, before["model.layers.0.self_attn.k_proj.weight"])
    if family == "qwen2":  # biased projections: the biases merged alike
        assert torch.equal(attn.v_proj.bias, before["model.layers.0.self_attn.v_proj.bias"])


def test_a_part_called_out_of_turn_computes_its_own_product():
    """The product is shared only for the same input tensor: a part called first, twice, or with
    another input gives its own projection, whatever order the model calls its parts in."""
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    plain = {n: torch.nn.Linear(32, getattr(attn, n).out_features) for n in ("q_proj", "k_proj", "v_proj")}
    for n, lin in plain.items():
        lin.load_state_dict(getattr(attn, n).state_dict())
    merge_projections(model)
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    with torch.inference_mode():
        for name, inp in (("v_proj", x), ("k_proj", x), ("k_proj", x), ("q_proj", y), ("v_proj", x),
                          ("k_proj", y), ("q_proj", x)):
            torch.testing.assert_close(getattr(attn, name)(inp), plain[name](inp))


def test_only_plain_linears_of_one_input_are_merged():
    """A group with a part that is not a plain ``nn.Linear`` (a tensor-parallel shard, a CPU kernel's
    subclass) is left alone."""
    model = tiny_model("llama")

    class Shard(torch.nn.Linear):
        pass
    mlp = model.model.layers[0].mlp
    shard = Shard(32, 64, bias=False)
    mlp.up_proj = shard
    assert merge_projections(model) == 2 * LAYERS["llama"] - 1
    assert mlp.up_proj is shard and not isinstance(mlp.gate_proj, MergedPart)


def _gemms(code: str) -> int:
    return len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", code))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_step_runs_one_gemm_per_merged_group_and_is_lossless(family):
    """Merged, the code inductor generates for a compiled step holds 3 GEMMs fewer per layer than
    unmerged (query/key/value in one, gate/up in one), and a second run compiles nothing; its greedy
    tokens equal the eager runner's on the merged model."""
    from torch._inductor.utils import run_and_get_code

    prompts = repetitive_prompts(2, seed=6)
    counts = {}
    for merged in (False, True):
        model = tiny_model(family)
        if merged:
            merge_projections(model)
        runner = one_bucket_runner(model, compile=True)
        got, code = run_and_get_code(lambda: Engine(model, None, CFG, runner=runner).run(prompts, GREEDY))
        assert runner.counters["compiles"] >= 1 and runner.counters["uncompiled"] == 0
        steps = [c for c in code if "def call" in c]
        counts[merged] = max(_gemms(c) for c in steps)
        compiled = graphs_compiled()
        Engine(model, None, CFG, runner=runner).run(prompts, GREEDY)  # the parts' state guards nothing new
        assert graphs_compiled() == compiled
    assert counts[False] - counts[True] == 3 * LAYERS[family], counts
    want = Engine(model, None, CFG).run(prompts, GREEDY).results
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want]
    assert max(r.stats["mean_accepted"] for r in want) > 1.0  # draft nodes were accepted


def test_merged_models_are_lossless_through_the_graph_runner_sampled():
    """Sampled: the graph runner's draws on the merged model equal the eager runner's."""
    from logitspec.engine.request import Request

    model = tiny_model("gemma3")
    merge_projections(model)
    prompts = repetitive_prompts(3, seed=8)
    sampled = Request.make(max_new_tokens=12, temperature=0.8, seed=3)
    want = Engine(model, None, CFG).run(prompts, sampled).results
    runner = GraphRunner(model, max_rows=2, max_len=256)
    got = Engine(model, None, CFG, runner=runner).run(prompts, sampled).results
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
