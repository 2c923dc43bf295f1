// The low-latency protocol of send_recv.hpp on the device, inside the send/recv batch kernel
// (send_recv.cu includes this file inside its anonymous namespace, after zero_copy.cuh).
//
// A message of at most the cut travels in its slot of the receiver's ring as 8-byte lines, each
// {flag, 4 data bytes} written by one store: a line is single-copy atomic, so a reader that sees
// the flag sees its data, and no fence separates data from flag. Nothing is handshaken per
// message: the sender waits only when the slot still holds a message the receiver has not
// consumed (the ring credits kLowLatencySlots messages ahead), and the receiver posts one credit,
// a release of the ordinal + 1, once it has copied a message out.
#pragma once

namespace low_latency_detail {
constexpr int kModeLowLatency = 3;  // beside zero_copy_detail's kModeStaged / kModeZeroCopy
constexpr int64_t kSlotStride = kLowLatencySlotStride;
// Line pairs in flight per thread, each way (a 64 KiB message is 16 pairs per thread of a block).
constexpr int kUnroll = 8;

// A line's flag: the low 31 bits of the ordinal + 1 with bit 31 set, so never 0 (a ring line never
// written, zero since the rebuild, matches no message). Flags repeat every 2^31 messages of a
// channel (its epoch: (ordinal + 1) >> 31, which line 1 carries): the first message of an epoch
// in a slot clears the whole slot, fenced before its header (low_latency_send_visit), and its
// receiver fences after the header before reading data, so a line left from an earlier epoch
// never passes for the current message's.
constexpr int kEpochShift = 31;
__device__ __forceinline__ uint64_t flag_of(uint64_t message) {
  return ((message + 1) & ((1ull << kEpochShift) - 1)) | (1ull << kEpochShift);
}
__device__ __forceinline__ uint64_t epoch_of(uint64_t ordinal_plus_one) { return ordinal_plus_one >> kEpochShift; }
// Line 1's data: the epoch, with kRewritten set when the message is its slot's first of an epoch
// (the sender cleared the slot first: the receiver fences before its data loads).
constexpr uint32_t kRewritten = 1u << 31;
__device__ __forceinline__ uint32_t epoch_word(uint64_t message) {
  return static_cast<uint32_t>(epoch_of(message + 1)) & (kRewritten - 1);
}
__device__ __forceinline__ uint64_t line(uint64_t flag, uint32_t data) { return (flag << 32) | data; }

// Four bytes of `src` at `offset` (of `bytes`), zeros past the end; any alignment.
__device__ __forceinline__ uint32_t load_word(const uint8_t* src, int64_t offset, int64_t bytes) {
  if (offset + 4 <= bytes && (reinterpret_cast<uintptr_t>(src + offset) & 3) == 0)
    return *reinterpret_cast<const uint32_t*>(src + offset);
  uint32_t word = 0;
  for (int b = 0; b < 4 && offset + b < bytes; ++b) word |= static_cast<uint32_t>(src[offset + b]) << (8 * b);
  return word;
}
__device__ __forceinline__ void store_word(uint8_t* dst, int64_t offset, int64_t bytes, uint32_t word) {
  if (offset + 4 <= bytes && (reinterpret_cast<uintptr_t>(dst + offset) & 3) == 0) {
    *reinterpret_cast<uint32_t*>(dst + offset) = word;
    return;
  }
  for (int b = 0; b < 4 && offset + b < bytes; ++b) dst[offset + b] = static_cast<uint8_t>(word >> (8 * b));
}

__device__ __forceinline__ void store_pair(uint64_t* at, uint64_t first, uint64_t second) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(at), "l"(first), "l"(second) : "memory");
}
__device__ __forceinline__ void load_pair(const uint64_t* at, uint64_t& first, uint64_t& second) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(first), "=l"(second) : "l"(at) : "memory");
}
}  // namespace low_latency_detail

// Thread 0, recv side of a staged or zero-copy op: the sender sent the message by the
// low-latency protocol instead (another size, or a graph captured under another cut). Returns
// true after refusing the channel at both ends.
__device__ bool low_latency_instead(const ChunkStreamArgs& a, uint64_t message) {
  using namespace low_latency_detail;
  if (a.ll_lines == nullptr) return false;
  uint64_t header = 0, high = 0;
  load_pair(a.ll_lines + (message % kLowLatencySlots) * kSlotStride, header, high);
  const uint64_t flag = flag_of(message);
  if ((header >> 32) != flag || (high & ~static_cast<uint64_t>(kRewritten)) != line(flag, epoch_word(message)))
    return false;
  refuse_from_recv(a, header & 0xffffffffull);
  return true;
}

