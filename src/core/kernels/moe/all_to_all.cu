// The all-to-all-v's two kernels (protocol: include/pydatacopy/all_to_all.hpp) and MoE combine's
// weighted reduction.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "kernels/copy.cuh"
#include "kernels/moe/warp_search.cuh"
#include "pydatacopy/all_to_all.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPes = AllToAllLayout::kMaxPes;
// Bytes a warp moves per piece (whole rows): large enough for full-speed stores, small enough
// that a few hundred rows of a small width spread over the grid.
constexpr int64_t kPieceBytes = 16384;
static_assert(kAllToAllMaxFields == AllToAllLayout::kMaxFields, "one field limit");

__device__ __forceinline__ uint64_t* word(const AllToAllArgs& a, int64_t array, int pe) {
  return reinterpret_cast<uint64_t*>(a.base + array) + pe;
}

__device__ __forceinline__ uint64_t* peer_word(uint8_t* peer_base, int64_t array, int pe) {
  return reinterpret_cast<uint64_t*>(peer_base + array) + pe;
}

// PE pe's (meta, tag) pair in a pair array (AllToAllLayout::metas / outgoing) at `base`.
__device__ __forceinline__ volatile uint64_t* meta_pair(uint8_t* base, int64_t array, int pe) {
  return reinterpret_cast<volatile uint64_t*>(base + array + static_cast<int64_t>(pe) * AllToAllLayout::kMetaBytes);
}

__device__ __forceinline__ int64_t rows_per_piece(int64_t row_bytes) {
  const int64_t rows = kPieceBytes / (row_bytes > 0 ? row_bytes : 1);
  return rows > 0 ? rows : 1;
}

// warp_copy with eight 16-byte vectors in flight per lane (4 KiB per warp) when both pointers
// share their 16-byte alignment, as rows of 16-byte multiples do: a row of a few KiB then takes
// one or two memory latencies instead of four to eight. Other alignments: warp_copy.
__device__ __forceinline__ void row_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) != 0) {
    warp_copy(dst, src, bytes, lane);
    return;
  }
  constexpr int kUnroll = 8;
  const int64_t vectors = bytes / 16;
  auto* dst_v = reinterpret_cast<int4*>(dst);
  const auto* src_v = reinterpret_cast<const int4*>(src);
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < vectors; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src_v[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst_v[i + 32 * u] = v[u];
  }
  // The tail (fewer than kUnroll vectors per lane left): its loads issued together as well. A
  // loop of one vector per lane waited out up to kUnroll - 1 memory latencies in a row: a 14 KiB
  // row (896 vectors) took three full steps and four of those.
  if (i < vectors) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < vectors) v[u] = src_v[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < vectors) dst_v[i + 32 * u] = v[u];
  }
  for (int64_t b = vectors * 16 + lane; b < bytes; b += 32) dst[b] = src[b];
}


// Exclusive scan over the block, one value per thread in thread order, with `op` (associative,
// `identity` neutral); *total gets the block's whole. Every thread of the block calls it (it
// synchronises the block); blockDim.x a multiple of 32. The prologues' prefix sums: one thread
// running one over the PEs or bins was a chain of dependent loads and divisions (~0.2 us a step).
template <typename T, typename Op>
__device__ __forceinline__ T block_exclusive_scan(T value, T identity, Op op, T* total) {
  __shared__ T warp_inclusive[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  T inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive = op(other, inclusive);
  }
  if (lane == 31) warp_inclusive[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T sum = lane < warps ? warp_inclusive[lane] : identity;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const T other = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum = op(other, sum);
    }
    if (lane < warps) warp_inclusive[lane] = sum;  // now inclusive over warps 0..lane
  }
  __syncthreads();
  T exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = identity;
  if (warp > 0) exclusive = op(warp_inclusive[warp - 1], exclusive);
  *total = warp_inclusive[warps - 1];
  __syncthreads();  // every thread has read warp_inclusive before a next call writes it
  return exclusive;
}

struct AddInt64 {
  __device__ __forceinline__ int64_t operator()(int64_t x, int64_t y) const { return x + y; }
};

// ceil(rows / per_piece) for 0 <= rows <= AllToAllLayout::kMaxCapacity (2^31 - 1) and
// per_piece >= 1, in 32-bit arithmetic: per_piece is capped at 2^31 - 1 (rows <= the cap, so
// the answer is the same: 1 for rows > 0, else 0), and rows + per_piece - 1 <= 2^32 - 3 fits
// an unsigned 32-bit word. (A 64-bit division is a long software routine on the GPU.)
__device__ __forceinline__ int64_t pieces_of(int64_t rows, int64_t per_piece) {
  const uint32_t r = static_cast<uint32_t>(rows);
  const uint32_t p = static_cast<uint32_t>(min(per_piece, AllToAllLayout::kMaxCapacity));
  return static_cast<int64_t>((r + p - 1u) / p);
}

__device__ __forceinline__ void refuse(const AllToAllArgs& a, detail::WaitOp op, int peer,
                                       int64_t asked, int64_t limit) {
  detail::record_error(&a.status->all_to_all, detail::kBadInput, op, peer, a.my_pe,
                       static_cast<uint64_t>(asked), static_cast<uint64_t>(limit));
}

// The last block of a launch to finish runs `last` (every block counts itself, also after a
// timeout, so that the counter is back at zero for the next launch).
template <typename Last>
__device__ __forceinline__ void after_every_block(unsigned int* done, Last last) {
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(done, 1u) + 1 == gridDim.x;
    if (is_last) *done = 0;
  }
  __syncthreads();
  if (is_last) {
    __threadfence();
    last();
  }
}

// Where row `row` of field f goes in the destination's set: this PE's region there, or in a
// compact call the field's packed rows, from the first row the destination placed this PE at.
__device__ __forceinline__ int64_t row_at(const AllToAllArgs& a, int64_t my_region, int f, int64_t placed_at,
                                          int64_t row) {
  return a.compact ? a.regions + a.n_pes * a.field_start[f] + (placed_at + row) * a.row_bytes[f]
                   : my_region + a.field_start[f] + row * a.row_bytes[f];
}

// Destination d's place for this PE's rows in this round (the word's round equal to this one's,
// AllToAllLayout::place_is_round): its first row, or -1 after the deadline (the timeout recorded).
__device__ int64_t wait_for_place(const AllToAllArgs& a, int d, uint64_t round, uint64_t deadline) {
  const uint64_t* at = word(a, a.places, d);
  uint64_t seen = detail::load_acquire_sys(at);
  for (uint32_t spins = 0; !AllToAllLayout::place_is_round(seen, round); ++spins) {
    if ((spins & 1023u) == 1023u && detail::globaltimer_ns() > deadline) {
      detail::record_timeout(a.status, detail::WaitOp::kAllToAllCredit, d, a.my_pe,
                             AllToAllLayout::pack_place(round, 0), seen);
      return -1;
    }
    seen = detail::load_acquire_sys(at);
  }
  return AllToAllLayout::place_row(seen);
}

// A source's place word at this PE (index my_pe of the source's place words): direct, or a put.
__device__ __forceinline__ void send_place(const AllToAllArgs& a, int s, uint64_t place) {
  uint8_t* peer = a.direct ? a.peer_bases[s] : nullptr;
  if (peer != nullptr) store_release_sys(peer_word(peer, a.places, a.my_pe), place);
  else nvshmemx_signal_op(word(a, a.places, a.my_pe), place, NVSHMEM_SIGNAL_SET, s);
}

// A compact call's placing (AllToAllLayout, "Compact calls"), block 0 of the send kernel, every
// thread: each source's rows after those of the sources before it (placed_rows of their meta
// words, as the receive kernel counts them for recv_counts and recv_offsets), told to each source
// in its place word at index my_pe; a source placed for no rows is told kDroppedRow (it sends
// nothing). After this PE's own metas went out: the sources wait for their places only after
// sending theirs, so no PE waits on one that waits on it. A meta that never comes (a dead or
// late peer: its wait recorded the timeout) places nobody, since every later source's row would
// move: the sources then time out on their places, as on any dead peer.
__device__ void place_sources(const AllToAllArgs& a, uint64_t round, uint64_t deadline, int* failed) {
  __shared__ int missing;
  const int n = a.n_pes;
  if (threadIdx.x == 0) missing = 0;
  __syncthreads();
  int64_t first[2] = {0, 0};  // this thread's sources' first rows (n <= 2 x kThreads: two passes)
  bool placed_any[2] = {false, false};
  int64_t before = 0;
  for (int pass = 0, base = 0; base < n; ++pass, base += blockDim.x) {
    const int s = base + threadIdx.x;
    int64_t rows = 0;
    if (s < n) {
      if (detail::wait_until_at_least(word(a, a.meta_signals, s), round, deadline, a.status,
                                      detail::WaitOp::kAllToAllArrival, s, a.my_pe)) {
        volatile uint64_t* pair = meta_pair(a.base, a.metas, s);
        rows = AllToAllLayout::placed_rows(pair[0], pair[1], a.capacity, a.fields, a.row_bytes_total, a.tag);
      } else {
        missing = 1;
      }
    }
    placed_any[pass] = rows > 0;
    int64_t pass_rows;  // rows <= capacity < 2^31 each, n <= 2^10: no overflow
    first[pass] = before + block_exclusive_scan(rows, int64_t{0}, AddInt64{}, &pass_rows);
    before += pass_rows;
  }
  __syncthreads();  // every thread's `missing` is in
  if (missing) {
    if (threadIdx.x == 0) *failed = 1;
    return;
  }
  for (int pass = 0, base = 0; base < n; ++pass, base += blockDim.x) {
    const int s = base + threadIdx.x;
    if (s >= n) continue;
    send_place(a, s, AllToAllLayout::pack_place(round, placed_any[pass] ? first[pass] : AllToAllLayout::kDroppedRow));
  }
}

