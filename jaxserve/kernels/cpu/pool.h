// Work spread over XLA's intra-op thread pool, for jaxserve's CPU kernels (attention.cc, matmul.cc).

#ifndef JAXSERVE_MODEL_CPU_POOL_H_
#define JAXSERVE_MODEL_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs fn(i) for every i in [0, n) on the calling thread and up to threads - 1 of the pool's; items are claimed
// one at a time, in order. Returns when every item is done. A helper that starts after the work is gone finds
// nothing to claim; it holds the shared state (and `fn`) alive, so the caller waits only for the items, never for
// the helpers themselves.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int n, int threads, Fn fn) {
  struct State {
    State(int n, Fn fn) : n(n), fn(std::move(fn)) {}
    void Run() {
      for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    const int n;
    Fn fn;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
  };
  auto state = std::make_shared<State>(n, std::move(fn));
  for (int i = 1; i < std::min(threads, n); ++i) pool.Schedule([state] { state->Run(); });
  state->Run();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_MODEL_CPU_POOL_H_
