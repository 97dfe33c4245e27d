"""How many tokens an int8 screen of the output layer would leave to rescore, on real final hidden states.

    .venv/bin/python scripts/int8_screen_bound.py [--model default] [--outliers 0,32] [--batch-sizes 6,24] [--time]

An exact screen computes approximate logits a_v, a provable bound e_v >= |a_v - exact_v| per token,
and rescores in float32 every token with a_v + e_v >= max_u (a_u - e_u). Weights: int8 per output row
(scale max|W_v| / 127). Three kinds:
- fbgemm as it is (``quantized::linear_dynamic`` with ``reduce_range``, the setting that keeps its
  int16 pair sums from saturating): it rounds the activations to 7 bits over the batch inside the
  call, so their error is known only as at most one step s an element:
  e_v = ||W~_v|| s sqrt(H) + ||dW_v|| ||x||; a_v is fbgemm's own output;
- int8 with known activations (a kernel that rounded them to 8 bits over the batch itself and
  reported the error): e_v = ||dW_v|| ||x~|| + ||W_v|| ||x~ - x||;
- weight-only int8 (float32 activations): e_v = ||dW_v|| ||x||.
The ``--outliers`` channels with the largest mean |x| are computed exactly in float32 and left out of
all three (Gemma 3's final states have channels of magnitude 45-130 against a median of 2.3). A float32
slack of 1e-4 ||W_v|| ||x|| is added. Prints the candidate counts per row, the bounds' violations
against the float32 logits (must be 0), and the gap between each state's two best logits.
``--time``: the output-layer pass alone, alternating, fastest of 20 calls: the screen's bfloat16
oneDNN pass, fbgemm's dynamic int8 (prepacked), and, where the CPU has AVX-512 VNNI, a prototype
u8 x s8 kernel of this script's own (``VNNI_SOURCE``: activations rounded per row to 8 bits in torch,
then one ``vpdpbusd`` chain a token, 8 rows at a time; not in the engine) over the first 608 channels.
"""
import argparse
import time
import warnings

import torch

from logitspec.bench.questions import first_turns
from logitspec.kernels import onednn
from logitspec.models import load_model


VNNI_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

// w [V, K] int8 -> [V/16][K/4][16][4]
torch::Tensor pack(torch::Tensor w) {
  const int64_t V = w.size(0), K = w.size(1);
  auto p = torch::empty({V / 16, K / 4, 16, 4}, w.options());
  auto wa = w.accessor<int8_t, 2>();
  int8_t* out = p.data_ptr<int8_t>();
  for (int64_t b = 0; b < V / 16; ++b)
    for (int64_t g = 0; g < K / 4; ++g)
      for (int l = 0; l < 16; ++l)
        for (int j = 0; j < 4; ++j) out[((b * (K / 4) + g) * 16 + l) * 4 + j] = wa[b * 16 + l][g * 4 + j];
  return p;
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile(
    const int8_t* __restrict p, const uint8_t* __restrict x, int64_t K, float* __restrict y, int64_t V, int64_t v0,
    const int32_t* colsum, const float* ws, const int32_t* zp, const float* xs) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  const int64_t G = K / 4;
  for (int64_t g = 0; g < G; ++g) {
    const __m512i w = _mm512_loadu_si512(p + g * 64);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + g * 4));
      acc[r] = _mm512_dpbusd_epi32(acc[r], xb, w);
    }
  }
  const __m512i cs = _mm512_loadu_si512(colsum + v0);
  const __m512 sv = _mm512_loadu_ps(ws + v0);
  for (int r = 0; r < R; ++r) {
    __m512i a = _mm512_sub_epi32(acc[r], _mm512_mullo_epi32(_mm512_set1_epi32(zp[r]), cs));
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sv, _mm512_set1_ps(xs[r])));
    _mm512_storeu_ps(y + r * V + v0, f);
  }
}

