// Bindings of two-sided send/recv (send_recv.hpp), with the hot path's METH_FASTCALL entries.
#include "bindings.hpp"

#include <string>
#include <tuple>
#include <vector>
#include "pydatacopy/send_recv.hpp"

namespace pydatacopy::bindings {

namespace {

// ---- send, recv and sendrecv from the hot path (outside group()) ----
//
// As put_fast: the engine's pybind11 methods with their five or eight arguments go through
// pybind11's dispatch; these take the engine (a SendRecvEngine) first, then the method's
// arguments positionally (the engine takes its own lock, send_recv.hpp).
bool engine_argument(PyObject* value, SendRecvEngine*& out) {
  out = nullptr;
  try {
    out = py::handle(value).cast<SendRecvEngine*>();  // None casts to nullptr
  } catch (const py::cast_error&) {
  }
  if (out == nullptr)
    PyErr_Format(PyExc_TypeError, "the first argument must be a SendRecvEngine, got %s", Py_TYPE(value)->tp_name);
  return out != nullptr;
}

// send_fast / recv_fast(engine, address, bytes, peer, stream, timeout)
template <bool Send>
PyObject* one_way_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != 6) {
    PyErr_SetString(PyExc_TypeError, "takes 6 positional arguments: engine, address, bytes, peer, stream, timeout");
    return nullptr;
  }
  SendRecvEngine* engine = nullptr;
  unsigned long long address = 0, bytes = 0, stream = 0;
  int peer = 0;
  double timeout = 0;
  if (!engine_argument(args[0], engine) || !unsigned_argument(args[1], address) ||
      !unsigned_argument(args[2], bytes) || !int_argument(args[3], peer) ||
      !unsigned_argument(args[4], stream) || !double_argument(args[5], timeout))
    return nullptr;
  return without_gil([&] {
    flush_torch_backend_queue();
    if constexpr (Send)
      engine->send(as_pointer<const void>(address), bytes, peer, as_stream(stream), timeout);
    else
      engine->recv(as_pointer<void>(address), bytes, peer, as_stream(stream), timeout);
  });
}

// sendrecv_fast(engine, src, send_bytes, dst_pe, dst, recv_bytes, src_pe, stream, timeout)
PyObject* sendrecv_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != 9) {
    PyErr_SetString(PyExc_TypeError, "takes 9 positional arguments: engine, src, send_bytes, dst_pe, "
                                     "dst, recv_bytes, src_pe, stream, timeout");
    return nullptr;
  }
  SendRecvEngine* engine = nullptr;
  unsigned long long src = 0, send_bytes = 0, dst = 0, recv_bytes = 0, stream = 0;
  int dst_pe = 0, src_pe = 0;
  double timeout = 0;
  if (!engine_argument(args[0], engine) || !unsigned_argument(args[1], src) ||
      !unsigned_argument(args[2], send_bytes) || !int_argument(args[3], dst_pe) ||
      !unsigned_argument(args[4], dst) || !unsigned_argument(args[5], recv_bytes) ||
      !int_argument(args[6], src_pe) || !unsigned_argument(args[7], stream) ||
      !double_argument(args[8], timeout))
    return nullptr;
  return without_gil([&] {
    flush_torch_backend_queue();
    engine->sendrecv(as_pointer<const void>(src), send_bytes, dst_pe, as_pointer<void>(dst), recv_bytes,
                     src_pe, as_stream(stream), timeout);
  });
}

PyMethodDef g_send_recv_fast_calls[] = {
    fast_call("send_fast", &one_way_fastcall<true>,
              "send_fast(engine, src, bytes, dst_pe, stream, timeout): engine.send, positional only (the hot path)"),
    fast_call("recv_fast", &one_way_fastcall<false>,
              "recv_fast(engine, dst, bytes, src_pe, stream, timeout): engine.recv, positional only (the hot path)"),
    fast_call("sendrecv_fast", &sendrecv_fastcall,
              "sendrecv_fast(engine, src, send_bytes, dst_pe, dst, recv_bytes, src_pe, stream, timeout): "
              "engine.sendrecv, positional only (the hot path)"),
};

}  // namespace

