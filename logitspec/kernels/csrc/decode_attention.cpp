// Exact float32 attention for decoding and tree-verification steps (few queries per row, AVX2 + FMA);
// keys and values float32 or bfloat16 (widened exactly as they are loaded; the sums are float32's).
//
// out[b, t, h, :] = softmax_j(scale * q[b, h, t] . k[b, kv(h), j]) v[b, kv(h), j] over the columns j
// that query node t of row b may see (mask[b, 0, t, j] == 0 for an additive float mask whose hidden
// entries are large negative numbers, or true for a boolean mask).
//
// Why a kernel of our own: SDPA's CPU kernels read a batch's cached keys at about 9 GB/s here for one
// query per row (docs/performance.md), and their sums run over the whole padded row, holes included,
// so a node's result depends on where its row's holes and its tree siblings sit.
//
// Batch invariance, by construction: each query's result depends only on the sequence of (key, value)
// columns it sees, in increasing column order. A step's rows hold their committed tokens first
// (column = position) and the step's nodes after them, a node's ancestors before it, so a node
// verified in a tree of k nodes sees the same sequence as the same token decoded alone after its
// ancestors were committed: one forward or the other, its output is bitwise the same.
//   - a score is one dot product over D (8-lane FMA chain in D order, then a fixed horizontal sum);
//   - the softmax runs over the query's visible scores packed densely in column order (max, exp of
//     the difference, 8-lane sum over the packed index, fixed horizontal sum), so holes do not shift
//     any lane;
//   - the output accumulates p_j * v_j in increasing j over visible columns, one chain per lane of D.
// Only the columns some node of a row sees are visited (listed once per call, in increasing order): a
// static batch's short rows sit in a buffer as wide as its longest, and reading or prefetching their
// padding cost more than their own columns. Work is split over torch's threads by (row, key head,
// chunk of listed columns) for the scores, by query for the softmax and by (row, key head, 32-lane
// chunk of D) for the output, whose sums pause and resume at 64-column blocks (every node's over one
// block before the next); no split changes the order of any sum. Built with -ffp-contract=off (see
// skinny_linear.cpp).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec8.h"

namespace {

using logitspec_vec8::hsum8;
using logitspec_vec8::load8;

// e^x for x <= 0, 8 lanes (Cephes' single-precision polynomial; the same operations on every lane).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// KT: the keys' and values' element type, float or uint16_t (bfloat16 bits).
template <typename KT>
struct Shape {
  int64_t B, H, KV, G, T, S, D, Q;  // Q = G * T queries per (row, key head): i = g * T + t
  const float* q; int64_t qs0, qs1, qs2;
  const KT* k; int64_t ks0, ks1, ks2;
  const KT* v; int64_t vs0, vs1, vs2;
  const float* mf; const uint16_t* mh; const bool* mb; int64_t ms0, ms2;  // one of the three mask kinds
  float scale;
  // the columns some node of row b sees, increasing: cols[off[b] .. off[b + 1]) (padding, holes and
  // columns no node sees are never read, prefetched or scanned)
  const int32_t* cols; const int64_t* off;
};

template <typename KT>
inline bool visible(const Shape<KT>& s, int64_t b, int64_t t, int64_t j) {
  const int64_t o = b * s.ms0 + t * s.ms2 + j;
  return s.mf ? s.mf[o] == 0.0f : s.mh ? (s.mh[o] & 0x7fff) == 0 : s.mb[o];  // bfloat16: +-0 visible
}

template <typename KT>
inline const float* query(const Shape<KT>& s, int64_t b, int64_t h, int64_t i) {
  const int64_t g = i / s.T, t = i % s.T;
  return s.q + b * s.qs0 + (h * s.G + g) * s.qs1 + t * s.qs2;
}

constexpr int64_t kColumnChunk = 64;
constexpr int64_t kHeadBlock = 4;  // query heads of one key head whose dot products share each load of k

// Dot products of NG queries (a, a + stride, ...) with the column kj: each its own 8-lane FMA chain
// in D order and horizontal sum, exactly as one at a time; k is loaded once for all NG.
template <int NG, typename KT>
inline void dots(const float* const* qs, const KT* kj, int64_t D, float* out) {
  __m256 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 kv = load8(kj + d);
    for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + d), kv, acc[g]);
  }
  for (int g = 0; g < NG; ++g) out[g] = hsum8(acc[g]);
}

