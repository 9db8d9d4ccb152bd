// Decode attention straight out of the KV cache for XLA:CPU (AVX-512F), as an XLA FFI custom call.
//
// q       f32 [B, H, D]          the new query of the first B cache slots (row b is slot b)
// k, v    [layers, B, KV, S, D]  the whole cache: float32, or bfloat16 held as uint16 bit patterns
// lengths s32 [B]                keys per row including the new one; 0 for an inactive slot (zeros out)
// attributes: layer, window (0: none; else keys in [length - window, length)), scale, softcap (0: none)
// out     f32 [B, H, D]
//
// XLA's form of this (kernel_dispatch.attention_xla) copies each layer's slice of the cache out of the
// buffer being updated in place, widens it, and runs small batched dots through YNNPACK: at 16 slots
// ~40% of a SmolLM2 decode step. Here each (slot, KV head) reads its own keys and values once, for
// all the query heads that share them, and only up to the slot's length.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kHeadGroup = 8;  // query heads per pass over the keys (accumulators in registers)

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

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* lengths;
  float* out;
  int64_t rows, slots, heads, kv_heads, positions, dim, layer, window;
  float scale, softcap;
};

// Query heads [h0, h0 + G) of one slot against keys/values [start, end) of their KV head.
template <typename T, int G>
void HeadGroup(const Problem& p, const T* keys, const T* values, const float* q, float* out, int64_t start,
               int64_t end, std::vector<float>& scores) {
  const int64_t n = end - start, stride = (n + kLanes - 1) / kLanes * kLanes, d = p.dim;
  scores.assign(G * stride, 0.0f);
  // Scores: each key row is read and widened once for the G heads.
  for (int64_t j = 0; j < n; ++j) {
    const T* key = keys + (start + j) * d;
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m512 kv = Load16(key + c);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + c), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * stride + j] = _mm512_reduce_add_ps(acc[g]) * p.scale;
  }
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
  // Values: 16 dimensions at a time, G accumulators, each value row chunk widened once.
  for (int64_t c = 0; c < d; c += kLanes) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 vv = Load16(values + (start + j) * d + c);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + j]), vv, acc[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + g * d + c, _mm512_mul_ps(acc[g], _mm512_set1_ps(inverse_sum[g])));
  }
}

template <typename T>
void SlotHead(const Problem& p, int64_t item) {
  const int64_t b = item / p.kv_heads, kv = item % p.kv_heads, group = p.heads / p.kv_heads, d = p.dim;
  const float* q = p.q + (b * p.heads + kv * group) * d;
  float* out = p.out + (b * p.heads + kv * group) * d;
  const int64_t end = std::min<int64_t>(p.lengths[b], p.positions);
  if (end <= 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, end - p.window) : 0;
  const int64_t offset = ((p.layer * p.slots + b) * p.kv_heads + kv) * p.positions * d;
  const T* keys = static_cast<const T*>(p.k) + offset;
  const T* values = static_cast<const T*>(p.v) + offset;
  thread_local std::vector<float> scores;
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    const int64_t qo = g * d;
    switch (std::min<int64_t>(left, kHeadGroup)) {
      case 8: HeadGroup<T, 8>(p, keys, values, q + qo, out + qo, start, end, scores); g += 8; break;
      case 7: HeadGroup<T, 7>(p, keys, values, q + qo, out + qo, start, end, scores); g += 7; break;
      case 6: HeadGroup<T, 6>(p, keys, values, q + qo, out + qo, start, end, scores); g += 6; break;
      case 5: HeadGroup<T, 5>(p, keys, values, q + qo, out + qo, start, end, scores); g += 5; break;
      case 4: HeadGroup<T, 4>(p, keys, values, q + qo, out + qo, start, end, scores); g += 4; break;
      case 3: HeadGroup<T, 3>(p, keys, values, q + qo, out + qo, start, end, scores); g += 3; break;
      case 2: HeadGroup<T, 2>(p, keys, values, q + qo, out + qo, start, end, scores); g += 2; break;
      default: HeadGroup<T, 1>(p, keys, values, q + qo, out + qo, start, end, scores); g += 1; break;
    }
  }
}

template <ffi::DataType CacheType>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<CacheType> k,
                           ffi::Buffer<CacheType> v, ffi::Buffer<ffi::S32> lengths,
                           ffi::ResultBuffer<ffi::F32> out, int64_t layer, int64_t window, float scale,
                           float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || qd[0] > kd[1] || kd[4] != qd[2] || qd[1] % kd[2] != 0 ||
      qd[2] % kLanes != 0 || lengths.element_count() != qd[0] || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [B, H, D], k/v [layers, >= B, KV, S, D] with KV | H, D % 16 == 0, lengths [B]");
  Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(), lengths.typed_data(), out->typed_data(),
            qd[0], kd[1], qd[1], kd[2], kd[3], kd[4], layer, window, scale, softcap};
  using T = std::conditional_t<CacheType == ffi::DataType::F32, float, uint16_t>;
  int64_t keys = 0;  // keys read by all rows: the work is ~2 * heads * dim multiply-adds per key
  for (int64_t b = 0; b < p.rows; ++b) keys += std::clamp<int64_t>(p.lengths[b], 0, p.positions);
  jaxinfer::ParallelFor(pool, p.rows * p.kv_heads, 2 * keys * p.heads * p.dim,
                        [&p](int64_t item) { SlotHead<T>(p, item); });
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
                                    .Ret<ffi::Buffer<ffi::F32>>()             \
                                    .Attr<int64_t>("layer")                   \
                                    .Attr<int64_t>("window")                  \
                                    .Attr<float>("scale")                     \
                                    .Attr<float>("softcap"));

JAXINFER_DECODE_ATTENTION(jaxinfer_decode_attention_f32, ffi::DataType::F32)
JAXINFER_DECODE_ATTENTION(jaxinfer_decode_attention_bf16bits, ffi::DataType::U16)
