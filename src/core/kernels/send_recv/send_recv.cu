#include <cuda.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "kernels/copy.cuh"
#include "kernels/launch.cuh"
#include "kernels/send_recv/batch_order.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kThreads = 512;
constexpr uint64_t kDescriptorSpinNs = 4000;  // a visit's bounded spin: a send on its descriptor, a recv on its words
// kMaxSlicesPerBlock (api.cuh): the grid is cut to what can be resident at once, so a message's
// slices never wait for blocks that start only when others end.

// A staging slot is cut into fixed pages, each with its own arrival and credit signal, the same
// for every message; a message moving on `page_slices` slices gives slice s the pages s,
// s + page_slices, s + 2 * page_slices, ... of every slot, and every op of a batch on one channel
// uses the same count. (A send that awaits a zero-copy descriptor launches more slices than that,
// `active_blocks`, one per part of a zero-copy message; if it moves staged after all, its slices
// from page_slices on have no pages and end at once.) Block b of the launch drives slices b,
// b + grid, ... of every op of the batch (sends and recvs alike) with a loop that never blocks on
// one op: it moves whichever slice's next chunk is ready. Slice s needs only slice s of the peer's
// launch, and the grid is no larger than what can be resident, so no slice waits for another
// block to end: a dead peer's op holds no live op back.
//
// Only the pages a chunk fills are signalled (send_recv.hpp): the receiver waits for the
// arrival (sequence + 1) of the pages its chunk fills; the sender remembers in `filled` which
// sequence last put data into each page of each slot and waits for that page's credit to reach
// it. Signals only grow, and a page untouched by later chunks keeps the credit of the last
// chunk that used it, which is what `filled` asks for; so any later message, cut differently,
// finds every page's state up to date.

// An empty message still moves one chunk: a header with no data on one page, checked and
// credited like any other, so that the byte-count handshake sees it (a 0-byte recv facing a
// 4 KiB send is a mismatch, not a silent shift of every later message by one).
__device__ __forceinline__ int64_t chunk_count(const ChunkStreamArgs& a) {
  return max(int64_t{1}, (a.bytes + a.chunk_bytes - 1) / a.chunk_bytes);
}

__device__ __forceinline__ int64_t chunk_length(const ChunkStreamArgs& a, int64_t i) {
  return min(a.chunk_bytes, a.bytes - i * a.chunk_bytes);
}

// Pages chunk i fills (one, header only, for an empty message).
__device__ __forceinline__ int data_pages(const ChunkStreamArgs& a, int64_t i) {
  return max(1, static_cast<int>((chunk_length(a, i) + a.page_bytes - 1) / a.page_bytes));
}


// The channel made no progress for the timeout: record a page of the slice still short.
// Returns false (for every thread) when none is short any more: the data came in since the last
// look, so the block goes on instead of giving up unrecorded. All threads of the block must call.
__device__ __forceinline__ bool report_timeout(const ChunkStreamArgs& a, bool send, int slice,
                                               int64_t i, uint64_t k) {
  const int64_t signals = static_cast<int64_t>(k % a.num_slots) * a.pages;
  const int pages = data_pages(a, i);
  int short_page = 0;
  for (int p = slice + static_cast<int>(threadIdx.x) * a.page_slices; !short_page && p < pages;
       p += static_cast<int>(blockDim.x) * a.page_slices) {
    const uint64_t* signal = (send ? a.credits : a.arrivals) + signals + p;
    const uint64_t expected = send ? a.filled[signals + p] : k + 1;
    const uint64_t seen = detail::load_acquire_sys(signal);
    if (seen < expected) {
      detail::record_timeout(a.status, send ? detail::WaitOp::kChunkCredit : detail::WaitOp::kChunkArrival,
                             a.peer, a.my_pe, expected, seen);
      short_page = 1;
    }
  }
  return __syncthreads_or(short_page) != 0;
}

// The channel is refused (a size mismatch: found by this recv, told to this send, or found in
// an earlier launch): record it for this call, so that the caller hears of it, and fail the
// channel for the rest of this launch.
__device__ __forceinline__ void refuse(const ChunkStreamArgs& a, detail::WaitOp why, uint64_t other_bytes) {
  detail::record_error(&a.status->mismatch[a.is_send ? 0 : 1][detail::tracked_pe_index(a.peer)], detail::kMismatch, why, a.peer, a.my_pe,
                       static_cast<uint64_t>(a.bytes), other_bytes);
  atomicExch(a.failed, 1u);
}

// Chunk i of a send, on the slice's pages of its slot (whose credits are in).
// The channel's progress clock (a watchdog on progress, see send_recv.hpp), thread 0's only:
// moved() stamps this op and the channel now; channel_stalled() says the channel moved nothing (by any
// block) for the timeout. The last progress is read before the clock: another block may have
// moved the channel just now, and a stamp later than the reading must not wrap the difference.
__device__ __forceinline__ void moved(const ChunkStreamArgs& a, uint64_t& since) {
  const uint64_t now = detail::globaltimer_ns();
  since = now;
  atomicMax(reinterpret_cast<unsigned long long*>(a.progress), static_cast<unsigned long long>(now));
}
__device__ __forceinline__ bool channel_stalled(const ChunkStreamArgs& a, uint64_t since) {
  const uint64_t last = max(since, *reinterpret_cast<volatile uint64_t*>(a.progress));
  const uint64_t now = detail::globaltimer_ns();
  return now > last && now - last > a.timeout_ns;
}

