// Paged attention over a ragged batch on a CPU, as an XLA FFI custom call.
//
// XLA's CPU code for these shapes (a few query rows against a long paged history, or a chunk against its own
// causal triangle) ran at several times its floors and on one core; see docs/tuning.md. This kernel takes the
// same ragged batch as `paged_attention` in jnp (q [T, H, D]; K/V pools [pages, page_size, kv_heads, D];
// page_table [S, W]; kv_lens [S]; cu_q_lens [S+1]; num_seqs []) and computes causal GQA attention over every
// sequence's pages with an online softmax. Work items are (sequence, KV head) pairs, with long chunks split into
// tiles of query rows, spread over XLA's intra-op thread pool. Padded rows come back as zeros. Vectors and register
// blocks follow the instruction set built for (cpu_vec.h). A second handler reads quantized pools
// (`--kv-cache-dtype int8|fp8`, kv_quant.py): one-byte codes converted to floats in registers, and one float32
// scale per token per KV head folded into the key's scores and the value's row.

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

#include "cpu_pool.h"
#include "cpu_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// Attention of sequence s's query rows of KV head h. D is the head dimension (a template parameter so the
// inner loops unroll into whole SIMD registers).
template <int D, typename T>
void Attend(const Problem<T>& p, int s, int h, std::vector<float>& scratch) {
  const int q0 = p.cu_q_lens[s];
  const int q_len = p.cu_q_lens[s + 1] - q0;
  const int kv_len = p.kv_lens[s];
  const int ctx = kv_len - q_len;
  const int g = static_cast<int>(p.group);
  const int m_rows = q_len * g;
  scratch.resize(static_cast<size_t>(m_rows) * (2 * D + kBlockKeys + 3));
  float* qs = scratch.data();
  float* acc = qs + m_rows * D;
  float* sc = acc + m_rows * D;
  float* mx = sc + m_rows * kBlockKeys;
  float* den = mx + m_rows;
  int* limit = reinterpret_cast<int*>(den + m_rows);
  static_assert(sizeof(int) == sizeof(float));
  static_assert(D % kLanes == 0, "head_dim must be a multiple of 16");

  for (int r = 0; r < q_len; ++r) {
    for (int j = 0; j < g; ++j) {
      const int m = r * g + j;
      const float* src = p.q + ((q0 + r) * p.heads + h * g + j) * D;
      for (int d = 0; d < D; ++d) qs[m * D + d] = src[d] * p.scale;
      limit[m] = std::min(ctx + r + 1, kv_len);  // keys [0, limit) are visible to this row
      mx[m] = kMasked;
      den[m] = 0.0f;
    }
  }
  std::memset(acc, 0, sizeof(float) * m_rows * D);

  const int32_t* row = p.page_table + static_cast<int64_t>(s) * p.table_width;
  KeyBlock<T> blocks[2];
  PointKeys<D>(p, row, h, 0, std::min(kBlockKeys, kv_len), blocks[0], false);
  for (int k0 = 0, cur = 0; k0 < kv_len; k0 += kBlockKeys, cur ^= 1) {
    const int nk = std::min(kBlockKeys, kv_len - k0);
    if (k0 + kBlockKeys < kv_len) {
      PointKeys<D>(p, row, h, k0 + kBlockKeys, std::min(kBlockKeys, kv_len - k0 - kBlockKeys), blocks[cur ^ 1], true);
    }
    const T* const* kp = blocks[cur].k;
    const T* const* vp = blocks[cur].v;
    const float* ks = blocks[cur].ks;
    const float* vs = blocks[cur].vs;
    // Scores: each key row is read once for all query rows of this KV head that see it.
    // Limits grow with the row, so the rows that see any of this block are a suffix [first, m_rows); the
    // earlier rows' keys all lie in earlier blocks.
    int first = 0;
    while (first < m_rows && limit[first] <= k0) ++first;
    constexpr int C = D / kLanes;  // vectors a row
    for (int j = 0; j < nk; ++j) {
      Vec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = LoadRow(kp[j] + c * kLanes);
      if constexpr (kQuantized<T>) {
        for (int c = 0; c < C; ++c) kv[c] *= ks[j];
      }
      for (int m = first; m < m_rows; ++m) {
        const float* qm = qs + m * D;
        Vec a = Load(qm) * kv[0];
        for (int c = 1; c < C; ++c) a += Load(qm + c * kLanes) * kv[c];
        sc[m * kBlockKeys + j] = k0 + j < limit[m] ? Sum(a) : kMasked;
      }
    }
    for (int m = first; m < m_rows; ++m) {
      const int visible = std::min(nk, limit[m] - k0);
      float* sm = sc + m * kBlockKeys;
      float block_max = kMasked;
      for (int j = 0; j < visible; ++j) block_max = std::max(block_max, sm[j]);
      const float m_new = std::max(mx[m], block_max);
      const float alpha = std::exp(mx[m] - m_new);
      mx[m] = m_new;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < visible; ++j) {
        const float e = std::exp(sm[j] - m_new);
        sm[j] = e;
        sum += e;
      }
      den[m] = den[m] * alpha + sum;
      float* am = acc + m * D;
      Vec o[C];
      for (int c = 0; c < C; ++c) o[c] = Load(am + c * kLanes) * alpha;
      for (int j = 0; j < visible; ++j) {
        const T* vj = vp[j];
        float pj = sm[j];
        if constexpr (kQuantized<T>) pj *= vs[j];
        for (int c = 0; c < C; ++c) o[c] += pj * LoadRow(vj + c * kLanes);
      }
      for (int c = 0; c < C; ++c) Store(am + c * kLanes, o[c]);
    }
  }

  for (int r = 0; r < q_len; ++r) {
    for (int j = 0; j < g; ++j) {
      const int m = r * g + j;
      float* dst = p.out + ((q0 + r) * p.heads + h * g + j) * D;
      const float inv = den[m] > 0.0f ? 1.0f / den[m] : 0.0f;
      for (int d = 0; d < D; ++d) dst[d] = acc[m * D + d] * inv;
    }
  }
}

