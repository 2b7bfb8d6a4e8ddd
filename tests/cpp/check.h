// A tiny self-contained test harness (no downloads): TEST_CASE registers a function, CHECK* record failures
// with file:line and keep going, main() (SPECDEC_TEST_MAIN) runs every case and returns the failure count.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}
inline int& failures() {
  static int n = 0;
  return n;
}
inline int& checks() {
  static int n = 0;
  return n;
}
inline const char*& current() {
  static const char* name = "";
  return name;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};

template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
inline std::string show(float v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}
inline std::string show(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}
inline std::string show(bool v) { return v ? "true" : "false"; }

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "FAILED [%s] %s:%d: %s\n", current(), file, line, what.c_str());
}

template <typename A, typename B>
void check_eq(const A& a, const B& b, const char* ea, const char* eb, const char* file, int line) {
  ++checks();
  if (!(a == b)) fail(file, line, std::string(ea) + " == " + eb + "  (" + show(a) + " vs " + show(b) + ")");
}

inline void check_near(double a, double b, double tol, const char* ea, const char* eb, const char* file, int line) {
  ++checks();
  if (!(std::fabs(a - b) <= tol))
    fail(file, line, std::string(ea) + " ~= " + eb + "  (" + show(a) + " vs " + show(b) + ", tol " + show(tol) + ")");
}

template <typename A, typename B>
void check_vec(const std::vector<A>& a, const std::vector<B>& b, const char* ea, const char* eb, const char* file,
               int line) {
  ++checks();
  bool ok = a.size() == b.size();
  for (size_t i = 0; ok && i < a.size(); ++i) ok = a[i] == static_cast<A>(b[i]);
  if (!ok) {
    std::string sa, sb;
    for (auto& x : a) sa += show(x) + " ";
    for (auto& x : b) sb += show(x) + " ";
    fail(file, line, std::string(ea) + " == " + eb + "\n    got      [ " + sa + "]\n    expected [ " + sb + "]");
  }
}

inline int run_all(const char* prog) {
  for (auto& c : registry()) {
    current() = c.name;
    const int before = failures();
    c.fn();
    std::printf("%s %s\n", failures() == before ? "ok    " : "FAILED", c.name);
  }
  std::printf("%s: %zu cases, %d checks, %d failures\n", prog, registry().size(), checks(), failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace check

#define CHECK_CONCAT2(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT2(a, b)
#define TEST_CASE(name)                                                                    \
  static void CHECK_CONCAT(test_fn_, __LINE__)();                                          \
  static ::check::Registrar CHECK_CONCAT(test_reg_, __LINE__)(name, CHECK_CONCAT(test_fn_, __LINE__)); \
  static void CHECK_CONCAT(test_fn_, __LINE__)()

#define CHECK(cond)                                                       \
  do {                                                                    \
    ++::check::checks();                                                  \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, "CHECK(" #cond ")");   \
  } while (0)
#define CHECK_EQ(a, b) ::check::check_eq((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_NEAR(a, b, tol) ::check::check_near((a), (b), (tol), #a, #b, __FILE__, __LINE__)
#define CHECK_VEC(a, b) ::check::check_vec((a), (b), #a, #b, __FILE__, __LINE__)

#define SPECDEC_TEST_MAIN \
  int main(int, char** argv) { return ::check::run_all(argv[0]); }
