// The pools' side of jaxserve's CPU paged attention (attention.cc): the problem, a pool row's elements as
// floats (float32, int8 codes, fp8 e4m3fn bits) and the pointers to a block of keys' rows, page by page.

#ifndef JAXSERVE_MODEL_CPU_ATTENTION_ROWS_H_
#define JAXSERVE_MODEL_CPU_ATTENTION_ROWS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "vec.h"

namespace jaxserve::attention {

constexpr int kBlockKeys = 64;      // keys per online-softmax step
constexpr float kMasked = -1e30f;   // finite: the kernel is built with -ffast-math, which assumes no infinities

using jaxserve::IVec;
using jaxserve::kLanes;
using jaxserve::kLineFloats;
using jaxserve::kVecRegs;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Sum;
using jaxserve::Vec;
using jaxserve::WithBlock;

// T: the pool's element: float, int8_t (int8 codes) or uint8_t (fp8 e4m3fn codes, as bits).
template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  float* out;
  const int32_t* page_table;
  const int32_t* kv_lens;
  const int32_t* cu_q_lens;
  int64_t heads, kv_heads, group, page_size, table_width;
  float scale;
  const float* k_scale = nullptr;  // quantized pools: [pages, page_size, kv_heads], one scale a row
  const float* v_scale = nullptr;
};

template <typename T>
constexpr bool kQuantized = !std::is_same_v<T, float>;

// An fp8 (e4m3fn) code's value: 2^(e-7) (1 + m/8), subnormals m 2^-9; 256 entries, for the portable build.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float mag = e == 0 ? m * 0.001953125f : std::ldexp(1.0f + m / 8.0f, e - 7);
      v[c] = c & 0x80 ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

// kLanes pool elements as floats. int8: sign-extended and converted (GCC 12 lowers __builtin_convertvector from
// int8 one lane at a time). fp8: each code's bits moved into a half's (sign to bit 15, exponent and mantissa up by
// 7), converted by vcvtph2ps and scaled by 2^8 (the biases differ by 15 - 7): exact for every code, subnormals too.
inline Vec LoadRow(const float* p) { return Load(p); }
inline Vec LoadRow(const int8_t* p) {
#if JAXSERVE_LANES == 16 && defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif JAXSERVE_LANES == 8 && defined(__AVX2__)
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}
inline Vec LoadRow(const uint8_t* p) {
#if JAXSERVE_LANES == 16 && defined(__AVX512F__)
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
  return (Vec)_mm512_cvtph_ps(h) * 256.0f;
#elif JAXSERVE_LANES == 8 && defined(__AVX2__) && defined(__F16C__)
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
  return (Vec)_mm256_cvtph_ps(h) * 256.0f;
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = kFp8.v[p[i]];
  return v;
#endif
}

// The K and V rows of a block of keys of one sequence's KV head, and (quantized pools) their scales.
template <typename T>
struct KeyBlock {
  const T* k[kBlockKeys];
  const T* v[kBlockKeys];
  float ks[kBlockKeys];
  float vs[kBlockKeys];
};

// Points `b` at the rows of keys [k0, k0 + nk) of KV head h (`row`: the sequence's page-table row), page by page:
// a page's tokens lie kv_heads * D floats apart (kBlockKeys is a multiple of any page size up to 64; a larger page
// is walked from the offset inside it). With `prefetch`, the rows are also requested into L2: the next block's,
// while the current one is computed, since a block's pages are scattered over the pool where the hardware
// prefetcher cannot follow them.
template <int D, typename T>
void PointKeys(const Problem<T>& p, const int32_t* row, int h, int k0, int nk, KeyBlock<T>& b, bool prefetch) {
  const int ps = static_cast<int>(p.page_size);
  const int64_t stride = p.kv_heads * D;
  constexpr int kLineElems = kLineFloats * sizeof(float) / sizeof(T);
  for (int j = 0; j < nk;) {
    const int t = k0 + j;
    const int in_page = t % ps;
    const int run = std::min(ps - in_page, nk - j);
    const int64_t token = static_cast<int64_t>(row[t / ps]) * ps + in_page;
    const int64_t base = token * stride + h * D;
    for (int i = 0; i < run; ++i, ++j) {
      b.k[j] = p.k + base + i * stride;
      b.v[j] = p.v + base + i * stride;
      if constexpr (kQuantized<T>) {
        b.ks[j] = p.k_scale[(token + i) * p.kv_heads + h];
        b.vs[j] = p.v_scale[(token + i) * p.kv_heads + h];
      }
      if (prefetch) {
        for (int c = 0; c < D; c += kLineElems) {
          __builtin_prefetch(b.k[j] + c, 0, 2);
          __builtin_prefetch(b.v[j] + c, 0, 2);
        }
      }
    }
  }
}

}  // namespace jaxserve::attention

#endif  // JAXSERVE_MODEL_CPU_ATTENTION_ROWS_H_
