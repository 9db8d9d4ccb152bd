// Activations quantised per row and block of 32 inputs (symmetric int8, as llama.cpp's Q8_0 activations),
// shared by the int8 and int4 product kernels. The kernels take float activations and quantise them here
// rather than in the graph, where it costs five fused ops around every product (a max, a divide, a
// rounding convert, the block sums), each a thunk dispatched on its own for a few microseconds of work.
#ifndef JAXINFER_CPU_KERNELS_QUANTIZE_ACTIVATIONS_H_
#define JAXINFER_CPU_KERNELS_QUANTIZE_ACTIVATIONS_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

constexpr int64_t kActivationBlock = 32;

// One block of 32 activations: int8 values at scale amax / 127 (round half to even, as jnp.round in the
// references), the scale, and where asked for (not null) the block's float sum and the sum of its int8
// values.
inline void QuantizeBlock(const float* src, int8_t* dst, float* scale, float* sum, int32_t* q_sum) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (sum != nullptr) *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  const float s = amax == 0.0f ? 1.0f : amax / 127.0f;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, sv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
  if (q_sum != nullptr) *q_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps(), t = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    t = _mm256_add_ps(t, v[i]);
  }
  alignas(32) float lanes[8], sums[8];
  _mm256_store_ps(lanes, m);
  _mm256_store_ps(sums, t);
  float amax = 0.0f, total = 0.0f;
  for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]), total += sums[i];
  if (sum != nullptr) *sum = total;
  const float s = amax == 0.0f ? 1.0f : amax / 127.0f;
  const __m256 sv = _mm256_set1_ps(s);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));
  // |x / s| <= 127, so the saturating packs are exact; they interleave 128-bit lanes, undone by the permute.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  if (q_sum != nullptr) {
    alignas(32) int32_t q_lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q_lanes),
                       _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    int32_t q_total = 0;
    for (int i = 0; i < 8; ++i) q_total += q_lanes[i];
    *q_sum = q_total;
  }
#endif
  *scale = s;
}

// Rows x [M, K] (K a multiple of 32) -> xq [M, K] int8, xs [M, K/32] scales, and per row and block the
// float sums of x (sum [M, K/32]) and the sums of xq (q_sum [M, K/32]), each only where not null. Many
// rows (a prefill chunk) are split over the pool; a few rows cost less than waking it.
inline void QuantizeRows(xla::ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, int8_t* xq, float* xs,
                         float* sum, int32_t* q_sum) {
  const int64_t blocks = k / kActivationBlock;
  constexpr int64_t kRowsPerItem = 8;
  ParallelFor(pool, (m + kRowsPerItem - 1) / kRowsPerItem, m * k * 64, [&](int64_t item) {
    for (int64_t r = item * kRowsPerItem; r < std::min(m, (item + 1) * kRowsPerItem); ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = r * blocks + b;
        QuantizeBlock(x + at * kActivationBlock, xq + at * kActivationBlock, xs + at,
                      sum == nullptr ? nullptr : sum + at, q_sum == nullptr ? nullptr : q_sum + at);
      }
  });
}

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_QUANTIZE_ACTIVATIONS_H_
