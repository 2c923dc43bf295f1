#include "pydatacopy/all_to_all.hpp"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <climits>
#include <sstream>
#include <string>
#include <utility>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

// ---- layout -----------------------------------------------------------------------------------

int64_t AllToAllLayout::field_start(int64_t capacity, const int64_t* row_bytes, int f) {
  int64_t start = 0;
  for (int g = 0; g < f; ++g) start = align_up(start + capacity * row_bytes[g], 16);
  return start;
}

int64_t AllToAllLayout::region_bytes() const {
  // The fields' rows, and up to 15 bytes of padding after each field but the last.
  return align_up(capacity * max_row_bytes + 16 * (kMaxFields - 1), kAlignment);
}

int64_t AllToAllLayout::words_bytes() const {
  return align_up(2 * static_cast<int64_t>(n_pes) * static_cast<int64_t>(sizeof(uint64_t)), kAlignment);
}

void AllToAllLayout::check(int64_t capacity, int64_t max_row_bytes, int n_pes) {
  PDC_REQUIRE(capacity > 0 && capacity <= kMaxCapacity,
              "capacity (rows per source PE and call) must be in [1, " << kMaxCapacity << "], got "
                                                                        << capacity);
  PDC_REQUIRE(max_row_bytes > 0 && max_row_bytes <= kMaxRowBytes,
              "max_row_bytes must be in [1, " << kMaxRowBytes << "] (bytes of one row, all fields), got "
                                              << max_row_bytes);
  PDC_REQUIRE(n_pes >= 1 && n_pes <= kMaxPes,
              "the all-to-all supports 1 to " << kMaxPes << " PEs, this job has " << n_pes);
  // Two sets of n_pes regions: keep the product far from overflowing (and say what it is).
  PDC_REQUIRE(capacity <= (int64_t{1} << 46) / max_row_bytes / n_pes,
              "capacity x max_row_bytes x n_pes = " << capacity << " x " << max_row_bytes << " x "
                  << n_pes << " bytes per receive set is larger than 64 TiB; use a smaller capacity");
}

// ---- AllToAll -----------------------------------------------------------------------------------

AllToAll::~AllToAll() {
  // Local releases only (the symmetric memory needs every PE: cleanup()).
  if (peer_bases_ != nullptr) cudaFree(peer_bases_);
  if (counters_ != nullptr) cudaFree(counters_);
}

std::size_t AllToAll::symmetric_bytes_needed(int64_t capacity, int64_t max_row_bytes, int n_pes) {
  AllToAllLayout::check(capacity, max_row_bytes, n_pes);
  return static_cast<std::size_t>(AllToAllLayout(capacity, max_row_bytes, n_pes).total());
}

std::size_t AllToAll::symmetric_bytes() const {
  return base_ == nullptr ? 0 : symmetric_bytes_needed(capacity_, max_row_bytes_, n_pes_);
}

void AllToAll::require_initialized(const char* what) const {
  pydatacopy::require_initialized(what);
  PDC_REQUIRE(base_ != nullptr,
              what << ": the all-to-all buffer is not set up (call init(capacity, max_row_bytes) "
                      "first, or it was cleaned up)");
}

void AllToAll::init(int64_t capacity, int64_t max_row_bytes) {
  pydatacopy::require_initialized("AllToAll.init");
  PDC_REQUIRE(base_ == nullptr, "AllToAll.init: already initialised; call cleanup() first");
  const int pes = n_pes();
  AllToAllLayout::check(capacity, max_row_bytes, pes);
  const AllToAllLayout layout(capacity, max_row_bytes, pes);
  // Every PE must set up the same buffer: a receiver trusts a sender's rows to fit its regions
  // (two PEs with other capacities but the same product would allocate alike and then overrun).
  // Voted before anything is allocated, so that a refusal leaves nothing to undo on any PE.
  const uint64_t mine = (static_cast<uint64_t>(capacity) * 1000003u) ^ static_cast<uint64_t>(max_row_bytes);
  const std::vector<uint64_t> votes =
      barrier_all_blocking("AllToAll.init (collective: every PE must set up the buffer)", default_timeout_seconds(), mine);
  for (std::size_t pe = 0; pe < votes.size(); ++pe)
    PDC_REQUIRE(votes[pe] == mine, "AllToAll.init: PE " << pe << " set up its buffer with another capacity or "
                                   "max_row_bytes than this PE (capacity=" << capacity << ", max_row_bytes="
                                   << max_row_bytes << "); every PE must pass the same. Nothing was allocated on any PE");
  // Local resources first, so that nothing collective needs undoing when they fail.
  ChannelOrder order(1);
  const std::size_t counter_bytes = (2 + 4 * static_cast<std::size_t>(pes)) * sizeof(uint64_t) +
                                    4 * sizeof(unsigned int);
  void* counters = nullptr;
  PDC_CHECK_CUDA(cudaMalloc(&counters, counter_bytes));
  void* peer_bases = nullptr;
  if (cudaMalloc(&peer_bases, pes * sizeof(uint8_t*)) != cudaSuccess) {
    cudaFree(counters);
    PDC_REQUIRE(false, "AllToAll.init: cudaMalloc of " << pes * sizeof(uint8_t*) << " bytes failed");
  }
  void* base = nullptr;
  try {
    PDC_CHECK_CUDA(cudaMemset(counters, 0, counter_bytes));
    base = symmetric_malloc(static_cast<std::size_t>(layout.total()));  // collective
    // Zeroed signals and counters mean "nothing yet"; the barrier below keeps peers from
    // writing before.
    PDC_CHECK_CUDA(cudaMemset(base, 0, static_cast<std::size_t>(layout.total())));
    // The direct path's addresses, asked once (nvshmem_ptr itself, not peer_pointer: whether
    // PYDATACOPY_FORCE_RMA holds is asked at every call).
    std::vector<uint8_t*> bases(static_cast<std::size_t>(pes));
    bool every_direct = true;
    for (int pe = 0; pe < pes; ++pe) {
      bases[pe] = static_cast<uint8_t*>(nvshmem_ptr(base, pe));
      every_direct = every_direct && bases[pe] != nullptr;
    }
    PDC_CHECK_CUDA(cudaMemcpy(peer_bases, bases.data(), pes * sizeof(uint8_t*), cudaMemcpyHostToDevice));
    PDC_CHECK_CUDA(cudaDeviceSynchronize());
    barrier_all_blocking("AllToAll.init", default_timeout_seconds());
    every_peer_direct_ = every_direct;
  } catch (...) {
    // A failure after the allocation leaves it to NVSHMEM's teardown: freeing is collective,
    // and the peers may not be here.
    cudaFree(counters);
    cudaFree(peer_bases);
    throw;
  }
  base_ = static_cast<uint8_t*>(base);
  peer_bases_ = static_cast<uint8_t**>(peer_bases);
  counters_ = static_cast<uint64_t*>(counters);
  done_ = reinterpret_cast<unsigned int*>(counters_ + 2 + 4 * pes);
  order_ = std::move(order);
  capacity_ = capacity;
  max_row_bytes_ = max_row_bytes;
  n_pes_ = pes;
  calls_ = 0;
  last_call_ = -1;
  release_owed_[0] = release_owed_[1] = false;
  owed_capture_[0] = owed_capture_[1] = 0;
}

