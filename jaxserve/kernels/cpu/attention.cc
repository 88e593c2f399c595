// Paged attention over a ragged batch on a CPU, as an XLA FFI custom call.
//
// XLA's CPU code for these shapes (a few query rows against a long paged history, or a chunk against its own
// causal triangle) ran at several times its floors and on one core; see docs/tuning.md. This kernel takes the
// same ragged batch as `paged_attention` in jnp (q [T, H, D]; K/V pools [pages, page_size, kv_heads, D];
// page_table [S, W]; kv_lens [S]; cu_q_lens [S+1]; num_seqs []) and computes causal GQA attention over every
// sequence's pages with an online softmax. Work items are (sequence, KV head) pairs, with long chunks split into
// tiles of query rows, spread over XLA's intra-op thread pool. Padded rows come back as zeros. Vectors and register
// blocks follow the instruction set built for (vec.h); the pools' rows are read as attention_rows.h says,
// long chunks go through the tile path of attention_tile.h. A second handler reads quantized pools
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

#include "attention_rows.h"
#include "attention_tile.h"
#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve::attention;  // NOLINT: the kernel's own pieces (the two headers)

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
