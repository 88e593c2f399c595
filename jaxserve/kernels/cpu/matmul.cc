// y [M, N] = x [M, K] @ w [K, N] (JaxserveMatmul) and y = x @ w^T for w [N, K] (JaxserveMatmulNT, a tied LM
// head's embedding) for the few rows of decode steps and small chunks on a CPU, as XLA FFI custom calls.
//
// XLA's CPU dots (Eigen, YNNPACK) ran a decode step's 2-32-row projections far below the memory bandwidth that
// streaming the weights once needs (docs/tuning.md). Here each thread takes a band of w's columns and walks it in
// blocks of kRowBlock rows of w (kRowBlockFewNarrow for a few rows under AVX2): for every 16 columns (a cache
// line) it accumulates up to kMaxRows rows of y in registers over the block, so w streams from memory as kRowBlock
// sequential row segments (the prefetcher follows those; the next block's rows are prefetched into L2 as the
// current one is read) and y stays in cache between blocks. More rows than kMaxRows take more passes over each
// block while it is in L2, so w is read from memory once. For w^T each thread takes a band of w's rows and walks
// them four at a time, the rows of x a few at a time against them (from L1), as vector partial dot products summed
// across lanes at the end of each row; for 9-16 rows of x, a few rows of w at a time are broadcast against x^T
// instead (BcastRows). One row of x against w takes w's rows in contiguous parts instead of its columns in bands
// (RunOneRow). Block sizes follow the vector registers of the instruction set built for (vec.h).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve::kLanes;
using jaxserve::kLineFloats;
using jaxserve::kVecRegs;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Sum;
using jaxserve::Vec;
using jaxserve::WithBlock;

constexpr int kRowBlock = 16;  // rows of w per sweep over a band (more streams than this slowed `small`'s)
// 16 vector registers (AVX2, portable x86), one or two passes of rows: half the streams read faster on a Zen 3
// (three or more passes slower).
constexpr int kRowBlockFewNarrow = 8;
constexpr int kTileVecs = kLineFloats / kLanes;  // vectors of y's 16 columns
// Rows of y a pass keeps in registers: their accumulators, w's vectors and x's broadcast in the register file
// (AVX-512: 16, the most measured; AVX2: 6).
constexpr int kMaxRows = std::min(16, (kVecRegs - kTileVecs - 1) / kTileVecs);

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n;
};

// Rows [m0, m0 + MB) of y, columns [c0, c1) (a multiple of 16 wide), for rows [k0, k0 + kb) of w, added to what
// y holds unless k0 is 0; with `prefetch`, the next block's rows of w (`block` rows on) are requested into L2.
template <int MB>
inline void Sweep(const Problem& p, int64_t m0, int64_t c0, int64_t c1, int64_t k0, int kb, int block,
                  bool prefetch) {
  const float* x = p.x + m0 * p.k + k0;
  float* y = p.y + m0 * p.n;
  for (int64_t c = c0; c < c1; c += kLineFloats) {
    Vec acc[MB][kTileVecs];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < kTileVecs; ++v) acc[i][v] = k0 ? Load(y + i * p.n + c + v * kLanes) : Vec{};
    const float* w = p.w + k0 * p.n + c;
    for (int r = 0; r < kb; ++r) {
      if (prefetch) __builtin_prefetch(w + (r + block) * p.n, 0, 2);
      Vec wv[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) wv[v] = Load(w + r * p.n + v * kLanes);
      for (int i = 0; i < MB; ++i) {
        const float xi = x[i * p.k + r];
        for (int v = 0; v < kTileVecs; ++v) acc[i][v] += xi * wv[v];
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < kTileVecs; ++v) Store(y + i * p.n + c + v * kLanes, acc[i][v]);
  }
}

// All rows of y, columns [c0, c1), in `passes` near-equal passes of rows over each block of w's rows (24 rows
// under AVX-512 are two of 12, not 16 and 8); the first pass prefetches the next block, the others find the
// block in L2.
void Band(const Problem& p, int passes, int64_t c0, int64_t c1) {
  const int block = kVecRegs < 32 && passes <= 2 ? kRowBlockFewNarrow : kRowBlock;
  for (int64_t k0 = 0; k0 < p.k; k0 += block) {
    const int kb = static_cast<int>(std::min<int64_t>(block, p.k - k0));
    const bool prefetch = k0 + 2 * block <= p.k;
    for (int i = 0; i < passes; ++i) {
      const int64_t m0 = p.m * i / passes, m1 = p.m * (i + 1) / passes;
      WithBlock<kMaxRows>(static_cast<int>(m1 - m0), [&](auto mb) {
        Sweep<decltype(mb)::value>(p, m0, c0, c1, k0, kb, block, prefetch && i == 0);
      });
    }
  }
}