// All threads, send side: one visit. Returns false while the slot still holds a message the
// receiver has not consumed; else writes the message (header and data lines) and returns true.
__device__ __forceinline__ bool low_latency_send_visit(const ChunkStreamArgs& a, uint64_t message) {
  using namespace low_latency_detail;
  const int slot = static_cast<int>(message % kLowLatencySlots);
  const bool free = __syncthreads_or(threadIdx.x == 0 && detail::load_acquire_sys(a.ll_credit) >= a.ll_filled[slot]);
  if (!free) return false;
  uint64_t* lines = a.peer_ll_lines + slot * kSlotStride;
  const uint64_t flag = flag_of(message);
  // The slot's first message of an epoch clears every line of the slot first (0 matches no flag),
  // fenced before the header: no line keeps a flag of the epoch before, which this epoch's repeat.
  const uint64_t last = a.ll_filled[slot];  // ordinal + 1 of the slot's last message, 0: none
  const bool new_epoch = last != 0 && epoch_of(last) != epoch_of(message + 1);
  if (new_epoch) {
    for (int64_t p = threadIdx.x; p < (kLowLatencySlotLines - 2) / 2; p += blockDim.x) store_pair(lines + 2 + 2 * p, 0, 0);
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();  // cumulative: the block's clears, seen through the barrier
  }
  // Line 1: the epoch (and the mark of a cleared slot), so that a slot's line 0 from 2^31
  // messages earlier is no match.
  if (threadIdx.x == 0)
    store_pair(lines, line(flag, static_cast<uint32_t>(a.bytes)),
               line(flag, epoch_word(message) | (new_epoch ? kRewritten : 0u)));
  // Each thread's source words are loaded kUnroll pairs at a time before their stores: a store's
  // "memory" clobber keeps every later load behind it, so one pair a round made each thread wait
  // a load's latency per 8 bytes (64 KiB: 16 rounds a thread).
  const int64_t pairs = (a.bytes + 7) / 8;
  const int64_t threads = blockDim.x;
  const int64_t whole_pairs = a.bytes / 8;
  const bool aligned = (reinterpret_cast<uintptr_t>(a.src) & 7) == 0;
  int64_t p = threadIdx.x;
  for (; p + (kUnroll - 1) * threads < whole_pairs; p += kUnroll * threads) {
    uint2 words[kUnroll];
    if (aligned) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) words[u] = *reinterpret_cast<const uint2*>(a.src + 8 * (p + u * threads));
    } else {  // (a view at an odd offset: the same loads in flight, narrower)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        words[u] = make_uint2(load_word(a.src, 8 * (p + u * threads), a.bytes),
                              load_word(a.src, 8 * (p + u * threads) + 4, a.bytes));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      store_pair(lines + 2 + 2 * (p + u * threads), line(flag, words[u].x), line(flag, words[u].y));
  }
  for (; p < pairs; p += threads)
    store_pair(lines + 2 + 2 * p, line(flag, load_word(a.src, 8 * p, a.bytes)),
               line(flag, load_word(a.src, 8 * p + 4, a.bytes)));
  __syncthreads();
  if (threadIdx.x == 0) a.ll_filled[slot] = message + 1;
  return true;
}

