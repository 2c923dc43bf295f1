// Move-only owners of CUDA streams and events. Destruction never synchronises.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {

class Stream {
 public:
  Stream() = default;
  static Stream create() {
    Stream s;
    PDC_CHECK_CUDA(cudaStreamCreateWithFlags(&s.handle_, cudaStreamNonBlocking));
    return s;
  }
  Stream(Stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (handle_ != nullptr) cudaStreamDestroy(handle_);  // returns at once; work still completes
  }
  cudaStream_t get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }

 private:
  cudaStream_t handle_ = nullptr;
};

class Event {
 public:
  Event() = default;
  static Event create() {
    Event e;
    PDC_CHECK_CUDA(cudaEventCreateWithFlags(&e.handle_, cudaEventDisableTiming));
    return e;
  }
  Event(Event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (handle_ != nullptr) cudaEventDestroy(handle_);
  }
  cudaEvent_t get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }

 private:
  cudaEvent_t handle_ = nullptr;
};

}  // namespace pydatacopy::detail
