// int4 (or int5) weights x int8-quantised activations for XLA:CPU (AVX-512 VNNI or AVX2), as XLA FFI custom
// calls: jaxinfer_int4_matmul and jaxinfer_int5_matmul, the same kernel with a fifth bit per weight.
//
//   out[m, n] = sum_b xs[m, b] * scale[n, g(b)] * sum_{k in b} xq[m, k] * q[n, k]
//             + sum_g minimum[n, g] * sum_{k in g} x[m, k]
//
// x       f32 [M, K]               activations; quantised on entry per row and block of 32 (symmetric
//                                  int8, quantize_activations.h), their exact float sums kept per group
// w       u8  [N/16, K/8, 16, 4]   4-bit q in [0, 15]: byte j of output lane o in chunk c holds
//                                  q[o, 8c + j] (low nibble) and q[o, 8c + 4 + j] (high nibble)
// scale   f32 or f16 [N/16, G, 16] per output and group of K/G inputs (32 or 128)
// minimum [N/16, G, 16]            of the scale's type: float16 where every value is one exactly (GGUF's
//                                  Q4_0 / Q4_1 blocks), a sixth fewer bytes to read than float32
// high    u8  [N/16, K/8, 16]      int5 only: the fifth bits. Bytes 0-7 of a chunk are a little-endian
//                                  64-bit mask over the 64 bytes of w's chunk, bit 4o + j the fifth bit of
//                                  the value in its low nibble (q[o, 8c + j]); bytes 8-15 the same for
//                                  the high nibbles (q[o, 8c + 4 + j]). q in [0, 31].
// out     f32 [M, N]
//
// q is unsigned and x signed, the operand types of vpdpbusd (AVX-512 VNNI, and AVX-VNNI on 256 bits). AVX2 alone
// has no such instruction:
// vpmaddubsw (u8 x s8 -> s16 pair sums, at most 2 * 15 * 127) accumulates a whole block of 32 inputs in
// 16 bits (8 products of at most 3810 stay below 32767), then one vpmaddwd widens it to 32 bits; with five
// bits a pair reaches 2 * 31 * 127 = 7874, so int5 widens after every two chunks (4 pairs).
// One 64-byte load holds 8 inputs of 16 outputs; the nibbles split with a shift and a mask.
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

constexpr int kBlockN = 16;  // outputs per packed vector group
constexpr int kBlockK = jaxinfer::kActivationBlock;  // inputs per activation scale
constexpr int kChunkK = 8;   // inputs per 64 packed bytes

struct Problem {
  const int8_t* xq;    // [M, K]
  const float* xs;     // [M, K/32]
  const float* xsum;   // [M, G]: float sums of x over each weight group
  const uint8_t* w;
  const uint8_t* high;  // int5's fifth bits, nullptr for int4
  const void* scale;  // float or float16 bits (half)
  const void* minimum;
  bool half;
  float* out;
  int64_t m, n, k, groups, blocks_per_group;
};

#if defined(__AVX512VNNI__)

// The 16 lanes of a scale or minimum array at element `at`, widened from float16 where they are half.
inline __m512 LoadLanes(const void* base, bool half, int64_t at) {
  const uint16_t* bits = static_cast<const uint16_t*>(base) + at;
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}

// A 64-bit mask from 8 bytes of the fifth-bit plane.
inline __mmask64 LoadMask(const uint8_t* at) {
  uint64_t bits;
  __builtin_memcpy(&bits, at, 8);
  return _cvtu64_mask64(bits);
}

// Chunk c of output block nb as two vectors of 4 inputs x 16 outputs: its low nibbles and its high ones,
// each with its fifth bits for int5. `ahead` > 0: ask for the weights that many bytes on, into L2.
template <bool kFive>
inline void UnpackChunk(const Problem& p, int64_t nb, int64_t c, int64_t ahead, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(16);
  const int64_t at = nb * (p.k / kChunkK) + c;
  const uint8_t* w = p.w + at * 64;
  if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T1);
  const __m512i v = _mm512_loadu_si512(w);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (kFive) {
    const uint8_t* bits = p.high + at * 16;
    lo = _mm512_mask_add_epi8(lo, LoadMask(bits), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, LoadMask(bits + 8), hi, sixteen);
  }
}

