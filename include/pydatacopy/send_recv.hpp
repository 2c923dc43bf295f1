// Two-sided copies of any device buffer, neither side needing symmetric memory.
//
// A message streams through `num_chunks` symmetric staging chunks per sending peer, held at the
// receiver, with flow control: the sender puts chunk k into slot k % num_chunks and raises its
// arrival signals; the receiver copies the slot out and returns credits, so the put of chunk
// k + 1 overlaps the receiver draining chunk k. Slots are cut into 32 KiB pages with an arrival
// and a credit signal each. A message moves on `active` slices (from its size); slice s owns the
// pages s, s + active, ... of every slot and waits only for their signals. The launch has no
// more blocks than can be resident at once (block b drives slices b, b + grid, ...), and a block
// never blocks on one slice: it moves whichever slice's next chunk is ready. So no slice waits
// for a block that starts only when another ends, whatever the block count or the SMs left free.
//
// Signals: a chunk signals only the pages it fills (a 4 KiB message: one page, one put with its
// signal, one credit). Signal values are sequence numbers + 1 and only grow. The receiver of
// chunk k waits for arrival >= k + 1 on the pages chunk k fills. The sender keeps, per slot and
// page, the sequence + 1 of the last chunk that put data there (`filled`, on the device) and, to
// reuse a page, waits for its credit to reach that value: a page that later chunks left alone
// still holds the credit of the last chunk that used it, so messages cut differently (4 KiB,
// then 3 MiB + 5, then 4 KiB) find every page's state up to date.
//
// Byte-count handshake: with each chunk, slice s of the sender writes a header (the chunk's
// sequence + 1, its message's bytes, the chunk's index in the message) into header s of the
// slot at the receiver, before the slice's arrival signals (a store then a system fence on the
// direct path; a put, nvshmem_fence, then the putmem_signal calls on the RMA path). The receiver
// checks it against its own message before copying anything out. On a mismatch it copies
// nothing, refuses the channel on its side and on the sender's (a refusal word in symmetric
// memory holding the other side's bytes + 1), and records the sizes. The sender reads its word
// when it waits for a credit and at the start of every launch on the channel, so both PEs raise
// pydatacopy.Error (at their next send/recv, or check_errors() after the stream's work): the
// receiver at once, the sender at its next send to that peer or at its check_errors() once the
// receiver has looked (check_refusals() reads the word from the host). The receiver checks a
// slice's header as soon as the page that guards it has landed, before waiting for the slice's
// other pages: a sender that cut a smaller message never fills those. A slice whose header is
// stale (the sender cut fewer slices: another size) leaves the verdict to slice 0, whose header
// the sender writes with every chunk; the others give up once the channel has failed. A refused channel (one direction
// between two PEs) moves nothing until setup_send_recv() rebuilds all channels on every PE; a
// later call on it is still launched (the kernel refuses it at both ends, so that an op of the
// same pair on the healthy channel meets its peer's), and the refusal is reported by that call
// (when the record is already on the host) or by the next call with that PE or check_errors().
// The record is per peer and direction (both directions of a pair can be refused, each reported
// once): a call that reports it has still launched its other ops, which ran, so do not retry it.
// Nothing is resynchronised in place. Staged sends of a message that fits in the staging
// complete before the receiver looks: the sender learns of a mismatch at its next send to that
// PE or at check_errors() once the receiver has looked (check_refusals), and a send that waits
// for a zero-copy rendezvous learns it at once (see below).
//
// An empty message moves one header-only chunk (one page, no data, header checked, credit
// returned): both sides' sequences stay in step, and a 0-byte call facing a non-empty one is a
// size mismatch like any other.
//
// Timeouts are a watchdog on progress: an op times out when its channel has moved no chunk for
// `timeout` seconds (the clock restarts whenever any block moves one of the channel's chunks).
// A channel that timed out fails for the rest of its launch, while the launch's other ops go
// on; the host then refuses every call with that peer (runtime.hpp: check_peer_timeouts) and
// keeps serving the others. A send that fits in the staging can complete although its receiver
// is dead (as an eager send does with NCCL); one at or above the zero-copy threshold that fits
// the staging after settings::kZeroCopyFallbackLongWaitNs (zero_copy.cuh, fall_back_to_staged).
//
// Chunk sequence numbers are counted on the device, so a call captured in a CUDA graph moves a
// fresh message at every replay, and replays mix freely with eager calls on the same channel.
// Launches on one channel must not overlap: between eager calls on different streams (and
// between calls of one capture) the engine orders them itself, through one owned event per
// channel (ChannelOrder; no stream of the caller is kept); a graph replayed on one stream and
// eager calls on another must be ordered by the caller, as with NCCL.
//
// The low-latency protocol between load/store peers (not to itself, not under
// PYDATACOPY_FORCE_RMA): a message of at most low_latency_max_bytes() (PYDATACOPY_LOW_LATENCY_MAX_BYTES,
// default 16 KiB, measured: docs/perf-notes.md v13 and v30; at most kLowLatencyCapacityBytes, agreed by every PE at init; 0: off) that does not
// move zero-copy travels in a slot of a ring of kLowLatencySlots at the receiver (slot: the
// message's ordinal on the channel modulo the ring), as 8-byte lines {flag, 4 data bytes}, each
// one store (single-copy atomic: a reader that sees the flag sees its data, so no fence separates
// them); the flag is the ordinal + 1's low 31 bits with bit 31 set (never 0: a line never written
// matches nothing), line 0 holds the sender's byte count and line 1 the epoch ((ordinal + 1) >> 31;
// a slot's first message of an epoch clears the whole slot, fenced before its header, and marks
// line 1 so that the receiver fences before its data loads: no line of the epoch before passes for
// the current message's). The receiver polls the
// lines, copies the data out, and releases a credit (the ordinal + 1) into the sender's memory; the
// sender waits only when the slot still holds a message not consumed (the ring is credited
// ahead), and takes no staging chunk (the channel's chunk sequence does not move). One block, no
// page signals, no header handshake. Sizes that differ: the receiver reads the sender's byte count
// in line 0 and refuses both ends; a receiver on another path (staged, zero-copy: the other
// size over the cut) also watches line 0 of its message's slot, and a low-latency receiver watches
// the staged first chunk and its refusal word (a zero-copy sender reads the descriptor this recv
// posts, as every recv on such a channel does, and refuses). Every case ends in pydatacopy.Error on
// both PEs. A CUDA graph keeps the path it was captured with; replaying it against calls issued
// after the cut changed is refused as a mismatch.
//
// Zero-copy between load/store peers (PEs on one node whose heaps nvshmem_ptr reaches, several
// PEs on one GPU included; not under PYDATACOPY_FORCE_RMA, never to itself): a message of at
// least zero_copy_min_bytes() (PYDATACOPY_ZERO_COPY_MIN_BYTES, default 16 MiB, agreed by every PE
// at init; 0: off) moves once, from the sender's tensor into the receiver's, inside the same
// batch kernel (so a sendrecv's zero-copy and staged ops still run in one launch).
// - Rendezvous: on such a channel EVERY recv (any size) posts a descriptor into the sender's
//   ring (slot: the message's ordinal on the channel modulo kRendezvousRing, 64, counted on the device like the
//   sequences): {ordinal + 1, first chunk's sequence + 1, its bytes, mode, index, offset}, the
//   ordinal last with a system-scope release, when the op's first slice gets its turn on the
//   channel; a recv below the threshold (a.post_late) only once it has waited
//   settings::kLatePostNs (20 us) more without progress, since only a sender of another size reads
//   it (below). mode ZERO_COPY when the receiver's host knows that the sender has the receive
//   buffer's allocation mapped at index j (zero_copy.hpp), else STAGED. A send at or above the
//   threshold waits for that descriptor (watchdog: TimeoutError naming the rendezvous; a message
//   that fits the staging moves staged once its receiver has been held in send/recv kernels for
//   settings::kZeroCopyFallbackWaitNs, or after kZeroCopyFallbackLongWaitNs whatever holds it:
//   zero_copy.cuh, fall_back_to_staged), checks
//   its bytes, then either writes straight into mapped_base[j] + offset (mapped_base[j] read from
//   the host-mapped table once per message by block 0, which drives slice 0 and publishes it to the
//   launch's other blocks in a device ring per channel; SM stores: slice s of
//   zc_slices = min(active blocks, resident blocks) copies the s-th contiguous part of the
//   message; each slice then stores (ordinal + 1) << 24 | visits done into its done word at the
//   receiver, all ones in the low bits at the end, after a system fence) or runs the staged
//   protocol. A zero-copy recv waits on one block (its slice 0), which reads every sender slice's
//   done word (a watchdog on their progress).
//   Either mode consumes the message's chunk sequence numbers, so the channel stays in step
//   whatever the mode, in eager calls and graph replays alike.
// - Sizes that differ: the descriptor carries the receiver's bytes, so both sides learn of a
//   mismatch as soon as the sender reads it, with no data moved. Eligibility is decided on each
//   side from the size, so the sides can disagree only when the sizes do:
//   * both at or above the threshold: the sender reads the descriptor, refuses the channel at
//     both ends (its own refusal word, and the receiver's with its bytes + 1); the receiver,
//     waiting for done words or staged chunks, watches its refusal word and refuses too.
//   * sender above, receiver below: the receiver posts a STAGED descriptor anyway (every recv on
//     the channel does, which is why small recvs post too: late, after kLatePostNs without its
//     message, since 2026-12-07), so the sender reads it and refuses both ends as above; the
//     receiver's staged wait watches its refusal word. (A sender that fits the staging may give
//     its wait up first, after kZeroCopyFallbackWaitNs: its staged header then names its size.)
//   * receiver above (posted ZERO_COPY), sender below: the sender sends staged; the receiver's
//     first slice, while it waits for done words, also watches the arrival signal of the
//     message's first staged page, reads that header (another size) and refuses both ends.
//   Every case ends in pydatacopy.Error on both PEs, found by the device at once, never a hang.
// - A receiver never gives up a message whose bytes the sender may still write. Before its
//   first write, each sender slice stores "started" into its done word, fences (system scope,
//   sequentially consistent), then reads the channel's failure flag and refusal word: when
//   either is set it stores "cancelled" and writes nothing; once started it finishes its part
//   whatever happens (a copy waits on nothing). A receiver that sees the channel refused and a
//   slice not started stores the sender's refusal word itself, fences, and looks again: either
//   the slice's look saw the word (it cancels and writes nothing), or the receiver now sees it
//   started and waits for it (final or cancelled). A descriptor is
//   posted only when the op's first slice gets its turn on the channel (earlier ops of the
//   channel in the launch past their first slice, none refused). What remains: after a timeout,
//   a peer that was only slow, not dead, may still write into that receive buffer later (treat a
//   TimeoutError as fatal for the buffers in flight with that peer). A dead peer writes nothing:
//   the survivor gets TimeoutError, never an illegal address.
// - The mapping table is host-mapped memory written by the sender's host (zero_copy.hpp: why an
//   index is never reused while a launch may still post it, and how freed memory is detected);
//   a descriptor naming an empty entry is refused, never written through. Memory that CUDA IPC
//   cannot export (torch's expandable segments, cudaMallocAsync pools) stays staged.
// - A send at or above the threshold to a load/store peer waits for its recv to start (as large
//   messages do with NCCL): it no longer completes into the staging ahead of its receiver. A PE
//   that sends and receives at once groups them (below), as it must anyway.
// - CUDA graphs: a captured recv freezes its mode and index. At capture, a receive buffer not
//   mapped yet waits up to 0.5 s (bounded by the timeout) for the sender's host, serving that
//   peer's own requests meanwhile, so a captured sendrecv (both sides capturing) replays
//   zero-copy; a one-way capture whose sender is not calling meanwhile stays staged. Entries used
//   by captures are pinned until cleanup().
//
// The copy engine (settings::kDefaultCopyEngineMinBytes, PYDATACOPY_COPY_ENGINE_MIN_BYTES; 0: off):
// a zero-copy send of at least that many bytes that does not fit the staging (so it has no bounded
// fallback), launched eagerly (not captured) in a launch of at most one send and one recv (a recv
// posted zero-copy that fits the staging excepted: its post takes the fallback's verdict), to a
// receive allocation the sender maps now (zero_copy::Importer::maps), is launched as a CUDA graph
// (copy_engine.hpp), one per send channel:
//   probe (one block) -> IF { cudaMemcpy into the guess -> copied } ELSE { ordinary }
// - The guess is the channel's last zero-copy target, which the kernels leave in host-mapped memory
//   (a loop into one receive buffer guesses right from its second zero-copy message). Only the
//   sender decides; the receiver's recv is the usual zero-copy recv, waiting for its done words.
// - The probe posts the launch's recv descriptors (before it waits for anything: a sendrecv's peer
//   waits for them), then takes the send's descriptor as the kernel does (sizes checked, refused at
//   both ends on a mismatch). When the target is the guess it marks every part started
//   (zero_copy_begin's protocol for all parts) and sets the IF node; the copy engine writes the
//   message, and the `copied` kernel stores every part's final word (after the copy, by the graph's
//   order) and runs the recv. Otherwise (another target, staged, refused, a timeout) the
//   `ordinary` kernel runs the launch as an eager launch would, its recvs already posted. The probe
//   moves no channel counter: both steps find the ops where the probe did.
// - A wrong guess never reaches the copy: the memcpy node runs only in the IF branch.
// - Only with a recv posted zero-copy beside it (or none): a staged recv drains in the step after
//   the probe, and its sender may wait for that before it posts what the probe waits for. The
//   probe counts as held in a send/recv kernel (the activity word) while it waits.
// - CUDA refusing the graph (build, update or launch) turns the copy engine off until the next
//   setup (copy_engine_status() says why); those sends take the ordinary kernel. The cut set by
//   set_copy_engine_min_bytes() also lasts until the next setup, which rereads the variable.
//
// Both sides must move the same number of bytes, in the same order per peer pair. Every call is
// stream-ordered and runs until its whole message has moved, so a PE that sends and receives at
// once issues both in one batch() (or sendrecv()): one kernel launch, in which all of them are
// guaranteed to run at the same time. Two launches on two streams are not (the hardware may
// serialise them), which could deadlock.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <memory>
#include <string>
#include <mutex>
#include <vector>

