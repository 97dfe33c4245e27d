"""The fused RMS norm kernel (logitspec/kernels/rms_norm.py) and its swap into models."""
import pickle

import pytest
import torch
from tiny_models import FAMILIES, hf_greedy, repetitive_prompts, tiny_model
from torch import nn

from logitspec import Engine, SpecConfig
from logitspec.kernels import rms_norm, skinny

pytestmark = pytest.mark.skipif(not skinny.available(), reason="the CPU kernels cannot be built here")


def _norms(model):
    return [m for m in model.modules() if "RMSNorm" in type(m).__name__]


def _randomise_norm_weights(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in _norms(model):
            m.weight.add_(torch.randn(m.weight.shape, generator=g) * 0.3)


@pytest.mark.parametrize("family,offset", [("llama", 0.0), ("qwen2", 0.0), ("gemma3", 1.0)])
def test_swapped_norms_reproduce_the_modules(family, offset):
    """Every RMS norm of each family is swapped, with the family's weight offset; the outputs equal
    the original modules' to float32 rounding, for decoding, verification and prefill shapes, and
    the state dict and the module classes' lineage are unchanged."""
    model = tiny_model(family)
    _randomise_norm_weights(model)
    norms = _norms(model)
    originals = [type(m) for m in norms]
    keys = list(model.state_dict())
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(shape + (m.weight.shape[0],), generator=g) * 4
              for m in norms for shape in ((3, 1), (2, 5), (1, 700))]
    with torch.inference_mode():
        want = [m(x) for m, x in zip([m for m in norms for _ in range(3)], inputs)]
    assert rms_norm.use_fused_rms_norms(model) == len(norms)
    assert all(isinstance(m, cls) and type(m) is not cls and m.rms_offset == offset
               for m, cls in zip(norms, originals))
    assert list(model.state_dict()) == keys
    with torch.inference_mode():
        got = [m(x) for m, x in zip([m for m in norms for _ in range(3)], inputs)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    assert rms_norm.use_fused_rms_norms(model) == 0  # already swapped: nothing twice


def test_each_row_is_computed_alone():
    """A row's result is bitwise the same alone, in a few rows and in a large (threaded) input,
    and a non-contiguous input gives what its contiguous copy gives."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(640, generator=g)
    x = torch.randn(3000, 640, generator=g)
    big = rms_norm.rms_norm(x, w, 1.0, 1e-6)
    assert torch.equal(rms_norm.rms_norm(x[7:8], w, 1.0, 1e-6), big[7:8])
    assert torch.equal(rms_norm.rms_norm(x[5:11], w, 1.0, 1e-6), big[5:11])
    q = x[:24].reshape(2, 3, 4, 640).transpose(1, 2)  # [B, H, T, D] as transformers' q_norm sees it
    torch.testing.assert_close(rms_norm.rms_norm(q, w, 0.0, 1e-6),
                               rms_norm.rms_norm(q.contiguous(), w, 0.0, 1e-6), rtol=0, atol=0)
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + w)
    torch.testing.assert_close(big, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("family,offset", [("llama", 0.0), ("gemma3", 1.0)])
def test_bfloat16_norms_are_the_float32_kernel_rounded_once(family, offset):
    """bfloat16 models' norms are swapped too: each row is the float32 kernel's result on the
    widened row, rounded to bfloat16 (bitwise; alone or among 3000 rows), within a bfloat16 ulp of
    the module's own forward (Llama's rounds before its weight product, Gemma's only at the end)."""
    model = tiny_model(family).to(torch.bfloat16)
    _randomise_norm_weights(model)
    norms = _norms(model)
    norm = norms[0]
    x = (torch.randn(3000, norm.weight.shape[0], generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    with torch.inference_mode():
        want = norm(x)
        assert rms_norm.use_fused_rms_norms(model) == len(norms) and norm.rms_offset == offset
        got = norm(x)
        wide = rms_norm.rms_norm(x.float(), norm.weight.float(), offset, norm.rms_eps)
        alone = norm(x[1234:1235])
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.bfloat16())
    assert torch.equal(alone, got[1234:1235])
    err = (got.float() - want.float()).abs()
    assert bool((err <= 2.0 ** -7 * torch.maximum(got.float().abs(), want.float().abs())).all())


class _ScaleRMSNorm(nn.Module):
    """Named like an RMS norm, with a weight and an epsilon, but computing something else."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x):
        return x * self.weight


class _WrongEpsRMSNorm(_ScaleRMSNorm):
    """An RMS norm whose real epsilon is not its ``eps`` attribute (the probe's tiny rows show it)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight


class _GatedRMSNorm(_ScaleRMSNorm):
    def forward(self, x, gate):
        return x * gate


@pytest.mark.parametrize("cls", [_ScaleRMSNorm, _WrongEpsRMSNorm, _GatedRMSNorm])
def test_modules_the_kernel_does_not_reproduce_are_left_alone(cls):
    model = nn.Sequential(cls(16))
    assert rms_norm.use_fused_rms_norms(model) == 0
    assert type(model[0]) is cls


def test_other_dtypes_use_the_original_forward():
    model = tiny_model("gemma3")
    _randomise_norm_weights(model)
    norm = _norms(model)[0]
    x = torch.randn(2, 3, norm.weight.shape[0])
    rms_norm.use_fused_rms_norms(model)
    with torch.inference_mode():
        want = type(norm).__mro__[1].forward(norm, x.double())  # the transformers forward
        assert torch.equal(norm(x.double()), want)
        # not its weight's dtype
        assert torch.equal(norm(x.bfloat16()), type(norm).__mro__[1].forward(norm, x.bfloat16()))
    x.requires_grad_(True)
    norm(x).sum().backward()  # under autograd: the original forward, differentiable
    assert x.grad is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_fused_norms_equals_generate(family):
    """Lossless with the fused norms (and the skinny linears): every method's greedy output equals
    the model's own ``generate`` on the same swapped model."""
    model = tiny_model(family)
    _randomise_norm_weights(model)
    assert rms_norm.use_fused_rms_norms(model) > 0
    skinny.use_skinny_linears(model)
    prompts = repetitive_prompts(6, seed=7)
    refs = [hf_greedy(model, p, 16) for p in prompts]
    for method in ("ar", "pld", "logitspec"):
        eng = Engine(model, None, SpecConfig(method=method, max_batch_size=3, budget="fixed"))
        assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=16)] == refs


def test_a_swapped_model_pickles_as_the_original_classes():
    model = tiny_model("llama")
    _randomise_norm_weights(model)
    originals = [type(m) for m in _norms(model)]
    rms_norm.use_fused_rms_norms(model)
    x = torch.randint(0, 90, (1, 7))
    back = pickle.loads(pickle.dumps(model))
    assert [type(m) for m in _norms(back)] == originals
    with torch.inference_mode():
        torch.testing.assert_close(back(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_stored_cost_curves_tell_fused_norms_apart():
    """A cost curve measured with transformers' norms is not reused for the fused ones (the kernel
    fingerprint in the curve's key names the norm classes)."""
    from logitspec.worker import calibrate

    model = tiny_model("qwen2")
    before = calibrate.kernel_fingerprint(model)
    rms_norm.use_fused_rms_norms(model)
    after = calibrate.kernel_fingerprint(model)
    assert "norms=Qwen2RMSNorm|" in before and "norms=FusedQwen2RMSNorm|" in after
