// Bindings of the all-to-all-v with counts on the GPU and MoE's layouts and reductions (all_to_all.hpp).
#include "bindings.hpp"

#include <string>
#include <tuple>
#include <vector>
#include "pydatacopy/all_to_all.hpp"
#include "pydatacopy/moe.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"

namespace pydatacopy::bindings {

void bind_moe(py::module_& m) {
  // The all-to-all-v with counts on the GPU (all_to_all.hpp), and MoE combine's reduction.
  py::class_<AllToAll>(m, "AllToAll")
      .def(py::init<>())
      .def("init", &AllToAll::init, py::arg("capacity"), py::arg("max_row_bytes"), release_gil(),
           "Allocate the receive regions on every PE (collective, blocking)")
      .def("cleanup", &AllToAll::cleanup, release_gil(), "Free them on every PE (collective, blocking)")
      .def_property_readonly("initialized", &AllToAll::initialized)
      .def_property_readonly("capacity", &AllToAll::capacity)
      .def_property_readonly("max_row_bytes", &AllToAll::max_row_bytes)
      .def_property_readonly("calls", &AllToAll::calls)
      .def_property_readonly("symmetric_bytes", &AllToAll::symmetric_bytes)
      .def_property_readonly("sums_in_send", &AllToAll::sums_in_send)
      .def_static("symmetric_bytes_needed", &AllToAll::symmetric_bytes_needed, py::arg("capacity"),
                  py::arg("max_row_bytes"), py::arg("n_pes"))
      .def("exchange",
           [](AllToAll& self,
              const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, int64_t, int64_t, int64_t>>& fields,
              std::uintptr_t send_counts, std::uintptr_t send_index, int64_t index_rows,
              std::uintptr_t recv_counts, std::uintptr_t recv_offsets, std::uintptr_t stream,
              double timeout, uint64_t tag) {
             std::vector<AllToAllField> list;
             for (const auto& [send, recv, row_bytes, send_rows, recv_rows] : fields)
               list.push_back({as_pointer<const void>(send), as_pointer<void>(recv), row_bytes, send_rows, recv_rows});
             return self.exchange(list, as_pointer<const int64_t>(send_counts), as_pointer<const int64_t>(send_index),
                                  index_rows, as_pointer<int64_t>(recv_counts), as_pointer<int64_t>(recv_offsets),
                                  as_stream(stream), timeout, nullptr, tag);  // the call's number (release() takes it)
           },
           py::arg("fields"), py::arg("send_counts"), py::arg("send_index"), py::arg("index_rows"),
           py::arg("recv_counts"), py::arg("recv_offsets"), py::arg("stream"), py::arg("timeout"),
           py::arg("tag") = 0, release_gil(),
           "fields: (send, recv, row_bytes, send_rows, recv_rows) tuples (addresses as ints); "
           "send_index 0 for none; recv 0: the rows stay in the receive region (in_region, release); "
           "tag: the call's identity, compared on the device with every source's. Returns the call's number")
      .def("exchange_compact",
           [](AllToAll& self,
              const std::vector<std::tuple<std::uintptr_t, int64_t, int64_t>>& fields,
              std::uintptr_t send_counts, std::uintptr_t send_index, int64_t index_rows,
              std::uintptr_t recv_counts, std::uintptr_t recv_offsets, std::uintptr_t stream,
              double timeout, uint64_t tag) {
             std::vector<AllToAllField> list;
             for (const auto& [send, row_bytes, send_rows] : fields)
               list.push_back({as_pointer<const void>(send), nullptr, row_bytes, send_rows, 0});
             AllToAllRegion region;
             const int64_t call = self.exchange(list, as_pointer<const int64_t>(send_counts),
                                                as_pointer<const int64_t>(send_index), index_rows,
                                                as_pointer<int64_t>(recv_counts), as_pointer<int64_t>(recv_offsets),
                                                as_stream(stream), timeout, &region, tag, /*compact=*/true);
             std::vector<std::uintptr_t> at;
             for (std::size_t f = 0; f < list.size(); ++f) at.push_back(reinterpret_cast<std::uintptr_t>(region.field[f]));
             return std::make_tuple(call, at);
           },
           py::arg("fields"), py::arg("send_counts"), py::arg("send_index"), py::arg("index_rows"),
           py::arg("recv_counts"), py::arg("recv_offsets"), py::arg("stream"), py::arg("timeout"),
           py::arg("tag") = 0, release_gil(),
           "A compact call (all_to_all.hpp): fields as (send, row_bytes, send_rows) tuples; the rows land "
           "packed by source in the receive region, valid until this PE's call two later on the buffer. "
           "Returns (the call's number, each field's packed rows' device address)")
      .def("refuse",
           [](AllToAll& self, const std::string& why, std::uintptr_t stream, double timeout, bool compact) {
             self.refuse(why, as_stream(stream), timeout, compact);
           },
           py::arg("why"), py::arg("stream"), py::arg("timeout"), py::arg("compact") = false, release_gil(),
           "A round in refuse mode (this PE sends nothing; its peers' calls complete and record the "
           "refusal), then raise Error(why); compact: the peers' call is compact")
      .def("in_region",
           [](const AllToAll& self, int field) { return reinterpret_cast<std::uintptr_t>(self.in_region(field)); },
           py::arg("field"), "Device address of field's rows from source 0 in the last call's region")
      .def_property_readonly("region_stride", &AllToAll::region_stride)
      .def("release",
           [](AllToAll& self, int64_t call, std::uintptr_t stream) { self.release(call, as_stream(stream)); },
           py::arg("call"), py::arg("stream"), release_gil(),
           "Hand call's receive regions back to the sources (stream-ordered)");
  m.def("zero_rows_past",
        [](std::uintptr_t out, int64_t rows, int64_t row_bytes, std::uintptr_t counts, int n_counts,
           std::uintptr_t stream) {
          zero_rows_past(as_pointer<void>(out), rows, row_bytes, as_pointer<const int64_t>(counts), n_counts,
                         as_stream(stream));
        },
        py::arg("out"), py::arg("rows"), py::arg("row_bytes"), py::arg("counts"), py::arg("n_counts"),
        py::arg("stream"), "Rows [sum(counts), rows) of out set to zero (counts: device int64, read on the GPU)");
  m.def("moe_combine_reduce",
        [](std::uintptr_t out, std::uintptr_t rows, int64_t row_count, std::uintptr_t slots,
           std::uintptr_t weights, int64_t tokens, int64_t topk, int64_t hidden, int dtype,
           std::uintptr_t stream) {
          moe_combine_reduce(as_pointer<void>(out), as_pointer<const void>(rows), row_count,
                             as_pointer<const int64_t>(slots), as_pointer<const float>(weights), tokens,
                             topk, hidden, dtype, as_stream(stream));
        },
        py::arg("out"), py::arg("rows"), py::arg("row_count"), py::arg("slots"), py::arg("weights"),
        py::arg("tokens"), py::arg("topk"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"),
        release_gil(), "out[t] = sum_k weights[t,k] * rows[slots[t,k]] (float32, in k order); dtype 0 f32, 1 bf16, 2 f16");
  m.def("gather_rows",
        [](std::uintptr_t out, std::uintptr_t src, std::uintptr_t index, std::uintptr_t count, int64_t rows,
           int64_t src_rows, int64_t row_bytes, std::uintptr_t stream) {
          gather_rows(as_pointer<void>(out), as_pointer<const void>(src), as_pointer<const int64_t>(index),
                      as_pointer<const int64_t>(count), rows, src_rows, row_bytes, as_stream(stream));
        },
        py::arg("out"), py::arg("src"), py::arg("index"), py::arg("count"), py::arg("rows"),
        py::arg("src_rows"), py::arg("row_bytes"), py::arg("stream"), release_gil(),
        "out[i] = src[index[i]] for i < min(*count, rows) (count: a device int64)");
  m.def("moe_dispatch_layout",
        [](std::uintptr_t topk_idx, int id_bytes, int64_t tokens, int64_t topk, int64_t num_experts, int n_pes,
           std::uintptr_t send_counts, std::uintptr_t send_index, std::uintptr_t meta, std::uintptr_t pair_pe,
           std::uintptr_t pair_rank, std::uintptr_t stream, std::uintptr_t scratch, int64_t scratch_bytes) {
          moe_dispatch_layout(as_pointer<const void>(topk_idx), id_bytes, tokens, topk, num_experts, n_pes,
                              as_pointer<int64_t>(send_counts), as_pointer<int64_t>(send_index),
                              as_pointer<int32_t>(meta), as_pointer<int64_t>(pair_pe),
                              as_pointer<int64_t>(pair_rank), as_stream(stream), as_pointer<void>(scratch),
                              scratch_bytes);
        },
        py::arg("topk_idx"), py::arg("id_bytes"), py::arg("tokens"), py::arg("topk"), py::arg("num_experts"),
        py::arg("n_pes"), py::arg("send_counts"), py::arg("send_index"), py::arg("meta"), py::arg("pair_pe"),
        py::arg("pair_rank"), py::arg("stream"), py::arg("scratch") = 0, py::arg("scratch_bytes") = 0,
        release_gil(),
        "MoE dispatch's sender layout (all_to_all.hpp); addresses as ints; a scratch of "
        "moe_dispatch_layout_scratch_bytes for large inputs' multi-block path");
  m.def("moe_dispatch_layout_scratch_bytes", &moe_dispatch_layout_scratch_bytes, py::arg("tokens"),
        py::arg("topk"), py::arg("n_pes"), "scratch bytes of moe_dispatch_layout's multi-block path (0: none)");
  m.def("moe_receive_layout",
        [](std::uintptr_t recv_meta, int64_t rows, int64_t topk, std::uintptr_t recv_counts, int n_pes, int my_pe,
           int64_t experts_per_pe, std::uintptr_t row_of, std::uintptr_t expert_counts,
           std::uintptr_t expert_offsets, std::uintptr_t num_rows, std::uintptr_t expert_of_row,
           std::uintptr_t source_pe, std::uintptr_t source_token, std::uintptr_t combine_index,
           std::uintptr_t combine_counts, std::uintptr_t pair_position, std::uintptr_t stream,
           std::uintptr_t scratch, int64_t scratch_bytes) {
          moe_receive_layout(as_pointer<const int32_t>(recv_meta), rows, topk, as_pointer<const int64_t>(recv_counts),
                             n_pes, my_pe, experts_per_pe, as_pointer<int64_t>(row_of),
                             as_pointer<int64_t>(expert_counts), as_pointer<int64_t>(expert_offsets),
                             as_pointer<int64_t>(num_rows), as_pointer<int64_t>(expert_of_row),
                             as_pointer<int64_t>(source_pe), as_pointer<int64_t>(source_token),
                             as_pointer<int64_t>(combine_index), as_pointer<int64_t>(combine_counts),
                             as_pointer<int64_t>(pair_position), as_stream(stream), as_pointer<void>(scratch),
                             scratch_bytes);
        },
        py::arg("recv_meta"), py::arg("rows"), py::arg("topk"), py::arg("recv_counts"), py::arg("n_pes"),
        py::arg("my_pe"), py::arg("experts_per_pe"), py::arg("row_of"), py::arg("expert_counts"),
        py::arg("expert_offsets"), py::arg("num_rows"), py::arg("expert_of_row"), py::arg("source_pe"),
        py::arg("source_token"), py::arg("combine_index"), py::arg("combine_counts"), py::arg("pair_position"),
        py::arg("stream"), py::arg("scratch") = 0, py::arg("scratch_bytes") = 0,
        release_gil(),
        "MoE dispatch's receiver layout (all_to_all.hpp); addresses as ints; a scratch of "
        "moe_receive_layout_scratch_bytes for large inputs' multi-block path");
  m.def("moe_token_destinations",
        [](std::uintptr_t send_counts, std::uintptr_t send_index, std::uintptr_t pair_pe, int64_t tokens,
           int64_t topk, int n_pes, std::uintptr_t token_pe, std::uintptr_t token_rank, std::uintptr_t stream) {
          moe_token_destinations(as_pointer<const int64_t>(send_counts), as_pointer<const int64_t>(send_index),
                                 as_pointer<const int64_t>(pair_pe), tokens, topk, n_pes,
                                 as_pointer<int64_t>(token_pe), as_pointer<int64_t>(token_rank), as_stream(stream));
        },
        py::arg("send_counts"), py::arg("send_index"), py::arg("pair_pe"), py::arg("tokens"), py::arg("topk"),
        py::arg("n_pes"), py::arg("token_pe"), py::arg("token_rank"), py::arg("stream"), release_gil(),
        "expand=False's sender layout (all_to_all.hpp): each token's PEs and its rank at each; one kernel");
  m.def("moe_local_topk",
        [](std::uintptr_t recv_meta, int64_t rows, int64_t topk, std::uintptr_t recv_counts, int n_pes, int my_pe,
           int64_t experts_per_pe, std::uintptr_t recv_topk_idx, std::uintptr_t recv_topk_weights,
           std::uintptr_t source_token, std::uintptr_t num_rows, std::uintptr_t stream) {
          moe_local_topk(as_pointer<const int32_t>(recv_meta), rows, topk, as_pointer<const int64_t>(recv_counts),
                         n_pes, my_pe, experts_per_pe, as_pointer<int64_t>(recv_topk_idx),
                         as_pointer<float>(recv_topk_weights), as_pointer<int64_t>(source_token),
                         as_pointer<int64_t>(num_rows), as_stream(stream));
        },
        py::arg("recv_meta"), py::arg("rows"), py::arg("topk"), py::arg("recv_counts"), py::arg("n_pes"),
        py::arg("my_pe"), py::arg("experts_per_pe"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
        py::arg("source_token"), py::arg("num_rows"), py::arg("stream"), release_gil(),
        "expand=False's receiver layout (all_to_all.hpp): local expert ids, weights zeroed in place, source "
        "tokens, rows received; one kernel");
  m.def("moe_receive_layout_scratch_bytes", &moe_receive_layout_scratch_bytes, py::arg("rows"), py::arg("topk"),
        py::arg("experts_per_pe"), "scratch bytes of moe_receive_layout's multi-block path (0: none)");
  m.def("gather_region_rows",
        [](std::uintptr_t out, std::uintptr_t region, int64_t stride, std::uintptr_t recv_offsets,
           std::uintptr_t recv_counts, int n_sources, std::uintptr_t index, std::uintptr_t count, int64_t rows,
           int64_t row_bytes, std::uintptr_t stream) {
          gather_region_rows(as_pointer<void>(out), as_pointer<const void>(region), stride,
                             as_pointer<const int64_t>(recv_offsets), as_pointer<const int64_t>(recv_counts),
                             n_sources, as_pointer<const int64_t>(index), as_pointer<const int64_t>(count), rows,
                             row_bytes, as_stream(stream));
        },
        py::arg("out"), py::arg("region"), py::arg("stride"), py::arg("recv_offsets"), py::arg("recv_counts"),
        py::arg("n_sources"), py::arg("index"), py::arg("count"), py::arg("rows"), py::arg("row_bytes"),
        py::arg("stream"), release_gil(), "gather_rows straight from an all-to-all receive region");
  m.def("scatter_region_rows",
        [](std::uintptr_t out, int64_t out_rows, std::uintptr_t region, int64_t stride, std::uintptr_t recv_offsets,
           std::uintptr_t recv_counts, int n_sources, std::uintptr_t positions, int64_t topk, int64_t rows,
           int64_t row_bytes, std::uintptr_t stream) {
          scatter_region_rows(as_pointer<void>(out), out_rows, as_pointer<const void>(region), stride,
                              as_pointer<const int64_t>(recv_offsets), as_pointer<const int64_t>(recv_counts),
                              n_sources, as_pointer<const int64_t>(positions), topk, rows, row_bytes,
                              as_stream(stream));
        },
        py::arg("out"), py::arg("out_rows"), py::arg("region"), py::arg("stride"), py::arg("recv_offsets"),
        py::arg("recv_counts"), py::arg("n_sources"), py::arg("positions"), py::arg("topk"), py::arg("rows"),
        py::arg("row_bytes"), py::arg("stream"), release_gil(),
        "MoE grouping by expert from an all-to-all receive region, each received row read once");
  m.def("moe_combine_reduce_region",
        [](std::uintptr_t out, std::uintptr_t region, int64_t stride, std::uintptr_t pair_pe,
           std::uintptr_t pair_rank, std::uintptr_t back_counts, int n_sources, std::uintptr_t weights,
           int64_t tokens, int64_t topk, int64_t hidden, int dtype, std::uintptr_t stream) {
          moe_combine_reduce_region(as_pointer<void>(out), as_pointer<const void>(region), stride,
                                    as_pointer<const int64_t>(pair_pe), as_pointer<const int64_t>(pair_rank),
                                    as_pointer<const int64_t>(back_counts), n_sources,
                                    as_pointer<const float>(weights), tokens, topk, hidden, dtype,
                                    as_stream(stream));
        },
        py::arg("out"), py::arg("region"), py::arg("stride"), py::arg("pair_pe"), py::arg("pair_rank"),
        py::arg("back_counts"), py::arg("n_sources"), py::arg("weights"), py::arg("tokens"), py::arg("topk"),
        py::arg("hidden"), py::arg("dtype"), py::arg("stream"), release_gil(),
        "moe_combine_reduce reading each pair's row from combine's receive region");
  // The region totals by name ({"recv_x": bytes, "handle": bytes, "scratch": bytes}).
  auto region_totals = [](const MoeDispatchWorkspace& w) {
    py::dict totals;
    for (int r = 0; r < MoeDispatchWorkspace::kRegions; ++r)
      totals[MoeDispatchWorkspace::kRegionNames[r]] = w.total(static_cast<MoeDispatchWorkspace::Region>(r));
    return totals;
  };
  m.def("moe_dispatch_workspace",
        [region_totals](int64_t tokens, int64_t topk, int n_pes, int64_t experts_per_pe, int64_t recv_rows,
                        int64_t row_bytes) -> py::object {
          if (!moe_dispatch_fits(tokens, topk, n_pes, experts_per_pe, recv_rows)) return py::none();
          const MoeDispatchWorkspace w(tokens, topk, n_pes, experts_per_pe, recv_rows, row_bytes);
          py::dict parts;
          for (int p = 0; p < MoeDispatchWorkspace::kParts; ++p)
            parts[MoeDispatchWorkspace::kNames[p]] = py::make_tuple(
                MoeDispatchWorkspace::kRegionNames[MoeDispatchWorkspace::kRegionOf[p]], w.offset[p], w.bytes[p]);
          return py::make_tuple(region_totals(w), parts);
        },
        py::arg("tokens"), py::arg("topk"), py::arg("n_pes"), py::arg("experts_per_pe"), py::arg("recv_rows"),
        py::arg("row_bytes"),
        "moe_dispatch_region's regions (moe.hpp): ({region: bytes}, {part: (region, offset, bytes)}), regions "
        "recv_x, handle, scratch; or None when the sizes are past the layout kernels' limits");
  m.def("moe_dispatch_workspace_bytes",
        [region_totals](int64_t tokens, int64_t topk, int n_pes, int64_t experts_per_pe, int64_t recv_rows,
                        int64_t row_bytes) {
          return region_totals(MoeDispatchWorkspace(tokens, topk, n_pes, experts_per_pe, recv_rows, row_bytes));
        },
        py::arg("tokens"), py::arg("topk"), py::arg("n_pes"), py::arg("experts_per_pe"), py::arg("recv_rows"),
        py::arg("row_bytes"), "{region: bytes} of moe_dispatch_region's regions (Error past the layout kernels' limits)");
  m.def("moe_dispatch_fits", &moe_dispatch_fits, py::arg("tokens"), py::arg("topk"), py::arg("n_pes"),
        py::arg("experts_per_pe"), py::arg("recv_rows"));
  m.def("moe_layout_kernels_fit", &moe_layout_kernels_fit, py::arg("n_pes"), py::arg("experts_per_pe"),
        py::arg("pairs"));
  m.def("moe_dispatch_region",
        [](AllToAll& engine, std::uintptr_t x, int64_t row_bytes, std::uintptr_t topk_idx, int id_bytes,
           int64_t tokens, int64_t topk, int64_t num_experts, std::uintptr_t recv_x, int64_t recv_x_bytes,
           std::uintptr_t handle, int64_t handle_bytes, std::uintptr_t scratch, int64_t scratch_bytes,
           std::uintptr_t stream, double timeout) {
          return moe_dispatch_region(engine, as_pointer<const void>(x), row_bytes, as_pointer<const void>(topk_idx), id_bytes,
                              tokens, topk, num_experts, as_pointer<void>(recv_x), recv_x_bytes,
                              as_pointer<void>(handle), handle_bytes, as_pointer<void>(scratch), scratch_bytes,
                              as_stream(stream), timeout);
        },
        py::arg("engine"), py::arg("x"), py::arg("row_bytes"), py::arg("topk_idx"), py::arg("id_bytes"),
        py::arg("tokens"), py::arg("topk"), py::arg("num_experts"), py::arg("recv_x"), py::arg("recv_x_bytes"),
        py::arg("handle"), py::arg("handle_bytes"), py::arg("scratch"), py::arg("scratch_bytes"),
        py::arg("stream"), py::arg("timeout"), release_gil(),
        "MoE dispatch's region path in one call (moe.hpp): layouts, exchange, grouping, release; "
        "returns the exchange's call number");
  m.def("moe_combine_region",
        [](AllToAll& engine, std::uintptr_t y, int64_t y_rows, int64_t hidden, int dtype, std::uintptr_t combine_counts,
           std::uintptr_t combine_index, int64_t index_rows, std::uintptr_t pair_pe, std::uintptr_t pair_rank,
           std::uintptr_t weights, int64_t tokens, int64_t topk, std::uintptr_t out, std::uintptr_t back_counts,
           std::uintptr_t back_offsets, std::uintptr_t stream, double timeout, uint64_t tag) {
          moe_combine_region(engine, as_pointer<const void>(y), y_rows, hidden, dtype,
                             as_pointer<const int64_t>(combine_counts), as_pointer<const int64_t>(combine_index),
                             index_rows, as_pointer<const int64_t>(pair_pe), as_pointer<const int64_t>(pair_rank),
                             as_pointer<const float>(weights), tokens, topk, as_pointer<void>(out),
                             as_pointer<int64_t>(back_counts), as_pointer<int64_t>(back_offsets), as_stream(stream),
                             timeout, tag);
        },
        py::arg("engine"), py::arg("y"), py::arg("y_rows"), py::arg("hidden"), py::arg("dtype"),
        py::arg("combine_counts"), py::arg("combine_index"), py::arg("index_rows"), py::arg("pair_pe"),
        py::arg("pair_rank"), py::arg("weights"), py::arg("tokens"), py::arg("topk"), py::arg("out"),
        py::arg("back_counts"), py::arg("back_offsets"), py::arg("stream"), py::arg("timeout"), py::arg("tag") = 0,
        release_gil(), "MoE combine's region path in one call (moe.hpp): the exchange back, the reduction, the release");
  m.def("moe_combine_region_summed",
        [](AllToAll& engine, std::uintptr_t y, int64_t y_rows, int64_t hidden, int dtype, std::uintptr_t pair_row,
           std::uintptr_t pair_weight, int64_t recv_rows, int64_t topk, std::uintptr_t recv_counts,
           std::uintptr_t token_pe, std::uintptr_t token_rank, std::uintptr_t unit_weights, int64_t tokens,
           int64_t width, std::uintptr_t out, std::uintptr_t back_counts, std::uintptr_t back_offsets,
           std::uintptr_t stream, double timeout, uint64_t tag) {
          moe_combine_region_summed(engine, as_pointer<const void>(y), y_rows, hidden, dtype,
                                    as_pointer<const int64_t>(pair_row), as_pointer<const float>(pair_weight),
                                    recv_rows, topk, as_pointer<const int64_t>(recv_counts),
                                    as_pointer<const int64_t>(token_pe), as_pointer<const int64_t>(token_rank),
                                    as_pointer<const float>(unit_weights), tokens, width, as_pointer<void>(out),
                                    as_pointer<int64_t>(back_counts), as_pointer<int64_t>(back_offsets),
                                    as_stream(stream), timeout, tag);
        },
        py::arg("engine"), py::arg("y"), py::arg("y_rows"), py::arg("hidden"), py::arg("dtype"), py::arg("pair_row"),
        py::arg("pair_weight"), py::arg("recv_rows"), py::arg("topk"), py::arg("recv_counts"), py::arg("token_pe"),
        py::arg("token_rank"), py::arg("unit_weights"), py::arg("tokens"), py::arg("width"), py::arg("out"),
        py::arg("back_counts"), py::arg("back_offsets"), py::arg("stream"), py::arg("timeout"), py::arg("tag") = 0,
        release_gil(),
        "MoE combine's pre_reduce path in one call (moe.hpp): each received token's local experts summed as "
        "its row is sent back, the sum across PEs at the source, the release");
  m.attr("MOE_REGION_ROW_ALIGNMENT") = kMoeRegionRowAlignment;
  m.attr("MOE_DISPATCH_WORKSPACE_ALIGNMENT") = MoeDispatchWorkspace::kAlignment;
  m.attr("ALL_TO_ALL_MAX_FIELDS") = AllToAllLayout::kMaxFields;
  m.attr("ALL_TO_ALL_MAX_PES") = AllToAllLayout::kMaxPes;
  m.attr("ALL_TO_ALL_MAX_ROW_BYTES") = AllToAllLayout::kMaxRowBytes;
  m.attr("ALL_TO_ALL_MAX_CAPACITY") = AllToAllLayout::kMaxCapacity;
  {
    py::dict dtypes;
    dtypes["float32"] = static_cast<int>(kReduceFloat32);
    dtypes["bfloat16"] = static_cast<int>(kReduceBfloat16);
    dtypes["float16"] = static_cast<int>(kReduceFloat16);
    m.attr("REDUCE_DTYPES") = dtypes;
  }
  m.attr("MOE_LAYOUT_MAX_PES") = kMoeLayoutMaxPes;
  m.attr("MOE_LAYOUT_MAX_EXPERTS_PER_PE") = kMoeLayoutMaxExpertsPerPe;
  m.attr("MOE_LAYOUT_MAX_PAIRS") = kMoeLayoutMaxPairs;
  m.def("check_all_to_all_refusal", &check_all_to_all_refusal,
        "Raise (once) an all-to-all refusal recorded on the device.");
}

}  // namespace pydatacopy::bindings
