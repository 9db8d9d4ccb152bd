// Decode attention straight out of the paged KV cache for XLA:CPU (AVX-512F), as an XLA FFI custom call.
//
// q          f32 [R, H, D]        the new query of each of R rows
// k, v       [L, KV, P, S, D]     the page pool of every layer: float32, or bfloat16 held as uint16 bits;
//                                 the S * D values of one (layer, KV head, page) are contiguous
// page_table s32 [R, W]           key position t of row r lives at page page_table[r, t / S], offset t % S
// lengths    s32 [R]              keys per row including the new one (the query sits at length - 1); 0 for
//                                 an inactive row (zeros out). Clamped to W * S.
// attributes: layer, window (0: none; else keys in [length - window, length)), scale, softcap (0: none)
// out        f32 [R, H, D]
//
// Only the pages a row's visible keys sit on are read, and of them only those keys: table entries past a
// row's length (the null page, or stale ids) and page slots past its last key are never touched. Page ids
// are clamped to [0, P) so a corrupt table cannot read outside the pool.
//
// Each (row, KV head) reads its keys and values once for all the query heads that share them, where XLA's
// form (gather the pages, widen, small batched dots) copies every layer's pages out of the pool first.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kHeadGroup = 8;      // query heads per pass over the keys (accumulators in registers)
constexpr int kValueRegisters = 24;  // most accumulators of the value pass: heads x 16-wide chunks of d

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {  // bfloat16 bits -> float32: the high half of each word
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) within ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial
// (its remainder r^7 / 7! < 1.2e-7 relative). Below -87 the result is ~1e-38, not 0; above 88, inf.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// softcap * tanh(s / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1): -1 and 1 exactly at the far ends.
inline __m512 Softcap(__m512 s, float softcap) {
  const __m512 e = Exp(_mm512_mul_ps(s, _mm512_set1_ps(2.0f / softcap)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(tanh, _mm512_set1_ps(softcap));
}

// The sums of 16 vectors in one: 15 shuffle-add steps where 16 horizontal reductions take ~60. Lane
// 4k + m of the result is the sum of x[4m + k] (a 4 x 4 transpose of the order; callers permute x).
inline __m512 TransposeSum16(__m512 x[16]) {
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

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* page_table;
  const int32_t* lengths;
  float* out;
  int64_t rows, heads, kv_heads, pages, page_size, dim, table_width, layer, window;
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
  const __m512 scale = _mm512_set1_ps(p.scale);
  // Blocks of 16 keys (which may straddle pages): row sums deferred to one transpose-sum per head.
  alignas(64) float partial[G][kLanes][kLanes];
  int pending = 0;
  int64_t base = 0;  // index of the first pending key
  auto flush = [&]() {
    for (int g = 0; g < G; ++g) {
      __m512 x[kLanes];
      for (int i = 0; i < kLanes; ++i) {  // x[4m + k] holds key 4k + m (see TransposeSum16)
        const int key = i % 4 * 4 + i / 4;
        x[i] = key < pending ? _mm512_load_ps(partial[g][key]) : _mm512_setzero_ps();
      }
      _mm512_storeu_ps(scores + g * stride + base, _mm512_mul_ps(TransposeSum16(x), scale));
    }
  };
  ForEachRun(p, table, start, end, [&](const Run& run) {
    const T* key = keys + run.at;
    for (int64_t i = 0; i < run.count; ++i, key += d) {
      PrefetchRow(keys, run, i, d);
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += kLanes) {
        const __m512 kv = Load16(key + c);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + c), kv, acc[g]);
      }
      if (pending == 0) base = run.index + i;
      for (int g = 0; g < G; ++g) _mm512_store_ps(partial[g][pending], acc[g]);
      if (++pending == kLanes) {
        flush();
        pending = 0;
      }
    }
  });
  if (pending > 0) flush();  // the padding past n (stride is a multiple of 16) takes the zero rows
}

// out[g] = sum_j weights[g * stride + j] * value_j * inverse_sum[g] for C 16-wide chunks of d at a time.
template <typename T, int G, int C>
void Values(const Problem& p, const int32_t* table, const T* values, const float* weights,
            const float* inverse_sum, int64_t start, int64_t end, int64_t stride, float* out) {
  const int64_t d = p.dim;
  for (int64_t c0 = 0; c0 < d; c0 += C * kLanes) {
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    ForEachRun(p, table, start, end, [&](const Run& run) {
      const T* value = values + run.at + c0;
      const float* w = weights + run.index;
      for (int64_t i = 0; i < run.count; ++i, value += d) {
        if (c0 == 0) PrefetchRow(values, run, i, d);
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = Load16(value + c * kLanes);
        for (int g = 0; g < G; ++g) {
          const __m512 wg = _mm512_set1_ps(w[g * stride + i]);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(wg, vv[c], acc[g][c]);
        }
      }
    });
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(out + g * d + c0 + c * kLanes, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inverse_sum[g])));
  }
}

