// MoE dispatch's host path in one call: the region dispatch of MoeDispatcher (python/pydatacopy/
// moe/dispatcher.py) as the core runs it, on the caller's stream, with every output and scratch
// carved out of three allocations of the caller's, split by lifetime (recv_x; the handle's
// tensors; the scratch), MoeDispatchWorkspace says where each is.
//
// moe_dispatch_region = moe_dispatch_layout (the sender's layout, its scratch), the exchange of
// the token rows (left in the receive region) and the meta rows (compacted, recv_meta), the
// receive layout (its scratch), then the grouping by expert straight from the region:
// scatter_region_rows (rows of 16-byte multiples, moe_region_rows_scatter) or gather_region_rows
// (other rows), and the region's release. The calls and their arguments are those the Python
// layer made one by one before (the same kernels, the same outputs, bit for bit).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pydatacopy/all_to_all.hpp"

namespace pydatacopy {

// Rows whose bytes are a multiple of this (and 16-byte aligned tensors) take scatter_region_rows
// (each received row read once); the others gather_region_rows.
constexpr int64_t kMoeRegionRowAlignment = 16;
inline bool moe_region_rows_scatter(int64_t row_bytes) { return row_bytes % kMoeRegionRowAlignment == 0; }

// Where each output and scratch of moe_dispatch_region lies: every part belongs to one of three
// regions, split by lifetime, each its own allocation of the caller's (byte offsets from the
// region's start, each kAlignment-aligned, in Part order, none overlapping within a region;
// region_total[r] bytes in region r, ending at its last part, unpadded):
// - kRecvXRegion: recv_x alone (the largest output; the caller's [pairs, hidden] tensor);
// - kHandleRegion: the outputs that MoeHandle keeps for combine (and backward), small, together;
// - kScratchRegion: everything else, the layouts' scratch and the intermediates no caller reads
//   after the call (the caller frees it after the call: stream-ordered, like its kernels).
// Sizes: `tokens` rows of x (row_bytes each) with `topk` expert ids each, over n_pes PEs of
// experts_per_pe experts, recv_rows (n_pes x the dispatch buffer's capacity) rows received at most.
struct MoeDispatchWorkspace {
  static constexpr int64_t kAlignment = 256;
  enum Part : int {
    // The sender's layout (dispatch_plan): int64 but meta (int32 [tokens, topk + 1]).
    kSendCounts, kSendIndex, kMeta, kPairPe, kPairRank, kDispatchScratch,
    // The exchange's outputs: recv_meta int32 [recv_rows, topk + 1], recv_counts, recv_offsets.
    kRecvMeta, kRecvCounts, kRecvOffsets,
    // The receive layout (receive_layout), int64; positions: scatter_region_rows' [pairs].
    kPositions, kRowOf, kExpertCounts, kExpertOffsets, kNumRows, kExpertOfRow, kSourcePe,
    kSourceToken, kCombineIndex, kCombineCounts, kReceiveScratch,
    kRecvX,  // [pairs, row_bytes]: the rows grouped by expert
    kParts
  };
  enum Region : int { kRecvXRegion, kHandleRegion, kScratchRegion, kRegions };
  static const char* const kNames[kParts];          // "send_counts", ... (the Python views' names)
  static const char* const kRegionNames[kRegions];  // "recv_x", "handle", "scratch"
  static const Region kRegionOf[kParts];             // each part's region

  int64_t tokens = 0, topk = 0, experts_per_pe = 0, recv_rows = 0, row_bytes = 0;
  int n_pes = 0;
  int64_t offset[kParts] = {};  // from the start of its region (kRegionOf)
  int64_t bytes[kParts] = {};
  int64_t region_total[kRegions] = {};