#include "pydatacopy/error.hpp"
#include "pydatacopy/settings.hpp"

#include "pydatacopy/detail/channel_order.hpp"

namespace pydatacopy {
namespace kernels {
struct ChunkStreamArgs;
struct ChunkBatch;
struct SlotHeader;
struct RendezvousDescriptor;
}
struct ZeroCopyState;  // send_recv.cpp: the mailboxes and mapping tables
namespace zero_copy {
class ProgressThread;  // send_recv/progress_thread.hpp
}


// Reads a few device words from the host (SendRecvEngine::check_refusals, and the test hook's
// counters in zero_copy_counters): a pinned buffer and a non-blocking stream of its own, so the
// copy never waits behind the caller's streams. Local; move-only.
class RefusalPoll {
 public:
  RefusalPoll() = default;
  explicit RefusalPoll(std::size_t words);
  ~RefusalPoll();
  RefusalPoll(const RefusalPoll&) = delete;
  RefusalPoll& operator=(const RefusalPoll&) = delete;
  RefusalPoll(RefusalPoll&& other) noexcept { *this = std::move(other); }
  RefusalPoll& operator=(RefusalPoll&& other) noexcept;
  friend void swap(RefusalPoll& a, RefusalPoll& b) noexcept {
    std::swap(a.host_, b.host_);
    std::swap(a.stream_, b.stream_);
    std::swap(a.words_, b.words_);
  }
  // Host-blocking on this copy only: `words` (at most the buffer's) at `device_words`, in host memory.
  const uint64_t* read(const uint64_t* device_words, std::size_t words);

