#include <nvshmem.h>
#include <nvshmemx.h>

#include "../device_status.cuh"
#include "api.cuh"
#include "copy.cuh"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kThreads = 512;

// A staging slot is cut into fixed pages, each with its own arrival and credit signal, the same
// for every message; a message moving on `active_blocks` blocks gives block b the pages b,
// b + active, b + 2 * active, ... of every slot. So a block only ever waits for the signals of its
// own pages: its progress needs its partner block on the peer (same index) and no other block
// of either launch, whatever block count or SM count (no co-residency assumed).
// Every owned page is signalled for every chunk, data or not, so that any later message, cut
// differently, finds each page's credit up to date.
__device__ __forceinline__ bool wait_own_pages(const uint64_t* slot_signals, int block, uint64_t expected,
                                               uint64_t deadline, const ChunkStreamArgs& a,
                                               detail::WaitOp op) {
  int ok = 1;
  for (int p = block + static_cast<int>(threadIdx.x) * a.active_blocks; ok && p < a.pages;
       p += static_cast<int>(blockDim.x) * a.active_blocks)
    ok = detail::wait_until_at_least(slot_signals + p, expected, deadline, a.status, op, a.peer, a.my_pe);
  return __syncthreads_and(ok) != 0;
}

// After the block's copies (and a __syncthreads): raise every signal the block owns in the slot.
// peer_slot_signals null: through NVSHMEM (signal_op), skipping the pages in `skip_below` (their
// putmem_signal raised them already).
__device__ __forceinline__ void signal_own_pages(uint64_t* peer_slot_signals, uint64_t* slot_signals,
                                                 int block, uint64_t value, const ChunkStreamArgs& a,
                                                 int skip_below) {
  bool fenced = false;
  for (int p = block + static_cast<int>(threadIdx.x) * a.active_blocks; p < a.pages;
       p += static_cast<int>(blockDim.x) * a.active_blocks) {
    if (peer_slot_signals != nullptr) {
      if (!fenced) __threadfence_system();  // cumulative: covers the block's stores seen through the barrier
      fenced = true;
      store_release_sys(peer_slot_signals + p, value);
    } else if (p >= skip_below) {
      nvshmemx_signal_op(slot_signals + p, value, NVSHMEM_SIGNAL_SET, a.peer);
    }
  }
}

// The channel's sequence number of the message's first chunk: the device counter (advanced by
// the previous launch on this channel), plus the chunks of earlier ops of this batch on it.
__device__ __forceinline__ uint64_t first_chunk(const ChunkStreamArgs& a) {
  __shared__ uint64_t base;
  if (threadIdx.x == 0) base = *reinterpret_cast<volatile uint64_t*>(a.sequence);
  __syncthreads();
  return base + a.offset_chunks;
}

// Called by every block of the op once it is done (or gave up): the last block of the channel
// in this launch moves the channel's counter on. Every block read the counter before it counted
// itself, so the counter moves only after all of them read it.
__device__ __forceinline__ void finish_block(const ChunkStreamArgs& a, uint64_t first) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(a.done, 1u) + 1 == static_cast<unsigned>(a.channel_blocks)) {
    *a.done = 0;
    *reinterpret_cast<volatile uint64_t*>(a.sequence) = first - a.offset_chunks + a.channel_chunks;
    __threadfence();
  }
}

__device__ __forceinline__ int64_t chunk_length(const ChunkStreamArgs& a, int64_t i) {
  return min(a.chunk_bytes, a.bytes - i * a.chunk_bytes);
}

__device__ void send_role(const ChunkStreamArgs& a, int block) {
  const uint64_t first = first_chunk(a);
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t chunks = (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint64_t k = first + i;
    const int64_t slot = static_cast<int64_t>(k % a.num_slots);
    const int64_t signals = slot * a.pages;
    // The slot's pages are free once the receiver drained the chunk that used it num_slots ago.
    if (k >= static_cast<uint64_t>(a.num_slots) &&
        !wait_own_pages(a.credits + signals, block, k - a.num_slots + 1, deadline, a,
                        detail::WaitOp::kChunkCredit))
      break;
    const int64_t length = chunk_length(a, i);
    const uint8_t* from = a.src + i * a.chunk_bytes;
    const int64_t to = slot * a.chunk_bytes;
    int data_pages_end = 0;  // pages below it that this block put with their own signal (RMA)
    for (int p = block; p < a.pages && p * a.page_bytes < length; p += a.active_blocks) {
      const int64_t offset = p * a.page_bytes, n = min(a.page_bytes, length - offset);
      if (a.peer_staging != nullptr) {
        copy_bytes(a.peer_staging + to + offset, from + offset, n, threadIdx.x, blockDim.x);
      } else {
        // NVSHMEM RMA: the put's own signal guarantees the page's data.
        nvshmemx_putmem_signal_block(a.staging + to + offset, from + offset, static_cast<size_t>(n),
                                     a.arrivals + signals + p, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
        data_pages_end = p + 1;
      }
    }
    __syncthreads();
    signal_own_pages(a.peer_staging != nullptr ? a.peer_arrivals + signals : nullptr,
                     a.arrivals + signals, block, k + 1, a, data_pages_end);
  }
  finish_block(a, first);
}

__device__ void recv_role(const ChunkStreamArgs& a, int block) {
  const uint64_t first = first_chunk(a);
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t chunks = (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const uint64_t k = first + i;
    const int64_t slot = static_cast<int64_t>(k % a.num_slots);
    const int64_t signals = slot * a.pages;
    if (!wait_own_pages(a.arrivals + signals, block, k + 1, deadline, a, detail::WaitOp::kChunkArrival))
      break;
    const int64_t length = chunk_length(a, i);
    for (int p = block; p < a.pages && p * a.page_bytes < length; p += a.active_blocks) {
      const int64_t offset = p * a.page_bytes;
      copy_bytes(a.dst + i * a.chunk_bytes + offset, a.staging + slot * a.chunk_bytes + offset,
                 min(a.page_bytes, length - offset), threadIdx.x, blockDim.x);
    }
    __syncthreads();
    // Our reads of the slot are done: the sender may overwrite it.
    signal_own_pages(a.peer_credits == nullptr ? nullptr : a.peer_credits + signals, a.credits + signals,
                     block, k + 1, a, 0);
  }
  finish_block(a, first);
}

// Every send and recv of a batch in one launch: ops that wait on each other must both make
// progress, and kernels on two streams may be serialised by the hardware queues. The ops' blocks
// are interleaved (block 0 of every op, then block 1 of every op, ...), so that whichever blocks
// are resident, on few free SMs too, hold partners of the peer's resident blocks.
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
  int index = static_cast<int>(blockIdx.x);
  for (int slice = 0;; ++slice) {
    bool any = false;
    for (int i = 0; i < batch.count; ++i) {
      if (batch.ops[i].active_blocks <= slice) continue;
      any = true;
      if (index-- == 0) {
        if (batch.is_send[i])
          send_role(batch.ops[i], slice);
        else
          recv_role(batch.ops[i], slice);
        return;
      }
    }
    if (!any) return;
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