// MR rows x NB blocks of 16 outputs starting at block nb0. The first row group asks for the next NB
// blocks' weights (the next tile's) into L2 as it loads its own, so that every product's one pass over
// memory streams ahead of its multiply-adds: SmolLM2's 120 layer products chained, alternated 15 times
// on a Zen 4 EPYC, took 0.87x the time at 1 row, 0.83x at 2-3, 0.94x at 5, 0.88x at 16. Into L1 (T0), or
// 1 KB ahead within a block's own stream, the hints slowed one row down. With kUnpacked the blocks come
// already unpacked (`unpacked`: UnpackBlocks' vectors).
template <int MR, int NB, bool kFive, bool kUnpacked = false>
void Tile(const Problem& p, int64_t m0, int64_t nb0, const __m512i* unpacked = nullptr) {
  __m512 total[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) total[i][j] = _mm512_setzero_ps();
  const int64_t chunks = p.k / kChunkK;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 scale[NB];
    for (int j = 0; j < NB; ++j) scale[j] = LoadLanes(p.scale, p.half, ((nb0 + j) * p.groups + g) * kBlockN);
    for (int64_t b = g * p.blocks_per_group; b < (g + 1) * p.blocks_per_group; ++b) {
      __m512i acc[MR][NB];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
      for (int64_t c = b * (kBlockK / kChunkK); c < (b + 1) * (kBlockK / kChunkK); ++c) {
        __m512i lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          if constexpr (kUnpacked) {
            lo[j] = _mm512_loadu_si512(unpacked + 2 * (j * chunks + c));
            hi[j] = _mm512_loadu_si512(unpacked + 2 * (j * chunks + c) + 1);
          } else {
            UnpackChunk<kFive>(p, nb0 + j, c, m0 == 0 ? NB * chunks * 64 : 0, lo[j], hi[j]);
          }
        }
        for (int i = 0; i < MR; ++i) {
          int32_t four[2];
          __builtin_memcpy(four, p.xq + (m0 + i) * p.k + c * kChunkK, 8);
          const __m512i x_lo = _mm512_set1_epi32(four[0]), x_hi = _mm512_set1_epi32(four[1]);
          for (int j = 0; j < NB; ++j) {
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lo[j], x_lo);
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], hi[j], x_hi);
          }
        }
      }
      for (int i = 0; i < MR; ++i) {
        const __m512 xs = _mm512_set1_ps(p.xs[(m0 + i) * (p.k / kBlockK) + b]);
        for (int j = 0; j < NB; ++j)
          total[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), xs), scale[j], total[i][j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 minimum = LoadLanes(p.minimum, p.half, ((nb0 + j) * p.groups + g) * kBlockN);
      for (int i = 0; i < MR; ++i)
        total[i][j] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(p.xsum[(m0 + i) * p.groups + g]), total[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(p.out + (m0 + i) * p.n + (nb0 + j) * kBlockN, total[i][j]);
}

constexpr int kRows = 4;
constexpr int kBlocks = 2;
// From this many rows, Rows unpacks an int5 tile's blocks once for all its row groups: each group would
// otherwise add every fifth bit again (a mask load and a masked add per vector). Gemma 3's int5 shapes
// (1536 x 640, 4096 x 640, 640 x 2048), alternated nine times on a Zen 4 EPYC against the tile unpacking
// them itself: 0.91x the time at 32 rows, 0.90x at 64, 0.87x at 128, 0.80x at 512; at 16, the same. The
// int4 tile's unpacking (a shift and two ands) measured no gain from it, even at 512 rows.
constexpr int64_t kUnpackOnceFromRows = 32;

// Blocks [nb0, nb0 + NB) as the tile's weight vectors, chunk by chunk: for block j and chunk c, the low
// nibbles (with their fifth bits) at 2 (j * chunks + c), the high ones next. The pass streams the weights
// from memory and asks for the next NB blocks into L2, as the tile's first row group does.
template <int NB, bool kFive>
void UnpackBlocks(const Problem& p, int64_t nb0, __m512i* unpacked) {
  const int64_t chunks = p.k / kChunkK;
  for (int j = 0; j < NB; ++j)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i lo, hi;
      UnpackChunk<kFive>(p, nb0 + j, c, NB * chunks * 64, lo, hi);
      _mm512_storeu_si512(unpacked + 2 * (j * chunks + c), lo);
      _mm512_storeu_si512(unpacked + 2 * (j * chunks + c) + 1, hi);
    }
}

