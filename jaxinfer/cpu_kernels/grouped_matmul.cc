// Grouped (ragged) matmul for Mixture-of-Experts layers on XLA:CPU (AVX-512 or AVX2), as XLA FFI custom calls.
//
//   out[r, o] = sum_i x[r, i] * W[g(r), o, i]            (float32 weights)
//   out[r, o] = scale[g(r), o] * sum_i x[r, i] * q[g(r), o, i]   (int8 weights, dequantised on the fly)
//   out[r, o] = sum_i x[r, i] * (q[g(r), o, i] * scale[g(r), o, i / S] + minimum[g(r), o, i / S])   (int4)
//
// x            f32 [R, K]      rows sorted by group: group g is rows offset(g) .. offset(g) + group_sizes[g]
// w            f32 [E, N, K]   or q s8 [E, N, K] with scale f32 [E, N] (our weights are [out, in]: x @ W.T)
//                              or int4: packed u8 [E, N, K/2] (byte j: q[.., 2j] low nibble, q[.., 2j + 1]
//                              high; weight_formats.Int4Weight's own bytes) with scale and minimum f32
//                              [E, N, K/S], S (the int4 group) a power of two from 32
// group_sizes  s32 [E]         rows past sum(group_sizes) come out as zeros (as lax.ragged_dot's)
// out          f32 [R, N]
//
// XLA:CPU expands lax.ragged_dot into a dense masked product over every group (every expert's weights read
// for every call). This kernel is bound by memory instead: the work is a list of (group, tile of outputs)
// items over the non-empty groups only, so an expert no row was routed to is never read, and each item
// streams its weight tile once while every row block of its group (MR rows at a time, the rows in L1, the
// tile in L1/L2) multiplies it. Both operands are contiguous along K, so a tile is MR rows x NB outputs of
// vector accumulators over K, reduced horizontally at the end (K not a multiple of the vector width ends in
// a scalar tail). int8 weights widen to float in registers (vpmovsxbd + vcvtdq2ps) and the per-output
// scale multiplies the finished sum. int4 weights: one vpmovzxbd widens a vector of packed bytes, a mask
// and a shift split them into the low nibbles (even inputs) and the high ones (odd inputs), and each is
// dequantised in registers with its group's scale and minimum (one fma) before it meets the rows. The rows
// are copied once per call with even and odd inputs apart, in steps of 2 x lanes inputs (x_even, then
// x_odd), so the nibbles need no shuffle back into input order.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)

using Vec = __m512;
constexpr int kLanes = 16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
// kLanes packed int4 bytes -> their low nibbles and their high ones as float.
inline void LoadNibbles(const uint8_t* p, Vec* lo, Vec* hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
// Outputs per tile for MR rows: accumulators MR x NB, plus NB weight vectors and one row vector, within
// the 32 zmm registers. (Single-thread probe, 256 KiB of weights in L2, 2-core Zen 4: about 50 / 75 /
// 80 GMAC/s of int8 at 1 / 2 / 4 rows, above the ~16 GB/s of weights one core streams from memory. A
// single row as one output at a time with four accumulators along K ran 2-3x slower for int8.)
template <int MR>
constexpr int Cols() {
  return MR <= 2 ? 8 : 4;
}
// int4: the same (the dequantised weight vectors are temporaries; the rows are fma memory operands), in
// row blocks of 4 (8 rows by 2 outputs ran ~10% slower at 32 rows per expert, 2-core Zen 4).
template <int MR>
constexpr int Cols4() {
  return Cols<MR>();
}
constexpr int kRows4 = 4;

#else  // AVX2

using Vec = __m256;
constexpr int kLanes = 8;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void LoadNibbles(const uint8_t* p, Vec* lo, Vec* hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Within the 16 ymm registers.
template <int MR>
constexpr int Cols() {
  return MR == 1 ? 6 : (MR == 2 ? 4 : 3);
}
// int4: 3 or 4 rows by 3 outputs spilled the accumulators (the nibble mask and the dequantised weights
// take three more registers), so 2 outputs there, 1 in row blocks of 8, which share each dequantised
// weight vector among more rows (32 rows per expert: ~1.5x faster than blocks of 4).
template <int MR>
constexpr int Cols4() {
  return MR == 1 ? 6 : (MR == 2 ? 4 : (MR <= 4 ? 2 : 1));
}
constexpr int kRows4 = 8;

#endif

constexpr int kRows = 4;  // rows per row block
constexpr int kStep = 2 * kLanes;  // int4: inputs per step (kLanes packed bytes)

template <typename W>
struct Problem {
  const float* x;      // [R, K]
  const W* w;          // [E, N, K]
  const float* scale;  // [E, N] (int8) or nullptr (float32)
  float* out;          // [R, N]
  int64_t n, k;
};

struct Int4 {};  // the int4 weight format

template <>
struct Problem<Int4> {
  const float* x;        // [R, K], each step of kStep inputs as its kLanes even inputs, then its odd ones
  const uint8_t* w;      // [E, N, K/2]
  const float* scale;    // [E, N, G]
  const float* minimum;  // [E, N, G]
  float* out;            // [R, N]
  int64_t n, k, groups;
  int group_shift;  // log2 of the int4 group size (a power of two: 32 or 128)
};

// Bytes of one output row of weights (what a work item's tile holds in cache).
template <typename W>
int64_t RowBytes(const Problem<W>& p) {
  return p.k * static_cast<int64_t>(sizeof(W));
}
int64_t RowBytes(const Problem<Int4>& p) { return p.k / 2 + 2 * static_cast<int64_t>(sizeof(float)) * p.groups; }

// Rows r0 .. r0 + MR by outputs o0 .. o0 + NB of group g.
template <typename W, int MR, int NB>
void Tile(const Problem<W>& p, int64_t g, int64_t r0, int64_t o0) {
  const float* x = p.x + r0 * p.k;
  const W* w = p.w + (g * p.n + o0) * p.k;
  Vec acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Zero();
  int64_t c = 0;
  for (; c + kLanes <= p.k; c += kLanes) {
    Vec wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = Load(w + j * p.k + c);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = Load(x + i * p.k + c);
      for (int j = 0; j < NB; ++j) acc[i][j] = Fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NB; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t t = c; t < p.k; ++t) s += x[i * p.k + t] * static_cast<float>(w[j * p.k + t]);
      if (p.scale != nullptr) s *= p.scale[g * p.n + o0 + j];
      p.out[(r0 + i) * p.n + o0 + j] = s;
    }
  }
}

