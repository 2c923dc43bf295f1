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
// - Send kernel: prefix sum of send_counts on the device; a source's rows for d are rows
//   [offset_d, offset_d + count_d) of each field, or, with a gather index, the rows named by
//   index[offset_d ..]. Before writing into d's region of the set it waits (watchdog) until d
//   has consumed the set's previous round (d's credit). Then rows: direct stores through
//   nvshmem_ptr where d is reachable (and PYDATACOPY_FORCE_RMA is off), NVSHMEM putmem_signal
//   otherwise; each piece of rows raises d's arrival counter for this source by the row-field
//   units it carried (signal ADD). Beside the rows, one meta word per (d, set): the count, the
//   fields and bytes per row, and a refusal bit, published with the round number as its signal.
// - A count over capacity (or negative, or past the send rows) is refused by the sender: it
//   records a device error (pydatacopy.Error at check_errors(), or after the next call's launch)
//   and sends the meta word with the refusal bit and no rows; the receiver records its side of
//   it too and reports 0 rows from that source. Nothing is truncated silently.
// - Receive kernel: waits (watchdog) for every source's meta of this round, writes recv_counts
//   and recv_offsets, waits for each source's units, copies its rows out of the region into the
//   caller's tensors (the compaction: one extra local read and write of the bytes received),
//   then credits every source: the set's region is free again.
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
#include <vector>

#include "pydatacopy/channel_order.hpp"

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
  int64_t metas(int set) const { return words(1, set); }
  int64_t arrivals(int set) const { return words(2, set); }
  int64_t credits(int set) const { return words(3, set); }
  int64_t outgoing(int set) const { return words(4, set); }
  int64_t total() const { return words(5, 0); }

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

// One array moved by a call: rows of `row_bytes` bytes; `send` has `send_rows` of them, `recv`
// has room for `recv_rows` (at least n_pes x capacity).
struct AllToAllField {
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t row_bytes = 0;
  int64_t send_rows = 0;
  int64_t recv_rows = 0;
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
  void exchange(const std::vector<AllToAllField>& fields, const int64_t* send_counts,
                const int64_t* send_index, int64_t index_rows, int64_t* recv_counts,
                int64_t* recv_offsets, cudaStream_t stream, double timeout_seconds);

 private:
  void require_initialized(const char* what) const;

  uint8_t* base_ = nullptr;            // the symmetric allocation
  uint8_t** peer_bases_ = nullptr;     // device [n_pes]: base_ at each PE through nvshmem_ptr, or null
  bool every_peer_direct_ = false;     // every peer reachable through nvshmem_ptr
  uint64_t* counters_ = nullptr;       // device: uses[2], consumed[2][n_pes]
  unsigned int* done_ = nullptr;       // device: send blocks done[2], receive blocks done[2]
  ChannelOrder order_;                 // one channel: a call's kernels after the previous call's
  int64_t capacity_ = 0;
  int64_t max_row_bytes_ = 0;
  int64_t calls_ = 0;
  int n_pes_ = 0;
};

// out[i] = src[index[i]] for i < min(*count, rows), rows of `row_bytes` bytes; `count` is a
// device int64 (read by the kernel: no host synchronisation, a captured launch follows it); rows
// past it, and rows whose index is outside [0, src_rows), are left as they are. MoE dispatch's
// grouping by expert copies only the rows in use this way.
void gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count, int64_t rows,
                 int64_t src_rows, int64_t row_bytes, cudaStream_t stream);

// MoE combine's reduction: out[t] = sum over k in order of weights[t, k] * rows[slots[t, k]]
// (slots < 0 skipped), each product and sum rounded to float32 in that order (no fused
// multiply-add, so a float32 reference computed in the same order matches bit for bit), then
// rounded to out's dtype. dtype: 0 float32, 1 bfloat16, 2 float16 (rows and out alike).
void moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                        const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                        int dtype, cudaStream_t stream);

}  // namespace pydatacopy
