// Kernel launches that overlap the previous kernel's end on the stream (programmatic dependent
// launch, sm_90+): measured 2026-12-02 on an H200 under MPS, two back-to-back send/recv kernels on
// one stream sat 8 us apart (last block's end to the next kernel's first block), a third of a
// small message's time. With the launch marked programmatic, the GPU sets the next kernel up while
// this one finishes; every kernel launched so waits (wait_for_previous_grid) for the previous
// grid's completion and memory before it reads or writes anything, so stream order is kept.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace pydatacopy::kernels {

// First thing in a kernel launched by launch_kernel(): returns once the previous kernel on the
// stream has completed and its writes are visible (at once when it was not a programmatic launch).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next kernel on the stream may be set up now (it still waits for this whole grid's end before
// it touches memory). Its blocks then hold SMs while they wait: call it only once this block
// waits on nothing outside the grid (a kernel that still waits on a peer would keep those SMs
// from whatever the peer waits for: another stream of this PE, a PE sharing the GPU).
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether a launch may be programmatic: programmatic_launch_enabled() (api.cuh). Callers leave it
// off while capturing a CUDA graph (a graph's own launches are already close together).

template <typename... KernelParams, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelParams...), dim3 grid, dim3 block, std::size_t shared_bytes,
                   cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace pydatacopy::kernels