// scores[(b, h), i, j] for visible (t, j); other entries are left as they are (never read).
template <typename KT>
void scores(const Shape<KT>& s, float* out) {
  int64_t widest = 0;
  for (int64_t b = 0; b < s.B; ++b) widest = std::max(widest, s.off[b + 1] - s.off[b]);
  const int64_t chunks = (widest + kColumnChunk - 1) / kColumnChunk;
  at::parallel_for(0, s.B * s.KV * chunks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<const float*> qs(s.G);
    float d[kHeadBlock];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bh = u / chunks, c = u % chunks, b = bh / s.KV, h = bh % s.KV;
      const int32_t* cols = s.cols + s.off[b];
      const int64_t n = s.off[b + 1] - s.off[b];
      float* row = out + bh * s.Q * s.S;
      for (int64_t x = c * kColumnChunk; x < std::min(n, (c + 1) * kColumnChunk); ++x) {
        const int64_t j = cols[x];
        const KT* kj = s.k + b * s.ks0 + h * s.ks1 + j * s.ks2;
        if (x + 2 < n) {
          const char* ahead = reinterpret_cast<const char*>(s.k + b * s.ks0 + h * s.ks1 + cols[x + 2] * s.ks2);
          for (int64_t o = 0; o < s.D * int64_t{sizeof(KT)}; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
        for (int64_t t = 0; t < s.T; ++t) {
          if (!visible(s, b, t, j)) continue;
          for (int64_t g = 0; g < s.G; ++g) qs[g] = query(s, b, h, g * s.T + t);
          for (int64_t g0 = 0; g0 < s.G; g0 += kHeadBlock) {
            const int64_t ng = std::min(kHeadBlock, s.G - g0);
            switch (ng) {
              case 4: dots<4>(&qs[g0], kj, s.D, d); break;
              case 3: dots<3>(&qs[g0], kj, s.D, d); break;
              case 2: dots<2>(&qs[g0], kj, s.D, d); break;
              default: dots<1>(&qs[g0], kj, s.D, d); break;
            }
            for (int64_t y = 0; y < ng; ++y) row[((g0 + y) * s.T + t) * s.S + j] = d[y] * s.scale;
          }
        }
      }
    }
  });
}

// Per query: its visible scores -> unnormalised softmax weights in place; their sum into total.
template <typename KT>
void softmax(const Shape<KT>& s, float* sc, float* total) {
  at::parallel_for(0, s.B * s.KV * s.Q, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf(s.S + 8);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bh = u / s.Q, i = u % s.Q, b = bh / s.KV, t = i % s.T;
      float* row = sc + u * s.S;
      const int32_t* cols = s.cols + s.off[b];
      const int64_t listed = s.off[b + 1] - s.off[b];
      int64_t n = 0;
      for (int64_t x = 0; x < listed; ++x)
        if (visible(s, b, t, cols[x])) buf[n++] = row[cols[x]];
      if (n == 0) { total[u] = 0.0f; continue; }
      float m = buf[0];
      for (int64_t c = 1; c < n; ++c) m = std::max(m, buf[c]);
      const __m256 mv = _mm256_set1_ps(m);
      std::fill(buf.begin() + n, buf.begin() + ((n + 7) & ~int64_t{7}), m);  // padding lanes -> e^0, not summed
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < n; c += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&buf[c]), mv));
        _mm256_storeu_ps(&buf[c], e);
        if (c + 8 > n) {  // the last partial chunk: lanes past n add +0
          const int r = static_cast<int>(n - c);
          const __m256i keep = _mm256_setr_epi32(-1, r > 1 ? -1 : 0, r > 2 ? -1 : 0, r > 3 ? -1 : 0,
                                                 r > 4 ? -1 : 0, r > 5 ? -1 : 0, r > 6 ? -1 : 0, 0);
          e = _mm256_and_ps(e, _mm256_castsi256_ps(keep));
        }
        acc = _mm256_add_ps(acc, e);
      }
      total[u] = hsum8(acc);
      n = 0;
      for (int64_t x = 0; x < listed; ++x)
        if (visible(s, b, t, cols[x])) row[cols[x]] = buf[n++];
    }
  });
}