// The reduction's element types to and from float32 (round to nearest even).
template <typename T>
struct FloatCast;
template <>
struct FloatCast<float> {
  static __device__ __forceinline__ float to(float value) { return value; }
  static __device__ __forceinline__ float from(float value) { return value; }
};
template <>
struct FloatCast<__nv_bfloat16> {
  static __device__ __forceinline__ float to(__nv_bfloat16 value) { return __bfloat162float(value); }
  static __device__ __forceinline__ __nv_bfloat16 from(float value) { return __float2bfloat16_rn(value); }
};
template <>
struct FloatCast<__half> {
  static __device__ __forceinline__ float to(__half value) { return __half2float(value); }
  static __device__ __forceinline__ __half from(float value) { return __float2half_rn(value); }
};
template <typename T>
__device__ __forceinline__ float to_float(T value) { return FloatCast<T>::to(value); }
template <typename T>
__device__ __forceinline__ T from_float(float value) { return FloatCast<T>::from(value); }

// The reductions' arithmetic, in one place (combine_reduce_rows_kernel and its vector form, and
// the summing send, sum_rows_as): element h of sum over k < topk of weight(k) x row(k) (row(k)
// nullptr: skipped), 0.0f, then k in order, each product and each sum rounded (no fused
// multiply-add), rounded once to T.
template <typename T, typename Row, typename Weight>
__device__ __forceinline__ T weighted_sum_element(int64_t h, int64_t topk, const Row& row, const Weight& weight) {
  float sum = 0.0f;
  for (int64_t k = 0; k < topk; ++k) {
    const uint8_t* from = row(k);
    if (from == nullptr) continue;
    sum = __fadd_rn(sum, __fmul_rn(weight(k), to_float(reinterpret_cast<const T*>(from)[h])));
  }
  return from_float<T>(sum);
}

// The same for the 16-byte vector v of each row (16-byte aligned rows): kBatch rows' vectors
// loaded together, then summed in k order (the same sum, bit for bit): a loop that loaded one
// row's vector and added it waited out one memory latency per k, topk of them per vector (22-27
// us for 128 tokens x 8 rows of 14 KiB, measured).
template <typename T, int kBatch, typename Row, typename Weight>
__device__ __forceinline__ int4 weighted_sum_vector(int64_t v, int64_t topk, const Row& row, const Weight& weight) {
  constexpr int kPer = 16 / sizeof(T);
  float sum[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) sum[e] = 0.0f;
  for (int64_t k0 = 0; k0 < topk; k0 += kBatch) {
    const uint8_t* from[kBatch];
    int4 packed[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      from[u] = k0 + u < topk ? row(k0 + u) : nullptr;
      if (from[u] != nullptr) packed[u] = reinterpret_cast<const int4*>(from[u])[v];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (from[u] == nullptr) continue;
      const float w = weight(k0 + u);
      const T* values = reinterpret_cast<const T*>(&packed[u]);
#pragma unroll
      for (int e = 0; e < kPer; ++e) sum[e] = __fadd_rn(sum[e], __fmul_rn(w, to_float(values[e])));
    }
  }
  int4 packed;
  T* values = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int e = 0; e < kPer; ++e) values[e] = from_float<T>(sum[e]);
  return packed;
}

// A summed field's rows (AllToAllArgs::sum_rows): rows [first, first + rows) of the sums,
// stored at dst one after another (`width` bytes each), by one warp, with the reduction
// kernels' own arithmetic (weighted_sum_element / _vector): a sum sent equals one computed by
// moe_combine_reduce and then copied, bit for bit.
// Not inlined: in the send kernel (128 registers a thread at 512 threads) the loops spilled
// (352 bytes of spill loads, -Xptxas=-v); a call of its own keeps its loops in registers, at a
// few saved registers per call (a call per piece, a row of several KiB).
constexpr int kSumBatch = 4;  // rows of a sum whose vectors a lane loads together

// (The arguments by value: a reference to the kernel's parameters would make the kernel copy
// them all to local memory to take their address.)
template <typename T>
__device__ __noinline__ void sum_rows_as(uint8_t* dst, const uint8_t* sum_rows, int64_t sum_row_count,
                                         const int64_t* sum_slots, const float* sum_weights, int64_t topk,
                                         int64_t first, int64_t rows, int64_t width, int lane) {
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t* slots = sum_slots + (first + j) * topk;
    const float* weights = sum_weights + (first + j) * topk;
    const auto row = [&](int64_t k) -> const uint8_t* {
      const int64_t slot = slots[k];
      return slot >= 0 && slot < sum_row_count ? sum_rows + slot * width : nullptr;
    };
    const auto weight = [&](int64_t k) { return weights[k]; };
    uint8_t* out = dst + j * width;
    if (width % 16 == 0 && ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(sum_rows)) & 15) == 0) {
      for (int64_t v = lane; v < width / 16; v += 32)
        reinterpret_cast<int4*>(out)[v] = weighted_sum_vector<T, kSumBatch>(v, topk, row, weight);
    } else {
      for (int64_t h = lane; h < width / static_cast<int64_t>(sizeof(T)); h += 32)
        reinterpret_cast<T*>(out)[h] = weighted_sum_element<T>(h, topk, row, weight);
    }
  }
}

__device__ __forceinline__ void sum_rows_to(uint8_t* dst, const AllToAllArgs& a, int64_t first, int64_t rows,
                                            int64_t width, int lane) {
#define PDC_SUM_ROWS_AS(T) \
  sum_rows_as<T>(dst, a.sum_rows, a.sum_row_count, a.sum_slots, a.sum_weights, a.sum_topk, first, rows, width, lane)
  switch (a.sum_dtype) {
    case kReduceFloat32: PDC_SUM_ROWS_AS(float); break;
    case kReduceBfloat16: PDC_SUM_ROWS_AS(__nv_bfloat16); break;
    default: PDC_SUM_ROWS_AS(__half); break;  // kReduceFloat16 (checked on the host)
  }
#undef PDC_SUM_ROWS_AS
}

