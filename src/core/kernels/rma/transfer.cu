#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "kernels/copy.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/prepared_put_many.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"
#include "pydatacopy/transfer.hpp"
#include "rma/transfer_internal.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kCopyThreads = 512;
constexpr int64_t kBytesPerBlock = 64 << 10;  // below this a block would idle on launch overhead
static_assert(kHandoffMessageOnDeviceMaxBytes == kBytesPerBlock, "a device-numbered handoff: one block");

__global__ void __launch_bounds__(kCopyThreads)
    copy_kernel(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  // Each block takes one contiguous span so that its stores stay sequential.
  const int64_t span = (bytes + gridDim.x - 1) / gridDim.x;
  const int64_t begin = span * blockIdx.x;
  const int64_t end = begin + span < bytes ? begin + span : bytes;
  if (begin < end) copy_bytes(dst + begin, src + begin, end - begin, threadIdx.x, blockDim.x);
}

// The benchmark's floor for a one-copy send/recv made of kernels (bench_kernel_handoff): the least
// a rendezvous can add to a copy. A receiving PE's block 0 says it is ready in the sender's word;
// each sending block waits for that word, copies its span straight into the receiver's buffer,
// then (one system fence) adds one to the receiver's done word, which the receiver waits for.
// No descriptor, no table, no cancellation, no watchdog beyond a deadline that keeps a benchmark
// from hanging: a wait that reaches it sets this PE's timed-out word (a sender then copies
// nothing), which the row's check reads. Words as CopyEngineHandoff: {ready, done, resolved,
// timed out, begin[kHandoffBeginWords]}. `variant` adds, one by one, what the zero-copy send/recv
// does beyond this (api.cuh, kHandoff*), so that an experiment can price each.
__global__ void __launch_bounds__(kCopyThreads)
    handoff_copy_kernel(uint8_t* peer_dst, const uint8_t* src, int64_t bytes, uint64_t* my_words,
                        uint64_t* peer_words, bool sends, bool receives, uint64_t message, int sender_blocks,
                        uint64_t wait_ns, unsigned variant, const uint64_t* host_word) {
  constexpr int kReady = 0, kDone = 1, kResolved = 2, kTimedOut = 3, kMessage = kHandoffMessageWord,
                kBegin = kHandoffWords;
  const uint64_t deadline = detail::globaltimer_ns() + wait_ns;
  if (variant & kHandoffMessageOnDevice) {  // one block (the launcher's): the last kernel's word, in stream order
    __shared__ uint64_t next;
    if (threadIdx.x == 0) next = *reinterpret_cast<volatile uint64_t*>(my_words + kMessage) + 1;
    __syncthreads();
    message = next;
  }
  // Thread 0: waits until *word reaches `value`; at the deadline, says so in the timed-out word.
  const auto wait_for = [&](const uint64_t* word, uint64_t value, bool gpu_scope) {
    while ((gpu_scope ? load_acquire_gpu(word) : detail::load_acquire_sys(word)) < value)
      if (detail::globaltimer_ns() > deadline) {
        *reinterpret_cast<volatile uint64_t*>(my_words + kTimedOut) = 1;
        return false;
      }
    return true;
  };
  if (receives && blockIdx.x == 0 && threadIdx.x == 0) store_release_sys(peer_words + kReady, message);
  if (sends) {
    __shared__ bool ready;
    if (threadIdx.x == 0) {
      ready = wait_for(my_words + kReady, message, false);
      if (ready && (variant & kHandoffResolve)) {  // block 0 reads a host-mapped word, the others wait for it
        if (blockIdx.x == 0)
          store_release_gpu(my_words + kResolved,
                            message + (*reinterpret_cast<const volatile uint64_t*>(host_word) & 0));
        else
          ready = wait_for(my_words + kResolved, message, true);
      }
      if (ready && (variant & kHandoffBegin)) {  // zero_copy_begin: a word at the receiver, a fence, two looks
        *reinterpret_cast<volatile uint64_t*>(peer_words + kBegin + blockIdx.x % kHandoffBeginWords) = message;
        __threadfence_system();
        __shared__ volatile uint64_t looked;  // the two looks must happen: kept
        looked = *reinterpret_cast<volatile uint64_t*>(my_words + kDone) +
                 *reinterpret_cast<volatile uint64_t*>(my_words + kReady);
      }
    }
    __syncthreads();
    if (!ready) return;  // every thread of the block alike: nothing written, the row fails
    const int64_t span = (bytes + gridDim.x - 1) / gridDim.x;
    const int64_t begin = span * blockIdx.x, end = begin + span < bytes ? begin + span : bytes;
    if (begin < end) copy_bytes<8, true>(peer_dst + begin, src + begin, end - begin, threadIdx.x, blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // cumulative: the block's stores, seen through the barrier
      atomicAdd_system(reinterpret_cast<unsigned long long*>(peer_words + kDone), 1ull);
    }
  }
  if (receives && blockIdx.x == 0 && threadIdx.x == 0) wait_for(my_words + kDone, message * sender_blocks, false);
  if ((variant & kHandoffMessageOnDevice) && threadIdx.x == 0) my_words[kMessage] = message;
}