 private:
  uint64_t* host_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::size_t words_ = 0;
};

// Threads: every public method may be called from any thread. The engine serialises them with
// a lock of its own (the hot calls run without the GIL in Python, which is what kept two
// threads out of one engine's host state before). The collective init() and cleanup() hold it
// only to check and swap the engine's state in or out, never across their barriers (a thread
// waiting in one must not keep another from the transfers its peers wait for), so a hot call
// sees either the whole old state or none (it never uses freed staging). Two threads racing
// init(): one wins, the other cleans up the engine it built (collective) and throws.
class SendRecvEngine {
 public:
  SendRecvEngine();
  ~SendRecvEngine();  // never collective: call cleanup() on every PE
  SendRecvEngine(const SendRecvEngine&) = delete;
  SendRecvEngine& operator=(const SendRecvEngine&) = delete;
  // Takes other's state (under other's lock); other is left empty. The lock is not moved.
  SendRecvEngine(SendRecvEngine&& other) noexcept;
  SendRecvEngine& operator=(SendRecvEngine&&) = delete;

  // Collective and blocking. chunk_bytes is rounded up to a multiple of the 32 KiB page; a
  // message moves on up to `blocks` slices on each side (fewer for small messages), driven by at
  // most as many thread blocks as can be resident at once. Also the way back after a size
  // mismatch (cleanup(), then init(): every channel starts afresh). Throws when the engine is
  // initialised already, or was initialised by another thread while this one built its state.
  void init(std::size_t chunk_bytes, int num_chunks, int blocks);
  void cleanup();  // collective and blocking; harmless twice
  bool initialized() const;
  std::size_t chunk_bytes() const;
  int num_chunks() const;
  int blocks() const;
  // Blocks of a launch at most: what can be resident at once (an MPS share, and at most 1/K of
  // a GPU with K PEs on it), the smallest over every PE (agreed at init, so that both sides of a
  // message cut it alike).
  int max_grid() const;
  // Slices a message of `bytes` moves on: <= blocks() (under settings::kNarrowMessageBytes <=
  // narrow_blocks() too), <= pages, <= kMaxSlicesPerBlock x max_grid().
  int slices_for(std::size_t bytes) const;
  // PYDATACOPY_NARROW_SEND_BLOCKS as init read it (agreed by every PE).
  int narrow_blocks() const;
  // The rule slices_for applies, from the engine's agreed numbers (both sides of a message must
  // cut it alike): no GPU needed.
  static int message_slices(std::size_t bytes, std::size_t chunk_bytes, int pages, int blocks, int narrow_blocks,
                            int resident_blocks);
  // The most slices any message has under these numbers (message_slices never gives more, nor
  // does a batch's raise): a send writes the header of each page below it.
  static int most_message_slices(int pages, int blocks, int resident_blocks);
  // The slices of a message that moves zero-copy (each writes one contiguous part straight into
  // the receive buffer), from the same agreed numbers on both sides: message_slices without the
  // narrow cut, at most one per resident block. The narrow count serves the staging, whose pages
  // a slice fills and drains in turn; a zero-copy part has no pages, and fewer slices only leave
  // SMs idle (16 MiB on 32 slices of one H100's 66: 15.8 us from the descriptor to block 0's last
  // write, docs/perf-notes.md v27). A send that awaits a descriptor launches this many slices.
  static int zero_copy_slices(std::size_t bytes, std::size_t chunk_bytes, int pages, int blocks,
                              int resident_blocks);
  // Symmetric bytes one PE holds for staging and signals.
  std::size_t symmetric_bytes() const;
  // What init(chunk_bytes, num_chunks, blocks) takes on each of n_pes PEs (no GPU needed).
  static std::size_t symmetric_bytes_needed(int n_pes, std::size_t chunk_bytes, int num_chunks,
                                            int blocks);