// kSum: field 0's rows are sums (AllToAllArgs::sum_rows), computed as they are stored; the
// plain instantiation is the copy kernel as it was.
template <bool kSum>
__global__ void __launch_bounds__(kThreads) all_to_all_send_kernel(const AllToAllArgs a) {
  __shared__ int64_t asked_of[kMaxPes];    // send_counts, read once
  __shared__ int64_t first_row[kMaxPes];   // send row (or index entry) of each destination's first
  __shared__ int64_t rows_to[kMaxPes];     // rows sent to each destination (0 when refused)
  __shared__ int64_t pieces[kMaxPes + 1];  // prefix, in send order: position i is PE my_pe + i
  __shared__ uint64_t round_value;
  __shared__ int failed;
  __shared__ int first_refused;            // the lowest refused destination (n: none)
  __shared__ int64_t per_piece_shared;
  const int n = a.n_pes;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    // This use of the set: one more than the device count, which the last block moves on.
    round_value = *reinterpret_cast<volatile uint64_t*>(a.uses) + 1;
    failed = 0;
    first_refused = n;
  }
  // One thread per destination (n <= kMaxPes = 2 x kThreads: at most two passes), the offsets
  // by a block-wide scan. An offset saturates at `limit` (counts past the rows never wrap it;
  // later destinations are refused): with every term clamped to [0, limit] (limit >= 0: a row
  // count), x + y capped at limit is associative, and gives the sequential loop's offsets.
  const int64_t limit = a.send_index != nullptr ? a.index_rows : a.send_rows;
  const auto saturated_add = [limit](int64_t x, int64_t y) { return x > limit - y ? limit : x + y; };
  int64_t offset_before = 0;  // of this pass's first destination
  int64_t rows_before = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int d = base + threadIdx.x;
    const int64_t asked = d < n && a.refusal == 0 ? a.send_counts[d] : 0;
    const int64_t term = asked > 0 ? (asked < limit ? asked : limit) : 0;
    int64_t pass_offsets;
    const int64_t offset =
        saturated_add(offset_before, block_exclusive_scan(term, int64_t{0}, saturated_add, &pass_offsets));
    offset_before = saturated_add(offset_before, pass_offsets);
    int64_t rows = 0;
    if (d < n) {
      asked_of[d] = asked;
      first_row[d] = offset;
      const bool refused = asked < 0 || asked > limit - offset || asked > a.capacity;
      if (refused) atomicMin(&first_refused, d);
      rows = refused ? 0 : asked;
      rows_to[d] = rows;
    }
    int64_t pass_rows;  // rows <= capacity < 2^31, n <= 2^10: no overflow
    block_exclusive_scan(rows, int64_t{0}, AddInt64{}, &pass_rows);
    rows_before += pass_rows;
  }
  // (The scans synchronised the block: first_refused and the shared arrays are complete; thread
  // 0 set first_refused before the first scan's barrier, every atomicMin comes after it.)
  // Refusals: the lowest refused destination's, as the one-thread loop recorded first (the
  // record keeps the first one).
  if (blockIdx.x == 0 && threadIdx.x == 0 && first_refused < n) {
    const int d = first_refused;
    const int64_t asked = asked_of[d];
    if (asked < 0 || asked > limit - first_row[d]) refuse(a, detail::WaitOp::kAllToAllCount, d, asked, limit);
    else refuse(a, detail::WaitOp::kAllToAllCapacity, d, asked, a.capacity);
  }
  // Rows per piece: at least kPieceBytes' worth, and enough that the rows make about two
  // pieces per warp of the grid: each piece ends with a system-scope fence and an atomic at
  // the destination, which per row (rows of several KiB) cost as much as the row's copy.
  // (Every thread computes it, side by side; the main loop reads it back from shared memory,
  // as before: with the value kept in a register it spilled more, measured with -Xptxas=-v.)
  const int64_t rows_all = rows_before;
  const int64_t target = 2 * static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t spread = (rows_all + target - 1) / target;
  const int64_t by_bytes = rows_per_piece(a.row_bytes_total);
  const int64_t piece_size = spread > by_bytes ? spread : by_bytes;
  if (threadIdx.x == 0) per_piece_shared = piece_size;
  // Pieces in send order (position i: destination my_pe + i), one thread per position.
  int64_t pieces_before = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int64_t count = i < n ? pieces_of(rows_to[(a.my_pe + i) % n], piece_size) : 0;
    int64_t pass_pieces;
    const int64_t before = block_exclusive_scan(count, int64_t{0}, AddInt64{}, &pass_pieces);
    if (i < n) pieces[i] = pieces_before + before;
    pieces_before += pass_pieces;
  }
  if (threadIdx.x == 0) pieces[n] = pieces_before;
  __syncthreads();
  const int64_t per_piece = per_piece_shared;
  const uint64_t round = round_value;
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t my_region = a.regions + static_cast<int64_t>(a.my_pe) * a.region_bytes;

  // Block 0: first the credits this PE still owes its sources for the set's previous round (a
  // compact call's, stream-ordered after its readers as the next round of the set is: the host
  // refuses a call whose set owes a release() instead, so that none is pending then); then every
  // destination's meta word, once that destination has freed this set.
  if (blockIdx.x == 0) {
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      const uint64_t owed = a.pending[s];
      if (owed == 0) continue;  // nothing owed (or that round failed for the source: no credit)
      a.pending[s] = 0;
      nvshmemx_signal_op(word(a, a.credits, a.my_pe), owed, NVSHMEM_SIGNAL_SET, s);
    }
    for (int d = threadIdx.x; d < n; d += blockDim.x) {
      if (!detail::wait_until_at_least(word(a, a.credits, d), round - 1, deadline, a.status,
                                       detail::WaitOp::kAllToAllCredit, d, a.my_pe)) {
        failed = 1;
        continue;
      }
      const int64_t asked = asked_of[d];
      const bool refused = rows_to[d] != asked;
      const int fields = a.fields | (a.compact ? AllToAllLayout::kCompactFields : 0);
      const uint64_t meta = a.refusal != 0 ? AllToAllLayout::pack_call_refused(a.refusal)
                                           : AllToAllLayout::pack_meta(asked, a.row_bytes_total, fields, refused);
      // The meta and the tag side by side (one put moves both), published by the signal.
      uint8_t* peer = a.direct ? a.peer_bases[d] : nullptr;
      if (peer != nullptr) {
        volatile uint64_t* at = meta_pair(peer, a.metas, a.my_pe);
        at[0] = meta;
        at[1] = a.tag;
        __threadfence_system();
        store_release_sys(peer_word(peer, a.meta_signals, a.my_pe), round);
      } else {
        uint64_t* outgoing = const_cast<uint64_t*>(meta_pair(a.base, a.outgoing, d));  // symmetric: the RMA source
        outgoing[0] = meta;
        outgoing[1] = a.tag;
        nvshmem_putmem_signal(const_cast<uint64_t*>(meta_pair(a.base, a.metas, a.my_pe)), outgoing,
                              AllToAllLayout::kMetaBytes, word(a, a.meta_signals, a.my_pe), round,
                              NVSHMEM_SIGNAL_SET, d);
      }
    }
    if (a.compact) place_sources(a, round, deadline, &failed);
  }

  __syncwarp();  // block 0's lanes took their own paths above; the warp calls below need all

  // Rows, piece by piece: each warp takes whole pieces of one destination.
  const int64_t total = pieces[n];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int credited = -1;  // the destination whose credit (compact: place) this warp has seen
  int64_t placed_at = 0;  // compact: d's first row for this PE's rows
  for (int64_t piece = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; piece < total;
       piece += warps) {
    const int i = find_slot(pieces, n, piece);
    const int d = (a.my_pe + i) % n;
    if (d != credited) {
      int ok = 1;
      long long place = 0;
      if (lane == 0) {
        // A compact call's place comes after d freed the set (d placed this PE after it saw this
        // PE's meta, sent only once d's credit was in): the place is the credit too.
        if (a.compact) {
          place = wait_for_place(a, d, round, deadline);
          ok = place >= 0;
        } else {
          ok = detail::wait_until_at_least(word(a, a.credits, d), round - 1, deadline, a.status,
                                           detail::WaitOp::kAllToAllCredit, d, a.my_pe);
        }
      }
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (!ok) {
        failed = 1;
        break;
      }
      placed_at = __shfl_sync(0xffffffffu, place, 0);
      credited = d;
    }
    // Not taken by d (another layout, tag or kind of call: d records why): nothing to send,
    // and d expects nothing from this PE.
    if (a.compact && placed_at == AllToAllLayout::kDroppedRow) continue;
    // Another warp may set `failed` at any time: one lane reads it, so that the warp stays whole.
    int stop = 0;
    if (lane == 0) stop = *reinterpret_cast<volatile int*>(&failed);
    if (__shfl_sync(0xffffffffu, stop, 0)) break;
    const int64_t first = (piece - pieces[i]) * per_piece;
    const int64_t rows = min(per_piece, rows_to[d] - first);
    uint8_t* peer = a.direct ? a.peer_bases[d] : nullptr;
    uint64_t* arrivals = word(a, a.arrivals, a.my_pe);  // d's counter for this source
    if (a.send_index == nullptr) {
      for (int f = 0; f < a.fields; ++f) {
        const int64_t width = a.row_bytes[f];
        const int64_t at = row_at(a, my_region, f, placed_at, first);
        const uint8_t* src = a.send[f] + (first_row[d] + first) * width;
        if (peer != nullptr) {
          if constexpr (kSum) {
            sum_rows_to(peer + at, a, first_row[d] + first, rows, width, lane);
          } else {
            row_copy(peer + at, src, rows * width, lane);
          }
        } else {
          nvshmemx_putmem_signal_warp(a.base + at, src, static_cast<size_t>(rows * width), arrivals,
                                      static_cast<uint64_t>(rows), NVSHMEM_SIGNAL_ADD, d);
        }
      }
    } else {
      // Gathered rows: the lanes load 32 rows' indices at once (one memory latency, not one per
      // row and field), then the warp copies row by row, every field of a row together.
      const int64_t* index_of = a.send_index + first_row[d] + first;
      for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const int batch = static_cast<int>(min(static_cast<int64_t>(32), rows - r0));
        const int64_t my_index = lane < batch ? index_of[r0 + lane] : 0;
        for (int j = 0; j < batch; ++j) {
          const int64_t r = r0 + j;
          const int64_t index = __shfl_sync(0xffffffffu, my_index, j);
          const bool valid = index >= 0 && index < a.send_rows;
          if (!valid && lane == 0) refuse(a, detail::WaitOp::kAllToAllIndex, d, index, a.send_rows);
          for (int f = 0; f < a.fields; ++f) {
            const int64_t width = a.row_bytes[f];
            const int64_t at = row_at(a, my_region, f, placed_at, first + r);
            const uint8_t* src = a.send[f] + index * width;
            if (peer != nullptr) {
              if (valid) row_copy(peer + at, src, width, lane);
            } else if (valid) {
              nvshmemx_putmem_signal_warp(a.base + at, src, static_cast<size_t>(width), arrivals, 1,
                                          NVSHMEM_SIGNAL_ADD, d);
            } else if (lane == 0) {
              // The receiver counts every row: an unsent one still counts, its bytes stay stale.
              nvshmemx_signal_op(arrivals, 1, NVSHMEM_SIGNAL_ADD, d);
            }
          }
        }
      }
    }
    if (peer != nullptr) {
      // The piece's stores (every lane's) are visible at d before its count.
      __threadfence_system();
      __syncwarp();
      if (lane == 0) {
        atomicAdd_system(reinterpret_cast<unsigned long long*>(peer_word(peer, a.arrivals, a.my_pe)),
                         static_cast<unsigned long long>(rows * a.fields));
      }
    }
  }
  after_every_block(a.send_done, [&] {
    if (threadIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(a.uses) = round;
  });
}

