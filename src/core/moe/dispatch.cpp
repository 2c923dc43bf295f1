// MoE dispatch's region path in one call (moe.hpp): the steps MoeDispatcher.dispatch made one
// by one from Python, in the same order with the same arguments, on three allocations of the
// caller's (recv_x, the handle's tensors, the scratch).
#include "pydatacopy/moe.hpp"

#include <optional>
#include <vector>

#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"

namespace pydatacopy {
namespace {

int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// The failure path's release: the region still goes back to its sources, but an error of the
// release itself must not replace the one being thrown (the caller rethrows that one).
void release_after_failure(AllToAll& engine, int64_t call, cudaStream_t stream) noexcept {
  try {
    engine.release(call, stream);
  } catch (...) {
  }
}

}  // namespace

const char* const MoeDispatchWorkspace::kNames[kParts] = {
    "send_counts", "send_index",     "meta",           "pair_pe",   "pair_rank",     "dispatch_scratch",
    "recv_meta",   "recv_counts",    "recv_offsets",   "positions", "row_of",        "expert_counts",
    "expert_offsets", "num_rows",    "expert_of_row",  "source_pe", "source_token",  "combine_index",
    "combine_counts", "receive_scratch", "recv_x"};

const char* const MoeDispatchWorkspace::kRegionNames[kRegions] = {"recv_x", "handle", "scratch"};

// By lifetime: MoeHandle's tensors (kept for combine and backward) together, recv_x alone, the
// rest scratch (nothing read after the call).
const MoeDispatchWorkspace::Region MoeDispatchWorkspace::kRegionOf[kParts] = {
    kScratchRegion /*send_counts*/,   kScratchRegion /*send_index*/,    kScratchRegion /*meta*/,
    kHandleRegion /*pair_pe*/,        kHandleRegion /*pair_rank*/,      kScratchRegion /*dispatch_scratch*/,
    kScratchRegion /*recv_meta*/,     kHandleRegion /*recv_counts*/,    kScratchRegion /*recv_offsets*/,
    kScratchRegion /*positions*/,     kScratchRegion /*row_of*/,        kHandleRegion /*expert_counts*/,
    kHandleRegion /*expert_offsets*/, kHandleRegion /*num_rows*/,       kHandleRegion /*expert_of_row*/,
    kHandleRegion /*source_pe*/,      kHandleRegion /*source_token*/,   kHandleRegion /*combine_index*/,
    kHandleRegion /*combine_counts*/, kScratchRegion /*receive_scratch*/, kRecvXRegion /*recv_x*/};

bool moe_dispatch_fits(int64_t tokens, int64_t topk, int n_pes, int64_t experts_per_pe, int64_t recv_rows) {
  if (tokens < 0 || topk < 1 || n_pes < 1 || experts_per_pe < 1 || recv_rows < 0) return false;
  if (tokens > kMoeLayoutMaxPairs / topk || recv_rows > (kMoeLayoutMaxPairs - 1) / topk) return false;
  return moe_layout_kernels_fit(n_pes, 1, tokens * topk) &&
         moe_layout_kernels_fit(n_pes, experts_per_pe, recv_rows * topk + 1);
}

MoeDispatchWorkspace::MoeDispatchWorkspace(int64_t tokens_, int64_t topk_, int n_pes_, int64_t experts_per_pe_,
                                           int64_t recv_rows_, int64_t row_bytes_)
    : tokens(tokens_), topk(topk_), experts_per_pe(experts_per_pe_), recv_rows(recv_rows_), row_bytes(row_bytes_),
      n_pes(n_pes_) {
  PDC_REQUIRE(moe_dispatch_fits(tokens, topk, n_pes, experts_per_pe, recv_rows),
              "moe_dispatch_region: tokens " << tokens << ", topk " << topk << ", " << n_pes << " PEs of "
                  << experts_per_pe << " experts, " << recv_rows
                  << " rows received are outside the layout kernels' limits");
  PDC_REQUIRE(row_bytes >= 0 && row_bytes <= AllToAllLayout::kMaxRowBytes,
              "moe_dispatch_region: rows of " << row_bytes << " bytes; at most " << AllToAllLayout::kMaxRowBytes);
  const int64_t pes = n_pes, sent = tokens * topk, pairs = recv_rows * topk;
  bytes[kSendCounts] = 8 * pes;
  bytes[kSendIndex] = 8 * (pes * tokens + 1);
  bytes[kMeta] = 4 * tokens * (topk + 1);
  bytes[kPairPe] = bytes[kPairRank] = 8 * sent;
  bytes[kDispatchScratch] = moe_dispatch_layout_scratch_bytes(tokens, topk, n_pes);
  bytes[kRecvMeta] = 4 * recv_rows * (topk + 1);
  bytes[kRecvCounts] = bytes[kRecvOffsets] = 8 * pes;
  bytes[kPositions] = bytes[kRowOf] = 8 * pairs;
  bytes[kExpertCounts] = bytes[kExpertOffsets] = 8 * experts_per_pe;
  bytes[kNumRows] = 8;
  bytes[kExpertOfRow] = bytes[kSourcePe] = bytes[kSourceToken] = 8 * pairs;
  bytes[kCombineIndex] = 8 * (pairs + 1);
  bytes[kCombineCounts] = 8 * pes;
  bytes[kReceiveScratch] = moe_receive_layout_scratch_bytes(recv_rows, topk, experts_per_pe);
  PDC_REQUIRE(row_bytes == 0 || pairs <= (int64_t{1} << 50) / row_bytes,
              "moe_dispatch_region: recv_x of " << pairs << " rows of " << row_bytes << " bytes is too large");
  bytes[kRecvX] = pairs * row_bytes;
  // Each part starts aligned in its region; a region's total ends at its last part, unpadded
  // (recv_x's is exactly the [pairs, hidden] tensor's bytes).
  int64_t next[kRegions] = {};
  for (int part = 0; part < kParts; ++part) {
    const int region = kRegionOf[part];
    offset[part] = next[region];
    region_total[region] = offset[part] + bytes[part];
    next[region] = align_up(region_total[region], kAlignment);
  }
}

int64_t moe_dispatch_region(AllToAll& engine, const void* x, int64_t row_bytes, const void* topk_idx, int id_bytes,
                         int64_t tokens, int64_t topk, int64_t num_experts, void* recv_x_region,
                         int64_t recv_x_bytes, void* handle_region, int64_t handle_bytes, void* scratch_region,
                         int64_t scratch_bytes, cudaStream_t stream, double timeout_seconds) {
  using W = MoeDispatchWorkspace;
  PDC_REQUIRE(engine.initialized(), "moe_dispatch_region: the dispatch buffer is not set up (or was closed)");
  const int pes = n_pes();
  uint8_t* const bases[W::kRegions] = {static_cast<uint8_t*>(recv_x_region), static_cast<uint8_t*>(handle_region),
                                       static_cast<uint8_t*>(scratch_region)};
  const int64_t given[W::kRegions] = {recv_x_bytes, handle_bytes, scratch_bytes};
  // This PE's own checks and the sender's layout: its peers make the exchange, so a refusal here
  // still runs the round (AllToAll::refuse), and every PE's dispatch ends with an Error.
  std::optional<W> workspace;
  try {
    PDC_REQUIRE(num_experts >= pes && num_experts % pes == 0,
                "moe_dispatch_region: num_experts=" << num_experts << " must be a multiple of the " << pes << " PEs");
    workspace.emplace(tokens, topk, pes, num_experts / pes, pes * engine.capacity(), row_bytes);
    for (int r = 0; r < W::kRegions; ++r) {
      const int64_t total = workspace->total(static_cast<W::Region>(r));
      PDC_REQUIRE((bases[r] != nullptr || total == 0) && (reinterpret_cast<uintptr_t>(bases[r]) % W::kAlignment) == 0 &&
                      given[r] >= total,
                  "moe_dispatch_region: the " << W::kRegionNames[r] << " region (" << given[r] << " bytes at "
                      << static_cast<const void*>(bases[r]) << ") must be " << W::kAlignment
                      << "-byte aligned and hold " << total << " bytes (moe_dispatch_workspace)");
    }
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error& error) {
    engine.refuse(error.what(), stream, timeout_seconds);
  }
  const W& w = *workspace;
  auto at = [&](W::Part p) -> void* { return bases[W::kRegionOf[p]] + w.offset[p]; };
  auto part = [&](W::Part p) -> void* { return w.bytes[p] == 0 ? nullptr : at(p); };
  auto longs = [&](W::Part p) { return static_cast<int64_t*>(part(p)); };
  // (Empty parts are null, as the data_ptr() of an empty tensor was: the layouts allow it.)
  auto* send_counts = static_cast<int64_t*>(at(W::kSendCounts));
  auto* send_index = static_cast<int64_t*>(at(W::kSendIndex));
  auto* meta = static_cast<int32_t*>(part(W::kMeta));
  try {
    moe_dispatch_layout(topk_idx, id_bytes, tokens, topk, num_experts, pes, send_counts, send_index, meta,
                        longs(W::kPairPe), longs(W::kPairRank), stream,
                        part(W::kDispatchScratch), w.bytes[W::kDispatchScratch]);
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error& error) {
    engine.refuse(error.what(), stream, timeout_seconds);
  }
  // The token rows stay in the receive region (the grouping reads them there); the meta rows
  // are compacted into recv_meta for the receive layout.
  const int64_t recv_rows = w.recv_rows;
  auto* recv_meta = static_cast<int32_t*>(part(W::kRecvMeta));
  auto* recv_counts = static_cast<int64_t*>(at(W::kRecvCounts));
  auto* recv_offsets = static_cast<int64_t*>(at(W::kRecvOffsets));
  const std::vector<AllToAllField> fields = {{x, nullptr, row_bytes, tokens, 0},
                                             {meta, recv_meta, (topk + 1) * 4, tokens, recv_rows}};
  AllToAllRegion in_region;  // this call's region, taken under the buffer's lock by exchange()
  const int64_t call = engine.exchange(fields, send_counts, send_index, pes * tokens + 1, recv_counts, recv_offsets,
                                       stream, timeout_seconds, &in_region);
  try {
    const uint8_t* region = in_region.field[0];
    const int64_t stride = in_region.stride;
    const bool scatter = moe_region_rows_scatter(row_bytes);
    int64_t* positions = scatter ? longs(W::kPositions) : nullptr;
    int64_t* row_of = longs(W::kRowOf);
    int64_t* num_rows = longs(W::kNumRows);
    moe_receive_layout(recv_meta, recv_rows, topk, recv_counts, pes, my_pe(), w.experts_per_pe, row_of,
                       longs(W::kExpertCounts), longs(W::kExpertOffsets),
                       num_rows, longs(W::kExpertOfRow), longs(W::kSourcePe),
                       longs(W::kSourceToken), longs(W::kCombineIndex),
                       longs(W::kCombineCounts), positions, stream,
                       part(W::kReceiveScratch), w.bytes[W::kReceiveScratch]);
    void* recv_x = part(W::kRecvX);
    if (scatter) {
      // Each received row read once and written to each of its experts' rows.
      scatter_region_rows(recv_x, w.pairs(), region, stride, recv_offsets, recv_counts, pes, positions, topk,
                          recv_rows, row_bytes, stream);
    } else {
      gather_region_rows(recv_x, region, stride, recv_offsets, recv_counts, pes, row_of, num_rows, w.pairs(),
                         row_bytes, stream);
    }
  } catch (...) {
    release_after_failure(engine, call, stream);
    throw;  // the first error
  }
  engine.release(call, stream);
  return call;
}

namespace {
// moe_combine_region and moe_combine_region_summed: this PE's checks (a refusal still runs the
// round), the exchange of field 0 (y's rows by index, or the sums `summed` describes), the
// reduction from the region with pairs (pair_pe, pair_rank) and weights [tokens, topk], the
// release (after a failure too).
void combine_through_region(AllToAll& engine, const void* y, int64_t send_rows, int64_t hidden, int dtype,
                            const int64_t* send_counts, const int64_t* send_index, int64_t index_rows,
                            const AllToAllSummedRows* summed, const int64_t* pair_pe, const int64_t* pair_rank,
                            const float* weights, int64_t tokens, int64_t topk, void* out, int64_t* back_counts,
                            int64_t* back_offsets, cudaStream_t stream, double timeout_seconds, uint64_t tag) {
  try {
    PDC_REQUIRE(dtype == kReduceFloat32 || dtype == kReduceBfloat16 || dtype == kReduceFloat16,
                "moe_combine_region: dtype code " << dtype << " is not float32 (0), bfloat16 (1) or float16 (2)");
    PDC_REQUIRE(hidden >= 1 && send_rows >= 0, "moe_combine_region: hidden " << hidden << ", rows " << send_rows);
  } catch (const Error& error) {
    engine.refuse(error.what(), stream, timeout_seconds);
  }
  const int64_t row_bytes = hidden * (dtype == kReduceFloat32 ? 4 : 2);
  const std::vector<AllToAllField> fields = {{y, nullptr, row_bytes, send_rows, 0}};
  // The rows stay in the receive region: the reduction reads each (token, k)'s row there
  // (source pair_pe, row pair_rank), with no compaction copy and no slot tensor.
  AllToAllRegion in_region;  // this call's region, taken under the buffer's lock by exchange()
  const int64_t call = engine.exchange(fields, send_counts, send_index, index_rows, back_counts, back_offsets,
                                       stream, timeout_seconds, &in_region, tag, false, summed);
  try {
    moe_combine_reduce_region(out, in_region.field[0], in_region.stride, pair_pe, pair_rank, back_counts,
                              n_pes(), weights, tokens, topk, hidden, dtype, stream);
  } catch (...) {
    release_after_failure(engine, call, stream);
    throw;  // the first error
  }
  engine.release(call, stream);
}
}  // namespace

void moe_combine_region(AllToAll& engine, const void* y, int64_t y_rows, int64_t hidden, int dtype,
                        const int64_t* combine_counts, const int64_t* combine_index, int64_t index_rows,
                        const int64_t* pair_pe, const int64_t* pair_rank, const float* weights, int64_t tokens,
                        int64_t topk, void* out, int64_t* back_counts, int64_t* back_offsets, cudaStream_t stream,
                        double timeout_seconds, uint64_t tag) {
  combine_through_region(engine, y, y_rows, hidden, dtype, combine_counts, combine_index, index_rows, nullptr,
                         pair_pe, pair_rank, weights, tokens, topk, out, back_counts, back_offsets, stream,
                         timeout_seconds, tag);
}

void moe_combine_region_summed(AllToAll& engine, const void* y, int64_t y_rows, int64_t hidden, int dtype,
                               const int64_t* pair_row, const float* pair_weight, int64_t recv_rows, int64_t topk,
                               const int64_t* recv_counts, const int64_t* token_pe, const int64_t* token_rank,
                               const float* unit_weights, int64_t tokens, int64_t width, void* out,
                               int64_t* back_counts, int64_t* back_offsets, cudaStream_t stream,
                               double timeout_seconds, uint64_t tag) {
  // The received tokens are in source order already: recv_counts[d] sums go to PE d, no index.
  const AllToAllSummedRows summed{y, y_rows, pair_row, pair_weight, topk, dtype};
  combine_through_region(engine, nullptr, recv_rows, hidden, dtype, recv_counts, nullptr, 0, &summed, token_pe,
                         token_rank, unit_weights, tokens, width, out, back_counts, back_offsets, stream,
                         timeout_seconds, tag);
}

}  // namespace pydatacopy
