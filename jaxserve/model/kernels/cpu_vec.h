// 16-float vectors for jaxserve's CPU kernels (cpu_attention.cc, cpu_matmul.cc).
//
// 16 floats in whatever SIMD registers the target has (one AVX-512 register, two AVX2 ones, ...). Written out
// rather than left to the auto-vectoriser, which turned the attention's P.V loop into gathers across keys
// (docs/tuning.md).

#ifndef JAXSERVE_MODEL_CPU_VEC_H_
#define JAXSERVE_MODEL_CPU_VEC_H_

namespace jaxserve {

typedef float Vec __attribute__((vector_size(64)));
typedef float UnalignedVec __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;

inline Vec Load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

// The sum of a vector's lanes.
inline float Sum(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

}  // namespace jaxserve

#endif  // JAXSERVE_MODEL_CPU_VEC_H_