// Query heads [h0, h0 + G) of one row against keys/values [start, end) of their KV head.
template <typename T, int G>
void HeadGroup(const Problem& p, const int32_t* table, const T* keys, const T* values, const float* q, float* out,
               int64_t start, int64_t end, std::vector<float>& scores) {
  const int64_t n = end - start, stride = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * stride);
  Scores<T, G>(p, table, keys, q, start, end, stride, scores.data());
  // Softmax numerators per head, vectorised over positions; the padding past n is masked out.
  float inverse_sum[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores.data() + g * stride;
    __m512 best = _mm512_set1_ps(-3.0e38f);
    for (int64_t j = 0; j < stride; j += kLanes) {
      const __mmask16 valid = j + kLanes <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      __m512 x = _mm512_loadu_ps(s + j);
      if (p.softcap > 0) x = Softcap(x, p.softcap);
      _mm512_storeu_ps(s + j, x);
      best = _mm512_mask_max_ps(best, valid, best, x);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < stride; j += kLanes) {
      const __mmask16 valid = j + kLanes <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, Exp(_mm512_sub_ps(_mm512_loadu_ps(s + j), top)));
      _mm512_storeu_ps(s + j, e);
      total = _mm512_add_ps(total, e);
    }
    inverse_sum[g] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // Values: as many 16-wide chunks of d per pass over the keys as fit the accumulator registers.
  const int64_t chunks = p.dim / kLanes;
  if constexpr (G * 4 <= kValueRegisters) {
    if (chunks % 4 == 0) return Values<T, G, 4>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
  }
  if (chunks % 2 == 0) return Values<T, G, 2>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
  Values<T, G, 1>(p, table, values, scores.data(), inverse_sum, start, end, stride, out);
}

template <typename T>
void RowHead(const Problem& p, int64_t item) {
  const int64_t r = item / p.kv_heads, kv = item % p.kv_heads, group = p.heads / p.kv_heads, d = p.dim;
  const float* q = p.q + (r * p.heads + kv * group) * d;
  float* out = p.out + (r * p.heads + kv * group) * d;
  const int64_t end = std::min<int64_t>(p.lengths[r], p.table_width * p.page_size);
  if (end <= 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, end - p.window) : 0;
  const int64_t pool = ((p.layer * p.kv_heads + kv) * p.pages) * p.page_size * d;  // this (layer, KV head)
  const T* keys = static_cast<const T*>(p.k) + pool;
  const T* values = static_cast<const T*>(p.v) + pool;
  const int32_t* table = p.page_table + r * p.table_width;
  thread_local std::vector<float> scores;
  for (int64_t g = 0; g < group;) {
    const int64_t qo = g * d;
    switch (std::min<int64_t>(group - g, kHeadGroup)) {
#define JAXINFER_HEAD_GROUP(N)                                                                  \
  case N:                                                                                       \
    HeadGroup<T, N>(p, table, keys, values, q + qo, out + qo, start, end, scores); \
    g += N;                                                                                     \
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

template <ffi::DataType CacheType>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<CacheType> k,
                           ffi::Buffer<CacheType> v, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out, int64_t layer,
                           int64_t window, float scale, float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = page_table.dimensions();
  const bool same_kv = kd.size() == vd.size() && std::equal(kd.begin(), kd.end(), vd.begin());
  if (qd.size() != 3 || kd.size() != 5 || !same_kv || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [R, H, D], k and v pages [L, KV, P, S, D] of one shape, page_table [R, W]");
  if (kd[4] != qd[2] || qd[2] % kLanes != 0 || kd[1] < 1 || qd[1] % kd[1] != 0)
    return ffi::Error::InvalidArgument(
        "decode_attention: head_dim must match between q and the pages and be a multiple of 16, and the KV "
        "heads must divide the query heads");
  if (td[0] != qd[0] || lengths.element_count() != qd[0])
    return ffi::Error::InvalidArgument("decode_attention: page_table [R, W] and lengths [R] need R = q rows");
  if (kd[2] < 1 || kd[3] < 1 || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument("decode_attention: need pages P >= 1, page size S >= 1, 0 <= layer < L");
  Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(), page_table.typed_data(), lengths.typed_data(),
            out->typed_data(), qd[0], qd[1], kd[1], kd[2], kd[3], kd[4], td[1], layer, window, scale, softcap};
  using T = std::conditional_t<CacheType == ffi::DataType::F32, float, uint16_t>;
  int64_t keys = 0;  // keys read by all rows: the work is ~2 * heads * dim multiply-adds per key
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t end = std::clamp<int64_t>(p.lengths[r], 0, p.table_width * p.page_size);
    keys += p.window > 0 ? std::min(end, p.window) : end;
  }
  jaxinfer::ParallelFor(pool, p.rows * p.kv_heads, 2 * keys * p.heads * p.dim,
                        [&p](int64_t item) { RowHead<T>(p, item); });
  return ffi::Error::Success();
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
                                    .Attr<float>("softcap"));

JAXINFER_DECODE_ATTENTION(jaxinfer_decode_attention_f32, ffi::DataType::F32)
JAXINFER_DECODE_ATTENTION(jaxinfer_decode_attention_bf16bits, ffi::DataType::U16)