void AllToAll::cleanup() {
  if (base_ == nullptr) return;
  pydatacopy::require_initialized("AllToAll.cleanup");
  uint8_t* base = base_;
  base_ = nullptr;
  capacity_ = max_row_bytes_ = calls_ = 0;
  last_call_ = -1;
  release_owed_[0] = release_owed_[1] = false;
  owed_capture_[0] = owed_capture_[1] = 0;
  n_pes_ = 0;
  // Settles every PE (bounded barrier) before freeing, after this device's work is done: peers
  // may still be writing into our regions until then.
  symmetric_free(base);
  cudaFree(peer_bases_);  // local; a failure here changes nothing later calls depend on
  cudaFree(counters_);
  peer_bases_ = nullptr;
  counters_ = nullptr;
  done_ = nullptr;
  order_ = ChannelOrder();
}

namespace {
// The first refusal of a call: its reason (AllToAllRefusal) and text; later ones are not kept.
struct Refusal {
  int reason = 0;
  std::string text;
  void add(int why, const std::string& what) {
    if (reason == 0) {
      reason = why;
      text = what;
    }
  }
};
#define PDC_REFUSE_UNLESS(refusal, condition, why, message) \
  do {                                                      \
    if (!(condition)) {                                     \
      std::ostringstream pdc_text_;                         \
      pdc_text_ << message;                                 \
      (refusal).add(why, pdc_text_.str());                  \
    }                                                       \
  } while (0)
}  // namespace

bool AllToAll::owed(int set, unsigned long long capture) const {
  return release_owed_[set] && (owed_capture_[set] == 0 || owed_capture_[set] == capture);
}

