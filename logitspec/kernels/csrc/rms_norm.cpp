// RMS normalisation of float32 or bfloat16 rows in one pass over each row (AVX2 + FMA):
//   y[r, i] = (x[r, i] * s_r) * (offset + w[i]),   s_r = 1 / sqrt(sum_i x[r, i]^2 / D + eps)
// offset 0 is Llama's and Qwen2's RMSNorm (weight * normalised x), offset 1 Gemma's ((1 + weight) *
// normalised x); the two products are rounded in that order, as those modules' float32 forwards do.
// Transformers' modules take about eight tensor operations a call; this is one, which matters in a
// decoding step (a hundred calls on a few rows each). Each row's result depends on that row alone
// (one fixed sequence of operations: batch-invariant). Rows are split over torch's threads only when
// there are many (a prefill chunk).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec8.h"

namespace {

constexpr int64_t kSerialElements = 1 << 16;  // inputs smaller than this stay on one thread

// XT: the rows' element type (float or uint16_t bfloat16 bits; the output's too), WT: the weight's.
// bfloat16 is widened exactly, normalised in float32 as above, and rounded once at the end (Gemma's
// order; Llama's bfloat16 module rounds before the weight product: at most an ulp apart).
template <typename XT, typename WT>
void normalise_row(const XT* x, const WT* w, XT* y, int64_t D, float offset, float eps) {
  using namespace logitspec_vec8;
  const int64_t D8 = D & ~int64_t{7};
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < D8; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sq = hsum8(acc);
  for (int64_t i = D8; i < D; ++i) sq += to_float(x[i]) * to_float(x[i]);
  const float mean = sq / static_cast<float>(D);
  const float s = 1.0f / std::sqrt(mean + eps);
  const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(offset);
  for (int64_t i = 0; i < D8; i += 8) {
    const __m256 n = _mm256_mul_ps(load8(x + i), sv);
    store8(y + i, _mm256_mul_ps(n, _mm256_add_ps(ov, load8(w + i))));
  }
  for (int64_t i = D8; i < D; ++i) from_float(y + i, (to_float(x[i]) * s) * (offset + to_float(w[i])));
}

template <typename XT, typename WT>
void normalise(const torch::Tensor& xc, const torch::Tensor& wc, torch::Tensor& y, float off, float e) {
  const int64_t D = xc.size(-1);
  const int64_t rows = xc.numel() / D;
  const XT* xp = static_cast<const XT*>(xc.data_ptr());
  const WT* wp = static_cast<const WT*>(wc.data_ptr());
  XT* yp = static_cast<XT*>(y.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) normalise_row<XT, WT>(xp + r * D, wp, yp + r * D, D, off, e);
  });
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double offset, double eps) {
  const auto ok = [](const torch::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; };
  TORCH_CHECK(ok(x) && ok(weight), "rms_norm: float32 or bfloat16 x and weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [D] for x [..., D]");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = torch::empty_like(xc);
  if (xc.size(-1) == 0 || xc.numel() == 0) return y;
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  const bool xb = xc.scalar_type() == at::kBFloat16, wb = wc.scalar_type() == at::kBFloat16;
  if (xb && wb) normalise<uint16_t, uint16_t>(xc, wc, y, off, e);
  else if (xb) normalise<uint16_t, float>(xc, wc, y, off, e);
  else if (wb) normalise<float, uint16_t>(xc, wc, y, off, e);
  else normalise<float, float>(xc, wc, y, off, e);
  return y;
}
