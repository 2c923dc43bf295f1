#include "pydatacopy/send_recv.hpp"

#include <cuda_runtime.h>
#include <nvshmem.h>

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cuda_calls.hpp"
#include "common/device_status.cuh"
#include "common/pointer_attributes.hpp"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/settings.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"
#include "send_recv/zero_copy.hpp"
#include "send_recv/progress_thread.hpp"
#include "send_recv/zero_copy_state.hpp"

namespace pydatacopy {
namespace {

constexpr std::size_t kAlignment = 256;
std::size_t align_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }

static_assert(kernels::kRendezvousRing >= kernels::kMaxBatchOps,
              "a batch's ops on one channel must have descriptor slots of their own");
static_assert(kernels::kZeroCopyTableEntries == zero_copy::kTableEntries, "one table size");
static_assert(sizeof(kernels::RendezvousDescriptor) == 64, "a descriptor is one 64-byte line");

using detail::RelaxedCaptureMode;

// PYDATACOPY_ZERO_COPY_MIN_BYTES: a whole number of bytes (0: zero-copy off), by the settings
// table's rule (settings.hpp).
std::size_t zero_copy_min_bytes_from_environment() {
  return static_cast<std::size_t>(settings::value("PYDATACOPY_ZERO_COPY_MIN_BYTES").integer);
}
std::size_t low_latency_max_bytes_from_environment() {
  return static_cast<std::size_t>(settings::value("PYDATACOPY_LOW_LATENCY_MAX_BYTES").integer);
}
// A setting's value as this PE read it, or the SettingError's text in `unreadable`.
template <class Read>
std::size_t read_setting(Read read, std::string& unreadable) {
  try {
    return read();
  } catch (const settings::SettingError& e) {
    unreadable = e.what();
    return 0;
  }
}

}  // namespace


namespace {
// A slot's page: the unit each block signals for (32 KiB, or the whole chunk when smaller).
constexpr std::size_t kPageBytes = 32 << 10;
std::size_t page_bytes_for(std::size_t chunk_bytes) {
  return std::min(kPageBytes, align_up(chunk_bytes, 16));
}
std::size_t chunk_bytes_for(std::size_t chunk_bytes) {
  return align_up(chunk_bytes, page_bytes_for(chunk_bytes));
}
// Staging: [n_pes][num_chunks][chunk]; then arrivals and credits, [n_pes][num_chunks][pages]
// each; then incoming and outgoing slot headers, [n_pes][num_chunks][pages] each; then the
// refusal words, [3][n_pes]: send channels, recv channels, and per send channel the bytes + 1
// its receiver saw in the refused message's header (check_refusals names both sizes).
std::size_t signal_array_bytes(int n_pes, int num_chunks, std::size_t pages) {
  return align_up(static_cast<std::size_t>(n_pes) * num_chunks * pages * sizeof(uint64_t), kAlignment);
}
std::size_t header_array_bytes(int n_pes, int num_chunks, std::size_t pages) {
  return align_up(static_cast<std::size_t>(n_pes) * num_chunks * pages * sizeof(kernels::SlotHeader),
                  kAlignment);
}
// The refusal words [2][n_pes], the refused sizes [n_pes], then this PE's count of send/recv
// blocks waiting in their loops (SendRecvEngine::activity_word).
std::size_t broken_array_bytes(int n_pes) {
  return align_up((3 * static_cast<std::size_t>(n_pes) + 1) * sizeof(uint64_t), kAlignment);
}
std::size_t staging_array_bytes(int n_pes, int num_chunks, std::size_t chunk_bytes) {
  return align_up(static_cast<std::size_t>(n_pes) * num_chunks * chunk_bytes, kAlignment);
}
// Zero-copy: after the refusal words, the rendezvous rings [n_pes][kRendezvousRing] (at the
// sender, one ring per receiver) and the done words [n_pes][blocks] (at the receiver, one
// word per slice of each sender).
std::size_t ring_array_bytes(int n_pes) {
  return align_up(static_cast<std::size_t>(n_pes) * kernels::kRendezvousRing *
                      sizeof(kernels::RendezvousDescriptor), kAlignment);
}
std::size_t done_array_bytes(int n_pes, int blocks) {
  return align_up(static_cast<std::size_t>(n_pes) * blocks * sizeof(uint64_t), kAlignment);
}
// The low-latency protocol: after the done words, the rings [n_pes][kLowLatencySlots][stride
// lines] (at the receiver, one per sender), then the credit words [n_pes] (at the sender, one
// per receiver).
std::size_t ll_ring_array_bytes(int n_pes) {
  return align_up(static_cast<std::size_t>(n_pes) * kernels::kLowLatencySlots * kernels::kLowLatencySlotStride *
                      sizeof(uint64_t), kAlignment);
}
std::size_t ll_credit_array_bytes(int n_pes) {
  return align_up(static_cast<std::size_t>(n_pes) * sizeof(uint64_t), kAlignment);
}
}  // namespace