// Every row in groups of kRows, then one group of the rest, over blocks [nb0, nb0 + NB).
template <int NB, bool kFive, bool kUnpacked>
void RowGroups(const Problem& p, int64_t nb0, const __m512i* unpacked = nullptr) {
  int64_t m = 0;
  for (; m + kRows <= p.m; m += kRows) Tile<kRows, NB, kFive, kUnpacked>(p, m, nb0, unpacked);
  switch (p.m - m) {
    case 3: Tile<3, NB, kFive, kUnpacked>(p, m, nb0, unpacked); break;
    case 2: Tile<2, NB, kFive, kUnpacked>(p, m, nb0, unpacked); break;
    case 1: Tile<1, NB, kFive, kUnpacked>(p, m, nb0, unpacked); break;
  }
}
// Up to five rows (decode of a few streams, a verification step of up to four drafts) run as one tile:
// the weights are unpacked once for all the rows. One row spans four output blocks, so that more
// independent accumulator chains stay in flight while the weights stream from memory; more rows span
// two, whose accumulators, totals and weights fit the 32 registers (four blocks left the totals on the
// stack: SmolLM2's 120 layer products, 11 alternations on a Zen 4 EPYC, took 0.94x the time over two
// blocks at 2 rows, 0.91x at 3, 0.87x at 4, 0.86x at 5; over one block, 0.92x at 5).
constexpr int kMaxOneTileRows = 5;
template <int MR>
constexpr int kBlocksOneTile = MR == 1 ? 4 : 2;

#else  // AVX2, with vpdpbusd where built for AVX-VNNI

// 8 lanes of a scale or minimum array at element `at`, widened from float16 (F16C) where they are half.
inline __m256 LoadLanes(const void* base, bool half, int64_t at) {
  const uint16_t* bits = static_cast<const uint16_t*>(base) + at;
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
  return _mm256_loadu_ps(static_cast<const float*>(base) + at);
}

// 16 added to each of 32 bytes whose bit is set in 32-bit word W of `high` (a chunk's 16 bytes of fifth
// bits in both 128-bit lanes; bit k of the word for byte k). One byte shuffle spreads the word's bytes
// over the lanes' bytes, whatever W: no broadcast of a general register per vector.
template <int W>
inline __m256i FifthBits(__m256i high) {
  const __m256i byte_of_bit = _mm256_add_epi8(
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
      _mm256_set1_epi8(4 * W));  // constants: folded at compile time
  const __m256i bit_of_byte = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i spread = _mm256_shuffle_epi8(high, byte_of_bit);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_of_byte), bit_of_byte);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// How far ahead of its loads the first pass over a block's weights asks for them. That pass streams the
// weights from memory, and without the hint a core waits on each line: SmolLM2's decode at one stream ran
// ~5% faster on a Zen 1 EPYC with it (1 KB ahead; 256 B gained little), and 16 streams, which reuse each
// line across row groups, the same.
constexpr int kPrefetchAhead = 1024;