int64_t AllToAll::exchange(const std::vector<AllToAllField>& fields, const int64_t* send_counts,
                           const int64_t* send_index, int64_t index_rows, int64_t* recv_counts,
                           int64_t* recv_offsets, cudaStream_t stream, double timeout_seconds,
                           AllToAllRegion* region, uint64_t tag, bool compact,
                           const AllToAllSummedRows* summed) {
  const std::lock_guard<std::mutex> lock(mutex_);
  // Host-only refusals: no round can run without the buffer, nor with a peer presumed dead
  // (check_timeouts refuses every collective; the peers' own calls refuse or time out alike).
  require_initialized("all_to_all");
  check_timeouts();
  check_compact(compact);
  // Everything below is this PE's own arguments or state, which its peers cannot see: a refusal
  // still runs the round (refuse mode), so that the peers' calls complete and learn of it.
  Refusal refusal;
  const int count = static_cast<int>(fields.size());
  PDC_REFUSE_UNLESS(refusal, count >= 1 && count <= AllToAllLayout::kMaxFields, kRefusedArguments,
                    "all_to_all: 1 to " << AllToAllLayout::kMaxFields << " fields per call, got " << count);
  PDC_REFUSE_UNLESS(refusal, send_counts != nullptr && recv_counts != nullptr && recv_offsets != nullptr,
                    kRefusedArguments, "all_to_all: send_counts, recv_counts and recv_offsets must be device tensors");
  PDC_REFUSE_UNLESS(refusal, send_index == nullptr ? index_rows == 0 : index_rows >= 0, kRefusedArguments,
                    "all_to_all: index_rows must be 0 without an index and >= 0 with one, got " << index_rows);
  const int64_t send_rows = count >= 1 ? fields[0].send_rows : 0;
  // (The send kernel's offsets saturate at the send rows: a row count, never negative.)
  PDC_REFUSE_UNLESS(refusal, send_rows >= 0, kRefusedArguments,
                    "all_to_all: send tensors must have at least 0 rows, got " << send_rows);
  int64_t total_width = 0;
  for (int f = 0; f < count && f < AllToAllLayout::kMaxFields; ++f) {
    const AllToAllField& field = fields[f];
    PDC_REFUSE_UNLESS(refusal, field.row_bytes > 0, kRefusedArguments,
                      "all_to_all: field " << f << " has rows of " << field.row_bytes
                                           << " bytes; rows must be at least 1 byte");
    PDC_REFUSE_UNLESS(refusal, field.send_rows == send_rows, kRefusedArguments,
                      "all_to_all: every field must have the same number of send rows (field 0: "
                          << send_rows << ", field " << f << ": " << field.send_rows << ")");
    PDC_REFUSE_UNLESS(refusal, !compact || field.recv == nullptr, kRefusedArguments,
                      "all_to_all: a compact call leaves every field in the receive region; field " << f
                          << " has a receive tensor");
    PDC_REFUSE_UNLESS(refusal, field.recv == nullptr || field.recv_rows >= n_pes_ * capacity_, kRefusedArguments,
                      "all_to_all: field " << f << "'s receive tensor has " << field.recv_rows
                          << " rows; it needs n_pes x capacity = " << n_pes_ << " x " << capacity_ << " = "
                          << n_pes_ * capacity_);
    PDC_REFUSE_UNLESS(refusal, field.send != nullptr || send_rows == 0 || (summed != nullptr && f == 0),
                      kRefusedArguments, "all_to_all: field " << f << " has no send tensor");
    // (Each width clamped: four of them cannot overflow the sum, and any clamped one is refused.)
    total_width += std::min(std::max<int64_t>(field.row_bytes, 0), AllToAllLayout::kMaxRowBytes + 1);
  }
  if (summed != nullptr) {
    const int64_t element = summed->dtype == kReduceFloat32 ? 4 : 2;
    PDC_REFUSE_UNLESS(refusal, count == 1 && send_index == nullptr && !compact && sums_in_send(), kRefusedArguments,
                      "all_to_all: summed rows need a call of one field, no send index, not compact, and every "
                      "peer reached by direct stores (sums_in_send())");
    PDC_REFUSE_UNLESS(refusal, summed->dtype == kReduceFloat32 || summed->dtype == kReduceBfloat16 ||
                                   summed->dtype == kReduceFloat16, kRefusedArguments,
                      "all_to_all: summed rows' dtype code " << summed->dtype
                          << " is not float32 (0), bfloat16 (1) or float16 (2)");
    PDC_REFUSE_UNLESS(refusal, summed->topk >= 1 && summed->row_count >= 0 && count >= 1 &&
                                   fields[0].row_bytes % element == 0 &&
                                   (send_rows == 0 || (summed->slots != nullptr && summed->weights != nullptr)) &&
                                   (summed->row_count == 0 || summed->rows != nullptr), kRefusedArguments,
                      "all_to_all: summed rows need topk >= 1, slots, weights and rows of whole elements ("
                          << element << " bytes), got topk " << summed->topk);
  }
  PDC_REFUSE_UNLESS(refusal, total_width <= max_row_bytes_, kRefusedArguments,
                    "all_to_all: rows of " << total_width << " bytes (all fields) do not fit the "
                        << max_row_bytes_ << " bytes per row fixed at setup; set the buffer up with "
                                             "max_row_bytes >= " << total_width);
  const int set = static_cast<int>(calls_ % 2);
  const unsigned long long capture = capture_id(stream);
  // The sources' sends into this set wait for its previous round's credits: a release owed and
  // never made would make them time out. The refusal hands the region back first (below).
  PDC_REFUSE_UNLESS(refusal, !owed(set, capture), kRefusedRelease,
                    "all_to_all: call " << calls_ - 2 << " on this buffer left rows in its receive region "
                        "and was never released (AllToAll.release); this call was refused on every PE and "
                        "that region handed back to its sources (its rows are no longer valid). Release "
                        "each such call before the call two after it");
  if (refusal.reason == 0 && (rma_forced() || !every_peer_direct_) && send_rows > 0) {
    // Some rows leave through NVSHMEM RMA: their sources must be symmetric or registered. A PE
    // whose tensor cannot be (expandable segments, registration off) refuses: its peers run.
    for (int f = 0; f < count && refusal.reason == 0; ++f) {
      try {
        prepare_rma_local(fields[f].send, static_cast<std::size_t>(send_rows * fields[f].row_bytes),
                          "all_to_all: a send tensor");
      } catch (const TimeoutError&) {
        throw;
      } catch (const Error& error) {
        refusal.add(kRefusedSendTensor, error.what());
      }
    }
  }
  if (refusal.reason != 0) refused_round(refusal.reason, refusal.text, stream, capture, timeout_seconds, compact);
  return launch_round(fields, send_counts, send_index, index_rows, recv_counts, recv_offsets, stream, capture,
                      timeout_seconds, region, tag, 0, compact, summed);
}