std::size_t SendRecvEngine::symmetric_bytes_needed(int n_pes, std::size_t chunk_bytes, int num_chunks,
                                                   int blocks) {
  PDC_REQUIRE(n_pes >= 1 && num_chunks >= 1 && blocks >= 1 && chunk_bytes >= 1,
              "symmetric_bytes_needed: n_pes, chunk_bytes, num_chunks and blocks must be positive");
  const std::size_t page = page_bytes_for(chunk_bytes);
  chunk_bytes = chunk_bytes_for(chunk_bytes);
  return staging_array_bytes(n_pes, num_chunks, chunk_bytes) +
         2 * signal_array_bytes(n_pes, num_chunks, chunk_bytes / page) +
         2 * header_array_bytes(n_pes, num_chunks, chunk_bytes / page) + broken_array_bytes(n_pes) +
         ring_array_bytes(n_pes) + done_array_bytes(n_pes, blocks) + ll_ring_array_bytes(n_pes) +
         ll_credit_array_bytes(n_pes);
}

void SendRecvEngine::build(std::size_t chunk_bytes, int num_chunks, int blocks) {
  require_initialized("SendRecvEngine.init");  // init() checked that the engine is not set up
  PDC_REQUIRE(num_chunks >= 2, "num_chunks must be at least 2 (one drains while the next fills), got "
                                   << num_chunks);
  PDC_REQUIRE(blocks >= 1 && blocks <= settings::kMaxSendBlocks,
              "blocks must be in [1, " << settings::kMaxSendBlocks << "], got " << blocks);
  PDC_REQUIRE(chunk_bytes >= 1, "chunk_bytes must be positive, got " << chunk_bytes);
  const int pes = n_pes();
  const std::size_t total = symmetric_bytes_needed(pes, chunk_bytes, num_chunks, blocks);
  ChannelOrder order(2 * pes);  // local, before anything collective can need undoing
  // check_refusals(): a pinned copy of the refusal words and a stream of its own, also local and
  // made before anything collective (a failure here leaves no peer waiting).
  RefusalPoll poll(static_cast<std::size_t>(pes) * std::max<std::size_t>(3, kernels::kZeroCopyCounters));
  // Both sides of a message must cut it into the same slices: every PE must ask for the same
  // `blocks`, and all take the smallest grid cap (PEs with different SM shares, e.g. other MPS
  // percentages, would otherwise cut messages differently: false size mismatches or stalls).
  // Voted before anything is allocated, so that a refusal leaves nothing to undo on any PE.
  // PYDATACOPY_FORCE_RMA too: each side decides from it whether a channel is load/store (the
  // low-latency and zero-copy paths), so two PEs that disagree would time out on small messages.
  const int my_cap = kernels::chunk_batch_resident_blocks(pes_sharing_my_gpu());
  // PYDATACOPY_ZERO_COPY_PROGRESS too: a receiver waits for answers that its sender's thread gives,
  // so PEs that disagree would wait for nothing; a value one PE cannot read refuses on every PE.
  constexpr uint64_t kForcedBit = 1ull << 31, kProgressBit = 1ull << 30, kProgressUnreadableBit = 1ull << 29;
  // PYDATACOPY_COPY_ENGINE_MIN_BYTES is this PE's alone (only a sender decides), but a value one PE
  // cannot read refuses on every PE, as the others do.
  constexpr uint64_t kCopyEngineUnreadableBit = 1ull << 28;
  constexpr uint64_t kGridCapMask = kCopyEngineUnreadableBit - 1;  // a grid cap is far below 2^28
  const bool forced = rma_forced();
  bool progress = false;
  std::string progress_unreadable;
  try {
    progress = settings::value("PYDATACOPY_ZERO_COPY_PROGRESS").on;
  } catch (const std::exception& error) {
    progress_unreadable = error.what();
  }
  std::string copy_engine_unreadable;
  const std::size_t copy_engine_min_bytes = read_setting(
      [] { return static_cast<std::size_t>(settings::value("PYDATACOPY_COPY_ENGINE_MIN_BYTES").integer); },
      copy_engine_unreadable);
  // PYDATACOPY_NARROW_SEND_BLOCKS too (it cuts messages under 64 MiB): voted beside `blocks` in
  // the word's high half, 0 where this PE cannot read it (its range starts at 1).
  std::string narrow_unreadable;
  int narrow_blocks = 0;
  try {
    narrow_blocks = static_cast<int>(settings::value("PYDATACOPY_NARROW_SEND_BLOCKS").integer);
  } catch (const std::exception& error) {
    narrow_unreadable = error.what();
  }
  constexpr int kBlocksBits = 11;  // kMaxSendBlocks < 2^11
  static_assert(settings::kMaxSendBlocks < (1 << kBlocksBits), "blocks and narrow blocks share 32 bits");
  const uint64_t blocks_vote = static_cast<uint64_t>(blocks) | (static_cast<uint64_t>(narrow_blocks) << kBlocksBits);
  const std::vector<uint64_t> votes = barrier_all_blocking(
      "SendRecvEngine.init (collective: every PE must set up send/recv)", default_timeout_seconds(),
      (blocks_vote << 32) | (forced ? kForcedBit : 0) | (progress ? kProgressBit : 0) |
          (progress_unreadable.empty() ? 0 : kProgressUnreadableBit) |
          (copy_engine_unreadable.empty() ? 0 : kCopyEngineUnreadableBit) | (static_cast<uint32_t>(my_cap) & kGridCapMask));
  int grid_cap = my_cap;
  PDC_REQUIRE(narrow_unreadable.empty(), narrow_unreadable << " (every PE refuses: nothing was allocated on any PE)");
  for (std::size_t pe = 0; pe < votes.size(); ++pe) {
    const uint64_t their_blocks = (votes[pe] >> 32) & ((1u << kBlocksBits) - 1);
    const uint64_t their_narrow = votes[pe] >> (32 + kBlocksBits);
    PDC_REQUIRE(their_narrow != 0, "SendRecvEngine.init: PE " << pe << " cannot read PYDATACOPY_NARROW_SEND_BLOCKS "
                                   "(its error says why); every PE refuses. Set the same valid value on every PE, "
                                   "or unset it. Nothing was allocated on any PE");
    PDC_REQUIRE(static_cast<int>(their_narrow) == narrow_blocks,
                "SendRecvEngine.init: PE " << pe << " set up send/recv with PYDATACOPY_NARROW_SEND_BLOCKS="
                                           << their_narrow << " and this PE with " << narrow_blocks
                                           << "; every PE must use the same value (both sides of a message "
                                              "cut it alike). Nothing was allocated on any PE");
    PDC_REQUIRE((votes[pe] & kCopyEngineUnreadableBit) == 0,
                "SendRecvEngine.init: PE " << pe << " cannot read PYDATACOPY_COPY_ENGINE_MIN_BYTES"
                                           << (copy_engine_unreadable.empty() ? "" : " (here: " + copy_engine_unreadable + ")")
                                           << "; every PE refuses. Set a valid value or unset it. Nothing was "
                                              "allocated on any PE");
    PDC_REQUIRE((votes[pe] & kProgressUnreadableBit) == 0,
                "SendRecvEngine.init: PE " << pe << " cannot read PYDATACOPY_ZERO_COPY_PROGRESS"
                                           << (progress_unreadable.empty() ? "" : " (here: " + progress_unreadable + ")")
                                           << "; set it to 0 or 1 on every PE. Nothing was allocated on any PE");
    PDC_REQUIRE(((votes[pe] & kProgressBit) != 0) == progress,
                "SendRecvEngine.init: PE " << pe << " runs " << ((votes[pe] & kProgressBit) != 0 ? "with" : "without")
                                           << " PYDATACOPY_ZERO_COPY_PROGRESS and this PE " << (progress ? "with" : "without")
                                           << " it; every PE must set it alike (a receiver waits for what its sender's "
                                              "thread answers). Nothing was allocated on any PE");
    PDC_REQUIRE(((votes[pe] & kForcedBit) != 0) == forced,
                "SendRecvEngine.init: PE " << pe << " runs " << ((votes[pe] & kForcedBit) != 0 ? "with" : "without")
                                           << " PYDATACOPY_FORCE_RMA and this PE "
                                           << (forced ? "with" : "without")
                                           << " it; every PE must set it alike (it decides which path "
                                              "a message takes on both sides). Nothing was allocated on any PE");
    PDC_REQUIRE(static_cast<int>(their_blocks) == blocks,
                "SendRecvEngine.init: PE " << pe << " set up send/recv with blocks=" << their_blocks
                                           << " and this PE with blocks=" << blocks
                                           << "; every PE must use the same settings "
                                              "(PYDATACOPY_SEND_BLOCKS, setup_send_recv's arguments). "
                                              "Nothing was allocated on any PE");
    grid_cap = std::min(grid_cap, static_cast<int>(votes[pe] & kGridCapMask));
  }
  zero_copy_progress_wanted_ = progress;
  // The zero-copy threshold decides, on each side alike, whether a message waits for a
  // rendezvous: every PE must have the same. A value this PE cannot read is voted as such, so
  // that every PE refuses (nothing is allocated yet), not this one alone while its peers wait.
  // Then PE 0 draws the job's mailbox name.
  // The low-latency cut likewise.
  std::string unreadable, ll_unreadable;
  const std::size_t min_bytes = read_setting(zero_copy_min_bytes_from_environment, unreadable);
  agree_zero_copy_min_bytes(unreadable.empty() ? min_bytes : kUnreadableThreshold, unreadable);
  const std::size_t ll_max_bytes = read_setting(low_latency_max_bytes_from_environment, ll_unreadable);
  agree_low_latency_max_bytes(ll_unreadable.empty() ? ll_max_bytes : kUnreadableThreshold, ll_unreadable);
  uint64_t job = 0;
  if (my_pe() == 0) {
    std::random_device random;
    job = (static_cast<uint64_t>(random()) << 32) ^ random() ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
          (static_cast<uint64_t>(getpid()) << 16);
  }
  job = barrier_all_blocking("SendRecvEngine.init", default_timeout_seconds(), job)[0];
  // And the key a peer's descriptor socket asks for (fd_channel.hpp), drawn apart from the job's
  // word, which anyone can read in the socket's name.
  uint64_t fd_key = 0;
  if (my_pe() == 0) {
    std::random_device random;
    fd_key = (static_cast<uint64_t>(random()) << 32) ^ random();
  }
  fd_key = barrier_all_blocking("SendRecvEngine.init", default_timeout_seconds(), fd_key)[0];
  int device = -1;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  page_bytes_ = page_bytes_for(chunk_bytes);
  chunk_bytes = chunk_bytes_for(chunk_bytes);
  // Per channel (send to / receive from each PE): the next chunk's sequence number, the time
  // of its last progress, the slices finished in the launch in flight and whether the channel
  // failed in it; per send channel, the sequence that last filled each page of each slot. On the
  // device, so that graph replays advance them.
  const std::size_t pages_per_peer = static_cast<std::size_t>(num_chunks) * (chunk_bytes / page_bytes_);
  // Then per send channel the ring of zero-copy targets its slice-0 block resolved, and the
  // test hook's counters of finished ops by mode.
  const std::size_t counter_bytes = 2 * pes * (2 * sizeof(uint64_t) + 2 * sizeof(unsigned int)) +
                                    pes * pages_per_peer * sizeof(uint64_t) + 2 * pes * sizeof(uint64_t) +
                                    (pes * 2 * kernels::kRendezvousRing + pes * kernels::kZeroCopyCounters) *
                                        sizeof(uint64_t) +
                                    static_cast<std::size_t>(pes) * kernels::kLowLatencySlots * sizeof(uint64_t);
  void* counters = nullptr;
  PDC_CHECK_CUDA(cudaMalloc(&counters, counter_bytes));
  if (cudaError_t e = cudaMemset(counters, 0, counter_bytes); e != cudaSuccess) {
    cudaFree(counters);
    PDC_CHECK_CUDA(e);
  }
  void* base = nullptr;
  try {
    base = symmetric_malloc(total);
    PDC_CHECK_CUDA(cudaMemset(base, 0, total));
  } catch (...) {
    cudaFree(counters);
    throw;
  }
  base_ = static_cast<uint8_t*>(base);
  peer_bases_.assign(static_cast<std::size_t>(pes), nullptr);
  for (int peer = 0; peer < pes; ++peer) peer_bases_[peer] = static_cast<uint8_t*>(nvshmem_ptr(base_, peer));
  sequences_ = static_cast<uint64_t*>(counters);
  order_ = std::move(order);
  refusal_poll_ = std::move(poll);
  progress_ = sequences_ + 2 * pes;
  filled_ = progress_ + 2 * pes;
  messages_ = filled_ + pes * pages_per_peer;
  zc_resolved_ = messages_ + 2 * pes;
  zc_counts_ = zc_resolved_ + static_cast<std::size_t>(pes) * 2 * kernels::kRendezvousRing;
  ll_filled_ = zc_counts_ + static_cast<std::size_t>(pes) * kernels::kZeroCopyCounters;
  done_ = reinterpret_cast<unsigned int*>(ll_filled_ + static_cast<std::size_t>(pes) * kernels::kLowLatencySlots);
  failed_ = done_ + 2 * pes;
  resident_blocks_ = std::max(1, grid_cap);
  chunk_bytes_ = chunk_bytes;
  num_chunks_ = num_chunks;
  blocks_ = blocks;
  narrow_blocks_ = narrow_blocks;
  n_pes_ = pes;
  symmetric_bytes_ = total;
  zero_copy_min_bytes_ = min_bytes;
  low_latency_max_bytes_ = ll_max_bytes;
  // Only the sender decides (its receiver's recv is a zero-copy recv either way): no vote.
  copy_engine_min_bytes_ = copy_engine_min_bytes;
  PDC_CHECK_CUDA(cudaDeviceSynchronize());
  clear_size_mismatch();  // about channels that no longer exist
  // Zero-copy's host side: the table the send kernels read (host-mapped: the importer updates
  // it from the host at any time, with no stream to order it on, and a captured graph reads the
  // live entry at each replay), and a mailbox per load/store peer. A mailbox that cannot be
  // made only keeps that peer's messages staged.
  auto state = std::make_unique<ZeroCopyState>(&order_, pes);
  // Its senders connect to this listener from their first recv into expandable memory, after the
  // barriers below (a listener that cannot open keeps that memory staged).
  state->open_fd_channel(job, fd_key, my_pe(), device);
  // Zeroed host-mapped words: the host's address in `host`, the kernels' in `device`.
  const auto mapped_words = [](std::size_t words, uint64_t*& host, uint64_t*& device) {
    PDC_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host), words * sizeof(uint64_t), cudaHostAllocMapped));
    std::memset(host, 0, words * sizeof(uint64_t));
    PDC_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0));
  };
  mapped_words(static_cast<std::size_t>(pes) * zero_copy::kTableEntries, state->table_host, state->table_device);
  mapped_words(static_cast<std::size_t>(pes), state->ce_last_target_host, state->ce_last_target_device);
  PDC_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&state->ce_state), pes * sizeof(unsigned int)));
  PDC_CHECK_CUDA(cudaMemset(state->ce_state, 0, pes * sizeof(unsigned int)));
  state->ce_graphs.resize(static_cast<std::size_t>(pes));
  const int me = my_pe();
  auto table_of = [&state](int peer) {
    return state->table_host + static_cast<std::size_t>(peer) * zero_copy::kTableEntries;
  };
  for (int peer = 0; peer < pes; ++peer) {
    zero_copy::Mailbox* incoming = nullptr;
    if (peer != me && min_bytes != 0 && nvshmem_ptr(base_, peer) != nullptr) {
      const std::string name = zero_copy::mailbox_name(job, me, peer);
      incoming = zero_copy::create_mailbox(name);
      if (incoming != nullptr) state->created.push_back(incoming), state->names.push_back(name);
    }
    state->exporters.push_back(std::make_unique<zero_copy::Exporter>(*state, incoming, peer));
    // Without a mailbox until every PE made its own (after the barrier below).
    state->importers.push_back(std::make_unique<zero_copy::Importer>(*state, nullptr, peer, table_of(peer)));
  }
  ZeroCopyState* zc = state.get();
  zero_copy_ = std::move(state);
  // Nobody signals into memory a peer has not zeroed yet, nor opens a mailbox not made yet.
  barrier_all_blocking("SendRecvEngine.init", default_timeout_seconds());
  for (int peer = 0; peer < pes; ++peer) {
    if (peer == me || min_bytes == 0 || nvshmem_ptr(base_, peer) == nullptr) continue;
    zero_copy::Mailbox* outgoing = zero_copy::open_mailbox(zero_copy::mailbox_name(job, peer, me));
    if (outgoing == nullptr) continue;  // another container, no /dev/shm: that peer stays staged
    zc->opened.push_back(outgoing);
    zc->importers[peer] = std::make_unique<zero_copy::Importer>(
        *zc, outgoing, peer, zc->table_host + static_cast<std::size_t>(peer) * zero_copy::kTableEntries);
  }
  // Every PE has opened what it needs: the names go, so that nothing is left if a process dies.
  barrier_all_blocking("SendRecvEngine.init", default_timeout_seconds());
  for (const std::string& name : zero_copy_->names) zero_copy::unlink_mailbox(name);
  zero_copy_->names.clear();
}

