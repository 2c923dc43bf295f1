// Zero-copy send/recv on the device: the rendezvous of send_recv.hpp, inside the send/recv batch
// kernel (send_recv.cu includes this file inside its anonymous namespace, after refuse()).
//
// Per op the kernel keeps a mode in shared memory: a recv knows its own (the host decided it:
// zero-copy at (index, offset), else staged); a send that awaits a descriptor learns it from the
// receiver's descriptor, read by each block when it first visits one of the op's slices (every
// block reads the same descriptor, so all take the same mode; for a zero-copy one the blocks then
// wait for block 0 (slice 0's) to look the receiver's allocation up, take_descriptor).
#pragma once

namespace zero_copy_detail {
constexpr int kModeStaged = 1, kModeZeroCopy = 2;
// A send the copy engine moved (the copy-engine graph's step after its copy: kCopyEngineCopied).
constexpr int kModeCopyEngine = 4;  // beside low_latency_detail's kModeLowLatency (3)
// A sender slice's done word: (message + 1) << 24 | chunks written: 0 once the slice has
// started the message (before it writes anything), kCancel when it gave the message up before
// writing anything, kFinal once all its writes landed. Words only grow, so a later message never
// looks like an earlier one's.
constexpr uint64_t kFinal = 0xFFFFFF, kCancel = kFinal - 1, kMostProgress = kFinal - 2;
// The resolved ring's base when the resolver gave the descriptor wait up (fall_back_to_staged):
// the message moves staged. No allocation starts at address 1.
constexpr uint64_t kFallbackBase = 1;
// A zero-copy recv's verdict in the descriptor (RendezvousDescriptor::verdict).
__device__ __forceinline__ uint64_t verdict_word(uint64_t message, bool staged) {
  return ((message + 1) << 1) | (staged ? 1 : 0);
}
__device__ __forceinline__ uint64_t done_word(uint64_t message, uint64_t written) {
  return ((message + 1) << 24) | written;
}
}  // namespace zero_copy_detail

// Thread 0. The receiver's descriptor of message `message` (first chunk `first`) into the
// sender's ring: the fields, then `message` with a release (the sender acquires it).
__device__ __forceinline__ void post_descriptor(const ChunkStreamArgs& a, uint64_t message, uint64_t first) {
  RendezvousDescriptor* d = a.peer_ring + message % kRendezvousRing;
  volatile RendezvousDescriptor* v = d;
  v->first = first + 1;
  v->bytes = static_cast<uint64_t>(a.bytes);
  v->mode = a.zero_copy ? kPostedZeroCopy : kPostedStaged;
  v->index = a.zc_index;
  v->offset = a.zc_offset;
  store_release_sys(&d->message, message + 1);
}

// Thread 0, recv side: refuse the channel at both ends (the sender's refusal word gets this
// recv's bytes + 1, ours the sender's), and record it for this call.
__device__ __forceinline__ void refuse_from_recv(const ChunkStreamArgs& a, uint64_t sender_bytes) {
  *reinterpret_cast<volatile uint64_t*>(a.broken) = sender_bytes + 1;
  if (a.peer_broken != nullptr) {
    store_release_sys(a.peer_refused_bytes, sender_bytes + 1);  // the sender's host names both sizes
    __threadfence_system();
    store_release_sys(a.peer_broken, static_cast<uint64_t>(a.bytes) + 1);
  }
  refuse(a, detail::WaitOp::kChunkArrival, sender_bytes);
  __threadfence_system();  // before this PE looks at whether the sender's slices started
}

// Thread 0, send side: the receiver's descriptor disagrees (another size, or a mapping this PE
// no longer holds): refuse at both ends before anything is written. The channel's failure flag
// is set before the receiver's word, with a full fence between: a slice of this launch that
// starts a zero-copy message after the receiver saw the word sees the flag (zero_copy_begin).
__device__ __forceinline__ void refuse_from_send(const ChunkStreamArgs& a, detail::WaitOp why,
                                                 uint64_t receiver_bytes) {
  *reinterpret_cast<volatile uint64_t*>(a.broken) = receiver_bytes + 1;
  refuse(a, why, receiver_bytes);
  __threadfence_system();
  store_release_sys(a.peer_recv_broken, static_cast<uint64_t>(a.bytes) + 1);
}