constexpr int64_t kLanes = 32;        // lanes of D per output unit: 4 ymm registers of v
constexpr int64_t kPrefetch = 16;     // columns ahead whose values are prefetched
constexpr int64_t kValueBlock = 64;   // columns whose values (8 KB of the unit's lanes) serve every node from L1
constexpr int kOutHeads = 3;          // query heads accumulated together (3 x 4 accumulators + 4 of v)

// For node t and query heads g0 .. g0 + NG - 1 of key head h: adds p_j v_j[d0 .. d0 + 32) over the
// listed columns j = cols[x], x in [x0, x1), that t sees, in increasing j, to the running sums in acc
// (NG x 32 floats; one FMA chain per lane and query, resumed where the previous block left it: the
// same chain as one pass over all columns). ``prefetch``: the first pass over the block, which
// fetches the next one.
template <int NG, typename KT>
inline void weigh(const Shape<KT>& s, const float* prow, float* acc_io, const KT* vb, int64_t b, int64_t t,
                  int64_t g0, const int32_t* cols, int64_t n, int64_t x0, int64_t x1, bool prefetch) {
  __m256 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int y = 0; y < 4; ++y) acc[g][y] = _mm256_loadu_ps(acc_io + g * kLanes + 8 * y);
  const float* p[NG];
  for (int g = 0; g < NG; ++g) p[g] = prow + ((g0 + g) * s.T + t) * s.S;
  for (int64_t x = x0; x < x1; ++x) {
    if (prefetch) {
      // the chunk's two cache lines kPrefetch listed columns ahead: a column's 32 lanes sit a whole
      // row of D apart from the next column's, a stride the hardware prefetchers follow poorly
      const char* ahead = reinterpret_cast<const char*>(vb + cols[std::min(x + kPrefetch, n - 1)] * s.vs2);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    const int64_t j = cols[x];
    if (!visible(s, b, t, j)) continue;
    const KT* vj = vb + j * s.vs2;
    __m256 vv[4];
    for (int y = 0; y < 4; ++y) vv[y] = load8(vj + 8 * y);
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_set1_ps(p[g][j]);
      for (int y = 0; y < 4; ++y) acc[g][y] = _mm256_fmadd_ps(w, vv[y], acc[g][y]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int y = 0; y < 4; ++y) _mm256_storeu_ps(acc_io + g * kLanes + 8 * y, acc[g][y]);
}

// out[b, t, h * G + g, :] = sum_j p_j v_j / total over visible j. D must be a multiple of 32 here
// (checked by the caller); units are (row, key head, 32-lane chunk of D). A unit walks its listed
// columns in blocks of kValueBlock and runs every node's sums over a block while its values are in
// L1, so the values are read from memory once per step, not once per node.
template <typename KT>
void weighted_values(const Shape<KT>& s, const float* p, const float* total, float* out) {
  const int64_t chunks = s.D / kLanes;
  at::parallel_for(0, s.B * s.KV * chunks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> sums(s.Q * kLanes);  // [T, G, 32] running sums of one unit
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bh = u / chunks, c = u % chunks, b = bh / s.KV, h = bh % s.KV, d0 = c * kLanes;
      const float* prow = p + bh * s.Q * s.S;
      const KT* vb = s.v + b * s.vs0 + h * s.vs1 + d0;
      const int32_t* cols = s.cols + s.off[b];
      const int64_t n = s.off[b + 1] - s.off[b];
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t x0 = 0; x0 < n; x0 += kValueBlock) {
        const int64_t x1 = std::min(n, x0 + kValueBlock);
        for (int64_t t = 0; t < s.T; ++t)
          for (int64_t g0 = 0; g0 < s.G; g0 += kOutHeads) {
            float* acc = sums.data() + (t * s.G + g0) * kLanes;
            const bool first = t == 0 && g0 == 0;
            switch (std::min<int64_t>(kOutHeads, s.G - g0)) {
              case 3: weigh<3>(s, prow, acc, vb, b, t, g0, cols, n, x0, x1, first); break;
              case 2: weigh<2>(s, prow, acc, vb, b, t, g0, cols, n, x0, x1, first); break;
              default: weigh<1>(s, prow, acc, vb, b, t, g0, cols, n, x0, x1, first); break;
            }
          }
      }
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t g = 0; g < s.G; ++g) {
          const float l = total[bh * s.Q + g * s.T + t];
          const __m256 inv = _mm256_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
          const float* a = sums.data() + (t * s.G + g) * kLanes;
          float* o = out + ((b * s.T + t) * s.H + h * s.G + g) * s.D + d0;
          for (int x = 0; x < 4; ++x) _mm256_storeu_ps(o + 8 * x, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * x), inv));
        }
    }
  });
}