// e^x for x <= 0 (Cephes' expf polynomial, ~2 ulp), in whole vectors: the tile path exponentiates a block's
// scores a vector of rows at a time.
inline Vec Exp(Vec x) {
  const Vec lo = Vec{} - 87.0f;
  x = x < lo ? lo : x;
  const IVec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IVec);  // round(x / ln 2), x <= 0
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const IVec bits = (n + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Scores of 4 keys against NV vectors of query rows: st[kk * mp + row] = q[row] . key[kk], with q transposed
// ([D][mp]) so each key element is one broadcast against a vector of rows.
template <int D, int NV>
inline void ScoreKeys(const float* qt, int mp, const float* const* keys, float* st) {
  Vec acc[4][NV];
  for (int kk = 0; kk < 4; ++kk)
    for (int v = 0; v < NV; ++v) acc[kk][v] = Vec{};
  for (int d = 0; d < D; ++d) {
    Vec qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = Load(qt + d * mp + v * kLanes);
    for (int kk = 0; kk < 4; ++kk) {
      const float kd = keys[kk][d];
      for (int v = 0; v < NV; ++v) acc[kk][v] += kd * qv[v];
    }
  }
  for (int kk = 0; kk < 4; ++kk)
    for (int v = 0; v < NV; ++v) Store(st + kk * mp + v * kLanes, acc[kk][v]);
}

template <int D>
void ScoreBlock(const float* qt, int mp, const float* const* keys, int nk4, float* st) {
  // 4 keys x NV vectors of accumulators, NV vectors of q and a key's broadcast in the register file (AVX-512: 6,
  // 24 accumulators of its 32 registers; AVX2: 3).
  constexpr int kMaxNV = (kVecRegs - 1) / 5;
  for (int v0 = 0; v0 < mp / kLanes; v0 += kMaxNV) {
    const int nv = std::min(kMaxNV, mp / kLanes - v0);
    const float* q = qt + v0 * kLanes;
    float* s = st + v0 * kLanes;
    WithBlock<kMaxNV>(nv, [&](auto n) {
      for (int j = 0; j < nk4; j += 4) ScoreKeys<D, decltype(n)::value>(q, mp, keys + j, s + j * mp);
    });
  }
}

// P.V rows a pass of the tile path for C vectors a row: MR x C accumulators and a value row's C vectors in the
// register file, MR a power of two up to 8 that divides a vector of rows (AVX-512, D = 64: 4; AVX2: 1).
constexpr int PvRows(int c) {
  int mr = std::min(8, kLanes);
  while (mr > 1 && (mr + 1) * c > kVecRegs) mr /= 2;
  return mr;
}

// Query rows (tokens x group) per work item of the tile path, and the fewest a sequence needs to take it (fewer
// stay on the per-key path, faster for them; see docs/tuning.md).
constexpr int kTileRows = 96;
constexpr int kMinTileRows = 8;

// Attention of query tokens [r0, r1) of sequence s (chunk-relative) for KV head h, as small GEMMs: Q^T is laid
// out once per tile, each 64-key block is scored by broadcasting key elements against a vector of rows at a time,
// the online softmax runs a vector of rows at a time, and P.V accumulates a few rows' outputs in registers per key.
template <int D, typename T>
void AttendTile(const Problem<T>& p, int s, int h, int r0, int r1, std::vector<float>& scratch) {
  constexpr int C = D / kLanes;
  constexpr int MR = PvRows(C);
  const int q0 = p.cu_q_lens[s];
  const int q_len = p.cu_q_lens[s + 1] - q0;
  const int kv_len = p.kv_lens[s];
  const int ctx = kv_len - q_len;
  const int g = static_cast<int>(p.group);
  const int m_rows = (r1 - r0) * g;
  const int mp = (m_rows + kLanes - 1) / kLanes * kLanes;
  // Quantized pools: each block's keys and values are converted once into floats (times their scales) for all
  // of the tile's rows, since the score loop reads a key one broadcast element at a time.
  scratch.resize(static_cast<size_t>(mp) * (2 * D + kBlockKeys + 4) + (kQuantized<T> ? 2 * kBlockKeys * D : 0));
  float* qt = scratch.data();             // [D][mp]
  float* acc = qt + mp * D;               // [mp][D]
  float* st = acc + mp * D;               // [kBlockKeys][mp]
  float* mx = st + mp * kBlockKeys;       // [mp] running max
  float* den = mx + mp;                   // [mp] running denominator
  float* alpha = den + mp;                // [mp] this block's rescale
  float* limit = alpha + mp;              // [mp] keys [0, limit) are visible to the row
  float* kbuf = limit + mp;               // quantized pools: [kBlockKeys][D] keys, then values, as floats
  float* vbuf = kbuf + kBlockKeys * D;

  std::memset(qt, 0, sizeof(float) * mp * D);
  for (int r = r0; r < r1; ++r) {
    for (int j = 0; j < g; ++j) {
      const int m = (r - r0) * g + j;
      const float* src = p.q + ((q0 + r) * p.heads + h * g + j) * D;
      for (int d = 0; d < D; ++d) qt[d * mp + m] = src[d] * p.scale;
      limit[m] = static_cast<float>(std::min(ctx + r + 1, kv_len));
    }
  }
  for (int m = m_rows; m < mp; ++m) limit[m] = 0.0f;
  for (int m = 0; m < mp; ++m) mx[m] = kMasked, den[m] = 0.0f;
  std::memset(acc, 0, sizeof(float) * mp * D);

  const int32_t* row = p.page_table + static_cast<int64_t>(s) * p.table_width;
  const int kv_end = std::min(kv_len, ctx + r1);  // the last row's limit
  const int first_limit = ctx + r0 + 1;           // the first row's
  KeyBlock<T> blocks[2];
  PointKeys<D>(p, row, h, 0, std::min(kBlockKeys, kv_end), blocks[0], false);
  for (int k0 = 0, cur = 0; k0 < kv_end; k0 += kBlockKeys, cur ^= 1) {
    const int nk = std::min(kBlockKeys, kv_end - k0);
    const int nk4 = (nk + 3) / 4 * 4;
    if (k0 + kBlockKeys < kv_end) {
      PointKeys<D>(p, row, h, k0 + kBlockKeys, std::min(kBlockKeys, kv_end - k0 - kBlockKeys), blocks[cur ^ 1], true);
    }
    const float* kp[kBlockKeys];
    const float* vp[kBlockKeys];
    for (int j = 0; j < nk; ++j) {
      if constexpr (kQuantized<T>) {
        const KeyBlock<T>& b = blocks[cur];
        for (int c = 0; c < C; ++c) {
          Store(kbuf + j * D + c * kLanes, LoadRow(b.k[j] + c * kLanes) * b.ks[j]);
          Store(vbuf + j * D + c * kLanes, LoadRow(b.v[j] + c * kLanes) * b.vs[j]);
        }
        kp[j] = kbuf + j * D, vp[j] = vbuf + j * D;
      } else {
        kp[j] = blocks[cur].k[j], vp[j] = blocks[cur].v[j];
      }
    }
    for (int j = nk; j < nk4; ++j) kp[j] = kp[0];  // scored, then masked: every such key lies past every limit

    ScoreBlock<D>(qt, mp, kp, nk4, st);
    const bool masked = k0 + nk4 > first_limit;
    for (int v = 0; v < mp; v += kLanes) {
      const Vec lim = Load(limit + v);
      Vec block_max = Vec{} + kMasked;
      for (int j = 0; j < nk4; ++j) {
        Vec sj = Load(st + j * mp + v);
        if (masked) {
          sj = Vec{} + static_cast<float>(k0 + j) < lim ? sj : Vec{} + kMasked;
          Store(st + j * mp + v, sj);
        }
        block_max = block_max < sj ? sj : block_max;
      }
      const Vec m_old = Load(mx + v);
      const Vec m_new = m_old < block_max ? block_max : m_old;
      Vec sum = Vec{};
      for (int j = 0; j < nk4; ++j) {
        const Vec e = Exp(Load(st + j * mp + v) - m_new);
        Store(st + j * mp + v, e);
        sum += e;
      }
      const Vec a = Exp(m_old - m_new);
      Store(alpha + v, a);
      Store(mx + v, m_new);
      Store(den + v, Load(den + v) * a + sum);
    }
    for (int m = 0; m < m_rows; m += MR) {
      Vec o[MR][C];
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = Load(acc + (m + i) * D + c * kLanes) * alpha[m + i];
      for (int j = 0; j < nk; ++j) {
        Vec vv[C];
        for (int c = 0; c < C; ++c) vv[c] = Load(vp[j] + c * kLanes);
        const float* pj = st + j * mp + m;
        for (int i = 0; i < MR; ++i)
          for (int c = 0; c < C; ++c) o[i][c] += pj[i] * vv[c];
      }
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < C; ++c) Store(acc + (m + i) * D + c * kLanes, o[i][c]);
    }
  }

  for (int r = r0; r < r1; ++r) {
    for (int j = 0; j < g; ++j) {
      const int m = (r - r0) * g + j;
      float* dst = p.out + ((q0 + r) * p.heads + h * g + j) * D;
      const float inv = den[m] > 0.0f ? 1.0f / den[m] : 0.0f;
      for (int d = 0; d < D; ++d) dst[d] = acc[m * D + d] * inv;
    }
  }
}

