#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "kernels/copy.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kExchangeThreads = 512;  // 16 warps, each moving whole tokens
constexpr int kWaitThreads = 256;

__device__ void exchange_tokens(const TokenExchangeArgs& args, uint64_t round_value) {
  const uint64_t deadline = detail::globaltimer_ns() + args.timeout_ns;
  // Tell the PE that sends to us that our receive set for this round is free.
  if (blockIdx.x == 0 && threadIdx.x == 0)
    nvshmemx_signal_op(args.credits + args.my_pe, round_value, NVSHMEM_SIGNAL_SET,
                       args.src_pe);
  // Do not write into dst before it has freed its receive set for this round.
  __shared__ int credit_ok;
  if (threadIdx.x == 0)
    credit_ok = detail::wait_until_at_least(args.credits + args.dst_pe, round_value, deadline,
                                            args.status, detail::WaitOp::kTokenCredit, args.dst_pe,
                                            args.my_pe);
  __syncthreads();
  if (!credit_ok) return;

  const int lane = threadIdx.x % 32;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (kExchangeThreads / 32);
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * (kExchangeThreads / 32) +
                             threadIdx.x / 32;
  for (int64_t token = first_warp; token < args.n_tokens; token += warps_total) {
    const int64_t offset = token * args.token_bytes;
    if (args.peer_recv != nullptr) {
      // Direct stores over NVLink, then one release store of the token's signal.
      warp_copy(args.peer_recv + offset, args.send + offset, args.token_bytes, lane);
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        store_release_sys(args.peer_signals + token, round_value);
      }
    } else {
      nvshmemx_putmem_signal_warp(args.recv + offset, args.send + offset,
                                  static_cast<size_t>(args.token_bytes), args.signals + token,
                                  round_value, NVSHMEM_SIGNAL_SET, args.dst_pe);
    }
  }
}

__global__ void __launch_bounds__(kExchangeThreads)
    token_exchange_kernel(const TokenExchangeArgs args) {
  // This use of the set: one more than the device count, which the last block moves on (every
  // block reads it before it counts itself done), so a replayed graph makes a fresh round.
  __shared__ uint64_t base;
  if (threadIdx.x == 0) base = *reinterpret_cast<volatile uint64_t*>(args.uses);
  __syncthreads();
  const uint64_t round_value = base + 1;
  exchange_tokens(args, round_value);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(args.done, 1u) + 1 == gridDim.x) {
      *args.done = 0;
      *reinterpret_cast<volatile uint64_t*>(args.uses) = round_value;
      __threadfence();
    }
  }
}

__global__ void __launch_bounds__(kWaitThreads)
    token_wait_kernel(const uint64_t* signals, int64_t n_tokens, const uint64_t* uses, int my_pe,
                      int src_pe, uint64_t timeout_ns, detail::DeviceStatus* status) {
  const uint64_t round_value = *reinterpret_cast<const volatile uint64_t*>(uses);
  const uint64_t deadline = detail::globaltimer_ns() + timeout_ns;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       token < n_tokens; token += stride) {
    if (!detail::wait_until_at_least(signals + token, round_value, deadline, status,
                                     detail::WaitOp::kTokenArrival, src_pe, my_pe))
      return;
  }
}

}  // namespace

void launch_token_exchange(const TokenExchangeArgs& args, int num_blocks, cudaStream_t stream) {
  // PYDATACOPY_CHECK_RMA: what the kernel hands NVSHMEM. The credit goes to src_pe through
  // nvshmemx_signal_op on every path; with no direct pointers (another server, or
  // PYDATACOPY_FORCE_RMA) the tokens and their signals go through nvshmemx_putmem_signal_warp.
  check_rma_remote(args.credits + args.my_pe, sizeof(uint64_t), "DoubleBufferManager.exchange: credit");
  if (args.peer_recv == nullptr) {
    const auto set_bytes = static_cast<std::size_t>(args.n_tokens * args.token_bytes);
    check_rma_local(args.send, set_bytes, "DoubleBufferManager.exchange: send set");
    check_rma_remote(args.recv, set_bytes, "DoubleBufferManager.exchange: receive set");
    check_rma_remote(args.signals, static_cast<std::size_t>(args.n_tokens) * sizeof(uint64_t),
                     "DoubleBufferManager.exchange: token signals");
  }
  token_exchange_kernel<<<num_blocks, kExchangeThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_token_wait(const uint64_t* signals, int64_t n_tokens, const uint64_t* uses, int my_pe,
                       int src_pe, uint64_t timeout_ns, detail::DeviceStatus* status,
                       int num_blocks, cudaStream_t stream) {
  token_wait_kernel<<<num_blocks, kWaitThreads, 0, stream>>>(signals, n_tokens, uses, my_pe,
                                                             src_pe, timeout_ns, status);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_token_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, token_exchange_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, token_wait_kernel));
}

}  // namespace pydatacopy::kernels