template <typename KT>
torch::Tensor run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                  const torch::Tensor& mask, double scale) {
  Shape<KT> s;
  s.B = query.size(0); s.H = query.size(1); s.T = query.size(2); s.D = query.size(3);
  s.KV = key.size(1); s.S = key.size(2);
  TORCH_CHECK(s.KV > 0 && s.H % s.KV == 0, "decode_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(key.size(0) == s.B && value.sizes() == key.sizes() && key.size(3) == s.D && s.D % 32 == 0,
              "decode_attention: key/value [B, KV, S, D] with D a multiple of 32");
  TORCH_CHECK(mask.size(0) == s.B && mask.size(1) == 1 && mask.size(2) == s.T && mask.size(3) == s.S,
              "decode_attention: mask must be [B, 1, T, S]");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1 && mask.stride(3) == 1,
              "decode_attention: the last dimension must be contiguous");
  s.G = s.H / s.KV; s.Q = s.G * s.T; s.scale = static_cast<float>(scale);
  s.q = query.data_ptr<float>(); s.qs0 = query.stride(0); s.qs1 = query.stride(1); s.qs2 = query.stride(2);
  s.k = static_cast<const KT*>(key.data_ptr()); s.ks0 = key.stride(0); s.ks1 = key.stride(1); s.ks2 = key.stride(2);
  s.v = static_cast<const KT*>(value.data_ptr()); s.vs0 = value.stride(0); s.vs1 = value.stride(1); s.vs2 = value.stride(2);
  s.mf = mask.scalar_type() == at::kFloat ? mask.data_ptr<float>() : nullptr;
  s.mh = mask.scalar_type() == at::kBFloat16 ? static_cast<const uint16_t*>(mask.data_ptr()) : nullptr;
  s.mb = mask.scalar_type() == at::kBool ? mask.data_ptr<bool>() : nullptr;
  s.ms0 = mask.stride(0); s.ms2 = mask.stride(2);
  torch::Tensor out = torch::empty({s.B, s.T, s.H, s.D}, query.options());
  if (out.numel() == 0 || s.S == 0) return out.zero_();
  std::vector<int64_t> off(s.B + 1, 0);
  std::vector<int32_t> cols;
  cols.reserve(s.B * s.S);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t j = 0; j < s.S; ++j)
      for (int64_t t = 0; t < s.T; ++t)
        if (visible(s, b, t, j)) { cols.push_back(static_cast<int32_t>(j)); break; }
    off[b + 1] = static_cast<int64_t>(cols.size());
  }
  s.cols = cols.data(); s.off = off.data();
  torch::Tensor sc = torch::empty({s.B * s.KV * s.Q, s.S}, query.options());
  torch::Tensor total = torch::empty({s.B * s.KV * s.Q}, query.options());
  scores(s, sc.data_ptr<float>());
  softmax(s, sc.data_ptr<float>(), total.data_ptr<float>());
  weighted_values(s, sc.data_ptr<float>(), total.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace

// query [B, H, T, D] float32, key/value [B, KV, S, D] both float32 or both bfloat16, mask [B, 1, T, S]
// (float32 or bfloat16 additive 0 / large negative, or bool) -> [B, T, H, D] float32. The last dimension of every
// input must be contiguous, D a multiple of 32.
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() && mask.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == value.scalar_type() &&
              (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "decode_attention: float32 query; float32 or bfloat16 key and value (the same)");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, "decode_attention: 4-D inputs");
  TORCH_CHECK(mask.scalar_type() == at::kFloat || mask.scalar_type() == at::kBFloat16 || mask.scalar_type() == at::kBool,
              "decode_attention: float32, bfloat16 or bool mask");
  if (key.scalar_type() == at::kBFloat16) return run<uint16_t>(query, key, value, mask, scale);
  return run<float>(query, key, value, mask, scale);
}
