// The int8 pass of the output-layer screen (logitspec/int8_screen.py): u8 activations x s8 weights,
// exact integer sums, one float scale per row and per token; and the candidate search under a bound
// that differs per token. AVX-512 VNNI (vpdpbusd) where the CPU has it (int8_vnni()), else a plain
// loop over the same integers (the same results: integer sums are exact in any order).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

std::vector<torch::Tensor> candidate_tensors(const std::vector<std::vector<int64_t>>& found);  // screen.cpp

namespace {

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// y[r, v0 .. v0 + 16) for R rows: acc = sum_k x[r, k] * w[v, k] (u8 x s8), then
// (acc - zero[r] * colsum[v]) * step[r] * scale[v]. p: the 16 tokens' block, [K/4][16][4].
// The bound's inputs for one call: per row its coefficients, per token its norms (bounded_candidates).
struct Bound {
  const float* coef;   // [B, 3]
  const float* norms;  // [3, V]
  int64_t V;
};

// y[r, v0 .. v0 + 16) for R rows: acc = sum_k x[r, k] * w[v, k] (u8 x s8), then
// (acc - zero[r] * colsum[v]) * step[r] * scale[v]; floor[r] = max(floor[r], y - e) over the 16 tokens.
// p: the 16 tokens' block, [K/4][16][4].
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(
    const int8_t* __restrict p, const uint8_t* __restrict x, int64_t K, float* __restrict y, int64_t v0,
    const int32_t* colsum, const float* scale, const int32_t* zero, const float* step, Bound bd, float* floor) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K / 4; ++g) {
    const __m512i w = _mm512_loadu_si512(p + g * 64);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + g * 4));
      acc[r] = _mm512_dpbusd_epi32(acc[r], xb, w);
    }
  }
  const __m512i cs = _mm512_loadu_si512(colsum + v0);
  const __m512 sv = _mm512_loadu_ps(scale + v0);
  const __m512 n0 = _mm512_loadu_ps(bd.norms + v0), n1 = _mm512_loadu_ps(bd.norms + bd.V + v0),
               n2 = _mm512_loadu_ps(bd.norms + 2 * bd.V + v0);
  for (int r = 0; r < R; ++r) {
    const __m512i a = _mm512_sub_epi32(acc[r], _mm512_mullo_epi32(_mm512_set1_epi32(zero[r]), cs));
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sv, _mm512_set1_ps(step[r])));
    _mm512_storeu_ps(y + r * bd.V + v0, f);
    const float* c = bd.coef + r * 3;
    const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(c[0]), n0),
                                                 _mm512_mul_ps(_mm512_set1_ps(c[1]), n1)),
                                   _mm512_mul_ps(_mm512_set1_ps(c[2]), n2));
    floor[r] = std::max(floor[r], _mm512_reduce_max_ps(_mm512_sub_ps(f, e)));
  }
}

template <int R>
void tile_plain(const int8_t* p, const uint8_t* x, int64_t K, float* y, int64_t v0, const int32_t* colsum,
                const float* scale, const int32_t* zero, const float* step, Bound bd, float* floor) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) {
      int32_t acc = 0;
      for (int64_t g = 0; g < K / 4; ++g)
        for (int j = 0; j < 4; ++j) acc += int32_t(x[r * K + g * 4 + j]) * int32_t(p[(g * 16 + l) * 4 + j]);
      const int64_t v = v0 + l;
      const float f = float(acc - zero[r] * colsum[v]) * (scale[v] * step[r]);
      y[r * bd.V + v] = f;
      const float* c = bd.coef + r * 3;
      const float e = c[0] * bd.norms[v] + c[1] * bd.norms[bd.V + v] + c[2] * bd.norms[2 * bd.V + v];
      floor[r] = std::max(floor[r], f - e);
    }
}

}  // namespace

bool int8_vnni() {
  static const bool ok = cpu_has_vnni();
  return ok;
}

