#include "common/stream_memops.hpp"

#include <cuda.h>

#include <sstream>

#include "common/cuda_calls.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {
namespace {

using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using GetErrorName = CUresult (*)(CUresult, const char**);

[[noreturn]] void throw_driver_error(const char* call, CUresult status) {
  static const GetErrorName name_of = driver_function<GetErrorName>("cuGetErrorName");
  const char* name = nullptr;
  if (name_of(status, &name) != CUDA_SUCCESS || name == nullptr) name = "an unknown CUresult";
  std::ostringstream text;
  text << call << " failed: " << name << " (" << static_cast<int>(status)
       << "); the CUDA driver refused a stream memory operation (CUDA 12's stream wait or write of a "
          "64-bit word): update the NVIDIA driver, or report it with `python -m pydatacopy.doctor`'s output";
  throw_error(__FILE__, __LINE__, text.str());
}

}  // namespace

void stream_wait_at_least(cudaStream_t stream, const uint64_t* word, uint64_t value) {
  static const WaitValue64 wait = driver_function<WaitValue64>("cuStreamWaitValue64");
  const CUresult status = wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                               CU_STREAM_WAIT_VALUE_GEQ);
  if (status != CUDA_SUCCESS) throw_driver_error("cuStreamWaitValue64", status);
}

void stream_write_word(cudaStream_t stream, uint64_t* word, uint64_t value) {
  static const WriteValue64 write = driver_function<WriteValue64>("cuStreamWriteValue64");
  const CUresult status = write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                                CU_STREAM_WRITE_VALUE_DEFAULT);
  if (status != CUDA_SUCCESS) throw_driver_error("cuStreamWriteValue64", status);
}

}  // namespace pydatacopy::detail