__device__ void send_chunk(const ChunkStreamArgs& a, int slice, int64_t i, uint64_t k, uint64_t message) {
  const int64_t slot = static_cast<int64_t>(k % a.num_slots);
  const int64_t signals = slot * a.pages;
  const int64_t length = chunk_length(a, i);
  const int pages = data_pages(a, i);
  const uint8_t* from = a.src + i * a.chunk_bytes;
  const int64_t to = slot * a.chunk_bytes;
  // A slice with no page in this (short, last) chunk moves nothing and writes no header: page
  // `slice`, whose credit guards header `slice`, is not its to wait for in this chunk.
  if (slice >= pages) return;
  const SlotHeader header{k + 1, static_cast<uint64_t>(a.bytes), static_cast<uint64_t>(i), message + 1};
  // The header first, ordered before any of the slice's arrival signals. Then the header of each
  // further page of the slice below header_pages (api.cuh): a receiver whose batch raised the
  // slice count checks the header of its own first page, which may be this slice's page p, and
  // the slice waited for page p's credit before this write. Where the slice count is the old
  // rule's (PYDATACOPY_NARROW_SEND_BLOCKS not under PYDATACOPY_SEND_BLOCKS), no such page exists:
  // one header, as before.
  if (threadIdx.x == 0) {
    const int headed = max(slice + 1, min(pages, a.header_pages));  // page `slice`'s header always
    for (int p = slice; p < headed; p += a.page_slices) {
      if (a.peer_staging != nullptr) {
        a.peer_headers[signals + p] = header;
      } else {
        a.outgoing[signals + p] = header;
        nvshmem_putmem(a.headers + signals + p, a.outgoing + signals + p, sizeof(SlotHeader), a.peer);
      }
    }
    if (a.peer_staging == nullptr) nvshmem_fence();  // delivered before the putmem_signal calls below
  }
  __syncthreads();
  bool fenced = false;
  for (int p = slice; p < pages; p += a.page_slices) {
    const int64_t offset = p * a.page_bytes, n = min(a.page_bytes, length - offset);
    if (a.peer_staging != nullptr) {
      if (n > 0) copy_bytes(a.peer_staging + to + offset, from + offset, n, threadIdx.x, blockDim.x);
    } else if (n == 0) {
      // An empty message's header-only page: the arrival signal alone (nvshmem_fence above
      // orders it after the header).
      if (threadIdx.x == 0)
        nvshmemx_signal_op(a.arrivals + signals + p, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
    } else {
      // NVSHMEM RMA: the put's own signal guarantees the page's data.
      nvshmemx_putmem_signal_block(a.staging + to + offset, from + offset, static_cast<size_t>(n),
                                   a.arrivals + signals + p, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
    }
  }
  __syncthreads();
  for (int p = slice + static_cast<int>(threadIdx.x) * a.page_slices; p < pages;
       p += static_cast<int>(blockDim.x) * a.page_slices) {
    a.filled[signals + p] = k + 1;  // the credit that frees this page again
    if (a.peer_staging != nullptr) {
      if (!fenced) __threadfence_system();  // cumulative: covers the block's stores seen through the barrier
      fenced = true;
      store_after_fence_sys(a.peer_arrivals + signals + p, k + 1);
    }
  }
}

// The header of slice `slice` in chunk i, checked as soon as the page that guards it (page
// `slice`, whose arrival the sender signals after writing the header) has landed, before the
// slice waits for the rest of its pages: a sender that cut a smaller message never fills those,
// so waiting for them first turned a size mismatch into a timeout. Thread 0 only, no barrier:
// slice_ready() calls it and publishes the verdict through its own barrier. Returns
// kHeaderNotYet (the page has not landed), kHeaderOk, or kHeaderMismatch: the header is stale or
// names another size or chunk (both sides cut messages alike from their sizes, so a landed page
// under a stale header is a mismatch too); the channel is then refused at both ends, and the
// mismatch recorded.
constexpr int kHeaderNotYet = 0, kHeaderOk = 1, kHeaderMismatch = 2;
__device__ int check_header(const ChunkStreamArgs& a, int slice, int64_t i, uint64_t k, uint64_t message) {
  const int64_t signals = static_cast<int64_t>(k % a.num_slots) * a.pages;
  if (detail::load_acquire_sys(a.arrivals + signals + slice) < k + 1) return kHeaderNotYet;
  // Written before that arrival signal (a fence on either path), by whichever sender slice sent
  // page `slice` (header_pages, api.cuh); rewritten only after this slice credits the page.
  const volatile SlotHeader* h = a.headers + signals + slice;
  const uint64_t sequence = h->sequence, bytes = h->message_bytes, index = h->chunk_index;
  if (sequence == k + 1 && bytes == static_cast<uint64_t>(a.bytes) && index == static_cast<uint64_t>(i) &&
      h->message == message + 1)
    return kHeaderOk;
  // Refuse the channel on both sides: ours, and the sender's, whose waits, next launch and
  // host's check_errors() read it. The sender's word gets our bytes + 1; beside it, first, the
  // bytes its header said (+ 1), so that its host can name both sizes.
  *reinterpret_cast<volatile uint64_t*>(a.broken) = bytes + 1;
  if (a.peer_broken != nullptr) {
    store_release_sys(a.peer_refused_bytes, bytes + 1);
    __threadfence_system();
    store_release_sys(a.peer_broken, static_cast<uint64_t>(a.bytes) + 1);
  } else {
    nvshmemx_signal_op(a.remote_refused_bytes, bytes + 1, NVSHMEM_SIGNAL_SET, a.peer);
    nvshmem_fence();  // the sizes before the word that says there is a refusal
    nvshmemx_signal_op(a.remote_broken, static_cast<uint64_t>(a.bytes) + 1, NVSHMEM_SIGNAL_SET, a.peer);
    nvshmem_quiet();  // delivered by the time this launch ends (the sender may look next)
  }
  refuse(a, detail::WaitOp::kChunkArrival, bytes);
  return kHeaderMismatch;
}

// Whether every page the slice fills (send) or reads (recv) in the slot is ready (one look, no
// waiting). All threads of the block must call.
// For a recv with `check`, thread 0 then checks the slice's header (check_header) into the
// shared `verdict`, which every thread reads after this call's barrier: kHeaderNotYet only when
// the slice is not ready either (thread 0's pages start with page `slice`, and arrivals only grow).
__device__ __forceinline__ bool slice_ready(const ChunkStreamArgs& a, bool send, int slice,
                                            int64_t i, uint64_t k, uint64_t message, bool check, int& verdict) {
  const int64_t signals = static_cast<int64_t>(k % a.num_slots) * a.pages;
  const int pages = data_pages(a, i);
  int ok = 1;
  for (int p = slice + static_cast<int>(threadIdx.x) * a.page_slices; ok && p < pages;
       p += static_cast<int>(blockDim.x) * a.page_slices) {
    if (send)
      ok = detail::load_acquire_sys(a.credits + signals + p) >= a.filled[signals + p];
    else
      ok = detail::load_acquire_sys(a.arrivals + signals + p) >= k + 1;
  }
  if (check && threadIdx.x == 0) verdict = check_header(a, slice, i, k, message);
  return __syncthreads_and(ok) != 0;
}

// Chunk i of a recv, from the slice's pages of its slot (whose arrivals are in and whose header
// check_header() accepted).
__device__ void recv_chunk(const ChunkStreamArgs& a, int slice, int64_t i, uint64_t k) {
  const int64_t slot = static_cast<int64_t>(k % a.num_slots);
  const int64_t signals = slot * a.pages;
  const int64_t length = chunk_length(a, i);
  const int pages = data_pages(a, i);
  if (slice >= pages) return;  // no page of this chunk: nothing to check or copy
  for (int p = slice; p < pages; p += a.page_slices) {
    const int64_t offset = p * a.page_bytes, n = min(a.page_bytes, length - offset);
    if (n > 0)  // an empty message's page carries only its header
      copy_bytes(a.dst + i * a.chunk_bytes + offset, a.staging + slot * a.chunk_bytes + offset, n,
                 threadIdx.x, blockDim.x);
  }
  __syncthreads();
  // Our reads of the slot are done: the sender may overwrite the pages.
  bool fenced = false;
  for (int p = slice + static_cast<int>(threadIdx.x) * a.page_slices; p < pages;
       p += static_cast<int>(blockDim.x) * a.page_slices) {
    if (a.peer_credits != nullptr) {
      if (!fenced) __threadfence_system();  // our reads of the pages are done before the credit
      fenced = true;
      store_after_fence_sys(a.peer_credits + signals + p, k + 1);
    } else {
      nvshmemx_signal_op(a.credits + signals + p, k + 1, NVSHMEM_SIGNAL_SET, a.peer);
    }
  }
}

#include "kernels/send_recv/zero_copy.cuh"
#include "kernels/send_recv/low_latency.cuh"

// All threads of a send op's block, while it waits on the receiver (a descriptor, a credit): the
// receiver's refusal word, read by thread 0. When it is set the op is refused (a kChunkCredit
// record: the receiver's size) and given up; returns whether it was.
__device__ __forceinline__ bool receiver_refused(const ChunkStreamArgs& a, int64_t& next, int64_t chunks,
                                                 bool& gave_up) {
  const uint64_t broken = threadIdx.x == 0 ? *reinterpret_cast<volatile uint64_t*>(a.broken) : 0;
  if (!__syncthreads_or(broken != 0)) return false;
  if (threadIdx.x == 0) {
    refuse(a, detail::WaitOp::kChunkCredit, broken - 1);
    next = chunks, gave_up = true;
  }
  __syncthreads();
  return true;
}

// Once the block is done with a slice (or gave up): the last slice of the op's channel in this
// launch moves the channel's counters on and clears its failure flag. Every block read the
// counters at its start, before it counted a slice, so they move only after all read them.
// A channel with one slice in the launch (a small message, a zero-copy recv) has no other block
// to count with: the barrier orders the block's reads of the counters before thread 0's stores,
// and the fence and the count (about 1 us a launch, measured 2026-12-03) are left out.
// The channel's counters past this launch's ops on it, its failure flag cleared (thread 0 of the
// block that finishes the channel's last slice). `first`/`message`: this op's, as read at the start.
__device__ __forceinline__ void move_channel_on(const ChunkStreamArgs& a, uint64_t first, uint64_t message) {
  *reinterpret_cast<volatile unsigned int*>(a.failed) = 0;
  *reinterpret_cast<volatile uint64_t*>(a.sequence) = first - a.offset_chunks + a.channel_chunks;
  *reinterpret_cast<volatile uint64_t*>(a.messages) = message - a.offset_messages + a.channel_messages;
}
__device__ __forceinline__ void finish_slice(const ChunkStreamArgs& a, uint64_t first, uint64_t message) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (a.channel_blocks == 1) {
    move_channel_on(a, first, message);
    return;
  }
  __threadfence();
  if (atomicAdd(a.done, 1u) + 1 == static_cast<unsigned>(a.channel_blocks)) {
    *a.done = 0;
    move_channel_on(a, first, message);
    __threadfence();
  }
}

// The op before `i` on its channel in the batch (the same sequence counter), -1 if none.
__device__ __forceinline__ int previous_on_channel(const ChunkStreamArgs* ops, int i) {
  return batch_order::previous_on_channel(i, [ops](int e, int op) { return ops[e].sequence == ops[op].sequence; });
}

// An op's place on its channel at the launch's start: the sequence number of its first chunk and
// its message ordinal (the device counters, advanced by the channel's previous launch, plus the
// earlier ops of this batch on it), and its progress clock's start.
__device__ __forceinline__ void op_start(const ChunkStreamArgs& a, uint64_t& first, uint64_t& message, uint64_t& since) {
  first = *reinterpret_cast<volatile uint64_t*>(a.sequence) + a.offset_chunks;
  message = *reinterpret_cast<volatile uint64_t*>(a.messages) + a.offset_messages;
  since = detail::globaltimer_ns();
}

// Thread 0 of the probe's one block (kCopyEngineProbe): the batch's recv descriptors go out (their
// ops wait in the step after the copy, which does not post them again), and the send (at most one
// per launch, the host's rule) takes its descriptor. When its receiver posted zero-copy at exactly
// the host's guess, every part of the message is marked started (zero_copy_begin's protocol, for
// all parts at once) and the IF node is set, so that the copy engine moves the message; otherwise
// the ordinary step does the whole send, as it would have. No channel counter moves here: the next
// step finds the ops at the same places on their channels. A recv of a refused channel is not
// posted (the next step gives it up at its start, as it reads the same word).
__device__ __forceinline__ void copy_engine_probe(const ChunkStreamArgs* ops, const bool* is_send, int count) {
  // Every recv's descriptor first: the peer's probe of a sendrecv waits for it before it posts its own.
  for (int i = 0; i < count; ++i) {
    const ChunkStreamArgs& a = ops[i];
    if (is_send[i] || !a.post_descriptor || *reinterpret_cast<volatile uint64_t*>(a.broken) != 0) continue;
    uint64_t first = 0, message = 0, since = 0;
    op_start(a, first, message, since);
    post_descriptor(a, message, first);
  }
  for (int i = 0; i < count; ++i) {
    const ChunkStreamArgs& a = ops[i];
    if (!is_send[i] || a.ce_state == nullptr) continue;
    uint64_t first = 0, message = 0, since = 0;
    op_start(a, first, message, since);
    const bool refused = *reinterpret_cast<volatile uint64_t*>(a.broken) != 0;
    unsigned verdict = kCopyEngineVerdictOrdinary;
    if (a.ce_guess != nullptr && a.await_descriptor && !refused) {
      uint8_t* into = nullptr;
      int taken = 0;
      // Held in a send/recv kernel while it waits, as the ordinary kernel's loop is: a peer's
      // bounded descriptor wait counts it (zero_copy.cuh, fall_back_to_staged).
      atomicAdd(a.activity, 1u);
      for (;;) {
        taken = take_descriptor(a, message, first, true, &into);
        if (taken != 0 || *reinterpret_cast<volatile uint64_t*>(a.broken) != 0) break;
        if (channel_stalled(a, since)) {  // the ordinary step then finds the channel failed and gives up
          const RendezvousDescriptor* d = a.ring + message % kRendezvousRing;
          detail::record_timeout(a.status, detail::WaitOp::kRendezvous, a.peer, a.my_pe, message + 1,
                                 detail::load_acquire_sys(&d->message));
          atomicExch(a.failed, 1u);
          break;
        }
      }
      atomicSub(a.activity, 1u);
      if (taken == zero_copy_detail::kModeZeroCopy) {
        moved(a, since);
        if (a.ce_last_target != nullptr) *reinterpret_cast<volatile uint64_t*>(a.ce_last_target) = reinterpret_cast<uint64_t>(into);
        if (into == a.ce_guess) {
          for (int s = 0; s < a.zc_slices; ++s)
            *reinterpret_cast<volatile uint64_t*>(a.peer_zc_done + s) = zero_copy_detail::done_word(message, 0);
          __threadfence_system();
          const bool failed = *reinterpret_cast<volatile unsigned int*>(a.failed) != 0 ||
                              *reinterpret_cast<volatile uint64_t*>(a.broken) != 0;
          if (failed) {
            for (int s = 0; s < a.zc_slices; ++s)
              *reinterpret_cast<volatile uint64_t*>(a.peer_zc_done + s) =
                  zero_copy_detail::done_word(message, zero_copy_detail::kCancel);
            verdict = kCopyEngineVerdictGaveUp;
          } else {
            verdict = kCopyEngineVerdictCopy;
            // Progress, so that a receiver that waited long for this message restarts its watchdog
            // for the copy (words only grow: started, then 1, then final; the message has more
            // than one chunk, being larger than the staging).
            for (int s = 0; s < a.zc_slices; ++s)
              *reinterpret_cast<volatile uint64_t*>(a.peer_zc_done + s) = zero_copy_detail::done_word(message, 1);
          }
        }
      }
      // The ordinary kernel resolves the target afresh (block 0 from the table, as in any launch):
      // none of its blocks may take the base this probe read.
      *reinterpret_cast<volatile uint64_t*>(a.zc_resolved + 2 * (message % kRendezvousRing)) = 0;
    }
    *reinterpret_cast<volatile unsigned int*>(a.ce_state) = verdict;
    if (verdict == kCopyEngineVerdictCopy) cudaGraphSetConditional(a.ce_handle, 1);
  }
}

// The bounded descriptor wait's bounds (api.cuh, set_zero_copy_fallback_waits): held, long. In
// constant memory: read at every look of a waiting send, without a trip to global memory.
__constant__ uint64_t c_zero_copy_fallback_waits[2] = {static_cast<uint64_t>(settings::kZeroCopyFallbackWaitNs),
                                                       static_cast<uint64_t>(settings::kZeroCopyFallbackLongWaitNs)};

// The phase stamps (api.cuh's probe): off unless set_phase_stamps(true).
__device__ int g_phase_stamps_on;
__device__ unsigned long long g_phase_stamp_count;
__device__ PhaseStampRecord g_phase_stamps[kPhaseStampRing];
// The ring slot of the launch that stamps now: taken by its block 0 at entry, read by its other
// blocks for the stamps they share (the parts').
__device__ unsigned long long g_phase_stamp_slot;
enum Phase {
  kEntered, kGridWaited, kPrologueDone, kRendezvous, kCopyBegun, kCopied, kOpDone, kLoopLeft, kCountersDone, kEnded,
  kPosted, kPartsLastBegun, kPartsLastFinal
};
static_assert(kPartsLastFinal + 1 == kPhaseStamps, "api.cuh's kPhaseStampNames names every phase");
// Block 0's own stamps end at kPosted; the parts' stamps are every block's (shared_phase_stamp).
constexpr int kBlockZeroStamps = kPosted + 1;
// Thread 0 of block 0, at entry: the launch's slot in the ring, its shared stamps cleared, then
// published for the launch's other blocks (which read it only after block 0 resolved a zero-copy
// descriptor, a release after this).
// Returns the slot, which block 0 keeps for its record (another stream's launch may publish its own
// slot meanwhile: the stamps are for one stream's launches in a row, api.cuh).
__device__ __forceinline__ unsigned long long take_phase_stamp_slot() {
  const unsigned long long slot = atomicAdd(&g_phase_stamp_count, 1ull) % kPhaseStampRing;
  for (int p = kBlockZeroStamps; p < kPhaseStamps; ++p) g_phase_stamps[slot].at[p] = 0;
  *reinterpret_cast<volatile unsigned long long*>(&g_phase_stamp_slot) = slot;
  __threadfence();
  return slot;
}
// Thread 0 of block 0, at the end: the launch's record in its slot, but the stamps its other
// blocks share.
__device__ __forceinline__ void record_phase_stamps(unsigned long long slot, const uint64_t* stamp, int mode,
                                                    bool is_send) {
  PhaseStampRecord& record = g_phase_stamps[slot];
  for (int p = 0; p < kBlockZeroStamps; ++p) record.at[p] = stamp[p];
  record.mode = mode;
  record.is_send = is_send ? 1 : 0;
}
// Thread 0 of any block: the latest time of phase `p` (kPartsLastBegun, kPartsLastFinal).
__device__ __forceinline__ void shared_phase_stamp(int p) {
  const unsigned long long slot = *reinterpret_cast<volatile unsigned long long*>(&g_phase_stamp_slot);
  atomicMax(reinterpret_cast<unsigned long long*>(&g_phase_stamps[slot].at[p]),
            static_cast<unsigned long long>(detail::globaltimer_ns()));
}
__device__ __forceinline__ bool phase_stamps_on() { return *reinterpret_cast<volatile int*>(&g_phase_stamps_on) != 0; }

// The batch travels as the kernel's parameter; a one- or two-op batch (send, recv, sendrecv)
// uses a small copy of it, since a 2 KiB parameter block lengthens every launch.
template <int kCapacity>
struct SizedBatch {
  static_assert(kCapacity <= 127, "the kernels keep op indices in signed chars");
  ChunkStreamArgs ops[kCapacity];
  bool is_send[kCapacity];
  int count;
};
static_assert(sizeof(SizedBatch<kMaxBatchOps>) <= 32764, "a full batch must fit the kernel-parameter limit");

// The copy engine's probe (kCopyEngineProbe), a kernel of its own: one block, thread 0.
template <int kCapacity>
__global__ void __launch_bounds__(kThreads) copy_engine_probe_kernel(const SizedBatch<kCapacity> batch) {
  if (threadIdx.x == 0) copy_engine_probe(batch.ops, batch.is_send, batch.count);
}

template <int kCapacity>
__global__ void __launch_bounds__(kThreads) chunk_batch_kernel(const SizedBatch<kCapacity> batch) {
  // The probe's stamps, thread 0 of block 0 only (its flag is not the previous grid's output).
  __shared__ uint64_t stamp[kPhaseStamps];
  // Every block's thread 0 stamps its zero-copy parts (shared_phase_stamp); block 0's the rest.
  const bool part_stamping = threadIdx.x == 0 && phase_stamps_on();
  const bool stamping = blockIdx.x == 0 && part_stamping;
  unsigned long long stamp_slot = 0;  // the record's slot in the ring (stamping only)
  if (stamping) {
    for (int p = 0; p < kPhaseStamps; ++p) stamp[p] = 0;
    stamp[kEntered] = detail::globaltimer_ns();
  }
  wait_for_previous_grid();  // launch_kernel: the channel's counters and the user's data are ready
  if (stamping) {
    stamp[kGridWaited] = detail::globaltimer_ns();
    stamp_slot = take_phase_stamp_slot();  // after the previous launch's blocks are gone: none stamps it any more
  }
  const int block = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
  // Per op: the channel's sequence number of the message's first chunk (the device counter,
  // advanced by the previous launch on the channel, plus the chunks of earlier ops of this batch
  // on it), this block's last progress on it (its start at first), and per slice the next chunk
  // to move; slices past the op's count start done.
  __shared__ uint64_t first[kCapacity];
  __shared__ uint64_t since[kCapacity];
  __shared__ int64_t next[kCapacity][kMaxSlicesPerBlock];
  // Per op and slice: the op before it on its channel whose slice did not start done (-1: none).
  // Ops of one channel move in its order slice by slice, so that op's slice being done says that
  // every earlier one's is (it moved only then): a scan of every earlier op per visit made each
  // round of a 32-op group quadratic.
  __shared__ signed char waits_for[kCapacity][kMaxSlicesPerBlock];
  __shared__ signed char before[kCapacity];  // the op before on the channel (-1: none)
  // recv: the header of the slice's next chunk was checked (its page landed before the rest).
  __shared__ unsigned char header_ok[kCapacity][kMaxSlicesPerBlock];
  __shared__ int verdict;  // check_header's, published by slice_ready's barrier
  // The zero-copy rendezvous (zero_copy.cuh): the op's message ordinal on its channel, its mode
  // (0 while a send waits for the descriptor), a zero-copy send's target, whether this block
  // posted a recv's descriptor, and whether the block gave up on the op (for the counters).
  __shared__ uint64_t message[kCapacity];
  __shared__ int mode[kCapacity];
  __shared__ uint8_t* target[kCapacity];
  __shared__ bool posted[kCapacity];
  // A recv that posts late (a.post_late): its time has come. Set by thread 0 before a barrier.
  __shared__ bool late_due[kCapacity];
  __shared__ bool gave_up[kCapacity];
  __shared__ uint64_t zc_landed[kCapacity];  // a zero-copy recv's progress at its last look
  // A send's bounded descriptor wait (block 0: zero_copy.cuh, fall_back_to_staged): since when it
  // waits, since when its receiver has been seen held in a send/recv kernel without a break (0:
  // not seen so), and whether the fallback store went out.
  __shared__ uint64_t awaited_since[kCapacity];
  __shared__ uint64_t held_since[kCapacity];
  __shared__ bool fallback_intent[kCapacity];
  __shared__ int64_t chunks[kCapacity];  // chunk_count of each op
  // One thread per op, then the slices' state in parallel: a single thread that set up every
  // op's 32 slices (a 64-bit division each) kept a launch 12 us in its prologue (measured
  // 2026-12-02, a 4 KiB sendrecv).
  if (threadIdx.x < batch.count) {
    const int i = static_cast<int>(threadIdx.x);
    const ChunkStreamArgs& a = batch.ops[i];
    before[i] = static_cast<signed char>(previous_on_channel(batch.ops, i));
    op_start(a, first[i], message[i], since[i]);
    const bool send = batch.is_send[i];
    mode[i] = a.low_latency ? low_latency_detail::kModeLowLatency
              : send        ? (a.await_descriptor ? 0 : zero_copy_detail::kModeStaged)
                            : (a.zero_copy ? zero_copy_detail::kModeZeroCopy : zero_copy_detail::kModeStaged);
    target[i] = nullptr;
    // After the copy engine's probe, which posted the recv descriptors (a refused channel's recv,
    // which it did not post, is given up below) and left its verdict on the send.
    posted[i] = !a.post_descriptor || a.ce_phase != kCopyEngineOff;
    bool ce_gave_up = false;
    if (send && a.ce_phase == kCopyEngineCopied) {
      mode[i] = zero_copy_detail::kModeCopyEngine;
    } else if (send && a.ce_phase == kCopyEngineOrdinary && a.ce_state != nullptr) {
      const unsigned verdict = *reinterpret_cast<volatile unsigned int*>(a.ce_state);
      // (Copy cannot reach this branch of the graph; were it to, the parts are started at the
      // guess, which the probe checked: the SM copy writes them.)
      if (verdict == kCopyEngineVerdictCopy) mode[i] = zero_copy_detail::kModeZeroCopy, target[i] = a.ce_guess;
      ce_gave_up = verdict == kCopyEngineVerdictGaveUp;
    }
    late_due[i] = false;
    zc_landed[i] = 0;
    awaited_since[i] = 0;
    held_since[i] = 0;
    fallback_intent[i] = false;
    chunks[i] = chunk_count(a);
    // A refused channel moves nothing until setup_send_recv() rebuilds it.
    const uint64_t broken = *reinterpret_cast<volatile uint64_t*>(a.broken);
    // (A copy-engine send whose bytes are written says final whatever its channel says since.)
    gave_up[i] = (broken != 0 && mode[i] != zero_copy_detail::kModeCopyEngine) || ce_gave_up;
    if (broken != 0) refuse(a, detail::WaitOp::kChannelRefused, broken - 1);
  }
  __syncthreads();
  for (int k = static_cast<int>(threadIdx.x); k < batch.count * kMaxSlicesPerBlock; k += static_cast<int>(blockDim.x)) {
    const int i = k / kMaxSlicesPerBlock, j = k % kMaxSlicesPerBlock;
    const int slice = block + j * grid;
    header_ok[i][j] = 0;
    // A zero-copy recv waits in its slice 0 alone (for every sender slice); a low-latency op
    // moves on its slice 0 alone (the others, when its channel's ops share more, are idle). A
    // zero-copy recv that fits the staging keeps its other slices until its verdict says
    // zero-copy (zero_copy.cuh, fall_back_to_staged).
    const bool idle = ((mode[i] == zero_copy_detail::kModeZeroCopy && !batch.ops[i].zc_fallback) ||
                       mode[i] == low_latency_detail::kModeLowLatency) &&
                      slice != 0;
    next[i][j] = !gave_up[i] && slice < batch.ops[i].active_blocks && !idle ? 0 : chunks[i];
  }
  __syncthreads();
  // A thread per slice, down the batch (batch_order.hpp).
  for (int j = static_cast<int>(threadIdx.x); j < kMaxSlicesPerBlock; j += static_cast<int>(blockDim.x))
    batch_order::slice_waits_for(before, batch.count, [&](int e) { return next[e][j] < chunks[e]; }, waits_for, j);
  __syncthreads();
  if (stamping) stamp[kPrologueDone] = detail::globaltimer_ns();
  // In the loop, where a block may wait on a peer: counted for the peers' bounded descriptor
  // waits (zero_copy.cuh, fall_back_to_staged). A reduction: nothing waits for its result.
  if (threadIdx.x == 0) atomicAdd(batch.ops[0].activity, 1u);
  // How long a recv's visit may spin on its words (low-latency lines, zero-copy done words): a
  // bounded spin while no other op's slice of this block is left to move, none otherwise (the
  // block's other ops must not wait on it: a sendrecv's send is what the peer's recv waits for).
  const auto spin_ns = [&](int op) {
    for (int e = 0; e < batch.count; ++e)
      for (int j = 0; j < kMaxSlicesPerBlock && block + j * grid < batch.ops[e].active_blocks; ++j)
        if (e != op && next[e][j] < chunks[e]) return uint64_t{0};
    return kDescriptorSpinNs;
  };
  // Thread 0: recv op i's descriptor goes out; a zero-copy post that its sender may have given up
  // on takes the verdict, for every slice (zero_copy.cuh, post_verdict).
  const auto post_recv = [&](int i) {
    const ChunkStreamArgs& a = batch.ops[i];
    post_descriptor(a, message[i], first[i]);
    if (stamping && i == 0) stamp[kPosted] = detail::globaltimer_ns();
    if (mode[i] == zero_copy_detail::kModeZeroCopy && a.zc_fallback && post_verdict(a, message[i]))
      mode[i] = zero_copy_detail::kModeStaged;
    posted[i] = true;
    if (stamping && i == 0) stamp[kRendezvous] = detail::globaltimer_ns();
  };
  for (bool all_done = false; !all_done;) {
    all_done = true;
    if (stamping && stamp[kOpDone] == 0 && next[0][0] >= chunks[0]) stamp[kOpDone] = detail::globaltimer_ns();
    // Block 0 posts every recv descriptor whose turn has come before this round's visits, as a
    // visit to the recv's slice 0 would (below), so that a recv late in a batch is not posted only
    // after the visits of the ops before it (a zero-copy send's visit moves up to kVisitBytes a
    // slice): its sender would wait that long, and one that fits the staging could give its
    // descriptor wait up (a review's finding, 2026-12-07). Every thread reads the same posted[]
    // and next[][] here (each change by thread 0 is followed by a barrier).
    if (block == 0) {
      // Due: not posted, its first slice not done, and its turn on the channel (every earlier
      // op's first slice done).
      const auto due = [&](int i) {
        if (posted[i] || next[i][0] >= chunks[i] || (batch.ops[i].post_late && !late_due[i])) return false;
        return !batch_order::waits(waits_for[i][0], [&](int e) { return next[e][0] >= chunks[e]; });
      };
      bool any_due = false;
      for (int i = 0; i < batch.count; ++i) any_due = any_due || due(i);
      if (any_due) {
        __syncthreads();  // every thread has read posted[] before thread 0 changes it
        if (threadIdx.x == 0) {
          for (int i = 0; i < batch.count; ++i) {
            const ChunkStreamArgs& a = batch.ops[i];
            // A failed channel gives the op up at its visit; nothing is posted for it.
            if (!due(i) || *reinterpret_cast<volatile unsigned int*>(a.failed) != 0) continue;
            post_recv(i);
          }
        }
        __syncthreads();
      }
    }
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      const bool send = batch.is_send[i];
      for (int j = 0; j < kMaxSlicesPerBlock && block + j * grid < a.active_blocks; ++j) {
        const int slice = block + j * grid;
        const int64_t chunk = next[i][j];
        if (chunk >= chunks[i]) continue;
        all_done = false;
        // Ops of one channel move in the channel's order, slice by slice: a send's wait reads
        // `filled`, which only the slot's previous chunk (maybe an earlier op's) sets.
        if (batch_order::waits(waits_for[i][j], [&](int e) { return next[e][j] >= chunks[e]; })) continue;
        // The channel failed elsewhere in the launch (a timeout or a mismatch): give up on it.
        // Not a zero-copy part under way: a sender slice that started writing finishes, and a
        // receiver waits until it knows the sender writes nothing more (zero_copy_begin).
        // (The barrier is taken either way: every thread has read `chunk` before thread 0 may
        // change next[i][j] in this visit.)
        const bool zero_copy_under_way =
            (mode[i] == zero_copy_detail::kModeZeroCopy && (send ? chunk > 0 : slice != 0 || posted[i])) ||
            mode[i] == zero_copy_detail::kModeCopyEngine;  // its bytes are there: the parts must say final
        // Read before the barrier below, after which thread 0 may change posted[i] and mode[i]:
        // every thread must take the same branches (each holds a __syncthreads).
        const bool post_now = !send && slice == 0 && !posted[i] && (!a.post_late || late_due[i]);
        const bool await_now = send && mode[i] == 0;
        const bool channel_failed =
            __syncthreads_or(threadIdx.x == 0 && *reinterpret_cast<volatile unsigned int*>(a.failed) != 0);
        if (channel_failed && !zero_copy_under_way) {
          if (threadIdx.x == 0) next[i][j] = chunks[i], gave_up[i] = true;
          __syncthreads();
          continue;
        }
        // A recv's descriptor goes out when its first slice's turn on the channel comes (every
        // earlier op's first slice done, none refused), so that a descriptor is never posted
        // for an op that the receiver then gives up on while the sender writes.
        if (post_now) {
          if (threadIdx.x == 0) post_recv(i);
          __syncthreads();
        }
        // A send above the threshold first takes the receiver's descriptor (same size, and the
        // mode: zero-copy into its buffer, or staged).
        if (await_now) {
          __shared__ int taken;
          if (threadIdx.x == 0) {
            uint8_t* into = nullptr;
            // A short spin before the loop's next round (whose barriers and checks made the
            // descriptor wait ~3 us longer than its store takes to be seen, measured 2026-12-02);
            // bounded, so that the block's other ops still move.
            // Not while this block still has a recv's descriptor to post (block 0, e.g. the recv
            // of a sendrecv, after its send): the peer's send waits for that descriptor, so a
            // spin here would only delay both sides.
            // (Slice 0, which posts, is always block 0's.)
            // A recv that posts late and whose time has not come (a.post_late) holds no one up.
            bool may_spin = true;
            for (int e = 0; e < batch.count && block == 0; ++e)
              may_spin = may_spin && (posted[e] || (batch.ops[e].post_late && !late_due[e]) || next[e][0] >= chunks[e]);
            const uint64_t spin_until = detail::globaltimer_ns() + (may_spin ? kDescriptorSpinNs : 0);
            if (fallback_intent[i]) {
              // Block 0 stored its fallback and saw the post: the receiver's verdict decides.
              taken = fall_back_to_staged(a, message[i], first[i], fallback_intent[i], &into);
            } else {
              do {
                // Block 0 (which drives slice 0) resolves, from whichever of its slices it waits in:
                // when the resolver was slice 0 alone, block 0 waiting in another slice (slice grid,
                // a message with more slices than blocks) spun out its 4 us on a target only it could
                // publish, and every block waited with it (4-16 MiB: 8 us from the descriptor's post
                // to its take, measured 2026-12-06).
                taken = take_descriptor(a, message[i], first[i], block == 0, &into);
              } while (taken == 0 && detail::globaltimer_ns() < spin_until);
              // The bounded wait of a message that fits the staging: block 0 decides for all, once
              // its receiver has been held in send/recv kernels for kZeroCopyFallbackWaitNs without
              // a break (held at one look was not enough: a receiver whose kernel had just
              // started, about to post, made senders of grouped sendrecvs fall back; seen on the
              // GPU, 2026-12-07), or after kZeroCopyFallbackLongWaitNs whatever holds it (a
              // receiver in pydatacopy.barrier() or a host barrier that waits for this send).
              if (taken == 0 && block == 0 && a.zc_fallback) {
                const uint64_t now = detail::globaltimer_ns();
                if (awaited_since[i] == 0) awaited_since[i] = now;
                if (*reinterpret_cast<const volatile unsigned int*>(a.peer_activity) == 0)
                  held_since[i] = 0;
                else if (held_since[i] == 0)
                  held_since[i] = now;
                if ((held_since[i] != 0 && now - held_since[i] >= c_zero_copy_fallback_waits[0]) ||
                    now - awaited_since[i] >= c_zero_copy_fallback_waits[1])
                  taken = fall_back_to_staged(a, message[i], first[i], fallback_intent[i], &into);
              }
            }
            if (taken > 0) mode[i] = taken, target[i] = into;
            // The host's next guess of a copy-engine send (a store into host memory, once a message).
            if (taken == zero_copy_detail::kModeZeroCopy && block == 0 && a.ce_last_target != nullptr)
              *reinterpret_cast<volatile uint64_t*>(a.ce_last_target) = reinterpret_cast<uint64_t>(into);
            if (stamping && i == 0 && taken > 0) stamp[kRendezvous] = detail::globaltimer_ns();
            if (taken < 0) next[i][j] = chunks[i], gave_up[i] = true;
            if (taken != 0) {
              moved(a, since[i]);
            }
          }
          __syncthreads();
          if (taken < 0) continue;
          if (taken == 0) {
            // Not there yet: the receiver may have refused (its size differs), or the watchdog.
            if (receiver_refused(a, next[i][j], chunks[i], gave_up[i])) continue;
            if (threadIdx.x == 0 && channel_stalled(a, since[i])) {
              const RendezvousDescriptor* d = a.ring + message[i] % kRendezvousRing;
              detail::record_timeout(a.status, detail::WaitOp::kRendezvous, a.peer, a.my_pe, message[i] + 1,
                                     detail::load_acquire_sys(&d->message));
              atomicExch(a.failed, 1u);
            }
            __syncthreads();
            continue;
          }
        }
        if (mode[i] == zero_copy_detail::kModeCopyEngine) {  // a send on one slice (the host's rule)
          if (threadIdx.x == 0) {
            copy_engine_done(a, message[i]);
            next[i][j] = chunks[i];
            moved(a, since[i]);
          }
          __syncthreads();
          continue;
        }
        if (mode[i] == low_latency_detail::kModeLowLatency) {
          if (send) {
            if (low_latency_send_visit(a, message[i])) {
              if (threadIdx.x == 0) {
                next[i][j] = chunks[i];
                moved(a, since[i]);
              }
              __syncthreads();
              continue;
            }
            // Its slot is not credited yet: the receiver may have refused, or the watchdog.
            if (receiver_refused(a, next[i][j], chunks[i], gave_up[i])) continue;
            if (threadIdx.x == 0 && channel_stalled(a, since[i])) {
              detail::record_timeout(a.status, detail::WaitOp::kChunkCredit, a.peer, a.my_pe,
                                     a.ll_filled[message[i] % kLowLatencySlots], detail::load_acquire_sys(a.ll_credit));
              atomicExch(a.failed, 1u);  // the next visit gives up (the host refuses this peer from now on)
              gave_up[i] = true;
            }
            __syncthreads();
            continue;
          }
          // A bounded spin on the message while this block has nothing else to move (a spin
          // between the loop's barriers and checks saw a message later than its store).
          const int seen = low_latency_recv_visit(a, message[i], first[i], since[i], spin_ns(i));
          if (threadIdx.x == 0 && seen != kLowLatencyWaiting) {
            next[i][j] = chunks[i];
            if (seen == kLowLatencyGaveUp) gave_up[i] = true;
          }
          // No message yet after settings::kLatePostNs: a recv that posts late posts at the next
          // round (a review's finding: without this a low-latency recv in this kernel never
          // posted, and a sender of another size too large for the staging waited until the
          // timeout). late_due is read after the barrier below.
          if (threadIdx.x == 0 && seen == kLowLatencyWaiting && a.post_late && !posted[i] && !late_due[i] &&
              detail::globaltimer_ns() - since[i] >= static_cast<uint64_t>(settings::kLatePostNs))
            late_due[i] = true;
          __syncthreads();
          continue;
        }
        if (mode[i] == zero_copy_detail::kModeZeroCopy) {
          if (send) {
            // Slices past the copy's own have nothing to write; the others say they start
            // before their first write, unless the channel failed meanwhile.
            if (slice < a.zc_slices && chunk == 0) {
              __shared__ int begun;
              if (threadIdx.x == 0) {
                // The stamps read thread 0's own result, not the shared word: a load of `begun`
                // that the compiler hoists above `stamping` in the other threads is a race with
                // this store (compute-sanitizer's racecheck, 2026-12-07).
                const bool started = zero_copy_begin(a, slice, message[i]);
                begun = started;
                if (stamping && i == 0 && j == 0 && started) stamp[kCopyBegun] = detail::globaltimer_ns();
                if (part_stamping && started) shared_phase_stamp(kPartsLastBegun);
              }
              __syncthreads();
              if (!begun) {
                if (threadIdx.x == 0) next[i][j] = chunks[i], gave_up[i] = true;
                __syncthreads();
                continue;
              }
            }
            const int64_t done_to =
                slice < a.zc_slices ? zero_copy_chunks(a, slice, chunk, message[i], target[i],
                                                       stamping && i == 0 && j == 0 ? &stamp[kCopied] : nullptr)
                                    : chunks[i];
            if (part_stamping && slice < a.zc_slices && done_to >= chunks[i]) shared_phase_stamp(kPartsLastFinal);
            if (threadIdx.x == 0) {
              next[i][j] = done_to;
              moved(a, since[i]);
            }
            __syncthreads();
            continue;
          }
          // Another slice of a zero-copy recv that fits the staging: it waits for its block 0's
          // verdict (zero_copy.cuh, post_verdict): zero-copy leaves it nothing to do, staged gives
          // it its pages. Without a verdict it gives up only with the channel (failed, refused, or
          // no progress for the timeout): block 0 then posts nothing more for the message.
          if (slice != 0) {
            // Every thread has read mode[i] for this visit before thread 0 may change it (a warp
            // behind would otherwise take the staged path's barriers alone: a review's finding).
            __syncthreads();
            if (threadIdx.x == 0) {
              const int verdict_now = read_verdict(a, message[i]);
              if (verdict_now == 1) {
                next[i][j] = chunks[i];
              } else if (verdict_now == 2) {
                mode[i] = zero_copy_detail::kModeStaged;
              } else if (*reinterpret_cast<volatile unsigned int*>(a.failed) != 0 ||
                         *reinterpret_cast<volatile uint64_t*>(a.broken) != 0) {
                next[i][j] = chunks[i], gave_up[i] = true;
              } else if (channel_stalled(a, since[i])) {
                detail::record_timeout(a.status, detail::WaitOp::kRendezvous, a.peer, a.my_pe, message[i] + 1, 0);
                atomicExch(a.failed, 1u);
                next[i][j] = chunks[i], gave_up[i] = true;
              }
            }
            __syncthreads();
            continue;
          }
          // A zero-copy recv: its slice 0 watches every sender slice's done word (the recv's
          // other slices are idle from the start), see zero_copy_recv_visit.
          const int seen = zero_copy_recv_visit(a, message[i], first[i], since[i], zc_landed[i], spin_ns(i));
          if (threadIdx.x == 0 && seen != kZeroCopyWaiting) {
            next[i][j] = chunks[i];
            if (seen == kZeroCopyGaveUp) gave_up[i] = true;
          }
          __syncthreads();
          continue;
        }
        // Staged: a slice past the message's page slices (a send raised for zero-copy parts that
        // moved staged after all) owns no page.
        if (slice >= a.page_slices) {
          if (threadIdx.x == 0) next[i][j] = chunks[i];
          __syncthreads();
          continue;
        }
        const uint64_t k = first[i] + chunk;
        // A recv checks its header as soon as its own page has landed (see check_header).
        const bool check = !send && slice < data_pages(a, chunk) && !header_ok[i][j];
        const bool ready = slice_ready(a, send, slice, chunk, k, message[i], check, verdict);
        if (check && verdict == kHeaderMismatch) {  // nothing is copied out; the channel fails
          __syncthreads();  // every thread has read `verdict` before thread 0 writes it again
          if (threadIdx.x == 0) next[i][j] = chunks[i], gave_up[i] = true;
          __syncthreads();
          continue;
        }
        if (check && verdict == kHeaderOk && threadIdx.x == 0) header_ok[i][j] = 1;
        if (!ready) {
          // A staged recv's first look also finds a sender that sent the message by the
          // low-latency protocol (another size): refused at both ends.
          if (!send && slice == 0 && chunk == 0 &&
              __syncthreads_or(threadIdx.x == 0 && low_latency_instead(a, message[i]))) {
            if (threadIdx.x == 0) next[i][j] = chunks[i], gave_up[i] = true;
            __syncthreads();
            continue;
          }
          // Either side also reads its refusal word: the other side found a size mismatch (a
          // receiver is told so by a sender that read its rendezvous descriptor).
          if (__syncthreads_or(threadIdx.x == 0 && *reinterpret_cast<volatile uint64_t*>(a.broken) != 0)) {
            if (threadIdx.x == 0) {
              refuse(a, send ? detail::WaitOp::kChunkCredit : detail::WaitOp::kChunkArrival,
                     *reinterpret_cast<volatile uint64_t*>(a.broken) - 1);
              next[i][j] = chunks[i], gave_up[i] = true;
            }
            __syncthreads();
            continue;
          }
          // A recv that posts late and has waited that long without progress: its descriptor goes
          // out at the next round (late_due is read after the barrier below).
          if (threadIdx.x == 0 && !send && slice == 0 && chunk == 0 && a.post_late && !posted[i] && !late_due[i] &&
              detail::globaltimer_ns() - since[i] >= static_cast<uint64_t>(settings::kLatePostNs))
            late_due[i] = true;
          // The watchdog, on one clock reading for the whole block (thread 0's): threads that
          // disagreed would break the block's barriers.
          const bool over = threadIdx.x == 0 && channel_stalled(a, since[i]);
          const bool stalled = __syncthreads_or(over);
          if (stalled && report_timeout(a, send, slice, chunk, k)) {
            if (threadIdx.x == 0) atomicExch(a.failed, 1u), gave_up[i] = true;  // the host refuses this peer from now on
            __syncthreads();
          }
          continue;
        }
        if (send)
          send_chunk(a, slice, chunk, k, message[i]);
        else
          recv_chunk(a, slice, chunk, k);
        if (threadIdx.x == 0) {
          next[i][j] = chunk + 1;
          header_ok[i][j] = 0;
          moved(a, since[i]);
        }
        __syncthreads();
      }
    }
  }
  // The next kernel on the stream may be set up only now: its blocks sit on SMs (in
  // wait_for_previous_grid) from the moment every block of ours has said so, and while ours
  // still wait on a peer those SMs may be the ones another kernel of this PE (another stream's
  // send that the peer waits for) or a PE sharing the GPU needs: a deadlock until the timeout.
  // Past the loop nothing waits on a peer any more.
  if (stamping) stamp[kLoopLeft] = detail::globaltimer_ns();
  if (threadIdx.x == 0) atomicSub(batch.ops[0].activity, 1u);
  allow_next_grid();
  // The test hook's counters (block 0 holds every op's first slice): ops finished, by mode.
  if (block == 0 && threadIdx.x == 0) {
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      if (gave_up[i] || a.zc_counters == nullptr || *reinterpret_cast<volatile unsigned int*>(a.failed) != 0)
        continue;
      const bool copy_engine = mode[i] == zero_copy_detail::kModeCopyEngine;
      const bool zero_copy = mode[i] == zero_copy_detail::kModeZeroCopy || copy_engine;
      const bool low_latency = mode[i] == low_latency_detail::kModeLowLatency;
      const int counter = batch.is_send[i] ? (low_latency ? kSendLowLatency : zero_copy ? kSendZeroCopy : kSendStaged)
                                           : (low_latency ? kRecvLowLatency : zero_copy ? kRecvZeroCopy : kRecvStaged);
      atomicAdd(a.zc_counters + counter, 1ull);
      if (copy_engine) atomicAdd(a.zc_counters + kSendCopyEngine, 1ull);
    }
  }
  if (stamping) stamp[kCountersDone] = detail::globaltimer_ns();
  for (int i = 0; i < batch.count; ++i)
    for (int j = 0; j < kMaxSlicesPerBlock && block + j * grid < batch.ops[i].active_blocks; ++j)
      finish_slice(batch.ops[i], first[i], message[i]);
  if (stamping) {
    stamp[kEnded] = detail::globaltimer_ns();
    record_phase_stamps(stamp_slot, stamp, mode[0], batch.is_send[0]);
  }
}


