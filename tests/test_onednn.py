"""oneDNN's packed float32 and bfloat16 linears: exact, batch-invariant where swapped, lossless in the
engine."""
import pytest
import torch
from tiny_models import FAMILIES, hf_greedy, repetitive_prompts, tiny_model
from torch import nn

from logitspec import Engine, SpecConfig
from logitspec.kernels import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch has no oneDNN here")
N_NEW = 24


def test_linear_matches_float32_product_for_any_row_count():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(70, 40, generator=g)
    packed = onednn.pack(w)
    for n in (1, 2, 7, 70):
        torch.testing.assert_close(onednn.linear(x[:n], packed, b), x[:n] @ w.T + b, rtol=1e-5, atol=1e-5)


def test_a_swapped_shape_gives_each_row_the_bits_it_gets_alone():
    """What the swap relies on: a row's result is the same alone, in a few rows or in hundreds."""
    if not onednn.batch_invariant(256, 64, torch.get_num_threads()):
        pytest.skip("oneDNN is not batch-invariant for this shape on this CPU (nothing would be swapped)")
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 256, bias=False)
    holder = nn.Sequential(lin)
    assert onednn.use_onednn_linears(holder) == 1 and type(holder[0]) is onednn.OneDnnLinear
    x = torch.randn(300, 64, generator=g)
    with torch.inference_mode():
        together = holder[0](x)
        for i in (0, 1, 150, 299):
            assert torch.equal(holder[0](x[i:i + 1]), together[i:i + 1])
            assert torch.equal(holder[0](x[i:i + 5])[:1], together[i:i + 1])


def test_shapes_that_fail_the_check_are_left_alone(monkeypatch):
    monkeypatch.setattr(onednn, "batch_invariant", lambda *shape: shape[:2] != (32, 16))
    holder = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    assert onednn.use_onednn_linears(holder) == 1
    assert type(holder[0]) is nn.Linear and type(holder[1]) is onednn.OneDnnLinear


def test_batch_invariance_check_finds_a_row_dependent_product(monkeypatch):
    """The check compares bits: a product whose rows depend on the batch size fails it."""
    real = onednn.linear
    def drifting(x, p, b=None, chunk=0):
        return real(x, p, b, chunk) * (1 + 1e-6 * (len(x) > 8))

    monkeypatch.setattr(onednn, "linear", drifting)
    onednn.batch_invariant.cache_clear()
    try:
        assert not onednn.batch_invariant(48, 24, torch.get_num_threads())
        assert onednn.rows_per_call(48, 24, torch.get_num_threads()) is None
    finally:
        onednn.batch_invariant.cache_clear()


def test_a_product_invariant_only_up_to_chunk_rows_is_computed_in_chunks(monkeypatch):
    real = onednn.linear

    def drifting(x, p, b=None, chunk=0):  # other bits past CHUNK_ROWS rows in one call
        if 0 < chunk < len(x):
            return torch.cat([drifting(x[i:i + chunk], p, b) for i in range(0, len(x), chunk)])
        return real(x, p, b) * (1 + 1e-6 * (len(x) > onednn.CHUNK_ROWS))
    monkeypatch.setattr(onednn, "linear", drifting)
    onednn.batch_invariant.cache_clear()
    try:
        assert onednn.rows_per_call(40, 24, torch.get_num_threads()) == onednn.CHUNK_ROWS
    finally:
        onednn.batch_invariant.cache_clear()


def test_probe_inputs_show_another_summation_order_even_in_bfloat16():
    """The checks' inputs: the same products summed in two orders (whole rows, or two halves added)
    differ in nearly every row once rounded to bfloat16; on plain random inputs far fewer rows show
    it (a check on those passed oneDNN's bfloat16 256 x 640 product, which parted on real rows)."""
    def rows_differing(w, x):
        wf, xf = w.float(), x.float()
        whole = torch.stack([sum(xf[r, i] * wf[:, i] for i in range(256)) for r in range(len(xf))])
        halves = xf[:, :128] @ wf[:, :128].T + xf[:, 128:] @ wf[:, 128:].T
        return int((whole.bfloat16() != halves.bfloat16()).any(dim=1).sum())
    w, x = onednn.probe(16, 256, 40, torch.bfloat16, 0)
    assert rows_differing(w, x) >= 38
    g = torch.Generator().manual_seed(0)
    plain = rows_differing(torch.randn(16, 256, generator=g).bfloat16() / 16,
                           torch.randn(40, 256, generator=g).bfloat16())
    assert plain < rows_differing(w, x)