__global__ void __launch_bounds__(kThreads) all_to_all_recv_kernel(const AllToAllArgs a) {
  __shared__ int64_t rows_from[kMaxPes];    // rows taken from each source (0 when refused)
  __shared__ int64_t offset_of[kMaxPes];    // first row of each source in the outputs
  __shared__ uint64_t expected[kMaxPes];    // each source's arrival counter once its rows are in
  __shared__ int64_t pieces[kMaxPes + 1];   // prefix over sources
  __shared__ int meta_seen[kMaxPes];
  const int n = a.n_pes;
  const int lane = threadIdx.x % 32;
  // Pieces sized by the bytes copied out (fields left in the region are not: a dispatch's meta
  // rows alone make pieces of hundreds of rows, not one row per piece).
  int64_t copied_bytes = 0;
  for (int f = 0; f < a.fields; ++f) copied_bytes += a.recv[f] != nullptr ? a.row_bytes[f] : 0;
  const int64_t per_piece = rows_per_piece(copied_bytes);
  // The send kernel of this call has moved the set's round count on.
  const uint64_t round = *reinterpret_cast<volatile uint64_t*>(a.uses);
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  for (int s = threadIdx.x; s < n; s += blockDim.x) {
    const bool seen = detail::wait_until_at_least(word(a, a.meta_signals, s), round, deadline,
                                                  a.status, detail::WaitOp::kAllToAllArrival, s,
                                                  a.my_pe);
    meta_seen[s] = seen;
    int64_t rows = 0;
    uint64_t units = 0;
    if (seen) {
      volatile uint64_t* pair = meta_pair(a.base, a.metas, s);
      const uint64_t meta = pair[0];
      const uint64_t tag = pair[1];
      const int64_t count = AllToAllLayout::meta_count(meta);
      const bool refused = AllToAllLayout::meta_refused(meta);
      const bool sender_compact = AllToAllLayout::meta_compact(meta);
      const int64_t placed =
          AllToAllLayout::placed_rows(meta, tag, a.capacity, a.fields, a.row_bytes_total, a.tag);
      // What the sender adds to our counter for this round, whether we take its rows or not; a
      // plain receiver tells a compact source it is dropped (here, once), so it sends nothing.
      units = AllToAllLayout::units_from(meta, tag, a.compact, a.capacity, a.fields, a.row_bytes_total, a.tag);
      if (!a.compact && sender_compact && !refused && blockIdx.x == 0)
        send_place(a, s, AllToAllLayout::pack_place(round, AllToAllLayout::kDroppedRow));
      if (a.refusal != 0) {
        // This PE refuses the call: it takes no rows (its outputs may be the reason) and records
        // nothing (its host throws); the units are still awaited and credited below.
      } else if (AllToAllLayout::meta_call_refused(meta)) {
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllRefusedBy, s, count, 0);
      } else if (refused) {
        if (blockIdx.x == 0 && count > a.capacity)
          refuse(a, detail::WaitOp::kAllToAllCapacityFrom, s, count, a.capacity);
      } else if (count < 0 || count > a.capacity) {  // never past this PE's region (init votes alike)
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllCapacityFrom, s, count, a.capacity);
      } else if (AllToAllLayout::meta_fields(meta) != (a.fields | (a.compact ? AllToAllLayout::kCompactFields : 0)) ||
                 AllToAllLayout::meta_row_bytes(meta) != a.row_bytes_total) {
        if (blockIdx.x == 0)
          refuse(a, detail::WaitOp::kAllToAllLayout, s, AllToAllLayout::meta_row_bytes(meta),
                 a.row_bytes_total);
      } else if (tag != a.tag) {  // another call's rows (MoE: another dispatch's handle)
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllTag, s, tag, a.tag);
      } else {
        rows = count;
      }
      // A compact call's rows are where place_sources put them, by the same rule (placed_rows
      // takes exactly the metas the checks above accept; none in refuse mode).
      if (a.compact) rows = placed;
    }
    rows_from[s] = rows;
    expected[s] = a.consumed[s] + units;
  }
  // Offsets and pieces by block-wide scans, one thread per source (n <= 2 x kThreads: at most
  // two passes; rows <= capacity < 2^31, n <= 2^10: no overflow). A compact call's offsets are
  // where its sources were placed (place_sources: the same meta words, the same rule), and it
  // copies nothing (no pieces): its rows are read where they landed.
  __syncthreads();
  int64_t offset_before = 0, pieces_before = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int s = base + threadIdx.x;
    const int64_t rows = s < n ? rows_from[s] : 0;
    int64_t pass_rows, pass_pieces;
    const int64_t offset = block_exclusive_scan(rows, int64_t{0}, AddInt64{}, &pass_rows);
    const int64_t before =
        block_exclusive_scan(a.compact ? 0 : pieces_of(rows, per_piece), int64_t{0}, AddInt64{}, &pass_pieces);
    if (s < n) {
      offset_of[s] = offset_before + offset;
      pieces[s] = pieces_before + before;
    }
    offset_before += pass_rows;
    pieces_before += pass_pieces;
  }
  if (threadIdx.x == 0) pieces[n] = pieces_before;
  __syncthreads();
  if (blockIdx.x == 0 && a.refusal == 0) {  // (refuse mode writes no output)
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      a.recv_counts[s] = rows_from[s];
      a.recv_offsets[s] = offset_of[s];
    }
  }
  const int64_t total = pieces[n];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int arrived = -1;  // the source whose rows this warp has seen arrive
  for (int64_t piece = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; piece < total;
       piece += warps) {
    const int s = find_slot(pieces, n, piece);
    if (s != arrived) {
      int ok = 1;
      if (lane == 0)
        ok = detail::wait_until_at_least(word(a, a.arrivals, s), expected[s], deadline, a.status,
                                         detail::WaitOp::kAllToAllArrival, s, a.my_pe);
      if (!__shfl_sync(0xffffffffu, ok, 0)) break;
      // Every lane's reads of the region come after lane 0 saw the rows' count.
      __syncwarp();
      __threadfence();
      arrived = s;
    }
    const int64_t first = (piece - pieces[s]) * per_piece;
    const int64_t rows = min(per_piece, rows_from[s] - first);
    const uint8_t* region = a.base + a.regions + static_cast<int64_t>(s) * a.region_bytes;
    for (int f = 0; f < a.fields; ++f) {
      if (a.recv[f] == nullptr) continue;  // left in the region for the caller's kernels
      const int64_t width = a.row_bytes[f];
      row_copy(a.recv[f] + (offset_of[s] + first) * width, region + a.field_start[f] + first * width,
               rows * width, lane);
    }
  }
  after_every_block(a.recv_done, [&] {
    // Every block has read what it copies: free the set's region to every source (after the
    // rows of a source whose rows were dropped have landed too).
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      if (!meta_seen[s]) continue;
      if (!detail::wait_until_at_least(word(a, a.arrivals, s), expected[s], deadline, a.status,
                                       detail::WaitOp::kAllToAllArrival, s, a.my_pe))
        continue;
      a.consumed[s] = expected[s];
      if (a.defer_credits) a.pending[s] = round;  // release() signals it after the readers
      else nvshmemx_signal_op(word(a, a.credits, a.my_pe), round, NVSHMEM_SIGNAL_SET, s);
    }
  });
}

// out[i] = the row locate(index[i]) points at, for i < min(*count, rows), one warp per row; a
// row whose locate() is nullptr, and rows past the count, are left as they are (the count is
// read on the device, so a captured launch follows it).
template <typename Locate>
__device__ __forceinline__ void gather_by_warps(uint8_t* out, const int64_t* index, const int64_t* count,
                                                int64_t rows, int64_t row_bytes, Locate&& locate) {
  const int64_t used = min(*count, rows);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; row < used;
       row += warps) {
    const uint8_t* from = locate(index[row]);
    if (from != nullptr) row_copy(out + row * row_bytes, from, row_bytes, lane);
  }
}

// out[i] = src[index[i]] (an index outside src: left as it is).
__global__ void __launch_bounds__(256)
    gather_rows_kernel(uint8_t* out, const uint8_t* src, const int64_t* index, const int64_t* count,
                       int64_t rows, int64_t src_rows, int64_t row_bytes) {
  gather_by_warps(out, index, count, rows, row_bytes, [&](int64_t from) -> const uint8_t* {
    return from < 0 || from >= src_rows ? nullptr : src + from * row_bytes;
  });
}


// ---- MoE layout kernels: one block each, no host synchronisation --------------------------
//
// Both are counting sorts with deterministic order: each thread (dispatch) or warp (receive)
// takes a contiguous stretch of the input, counts per bin, a block-wide exclusive scan of the
// counts gives every stretch its start in every bin, and a second pass writes the positions.
// One block: the counts are small (tokens x topk <= 2^31, at most kLayoutMaxBins bins) and a
// second launch or a grid-wide scan would cost more than the work.

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
static_assert(kMoeLayoutMaxBins <= kLayoutThreads, "moe_receive_layout scans the bins one per thread");
static_assert(kLayoutWarps <= 32 && kMoeLayoutMaxPes <= 64, "the layouts scan warps in one warp, PEs in two passes of one");

// Pairs whose loads a thread issues together before it uses (and stores after) any of them:
// a loop that loads, then stores through a pointer that may alias the next load, waits out one
// memory latency per pair (topk of them per token, once more per destination in pass 2).
constexpr int kPairBatch = 8;

// Batches of 32 pairs a warp of moe_receive_layout loads together (one memory round trip for
// them all) before it uses any: decode's (up to 6144 pairs: 768 rows of topk 8, e.g. 4 PEs of
// 128 tokens send at most 512) are one such round a warp, and pass 2 then places its pairs from
// what pass 1 kept in registers. (8 batches spilled registers under the 64 of 1024 threads.)
constexpr int kReceiveBatches = 6;
constexpr int kReceiveRoundPairs = 32 * kReceiveBatches;

// Per-warp counts (counts[w][c], w < warps <= 32, c < columns) into exclusive bases over warps,
// each column's total into totals[c]: warp w scans columns w, w + 32, ..., one lane per warp
// (one thread walking a column's 32 warps was 32 dependent shared-memory steps).
template <typename T, int kColumns>
__device__ __forceinline__ void exclusive_over_warps(T (*counts)[kColumns], int warps, int columns,
                                                     T* totals) {
  const int lane = threadIdx.x % 32;
  for (int c = threadIdx.x / 32; c < columns; c += blockDim.x / 32) {
    const T count = lane < warps ? counts[lane][c] : T{0};
    const T inclusive = warp_inclusive_scan(count, lane);
    if (lane < warps) counts[lane][c] = inclusive - count;
    if (lane == 31) totals[c] = inclusive;
  }
}