// A batch whose every op moves by the low-latency protocol (a small send, recv or sendrecv
// between load/store peers, or a group of them): one block runs the ops in the channel's order,
// as chunk_batch_kernel's block 0 does, without what only chunked and zero-copy messages need
// there (the slices' state set up, a look at the channel's failure flag per visit, finish_slice's
// fence and count across blocks): a low-latency op has one slice, so only this block touches
// its channel in the launch, and the thread that read the channel's counters moves them on.
// Measured 2026-12-03 (the phase stamps, 4 KiB one way, 2 PEs under MPS): the general kernel took
// 7.8 us a message, a bare copy kernel 2.5 us; its prologue, flag looks, counters and
// finish_slice were 4 us of it.
template <int kCapacity>
__global__ void __launch_bounds__(kThreads) low_latency_batch_kernel(const SizedBatch<kCapacity> batch) {
  __shared__ uint64_t stamp[kPhaseStamps];
  const bool stamping = threadIdx.x == 0 && phase_stamps_on();
  unsigned long long stamp_slot = 0;  // the record's slot in the ring (stamping only)
  if (stamping) {
    for (int p = 0; p < kPhaseStamps; ++p) stamp[p] = 0;
    stamp[kEntered] = detail::globaltimer_ns();
  }
  wait_for_previous_grid();  // launch_kernel: the channel's counters and the user's data are ready
  if (stamping) {
    stamp[kGridWaited] = detail::globaltimer_ns();
    stamp_slot = take_phase_stamp_slot();
  }
  // Per op (thread 0 changes them, between barriers): the channel's chunk sequence and message
  // ordinal, its last progress, whether it is over (finished, or given up) and given up, and
  // whether a recv's rendezvous descriptor is out.
  __shared__ uint64_t first[kCapacity], message[kCapacity], since[kCapacity];
  __shared__ int64_t over[kCapacity];  // 0 or 1: receiver_refused's `next` against 1 chunk
  __shared__ bool gave_up[kCapacity], posted[kCapacity];
  __shared__ bool late_due[kCapacity];  // a recv that posts late (a.post_late): its time has come
  // The op before each on its channel (-1: none). Ops of one channel finish in its order and give up
  // together, so that one op says what a scan of all the earlier ones would: a scan per op and
  // round made a group of 32 ops quadratic in every round of the loop.
  __shared__ signed char before[kCapacity];
  __shared__ uint64_t channel_broken[kCapacity];  // a channel's refusal word, at its first op
  if (threadIdx.x < batch.count) {
    const int i = static_cast<int>(threadIdx.x);
    const ChunkStreamArgs& a = batch.ops[i];
    before[i] = static_cast<signed char>(previous_on_channel(batch.ops, i));
    op_start(a, first[i], message[i], since[i]);
    posted[i] = batch.is_send[i] || !a.post_descriptor;
    late_due[i] = false;
    if (before[i] < 0) channel_broken[i] = *reinterpret_cast<volatile uint64_t*>(a.broken);
  }
  __syncthreads();
  // A refused channel moves nothing until setup_send_recv() rebuilds it. Its word is read once, by
  // the channel's first op, for all of its ops: each reading its own could see a refusal the peer
  // stored meanwhile where an earlier op did not, and the earlier op would move behind ops
  // already given up (a review's finding).
  if (threadIdx.x < batch.count) {
    const int i = static_cast<int>(threadIdx.x);
    const uint64_t broken = channel_broken[batch_order::channel_head(before, i)];
    gave_up[i] = broken != 0;
    over[i] = broken != 0 ? 1 : 0;
    if (broken != 0) refuse(batch.ops[i], detail::WaitOp::kChannelRefused, broken - 1);
  }
  __syncthreads();
  if (stamping) stamp[kPrologueDone] = detail::globaltimer_ns();
  // In the loop, where a block may wait on a peer: counted for the peers' bounded descriptor
  // waits (zero_copy.cuh, fall_back_to_staged). A reduction: nothing waits for its result.
  if (threadIdx.x == 0) atomicAdd(batch.ops[0].activity, 1u);
  for (bool all_done = false; !all_done;) {
    all_done = true;
    if (stamping && stamp[kOpDone] == 0 && over[0] != 0) stamp[kOpDone] = detail::globaltimer_ns();
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      // An op's flags change only in its own visit, after the barrier below, which every thread
      // reaches, and before the barrier that ends the visit: an op over, or behind the op before
      // it, reads the same here in every thread and is passed without a barrier (a barrier per op
      // and round made a 32-op group pay 32 a round for the two ops that move).
      if (over[i] != 0) continue;
      all_done = false;
      // Ops of one channel move in its order: the op before is over only once every earlier one
      // is (it moved only when they were), and it gave up if the channel failed in this launch (an
      // op that finds its channel failed gives up too, below; a refused channel's ops all start
      // given up). A later op of the channel has not moved while this one is not over.
      if (batch_order::waits(before[i], [&](int e) { return over[e] != 0; })) continue;
      const bool channel_failed = batch_order::failed_before(before[i], gave_up);
      // Read by every thread before the barrier below, after which thread 0 may change them: all
      // threads take the same branches (each holds a barrier).
      const bool post_now = !posted[i] && (!a.post_late || late_due[i]);
      __syncthreads();
      if (channel_failed) {
        if (threadIdx.x == 0) over[i] = 1, gave_up[i] = true;
        __syncthreads();
        continue;
      }
      if (post_now) {  // a recv's descriptor, when its turn on the channel comes (chunk_batch_kernel)
        if (threadIdx.x == 0) {
          post_descriptor(a, message[i], first[i]);
          posted[i] = true;
          if (stamping && i == 0) stamp[kPosted] = stamp[kRendezvous] = detail::globaltimer_ns();
        }
        __syncthreads();
      }
      if (batch.is_send[i]) {
        if (low_latency_send_visit(a, message[i])) {
          if (threadIdx.x == 0) {
            over[i] = 1;
            moved(a, since[i]);
          }
          __syncthreads();
          continue;
        }
        // Its slot is not credited yet: the receiver may have refused, or the watchdog.
        if (receiver_refused(a, over[i], 1, gave_up[i])) continue;
        if (threadIdx.x == 0 && channel_stalled(a, since[i])) {
          detail::record_timeout(a.status, detail::WaitOp::kChunkCredit, a.peer, a.my_pe,
                                 a.ll_filled[message[i] % kLowLatencySlots], detail::load_acquire_sys(a.ll_credit));
          atomicExch(a.failed, 1u);  // the host refuses this peer from now on
          over[i] = 1, gave_up[i] = true;
        }
        __syncthreads();
        continue;
      }
      // A bounded spin on the message while no other op of the block is left to move.
      bool alone = true;
      for (int e = 0; e < batch.count; ++e) alone = alone && (e == i || over[e] != 0);
      const int seen = low_latency_recv_visit(a, message[i], first[i], since[i], alone ? kDescriptorSpinNs : 0);
      if (threadIdx.x == 0 && seen != kLowLatencyWaiting) {
        over[i] = 1;
        if (seen == kLowLatencyGaveUp) gave_up[i] = true;
      }
      // No message yet after settings::kLatePostNs: a recv that posts late posts at its next visit.
      if (threadIdx.x == 0 && seen == kLowLatencyWaiting && a.post_late && !posted[i] && !late_due[i] &&
          detail::globaltimer_ns() - since[i] >= static_cast<uint64_t>(settings::kLatePostNs))
        late_due[i] = true;
      __syncthreads();
    }
  }
  if (stamping) stamp[kLoopLeft] = detail::globaltimer_ns();
  if (threadIdx.x == 0) atomicSub(batch.ops[0].activity, 1u);
  allow_next_grid();  // nothing waits on a peer any more (chunk_batch_kernel)
  if (threadIdx.x == 0) {
    // The test hook's counters: ops finished, unless their channel failed in the launch (the
    // failure flag, which only this block sets for a low-latency channel).
    bool channel_failed[kCapacity], known[kCapacity];
    batch_order::channel_failed(before, gave_up, batch.count, channel_failed, known);
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      if (!channel_failed[i] && a.zc_counters != nullptr)
        atomicAdd(a.zc_counters + (batch.is_send[i] ? kSendLowLatency : kRecvLowLatency), 1ull);
    }
    if (stamping) stamp[kCountersDone] = detail::globaltimer_ns();
    // The channel's counters move on at its last op of the launch (finish_slice's last slice);
    // the next launch on the channel is ordered after this one (stream or event), which makes
    // these stores visible to it.
    for (int i = 0; i < batch.count; ++i) {
      const ChunkStreamArgs& a = batch.ops[i];
      if (a.offset_messages + 1 != a.channel_messages) continue;
      *a.done = 0;
      move_channel_on(a, first[i], message[i]);
    }
    if (stamping) {
      stamp[kEnded] = detail::globaltimer_ns();
      record_phase_stamps(stamp_slot, stamp, low_latency_detail::kModeLowLatency, batch.is_send[0]);
    }
  }
}

}  // namespace

