// Test support, not part of the data path: a kernel that holds most of the GPU's SMs, so that the
// tests can check that pydatacopy's kernels make progress on the few that are left.
#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

// Every block spins until *release becomes non-zero or max_ns passes, whichever is first, then
// records in *released_by_flag whether the flag (1) or the deadline (0) ended it. The dynamic
// shared memory and the full thread count keep other kernels' blocks off the SMs it holds.
__global__ void __launch_bounds__(1024)
    occupy_kernel(const volatile int* release, int* released_by_flag, uint64_t max_ns) {
  extern __shared__ unsigned char hold[];
  const uint64_t deadline = detail::globaltimer_ns() + max_ns;
  bool by_flag = false;
  if (threadIdx.x == 0) {
    hold[0] = 1;
    while (true) {
      if (*release != 0) { by_flag = true; break; }
      if (detail::globaltimer_ns() > deadline) break;
    }
    if (!by_flag) atomicExch(released_by_flag, 0);
  }
  __syncthreads();
}

}  // namespace

void launch_occupy_sms(int blocks, int threads, std::size_t shared_bytes, const int* release,
                       int* released_by_flag, uint64_t max_ns, cudaStream_t stream) {
  PDC_CHECK_CUDA(cudaFuncSetAttribute(occupy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(shared_bytes)));
  occupy_kernel<<<blocks, threads, shared_bytes, stream>>>(release, released_by_flag, max_ns);
  PDC_CHECK_CUDA(cudaGetLastError());
}

}  // namespace pydatacopy::kernels
