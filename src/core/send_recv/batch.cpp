// The send/recv engine's per-call work: each op's kernel arguments (prepare), a recv's zero-copy
// decision, and the batch's launch in its channels' order. The engine's setup, thresholds and
// buffers are in send_recv.cpp.
#include "pydatacopy/send_recv.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "send_recv/zero_copy.hpp"
#include "send_recv/zero_copy_state.hpp"

namespace pydatacopy {

namespace {
// The host phases of a call (SendRecvEngine::set_host_phases), in batch_locked's order: the peers'
// zero-copy mailboxes; the stream's capture state and id; each op's checks and kernel arguments
// (prepare, decide_recv_mode); the batch's channel totals; the waits on the channels' last
// launches; the launch; the channels' records.
constexpr const char* kHostPhaseNames[] = {"mailboxes", "stream", "prepare", "channels", "order", "launch", "record"};

// A steady_clock reading per phase boundary, only while the hook is on; a call's phases count
// only once it has come to its end (committed with the call: one that threw counts nowhere).
template <int kPhases>
class HostPhaseClock {
 public:
  explicit HostPhaseClock(bool on) : on_(on) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void ended(int phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    ns_[phase] += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }
  void commit(uint64_t* totals, uint64_t& calls) const {
    if (!on_) return;
    for (int p = 0; p < kPhases; ++p) totals[p] += ns_[p];
    ++calls;
  }

 private:
  bool on_;
  uint64_t ns_[kPhases] = {};
  std::chrono::steady_clock::time_point last_;
};
}  // namespace

std::vector<std::string> SendRecvEngine::host_phase_names() {
  static_assert(std::size(kHostPhaseNames) == kHostPhases, "a name per host phase");
  return {std::begin(kHostPhaseNames), std::end(kHostPhaseNames)};
}

bool SendRecvEngine::fits_staging(std::size_t bytes) const {
  return bytes <= chunk_bytes_ * static_cast<std::size_t>(num_chunks_);
}

int SendRecvEngine::active_blocks(std::size_t bytes) const {
  return message_slices(bytes, chunk_bytes_, pages(), blocks_, narrow_blocks_, resident_blocks_);
}

int SendRecvEngine::message_slices(std::size_t bytes, std::size_t chunk_bytes, int pages, int blocks,
                                   int narrow_blocks, int resident_blocks) {
  // Small messages move on few blocks: each must carry at least kMinBytesPerBlock of a chunk.
  constexpr std::size_t kMinBytesPerBlock = 32 << 10;
  const std::size_t chunk = std::min(bytes, chunk_bytes);
  const std::size_t wanted = (chunk + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  // Messages under the narrow cut on fewer (settings.hpp says why).
  const int most = bytes < static_cast<std::size_t>(settings::kNarrowMessageBytes) ? std::min(blocks, narrow_blocks)
                                                                                    : blocks;
  const std::size_t limit = static_cast<std::size_t>(most_message_slices(pages, most, resident_blocks));
  return static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(wanted, limit)));
}

int SendRecvEngine::zero_copy_slices(std::size_t bytes, std::size_t chunk_bytes, int pages, int blocks,
                                     int resident_blocks) {
  return std::min(message_slices(bytes, chunk_bytes, pages, blocks, blocks, resident_blocks),
                  std::max(1, resident_blocks));
}

int SendRecvEngine::most_message_slices(int pages, int blocks, int resident_blocks) {
  // A block owns >= 1 page, and drives at most kMaxSlicesPerBlock slices of an op: more slices
  // than that times the resident blocks would need a grid larger than what can be resident.
  return static_cast<int>(std::min({static_cast<std::size_t>(std::max(1, blocks)), static_cast<std::size_t>(std::max(1, pages)),
                                    static_cast<std::size_t>(kernels::kMaxSlicesPerBlock) *
                                        static_cast<std::size_t>(std::max(1, resident_blocks))}));
}

