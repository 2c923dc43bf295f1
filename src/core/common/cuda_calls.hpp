// Small CUDA helpers shared by the core's host files (internal).
#pragma once

#include <cuda_runtime.h>

#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {

// Driver functions through the runtime's entry point: the core links no libcuda.
template <typename Function>
Function driver_function(const char* name) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  PDC_CHECK_CUDA(cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault, &found));
  PDC_REQUIRE(found == cudaDriverEntryPointSuccess && symbol != nullptr,
              "the CUDA driver has no " << name << ": update the NVIDIA driver");
  return reinterpret_cast<Function>(symbol);
}

// This thread's CUDA calls in relaxed capture mode for the object's lifetime: calls that are not
// stream work (NVSHMEM's registration, IPC handles, event queries, a copy on a private stream)
// must neither be refused by nor invalidate a global-mode capture running on another stream.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { PDC_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace pydatacopy::detail