SendRecvEngine::SendRecvEngine() = default;
// Stops the progress thread first (it calls this engine); never collective.
SendRecvEngine::~SendRecvEngine() { zero_copy_progress_.reset(); }

void SendRecvEngine::agree_zero_copy_min_bytes(std::size_t bytes) { agree_zero_copy_min_bytes(bytes, ""); }

namespace {
// A threshold both sides of a message decide by: its variable, and what it decides.
struct SharedThreshold {
  const char* variable;
  const char* what;
  const char* decides;
  std::size_t most;
};
constexpr SharedThreshold kZeroCopyThreshold{"PYDATACOPY_ZERO_COPY_MIN_BYTES", "the zero-copy threshold",
                                             "whether it moves zero-copy", ~std::size_t{0} - 1};
constexpr SharedThreshold kLowLatencyCut{"PYDATACOPY_LOW_LATENCY_MAX_BYTES", "the low-latency cut",
                                         "whether it moves by the low-latency protocol",
                                         static_cast<std::size_t>(settings::kLowLatencyCapacityBytes)};

// Collective: every PE votes its value (`unreadable`: this PE could not read its variable, voted
// as `unreadable_vote`); every PE then refuses alike unless all are readable, equal and in range.
void agree_threshold(const SharedThreshold& t, std::size_t bytes, const std::string& unreadable,
                     std::size_t unreadable_vote) {
  const std::vector<uint64_t> votes = barrier_all_blocking(
      (std::string(t.what) + " (collective: every PE must set it, to the same value)").c_str(),
      default_timeout_seconds(), static_cast<uint64_t>(bytes));
  for (std::size_t pe = 0; pe < votes.size(); ++pe) {
    PDC_REQUIRE(!(static_cast<int>(pe) == my_pe() && !unreadable.empty()),
                unreadable << " (every PE refuses: nothing was set up)");
    PDC_REQUIRE(votes[pe] != unreadable_vote,
                "PE " << pe << " could not read its " << t.variable << " (its error says "
                "why): every PE refuses, nothing was set up; set the same valid value on every PE");
  }
  for (std::size_t pe = 0; pe < votes.size(); ++pe) {
    PDC_REQUIRE(votes[pe] == bytes,
                t.what << " differs between PEs: PE " << pe << " has " << votes[pe] << " bytes and this PE "
                       << bytes << " (" << t.variable << ", or the setter): both sides of a message must "
                       "decide alike " << t.decides << ". Set the same value on every PE; nothing was changed");
    PDC_REQUIRE(votes[pe] <= t.most, t.what << " of " << votes[pe] << " bytes is over its most, " << t.most
                                             << " (" << t.variable << "); nothing was changed on any PE");
  }
}
}  // namespace