kernels::ChunkStreamArgs SendRecvEngine::prepare(bool send, void* buffer, std::size_t bytes,
                                                 int peer, double timeout_seconds) {
  const int me = my_pe();
  kernels::ChunkStreamArgs a{};
  a.bytes = static_cast<int64_t>(bytes);
  a.chunk_bytes = static_cast<int64_t>(chunk_bytes_);
  a.page_bytes = static_cast<int64_t>(page_bytes_);
  a.pages = pages();
  a.num_slots = num_chunks_;
  const int channel = (send ? 0 : n_pes_) + peer;
  a.sequence = sequences_ + channel;
  a.progress = progress_ + channel;
  a.done = done_ + channel;
  a.failed = failed_ + channel;
  a.broken = broken(send, peer);
  a.is_send = send;
  a.active_blocks = active_blocks(bytes);
  a.page_slices = a.active_blocks;
  a.header_pages = most_message_slices(pages(), blocks_, resident_blocks_);
  a.my_pe = me;
  a.peer = peer;
  a.timeout_ns = timeout_nanoseconds(timeout_seconds);
  a.status = detail::device_status();
  a.messages = messages_ + channel;
  a.zc_index = -1;
  a.activity = activity_word();
  // Slices of a zero-copy message: from its size and the agreed numbers alone (the batch may
  // raise active_blocks), so both sides count the same; at most one per resident block, so that
  // a block streams one contiguous part instead of visiting two in turn; not narrowed.
  a.zc_slices = zero_copy_slices(bytes, chunk_bytes_, pages(), blocks_, resident_blocks_);
  a.zc_counters = reinterpret_cast<unsigned long long*>(zc_counts_) +
                  static_cast<std::size_t>(peer) * kernels::kZeroCopyCounters;  // this peer's
  const bool load_store = load_store_peer(peer);
  a.low_latency = moves_low_latency(peer, bytes);
  if (send) {
    a.src = static_cast<const uint8_t*>(buffer);
    a.staging = staging(me);
    a.arrivals = arrivals(me);
    a.credits = credits(peer);
    a.headers = headers(me);
    a.outgoing = outgoing_headers(peer);
    a.filled = filled_ + static_cast<std::size_t>(peer) * num_chunks_ * pages();
    a.peer_staging = static_cast<uint8_t*>(peer_address(a.staging, peer));
    a.peer_arrivals = static_cast<uint64_t*>(peer_address(a.arrivals, peer));
    a.peer_headers = static_cast<kernels::SlotHeader*>(peer_address(a.headers, peer));
    if (a.peer_staging == nullptr || a.peer_arrivals == nullptr || a.peer_headers == nullptr)
      a.peer_staging = nullptr, a.peer_arrivals = nullptr, a.peer_headers = nullptr;
    if (load_store && a.peer_staging != nullptr && bytes >= zero_copy_min_bytes_) {
      a.ring = rendezvous_ring(peer);
      a.peer_zc_done = static_cast<uint64_t*>(peer_address(zero_copy_done(me), peer));
      a.peer_recv_broken = static_cast<uint64_t*>(peer_address(broken(false, me), peer));
      a.zc_table = zero_copy_->table_device + static_cast<std::size_t>(peer) * zero_copy::kTableEntries;
      a.zc_resolved = zc_resolved_ + static_cast<std::size_t>(peer) * 2 * kernels::kRendezvousRing;
      a.await_descriptor = a.peer_zc_done != nullptr && a.peer_recv_broken != nullptr;
      a.peer_activity = static_cast<const unsigned int*>(peer_address(activity_word(), peer));
      a.zc_fallback = a.await_descriptor && a.peer_activity != nullptr && fits_staging(bytes);
      // Every zero-copy part needs its slice. If the send moves staged after all (its receiver's
      // descriptor says so: a buffer not mapped yet, memory CUDA IPC cannot export; or the bounded
      // wait ran out), its pages stay on page_slices (the staged count; the receiver's may differ,
      // as either side's batch may raise it, which the staging allows), and the slices past it end
      // at once.
      if (a.await_descriptor) a.active_blocks = std::max(a.active_blocks, a.zc_slices);
      // The copy engine's places (launch_copy_engine): where the kernels leave the host its next
      // guess, and the probe its verdict.
      if (a.await_descriptor && copy_engine_min_bytes_ != 0 && bytes >= copy_engine_min_bytes_) {
        a.ce_last_target = zero_copy_->ce_last_target_device + peer;
        a.ce_state = zero_copy_->ce_state + peer;
      }
    }
    if (a.low_latency) {
      a.peer_ll_lines = static_cast<uint64_t*>(peer_address(ll_lines(me), peer));
      a.ll_credit = ll_credits(peer);
      a.ll_filled = ll_filled_ + static_cast<std::size_t>(peer) * kernels::kLowLatencySlots;
    }
  } else {
    a.dst = static_cast<uint8_t*>(buffer);
    a.staging = staging(peer);
    a.arrivals = arrivals(peer);
    a.credits = credits(me);
    a.headers = headers(peer);
    a.peer_credits = static_cast<uint64_t*>(peer_address(a.credits, peer));
    // The sender's refusal word for this channel: its send channel to this PE.
    a.remote_broken = broken(true, me);
    a.peer_broken = static_cast<uint64_t*>(peer_address(a.remote_broken, peer));
    a.remote_refused_bytes = refused_bytes(me);
    a.peer_refused_bytes = a.peer_broken == nullptr ? nullptr
                                                    : static_cast<uint64_t*>(peer_address(a.remote_refused_bytes, peer));
    if (a.peer_refused_bytes == nullptr) a.peer_broken = nullptr;  // both words by one path
    if (load_store && a.peer_credits != nullptr && a.peer_broken != nullptr) {
      a.peer_ring = static_cast<kernels::RendezvousDescriptor*>(peer_address(rendezvous_ring(me), peer));
      a.zc_done = zero_copy_done(peer);
      a.post_descriptor = a.peer_ring != nullptr;
      // Below the threshold a sender of this size never reads it: it goes out only for a sender of
      // another size that waits for it (settings::kLatePostNs).
      a.post_late = a.post_descriptor && bytes < zero_copy_min_bytes_;
      // Used only when the recv is posted zero-copy (decide_recv_mode), at or above the threshold.
      a.zc_fallback = a.post_descriptor && fits_staging(bytes);
    }
    // Every recv of a low-latency channel watches the ring (a sender that sent low-latency
    // another size), a low-latency one reads its message there.
    // (Also with the cut at 0: a graph captured under another cut may still send by it.)
    if (low_latency_peer(peer)) {
      a.ll_lines = ll_lines(peer);
      a.peer_ll_credit = static_cast<uint64_t*>(peer_address(ll_credits(me), peer));
    }
  }
  return a;
}