// The sender's side (dispatch_plan in _moe.py is the reference). For each destination d (and
// d == n_pes: "no expert"), a thread's count is packed as (tokens it sends to d) << 32 | (pairs
// it has with d): both fit 32 bits (tokens x topk <= 2^31 - 1, checked by the caller), so one
// 64-bit scan does both.
//
// Decode (tokens <= kLayoutThreads, topk <= kPairBatch) takes a path of its own: thread t owns
// token t (the launcher gives it a block of that many lanes, not 1024 of which most would only
// take issue slots from the others in every scan and barrier), and its critical path is one
// memory round trip (the ids), one 64-bit warp scan per 4 destinations (16-bit fields), two
// block barriers, and stores. The general path: thread i owns tokens [i * per_thread,
// + per_thread) and reads its pairs' PEs back from pair_pe.
template <typename Id>
__global__ void __launch_bounds__(kLayoutThreads)
    moe_dispatch_layout_kernel(const Id* ids, int64_t tokens, int topk, int64_t num_experts,
                               int64_t experts_per_pe, int n_pes, int64_t* send_counts,
                               int64_t* send_index, int32_t* meta, int64_t* pair_pe,
                               int64_t* pair_rank) {
  __shared__ uint64_t warp_base[kLayoutWarps][kMoeLayoutMaxPes + 1];  // exclusive, per destination
  __shared__ uint64_t dest_total[kMoeLayoutMaxPes + 1];  // packed, over the whole block
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;  // (<= kLayoutWarps; decode's block has one lane a token)
  // The division in 32 bits: a valid id is in [0, num_experts) and num_experts < 2^31 (checked
  // on the host), so id and experts_per_pe (<= num_experts) are non-negative int32 values, and
  // the quotient is the 64-bit one.
  const int32_t per_pe = static_cast<int32_t>(experts_per_pe);
  const int64_t index_rows = static_cast<int64_t>(n_pes) * tokens + 1;
  if (tokens <= blockDim.x && topk <= kPairBatch) {  // (the same for the whole block)
    const int t = threadIdx.x;
    const bool has_token = t < tokens;
    int32_t pe[kPairBatch];  // the PE of pair (t, u) (n_pes: no expert; -1: no pair)
    {
      int64_t id[kPairBatch];
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u)
        id[u] = has_token && u < topk ? static_cast<int64_t>(ids[t * topk + u]) : -1;
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u) {
        pe[u] = -1;
        if (!has_token || u >= topk) continue;
        const bool valid = id[u] >= 0 && id[u] < num_experts;
        pe[u] = valid ? static_cast<int32_t>(id[u]) / per_pe : n_pes;
        pair_pe[t * topk + u] = pe[u];
        meta[t * (topk + 1) + u] = valid ? static_cast<int32_t>(id[u]) : -1;
      }
      if (has_token) meta[t * (topk + 1) + topk] = t;
    }
    // Per warp, destinations 4 at a time: 16-bit fields of (token sent) << 9 | pairs, which a
    // warp's sums keep apart (<= 32 << 9 | 32 x 8 < 2^16). The exclusive field of each pair's
    // destination (tokens and pairs to it from the lanes before) stays in a register.
    uint32_t before[kPairBatch] = {};
    for (int d0 = 0; d0 <= n_pes; d0 += 4) {
      uint64_t fields = 0;
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u) {
        const int slot = pe[u] - d0;
        if (slot >= 0 && slot < 4) fields += uint64_t{1} << (16 * slot);
      }
#pragma unroll
      for (int slot = 0; slot < 4; ++slot)
        if (d0 + slot < n_pes && ((fields >> (16 * slot)) & 0xffffu) != 0) fields += uint64_t{1} << (16 * slot + 9);
      const uint64_t inclusive = warp_inclusive_scan(fields, lane);
      const uint64_t exclusive = inclusive - fields;
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u) {
        const int slot = pe[u] - d0;
        if (slot >= 0 && slot < 4) before[u] = static_cast<uint32_t>(exclusive >> (16 * slot)) & 0xffffu;
      }
      if (lane == 31) {
#pragma unroll
        for (int slot = 0; slot < 4; ++slot) {
          if (d0 + slot > n_pes) break;
          const uint32_t field = static_cast<uint32_t>(inclusive >> (16 * slot)) & 0xffffu;
          warp_base[warp][d0 + slot] = static_cast<uint64_t>(field >> 9) << 32 | (field & 0x1ffu);
        }
      }
    }
    __syncthreads();
    exclusive_over_warps(warp_base, warps, n_pes + 1, dest_total);
    __syncthreads();
    // Every warp scans the destinations' token counts itself (lane l: destinations l, l + 32):
    // no third barrier behind one warp doing it.
    const int32_t count_low = lane < n_pes ? static_cast<int32_t>(dest_total[lane] >> 32) : 0;
    const int32_t count_high = lane + 32 < n_pes ? static_cast<int32_t>(dest_total[lane + 32] >> 32) : 0;
    const int32_t inclusive_low = warp_inclusive_scan(count_low, lane);
    const int32_t inclusive_high = warp_inclusive_scan(count_high, lane);
    const int32_t total_low = __shfl_sync(0xffffffffu, inclusive_low, 31);
    const int32_t start_low = inclusive_low - count_low;
    const int32_t start_high = total_low + inclusive_high - count_high;
    const int32_t rows_sent = total_low + __shfl_sync(0xffffffffu, inclusive_high, 31);
    if (warp == 0) {
      if (lane < n_pes) send_counts[lane] = count_low;
      if (lane + 32 < n_pes) send_counts[lane + 32] = count_high;
    }
    // Entries past the rows sent (and the spare last one) are never read; zeros, to be definite.
    for (int64_t i = rows_sent + threadIdx.x; i < index_rows; i += blockDim.x) send_index[i] = 0;
    // Positions. Tokens in order within a destination; pairs in (token, k) order.
#pragma unroll
    for (int u = 0; u < kPairBatch; ++u) {
      const int d = pe[u];
      // (Every lane shuffles, whether its pair exists or not: full masks, no divergence.)
      const int32_t start_of_low = __shfl_sync(0xffffffffu, start_low, d & 31);
      const int32_t start_of_high = __shfl_sync(0xffffffffu, start_high, d & 31);
      if (d >= 0) {
        int same_before = 0;  // pairs of this token before u with the same destination
#pragma unroll
        for (int v = 0; v < u; ++v) same_before += pe[v] == d;
        const uint64_t base = warp_base[warp][d];
        pair_rank[t * topk + u] = static_cast<int64_t>(base & 0xffffffffull) + (before[u] & 0x1ffu) + same_before;
        if (same_before == 0 && d < n_pes)
          send_index[(d < 32 ? start_of_low : start_of_high) + static_cast<int64_t>(base >> 32) + (before[u] >> 9)] = t;
      }
    }
    return;
  }
  __shared__ int64_t dest_start[kMoeLayoutMaxPes + 1];  // first send_index entry of each PE
  const int64_t per_thread = (tokens + blockDim.x - 1) / blockDim.x;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * per_thread;
  const int64_t last = min(tokens, first + per_thread);
  // Pass 0: each pair's PE (n_pes: no expert) and the meta rows sent along.
  for (int64_t t = first; t < last; ++t) {
    for (int k0 = 0; k0 < topk; k0 += kPairBatch) {
      int64_t id[kPairBatch];
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u)
        id[u] = k0 + u < topk ? static_cast<int64_t>(ids[t * topk + k0 + u]) : -1;
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u) {
        const int k = k0 + u;
        if (k >= topk) break;
        const bool valid = id[u] >= 0 && id[u] < num_experts;
        const int32_t pe = valid ? static_cast<int32_t>(id[u]) / per_pe : n_pes;
        pair_pe[t * topk + k] = pe;
        meta[t * (topk + 1) + k] = valid ? static_cast<int32_t>(id[u]) : -1;
      }
    }
    meta[t * (topk + 1) + topk] = static_cast<int32_t>(t);
  }
  // The PEs of pairs (t, k0 ..< k0 + kPairBatch) of this thread's tokens (-1 past topk): its
  // own pass-0 writes, kPairBatch loads issued together.
  auto load_pes = [&](int64_t t, int k0, int32_t (&pe)[kPairBatch]) {
#pragma unroll
    for (int u = 0; u < kPairBatch; ++u)
      pe[u] = k0 + u < topk ? static_cast<int32_t>(pair_pe[t * topk + k0 + u]) : -1;
  };
  // The pairs of token t that go to destination d, in k order: on_pair(k, rank among them) for
  // each; returns their count.
  auto pairs_to = [&](int64_t t, int d, auto&& on_pair) {
    int64_t pairs = 0;
    for (int k0 = 0; k0 < topk; k0 += kPairBatch) {
      int32_t pe[kPairBatch];
      load_pes(t, k0, pe);
#pragma unroll
      for (int u = 0; u < kPairBatch; ++u)
        if (pe[u] == d) on_pair(k0 + u, pairs++);  // (-1, also every u past topk, is never a destination)
    }
    return pairs;
  };
  // This thread's packed count for destination d: tokens in the high 32 bits, pairs in the low.
  auto count_for = [&](int d) {
    uint64_t packed = 0;
    for (int64_t t = first; t < last; ++t) {
      const auto pairs = static_cast<uint64_t>(pairs_to(t, d, [](int, int64_t) {}));
      packed += pairs + ((pairs > 0 && d < n_pes) ? (uint64_t{1} << 32) : 0);
    }
    return packed;
  };
  // Pass 1: every warp's total per destination.
  for (int d = 0; d <= n_pes; ++d) {
    const uint64_t inclusive = warp_inclusive_scan(count_for(d), lane);
    if (lane == 31) warp_base[warp][d] = inclusive;
  }
  __syncthreads();
  exclusive_over_warps(warp_base, warps, n_pes + 1, dest_total);
  __syncthreads();
  if (warp == 0) {  // tokens for each destination, and their start: a scan over <= 64 of them
    int64_t carry = 0;
    for (int base = 0; base < n_pes; base += 32) {
      const int d = base + lane;
      const int64_t count = d < n_pes ? static_cast<int64_t>(dest_total[d] >> 32) : 0;
      const int64_t inclusive = warp_inclusive_scan(count, lane);
      if (d < n_pes) {
        send_counts[d] = count;
        dest_start[d] = carry + inclusive - count;
      }
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) dest_start[n_pes] = carry;  // rows sent in all
  }
  __syncthreads();
  // Entries past the rows sent (and the spare last one) are never read; zeros, to be definite.
  for (int64_t i = dest_start[n_pes] + threadIdx.x; i < index_rows; i += blockDim.x) send_index[i] = 0;
  // Pass 2: positions. Tokens in order within a destination; pairs in (token, k) order.
  for (int d = 0; d <= n_pes; ++d) {
    const uint64_t mine = count_for(d);
    const uint64_t before = warp_inclusive_scan(mine, lane) - mine + warp_base[warp][d];
    int64_t token_at = static_cast<int64_t>(before >> 32);
    int64_t pair_at = static_cast<int64_t>(before & 0xffffffffull);
    for (int64_t t = first; t < last; ++t) {
      const int64_t pairs =
          pairs_to(t, d, [&](int k, int64_t rank) { pair_rank[t * topk + k] = pair_at + rank; });
      if (pairs > 0 && d < n_pes) send_index[dest_start[d] + token_at++] = t;
      pair_at += pairs;
    }
  }
}

