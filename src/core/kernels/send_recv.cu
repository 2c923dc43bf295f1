#include <nvshmem.h>
#include <nvshmemx.h>

#include "../device_status.cuh"
#include "api.cuh"
#include "copy.cuh"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kThreads = 512;

struct Slice {
  int64_t offset, length;  // of this block's part of chunk i
};

// A message moves on `active_blocks` blocks, which both sides derive from its size; every slot
// still has `total_blocks` signals (the engine's block count), so that messages of any size can
// share the slots: block b owns signals b, b + active, b + 2 * active, ...
__device__ __forceinline__ Slice block_slice(const ChunkStreamArgs& a, int64_t chunk_index, int block) {
  const int64_t chunk_start = chunk_index * a.chunk_bytes;
  const int64_t chunk_length = min(a.chunk_bytes, a.bytes - chunk_start);
  int64_t slice = (chunk_length + a.active_blocks - 1) / a.active_blocks;
  slice = (slice + 15) / 16 * 16;  // 16-byte-aligned slices inside the staging slot
  const int64_t offset = slice * block;
  const int64_t length = offset < chunk_length ? min(slice, chunk_length - offset) : 0;
  return {offset, length};
}

// Thread 0 waits for every signal the block owns in `slot`; the whole block learns the outcome.
__device__ __forceinline__ bool block_wait(const uint64_t* slot_signals, int block, uint64_t expected,
                                           uint64_t deadline, const ChunkStreamArgs& a,
                                           detail::WaitOp op) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int j = block; j < a.total_blocks && ok; j += a.active_blocks)
      ok = detail::wait_until_at_least(slot_signals + j, expected, deadline, a.status, op, a.peer, a.my_pe);
  }
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();  // `ok` is reused by the next wait
  return result;
}

// Thread 0 raises every signal the block owns in `slot`, after the block's copy is visible.
__device__ __forceinline__ void block_signal(uint64_t* peer_slot_signals, uint64_t* slot_signals,
                                             int block, uint64_t value, const ChunkStreamArgs& a) {
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int j = block; j < a.total_blocks; j += a.active_blocks) {
    if (peer_slot_signals != nullptr)
      store_release_sys(peer_slot_signals + j, value);
    else
      nvshmemx_signal_op(slot_signals + j, value, NVSHMEM_SIGNAL_SET, a.peer);
  }
}

__device__ void send_role(const ChunkStreamArgs& a, int block) {
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t chunks = (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint64_t k = a.first_chunk + i;
    const int64_t slot = static_cast<int64_t>(k % a.num_slots);
    const int64_t signals = slot * a.total_blocks;
    // The slot is free once the receiver drained the chunk that used it num_slots ago.
    if (k >= static_cast<uint64_t>(a.num_slots) &&
        !block_wait(a.credits + signals, block, k - a.num_slots + 1, deadline, a, detail::WaitOp::kChunkCredit))
      return;
    const Slice s = block_slice(a, i, block);
    const uint8_t* from = a.src + i * a.chunk_bytes + s.offset;
    const int64_t to = slot * a.chunk_bytes + s.offset;
    if (a.peer_staging != nullptr) {
      copy_bytes(a.peer_staging + to, from, s.length, threadIdx.x, blockDim.x);
      __syncthreads();
      block_signal(a.peer_arrivals + signals, a.arrivals + signals, block, k + 1, a);
    } else {
      // NVSHMEM RMA: the put's own signal (signal `block`) guarantees the data; the block's
      // other signals only keep the slot's bookkeeping.
      nvshmemx_putmem_signal_block(a.staging + to, from, static_cast<size_t>(s.length),
                                   a.arrivals + signals + block, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
      if (threadIdx.x == 0)
        for (int j = block + a.active_blocks; j < a.total_blocks; j += a.active_blocks)
          nvshmemx_signal_op(a.arrivals + signals + j, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
    }
  }
}

__device__ void recv_role(const ChunkStreamArgs& a, int block) {
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t chunks = (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint64_t k = a.first_chunk + i;
    const int64_t slot = static_cast<int64_t>(k % a.num_slots);
    const int64_t signals = slot * a.total_blocks;
    if (!block_wait(a.arrivals + signals, block, k + 1, deadline, a, detail::WaitOp::kChunkArrival))
      return;
    const Slice s = block_slice(a, i, block);
    copy_bytes(a.dst + i * a.chunk_bytes + s.offset, a.staging + slot * a.chunk_bytes + s.offset,
               s.length, threadIdx.x, blockDim.x);
    __syncthreads();
    // Our reads of the slot are done: the sender may overwrite it.
    block_signal(a.peer_credits == nullptr ? nullptr : a.peer_credits + signals, a.credits + signals,
                 block, k + 1, a);
  }
}

__global__ void __launch_bounds__(kThreads) chunk_send_kernel(const ChunkStreamArgs a) {
  send_role(a, blockIdx.x);
}

__global__ void __launch_bounds__(kThreads) chunk_recv_kernel(const ChunkStreamArgs a) {
  recv_role(a, blockIdx.x);
}

// send and recv in one launch: the first send.active_blocks blocks send, the rest receive.
__global__ void __launch_bounds__(kThreads)
    chunk_sendrecv_kernel(const ChunkStreamArgs send, const ChunkStreamArgs recv) {
  if (static_cast<int>(blockIdx.x) < send.active_blocks)
    send_role(send, blockIdx.x);
  else
    recv_role(recv, blockIdx.x - send.active_blocks);
}

__global__ void signal_span_kernel(uint64_t* signals, int count, uint64_t value) {
  __threadfence_system();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    store_release_sys(signals + i, value);
}

__global__ void wait_span_kernel(const uint64_t* signals, int count, uint64_t value, int my_pe,
                                 int peer, detail::WaitOp op, uint64_t timeout_ns,
                                 detail::DeviceStatus* status) {
  const uint64_t deadline = detail::globaltimer_ns() + timeout_ns;
  for (int i = threadIdx.x; i < count; i += blockDim.x)
    if (!detail::wait_until_at_least(signals + i, value, deadline, status, op, peer, my_pe)) return;
}

}  // namespace

void launch_signal_span(uint64_t* signals, int count, uint64_t value, cudaStream_t stream) {
  const int blocks = count > 4096 ? 32 : 1;
  signal_span_kernel<<<blocks, 128, 0, stream>>>(signals, count, value);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_wait_span(const uint64_t* signals, int count, uint64_t value, int my_pe, int peer,
                      detail::WaitOp op, uint64_t timeout_ns, detail::DeviceStatus* status,
                      cudaStream_t stream) {
  wait_span_kernel<<<1, 128, 0, stream>>>(signals, count, value, my_pe, peer, op, timeout_ns, status);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_chunk_send(const ChunkStreamArgs& args, cudaStream_t stream) {
  chunk_send_kernel<<<args.active_blocks, kThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_chunk_recv(const ChunkStreamArgs& args, cudaStream_t stream) {
  chunk_recv_kernel<<<args.active_blocks, kThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_chunk_sendrecv(const ChunkStreamArgs& send, const ChunkStreamArgs& recv,
                           cudaStream_t stream) {
  chunk_sendrecv_kernel<<<send.active_blocks + recv.active_blocks, kThreads, 0, stream>>>(send, recv);
  PDC_CHECK_CUDA(cudaGetLastError());
}

}  // namespace pydatacopy::kernels