// A put_many table in kernel parameters, sized by the launch (a short list does not carry the
// largest table).
template <int kRows>
struct PutManyTable {
  TransferDescriptor rows[kRows];
};
static_assert(sizeof(PutManyTable<kPutManyRowsPerLaunch>) + 64 <= 32764,
              "put_many's table must fit in the kernel parameters");

// __grid_constant__: rows indexed at run time are read from the parameter space, not copied
// into every thread's local memory.
template <int kRows>
__global__ void __launch_bounds__(kCopyThreads)
    put_many_kernel(const __grid_constant__ PutManyTable<kRows> table, int count, int pe, bool force_rma) {
  // One warp per descriptor: small tensors of a KV-cache block list each get a warp.
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kCopyThreads / 32);
  for (int i = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; i < count; i += warps) {
    const TransferDescriptor& d = table.rows[i];
    void* dst = reinterpret_cast<void*>(d.dst);
    const void* src = reinterpret_cast<const void*>(d.src);
    void* peer = force_rma ? nullptr : nvshmem_ptr(dst, pe);
    if (peer != nullptr)
      warp_copy(static_cast<uint8_t*>(peer), static_cast<const uint8_t*>(src),
                static_cast<int64_t>(d.bytes), lane);
    else
      nvshmemx_putmem_warp(dst, src, d.bytes, pe);
  }
}

template <int kRows>
void launch_put_many_rows(const TransferDescriptor* rows, int count, int pe, bool force_rma,
                          cudaStream_t stream) {
  PutManyTable<kRows> table;
  std::copy(rows, rows + count, table.rows);
  const int warps_per_block = kCopyThreads / 32;
  const int blocks = std::min((count + warps_per_block - 1) / warps_per_block, multiprocessor_count());
  put_many_kernel<kRows><<<blocks, kCopyThreads, 0, stream>>>(table, count, pe, force_rma);
  PDC_CHECK_CUDA(cudaGetLastError());
}

// One warp per row of the table in device memory (rows of any size: prepare cut long ones).
__global__ void __launch_bounds__(kCopyThreads)
    prepared_put_many_kernel(const PreparedRow* rows, int64_t count, int pe, bool force_rma) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kCopyThreads / 32);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kCopyThreads / 32) + threadIdx.x / 32; i < count;
       i += warps) {
    const PreparedRow row = rows[i];  // one 32-byte load, the same address for the whole warp
    const auto* src = reinterpret_cast<const uint8_t*>(row.src);
    if (row.peer != 0 && !force_rma)
      warp_copy(reinterpret_cast<uint8_t*>(row.peer), src, static_cast<int64_t>(row.bytes), lane);
    else
      nvshmemx_putmem_warp(reinterpret_cast<void*>(row.dst), src, row.bytes, pe);
  }
}