// Rows of w ahead of the ones being read that x @ w^T prefetches into L2: an embedding comes from memory, and
// without the prefetch a few rows of x read it well below one row's rate; see docs/tuning.md.
constexpr int kDotPrefetchRows = 8;

// y[m, n] = x[m] . w[n] for rows [n0, n1) of w, MB rows of x at a time against 4 rows of w.
template <int MB>
inline void DotRows(const Problem& p, int64_t m0, int64_t n, bool prefetch) {
  const float* w = p.w + n * p.k;
  Vec acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = Vec{};
  for (int64_t c0 = 0; c0 < p.k; c0 += kLineFloats) {
    if (prefetch) {
      for (int j = 0; j < 4; ++j) __builtin_prefetch(w + (kDotPrefetchRows + j) * p.k + c0, 0, 2);
    }
    for (int64_t c = c0; c < c0 + kLineFloats; c += kLanes) {
      Vec wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = Load(w + j * p.k + c);
      for (int i = 0; i < MB; ++i) {
        const Vec xv = Load(p.x + (m0 + i) * p.k + c);
        for (int j = 0; j < 4; ++j) acc[i][j] += xv * wv[j];
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) p.y[(m0 + i) * p.n + n + j] = Sum(acc[i][j]);
}

// Rows of x a pass: MB x 4 accumulators, 4 rows of w and one of x in registers (AVX-512: 4, AVX2: 2).
constexpr int kDotRows = std::min(4, (kVecRegs - 5) / 4);

// y[0, n] = x[0] . w[n] for rows [n0, n1) of w, one row of w at a time: one row of x reads the band as a single
// sequential stream (four rows interleaved read it 8% slower on the Zen 5 EPYC, below XLA's dot; docs/tuning.md).
void DotOneRow(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = p.w + n * p.k;
    Vec acc[4] = {};
    int64_t c = 0;
    for (; c + 4 * kLanes <= p.k; c += 4 * kLanes) {
      for (int j = 0; j < 4; ++j) acc[j] += Load(p.x + c + j * kLanes) * Load(w + c + j * kLanes);
    }
    for (; c < p.k; c += kLanes) acc[0] += Load(p.x + c) * Load(w + c);
    p.y[n] = Sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  }
}

void DotBand(const Problem& p, int64_t n0, int64_t n1) {
  if (p.m == 1) return DotOneRow(p, n0, n1);
  for (int64_t n = n0; n < n1; n += 4) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kDotRows) {
      const bool prefetch = m0 == 0 && n + kDotPrefetchRows + 4 <= n1;  // the first pass over these rows
      WithBlock<kDotRows>(static_cast<int>(std::min<int64_t>(kDotRows, p.m - m0)),
                          [&](auto mb) { DotRows<decltype(mb)::value>(p, m0, n, prefetch); });
    }
  }
}

// x @ w^T for kBcastMinRows to 16 rows of x. Four rows of w against four rows of x at a time re-read all of x
// (from L2: 16 rows of `small`'s are 48 KB) for every four rows of w and sum every output across lanes. Here x^T
// ([K][16], rows padded with zeros) is laid out once, and each element of kBcastRows rows of w is broadcast
// against its 16 rows, so y's columns accumulate in registers and x^T streams once per kBcastRows rows of w. At
// 8 rows and fewer the four-by-four blocks stay faster; see docs/tuning.md.
constexpr int kBcastVecs = kLineFloats / kLanes;  // vectors of x^T's 16 rows
// Rows of w a step: their accumulators, x^T's vectors and w's broadcast in the register file (AVX-512: 8, AVX2: 4).
constexpr int kBcastRows = jaxserve::FloorPow2(std::min(8, (kVecRegs - kBcastVecs - 1) / kBcastVecs));
constexpr int kBcastMinRows = 9;

inline void BcastRows(const Problem& p, const float* xt, int64_t n, bool prefetch) {
  const float* w = p.w + n * p.k;
  Vec acc[kBcastRows][kBcastVecs];
  for (int j = 0; j < kBcastRows; ++j)
    for (int v = 0; v < kBcastVecs; ++v) acc[j][v] = Vec{};
  for (int64_t c0 = 0; c0 < p.k; c0 += kLineFloats) {
    if (prefetch) {
      for (int j = 0; j < kBcastRows; ++j) __builtin_prefetch(w + (kBcastRows + j) * p.k + c0, 0, 2);
    }
    for (int64_t c = c0; c < c0 + kLineFloats; ++c) {
      Vec xv[kBcastVecs];
      for (int v = 0; v < kBcastVecs; ++v) xv[v] = Load(xt + c * kLineFloats + v * kLanes);
      for (int j = 0; j < kBcastRows; ++j) {
        const float wj = w[j * p.k + c];
        for (int v = 0; v < kBcastVecs; ++v) acc[j][v] += wj * xv[v];
      }
    }
  }
  alignas(64) float col[kLineFloats];
  for (int j = 0; j < kBcastRows; ++j) {
    for (int v = 0; v < kBcastVecs; ++v) Store(col + v * kLanes, acc[j][v]);
    for (int64_t m = 0; m < p.m; ++m) p.y[m * p.n + n + j] = col[m];
  }
}

