// A small spinning thread pool for the CPU kernels of this extension.
//
// Why not at::parallel_for (OpenMP): a decode step runs ~70 short parallel regions (a few
// microseconds to a millisecond each) with Python in between. libgomp parks its workers on a
// futex between regions, and once a process has more OpenMP threads than cores (the serving
// thread's team plus the main thread's, which any torch op on the main thread creates) it stops
// spinning altogether, so every region pays a wake-up: measured ~25% of a batch-1 decode step of
// the benchmark model on a 2-core machine. These workers spin between calls for a bounded time
// (``MSTAR_SPIN_US``, default 2 ms) and then sleep on a condition variable, so a busy stream of calls never sleeps
// and an idle process burns no CPU; while spinning they yield the core to any other runnable
// thread (an OpenMP region of a torch op, another worker process).
//
// Tasks are taken from a shared counter; a task runs whole on one thread, so which thread runs
// it never changes its result. One call runs at a time (callers from other threads wait). A
// forked child makes a fresh pool (threads do not survive fork).
#pragma once

#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mstar_cpu {

constexpr int64_t kDefaultSpinMicros = 2000;  // 200 was 25% slower at batch 1: gaps are longer

// How long idle workers spin before sleeping: $MSTAR_SPIN_US, else kDefaultSpinMicros.
inline int64_t spin_micros() {
  const char* env = std::getenv("MSTAR_SPIN_US");
  return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : kDefaultSpinMicros;
}

class SpinPool {
 public:
  explicit SpinPool(int workers) : spin_(spin_micros()), pid_(getpid()) {
    // workers start from generation 0, whenever they get to run: no call is missed
    for (int i = 0; i < workers; ++i) std::thread([this] { loop(0); }).detach();
    size_ = workers;
  }

  int size() const { return size_; }
  pid_t pid() const { return pid_; }

  // fn(task) for task in [0, n): the caller and the workers take tasks until none are left.
  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> call(call_mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    pending_.store(size_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    drain();
    while (pending_.load(std::memory_order_acquire) != 0) pause();
    fn_ = nullptr;
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void drain() {
    for (int64_t t = next_.fetch_add(1, std::memory_order_relaxed); t < n_;
         t = next_.fetch_add(1, std::memory_order_relaxed))
      (*fn_)(t);
  }

  void loop(uint64_t seen) {
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        pause();
        if (++spins % 64 == 0) std::this_thread::yield();  // a runnable thread here goes first
        if (spins % 1024 == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_)) {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      drain();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int size_ = 0;
  int64_t spin_;
  pid_t pid_;
};

// The pool (workers = torch's intra-op thread count - 1 when first used; remade after a fork).
// Leaked on purpose: its detached workers may still be spinning when the process exits.
inline SpinPool& pool() {
  static std::mutex mu;
  static SpinPool* current = nullptr;
  std::lock_guard<std::mutex> lk(mu);
  if (current == nullptr || current->pid() != getpid())
    current = new SpinPool(std::max(0, at::get_num_threads() - 1));
  return *current;
}

// fn(task) for every task in [0, n), spread over the pool; inline when there is one task, one
// intra-op thread, or no worker.
inline void parallel_tasks(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 1 || at::get_num_threads() <= 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  SpinPool& p = pool();
  if (p.size() == 0) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  p.run(n, fn);
}

}  // namespace mstar_cpu
