// AllToAll: an all-to-all-v whose counts never leave the GPU (the MoE token exchange).
//
// Every PE sends send_counts[d] rows to every PE d (itself included); the counts are an int64
// tensor on the GPU, read by the kernel, so a call never synchronises with the host and a CUDA
// graph replays it with whatever counts the graph's inputs hold. Received rows land in the
// caller's tensors grouped by source PE, and the call writes recv_counts[s] and recv_offsets[s]
// (int64, on the GPU) itself.
//
// Protocol (one call = one round; a round moves 1..kMaxFields "fields", arrays that share the
// row count and the optional gather index, each with its own row width in bytes):
// - Symmetric receive regions, two sets by the parity of the caller's call count (set), each
//   [n_pes sources][capacity rows x max_row_bytes]: PE s writes its rows for PE d into d's region
//   of set for source s (slot = s). capacity (rows per source) and max_row_bytes are fixed at
//   init; a call's fields' row widths must sum to at most max_row_bytes.
// - Send kernel: prefix sum of send_counts on the device (a block-wide scan, one thread per
//   PE; the receive kernel's offsets likewise); a source's rows for d are rows
//   [offset_d, offset_d + count_d) of each field, or, with a gather index, the rows named by
//   index[offset_d ..]. Before writing into d's region of the set it waits (watchdog) until d
//   has consumed the set's previous round (d's credit). Then rows: direct stores through
//   nvshmem_ptr where d is reachable (and PYDATACOPY_FORCE_RMA is off), NVSHMEM putmem_signal
//   otherwise; each piece of rows raises d's arrival counter for this source by the row-field
//   units it carried (signal ADD). Beside the rows, one meta word per (d, set): the count, the
//   fields and bytes per row, and a refusal bit, with the call's tag beside it (one 16-byte
//   pair, one put), published with the round number as its signal. A receiver drops (and
//   reports) a source whose tag differs from its own call's.
// - A PE that refuses its own call runs the round in refuse mode (exchange() says how): no
//   rows, a call-refused meta to every destination; its peers' calls complete and report it
//   (pydatacopy.Error at their check_errors(): a peer that goes on to its next collective without
//   looking meets this PE there, as after any error). Not while capturing: a refused round
//   recorded into one PE's graph reaches its peers only if every PE replays, so nothing is
//   recorded and the error says to abandon the capture on every PE.
// - A count over capacity (or negative, or past the send rows) is refused by the sender: it
//   records a device error (pydatacopy.Error at check_errors(), or after the next call's launch)
//   and sends the meta word with the refusal bit and no rows; the receiver records its side of
//   it too and reports 0 rows from that source. Nothing is truncated silently.
// - Receive kernel: waits (watchdog) for every source's meta of this round, writes recv_counts
//   and recv_offsets, waits for each source's units, copies its rows out of the region into the
//   caller's tensors (the compaction: one extra local read and write of the bytes received),
//   then credits every source: the set's region is free again. A field with no receive tensor
//   stays in the region (no compaction; the caller's kernels read it there): the credits are
//   then owed (a per-set pending word per source) and signalled by release(), a one-block
//   kernel the caller puts on the stream after its readers. A call that would reuse a set
//   whose release is owed hands it back and is refused in refuse mode (the sources would time
//   out on it otherwise).
// - Send pieces: whole rows, at least 16 KiB and about two pieces per warp of the grid; each
//   ends with one system-scope fence and one arrival atomic (per piece, not per row). Gathered
//   rows (an index) load 32 indices per warp at once and copy every field of a row together.
// - Round numbers are per set and counted on the device, so a replayed graph is a fresh round.
//   The set is chosen by the host call count, the same on every PE as long as every PE makes the
//   same calls (eager and captured) in the same order, as with any collective.
//
// Collective: every PE calls exchange() for every round, with the same number of fields and the
// same row widths. A PE that does not come makes the others' waits time out (TimeoutError).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "pydatacopy/detail/channel_order.hpp"

#ifdef __CUDACC__
#define PDC_ALL_TO_ALL_HOST_DEVICE __host__ __device__
#else
#define PDC_ALL_TO_ALL_HOST_DEVICE
#endif

