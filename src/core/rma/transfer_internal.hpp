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

// The benchmark's floor for a copy-engine send/recv (issue 35, item 2b): one message handed over
// with a cudaMemcpyAsync and stream memory operations only, no kernel and no pydatacopy logic.
// `my_words` and `peer_words` are this PE's two symmetric words {ready, done} and the peer's
// (mapped here), zero before the first message; `message` counts from 1. A receiving PE's stream
// writes the peer's ready word; a sending PE's stream waits for its own ready word, copies `bytes`
// from `src` into `peer_dst` and writes the peer's done word; a receiving PE's stream then waits
// for its own done word. Both at once: a sendrecv. (Benchmark only: a stream wait has no timeout.)
struct CopyEngineHandoff {
  void* peer_dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  uint64_t* my_words = nullptr;
  uint64_t* peer_words = nullptr;
  bool sends = false, receives = false;
};
void bench_copy_engine_handoff(const CopyEngineHandoff& handoff, uint64_t message, cudaStream_t stream);
// The same handoff made of one kernel per PE (kernels::launch_handoff_copy): the receiver's block
// writes the peer's ready word, the sender's blocks wait for theirs, copy their spans into
// `peer_dst` and each add one to the peer's done word (after a system fence), for which the
// receiver's block waits. The floor of a zero-copy send/recv: what a rendezvous adds to a kernel's
// copy when it is all that is added (variant 0), or with what the zero-copy send/recv adds
// (kernels::kHandoff* flags, api.cuh). `my_words`/`peer_words` hold kernels::kHandoffWords +
// kHandoffBeginWords words each. (Benchmark only: a missed word ends the wait after 5 s.)
void bench_kernel_handoff(const CopyEngineHandoff& handoff, uint64_t message, unsigned variant, cudaStream_t stream);


}  // namespace pydatacopy
