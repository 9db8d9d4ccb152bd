// int8 x int8 matmul for XLA:CPU through AVX-512 VNNI (vpdpbusd), as an XLA FFI custom call.
//
//   out[m, n] = w_scale[n] * sum_b x_scale[m, b] * sum_{k in block b} x_q[m, k] * w_q[n, k]
//
// x_q     s8  [M, K]        activations quantised per row and per block of K (int8_matmul_vnni.py)
// x_scale f32 [M, KB]       one scale per row and block (block = K / KB)
// x_comp  s32 [M, KB]       128 * the sum of x_q over each block
// w       u8  [N/16, K/4, 16, 4]  w_q + 128, packed so one 64-byte load holds 4 consecutive k of 16 outputs
// w_scale f32 [N]           per-output-channel weight scale
// out     f32 [M, N]
//
// vpdpbusd multiplies unsigned by signed bytes, so the weights carry a +128 offset and the activations
// stay signed (the broadcast operand); the offset's contribution, 128 * sum(x_q), is subtracted per
// block. XLA:CPU's own dots repack the weight on every call (Gemma 3's 335 MB bf16 logits weight: ~30 ms
// at 16 rows); here the weight is packed once, at load time, and read once per row group from L1.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
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

// MR rows x NB blocks of 16 outputs, starting at output n0.
template <int MR, int NB>
void Tile(const Problem& p, int64_t m0, int64_t n0) {
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
template <int NB>
void Rows(const Problem& p, int64_t n0) {
  constexpr int kRows = 4;
  int64_t m = 0;
  for (; m + kRows <= p.m; m += kRows) Tile<kRows, NB>(p, m, n0);
  switch (p.m - m) {
    case 3: Tile<3, NB>(p, m, n0); break;
    case 2: Tile<2, NB>(p, m, n0); break;
    case 1: Tile<1, NB>(p, m, n0); break;
    default: break;
  }
}

// Outputs [n_begin, n_end), in pairs of 16-output blocks: each pair's weights (K * 32 bytes) stay in L1
// while every row group passes over them.
void Columns(const Problem& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 2 * kBlockN <= n_end; n += 2 * kBlockN) Rows<2>(p, n);
  if (n < n_end) Rows<1>(p, n);
}

ffi::Error Int8MatmulVnni(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> x_scale,
                          ffi::Buffer<ffi::S32> x_comp, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> w_scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = x_scale.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || sd.size() != 2 || wd[2] != kBlockN || wd[3] != 4)
    return ffi::Error::InvalidArgument("int8_matmul_vnni: want x [M, K], x_scale [M, KB], w [N/16, K/4, 16, 4]");
  Problem p{x.typed_data(), x_scale.typed_data(), x_comp.typed_data(), w.typed_data(), w_scale.typed_data(),
            out->typed_data(), xd[0], wd[0] * kBlockN, xd[1], sd[1], 0};
  if (wd[1] * 4 != p.k || sd[0] != p.m || p.kb <= 0 || p.k % (4 * p.kb) != 0)
    return ffi::Error::InvalidArgument("int8_matmul_vnni: K, blocks and weight layout disagree");
  p.block = p.k / p.kb;
  if (p.m == 0) return ffi::Error::Success();

  const int64_t pairs = (p.n + 2 * kBlockN - 1) / (2 * kBlockN);
  const int64_t per_chunk = std::max<int64_t>(1, pairs / (8 * std::max<int64_t>(1, pool.num_threads())));
  const int64_t chunks = (pairs + per_chunk - 1) / per_chunk;
  jaxinfer::ParallelFor(pool, chunks, p.m * p.n * p.k, [&p, per_chunk](int64_t c) {
    const int64_t begin = c * per_chunk * 2 * kBlockN;
    Columns(p, begin, std::min(p.n, begin + per_chunk * 2 * kBlockN));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_int8_matmul_vnni, Int8MatmulVnni,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