// Seconds a capture may wait for the sender's host to map a new receive buffer, so that the
// graph's replays move the data once (a capture is not a hot path). Bounded by the call's
// timeout too; past it the captured recv stays staged (correct, two copies).
constexpr double kCaptureHandshakeSeconds = 0.5;

void SendRecvEngine::decide_recv_mode(kernels::ChunkStreamArgs& a, void* dst, std::size_t bytes, int peer,
                                      bool capturing, double timeout_seconds) {
  if (!a.post_descriptor || bytes < zero_copy_min_bytes_) return;
  zero_copy::Exporter& exporter = *zero_copy_->exporters[peer];
  zero_copy::Exporter::Decision d = exporter.prepare(dst, bytes, capturing);
  // Waits up to `seconds` (never past the call's timeout) for the sender's answer about dst's
  // allocation, serving the peers' requests meanwhile (both sides may wait at once), then decides
  // again.
  const auto wait_for_answer = [&](double seconds) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(std::min(timeout_seconds, seconds));
    while (std::chrono::steady_clock::now() < deadline) {
      // Every peer's requests, not only this one's: the lock held here also keeps this process's
      // progress thread out, and a ring of PEs that each wait here needs each to serve its receiver.
      service_zero_copy_locked();
      if (exporter.acked(dst) || !exporter.awaiting(dst)) break;  // mapped, or refused for good
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    d = exporter.prepare(dst, bytes, capturing);
  };
  if (!d.zero_copy && capturing && exporter.awaiting(dst)) {
    wait_for_answer(kCaptureHandshakeSeconds);  // a captured recv keeps its mode for the graph's life
  } else if (!d.zero_copy && !capturing && zero_copy_progress_on_ && exporter.claim_wait(dst)) {
    // PYDATACOPY_ZERO_COPY_PROGRESS: the second call into an allocation whose mapping the first
    // one asked for waits once, briefly, for the answer that the sender's progress thread gives
    // between its own calls: from the second call on, the buffer moves once.
    wait_for_answer(zero_copy_wait_seconds_);
  }
  a.zero_copy = d.zero_copy;
  a.zc_index = d.index;
  a.zc_offset = d.offset;
}

