// When splitting an op's rows over threads pays, learned from the op's own parallel regions (CpuBackend, ops_cpu.cpp).
//
// Why: on an idle machine a region of two threads halves a 30 us product, but beside a busy process a thread is often
// descheduled (OpenMP's workers spin between regions, and the scheduler shares their core with the busy process);
// the region then waits for it, and the same product took 1-5 ms. No fixed size threshold serves both cases. So each
// split region measures itself: its threads' summed work (what one thread would need, near enough) against its wall
// time. While regions take longer than that (a running mean), ops run on the calling thread only; after a pause
// (0.1 s, doubling to 3.2 s while splitting keeps losing) one region probes again.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace specdec::glue {

class SplitGuard {
 public:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Whether the next region may split (true for one probe once the pause is over).
  bool allowed(int64_t t = now_ns()) {
    if (enabled_.load(std::memory_order_relaxed)) return true;
    int64_t probe_at = probe_at_ns_.load(std::memory_order_relaxed);
    // (one caller wins the probe; the others see the pushed-back time)
    return t >= probe_at && probe_at_ns_.compare_exchange_strong(probe_at, t + pause_ns_.load());
  }

  // One split region: `work_ns` summed over its chunks, `wall_ns` from its start to its end (at time `t`).
  void record(int64_t work_ns, int64_t wall_ns, int64_t t = now_ns()) {
    if (work_ns <= 0) return;
    const double ratio = std::min(4.0, static_cast<double>(wall_ns) / static_cast<double>(work_ns));
    if (!enabled_.load(std::memory_order_relaxed)) {  // a probe
      if (ratio < 1.0) {
        mean_ratio_.store(ratio);
        pause_ns_.store(kFirstPauseNs);
        enabled_.store(true);
      } else {
        const int64_t pause = std::min(kMaxPauseNs, 2 * pause_ns_.load());
        pause_ns_.store(pause);
        probe_at_ns_.store(t + pause);
      }
      return;
    }
    const double mean = 0.75 * mean_ratio_.load(std::memory_order_relaxed) + 0.25 * ratio;
    mean_ratio_.store(mean, std::memory_order_relaxed);
    if (mean >= 1.0) {
      probe_at_ns_.store(t + pause_ns_.load());
      enabled_.store(false);
    }
  }

  bool enabled() const { return enabled_.load(); }
  int64_t pause_ns() const { return pause_ns_.load(); }

  static constexpr int64_t kFirstPauseNs = 100'000'000, kMaxPauseNs = 3'200'000'000;

 private:
  std::atomic<bool> enabled_{true};
  std::atomic<double> mean_ratio_{0.5};
  std::atomic<int64_t> probe_at_ns_{0};
  std::atomic<int64_t> pause_ns_{kFirstPauseNs};
};

// The process's guard (one: contention is a property of the machine, not of an op).
inline SplitGuard& split_guard() {
  static SplitGuard guard;
  return guard;
}

}  // namespace specdec::glue