template <int kCapacity>
cudaError_t launch_sized(const ChunkBatch& batch, int blocks, cudaStream_t stream, bool programmatic) {
  SizedBatch<kCapacity> sized{};
  bool all_low_latency = true;
  for (int i = 0; i < batch.count; ++i) {
    sized.ops[i] = batch.ops[i];
    sized.is_send[i] = batch.is_send[i];
    all_low_latency = all_low_latency && batch.ops[i].low_latency;
  }
  sized.count = batch.count;
  if (all_low_latency)  // one slice per op: one block (low_latency_batch_kernel)
    return launch_kernel(low_latency_batch_kernel<kCapacity>, dim3(1), dim3(kThreads), 0, stream, programmatic, sized);
  return launch_kernel(chunk_batch_kernel<kCapacity>, dim3(blocks), dim3(kThreads), 0, stream, programmatic, sized);
}

namespace {
// The launch's blocks (0: nothing to launch): block b drives slices b, b + grid, ... of every op.
// No more blocks than can be resident at once (a block that waits its turn would hold its
// slices' peers back until a block ahead of it ends), and no more slices than a block holds.
int chunk_batch_blocks(const ChunkBatch& batch) {
  int slices = 0;
  for (int i = 0; i < batch.count; ++i) slices = max(slices, batch.ops[i].active_blocks);
  if (slices == 0) return 0;
  const int least = (slices + kMaxSlicesPerBlock - 1) / kMaxSlicesPerBlock;
  return max(least, min(slices, max(1, batch.max_grid)));
}
}  // namespace