  // Stream-ordered. timeout_seconds: how long the channel may go without moving a chunk (not a
  // deadline for the whole message); a timeout is reported by check_errors() and marks the peer
  // (every later call with it raises TimeoutError at once; calls with other PEs go on). A size
  // mismatch with the peer raises pydatacopy.Error here or at check_errors() (see above).
  void send(const void* src, std::size_t bytes, int dst_pe, cudaStream_t stream,
            double timeout_seconds);
  void recv(void* dst, std::size_t bytes, int src_pe, cudaStream_t stream, double timeout_seconds);

  struct Operation {
    bool send;          // true: send `bytes` from `buffer` to `peer`; false: receive into it
    void* buffer;
    std::size_t bytes;
    int peer;
  };
  // Up to settings::kMaxGroupOps (64) sends and recvs (any peers) in one launch. An op whose peer is refused (timed out,
  // or an unreported size mismatch with it) is left out; the others launch, then the first
  // refusal is raised.
  void batch(const std::vector<Operation>& ops, cudaStream_t stream, double timeout_seconds);
  // A send and a recv at once: batch() of the two.
  void sendrecv(const void* src, std::size_t send_bytes, int dst_pe, void* dst,
                std::size_t recv_bytes, int src_pe, cudaStream_t stream, double timeout_seconds);