void BcastBand(const Problem& p, const float* xt, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kBcastRows) BcastRows(p, xt, n, n + 2 * kBcastRows <= n1);
}

// One row of x against w [K, N] (a decode step of one request): w's rows are cut into up to kRowParts contiguous
// runs of at least kMinPartRows rows, claimed by the threads one at a time, each summed into its own partial y,
// and the partials added at the end. With more parts than threads, a thread the OS takes away for a while (the
// engine's Python thread shares the cores under asynchronous scheduling) holds up only the part it claimed, not
// half the matrix; see docs/tuning.md. The default: the kernel plan may choose another count per machine.
constexpr int kRowParts = 16;
constexpr int kMinPartRows = 32;
// Rows of w summed into y per pass over it, and how far ahead of them one row of x prefetches w into L2: a
// part's rows are separate streams the hardware prefetcher followed too late (docs/tuning.md).
constexpr int kRowGroupWide = 8;    // 32 vector registers (AVX-512)
constexpr int kRowGroupNarrow = 4;  // 16 (AVX2, portable x86): four rows read faster on a Zen 3 (docs/tuning.md)
constexpr int kRowGroup = kVecRegs >= 32 ? kRowGroupWide : kRowGroupNarrow;
constexpr int kRowPrefetchRows = 8;
// Bands of w's rows per thread for x @ w^T: its bands are contiguous in memory however many there are, and more
// of them than threads let a thread that runs on finish what a descheduled one has not claimed.
constexpr int kBandsPerThreadNT = 4;

// y[c] += sum_j x[k + j] w[k + j][c] over G rows of w; with `prefetch`, the G rows kRowPrefetchRows further on
// are requested into L2, a cache line of each per line read.
template <int G>
inline void RowGroup(const Problem& p, int64_t k, float* y, bool prefetch) {
  const float* w = p.w + k * p.n;
  const float* ahead = w + kRowPrefetchRows * p.n;
  float xs[G];
  for (int j = 0; j < G; ++j) xs[j] = p.x[k + j];
  for (int64_t c = 0; c < p.n; c += kLanes) {
    if (prefetch && c % kLineFloats == 0) {
      for (int j = 0; j < G; ++j) __builtin_prefetch(ahead + j * p.n + c, 0, 2);
    }
    Vec acc = Load(y + c);
    for (int j = 0; j < G; ++j) acc += xs[j] * Load(w + j * p.n + c);
    Store(y + c, acc);
  }
}

void RowPart(const Problem& p, int64_t k0, int64_t k1, float* y) {
  for (int64_t c = 0; c < p.n; c += kLanes) Store(y + c, Vec{});
  int64_t k = k0;
  for (; k + kRowGroup <= k1; k += kRowGroup) {
    RowGroup<kRowGroup>(p, k, y, k + kRowPrefetchRows + kRowGroup <= p.k);
  }
  for (; k < k1; ++k) RowGroup<1>(p, k, y, false);
}

ffi::Error RunOneRow(ffi::ThreadPool& pool, const Problem& p, int row_parts) {
  const int most = row_parts > 0 ? row_parts : kRowParts;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most, p.k / kMinPartRows)));
  // Part 0 sums into y itself, the others into this buffer, kept per calling thread so that a decode step's 48
  // projections neither allocate nor clear it (each part clears its own rows).
  thread_local std::vector<float> partial;
  if (partial.size() < static_cast<size_t>((parts - 1) * p.n)) partial.resize((parts - 1) * p.n);
  float* y = p.y;
  float* rest = partial.data();
  jaxserve::ParallelFor(pool, parts, pool.num_threads(), [p, parts, y, rest](int i) {
    RowPart(p, p.k * i / parts, p.k * (i + 1) / parts, i == 0 ? y : rest + (i - 1) * p.n);
  });
  for (int i = 1; i < parts; ++i) {
    for (int64_t c = 0; c < p.n; c += kLanes) Store(y + c, Load(y + c) + Load(rest + (i - 1) * p.n + c));
  }
  return ffi::Error::Success();
}