// The receiver's side (receive_layout in _moe.py is the reference): pairs (received row, k),
// rows*topk of them, sorted stably by local expert (bin experts_per_pe: none here, or a row not
// in use), and the pairs of a local expert in (row, k) order once more for combine. Warp w owns
// pairs [w * stretch, + stretch), 32 at a time; __match_any_sync ranks a batch's lanes of one
// bin in lane order, and warp-private histograms (exclusive over warps after pass 1) place them.
//
// Critical path (decode: <= kReceiveRoundPairs pairs a warp, one round): one memory round trip
// (every pair's id and token and the receive counts, loaded together up front), four block
// barriers; pass 2 places the pairs from what pass 1 kept in registers and only stores.
__global__ void __launch_bounds__(kLayoutThreads)
    moe_receive_layout_kernel(const int32_t* recv_meta, int64_t rows, int topk,
                              const int64_t* recv_counts, int n_pes, int my_pe,
                              int64_t experts_per_pe, int64_t* row_of, int64_t* expert_counts,
                              int64_t* expert_offsets, int64_t* num_rows, int64_t* expert_of_row,
                              int64_t* source_pe, int64_t* source_token, int64_t* combine_index,
                              int64_t* combine_counts, int64_t* pair_position) {
  __shared__ int32_t hist[kLayoutWarps][kMoeLayoutMaxBins];
  __shared__ int32_t bin_start[kMoeLayoutMaxBins];
  __shared__ int32_t valid_base[kLayoutWarps];
  __shared__ int64_t source_start[kMoeLayoutMaxPes + 1];
  __shared__ int32_t back_counts[kMoeLayoutMaxPes];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  constexpr int warps = kLayoutWarps;  // (the launcher's block: divisions by it are shifts)
  const int bins = static_cast<int>(experts_per_pe) + 1;
  const int none = bins - 1;
  const int64_t pairs = rows * topk;  // < 2^31 (checked by the caller)
  // (< kMaxPes x kMaxBins: 32 bits; a pair's local expert is (uint32_t)(id - first_expert).)
  const uint32_t first_expert = static_cast<uint32_t>(my_pe) * static_cast<uint32_t>(experts_per_pe);
  const int64_t stretch = ((pairs + warps - 1) / warps + 31) / 32 * 32;
  const int64_t begin = warp * stretch;
  const int64_t end = min(pairs, begin + stretch);
  const bool one_round = stretch <= kReceiveRoundPairs;  // (the same for every warp)
  const unsigned below = (1u << lane) - 1u;
  // A round's pairs are p = round + 32 j + lane (j < kReceiveBatches), present while
  // 32 j + lane < end - round. Pair p is (row, k), row * topk + k = p: the first batch's by one
  // division, each next one by adds (32 warps issue all their instructions on 4 schedulers,
  // and a division a pair was ~20 of them). Unsigned: past the stretch they may pass 2^31.
  const uint32_t rows_a_batch = 32u / static_cast<uint32_t>(topk);
  const uint32_t ks_a_batch = 32u % static_cast<uint32_t>(topk);
  struct PairAt {
    uint32_t row, k;
  };
  auto first_pair = [&](int64_t round) {
    const uint32_t p = static_cast<uint32_t>(round) + lane;
    const uint32_t row = p / static_cast<uint32_t>(topk);
    return PairAt{row, p - row * static_cast<uint32_t>(topk)};
  };
  auto next_batch = [&](PairAt& at) {
    at.row += rows_a_batch;
    at.k += ks_a_batch;
    if (at.k >= static_cast<uint32_t>(topk)) {
      at.k -= topk;
      ++at.row;
    }
  };
  // A round's expert ids and their rows' tokens, every load issued before any is used (-1 for
  // no pair). A present pair is one of a row < rows, in recv_meta, whether in use or not.
  int32_t expert_id[kReceiveBatches];
  int32_t token[kReceiveBatches];
  auto load_round = [&](int64_t round) {
    const int64_t left = end - round;
    PairAt at = first_pair(round);
#pragma unroll
    for (int j = 0; j < kReceiveBatches; ++j) {
      expert_id[j] = -1;
      token[j] = -1;
      if (32 * j + lane < left) {
        const int64_t row_start = static_cast<int64_t>(at.row) * (topk + 1);
        expert_id[j] = recv_meta[row_start + at.k];
        token[j] = recv_meta[row_start + topk];
      }
      next_batch(at);
    }
  };
  if (begin < end) load_round(begin);  // in flight across the prologue and its barrier
  for (int b = lane; b < bins; b += 32) hist[warp][b] = 0;  // (columns past bins: never read)
  for (int s = threadIdx.x; s < n_pes; s += blockDim.x) back_counts[s] = 0;
  if (warp == 0) {  // each source's first row: a scan over <= 64 counts, one lane each
    int64_t carry = 0;
    for (int base = 0; base < n_pes; base += 32) {
      const int s = base + lane;
      const int64_t count = s < n_pes ? recv_counts[s] : 0;
      const int64_t used = count > 0 ? count : 0;
      const int64_t inclusive = warp_inclusive_scan(used, lane);
      if (s < n_pes) source_start[s] = carry + inclusive - used;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) source_start[n_pes] = carry < rows ? carry : rows;  // rows in use
  }
  __syncthreads();
  const uint32_t rows_in_use = static_cast<uint32_t>(source_start[n_pes]);  // (<= rows < 2^31)
  // A pair's bin (-1: not present, a lane with nothing) and its row's source (n_pes: not a row
  // in use).
  auto classify = [&](bool present, PairAt at, int32_t id, int& bin, int& source) {
    bin = -1;
    source = n_pes;
    if (!present) return;
    bin = none;
    if (at.row >= rows_in_use) return;
    source = find_slot(source_start, n_pes, at.row);
    const uint32_t local = static_cast<uint32_t>(id) - first_expert;
    if (local < static_cast<uint32_t>(experts_per_pe)) bin = static_cast<int>(local);
  };
  // A batch's pair's offset among this warp's pairs of its bin so far (hist[warp], which the
  // batch's lowest lane of each bin then moves on), and which lanes hold a valid pair.
  auto rank_batch = [&](int bin, unsigned& valid_lanes) -> int32_t {
    const unsigned same = __match_any_sync(0xffffffffu, bin);
    valid_lanes = __ballot_sync(0xffffffffu, bin >= 0 && bin != none);
    const int32_t before = bin >= 0 ? hist[warp][bin] : 0;
    __syncwarp();  // every lane has read hist before the leaders move it on
    if (bin >= 0 && (same & below) == 0) hist[warp][bin] = before + __popc(same);
    __syncwarp();  // the next batch reads the moved counts
    return before + __popc(same & below);
  };
  // Valid pairs per source: lanes of one source are a run (rows ascend with the lane), and the
  // first lane of each run adds the run's valid pairs: one shared atomic a run, not one a pair.
  auto count_sources = [&](int source, unsigned valid_lanes) {
    const int previous = __shfl_up_sync(0xffffffffu, source, 1);
    const bool starts_run = lane == 0 || previous != source;
    const unsigned run_starts = __ballot_sync(0xffffffffu, starts_run);
    if (!starts_run || source >= n_pes) return;
    const unsigned later = run_starts & ~below & ~(1u << lane);
    const unsigned run = (later != 0 ? (later & (0u - later)) - 1u : 0xffffffffu) & ~below;
    const int count = __popc(valid_lanes & run);
    if (count > 0) atomicAdd(&back_counts[source], count);
  };
  // Pass 1: per-warp counts of each bin, of valid pairs, and of valid pairs per source. With
  // one round, each pair's state stays for pass 2 in one word: bin + 1 (9 bits: <= 257),
  // source (7 bits: <= 64), offset in its bin and among valid pairs within the warp (8 bits
  // each: a round is kReceiveRoundPairs <= 256 pairs).
  static_assert(kMoeLayoutMaxBins < 512 && kMoeLayoutMaxPes < 128 && kReceiveRoundPairs <= 256,
                "a pair's state: 9 + 7 + 8 + 8 bits");
  uint32_t state[kReceiveBatches] = {};
  int32_t valid_here = 0;
  // One round's batches (loaded), each pair's state returned.
  auto count_round = [&](int64_t round, auto&& keep) {
    const int64_t left = end - round;
    PairAt at = first_pair(round);
#pragma unroll
    for (int j = 0; j < kReceiveBatches; ++j, next_batch(at)) {
      if (32 * j >= left) break;  // (the same for the whole warp)
      int bin, source;
      classify(32 * j + lane < left, at, expert_id[j], bin, source);
      unsigned valid_lanes;
      const int32_t offset = rank_batch(bin, valid_lanes);
      count_sources(source, valid_lanes);
      keep(j, static_cast<uint32_t>(bin + 1) | static_cast<uint32_t>(source) << 9 |
                  (static_cast<uint32_t>(offset) & 0xffu) << 16 |
                  static_cast<uint32_t>(valid_here + __popc(valid_lanes & below)) << 24);
      valid_here += __popc(valid_lanes);
    }
  };
  if (one_round) {
    if (begin < end) count_round(begin, [&](int j, uint32_t pair_state) { state[j] = pair_state; });
  } else {  // (no state kept: registers for the loads)
    for (int64_t round = begin; round < end; round += kReceiveRoundPairs) {
      if (round != begin) load_round(round);
      count_round(round, [](int, uint32_t) {});
    }
  }
  if (lane == 0) valid_base[warp] = valid_here;
  __syncthreads();
  // Each bin's count exclusive over warps (its total into bin_start for now), the warps' valid
  // pairs exclusive (the last warp, which has the fewest bins), the counts per source.
  exclusive_over_warps(hist, warps, bins, bin_start);
  if (warp == warps - 1) {
    const int32_t count = valid_base[lane];
    const int32_t inclusive = warp_inclusive_scan(count, lane);
    valid_base[lane] = inclusive - count;
  }
  for (int s = threadIdx.x; s < n_pes; s += blockDim.x) combine_counts[s] = back_counts[s];
  __syncthreads();
  if (warp == 0) {  // the bins' starts: lane l scans bins [l * per_lane, + per_lane), <= 9 of them
    constexpr int kMaxPerLane = (kMoeLayoutMaxBins + 31) / 32;
    const int per_lane = (bins + 31) / 32;
    const int first_bin = lane * per_lane;
    int32_t count[kMaxPerLane];
    int32_t sum = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int b = first_bin + i;
      count[i] = i < per_lane && b < bins ? bin_start[b] : 0;
      sum += count[i];
    }
    int32_t offset = warp_inclusive_scan(sum, lane) - sum;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int b = first_bin + i;
      if (i >= per_lane || b >= bins) break;
      bin_start[b] = offset;
      if (b < none) {
        expert_counts[b] = count[i];
        expert_offsets[b] = offset;
      } else {
        num_rows[0] = offset;
      }
      offset += count[i];
    }
  }
  __syncthreads();
  // combine_index past the valid pairs (and its spare last entry): never read; zeros.
  for (int64_t i = bin_start[none] + threadIdx.x; i <= pairs; i += blockDim.x) combine_index[i] = 0;
  // Pass 2: the positions. One pair's outputs:
  auto place = [&](int64_t p, int64_t row, int bin, int source, int32_t token_of_row,
                   int64_t position, int64_t valid_index) {
    const bool valid = bin != none;
    row_of[position] = row;
    expert_of_row[position] = bin;
    source_pe[position] = valid ? source : -1;
    source_token[position] = valid ? token_of_row : -1;
    if (valid) combine_index[valid_index] = position;
    if (pair_position != nullptr) pair_position[p] = valid ? position : -1;
  };
  if (one_round) {
    const int32_t warp_valid = valid_base[warp];
    const int64_t left = end - begin;
    PairAt at = first_pair(begin);
#pragma unroll
    for (int j = 0; j < kReceiveBatches; ++j, next_batch(at)) {
      if (32 * j >= left) break;
      const int bin = static_cast<int>(state[j] & 0x1ffu) - 1;
      if (bin < 0) continue;
      const int64_t position =
          static_cast<int64_t>(bin_start[bin]) + hist[warp][bin] + ((state[j] >> 16) & 0xffu);
      place(begin + 32 * j + lane, at.row, bin, static_cast<int>((state[j] >> 9) & 0x7fu), token[j],
            position, warp_valid + static_cast<int32_t>(state[j] >> 24));
    }
  } else {  // load and rank once more, round by round (hist[warp] now starts at the warp's base)
    int32_t valid_at = valid_base[warp];
    for (int64_t round = begin; round < end; round += kReceiveRoundPairs) {
      load_round(round);
      const int64_t left = end - round;
      PairAt at = first_pair(round);
#pragma unroll
      for (int j = 0; j < kReceiveBatches; ++j, next_batch(at)) {
        if (32 * j >= left) break;
        int bin, source;
        classify(32 * j + lane < left, at, expert_id[j], bin, source);
        unsigned valid_lanes;
        const int32_t offset = rank_batch(bin, valid_lanes);
        if (bin >= 0)
          place(round + 32 * j + lane, at.row, bin, source, token[j],
                static_cast<int64_t>(bin_start[bin]) + offset, valid_at + __popc(valid_lanes & below));
        valid_at += __popc(valid_lanes);
      }
    }
  }
}