  // Local, host-blocking only on a copy of a few words (on a stream of its own, never behind the
  // caller's work): throws pydatacopy.Error, once per channel, when a receiver has refused one of
  // this PE's send channels since the last look (a size mismatch it found after this PE's send
  // had completed: a send that fits in the staging does not wait for its receiver).
  // check_errors() calls it, so the sender hears of a mismatch without a further send.
  void check_refusals();
  // ---- zero-copy (see above) ----
  // Messages of at least this many bytes to or from a load/store peer move once (0: never).
  // PYDATACOPY_ZERO_COPY_MIN_BYTES at init (default kDefaultZeroCopyMinBytes), the same on every PE.
  static constexpr std::size_t kDefaultZeroCopyMinBytes = settings::kDefaultZeroCopyMinBytes;
  std::size_t zero_copy_min_bytes() const;
  // Collective and blocking (every PE, the same value, between calls; the pair's messages in
  // flight keep the mode they were issued with): changes the threshold. Throws on every PE
  // alike when the PEs disagree, changing nothing. The agreement (a barrier) runs outside the
  // engine's lock; only the store is under it.
  void set_zero_copy_min_bytes(std::size_t bytes);
  // The two halves of set_zero_copy_min_bytes: the collective vote (touches no engine), then
  // the local store of the value agreed.
  static void agree_zero_copy_min_bytes(std::size_t bytes);
  void set_zero_copy_min_bytes_agreed(std::size_t bytes);
  // ---- the low-latency protocol (see above) ----
  // Messages of at most this many bytes to or from a load/store peer (not zero-copy) move by it
  // (0: never). PYDATACOPY_LOW_LATENCY_MAX_BYTES at init (default kDefaultLowLatencyMaxBytes, at
  // most kLowLatencyCapacityBytes), the same on every PE.
  static constexpr std::size_t kDefaultLowLatencyMaxBytes = settings::kDefaultLowLatencyMaxBytes;
  static constexpr std::size_t kLowLatencyCapacityBytes = settings::kLowLatencyCapacityBytes;
  std::size_t low_latency_max_bytes() const;
  // Collective and blocking, as set_zero_copy_min_bytes: every PE, the same value (at most
  // kLowLatencyCapacityBytes), between calls; refused on every PE alike otherwise.
  void set_low_latency_max_bytes(std::size_t bytes);
  // Serves the peers' zero-copy mapping requests and answers (never blocks; nothing to do
  // when not initialised): every call with a peer does it for that peer; check_errors() does
  // it for all.
  void service_zero_copy();
  // PYDATACOPY_ZERO_COPY_PROGRESS: how long an eager recv waits, once per mapping request, for its
  // sender's answer (20 ms by default: the sender's thread answers within about 1 ms, and an open
  // takes 0.4-1.4 ms on an H200). A test hook sets it to the timeout, so that a test of the protocol
  // does not rest on a machine's speed (never past the call's own timeout either way).
  static constexpr double kDefaultZeroCopyWaitSeconds = 0.02;
  void set_zero_copy_wait_seconds(double seconds);
  // Test hook: ops finished since init, [send staged, send zero-copy, recv staged, recv
  // zero-copy] (counted on the device: synchronise first), and the host's bookkeeping:
  // [map requests, acknowledged, refused by the sender, not exportable, stale dropped, evicted,
  // handles opened here, closed here].
  std::vector<uint64_t> zero_copy_counters();
  // What this PE's calls with one peer did since setup (pydatacopy.stats()): ops finished by the
  // path their bytes took (counted on the device when each op ends: synchronise first), and the
  // zero-copy mapping bookkeeping with that peer.
  struct PeerStats {
    int peer = 0;
    uint64_t send_one_copy = 0, send_staged = 0, send_low_latency = 0;  // sends to `peer`
    uint64_t send_copy_engine = 0;  // of send_one_copy: those the copy engine moved
    uint64_t recv_one_copy = 0, recv_staged = 0, recv_low_latency = 0;  // recvs from `peer`
    uint64_t map_requests = 0;    // receive allocations (or expandable chunks) this PE asked `peer` to map
    uint64_t not_exportable = 0;  // receive allocations that cannot be exported: staged on purpose
    uint64_t refused = 0;         // mappings `peer` could not open
    uint64_t mapped_here = 0;     // `peer`'s allocations (chunks) this process mapped to send into
  };
  std::vector<PeerStats> stats();
  // The copy engine (see above): "on from N bytes", or "off: " and why (the setting at 0, zero-copy
  // off, or what CUDA refused when its graph was built, set or launched: the engine's sends then
  // move by the SM kernel). Local; no GPU work.
  std::string copy_engine_status();
  // PYDATACOPY_COPY_ENGINE_MIN_BYTES as init read it, and a local change of it (0: off) until the
  // next init, between calls: only the sender decides, so no PE needs to agree. A CUDA graph captured before keeps
  // its ordinary kernel (a capture never takes the copy engine).
  std::size_t copy_engine_min_bytes() const;
  void set_copy_engine_min_bytes(std::size_t bytes);
  // Test hook (the timeline's probe, issue 35): while on, every send/recv launch of this process
  // records %globaltimer at its phases (kernels/api.cuh, phase_stamp_names()); turning it on
  // empties the ring. phase_stamps(): the last 1024 launches, oldest first, each {the stamps in ns
  // (0: not reached), op 0's mode, op 0 is a send}.
  static void set_phase_stamps(bool on);
  // Test hook: a send that fits the staging gives its descriptor wait up after `held_seconds` with
  // its receiver held in send/recv kernels, or after `long_seconds` whatever holds it (defaults:
  // settings::kZeroCopyFallbackWaitNs, kZeroCopyFallbackLongWaitNs). For tests that count the
  // path each message took on a slowed-down GPU (compute-sanitizer). Process-wide, between calls.
  static void set_zero_copy_fallback_waits(double held_seconds, double long_seconds);
  static std::vector<std::vector<uint64_t>> phase_stamps();
  // The names of a record's stamps, in order (kernels::kPhaseStampNames).
  static std::vector<std::string> phase_stamp_names();
  // Benchmark hook (issue 35's host path): while on, the host time of this engine's calls is summed
  // per phase of the call (host_phase_names(), in order) from steady_clock readings; off, each
  // phase costs one branch. host_phases(): the calls counted (those that came to their end: one
  // that threw counts nowhere), then ns per phase, since it was turned on or last read (which
  // clears them). Local, under the engine's lock.
  void set_host_phases(bool on);
  std::vector<uint64_t> host_phases();
  static std::vector<std::string> host_phase_names();