void SendRecvEngine::batch_locked(const std::vector<Operation>& ops, cudaStream_t stream,
                                  double timeout_seconds) {
  PDC_REQUIRE(ops.size() <= static_cast<std::size_t>(kernels::kMaxBatchOps),
              "a batch (group) holds at most " << kernels::kMaxBatchOps << " sends and recvs, got "
                                               << ops.size() << "; split it into several groups");
  // Check the arguments before any sequence number moves.
  timeout_nanoseconds(timeout_seconds);
  for (const Operation& op : ops) require_ready(op.send ? "send" : "recv", op.peer);
  HostPhaseClock<kHostPhases> clock(host_phases_on_);
  // A peer that timed out has its ops left out; a peer with a size-mismatch record has them
  // launched (the kernel refuses the broken channel, the healthy direction runs). Every other op
  // launches (its peer waits for it), and the first refusal is raised after the launch: the
  // call that raises has still launched the rest of its ops, so it must not be retried.
  std::exception_ptr refused;
  // Default-initialised: only the first `count` ops are written and read (prepare() fills each
  // whole), so a send of one op does not clear the 64 ops' 26 KiB on every call.
  kernels::ChunkBatch launch;
  launch.count = 0;
  launch.max_grid = resident_blocks_;
  // Zero-copy's mailboxes of the peers of this call: their requests and answers, without waiting.
  for (std::size_t i = 0; i < ops.size(); ++i) {
    bool seen = false;
    for (std::size_t j = 0; j < i; ++j) seen = seen || ops[j].peer == ops[i].peer;
    if (seen) continue;
    zero_copy_->importers[ops[i].peer]->drain();
    zero_copy_->exporters[ops[i].peer]->poll();
    zero_copy_->exporters[ops[i].peer]->begin_call();
  }
  clock.ended(0);
  const unsigned long long capturing = capture_id(stream);
  // Asked before the ops are prepared (a failure leaves no op half done): the launch skips the
  // channel order's wait where the channel's last launch was on this very stream.
  const StreamId stream_id = ChannelOrder::eager_stream_id(stream, capturing);
  clock.ended(1);
  for (const Operation& op : ops) {
    try {  // a timed-out peer: its ops are left out
      check_peer_timeouts(op.peer, op.send ? "send" : "recv");
    } catch (...) {
      if (!refused) refused = std::current_exception();
      continue;
    }
    try {
      check_size_mismatch(op.peer);
    } catch (...) {
      // Launched all the same: the kernel refuses a broken channel at both ends (and records it
      // again), while an op of the same pair on the other, healthy channel must still meet its
      // peer's, which has not heard of the mismatch yet.
      if (!refused) refused = std::current_exception();
    }
    // An empty message moves too (one header-only chunk), so that both sides' sequences stay
    // in step and a 0-byte call facing a non-empty one is caught as a mismatch.
    launch.is_send[launch.count] = op.send;
    kernels::ChunkStreamArgs& a = launch.ops[launch.count++];
    a = prepare(op.send, op.buffer, op.bytes, op.peer, timeout_seconds);
    if (!op.send) {
      decide_recv_mode(a, op.buffer, op.bytes, op.peer, capturing != 0, timeout_seconds);
      // A zero-copy recv waits on one block (send_recv.cu: zero_copy_recv_visit); its zc_slices,
      // set above from the size, still counts the sender's slices. One that fits the staging keeps
      // its staged slices: its sender may give the descriptor wait up and move it staged
      // (zero_copy.cuh, fall_back_to_staged), and then every slice has pages to drain.
      if (a.zero_copy && !a.zc_fallback) a.active_blocks = a.page_slices = 1;
    }
    // A low-latency message moves on one block (its slice 0) and takes no staging chunk.
    if (a.low_latency) a.active_blocks = a.page_slices = 1;
    // NVSHMEM RMA reads the user's buffer of a send (a recv drains the staging with loads).
    prepare_rma_chunk_stream(a, op.send);
  }
  clock.ended(2);
  // Several ops of the batch on one channel (direction and peer) follow each other in the
  // channel's sequence: each learns its offset, and all learn the channel's totals. They share
  // one block count and one page count (the largest of each), so that a page of the channel has
  // one owner in the launch: the slice that sends (receives) a message's page also drained
  // (filled) it for the last one.
  for (int i = 0; i < launch.count; ++i) {
    kernels::ChunkStreamArgs& op = launch.ops[i];
    for (int j = 0; j < launch.count; ++j)
      if (launch.ops[j].sequence == op.sequence) {
        op.active_blocks = std::max(op.active_blocks, launch.ops[j].active_blocks);
        op.page_slices = std::max(op.page_slices, launch.ops[j].page_slices);
      }
  }
  for (int i = 0; i < launch.count; ++i) {
    kernels::ChunkStreamArgs& op = launch.ops[i];
    for (int j = 0; j < launch.count; ++j) {
      const kernels::ChunkStreamArgs& other = launch.ops[j];
      if (other.sequence != op.sequence) continue;
      const uint64_t chunks =
          other.low_latency ? 0 : std::max<uint64_t>(1, (static_cast<uint64_t>(other.bytes) + chunk_bytes_ - 1) / chunk_bytes_);
      if (j < i) op.offset_chunks += chunks, ++op.offset_messages;
      op.channel_chunks += chunks;
      ++op.channel_messages;
      op.channel_blocks += other.active_blocks;
    }
  }
  clock.ended(3);
  // Launches on one channel must not overlap: this one waits for the channel's last launch,
  // on whatever other stream that was (see ChannelOrder for the same stream and for captures).
  if (launch.count > 0) {
    const unsigned long long capture = capturing;
    for (int i = 0; i < launch.count; ++i)
      order_.order_after_last(static_cast<int>(launch.ops[i].sequence - sequences_), stream, capture,
                              stream_id);
    clock.ended(4);
    // A capture keeps the ordinary kernel (its graph would freeze the guess).
    if (capture != 0 || !launch_copy_engine(launch, stream))
      kernels::launch_chunk_batch(launch, stream, capture == 0 && kernels::programmatic_launch_enabled());
    clock.ended(5);
    for (int i = 0; i < launch.count; ++i) sends_launched_ = sends_launched_ || launch.is_send[i];
    int channels[kernels::kMaxBatchOps];
    for (int i = 0; i < launch.count; ++i) channels[i] = static_cast<int>(launch.ops[i].sequence - sequences_);
    order_.record_launch(channels, launch.count, stream, capture, stream_id);
    clock.ended(6);
  }
  clock.commit(host_phase_ns_, host_phase_calls_);
  if (refused) std::rethrow_exception(refused);
}