__global__ void __launch_bounds__(kCopyThreads) put_blocks_kernel(const BlockCopyArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kCopyThreads / 32);
  uint8_t* peer_pool = a.force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(a.dst_pool, a.pe));
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kCopyThreads / 32) + threadIdx.x / 32;
       i < a.count; i += warps) {
    const int64_t d = a.dst_indices[i], s = a.src_indices[i];
    if (d < 0 || d >= a.dst_blocks || s < 0 || s >= a.src_blocks) {
      if (lane == 0)
        detail::report_bad_input(a.status, detail::WaitOp::kBlockIndex, a.my_pe,
                                 static_cast<uint64_t>(d < 0 || d >= a.dst_blocks ? d : s),
                                 static_cast<uint64_t>(d < 0 || d >= a.dst_blocks ? a.dst_blocks : a.src_blocks));
      continue;
    }
    const uint8_t* from = a.src_pool + s * a.block_bytes;
    if (peer_pool != nullptr)
      warp_copy(peer_pool + d * a.block_bytes, from, a.block_bytes, lane);
    else
      nvshmemx_putmem_warp(a.dst_pool + d * a.block_bytes, from, static_cast<size_t>(a.block_bytes), a.pe);
  }
}

__global__ void signal_wait_kernel(const uint64_t* signal, uint64_t value, int my_pe,
                                   uint64_t timeout_ns, detail::DeviceStatus* status) {
  const uint64_t deadline = detail::globaltimer_ns() + timeout_ns;
  detail::wait_until_at_least(signal, value, deadline, status, detail::WaitOp::kSignal, my_pe, my_pe);
}

// One block. The epoch comes from a device counter (so a replayed CUDA graph gets a fresh one);
// arrivals are added, never set, so they only grow whatever order barriers run in. With `votes`,
// every PE first writes `vote` into its slot of every PE's votes (ordered before the arrival by
// nvshmem_fence), so that after the barrier each PE holds every PE's vote.
__global__ void barrier_kernel(uint64_t* signals, uint64_t* epoch_counter, uint64_t* votes,
                               uint64_t vote, int my_pe, int n_pes, uint64_t timeout_ns,
                               detail::DeviceStatus* status) {
  __shared__ uint64_t epoch;
  if (threadIdx.x == 0) epoch = atomicAdd(reinterpret_cast<unsigned long long*>(epoch_counter), 1ull) + 1;
  __syncthreads();
  const uint64_t deadline = detail::globaltimer_ns() + timeout_ns;
  for (int pe = threadIdx.x; pe < n_pes; pe += blockDim.x) {
    if (pe == my_pe) continue;
    if (votes != nullptr) {
      nvshmem_uint64_p(votes + my_pe, vote, pe);
      nvshmem_fence();
    }
    nvshmemx_signal_op(signals + my_pe, 1, NVSHMEM_SIGNAL_ADD, pe);
  }
  for (int pe = threadIdx.x; pe < n_pes; pe += blockDim.x)
    if (pe != my_pe &&
        !detail::wait_until_at_least(signals + pe, epoch, deadline, status, detail::WaitOp::kBarrier,
                                     pe, my_pe))
      break;
}

}  // namespace

