// int8 x int8 matmul for XLA:CPU (AVX-512 VNNI, or AVX2), as an XLA FFI custom call.
//
//   out[m, n] = w_scale[n] * sum_b x_scale[m, b] * sum_{k in block b} x_q[m, k] * w_q[n, k]
//
// x       f32 [M, K]        activations, quantised on entry (quantize_activations.h) to x_q in [-127, 127]
//                           with one scale x_scale per row and block of 32 inputs
// w       u8  [N/16, K/4, 16, 4]  w_q + 128, packed so one 64-byte load holds 4 consecutive k of 16 outputs
// w_scale f32 [N]           per-output-channel weight scale
// out     f32 [M, N]
//
// AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so the weights carry a +128 offset and the
// activations stay signed (the broadcast operand); the offset's contribution, 128 * sum(x_q), is
// subtracted per block.
// AVX-VNNI (AVX2 machines with VEX-encoded VNNI, Intel's since Alder Lake): the same vpdpbusd on 256 bits.
// AVX2: vpmaddubsw (u8 x s8 -> saturating s16 pair sums) then vpmaddwd with ones (-> s32). Offset
// weights would reach 255 * 127 per product and overflow the pair sums, so the weight is made signed
// again (byte ^ 0x80 = w_q, in [-127, 127]) and the signs move onto it: |x_q| * (w_q * sign(x_q)) pairs
// stay within 2 * 127 * 127 and need no compensation. One 64-byte weight vector is two 32-byte halves
// (outputs 0-7 and 8-15).
// XLA:CPU's own dots repack the weight on every call (Gemma 3's 335 MB bf16 logits weight: ~30 ms at 16
// rows); here the weight is packed once, at load time, and read once per row group from L1.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "layer_slice.h"
#include "parallel_for.h"
#include "quantize_activations.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlockN = 16;  // outputs per 64-byte weight vector

struct Problem {
  const int8_t* x;
  const float* x_scale;
  const int32_t* x_comp;
  const uint8_t* w;
  const float* w_scale;
  float* out;
  int64_t m, n, k, kb, block;
};

#if defined(__AVX512VNNI__)

// MR rows x NB blocks of 16 outputs, starting at output n0.
template <int MR, int NB>
void Tile(const Problem& p, int64_t m0, int64_t n0, bool prefetch_next) {
  __m512 total[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) total[i][j] = _mm512_setzero_ps();
  const uint8_t* w = p.w + (n0 / kBlockN) * p.k * kBlockN;
  for (int64_t b = 0; b < p.kb; ++b) {
    __m512i acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = b * p.block; k < (b + 1) * p.block; k += 4) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * p.k * kBlockN + k * kBlockN);
      if (prefetch_next)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * p.k * kBlockN + k * kBlockN), _MM_HINT_T1);
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        __builtin_memcpy(&four, p.x + (m0 + i) * p.k + k, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv[j], xv);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i comp = _mm512_set1_epi32(p.x_comp[(m0 + i) * p.kb + b]);
      const __m512 scale = _mm512_set1_ps(p.x_scale[(m0 + i) * p.kb + b]);
      for (int j = 0; j < NB; ++j)
        total[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], comp)), scale, total[i][j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 ws = _mm512_loadu_ps(p.w_scale + n0 + j * kBlockN);
    for (int i = 0; i < MR; ++i)
      _mm512_storeu_ps(p.out + (m0 + i) * p.n + n0 + j * kBlockN, _mm512_mul_ps(total[i][j], ws));
  }
}

// 4 rows x 2 blocks: 8 int32 accumulators and 2 weight vectors in registers (the float32 block totals,
// updated once per block of 32 inputs, may live in L1).
constexpr int kRows = 4;
constexpr int kBlocks = 2;
// Fewer rows than a row tile (an int4 model's logits at one row, through this kernel): four blocks keep
// more independent accumulator chains in flight while the weights stream from memory; one row, eight
// (8 accumulators, 8 weight vectors and 8 totals fit the registers; Gemma 3's 262k x 640 logits at one
// row read at 34.0 instead of 32.4 GB/s, every one of nine alternations faster).
constexpr int kBlocksFewRows = 4;
constexpr int kBlocksOneRow = 8;
// Five rows (a verification step of four drafts) in one tile: 10 accumulators, 10 totals and the
// weights fit the 32 registers, where a tile of four and one of one pass over the weights twice (the
// 49152 x 576 SmolLM2 logits at 5 rows: 1.80 -> 1.35 ms).
constexpr bool kFiveRowTile = true;
// The first row group asks for the next column group's weights, into L2 (T1): every product's one pass
// over memory then streams ahead of its multiply-adds, whatever its rows. Nine alternations on a Zen 4
// EPYC, the 49152 x 576 SmolLM2 logits: 0.92x the time at 1 row, 0.82x at 2-3, 0.66x at 5 (against the
// last group's L1 prefetch below), 0.86x at 16, 0.97x at 64. Into L1 (T0), the same hints slowed one row.
constexpr bool kFirstGroupPrefetches = true;

