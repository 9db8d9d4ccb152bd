// ParallelFor over XLA:CPU's intra-op thread pool, shared by the kernels of this directory.
#ifndef JAXINFER_CPU_KERNELS_PARALLEL_FOR_H_
#define JAXINFER_CPU_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Work below this many multiply-adds runs on the calling thread alone: waking a pool thread costs
// more than it saves (a SmolLM2 decode step at one slot: ~9 -> ~12 ms when every layer's attention
// handed a few microseconds of work to the pool). Kernels whose one-row work streams from memory pass
// a lower threshold (the products from 512K, attention from 128K).
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

// Runs body(i) for i in [0, n), `multiply_adds` of work in all (split from `min_work` on). Items are
// claimed from a shared counter by the calling thread and by helpers on the pool: a helper that starts
// late finds nothing left and returns, so the caller never waits on a task that has not begun, and
// works alone where the pool is busy or absent. `body` must stay valid until ParallelFor returns (helpers touch it only while items
// remain).
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t multiply_adds, const Body& body,
                 int64_t min_work = kMinParallelWork) {
  if (multiply_adds < min_work || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, n, &body]() {
    for (int64_t i; (i = progress->next.fetch_add(1)) < n;) {
      body(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_PARALLEL_FOR_H_
