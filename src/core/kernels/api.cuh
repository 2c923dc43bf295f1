// Kernel launchers of the core. Kernels see raw pointers and a cudaStream_t, never torch or
// Python; each launcher checks its launch and returns without synchronising.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device_status.cuh"

namespace pydatacopy::kernels {

// Per-round arguments of the token exchange; pointers are this PE's symmetric addresses.
struct TokenExchangeArgs {
  const uint8_t* send;      // this round's send set
  uint8_t* recv;            // this round's receive set (the peer's copy is written)
  uint64_t* signals;        // one per token, in the receive set's signal array
  uint64_t* credits;        // [n_pes] of this round's set: credits[q] = rounds q released to us
  uint8_t* peer_recv;       // dst's receive set through nvshmem_ptr, or null: use NVSHMEM RMA
  uint64_t* peer_signals;   // likewise for the signals
  int64_t n_tokens;
  int64_t token_bytes;
  uint64_t round_value;     // round + 1, so that zeroed signals mean "nothing yet"
  int my_pe, dst_pe, src_pe;
  uint64_t timeout_ns;
  detail::DeviceStatus* status;
};

void launch_token_exchange(const TokenExchangeArgs& args, int num_blocks, cudaStream_t stream);

void launch_token_wait(const uint64_t* signals, int64_t n_tokens, uint64_t round_value,
                       int my_pe, int src_pe, uint64_t timeout_ns, detail::DeviceStatus* status,
                       int num_blocks, cudaStream_t stream);

}  // namespace pydatacopy::kernels