void chunk_batch_node(const ChunkBatch& batch, ChunkBatchNode& params) {
  static_assert(sizeof(SizedBatch<2>) <= sizeof(params.storage), "ChunkBatchNode holds a batch of 2 ops");
  PDC_REQUIRE(batch.count >= 1 && batch.count <= 2, "a copy-engine launch holds 1 or 2 ops, got " << batch.count);
  SizedBatch<2>* sized = new (params.storage) SizedBatch<2>{};
  for (int i = 0; i < batch.count; ++i) sized->ops[i] = batch.ops[i], sized->is_send[i] = batch.is_send[i];
  sized->count = batch.count;
  params.args[0] = sized;
  params.node = cudaKernelNodeParams{};
  params.node.func = batch.ops[0].ce_phase == kCopyEngineProbe ? reinterpret_cast<void*>(copy_engine_probe_kernel<2>)
                                                                : reinterpret_cast<void*>(chunk_batch_kernel<2>);
  params.node.gridDim = dim3(static_cast<unsigned>(max(1, chunk_batch_blocks(batch))));
  params.node.blockDim = dim3(kThreads);
  params.node.sharedMemBytes = 0;
  params.node.kernelParams = params.args;
  params.node.extra = nullptr;
}

void launch_chunk_batch(const ChunkBatch& batch, cudaStream_t stream, bool programmatic) {
  const int blocks = chunk_batch_blocks(batch);
  if (blocks == 0) return;
  const cudaError_t launched =
      batch.count <= 2             ? launch_sized<2>(batch, blocks, stream, programmatic)
      : batch.count <= kMidBatchOps ? launch_sized<kMidBatchOps>(batch, blocks, stream, programmatic)
                                    : launch_sized<kMaxBatchOps>(batch, blocks, stream, programmatic);
  // A failed cudaLaunchKernelEx also leaves the thread's last error set: cleared, or torch's next
  // launch check would report it as its own.
  if (launched != cudaSuccess) cudaGetLastError();
  PDC_CHECK_CUDA(launched);
}

