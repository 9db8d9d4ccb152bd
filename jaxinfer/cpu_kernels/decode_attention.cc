// Attention straight out of the paged KV cache for XLA:CPU (AVX-512 or AVX2), one query per row, as an XLA
// FFI custom call: a decode step is a row per sequence; a verification step or a prefill chunk passes each
// new token of a sequence as a row of its own (Q rows per page-table row), attending up to its position.
//
// q          f32 [R, H, D]        the query of each of R rows
// k, v       [L, KV, P, S, D]     the page pool of every layer: float32, bfloat16 held as uint16 bits, or
//                                 int8; the S * D values of one (layer, KV head, page) are contiguous
// k_scale, v_scale f32 [L, KV, P, S]  int8 pages only: each position's scale (value = int8 * scale)
// page_table s32 [R / Q, W]       key position t of row r lives at page page_table[r / Q, t / S], offset
//                                 t % S, Q the attribute queries_per_row (a prefill chunk's Q queries of
//                                 one sequence share its table row)
// lengths    s32 [R]              keys per row including the new one (the query sits at length - 1); 0 for
//                                 an inactive row (zeros out). Clamped to W * S.
// attributes: layer, window (0: none; else keys in [length - window, length)), scale, softcap (0: none),
//             queries_per_row (Q >= 1)
// out        f32 [R, H, D]
//
// Only the pages a row's visible keys sit on are read, and of them only those keys: table entries past a
// row's length (the null page, or stale ids) and page slots past its last key are never touched. Page ids
// are clamped to [0, P) so a corrupt table cannot read outside the pool.
//
// Each (row, KV head) reads its keys and values once for all the query heads that share them, where XLA's
// form (gather the pages, widen, small batched dots) copies every layer's pages out of the pool first.
//
// The code is written once over a float vector Vec of kLanes lanes: 16 (zmm) where the build has AVX-512F,
// else 8 (ymm, AVX2 + FMA); the register-sized constants follow the register file (32 zmm or 16 ymm).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kDimMultiple = 16;  // head_dim must be a multiple of this (both vector widths divide it)
constexpr int kHeadGroup = 8;     // query heads per pass over the keys (accumulators in registers)

#if defined(__AVX512F__)

using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kValueRegisters = 24;  // most accumulators of the value pass: heads x kLanes-wide chunks of d
constexpr int ValueRegisters(int heads, int chunks) { return heads * chunks; }
constexpr int ScoreKeys(int heads) { return 1; }  // keys per step of the score pass
constexpr bool kStreamValues = false;             // see the AVX2 definition

inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {  // bfloat16 bits -> float32: the high half of each word
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vec Load(const int8_t* p) {  // int8 -> float32, unscaled (scores and weights take the scales)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec LoadAligned(const float* p) { return _mm512_load_ps(p); }
inline void Store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline void StoreAligned(float* p, Vec x) { _mm512_store_ps(p, x); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }

// exp(x) within ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial
// (its remainder r^7 / 7! < 1.2e-7 relative). Below -87 the result is ~1e-38, not 0; above 88, inf.
inline Vec Exp(Vec x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// The sums of 16 vectors in one: 15 shuffle-add steps where 16 horizontal reductions take ~60. Lane
// 4k + m of the result is the sum of x[4m + k] (a 4 x 4 transpose of the order; callers permute x by
// TransposeSumSource).
inline Vec TransposeSum(Vec x[16]) {
  // 8 vectors, each 256-bit half holding 8 partial sums of one of x[2i], x[2i + 1].
  for (int i = 0; i < 8; ++i) {
    const __m512 a = x[2 * i], b = x[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  // 4 vectors, each 128-bit block holding 4 partial sums of one of x[4i .. 4i + 3].
  for (int i = 0; i < 4; ++i) {
    const __m512 a = x[2 * i], b = x[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // 2 vectors, block k holding 2 partial sums each of x[8i + k] and x[8i + 4 + k].
  for (int i = 0; i < 2; ++i) {
    const __m512 a = x[2 * i], b = x[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  // Block k: the sums of x[k], x[4 + k], x[8 + k], x[12 + k].
  return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}
constexpr int TransposeSumSource(int i) { return i % 4 * 4 + i / 4; }  // the key whose sums go in x[i]

// The first `count` lanes (all where count >= kLanes).
using Mask = __mmask16;
inline Mask FirstLanes(int64_t count) {
  return count >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}
inline Vec MaxWhere(Mask valid, Vec best, Vec x) { return _mm512_mask_max_ps(best, valid, best, x); }
inline Vec ZeroUnless(Mask valid, Vec x) { return _mm512_maskz_mov_ps(valid, x); }
inline float ReduceMax(Vec x) { return _mm512_reduce_max_ps(x); }
inline float ReduceAdd(Vec x) { return _mm512_reduce_add_ps(x); }

#else  // AVX2 + FMA

using Vec = __m256;
constexpr int kLanes = 8;
// Registers of the value pass: heads x chunks accumulators, the chunks of one value and the broadcast
// weight, within the 16 ymm registers.
constexpr int kValueRegisters = 16;
constexpr int ValueRegisters(int heads, int chunks) { return heads * chunks + std::min(heads, chunks) + 1; }
// With fewer heads than chunks, hold the broadcast weights and stream the value chunks (so 3 heads x 4
// chunks fit: one pass over the keys where holding 4 chunks would take two).
constexpr bool kStreamValues = true;
// Keys per step of the score pass: K x heads accumulators, K key chunks and one q chunk in the 16 ymm
// registers, so each q chunk is loaded once for K keys (the pass is otherwise bound by its loads).
constexpr int ScoreKeys(int heads) {
  for (int k = 4; k > 1; --k)
    if (k * heads + k + 1 <= 16) return k;
  return 1;
}

inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const uint16_t* p) {  // bfloat16 bits -> float32: the high half of each word
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Vec Load(const int8_t* p) {  // int8 -> float32, unscaled (scores and weights take the scales)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec LoadAligned(const float* p) { return _mm256_load_ps(p); }
inline void Store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline void StoreAligned(float* p, Vec x) { _mm256_store_ps(p, x); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

// exp(x) as the AVX-512 path computes it (same reduction and polynomial). AVX2 has no vscalefps: 2^n is
// built in the exponent field, in two factors 2^(n/2) 2^(n - n/2) so that n = 128 (x up to the clamp at
// 89) still gives p * 2^128, finite below ~88.72 and inf above, where one factor 2^128 would not exist.
inline Vec Exp(Vec x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

// The sums of 8 vectors in one, lane i the sum of x[i]: 6 horizontal adds and a cross-half add.
inline Vec TransposeSum(Vec x[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  // a: the sums of x[0..3] over lanes 0-3 | the same over lanes 4-7; b likewise for x[4..7].
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
constexpr int TransposeSumSource(int i) { return i; }

// The first `count` lanes (all where count >= kLanes), as all-ones lanes.
using Mask = __m256;
inline Mask FirstLanes(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t c = static_cast<int32_t>(std::min<int64_t>(count, kLanes));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
}
inline Vec MaxWhere(Mask valid, Vec best, Vec x) { return _mm256_max_ps(best, _mm256_blendv_ps(best, x, valid)); }
inline Vec ZeroUnless(Mask valid, Vec x) { return _mm256_and_ps(valid, x); }
inline float ReduceMax(Vec x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float ReduceAdd(Vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif

// softcap * tanh(s / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1): -1 and 1 exactly at the far ends.
inline Vec Softcap(Vec s, float softcap) {
  const Vec e = Exp(Mul(s, Set1(2.0f / softcap)));
  const Vec one = Set1(1.0f);
  const Vec tanh = Sub(one, Div(Set1(2.0f), Add(e, one)));
  return Mul(tanh, Set1(softcap));
}

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* page_table;
  const int32_t* lengths;
  const float* k_scale;  // int8 pages: [L, KV, P, S]; else null
  const float* v_scale;
  float* out;
  int64_t rows, heads, kv_heads, pages, page_size, dim, table_width, layer, window, queries_per_row;
  float scale, softcap;
};

// The keys [start, end) of one row as runs within pages, f(run) for each: the element offset of the run's
// first key in the (layer, KV head) pool, the index of that key relative to start, the keys in the run, and
// where to prefetch while reading it (below).
struct Run {
  int64_t at, index, count;
  int64_t ahead, ahead_count;  // the same offset in the page kPrefetchPages(S) on, and how many keys of it
};

// Pages are scattered, so the hardware prefetcher, which follows a stream within a 4 KiB page, finds no
// pattern across them: while key i of a run is read, the kernel prefetches the key at the same offset of
// the page that is ~kPrefetchKeys positions on (bf16, d 64, pages of 16: ~2x faster with it).
constexpr int64_t kPrefetchKeys = 64;

template <typename F>
inline void ForEachRun(const Problem& p, const int32_t* table, int64_t start, int64_t end, F&& f) {
  const int64_t s = p.page_size, page_elems = s * p.dim;
  const int64_t ahead_pages = std::max<int64_t>(1, (kPrefetchKeys + s - 1) / s);
  auto page_at = [&](int64_t slot) { return std::clamp<int64_t>(table[slot], 0, p.pages - 1) * page_elems; };
  for (int64_t t = start; t < end;) {
    const int64_t slot = t / s, offset = t - slot * s, count = std::min(end - t, s - offset);
    const int64_t target = t + ahead_pages * s, ahead_count = std::min(count, end - target);
    const int64_t ahead = ahead_count > 0 ? page_at(slot + ahead_pages) + offset * p.dim : 0;
    f(Run{page_at(slot) + offset * p.dim, t - start, count, ahead, std::max<int64_t>(ahead_count, 0)});
    t += count;
  }
}

template <typename T>
inline void PrefetchRow(const T* pool, const Run& run, int64_t i, int64_t d) {
  if (i >= run.ahead_count) return;
  const char* row = reinterpret_cast<const char*>(pool + run.ahead + i * d);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

// scores[g * stride + j] = q_g . key_j * scale for the keys of one row's run of pages.
template <typename T, int G>
void Scores(const Problem& p, const int32_t* table, const T* keys, const float* q, int64_t start, int64_t end,
            int64_t stride, float* scores) {
  const int64_t d = p.dim;
  const Vec scale = Set1(p.scale);
  // Blocks of kLanes keys (which may straddle pages): row sums deferred to one transpose-sum per head.
  alignas(64) float partial[G][kLanes][kLanes];
  int pending = 0;
  int64_t base = 0;  // index of the first pending key
  auto flush = [&]() {
    for (int g = 0; g < G; ++g) {
      Vec x[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const int key = TransposeSumSource(i);
        x[i] = key < pending ? LoadAligned(partial[g][key]) : Zero();
      }
      Store(scores + g * stride + base, Mul(TransposeSum(x), scale));
    }
  };
  constexpr int kKeys = ScoreKeys(G);
  ForEachRun(p, table, start, end, [&](const Run& run) {
    const T* key = keys + run.at;
    for (int64_t i = 0; i < run.count; ++i, key += d) {
      if constexpr (kKeys > 1) {  // kKeys keys at once where they fit the run and the block
        if (i + kKeys <= run.count && pending + kKeys <= kLanes) {
          for (int k = 0; k < kKeys; ++k) PrefetchRow(keys, run, i + k, d);
          Vec acc[kKeys][G];
          for (int k = 0; k < kKeys; ++k)
            for (int g = 0; g < G; ++g) acc[k][g] = Zero();
          for (int64_t c = 0; c < d; c += kLanes) {
            Vec kv[kKeys];
            for (int k = 0; k < kKeys; ++k) kv[k] = Load(key + k * d + c);
            for (int g = 0; g < G; ++g) {
              const Vec qv = Load(q + g * d + c);
              for (int k = 0; k < kKeys; ++k) acc[k][g] = Fmadd(qv, kv[k], acc[k][g]);
            }
          }
          if (pending == 0) base = run.index + i;
          for (int k = 0; k < kKeys; ++k)
            for (int g = 0; g < G; ++g) StoreAligned(partial[g][pending + k], acc[k][g]);
          if ((pending += kKeys) == kLanes) {
            flush();
            pending = 0;
          }
          i += kKeys - 1;
          key += (kKeys - 1) * d;
          continue;
        }
      }
      PrefetchRow(keys, run, i, d);
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Zero();
      for (int64_t c = 0; c < d; c += kLanes) {
        const Vec kv = Load(key + c);
        for (int g = 0; g < G; ++g) acc[g] = Fmadd(Load(q + g * d + c), kv, acc[g]);
      }
      if (pending == 0) base = run.index + i;
      for (int g = 0; g < G; ++g) StoreAligned(partial[g][pending], acc[g]);
      if (++pending == kLanes) {
        flush();
        pending = 0;
      }
    }
  });
  if (pending > 0) flush();  // the padding past n (stride is a multiple of kLanes) takes the zero rows
}

// out[g] = sum_j weights[g * stride + j] * value_j * inverse_sum[g] for C kLanes-wide chunks of d at a time.
template <typename T, int G, int C>
void Values(const Problem& p, const int32_t* table, const T* values, const float* weights,
            const float* inverse_sum, int64_t start, int64_t end, int64_t stride, float* out) {
  const int64_t d = p.dim;
  for (int64_t c0 = 0; c0 < d; c0 += C * kLanes) {
    Vec acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = Zero();
    ForEachRun(p, table, start, end, [&](const Run& run) {
      const T* value = values + run.at + c0;
      const float* w = weights + run.index;
      for (int64_t i = 0; i < run.count; ++i, value += d) {
        if (c0 == 0) PrefetchRow(values, run, i, d);
        if constexpr (kStreamValues && G < C) {
          Vec wg[G];
          for (int g = 0; g < G; ++g) wg[g] = Set1(w[g * stride + i]);
          for (int c = 0; c < C; ++c) {
            const Vec vv = Load(value + c * kLanes);
            for (int g = 0; g < G; ++g) acc[g][c] = Fmadd(wg[g], vv, acc[g][c]);
          }
        } else {
          Vec vv[C];
          for (int c = 0; c < C; ++c) vv[c] = Load(value + c * kLanes);
          for (int g = 0; g < G; ++g) {
            const Vec wg = Set1(w[g * stride + i]);
            for (int c = 0; c < C; ++c) acc[g][c] = Fmadd(wg, vv[c], acc[g][c]);
          }
        }
      }
    });
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        Store(out + g * d + c0 + c * kLanes, Mul(acc[g][c], Set1(inverse_sum[g])));
  }
}

// The per-position scales of an int8 row's keys [start, end), gathered from their pages: scales[j] for key
// start + j (the pool's scales are laid out as its values without the d axis).
inline void GatherScales(const Problem& p, const int32_t* table, const float* pool, int64_t start, int64_t end,
                         float* scales) {
  ForEachRun(p, table, start, end, [&](const Run& run) {
    std::copy_n(pool + run.at / p.dim, run.count, scales + run.index);
  });
}

// x[g * stride + j] *= scales[j] for the G heads' first n entries.
inline void ScaleByKey(float* x, const float* scales, int groups, int64_t stride, int64_t n) {
  for (int g = 0; g < groups; ++g)
    for (int64_t j = 0; j < n; ++j) x[g * stride + j] *= scales[j];
}

// Query heads [h0, h0 + G) of one row against keys/values [start, end) of their KV head. Where `stats` is
// given, each head's softmax maximum and sum go to stats[2 g] and stats[2 g + 1] (to merge parts by).
template <typename T, int G>
void HeadGroup(const Problem& p, const int32_t* table, const T* keys, const T* values, const float* q, float* out,
               int64_t start, int64_t end, const float* k_scale, const float* v_scale, std::vector<float>& scores,
               float* stats) {
  const int64_t n = end - start, stride = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * stride);
  Scores<T, G>(p, table, keys, q, start, end, stride, scores.data());
  if (k_scale != nullptr) ScaleByKey(scores.data(), k_scale, G, stride, n);
  // Softmax numerators per head, vectorised over positions; the padding past n is masked out.
  float inverse_sum[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores.data() + g * stride;
    Vec best = Set1(-3.0e38f);
    for (int64_t j = 0; j < stride; j += kLanes) {
      Vec x = Load(s + j);
      if (p.softcap > 0) x = Softcap(x, p.softcap);
      Store(s + j, x);
      best = MaxWhere(FirstLanes(n - j), best, x);
    }
    const float most = ReduceMax(best);
    const Vec top = Set1(most);
    Vec total = Zero();
    for (int64_t j = 0; j < stride; j += kLanes) {
      const Vec e = ZeroUnless(FirstLanes(n - j), Exp(Sub(Load(s + j), top)));
      Store(s + j, e);
      total = Add(total, e);
    }
    const float sum = ReduceAdd(total);
    inverse_sum[g] = 1.0f / sum;
    if (stats != nullptr) {
      stats[2 * g] = most;
      stats[2 * g + 1] = sum;
    }
  }
  if (v_scale != nullptr) ScaleByKey(scores.data(), v_scale, G, stride, n);  // weights take V's scales
  // Values: as many kLanes-wide chunks of d per pass over the keys as fit the registers.
  const int64_t chunks = p.dim / kLanes;
  if constexpr (ValueRegisters(G, 4) <= kValueRegisters) {
    if (chunks % 4 == 0) return Values<T, G, 4>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
  }
  if constexpr (ValueRegisters(G, 2) <= kValueRegisters) {
    if (chunks % 2 == 0) return Values<T, G, 2>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
  }
  Values<T, G, 1>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
}

// Where a model has fewer KV heads than the pool has threads (Gemma 3: one), a row's attention is fewer
// items than can keep the pool busy at one row, so each (row, KV head)'s keys are cut into parts, each
// attended with its own softmax into `out` [parts, R, H, D] and `stats` [parts, R, H, 2] (maximum,
// sum), merged after. A row's parts follow from its own key count alone, never from the rows beside it:
// a token's output must not depend on how many tokens its step ran (a verification step's rows must
// equal one-row decode steps bit for bit, or greedy speculation would drift from plain decoding).
struct Split {
  int64_t by_threads;  // parts a long row takes: two items a thread over the KV heads; 1: never split
  int64_t parts;       // the most any row takes (items per (row, KV head))
  float* out;          // null: one part, written straight to the problem's out
  float* stats;
};

// Keys per part at least. Every row of that length splits, at any row count, so a part must be worth
// its fixed cost (its softmax pass, its share of the merge) in a batch too: 64 made 16 rows of Gemma 3 at
// 300 keys ~10% slower; from 256 only long rows split (Gemma 3's global layers past its 512 window).
constexpr int64_t kMinPartKeys = 256;
constexpr int64_t kMaxParts = 16;

// The keys row r attends to, [first, length): its length clamped to its table (0: an inactive row),
// from `window` keys back where the layer has a window.
struct KeyRange {
  int64_t first, length;
};
inline KeyRange VisibleKeys(const Problem& p, int64_t r) {
  const int64_t length = std::clamp<int64_t>(p.lengths[r], 0, p.table_width * p.page_size);
  return {p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0, length};
}

// The parts of a row attending to `keys` keys.
inline int64_t RowParts(const Split& split, int64_t keys) {
  return std::clamp<int64_t>(std::min(split.by_threads, keys / kMinPartKeys), 1, kMaxParts);
}

template <typename T>
void RowHead(const Problem& p, const Split& split, int64_t item) {
  const int64_t part = item % split.parts, row_head = item / split.parts;
  const int64_t r = row_head / p.kv_heads, kv = row_head % p.kv_heads, group = p.heads / p.kv_heads, d = p.dim;
  const int64_t first_head = r * p.heads + kv * group;
  const float* q = p.q + first_head * d;
  float* out = (split.out != nullptr ? split.out + part * p.rows * p.heads * d : p.out) + first_head * d;
  float* stats = split.stats != nullptr ? split.stats + (part * p.rows * p.heads + first_head) * 2 : nullptr;
  const auto [first, length] = VisibleKeys(p, r);
  // This part's keys: equal runs of whole vector blocks, the last part taking what remains.
  const int64_t visible = length - first, parts = RowParts(split, visible);
  const int64_t run = ((visible + parts - 1) / parts + kLanes - 1) / kLanes * kLanes;
  const int64_t start = first + part * run, end = part < parts ? std::min(length, start + run) : start;
  if (end <= start) {
    std::fill(out, out + group * d, 0.0f);
    if (stats != nullptr)
      for (int64_t g = 0; g < group; ++g) stats[2 * g] = 0.0f, stats[2 * g + 1] = 0.0f;  // weighs nothing
    return;
  }
  const int64_t pool = ((p.layer * p.kv_heads + kv) * p.pages) * p.page_size * d;  // this (layer, KV head)
  const T* keys = static_cast<const T*>(p.k) + pool;
  const T* values = static_cast<const T*>(p.v) + pool;
  const int32_t* table = p.page_table + r / p.queries_per_row * p.table_width;
  thread_local std::vector<float> scores, scales;
  const float *k_scale = nullptr, *v_scale = nullptr;
  if (p.k_scale != nullptr) {  // this run's scales, contiguous: [0, n) for K, [n, 2n) for V
    const int64_t n = end - start, scale_pool = pool / d;
    scales.resize(2 * n);
    GatherScales(p, table, p.k_scale + scale_pool, start, end, scales.data());
    GatherScales(p, table, p.v_scale + scale_pool, start, end, scales.data() + n);
    k_scale = scales.data();
    v_scale = scales.data() + n;
  }
  for (int64_t g = 0; g < group;) {
    const int64_t qo = g * d;
    float* head_stats = stats != nullptr ? stats + 2 * g : nullptr;
    switch (std::min<int64_t>(group - g, kHeadGroup)) {
#define JAXINFER_HEAD_GROUP(N)                                                                        \
  case N:                                                                                             \
    HeadGroup<T, N>(p, table, keys, values, q + qo, out + qo, start, end, k_scale, v_scale, scores, \
                    head_stats);                                                                      \
    g += N;                                                                                           \
    break;
      JAXINFER_HEAD_GROUP(8)
      JAXINFER_HEAD_GROUP(7)
      JAXINFER_HEAD_GROUP(6)
      JAXINFER_HEAD_GROUP(5)
      JAXINFER_HEAD_GROUP(4)
      JAXINFER_HEAD_GROUP(3)
      JAXINFER_HEAD_GROUP(2)
      default:
        JAXINFER_HEAD_GROUP(1)
#undef JAXINFER_HEAD_GROUP
    }
  }
}

// out[r, h] = the parts' outputs weighted by their share of the whole softmax: sum_i e^(m_i - m) s_i out_i
// over sum_i e^(m_i - m) s_i, m the largest part maximum (an empty part has s_i = 0).
inline void MergeParts(const Problem& p, const Split& split) {
  const int64_t d = p.dim, heads = p.rows * p.heads;
  std::vector<float> weight(split.parts);
  for (int64_t h = 0; h < heads; ++h) {
    float most = -3.0e38f;
    for (int64_t i = 0; i < split.parts; ++i) {
      const float* s = split.stats + (i * heads + h) * 2;
      if (s[1] > 0) most = std::max(most, s[0]);
    }
    float total = 0.0f;
    for (int64_t i = 0; i < split.parts; ++i) {
      const float* s = split.stats + (i * heads + h) * 2;
      weight[i] = s[1] > 0 ? std::exp(s[0] - most) * s[1] : 0.0f;
      total += weight[i];
    }
    float* out = p.out + h * d;
    std::fill(out, out + d, 0.0f);
    if (total <= 0) continue;  // an inactive row: zeros
    for (int64_t i = 0; i < split.parts; ++i) {
      const float w = weight[i] / total;
      if (w == 0.0f) continue;
      const float* part = split.out + (i * heads + h) * d;
      for (int64_t c = 0; c < d; c += kLanes) Store(out + c, Fmadd(Set1(w), Load(part + c), Load(out + c)));
    }
  }
}

template <ffi::DataType CacheType>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<CacheType> k, ffi::Buffer<CacheType> v,
                  const float* k_scale, const float* v_scale, ffi::Buffer<ffi::S32> page_table,
                  ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out, int64_t layer, int64_t window,
                  float scale, float softcap, int64_t queries_per_row) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = page_table.dimensions();
  const bool same_kv = kd.size() == vd.size() && std::equal(kd.begin(), kd.end(), vd.begin());
  if (qd.size() != 3 || kd.size() != 5 || !same_kv || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [R, H, D], k and v pages [L, KV, P, S, D] of one shape, page_table [R, W]");
  if (kd[4] != qd[2] || qd[2] % kDimMultiple != 0 || kd[1] < 1 || qd[1] % kd[1] != 0)
    return ffi::Error::InvalidArgument(
        "decode_attention: head_dim must match between q and the pages and be a multiple of 16, and the KV "
        "heads must divide the query heads");
  if (queries_per_row < 1 || td[0] * queries_per_row != qd[0] || lengths.element_count() != qd[0])
    return ffi::Error::InvalidArgument(
        "decode_attention: want page_table [R / Q, W] and lengths [R] for the R rows of q, Q = queries_per_row");
  if (kd[2] < 1 || kd[3] < 1 || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument("decode_attention: need pages P >= 1, page size S >= 1, 0 <= layer < L");
  Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(), page_table.typed_data(), lengths.typed_data(),
            k_scale, v_scale, out->typed_data(), qd[0], qd[1], kd[1], kd[2], kd[3], kd[4], td[1], layer, window,
            queries_per_row, scale, softcap};
  using T = std::conditional_t<CacheType == ffi::DataType::F32, float,
                               std::conditional_t<CacheType == ffi::DataType::S8, int8_t, uint16_t>>;
  int64_t keys = 0, longest = 0;  // keys read by all rows (~2 * heads * dim multiply-adds each), by one
  for (int64_t r = 0; r < p.rows; ++r) {
    const auto [first, length] = VisibleKeys(p, r);
    const int64_t n = length - first;
    keys += n;
    longest = std::max(longest, n);
  }
  // Split from 128K multiply-adds (one row of SmolLM2 from ~110 keys): a layer's attention at one row
  // reads its keys at one core's pace otherwise, and the pool thread left idle through it and the small
  // product after it has gone to sleep when the next large product wants it (joining ~26 us late).
  constexpr int64_t kMinWork = int64_t{1} << 17;
  const int64_t work = 2 * keys * p.heads * p.dim, row_heads = p.rows * p.kv_heads;
  const int64_t threads = pool.num_threads();
  Split split{p.kv_heads < threads ? (2 * threads + p.kv_heads - 1) / p.kv_heads : 1, 1, nullptr, nullptr};
  split.parts = RowParts(split, longest);
  std::unique_ptr<float[]> partial;  // every entry is written before the merge reads it
  if (split.parts > 1) {
    partial.reset(new float[split.parts * p.rows * p.heads * (p.dim + 2)]);
    split.out = partial.get();
    split.stats = partial.get() + split.parts * p.rows * p.heads * p.dim;
  }
  jaxinfer::ParallelFor(pool, row_heads * split.parts, work,
                        [&p, &split](int64_t item) { RowHead<T>(p, split, item); }, kMinWork);
  if (split.parts > 1) MergeParts(p, split);
  return ffi::Error::Success();
}

template <ffi::DataType CacheType>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<CacheType> k,
                           ffi::Buffer<CacheType> v, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out, int64_t layer,
                           int64_t window, float scale, float softcap, int64_t queries_per_row) {
  return Attend<CacheType>(pool, q, k, v, nullptr, nullptr, page_table, lengths, out, layer, window, scale,
                           softcap, queries_per_row);
}

ffi::Error DecodeAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                               ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths,
                               ffi::ResultBuffer<ffi::F32> out, int64_t layer, int64_t window, float scale,
                               float softcap, int64_t queries_per_row) {
  const auto kd = k.dimensions(), ks = k_scale.dimensions(), vs = v_scale.dimensions();
  const bool fits = kd.size() == 5 && ks.size() == 4 && vs.size() == 4 &&
                    std::equal(ks.begin(), ks.end(), kd.begin()) && std::equal(vs.begin(), vs.end(), kd.begin());
  if (!fits)
    return ffi::Error::InvalidArgument("decode_attention: int8 pages [L, KV, P, S, D] want scales [L, KV, P, S]");
  return Attend<ffi::DataType::S8>(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(), page_table, lengths,
                                   out, layer, window, scale, softcap, queries_per_row);
}

}  // namespace

#define JAXINFER_DECODE_ATTENTION(NAME, TYPE)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, DecodeAttention<TYPE>,                  \
                                ffi::Ffi::Bind()                              \
                                    .Ctx<ffi::ThreadPool>()                   \
                                    .Arg<ffi::Buffer<ffi::F32>>()             \
                                    .Arg<ffi::Buffer<TYPE>>()                 \
                                    .Arg<ffi::Buffer<TYPE>>()                 \
                                    .Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()             \
                                    .Ret<ffi::Buffer<ffi::F32>>()             \
                                    .Attr<int64_t>("layer")                   \
                                    .Attr<int64_t>("window")                  \
                                    .Attr<float>("scale")                     \
                                    .Attr<float>("softcap")                   \
                                    .Attr<int64_t>("queries_per_row"));

JAXINFER_DECODE_ATTENTION(JAXINFER_SYMBOL(jaxinfer_decode_attention_f32), ffi::DataType::F32)
JAXINFER_DECODE_ATTENTION(JAXINFER_SYMBOL(jaxinfer_decode_attention_bf16bits), ffi::DataType::U16)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_decode_attention_int8), DecodeAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("queries_per_row"));