void bind_send_recv(py::module_& m) {
  // Two-sided copies through symmetric staging.
  py::class_<SendRecvEngine>(m, "SendRecvEngine")
      .def(py::init<>())
      .def("init", &SendRecvEngine::init, py::arg("chunk_bytes"), py::arg("num_chunks"), py::arg("blocks"),
           release_gil())
      .def("cleanup", &SendRecvEngine::cleanup, release_gil())
      .def_property_readonly("initialized", without_gil_getter(&SendRecvEngine::initialized))
      .def_property_readonly("chunk_bytes", without_gil_getter(&SendRecvEngine::chunk_bytes))
      .def_property_readonly("num_chunks", without_gil_getter(&SendRecvEngine::num_chunks))
      .def_property_readonly("blocks", without_gil_getter(&SendRecvEngine::blocks))
      .def_property_readonly("narrow_blocks", without_gil_getter(&SendRecvEngine::narrow_blocks),
                             "PYDATACOPY_NARROW_SEND_BLOCKS as init read it: messages under NARROW_MESSAGE_BYTES")
      .def_property_readonly("symmetric_bytes", without_gil_getter(&SendRecvEngine::symmetric_bytes))
      .def_property_readonly("max_grid", without_gil_getter(&SendRecvEngine::max_grid),
                             "blocks of a launch at most (what can be resident at once for this PE)")
      .def("slices_for", &SendRecvEngine::slices_for, py::arg("bytes"), release_gil(),
           "slices (per-op block slots) a message of `bytes` moves on")
      .def_static("symmetric_bytes_needed", &SendRecvEngine::symmetric_bytes_needed, py::arg("n_pes"),
                  py::arg("chunk_bytes"), py::arg("num_chunks"), py::arg("blocks"))
      .def("check_refusals", &SendRecvEngine::check_refusals, release_gil(),
           "Raise, once per channel, a size mismatch a receiver found after this PE's send completed.")
      .def("send", [](SendRecvEngine& self, std::uintptr_t src, std::size_t bytes, int dst_pe,
                      std::uintptr_t stream, double timeout) {
             flush_torch_backend_queue();
             self.send(as_pointer<const void>(src), bytes, dst_pe, as_stream(stream), timeout);
           }, py::arg("src"), py::arg("bytes"), py::arg("dst_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("recv", [](SendRecvEngine& self, std::uintptr_t dst, std::size_t bytes, int src_pe,
                      std::uintptr_t stream, double timeout) {
             flush_torch_backend_queue();
             self.recv(as_pointer<void>(dst), bytes, src_pe, as_stream(stream), timeout);
           }, py::arg("dst"), py::arg("bytes"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("sendrecv", [](SendRecvEngine& self, std::uintptr_t src, std::size_t send_bytes, int dst_pe,
                          std::uintptr_t dst, std::size_t recv_bytes, int src_pe, std::uintptr_t stream,
                          double timeout) {
             flush_torch_backend_queue();
             self.sendrecv(as_pointer<const void>(src), send_bytes, dst_pe, as_pointer<void>(dst),
                           recv_bytes, src_pe, as_stream(stream), timeout);
           }, py::arg("src"), py::arg("send_bytes"), py::arg("dst_pe"), py::arg("dst"),
           py::arg("recv_bytes"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("batch", [](SendRecvEngine& self, const std::vector<std::tuple<bool, std::uintptr_t, std::size_t, int>>& ops,
                       std::uintptr_t stream, double timeout) {
             std::vector<SendRecvEngine::Operation> list;
             for (const auto& [send, buffer, bytes, peer] : ops)
               list.push_back({send, as_pointer<void>(buffer), bytes, peer});
             self.batch(list, as_stream(stream), timeout);  // (group() launched the backend's queue at its start)
           }, py::arg("ops"), py::arg("stream"), py::arg("timeout"), release_gil(),
           "ops: (is_send, address, bytes, peer) tuples, run in one launch")
      .def_property_readonly("zero_copy_min_bytes", without_gil_getter(&SendRecvEngine::zero_copy_min_bytes),
                             "messages of at least this many bytes between load/store peers move once (0: never)")
      .def("set_zero_copy_min_bytes", &SendRecvEngine::set_zero_copy_min_bytes, py::arg("bytes"), release_gil(),
           "collective: every PE, the same value, between calls (bench and tests: 0 turns zero-copy off)")
      .def_property_readonly("low_latency_max_bytes", without_gil_getter(&SendRecvEngine::low_latency_max_bytes),
                             "messages of at most this many bytes between load/store peers move by the "
                             "low-latency protocol (0: never)")
      .def("set_low_latency_max_bytes", &SendRecvEngine::set_low_latency_max_bytes, py::arg("bytes"), release_gil(),
           "collective: every PE, the same value (at most LOW_LATENCY_CAPACITY_BYTES), between calls")
      .def_static("set_phase_stamps", &SendRecvEngine::set_phase_stamps, py::arg("on"), release_gil(),
                  "test hook: every send/recv launch records its phases' %globaltimer (on: empties the ring)")
      .def_static("phase_stamps", &SendRecvEngine::phase_stamps, release_gil(),
                  "test hook: the last 1024 launches' stamps in ns (phase_stamp_names(); 0: not reached), then "
                  "op 0's mode and whether it is a send")
      .def_static("set_zero_copy_fallback_waits", &SendRecvEngine::set_zero_copy_fallback_waits,
                  py::arg("held_seconds"), py::arg("long_seconds"), release_gil(),
                  "test hook: the bounded descriptor wait's two bounds (ZERO_COPY_FALLBACK_WAIT_NS, "
                  "ZERO_COPY_FALLBACK_LONG_WAIT_NS by default); process-wide, between calls")
      .def_static("phase_stamp_names", &SendRecvEngine::phase_stamp_names,
                  "the names of a phase_stamps() record's stamps, in order")
      .def("set_host_phases", &SendRecvEngine::set_host_phases, py::arg("on"), release_gil(),
           "benchmark hook: while on, this engine's calls sum their host time per phase (host_phase_names())")
      .def("host_phases", [](SendRecvEngine& self) {
             const std::vector<uint64_t> v = [&self] {
               py::gil_scoped_release release;  // the engine's lock
               return self.host_phases();
             }();
             py::dict out;
             out["calls"] = v[0];
             const std::vector<std::string> names = SendRecvEngine::host_phase_names();
             for (std::size_t i = 0; i < names.size(); ++i) out[py::str(names[i])] = v[i + 1];
             return out;
           }, "the calls counted and ns per phase since set_host_phases(True) or the last read, which clears them")
      .def_static("host_phase_names", &SendRecvEngine::host_phase_names, "the host phases of a call, in order")
      .def("service_zero_copy", &SendRecvEngine::service_zero_copy, release_gil(), "serve the peers' zero-copy mapping requests (never blocks)")
      .def("set_zero_copy_wait_seconds", &SendRecvEngine::set_zero_copy_wait_seconds, py::arg("seconds"),
           "test hook: how long an eager recv waits once for its mapping (PYDATACOPY_ZERO_COPY_PROGRESS)")
      .def_property_readonly_static("DEFAULT_ZERO_COPY_WAIT_SECONDS",
                                    [](py::object) { return SendRecvEngine::kDefaultZeroCopyWaitSeconds; })
      .def_property_readonly("copy_engine_min_bytes", without_gil_getter(&SendRecvEngine::copy_engine_min_bytes))
      .def("set_copy_engine_min_bytes", &SendRecvEngine::set_copy_engine_min_bytes, py::arg("bytes"), release_gil(),
           "local, between calls: the smallest zero-copy send the copy engine may move (0: off)")
      .def("copy_engine_status", &SendRecvEngine::copy_engine_status, release_gil(),
           "the copy engine's sends: 'on from N bytes', or 'off: ' and why")
      .def("stats", [](SendRecvEngine& self) {
             const std::vector<SendRecvEngine::PeerStats> all = [&self] {
               py::gil_scoped_release release;  // the engine's lock
               return self.stats();
             }();
             py::list out;
             for (const SendRecvEngine::PeerStats& s : all) {
               py::dict d;
               d["peer"] = s.peer;
               d["send_one_copy"] = s.send_one_copy, d["send_staged"] = s.send_staged;
               d["send_low_latency"] = s.send_low_latency, d["send_copy_engine"] = s.send_copy_engine;
               d["recv_one_copy"] = s.recv_one_copy, d["recv_staged"] = s.recv_staged;
               d["recv_low_latency"] = s.recv_low_latency;
               d["map_requests"] = s.map_requests, d["not_exportable"] = s.not_exportable;
               d["refused"] = s.refused, d["mapped_here"] = s.mapped_here;
               out.append(d);
             }
             return out;
           }, "per peer: ops finished by path since setup (counted on the device: synchronise first) "
              "and the zero-copy mapping bookkeeping (pydatacopy.stats())")
      .def("zero_copy_counters", [](SendRecvEngine& self) {
             const std::vector<uint64_t> v = [&self] {
               py::gil_scoped_release release;  // the engine's lock (see without_gil_getter)
               return self.zero_copy_counters();
             }();
             static const char* names[] = {"send_staged", "send_zero_copy", "recv_staged", "recv_zero_copy",
                                           "send_low_latency", "recv_low_latency", "send_copy_engine",
                                           "map_requests", "acked", "refused", "not_exportable",
                                           "stale_dropped", "evicted", "opened", "closed",
                                           "chunk_requests", "chunks_acked", "chunks_dropped",
                                           "chunks_mapped", "chunk_failed", "chunks_unmapped"};
             py::dict out;
             for (std::size_t i = 0; i < v.size() && i < sizeof(names) / sizeof(names[0]); ++i)
               out[names[i]] = v[i];
             return out;
           }, "test hook: ops finished by mode (counted on the device: synchronise first) and the "
              "mapping bookkeeping, since init");
  add_fast_calls(m, g_send_recv_fast_calls, sizeof(g_send_recv_fast_calls) / sizeof(g_send_recv_fast_calls[0]));
}

}  // namespace pydatacopy::bindings