bool AllToAll::sums_in_send() const { return every_peer_direct_ && !rma_forced(); }

void AllToAll::refuse(const std::string& why, cudaStream_t stream, double timeout_seconds, bool compact) {
  const std::lock_guard<std::mutex> lock(mutex_);
  require_initialized("all_to_all");
  check_timeouts();
  check_compact(compact);
  refused_round(kRefusedByCaller, why, stream, capture_id(stream), timeout_seconds, compact);
}

void AllToAll::check_compact(bool compact) const {
  // The same on every PE (one buffer's setup): every PE refuses alike, on its host.
  PDC_REQUIRE(!compact || n_pes_ * capacity_ <= AllToAllLayout::kMaxCompactRows,
              "all_to_all: a compact call packs n_pes x capacity = " << n_pes_ << " x " << capacity_
                  << " rows, more than " << AllToAllLayout::kMaxCompactRows
                  << " (32-bit places); set the buffer up with a smaller capacity");
}

void AllToAll::refused_round(int reason, const std::string& why, cudaStream_t stream, unsigned long long capture,
                             double timeout_seconds, bool compact) {
  // A refused round recorded into this PE's graph would reach the peers only if every PE
  // completed and replayed its capture, and this PE's capture ends here with the error; an
  // eager release owed must not be recorded into it either (it would be lost with the graph).
  // So nothing is recorded or changed: the peers' captures of this call cannot be replayed.
  if (capture != 0)
    throw Error(why + " (refused while capturing a CUDA graph: nothing was recorded on this PE; abandon "
                      "this capture on every PE, since the peers' graphs would wait for this PE's rows)");
  const int set = static_cast<int>(calls_ % 2);
  if (owed(set, capture)) release_set(set, stream, capture);  // whatever the refusal's reason
  launch_round({}, nullptr, nullptr, 0, nullptr, nullptr, stream, capture, timeout_seconds, nullptr, 0, reason,
               compact);
  throw Error(why);
}

int64_t AllToAll::launch_round(const std::vector<AllToAllField>& fields, const int64_t* send_counts,
                               const int64_t* send_index, int64_t index_rows, int64_t* recv_counts,
                               int64_t* recv_offsets, cudaStream_t stream, unsigned long long capture,
                               double timeout_seconds, AllToAllRegion* region, uint64_t tag, int refusal,
                               bool compact, const AllToAllSummedRows* summed) {
  const AllToAllLayout layout(capacity_, max_row_bytes_, n_pes_);
  kernels::AllToAllArgs args{};
  // Refuse mode moves no field and reads none of the call's tensors (they may be the reason).
  const int count = refusal != 0 ? 0 : static_cast<int>(fields.size());
  int64_t widths[AllToAllLayout::kMaxFields] = {};
  int64_t total_width = 0;
  bool defer = false;
  for (int f = 0; f < count; ++f) {
    widths[f] = fields[f].row_bytes;
    total_width += fields[f].row_bytes;
    args.send[f] = static_cast<const uint8_t*>(fields[f].send);
    args.recv[f] = static_cast<uint8_t*>(fields[f].recv);
    args.row_bytes[f] = fields[f].row_bytes;
    defer = defer || fields[f].recv == nullptr;
  }
  for (int f = 0; f < count; ++f) args.field_start[f] = AllToAllLayout::field_start(capacity_, widths, f);
  const int set = static_cast<int>(calls_ % 2);
  args.fields = count;
  args.row_bytes_total = total_width;
  args.send_rows = count > 0 ? fields[0].send_rows : 0;
  args.send_counts = refusal != 0 ? nullptr : send_counts;
  args.send_index = refusal != 0 ? nullptr : send_index;
  args.index_rows = refusal != 0 ? 0 : index_rows;
  args.recv_counts = refusal != 0 ? nullptr : recv_counts;
  args.recv_offsets = refusal != 0 ? nullptr : recv_offsets;
  args.refusal = refusal;
  args.tag = tag;
  if (summed != nullptr && count > 0) {  // (refuse mode reads none of the call's tensors)
    args.sum_rows = static_cast<const uint8_t*>(summed->rows);
    args.sum_row_count = summed->row_count;
    args.sum_slots = summed->slots;
    args.sum_weights = summed->weights;
    args.sum_topk = summed->topk;
    args.sum_dtype = summed->dtype;
  }
  args.base = base_;
  args.peer_bases = peer_bases_;
  // A summed call was admitted with every peer direct (sums_in_send(), under this lock): it stays
  // direct should the RMA switch flip since (its send kernel has no RMA path).
  args.direct = summed != nullptr || !rma_forced();
  args.capacity = capacity_;
  args.region_bytes = layout.region_bytes();
  args.regions = layout.regions(set);
  args.meta_signals = layout.meta_signals(set);
  args.metas = layout.metas(set);
  args.arrivals = layout.arrivals(set);
  args.credits = layout.credits(set);
  args.outgoing = layout.outgoing(set);
  args.places = layout.places(set);
  args.compact = compact;
  args.uses = counters_ + set;
  args.consumed = counters_ + 2 + set * n_pes_;
  args.pending = counters_ + 2 + 2 * n_pes_ + set * n_pes_;
  // A compact call's credits wait for the set's next round (its send kernel signals them).
  args.defer_credits = defer || compact;
  args.send_done = done_ + set;
  args.recv_done = done_ + 2 + set;
  args.my_pe = my_pe();
  args.n_pes = n_pes_;
  args.timeout_ns = timeout_nanoseconds(timeout_seconds);
  args.status = detail::device_status();
  if (!args.direct || !every_peer_direct_) {
    // PYDATACOPY_CHECK_RMA checks what the kernels hand NVSHMEM (the send tensors were
    // prepared by exchange()). These are this buffer's own symmetric words, the same on every PE.
    const auto words = static_cast<std::size_t>(n_pes_) * sizeof(uint64_t);
    const auto pairs = static_cast<std::size_t>(n_pes_ * AllToAllLayout::kMetaBytes);
    check_rma_local(base_ + args.outgoing, pairs, "all_to_all: the meta words put from here");
    check_rma_remote(base_ + args.regions, static_cast<std::size_t>(n_pes_ * args.region_bytes),
                     "all_to_all: the receive regions");
    check_rma_remote(base_ + args.metas, pairs, "all_to_all: the meta words");
    check_rma_remote(base_ + args.meta_signals, words, "all_to_all: the meta signals");
    check_rma_remote(base_ + args.arrivals, words, "all_to_all: the arrival counters");
    // (Plain receivers signal places too: a dropped place to a compact source.)
    check_rma_remote(base_ + args.places, words, "all_to_all: the place words");
  }
  check_rma_remote(base_ + args.credits, static_cast<std::size_t>(n_pes_) * sizeof(uint64_t),
                   "all_to_all: the credits");
  // One call at a time per buffer (its device counters), whatever streams they come on.
  order_.order_after_last(0, stream, capture);
  kernels::launch_all_to_all(args, std::max(1, kernels::all_to_all_blocks(pes_sharing_my_gpu())), stream);
  order_.record(0, stream, capture);
  for (int f = 0; f < AllToAllLayout::kMaxFields; ++f) last_field_start_[f] = f < count ? args.field_start[f] : 0;
  release_owed_[set] = defer && !compact;  // (a compact call's: released by the set's next round)
  owed_capture_[set] = capture;
  last_call_ = calls_;
  if (region != nullptr) {  // this call's, read under the lock (in_region() reads the last call's)
    *region = AllToAllRegion{};
    for (int f = 0; f < count; ++f)
      region->field[f] = base_ + args.regions + (compact ? n_pes_ : 1) * args.field_start[f];
    region->stride = compact ? 0 : args.region_bytes;
  }
  return calls_++;
}