// w [V, K] int8 (V a multiple of 16, K of 4) -> [V/16, K/4, 16, 4]: 16 tokens' 4 channels side by side.
torch::Tensor int8_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 4 == 0,
              "int8_pack: int8 [V, K] with V % 16 == 0 and K % 4 == 0");
  const int64_t V = w.size(0), K = w.size(1);
  return w.contiguous().view({V / 16, 16, K / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

// (scores [B, V] float32, floor [B]): scores[r, v] = (sum_k xq[r, k] * w[v, k] - zero[r] * colsum[v]) * step[r] * scale[v],
// and per row the largest scores[r, v] - e_v, with e_v = coef[r] . norms[:, v] (bounded_candidates).
std::vector<torch::Tensor> int8_scores(const torch::Tensor& xq, const torch::Tensor& step, const torch::Tensor& zero,
                                       const torch::Tensor& packed, const torch::Tensor& colsum,
                                       const torch::Tensor& scale, const torch::Tensor& coef, const torch::Tensor& norms) {
  TORCH_CHECK(xq.scalar_type() == at::kByte && xq.dim() == 2 && xq.is_contiguous(), "int8_scores: uint8 xq [B, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
              packed.size(1) * 4 == xq.size(1), "int8_scores: packed [V/16, K/4, 16, 4] matching xq");
  const int64_t B = xq.size(0), K = xq.size(1), VB = packed.size(0), V = VB * 16;
  TORCH_CHECK(step.scalar_type() == at::kFloat && step.numel() == B && step.is_contiguous() &&
              zero.scalar_type() == at::kInt && zero.numel() == B && zero.is_contiguous() &&
              colsum.scalar_type() == at::kInt && colsum.numel() == V && colsum.is_contiguous() &&
              scale.scalar_type() == at::kFloat && scale.numel() == V && scale.is_contiguous(),
              "int8_scores: contiguous per-row step, zero [B] and per-token colsum, scale [V]");
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.numel() == B * 3 &&
              norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == 3 * V,
              "int8_scores: float32 coef [B, 3] and norms [3, V]");
  auto y = torch::empty({B, V}, xq.options().dtype(at::kFloat));
  auto floor = torch::full({B}, -std::numeric_limits<float>::infinity(), xq.options().dtype(at::kFloat));
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const int8_t* pp = packed.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  float* fl = floor.data_ptr<float>();
  const int32_t* cp = colsum.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* zp = zero.data_ptr<int32_t>();
  const float* st = step.data_ptr<float>();
  const bool vnni = int8_vnni();
  std::mutex merge;
  at::parallel_for(0, VB, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> mine(B, -std::numeric_limits<float>::infinity());
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* blk = pp + b * K * 16;
      for (int64_t r0 = 0; r0 < B; r0 += 16) {  // 16 rows' sums in registers: one read of the weight
        const int64_t R = std::min<int64_t>(16, B - r0);
        const Bound bd{coef.data_ptr<float>() + r0 * 3, norms.data_ptr<float>(), V};
        auto args = std::make_tuple(blk, xp + r0 * K, K, yp + r0 * V, b * 16, cp, sp, zp + r0, st + r0, bd,
                                    mine.data() + r0);
#define LOGITSPEC_TILE(n) \
  case n: std::apply(vnni ? tile_vnni<n> : tile_plain<n>, args); break;
        switch (R) {
          LOGITSPEC_TILE(1) LOGITSPEC_TILE(2) LOGITSPEC_TILE(3) LOGITSPEC_TILE(4)
          LOGITSPEC_TILE(5) LOGITSPEC_TILE(6) LOGITSPEC_TILE(7) LOGITSPEC_TILE(8)
          LOGITSPEC_TILE(9) LOGITSPEC_TILE(10) LOGITSPEC_TILE(11) LOGITSPEC_TILE(12)
          LOGITSPEC_TILE(13) LOGITSPEC_TILE(14) LOGITSPEC_TILE(15) default: std::apply(vnni ? tile_vnni<16> : tile_plain<16>, args);
        }
#undef LOGITSPEC_TILE
      }
    }
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t r = 0; r < B; ++r) fl[r] = std::max(fl[r], mine[r]);
  });
  return {y, floor};
}

// Per row r of approx [N, V]: the tokens v with approx[r, v] + e_v >= floor[r] (floor: int8_scores's),
// e_v = coef[r] . norms[:, v]. (rows, tokens) [K] int64, rows in order, tokens ascending. One pass over
// the tokens in chunks, every row per chunk, so each chunk's norms are read from memory once.
std::vector<torch::Tensor> bounded_candidates(const torch::Tensor& approx, const torch::Tensor& coef,
                                              const torch::Tensor& norms, const torch::Tensor& floor) {
  TORCH_CHECK(approx.scalar_type() == at::kFloat && approx.dim() == 2 && approx.is_contiguous(),
              "bounded_candidates: contiguous float32 approx [N, V]");
  const int64_t N = approx.size(0), V = approx.size(1);
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.numel() == N * 3 &&
              norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == 3 * V &&
              floor.scalar_type() == at::kFloat && floor.is_contiguous() && floor.numel() == N,
              "bounded_candidates: float32 coef [N, 3], norms [3, V], floor [N]");
  const float* a = approx.data_ptr<float>();
  const float* c = coef.data_ptr<float>();
  const float* n0 = norms.data_ptr<float>();
  const float *n1 = n0 + V, *n2 = n0 + 2 * V;
  const float* fl = floor.data_ptr<float>();
  constexpr int64_t CHUNK = 2048;
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  std::vector<std::vector<int64_t>> part(chunks * N);  // [chunk][row]
  at::parallel_for(0, chunks, 8, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t lo = q * CHUNK, hi = std::min(V, lo + CHUNK);
      for (int64_t r = 0; r < N; ++r) {
        const float* ar = a + r * V;
        const float c0 = c[r * 3], c1 = c[r * 3 + 1], c2 = c[r * 3 + 2], f = fl[r];
        auto& out = part[q * N + r];
        int64_t v = lo;
        const __m256 vc0 = _mm256_set1_ps(c0), vc1 = _mm256_set1_ps(c1), vc2 = _mm256_set1_ps(c2),
                     vf = _mm256_set1_ps(f);
        for (; v + 8 <= hi; v += 8) {
          const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(vc0, _mm256_loadu_ps(n0 + v)),
                                                       _mm256_mul_ps(vc1, _mm256_loadu_ps(n1 + v))),
                                         _mm256_mul_ps(vc2, _mm256_loadu_ps(n2 + v)));
          int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(ar + v), e), vf, _CMP_GE_OQ));
          while (bits) {
            out.push_back(v + __builtin_ctz(bits));
            bits &= bits - 1;
          }
        }
        for (; v < hi; ++v)
          if (ar[v] + (c0 * n0[v] + c1 * n1[v] + c2 * n2[v]) >= f) out.push_back(v);
      }
    }
  });
  std::vector<std::vector<int64_t>> found(N);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t q = 0; q < chunks; ++q) found[r].insert(found[r].end(), part[q * N + r].begin(), part[q * N + r].end());
  return candidate_tensors(found);
}