// All threads, recv side: one visit (a bounded spin, `spin_ns`, while this block has nothing
// else to move). Returns kLowLatencyWaiting, kLowLatencyDone (copied out, credit posted) or
// kLowLatencyGaveUp (refused at both ends, or the watchdog). While the header has not landed it
// also looks for the message sent another way: a staged first chunk (staged_instead) or the
// refusal word (a zero-copy sender that read this recv's descriptor and found another size).
// `since` is the op's last progress, in shared memory, changed by thread 0 only.
constexpr int kLowLatencyWaiting = 0, kLowLatencyDone = 1, kLowLatencyGaveUp = 2;
__device__ __forceinline__ int low_latency_recv_visit(const ChunkStreamArgs& a, uint64_t message, uint64_t first,
                                                      uint64_t& since, uint64_t spin_ns) {
  using namespace low_latency_detail;
  const int slot = static_cast<int>(message % kLowLatencySlots);
  const uint64_t* lines = a.ll_lines + slot * kSlotStride;
  const uint64_t flag = flag_of(message);
  __shared__ int verdict;  // kLowLatencyWaiting: the header has not landed; else as returned
  __shared__ uint64_t deadline;
  if (threadIdx.x == 0) {
    deadline = detail::globaltimer_ns() + spin_ns;
    uint64_t header = 0, high = 0;
    const uint64_t want_high = line(flag, epoch_word(message));  // kRewritten aside
    const uint64_t rewritten = kRewritten;
    do {
      low_latency_detail::load_pair(lines, header, high);
    } while (((header >> 32) != flag || (high & ~rewritten) != want_high) && detail::globaltimer_ns() < deadline);
    verdict = kLowLatencyWaiting;
    if ((header >> 32) == flag && (high & ~rewritten) == want_high) {
      // A cleared slot: the data loads (after the barrier below) come after the sender's clears.
      if ((high & rewritten) != 0) __threadfence_system();
      const uint64_t sender_bytes = header & 0xffffffffull;
      if (sender_bytes == static_cast<uint64_t>(a.bytes)) {
        verdict = kLowLatencyDone;  // the header is in: the data lines follow
      } else {
        refuse_from_recv(a, sender_bytes);
        verdict = kLowLatencyGaveUp;
      }
    } else if (staged_instead(a, first, message)) {
      verdict = kLowLatencyGaveUp;
    } else if (const uint64_t broken = *reinterpret_cast<volatile uint64_t*>(a.broken); broken != 0) {
      refuse(a, detail::WaitOp::kChunkArrival, broken - 1);
      verdict = kLowLatencyGaveUp;
    } else if (channel_stalled(a, since)) {
      detail::record_timeout(a.status, detail::WaitOp::kChunkArrival, a.peer, a.my_pe, flag, header >> 32);
      atomicExch(a.failed, 1u);
      verdict = kLowLatencyGaveUp;
    }
  }
  __syncthreads();
  const int header_verdict = verdict;
  if (header_verdict != kLowLatencyDone) {
    __syncthreads();  // every thread has read it before the next visit's thread 0 writes it
    return header_verdict;
  }
  // The data: each thread its pairs of lines, kUnroll loads in flight (as the sender's), each
  // pair not yet in spun on until the deadline, copied out as they come.
  const int64_t pairs = (a.bytes + 7) / 8;
  const int64_t threads = blockDim.x;
  const bool dst_aligned = (reinterpret_cast<uintptr_t>(a.dst) & 7) == 0;
  bool all_in = true;
  auto take = [&](int64_t p, uint64_t low, uint64_t high) {
    while (((low >> 32) != flag || (high >> 32) != flag) && detail::globaltimer_ns() < deadline)
      load_pair(lines + 2 + 2 * p, low, high);
    if ((low >> 32) != flag || (high >> 32) != flag) {
      all_in = false;
      return;
    }
    if (dst_aligned && 8 * p + 8 <= a.bytes) {
      *reinterpret_cast<uint2*>(a.dst + 8 * p) = make_uint2(static_cast<uint32_t>(low), static_cast<uint32_t>(high));
      return;
    }
    store_word(a.dst, 8 * p, a.bytes, static_cast<uint32_t>(low));
    store_word(a.dst, 8 * p + 4, a.bytes, static_cast<uint32_t>(high));
  };
  int64_t p = threadIdx.x;
  for (; p + (kUnroll - 1) * threads < pairs; p += kUnroll * threads) {
    uint64_t low[kUnroll], high[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_pair(lines + 2 + 2 * (p + u * threads), low[u], high[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) take(p + u * threads, low[u], high[u]);
  }
  for (; p < pairs; p += threads) {
    uint64_t low = 0, high = 0;
    load_pair(lines + 2 + 2 * p, low, high);
    take(p, low, high);
  }
  if (!__syncthreads_and(all_in)) {
    // A sender still writing (or dead mid-message: the watchdog, on thread 0's clock).
    if (__syncthreads_or(threadIdx.x == 0 && channel_stalled(a, since))) {
      if (threadIdx.x == 0) {
        detail::record_timeout(a.status, detail::WaitOp::kChunkArrival, a.peer, a.my_pe, flag, 0);
        atomicExch(a.failed, 1u);
      }
      __syncthreads();
      return kLowLatencyGaveUp;
    }
    return kLowLatencyWaiting;
  }
  // Every line was read (the loads returned) before the credit frees the slot; the release also
  // covers the block's stores into dst, seen through the barrier.
  if (threadIdx.x == 0) {
    store_release_sys(a.peer_ll_credit, message + 1);
    moved(a, since);
  }
  __syncthreads();
  return kLowLatencyDone;
}