bool SendRecvEngine::launch_copy_engine(const kernels::ChunkBatch& launch, cudaStream_t stream) {
  if (copy_engine_min_bytes_ == 0 || zero_copy_ == nullptr || !zero_copy_->copy_engine_off.empty()) return false;
  if (launch.count < 1 || launch.count > 2) return false;
  int send = -1;
  for (int i = 0; i < launch.count; ++i) {
    if (launch.is_send[i]) {
      if (send >= 0) return false;  // one send a launch: one copy, one verdict
      send = i;
    } else if (!launch.ops[i].zero_copy || launch.ops[i].zc_fallback || launch.ops[i].low_latency) {
      // Only a recv that needs nothing of this PE's kernel while the probe waits: one posted
      // zero-copy, which its sender writes itself. A staged recv drains the staging in the step
      // after the probe, and its sender (an ungrouped send(); recv() on the peer) may wait for that
      // before it posts the descriptor the probe waits for: a deadlock (a review's finding). One
      // that fits the staging takes the bounded wait's verdict at its post, which the probe does not.
      return false;
    }
  }
  if (send < 0) return false;
  const kernels::ChunkStreamArgs& s = launch.ops[send];
  // ce_state is set (prepare) only on a send that awaits a descriptor, at or above the cut. A message
  // that fits the staging may fall back to staged after a bounded wait: not here.
  if (s.ce_state == nullptr || s.zc_fallback) return false;
  // The guess: the channel's last zero-copy target (0: none yet). The probe checks it against the
  // receiver's descriptor before the copy engine writes anything.
  const uint64_t guess = *reinterpret_cast<volatile uint64_t*>(zero_copy_->ce_last_target_host + s.peer);
  if (guess == 0 || !zero_copy_->importers[static_cast<std::size_t>(s.peer)]->maps(guess, static_cast<std::size_t>(s.bytes)))
    return false;  // none yet, or memory this PE no longer maps (the copy node must not be set to it)
  // The three kernels' batches: only the launch's (at most two) ops are copied, not the 64-op arrays.
  static thread_local copy_engine::Call call;
  const auto with_phase = [&](kernels::ChunkBatch& batch, int phase) {
    batch.count = launch.count;
    batch.max_grid = launch.max_grid;
    for (int i = 0; i < launch.count; ++i) {
      batch.ops[i] = launch.ops[i];
      batch.is_send[i] = launch.is_send[i];
      batch.ops[i].ce_phase = phase;
    }
    batch.ops[send].ce_guess = reinterpret_cast<uint8_t*>(guess);
  };
  with_phase(call.ordinary, kernels::kCopyEngineOrdinary);
  with_phase(call.probe, kernels::kCopyEngineProbe);
  for (int i = 0; i < call.probe.count; ++i) call.probe.ops[i].active_blocks = call.probe.ops[i].page_slices = 1;
  with_phase(call.copied, kernels::kCopyEngineCopied);
  // The send has nothing left but its done words: one slice (its channel holds only this op).
  kernels::ChunkStreamArgs& copied = call.copied.ops[send];
  copied.active_blocks = copied.page_slices = copied.channel_blocks = 1;
  call.target = reinterpret_cast<void*>(guess);
  call.src = s.src;
  call.bytes = static_cast<std::size_t>(s.bytes);
  std::string why;
  const cudaError_t e = zero_copy_->ce_graphs[static_cast<std::size_t>(s.peer)].launch(call, stream, why);
  if (e == cudaSuccess) return true;
  zero_copy_->copy_engine_off = why + ": " + cudaGetErrorString(e);
  return false;
}

}  // namespace pydatacopy