// Chunk c of output block nb0 as four vectors of 32 weights in [0, 15] (or [0, 31]): the low nibbles of
// lanes 0-7, their high nibbles, then the same for lanes 8-15. `ahead`: a pass that streams the weights
// from memory, which asks for the line kPrefetchAhead bytes on.
template <bool kFive>
inline void UnpackChunk(const Problem& p, int64_t nb0, int64_t c, bool ahead, __m256i v[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t chunks = p.k / kChunkK;
  const uint8_t* w = p.w + (nb0 * chunks + c) * 64;
  if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead), _MM_HINT_T0);
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  v[0] = _mm256_and_si256(v0, low);
  v[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
  v[2] = _mm256_and_si256(v1, low);
  v[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
  if constexpr (kFive) {
    // Words: low nibbles of lanes 0-7, of lanes 8-15; high nibbles the same.
    const __m256i high = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.high + (nb0 * chunks + c) * 16)));
    v[0] = _mm256_or_si256(v[0], FifthBits<0>(high));
    v[2] = _mm256_or_si256(v[2], FifthBits<1>(high));
    v[1] = _mm256_or_si256(v[1], FifthBits<2>(high));
    v[3] = _mm256_or_si256(v[3], FifthBits<3>(high));
  }
}

// One 16-output block is two 8-lane halves; MR rows x 2 halves. With kUnpacked the block's weights come
// already unpacked (`unpacked`: UnpackChunk's four vectors for each chunk in order), else from p.w.
template <int MR, int NB, bool kFive, bool kUnpacked = false>
void Tile(const Problem& p, int64_t m0, int64_t nb0, const __m256i* unpacked = nullptr) {
  static_assert(NB == 1, "the AVX2 tile covers one block of 16 outputs");
#if defined(__AVXVNNI__)
  // vpdpbusd adds four byte products straight into 32 bits: nothing to widen.
  constexpr int kChunksPerWiden = kBlockK / kChunkK;
#else
  // Chunks whose pair sums one 16-bit lane holds: 8 pairs of 4-bit products, 4 of 5-bit ones.
  constexpr int kChunksPerWiden = kFive ? 2 : kBlockK / kChunkK;
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 total[MR][2];
  for (int i = 0; i < MR; ++i) total[i][0] = total[i][1] = _mm256_setzero_ps();
  const bool first_pass = m0 == 0;  // later row groups find this block's weights in L1
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t at = (nb0 * p.groups + g) * kBlockN;
    const __m256 scale_lo = LoadLanes(p.scale, p.half, at), scale_hi = LoadLanes(p.scale, p.half, at + 8);
    for (int64_t b = g * p.blocks_per_group; b < (g + 1) * p.blocks_per_group; ++b) {
      __m256i sum[MR][2];
      for (int i = 0; i < MR; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
      for (int64_t c0 = b * (kBlockK / kChunkK); c0 < (b + 1) * (kBlockK / kChunkK); c0 += kChunksPerWiden) {
#if !defined(__AVXVNNI__)
        __m256i acc[MR][2];
        for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#endif
        for (int64_t c = c0; c < c0 + kChunksPerWiden; ++c) {
          __m256i v[4];  // low nibbles of lanes 0-7, high nibbles; the same for lanes 8-15
          if constexpr (kUnpacked) {
            for (int j = 0; j < 4; ++j) v[j] = _mm256_load_si256(unpacked + 4 * c + j);
          } else {
            UnpackChunk<kFive>(p, nb0, c, first_pass, v);
          }
          for (int i = 0; i < MR; ++i) {
            int32_t four[2];
            __builtin_memcpy(four, p.xq + (m0 + i) * p.k + c * kChunkK, 8);
            const __m256i x_lo = _mm256_set1_epi32(four[0]), x_hi = _mm256_set1_epi32(four[1]);
#if defined(__AVXVNNI__)
            sum[i][0] = _mm256_dpbusd_avx_epi32(sum[i][0], v[0], x_lo);
            sum[i][0] = _mm256_dpbusd_avx_epi32(sum[i][0], v[1], x_hi);
            sum[i][1] = _mm256_dpbusd_avx_epi32(sum[i][1], v[2], x_lo);
            sum[i][1] = _mm256_dpbusd_avx_epi32(sum[i][1], v[3], x_hi);
#else
            acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(v[0], x_lo));
            acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(v[1], x_hi));
            acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(v[2], x_lo));
            acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(v[3], x_hi));
#endif
          }
        }