  // Throws Error for sizes outside the layout kernels' limits (moe_dispatch_fits says which fit).
  MoeDispatchWorkspace(int64_t tokens, int64_t topk, int n_pes, int64_t experts_per_pe, int64_t recv_rows,
                       int64_t row_bytes);
  int64_t pairs() const { return recv_rows * topk; }  // rows of recv_x and of the receive layout
  int64_t total(Region region) const { return region_total[region]; }
};

// Whether moe_dispatch_region takes these sizes: both layouts within their one-block kernels'
// limits (moe_layout_kernels_fit: tokens x topk pairs sent, recv_rows x topk + 1 received).
// Past them the Python layer's torch layouts serve (as before).
bool moe_dispatch_fits(int64_t tokens, int64_t topk, int n_pes, int64_t experts_per_pe, int64_t recv_rows);

// The region dispatch, stream-ordered on `stream` (nothing read on the host). x: [tokens,
// row_bytes] on this PE's GPU; topk_idx [tokens, topk] int32 or int64 (id_bytes 4 or 8) of
// global expert ids; engine: the dispatch buffer (max_row_bytes >= row_bytes + (topk + 1) x 4,
// capacity rows per source); recv_x, handle, scratch: device memory of at least
// MoeDispatchWorkspace(...).total(region) bytes each (recv_x_bytes, handle_bytes, scratch_bytes,
// checked), kAlignment-aligned (null allowed only for a region of 0 bytes): recv_x and handle the
// outputs' homes (the caller keeps them while it reads them), scratch free again once the call's
// work on `stream` is done. Collective like AllToAll::exchange: every PE calls it, in the same
// order. A failure after the exchange still releases its region (as the Python path did), and the
// first error is the one thrown. Returns the exchange's call number on the buffer (the same on
// every PE for the same dispatch: MoE combine's tag names the dispatch by it).
int64_t moe_dispatch_region(AllToAll& engine, const void* x, int64_t row_bytes, const void* topk_idx, int id_bytes,
                         int64_t tokens, int64_t topk, int64_t num_experts, void* recv_x, int64_t recv_x_bytes,
                         void* handle, int64_t handle_bytes, void* scratch, int64_t scratch_bytes,
                         cudaStream_t stream, double timeout_seconds);

// MoE combine's region path in one call: the exchange of the expert outputs y ([y_rows, hidden]
// of the reduction dtype `dtype`, ReduceDtype) back to their tokens' PEs (combine_counts rows to
// each, the rows combine_index[index_rows] names, left in the receive region), then
// moe_combine_reduce_region into out ([tokens, hidden], y's dtype) with pair_pe / pair_rank /
// weights ([tokens, topk]) and the region's release. back_counts, back_offsets: device int64
// [n_pes], the exchange's recv_counts / recv_offsets. Collective like moe_dispatch_region; a
// failure after the exchange still releases its region. tag: the exchange's (AllToAll::exchange):
// the handle's dispatch, so that PEs combining different dispatches are refused on the device.
void moe_combine_region(AllToAll& engine, const void* y, int64_t y_rows, int64_t hidden, int dtype,
                        const int64_t* combine_counts, const int64_t* combine_index, int64_t index_rows,
                        const int64_t* pair_pe, const int64_t* pair_rank, const float* weights, int64_t tokens,
                        int64_t topk, void* out, int64_t* back_counts, int64_t* back_offsets, cudaStream_t stream,
                        double timeout_seconds, uint64_t tag = 0);

// MoE combine's pre_reduce path in one call (MoeDispatcher(pre_reduce=True)): the row sent back
// for received token r (recv_rows of them, in source order: recv_counts[d] to PE d, no index) is
// the sum over its slots k of pair_weight[r, k] x y[pair_row[r, k]] (y: [y_rows, hidden] of
// dtype; pair_row -1 where expert k is elsewhere), computed as it is stored at its destination
// (AllToAllSummedRows: moe_combine_reduce's arithmetic, never written here first). Then, at the
// source, the rows of each token's PEs summed in ascending PE order (token_pe / token_rank
// [tokens, width], unit_weights [tokens, width] of ones) into out ([tokens, hidden], dtype),
// and the region's release, as moe_combine_region. Needs engine.sums_in_send() (else refused on
// every PE: the caller sums with moe_combine_reduce and sends the rows instead).
void moe_combine_region_summed(AllToAll& engine, const void* y, int64_t y_rows, int64_t hidden, int dtype,
                               const int64_t* pair_row, const float* pair_weight, int64_t recv_rows, int64_t topk,
                               const int64_t* recv_counts, const int64_t* token_pe, const int64_t* token_rank,
                               const float* unit_weights, int64_t tokens, int64_t width, void* out,
                               int64_t* back_counts, int64_t* back_offsets, cudaStream_t stream,
                               double timeout_seconds, uint64_t tag = 0);

}  // namespace pydatacopy
