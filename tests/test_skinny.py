"""logitspec.kernels.skinny: the AVX2 skinny-linear kernel, its fallbacks and the module swap."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from logitspec.kernels import skinny, swap_linears

SHAPES = [(1, 1), (7, 13), (9, 8), (33, 100), (64, 640), (257, 72), (130, 17), (6, 2051)]


@pytest.fixture
def kernel():
    if not skinny.available():
        pytest.skip(f"skinny kernel unavailable: {skinny.unavailable_reason()}")
    return skinny._ext


def _check_close(y, x, W, b=None):
    """|y - F.linear| <= 1e-5 * (|x| @ |W|^T + |b|) elementwise: 1e-5 relative to the products summed."""
    ref = F.linear(x, W, b)
    scale = F.linear(x.abs(), W.abs(), None if b is None else b.abs())
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert ((y - ref).abs() <= 1e-5 * scale + 1e-30).all(), ((y - ref).abs() / scale).max()


@pytest.mark.parametrize("O,I", SHAPES)
def test_matches_f_linear(kernel, O, I):
    g = torch.Generator().manual_seed(O * 1000 + I)
    W = torch.randn(O, I, generator=g)
    for n in range(1, 21):
        x = torch.randn(n, I, generator=g)
        _check_close(kernel.skinny_linear(x, W), x, W)
        _check_close(skinny.skinny_linear(x, W), x, W)


@pytest.mark.parametrize("O,I", SHAPES)
def test_batch_invariant_bitwise(kernel, O, I):
    g = torch.Generator().manual_seed(O + I)
    W = torch.randn(O, I, generator=g)
    xb = torch.randn(16, I, generator=g)
    yb = kernel.skinny_linear(xb, W)
    for n in range(1, 17):
        assert torch.equal(kernel.skinny_linear(xb[:n].contiguous(), W), yb[:n]), n
    for j in range(16):
        assert torch.equal(kernel.skinny_linear(xb[j:j + 1].contiguous(), W)[0], yb[j]), j
    perm = torch.randperm(16, generator=g)
    assert torch.equal(kernel.skinny_linear(xb[perm].contiguous(), W), yb[perm])


def test_thread_count_does_not_change_bits(kernel):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(1031, 640, generator=g)  # large enough to be split over threads
    x = torch.randn(11, 640, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = kernel.skinny_linear(x, W)
        torch.set_num_threads(2)
        y2 = kernel.skinny_linear(x, W)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2)


def skinny_from(lin: nn.Linear, max_rows: int = skinny.MAX_ROWS) -> skinny.SkinnyLinear:
    holder = nn.Sequential(lin)
    skinny.use_skinny_linears(holder, max_rows=max_rows)
    return holder[0]


def test_module_bias_and_leading_dims(kernel):
    torch.manual_seed(0)
    lin = nn.Linear(37, 21)
    mod = skinny_from(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias
    with torch.no_grad():
        for shape in [(37,), (1, 37), (3, 37), (2, 5, 37)]:
            x = torch.randn(*shape)
            y = mod(x)
            assert y.shape == (*shape[:-1], 21)
            _check_close(y.reshape(-1, 21), x.reshape(-1, 37), lin.weight, lin.bias)
        x = torch.randn(37, 20).t()  # non-contiguous: copied (a few rows), then the kernel
        _check_close(mod(x), x, lin.weight, lin.bias)


class _Spy:
    """Stands in for the compiled extension, counting calls."""

    def __init__(self, ext):
        self.ext, self.calls = ext, 0

    def skinny_linear(self, x, W):
        self.calls += 1
        return self.ext.skinny_linear(x, W)


def test_fallbacks(kernel, monkeypatch):
    spy = _Spy(kernel)
    monkeypatch.setattr(skinny, "_ext", spy)
    g = torch.Generator().manual_seed(2)
    W = torch.randn(24, 40, generator=g)
    b = torch.randn(24, generator=g)
    with torch.no_grad():
        skinny.skinny_linear(torch.randn(64, 40, generator=g), W, b)
        assert spy.calls == 1  # 64 rows: kernel
        for x, w in [(torch.randn(65, 40, generator=g), W),  # too many rows
                     (torch.randn(4, 40, generator=g).double(), W.double()),  # not fp32
                     (torch.randn(4, 40, generator=g).half(), W.half()),
                     (torch.randn(4, 40, generator=g), W.t().contiguous().t())]:  # non-contiguous W
            y = skinny.skinny_linear(x, w, b.to(w.dtype))
            torch.testing.assert_close(y, F.linear(x, w, b.to(w.dtype)))
        assert spy.calls == 1
    # autograd: F.linear, so gradients flow
    lin = nn.Linear(40, 24)
    mod = skinny_from(lin, max_rows=8)
    x = torch.randn(3, 40, requires_grad=True)
    mod(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert spy.calls == 1
    with torch.no_grad():
        mod(torch.randn(8, 40))
        assert spy.calls == 2
        mod(torch.randn(9, 40))  # beyond the module's max_rows
        assert spy.calls == 2


def test_unavailable_falls_back_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(skinny, "_ext", None)
    monkeypatch.setattr(skinny, "_failed", None)
    monkeypatch.setattr(skinny, "_cpu_lacks_avx2_fma", lambda: "CPU lacks avx2 (test)")
    with caplog.at_level(logging.WARNING, logger="logitspec.skinny"):
        assert not skinny.available()
        assert not skinny.available()
    assert [r.getMessage() for r in caplog.records].count(
        "skinny-linear kernel unavailable, using F.linear: CPU lacks avx2 (test)") == 1
    assert skinny.unavailable_reason() == "CPU lacks avx2 (test)"
    torch.manual_seed(3)
    holder = nn.Sequential(nn.Linear(16, 8))
    assert skinny.use_skinny_linears(holder) == 0 and type(holder[0]) is nn.Linear
    lin = holder[0]
    swap_linears(holder, skinny.SkinnyLinear, skinny.MAX_ROWS)  # the module still works: F.linear
    mod = holder[0]
    assert isinstance(mod, skinny.SkinnyLinear)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), lin(x), rtol=0, atol=0)


def _tiny_llama(tie: bool, seed: int = 0):
    # sizes not multiples of 8 and odd output counts, so the kernel's tails are exercised
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=44, intermediate_size=83, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=10, tie_word_embeddings=tie,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharp logits: no greedy near-ties
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_swap_tiny_llama_same_greedy_output(kernel, tie):
    model = _tiny_llama(tie)
    prompt = torch.tensor([[5, 17, 3, 99, 42, 5, 17, 3, 64]])
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        logits_before = model(prompt).logits
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    weights = {id(m.weight) for m in linears}
    n = skinny.use_skinny_linears(model)
    assert n == len(linears) - 1 == 7 * 2  # every projection but lm_head
    assert type(model.get_output_embeddings()) is nn.Linear
    swapped = [m for m in model.modules() if isinstance(m, skinny.SkinnyLinear)]
    assert len(swapped) == n and {id(m.weight) for m in swapped} <= weights  # shared, not copied
    spy = _Spy(kernel)
    skinny._ext, real = spy, skinny._ext
    try:
        with torch.no_grad():
            got = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            logits_after = model(prompt).logits
    finally:
        skinny._ext = real
    assert spy.calls > 0
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path, caplog):
    src = tmp_path / "broken.cpp"
    src.write_text("#error deliberately broken\n")
    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(skinny, "_SOURCE", src)
    monkeypatch.setattr(skinny, "_OTHER_SOURCES", ())  # only the broken file: no 30 s of -O3 builds
    monkeypatch.setattr(skinny, "_EXT_NAME", "logitspec_skinny_broken_test")
    monkeypatch.setattr(skinny, "_ext", None)
    monkeypatch.setattr(skinny, "_failed", None)
    monkeypatch.setattr(skinny, "_cpu_lacks_avx2_fma", lambda: None)
    with caplog.at_level(logging.WARNING, logger="logitspec.skinny"):
        assert not skinny.available()
    assert skinny.unavailable_reason().startswith("build failed")
    assert len(caplog.records) == 1
    W, x = torch.randn(5, 9), torch.randn(3, 9)
    torch.testing.assert_close(skinny.skinny_linear(x, W), F.linear(x, W), rtol=0, atol=0)


@pytest.mark.parametrize("O,I", SHAPES)
def test_f16_weights_match_float32_of_the_same_values(kernel, O, I):
    """The float16-weight kernel computes x @ float32(W16)^T (the conversion is exact), batch-invariantly."""
    g = torch.Generator().manual_seed(O * 7 + I)
    W16 = torch.randn(O, I, generator=g).half()
    xb = torch.randn(12, I, generator=g)
    yb = skinny.skinny_linear_f16(xb, W16)
    _check_close(yb, xb, W16.float())
    assert torch.equal(yb, kernel.skinny_linear(xb, W16.float()))  # same arithmetic as the float32 kernel
    for n in (1, 2, 3, 5, 11):
        assert torch.equal(skinny.skinny_linear_f16(xb[:n].contiguous(), W16), yb[:n]), n


def test_f16_kernel_declines_what_it_cannot_do(kernel):
    W16 = torch.randn(8, 4).half()
    assert skinny.skinny_linear_f16(torch.randn(2, 4), W16.float()) is None  # not float16
    assert skinny.skinny_linear_f16(torch.randn(skinny.MAX_ROWS + 1, 4), W16) is None  # too many rows
    assert skinny.skinny_linear_f16(torch.randn(2, 5), W16) is None  # shape mismatch


def test_a_stale_build_baton_is_removed_not_waited_on(kernel, tmp_path):
    """A build killed mid-way leaves torch's ``lock`` file behind; the next load removes it and loads
    (before, every later load waited on it forever: a hung CI run)."""
    import shutil
    import subprocess
    import sys

    from logitspec.paths import default_cache_dir

    built = skinny.build_dir()
    copy = tmp_path / "cache" / built.relative_to(default_cache_dir())
    shutil.copytree(built, copy)
    (copy / "lock").touch()  # what a killed build leaves
    code = ("from logitspec.kernels import skinny; import sys; "
            "sys.exit(0 if skinny.available() else skinny.unavailable_reason())")
    p = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ,
                                                          "LOGITSPEC_CACHE": str(tmp_path / "cache")},
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "stale build lock" in p.stderr and not (copy / "lock").exists()


def test_the_build_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    import fcntl
    import subprocess
    import sys

    d = tmp_path / "build"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path / "build.flock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.flock") as f:
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    with skinny._build_lock(d):  # the holder was killed: its lock went with it
        pass
