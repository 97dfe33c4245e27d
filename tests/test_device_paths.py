"""The paths a GPU takes, checked on CPU: acceptance decided where the logits are (one transfer),
sampling of every node in one batch, half-precision models end to end, masks laid out for SDPA."""
import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, VOCAB, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.kernels import onednn, rms_norm
from logitspec.sample.acceptance import decide, greedy_accept
from logitspec.sample.node_logits import NodeLogits, OutputMode
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import inverse_cdf, sample_token
from logitspec.spec_decode.tree import DraftTree, TreeBuilder
from logitspec.worker import attention as attention_module
from logitspec.worker.head import Head
from logitspec.worker.masks import MASK_ALIGN, StepRow, attention_masks, fold_groups, pack, sdpa_aligned

N_NEW = 20


def _trees(seed: int, n: int) -> list[DraftTree]:
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(n):
        b = TreeBuilder(int(rng.integers(0, 6)), int(rng.integers(0, 12)))
        for _ in range(5):
            chain = rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
            b.add_chain(chain, parent=int(rng.integers(0, len(b.tokens))))
        trees.append(b.build())
    # siblings with the same token: the walk follows the first (DraftTree.child)
    trees.append(DraftTree(np.array([9, 2, 2, 3, 4]), np.array([-1, 0, 0, 2, 1])))
    return trees


@pytest.mark.parametrize("seed", range(6))
def test_decide_greedy_equals_the_host_walk(seed):
    trees = _trees(seed, 5)
    rng = np.random.default_rng(100 + seed)
    rows = [StepRow.from_tree(10 + i, t) for i, t in enumerate(trees)]
    packed = pack(rows, 40, {"full_attention": None}, torch.float32)
    B, T = packed.ids.shape
    argmax = [rng.integers(0, 6, len(t)) for t in trees]
    argmax[-1][:] = [2, 4, 3, 0, 1]  # the first 2 (node 1) is followed: 4 is its child, 3 is under node 2
    scores = torch.randn(sum(len(t) for t in trees), 8)
    flat = torch.from_numpy(np.concatenate(argmax))
    scores[torch.arange(len(flat)), flat] = 10.0  # the argmax, and the best score for the guesses
    select = torch.cat([torch.arange(b * T, b * T + len(t)) for b, t in enumerate(trees)])
    starts = torch.tensor(np.cumsum([0] + [len(t) for t in trees[:-1]]))
    d = decide(NodeLogits(scores, exact=True), packed, select, starts, SamplingParams(), None, top_k=3)
    for b, (tree, am) in enumerate(zip(trees, argmax)):
        path, bonus = greedy_accept(tree, am.tolist())
        assert (tree.path_to(d.last[b]), d.bonus[b]) == (path, bonus)
        assert d.top[b] == torch.topk(scores[starts[b] + path[-1]], 4).indices.tolist()
    assert trees[-1].path_to(d.last[-1]) == [0, 1, 4]


def test_inverse_cdf_is_sample_token():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, 30, generator=g) * 3, dim=-1)
    probs[probs < 0.02] = 0.0  # zero-probability tokens, as after top-k / top-p
    probs[:, -3:] = 0.0  # ... including the last ones (the top edge)
    for seed in range(3):
        host = [sample_token(p, torch.Generator().manual_seed(seed * 100 + i)) for i, p in enumerate(probs)]
        gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(probs))]
        u = torch.tensor([torch.rand((), generator=g, dtype=torch.float64).item() for g in gens])
        assert inverse_cdf(probs, u, chunk=16).tolist() == host
    # u at the top edge: the last token with probability, never a zero-probability one
    top = inverse_cdf(probs[:2], torch.tensor([1.0, 1.0 - 2.0 ** -53], dtype=torch.float64))
    assert top.tolist() == [int(torch.nonzero(p).max()) for p in probs[:2]]


@pytest.mark.parametrize("batch", [1, 3])
def test_sampling_on_the_device_equals_the_host_walk(batch):
    """Every node drawn at once with its depth's uniform == the host walk's draws at visited nodes
    (from full float32 rows: the screened host walk maps uniforms to tokens in another order)."""
    model = tiny_model("llama")
    prompts = repetitive_prompts(4, seed=7)
    kw = dict(max_new_tokens=N_NEW, temperature=0.9, top_p=0.9, top_k=40, seed=5)
    cfg = SpecConfig(method="logitspec", max_batch_size=batch, budget="fixed")
    host = Engine(model, None, cfg, sample_on_host=True, screened_sampling=False).generate(prompts, **kw)
    dev = Engine(model, None, cfg, sample_on_host=False).generate(prompts, **kw)
    assert [r.token_ids for r in dev] == [r.token_ids for r in host]
    assert max(r.stats["mean_accepted"] for r in dev) > 1.0  # drafts were verified by sampling


