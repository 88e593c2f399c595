// The tile path of jaxserve's CPU paged attention (attention.cc): long prefill chunks as small GEMMs over
// tiles of query rows, with a vector exponential for their online softmax.

#ifndef JAXSERVE_MODEL_CPU_ATTENTION_TILE_H_
#define JAXSERVE_MODEL_CPU_ATTENTION_TILE_H_

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

#include "attention_rows.h"
#include "vec.h"

namespace jaxserve::attention {

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

}  // namespace jaxserve::attention

#endif  // JAXSERVE_MODEL_CPU_ATTENTION_TILE_H_
