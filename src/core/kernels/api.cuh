// Kernel launchers of the core. Kernels see raw pointers and a cudaStream_t, never torch or
// Python; each launcher checks its launch and returns without synchronising.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/device_status.cuh"
#include "pydatacopy/settings.hpp"

namespace pydatacopy {
struct TransferDescriptor;  // transfer.hpp
struct PreparedRow;         // prepared_put_many.hpp
}

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
  uint64_t* uses;           // device: exchanges of this set so far; this one is uses + 1
  unsigned int* done;       // device: blocks finished in this launch
  int my_pe, dst_pe, src_pe;
  uint64_t timeout_ns;
  detail::DeviceStatus* status;
};

void launch_token_exchange(const TokenExchangeArgs& args, int num_blocks, cudaStream_t stream);

// Waits until every token's signal reached *uses (the set's use count, as its last exchange left it).
void launch_token_wait(const uint64_t* signals, int64_t n_tokens, const uint64_t* uses,
                       int my_pe, int src_pe, uint64_t timeout_ns, detail::DeviceStatus* status,
                       int num_blocks, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// Loads every kernel of the library now (init calls it). With CUDA's lazy module loading a
// kernel's first launch can wait until the kernels already running end: a first send/recv
// issued while the caller's long kernel holds the GPU would stall behind it.
void preload_kernels();

// SM-store copy of `bytes` from src to dst (dst may be a peer's memory through nvshmem_ptr).
void launch_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

// The benchmark's floor for a kernel send/recv with a rendezvous (handoff_copy_kernel in
// transfer.cu; rma/transfer_internal.hpp's bench_kernel_handoff says what it does). `variant`:
// 0, or what the zero-copy send/recv adds, each alone priced by scripts/handoff_variants.py:
// kHandoffBegin (each sending block's store at the receiver, system fence and two looks before it
// writes: zero_copy_begin), kHandoffResolve (block 0 reads a host-mapped word, `host_word`, and
// publishes it to the other blocks: take_descriptor's resolver), kHandoffTwoBlocksPerSm (twice the
// blocks; with one 512-thread block a multiprocessor resident, they run in two waves). {ready,
// done, resolved, timed out, message, begin[kHandoffBeginWords]} words; the timed-out word is set
// by a wait that reached its deadline (the row's check reads it). kHandoffMessageOnDevice: the
// message number is the message word + 1, which the kernel then stores there (`message` is not
// read), so that a CUDA graph of handoffs moves a new message at every replay: the floor of a
// graph-replayed send/recv (one block: at most kHandoffMessageOnDeviceMaxBytes).
constexpr unsigned kHandoffBegin = 1, kHandoffResolve = 2, kHandoffTwoBlocksPerSm = 4, kHandoffMessageOnDevice = 8;
constexpr int kHandoffWords = 5, kHandoffTimedOutWord = 3, kHandoffMessageWord = 4, kHandoffBeginWords = 256;
constexpr std::size_t kHandoffMessageOnDeviceMaxBytes = 64 << 10;
void launch_handoff_copy(void* peer_dst, const void* src, std::size_t bytes, uint64_t* my_words,
                         uint64_t* peer_words, bool sends, bool receives, uint64_t message, uint64_t wait_ns,
                         unsigned variant, const uint64_t* host_word, cudaStream_t stream);

// Many puts to `pe`: direct stores where nvshmem_ptr reaches the peer (unless force_rma), NVSHMEM
// RMA otherwise. The host table is passed by value in kernel parameters, one launch per
// kPutManyRowsPerLaunch rows (24 bytes each, under the 32 KiB parameter limit), so it may be
// freed when this returns and nothing is allocated or copied beside the launch.
constexpr int kPutManyRowsPerLaunch = 1280;
void launch_put_many(const TransferDescriptor* host_descriptors, int count, int pe, bool force_rma,
                     cudaStream_t stream);

// A prepared put_many: `count` rows read from device memory, a warp per row; a row with a peer
// address is stored directly (unless force_rma), else put through NVSHMEM RMA.
void launch_prepared_put_many(const PreparedRow* device_rows, int64_t count, int pe, bool force_rma,
                              cudaStream_t stream);

// Every PE takes its next epoch from the device counter *epoch_counter, adds one to its slot
// `my_pe` of every other PE's `signals`, then waits until each of its own slots reached the
// epoch (deadline: timeout_ns). With `votes`, each PE's `vote` lands in slot my_pe of every
// PE's votes before its arrival does. No launch when n_pes == 1.
void launch_barrier(uint64_t* signals, uint64_t* epoch_counter, uint64_t* votes, uint64_t vote,
                    int my_pe, int n_pes, uint64_t timeout_ns, detail::DeviceStatus* status,
                    cudaStream_t stream);

void launch_signal_wait(const uint64_t* signal, uint64_t value, int my_pe, uint64_t timeout_ns,
                        detail::DeviceStatus* status, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// One message of a send/recv channel (see send_recv.hpp). Addresses are this PE's symmetric
// ones; the peer_* pointers are the peer's copies through nvshmem_ptr, or null for NVSHMEM RMA.
// Sequence numbers live on the device (`sequence`), so a captured CUDA graph replays as fresh
// messages; the launch carries only offsets within its batch.
//
// What the sender writes with each chunk, per slice, so that the receiver can check that both
// sides cut the same message (the byte-count handshake of send_recv.hpp).
struct SlotHeader {
  uint64_t sequence;       // the chunk's sequence number + 1 (the value of its arrival signals)
  uint64_t message_bytes;  // the sender's message size
  uint64_t chunk_index;    // the chunk's index in its message
  uint64_t message;        // the message's ordinal on the channel + 1 (a message sent by the
                           // low-latency protocol takes no chunk: without it, the next staged
                           // message would pass for the one the receiver expects)
};

// Zero-copy rendezvous (send_recv.hpp): per channel, the receiver writes one descriptor per
// message into a ring at the sender (slot: the message's ordinal modulo the ring), the field
// `message` last, with a system-scope release.
constexpr int kRendezvousRing = 64;  // >= kMaxBatchOps (checked in send_recv.cpp)
constexpr uint32_t kPostedStaged = 1, kPostedZeroCopy = 2;
constexpr int kZeroCopyTableEntries = 64;  // = zero_copy::kTableEntries (checked in send_recv.cpp)
struct RendezvousDescriptor {
  uint64_t message;  // the message's ordinal on the channel + 1
  uint64_t first;    // the sequence number of its first chunk + 1
  uint64_t bytes;    // the receiver's byte count
  uint32_t mode;     // kPostedStaged or kPostedZeroCopy
  int32_t index;     // zero-copy: the sender's table index of the receiver's allocation
  uint64_t offset;   // zero-copy: the receive buffer's offset in that allocation
  // The bounded descriptor wait (zero_copy.cuh, fall_back_to_staged): the sender's `message` + 1
  // when it gave the wait up, and the receiver's verdict after its post, (message + 1) << 1 | staged.
  uint64_t fallback;
  uint64_t verdict;
  uint64_t unused;
};
// The test hook's counters (device memory): ops finished per side and mode.
enum ZeroCopyCounter {
  kSendStaged = 0, kSendZeroCopy = 1, kRecvStaged = 2, kRecvZeroCopy = 3,
  kSendLowLatency = 4, kRecvLowLatency = 5,
  kSendCopyEngine = 6,  // zero-copy sends the copy engine moved (counted in kSendZeroCopy too)
  kZeroCopyCounters = 7
};

// The copy engine (send_recv.hpp, "The copy engine"): a send launched as a CUDA graph,
//   probe -> IF (the probe's verdict) { memcpy into the guessed target -> copied } ELSE { ordinary }
// where each step is the send/recv kernel on the same ops in one of these phases.
constexpr int kCopyEngineOff = 0;       // an ordinary launch
constexpr int kCopyEngineProbe = 1;     // one block: posts the batch's recv descriptors; the send takes
                                        // its descriptor and compares the target with the guess
constexpr int kCopyEngineCopied = 2;    // after the copy engine moved the send: its done words, and the recvs
constexpr int kCopyEngineOrdinary = 3;  // the guess was wrong (or no zero-copy): the ordinary kernel,
                                        // its recv descriptors already posted by the probe
// The probe's verdict, in the send channel's device word (ChunkStreamArgs::ce_state).
constexpr unsigned kCopyEngineVerdictCopy = 1, kCopyEngineVerdictOrdinary = 2, kCopyEngineVerdictGaveUp = 3;

// The low-latency protocol (send_recv.hpp): per channel, a ring of kLowLatencySlots slots at the
// receiver, slot = the message's ordinal modulo the ring. A slot is lines of 8 bytes, each
// {flag: 32 bits, data: 32 bits} written by one store, the flag the ordinal + 1 (its low 32
// bits): line 0 holds the sender's byte count, line 1 is spare (the data lines then start
// 16-byte aligned, two per vector store), lines 2... the message's 4-byte words.
constexpr int kLowLatencySlots = 4;
constexpr int64_t kLowLatencySlotLines = 2 + settings::kLowLatencyCapacityBytes / 4;
constexpr int64_t kLowLatencySlotStride = (kLowLatencySlotLines + 15) / 16 * 16;  // lines: 128-byte aligned slots
static_assert(settings::kLowLatencyCapacityBytes % 8 == 0, "whole line pairs");

struct ChunkStreamArgs {
  const uint8_t* src;        // send: the user's buffer
  uint8_t* dst;              // recv: the user's buffer
  int64_t bytes;
  int64_t chunk_bytes;       // a multiple of page_bytes
  int64_t page_bytes;
  int pages;                 // per slot: chunk_bytes / page_bytes, each with its own signals
  int num_slots;
  uint64_t* sequence;        // device: this channel's next chunk sequence number
  unsigned int* done;        // device: slices of this channel finished in the current launch
  unsigned int* failed;      // device: nonzero once the channel failed in the current launch
  uint64_t* progress;        // device: %globaltimer of the channel's last chunk moved
  uint64_t* filled;          // send, device [num_slots][pages]: last sequence + 1 put in the page
  uint64_t offset_chunks;    // chunks of earlier ops of this batch on the same channel
  uint64_t channel_chunks;   // chunks of all ops of this batch on the channel
  int channel_blocks;        // slices of all ops of this batch on the channel
  uint8_t* staging;          // [num_slots][chunk_bytes] of this channel, at the receiver
  uint8_t* peer_staging;
  uint64_t* arrivals;        // [num_slots][pages] at the receiver: chunks landed
  uint64_t* peer_arrivals;
  uint64_t* credits;         // [num_slots][pages] at the sender: chunks drained
  uint64_t* peer_credits;
  SlotHeader* headers;       // [num_slots][pages] at the receiver: one per slice
  SlotHeader* peer_headers;
  SlotHeader* outgoing;      // send: [num_slots][pages], this PE's source for RMA header puts
  uint64_t* broken;          // this channel's refusal word (nonzero: the other side's bytes + 1)
  uint64_t* remote_broken;   // recv: the sender's word for this channel (symmetric address)
  uint64_t* peer_broken;     // recv: the same through nvshmem_ptr, or null for NVSHMEM RMA
  uint64_t* remote_refused_bytes;  // recv: beside it, the sender's message bytes + 1 as its header said
  uint64_t* peer_refused_bytes;    // recv: the same through nvshmem_ptr, or null for NVSHMEM RMA
  bool is_send;              // the direction: which mismatch record a refusal goes to
  int active_blocks;         // slices of this op in the launch (<= pages), from its size
  // The slices among which a staged message's pages are dealt (send_recv.cu): active_blocks, except
  // for a send that awaits a zero-copy descriptor, whose active_blocks is raised to zc_slices
  // (SendRecvEngine::zero_copy_slices) while its staged pages stay on the narrower count.
  int page_slices;
  // send: the header of every page below this that a chunk fills goes out with the page (not only
  // page `slice`'s): the most slices any message can have (SendRecvEngine::most_message_slices),
  // so a receiver slice finds the header of its own first page however the batches on either side
  // raised the count. (A receiver that groups a 4 MiB recv with a 64 MiB one drives the 4 MiB
  // message on 128 slices where its sender, alone, used PYDATACOPY_NARROW_SEND_BLOCKS' 32: before,
  // receiver slices 32..127 read headers nobody wrote, a false mismatch.)
  int header_pages;
  int my_pe, peer;
  uint64_t timeout_ns;       // no progress of the channel for this long: a timeout
  detail::DeviceStatus* status;
  // The zero-copy rendezvous (send_recv.hpp). Both sides decide `rendezvous` alike from the
  // channel (load/store reachable, not forced RMA, zero-copy on) and the size (>= threshold).
  bool post_descriptor;      // recv: post a descriptor (every recv on a reachable channel)
  bool post_late;            // recv: ... only after settings::kLatePostNs without progress (below the threshold)
  bool await_descriptor;     // send: wait for the receiver's descriptor (bytes >= threshold)
  bool zero_copy;            // recv: posted as zero-copy at (zc_index, zc_offset)
  // Both: the message fits the staging (SendRecvEngine::fits_staging), so a send that awaits its
  // descriptor waits at most settings::kZeroCopyFallbackWaitNs, then moves staged, and a zero-copy
  // recv learns which (zero_copy.cuh, fall_back_to_staged).
  bool zc_fallback;
  unsigned int* activity;          // this PE's SendRecvEngine::activity_word (every op)
  const unsigned int* peer_activity;  // send with zc_fallback: the receiver's (nvshmem_ptr)
  int zc_index;
  uint64_t zc_offset;
  int zc_slices;             // slices of a zero-copy message: from its size alone
  uint64_t* messages;        // device: the channel's next message ordinal
  uint64_t offset_messages;  // messages of earlier ops of this batch on the same channel
  uint64_t channel_messages; // messages of all ops of this batch on the channel
  RendezvousDescriptor* ring;       // send: this PE's ring of the receiver's descriptors
  RendezvousDescriptor* peer_ring;  // recv: the sender's ring for this PE (nvshmem_ptr)
  uint64_t* zc_done;         // recv: [slices] words the sender's slices write (this PE's)
  uint64_t* peer_zc_done;    // send: the receiver's words for this PE (nvshmem_ptr)
  uint64_t* peer_recv_broken;  // send: the receiver's refusal word for this channel (nvshmem_ptr)
  const volatile uint64_t* zc_table;  // send: [kTableEntries] the receiver's allocations, mapped here
  uint64_t* zc_resolved;     // send, device [kRendezvousRing][2]: {message + 1, base} read from zc_table
  unsigned long long* zc_counters;    // device [kZeroCopyCounters] (the test hook's)
  // The low-latency protocol (send_recv.hpp). Both sides decide `low_latency` alike from the
  // channel (load/store reachable) and the size (<= the cut, and not zero-copy).
  bool low_latency;
  uint64_t* peer_ll_lines;   // send: the receiver's ring for this PE [kLowLatencySlots][lines] (nvshmem_ptr)
  uint64_t* ll_credit;       // send: this PE's word the receiver advances (ordinal + 1 of the last consumed)
  uint64_t* ll_filled;       // send, device [kLowLatencySlots]: ordinal + 1 of the message that last used each slot
  const uint64_t* ll_lines;  // recv: this PE's ring from the sender; set on every recv of a low-latency
                             // channel (a staged or zero-copy recv watches it for a sender that sent low-latency)
  uint64_t* peer_ll_credit;  // recv: the sender's credit word for this channel (nvshmem_ptr)
  // The copy engine (kCopyEngine* above). ce_last_target is set on every send that awaits a
  // descriptor, the rest only in a copy-engine launch.
  int ce_phase;              // kCopyEngineOff, Probe, Copied or Ordinary (the same in every op of a launch)
  uint8_t* ce_guess;         // send: the host's guess of the zero-copy target (the last one's)
  unsigned int* ce_state;    // send, device: the probe's verdict for the step after the copy
  uint64_t* ce_last_target;  // send, host-mapped: the channel's last zero-copy target (the next guess)
  cudaGraphConditionalHandle ce_handle;  // send, probe: the IF node the verdict sets
};

// Several sends and recvs in one launch, passed by value: 64 ops (about 26 KiB of arguments)
// stay under the 32 KiB kernel-parameter limit; a launch copies only the smallest of the
// kernel's sizes (2, 16 or 64 ops, launch_chunk_batch) that holds its batch. 64: a batch of
// torch.distributed's batch_isend_irecv between 8 PEs, 4 messages each way to every peer, is 56
// ops, and one launch is what keeps such a batch free of deadlock (issue 38).
constexpr int kMaxBatchOps = settings::kMaxGroupOps;
constexpr int kMidBatchOps = 16;
// A block of the send/recv kernel drives at most this many slices of each op: the host keeps
// every op's slices <= this times the grid cap, so a grid never exceeds what is resident.
constexpr int kMaxSlicesPerBlock = 32;
struct ChunkBatch {
  ChunkStreamArgs ops[kMaxBatchOps];
  bool is_send[kMaxBatchOps];
  int count;
  int max_grid;  // blocks of the launch at most (those that can be resident at once)
};
// Blocks of the send/recv kernel that can be resident at once on the current device for this
// process: under MPS its share of the SMs, and at most a 1/pes_sharing_gpu of the GPU (the PEs
// on this GPU, as init learned them; their launches of one exchange must all fit at once).
int chunk_batch_resident_blocks(int pes_sharing_gpu);
// Blocks of the send/recv kernel one SM holds at once (the smaller of its two batch sizes).
int chunk_batch_blocks_per_sm();
// The send/recv kernel's phase stamps (issue 35's probe; a test hook, off unless asked for): while
// on, thread 0 of block 0 of every send/recv launch reads %globaltimer at each phase and stores the
// launch's record in a ring on the device. Phases: entry, after the wait for the previous grid,
// after the prologue, op 0's rendezvous (a recv's descriptor posted, with its verdict where it
// takes one; a send's taken; 0: none), a zero-copy send's slice 0 begun (zero_copy_begin) and
// copied (before its final fence; 0: not a zero-copy send), op 0 finished, the loop left, the
// counters done, the end (after finish_slice); then a recv's descriptor stored (before the
// verdict), and, from every block of the launch (not only block 0), the latest zero-copy part
// begun and the latest part's final store (0: no zero-copy part). The record's slot is taken at
// entry, so a launch's blocks find it; the stamps are meant for one stream's launches in a row.
constexpr int kPhaseStamps = 13;
// Their names, in the record's order (the timeline's columns: SendRecvEngine::phase_stamp_names).
constexpr const char* kPhaseStampNames[kPhaseStamps] = {
    "entered", "grid_waited", "prologue_done", "rendezvous", "copy_begun",
    "copied",  "op_done",     "loop_left",     "counters_done", "ended",
    "posted",  "parts_last_begun", "parts_last_final"};
constexpr int kPhaseStampRing = 1024;
struct PhaseStampRecord {
  uint64_t at[kPhaseStamps];
  int32_t mode;     // op 0's: 1 staged, 2 zero-copy, 3 low-latency (0: a send that took no descriptor)
  int32_t is_send;  // op 0's direction
};
void set_phase_stamps(bool on);  // on: also empties the ring
// Test hook: the bounded descriptor wait's two bounds (settings::kZeroCopyFallbackWaitNs and
// kZeroCopyFallbackLongWaitNs by default), for tests that count which path each message took
// and must not depend on the machine's speed (a receiver slowed down by compute-sanitizer posts
// later than 100 us, and its sender moves staged: 2026-12-07). Process-wide; between calls only
// (no send/recv kernel of this process in flight).
void set_zero_copy_fallback_waits(uint64_t held_ns, uint64_t long_ns);
std::vector<PhaseStampRecord> read_phase_stamps();  // the last kPhaseStampRing launches, oldest first
// `programmatic`: launch_kernel's (launch.cuh); callers pass programmatic_launch_enabled() for an
// eager launch, false while capturing.
void launch_chunk_batch(const ChunkBatch& batch, cudaStream_t stream, bool programmatic);
// The kernel node of such a launch, for a CUDA graph (the copy engine's steps): its function, grid
// and parameters for `batch` (at most 2 ops), in `params` (which holds the parameter block the
// node's kernelParams point at; keep it alive until the node is set).
struct ChunkBatchNode {
  cudaKernelNodeParams node;
  void* args[1];
  alignas(16) unsigned char storage[2 * sizeof(ChunkStreamArgs) + 64];
};
void chunk_batch_node(const ChunkBatch& batch, ChunkBatchNode& params);
// Launches may be programmatic (launch.cuh): compute capability 9.0 or later on the current device,
// the kernels built for sm_90+ (their PTX), and PYDATACOPY_PROGRAMMATIC_LAUNCH neither empty nor 0 (read
// once per process).
bool programmatic_launch_enabled();
// The settings the launch choices depend on (PYDATACOPY_PROGRAMMATIC_LAUNCH, PYDATACOPY_RANKS_PER_GPU,
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): read from the environment in host code (init_nvshmem, through
// settings.hpp) and passed in here, so that no kernel file reads the environment.
struct LaunchSettings {
  bool programmatic_launch = true;
  int ranks_per_gpu = 1;
  double mps_thread_percentage = 0;  // 0: unset
};
void set_launch_settings(const LaunchSettings& launch);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// Latency probe for the benchmark: one thread bounces an 8-byte signal between two PEs
// `iterations` times (the initiator starts). Symmetric `signal` starts at zero on both.
void launch_pingpong(uint64_t* signal, int my_pe, int peer, int iterations, bool initiator,
                     uint64_t timeout_ns, detail::DeviceStatus* status, cudaStream_t stream);
// Host-cost probe: an empty one-block kernel whose parameters take 16, 1024 or 8192 bytes (the
// smallest of those at least `parameter_bytes`), programmatic or not (launch.cuh).
void launch_empty_probe(int parameter_bytes, bool programmatic, cudaStream_t stream);

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

namespace pydatacopy::kernels {

// Test support: `blocks` blocks of `threads` threads and `shared_bytes` of dynamic shared memory
// spin until *release != 0 or max_ns pass; *released_by_flag (set to 1 by the caller) drops to 0
// when a block had to give up at the deadline.
void launch_occupy_sms(int blocks, int threads, std::size_t shared_bytes, const int* release,
                       int* released_by_flag, uint64_t max_ns, cudaStream_t stream);

}  // namespace pydatacopy::kernels

namespace pydatacopy::kernels {

// One round of the all-to-all-v (all_to_all.hpp). Offsets are from the symmetric base, the
// same at every PE; `base` is this PE's address of it, peer_bases[pe] pe's through nvshmem_ptr
// (null: NVSHMEM RMA to that PE).
constexpr int kAllToAllMaxFields = 4;
struct AllToAllArgs {
  const uint8_t* send[kAllToAllMaxFields];
  uint8_t* recv[kAllToAllMaxFields];
  int64_t row_bytes[kAllToAllMaxFields];
  int64_t field_start[kAllToAllMaxFields];  // in a region, for this call's row widths
  int fields;
  int64_t row_bytes_total;
  int64_t send_rows;          // rows in each send field
  const int64_t* send_counts;  // device [n_pes]
  const int64_t* send_index;   // device [index_rows] or null
  int64_t index_rows;
  int64_t* recv_counts;        // device [n_pes]
  int64_t* recv_offsets;       // device [n_pes]
  uint8_t* base;
  uint8_t* const* peer_bases;  // device [n_pes]
  bool direct;                 // false: PYDATACOPY_FORCE_RMA (every peer through NVSHMEM RMA)
  int64_t capacity;
  int64_t region_bytes;
  int64_t regions;             // offsets of this call's set
  int64_t meta_signals, metas, arrivals, credits, outgoing;
  // Compact call (AllToAllLayout, "Compact calls"): rows packed by source at regions + n_pes x
  // field_start[f], placed by each receiver's send kernel through the place words (`places`);
  // no field is copied out (recv all null) and the credits are owed until the set's next round,
  // whose send kernel signals them first (no release() call: graph replays stay balanced).
  bool compact;
  int64_t places;
  uint64_t* uses;              // device: rounds of this set so far (the send kernel moves it on)
  uint64_t* consumed;          // device [n_pes]: row-field units taken from each source, this set
  uint64_t* pending;           // device [n_pes]: credit owed to each source (release), this set
  bool defer_credits;          // a field stays in the region: credits wait for release
  // Refuse mode (nonzero: an AllToAllRefusal): this PE sends no rows and every destination a
  // call-refused meta, takes and credits its sources' rows without copying them, writes no
  // output and records nothing (its host throws); send_counts and the outputs may be null.
  int refusal;
  uint64_t tag;                // the call's identity: a source whose tag differs is refused
  // Field 0's rows as sums (AllToAllSummedRows, all_to_all.hpp; sum_slots null: rows copied
  // from send[0]): send row r is sum_k sum_weights[r x sum_topk + k] x sum_rows[sum_slots[...]]
  // (sum_row_count rows of field 0's width), moe_combine_reduce's arithmetic, computed as the row
  // is stored at its destination. One field, no index, every peer direct (the host checks).
  const uint8_t* sum_rows;
  int64_t sum_row_count;
  const int64_t* sum_slots;
  const float* sum_weights;
  int64_t sum_topk;
  int sum_dtype;
  unsigned int* send_done;     // device: send blocks finished in this launch
  unsigned int* recv_done;     // device: receive blocks finished in this launch
  int my_pe, n_pes;
  uint64_t timeout_ns;
  detail::DeviceStatus* status;
};
void launch_all_to_all(const AllToAllArgs& args, int blocks, cudaStream_t stream);
// pydatacopy::zero_rows_past's kernel.
void launch_zero_rows_past(void* out, int64_t rows, int64_t row_bytes, const int64_t* counts, int n_counts,
                           int blocks, cudaStream_t stream);
// The credits a deferred call owes (pending[s], 0: none) signalled to the sources: credits is
// the symmetric credit array of the call's set.
void launch_all_to_all_release(uint64_t* pending, uint64_t* credits, int my_pe, int n_pes,
                               cudaStream_t stream);
void launch_gather_region_rows(void* out, const void* region, int64_t stride, const int64_t* recv_offsets,
                               const int64_t* recv_counts, int n_sources, const int64_t* index,
                               const int64_t* count, int64_t rows, int64_t row_bytes, int blocks,
                               cudaStream_t stream);
void launch_moe_combine_reduce_region(void* out, const void* region, int64_t stride,
                                      const int64_t* pair_pe, const int64_t* pair_rank,
                                      const int64_t* back_counts, int n_sources, const float* weights,
                                      int64_t tokens, int64_t topk, int64_t hidden, int dtype,
                                      cudaStream_t stream);
// Blocks of the all-to-all kernels per launch: the SMs this PE may use (its MPS share, and a
// 1/pes_sharing_gpu of the GPU), one block each, so that the launches of every PE sharing the
// GPU are resident at once (they wait on one another).
int all_to_all_blocks(int pes_sharing_gpu);

void launch_gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count,
                        int64_t rows, int64_t src_rows, int64_t row_bytes, int blocks,
                        cudaStream_t stream);

void launch_moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                               const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                               int dtype, cudaStream_t stream);

// MoE layouts (one block each; pydatacopy::moe_dispatch_layout / moe_receive_layout check the
// limits: n_pes <= kMoeLayoutMaxPes, experts_per_pe < kMoeLayoutMaxBins, pairs < 2^31).
constexpr int kMoeLayoutMaxPes = 64;
constexpr int kMoeLayoutMaxBins = 257;  // local experts + "none"
void launch_moe_dispatch_layout(const void* topk_idx, bool ids_int32, int64_t tokens, int topk,
                                int64_t num_experts, int n_pes, int64_t* send_counts,
                                int64_t* send_index, int32_t* meta, int64_t* pair_pe,
                                int64_t* pair_rank, cudaStream_t stream);
// The receive layout's outputs (pydatacopy::moe_receive_layout says what each holds).
struct MoeReceiveLayoutOutputs {
  int64_t* row_of;
  int64_t* expert_counts;
  int64_t* expert_offsets;
  int64_t* num_rows;
  int64_t* expert_of_row;
  int64_t* source_pe;
  int64_t* source_token;
  int64_t* combine_index;
  int64_t* combine_counts;
  int64_t* pair_position;  // null: not written
};
void launch_moe_receive_layout(const int32_t* recv_meta, int64_t rows, int topk,
                               const int64_t* recv_counts, int n_pes, int my_pe,
                               int64_t experts_per_pe, const MoeReceiveLayoutOutputs& out, cudaStream_t stream);
// The same layouts for large inputs (moe_layout_large.cu): the same outputs, bit for bit, over
// many blocks in three launches each, with scratch memory of the bytes below (0: small enough
// for the one-block kernels, which the caller then uses). The limits above hold.
constexpr int64_t kMoeLayoutLargePairs = 8192;  // tokens x topk or rows x topk above: large
int64_t moe_dispatch_layout_scratch_bytes(int64_t tokens, int topk, int n_pes);
int64_t moe_receive_layout_scratch_bytes(int64_t rows, int topk, int64_t experts_per_pe);
void launch_moe_dispatch_layout_large(const void* topk_idx, bool ids_int32, int64_t tokens, int topk,
                                      int64_t num_experts, int n_pes, int64_t* send_counts,
                                      int64_t* send_index, int32_t* meta, int64_t* pair_pe,
                                      int64_t* pair_rank, void* scratch, cudaStream_t stream);
void launch_moe_receive_layout_large(const int32_t* recv_meta, int64_t rows, int topk,
                                     const int64_t* recv_counts, int n_pes, int my_pe,
                                     int64_t experts_per_pe, const MoeReceiveLayoutOutputs& out,
                                     void* scratch, cudaStream_t stream);
void preload_moe_layout_large_kernels();
// MoeDispatcher(expand=False)'s small layouts (kernels/moe/token_layout.hpp says what each element
// writes; pydatacopy::moe_token_destinations / moe_local_topk check the arguments), one launch
// each of at most max_blocks blocks.
void launch_moe_token_destinations(const int64_t* send_counts, const int64_t* send_index, const int64_t* pair_pe,
                                   int64_t tokens, int64_t topk, int n_pes, int64_t* token_pe, int64_t* token_rank,
                                   int max_blocks, cudaStream_t stream);
void launch_moe_local_topk(const int32_t* recv_meta, int64_t rows, int64_t topk, const int64_t* recv_counts,
                           int n_pes, int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx,
                           float* recv_topk_weights, int64_t* source_token, int64_t* num_rows, int max_blocks,
                           cudaStream_t stream);
// MoE dispatch's grouping by expert from the receive region, each received row read once and
// written to every recv_x row of it: positions [received rows x topk] (recv_x row, or < 0).
void launch_scatter_region_rows(void* out, int64_t out_rows, const void* region, int64_t stride,
                                const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                                const int64_t* positions, int topk, int64_t rows, int64_t row_bytes,
                                int blocks, cudaStream_t stream);

}  // namespace pydatacopy::kernels