#if !defined(__AVXVNNI__)
        for (int i = 0; i < MR; ++i)
          for (int h = 0; h < 2; ++h) sum[i][h] = _mm256_add_epi32(sum[i][h], _mm256_madd_epi16(acc[i][h], ones));
#endif
      }
      for (int i = 0; i < MR; ++i) {
        const __m256 xs = _mm256_set1_ps(p.xs[(m0 + i) * (p.k / kBlockK) + b]);
        const __m256 d0 = _mm256_cvtepi32_ps(sum[i][0]);
        const __m256 d1 = _mm256_cvtepi32_ps(sum[i][1]);
        total[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), scale_lo, total[i][0]);
        total[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), scale_hi, total[i][1]);
      }
    }
    const __m256 min_lo = LoadLanes(p.minimum, p.half, at), min_hi = LoadLanes(p.minimum, p.half, at + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 xsum = _mm256_set1_ps(p.xsum[(m0 + i) * p.groups + g]);
      total[i][0] = _mm256_fmadd_ps(min_lo, xsum, total[i][0]);
      total[i][1] = _mm256_fmadd_ps(min_hi, xsum, total[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(p.out + (m0 + i) * p.n + nb0 * kBlockN, total[i][0]);
    _mm256_storeu_ps(p.out + (m0 + i) * p.n + nb0 * kBlockN + 8, total[i][1]);
  }
}

constexpr int kRows = 2;  // rows per group over a block unpacked once
constexpr int kStreamRows = 4;  // rows per group that unpacks the block itself
constexpr int kBlocks = 1;
constexpr int kMaxOneTileRows = 2;
template <int MR>
constexpr int kBlocksOneTile = 1;
constexpr int64_t kUnpackOnceFromRows = 32;  // Rows unpacks each block once from this many rows

#endif

// Products from this many multiply-adds split over the pool, even at one row: a matrix-vector product is
// bound by memory, which one core does not saturate, while waking the pool for a smaller one costs more
// than it saves. AVX2's multiply-adds take longer, so a smaller product already pays for the wake-up
// (SmolLM2's 576 x 576 projection at one stream: decode ~3% faster on a Zen 1 EPYC splitting from 128K).
// With AVX-512 VNNI, 512K measured best (decode at one stream on a Zen 4 EPYC, SmolLM2 / Gemma 3: 164 / 96
// tok/s splitting from 128K, 176 / 100 from 512K, 149 / 93 from 1M).
#if defined(__AVX512VNNI__)
constexpr int64_t kMinSplitWork = int64_t{1} << 19;
#else
constexpr int64_t kMinSplitWork = int64_t{1} << 17;
#endif

// Every row group over NB output blocks from nb0: the blocks' weights stay in L1/L2 across row groups.
template <int NB, bool kFive>
void Rows(const Problem& p, int64_t nb0) {
#if defined(__AVX512VNNI__)
  if (kFive && p.m >= kUnpackOnceFromRows) {
    thread_local std::vector<__m512i> unpacked;
    unpacked.resize(2 * NB * (p.k / kChunkK));
    UnpackBlocks<NB, kFive>(p, nb0, unpacked.data());
    return RowGroups<NB, kFive, true>(p, nb0, unpacked.data());
  }
  RowGroups<NB, kFive, false>(p, nb0);
#else
  int64_t m = 0;
  // Fewer rows stream the block in groups of four, the inner loop's accumulators, weights and activations
  // all in registers. Each group unpacks every chunk again, so a count that would leave a lone row starts
  // with three and two instead (a step verifying two or four drafts is three or five rows).
  // Many rows (prefill) take the block unpacked once for all their row groups: AVX2 unpacks with the same
  // vector pipes that multiply (SmolLM2's products at 512 rows: ~8% faster than two-row groups that unpack
  // it themselves). At 16 rows the extra pass through memory cost as much as it saved.
  if (p.m < kUnpackOnceFromRows) {
    switch (p.m % kStreamRows) {
      case 1:
        if (p.m == 1) return Tile<1, NB, kFive>(p, 0, nb0);
        Tile<3, NB, kFive>(p, 0, nb0);
        Tile<2, NB, kFive>(p, 3, nb0);
        m = 5;
        break;
      case 2: Tile<2, NB, kFive>(p, 0, nb0); m = 2; break;
      case 3: Tile<3, NB, kFive>(p, 0, nb0); m = 3; break;
    }
    for (; m < p.m; m += kStreamRows) Tile<kStreamRows, NB, kFive>(p, m, nb0);
    return;
  }
  const int64_t chunks = p.k / kChunkK;
  thread_local std::vector<__m256i> unpacked;
  unpacked.resize(4 * chunks);
  for (int64_t c = 0; c < chunks; ++c) UnpackChunk<kFive>(p, nb0, c, true, unpacked.data() + 4 * c);
  for (; m + kRows <= p.m; m += kRows) Tile<kRows, NB, kFive, true>(p, m, nb0, unpacked.data());
  for (; m < p.m; ++m) Tile<1, NB, kFive, true>(p, m, nb0, unpacked.data());
#endif
}

// All MR rows in one tile, output blocks [nb_begin, nb_end).
template <int MR, bool kFive>
void OneTile(const Problem& p, int64_t nb_begin, int64_t nb_end) {
  int64_t nb = nb_begin;
  constexpr int NB = kBlocksOneTile<MR>;
  for (; nb + NB <= nb_end; nb += NB) Tile<MR, NB, kFive>(p, 0, nb);
  for (; nb < nb_end; ++nb) Tile<MR, 1, kFive>(p, 0, nb);
}

template <bool kFive>
void Columns(const Problem& p, int64_t nb_begin, int64_t nb_end) {
  // std::min keeps the cases an ISA never takes (more rows than kMaxOneTileRows) from instantiating tiles
  // too large for its registers.
  switch (p.m <= kMaxOneTileRows ? p.m : 0) {
    case 1: return OneTile<1, kFive>(p, nb_begin, nb_end);
    case 2: return OneTile<std::min(2, kMaxOneTileRows), kFive>(p, nb_begin, nb_end);
    case 3: return OneTile<std::min(3, kMaxOneTileRows), kFive>(p, nb_begin, nb_end);
    case 4: return OneTile<std::min(4, kMaxOneTileRows), kFive>(p, nb_begin, nb_end);
    case 5: return OneTile<std::min(5, kMaxOneTileRows), kFive>(p, nb_begin, nb_end);
  }
  int64_t nb = nb_begin;
  for (; nb + kBlocks <= nb_end; nb += kBlocks) Rows<kBlocks, kFive>(p, nb);
  for (; nb < nb_end; ++nb) Rows<1, kFive>(p, nb);
}

// w, high, scale and minimum hold one layer's weight, or every layer's stacked along a leading axis
// (layer_slice.h); `layer` picks the one to read. high: the fifth bits for int5 (a [N/16, K/8, 16] u8
// buffer), nullptr for int4.
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_all,
                  const ffi::AnyBuffer* high_all, ffi::AnyBuffer scale_all, ffi::AnyBuffer minimum_all,
                  int64_t layer, ffi::ResultBuffer<ffi::F32> out) {
  const jaxinfer::LayerSlice w = jaxinfer::SliceLayer(w_all, 4, layer);
  const jaxinfer::LayerSlice scale = jaxinfer::SliceLayer(scale_all, 3, layer);
  const jaxinfer::LayerSlice minimum = jaxinfer::SliceLayer(minimum_all, 3, layer);
  const auto xd = x.dimensions();
  const std::vector<int64_t>&wd = w.dims, &sd = scale.dims, &md = minimum.dims;
  if (xd.size() != 2 || !w.ok || !scale.ok || !minimum.ok || w_all.element_type() != ffi::DataType::U8 ||
      wd[2] != kBlockN || wd[3] != 4 || sd[2] != kBlockN || md != sd)
    return ffi::Error::InvalidArgument(
        "int4_matmul: want x [M, K], w u8 [N/16, K/8, 16, 4], scale and minimum [N/16, G, 16] (each with a "
        "leading [layers] axis holding `layer`, or without one and layer 0)");
  const int64_t m = xd[0], k = xd[1], groups = sd[1];
  if (wd[1] * kChunkK != k || sd[0] != wd[0] || groups <= 0 || k % groups != 0 || (k / groups) % kBlockK != 0)
    return ffi::Error::InvalidArgument("int4_matmul: K, groups and weight layout disagree");
  const ffi::DataType kind = scale_all.element_type();
  if ((kind != ffi::DataType::F32 && kind != ffi::DataType::F16) || minimum_all.element_type() != kind)
    return ffi::Error::InvalidArgument("int4_matmul: scale and minimum must be both float32 or both float16");
  jaxinfer::LayerSlice high;
  if (high_all != nullptr) {
    high = jaxinfer::SliceLayer(*high_all, 3, layer);
    if (!high.ok || high_all->element_type() != ffi::DataType::U8 || high.dims[0] != wd[0] ||
        high.dims[1] != wd[1] || high.dims[2] != 16)
      return ffi::Error::InvalidArgument("int5_matmul: want high u8 [N/16, K/8, 16] beside w [N/16, K/8, 16, 4]");
  }
  if (m == 0) return ffi::Error::Success();
  const int64_t group = k / groups;
  const int64_t blocks_per_row = k / kBlockK, blocks_per_group = group / kBlockK;
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * blocks_per_row), block_sum(m * blocks_per_row), xsum(m * groups, 0.0f);
  jaxinfer::QuantizeRows(pool, x.typed_data(), m, k, xq.data(), xs.data(), block_sum.data(), nullptr);
  for (int64_t b = 0; b < m * blocks_per_row; ++b) xsum[b / blocks_per_group] += block_sum[b];
  Problem p{xq.data(), xs.data(), xsum.data(), static_cast<const uint8_t*>(w.data),
            static_cast<const uint8_t*>(high.data), scale.data, minimum.data, kind == ffi::DataType::F16,
            out->typed_data(), m, wd[0] * kBlockN, k, groups, blocks_per_group};

  const int64_t blocks = wd[0];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Work items of whole tiles (of the widest, one row's), about four per thread.
  constexpr int64_t kWhole = kBlocksOneTile<1>;
  const int64_t per_chunk = (std::max<int64_t>(1, blocks / (4 * threads)) + kWhole - 1) / kWhole * kWhole;
  const int64_t chunks = (blocks + per_chunk - 1) / per_chunk;
  jaxinfer::ParallelFor(pool, chunks, m * p.n * p.k, [&p, per_chunk, blocks](int64_t c) {
    const int64_t begin = c * per_chunk, end = std::min(blocks, (c + 1) * per_chunk);
    if (p.high != nullptr) {
      Columns<true>(p, begin, end);
    } else {
      Columns<false>(p, begin, end);
    }
  }, kMinSplitWork);
  return ffi::Error::Success();
}

ffi::Error Int4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                      ffi::AnyBuffer minimum, int64_t layer, ffi::ResultBuffer<ffi::F32> out) {
  return Matmul(pool, x, w, nullptr, scale, minimum, layer, out);
}

ffi::Error Int5Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer high,
                      ffi::AnyBuffer scale, ffi::AnyBuffer minimum, int64_t layer,
                      ffi::ResultBuffer<ffi::F32> out) {
  return Matmul(pool, x, w, &high, scale, minimum, layer, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_int4_matmul), Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_int5_matmul), Int5Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());