torch::Tensor int8_linear(torch::Tensor xq, torch::Tensor xs, torch::Tensor zp, torch::Tensor p, torch::Tensor colsum,
                          torch::Tensor ws) {
  const int64_t B = xq.size(0), K = xq.size(1), VB = p.size(0), V = VB * 16;
  auto y = torch::empty({B, V}, torch::kFloat);
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const int8_t* pp = p.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int32_t* cp = colsum.data_ptr<int32_t>();
  const float* wsp = ws.data_ptr<float>();
  const int32_t* zpp = zp.data_ptr<int32_t>();
  const float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, VB, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r0 = 0; r0 < B; r0 += 8) {
        const int64_t R = std::min<int64_t>(8, B - r0);
        const int8_t* blk = pp + b * K * 16;
        auto args = std::make_tuple(blk, xp + r0 * K, K, yp + r0 * V, V, b * 16, cp, wsp, zpp + r0, xsp + r0);
        switch (R) {
          case 1: std::apply(tile<1>, args); break; case 2: std::apply(tile<2>, args); break;
          case 3: std::apply(tile<3>, args); break; case 4: std::apply(tile<4>, args); break;
          case 5: std::apply(tile<5>, args); break; case 6: std::apply(tile<6>, args); break;
          case 7: std::apply(tile<7>, args); break; default: std::apply(tile<8>, args); break;
        }
      }
    }
  });
  return y;
}

