// The one-sided calls' internals, for the core and its bindings only (not installed).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pydatacopy/transfer.hpp"

namespace pydatacopy {

// Latency probe (the benchmark's): one GPU thread bounces an 8-byte signal with `peer`
// `iterations` times; the initiator sends first. `signal` is symmetric and zero on both PEs.
void signal_pingpong(uint64_t* signal, int peer, int iterations, bool initiator,
                     cudaStream_t stream, double timeout_seconds);


}  // namespace pydatacopy