void SendRecvEngine::agree_zero_copy_min_bytes(std::size_t bytes, const std::string& unreadable) {
  agree_threshold(kZeroCopyThreshold, bytes, unreadable, kUnreadableThreshold);
}

void SendRecvEngine::agree_low_latency_max_bytes(std::size_t bytes, const std::string& unreadable) {
  agree_threshold(kLowLatencyCut, bytes, unreadable, kUnreadableThreshold);
}

void* SendRecvEngine::peer_address(const void* local, int peer) const {
  // As peer_pointer (null under PYDATACOPY_FORCE_RMA, read per call: tests switch it at run time).
  if (rma_forced() || peer < 0 || static_cast<std::size_t>(peer) >= peer_bases_.size() || peer_bases_[peer] == nullptr)
    return nullptr;
  return peer_bases_[peer] + (static_cast<const uint8_t*>(local) - base_);
}

bool SendRecvEngine::low_latency_peer(int peer) const {
  // A PE's messages to itself stay staged, as zero-copy's (a send and its recv may be in two launches).
  return peer != my_pe() && peer_address(base_, peer) != nullptr;
}

bool SendRecvEngine::moves_low_latency(int peer, std::size_t bytes) const {
  const bool zero_copy = load_store_peer(peer) && bytes >= zero_copy_min_bytes_;  // zero-copy wins where both apply
  return bytes <= low_latency_max_bytes_ && low_latency_max_bytes_ > 0 && !zero_copy && low_latency_peer(peer);
}