namespace {
// set_launch_settings' values (init_nvshmem sets them before any launch).
std::atomic<bool> g_programmatic_wanted{true};
std::atomic<int> g_ranks_per_gpu{1};
std::atomic<double> g_mps_thread_percentage{0};
}  // namespace

void set_launch_settings(const LaunchSettings& launch) {
  g_programmatic_wanted.store(launch.programmatic_launch, std::memory_order_relaxed);
  g_ranks_per_gpu.store(launch.ranks_per_gpu, std::memory_order_relaxed);
  g_mps_thread_percentage.store(launch.mps_thread_percentage, std::memory_order_relaxed);
}

void set_phase_stamps(bool on) {
  const int flag = on ? 1 : 0;
  const unsigned long long zero = 0;
  if (on) PDC_CHECK_CUDA(cudaMemcpyToSymbol(g_phase_stamp_count, &zero, sizeof(zero)));
  PDC_CHECK_CUDA(cudaMemcpyToSymbol(g_phase_stamps_on, &flag, sizeof(flag)));
}

void set_zero_copy_fallback_waits(uint64_t held_ns, uint64_t long_ns) {
  const uint64_t waits[2] = {held_ns, long_ns};
  PDC_CHECK_CUDA(cudaMemcpyToSymbol(c_zero_copy_fallback_waits, waits, sizeof(waits)));
}