// A deferred call's credits (AllToAll::release), after the kernels that read its regions.
__global__ void all_to_all_release_kernel(uint64_t* pending, uint64_t* credits, int my_pe, int n_pes) {
  for (int s = threadIdx.x; s < n_pes; s += blockDim.x) {
    const uint64_t round = pending[s];
    if (round == 0) continue;  // nothing owed (the source's round failed: no credit)
    pending[s] = 0;
    nvshmemx_signal_op(credits + my_pe, round, NVSHMEM_SIGNAL_SET, s);
  }
}

// Each source's first received row and its count into shared memory, side by side (a row's
// count read from global memory after its source was found was one more dependent memory round
// trip per row); the whole block calls it.
__device__ __forceinline__ void load_sources(int64_t* start, int64_t* counts, const int64_t* recv_offsets,
                                             const int64_t* recv_counts, int n_sources) {
  for (int s = threadIdx.x; s < n_sources; s += blockDim.x) {
    start[s] = recv_offsets[s];
    counts[s] = recv_counts[s];
  }
  __syncthreads();
}

// gather_rows from the receive regions: received row j is source s's row j - offsets[s].
__global__ void __launch_bounds__(256)
    gather_region_rows_kernel(uint8_t* out, const uint8_t* region, int64_t stride,
                              const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                              const int64_t* index, const int64_t* count, int64_t rows, int64_t row_bytes) {
  __shared__ int64_t start[AllToAllLayout::kMaxPes + 1];
  __shared__ int64_t counts[AllToAllLayout::kMaxPes];
  load_sources(start, counts, recv_offsets, recv_counts, n_sources);
  gather_by_warps(out, index, count, rows, row_bytes, [&](int64_t from) -> const uint8_t* {
    const int s = find_slot(start, n_sources, from);  // start[s] <= from (or s == 0)
    const int64_t at = from - start[s];
    return at < 0 || at >= counts[s] ? nullptr : region + s * stride + at * row_bytes;  // (not received)
  });
}

// Each received row read once (8 16-byte vectors per lane, 4 KiB per warp at a time) and
// stored to every recv_x row it has (its pairs' positions, up to topk).
__global__ void __launch_bounds__(256)
    scatter_region_rows_kernel(uint8_t* out, int64_t out_rows, const uint8_t* region, int64_t stride,
                               const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                               const int64_t* positions, int topk, int64_t rows, int64_t row_bytes) {
  __shared__ int64_t start[AllToAllLayout::kMaxPes + 1];
  __shared__ int64_t counts[AllToAllLayout::kMaxPes];
  load_sources(start, counts, recv_offsets, recv_counts, n_sources);
  const int64_t received = start[n_sources - 1] + counts[n_sources - 1];
  const int64_t used = min(received, rows);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  constexpr int kUnroll = 8;
  const int64_t vectors = row_bytes / 16;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; row < used;
       row += warps) {
    const int s = find_slot(start, n_sources, row);
    const int64_t at = row - start[s];
    if (at < 0 || at >= counts[s]) continue;
    const int4* src = reinterpret_cast<const int4*>(region + s * stride + at * row_bytes);
    const int64_t* row_positions = positions + row * topk;
    for (int k0 = 0; k0 < topk; k0 += 32) {
      // Up to 32 of the row's positions, one per lane; the valid ones, lane by lane.
      const int64_t mine = k0 + lane < topk ? row_positions[k0 + lane] : -1;
      unsigned targets = __ballot_sync(0xffffffffu, mine >= 0 && mine < out_rows);
      if (targets == 0) continue;
      for (int64_t v0 = 0; v0 < vectors; v0 += 32 * kUnroll) {
        int4 chunk[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + u * 32 + lane;
          if (v < vectors) chunk[u] = src[v];
        }
        for (unsigned left = targets; left != 0; left &= left - 1) {
          const int64_t position = __shfl_sync(0xffffffffu, mine, __ffs(left) - 1);
          int4* dst = reinterpret_cast<int4*>(out + position * row_bytes);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + u * 32 + lane;
            if (v < vectors) dst[v] = chunk[u];
          }
        }
      }
    }
  }
}

// Where (token, k)'s row is for the reductions: a compacted tensor's slot, or a source's row
// in combine's receive region. Null: skipped.
struct SlotRows {
  const uint8_t* rows;
  int64_t row_count, row_bytes;
  const int64_t* slots;
  __device__ __forceinline__ const uint8_t* operator()(int64_t pair) const {
    const int64_t slot = slots[pair];
    return slot >= 0 && slot < row_count ? rows + slot * row_bytes : nullptr;
  }
};
struct RegionRows {
  const uint8_t* region;
  int64_t stride, row_bytes;
  const int64_t *pair_pe, *pair_rank, *back_counts;
  int n_sources;
  __device__ __forceinline__ const uint8_t* operator()(int64_t pair) const {
    const int64_t pe = pair_pe[pair];
    if (pe < 0 || pe >= n_sources) return nullptr;
    const int64_t rank = pair_rank[pair];
    return rank >= 0 && rank < back_counts[pe] ? region + pe * stride + rank * row_bytes : nullptr;
  }
};

template <typename T, typename Rows>
__global__ void __launch_bounds__(256)
    combine_reduce_rows_kernel(T* out, Rows rows_of, const float* weights, int64_t tokens,
                               int64_t topk, int64_t hidden) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const auto row = [&](int64_t k) -> const uint8_t* { return rows_of(t * topk + k); };
    const auto weight = [&](int64_t k) { return weights[t * topk + k]; };
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
      out[t * hidden + h] = weighted_sum_element<T>(h, topk, row, weight);
  }
}

// 16-byte vectors (rows 16-byte aligned, hidden x element a multiple of 16): a thread keeps one
// vector of each of the token's rows in flight; the per-element arithmetic of the scalar kernel.
constexpr int kReduceBatch = 8;  // rows of a token whose vectors a thread loads together

