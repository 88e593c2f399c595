// Paged attention for decodes and short prefill chunks on a CPU, as an XLA FFI custom call.
//
// XLA's CPU code for these shapes (a few query rows against a long paged history) ran at ~7x the KV read and on
// one core of two; see BUILD.md, "The CPU attention kernel". This kernel takes the same ragged batch as
// `paged_attention` in jnp (q [T, H, D]; K/V pools [pages, page_size, kv_heads, D]; page_table [S, W];
// kv_lens [S]; cu_q_lens [S+1]; num_seqs []) and computes, for every real sequence with at most `max_rows` query
// rows, causal GQA attention over its pages with an online softmax, one (sequence, KV head) pair per work item,
// spread over XLA's intra-op thread pool. Rows of other sequences and of padding come back as zeros.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlockKeys = 64;      // keys per online-softmax step
constexpr float kMasked = -1e30f;   // finite: the kernel is built with -ffast-math, which assumes no infinities

// 16 floats in whatever SIMD registers the target has (one AVX-512 register, two AVX2 ones, ...). Written out
// rather than left to the auto-vectoriser, which turned the P.V loop into gathers across keys.
typedef float Vec __attribute__((vector_size(64)));
typedef float UnalignedVec __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;

inline Vec Load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

inline float Sum(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int32_t* page_table;
  const int32_t* kv_lens;
  const int32_t* cu_q_lens;
  int64_t heads, kv_heads, group, page_size, table_width;
  float scale;
};

// Attention of sequence s's query rows of KV head h. D is the head dimension (a template parameter so the
// inner loops unroll into whole SIMD registers).
template <int D>
void Attend(const Problem& p, int s, int h, std::vector<float>& scratch) {
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
  const int64_t token_stride = p.kv_heads * D;
  const float* kp[kBlockKeys];
  const float* vp[kBlockKeys];
  const int ps = static_cast<int>(p.page_size);
  for (int k0 = 0; k0 < kv_len; k0 += kBlockKeys) {
    const int nk = std::min(kBlockKeys, kv_len - k0);
    // Key pointers page by page: a page's tokens lie token_stride apart (kBlockKeys is a multiple of any page
    // size up to 64; a larger page is walked from the offset inside it).
    for (int j = 0; j < nk;) {
      const int t = k0 + j;
      const int in_page = t % ps;
      const int run = std::min(ps - in_page, nk - j);
      const int64_t base = (static_cast<int64_t>(row[t / ps]) * ps + in_page) * token_stride + h * D;
      for (int i = 0; i < run; ++i, ++j) {
        kp[j] = p.k + base + i * token_stride;
        vp[j] = p.v + base + i * token_stride;
      }
    }
    // Scores: each key row is read once for all query rows of this KV head that see it.
    // Limits grow with the row, so the rows that see any of this block are a suffix [first, m_rows); the
    // earlier rows' keys all lie in earlier blocks.
    int first = 0;
    while (first < m_rows && limit[first] <= k0) ++first;
    constexpr int C = D / kLanes;  // vectors a row
    for (int j = 0; j < nk; ++j) {
      Vec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = Load(kp[j] + c * kLanes);
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
        const float* vj = vp[j];
        const float pj = sm[j];
        for (int c = 0; c < C; ++c) o[c] += pj * Load(vj + c * kLanes);
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

void AttendAny(const Problem& p, int head_dim, int s, int h, std::vector<float>& scratch) {
  switch (head_dim) {
    case 16: return Attend<16>(p, s, h, scratch);
    case 32: return Attend<32>(p, s, h, scratch);
    case 64: return Attend<64>(p, s, h, scratch);
    case 80: return Attend<80>(p, s, h, scratch);
    case 96: return Attend<96>(p, s, h, scratch);
    case 128: return Attend<128>(p, s, h, scratch);
    case 256: return Attend<256>(p, s, h, scratch);
    default: return;  // the Python side only calls the kernel for these head dimensions
  }
}

// Work shared by the calling thread and the pool's: items are claimed one at a time from `next`.
struct Work {
  Problem problem;
  int head_dim;
  std::vector<int> items;  // s * kv_heads + h
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void Run() {
    thread_local std::vector<float> scratch;
    const int n = static_cast<int>(items.size());
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const int item = items[i];
      AttendAny(problem, head_dim, item / problem.kv_heads, item % problem.kv_heads, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                              ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, float scale, int64_t max_rows,
                              int64_t min_parallel_keys, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_cache.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || page_table.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be [T, H, D], K/V [pages, page_size, kvh, D]");
  }
  const int64_t tokens = q_dims[0], heads = q_dims[1], head_dim = q_dims[2];
  const int64_t kv_heads = kv_dims[2];
  if (kv_dims[3] != head_dim || heads % kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged attention: head dimensions of q and K/V disagree");
  }
  if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 80 && head_dim != 96 && head_dim != 128 &&
      head_dim != 256) {
    return ffi::Error::InvalidArgument("paged attention: head_dim must be 16, 32, 64, 80, 96, 128 or 256");
  }

  auto work = std::make_shared<Work>();
  work->problem = Problem{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), out->typed_data(),
                          page_table.typed_data(), kv_lens.typed_data(), cu_q_lens.typed_data(),
                          heads, kv_heads, heads / kv_heads, kv_dims[1], page_table.dimensions()[1], scale};
  work->head_dim = static_cast<int>(head_dim);
  const int32_t* cu = cu_q_lens.typed_data();
  const int seqs = num_seqs.typed_data()[0];
  float* o = out->typed_data();
  const int64_t row_floats = heads * head_dim;
  int64_t keys = 0;
  for (int s = 0; s < seqs; ++s) {
    const int q_len = cu[s + 1] - cu[s];
    if (q_len < 1 || q_len > max_rows) {  // not ours: zeros (a longer chunk is the jnp path's)
      std::memset(o + cu[s] * row_floats, 0, sizeof(float) * std::max(q_len, 0) * row_floats);
      continue;
    }
    keys += static_cast<int64_t>(kv_lens.typed_data()[s]) * q_len;
    for (int h = 0; h < kv_heads; ++h) work->items.push_back(static_cast<int>(s * kv_heads + h));
  }
  const int64_t used = seqs > 0 ? cu[seqs] : 0;
  std::memset(o + used * row_floats, 0, sizeof(float) * (tokens - used) * row_floats);

  const int n = static_cast<int>(work->items.size());
  const int helpers = keys >= min_parallel_keys ? std::min<int64_t>(pool.num_threads(), n) - 1 : 0;
  // A helper that starts after the work is gone finds nothing to claim; it holds `work` alive, so the caller
  // waits only for the items, never for the helpers themselves.
  for (int i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
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
                                  .Attr<int64_t>("max_rows")
                                  .Attr<int64_t>("min_parallel_keys")
                                  .Ret<ffi::Buffer<ffi::F32>>());
