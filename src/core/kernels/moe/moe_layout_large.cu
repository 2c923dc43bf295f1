// MoE dispatch's two layouts for large inputs (prefill: thousands of tokens), over many blocks.
// The outputs are the one-block kernels' (all_to_all.cu), bit for bit: both are stable counting
// sorts, and a stable counting sort's positions do not depend on how the input is cut.
//
// The input is cut into units, one warp each (a contiguous stretch of tokens or pairs), and each
// sort takes three launches, stream-ordered, nothing read on the host:
//   1. count: each unit's count per column (bin) into scratch counts[unit][column];
//   2. scan (one block): counts, in place, into exclusive prefixes over units, and each column's
//      start (a scan over columns) into offsets[column]; the small outputs (counts per PE or
//      expert, combine_counts);
//   3. place: each unit walks its stretch once more, 32 items at a time; __match_any_sync ranks
//      a batch's lanes of one bin in lane order, a warp-private running count per bin (from
//      step 2) places them: position = offsets[bin] + prefix[unit][bin] + rank so far.
// No __syncthreads in steps 1 and 3 (all state is warp-private); the units' sizes and the grids
// follow from the host-known sizes only (graph capture).
#include <algorithm>

#include "kernels/api.cuh"
#include "kernels/moe/warp_search.cuh"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kUnitWarps = 4;  // warps (units) per block of steps 1 and 3
constexpr int kUnitThreads = 32 * kUnitWarps;
constexpr int kScanThreads = 1024;
// Batches of 32 items whose loads a lane issues together before it uses any of them.
constexpr int kBatches = 8;
// Units x columns at most: step 2 (one block) reads and writes each entry once.
constexpr int64_t kMaxScanEntries = int64_t{1} << 16;
constexpr int kDispatchMaxColumns = 2 * kMoeLayoutMaxPes + 1;

// counts [units][columns] (int32) into exclusive prefixes over units, in place; each column's
// total into totals[column] (shared). Warp w scans columns w, w + warps, ...; lane l takes units
// u0 + l of each batch of 32, kBatches batches' loads issued together.
__device__ void scan_columns(int32_t* counts, int64_t units, int columns, int32_t* totals) {
  const int lane = threadIdx.x % 32;
  for (int c = threadIdx.x / 32; c < columns; c += blockDim.x / 32) {
    int32_t carry = 0;
    for (int64_t u0 = 0; u0 < units; u0 += 32 * kBatches) {
      int32_t value[kBatches];
#pragma unroll
      for (int j = 0; j < kBatches; ++j) {
        const int64_t u = u0 + 32 * j + lane;
        value[j] = u < units ? counts[u * columns + c] : 0;
      }
#pragma unroll
      for (int j = 0; j < kBatches; ++j) {
        const int64_t u = u0 + 32 * j + lane;
        const int32_t inclusive = warp_inclusive_scan(value[j], lane);
        if (u < units) counts[u * columns + c] = carry + inclusive - value[j];
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
      }
    }
    if (lane == 0) totals[c] = carry;
  }
}

// ---- dispatch (the sender): dispatch_plan in _moe.py ----------------------------------------
//
// Unit = unit_tokens tokens (a multiple of 32). Columns: [0, n_pes]: the unit's pairs with each
// PE (n_pes: no expert); [n_pes + 1, 2 n_pes + 1): its tokens sent to each PE. Offsets: 0 for
// pair columns (pair_rank is a rank within the PE), each PE's first send_index entry for token
// columns. After the offsets: the rows sent in all (int32: at most tokens x topk < 2^31).

// A pair's PE: n_pes for no expert (an id outside [0, num_experts)). The division in 32 bits as
// in the one-block kernel: a valid id and per_pe are non-negative int32 values.
__device__ __forceinline__ int pe_of(int64_t id, int64_t num_experts, int32_t per_pe, int n_pes) {
  return id >= 0 && id < num_experts ? static_cast<int32_t>(id) / per_pe : n_pes;
}

