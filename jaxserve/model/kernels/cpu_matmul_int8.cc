// y [M, N] = (x [M, K] @ q [K, N]) * scale [N] (JaxserveMatmulInt8): a projection over int8 weight codes with one
// float32 scale per output column (`--quantization int8`, model/quantize.py), for the few rows of decode steps.
//
// The weight is read as int8 (a quarter of float32's bytes) and converted to floats in registers, one vector at
// a time, right before the FMAs; the scale multiplies each column once, when its accumulators are stored. Each
// thread takes a band of q's columns, a tile of kTileCols (one cache line of codes under AVX-512) at a time, and
// walks q's rows in blocks of kRowBlock, prefetching the next block's rows; up to kMaxRows rows of y stay in
// registers per pass over a block, and more rows take more passes while the block is in L2 (as cpu_matmul.cc).

#include <algorithm>
#include <cstdint>

#include "cpu_pool.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kLanes;
using jaxserve::kVecRegs;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Vec;
using jaxserve::WithBlock;

typedef int8_t QVec __attribute__((vector_size(JAXSERVE_LANES), aligned(1)));

constexpr int kTileVecs = 4;                       // vectors of a tile's columns
constexpr int kTileCols = kTileVecs * kLanes;      // 64 codes under AVX-512 (a cache line), 32 AVX2, 16 portable
constexpr int kRowBlock = 16;                      // rows of q per sweep over a band
// Rows of y a pass keeps in registers: their accumulators, the converted codes and x's broadcast.
constexpr int kMaxRows = std::max(1, std::min(8, (kVecRegs - kTileVecs - 1) / kTileVecs));

struct Problem {
  const float* x;
  const int8_t* q;
  const float* scale;
  float* y;
  int64_t m, k, n;
};

inline Vec Codes(const int8_t* p) { return __builtin_convertvector(*reinterpret_cast<const QVec*>(p), Vec); }

// Rows [m0, m0 + MB) of y, columns [c0, c1), over rows [k0, k0 + kb) of q, added to what y holds unless k0 is 0;
// the last block (`last`) scales the sums as it stores them.
template <int MB>
inline void Sweep(const Problem& p, int64_t m0, int64_t c0, int64_t c1, int64_t k0, int kb, bool prefetch,
                  bool last) {
  const float* x = p.x + m0 * p.k + k0;
  float* y = p.y + m0 * p.n;
  for (int64_t c = c0; c < c1; c += kTileCols) {
    Vec acc[MB][kTileVecs];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < kTileVecs; ++v) acc[i][v] = k0 ? Load(y + i * p.n + c + v * kLanes) : Vec{};
    const int8_t* q = p.q + k0 * p.n + c;
    for (int r = 0; r < kb; ++r) {
      if (prefetch) __builtin_prefetch(q + (r + kRowBlock) * p.n, 0, 2);
      Vec wv[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) wv[v] = Codes(q + r * p.n + v * kLanes);
      for (int i = 0; i < MB; ++i) {
        const float xi = x[i * p.k + r];
        for (int v = 0; v < kTileVecs; ++v) acc[i][v] += xi * wv[v];
      }
    }
    for (int v = 0; v < kTileVecs && last; ++v) {
      const Vec s = Load(p.scale + c + v * kLanes);
      for (int i = 0; i < MB; ++i) acc[i][v] *= s;
    }
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < kTileVecs; ++v) Store(y + i * p.n + c + v * kLanes, acc[i][v]);
  }
}

void Band(const Problem& p, int passes, int64_t c0, int64_t c1) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kRowBlock) {
    const int kb = static_cast<int>(std::min<int64_t>(kRowBlock, p.k - k0));
    const bool prefetch = k0 + 2 * kRowBlock <= p.k, last = k0 + kRowBlock >= p.k;
    for (int i = 0; i < passes; ++i) {
      const int64_t m0 = p.m * i / passes, m1 = p.m * (i + 1) / passes;
      WithBlock<kMaxRows>(static_cast<int>(m1 - m0), [&](auto mb) {
        Sweep<decltype(mb)::value>(p, m0, c0, c1, k0, kb, prefetch && i == 0, last);
      });
    }
  }
}

// Bands per thread: a one-row step reads q at memory speed only with both cores busy to the end, so a thread the
// OS takes away for a while holds up one small band rather than half the matrix.
constexpr int kBandsPerThread = 4;

ffi::Error MatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[0] || scale.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("matmul_int8: x must be [M, K], q [K, N] and scale [N]");
  }
  if (qd[1] % kTileCols != 0) return ffi::Error::InvalidArgument("matmul_int8: N must be a multiple of the tile (64)");
  const Problem p{x.typed_data(), q.typed_data(), scale.typed_data(), y->typed_data(), xd[0], xd[1], qd[1]};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t units = p.n / kTileCols;
  const int threads = static_cast<int>(std::max<int64_t>(1, pool.num_threads()));
  const int bands = static_cast<int>(std::min<int64_t>(threads * kBandsPerThread, units));
  const int passes = static_cast<int>((p.m + kMaxRows - 1) / kMaxRows);
  jaxserve::ParallelFor(pool, bands, threads, [p, units, bands, passes](int b) {
    Band(p, passes, units * b / bands * kTileCols, units * (b + 1) / bands * kTileCols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulInt8, MatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
