// RMS normalisation of float32 rows in one pass over each row (AVX2 + FMA):
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

void normalise_row(const float* x, const float* w, float* y, int64_t D, float offset, float eps) {
  const float mean = logitspec_vec8::dot(x, x, D) / static_cast<float>(D);
  const float s = 1.0f / std::sqrt(mean + eps);
  const int64_t D8 = D & ~int64_t{7};
  const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(offset);
  for (int64_t i = 0; i < D8; i += 8) {
    const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(x + i), sv);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(n, _mm256_add_ps(ov, _mm256_loadu_ps(w + i))));
  }
  for (int64_t i = D8; i < D; ++i) y[i] = (x[i] * s) * (offset + w[i]);
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double offset, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [D] for x [..., D]");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t D = xc.size(-1);
  const int64_t rows = D ? xc.numel() / D : 0;
  if (rows == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) normalise_row(xp + r * D, wp, yp + r * D, D, off, e);
  });
  return y;
}
