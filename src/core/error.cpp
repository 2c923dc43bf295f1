#include <cuda_runtime.h>

#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {

[[noreturn]] void throw_cuda_error(const char* file, int line, const char* call, int code) {
  const auto status = static_cast<cudaError_t>(code);
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