// visit(p, pe, id) for every pair p of tokens [t0, t1), 32 x kBatches pairs at a time (their
// ids loaded together), on every lane of the warp: lanes past the last pair see p >= p1 and
// pe = -1, so the warp-wide intrinsics in visit stay converged.
template <typename Id, typename Visit>
__device__ __forceinline__ void for_each_pair(const Id* ids, int64_t t0, int64_t t1, int topk, int64_t num_experts,
                                              int32_t per_pe, int n_pes, int lane, Visit&& visit) {
  const int64_t p1 = t1 * topk;
  for (int64_t g = t0 * topk; g < p1; g += 32 * kBatches) {
    int64_t id[kBatches];
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      const int64_t p = g + 32 * j + lane;
      id[j] = p < p1 ? static_cast<int64_t>(ids[p]) : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      if (g + 32 * j >= p1) break;  // (the same for every lane)
      const int64_t p = g + 32 * j + lane;
      visit(p, p < p1 ? pe_of(id[j], num_experts, per_pe, n_pes) : -1, id[j]);
    }
  }
}

// The PEs token t sends to, as bits (n_pes <= 64), its topk ids loaded kBatches at a time.
template <typename Id>
__device__ __forceinline__ uint64_t token_pes(const Id* ids, int64_t t, int topk, int64_t num_experts,
                                              int32_t per_pe, int n_pes) {
  uint64_t hit = 0;
  for (int k0 = 0; k0 < topk; k0 += kBatches) {
    int64_t id[kBatches];
#pragma unroll
    for (int u = 0; u < kBatches; ++u) id[u] = k0 + u < topk ? static_cast<int64_t>(ids[t * topk + k0 + u]) : -1;
#pragma unroll
    for (int u = 0; u < kBatches; ++u) {
      const int pe = pe_of(id[u], num_experts, per_pe, n_pes);
      if (pe < n_pes) hit |= uint64_t{1} << pe;
    }
  }
  return hit;
}

__device__ __forceinline__ uint64_t or_over_lanes(uint64_t bits) {
  const uint32_t low = __reduce_or_sync(0xffffffffu, static_cast<uint32_t>(bits));
  const uint32_t high = __reduce_or_sync(0xffffffffu, static_cast<uint32_t>(bits >> 32));
  return (static_cast<uint64_t>(high) << 32) | low;
}

// Step 1: counts; also pair_pe and meta (each pair's, each token's), written once here.
template <typename Id>
__global__ void __launch_bounds__(kUnitThreads)
    dispatch_count_kernel(const Id* ids, int64_t tokens, int topk, int64_t num_experts, int32_t per_pe,
                          int n_pes, int64_t units, int64_t unit_tokens, int32_t* meta, int64_t* pair_pe,
                          int32_t* counts) {
  __shared__ int32_t pair_counts[kUnitWarps][kMoeLayoutMaxPes + 1];
  const int lane = threadIdx.x % 32;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitWarps + threadIdx.x / 32;
  if (unit >= units) return;  // the whole warp (no block-wide barrier in this kernel)
  int32_t* hist = pair_counts[threadIdx.x / 32];
  for (int d = lane; d <= n_pes; d += 32) hist[d] = 0;
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
  const int64_t t0 = unit * unit_tokens;
  const int64_t t1 = min(tokens, t0 + unit_tokens);
  for_each_pair(ids, t0, t1, topk, num_experts, per_pe, n_pes, lane, [&](int64_t p, int pe, int64_t id) {
    if (pe >= 0) {
      pair_pe[p] = pe;
      const int32_t t = static_cast<int32_t>(p) / topk;  // (p < 2^31)
      const int k = static_cast<int32_t>(p) - t * topk;
      meta[static_cast<int64_t>(t) * (topk + 1) + k] = pe < n_pes ? static_cast<int32_t>(id) : -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, pe);
    if (pe >= 0 && (same & below) == 0) hist[pe] += __popc(same);
    __syncwarp();  // the next batch's leaders see these counts
  });
  // Tokens for PE lane and lane + 32, counted by that lane.
  int32_t tokens_low = 0, tokens_high = 0;
  for (int64_t b = t0; b < t1; b += 32) {
    const int64_t t = b + lane;
    const uint64_t hit = t < t1 ? token_pes(ids, t, topk, num_experts, per_pe, n_pes) : 0;
    if (t < t1) meta[t * (topk + 1) + topk] = static_cast<int32_t>(t);
    for (uint64_t any = or_over_lanes(hit); any != 0; any &= any - 1) {
      const int d = __ffsll(static_cast<long long>(any)) - 1;
      const int32_t sending = __popc(__ballot_sync(0xffffffffu, (hit >> d) & 1));
      if (lane == d % 32) (d < 32 ? tokens_low : tokens_high) += sending;
    }
  }
  int32_t* row = counts + unit * (2 * n_pes + 1);
  for (int d = lane; d <= n_pes; d += 32) row[d] = hist[d];
  if (lane < n_pes) row[n_pes + 1 + lane] = tokens_low;
  if (lane + 32 < n_pes) row[n_pes + 1 + lane + 32] = tokens_high;
}