bool SendRecvEngine::load_store_peer(int peer) const {
  // peer_pointer is null for another node and under PYDATACOPY_FORCE_RMA; a PE's messages to
  // itself stay staged (a send and its recv may be in two launches).
  return zero_copy_min_bytes_ > 0 && peer != my_pe() && zero_copy_ != nullptr &&
         peer_address(base_, peer) != nullptr;
}

void SendRecvEngine::service_zero_copy_locked() {
  if (zero_copy_ == nullptr) return;
  for (int peer = 0; peer < n_pes_; ++peer) {
    zero_copy_->importers[peer]->drain();
    zero_copy_->exporters[peer]->poll();
  }
}

bool SendRecvEngine::serve_zero_copy_progress() {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || zero_copy_ == nullptr) return false;
  // What moved: handles opened, refused, unmapped or closed here; answers read from the peers.
  const auto activity = [this] {
    uint64_t sum = 0;
    for (int peer = 0; peer < n_pes_; ++peer) {
      const auto& in = zero_copy_->importers[peer]->stats();
      const auto& out = zero_copy_->exporters[peer]->stats();
      sum += in.opened + in.open_failed + in.unmapped + in.closed + out.acked + out.refused;
      sum += in.chunks_mapped + in.chunk_failed + in.chunks_unmapped + out.chunks_acked + out.chunks_dropped +
             out.stale_dropped;
    }
    return sum;
  };
  const uint64_t before = activity();
  service_zero_copy_locked();
  // Memory given back since (torch's empty_cache): let go of its mappings now, so that the senders
  // close theirs and it returns to the driver, not at this PE's next new mapping.
  const auto now = std::chrono::steady_clock::now();
  for (int peer = 0; peer < n_pes_; ++peer) zero_copy_->exporters[peer]->sweep_if_due(now);
  return activity() != before;
}