#else  // AVX2, with vpdpbusd where built for AVX-VNNI

// How far ahead of its loads a product of fewer rows than a row group (Rows) asks for its weights: its one
// pass streams them from memory, and nothing else prefetches them. Decode at one stream on a Zen 1 EPYC,
// where this kernel computes SmolLM2's logits and all of Gemma 3's int8 products: ~4% and ~20% faster.
constexpr int kPrefetchAhead = 1024;

// MR rows x NB blocks of 16 outputs (2 * NB halves of 8), starting at output n0.
template <int MR, int NB>
void Tile(const Problem& p, int64_t m0, int64_t n0, bool prefetch_next) {
  constexpr int H = 2 * NB;
  const bool only_pass = m0 == 0 && MR == p.m && !prefetch_next;
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  __m256 total[MR][H];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < H; ++h) total[i][h] = _mm256_setzero_ps();
  const uint8_t* w = p.w + (n0 / kBlockN) * p.k * kBlockN;
  for (int64_t b = 0; b < p.kb; ++b) {
    __m256i acc[MR][H];
    for (int i = 0; i < MR; ++i)
      for (int h = 0; h < H; ++h) acc[i][h] = _mm256_setzero_si256();
    for (int64_t k = b * p.block; k < (b + 1) * p.block; k += 4) {
      __m256i wv[H];  // w_q + 128 for vpdpbusd, else w_q (signed)
      for (int h = 0; h < H; ++h) {
        wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (h / 2) * p.k * kBlockN + k * kBlockN + (h % 2) * 32));
#if !defined(__AVXVNNI__)
        wv[h] = _mm256_xor_si256(wv[h], offset);
#endif
      }
      if (prefetch_next)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * p.k * kBlockN + k * kBlockN), _MM_HINT_T0);
      if (only_pass)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * p.k * kBlockN + k * kBlockN + kPrefetchAhead), _MM_HINT_T0);
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        __builtin_memcpy(&four, p.x + (m0 + i) * p.k + k, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#if defined(__AVXVNNI__)
        for (int h = 0; h < H; ++h) acc[i][h] = _mm256_dpbusd_avx_epi32(acc[i][h], wv[h], xv);
#else
        const __m256i magnitude = _mm256_abs_epi8(xv);
        for (int h = 0; h < H; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv[h], xv));
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(pairs, ones));
        }
#endif
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 scale = _mm256_set1_ps(p.x_scale[(m0 + i) * p.kb + b]);
#if defined(__AVXVNNI__)
      const __m256i comp = _mm256_set1_epi32(p.x_comp[(m0 + i) * p.kb + b]);
      for (int h = 0; h < H; ++h) acc[i][h] = _mm256_sub_epi32(acc[i][h], comp);
#endif
      for (int h = 0; h < H; ++h) total[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), scale, total[i][h]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 ws = _mm256_loadu_ps(p.w_scale + n0 + h * 8);
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(p.out + (m0 + i) * p.n + n0 + h * 8, _mm256_mul_ps(total[i][h], ws));
  }
}

// 4 rows x 1 block: 8 int32 accumulators, 2 weight halves, the row's broadcast, its magnitude and ones in
// the 16 ymm registers (the float32 block totals, updated once per block of 32 inputs, may live in L1).
constexpr int kRows = 4;
constexpr int kBlocks = 1;
constexpr int kBlocksFewRows = 1;
constexpr int kBlocksOneRow = 1;
constexpr bool kFiveRowTile = false;
constexpr bool kFirstGroupPrefetches = false;

#endif

// Whether the row group from m0 (the last when `last`) prefetches the next column group's weights, one
// cache line per block and step of 4 inputs. AVX-512: the first group, into L2 (kFirstGroupPrefetches).
// AVX2: the last group, into L1, so that the first row group of the next column group finds them there
// instead of waiting on memory while the compute units idle (a product whose weights stream from memory
// at several rows, such as Gemma 3's 262k x 640 logits at 16: ~15% of its time; docs/benchmarks.md);
// fewer rows than a row group prefetch ahead within their own stream instead (kPrefetchAhead).
inline bool PrefetchesNext(int64_t m0, bool last) { return kFirstGroupPrefetches ? m0 == 0 : last; }