def test_spans_cover_the_rows_once_in_calls_of_allowed_sizes():
    assert onednn.spans(100, 32) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert onednn.spans(720, 32, (512, 128)) == [(0, 512), (512, 640), (640, 672), (672, 704), (704, 720)]
    for n in (1, 31, 33, 1000, 5000):
        parts = onednn.spans(n, 32, (1024, 256))
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(b - a in (1024, 256) or b - a <= 32 for a, b in parts)
    # the fewest calls, not the largest piece first: 1024 + 992 + 384, not 1024 + 1024 + 11 x 32
    assert onednn.spans(2400, 32, (1024, 992, 384)) == [(0, 1024), (1024, 2016), (2016, 2400)]
    with pytest.raises(ValueError, match="multiples"):
        onednn.spans(100, 32, (48,))


def test_only_piece_sizes_that_give_the_chunked_bits_are_used(monkeypatch):
    real = onednn.linear

    def regime(x, p, b=None, chunk=0, pieces=()):  # other bits in one call of 33 to 299 rows
        if 0 < chunk < len(x):
            return torch.cat([regime(x[a:e], p, b) for a, e in onednn.spans(len(x), chunk, pieces)])
        return real(x, p, b) * (1 + 1e-6 * (onednn.CHUNK_ROWS < len(x) < 300))
    monkeypatch.setattr(onednn, "linear", regime)
    onednn.piece_sizes.cache_clear()
    try:
        sizes = onednn.piece_sizes(40, 24, torch.get_num_threads(), torch.float32)
        assert sizes == tuple(range(1024, 300, -32))
    finally:
        onednn.piece_sizes.cache_clear()


@pytest.mark.skipif(not onednn.bf16_supported(), reason="oneDNN runs no bfloat16 GEMM on this CPU")
def test_bfloat16_linears_give_each_row_the_bits_it_gets_alone():
    """Gemma 3's MLP shape in bfloat16: where oneDNN needs it (33+ rows parted here), chunks of
    CHUNK_ROWS (and pieces of the checked larger sizes); a row alone, in 5, 40, 100 or 1100 rows
    gets the same bits, close to the float32 product."""
    lin = nn.Linear(640, 2048, bias=False).bfloat16()
    holder = nn.Sequential(lin)
    if onednn.use_onednn_linears(holder) == 0:
        pytest.skip("oneDNN's bfloat16 product is not batch-invariant here even in chunks")
    assert type(holder[0]) is onednn.OneDnnLinear and holder[0].chunk in (0, onednn.CHUNK_ROWS)
    x = torch.randn(1100, 640, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        together = holder[0](x[:100])  # [100, 2048] bfloat16
        for i in (0, 31, 32, 33, 99):
            assert torch.equal(holder[0](x[i:i + 1]), together[i:i + 1])
            assert torch.equal(holder[0](x[i:i + 5])[:1], together[i:i + 1])
        many = holder[0](x)  # a prefill's worth: a 1024-row piece where it passed the check
        assert torch.equal(many[:100], together)
        assert torch.equal(holder[0](x[1000:1040]), many[1000:1040])
    torch.testing.assert_close(many.float(), x.float() @ lin.weight.float().T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_onednn_linears_equal_stock_generate(family):
    """Decoder linears on oneDNN, greedy `ar` and `logitspec` at batch 3 against stock transformers
    (references computed before the swap, with plain nn.Linear modules)."""
    model = tiny_model(family)
    prompts = repetitive_prompts(6, seed=5)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    if onednn.use_onednn_linears(model) == 0:
        pytest.skip("no weight shape of this model is batch-invariant under oneDNN here")
    for method in ("ar", "logitspec"):
        eng = Engine(model, None, SpecConfig(method=method, max_batch_size=3, budget="fixed"))
        assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=N_NEW)] == refs
