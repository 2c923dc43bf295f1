// Kernel launchers of the core. Kernels see raw pointers and a cudaStream_t, never torch or
// Python; each launcher checks its launch and returns without synchronising.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
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

namespace pydatacopy::kernels {

// SM-store copy of `bytes` from src to dst (dst may be a peer's memory through nvshmem_ptr).
void launch_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

// One launch for many puts to `pe`: direct stores where nvshmem_ptr reaches the peer (unless
// force_rma), NVSHMEM RMA otherwise.
void launch_put_many(const void* device_descriptors, int count, int pe, bool force_rma,
                     cudaStream_t stream);

// Every PE sets its slot `my_pe` of every other PE's `signals` to `epoch`, then waits until all
// of its own slots reached `epoch` (deadline: timeout_ns). No launch when n_pes == 1.
void launch_barrier(uint64_t* signals, uint64_t epoch, int my_pe, int n_pes, uint64_t timeout_ns,
                    detail::DeviceStatus* status, cudaStream_t stream);

void launch_signal_wait(const uint64_t* signal, uint64_t value, int my_pe, uint64_t timeout_ns,
                        detail::DeviceStatus* status, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// One message of a send/recv channel (see send_recv.hpp). Addresses are this PE's symmetric
// ones; the peer_* pointers are the peer's copies through nvshmem_ptr, or null for NVSHMEM RMA.
struct ChunkStreamArgs {
  const uint8_t* src;        // send: the user's buffer
  uint8_t* dst;              // recv: the user's buffer
  int64_t bytes;
  int64_t chunk_bytes;
  int num_slots;
  uint64_t first_chunk;      // sequence number of the message's first chunk on this channel
  uint8_t* staging;          // [num_slots][chunk_bytes] of this channel, at the receiver
  uint8_t* peer_staging;
  uint64_t* arrivals;        // [num_slots][blocks] at the receiver: chunks landed
  uint64_t* peer_arrivals;
  uint64_t* credits;         // [num_slots][blocks] at the sender: chunks drained
  uint64_t* peer_credits;
  int total_blocks;          // signals per slot (the engine's block count)
  int active_blocks;         // blocks moving this message (<= total_blocks), from its size
  int my_pe, peer;
  uint64_t timeout_ns;
  detail::DeviceStatus* status;
};

// Several sends and recvs in one launch (passed by value: 16 ops stay far under the 32 KiB
// kernel-parameter limit).
constexpr int kMaxBatchOps = 16;
struct ChunkBatch {
  ChunkStreamArgs ops[kMaxBatchOps];
  bool is_send[kMaxBatchOps];
  int count;
};
void launch_chunk_batch(const ChunkBatch& batch, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// Latency probe for the benchmark: one thread bounces an 8-byte signal between two PEs
// `iterations` times (the initiator starts). Symmetric `signal` starts at zero on both.
void launch_pingpong(uint64_t* signal, int my_pe, int peer, int iterations, bool initiator,
                     uint64_t timeout_ns, detail::DeviceStatus* status, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// KV-cache style: block dst_indices[i] of the peer's dst_pool receives block src_indices[i] of
// src_pool, all blocks `block_bytes` long, one launch. Indices are device int64; one out of
// range is skipped and reported (status code 2).
struct BlockCopyArgs {
  uint8_t* dst_pool;         // symmetric, this PE's address
  const uint8_t* src_pool;
  int64_t block_bytes;
  const int64_t* dst_indices;
  const int64_t* src_indices;
  int64_t count, dst_blocks, src_blocks;
  int pe, my_pe;
  bool force_rma;
  detail::DeviceStatus* status;
};
void launch_put_blocks(const BlockCopyArgs& args, cudaStream_t stream);

}  // namespace pydatacopy::kernels
