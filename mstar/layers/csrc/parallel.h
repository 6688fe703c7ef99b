// How the CPU kernels of this extension spread their tasks over threads.
//
// On torch's own intra-op pool (OpenMP): one set of worker threads for torch's operators and
// these kernels. Two pools fight over the cores on a small machine: a busy-waiting pool of our own
// (the previous design) slowed a Qwen3-Omni step that mixes torch operators and these kernels,
// because libgomp's workers spin after every torch region without yielding. libgomp only
// keeps spinning while the process has no more OpenMP threads than cores; the runtime frees the
// other threads' idle pools for that reason (mstar/runtime/openmp.py).
//
// Tasks are handed out one at a time from a shared counter (uneven tasks balance); a task runs
// whole on one thread, so which thread runs it never changes its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

namespace mstar_cpu {

// The work (the caller's estimate, in multiply-adds or element steps) below which a call runs its
// tasks inline on the calling thread: waking the team and joining it costs more than the other
// thread saves on such a call (a 1-row projection of a small model, a code predictor's step), and
// in a serving process that thread may be descheduled at the join. Which thread runs a task never
// changes its bits, so this only moves time. `set_inline_work` (Python) changes it for measurements.
inline std::atomic<int64_t> inline_work{int64_t{1} << 18};

// fn(task) for every task in [0, n); inline when there is one task or one intra-op thread, when the
// call's `work` is below `inline_work`, or when called inside a parallel region.
inline void parallel_tasks(int64_t n, int64_t work, const std::function<void(int64_t)>& fn) {
  const int threads = at::get_num_threads();
  if (n <= 1 || threads <= 1 || work < inline_work.load(std::memory_order_relaxed) || at::in_parallel_region()) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, threads), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n;
         t = next.fetch_add(1, std::memory_order_relaxed))
      fn(t);
  });
}

// The same for a call whose work is not estimated: always spread over the threads.
inline void parallel_tasks(int64_t n, const std::function<void(int64_t)>& fn) {
  parallel_tasks(n, INT64_MAX, fn);
}

}  // namespace mstar_cpu