@pytest.fixture(scope="module", params=FAMILIES)
def bf16_case(request):
    """A tiny bfloat16 model with the CPU kernels ``load_model`` gives one (oneDNN's bfloat16
    linears where batch-invariant here, fused norms; head dim 32, so that the decode attention kernel
    runs as on real models: with SDPA, bfloat16 rows part at near-ties when batched, which sampled
    draws expose), its prompts and its ``ar`` outputs at batch 1."""
    model = tiny_model(request.param, head_dim=32).to(torch.bfloat16)
    if onednn.available():
        onednn.use_onednn_linears(model)
    rms_norm.use_fused_rms_norms(model)
    prompts = repetitive_prompts(6, seed=1)
    refs = [r.token_ids for r in Engine(model, None, SpecConfig(method="ar")).generate(prompts,
                                                                                       max_new_tokens=N_NEW)]
    return model, prompts, refs


@pytest.mark.parametrize("method", ["pld", "logitspec"])
def test_bfloat16_greedy_equals_bfloat16_ar_batch1(bf16_case, method):
    """Our own bfloat16 ``ar`` is the reference (docs/gpu.md says why not HF generate)."""
    model, prompts, refs = bf16_case
    eng = Engine(model, None, SpecConfig(method=method, budget="fixed"))
    assert eng.runner.head.screen is not None  # on CPU the screen serves bfloat16 weights too
    res = eng.generate(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs
    assert max(r.stats["mean_accepted"] for r in res) > 1.2


@pytest.mark.parametrize("method", ["ar", "pld", "logitspec"])
def test_bfloat16_batched_equals_bfloat16_ar_alone(bf16_case, method):
    """Batched, a row's attention sums over its visible columns only (the decode kernel, widened
    to float32), its linears are batch-invariant and its logits float32 products: each row gets
    the tokens it gets alone."""
    model, prompts, refs = bf16_case
    res = Engine(model, None, SpecConfig(method=method, max_batch_size=3, budget="fixed")).generate(
        prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs


def test_bfloat16_host_sampling_is_seeded_and_batch_independent(bf16_case):
    """Sampled bfloat16 rows draw from the screen over the widened output weights: a row's tokens
    depend on its seed alone, not on its company."""
    model, prompts, _ = bf16_case
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, top_p=0.9)
    seeds = list(range(21, 21 + len(prompts)))
    solo = [Engine(model, None, SpecConfig(method="logitspec")).generate([p], seed=[s], **kw)[0].token_ids
            for p, s in zip(prompts, seeds)]
    batched = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=3)).generate(prompts,
                                                                                             seed=seeds, **kw)
    assert [r.token_ids for r in batched] == solo


def test_bfloat16_sampling_on_the_device_runs():
    model = tiny_model("gemma3").to(torch.bfloat16)
    res = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2),
                 sample_on_host=False).generate(
        repetitive_prompts(3, seed=2), max_new_tokens=N_NEW, temperature=1.0, seed=3)
    assert all(len(r.token_ids) == N_NEW and all(0 <= t < VOCAB for t in r.token_ids) for r in res)


def test_bfloat16_head_logits_are_float32_products_of_the_widened_weights():
    model = tiny_model("qwen2").to(torch.bfloat16)
    head = Head(model)
    assert head.fast and head.screen is not None
    rows = [StepRow.chain(0, [1, 2, 3])]
    from logitspec.worker.kv_cache import BatchKV

    p = pack(rows, 0, {"full_attention": None}, torch.bfloat16)
    out = head(p.ids, p.pos, p.mask, BatchKV.empty_row().hf, torch.tensor([2]))
    assert out.scores.dtype == torch.float32 and out.scores.shape == (1, VOCAB)
    assert p.mask.dtype == torch.bfloat16 and p.mask.min() == torch.finfo(torch.bfloat16).min
    h = torch.randn(5, model.config.hidden_size).bfloat16()
    exact = head.output(h)
    # float32 products of the widened weights: within float32 rounding of the float64 product (the
    # summation order is the GEMM's and varies by CPU), where a bfloat16 product is 100x further off
    ref = h.double() @ head.weight.double().T  # [5, V]
    scale = ref.abs().max()
    assert (exact.scores.double() - ref).abs().max() <= 1e-5 * scale
    assert (torch.mm(h, head.weight.T).double() - ref).abs().max() > 1e-3 * scale
    assert torch.equal(head.output(h, OutputMode.GREEDY).argmax, exact.scores.argmax(dim=1))