void SendRecvEngine::set_phase_stamps(bool on) { kernels::set_phase_stamps(on); }

void SendRecvEngine::set_zero_copy_fallback_waits(double held_seconds, double long_seconds) {
  PDC_REQUIRE(held_seconds >= 0 && long_seconds >= 0 && held_seconds <= 3600 && long_seconds <= 3600,
              "set_zero_copy_fallback_waits: " << held_seconds << " s and " << long_seconds
                                               << " s: each must lie in [0, 3600] seconds");
  kernels::set_zero_copy_fallback_waits(static_cast<uint64_t>(held_seconds * 1e9),
                                        static_cast<uint64_t>(long_seconds * 1e9));
}

std::vector<std::string> SendRecvEngine::phase_stamp_names() {
  return std::vector<std::string>(kernels::kPhaseStampNames, kernels::kPhaseStampNames + kernels::kPhaseStamps);
}

std::vector<std::vector<uint64_t>> SendRecvEngine::phase_stamps() {
  std::vector<std::vector<uint64_t>> rows;
  for (const kernels::PhaseStampRecord& record : kernels::read_phase_stamps()) {
    std::vector<uint64_t> row(record.at, record.at + kernels::kPhaseStamps);
    row.push_back(static_cast<uint64_t>(record.mode));
    row.push_back(static_cast<uint64_t>(record.is_send));
    rows.push_back(std::move(row));
  }
  return rows;
}

std::vector<SendRecvEngine::PeerStats> SendRecvEngine::peer_stats_locked() {
  PDC_REQUIRE(base_ != nullptr, "stats: the send/recv engine is not set up");
  // In device memory (a host-mapped atomic at the end of every launch cost a PCIe round trip),
  // [peer][kZeroCopyCounters].
  const uint64_t* device_counts =
      refusal_poll_.read(zc_counts_, static_cast<std::size_t>(n_pes_) * kernels::kZeroCopyCounters);
  std::vector<PeerStats> out;
  for (int peer = 0; peer < n_pes_; ++peer) {
    const uint64_t* c = device_counts + static_cast<std::size_t>(peer) * kernels::kZeroCopyCounters;
    PeerStats s;
    s.peer = peer;
    s.send_one_copy = c[kernels::kSendZeroCopy], s.send_staged = c[kernels::kSendStaged];
    s.send_low_latency = c[kernels::kSendLowLatency];
    s.send_copy_engine = c[kernels::kSendCopyEngine];
    s.recv_one_copy = c[kernels::kRecvZeroCopy], s.recv_staged = c[kernels::kRecvStaged];
    s.recv_low_latency = c[kernels::kRecvLowLatency];
    const auto& x = zero_copy_->exporters[peer]->stats();
    const auto& y = zero_copy_->importers[peer]->stats();
    s.map_requests = x.requests + x.chunk_requests, s.not_exportable = x.not_exportable, s.refused = x.refused;
    s.mapped_here = y.opened + y.chunks_mapped;
    out.push_back(s);
  }
  return out;
}