// Every row group over NB blocks of 16 outputs from n0: their weights (K * 16 * NB bytes) stay in L1.
template <int NB>
void Rows(const Problem& p, int64_t n0) {
  if constexpr (kFiveRowTile) {
    if (p.m == 5) return Tile<5, NB>(p, 0, n0, PrefetchesNext(0, true));
  }
  int64_t m = 0;
  for (; m + kRows <= p.m; m += kRows) Tile<kRows, NB>(p, m, n0, PrefetchesNext(m, m + kRows == p.m));
  switch (p.m - m) {
    case 3: Tile<3, NB>(p, m, n0, PrefetchesNext(m, m > 0)); break;
    case 2: Tile<2, NB>(p, m, n0, PrefetchesNext(m, m > 0)); break;
    case 1: Tile<1, NB>(p, m, n0, PrefetchesNext(m, m > 0)); break;
    default: break;
  }
}

// Outputs [n_begin, n_end), in groups of kBlocks 16-output blocks: each group's weights stay in L1 while
// every row group passes over them.
void Columns(const Problem& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (p.m == 1)
    for (; n + kBlocksOneRow * kBlockN <= n_end; n += kBlocksOneRow * kBlockN) Rows<kBlocksOneRow>(p, n);
  if (p.m < kRows)
    for (; n + kBlocksFewRows * kBlockN <= n_end; n += kBlocksFewRows * kBlockN) Rows<kBlocksFewRows>(p, n);
  for (; n + kBlocks * kBlockN <= n_end; n += kBlocks * kBlockN) Rows<kBlocks>(p, n);
  for (; n < n_end; n += kBlockN) Rows<1>(p, n);
}

// w and w_scale hold one layer's weight, or every layer's stacked along a leading axis (layer_slice.h);
// `layer` picks the one to read.
ffi::Error Int8MatmulVnni(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_all,
                          ffi::AnyBuffer w_scale_all, int64_t layer, ffi::ResultBuffer<ffi::F32> out) {
  const jaxinfer::LayerSlice w = jaxinfer::SliceLayer(w_all, 4, layer);
  const jaxinfer::LayerSlice w_scale = jaxinfer::SliceLayer(w_scale_all, 1, layer);
  const auto xd = x.dimensions();
  const std::vector<int64_t>& wd = w.dims;
  if (xd.size() != 2 || !w.ok || !w_scale.ok || w_all.element_type() != ffi::DataType::U8 ||
      w_scale_all.element_type() != ffi::DataType::F32 || wd[2] != kBlockN || wd[3] != 4 ||
      w_scale.dims[0] != wd[0] * kBlockN)
    return ffi::Error::InvalidArgument(
        "int8_matmul_vnni: want x [M, K], w u8 [N/16, K/4, 16, 4], scale f32 [N] (each with a leading [layers] "
        "axis holding `layer`, or without one and layer 0)");
  const int64_t m = xd[0], k = xd[1], kb = k / jaxinfer::kActivationBlock;
  if (wd[1] * 4 != k || k % jaxinfer::kActivationBlock != 0 || kb == 0)
    return ffi::Error::InvalidArgument("int8_matmul_vnni: K must be a positive multiple of 32 and fit the weight");
  if (m == 0) return ffi::Error::Success();
  std::vector<int8_t> x_q(m * k);
  std::vector<float> x_scale(m * kb);
  std::vector<int32_t> x_comp(m * kb);
  jaxinfer::QuantizeRows(pool, x.typed_data(), m, k, x_q.data(), x_scale.data(), nullptr, x_comp.data());
  for (int32_t& c : x_comp) c *= 128;
  Problem p{x_q.data(), x_scale.data(), x_comp.data(), static_cast<const uint8_t*>(w.data),
            static_cast<const float*>(w_scale.data),
            out->typed_data(), m, wd[0] * kBlockN, k, kb, jaxinfer::kActivationBlock};

  constexpr int64_t kGroup = kBlocks * kBlockN;
  const int64_t groups = (p.n + kGroup - 1) / kGroup;
  const int64_t per_chunk = std::max<int64_t>(1, groups / (8 * std::max<int64_t>(1, pool.num_threads())));
  const int64_t chunks = (groups + per_chunk - 1) / per_chunk;
  // Split from 512K multiply-adds, even at one row, as the int4 kernel: a matrix-vector product is bound
  // by memory, which one core does not saturate.
  jaxinfer::ParallelFor(pool, chunks, p.m * p.n * p.k, [&p, per_chunk](int64_t c) {
    const int64_t begin = c * per_chunk * kGroup;
    Columns(p, begin, std::min(p.n, begin + per_chunk * kGroup));
  }, int64_t{1} << 19);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_int8_matmul_vnni), Int8MatmulVnni,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());