namespace pydatacopy {

// Plain arithmetic of the symmetric layout (tested on the host, tests/cpp).
struct AllToAllLayout {
  static constexpr int kMaxFields = 4;
  static constexpr int kMaxPes = 1024;
  static constexpr int64_t kAlignment = 256;
  static constexpr int64_t kMaxRowBytes = (int64_t{1} << 24) - 1;  // 24 bits of the meta word
  static constexpr int64_t kMaxCapacity = (int64_t{1} << 31) - 1;
  int64_t capacity = 0, max_row_bytes = 0;
  int n_pes = 0;

  AllToAllLayout(int64_t capacity_rows, int64_t row_bytes, int pes)
      : capacity(capacity_rows), max_row_bytes(row_bytes), n_pes(pes) {}
  // One source's region: every field's rows, each field starting 16-byte aligned.
  int64_t region_bytes() const;
  // Where field f starts in a region for row widths `row_bytes` (fields 0..f-1 before it).
  static int64_t field_start(int64_t capacity, const int64_t* row_bytes, int f);
  int64_t regions(int set) const { return set * n_pes * region_bytes(); }
  int64_t words_bytes() const;  // one [2][n_pes] uint64 array
  int64_t meta_signals(int set) const { return words(0, set); }
  int64_t arrivals(int set) const { return words(1, set); }
  int64_t credits(int set) const { return words(2, set); }
  // [n_pes] pairs of words (kMetaBytes each): the meta word, then the call's tag (one put moves
  // both, so the tag is there when the meta's signal is).
  int64_t metas(int set) const { return words(3, 0) + set * words_bytes(); }
  int64_t outgoing(int set) const { return words(3, 0) + (2 + set) * words_bytes(); }
  // [n_pes] place words (compact calls, below): at index d, where PE d puts this PE's rows.
  int64_t places(int set) const { return words(3, 0) + 4 * words_bytes() + set * (words_bytes() / 2); }
  int64_t total() const { return words(3, 0) + 5 * words_bytes(); }
  static constexpr int64_t kMetaBytes = 16;