// One work item: query tokens [r0, r1) of sequence s for KV head h. Sequences with fewer than kMinTileRows
// query rows (decodes, the smallest chunks) are one item each on the per-key dot path; longer chunks are split
// into tiles of at most kTileRows rows.
struct Item {
  int s, h, r0, r1;
  int64_t cost;  // query rows x keys they see, to hand out the largest items first
};

template <int D, typename T>
void AttendItem(const Problem<T>& p, const Item& it, std::vector<float>& scratch) {
  const int q_len = p.cu_q_lens[it.s + 1] - p.cu_q_lens[it.s];
  if (q_len * p.group < kMinTileRows) return Attend<D>(p, it.s, it.h, scratch);
  AttendTile<D>(p, it.s, it.h, it.r0, it.r1, scratch);
}

template <typename T>
void AttendAny(const Problem<T>& p, int head_dim, const Item& it, std::vector<float>& scratch) {
  switch (head_dim) {
    case 16: return AttendItem<16>(p, it, scratch);
    case 32: return AttendItem<32>(p, it, scratch);
    case 64: return AttendItem<64>(p, it, scratch);
    case 80: return AttendItem<80>(p, it, scratch);
    case 96: return AttendItem<96>(p, it, scratch);
    case 128: return AttendItem<128>(p, it, scratch);
    case 256: return AttendItem<256>(p, it, scratch);
    default: return;  // the Python side only calls the kernel for these head dimensions
  }
}