// int4: rows r0 .. r0 + MR by outputs o0 .. o0 + NB of group g. Each step dequantises kStep inputs of NB
// outputs (kLanes packed bytes each, within one int4 group) and multiplies them into every row.
template <int MR, int NB>
void Tile4(const Problem<Int4>& p, int64_t g, int64_t r0, int64_t o0) {
  const float* x = p.x + r0 * p.k;
  const int64_t half = p.k / 2;
  const uint8_t* w = p.w + (g * p.n + o0) * half;
  const float* scale = p.scale + (g * p.n + o0) * p.groups;
  const float* minimum = p.minimum + (g * p.n + o0) * p.groups;
  Vec acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Zero();
  // One loop over the steps (a loop per int4 group ran ~3x slower at groups of one step: the compiler
  // hoisted the group's broadcasts and rows out of the step loop and spilled them).
  for (int64_t c = 0; c < p.k; c += kStep) {
    const int64_t s = c >> p.group_shift;
    for (int j = 0; j < NB; ++j) {
      Vec lo, hi;
      LoadNibbles(w + j * half + c / 2, &lo, &hi);
      const Vec sv = Broadcast(scale + j * p.groups + s), mv = Broadcast(minimum + j * p.groups + s);
      const Vec w_even = Fma(lo, sv, mv), w_odd = Fma(hi, sv, mv);
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = Fma(Load(x + i * p.k + c), w_even, acc[i][j]);
        acc[i][j] = Fma(Load(x + i * p.k + c + kLanes), w_odd, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) p.out[(r0 + i) * p.n + o0 + j] = Sum(acc[i][j]);
}

// MR rows from r0 over the outputs o .. o_end of group g, NB at a time, the rest in halving tiles.
template <typename W, int MR, int NB = std::is_same_v<W, Int4> ? Cols4<MR>() : Cols<MR>()>
void RowBlock(const Problem<W>& p, int64_t g, int64_t r0, int64_t o, int64_t o_end) {
  for (; o + NB <= o_end; o += NB) {
    if constexpr (std::is_same_v<W, Int4>)
      Tile4<MR, NB>(p, g, r0, o);
    else
      Tile<W, MR, NB>(p, g, r0, o);
  }
  if constexpr (NB > 1)
    if (o < o_end) RowBlock<W, MR, NB / 2>(p, g, r0, o, o_end);
}

// Every row of group g (rows r_begin .. r_end) over the outputs o_begin .. o_end.
template <typename W>
void Item(const Problem<W>& p, int64_t g, int64_t r_begin, int64_t r_end, int64_t o_begin, int64_t o_end) {
  int64_t r = r_begin;
  // int4 dequantises each weight vector once per row block: with AVX2, blocks of 8 rows share that work.
  if constexpr (std::is_same_v<W, Int4> && kRows4 > kRows)
    for (; r + kRows4 <= r_end; r += kRows4) RowBlock<W, kRows4>(p, g, r, o_begin, o_end);
  for (; r + kRows <= r_end; r += kRows) RowBlock<W, kRows>(p, g, r, o_begin, o_end);
  switch (r_end - r) {
    case 3: RowBlock<W, 3>(p, g, r, o_begin, o_end); break;
    case 2: RowBlock<W, 2>(p, g, r, o_begin, o_end); break;
    case 1: RowBlock<W, 1>(p, g, r, o_begin, o_end); break;
    default: break;
  }
}

struct WorkItem {
  int64_t group, r_begin, r_end, o_begin, o_end;
};

template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, const Problem<W>& p, int64_t rows, int64_t experts, const int32_t* sizes) {
  // The work: (group, output tile) over the groups that hold rows. A tile of ~128 KiB of weights stays in
  // L2 while the group's row blocks pass over it, and yields enough items to share among the threads; a
  // multiple of 48 outputs splits into whole register tiles (NB of 8, 6, 4 or 3).
  const int64_t tile_bytes = int64_t{128} << 10;
  int64_t tile = tile_bytes / std::max<int64_t>(1, RowBytes(p));
  tile = std::min<int64_t>(std::max<int64_t>(48, tile / 48 * 48), 480);
  std::vector<WorkItem> items;
  int64_t start = 0, work = 0;
  for (int64_t g = 0; g < experts; ++g) {
    const int64_t size = std::min<int64_t>(std::max<int32_t>(sizes[g], 0), rows - start);
    if (size <= 0) continue;
    for (int64_t o = 0; o < p.n; o += tile) items.push_back({g, start, start + size, o, std::min(p.n, o + tile)});
    start += size;
    work += size * p.n * p.k;
  }
  // Rows past the last group belong to no expert: zeros, as lax.ragged_dot gives them.
  if (start < rows) std::memset(p.out + start * p.n, 0, (rows - start) * p.n * sizeof(float));
  // Split from 512K multiply-adds, even at one row per group (memory bound; as int4_matmul.cc).
  jaxinfer::ParallelFor(pool, static_cast<int64_t>(items.size()), work, [&p, &items](int64_t i) {
    const WorkItem& it = items[i];
    Item(p, it.group, it.r_begin, it.r_end, it.o_begin, it.o_end);
  }, int64_t{1} << 19);
  return ffi::Error::Success();
}

ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> gd) {
  if (xd.size() != 2 || wd.size() != 3 || gd.size() != 1 || wd[2] != xd[1] || gd[0] != wd[0])
    return ffi::Error::InvalidArgument("grouped_matmul: want x [R, K], w [E, N, K], group_sizes [E]");
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (ffi::Error e = CheckShapes(xd, wd, group_sizes.dimensions()); e.failure()) return e;
  const Problem<float> p{x.typed_data(), w.typed_data(), nullptr, out->typed_data(), wd[1], wd[2]};
  return Run(pool, p, xd[0], wd[0], group_sizes.typed_data());
}