 private:
  // agree_zero_copy_min_bytes with this PE's reading of the variable: `unreadable` (the
  // SettingError's text, bytes = kUnreadableThreshold) when it could not read it, so that every
  // PE refuses alike.
  static constexpr std::size_t kUnreadableThreshold = ~std::size_t{0};  // above any value the table takes
  static void agree_zero_copy_min_bytes(std::size_t bytes, const std::string& unreadable);
  // The low-latency cut's vote (init and the setter): every PE the same value, within the
  // capacity; `unreadable` as above.
  static void agree_low_latency_max_bytes(std::size_t bytes, const std::string& unreadable);
  bool low_latency_peer(int peer) const;  // the protocol applies to this peer (load/store, not itself)
  // Whether a message of `bytes` with `peer` moves by the low-latency protocol now (both sides
  // of a message decide alike from its size).
  bool moves_low_latency(int peer, std::size_t bytes) const;
  // The public methods take mutex_ and call these, which expect it held (or the engine seen by
  // no other thread: the fresh state init() builds, the old state cleanup() detached).
  void build(std::size_t chunk_bytes, int num_chunks, int blocks);  // init's collective part
  void release();                                                   // cleanup's collective part
  void batch_locked(const std::vector<Operation>& ops, cudaStream_t stream, double timeout_seconds);
  void check_refusals_locked();
  void service_zero_copy_locked();
  // The progress thread's round (PYDATACOPY_ZERO_COPY_PROGRESS): service_zero_copy_locked() when the
  // engine's lock is free (a call holding it serves its own peers), and whether it moved anything.
  bool serve_zero_copy_progress();
  std::vector<uint64_t> zero_copy_counters_locked();
  std::vector<PeerStats> peer_stats_locked();
  // Local, never blocks: exchanges the whole state (channels, staging, counters), not the lock.
  void swap_state(SendRecvEngine& other) noexcept;
  // Moves the state out (this engine is left uninitialised); the caller release()s it.
  SendRecvEngine detach() noexcept;

