#include <cuda_runtime.h>

#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {

[[noreturn]] void throw_cuda_error(const char* file, int line, const char* call, int code) {
  const auto status = static_cast<cudaError_t>(code);
  // A failed runtime call also leaves the thread's last error set: cleared, so that the caller's
  // next check (torch's after its own launch) does not report this one as its own. (A sticky
  // error stays: the context is lost either way.)
  cudaGetLastError();
  std::ostringstream text;
  text << call << " failed: " << cudaGetErrorName(status) << " (" << cudaGetErrorString(status)
       << ")";
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver)
    text << "; pydatacopy needs an NVIDIA GPU and driver in this process: check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES";
  else if (status == cudaErrorInvalidDevice)
    text << "; the CUDA device index is out of range: check LOCAL_RANK and CUDA_VISIBLE_DEVICES";
  else if (status == cudaErrorMemoryAllocation)
    text << "; the GPU is out of memory";
  throw_error(file, line, text.str());
}

}  // namespace pydatacopy::detail