// Step 2 (one block): prefixes, offsets, send_counts and the rows sent in all.
__global__ void __launch_bounds__(kScanThreads)
    dispatch_scan_kernel(int32_t* counts, int64_t units, int n_pes, int32_t* offsets, int32_t* rows_sent,
                         int64_t* send_counts) {
  __shared__ int32_t totals[kDispatchMaxColumns];
  scan_columns(counts, units, 2 * n_pes + 1, totals);
  __syncthreads();
  for (int d = threadIdx.x; d <= n_pes; d += blockDim.x) offsets[d] = 0;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int32_t carry = 0;
    for (int base = 0; base < n_pes; base += 32) {
      const int d = base + lane;
      const int32_t count = d < n_pes ? totals[n_pes + 1 + d] : 0;
      const int32_t inclusive = warp_inclusive_scan(count, lane);
      if (d < n_pes) {
        send_counts[d] = count;
        offsets[n_pes + 1 + d] = carry + inclusive - count;
      }
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) rows_sent[0] = carry;
  }
}

// Step 3: pair_rank and send_index (zeros past the rows sent, as the one-block kernel).
template <typename Id>
__global__ void __launch_bounds__(kUnitThreads)
    dispatch_place_kernel(const Id* ids, int64_t tokens, int topk, int64_t num_experts, int32_t per_pe,
                          int n_pes, int64_t units, int64_t unit_tokens, const int32_t* prefixes,
                          const int32_t* offsets, const int32_t* rows_sent, int64_t* send_index,
                          int64_t* pair_rank) {
  __shared__ int32_t pair_runs[kUnitWarps][kMoeLayoutMaxPes + 1];
  // Entries past the rows sent (and the spare last one): no unit writes them.
  const int64_t index_rows = static_cast<int64_t>(n_pes) * tokens + 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = rows_sent[0] + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < index_rows;
       i += stride)
    send_index[i] = 0;
  const int lane = threadIdx.x % 32;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitWarps + threadIdx.x / 32;
  if (unit >= units) return;  // the whole warp
  const int columns = 2 * n_pes + 1;
  const int32_t* prefix = prefixes + unit * columns;
  int32_t* run = pair_runs[threadIdx.x / 32];
  for (int d = lane; d <= n_pes; d += 32) run[d] = prefix[d];  // (pair columns' offsets are 0)
  // The next send_index entry of PE lane and lane + 32, kept by that lane.
  int32_t next_low = lane < n_pes ? offsets[n_pes + 1 + lane] + prefix[n_pes + 1 + lane] : 0;
  int32_t next_high = lane + 32 < n_pes ? offsets[n_pes + 33 + lane] + prefix[n_pes + 33 + lane] : 0;
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
  const int64_t t0 = unit * unit_tokens;
  const int64_t t1 = min(tokens, t0 + unit_tokens);
  for_each_pair(ids, t0, t1, topk, num_experts, per_pe, n_pes, lane, [&](int64_t p, int pe, int64_t) {
    const unsigned same = __match_any_sync(0xffffffffu, pe);
    if (pe >= 0) pair_rank[p] = run[pe] + __popc(same & below);
    __syncwarp();  // every lane has read run before the leaders move it on
    if (pe >= 0 && (same & below) == 0) run[pe] += __popc(same);
    __syncwarp();
  });
  for (int64_t b = t0; b < t1; b += 32) {
    const int64_t t = b + lane;
    const uint64_t hit = t < t1 ? token_pes(ids, t, topk, num_experts, per_pe, n_pes) : 0;
    for (uint64_t any = or_over_lanes(hit); any != 0; any &= any - 1) {
      const int d = __ffsll(static_cast<long long>(any)) - 1;  // (the same for every lane)
      const unsigned sending = __ballot_sync(0xffffffffu, (hit >> d) & 1);
      const int32_t next = __shfl_sync(0xffffffffu, d < 32 ? next_low : next_high, d % 32);
      if ((hit >> d) & 1) send_index[next + __popc(sending & below)] = t;
      if (lane == d % 32) (d < 32 ? next_low : next_high) += __popc(sending);
    }
  }
}