  void require_ready(const char* what, int pe) const;       // the call's own arguments

  int active_blocks(std::size_t bytes) const;
  // Whether a message fits the staging at once (its chunks <= PYDATACOPY_NUM_CHUNKS): a zero-copy
  // send of it waits a bounded time for its descriptor (settings::kZeroCopyFallbackWaitNs).
  bool fits_staging(std::size_t bytes) const;
  kernels::ChunkStreamArgs prepare(bool send, void* buffer, std::size_t bytes, int peer, double timeout);
  int pages() const { return static_cast<int>(chunk_bytes_ / page_bytes_); }
  uint8_t* staging(int src_pe) const;
  uint64_t* arrivals(int src_pe) const;
  uint64_t* credits(int dst_pe) const;
  kernels::SlotHeader* headers(int src_pe) const;
  kernels::SlotHeader* outgoing_headers(int dst_pe) const;
  uint64_t* broken(bool send, int peer) const;
  uint64_t* refused_bytes(int dst_pe) const;  // send channel: the bytes + 1 its receiver saw
  kernels::RendezvousDescriptor* rendezvous_ring(int receiver) const;  // at the sender
  uint64_t* zero_copy_done(int sender) const;                          // at the receiver
  // This PE's send/recv thread blocks inside their loops (each adds 1 on entry, takes it away on
  // leaving): a sender whose descriptor wait outlasts kZeroCopyFallbackWaitNs gives it up only
  // while its receiver is itself held inside a send/recv kernel (zero_copy.cuh).
  unsigned int* activity_word() const;
  bool load_store_peer(int peer) const;  // zero-copy applies to this peer (see above)
  void decide_recv_mode(kernels::ChunkStreamArgs& a, void* dst, std::size_t bytes, int peer,
                        bool capturing, double timeout_seconds);

