// Bindings of the symmetric heap and the one-sided calls on it (symmetric.hpp, transfer.hpp, prepared_put_many.hpp).
#include "bindings.hpp"

#include <vector>
#include "pydatacopy/prepared_put_many.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"
#include "pydatacopy/transfer.hpp"
#include "rma/transfer_internal.hpp"
#include "kernels/api.cuh"

namespace pydatacopy::bindings {

namespace {

// put_many's rows, read from sequences of tensors through the tensors' own Python methods (this
// module links no libtorch) in one C++ pass: no Python loop, each fact asked once. The core
// checks that every dst is symmetric; what it cannot know (types, devices, layouts, dtypes,
// sizes) is checked here.
class TensorRows {
 public:
  // `call`: the public function named in errors.
  TensorRows(py::handle tensor_type, int device, const char* call = "pydatacopy.put_many")
      : type_(tensor_type), device_(device), call_(call) {}

  std::vector<TransferDescriptor> read(py::handle dsts, py::handle srcs) {
    const py::object dst_list = fast(dsts, "dsts"), src_list = fast(srcs, "srcs");
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(dst_list.ptr());
    PDC_REQUIRE(count == PySequence_Fast_GET_SIZE(src_list.ptr()),
                call_ << ": " << count << " destinations but "
                    << PySequence_Fast_GET_SIZE(src_list.ptr())
                    << " sources; pass one source per destination");
    PDC_REQUIRE(count <= INT_MAX, call_ << ": at most " << INT_MAX << " tensors per call");
    PyObject** dst_items = PySequence_Fast_ITEMS(dst_list.ptr());
    PyObject** src_items = PySequence_Fast_ITEMS(src_list.ptr());
    std::vector<TransferDescriptor> rows;
    rows.reserve(static_cast<std::size_t>(count));
    for (Py_ssize_t i = 0; i < count; ++i) {
      // dst's device needs no question: the core refuses any dst off this PE's symmetric heap.
      const Facts dst = facts(dst_items[i], "dsts", i, false);
      const Facts src = facts(src_items[i], "srcs", i, true);
      PDC_REQUIRE(dst.dtype.is(src.dtype),
                  call_ << ": dtype mismatch in row " << i << ": dst is "
                      << py::str(dst.dtype).cast<std::string>() << ", src is "
                      << py::str(src.dtype).cast<std::string>()
                      << "; use one dtype on both sides (src.to(dst.dtype))");
      PDC_REQUIRE(dst.bytes == src.bytes,
                  call_ << ": size mismatch in row " << i << ": dst has " << dst.bytes
                      << " bytes, src has " << src.bytes
                      << "; pass equal-sized tensors (a slice of the larger one)");
      if (src.bytes > 0) rows.push_back({dst.address, src.address, src.bytes});
    }
    return rows;
  }

 private:
  struct Facts {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    py::object dtype;
  };

  py::object fast(py::handle sequence, const char* name) const {
    PyObject* list = PySequence_Fast(sequence.ptr(), "");
    if (list == nullptr) {
      PyErr_Clear();
      PDC_REQUIRE(false, call_ << ": " << name << " must be a list or tuple of tensors, got "
                                                  << Py_TYPE(sequence.ptr())->tp_name);
    }
    return py::reinterpret_steal<py::object>(list);
  }

  // Interned once (and never freed: the module lives as long as the interpreter).
  static PyObject* name(const char* text) { return PyUnicode_InternFromString(text); }