  // Compact calls (AllToAll::exchange's `compact`): every field's rows land packed by source,
  // source 0's first, field f's at regions(set) + n_pes x field_start(f), one row after another
  // (the field's rows of all sources fit where n_pes regions hold them). Each receiver places
  // its sources in its send kernel, from their meta words: source s's rows start at the sum of
  // placed_rows() over the sources before it, which the receiver tells s in a place word
  // (round << 32 | first row); s waits for it before it stores a row there. A source the
  // receiver does not take (placed_rows 0: another layout, tag or kind of call; refused) is
  // told kDroppedRow and sends nothing, and the receiver expects nothing from it (no gap). A
  // receiver of a plain call that meets a compact meta tells its source the same (from its
  // receive kernel), so that a compact source never waits for a place in vain. PEs that mix
  // plain and compact calls in one round (a plain source writes its own region's range, over
  // packed rows) or fields of other widths with the same sum (not told apart by the meta) get
  // rows that are not valid: the first is refused as a layout mismatch, the second is the
  // caller's (every PE passes the same fields, as for any collective).
  static constexpr int64_t kDroppedRow = 0xffffffffll;
  static constexpr int64_t kMaxCompactRows = kDroppedRow - 1;  // n_pes x capacity: 32-bit places
  // A compact sender's meta says so (its field count with this bit): a receiver of the other
  // kind refuses it as a layout mismatch.
  static constexpr int kCompactFields = 0x40;
  PDC_ALL_TO_ALL_HOST_DEVICE static bool meta_compact(uint64_t meta) {
    return !meta_call_refused(meta) && (meta_fields(meta) & kCompactFields) != 0;
  }
  // The fields a (not refused) meta's rows carry, whatever the kind of call.
  PDC_ALL_TO_ALL_HOST_DEVICE static int meta_field_count(uint64_t meta) {
    return meta_fields(meta) & (kCompactFields - 1);
  }
  // What a compact receiver (a call of `fields` fields, `row_bytes` bytes per row, tag
  // `call_tag`, `capacity` rows per source) places for a source's meta word and tag: its count
  // when the source sent a compact meta of the same layout and tag within capacity, else 0.
  // In refuse mode (fields 0) nothing is placed. Both kernels decide with this one rule.
  PDC_ALL_TO_ALL_HOST_DEVICE static int64_t placed_rows(uint64_t meta, uint64_t tag, int64_t capacity, int fields,
                                                        int64_t row_bytes, uint64_t call_tag) {
    const int64_t count = meta_count(meta);
    const bool taken = !meta_refused(meta) && meta_compact(meta) && meta_field_count(meta) == fields &&
                       fields > 0 && meta_row_bytes(meta) == row_bytes && tag == call_tag && count <= capacity;
    return taken ? count : 0;
  }
  // The arrival units a receiver (of a compact call or not; the call's fields, row bytes, tag
  // and capacity) awaits from a source for its meta word and tag: a plain source sends its rows
  // whatever the receiver makes of them; a compact one only those placed for it (none when it
  // was told kDroppedRow: by a compact receiver that did not take it, or by a plain receiver,
  // which tells every compact source so). Rows x the fields they carry.
  PDC_ALL_TO_ALL_HOST_DEVICE static uint64_t units_from(uint64_t meta, uint64_t tag, bool compact_call,
                                                        int64_t capacity, int fields, int64_t row_bytes,
                                                        uint64_t call_tag) {
    if (meta_refused(meta)) return 0;
    const int64_t rows = !meta_compact(meta) ? meta_count(meta)
                         : compact_call     ? placed_rows(meta, tag, capacity, fields, row_bytes, call_tag)
                                            : 0;
    return static_cast<uint64_t>(rows) * static_cast<uint64_t>(meta_field_count(meta));
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static uint64_t pack_place(uint64_t round, int64_t first_row) {
    return (round << 32) | (static_cast<uint64_t>(first_row) & 0xffffffffull);
  }
  // Whether a place word is this round's: its round bits equal the round's low 32 (compared
  // for equality, not order: the word the set's previous round left differs there by one,
  // across the wrap at 2^32 rounds too).
  PDC_ALL_TO_ALL_HOST_DEVICE static bool place_is_round(uint64_t place, uint64_t round) {
    return (place >> 32) == (round & 0xffffffffull);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static int64_t place_row(uint64_t place) {
    return static_cast<int64_t>(place & 0xffffffffull);
  }

  // A sender that refuses the whole call (its own arguments or state: AllToAll::exchange) sends
  // every destination this meta: refused, fields kCallRefusedFields (never a real field count),
  // the reason (AllToAllRefusal) in the count.
  static constexpr int kCallRefusedFields = 0x7f;
  PDC_ALL_TO_ALL_HOST_DEVICE static uint64_t pack_call_refused(int reason) {
    return pack_meta(reason, 0, kCallRefusedFields, true);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static bool meta_call_refused(uint64_t meta) {
    return meta_refused(meta) && meta_fields(meta) == kCallRefusedFields;
  }

  // Meta word: count (32 bits, saturated), row bytes of all fields (24), fields (7), refused (1).
  // A count outside [0, 2^32 - 1] is saturated (only a refused one can be).
  PDC_ALL_TO_ALL_HOST_DEVICE static uint64_t pack_meta(int64_t count, int64_t row_bytes, int fields,
                                                       bool refused) {
    const uint64_t c = count < 0 ? 0 : (count > 0xffffffffll ? 0xffffffffull : static_cast<uint64_t>(count));
    return c | ((static_cast<uint64_t>(row_bytes) & 0xffffffull) << 32) |
           ((static_cast<uint64_t>(fields) & 0x7full) << 56) | (refused ? (1ull << 63) : 0ull);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static int64_t meta_count(uint64_t meta) {
    return static_cast<int64_t>(meta & 0xffffffffull);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static int64_t meta_row_bytes(uint64_t meta) {
    return static_cast<int64_t>((meta >> 32) & 0xffffffull);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static int meta_fields(uint64_t meta) {
    return static_cast<int>((meta >> 56) & 0x7full);
  }
  PDC_ALL_TO_ALL_HOST_DEVICE static bool meta_refused(uint64_t meta) { return (meta >> 63) != 0; }

  // Checks init's arguments; throws Error naming what to change.
  static void check(int64_t capacity, int64_t max_row_bytes, int n_pes);

 private:
  int64_t words(int array, int set) const {
    return regions(2) + array * words_bytes() + set * (words_bytes() / 2);
  }
};

// Why a PE refused a whole call (the count of its call-refused meta: the peers' message names it).
enum AllToAllRefusal : int {
  kRefusedArguments = 1,   // this PE's arguments (fields, counts' tensors, rows, widths)
  kRefusedSendTensor = 2,  // a send tensor NVSHMEM cannot take as an RMA source
  kRefusedRelease = 3,     // this PE's call two before was never released
  kRefusedByCaller = 4,    // the caller's own check (AllToAll::refuse: e.g. MoE's max_tokens)
};

// One array moved by a call: rows of `row_bytes` bytes; `send` has `send_rows` of them, `recv`
// has room for `recv_rows` (at least n_pes x capacity). recv null: the rows stay where they
// landed, in the receive regions (in_region(): source s's rows at in_region(f) + s x
// region_stride(), in the order sent), with no compaction copy; the set's regions are then
// handed back to the sources by release() instead of by the call, once the caller's kernels
// that read them are on the stream (MoE dispatch and combine read them directly).
struct AllToAllField {
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t row_bytes = 0;
  int64_t send_rows = 0;
  int64_t recv_rows = 0;
};

// Field 0's send rows as sums, computed as each row is stored at its destination (MoE combine's
// expert-side reduction, moe_combine_region_summed in moe.hpp): send row r = the sum over k < topk
// of weights[r x topk + k] x rows[slots[r x topk + k]] (a slot outside [0, row_count) skipped),
// in float32 in k order, each product and sum rounded (no fused multiply-add), rounded once to
// dtype (ReduceDtype): moe_combine_reduce's arithmetic, bit for bit, without the summed rows
// being written and read back first. rows: [row_count] rows of field 0's width, of dtype; slots
// and weights [field 0's send_rows, topk]. Only for a call of one field, no send index, not
// compact, on a buffer whose every peer takes direct stores (AllToAll::sums_in_send()).
struct AllToAllSummedRows {
  const void* rows = nullptr;
  int64_t row_count = 0;
  const int64_t* slots = nullptr;
  const float* weights = nullptr;
  int64_t topk = 0;
  int dtype = 0;
};

// Where a call's fields left in the region are (AllToAll::exchange fills it under the buffer's
// lock, so it is this call's, whatever other threads exchange on the buffer after it): source
// s's rows of field f at field[f] + s x stride (field[f] null for f past the call's fields).
// A compact call's (stride 0): every source's rows of field f packed at field[f], source s's
// from row recv_offsets[s], one row of the field's width after another.
struct AllToAllRegion {
  const uint8_t* field[AllToAllLayout::kMaxFields] = {};
  int64_t stride = 0;
};

class AllToAll {
 public:
  AllToAll() = default;
  // Never collective: one destroyed without cleanup() leaves its symmetric memory allocated.
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  // Collective and blocking: allocates the receive regions on every PE (every PE passes the same
  // values). capacity: rows per source PE and round; max_row_bytes: bytes of one row, all fields.
  void init(int64_t capacity, int64_t max_row_bytes);
  // Collective and blocking; harmless when not initialised.
  void cleanup();

  bool initialized() const { return base_ != nullptr; }
  int64_t capacity() const { return capacity_; }
  int64_t max_row_bytes() const { return max_row_bytes_; }
  int64_t calls() const { return calls_; }  // exchange() calls so far (the next uses set calls % 2)
  std::size_t symmetric_bytes() const;
  static std::size_t symmetric_bytes_needed(int64_t capacity, int64_t max_row_bytes, int n_pes);

  // One round, stream-ordered (two kernel launches on `stream`, no host synchronisation).
  // send_counts: device int64 [n_pes]. send_index: null, or device int64 [index_rows] naming the
  // send row of each row sent (destination-major). recv_counts, recv_offsets: device int64
  // [n_pes], written. Errors found on the device (a count refused, a timeout) are reported by
  // check_device_errors(); an earlier call's refusal is thrown by this call after its launches.
  // Returns the call's number (release() takes it). exchange() and release() hold the buffer's
  // lock (one at a time per buffer, whatever the threads); init() and cleanup() do not.
  // region (optional): filled with this call's region addresses and stride, under the lock (what
  // in_region() / region_stride() read afterwards, race-free against other threads' calls).
  //
  // A refusal of this PE's own arguments or state (rows, widths, a tensor missing, a send tensor
  // NVSHMEM cannot take, a release owed) still runs the round, in refuse mode: this PE sends no
  // rows, sends every destination a call-refused meta, takes and credits what its sources send
  // (the buffer stays in step for the next call), writes no outputs, and then throws Error with
  // the reason. Its peers' calls complete (recv_counts[this PE] = 0) and record the refusal:
  // pydatacopy.Error at their check_errors(), never a timeout. Refused on the host only (no
  // round) are a buffer not set up and a peer already timed out (no round can be run).
  //
  // tag: the call's identity, compared by every receiver with each source's (0 for plain calls):
  // a source whose tag differs is refused like a layout mismatch (its rows dropped, an Error at
  // check_errors() on the receiver). MoE combine passes its handle's dispatch, so that PEs that
  // combine different dispatches are refused on the device instead of summing wrong rows.
  //
  // compact (every PE passes the same; every field's recv null): the rows land packed by source
  // (AllToAllLayout, "Compact calls"; `region` says where), with no compaction copy: each
  // sender stores its rows straight at their final place, which each receiver tells it in the
  // round (one crossing of the bytes, not two). They stay valid until this PE's call two later
  // on this buffer, whose send kernel hands the set back to the sources after everything on
  // its stream before it: no release() (none is owed, and a CUDA graph of such calls replays
  // balanced). Refused on the host on every PE alike: n_pes x capacity past kMaxCompactRows.
  //
  // summed (optional): field 0's rows are sums computed as they are sent (AllToAllSummedRows;
  // field 0's `send` unused); a call that cannot take them (more fields, an index, compact, a
  // peer reached through RMA: sums_in_send() false) is refused like any bad argument.
  int64_t exchange(const std::vector<AllToAllField>& fields, const int64_t* send_counts,
                   const int64_t* send_index, int64_t index_rows, int64_t* recv_counts,
                   int64_t* recv_offsets, cudaStream_t stream, double timeout_seconds,
                   AllToAllRegion* region = nullptr, uint64_t tag = 0, bool compact = false,
                   const AllToAllSummedRows* summed = nullptr);

  // Whether a call may send summed rows (exchange's `summed`): every peer takes direct stores
  // (nvshmem_ptr) and PYDATACOPY_FORCE_RMA is off. Through RMA a row must exist before it is
  // put, so the caller sums first (moe_combine_reduce) and sends the rows as they are.
  bool sums_in_send() const;

  // A round in refuse mode (see exchange) for a refusal the caller found itself (MoE dispatch's
  // max_tokens, a tensor of the wrong shape on this PE): its peers make the call, so this PE
  // takes part, sending nothing; then throws Error(why) here. Returns only by throwing.
  // compact: the peers' call is compact (this PE still places its sources, who wait for it).
  [[noreturn]] void refuse(const std::string& why, cudaStream_t stream, double timeout_seconds,
                           bool compact = false);

  // After a call with a field left in the region (recv null): where field f's rows from source
  // 0 are (device address, this PE), and the bytes from one source's rows to the next. Valid
  // for stream-ordered reads until release(call) is on the stream. They describe the LAST call
  // on the buffer: with several threads on one buffer, take exchange()'s region instead.
  const uint8_t* in_region(int field) const;
  int64_t region_stride() const;
  // Stream-ordered: hands the regions of call `call` (calls() - 1 right after it) back to the
  // sources, after everything before on `stream`. Every call that left a field in the region
  // needs it, before the same PE's call two later on this buffer (the sources' sends of that
  // round wait for it: a missing release makes them time out). A call without one: no-op.
  // A call captured in a CUDA graph is released in the same capture; a release owed by a
  // capture that was invalidated or abandoned is dropped by the next call outside that capture
  // (its rounds never ran, so nothing is owed on the device).
  void release(int64_t call, cudaStream_t stream);

 private:
  void require_initialized(const char* what) const;
  // The round itself (refusal: 0, or the AllToAllRefusal this PE sends every destination), on
  // `stream` in capture state `capture` (its capture_id(), asked once by the caller).
  int64_t launch_round(const std::vector<AllToAllField>& fields, const int64_t* send_counts,
                       const int64_t* send_index, int64_t index_rows, int64_t* recv_counts,
                       int64_t* recv_offsets, cudaStream_t stream, unsigned long long capture,
                       double timeout_seconds, AllToAllRegion* region, uint64_t tag, int refusal,
                       bool compact, const AllToAllSummedRows* summed = nullptr);
  // This PE's refusal (`reason`, `why`), under the lock: while capturing nothing is recorded; else
  // the credits owed are handed back (the sources wait for them before they send), the round runs
  // in refuse mode; then Error(why) is thrown either way.
  [[noreturn]] void refused_round(int reason, const std::string& why, cudaStream_t stream,
                                  unsigned long long capture, double timeout_seconds, bool compact);
  // Throws Error when a compact call cannot be placed in 32-bit rows (the same on every PE).
  void check_compact(bool compact) const;
  // Whether set `set` is owed a release that a call in capture state `capture` must see.
  bool owed(int set, unsigned long long capture) const;
  // Set `set`'s owed credits released on `stream` (release(), and a refusal's hand-back).
  void release_set(int set, cudaStream_t stream, unsigned long long capture);

  std::mutex mutex_;                   // exchange() and release(): one at a time (their counters)

  uint8_t* base_ = nullptr;            // the symmetric allocation
  uint8_t** peer_bases_ = nullptr;     // device [n_pes]: base_ at each PE through nvshmem_ptr, or null
  bool every_peer_direct_ = false;     // every peer reachable through nvshmem_ptr
  uint64_t* counters_ = nullptr;       // device: uses[2], consumed[2][n_pes], pending[2][n_pes]
  unsigned int* done_ = nullptr;       // device: send blocks done[2], receive blocks done[2]
  ChannelOrder order_;                 // one channel: a call's kernels after the previous call's
  int64_t capacity_ = 0;
  int64_t max_row_bytes_ = 0;
  int64_t calls_ = 0;
  int n_pes_ = 0;
  // The last call's set, field starts, and whether it left rows in the region (release owed).
  int64_t last_call_ = -1;
  int64_t last_field_start_[AllToAllLayout::kMaxFields] = {};
  bool release_owed_[2] = {false, false};
  // The capture_id() of the call that left release_owed_[set] (0: eager). A capture that never
  // completes leaves its flag behind: only calls in that same capture are held to it.
  unsigned long long owed_capture_[2] = {0, 0};
};

// out[i] = src[index[i]] for i < min(*count, rows), rows of `row_bytes` bytes; `count` is a
// device int64 (read by the kernel: no host synchronisation, a captured launch follows it); rows
// past it, and rows whose index is outside [0, src_rows), are left as they are. MoE dispatch's
// grouping by expert copies only the rows in use this way.
void gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count, int64_t rows,
                 int64_t src_rows, int64_t row_bytes, cudaStream_t stream);

// Rows [first, rows) of out (rows of row_bytes bytes) set to zero, first = counts[0] + ... +
// counts[n_counts - 1] (device int64, read by the kernel: no host synchronisation), clamped to
// [0, rows]: the rows of an exchange's or a dispatch's output past those received, which are
// otherwise left as the allocator gave them (all_to_all_v / dispatch's zero_unused_rows).
void zero_rows_past(void* out, int64_t rows, int64_t row_bytes, const int64_t* counts, int n_counts,
                    cudaStream_t stream);

// gather_rows from an exchange's receive region (AllToAll::in_region): out[i] = received row
// index[i] for i < min(*count, rows), received rows numbered as a compacted receive tensor
// would hold them (source s's rows from recv_offsets[s], recv_counts[s] of them), read at
// region + s x stride + (row - recv_offsets[s]) x row_bytes; rows outside every source left.
void gather_region_rows(void* out, const void* region, int64_t stride, const int64_t* recv_offsets,
                        const int64_t* recv_counts, int n_sources, const int64_t* index,
                        const int64_t* count, int64_t rows, int64_t row_bytes, cudaStream_t stream);

// moe_combine_reduce reading (token, k)'s row straight from combine's receive region: the row
// pair_rank[t, k] of source pair_pe[t, k] (region + pe x stride + rank x hidden elements),
// skipped when pe is outside [0, n_sources) or rank outside [0, back_counts[pe]) (no expert, or
// a refused round). The arithmetic of moe_combine_reduce.
void moe_combine_reduce_region(void* out, const void* region, int64_t stride, const int64_t* pair_pe,
                               const int64_t* pair_rank, const int64_t* back_counts, int n_sources,
                               const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                               int dtype, cudaStream_t stream);

// The dtype codes of the reductions (rows, out): the Python layer maps torch dtypes by these names
// (_C.REDUCE_DTYPES).
enum ReduceDtype : int { kReduceFloat32 = 0, kReduceBfloat16 = 1, kReduceFloat16 = 2 };

// MoE combine's reduction: out[t] = sum over k in order of weights[t, k] * rows[slots[t, k]]
// (slots < 0 skipped), each product and sum rounded to float32 in that order (no fused
// multiply-add, so a float32 reference computed in the same order matches bit for bit), then
// rounded to out's dtype. dtype: 0 float32, 1 bfloat16, 2 float16 (rows and out alike).
void moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                        const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                        int dtype, cudaStream_t stream);

// MoE dispatch's layouts, one kernel each (the torch references: dispatch_plan and
// receive_layout in python/pydatacopy/_moe.py), stream-ordered, nothing read on the host.
// Limits of the one-block kernels (the Python side falls back to the torch code past them):
constexpr int kMoeLayoutMaxPes = 64;
constexpr int64_t kMoeLayoutMaxExpertsPerPe = 256;
constexpr int64_t kMoeLayoutMaxPairs = (int64_t{1} << 31) - 1;  // tokens x topk, rows x topk
// Within those limits (pairs: tokens x topk sent, or rows x topk + 1 received); past them, the
// torch layouts. (The Python layer's _layout_kernels_fit is this rule on the same constants: a
// traced call cannot call into _C; tests/test_moe_cpu.py checks the two agree.)
constexpr bool moe_layout_kernels_fit(int64_t n_pes, int64_t experts_per_pe, int64_t pairs) {
  return n_pes <= kMoeLayoutMaxPes && experts_per_pe <= kMoeLayoutMaxExpertsPerPe && pairs < kMoeLayoutMaxPairs;
}

// Sender: topk_idx [tokens, topk] (int32 or int64: id_bytes 4 or 8) of global expert ids (outside
// [0, num_experts): none) -> send_counts [n_pes] (tokens for each PE), send_index
// [n_pes * tokens + 1] (the token of each row sent, PE-major, tokens in order; zeros past them),
// meta [tokens, topk + 1] int32 (ids, -1 for none; the token), pair_pe [tokens, topk] (PE of
// each pair, n_pes for none), pair_rank [tokens, topk] (rank among this PE's pairs with that PE
// in (token, k) order).
// Above moe_dispatch_layout_scratch_bytes(...) > 0 (large inputs) with a scratch of that many
// bytes (device memory, 4-byte aligned, stream-ordered like the outputs; its contents need not
// survive the call), several blocks do it; without one, the one-block kernel (the same outputs,
// slower).
void moe_dispatch_layout(const void* topk_idx, int id_bytes, int64_t tokens, int64_t topk,
                         int64_t num_experts, int n_pes, int64_t* send_counts, int64_t* send_index,
                         int32_t* meta, int64_t* pair_pe, int64_t* pair_rank, cudaStream_t stream,
                         void* scratch = nullptr, int64_t scratch_bytes = 0);
int64_t moe_dispatch_layout_scratch_bytes(int64_t tokens, int64_t topk, int n_pes);

// Receiver: recv_meta [rows, topk + 1] int32 as received (rows grouped by source, recv_counts
// [n_pes] of each) -> the pairs (row, k) whose expert is local, grouped by local expert then in
// (row, k) order: row_of [rows * topk] (the received row of each recv_x row; then the other
// pairs), expert_counts / expert_offsets [experts_per_pe], num_rows [1], expert_of_row,
// source_pe, source_token [rows * topk] (experts_per_pe / -1 / -1 past num_rows), combine_index
// [rows * topk + 1] (recv_x row of each local pair in (row, k) order; zeros past them),
// combine_counts [n_pes] (local pairs among each source's rows); pair_position (null: not
// written) [rows * topk]: the recv_x row of each pair (row, k), -1 when not local.
void moe_receive_layout(const int32_t* recv_meta, int64_t rows, int64_t topk,
                        const int64_t* recv_counts, int n_pes, int my_pe, int64_t experts_per_pe,
                        int64_t* row_of, int64_t* expert_counts, int64_t* expert_offsets,
                        int64_t* num_rows, int64_t* expert_of_row, int64_t* source_pe,
                        int64_t* source_token, int64_t* combine_index, int64_t* combine_counts,
                        int64_t* pair_position, cudaStream_t stream, void* scratch = nullptr,
                        int64_t scratch_bytes = 0);
// Scratch bytes for moe_receive_layout's multi-block path (0: small, one block does it).
int64_t moe_receive_layout_scratch_bytes(int64_t rows, int64_t topk, int64_t experts_per_pe);

// MoeDispatcher(expand=False)'s small layouts, one kernel each, stream-ordered, nothing read on
// the host (the torch references: token_destinations and local_topk in python/pydatacopy/moe/
// layout.py; src/core/kernels/moe/token_layout.hpp, element by element). Limits: n_pes <=
// kMoeLayoutMaxPes, topk <= kMoeLayoutMaxTopk, tokens x n_pes and rows x topk below 2^31.
// Sender: from moe_dispatch_layout's send_counts, send_index and pair_pe -> token_pe / token_rank
// [tokens, min(topk, n_pes)]: the PEs token t was sent to, ascending (n_pes pads the rest), and
// t's rank among the tokens sent to each (-1 where token_pe pads).
void moe_token_destinations(const int64_t* send_counts, const int64_t* send_index, const int64_t* pair_pe,
                            int64_t tokens, int64_t topk, int n_pes, int64_t* token_pe, int64_t* token_rank,
                            cudaStream_t stream);
// Receiver: recv_meta [rows, topk + 1] int32 as the exchange compacted it (recv_counts [n_pes]
// from each source; the rows past their sum not read) -> recv_topk_idx [rows, topk] int64 (local
// expert ids, -1 for an expert elsewhere, none or a row past the received), recv_topk_weights
// ([rows, topk] float32 as received, or null) zeroed in place where the id is -1, source_token
// [rows] (-1 past the received), num_rows [1] (the rows received).
void moe_local_topk(const int32_t* recv_meta, int64_t rows, int64_t topk, const int64_t* recv_counts, int n_pes,
                    int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx, float* recv_topk_weights,
                    int64_t* source_token, int64_t* num_rows, cudaStream_t stream);

// MoE dispatch's grouping by expert straight from the receive region, each received row read
// once: received row j (numbered as in gather_region_rows; j < sum(recv_counts) and < rows) is
// written to out[positions[j * topk + k]] for each k with 0 <= position < out_rows. Rows of
// 16-byte multiples, region and out 16-byte aligned (else Error: use gather_region_rows).
void scatter_region_rows(void* out, int64_t out_rows, const void* region, int64_t stride,
                         const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                         const int64_t* positions, int64_t topk, int64_t rows, int64_t row_bytes,
                         cudaStream_t stream);

}  // namespace pydatacopy