const uint8_t* AllToAll::in_region(int field) const {
  require_initialized("all_to_all: in_region");
  PDC_REQUIRE(last_call_ >= 0 && field >= 0 && field < AllToAllLayout::kMaxFields,
              "all_to_all: in_region(" << field << ") needs a call before it and a field in [0, "
                                       << AllToAllLayout::kMaxFields << ")");
  const AllToAllLayout layout(capacity_, max_row_bytes_, n_pes_);
  return base_ + layout.regions(static_cast<int>(last_call_ % 2)) + last_field_start_[field];
}

int64_t AllToAll::region_stride() const {
  require_initialized("all_to_all: region_stride");
  return AllToAllLayout(capacity_, max_row_bytes_, n_pes_).region_bytes();
}

void AllToAll::release(int64_t call, cudaStream_t stream) {
  const std::lock_guard<std::mutex> lock(mutex_);
  require_initialized("all_to_all: release");
  PDC_REQUIRE(call >= 0 && call < calls_ && call >= calls_ - 2,
              "all_to_all: release(" << call << "): only one of the last two calls (" << calls_ - 2
                                     << ", " << calls_ - 1 << ") can be released");
  const int set = static_cast<int>(call % 2);
  const unsigned long long capture = capture_id(stream);
  // A flag left by a capture that never completed is nothing owed here (its round never ran).
  if (owed(set, capture)) release_set(set, stream, capture);
}

void AllToAll::release_set(int set, cudaStream_t stream, unsigned long long capture) {
  const AllToAllLayout layout(capacity_, max_row_bytes_, n_pes_);
  // Ordered like a call of this buffer: after its exchange (and after what the caller put on
  // `stream` since, the readers of the region), before the next call's kernels.
  order_.order_after_last(0, stream, capture);
  kernels::launch_all_to_all_release(counters_ + 2 + 2 * n_pes_ + set * n_pes_,
                                     reinterpret_cast<uint64_t*>(base_ + layout.credits(set)), my_pe(),
                                     n_pes_, stream);
  order_.record(0, stream, capture);
  release_owed_[set] = false;
}

void gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count, int64_t rows,
                 int64_t src_rows, int64_t row_bytes, cudaStream_t stream) {
  PDC_REQUIRE(rows >= 0 && src_rows >= 0 && row_bytes >= 0,
              "gather_rows: negative sizes (rows " << rows << ", src_rows " << src_rows << ", row_bytes "
                                                   << row_bytes << ")");
  PDC_REQUIRE(rows == 0 || (out != nullptr && index != nullptr && count != nullptr),
              "gather_rows: out, index and count must be device tensors");
  // Enough warps to keep the copy at full speed; the kernel strides over the rows in use.
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 7) / 8, 4 * multiprocessor_count()));
  kernels::launch_gather_rows(out, src, index, count, rows, src_rows, row_bytes, std::max(blocks, 1), stream);
}

