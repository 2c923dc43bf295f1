#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

__global__ void pingpong_kernel(uint64_t* signal, int my_pe, int peer, int iterations,
                                bool initiator, uint64_t timeout_ns, detail::DeviceStatus* status) {
  const uint64_t deadline = detail::globaltimer_ns() + timeout_ns;
  for (uint64_t i = 1; i <= static_cast<uint64_t>(iterations); ++i) {
    if (initiator) nvshmemx_signal_op(signal, i, NVSHMEM_SIGNAL_SET, peer);
    if (!detail::wait_until_at_least(signal, i, deadline, status, detail::WaitOp::kSignal, peer, my_pe))
      return;
    if (!initiator) nvshmemx_signal_op(signal, i, NVSHMEM_SIGNAL_SET, peer);
  }
}

}  // namespace

void launch_pingpong(uint64_t* signal, int my_pe, int peer, int iterations, bool initiator,
                     uint64_t timeout_ns, detail::DeviceStatus* status, cudaStream_t stream) {
  pingpong_kernel<<<1, 1, 0, stream>>>(signal, my_pe, peer, iterations, initiator, timeout_ns, status);
  PDC_CHECK_CUDA(cudaGetLastError());
}

}  // namespace pydatacopy::kernels