void launch_barrier(uint64_t* signals, uint64_t* epoch_counter, uint64_t* votes, uint64_t vote,
                    int my_pe, int n_pes, uint64_t timeout_ns, detail::DeviceStatus* status,
                    cudaStream_t stream) {
  if (n_pes <= 1) return;
  const int threads = std::min(1024, (n_pes + 31) / 32 * 32);
  barrier_kernel<<<1, threads, 0, stream>>>(signals, epoch_counter, votes, vote, my_pe, n_pes,
                                            timeout_ns, status);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  const int64_t wanted = (static_cast<int64_t>(bytes) + kBytesPerBlock - 1) / kBytesPerBlock;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, multiprocessor_count()));
  copy_kernel<<<blocks, kCopyThreads, 0, stream>>>(static_cast<uint8_t*>(dst),
                                                   static_cast<const uint8_t*>(src),
                                                   static_cast<int64_t>(bytes));
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_handoff_copy(void* peer_dst, const void* src, std::size_t bytes, uint64_t* my_words,
                         uint64_t* peer_words, bool sends, bool receives, uint64_t message, uint64_t wait_ns,
                         unsigned variant, const uint64_t* host_word, cudaStream_t stream) {
  if (!sends && !receives) return;
  // As launch_copy's grid: both PEs derive the sender's block count from the bytes alone.
  const int64_t wanted = (static_cast<int64_t>(std::max<std::size_t>(bytes, 1)) + kBytesPerBlock - 1) / kBytesPerBlock;
  const int per_sm = (variant & kHandoffTwoBlocksPerSm) ? 2 : 1;
  const int sender_blocks = static_cast<int>(std::min<int64_t>(wanted * per_sm, per_sm * multiprocessor_count()));
  PDC_REQUIRE(!(variant & kHandoffMessageOnDevice) || sender_blocks == 1,
              "handoff: a message number on the device needs one block (at most "
                  << kHandoffMessageOnDeviceMaxBytes << " bytes, one block a multiprocessor)");
  handoff_copy_kernel<<<sends ? sender_blocks : 1, kCopyThreads, 0, stream>>>(
      static_cast<uint8_t*>(peer_dst), static_cast<const uint8_t*>(src), static_cast<int64_t>(bytes), my_words,
      peer_words, sends, receives, message, sender_blocks, wait_ns, variant, host_word);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_put_many(const TransferDescriptor* host_descriptors, int count, int pe, bool force_rma,
                     cudaStream_t stream) {
  for (int first = 0; first < count; first += kPutManyRowsPerLaunch) {
    const int rows = std::min(count - first, kPutManyRowsPerLaunch);
    const TransferDescriptor* part = host_descriptors + first;
    if (rows <= 32)
      launch_put_many_rows<32>(part, rows, pe, force_rma, stream);
    else if (rows <= 256)
      launch_put_many_rows<256>(part, rows, pe, force_rma, stream);
    else
      launch_put_many_rows<kPutManyRowsPerLaunch>(part, rows, pe, force_rma, stream);
  }
}

void launch_prepared_put_many(const PreparedRow* device_rows, int64_t count, int pe, bool force_rma,
                              cudaStream_t stream) {
  if (count == 0) return;
  const int64_t warps_per_block = kCopyThreads / 32;
  // As put_blocks: a warp per row, at most a block per SM.
  const int blocks = static_cast<int>(
      std::min<int64_t>((count + warps_per_block - 1) / warps_per_block, multiprocessor_count()));
  prepared_put_many_kernel<<<blocks, kCopyThreads, 0, stream>>>(device_rows, count, pe, force_rma);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_put_blocks(const BlockCopyArgs& args, cudaStream_t stream) {
  if (args.count == 0) return;
  const int64_t warps_per_block = kCopyThreads / 32;
  const int blocks = static_cast<int>(
      std::min<int64_t>((args.count + warps_per_block - 1) / warps_per_block, multiprocessor_count()));
  put_blocks_kernel<<<blocks, kCopyThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_signal_wait(const uint64_t* signal, uint64_t value, int my_pe, uint64_t timeout_ns,
                        detail::DeviceStatus* status, cudaStream_t stream) {
  signal_wait_kernel<<<1, 1, 0, stream>>>(signal, value, my_pe, timeout_ns, status);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_send_recv_kernels();
void preload_token_kernels();
void preload_all_to_all_kernels();
void preload_moe_layout_large_kernels();

void preload_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, copy_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, handoff_copy_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, put_many_kernel<32>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, put_many_kernel<256>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, put_many_kernel<kPutManyRowsPerLaunch>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, put_blocks_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, prepared_put_many_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, signal_wait_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, barrier_kernel));
  preload_send_recv_kernels();
  preload_token_kernels();
  preload_all_to_all_kernels();
  preload_moe_layout_large_kernels();
}

}  // namespace pydatacopy::kernels
