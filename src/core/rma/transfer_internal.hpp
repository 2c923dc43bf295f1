// The one-sided calls' internals, for the core and its bindings only (not installed).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pydatacopy/transfer.hpp"

namespace pydatacopy {

// Latency probe (the benchmark's): one GPU thread bounces an 8-byte signal with `peer`
// `iterations` times; the initiator sends first. `signal` is symmetric and zero on both PEs.
void signal_pingpong(uint64_t* signal, int peer, int iterations, bool initiator,
                     cudaStream_t stream, double timeout_seconds);

// Benchmark probes, no pydatacopy logic on their path: a bare copy kernel (put's SM kernel,
// launched directly), and the host cost of the CUDA calls a send/recv makes, each timed over
// `calls` calls from C++ on `stream` (between groups the stream is synchronised, off the clock):
// (name, microseconds per call). `dst`/`src` are `bytes` of device memory for the copies.
void bench_kernel_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);
std::vector<std::pair<std::string, double>> bench_host_call_costs(void* dst, const void* src, std::size_t bytes,
                                                                  cudaStream_t stream, int calls);


}  // namespace pydatacopy