  uint8_t* base_ = nullptr;
  // Each PE's base_ as this PE reaches it by load/store (null: RMA only), asked once at init: every
  // array of the engine lies at the same offset in every PE's base_, so a peer's address is one
  // addition per op instead of an nvshmem_ptr call per array.
  std::vector<uint8_t*> peer_bases_;
  void* peer_address(const void* local, int peer) const;
  std::size_t chunk_bytes_ = 0, page_bytes_ = 0, symmetric_bytes_ = 0;
  int num_chunks_ = 0, blocks_ = 0, narrow_blocks_ = 0, n_pes_ = 0;
  uint64_t* sequences_ = nullptr;  // device [2][n_pes]: next chunk of each send / recv channel
  uint64_t* progress_ = nullptr;   // device [2][n_pes]: %globaltimer of each channel's last chunk
  uint64_t* filled_ = nullptr;     // device [n_pes][num_chunks][pages]: sequence + 1 last put per page
  unsigned int* failed_ = nullptr; // device [2][n_pes]: the channel failed in the launch in flight
  int resident_blocks_ = 1;        // send/recv kernel blocks resident at once (the grid's cap)
  // Channels [2][n_pes] as sequences_: a launch waits for the channel's last one, on any stream.
  ChannelOrder order_;
  unsigned int* done_ = nullptr;   // device [2][n_pes]: blocks finished in the launch in flight
  RefusalPoll refusal_poll_;     // check_refusals(): the refusal words, read from the host
  bool sends_launched_ = false;   // no send, no refusal to look for
  uint64_t* messages_ = nullptr;   // device [2][n_pes]: next message ordinal of each channel
  uint64_t* zc_resolved_ = nullptr;  // device [n_pes][kRendezvousRing][2]: zero-copy targets per send channel
  uint64_t* zc_counts_ = nullptr;    // device [n_pes][kZeroCopyCounters]: ops finished, by peer and mode
  std::size_t zero_copy_min_bytes_ = 0;
  std::size_t low_latency_max_bytes_ = 0;
  std::size_t copy_engine_min_bytes_ = 0;  // PYDATACOPY_COPY_ENGINE_MIN_BYTES as init read it (0: off)
  // The copy engine (see above): launches `launch` as its graph when its ops allow it (one send
  // of at least copy_engine_min_bytes_ that awaits a descriptor and has a guess, maybe one recv),
  // and says whether it did. Never throws before a launch; what the graph's calls refuse turns the
  // copy engine off (said once, zero_copy.md).
  bool launch_copy_engine(const kernels::ChunkBatch& launch, cudaStream_t stream);
  uint64_t* ll_filled_ = nullptr;  // device [n_pes][kLowLatencySlots]: per send channel, ordinal + 1 that last used each slot
  uint64_t* ll_lines(int src_pe) const;    // at the receiver: the ring of src_pe's channel
  uint64_t* ll_credits(int dst_pe) const;  // at the sender: the word dst_pe advances
  std::unique_ptr<ZeroCopyState> zero_copy_;
  bool zero_copy_progress_wanted_ = false;  // PYDATACOPY_ZERO_COPY_PROGRESS, as every PE voted at build()
  mutable std::mutex mutex_;  // the engine's lock (see the class comment); never swapped or moved
  // PYDATACOPY_ZERO_COPY_PROGRESS: a thread that serves the peers' mapping requests between this
  // process's calls (started by init(), stopped by cleanup() and the destructor, joined outside
  // mutex_), and whether a recv may wait once for a mapping an earlier call asked for. Belongs to
  // this object, not to its state: never swapped or moved (the thread calls this engine).
  std::unique_ptr<zero_copy::ProgressThread> zero_copy_progress_;  // under mutex_
  bool zero_copy_progress_on_ = false;                              // under mutex_
  // set_host_phases: on, the calls counted and ns per phase (host_phase_names()). Under mutex_;
  // this object's, never swapped.
  static constexpr int kHostPhases = 7;
  bool host_phases_on_ = false;
  uint64_t host_phase_calls_ = 0;
  uint64_t host_phase_ns_[kHostPhases] = {};
  double zero_copy_wait_seconds_ = kDefaultZeroCopyWaitSeconds;     // under mutex_
};

}  // namespace pydatacopy