std::vector<uint64_t> SendRecvEngine::zero_copy_counters_locked() {
  PDC_REQUIRE(base_ != nullptr, "zero_copy_counters: the send/recv engine is not set up");
  const uint64_t* device_counts =
      refusal_poll_.read(zc_counts_, static_cast<std::size_t>(n_pes_) * kernels::kZeroCopyCounters);
  std::vector<uint64_t> out(kernels::kZeroCopyCounters, 0);  // every peer's, summed
  for (int peer = 0; peer < n_pes_; ++peer)
    for (int i = 0; i < kernels::kZeroCopyCounters; ++i)
      out[i] += device_counts[static_cast<std::size_t>(peer) * kernels::kZeroCopyCounters + i];
  zero_copy::Exporter::Stats e;
  zero_copy::Importer::Stats m;
  for (int peer = 0; peer < n_pes_; ++peer) {
    const auto& x = zero_copy_->exporters[peer]->stats();
    const auto& y = zero_copy_->importers[peer]->stats();
    e.requests += x.requests, e.acked += x.acked, e.refused += x.refused;
    e.not_exportable += x.not_exportable, e.stale_dropped += x.stale_dropped, e.evicted += x.evicted;
    e.chunk_requests += x.chunk_requests, e.chunks_acked += x.chunks_acked, e.chunks_dropped += x.chunks_dropped;
    m.opened += y.opened, m.closed += y.closed;
    m.chunks_mapped += y.chunks_mapped, m.chunk_failed += y.chunk_failed, m.chunks_unmapped += y.chunks_unmapped;
  }
  for (uint64_t v : {e.requests, e.acked, e.refused, e.not_exportable, e.stale_dropped, e.evicted, m.opened, m.closed,
                     e.chunk_requests, e.chunks_acked, e.chunks_dropped, m.chunks_mapped, m.chunk_failed,
                     m.chunks_unmapped})
    out.push_back(v);
  return out;
}

SendRecvEngine::SendRecvEngine(SendRecvEngine&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mutex_);
  swap_state(other);
}

void SendRecvEngine::swap_state(SendRecvEngine& other) noexcept {
  using std::swap;
  swap(zero_copy_progress_wanted_, other.zero_copy_progress_wanted_);
  swap(base_, other.base_);
  swap(peer_bases_, other.peer_bases_);
  swap(chunk_bytes_, other.chunk_bytes_);
  swap(page_bytes_, other.page_bytes_);
  swap(symmetric_bytes_, other.symmetric_bytes_);
  swap(num_chunks_, other.num_chunks_);
  swap(blocks_, other.blocks_);
  swap(narrow_blocks_, other.narrow_blocks_);
  swap(n_pes_, other.n_pes_);
  swap(sequences_, other.sequences_);
  swap(progress_, other.progress_);
  swap(filled_, other.filled_);
  swap(failed_, other.failed_);
  swap(resident_blocks_, other.resident_blocks_);
  swap(order_, other.order_);
  swap(done_, other.done_);
  swap(refusal_poll_, other.refusal_poll_);
  swap(sends_launched_, other.sends_launched_);
  swap(messages_, other.messages_);
  swap(zc_resolved_, other.zc_resolved_);
  swap(zc_counts_, other.zc_counts_);
  swap(zero_copy_min_bytes_, other.zero_copy_min_bytes_);
  swap(low_latency_max_bytes_, other.low_latency_max_bytes_);
  swap(copy_engine_min_bytes_, other.copy_engine_min_bytes_);
  swap(ll_filled_, other.ll_filled_);
  swap(zero_copy_, other.zero_copy_);
  // The backend asks the engine's own channel events.
  if (zero_copy_ != nullptr) zero_copy_->order_ = &order_;
  if (other.zero_copy_ != nullptr) other.zero_copy_->order_ = &other.order_;
}

SendRecvEngine SendRecvEngine::detach() noexcept {
  SendRecvEngine state;
  swap_state(state);
  return state;
}

void SendRecvEngine::release() {
  if (base_ == nullptr) return;
  require_initialized("SendRecvEngine.cleanup");
  // symmetric_free settles every PE (bounded barrier) first: peers may still write into staging.
  uint8_t* base = base_;
  base_ = nullptr;
  std::unique_ptr<ZeroCopyState> zero_copy = std::move(zero_copy_);
  symmetric_free(base);  // synchronises the device first: no kernel still uses the counters
  if (sequences_ != nullptr) PDC_CHECK_CUDA(cudaFree(sequences_));
  sequences_ = progress_ = filled_ = messages_ = zc_resolved_ = zc_counts_ = ll_filled_ = nullptr;
  done_ = failed_ = nullptr;
  if (zero_copy != nullptr) {
    // No kernel runs any more (symmetric_free synchronised the device, or a peer died and
    // its transfers were given up): the peers' allocations close here.
    for (auto& importer : zero_copy->importers) importer->close_all();
    if (zero_copy->table_host != nullptr) cudaFreeHost(zero_copy->table_host);
    zero_copy->ce_graphs.clear();
    if (zero_copy->ce_last_target_host != nullptr) cudaFreeHost(zero_copy->ce_last_target_host);
    if (zero_copy->ce_state != nullptr) cudaFree(zero_copy->ce_state);
  }
  order_ = ChannelOrder();  // local events; nothing depends on them
  refusal_poll_ = RefusalPoll();  // local: a copy and a stream that nothing else uses
  sends_launched_ = false;
}

RefusalPoll::RefusalPoll(std::size_t words) : words_(words) {
  PDC_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), words * sizeof(uint64_t), cudaHostAllocDefault));
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess) {
    cudaFreeHost(host_);
    host_ = nullptr;
    PDC_CHECK_CUDA(e);
  }
}

RefusalPoll::~RefusalPoll() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);  // local; errors change nothing here
  if (host_ != nullptr) cudaFreeHost(host_);
}

RefusalPoll& RefusalPoll::operator=(RefusalPoll&& other) noexcept {
  if (this != &other) {
    this->~RefusalPoll();
    host_ = std::exchange(other.host_, nullptr);
    stream_ = std::exchange(other.stream_, nullptr);
    words_ = std::exchange(other.words_, 0);
  }
  return *this;
}

