// Candidates of the output layer's screen (logitspec/head.py, ScreenedArgmax.exact_argmax).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec8.h"

namespace {

// 8 consecutive approximate logits as float32 (a bfloat16 value widens exactly: its bits are the
// upper half of the float's).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

// Per row r of a [N, V]: the tokens within mg[r] of the row's largest value, ascending, into found[r].
template <typename T>
void candidates(const T* a, const float* mg, int64_t N, int64_t V, std::vector<std::vector<int64_t>>& found) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = a + r * V;
      const int64_t V8 = V & ~int64_t{7};
      __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 bad = _mm256_setzero_ps();
      for (int64_t v = 0; v < V8; v += 8) {
        const __m256 x = load8(row + v);
        mx = _mm256_max_ps(mx, x);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      float best = *std::max_element(lanes, lanes + 8);
      bool nan = _mm256_movemask_ps(bad) != 0;
      for (int64_t v = V8; v < V; ++v) {
        const float x = load1(row + v);
        nan |= x != x;
        best = std::max(best, x);
      }
      if (nan || V == 0) continue;
      const float thr = best - mg[r];
      const __m256 tv = _mm256_set1_ps(thr);
      for (int64_t v = 0; v < V8; v += 8) {
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + v), tv, _CMP_GE_OQ));
        while (bits) {
          found[r].push_back(v + __builtin_ctz(bits));
          bits &= bits - 1;
        }
      }
      for (int64_t v = V8; v < V; ++v)
        if (load1(row + v) >= thr) found[r].push_back(v);
    }
  });
}

// Per selected row rows[b] of a [N, V]: its k largest values' tokens, best first, ties to the lower
// token, into out[b * k ..]. One pass: 8 values are compared at once with the k-th best so far, and
// the few that beat it are inserted into a sorted list of k. NaN never beats anything.
template <typename T>
void top_tokens(const T* a, const int64_t* rows, int64_t B, int64_t V, int64_t k, int64_t* out) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<std::pair<float, int64_t>> best;  // (value, token), value descending, ties token ascending
    best.reserve(k + 1);
    for (int64_t b = b0; b < b1; ++b) {
      const T* row = a + rows[b] * V;
      best.clear();
      float thr = -std::numeric_limits<float>::infinity();
      auto offer = [&](float x, int64_t v) {
        if (!(x > thr) && static_cast<int64_t>(best.size()) == k) return;
        if (x != x) return;
        auto at = std::find_if(best.begin(), best.end(), [x](const auto& e) { return e.first < x; });
        best.insert(at, {x, v});
        if (static_cast<int64_t>(best.size()) > k) best.pop_back();
        if (static_cast<int64_t>(best.size()) == k) thr = best.back().first;
      };
      const int64_t V8 = V & ~int64_t{7};
      int64_t v = 0;
      for (; v < V8; v += 8) {
        if (static_cast<int64_t>(best.size()) < k) {  // not k numbers yet: no threshold to compare with
          for (int l = 0; l < 8; ++l) offer(load1(row + v + l), v + l);
          continue;
        }
        const __m256 x = load8(row + v);
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(thr), _CMP_GT_OQ));
        if (!bits) continue;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, x);
        while (bits) {
          const int l = __builtin_ctz(bits);
          offer(lanes[l], v + l);  // thr may rise between lanes: offer re-checks
          bits &= bits - 1;
        }
      }
      for (; v < V; ++v) offer(load1(row + v), v);
      for (int64_t i = 0; i < k; ++i) out[b * k + i] = i < static_cast<int64_t>(best.size()) ? best[i].second : -1;
    }
  });
}

}  // namespace