template <typename T, typename Rows>
__global__ void __launch_bounds__(256)
    combine_reduce_rows_vector_kernel(T* out, Rows rows_of, const float* weights, int64_t tokens,
                                      int64_t topk, int64_t hidden) {
  constexpr int kPer = 16 / sizeof(T);
  extern __shared__ int64_t reduce_rows_shared[];
  const uint8_t** token_rows = reinterpret_cast<const uint8_t**>(reduce_rows_shared);
  float* token_weights = reinterpret_cast<float*>(token_rows + topk);
  const int64_t vectors = hidden / kPer;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's rows are no longer read
    for (int64_t k = threadIdx.x; k < topk; k += blockDim.x) {
      token_rows[k] = rows_of(t * topk + k);
      token_weights[k] = weights[t * topk + k];
    }
    __syncthreads();
    const auto row = [&](int64_t k) -> const uint8_t* { return token_rows[k]; };
    const auto weight = [&](int64_t k) { return token_weights[k]; };
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x)
      reinterpret_cast<int4*>(out + t * hidden)[v] = weighted_sum_vector<T, kReduceBatch>(v, topk, row, weight);
  }
}

template <typename T, typename Rows>
void launch_reduce_rows(T* out, Rows rows_of, bool vector, const float* weights, int64_t tokens,
                        int64_t topk, int64_t hidden, cudaStream_t stream) {
  const int blocks = static_cast<int>(tokens < 65535 ? tokens : 65535);
  if (vector) {
    const std::size_t shared = static_cast<std::size_t>(topk) * (sizeof(void*) + sizeof(float));
    PDC_REQUIRE(shared <= 48 * 1024, "moe_combine_reduce: topk " << topk << " is too large");
    combine_reduce_rows_vector_kernel<T, Rows><<<blocks, 256, shared, stream>>>(out, rows_of, weights, tokens,
                                                                                topk, hidden);
  } else {
    combine_reduce_rows_kernel<T, Rows><<<blocks, 256, 0, stream>>>(out, rows_of, weights, tokens, topk, hidden);
  }
  PDC_CHECK_CUDA(cudaGetLastError());
}

template <typename Rows>
void reduce_rows_by_dtype(void* out, Rows rows_of, bool aligned, const float* weights, int64_t tokens,
                          int64_t topk, int64_t hidden, int dtype, cudaStream_t stream) {
  const int64_t element = dtype == kReduceFloat32 ? 4 : 2;
  const bool vector = aligned && (reinterpret_cast<uintptr_t>(out) & 15) == 0 && (hidden * element) % 16 == 0;
  switch (dtype) {
    case kReduceFloat32: launch_reduce_rows(static_cast<float*>(out), rows_of, vector, weights, tokens, topk, hidden, stream); break;
    case kReduceBfloat16: launch_reduce_rows(static_cast<__nv_bfloat16*>(out), rows_of, vector, weights, tokens, topk, hidden, stream); break;
    case kReduceFloat16: launch_reduce_rows(static_cast<__half*>(out), rows_of, vector, weights, tokens, topk, hidden, stream); break;
    default:
      PDC_REQUIRE(false, "moe_combine_reduce: dtype code " << dtype << " is not float32 (0), bfloat16 (1) or float16 (2)");
  }
}
}  // namespace

void launch_gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count,
                        int64_t rows, int64_t src_rows, int64_t row_bytes, int blocks,
                        cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  gather_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(src),
                                                 index, count, rows, src_rows, row_bytes);
  PDC_CHECK_CUDA(cudaGetLastError());
}

namespace {
// Rows [first, rows) of out zeroed, first = the sum of counts[0, n) (device int64: no host read,
// a captured launch follows it), clamped to [0, rows]. Every block sums the counts itself (n is
// at most kMaxPes: cheaper than a second launch).
__global__ void __launch_bounds__(256)
    zero_rows_past_kernel(uint8_t* out, int64_t rows, int64_t row_bytes, const int64_t* counts, int n) {
  __shared__ int64_t first_shared;
  if (threadIdx.x == 0) {
    int64_t first = 0;
    for (int i = 0; i < n; ++i) first += max(counts[i], int64_t{0});
    first_shared = min(first, rows);
  }
  __syncthreads();
  const int64_t begin = first_shared * row_bytes, end = rows * row_bytes;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (((reinterpret_cast<uintptr_t>(out) | static_cast<uintptr_t>(begin) | static_cast<uintptr_t>(end)) & 15) == 0) {
    for (int64_t v = begin / 16 + tid; v < end / 16; v += step) reinterpret_cast<int4*>(out)[v] = make_int4(0, 0, 0, 0);
  } else {
    for (int64_t b = begin + tid; b < end; b += step) out[b] = 0;
  }
}
}  // namespace

void launch_zero_rows_past(void* out, int64_t rows, int64_t row_bytes, const int64_t* counts, int n_counts,
                           int blocks, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  zero_rows_past_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out), rows, row_bytes, counts, n_counts);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_all_to_all(const AllToAllArgs& args, int blocks, cudaStream_t stream) {
  // (Summed rows always come with their slots; sum_rows alone may be null: no rows to sum.)
  if (args.sum_slots != nullptr) {
    all_to_all_send_kernel<true><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    all_to_all_send_kernel<false><<<blocks, kThreads, 0, stream>>>(args);
  }
  PDC_CHECK_CUDA(cudaGetLastError());
  all_to_all_recv_kernel<<<blocks, kThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_moe_dispatch_layout(const void* topk_idx, bool ids_int32, int64_t tokens, int topk,
                                int64_t num_experts, int n_pes, int64_t* send_counts,
                                int64_t* send_index, int32_t* meta, int64_t* pair_pe,
                                int64_t* pair_rank, cudaStream_t stream) {
  const int64_t per_pe = num_experts / n_pes;
  // One lane a token (whole warps, at least one) where the kernel's one-token-per-thread path
  // takes them all; else the whole block.
  const int threads = tokens <= kLayoutThreads && topk <= kPairBatch
                          ? static_cast<int>(std::max<int64_t>(32, (tokens + 31) / 32 * 32))
                          : kLayoutThreads;
  if (ids_int32) {
    moe_dispatch_layout_kernel<int32_t><<<1, threads, 0, stream>>>(
        static_cast<const int32_t*>(topk_idx), tokens, topk, num_experts, per_pe, n_pes, send_counts,
        send_index, meta, pair_pe, pair_rank);
  } else {
    moe_dispatch_layout_kernel<int64_t><<<1, threads, 0, stream>>>(
        static_cast<const int64_t*>(topk_idx), tokens, topk, num_experts, per_pe, n_pes, send_counts,
        send_index, meta, pair_pe, pair_rank);
  }
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_moe_receive_layout(const int32_t* recv_meta, int64_t rows, int topk,
                               const int64_t* recv_counts, int n_pes, int my_pe,
                               int64_t experts_per_pe, const MoeReceiveLayoutOutputs& out, cudaStream_t stream) {
  moe_receive_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(
      recv_meta, rows, topk, recv_counts, n_pes, my_pe, experts_per_pe, out.row_of, out.expert_counts,
      out.expert_offsets, out.num_rows, out.expert_of_row, out.source_pe, out.source_token, out.combine_index,
      out.combine_counts, out.pair_position);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                               const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                               int dtype, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  const int64_t element = dtype == kReduceFloat32 ? 4 : 2;
  const SlotRows rows_of{static_cast<const uint8_t*>(rows), row_count, hidden * element, slots};
  reduce_rows_by_dtype(out, rows_of, (reinterpret_cast<uintptr_t>(rows) & 15) == 0, weights, tokens, topk,
                       hidden, dtype, stream);
}

void launch_moe_combine_reduce_region(void* out, const void* region, int64_t stride,
                                      const int64_t* pair_pe, const int64_t* pair_rank,
                                      const int64_t* back_counts, int n_sources, const float* weights,
                                      int64_t tokens, int64_t topk, int64_t hidden, int dtype,
                                      cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  const int64_t element = dtype == kReduceFloat32 ? 4 : 2;
  const RegionRows rows_of{static_cast<const uint8_t*>(region), stride, hidden * element, pair_pe, pair_rank,
                           back_counts, n_sources};
  reduce_rows_by_dtype(out, rows_of, ((reinterpret_cast<uintptr_t>(region) | static_cast<uintptr_t>(stride)) & 15) == 0,
                       weights, tokens, topk, hidden, dtype, stream);
}

void launch_all_to_all_release(uint64_t* pending, uint64_t* credits, int my_pe, int n_pes,
                               cudaStream_t stream) {
  all_to_all_release_kernel<<<1, 256, 0, stream>>>(pending, credits, my_pe, n_pes);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_scatter_region_rows(void* out, int64_t out_rows, const void* region, int64_t stride,
                                const int64_t* recv_offsets, const int64_t* recv_counts, int n_sources,
                                const int64_t* positions, int topk, int64_t rows, int64_t row_bytes,
                                int blocks, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  scatter_region_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out), out_rows,
                                                         static_cast<const uint8_t*>(region), stride,
                                                         recv_offsets, recv_counts, n_sources, positions, topk,
                                                         rows, row_bytes);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_gather_region_rows(void* out, const void* region, int64_t stride, const int64_t* recv_offsets,
                               const int64_t* recv_counts, int n_sources, const int64_t* index,
                               const int64_t* count, int64_t rows, int64_t row_bytes, int blocks,
                               cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  gather_region_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out),
                                                        static_cast<const uint8_t*>(region), stride,
                                                        recv_offsets, recv_counts, n_sources, index, count,
                                                        rows, row_bytes);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_all_to_all_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_send_kernel<false>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_send_kernel<true>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_recv_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, gather_rows_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_rows_kernel<__nv_bfloat16, SlotRows>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_rows_vector_kernel<__nv_bfloat16, SlotRows>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_rows_vector_kernel<__nv_bfloat16, RegionRows>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, gather_region_rows_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, scatter_region_rows_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_release_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, moe_dispatch_layout_kernel<int32_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, moe_dispatch_layout_kernel<int64_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, moe_receive_layout_kernel));
}

}  // namespace pydatacopy::kernels