// Thread 0, send side, before a slice writes anything of a zero-copy message: says so in its
// done word, then (after a full fence) looks at the channel's failure flag and refusal word.
// Returns false, after cancelling the slice's part in its done word, when either is set. The
// receiver that gives up a slice not started first stores this refusal word itself, then fences,
// then looks at the done word again (the kernel's zero-copy wait): so either this look sees the
// word, or the receiver sees that the slice started and waits for its end. A receiver never gives
// up a message whose bytes a sender may still write. Once started, a slice finishes its part
// whatever happens (a copy waits on nothing).
__device__ __forceinline__ bool zero_copy_begin(const ChunkStreamArgs& a, int slice, uint64_t message) {
  volatile uint64_t* word = a.peer_zc_done + slice;
  *word = zero_copy_detail::done_word(message, 0);
  __threadfence_system();
  const bool failed = *reinterpret_cast<volatile unsigned int*>(a.failed) != 0 ||
                      *reinterpret_cast<volatile uint64_t*>(a.broken) != 0;
  if (failed) *word = zero_copy_detail::done_word(message, zero_copy_detail::kCancel);
  return !failed;
}

// Thread 0, send side. Returns 0 while the descriptor of `message` (or, for a block other than
// the resolver's, the resolved target) is not there, else the mode (kModeStaged / kModeZeroCopy,
// with *target set), or -1 after the channel was refused (by this block, or by the resolver).
//
// The receiver's allocation is looked up in the sender's table once per message, by block 0 (the
// `resolver`, which drives slice 0; from any of its slices), which publishes the base it read in
// the channel's resolved ring: the table is host-mapped (the host changes it at any time, see
// send_recv.cpp), and 66 blocks each reading it over PCIe cost ~1 us apiece, one after another, on
// an H200 (a zero-copy message spent 45-80 us in its kernels beyond the copy until 2026-12-02).
// All blocks thus write through the same mapping, or all give up.
__device__ __forceinline__ int take_descriptor(const ChunkStreamArgs& a, uint64_t message, uint64_t first,
                                               bool resolver, uint8_t** target) {
  RendezvousDescriptor* d = a.ring + message % kRendezvousRing;
  uint64_t* resolved = a.zc_resolved + 2 * (message % kRendezvousRing);  // {message + 1, base}
  // The resolver gave the wait up (fall_back_to_staged): staged, descriptor or not.
  const auto fell_back = [&] {
    return !resolver && a.zc_fallback && load_acquire_gpu(resolved) == message + 1 &&
           *reinterpret_cast<volatile uint64_t*>(resolved + 1) == zero_copy_detail::kFallbackBase;
  };
  if (detail::load_acquire_sys(&d->message) != message + 1) return fell_back() ? zero_copy_detail::kModeStaged : 0;
  const volatile RendezvousDescriptor* v = d;
  const uint64_t bytes = v->bytes, posted_first = v->first, offset = v->offset;
  const uint32_t mode = v->mode;
  const int index = v->index;
  if (bytes != static_cast<uint64_t>(a.bytes) || posted_first != first + 1) {
    refuse_from_send(a, detail::WaitOp::kChunkCredit, bytes);
    return -1;
  }
  if (mode != kPostedZeroCopy) return zero_copy_detail::kModeStaged;
  uint64_t base = 0;
  if (resolver) {
    base = index >= 0 && index < kZeroCopyTableEntries ? a.zc_table[index] : 0;
    *reinterpret_cast<volatile uint64_t*>(resolved + 1) = base;
    store_release_gpu(resolved, message + 1);
    if (base == 0) {  // unmapped since the receiver posted it: never write through a guess
      refuse_from_send(a, detail::WaitOp::kZeroCopyMapping, bytes);
      return -1;
    }
  } else {
    if (load_acquire_gpu(resolved) != message + 1) return 0;
    base = *reinterpret_cast<volatile uint64_t*>(resolved + 1);
    if (base == 0) return -1;  // the resolver refused the channel (and recorded it)
    if (base == zero_copy_detail::kFallbackBase) return zero_copy_detail::kModeStaged;
  }
  *target = reinterpret_cast<uint8_t*>(base) + offset;
  return zero_copy_detail::kModeZeroCopy;
}

