// 8-lane float32 helpers shared by the CPU kernels (AVX2 + FMA). Each is a fixed sequence of
// operations, so a result depends only on its inputs (the kernels' batch invariance rests on it).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace logitspec_vec8 {

// The horizontal sum of 8 lanes, always in the order (0+4 + 2+6) + (1+5 + 3+7).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l + h
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         // (0+2, 1+3)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x1));                                   // (0+2)+(1+3)
  return _mm_cvtss_f32(s);
}

// 8 floats from p: float32 as they are, bfloat16 (raw uint16 bits) widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store_one_bf16(uint16_t* p, float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  *p = v != v ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7fff) >> 16);
}

// 8 floats stored to p: as they are, or rounded to bfloat16 (nearest, ties to even, as c10::BFloat16
// rounds finite numbers and the quiet NaNs arithmetic makes).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xD8);  // 8 x u16 in the low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// One element as float, and back (the scalar twins of load8 / store8).
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float* p, float v) { *p = v; }
inline void from_float(uint16_t* p, float v) { store_one_bf16(p, v); }

// a . b over n floats: one 8-lane FMA chain over the multiples of 8, hsum8, then the tail in order.
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t n8 = n & ~int64_t{7};
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float v = hsum8(acc);
  for (int64_t i = n8; i < n; ++i) v += a[i] * b[i];
  return v;
}

}  // namespace logitspec_vec8