def test_masks_off_cpu_have_aligned_rows():
    """SDPA's memory-efficient kernel copies a mask whose row stride is not aligned, in every layer."""
    dev = torch.device("meta")
    pos = torch.zeros(3, 5, dtype=torch.int64, device=dev)
    vis = torch.zeros(3, 5, 5, dtype=torch.bool, device=dev)
    m = attention_masks(torch.zeros(3, dtype=torch.int64, device=dev), pos, vis, 37,
                        {"full_attention": None, "sliding_attention": 4}, torch.bfloat16)
    for mask in m.values():
        assert mask.shape == (3, 1, 5, 42) and mask.stride(-2) % MASK_ALIGN == 0 and mask.stride(-1) == 1


def test_sdpa_aligned_copies_only_views_that_start_mid_row():
    """A segment's square of a packed mask starts mid-row: SDPA's memory-efficient CUDA kernel read
    it at a misaligned address (the first run on the H200). The copy is aligned and holds the same
    values; an aligned mask passes through uncopied."""
    full = torch.randn(1, 1, 28, 32)[..., :28]  # [1, 1, T, W] rows padded to 32 columns
    assert sdpa_aligned(full) is full
    square = full[..., 5:14, 5:14]
    got = sdpa_aligned(square)
    assert torch.equal(got, square) and got.storage_offset() % MASK_ALIGN == 0
    assert all(s % MASK_ALIGN == 0 for s in got.stride()[:-1]) and got.stride(-1) == 1


def test_segment_masks_reach_sdpa_aligned_off_cpu(monkeypatch):
    """Off CPU, each prompt's square of a side-by-side prefill reaches SDPA aligned (meta tensors
    stand in for the GPU's; SDPA is replaced by a recorder)."""
    seen = []

    def sdpa(module, query, key, value, mask, **kw):
        seen.append(mask)
        return query.transpose(1, 2), None

    monkeypatch.setattr(attention_module, "sdpa_attention_forward", sdpa)
    dev = torch.device("meta")
    q = torch.empty(1, 4, 28, 16, device=dev)
    kv = torch.empty(1, 4, 28, 16, device=dev)
    mask = torch.empty(1, 1, 28, 32, device=dev)[..., :28]
    module = torch.nn.Module()
    module.num_key_value_groups = 1  # (grouped heads are folded, each group's mask copied: test above)
    out, _ = attention_module.attention(module, q, kv, kv, mask, segments=((0, 5), (5, 14), (14, 28)),
                                        prefill=True)
    assert out.shape == (1, 28, 4, 16) and len(seen) == 3
    assert all(m.storage_offset() % MASK_ALIGN == 0 and m.stride(-2) % MASK_ALIGN == 0 for m in seen)


def test_folded_group_masks_off_cpu_keep_aligned_rows():
    """Off CPU the query heads of a group are stacked along the queries as on CPU (no key copy per
    head); the repeated mask keeps rows padded to ``MASK_ALIGN`` (else SDPA copies it per layer)."""
    mask = torch.randn(3, 1, 5, 32)[..., :21]  # [B, 1, T, S]
    plain = fold_groups(mask, 4)
    got = fold_groups(mask, 4, aligned=True)
    assert torch.equal(got, plain) and got.shape == (3, 1, 20, 21)
    assert all(s % MASK_ALIGN == 0 for s in got.stride()[:-1]) and got.stride(-1) == 1
    meta = fold_groups(torch.empty(2, 1, 3, 40, device="meta"), 2)  # the default off CPU
    assert meta.stride(-2) % MASK_ALIGN == 0 and meta.shape == (2, 1, 6, 40)


def test_trimmed_sliding_masks_drop_only_columns_no_node_sees():
    """``pack(trim=True)``: a sliding kind's mask starts at min(prefix) - window + 1; the columns it
    drops are hidden from every real node in the full mask, the rest are the full mask's (padding
    nodes, whose outputs are never read, may differ); full-attention masks are untouched."""
    trees = _trees(3, 3)
    rows = [StepRow.from_tree(p, t) for p, t in zip((30, 41, 35), trees)]
    windows = {"full_attention": None, "sliding_attention": 8}
    full = pack(rows, 50, windows, torch.float32)
    trimmed = pack(rows, 50, windows, torch.float32, trim=True)
    assert full.starts == {"full_attention": 0, "sliding_attention": 0}
    start = trimmed.starts["sliding_attention"]
    assert start == 30 - 8 + 1 and trimmed.starts["full_attention"] == 0
    hidden = torch.finfo(torch.float32).min
    for b, n in enumerate(full.sizes):  # [B, 1, T, cols]: row b's real nodes
        assert (full.mask["sliding_attention"][b, :, :n, :start] == hidden).all()
        assert torch.equal(trimmed.mask["sliding_attention"][b, :, :n],
                           full.mask["sliding_attention"][b, :, :n, start:])
    assert torch.equal(trimmed.mask["full_attention"], full.mask["full_attention"])