"""


def vnni_prototype(W: torch.Tensor, channels: int):
    """The prototype kernel's pass over ``W[:, :channels]`` (``channels`` a multiple of 4), or None
    without AVX-512 VNNI or a compiler: ``x`` [B, H] -> [B, V] float32."""
    if W.shape[0] % 16 or channels % 4:
        raise ValueError(f"the prototype needs multiples of 16 tokens and of 4 channels, got {W.shape[0]}, {channels}")
    with open("/proc/cpuinfo") as f:
        if "avx512_vnni" not in f.read():
            return None
    from torch.utils.cpp_extension import load_inline

    try:
        ext = load_inline("int8_screen_vnni_prototype", VNNI_SOURCE, functions=["pack", "int8_linear"],
                          extra_cflags=["-O3"])
    except Exception as e:  # no compiler, no headers
        print(f"VNNI prototype not built: {type(e).__name__}: {e}")
        return None
    wq, scale = int8_rows(W[:, :channels])  # [V, K], [V]
    packed, colsum = ext.pack(wq), wq.sum(1, dtype=torch.int32).contiguous()  # [V/16, K/4, 16, 4], [V]

    def run(x: torch.Tensor) -> torch.Tensor:
        xr = x[:, :channels]
        xq, xs, zp = to_u8(xr, xr.amin(1, keepdim=True).clamp(max=0), xr.amax(1, keepdim=True).clamp(min=0))  # per row
        rows = (xs.flatten().float().contiguous(), zp.flatten().to(torch.int32).contiguous())  # [B] each
        return ext.int8_linear(xq.contiguous(), *rows, packed, colsum, scale.float().contiguous())
    return run


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [V, K] rounded per row to int8: (values [V, K] int8, scales [V] = max|w_v| / 127)."""
    scale = w.abs().amax(1) / 127  # [V]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def to_u8(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` rounded to 8 bits over [lo, hi] (which hold 0; tensors broadcasting against ``x``):
    (codes uint8, step, zero point), ``x ~ (codes - zero) * step``."""
    step = (hi - lo) / 255
    zero = torch.round(-lo / step)
    return (torch.round(x / step) + zero).clamp(0, 255).to(torch.uint8), step, zero


class FbgemmInt8:
    """fbgemm's dynamic int8 linear over :func:`int8_rows` of ``w`` [V, H] (prepacked), and the
    norms of its dequantized rows and of their error ([V] each)."""

    def __init__(self, w: torch.Tensor):
        _, scale = int8_rows(w)
        with warnings.catch_warnings():  # quantize_per_channel's deprecation notice
            warnings.simplefilter("ignore")
            wq = torch.quantize_per_channel(w, scale.double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(wq, None)
        deq = wq.dequantize()  # [V, H]
        self.wq_norm, self.dw_norm = deq.norm(dim=1), (deq - w).norm(dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # reduce_range: 7-bit activations


def stats(counts: list[int]) -> str:
    c = torch.tensor(counts, dtype=torch.float)
    return f"median {c.median():.0f} p90 {torch.quantile(c, 0.9):.0f} max {c.max():.0f}"


def candidates(X: torch.Tensor, W: torch.Tensor, k: int, batch_sizes: list[int]):
    """Per batch size B: (B, per kind the candidate count of each row over ``X`` [n, H] in batches of
    B, the number of bound violations), with the ``k`` channels of largest mean |x| exact."""
    wn = W.norm(dim=1)  # [V]
    values, scale = int8_rows(W)
    Wq = values.float() * scale[:, None]  # [V, H] int8 values, dequantized
    dW = (Wq - W).norm(dim=1)  # [V]
    order = X.abs().mean(0).argsort(descending=True)
    O, R = order[:k], order[k:]
    WqR, WO = Wq[:, R].T.contiguous(), W[:, O].T.contiguous()  # [H-k, V], [k, V]
    fbgemm = FbgemmInt8(W[:, R].contiguous())
    for B in batch_sizes:
        counts, violations = {"fbgemm": [], "known": [], "weight-only": []}, 0
        for i in range(0, len(X) - B + 1, B):
            x = X[i:i + B]  # [B, H]
            xr, exact_part, exact = x[:, R].contiguous(), x[:, O] @ WO, x @ W.T  # [B, H-k], [B, V], [B, V]
            lo, hi = xr.min().double().clamp(max=0), xr.max().double().clamp(min=0)  # over the batch
            codes, step8, zero = to_u8(xr, lo, hi)
            xt = (codes.float() - zero) * step8  # [B, H-k] uint8 values
            step7 = (hi - lo) / 127
            slack = 1e-4 * wn[None, :] * x.norm(dim=1)[:, None]  # [B, V]
            kinds = {
                "fbgemm": (fbgemm(xr) + exact_part, fbgemm.wq_norm[None, :] * step7 * xr.shape[1] ** 0.5
                           + fbgemm.dw_norm[None, :] * xr.norm(dim=1)[:, None] + slack),
                "known": (xt @ WqR + exact_part,
                          dW[None, :] * xt.norm(dim=1)[:, None] + wn[None, :] * (xt - xr).norm(dim=1)[:, None] + slack),
                "weight-only": (xr @ WqR + exact_part, dW[None, :] * xr.norm(dim=1)[:, None] + slack)}
            for name, (approx, bound) in kinds.items():  # [B, V] each
                violations += int(((approx - exact).abs() > bound).sum())
                floor = (approx - bound).amax(1, keepdim=True)  # [B, 1]
                counts[name] += ((approx + bound) >= floor).sum(1).tolist()
        yield B, counts, violations


def time_passes(W: torch.Tensor, batch_sizes: list[int], calls: int = 20) -> None:
    """ms per call of the screen's bfloat16 pass, fbgemm's dynamic int8 linear and the VNNI prototype, alternating."""
    packed16 = onednn.pack(W.bfloat16())  # the screen's "bf16" pass (logitspec.head)
    passes = {"bf16": lambda x: onednn.linear(x.bfloat16(), packed16), "fbgemm int8": FbgemmInt8(W)}
    vnni = vnni_prototype(W, W.shape[1] - 32)  # the 32 outlier channels stay float32 (not timed here)
    if vnni is not None:
        passes["VNNI prototype"] = vnni
    for B in batch_sizes:
        x = torch.randn(B, W.shape[1]) * 3
        best = {k: float("inf") for k in passes}
        for _ in range(3):
            for name, f in passes.items():
                f(x)
                for _ in range(calls):
                    t = time.perf_counter()
                    f(x)
                    best[name] = min(best[name], time.perf_counter() - t)
        print(f"{B:2d} rows: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--outliers", default="0,32", help="comma-separated counts of exact channels")
    ap.add_argument("--batch-sizes", default="6,24")
    ap.add_argument("--time", action="store_true", help="also time the bfloat16 pass against the int8 passes")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    sizes = [int(v) for v in args.batch_sizes.split(",")]
    with torch.inference_mode():
        W = model.get_output_embeddings().weight.float()  # [V, H]
        if args.time:
            time_passes(W, sizes)
        states = []
        for text in first_turns(None, 3, max_chars=1500)[:12]:  # Spec-Bench first turns, 300 tokens each at most
            ids = tok(text, return_tensors="pt").input_ids[:, :300]
            states.append(model.model(input_ids=ids).last_hidden_state[0])
        X = torch.cat(states)  # [n, H]
        top2 = (X @ W.T).topk(2, dim=1).values  # [n, 2]
        gap = top2[:, 0] - top2[:, 1]
        print(f"{len(X)} states; gap between the two best logits: p10 / p50 / p90 "
              f"{[round(v, 2) for v in torch.quantile(gap, torch.tensor([0.1, 0.5, 0.9])).tolist()]}")
        for k in (int(v) for v in args.outliers.split(",")):
            for B, counts, violations in candidates(X, W, k, sizes):
                print(f"exact channels {k:2d}, {B:2d} rows: candidates a row, "
                      + "; ".join(f"{name} {stats(c)}" for name, c in counts.items())
                      + f"; bound violations {violations}")


if __name__ == "__main__":
    main()
