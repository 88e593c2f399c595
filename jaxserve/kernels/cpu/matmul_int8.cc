// y [M, N] = (x [M, K] @ q [K, N]) * scale [N] (JaxserveMatmulInt8): a projection over int8 weight codes with one
// float32 scale per output column (`--quantization int8`, model/quantize.py), for the few rows of decode steps.
//
// The weight is read as int8 (a quarter of float32's bytes) and converted to floats in registers, one vector at
// a time, right before the FMAs; the scale multiplies each column once, when its accumulators are stored. Each
// thread takes a band of q's columns, a tile of kTileCols (one cache line of codes under AVX-512) at a time, and
// walks q's rows in blocks of kRowBlock, prefetching the next block's rows; up to kMaxRows rows of y stay in
// registers per pass over a block, and more rows take more passes while the block is in L2 (as matmul.cc).

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "pool.h"
#include "vec.h"
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

// kLanes codes as floats. GCC 12 lowers __builtin_convertvector from int8 to one scalar convert a lane, so the
// x86 builds use the sign-extend and convert instructions themselves.
inline Vec Codes(const int8_t* p) {
#if JAXSERVE_LANES == 16 && defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif JAXSERVE_LANES == 8 && defined(__AVX2__)
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(*reinterpret_cast<const QVec*>(p), Vec);
#endif
}

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

// One row of x (a one-request decode step): q's rows are cut into kRowParts contiguous runs claimed by the threads
// one at a time, each summed into its own partial y, so q streams as long sequential reads; the partials are added
// and scaled at the end. Column tiles over strided rows read a 5632-column matrix at a third of this rate.
constexpr int kRowParts = 16;
constexpr int kMinPartRows = 32;
constexpr int kPartRows = 8;  // rows of q summed a pass over y: y is loaded and stored once per kPartRows rows

void RowPart(const Problem& p, int64_t k0, int64_t k1, float* y) {
  for (int64_t c = 0; c < p.n; c += kLanes) Store(y + c, Vec{});
  int64_t k = k0;
  for (; k + kPartRows <= k1; k += kPartRows) {
    const int8_t* q = p.q + k * p.n;
    float xs[kPartRows];
    for (int j = 0; j < kPartRows; ++j) xs[j] = p.x[k + j];
    for (int64_t c = 0; c < p.n; c += kLanes) {
      Vec a = Load(y + c), b = xs[1] * Codes(q + p.n + c);
      a += xs[0] * Codes(q + c);
      for (int j = 2; j < kPartRows; j += 2) {  // two chains: the FMAs' latency, not their count, bounds one
        a += xs[j] * Codes(q + j * p.n + c);
        b += xs[j + 1] * Codes(q + (j + 1) * p.n + c);
      }
      Store(y + c, a + b);
    }
  }
  for (; k < k1; ++k) {
    for (int64_t c = 0; c < p.n; c += kLanes) Store(y + c, Load(y + c) + p.x[k] * Codes(p.q + k * p.n + c));
  }
}

void RunOneRow(ffi::ThreadPool& pool, const Problem& p, int threads) {
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kRowParts, p.k / kMinPartRows)));
  thread_local std::vector<float> partial;  // per calling thread: a step's projections neither allocate nor clear it
  if (partial.size() < static_cast<size_t>((parts - 1) * p.n)) partial.resize((parts - 1) * p.n);
  float* y = p.y;
  float* rest = partial.data();
  jaxserve::ParallelFor(pool, parts, threads, [p, parts, y, rest](int i) {
    RowPart(p, p.k * i / parts, p.k * (i + 1) / parts, i == 0 ? y : rest + (i - 1) * p.n);
  });
  for (int64_t c = 0; c < p.n; c += kLanes) {
    Vec sum = Load(y + c);
    for (int i = 1; i < parts; ++i) sum += Load(rest + (i - 1) * p.n + c);
    Store(y + c, sum * Load(p.scale + c));
  }
}

// Bands per thread: a one-row step reads q at memory speed only with both cores busy to the end, so a thread the
// OS takes away for a while holds up one small band rather than half the matrix.
constexpr int kBandsPerThread = 4;

ffi::Error MatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int32_t max_threads) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[0] || scale.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("matmul_int8: x must be [M, K], q [K, N] and scale [N]");
  }
  if (qd[1] % kTileCols != 0) return ffi::Error::InvalidArgument("matmul_int8: N must be a multiple of the tile (64)");
  const Problem p{x.typed_data(), q.typed_data(), scale.typed_data(), y->typed_data(), xd[0], xd[1], qd[1]};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  // At most max_threads (0: all of the pool): where two vCPUs share one core's vector units, a second thread only
  // contends for them (the kernel plan measures which is faster; docs/quantization.md).
  const int pool_threads = static_cast<int>(std::max<int64_t>(1, pool.num_threads()));
  const int threads = max_threads > 0 ? std::min(max_threads, pool_threads) : pool_threads;
  if (p.m == 1) {
    RunOneRow(pool, p, threads);
    return ffi::Error::Success();
  }
  const int64_t units = p.n / kTileCols;
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("max_threads"));