std::vector<PhaseStampRecord> read_phase_stamps() {
  unsigned long long count = 0;
  PDC_CHECK_CUDA(cudaMemcpyFromSymbol(&count, g_phase_stamp_count, sizeof(count)));
  std::vector<PhaseStampRecord> ring(kPhaseStampRing);
  PDC_CHECK_CUDA(cudaMemcpyFromSymbol(ring.data(), g_phase_stamps, sizeof(PhaseStampRecord) * ring.size()));
  std::vector<PhaseStampRecord> records;
  const unsigned long long kept = count < kPhaseStampRing ? count : kPhaseStampRing;
  for (unsigned long long n = count - kept; n < count; ++n) records.push_back(ring[n % kPhaseStampRing]);
  return records;
}

bool programmatic_launch_enabled() {
  if (!g_programmatic_wanted.load(std::memory_order_relaxed)) return false;
  // Per device: 0 not asked yet, 1 no (before sm_90), 2 yes (threads may ask at once: atomics).
  static std::atomic<int> known[64] = {};
  int device = 0;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return false;
  int answer = known[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    int major = 0;
    PDC_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    // The kernels' griddepcontrol instructions exist only in code compiled for sm_90+: a build
    // without such a target (CUDAARCHS=80) runs on an H100 from compute_80 PTX, with no
    // wait_for_previous_grid, and a programmatic launch would then read before its predecessor
    // (a user's kernel that triggers early) has finished.
    cudaFuncAttributes small{}, mid{}, large{};
    PDC_CHECK_CUDA(cudaFuncGetAttributes(&small, chunk_batch_kernel<2>));
    PDC_CHECK_CUDA(cudaFuncGetAttributes(&mid, chunk_batch_kernel<kMidBatchOps>));
    PDC_CHECK_CUDA(cudaFuncGetAttributes(&large, chunk_batch_kernel<kMaxBatchOps>));
    answer = major >= 9 && small.ptxVersion >= 90 && mid.ptxVersion >= 90 && large.ptxVersion >= 90 ? 2 : 1;
    known[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

namespace {
// The whole GPU's SMs split between the PEs sharing it (the more of PYDATACOPY_RANKS_PER_GPU and
// the PEs init() found on this GPU).
int sms_per_sharing_pe(int whole, int pes_sharing_gpu) {
  int share = whole;
  const int ranks = g_ranks_per_gpu.load(std::memory_order_relaxed);  // PYDATACOPY_RANKS_PER_GPU
  if (ranks > 1) share = std::min(share, whole / ranks);
  if (pes_sharing_gpu > 1) share = std::min(share, whole / pes_sharing_gpu);
  return share;
}

// SMs this process's context may use. Under MPS with an active thread percentage the device
// attribute (and the context's execution affinity, read through the runtime's driver entry point:
// the core does not link libcuda) already report this client's share, not the whole GPU: measured
// on an H200 at 50%, 66 of 132. With K PEs sharing the GPU (PYDATACOPY_RANKS_PER_GPU=K, or the K
// PEs init() found on this GPU, whichever is more: ranks placed with device= set no variable), each
// gets at most a K-th of the whole GPU, so that the K launches of a sendrecv between them all fit at
// once also when MPS sets no limit. The whole GPU is the share * 100 / percentage where the
// percentage is in the environment; dividing the share itself by K again (as before 2026-12-01) left
// zero-copy and all-to-all kernels half (2 PEs) or a quarter (4 PEs) of the SMs MPS gives them.
int usable_sms(int device, int pes_sharing_gpu) {
  int reported = 0;
  PDC_CHECK_CUDA(cudaDeviceGetAttribute(&reported, cudaDevAttrMultiProcessorCount, device));
  int usable = reported;
  using GetExecAffinity = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &function, 11040, cudaEnableDefault,
                                       &found) == cudaSuccess &&
      found == cudaDriverEntryPointSuccess && function != nullptr) {
    CUexecAffinityParam affinity{};
    if (reinterpret_cast<GetExecAffinity>(function)(&affinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS &&
        affinity.param.smCount.val > 0)
      usable = std::min(usable, static_cast<int>(affinity.param.smCount.val));
  }
  cudaGetLastError();  // a failed query is no error of the caller's
  int whole = reported;
  const double percent = g_mps_thread_percentage.load(std::memory_order_relaxed);  // 0: unset
  if (percent > 0 && percent < 100) whole = static_cast<int>(reported * 100.0 / percent);  // never rounded up
  return std::max(1, std::min(usable, sms_per_sharing_pe(whole, pes_sharing_gpu)));
}
}  // namespace

int all_to_all_blocks(int pes_sharing_gpu) {
  // Asked at every exchange: the answer (a driver query and the environment) is kept per device
  // and PE count for the process's life, as the send/recv engine keeps its own from init.
  int device = 0;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, pes_sharing_gpu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  const int blocks = usable_sms(device, pes_sharing_gpu);
  known.emplace(key, blocks);
  return blocks;
}

int chunk_batch_blocks_per_sm() {
  int small = 0, mid = 0, large = 0;
  PDC_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&small, chunk_batch_kernel<2>, kThreads, 0));
  PDC_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&mid, chunk_batch_kernel<kMidBatchOps>,
                                                               kThreads, 0));
  PDC_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&large, chunk_batch_kernel<kMaxBatchOps>,
                                                               kThreads, 0));
  return std::max(1, std::min({small, mid, large}));
}

int chunk_batch_resident_blocks(int pes_sharing_gpu) {
  int device = 0;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  return std::max(1, usable_sms(device, pes_sharing_gpu) * chunk_batch_blocks_per_sm());
}

void preload_send_recv_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, chunk_batch_kernel<2>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, chunk_batch_kernel<kMidBatchOps>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, chunk_batch_kernel<kMaxBatchOps>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, low_latency_batch_kernel<2>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, low_latency_batch_kernel<kMidBatchOps>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, low_latency_batch_kernel<kMaxBatchOps>));
}

}  // namespace pydatacopy::kernels