// Bands of w's columns (16 at a time), one a thread, since a band's rows are long sequential reads which more and
// narrower bands would cut up; or, `transposed` (w is [N, K]), bands of its rows (4 or kBcastRows at a time),
// kBandsPerThreadNT a thread.
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p, bool transposed, int row_parts = 0) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.m == 1 && !transposed) return RunOneRow(pool, p, row_parts);
  const bool bcast = transposed && p.m >= kBcastMinRows && p.m <= kLineFloats && p.n % kBcastRows == 0;
  std::vector<float> xt(bcast ? p.k * kLineFloats : 0, 0.0f);
  for (int64_t m = 0; bcast && m < p.m; ++m) {
    for (int64_t c = 0; c < p.k; ++c) xt[c * kLineFloats + m] = p.x[m * p.k + c];
  }
  const float* xtp = xt.data();
  const int64_t unit = bcast ? kBcastRows : transposed ? 4 : kLineFloats;
  const int64_t units = p.n / unit;
  const int threads = static_cast<int>(std::max<int64_t>(1, pool.num_threads()));
  const int bands = static_cast<int>(std::min<int64_t>(threads * (transposed ? kBandsPerThreadNT : 1), units));
  const int passes = static_cast<int>((p.m + kMaxRows - 1) / kMaxRows);
  jaxserve::ParallelFor(pool, bands, threads, [p, transposed, bcast, xtp, unit, units, bands, passes](int b) {
    const int64_t c0 = units * b / bands * unit, c1 = units * (b + 1) / bands * unit;
    if (bcast) return BcastBand(p, xtp, c0, c1);
    if (transposed) return DotBand(p, c0, c1);
    Band(p, passes, c0, c1);
  });
  return ffi::Error::Success();
}

// `row_parts`: the most parts one row cuts w into (0: kRowParts), chosen per machine at start-up (the kernel plan).
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, int32_t row_parts) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("matmul: x must be [M, K] and w [K, N]");
  }
  if (wd[1] % kLineFloats != 0) return ffi::Error::InvalidArgument("matmul: N must be a multiple of 16");
  return Run(pool, Problem{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[1]}, false, row_parts);
}

ffi::Error MatmulNTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("matmul_nt: x must be [M, K] and w [N, K]");
  }
  if (wd[1] % kLineFloats != 0 || wd[0] % 4 != 0) {
    return ffi::Error::InvalidArgument("matmul_nt: K must be a multiple of 16 and N of 4");
  }
  return Run(pool, Problem{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0]}, true);
}

// The tiles of a mixture-of-experts layer (moe.grouped_experts): rows [j R, (j + 1) R) of x times expert
// tile_expert[j] of w [E, K, N], of which only the first tile_rows[j] are real (the rest, and every row of a tile
// with none, come out zero). A run of tiles of one expert is one product over its rows, so each expert a step
// touches is read from memory once, straight out of w: XLA's loop copied every tile's expert before its dot.
ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> tile_expert, ffi::Buffer<ffi::S32> tile_rows,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t tiles = tile_expert.element_count();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || tiles == 0 || xd[0] % tiles != 0 ||
      tile_rows.element_count() != tiles) {
    return ffi::Error::InvalidArgument("grouped_matmul: x must be [tiles * R, K], w [E, K, N], one expert per tile");
  }
  if (wd[2] % kLineFloats != 0) return ffi::Error::InvalidArgument("grouped_matmul: N must be a multiple of 16");
  const int64_t r = xd[0] / tiles, k = xd[1], n = wd[2];
  const int32_t* ex = tile_expert.typed_data();
  const int32_t* used = tile_rows.typed_data();
  float* out = y->typed_data();
  std::fill(out, out + xd[0] * n, 0.0f);
  for (int64_t j = 0; j < tiles;) {
    int64_t end = j + 1;  // tiles [j, end) hold the rows of one expert, all but the last of them full
    while (end < tiles && ex[end] == ex[j] && used[end - 1] == r && used[end] > 0) ++end;
    const int64_t rows = (end - 1 - j) * r + used[end - 1];
    if (used[j] > 0 && ex[j] >= 0 && ex[j] < wd[0]) {
      const ffi::Error err = Run(pool, Problem{x.typed_data() + j * r * k, w.typed_data() + ex[j] * k * n,
                                               out + j * r * n, rows, k, n}, false);
      if (err.failure()) return err;
    }
    j = end;
  }
  return ffi::Error::Success();
}

}  // namespace

// The instruction set the library was built for ("avx512", "avx2" or "portable"; vec.h), for the start-up log.
extern "C" const char* JaxserveKernelIsa() { return jaxserve::kIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("row_parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulNT, MatmulNTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