// The next-next guesses (logitspec/verify.py, decide): per row rows[b] of scores [N, V] (float32 or
// bfloat16), the tokens of its k largest scores, best first, ties to the lower token: [B, k] int64
// (what a stable descending sort's first k give). 24 rows of 262k bfloat16 scores: one pass a row,
// where torch.topk took 4.3 ms here. A row with fewer than k numbers pads with -1.
torch::Tensor top_tokens(const torch::Tensor& scores, const torch::Tensor& rows, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16) &&
              scores.dim() == 2 && scores.is_contiguous(),
              "top_tokens: contiguous float32 or bfloat16 scores [N, V] on CPU");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "top_tokens: int64 rows [B]");
  TORCH_CHECK(k >= 1 && k <= scores.size(1), "top_tokens: need 1 <= k <= V");
  const int64_t B = rows.size(0), N = scores.size(0), V = scores.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < N, "top_tokens: row index out of range");
  auto out = torch::empty({B, k}, rows.options());
  if (scores.scalar_type() == at::kFloat)
    top_tokens(scores.data_ptr<float>(), r, B, V, k, out.data_ptr<int64_t>());
  else
    top_tokens(scores.data_ptr<at::BFloat16>(), r, B, V, k, out.data_ptr<int64_t>());
  return out;
}

// The output layer's screen (logitspec/head.py): per row r of approx [N, V] (float32, or bfloat16 as
// the bfloat16 pass returns it: no float32 copy of the [N, V] scores), the tokens whose approximate
// logit is >= the row's largest minus margin[r] (compared in float32), rows in order, tokens ascending
// (what torch.nonzero(approx >= (approx.amax(1) - margin)[:, None]) gives, in one pass over each row
// and a second over the same row while it is in cache). A row holding a NaN has no candidates.
std::vector<torch::Tensor> candidate_tensors(const std::vector<std::vector<int64_t>>& found);

std::vector<torch::Tensor> screen_candidates(const torch::Tensor& approx, const torch::Tensor& margin) {
  TORCH_CHECK(approx.device().is_cpu() && (approx.scalar_type() == at::kFloat || approx.scalar_type() == at::kBFloat16) &&
              approx.dim() == 2 && approx.is_contiguous(),
              "screen_candidates: contiguous float32 or bfloat16 approx [N, V] on CPU");
  TORCH_CHECK(margin.scalar_type() == at::kFloat && margin.dim() == 1 && margin.size(0) == approx.size(0) && margin.is_contiguous(),
              "screen_candidates: float32 margin [N]");
  const int64_t N = approx.size(0), V = approx.size(1);
  const float* mg = margin.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(N);
  if (approx.scalar_type() == at::kFloat)
    candidates(approx.data_ptr<float>(), mg, N, V, found);
  else
    candidates(approx.data_ptr<at::BFloat16>(), mg, N, V, found);
  return candidate_tensors(found);
}

// (rows, tokens) [K] int64 from per-row token lists: rows in order, each row's tokens as listed.
std::vector<torch::Tensor> candidate_tensors(const std::vector<std::vector<int64_t>>& found) {
  int64_t K = 0;
  for (const auto& f : found) K += static_cast<int64_t>(f.size());
  auto rows = torch::empty({K}, torch::kLong);
  auto toks = torch::empty({K}, torch::kLong);
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* tp = toks.data_ptr<int64_t>();
  for (int64_t r = 0; r < static_cast<int64_t>(found.size()); ++r)
    for (int64_t v : found[r]) { *rp++ = r; *tp++ = v; }
  return {rows, toks};
}

// Exact float32 logits of the candidates: out[k] = weight[toks[k]] . x[rows[k]], each one 8-lane FMA
// chain in H order and a fixed horizontal sum (a candidate's value depends on its row and token
// only), reading each candidate's weight row in place (no [K, H] gather: on flat distributions a
// screen leaves tens of thousands of candidates, 25k at 4 rows of random tokens here).
torch::Tensor rescore(const torch::Tensor& weight, const torch::Tensor& x, const torch::Tensor& rows,
                      const torch::Tensor& toks) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && weight.is_contiguous() &&
              x.is_contiguous() && weight.dim() == 2 && x.dim() == 2 && weight.size(1) == x.size(1),
              "rescore: contiguous float32 weight [V, H] and x [N, H]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && toks.scalar_type() == at::kLong && rows.numel() == toks.numel() &&
              rows.is_contiguous() && toks.is_contiguous(), "rescore: int64 rows and toks [K]");
  const int64_t K = rows.numel(), H = x.size(1);
  auto out = torch::empty({K}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* t = toks.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, K, 256, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      o[k] = logitspec_vec8::dot(w + t[k] * H, xs + r[k] * H, H);
    }
  });
  return out;
}
