// The host tests' two checks: each failure is printed and counted, and main() returns
// pydatacopy_test::failed != 0.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

#include "pydatacopy/error.hpp"

namespace pydatacopy_test {

inline int passed = 0, failed = 0;

inline void check(bool condition, const char* what) {
  if (condition) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s\n", what);
  }
}

// The call must throw pydatacopy::Error whose text contains `words`.
inline void check_throws(const std::function<void()>& call, const std::string& words, const char* what) {
  try {
    call();
  } catch (const pydatacopy::Error& e) {
    const bool ok = std::string(e.what()).find(words) != std::string::npos;
    if (!ok) std::printf("  message was: %s\n", e.what());
    return check(ok, what);
  } catch (...) {
    return check(false, what);
  }
  check(false, what);
}

}  // namespace pydatacopy_test
