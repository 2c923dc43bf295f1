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

// Every signal the block owns in `slot` gets its own thread: waits and stores run in parallel
// (one by one they cost a system-scope round trip each). All threads of the block must call.
// block < 0 waits for all of the slot's signals.
__device__ __forceinline__ bool block_wait(const uint64_t* slot_signals, int block, uint64_t expected,
                                           uint64_t deadline, const ChunkStreamArgs& a,
                                           detail::WaitOp op) {
  const int j = block < 0 ? static_cast<int>(threadIdx.x)
                          : block + static_cast<int>(threadIdx.x) * a.active_blocks;
  int ok = 1;
  if (j < a.total_blocks)
    ok = detail::wait_until_at_least(slot_signals + j, expected, deadline, a.status, op, a.peer, a.my_pe);
  return __syncthreads_and(ok) != 0;
}

// After the block's copy (and a __syncthreads): raise every signal the block owns in `slot`.
__device__ __forceinline__ void block_signal(uint64_t* peer_slot_signals, uint64_t* slot_signals,
                                             int block, uint64_t value, const ChunkStreamArgs& a) {
  const int j = block + static_cast<int>(threadIdx.x) * a.active_blocks;
  if (j >= a.total_blocks) return;
  __threadfence_system();  // cumulative: covers the block's stores seen through the barrier
  if (peer_slot_signals != nullptr)
    store_release_sys(peer_slot_signals + j, value);
  else
    nvshmemx_signal_op(slot_signals + j, value, NVSHMEM_SIGNAL_SET, a.peer);
}

__device__ void send_role(const ChunkStreamArgs& a, int block) {
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t chunks = (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint64_t k = a.first_chunk + i;
    const int64_t slot = static_cast<int64_t>(k % a.num_slots);
    const int64_t signals = slot * a.total_blocks;
    // The slot is free once the receiver drained the chunk that used it num_slots ago. That
    // message may have been cut into other slices, so wait for the whole slot, not our slice.
    if (k >= static_cast<uint64_t>(a.num_slots) &&
        !block_wait(a.credits + signals, -1, k - a.num_slots + 1, deadline, a, detail::WaitOp::kChunkCredit))
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
      const int j = block + (static_cast<int>(threadIdx.x) + 1) * a.active_blocks;
      if (j < a.total_blocks)
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

// Every send and recv of a batch in one launch, each on its own range of blocks: ops that wait
// on each other must run at once, and only one grid guarantees that (kernels on two streams may
// be serialised by the hardware queues and then deadlock).
// The batch travels as the kernel's parameter; a one- or two-op batch (send, recv, sendrecv)
// uses a small copy of it, since a 2 KiB parameter block lengthens every launch.
template <int kCapacity>
struct SizedBatch {
  ChunkStreamArgs ops[kCapacity];
  bool is_send[kCapacity];
  int count;
};

template <int kCapacity>
__global__ void __launch_bounds__(kThreads) chunk_batch_kernel(const SizedBatch<kCapacity> batch) {
  int first = 0;
  for (int i = 0; i < batch.count; ++i) {
    const ChunkStreamArgs& op = batch.ops[i];
    if (static_cast<int>(blockIdx.x) < first + op.active_blocks) {
      if (batch.is_send[i])
        send_role(op, blockIdx.x - first);
      else
        recv_role(op, blockIdx.x - first);
      return;
    }
    first += op.active_blocks;
  }
}

}  // namespace

template <int kCapacity>
void launch_sized(const ChunkBatch& batch, int blocks, cudaStream_t stream) {
  SizedBatch<kCapacity> sized{};
  for (int i = 0; i < batch.count; ++i) {
    sized.ops[i] = batch.ops[i];
    sized.is_send[i] = batch.is_send[i];
  }
  sized.count = batch.count;
  chunk_batch_kernel<kCapacity><<<blocks, kThreads, 0, stream>>>(sized);
}

void launch_chunk_batch(const ChunkBatch& batch, cudaStream_t stream) {
  int blocks = 0;
  for (int i = 0; i < batch.count; ++i) blocks += batch.ops[i].active_blocks;
  if (blocks == 0) return;
  if (batch.count <= 2)
    launch_sized<2>(batch, blocks, stream);
  else
    launch_sized<kMaxBatchOps>(batch, blocks, stream);
  PDC_CHECK_CUDA(cudaGetLastError());
}

}  // namespace pydatacopy::kernels
