// pydatacopy: one error header for the whole core.
//
// Every CUDA and NVSHMEM return value is checked through these macros; a failure becomes a
// pydatacopy::Error carrying file:line, the call's text and what the caller can do about it.
// Nothing in the core calls exit() or abort() on bad input.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pydatacopy {

// The one exception type of the library (a RuntimeError subclass in Python).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A blocking wait ran past its timeout (peer dead, hung, or never called the matching operation).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& what) {
  std::ostringstream text;
  text << what << " [" << file << ":" << line << "]";
  throw Error(text.str());
}

// Defined in src/core/error.cpp so that this header stays free of the CUDA runtime headers.
[[noreturn]] void throw_cuda_error(const char* file, int line, const char* call, int code);

}  // namespace detail
}  // namespace pydatacopy

// Check a cudaError_t-returning call.
#define PDC_CHECK_CUDA(call)                                                          \
  do {                                                                                \
    const int pdc_status_ = static_cast<int>(call);                                   \
    if (pdc_status_ != 0)                                                             \
      ::pydatacopy::detail::throw_cuda_error(__FILE__, __LINE__, #call, pdc_status_); \
  } while (0)

// Check an NVSHMEM call that returns 0 on success.
#define PDC_CHECK_NVSHMEM(call)                                                             \
  do {                                                                                      \
    const int pdc_status_ = static_cast<int>(call);                                         \
    if (pdc_status_ != 0) {                                                                 \
      std::ostringstream pdc_text_;                                                         \
      pdc_text_ << #call << " failed with NVSHMEM status " << pdc_status_                   \
                << "; rerun with NVSHMEM_DEBUG=INFO for NVSHMEM's own account";             \
      ::pydatacopy::detail::throw_error(__FILE__, __LINE__, pdc_text_.str());               \
    }                                                                                       \
  } while (0)

// Argument check: `message` is streamed, so it can name the values, e.g.
// PDC_REQUIRE(n_tokens > 0, "n_tokens must be positive, got " << n_tokens);
#define PDC_REQUIRE(condition, message)                                    \
  do {                                                                     \
    if (!(condition)) {                                                    \
      std::ostringstream pdc_text_;                                        \
      pdc_text_ << message;                                                \
      ::pydatacopy::detail::throw_error(__FILE__, __LINE__, pdc_text_.str()); \
    }                                                                      \
  } while (0)
