// SIMD vectors for jaxserve's CPU kernels (attention.cc, matmul.cc), as wide as the instruction set
// they are built for, chosen from the compiler's own macros:
//
//   AVX-512F         16 floats a vector, 32 registers ("avx512")
//   AVX2 and FMA      8 floats a vector, 16 registers ("avx2")
//   anything else     4 floats a vector (SSE2, NEON, ...), 16 registers, 32 on aarch64 ("portable")
//
// -DJAXSERVE_PORTABLE forces the last. The kernels are written once in `Vec` and derive their register blocking
// from kLanes and kVecRegs: a vector wider than the target's registers is lowered by GCC into pieces with round
// trips through memory, and more accumulators than registers spill (docs/tuning.md, "CPU instruction sets").
// Written out rather than left to the auto-vectoriser, which turned the attention's P.V loop into gathers across
// keys (docs/tuning.md).

#ifndef JAXSERVE_MODEL_CPU_VEC_H_
#define JAXSERVE_MODEL_CPU_VEC_H_

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && !defined(JAXSERVE_PORTABLE)
#define JAXSERVE_ISA "avx512"
#define JAXSERVE_LANES 16
#define JAXSERVE_VEC_REGS 32
#elif defined(__AVX2__) && defined(__FMA__) && !defined(JAXSERVE_PORTABLE)
#define JAXSERVE_ISA "avx2"
#define JAXSERVE_LANES 8
#define JAXSERVE_VEC_REGS 16
#else
#define JAXSERVE_ISA "portable"
#define JAXSERVE_LANES 4
#if defined(__aarch64__)
#define JAXSERVE_VEC_REGS 32
#else
#define JAXSERVE_VEC_REGS 16
#endif
#endif

namespace jaxserve {

constexpr const char* kIsa = JAXSERVE_ISA;
constexpr int kLanes = JAXSERVE_LANES;     // floats a vector
constexpr int kVecRegs = JAXSERVE_VEC_REGS;  // vector registers the target has
// Floats a cache line: the kernels' data layouts (N, K and head_dim in multiples of 16) and prefetches use it.
constexpr int kLineFloats = 16;
static_assert(kLineFloats % kLanes == 0);

typedef float Vec __attribute__((vector_size(4 * JAXSERVE_LANES)));
typedef float UnalignedVec __attribute__((vector_size(4 * JAXSERVE_LANES), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(4 * JAXSERVE_LANES)));

inline Vec Load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

// The sum of a vector's lanes: halves added in registers down to one lane.
inline float Sum(Vec v) {
#if JAXSERVE_LANES == 16
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif JAXSERVE_LANES == 8
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
#endif
  return v[0];
}

// The largest power of two <= n, and at least 1: block sizes that divide the kernels' power-of-two layouts.
constexpr int FloorPow2(int n) { return n < 2 ? 1 : 2 * FloorPow2(n / 2); }

// fn(std::integral_constant<int, n>{}) for a run-time n in [1, kMax]: the kernels' block sizes follow the
// instruction set, so their templates are instantiated up to a bound set here rather than listed by hand.
template <int kMax, typename Fn>
inline void WithBlock(int n, Fn&& fn) {
  if constexpr (kMax > 1) {
    if (n < kMax) return WithBlock<kMax - 1>(n, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

}  // namespace jaxserve

#endif  // JAXSERVE_MODEL_CPU_VEC_H_