  static py::object call(PyObject* self, PyObject* method) {
    PyObject* args[] = {self};
    PyObject* result = PyObject_VectorcallMethod(method, args, 1, nullptr);
    if (result == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(result);
  }

  static py::object attribute(PyObject* self, PyObject* attribute_name) {
    PyObject* result = PyObject_GetAttr(self, attribute_name);
    if (result == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(result);
  }

  // An int result as unsigned; a failed conversion is the Python error it raised.
  static unsigned long long as_unsigned(const py::object& value) {
    const unsigned long long result = PyLong_AsUnsignedLongLong(value.ptr());
    if (result == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    return result;
  }

  Facts facts(PyObject* tensor, const char* list, Py_ssize_t i, bool check_device) {
    static PyObject* const get_device = name("get_device");
    static PyObject* const is_contiguous = name("is_contiguous");
    static PyObject* const data_ptr = name("data_ptr");
    static PyObject* const nbytes = name("nbytes");
    static PyObject* const dtype = name("dtype");
    PDC_REQUIRE(PyObject_TypeCheck(tensor, reinterpret_cast<PyTypeObject*>(type_.ptr())),
                call_ << ": " << list << "[" << i << "] must be a torch.Tensor, got "
                                        << Py_TYPE(tensor)->tp_name);
    if (check_device) {
      const long device = PyLong_AsLong(call(tensor, get_device).ptr());  // -1: CPU
      if (device == -1 && PyErr_Occurred()) throw py::error_already_set();
      PDC_REQUIRE(device == device_,
                  call_ << ": " << list << "[" << i << "] is "
                      << (device < 0 ? std::string("not on a CUDA device; pydatacopy moves CUDA tensors: use .cuda() first")
                                     : "on cuda:" + std::to_string(device) +
                                           ", but this process runs pydatacopy on cuda:" +
                                           std::to_string(device_) + "; move it there first"));
    }
    PDC_REQUIRE(call(tensor, is_contiguous).ptr() == Py_True,
                call_ << ": " << list << "[" << i << "] must be contiguous (call .contiguous() first)");
    Facts f;
    f.address = static_cast<std::uintptr_t>(as_unsigned(call(tensor, data_ptr)));
    f.bytes = static_cast<std::size_t>(as_unsigned(attribute(tensor, nbytes)));
    f.dtype = attribute(tensor, dtype);
    return f;
  }

  py::handle type_;
  int device_;
  const char* call_;
};

using TransferCall = void (*)(std::uintptr_t, std::uintptr_t, std::size_t, int, cudaStream_t, Path);

template <TransferCall Call>
PyObject* transfer_fastcall(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != 6) {
    PyErr_SetString(PyExc_TypeError, "takes 6 positional arguments: dst, src, bytes, pe, stream, path");
    return nullptr;
  }
  unsigned long long dst = 0, src = 0, bytes = 0, stream = 0;
  int pe = 0, path = 0;
  if (!unsigned_argument(args[0], dst) || !unsigned_argument(args[1], src) ||
      !unsigned_argument(args[2], bytes) || !int_argument(args[3], pe) ||
      !unsigned_argument(args[4], stream) || !int_argument(args[5], path))
    return nullptr;
  return without_gil([&] { Call(dst, src, bytes, pe, as_stream(stream), as_path(path)); });
}

void put_call(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, int pe, cudaStream_t stream, Path path) {
  put(as_pointer<void>(dst), as_pointer<const void>(src), bytes, pe, stream, path);
}
void get_call(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, int pe, cudaStream_t stream, Path path) {
  get(as_pointer<void>(dst), as_pointer<const void>(src), bytes, pe, stream, path);
}
// The profile's probe: the same crossing, no work.
void probe_call(std::uintptr_t, std::uintptr_t, std::size_t, int, cudaStream_t, Path) {}

PyMethodDef g_rma_fast_calls[] = {
    fast_call("put_fast", &transfer_fastcall<put_call>,
              "put_fast(dst, src, bytes, pe, stream, path): put, positional only (the hot path)"),
    fast_call("get_fast", &transfer_fastcall<get_call>,
              "get_fast(dst, src, bytes, pe, stream, path): get, positional only (the hot path)"),
    fast_call("_host_path_probe", &transfer_fastcall<probe_call>,
              "put_fast's crossing, arguments and GIL release, with no work (profiles)"),
};

}  // namespace

void bind_rma(py::module_& m) {
  // Symmetric memory.
  m.def("symmetric_malloc", [](std::size_t bytes) { return as_address(symmetric_malloc(bytes)); },
        py::arg("bytes"), release_gil());
  m.def("symmetric_free", [](std::uintptr_t ptr) { symmetric_free(as_pointer<void>(ptr)); },
        py::arg("ptr"), release_gil());
  m.def("is_symmetric",
        [](std::uintptr_t ptr, std::size_t bytes) { return is_symmetric(as_pointer<void>(ptr), bytes); },
        py::arg("ptr"), py::arg("bytes"));  // a map lookup under a lock nobody holds long: keeps the GIL
  m.def("peer_pointer",
        [](std::uintptr_t ptr, int pe) { return as_address(peer_pointer(as_pointer<void>(ptr), pe)); },
        py::arg("ptr"), py::arg("pe"));
  m.def("rma_forced", &rma_forced);
  m.def("set_rma_forced", &set_rma_forced, py::arg("forced"),
        "Tests: PYDATACOPY_FORCE_RMA at run time (it is read once, at load and by init).");


  // One-sided operations (addresses as ints; the Python layer checks tensors).
  m.def("put", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, int pe,
                  std::uintptr_t stream, int path) {
          put(as_pointer<void>(dst), as_pointer<const void>(src), bytes, pe, as_stream(stream), as_path(path));
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("pe"), py::arg("stream"), py::arg("path") = 0, release_gil());
  m.def("get", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, int pe,
                  std::uintptr_t stream, int path) {
          get(as_pointer<void>(dst), as_pointer<const void>(src), bytes, pe, as_stream(stream), as_path(path));
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("pe"), py::arg("stream"), py::arg("path") = 0, release_gil());
  m.def("put_signal", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t signal,
                         uint64_t value, int pe, std::uintptr_t stream) {
          put_signal(as_pointer<void>(dst), as_pointer<const void>(src), bytes, as_pointer<uint64_t>(signal),
                     value, pe, as_stream(stream));
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("signal"), py::arg("value"), py::arg("pe"),
        py::arg("stream"), release_gil());
  m.def("signal_set", [](std::uintptr_t signal, uint64_t value, int pe, std::uintptr_t stream) {
          signal_set(as_pointer<uint64_t>(signal), value, pe, as_stream(stream));
        }, py::arg("signal"), py::arg("value"), py::arg("pe"), py::arg("stream"), release_gil());
  m.def("signal_wait", [](std::uintptr_t signal, uint64_t value, std::uintptr_t stream, double timeout,
                          bool blocking) {
          signal_wait(as_pointer<const uint64_t>(signal), value, as_stream(stream), timeout, blocking);
        }, py::arg("signal"), py::arg("value"), py::arg("stream"), py::arg("timeout"),
        py::arg("blocking") = false, release_gil());
  m.def("quiet", [](std::uintptr_t stream) { quiet(as_stream(stream)); }, py::arg("stream"), release_gil());
  m.def("barrier", [](std::uintptr_t stream, double timeout_seconds, bool blocking) {
          barrier(as_stream(stream), timeout_seconds, blocking);
        }, py::arg("stream"), py::arg("timeout_seconds"), py::arg("blocking") = false, release_gil());
  m.def("wait_for_stream", [](std::uintptr_t stream) { wait_for_stream(as_stream(stream)); },
        py::arg("stream"), release_gil(),
        "Host-blocking: returns once the work enqueued on the stream has finished, then raises a "
        "device-side timeout (the blocking calls wait this way).");
  m.def("peer_timed_out", &peer_timed_out, py::arg("pe"),
        "True once a device-side wait on PE `pe` has timed out (the PE is presumed dead).");
  m.def("put_many", [](const std::vector<std::uintptr_t>& dsts, const std::vector<std::uintptr_t>& srcs,
                       const std::vector<std::size_t>& bytes, int pe, std::uintptr_t stream, int path) {
          PDC_REQUIRE(dsts.size() == srcs.size() && srcs.size() == bytes.size(),
                      "put_many: dsts, srcs and bytes must have the same length");
          std::vector<TransferDescriptor> table(dsts.size());
          for (std::size_t i = 0; i < table.size(); ++i) table[i] = {dsts[i], srcs[i], bytes[i]};
          PDC_REQUIRE(table.size() <= INT_MAX, "put_many: at most " << INT_MAX << " rows per call");
          put_many(table.data(), static_cast<int>(table.size()), pe, as_stream(stream), as_path(path));
        }, py::arg("dsts"), py::arg("srcs"), py::arg("bytes"), py::arg("pe"), py::arg("stream"), py::arg("path") = 0,
        release_gil(), "Addresses and byte counts as lists of ints.");
  m.def("put_many_tensors", [](py::handle dsts, py::handle srcs, int pe, std::uintptr_t stream, int path,
                               int device, py::handle tensor_type) {
          const Path resolved = as_path(path);
          const std::vector<TransferDescriptor> rows = TensorRows(tensor_type, device).read(dsts, srcs);
          py::gil_scoped_release release;  // the rows are plain C++ from here on
          put_many(rows.data(), static_cast<int>(rows.size()), pe, as_stream(stream), resolved);
        }, py::arg("dsts"), py::arg("srcs"), py::arg("pe"), py::arg("stream"), py::arg("path"),
        py::arg("device"), py::arg("tensor_type"),
        "put_many from two lists (or tuples) of tensors, read and checked in one C++ pass; "
        "tensor_type is torch.Tensor, device the CUDA device every src must be on.");
  py::class_<PreparedPutMany>(m, "PreparedPutMany",
                              "put_many prepared once: the table in device memory, one launch per run")
      .def_static("from_tensors", [](py::handle dsts, py::handle srcs, int pe, int path, int device,
                                     py::handle tensor_type, const std::string& call) {
             const Path resolved = as_path(path);
             const std::vector<TransferDescriptor> rows =
                 TensorRows(tensor_type, device, call.c_str()).read(dsts, srcs);
             py::gil_scoped_release release;  // registration and the copy to the device block
             return PreparedPutMany::prepare(rows.data(), rows.size(), pe, resolved, call.c_str());
           }, py::arg("dsts"), py::arg("srcs"), py::arg("pe"), py::arg("path"), py::arg("device"),
           py::arg("tensor_type"), py::arg("call"),
           "rows from two lists (or tuples) of tensors, checked as put_many's; `call` names the "
           "public function in errors")
      .def_static("from_addresses", [](std::uintptr_t dst_addresses, std::uintptr_t src_addresses,
                                       std::uintptr_t sizes, int64_t count, int pe, int path, std::uintptr_t stream) {
             return PreparedPutMany::prepare_from_device(
                 as_pointer<const int64_t>(dst_addresses), as_pointer<const int64_t>(src_addresses),
                 as_pointer<const int64_t>(sizes), count, pe, as_path(path), as_stream(stream),
                 "pydatacopy.PreparedPutMany.from_addresses");
           }, py::arg("dst_addresses"), py::arg("src_addresses"), py::arg("sizes"), py::arg("count"),
           py::arg("pe"), py::arg("path"), py::arg("stream"), release_gil(),
           "rows from three int64 device arrays (read after `stream`'s work, which is synchronised)")
      .def("run", [](PreparedPutMany& self, std::uintptr_t stream) { self.run(as_stream(stream)); },
           py::arg("stream"), release_gil(), "one launch on `stream`")
      .def("release", &PreparedPutMany::release, "free the table (stream-ordered, local); idempotent")
      .def_property_readonly("released", &PreparedPutMany::released)
      .def_property_readonly("rows", &PreparedPutMany::rows)
      .def_property_readonly("pieces", &PreparedPutMany::pieces)
      .def_property_readonly("bytes", &PreparedPutMany::bytes)
      .def_property_readonly("pe", &PreparedPutMany::pe)
      .def_property_readonly("direct", &PreparedPutMany::direct);
  m.def("put_blocks", [](std::uintptr_t dst_pool, int64_t dst_blocks, std::uintptr_t src_pool,
                         int64_t src_blocks, std::size_t block_bytes, std::uintptr_t dst_indices,
                         std::uintptr_t src_indices, int64_t count, int pe, std::uintptr_t stream, int path) {
          put_blocks(as_pointer<void>(dst_pool), dst_blocks, as_pointer<const void>(src_pool), src_blocks,
                     block_bytes, as_pointer<const int64_t>(dst_indices), as_pointer<const int64_t>(src_indices),
                     count, pe, as_stream(stream), as_path(path));
        }, py::arg("dst_pool"), py::arg("dst_blocks"), py::arg("src_pool"), py::arg("src_blocks"),
        py::arg("block_bytes"), py::arg("dst_indices"), py::arg("src_indices"), py::arg("count"),
        py::arg("pe"), py::arg("stream"), py::arg("path") = 0, release_gil());
  m.def("resolve_path", [](int path, bool reachable, std::size_t bytes) {
          return std::string(path_name(resolve_path(as_path(path), reachable, bytes)));
        }, py::arg("path"), py::arg("peer_reachable"), py::arg("bytes"));

  // The benchmark's copy-engine baseline: a bare cudaMemcpyAsync, no pydatacopy logic on the path.
  m.def("bench_memcpy", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t stream) {
          PDC_CHECK_CUDA(cudaMemcpyAsync(as_pointer<void>(dst), as_pointer<const void>(src), bytes,
                                         cudaMemcpyDeviceToDevice, as_stream(stream)));
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"));
  // The benchmark's floor for a kernel path: put's SM copy kernel launched bare (no checks, no
  // pydatacopy logic), called exactly as bench_memcpy is.
  m.def("bench_kernel_copy", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t stream) {
          bench_kernel_copy(as_pointer<void>(dst), as_pointer<const void>(src), bytes, as_stream(stream));
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"));
  // The two handoff floors (rma/transfer_internal.hpp): the copy engine between stream memory
  // operations, or one kernel per PE (with a variant: what zero-copy adds, kernels/api.cuh).
  const auto handoff = [](std::uintptr_t peer_dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t my_words,
                          std::uintptr_t peer_words, bool sends, bool receives) {
    CopyEngineHandoff h;
    h.peer_dst = as_pointer<void>(peer_dst);
    h.src = as_pointer<const void>(src);
    h.bytes = bytes;
    h.my_words = as_pointer<uint64_t>(my_words);
    h.peer_words = as_pointer<uint64_t>(peer_words);
    h.sends = sends;
    h.receives = receives;
    return h;
  };
  m.def("bench_copy_engine_handoff", [handoff](std::uintptr_t peer_dst, std::uintptr_t src, std::size_t bytes,
                                               std::uintptr_t my_words, std::uintptr_t peer_words, bool sends,
                                               bool receives, uint64_t message, std::uintptr_t stream) {
          bench_copy_engine_handoff(handoff(peer_dst, src, bytes, my_words, peer_words, sends, receives), message,
                                    as_stream(stream));
        }, py::arg("peer_dst"), py::arg("src"), py::arg("bytes"), py::arg("my_words"), py::arg("peer_words"),
        py::arg("sends"), py::arg("receives"), py::arg("message"), py::arg("stream"));
  m.def("bench_kernel_handoff", [handoff](std::uintptr_t peer_dst, std::uintptr_t src, std::size_t bytes,
                                          std::uintptr_t my_words, std::uintptr_t peer_words, bool sends,
                                          bool receives, uint64_t message, std::uintptr_t stream, unsigned variant) {
          bench_kernel_handoff(handoff(peer_dst, src, bytes, my_words, peer_words, sends, receives), message, variant,
                               as_stream(stream));
        }, py::arg("peer_dst"), py::arg("src"), py::arg("bytes"), py::arg("my_words"), py::arg("peer_words"),
        py::arg("sends"), py::arg("receives"), py::arg("message"), py::arg("stream"), py::arg("variant") = 0);
  m.attr("BENCH_HANDOFF_WORDS") = kernels::kHandoffWords + kernels::kHandoffBeginWords;
  m.attr("BENCH_HANDOFF_TIMED_OUT_WORD") = kernels::kHandoffTimedOutWord;
  m.attr("BENCH_HANDOFF_BEGIN") = kernels::kHandoffBegin;
  m.attr("BENCH_HANDOFF_RESOLVE") = kernels::kHandoffResolve;
  m.attr("BENCH_HANDOFF_TWO_BLOCKS_PER_SM") = kernels::kHandoffTwoBlocksPerSm;
  m.attr("BENCH_HANDOFF_MESSAGE_ON_DEVICE") = kernels::kHandoffMessageOnDevice;
  m.attr("BENCH_HANDOFF_MESSAGE_ON_DEVICE_MAX_BYTES") = kernels::kHandoffMessageOnDeviceMaxBytes;
  m.def("bench_host_call_costs", [](std::uintptr_t dst, std::uintptr_t src, std::size_t bytes, std::uintptr_t stream,
                                    int calls) {
          return bench_host_call_costs(as_pointer<void>(dst), as_pointer<const void>(src), bytes, as_stream(stream),
                                       calls);
        }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"), py::arg("calls"), release_gil());
  // Benchmark probe: 8-byte signal ping-pong between this PE and `peer` (device-side latency).
  m.def("bench_pingpong", [](std::uintptr_t signal, int peer, int iterations, bool initiator,
                             std::uintptr_t stream, double timeout) {
          signal_pingpong(as_pointer<uint64_t>(signal), peer, iterations, initiator, as_stream(stream),
                          timeout);
        }, py::arg("signal"), py::arg("peer"), py::arg("iterations"), py::arg("initiator"),
        py::arg("stream"), py::arg("timeout"), release_gil());

  add_fast_calls(m, g_rma_fast_calls, sizeof(g_rma_fast_calls) / sizeof(g_rma_fast_calls[0]));
}

}  // namespace pydatacopy::bindings