void zero_rows_past(void* out, int64_t rows, int64_t row_bytes, const int64_t* counts, int n_counts,
                    cudaStream_t stream) {
  PDC_REQUIRE(rows >= 0 && row_bytes >= 0 && n_counts >= 0 && n_counts <= AllToAllLayout::kMaxPes,
              "zero_rows_past: bad sizes (rows " << rows << ", row_bytes " << row_bytes << ", counts " << n_counts
                                                 << ")");
  PDC_REQUIRE(rows == 0 || row_bytes == 0 || (out != nullptr && (counts != nullptr || n_counts == 0)),
              "zero_rows_past: out and counts must be device tensors");
  PDC_REQUIRE(row_bytes == 0 || rows <= (int64_t{1} << 50) / row_bytes, "zero_rows_past: " << rows << " rows of "
                                                                        << row_bytes << " bytes is too large");
  // Enough threads to write at full speed; the kernel strides over what is past the counts.
  const int64_t vectors = (rows * row_bytes + 15) / 16;
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + 255) / 256, 4 * multiprocessor_count()));
  kernels::launch_zero_rows_past(out, rows, row_bytes, counts, n_counts, std::max(blocks, 1), stream);
}

void gather_region_rows(void* out, const void* region, int64_t stride, const int64_t* recv_offsets,
                        const int64_t* recv_counts, int n_sources, const int64_t* index,
                        const int64_t* count, int64_t rows, int64_t row_bytes, cudaStream_t stream) {
  PDC_REQUIRE(rows >= 0 && row_bytes >= 0 && stride >= 0 && n_sources >= 1 && n_sources <= AllToAllLayout::kMaxPes,
              "gather_region_rows: bad sizes (rows " << rows << ", row_bytes " << row_bytes << ", sources "
                                                     << n_sources << ")");
  PDC_REQUIRE(rows == 0 || (out != nullptr && region != nullptr && index != nullptr && count != nullptr &&
                            recv_offsets != nullptr && recv_counts != nullptr),
              "gather_region_rows: every pointer must be a device address");
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 7) / 8, 4 * multiprocessor_count()));
  kernels::launch_gather_region_rows(out, region, stride, recv_offsets, recv_counts, n_sources, index, count,
                                     rows, row_bytes, std::max(blocks, 1), stream);
}

void moe_combine_reduce_region(void* out, const void* region, int64_t stride, const int64_t* pair_pe,
                               const int64_t* pair_rank, const int64_t* back_counts, int n_sources,
                               const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                               int dtype, cudaStream_t stream) {
  PDC_REQUIRE(tokens >= 0 && topk >= 0 && hidden >= 0 && stride >= 0 && n_sources >= 1,
              "moe_combine_reduce_region: negative sizes (tokens " << tokens << ", topk " << topk
                                                                   << ", hidden " << hidden << ")");
  kernels::launch_moe_combine_reduce_region(out, region, stride, pair_pe, pair_rank, back_counts, n_sources,
                                            weights, tokens, topk, hidden, dtype, stream);
}

void moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                        const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                        int dtype, cudaStream_t stream) {
  PDC_REQUIRE(tokens >= 0 && topk >= 0 && hidden >= 0 && row_count >= 0,
              "moe_combine_reduce: negative sizes (tokens " << tokens << ", topk " << topk
                                                            << ", hidden " << hidden << ")");
  kernels::launch_moe_combine_reduce(out, rows, row_count, slots, weights, tokens, topk, hidden,
                                     dtype, stream);
}

namespace {
// A multi-block layout's scratch: there, 4-byte aligned (int32 counts), large enough.
// None given (C++ callers, small inputs): the one-block kernel. One given that does not fit is the
// caller's bug, said here, not hidden behind the slow kernel.
bool scratch_fits(const void* scratch, int64_t scratch_bytes, int64_t needed, const char* what) {
  if (scratch == nullptr) return false;
  PDC_REQUIRE((reinterpret_cast<uintptr_t>(scratch) & 3) == 0 && scratch_bytes >= needed,
              what << ": the scratch given (" << scratch_bytes << " bytes at " << scratch
                   << ") must be 4-byte aligned and hold " << needed
                   << " bytes (the *_scratch_bytes function of the same sizes says how many)");
  return true;
}
// topk bounded where the kernels' loops over a token's k (int counters stepping by a batch)
// cannot wrap: far above any router's.
constexpr int64_t kMoeLayoutMaxTopk = int64_t{1} << 16;
}  // namespace