ffi::Error GroupedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                             ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = q.dimensions(), sd = scale.dimensions();
  if (ffi::Error e = CheckShapes(xd, wd, group_sizes.dimensions()); e.failure()) return e;
  if (sd.size() != 2 || sd[0] != wd[0] || sd[1] != wd[1])
    return ffi::Error::InvalidArgument("grouped_matmul: want scale [E, N] for q [E, N, K]");
  const Problem<int8_t> p{x.typed_data(), q.typed_data(), scale.typed_data(), out->typed_data(), wd[1], wd[2]};
  return Run(pool, p, xd[0], wd[0], group_sizes.typed_data());
}

ffi::Error GroupedMatmulInt4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                             ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> minimum,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), sd = scale.dimensions(), md = minimum.dimensions();
  const auto gd = group_sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || gd.size() != 1 || gd[0] != wd[0] || 2 * wd[2] != xd[1])
    return ffi::Error::InvalidArgument("grouped_matmul: want x [R, K], packed [E, N, K/2], group_sizes [E]");
  if (sd.size() != 3 || md.size() != 3 || sd[0] != wd[0] || sd[1] != wd[1] || md[0] != sd[0] || md[1] != sd[1] ||
      md[2] != sd[2])
    return ffi::Error::InvalidArgument("grouped_matmul: want scale and minimum [E, N, G] for packed [E, N, K/2]");
  const int64_t rows = xd[0], k = xd[1], groups = sd[2];
  if (groups <= 0 || k % groups != 0 || (k / groups) % 32 != 0 || ((k / groups) & (k / groups - 1)) != 0)
    return ffi::Error::InvalidArgument("grouped_matmul: int4 groups must be a power of two >= 32 inputs");
  int group_shift = 0;
  while ((int64_t{1} << group_shift) < k / groups) ++group_shift;
  // The rows in some group, each step of kStep inputs split into its even inputs, then its odd ones.
  const int32_t* sizes = group_sizes.typed_data();
  int64_t used = 0;
  for (int64_t g = 0; g < wd[0]; ++g) used += std::max<int32_t>(sizes[g], 0);
  used = std::min(used, rows);
  std::vector<float> split(used * k);
  const float* src = x.typed_data();
  for (int64_t i = 0; i < used * k; i += kStep)
    for (int l = 0; l < kLanes; ++l) {
      split[i + l] = src[i + 2 * l];
      split[i + kLanes + l] = src[i + 2 * l + 1];
    }
  const Problem<Int4> p{split.data(), packed.typed_data(), scale.typed_data(), minimum.typed_data(),
                        out->typed_data(), wd[1], k, groups, group_shift};
  return Run(pool, p, rows, wd[0], sizes);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_grouped_matmul_f32), GroupedMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_grouped_matmul_int8), GroupedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXINFER_SYMBOL(jaxinfer_grouped_matmul_int4), GroupedMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