// The bounded descriptor wait (send_recv.hpp, "a send that fits the staging"): a send whose
// message fits the staging (a.zc_fallback) moves staged once its receiver has been held inside
// send/recv kernels (its activity word: blocks in their loops) for kZeroCopyFallbackWaitNs
// without a break, so that `send(); recv()` on two PEs without a group still completes, as it did
// below the threshold; or once it has waited kZeroCopyFallbackLongWaitNs, whatever holds its
// receiver (a barrier queued behind this send). A receiver late for a shorter while for any other
// reason (its stream busy, its host not there yet) is waited for, and the message moves once.
// Sender and receiver agree on the mode by a store-fence-load on each
// side (a sequentially consistent system fence between each side's store and its load, so at
// least one side sees the other's store):
//   sender:   descriptor.fallback = message + 1; fence; look at descriptor.message
//   receiver: descriptor.message = message + 1 (post_descriptor); fence; look at .fallback,
//             then descriptor.verdict = (message + 1) << 1 | (it saw the fallback)
// A sender that does not see the post moves staged, and the receiver then sees its fallback (the
// post is later than the sender's look, so its look is later than the sender's store): staged at
// both ends. A sender that sees the post may or may not have been seen: it waits for the
// receiver's verdict and follows it. A send that took its descriptor in time never stores the
// fallback, and its receiver's verdict is zero-copy. The receiver's slices other than its first
// wait for the verdict too (zero-copy: nothing for them to do; staged: their share of the pages).
//
// Thread 0 of the resolver (block 0), once the wait is over: returns take_descriptor's codes;
// `intent` (the op's, in shared memory) says that the fallback store went out already.
__device__ __forceinline__ int fall_back_to_staged(const ChunkStreamArgs& a, uint64_t message, uint64_t first,
                                                   bool& intent, uint8_t** target) {
  RendezvousDescriptor* d = a.ring + message % kRendezvousRing;
  uint64_t* resolved = a.zc_resolved + 2 * (message % kRendezvousRing);
  const auto staged = [&] {  // the launch's other blocks learn it from the resolved ring
    *reinterpret_cast<volatile uint64_t*>(resolved + 1) = zero_copy_detail::kFallbackBase;
    store_release_gpu(resolved, message + 1);
    return zero_copy_detail::kModeStaged;
  };
  if (!intent) {
    *reinterpret_cast<volatile uint64_t*>(&d->fallback) = message + 1;
    __threadfence_system();  // fence.sc.sys: the store before the look
    intent = true;
    if (detail::load_acquire_sys(&d->message) != message + 1) return staged();
  }
  // Posted: its sizes first (a mismatch is refused as take_descriptor does), then its mode.
  const volatile RendezvousDescriptor* v = d;
  if (v->bytes != static_cast<uint64_t>(a.bytes) || v->first != first + 1 || v->mode != kPostedZeroCopy)
    return take_descriptor(a, message, first, true, target);
  const uint64_t verdict = detail::load_acquire_sys(&d->verdict);
  if (verdict == zero_copy_detail::verdict_word(message, true)) return staged();
  if (verdict == zero_copy_detail::verdict_word(message, false))
    return take_descriptor(a, message, first, true, target);
  return 0;  // the receiver has posted and not yet looked: soon
}

