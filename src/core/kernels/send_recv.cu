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
// b + active, b + 2 * active, ... of every slot, and every op of a batch on one channel uses the
// same count. Block b of the launch drives slice b of every op of the batch (sends and recvs
// alike) with a loop that never blocks on one op: it moves whichever op's next chunk is ready.
// So a block's progress needs only its partner block (same index) of the peer's launch, and one
// resident block per GPU is enough: no co-residency is assumed, whatever the block count, the
// SMs left free by other kernels, or the shape of a group().
// Every owned page is signalled for every chunk, data or not, so that any later message, cut
// differently, finds each page's credit up to date.

// Whether every signal of the block's own pages in the slot reached `expected` (one look, no
// waiting). All threads of the block must call.
__device__ __forceinline__ bool own_pages_ready(const uint64_t* slot_signals, int block,
                                                uint64_t expected, const ChunkStreamArgs& a) {
  int ok = 1;
  for (int p = block + static_cast<int>(threadIdx.x) * a.active_blocks; ok && p < a.pages;
       p += static_cast<int>(blockDim.x) * a.active_blocks)
    ok = detail::load_acquire_sys(slot_signals + p) >= expected;
  return __syncthreads_and(ok) != 0;
}

// The deadline passed: record a page of the block's still short of `expected`. Returns false
// (for every thread) when none is short any more: the data came in since the last look, so the
// block goes on instead of giving up unrecorded. All threads of the block must call.
__device__ __forceinline__ bool report_timeout(const uint64_t* slot_signals, int block,
                                               uint64_t expected, const ChunkStreamArgs& a,
                                               detail::WaitOp op) {
  int short_page = 0;
  for (int p = block + static_cast<int>(threadIdx.x) * a.active_blocks; !short_page && p < a.pages;
       p += static_cast<int>(blockDim.x) * a.active_blocks) {
    const uint64_t seen = detail::load_acquire_sys(slot_signals + p);
    if (seen < expected) {
      detail::record_error(&a.status->timeout, detail::kTimedOut, op, a.peer, a.my_pe, expected, seen);
      short_page = 1;
    }
  }
  return __syncthreads_or(short_page) != 0;
}

// After the block's copies (and a __syncthreads): raise every signal the block owns in the slot.
// peer_slot_signals null: through NVSHMEM (signal_op), skipping the pages below `skip_below`
// (their putmem_signal raised them already).
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

__device__ __forceinline__ int64_t chunk_count(const ChunkStreamArgs& a) {
  return (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes;
}

// Chunk i of a send, on the block's own pages of its slot (whose credits are in).
__device__ void send_chunk(const ChunkStreamArgs& a, int block, int64_t i, uint64_t k) {
  const int64_t slot = static_cast<int64_t>(k % a.num_slots);
  const int64_t signals = slot * a.pages;
  const int64_t length = min(a.chunk_bytes, a.bytes - i * a.chunk_bytes);
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

// Chunk i of a recv, from the block's own pages of its slot (whose arrivals are in).
__device__ void recv_chunk(const ChunkStreamArgs& a, int block, int64_t i, uint64_t k) {
  const int64_t slot = static_cast<int64_t>(k % a.num_slots);
  const int64_t signals = slot * a.pages;
  const int64_t length = min(a.chunk_bytes, a.bytes - i * a.chunk_bytes);
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

// Once the block is done with an op (or gave up): the last block of the op's channel in this
// launch moves the channel's counter on. Every block read the counter at its start, before it
// counted itself, so the counter moves only after all of them read it.
__device__ __forceinline__ void finish_op(const ChunkStreamArgs& a, uint64_t first) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(a.done, 1u) + 1 == static_cast<unsigned>(a.channel_blocks)) {
    *a.done = 0;
    *reinterpret_cast<volatile uint64_t*>(a.sequence) = first - a.offset_chunks + a.channel_chunks;
    __threadfence();
  }
}

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
  const int block = static_cast<int>(blockIdx.x);
  // Per op: the channel's sequence number of the message's first chunk (the device counter,
  // advanced by the previous launch on the channel, plus the chunks of earlier ops of this batch
  // on it) and the next chunk to move; ops this block has no slice of start done.
  __shared__ uint64_t first[kCapacity];
  __shared__ int64_t next[kCapacity];
  if (threadIdx.x == 0) {
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      first[i] = *reinterpret_cast<volatile uint64_t*>(a.sequence) + a.offset_chunks;
      next[i] = block < a.active_blocks ? 0 : chunk_count(a);
    }
  }
  __syncthreads();
  const uint64_t start = detail::globaltimer_ns();
  bool gave_up = false;
  while (!gave_up) {
    bool all_done = true;
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      const int64_t chunk = next[i];
      if (chunk >= chunk_count(a)) continue;
      all_done = false;
      const uint64_t k = first[i] + chunk;
      const int64_t signals = static_cast<int64_t>(k % a.num_slots) * a.pages;
      // A send needs the slot drained of the chunk that used it num_slots ago; a recv needs the
      // chunk landed.
      const bool send = batch.is_send[i];
      const uint64_t* wait_on = send ? a.credits + signals : a.arrivals + signals;
      const uint64_t expected = send ? (k >= static_cast<uint64_t>(a.num_slots) ? k - a.num_slots + 1 : 0) : k + 1;
      if (!own_pages_ready(wait_on, block, expected, a)) {
        // One clock reading for the whole block (thread 0's): threads that disagreed about the
        // deadline would leave the loop apart and break the block's barriers.
        if (__syncthreads_or(threadIdx.x == 0 && detail::globaltimer_ns() - start > a.timeout_ns) &&
            report_timeout(wait_on, block, expected, a,
                           send ? detail::WaitOp::kChunkCredit : detail::WaitOp::kChunkArrival)) {
          gave_up = true;  // the channel is broken; the host reports the timeout
          break;
        }
        continue;
      }
      if (send)
        send_chunk(a, block, chunk, k);
      else
        recv_chunk(a, block, chunk, k);
      if (threadIdx.x == 0) next[i] = chunk + 1;
      __syncthreads();
    }
    if (all_done) break;
  }
  for (int i = 0; i < batch.count; ++i)
    if (block < batch.ops[i].active_blocks) finish_op(batch.ops[i], first[i]);
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
  int blocks = 0;  // block b drives slice b of every op
  for (int i = 0; i < batch.count; ++i) blocks = max(blocks, batch.ops[i].active_blocks);
  if (blocks == 0) return;
  if (batch.count <= 2)
    launch_sized<2>(batch, blocks, stream);
  else
    launch_sized<kMaxBatchOps>(batch, blocks, stream);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_send_recv_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, chunk_batch_kernel<2>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, chunk_batch_kernel<kMaxBatchOps>));
}

}  // namespace pydatacopy::kernels