// ---- receive (the receiver): receive_layout in _moe.py ---------------------------------------
//
// Unit = unit_pairs pairs (row, k) (a multiple of 32 x kBatches). Columns: the bins, local
// experts then "none" (no local expert, or a row past the rows received). Offsets: each bin's
// first recv_x row. After the offsets: partial[s] (s < n_pes), the valid pairs before pair
// c(s) = min(first row of source s, rows in use) x topk within c(s)'s unit, written in step 1 by
// that unit: step 2 gets from them the valid pairs before each source's rows, combine_counts.

// Each source's first row (lanes s = lane and lane + 32) and the rows in use, as the one-block
// kernel: negative counts as 0, the rows in use at most rows.
__device__ __forceinline__ void source_starts(const int64_t* recv_counts, int n_pes, int64_t rows, int lane,
                                              int64_t& start_low, int64_t& start_high, int64_t& rows_in_use) {
  int64_t carry = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int s = 32 * half + lane;
    const int64_t count = s < n_pes ? recv_counts[s] : 0;
    const int64_t used = count > 0 ? count : 0;
    const int64_t inclusive = warp_inclusive_scan(used, lane);
    (half == 0 ? start_low : start_high) = carry + inclusive - used;
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  rows_in_use = carry < rows ? carry : rows;
}

// Step 1: counts per bin, and the partials of the sources' first pairs in this unit.
__global__ void __launch_bounds__(kUnitThreads)
    receive_count_kernel(const int32_t* recv_meta, int64_t rows, int topk, const int64_t* recv_counts,
                         int n_pes, int my_pe, int64_t experts_per_pe, int64_t units, int64_t unit_pairs,
                         int32_t* counts, int32_t* partial) {
  __shared__ int32_t bin_counts[kUnitWarps][kMoeLayoutMaxBins];
  const int lane = threadIdx.x % 32;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitWarps + threadIdx.x / 32;
  if (unit >= units) return;  // the whole warp (no block-wide barrier in this kernel)
  const int bins = static_cast<int>(experts_per_pe) + 1;
  const int none = bins - 1;
  int32_t* hist = bin_counts[threadIdx.x / 32];
  for (int b = lane; b < bins; b += 32) hist[b] = 0;
  int64_t start_low, start_high, rows_in_use;
  source_starts(recv_counts, n_pes, rows, lane, start_low, start_high, rows_in_use);
  const int64_t boundary_low = lane < n_pes ? min(start_low, rows_in_use) * topk : -1;
  const int64_t boundary_high = lane + 32 < n_pes ? min(start_high, rows_in_use) * topk : -1;
  const int64_t first_expert = static_cast<int64_t>(my_pe) * experts_per_pe;
  const int64_t p0 = unit * unit_pairs;
  const int64_t p1 = min(rows * topk, p0 + unit_pairs);
  const unsigned below = (1u << lane) - 1u;
  int32_t valid_before = 0;  // valid pairs of this unit before the batch
  __syncwarp();
  for (int64_t g = p0; g < p1; g += 32 * kBatches) {
    int32_t id[kBatches];
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      const int64_t p = g + 32 * j + lane;
      const int32_t row = static_cast<int32_t>(p) / topk;  // (p < 2^31)
      const int k = static_cast<int32_t>(p) - row * topk;
      id[j] = p < p1 && row < rows_in_use ? recv_meta[static_cast<int64_t>(row) * (topk + 1) + k] : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      const int64_t batch = g + 32 * j;
      if (batch >= p1) break;  // (the same for every lane)
      const int64_t p = batch + lane;
      int bin = -1;  // past the unit: no pair
      if (p < p1) {
        const int64_t local = static_cast<int64_t>(id[j]) - first_expert;
        const bool in_use = static_cast<int32_t>(p) / topk < rows_in_use;
        bin = in_use && local >= 0 && local < experts_per_pe ? static_cast<int>(local) : none;
      }
      const unsigned same = __match_any_sync(0xffffffffu, bin);
      if (bin >= 0 && (same & below) == 0) hist[bin] += __popc(same);
      const unsigned valid_lanes = __ballot_sync(0xffffffffu, bin >= 0 && bin != none);
      if (boundary_low >= batch && boundary_low < batch + 32 && boundary_low < p1)
        partial[lane] = valid_before + __popc(valid_lanes & ((1u << (boundary_low - batch)) - 1u));
      if (boundary_high >= batch && boundary_high < batch + 32 && boundary_high < p1)
        partial[lane + 32] = valid_before + __popc(valid_lanes & ((1u << (boundary_high - batch)) - 1u));
      valid_before += __popc(valid_lanes);
      __syncwarp();  // the next batch's leaders see these counts
    }
  }
  int32_t* row = counts + unit * bins;
  for (int b = lane; b < bins; b += 32) row[b] = hist[b];
}