void moe_dispatch_layout(const void* topk_idx, int id_bytes, int64_t tokens, int64_t topk,
                         int64_t num_experts, int n_pes, int64_t* send_counts, int64_t* send_index,
                         int32_t* meta, int64_t* pair_pe, int64_t* pair_rank, cudaStream_t stream,
                         void* scratch, int64_t scratch_bytes) {
  static_assert(kMoeLayoutMaxPes == kernels::kMoeLayoutMaxPes, "one limit");
  PDC_REQUIRE(n_pes >= 1 && n_pes <= kMoeLayoutMaxPes,
              "moe_dispatch_layout: 1 to " << kMoeLayoutMaxPes << " PEs, got " << n_pes);
  PDC_REQUIRE(id_bytes == 4 || id_bytes == 8, "moe_dispatch_layout: expert ids must be int32 or int64");
  PDC_REQUIRE(num_experts >= n_pes && num_experts % n_pes == 0 && num_experts <= kMoeLayoutMaxPairs,
              "moe_dispatch_layout: num_experts=" << num_experts << " must be a multiple of the "
                                                  << n_pes << " PEs below 2^31");
  PDC_REQUIRE(tokens >= 0 && topk >= 1 && tokens <= kMoeLayoutMaxPairs / topk,
              "moe_dispatch_layout: tokens x topk = " << tokens << " x " << topk
                                                      << " must be below 2^31");
  PDC_REQUIRE(topk <= kMoeLayoutMaxTopk,
              "moe_dispatch_layout: topk " << topk << " is above the " << kMoeLayoutMaxTopk << " supported");
  // (Tensors of no elements may have no address: zero tokens leaves only the counts and index.)
  PDC_REQUIRE(send_counts != nullptr && send_index != nullptr &&
                  (tokens == 0 || (topk_idx != nullptr && meta != nullptr && pair_pe != nullptr &&
                                   pair_rank != nullptr)),
              "moe_dispatch_layout: every tensor must be on the GPU");
  const int64_t large = kernels::moe_dispatch_layout_scratch_bytes(tokens, static_cast<int>(topk), n_pes);
  if (large > 0 && scratch_fits(scratch, scratch_bytes, large, "moe_dispatch_layout")) {
    kernels::launch_moe_dispatch_layout_large(topk_idx, id_bytes == 4, tokens, static_cast<int>(topk),
                                              num_experts, n_pes, send_counts, send_index, meta, pair_pe,
                                              pair_rank, scratch, stream);
    return;
  }
  kernels::launch_moe_dispatch_layout(topk_idx, id_bytes == 4, tokens, static_cast<int>(topk), num_experts,
                                      n_pes, send_counts, send_index, meta, pair_pe, pair_rank, stream);
}

int64_t moe_dispatch_layout_scratch_bytes(int64_t tokens, int64_t topk, int n_pes) {
  // (Sizes the layout refuses need none: moe_dispatch_layout says why.)
  if (n_pes < 1 || n_pes > kMoeLayoutMaxPes || tokens < 0 || topk < 1 || topk > kMoeLayoutMaxTopk ||
      tokens > kMoeLayoutMaxPairs / topk)
    return 0;
  return kernels::moe_dispatch_layout_scratch_bytes(tokens, static_cast<int>(topk), n_pes);
}

void moe_token_destinations(const int64_t* send_counts, const int64_t* send_index, const int64_t* pair_pe,
                            int64_t tokens, int64_t topk, int n_pes, int64_t* token_pe, int64_t* token_rank,
                            cudaStream_t stream) {
  PDC_REQUIRE(n_pes >= 1 && n_pes <= kMoeLayoutMaxPes,
              "moe_token_destinations: 1 to " << kMoeLayoutMaxPes << " PEs, got " << n_pes);
  PDC_REQUIRE(topk >= 1 && topk <= kMoeLayoutMaxTopk && tokens >= 0 && tokens <= kMoeLayoutMaxPairs / n_pes &&
                  tokens <= kMoeLayoutMaxPairs / topk,
              "moe_token_destinations: tokens " << tokens << ", topk " << topk << ", " << n_pes
                                                << " PEs: tokens x PEs and tokens x topk must be below 2^31");
  PDC_REQUIRE(tokens == 0 || (send_counts != nullptr && send_index != nullptr && pair_pe != nullptr &&
                              token_pe != nullptr && token_rank != nullptr),
              "moe_token_destinations: every tensor must be on the GPU");
  kernels::launch_moe_token_destinations(send_counts, send_index, pair_pe, tokens, topk, n_pes, token_pe, token_rank,
                                         4 * multiprocessor_count(), stream);
}

void moe_local_topk(const int32_t* recv_meta, int64_t rows, int64_t topk, const int64_t* recv_counts, int n_pes,
                    int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx, float* recv_topk_weights,
                    int64_t* source_token, int64_t* num_rows, cudaStream_t stream) {
  PDC_REQUIRE(n_pes >= 1 && n_pes <= kMoeLayoutMaxPes && my_pe >= 0 && my_pe < n_pes,
              "moe_local_topk: 1 to " << kMoeLayoutMaxPes << " PEs, got " << n_pes << " (PE " << my_pe << ")");
  PDC_REQUIRE(experts_per_pe >= 1 && experts_per_pe <= kMoeLayoutMaxPairs,
              "moe_local_topk: experts_per_pe " << experts_per_pe);
  PDC_REQUIRE(rows >= 0 && topk >= 1 && topk <= kMoeLayoutMaxTopk && rows <= kMoeLayoutMaxPairs / topk,
              "moe_local_topk: rows x topk = " << rows << " x " << topk << " must be below 2^31");
  PDC_REQUIRE(recv_counts != nullptr && num_rows != nullptr &&
                  (rows == 0 || (recv_meta != nullptr && recv_topk_idx != nullptr && source_token != nullptr)),
              "moe_local_topk: every tensor must be on the GPU");
  kernels::launch_moe_local_topk(recv_meta, rows, topk, recv_counts, n_pes, my_pe, experts_per_pe, recv_topk_idx,
                                 recv_topk_weights, source_token, num_rows, 4 * multiprocessor_count(), stream);
}

