// Exact fp32 skinny linear y[n, O] = x[n, I] @ W[O, I]^T for small n (AVX2 + FMA), and the same
// product with W stored in float16 (F16C converts each 8-wide chunk to float32; float32 products and
// sums), which reads half the bytes: the output layer's screen in logitspec/head.py.
//
// W is streamed once: each block of WR W rows is multiplied against all n x rows in tiles of XR
// rows, with WR * XR 8-lane accumulators held in registers. Output rows are split over threads with
// at::parallel_for (torch.get_num_threads()); W is software-prefetched ahead (kPrefetchBytes).
//
// Batch invariance: every output y[j, o] is computed by the same sequence of operations whatever n
// is and whichever (WR, XR) tile it falls in: one 8-lane accumulator starting at +0, one FMA per
// 8-wide chunk of I in increasing order, the last partial chunk read with a zero-filling masked load,
// then the fixed horizontal sum hsum8. Tiling only changes which registers hold the accumulators,
// never the arithmetic, so row j of the result is bitwise identical for any n.
// Built with -ffp-contract=off so the compiler cannot fuse the horizontal-sum adds differently in
// different template instances.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec8.h"

namespace {

struct Dims {
  int64_t n;     // x rows
  int64_t I;     // inner dimension
  int64_t O;     // W rows (outputs)
  int64_t I8;    // I rounded down to a multiple of 8
  __m256i tail;  // lanes [0, I - I8) set
};

// Software prefetch of W, 32 KB ahead of the block being computed, into L1.
// Issued during the first x tile of each block, so it covers the whole W stream once. Without it a
// single core's DRAM stream stalls whenever the FMAs take as long as the loads (cold weights, n >= 2:
// 2048 x 640 at n = 4 took 0.89 ms instead of 0.55 ms; n = 8 1.0 ms instead of 0.58 ms).
constexpr int64_t kPrefetchBytes = 32768;

using logitspec_vec8::hsum8;

// One 8-wide chunk of W as float32: a plain load, or 8 float16 values converted (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// The partial last chunk (lanes [0, I - I8)), other lanes +0.
inline __m256 load_tail(const float* p, const Dims& d) { return _mm256_maskload_ps(p, d.tail); }
inline __m256 load_tail(const uint16_t* p, const Dims& d) {
  alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::copy(p, p + (d.I - d.I8), buf);
  return load8(buf);
}

// WR W rows (from w) times XR x rows (from x) into y (y points at y[j0, o0], row stride O).
template <typename T, int WR, int XR>
inline void tile(const T* __restrict w, const float* __restrict x, float* __restrict y, const Dims& d,
                 bool pf) {
  __m256 acc[WR][XR];
  for (int r = 0; r < WR; ++r)
    for (int j = 0; j < XR; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t I = d.I;
  for (int64_t k = 0; k < d.I8; k += 8) {
    __m256 wv[WR];
    for (int r = 0; r < WR; ++r) wv[r] = load8(w + r * I + k);
    if (pf)
      for (int r = 0; r < WR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * I + k) + kPrefetchBytes, _MM_HINT_T0);
    for (int j = 0; j < XR; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * I + k);
      for (int r = 0; r < WR; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  if (d.I8 < I) {  // partial last chunk: masked lanes read as 0, so they add +0 * +0
    const int64_t k = d.I8;
    __m256 wv[WR];
    for (int r = 0; r < WR; ++r) wv[r] = load_tail(w + r * I + k, d);
    for (int j = 0; j < XR; ++j) {
      const __m256 xv = _mm256_maskload_ps(x + j * I + k, d.tail);
      for (int r = 0; r < WR; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  for (int j = 0; j < XR; ++j)
    for (int r = 0; r < WR; ++r) y[j * d.O + r] = hsum8(acc[r][j]);
}

// One block of WR W rows against all n x rows: full tiles of XT rows, then the remainder (< XT).
template <typename T, int WR, int XT>
inline void block(const T* w, const float* x, float* y, const Dims& d, bool pf) {
  static_assert(XT >= 1 && XT <= 8, "x tile of 1..8 rows");
  int64_t j = 0;
  for (; j + XT <= d.n; j += XT, pf = false) tile<T, WR, XT>(w, x + j * d.I, y + j * d.O, d, pf);
  const float* xr = x + j * d.I;
  float* yr = y + j * d.O;
  switch (d.n - j) {
    case 0: break;
    case 1: tile<T, WR, 1>(w, xr, yr, d, pf); break;
    case 2: if constexpr (XT > 2) tile<T, WR, 2>(w, xr, yr, d, pf); break;
    case 3: if constexpr (XT > 3) tile<T, WR, 3>(w, xr, yr, d, pf); break;
    case 4: if constexpr (XT > 4) tile<T, WR, 4>(w, xr, yr, d, pf); break;
    case 5: if constexpr (XT > 5) tile<T, WR, 5>(w, xr, yr, d, pf); break;
    case 6: if constexpr (XT > 6) tile<T, WR, 6>(w, xr, yr, d, pf); break;
    case 7: if constexpr (XT > 7) tile<T, WR, 7>(w, xr, yr, d, pf); break;
  }
}

// All W rows [o_begin, o_end) with blocks of WR rows; leftover rows (fewer than WR) one at a time.
template <typename T, int WR, int XT>
void rows(const T* W, const float* x, float* y, const Dims& d, int64_t o_begin, int64_t o_end) {
  int64_t o = o_begin;
  const int64_t pf_end = d.O * d.I - kPrefetchBytes / int64_t{sizeof(T)};  // prefetch only inside W
  for (; o + WR <= o_end; o += WR) block<T, WR, XT>(W + o * d.I, x, y + o, d, (o + WR) * d.I <= pf_end);
  for (; o < o_end; ++o) block<T, 1, 8>(W + o * d.I, x, y + o, d, (o + 1) * d.I <= pf_end);
}

template <typename T, int WR, int XT>
void run(const T* W, const float* x, float* y, const Dims& d) {
  // Threads get whole WR-row blocks; a chunk is at least ~64k W floats (256 KB) so that small
  // products stay on one thread (an OpenMP fork costs more than they do).
  const int64_t blocks = (d.O + WR - 1) / WR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (WR * std::max<int64_t>(d.I, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    rows<T, WR, XT>(W, x, y, d, b0 * WR, std::min(d.O, b1 * WR));
  });
}

// Tile shapes by n (<= 12 accumulators, so accumulators + W + x fit in 16 ymm registers). The
// choice changes speed only; every output's arithmetic is the same (see the top of this file).
template <typename T>
void dispatch(const T* W, const float* x, float* y, const Dims& d) {
  if (d.n == 1) {
    run<T, 8, 1>(W, x, y, d);  // 8 independent accumulator chains hide the FMA latency
  } else if (d.n == 2) {
    run<T, 4, 2>(W, x, y, d);
  } else if (d.n == 3) {
    run<T, 4, 3>(W, x, y, d);
  } else {
    run<T, 2, 6>(W, x, y, d);
  }
}

Dims dims(const torch::Tensor& x, const torch::Tensor& W, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && W.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2, name, ": x[n, I] and W[O, I] must be 2-D");
  TORCH_CHECK(x.is_contiguous() && W.is_contiguous(), name, ": x and W must be contiguous");
  TORCH_CHECK(x.size(1) == W.size(1), name, ": x has ", x.size(1), " columns, W has ", W.size(1));
  Dims d;
  d.n = x.size(0);
  d.I = x.size(1);
  d.O = W.size(0);
  d.I8 = d.I & ~int64_t{7};
  const int rem = static_cast<int>(d.I - d.I8);
  d.tail = _mm256_setr_epi32(rem > 0 ? -1 : 0, rem > 1 ? -1 : 0, rem > 2 ? -1 : 0, rem > 3 ? -1 : 0,
                             rem > 4 ? -1 : 0, rem > 5 ? -1 : 0, rem > 6 ? -1 : 0, 0);
  return d;
}

}  // namespace

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& W) {
  TORCH_CHECK(W.scalar_type() == at::kFloat, "skinny_linear: W must be float32");
  const Dims d = dims(x, W, "skinny_linear");
  auto y = torch::empty({d.n, d.O}, x.options());
  if (d.n == 0 || d.O == 0) return y;
  dispatch(W.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(), d);
  return y;
}

torch::Tensor skinny_linear_f16(const torch::Tensor& x, const torch::Tensor& W) {
  TORCH_CHECK(W.scalar_type() == at::kHalf, "skinny_linear_f16: W must be float16");
  const Dims d = dims(x, W, "skinny_linear_f16");
  auto y = torch::empty({d.n, d.O}, x.options());
  if (d.n == 0 || d.O == 0) return y;
  dispatch(reinterpret_cast<const uint16_t*>(W.data_ptr<at::Half>()), x.data_ptr<float>(), y.data_ptr<float>(), d);
  return y;
}

// decode_attention.cpp, screen.cpp, rms_norm.cpp and int8_screen.cpp (built into the same extension)
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& mask, double scale);
std::vector<torch::Tensor> screen_candidates(const torch::Tensor& approx, const torch::Tensor& margin);
torch::Tensor rescore(const torch::Tensor& weight, const torch::Tensor& x, const torch::Tensor& rows,
                      const torch::Tensor& toks);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double offset, double eps);
torch::Tensor top_tokens(const torch::Tensor& scores, const torch::Tensor& rows, int64_t k);
bool int8_vnni();
torch::Tensor int8_pack(const torch::Tensor& w);
std::vector<torch::Tensor> int8_scores(const torch::Tensor& xq, const torch::Tensor& step, const torch::Tensor& zero,
                                       const torch::Tensor& packed, const torch::Tensor& colsum,
                                       const torch::Tensor& scale, const torch::Tensor& coef, const torch::Tensor& norms);
std::vector<torch::Tensor> bounded_candidates(const torch::Tensor& approx, const torch::Tensor& coef,
                                              const torch::Tensor& norms, const torch::Tensor& floor);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y[n, O] = x[n, I] @ W[O, I]^T (fp32, AVX2, batch-invariant)",
        py::arg("x"), py::arg("W"), py::call_guard<py::gil_scoped_release>());
  m.def("skinny_linear_f16", &skinny_linear_f16,
        "y[n, O] = x[n, I] @ float32(W16[O, I])^T (float16 weights via F16C, float32 math, batch-invariant)",
        py::arg("x"), py::arg("W"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention,
        "attention of few queries per row over their visible columns, batch-invariant (decode_attention.cpp)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("screen_candidates", &screen_candidates,
        "per row of approx [N, V], the tokens within margin[r] of its largest value: (rows, tokens) (screen.cpp)",
        py::arg("approx"), py::arg("margin"), py::call_guard<py::gil_scoped_release>());
  m.def("rescore", &rescore, "out[k] = weight[toks[k]] . x[rows[k]] in float32 (screen.cpp)", py::arg("weight"),
        py::arg("x"), py::arg("rows"), py::arg("toks"), py::call_guard<py::gil_scoped_release>());
  m.def("top_tokens", &top_tokens,
        "per row rows[b] of scores [N, V], the tokens of its k largest scores, best first, ties to the lower token (screen.cpp)",
        py::arg("scores"), py::arg("rows"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm,
        "y = (x * rsqrt(mean(x^2, -1) + eps)) * (offset + weight), float32, one pass a row (rms_norm.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("offset"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("int8_vnni", &int8_vnni, "whether int8_scores runs AVX-512 VNNI here (else a plain loop) (int8_screen.cpp)");
  m.def("int8_pack", &int8_pack, "int8 [V, K] -> [V/16, K/4, 16, 4] for int8_scores (int8_screen.cpp)", py::arg("w"));
  m.def("int8_scores", &int8_scores,
        "(scores [B, V] = (xq[r] . w[v] - zero[r] colsum[v]) step[r] scale[v], u8 x s8 exact integer sums; "
        "floor [B] = max_v scores - coef[r] . norms[:, v]) (int8_screen.cpp)",
        py::arg("xq"), py::arg("step"), py::arg("zero"), py::arg("packed"), py::arg("colsum"), py::arg("scale"),
        py::arg("coef"), py::arg("norms"), py::call_guard<py::gil_scoped_release>());
  m.def("bounded_candidates", &bounded_candidates,
        "per row, tokens whose approx + bound reaches floor[r]; bound = coef[r] . norms[:, v] (int8_screen.cpp)",
        py::arg("approx"), py::arg("coef"), py::arg("norms"), py::arg("floor"), py::call_guard<py::gil_scoped_release>());
}