const uint64_t* RefusalPoll::read(const uint64_t* device_words, std::size_t words) {
  PDC_REQUIRE(words <= words_, "RefusalPoll::read: " << words << " words asked of a buffer of " << words_);
  RelaxedCaptureMode relaxed;  // a capture running in global mode on another stream stays valid
  PDC_CHECK_CUDA(cudaMemcpyAsync(host_, device_words, words * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream_));
  PDC_CHECK_CUDA(cudaStreamSynchronize(stream_));
  return host_;
}

void SendRecvEngine::check_refusals_locked() {
  if (base_ == nullptr || !sends_launched_) return;
  // [send words][recv words][refused sizes], each n_pes long (the symmetric layout).
  const uint64_t* words = refusal_poll_.read(broken(true, 0), 3 * static_cast<std::size_t>(n_pes_));
  for (int peer = 0; peer < n_pes_; ++peer) {
    const uint64_t word = words[peer], sender_bytes = words[2 * n_pes_ + peer];
    if (word == 0 || send_refusal_recorded(peer)) continue;  // none, or a device record will tell
    if (!claim_send_refusal_report(peer)) continue;           // told already
    std::ostringstream text;
    text << "send from PE " << my_pe() << " to PE " << peer << ": the receiver expected " << word - 1
         << " bytes";
    if (sender_bytes != 0 && sender_bytes == word)
      text << " for another message than this PE's of " << sender_bytes - 1 << " bytes (one between "
           << "them took another path, low-latency or zero-copy: the two sides' sizes differ for it)";
    else if (sender_bytes != 0)
      text << " for a message of " << sender_bytes - 1 << " bytes from this PE";
    text << " (found by the receiver after this PE's send had completed). Both sides must move the "
            "same number of bytes, in the same order, per pair of PEs. Nothing more was delivered on "
            "this channel, and every later send on it is refused and raises: call "
            "pydatacopy.setup_send_recv() on every PE to rebuild the channels.";
    throw Error(text.str());
  }
}

uint8_t* SendRecvEngine::staging(int src_pe) const {
  return base_ + static_cast<std::size_t>(src_pe) * num_chunks_ * chunk_bytes_;
}

uint64_t* SendRecvEngine::arrivals(int src_pe) const {
  return reinterpret_cast<uint64_t*>(base_ + staging_array_bytes(n_pes_, num_chunks_, chunk_bytes_)) +
         static_cast<std::size_t>(src_pe) * num_chunks_ * pages();
}

uint64_t* SendRecvEngine::credits(int dst_pe) const {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(arrivals(0)) +
                                     signal_array_bytes(n_pes_, num_chunks_, pages())) +
         static_cast<std::size_t>(dst_pe) * num_chunks_ * pages();
}

kernels::SlotHeader* SendRecvEngine::headers(int src_pe) const {
  return reinterpret_cast<kernels::SlotHeader*>(reinterpret_cast<uint8_t*>(credits(0)) +
                                                signal_array_bytes(n_pes_, num_chunks_, pages())) +
         static_cast<std::size_t>(src_pe) * num_chunks_ * pages();
}

kernels::SlotHeader* SendRecvEngine::outgoing_headers(int dst_pe) const {
  return reinterpret_cast<kernels::SlotHeader*>(reinterpret_cast<uint8_t*>(headers(0)) +
                                                header_array_bytes(n_pes_, num_chunks_, pages())) +
         static_cast<std::size_t>(dst_pe) * num_chunks_ * pages();
}

uint64_t* SendRecvEngine::broken(bool send, int peer) const {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(outgoing_headers(0)) +
                                     header_array_bytes(n_pes_, num_chunks_, pages())) +
         (send ? 0 : n_pes_) + peer;
}

uint64_t* SendRecvEngine::refused_bytes(int dst_pe) const { return broken(true, 0) + 2 * n_pes_ + dst_pe; }
unsigned int* SendRecvEngine::activity_word() const {
  return reinterpret_cast<unsigned int*>(broken(true, 0) + 3 * n_pes_);
}
kernels::RendezvousDescriptor* SendRecvEngine::rendezvous_ring(int receiver) const {
  return reinterpret_cast<kernels::RendezvousDescriptor*>(reinterpret_cast<uint8_t*>(broken(true, 0)) +
                                                          broken_array_bytes(n_pes_)) +
         static_cast<std::size_t>(receiver) * kernels::kRendezvousRing;
}

uint64_t* SendRecvEngine::zero_copy_done(int sender) const {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(rendezvous_ring(0)) + ring_array_bytes(n_pes_)) +
         static_cast<std::size_t>(sender) * blocks_;
}

uint64_t* SendRecvEngine::ll_lines(int src_pe) const {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(zero_copy_done(0)) + done_array_bytes(n_pes_, blocks_)) +
         static_cast<std::size_t>(src_pe) * kernels::kLowLatencySlots * kernels::kLowLatencySlotStride;
}

uint64_t* SendRecvEngine::ll_credits(int dst_pe) const {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(ll_lines(0)) + ll_ring_array_bytes(n_pes_)) + dst_pe;
}

void SendRecvEngine::require_ready(const char* what, int pe) const {
  require_valid_pe(pe, what);
  PDC_REQUIRE(base_ != nullptr, what << ": the send/recv engine is not set up (pydatacopy.init() "
                                        "does it; from C++ call SendRecvEngine::init)");
}

}  // namespace pydatacopy