// Thread 0 of the receiver's block 0, right after it posted a zero-copy descriptor whose message
// fits the staging: the receiver's half of the agreement above. Returns whether the message
// moves staged.
__device__ __forceinline__ bool post_verdict(const ChunkStreamArgs& a, uint64_t message) {
  RendezvousDescriptor* d = a.peer_ring + message % kRendezvousRing;
  __threadfence_system();  // fence.sc.sys: the post before the look
  const bool staged = *reinterpret_cast<volatile uint64_t*>(&d->fallback) == message + 1;
  store_release_sys(&d->verdict, zero_copy_detail::verdict_word(message, staged));
  return staged;
}

// Thread 0 of a receiver's block, for a zero-copy recv's slice other than its first: the verdict
// of its block 0 (post_verdict), read back from the sender's ring. 0: not yet, 1: zero-copy,
// 2: staged.
__device__ __forceinline__ int read_verdict(const ChunkStreamArgs& a, uint64_t message) {
  const uint64_t verdict = detail::load_acquire_sys(&a.peer_ring[message % kRendezvousRing].verdict);
  return verdict == zero_copy_detail::verdict_word(message, false)  ? 1
         : verdict == zero_copy_detail::verdict_word(message, true) ? 2
                                                                    : 0;
}

// All threads, send side: the next visit of slice `slice` to its part of the message, straight
// into the receive buffer; then its done word at the receiver. A zero-copy message has no staging
// pages to follow, so slice s owns one contiguous range, the s-th of zc_slices equal parts (256-byte
// multiples): a block streams through it with eight 16-byte loads in flight per thread. (Following
// the staging's 32 KiB pages, as until 2026-12-01, gave each thread one 4-vector copy per call and
// reached 0.70x a bare copy's throughput at 1 GiB.) `i` counts visits, in the op's chunk units: a
// visit moves at least kVisitBytes, and at least the part over chunk_count(a), so that the slice ends
// within chunk_count(a) visits (the receiver reads the count as progress for its watchdog; only the
// final word means done). A visit is long enough that the block's bookkeeping between visits costs
// little, short enough that the block soon polls its other ops again. Progress words need no fence
// (they only feed the watchdog); the last one follows a system fence: the writes land first.
// `copied_at` (thread 0 of block 0 with the phase stamps on, else null): the time the slice's last
// visit finished its copy, before that fence.
constexpr int64_t kVisitBytes = 2 << 20;
__device__ __forceinline__ int64_t zero_copy_chunks(const ChunkStreamArgs& a, int slice, int64_t i,
                                                    uint64_t message, uint8_t* target, uint64_t* copied_at) {
  const int64_t units = chunk_count(a);
  const int64_t per = (((a.bytes + a.zc_slices - 1) / a.zc_slices) + 255) / 256 * 256;
  const int64_t begin = min(a.bytes, slice * per), end = min(a.bytes, begin + per);
  const int64_t visit = max(kVisitBytes, (end - begin + units - 1) / units);
  const int64_t from = min(end, begin + i * visit), to = min(end, from + visit);
  if (from < to) copy_bytes<8, true>(target + from, a.src + from, to - from, threadIdx.x, blockDim.x);
  const int64_t next = to >= end ? units : i + 1;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (next >= units) {
      if (copied_at != nullptr) *copied_at = detail::globaltimer_ns();
      __threadfence_system();  // cumulative: the block's stores, seen through the barrier
      store_after_fence_sys(a.peer_zc_done + slice, zero_copy_detail::done_word(message, zero_copy_detail::kFinal));
    } else {
      *reinterpret_cast<volatile uint64_t*>(a.peer_zc_done + slice) =
          zero_copy_detail::done_word(message, min(static_cast<uint64_t>(next), zero_copy_detail::kMostProgress));
    }
  }
  return next;
}

// Recv side of a zero-copy op (any thread of the waiting block): what the sender's slice `slice`
// has said of the message so far.
struct Landed {
  bool started, cancelled, final;
  int64_t chunks;  // written so far (chunk_count once final)
};
__device__ __forceinline__ Landed zero_copy_landed(const ChunkStreamArgs& a, int slice, uint64_t message) {
  const uint64_t word = detail::load_acquire_sys(a.zc_done + slice);
  const uint64_t start = zero_copy_detail::done_word(message, 0);
  Landed l{false, false, false, 0};
  if (word < start) return l;
  l.started = true;
  const uint64_t said = word - start;
  l.final = said >= zero_copy_detail::kFinal;
  l.cancelled = said == zero_copy_detail::kCancel;
  l.chunks = l.final ? chunk_count(a) : l.cancelled ? 0 : min(static_cast<int64_t>(said), chunk_count(a) - 1);
  return l;
}