// Why q [T, H, D] and pools [pages, page_size, kvh, D] cannot run here, or "" when they can.
const char* ShapeError(ffi::Span<const int64_t> q_dims, ffi::Span<const int64_t> kv_dims, size_t table_rank) {
  if (q_dims.size() != 3 || kv_dims.size() != 4 || table_rank != 2) {
    return "paged attention: q must be [T, H, D], K/V [pages, page_size, kvh, D]";
  }
  if (kv_dims[3] != q_dims[2] || q_dims[1] % kv_dims[2] != 0) {
    return "paged attention: head dimensions of q and K/V disagree";
  }
  const int64_t d = q_dims[2];
  if (d != 16 && d != 32 && d != 64 && d != 80 && d != 96 && d != 128 && d != 256) {
    return "paged attention: head_dim must be 16, 32, 64, 80, 96, 128 or 256";
  }
  return "";
}

template <typename T>
ffi::Error Attention(ffi::ThreadPool& pool, const Problem<T>& problem, int64_t tokens, int64_t head_dim, int seqs) {
  std::vector<Item> items;
  const int32_t* cu = problem.cu_q_lens;
  float* o = problem.out;
  const int64_t heads = problem.heads, kv_heads = problem.kv_heads;
  const int64_t row_floats = heads * head_dim;
  const int32_t* lens = problem.kv_lens;
  const int group = static_cast<int>(heads / kv_heads);
  const int tile_tokens = std::max(1, kTileRows / group);
  for (int s = 0; s < seqs; ++s) {
    const int q_len = cu[s + 1] - cu[s];
    if (q_len < 1) continue;
    const int ctx = lens[s] - q_len;
    // Tiles of near-equal size: a 33-token chunk is two of 17 tokens, not 32 and 1.
    const int tiles = q_len * group < kMinTileRows ? 1 : (q_len + tile_tokens - 1) / tile_tokens;
    for (int i = 0; i < tiles; ++i) {
      const int r0 = static_cast<int>(static_cast<int64_t>(q_len) * i / tiles);
      const int r1 = static_cast<int>(static_cast<int64_t>(q_len) * (i + 1) / tiles);
      const int64_t cost = static_cast<int64_t>(r1 - r0) * (ctx + r1);
      for (int h = 0; h < kv_heads; ++h) items.push_back(Item{s, h, r0, r1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t used = seqs > 0 ? cu[seqs] : 0;
  std::memset(o + used * row_floats, 0, sizeof(float) * (tokens - used) * row_floats);

  const int n = static_cast<int>(items.size());
  // Every step's items go to every thread, however few: one thread alone reads a lone decode's pages slowly, and
  // XLA's other threads, idle meanwhile, fall asleep and start the next projection late (docs/tuning.md).
  const int threads = static_cast<int>(pool.num_threads());
  const int dim = static_cast<int>(head_dim);
  jaxserve::ParallelFor(pool, n, threads, [problem, dim, items = std::move(items)](int i) {
    thread_local std::vector<float> scratch;
    AttendAny(problem, dim, items[i], scratch);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                              ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, float scale,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_cache.dimensions();
  if (const char* e = ShapeError(q_dims, kv_dims, page_table.dimensions().size()); *e) {
    return ffi::Error::InvalidArgument(e);
  }
  const int64_t heads = q_dims[1], kv_heads = kv_dims[2];
  const Problem<float> problem{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), out->typed_data(),
                               page_table.typed_data(), kv_lens.typed_data(), cu_q_lens.typed_data(),
                               heads, kv_heads, heads / kv_heads, kv_dims[1], page_table.dimensions()[1], scale};
  return Attention(pool, problem, q_dims[0], q_dims[2], num_seqs.typed_data()[0]);
}

// The same over a quantized pool: int8 or fp8 (e4m3fn) codes and their float32 scales [pages, page_size, kvh].
ffi::Error QuantizedPagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_codes,
                                       ffi::AnyBuffer v_codes, ffi::Buffer<ffi::F32> k_scales,
                                       ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> page_table,
                                       ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                                       ffi::Buffer<ffi::S32> num_seqs, float scale,
                                       ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_codes.dimensions();
  if (const char* e = ShapeError(q_dims, kv_dims, page_table.dimensions().size()); *e) {
    return ffi::Error::InvalidArgument(e);
  }
  const auto type = k_codes.element_type();
  if (v_codes.element_type() != type || k_scales.dimensions().size() != 3 ||
      k_scales.element_count() * kv_dims[3] != k_codes.element_count()) {
    return ffi::Error::InvalidArgument("paged attention: K/V codes or scales disagree");
  }
  const int64_t heads = q_dims[1], kv_heads = kv_dims[2];
  const int seqs = num_seqs.typed_data()[0];
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> problem{q.typed_data(), static_cast<const T*>(k_codes.untyped_data()),
                       static_cast<const T*>(v_codes.untyped_data()), out->typed_data(), page_table.typed_data(),
                       kv_lens.typed_data(), cu_q_lens.typed_data(), heads, kv_heads, heads / kv_heads, kv_dims[1],
                       page_table.dimensions()[1], scale, k_scales.typed_data(), v_scales.typed_data()};
    return Attention(pool, problem, q_dims[0], q_dims[2], seqs);
  };
  if (type == ffi::DataType::S8) return run(int8_t{});
  if (type == ffi::DataType::U8 || type == ffi::DataType::F8E4M3FN) return run(uint8_t{});  // e4m3fn bits
  return ffi::Error::InvalidArgument("paged attention: quantized K/V must be int8 codes or float8_e4m3fn bits (uint8)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedPagedAttention, QuantizedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