// Step 2 (one block): prefixes, the bins' offsets, expert_counts / expert_offsets / num_rows,
// combine_counts.
__global__ void __launch_bounds__(kScanThreads)
    receive_scan_kernel(int32_t* counts, int64_t units, int64_t unit_pairs, int bins, int64_t rows, int topk,
                        const int64_t* recv_counts, int n_pes, const int32_t* partial, int32_t* offsets,
                        int64_t* expert_counts, int64_t* expert_offsets, int64_t* num_rows,
                        int64_t* combine_counts) {
  __shared__ int32_t totals[kMoeLayoutMaxBins];
  const int none = bins - 1;
  scan_columns(counts, units, bins, totals);
  __syncthreads();
  if (threadIdx.x >= 32) return;  // one warp from here (no barrier below)
  const int lane = threadIdx.x;
  int32_t carry = 0;
  for (int base = 0; base < bins; base += 32) {
    const int b = base + lane;
    const int32_t count = b < bins ? totals[b] : 0;
    const int32_t inclusive = warp_inclusive_scan(count, lane);
    const int32_t offset = carry + inclusive - count;
    if (b < none) {
      expert_counts[b] = count;
      expert_offsets[b] = offset;
    }
    if (b < bins) offsets[b] = offset;
    if (b == none) num_rows[0] = offset;
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  const int32_t valid = carry - totals[none];  // = the none bin's offset: the pairs placed first
  // valid_before(s): valid pairs before source s's first pair (valid for s >= n_pes: all).
  int64_t start_low, start_high, rows_in_use;
  source_starts(recv_counts, n_pes, rows, lane, start_low, start_high, rows_in_use);
  const int64_t pairs = rows * topk;
  auto valid_before = [&](int s, int64_t start) -> int32_t {
    if (s >= n_pes) return valid;
    const int64_t boundary = min(start, rows_in_use) * topk;
    if (boundary >= pairs) return valid;
    const int64_t u = boundary / unit_pairs;
    // The unit's first valid pair: its pairs before it, less its "none" pairs before it.
    const int32_t unit_base = static_cast<int32_t>(u * unit_pairs) - counts[u * bins + none];
    return unit_base + partial[s];
  };
  const int32_t before_low = valid_before(lane, start_low);
  const int32_t before_high = valid_before(lane + 32, start_high);
  const int32_t shifted_low = __shfl_sync(0xffffffffu, before_low, (lane + 1) % 32);
  const int32_t shifted_high = __shfl_sync(0xffffffffu, before_high, (lane + 1) % 32);
  const int32_t after_low = lane < 31 ? shifted_low : shifted_high;  // source lane + 1's
  const int32_t after_high = lane < 31 ? shifted_high : valid;       // source lane + 33's
  if (lane < n_pes) combine_counts[lane] = after_low - before_low;
  if (lane + 32 < n_pes) combine_counts[lane + 32] = after_high - before_high;
}

// Step 3: the pairs' positions and every per-row output (combine_index: zeros past the valid
// pairs, as the one-block kernel).
__global__ void __launch_bounds__(kUnitThreads)
    receive_place_kernel(const int32_t* recv_meta, int64_t rows, int topk, const int64_t* recv_counts,
                         int n_pes, int my_pe, int64_t experts_per_pe, int64_t units, int64_t unit_pairs,
                         const int32_t* prefixes, const int32_t* offsets, int64_t* row_of,
                         int64_t* expert_of_row, int64_t* source_pe, int64_t* source_token,
                         int64_t* combine_index, int64_t* pair_position) {
  __shared__ int32_t bin_runs[kUnitWarps][kMoeLayoutMaxBins];
  __shared__ int64_t source_firsts[kUnitWarps][kMoeLayoutMaxPes];
  const int bins = static_cast<int>(experts_per_pe) + 1;
  const int none = bins - 1;
  const int64_t pairs = rows * topk;
  // combine_index past the valid pairs (and its spare last entry): no unit writes them.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = offsets[none] + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i <= pairs;
       i += stride)
    combine_index[i] = 0;
  const int lane = threadIdx.x % 32;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kUnitWarps + threadIdx.x / 32;
  if (unit >= units) return;  // the whole warp
  const int32_t* prefix = prefixes + unit * bins;
  int32_t* run = bin_runs[threadIdx.x / 32];
  for (int b = lane; b < bins; b += 32) run[b] = offsets[b] + prefix[b];
  int64_t* start = source_firsts[threadIdx.x / 32];
  int64_t start_low, start_high, rows_in_use;
  source_starts(recv_counts, n_pes, rows, lane, start_low, start_high, rows_in_use);
  if (lane < n_pes) start[lane] = start_low;
  if (lane + 32 < n_pes) start[lane + 32] = start_high;
  const int64_t first_expert = static_cast<int64_t>(my_pe) * experts_per_pe;
  const int64_t p0 = unit * unit_pairs;
  const int64_t p1 = min(pairs, p0 + unit_pairs);
  // The unit's first valid pair's rank among the valid pairs (its combine_index entry).
  int32_t valid_at = static_cast<int32_t>(p0) - prefix[none];
  const unsigned below = (1u << lane) - 1u;
  __syncwarp();
  for (int64_t g = p0; g < p1; g += 32 * kBatches) {
    int32_t id[kBatches];
    int32_t token[kBatches];
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      const int64_t p = g + 32 * j + lane;
      const int32_t row = static_cast<int32_t>(p) / topk;
      const int k = static_cast<int32_t>(p) - row * topk;
      const int64_t at = static_cast<int64_t>(row) * (topk + 1);
      id[j] = p < p1 && row < rows_in_use ? recv_meta[at + k] : -1;
      token[j] = p < p1 ? recv_meta[at + topk] : -1;  // (any p < p1 is in a row < rows)
    }
#pragma unroll
    for (int j = 0; j < kBatches; ++j) {
      const int64_t batch = g + 32 * j;
      if (batch >= p1) break;  // (the same for every lane)
      const int64_t p = batch + lane;
      const int32_t row = static_cast<int32_t>(p) / topk;
      int bin = -1;
      if (p < p1) {
        const int64_t local = static_cast<int64_t>(id[j]) - first_expert;
        bin = row < rows_in_use && local >= 0 && local < experts_per_pe ? static_cast<int>(local) : none;
      }
      const unsigned same = __match_any_sync(0xffffffffu, bin);
      const bool valid = bin >= 0 && bin != none;
      const unsigned valid_lanes = __ballot_sync(0xffffffffu, valid);
      if (bin >= 0) {
        const int64_t position = run[bin] + __popc(same & below);
        row_of[position] = row;
        expert_of_row[position] = bin;
        source_pe[position] = valid ? find_slot(start, n_pes, row) : -1;
        source_token[position] = valid ? token[j] : -1;
        if (valid) combine_index[valid_at + __popc(valid_lanes & below)] = position;
        if (pair_position != nullptr) pair_position[p] = valid ? position : -1;
      }
      __syncwarp();  // every lane has read run before the leaders move it on
      if (bin >= 0 && (same & below) == 0) run[bin] += __popc(same);
      valid_at += __popc(valid_lanes);
      __syncwarp();
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Units of `quantum` items (or a multiple: at most kMaxScanEntries / columns units).
struct Units {
  int64_t count;
  int64_t size;
};

Units units_of(int64_t items, int64_t quantum, int columns) {
  const int64_t most = std::max<int64_t>(1, kMaxScanEntries / columns);
  const int64_t size = quantum * ceil_div(ceil_div(items, quantum), most);
  return Units{ceil_div(items, size), size};
}

int64_t scratch_bytes(int64_t words) { return (words * 4 + 15) / 16 * 16; }

int grid_of(int64_t units) { return static_cast<int>(ceil_div(units, kUnitWarps)); }

}  // namespace

int64_t moe_dispatch_layout_scratch_bytes(int64_t tokens, int topk, int n_pes) {
  if (tokens * topk <= kMoeLayoutLargePairs) return 0;
  const int columns = 2 * n_pes + 1;
  const Units units = units_of(tokens, 32, columns);
  return scratch_bytes(units.count * columns + columns + 1);
}

int64_t moe_receive_layout_scratch_bytes(int64_t rows, int topk, int64_t experts_per_pe) {
  if (rows * topk <= kMoeLayoutLargePairs) return 0;
  const int columns = static_cast<int>(experts_per_pe) + 1;
  const Units units = units_of(rows * topk, 32 * kBatches, columns);
  return scratch_bytes(units.count * columns + columns + kMoeLayoutMaxPes);
}

void launch_moe_dispatch_layout_large(const void* topk_idx, bool ids_int32, int64_t tokens, int topk,
                                      int64_t num_experts, int n_pes, int64_t* send_counts,
                                      int64_t* send_index, int32_t* meta, int64_t* pair_pe,
                                      int64_t* pair_rank, void* scratch, cudaStream_t stream) {
  const int columns = 2 * n_pes + 1;
  const Units units = units_of(tokens, 32, columns);
  int32_t* counts = static_cast<int32_t*>(scratch);
  int32_t* offsets = counts + units.count * columns;
  int32_t* rows_sent = offsets + columns;
  const auto per_pe = static_cast<int32_t>(num_experts / n_pes);
  const int grid = grid_of(units.count);
  auto launch = [&](auto ids) {
    dispatch_count_kernel<<<grid, kUnitThreads, 0, stream>>>(ids, tokens, topk, num_experts, per_pe, n_pes,
                                                             units.count, units.size, meta, pair_pe, counts);
    PDC_CHECK_CUDA(cudaGetLastError());
    dispatch_scan_kernel<<<1, kScanThreads, 0, stream>>>(counts, units.count, n_pes, offsets, rows_sent,
                                                         send_counts);
    PDC_CHECK_CUDA(cudaGetLastError());
    dispatch_place_kernel<<<grid, kUnitThreads, 0, stream>>>(ids, tokens, topk, num_experts, per_pe, n_pes,
                                                             units.count, units.size, counts, offsets,
                                                             rows_sent, send_index, pair_rank);
    PDC_CHECK_CUDA(cudaGetLastError());
  };
  if (ids_int32) launch(static_cast<const int32_t*>(topk_idx));
  else launch(static_cast<const int64_t*>(topk_idx));
}

void launch_moe_receive_layout_large(const int32_t* recv_meta, int64_t rows, int topk,
                                     const int64_t* recv_counts, int n_pes, int my_pe,
                                     int64_t experts_per_pe, const MoeReceiveLayoutOutputs& out,
                                     void* scratch, cudaStream_t stream) {
  const int bins = static_cast<int>(experts_per_pe) + 1;
  const Units units = units_of(rows * topk, 32 * kBatches, bins);
  int32_t* counts = static_cast<int32_t*>(scratch);
  int32_t* offsets = counts + units.count * bins;
  int32_t* partial = offsets + bins;
  const int grid = grid_of(units.count);
  receive_count_kernel<<<grid, kUnitThreads, 0, stream>>>(recv_meta, rows, topk, recv_counts, n_pes, my_pe,
                                                          experts_per_pe, units.count, units.size, counts,
                                                          partial);
  PDC_CHECK_CUDA(cudaGetLastError());
  receive_scan_kernel<<<1, kScanThreads, 0, stream>>>(counts, units.count, units.size, bins, rows, topk,
                                                      recv_counts, n_pes, partial, offsets, out.expert_counts,
                                                      out.expert_offsets, out.num_rows, out.combine_counts);
  PDC_CHECK_CUDA(cudaGetLastError());
  receive_place_kernel<<<grid, kUnitThreads, 0, stream>>>(recv_meta, rows, topk, recv_counts, n_pes, my_pe,
                                                          experts_per_pe, units.count, units.size, counts,
                                                          offsets, out.row_of, out.expert_of_row, out.source_pe,
                                                          out.source_token, out.combine_index, out.pair_position);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_moe_layout_large_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, dispatch_count_kernel<int32_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, dispatch_count_kernel<int64_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, dispatch_scan_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, dispatch_place_kernel<int32_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, dispatch_place_kernel<int64_t>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, receive_count_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, receive_scan_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, receive_place_kernel));
}

}  // namespace pydatacopy::kernels
