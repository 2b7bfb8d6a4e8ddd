// SplitGuard (csrc/ops/split_guard.h), the rule that stops the CPU ops from splitting rows over threads while split
// regions lose: regions that pay keep it on, regions slower than their work turn it off, a probe after the pause
// turns it back on or doubles the pause (up to its cap), and only one caller gets each probe.
#include "../../csrc/ops/split_guard.h"

#include "check.h"

using specdec::glue::SplitGuard;

namespace {
constexpr int64_t kMs = 1'000'000;
}

TEST_CASE("regions that pay keep splitting on") {
  SplitGuard g;
  for (int i = 0; i < 100; ++i) g.record(100, 60, i * kMs);  // wall 0.6 x the work: a gain
  CHECK(g.enabled());
  CHECK(g.allowed(100 * kMs));
}

TEST_CASE("one slow region among fast ones does not turn it off") {
  SplitGuard g;
  for (int i = 0; i < 20; ++i) g.record(100, 60, i * kMs);
  g.record(100, 130, 20 * kMs);  // (a preempted region, once)
  CHECK(g.enabled());
}

TEST_CASE("regions slower than their work turn it off until the pause ends") {
  SplitGuard g;
  int64_t t = 0;
  for (int i = 0; i < 10 && g.enabled(); ++i) g.record(100, 5000, t += kMs);  // a late thread: 50x the work
  CHECK(!g.enabled());
  CHECK(!g.allowed(t + 1));
  CHECK(!g.allowed(t + SplitGuard::kFirstPauseNs - 1));
  const int64_t probe = t + SplitGuard::kFirstPauseNs;
  CHECK(g.allowed(probe));       // the probe
  CHECK(!g.allowed(probe + 1));  // only one caller gets it
  g.record(100, 60, probe + kMs);  // it paid: on again, with the first pause
  CHECK(g.enabled());
  CHECK_EQ(g.pause_ns(), SplitGuard::kFirstPauseNs);
}

TEST_CASE("a losing probe doubles the pause, up to the cap") {
  SplitGuard g;
  int64_t t = 0;
  while (g.enabled()) g.record(100, 5000, t += kMs);
  int64_t pause = SplitGuard::kFirstPauseNs;
  for (int i = 0; i < 10; ++i) {
    CHECK(!g.allowed(t + pause - 1));
    t += pause;
    CHECK(g.allowed(t));
    g.record(100, 5000, t);
    CHECK(!g.enabled());
    pause = std::min(SplitGuard::kMaxPauseNs, 2 * pause);
    CHECK_EQ(g.pause_ns(), pause);
  }
  CHECK_EQ(g.pause_ns(), SplitGuard::kMaxPauseNs);
}

TEST_CASE("an empty region records nothing") {
  SplitGuard g;
  for (int i = 0; i < 10; ++i) g.record(0, 5000, i * kMs);
  CHECK(g.enabled());
}

SPECDEC_TEST_MAIN