void moe_receive_layout(const int32_t* recv_meta, int64_t rows, int64_t topk,
                        const int64_t* recv_counts, int n_pes, int my_pe, int64_t experts_per_pe,
                        int64_t* row_of, int64_t* expert_counts, int64_t* expert_offsets,
                        int64_t* num_rows, int64_t* expert_of_row, int64_t* source_pe,
                        int64_t* source_token, int64_t* combine_index, int64_t* combine_counts,
                        int64_t* pair_position, cudaStream_t stream, void* scratch, int64_t scratch_bytes) {
  static_assert(kMoeLayoutMaxExpertsPerPe + 1 == kernels::kMoeLayoutMaxBins, "one limit");
  PDC_REQUIRE(n_pes >= 1 && n_pes <= kMoeLayoutMaxPes && my_pe >= 0 && my_pe < n_pes,
              "moe_receive_layout: 1 to " << kMoeLayoutMaxPes << " PEs, got " << n_pes << " (PE " << my_pe << ")");
  PDC_REQUIRE(experts_per_pe >= 1 && experts_per_pe <= kMoeLayoutMaxExpertsPerPe,
              "moe_receive_layout: 1 to " << kMoeLayoutMaxExpertsPerPe << " experts per PE, got "
                                          << experts_per_pe);
  PDC_REQUIRE(rows >= 0 && topk >= 1 && rows <= (kMoeLayoutMaxPairs - 1) / topk,
              "moe_receive_layout: rows x topk = " << rows << " x " << topk << " must be below 2^31 - 1");
  PDC_REQUIRE(topk <= kMoeLayoutMaxTopk,
              "moe_receive_layout: topk " << topk << " is above the " << kMoeLayoutMaxTopk << " supported");
  PDC_REQUIRE(recv_counts != nullptr && expert_counts != nullptr && expert_offsets != nullptr &&
                  num_rows != nullptr && combine_index != nullptr && combine_counts != nullptr &&
                  (rows == 0 || (recv_meta != nullptr && row_of != nullptr && expert_of_row != nullptr &&
                                 source_pe != nullptr && source_token != nullptr)),
              "moe_receive_layout: every tensor must be on the GPU");
  const kernels::MoeReceiveLayoutOutputs out{row_of,    expert_counts, expert_offsets, num_rows,       expert_of_row,
                                              source_pe, source_token,  combine_index,  combine_counts, pair_position};
  const int64_t large = kernels::moe_receive_layout_scratch_bytes(rows, static_cast<int>(topk), experts_per_pe);
  if (large > 0 && scratch_fits(scratch, scratch_bytes, large, "moe_receive_layout")) {
    kernels::launch_moe_receive_layout_large(recv_meta, rows, static_cast<int>(topk), recv_counts, n_pes, my_pe,
                                             experts_per_pe, out, scratch, stream);
    return;
  }
  kernels::launch_moe_receive_layout(recv_meta, rows, static_cast<int>(topk), recv_counts, n_pes, my_pe,
                                     experts_per_pe, out, stream);
}

int64_t moe_receive_layout_scratch_bytes(int64_t rows, int64_t topk, int64_t experts_per_pe) {
  // (Sizes the layout refuses need none: moe_receive_layout says why.)
  if (rows < 0 || topk < 1 || topk > kMoeLayoutMaxTopk || rows > (kMoeLayoutMaxPairs - 1) / topk || experts_per_pe < 1 ||
      experts_per_pe > kMoeLayoutMaxExpertsPerPe)
    return 0;
  return kernels::moe_receive_layout_scratch_bytes(rows, static_cast<int>(topk), experts_per_pe);
}

void scatter_region_rows(void* out, int64_t out_rows, const void* region, int64_t stride,
                         const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                         const int64_t* positions, int64_t topk, int64_t rows, int64_t row_bytes,
                         cudaStream_t stream) {
  PDC_REQUIRE(rows >= 0 && out_rows >= 0 && topk >= 1 && topk <= INT32_MAX && row_bytes >= 0 && stride >= 0 &&
                  n_sources >= 1 && n_sources <= AllToAllLayout::kMaxPes,
              "scatter_region_rows: bad sizes (rows " << rows << ", topk " << topk << ", row_bytes "
                                                      << row_bytes << ", sources " << n_sources << ")");
  const auto address = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(region) |
                       static_cast<uintptr_t>(stride) | static_cast<uintptr_t>(row_bytes);
  PDC_REQUIRE((address & 15) == 0, "scatter_region_rows: rows of " << row_bytes << " bytes or the tensors "
                                   "are not 16-byte aligned; use gather_region_rows");
  PDC_REQUIRE(rows == 0 || (out != nullptr && region != nullptr && positions != nullptr &&
                            recv_offsets != nullptr && recv_counts != nullptr),
              "scatter_region_rows: every pointer must be a device address");
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 7) / 8, 4 * multiprocessor_count()));
  kernels::launch_scatter_region_rows(out, out_rows, region, stride, recv_offsets, recv_counts, n_sources,
                                      positions, static_cast<int>(topk), rows, row_bytes, std::max(blocks, 1),
                                      stream);
}

}  // namespace pydatacopy