// Thread 0, recv side of a zero-copy op, slice 0: the sender sent the message staged instead
// (its size under the threshold: another size than ours). Returns true after refusing.
// Only the arrival of exactly this message's first chunk counts: a later one on that page means
// that page was credited since, which this PE never did for a message sent staged to it.
__device__ __forceinline__ bool staged_instead(const ChunkStreamArgs& a, uint64_t first, uint64_t message) {
  const int64_t slot = static_cast<int64_t>(first % a.num_slots);
  if (detail::load_acquire_sys(a.arrivals + slot * a.pages) != first + 1) return false;
  const volatile SlotHeader* h = a.headers + slot * a.pages;
  // A later message's first chunk (this one took no chunk: it went by the low-latency protocol,
  // and the sender is past it) is not this message sent staged.
  if (h->message != message + 1) return false;
  refuse_from_recv(a, h->message_bytes);
  return true;
}

// All threads of the block that drives a zero-copy recv's slice 0: one look at the done word of
// every sender slice (thread t reads slices t, t + blockDim.x, ...). The recv's other slices are
// idle: one block waits for the whole message, so the receiver's launch is one block, which finds
// an SM at once on a GPU whose SMs the sender's blocks hold (PEs sharing a GPU under MPS: with a
// block per slice, the receiver's last blocks started only after the sender's kernel ended,
// measured 2026-12-02). Returns kZeroCopyWaiting, kZeroCopyDone (every slice final) or
// kZeroCopyGaveUp. It gives up only once no sender slice may still write into the buffer: every
// slice final, cancelled, or not started while the channel failed (seen after a full fence:
// zero_copy_begin), or the sender sent the message staged (another size); or at the watchdog.
// `since` and `landed` (the sum of the slices' progress at the last look) are the op's, in shared
// memory, changed by thread 0 only.
constexpr int kZeroCopyWaiting = 0, kZeroCopyDone = 1, kZeroCopyGaveUp = 2;
__device__ bool low_latency_instead(const ChunkStreamArgs& a, uint64_t message);  // low_latency.cuh
__device__ __forceinline__ int zero_copy_recv_visit(const ChunkStreamArgs& a, uint64_t message, uint64_t first,
                                                    uint64_t& since, uint64_t& landed, uint64_t spin_ns) {
  constexpr unsigned kUnfinished = 1, kCancelled = 2, kInProgress = 4, kSliceZeroUnstarted = 8;
  __shared__ unsigned flags;
  __shared__ unsigned long long sum;
  __shared__ int verdict;
  if (threadIdx.x == 0) flags = 0, sum = 0, verdict = kZeroCopyWaiting;
  __syncthreads();
  unsigned mine = 0;
  unsigned long long progress = 0;
  // Each thread first spins on its slices' words, for at most spin_ns, until they are final or
  // cancelled: the last word is seen within a load of its store, not a visit's barriers later.
  const uint64_t spin_until = spin_ns != 0 ? detail::globaltimer_ns() + spin_ns : 0;
  for (int s = static_cast<int>(threadIdx.x); s < a.zc_slices; s += static_cast<int>(blockDim.x)) {
    Landed l = zero_copy_landed(a, s, message);
    while (spin_ns != 0 && !l.final && !l.cancelled && detail::globaltimer_ns() < spin_until)
      l = zero_copy_landed(a, s, message);
    progress += static_cast<unsigned long long>(l.chunks) + (l.final ? 1 : 0);
    if (l.final) continue;
    mine |= kUnfinished | (l.cancelled ? kCancelled : l.started ? kInProgress : 0u);
    if (s == 0 && !l.started) mine |= kSliceZeroUnstarted;
  }
  if (mine != 0) atomicOr(&flags, mine);
  if (progress != 0) atomicAdd(&sum, progress);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned seen = flags;
    if (!(seen & kUnfinished)) {
      verdict = kZeroCopyDone;  // (the refusal and failure words are read only while waiting)
    } else {
      const uint64_t broken = *reinterpret_cast<volatile uint64_t*>(a.broken);
      const bool failed = *reinterpret_cast<volatile unsigned int*>(a.failed) != 0;
      // A slice the sender cancelled: it gave the message up (the channel is refused).
      if ((seen & kCancelled) && !failed)
        refuse(a, broken != 0 ? detail::WaitOp::kChunkArrival : detail::WaitOp::kChannelRefused,
               broken != 0 ? broken - 1 : static_cast<uint64_t>(a.bytes));
      if (!(seen & kInProgress)) {
        // Every unfinished slice is cancelled or not started.
        if ((seen & kSliceZeroUnstarted) && (staged_instead(a, first, message) || low_latency_instead(a, message))) {
          verdict = kZeroCopyGaveUp;  // refused at both ends; the sender writes nothing zero-copy for it
        } else if (broken != 0 || *reinterpret_cast<volatile unsigned int*>(a.failed) != 0) {
          // A refusal: this PE tells the sender itself (its refusal word; the same answer again if
          // the sender found it), then looks again after a full fence. Either each sender slice
          // sees the word before it starts (zero_copy_begin: it cancels), or this look sees that
          // it started. (Failed without a refusal is a timeout: the peer is taken for dead.)
          if (broken != 0) store_release_sys(a.peer_broken, static_cast<uint64_t>(a.bytes) + 1);
          __threadfence_system();
          bool writing = false;
          for (int s = 0; s < a.zc_slices && !writing; ++s) {
            const Landed l = zero_copy_landed(a, s, message);
            writing = l.started && !l.final && !l.cancelled;
          }
          if (!writing) {
            if (broken != 0) refuse(a, detail::WaitOp::kChunkArrival, broken - 1);
            else atomicExch(a.failed, 1u);
            verdict = kZeroCopyGaveUp;
          }
        }
      }
    }
    const uint64_t now = detail::globaltimer_ns();
    if (sum != landed) {
      landed = sum;
      since = now;
      atomicMax(reinterpret_cast<unsigned long long*>(a.progress), static_cast<unsigned long long>(now));
    } else if (verdict == kZeroCopyWaiting) {
      const uint64_t last = max(since, *reinterpret_cast<volatile uint64_t*>(a.progress));
      if (now > last && now - last > a.timeout_ns) {
        int short_slice = 0;
        while (short_slice + 1 < a.zc_slices && zero_copy_landed(a, short_slice, message).final) ++short_slice;
        detail::record_timeout(a.status, detail::WaitOp::kZeroCopyDone, a.peer, a.my_pe,
                               zero_copy_detail::done_word(message, zero_copy_detail::kFinal),
                               detail::load_acquire_sys(a.zc_done + short_slice));
        atomicExch(a.failed, 1u);
        verdict = kZeroCopyGaveUp;
      }
    }
  }
  __syncthreads();
  const int result = verdict;
  __syncthreads();  // every thread has read it before the next visit's thread 0 writes it
  return result;
}

// ---- The copy engine (send_recv.hpp, "The copy engine") --------------------------------------

// Thread 0, the step after the copy engine moved a send (kCopyEngineCopied): every part of the
// message final. The copy completed before this kernel started (the graph's edge); the fence
// orders that before the words for a reader on another GPU as for one on this.
__device__ __forceinline__ void copy_engine_done(const ChunkStreamArgs& a, uint64_t message) {
  __threadfence_system();
  for (int s = 0; s < a.zc_slices; ++s)
    *reinterpret_cast<volatile uint64_t*>(a.peer_zc_done + s) = zero_copy_detail::done_word(message, zero_copy_detail::kFinal);
}
