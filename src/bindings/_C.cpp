// The one binding file: pydatacopy._C. Pointers and streams cross as integers; torch stays in
// the Python layer, so this module links neither libtorch nor libpython.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "pydatacopy/all_to_all.hpp"
#include "pydatacopy/double_buffer_manager.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/prepared_put_many.hpp"
#include "pydatacopy/registration.hpp"
#include "pydatacopy/runtime.hpp"
#include "pydatacopy/send_recv.hpp"
#include "pydatacopy/symmetric.hpp"
#include "pydatacopy/transfer.hpp"
#include "../core/kernels/api.cuh"

namespace py = pybind11;
using namespace pydatacopy;

namespace {

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
template <typename T>
T* as_pointer(std::uintptr_t address) { return reinterpret_cast<T*>(address); }
std::uintptr_t as_address(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }
Path as_path(int path) {
  PDC_REQUIRE(path >= 0 && path <= 3, "path must be one of auto, copy_engine, sm, rma");
  return static_cast<Path>(path);
}

// The engines' hot calls run without the GIL (a first-use registration can block behind the
// legacy default stream); the GIL used to keep two Python threads out of one engine's host
// state, so these locks do now. The send/recv engine's collective init/cleanup hold its lock
// only to swap the engine's state in or out (SendRecvEngine::swap/detach), never across their
// barriers: a thread waiting in one must not keep another from the transfers its peers wait
// for, and a hot call sees either the whole old state or none (it never uses freed staging).
std::mutex g_send_recv_mutex, g_token_exchange_mutex, g_all_to_all_mutex;

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

// ---- put and get from the hot path: plain CPython entry points ----
//
// pybind11's dispatch of put's six integers, with its GIL release, cost 167 ns per call on the
// CPU where it was measured, a METH_FASTCALL function 60-90 ns (scripts/profile_host_path.py):
// the Python layer's fast path calls these, positionally, after its own checks.
PyObject* g_error = nullptr;          // pydatacopy.Error
PyObject* g_timeout_error = nullptr;  // pydatacopy.TimeoutError

bool unsigned_argument(PyObject* value, unsigned long long& out) {
  out = PyLong_AsUnsignedLongLong(value);
  return !(out == static_cast<unsigned long long>(-1) && PyErr_Occurred());
}

bool int_argument(PyObject* value, int& out) {
  const long wide = PyLong_AsLong(value);
  if (wide == -1 && PyErr_Occurred()) return false;
  if (wide < INT_MIN || wide > INT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "an int argument does not fit a C int");
    return false;
  }
  out = static_cast<int>(wide);
  return true;
}

bool double_argument(PyObject* value, double& out) {
  out = PyFloat_AsDouble(value);
  return !(out == -1.0 && PyErr_Occurred());
}

// `work()` without the GIL (a first-use registration or a launch can block): None, or nullptr
// with its exception set as pybind11's translator would (pydatacopy.TimeoutError, Error).
template <typename Work>
PyObject* without_gil(Work&& work) {
  std::exception_ptr failure;
  Py_BEGIN_ALLOW_THREADS
  try {
    work();
  } catch (...) {
    failure = std::current_exception();
  }
  Py_END_ALLOW_THREADS
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const TimeoutError& e) {
      PyErr_SetString(g_timeout_error, e.what());
    } catch (const Error& e) {
      PyErr_SetString(g_error, e.what());
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {  // never std::terminate out of a METH_FASTCALL entry
      PyErr_SetString(g_error, "pydatacopy: an unknown C++ exception in the core");
    }
    return nullptr;
  }
  Py_RETURN_NONE;
}

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

// ---- send, recv and sendrecv from the hot path (outside group()) ----
//
// As put_fast: the engine's pybind11 methods with their five or eight arguments go through
// pybind11's dispatch; these take the engine (a SendRecvEngine) first, then the method's
// arguments positionally, and hold the engine's lock as the methods do.
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
    std::lock_guard<std::mutex> lock(g_send_recv_mutex);
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
    std::lock_guard<std::mutex> lock(g_send_recv_mutex);
    engine->sendrecv(as_pointer<const void>(src), send_bytes, dst_pe, as_pointer<void>(dst), recv_bytes,
                     src_pe, as_stream(stream), timeout);
  });
}

PyMethodDef g_fast_calls[] = {
    {"put_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&transfer_fastcall<put_call>)),
     METH_FASTCALL, "put_fast(dst, src, bytes, pe, stream, path): put, positional only (the hot path)"},
    {"get_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&transfer_fastcall<get_call>)),
     METH_FASTCALL, "get_fast(dst, src, bytes, pe, stream, path): get, positional only (the hot path)"},
    {"_host_path_probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&transfer_fastcall<probe_call>)),
     METH_FASTCALL, "put_fast's crossing, arguments and GIL release, with no work (profiles)"},
    {"send_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&one_way_fastcall<true>)),
     METH_FASTCALL, "send_fast(engine, src, bytes, dst_pe, stream, timeout): engine.send, positional only (the hot path)"},
    {"recv_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&one_way_fastcall<false>)),
     METH_FASTCALL, "recv_fast(engine, dst, bytes, src_pe, stream, timeout): engine.recv, positional only (the hot path)"},
    {"sendrecv_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&sendrecv_fastcall)),
     METH_FASTCALL, "sendrecv_fast(engine, src, send_bytes, dst_pe, dst, recv_bytes, src_pe, stream, timeout): "
                    "engine.sendrecv, positional only (the hot path)"},
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pydatacopy native core (private: use the pydatacopy package)";
  m.attr("__version__") = PYDATACOPY_VERSION;
  m.attr("UNIQUE_ID_BYTES") = kUniqueIdBytes;

  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<TimeoutError> timeout_error(m, "TimeoutError", error.ptr());
  g_error = error.ptr();
  g_timeout_error = timeout_error.ptr();
  for (PyMethodDef& def : g_fast_calls) {
    PyObject* function = PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (function == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(function));
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      py::set_error(timeout_error, e.what());
    } catch (const Error& e) {
      py::set_error(error, e.what());
    }
  });

  using release_gil = py::call_guard<py::gil_scoped_release>;

  // Runtime.
  m.def("get_unique_id", &get_unique_id, release_gil(),
        "Create an NVSHMEM unique ID (128 bytes, as a list of ints). Needs no GPU.");
  m.def("init_nvshmem", &init_nvshmem, py::arg("root_unique_id"), py::arg("rank"),
        py::arg("world_size"), py::arg("device") = -1,
        py::arg("timeout_seconds"), release_gil(),
        "Join the NVSHMEM job named by root_unique_id (collective). Returns this PE.");
  m.def("finalize", &finalize, py::arg("end_nvshmem") = true, release_gil(),
        "Collective finalize; harmless twice. end_nvshmem=False leaves NVSHMEM running for "
        "another user in the process.");
  m.def("is_initialized", &is_initialized);
  m.def("my_pe", &my_pe);
  m.def("n_pes", &n_pes);
  m.def("pes_sharing_my_gpu", &pes_sharing_my_gpu, "PEs on this PE's GPU (itself included), as init() learned");
  m.def("send_recv_blocks_per_sm", &kernels::chunk_batch_blocks_per_sm,
        "blocks of the send/recv kernel one SM holds at once (the grid cap is SMs x this)");
  m.def("cuda_device", &cuda_device);
  m.def("built_nvshmem_version", [] { return built_nvshmem_version().str(); });
  m.def("loaded_nvshmem_version", [] { return loaded_nvshmem_version().str(); });
  m.def("check_nvshmem_version", &check_nvshmem_version);
  m.def("default_timeout_seconds", &default_timeout_seconds);
  m.def("default_init_timeout_seconds", &default_init_timeout_seconds);
  m.def("barrier_all_blocking",
        [](const std::string& what, double timeout_seconds, uint64_t vote) {
          return barrier_all_blocking(what.c_str(), timeout_seconds, vote);
        }, py::arg("what"), py::arg("timeout_seconds"), py::arg("vote") = 0, release_gil());
  m.def("check_device_errors", &check_device_errors);
  m.def("check_timeouts", &check_timeouts);
  m.def("is_capturing", [](std::uintptr_t stream) {
          cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
          PDC_CHECK_CUDA(cudaStreamIsCapturing(as_stream(stream), &status));
          return status != cudaStreamCaptureStatusNone;
        }, py::arg("stream"), "True while `stream` is being captured into a CUDA graph.");

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

  // Registered memory for NVSHMEM's remote transports.
  m.def("set_rma_options", &set_rma_options, py::arg("check"), py::arg("auto_register"));
  m.def("rma_check_enabled", &rma_check_enabled);
  m.def("auto_register_enabled", &auto_register_enabled);
  m.def("register_memory",
        [](std::uintptr_t ptr, std::size_t bytes) { register_memory(as_pointer<void>(ptr), bytes); },
        py::arg("ptr"), py::arg("bytes"), release_gil());
  m.def("unregister_memory", [](std::uintptr_t ptr) { unregister_memory(as_pointer<void>(ptr)); },
        py::arg("ptr"), release_gil());
  m.def("is_rma_ready",
        [](std::uintptr_t ptr, std::size_t bytes) { return is_rma_ready(as_pointer<void>(ptr), bytes); },
        py::arg("ptr"), py::arg("bytes"), release_gil());
  m.def("_verify_rma_local",
        [](std::uintptr_t ptr, std::size_t bytes) { verify_rma_local(as_pointer<void>(ptr), bytes, "test"); },
        py::arg("ptr"), py::arg("bytes"), release_gil(),
        "The checking mode's verification, whatever the mode (tests).");
  m.def("_check_rma_remote",
        [](std::uintptr_t ptr, std::size_t bytes) { check_rma_remote(as_pointer<void>(ptr), bytes, "test"); },
        py::arg("ptr"), py::arg("bytes"), release_gil(),
        "The checking mode's check of a peer-side address (tests; a no-op when the mode is off).");
  m.def("_refuse_rma_checks", [](const std::string& what_prefix) { refuse_rma_checks_for_tests(what_prefix.c_str()); },
        py::arg("what_prefix"),
        "Tests: the checking mode refuses every check whose label starts with what_prefix ('' : none).");
  m.def("registration_stats", [] {
    const RegistrationStats s = registration_stats();
    py::dict d;
    d["registrations"] = s.registrations;
    d["stale_dropped"] = s.stale_dropped;
    d["live_entries"] = s.live_entries;
    d["registered_bytes"] = s.registered_bytes;
    d["check_violations"] = s.check_violations;
    return d;
  });

  // The note's DoubleBufferManager, with the stream and timeout made explicit.
  py::class_<DoubleBufferManager>(m, "DoubleBufferManager")
      .def(py::init<>())
      .def("init", &DoubleBufferManager::init, py::arg("n_tokens"), py::arg("token_size"),
           release_gil(), "Initialize double buffer (collective)")
      .def("cleanup", &DoubleBufferManager::cleanup, release_gil(),
           "Cleanup double buffer (collective)")
      .def("test_bandwidth",
           [](DoubleBufferManager& self, int rank, int world_size, std::uintptr_t stream) {
             return self.test_bandwidth(rank, world_size, as_stream(stream));
           },
           py::arg("rank"), py::arg("world_size"), py::arg("stream") = 0, release_gil(),
           "Test bandwidth: one blocking round; returns GB/s")
      .def_property_readonly("initialized", &DoubleBufferManager::initialized)
      .def_property_readonly("n_tokens", &DoubleBufferManager::n_tokens)
      .def_property_readonly("token_size", &DoubleBufferManager::token_size)
      .def_property_readonly("round", &DoubleBufferManager::round)
      .def_property_readonly("last_waited_round", &DoubleBufferManager::last_waited_round)
      .def("send_buffer", [](const DoubleBufferManager& self, int set) {
             return as_address(self.send_buffer(set)); }, py::arg("set"))
      .def("recv_buffer", [](const DoubleBufferManager& self, int set) {
             return as_address(self.recv_buffer(set)); }, py::arg("set"))
      .def("exchange",
           [](DoubleBufferManager& self, int dst_pe, int src_pe, std::uintptr_t stream,
              double timeout) {
             std::lock_guard<std::mutex> lock(g_token_exchange_mutex);
             return self.exchange(dst_pe, src_pe, as_stream(stream), timeout);
           },
           py::arg("dst_pe"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("wait",
           [](DoubleBufferManager& self, int64_t round, int src_pe, std::uintptr_t stream,
              double timeout, bool blocking) {
             if (blocking) refuse_blocking_capture(as_stream(stream), "DoubleBufferManager.wait(blocking=True)");
             {
               std::lock_guard<std::mutex> lock(g_token_exchange_mutex);
               self.wait(round, src_pe, as_stream(stream), timeout);
             }
             // Outside the lock: another thread's exchange() need not wait for this host wait.
             if (blocking) wait_for_stream(as_stream(stream));
           },
           py::arg("round"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"),
           py::arg("blocking") = false, release_gil())
      .def_static("symmetric_bytes_needed", &DoubleBufferManager::symmetric_bytes_needed,
                  py::arg("n_tokens"), py::arg("token_size"), py::arg("n_pes"))
      .def_static("default_dst_pe", &DoubleBufferManager::default_dst_pe, py::arg("pe"),
                  py::arg("n_pes"))
      .def_static("default_src_pe", &DoubleBufferManager::default_src_pe, py::arg("pe"),
                  py::arg("n_pes"));

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
  // Benchmark probe: 8-byte signal ping-pong between this PE and `peer` (device-side latency).
  m.def("bench_pingpong", [](std::uintptr_t signal, int peer, int iterations, bool initiator,
                             std::uintptr_t stream, double timeout) {
          signal_pingpong(as_pointer<uint64_t>(signal), peer, iterations, initiator, as_stream(stream),
                          timeout);
        }, py::arg("signal"), py::arg("peer"), py::arg("iterations"), py::arg("initiator"),
        py::arg("stream"), py::arg("timeout"), release_gil());

  // Test support (tests/gpu): a kernel that holds most SMs until a flag is set or a deadline.
  m.def("_test_occupy_sms", [](int blocks, int threads, std::size_t shared_bytes, std::uintptr_t release,
                               std::uintptr_t released_by_flag, double seconds, std::uintptr_t stream) {
          kernels::launch_occupy_sms(blocks, threads, shared_bytes, as_pointer<const int>(release),
                                     as_pointer<int>(released_by_flag), timeout_nanoseconds(seconds),
                                     as_stream(stream));
        }, py::arg("blocks"), py::arg("threads"), py::arg("shared_bytes"), py::arg("release"),
        py::arg("released_by_flag"), py::arg("seconds"), py::arg("stream"));

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
      .def_static("symmetric_bytes_needed", &AllToAll::symmetric_bytes_needed, py::arg("capacity"),
                  py::arg("max_row_bytes"), py::arg("n_pes"))
      .def("exchange",
           [](AllToAll& self,
              const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, int64_t, int64_t, int64_t>>& fields,
              std::uintptr_t send_counts, std::uintptr_t send_index, int64_t index_rows,
              std::uintptr_t recv_counts, std::uintptr_t recv_offsets, std::uintptr_t stream,
              double timeout) {
             std::vector<AllToAllField> list;
             for (const auto& [send, recv, row_bytes, send_rows, recv_rows] : fields)
               list.push_back({as_pointer<const void>(send), as_pointer<void>(recv), row_bytes, send_rows, recv_rows});
             std::lock_guard<std::mutex> lock(g_all_to_all_mutex);
             self.exchange(list, as_pointer<const int64_t>(send_counts), as_pointer<const int64_t>(send_index),
                           index_rows, as_pointer<int64_t>(recv_counts), as_pointer<int64_t>(recv_offsets),
                           as_stream(stream), timeout);
             return self.calls() - 1;  // this call's number (release() takes it)
           },
           py::arg("fields"), py::arg("send_counts"), py::arg("send_index"), py::arg("index_rows"),
           py::arg("recv_counts"), py::arg("recv_offsets"), py::arg("stream"), py::arg("timeout"),
           release_gil(),
           "fields: (send, recv, row_bytes, send_rows, recv_rows) tuples (addresses as ints); "
           "send_index 0 for none; recv 0: the rows stay in the receive region (in_region, release). "
           "Returns the call's number")
      .def("in_region",
           [](const AllToAll& self, int field) { return reinterpret_cast<std::uintptr_t>(self.in_region(field)); },
           py::arg("field"), "Device address of field's rows from source 0 in the last call's region")
      .def_property_readonly("region_stride", &AllToAll::region_stride)
      .def("release",
           [](AllToAll& self, int64_t call, std::uintptr_t stream) {
             std::lock_guard<std::mutex> lock(g_all_to_all_mutex);
             self.release(call, as_stream(stream));
           },
           py::arg("call"), py::arg("stream"), release_gil(),
           "Hand call's receive regions back to the sources (stream-ordered)");
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
  m.attr("MOE_LAYOUT_MAX_PES") = kMoeLayoutMaxPes;
  m.attr("MOE_LAYOUT_MAX_EXPERTS_PER_PE") = kMoeLayoutMaxExpertsPerPe;
  m.attr("MOE_LAYOUT_MAX_PAIRS") = kMoeLayoutMaxPairs;
  m.def("check_all_to_all_refusal", &check_all_to_all_refusal,
        "Raise (once) an all-to-all refusal recorded on the device.");

  // Two-sided copies through symmetric staging.
  py::class_<SendRecvEngine>(m, "SendRecvEngine")
      .def(py::init<>())
      .def("init", [](SendRecvEngine& self, std::size_t chunk_bytes, int num_chunks, int blocks) {
             {
               std::lock_guard<std::mutex> lock(g_send_recv_mutex);
               PDC_REQUIRE(!self.initialized(), "SendRecvEngine.init: already initialised; call cleanup() first");
             }
             SendRecvEngine fresh;  // built (collectively) outside the lock, then swapped in
             fresh.init(chunk_bytes, num_chunks, blocks);
             bool lost = false;  // another thread's init won the race
             {
               std::lock_guard<std::mutex> lock(g_send_recv_mutex);
               if (self.initialized()) lost = true;
               else self.swap(fresh);
             }
             if (lost) {
               fresh.cleanup();  // collective, like the init every PE made; outside the lock
               PDC_REQUIRE(false, "SendRecvEngine.init: initialised by another thread meanwhile; "
                                  "call cleanup() first");
             }
           }, py::arg("chunk_bytes"), py::arg("num_chunks"), py::arg("blocks"), release_gil())
      .def("cleanup", [](SendRecvEngine& self) {
             SendRecvEngine old = [&self] {
               std::lock_guard<std::mutex> lock(g_send_recv_mutex);
               return self.detach();
             }();
             old.cleanup();  // collective (barrier, symmetric free) outside the lock
           }, release_gil())
      .def_property_readonly("initialized", &SendRecvEngine::initialized)
      .def_property_readonly("chunk_bytes", &SendRecvEngine::chunk_bytes)
      .def_property_readonly("num_chunks", &SendRecvEngine::num_chunks)
      .def_property_readonly("blocks", &SendRecvEngine::blocks)
      .def_property_readonly("symmetric_bytes", &SendRecvEngine::symmetric_bytes)
      .def_property_readonly("max_grid", &SendRecvEngine::max_grid,
                             "blocks of a launch at most (what can be resident at once for this PE)")
      .def("slices_for", &SendRecvEngine::slices_for, py::arg("bytes"),
           "slices (per-op block slots) a message of `bytes` moves on")
      .def_static("symmetric_bytes_needed", &SendRecvEngine::symmetric_bytes_needed, py::arg("n_pes"),
                  py::arg("chunk_bytes"), py::arg("num_chunks"), py::arg("blocks"))
      .def("check_refusals", [](SendRecvEngine& self) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.check_refusals();
           }, release_gil(),
           "Raise, once per channel, a size mismatch a receiver found after this PE's send completed.")
      .def("send", [](SendRecvEngine& self, std::uintptr_t src, std::size_t bytes, int dst_pe,
                      std::uintptr_t stream, double timeout) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.send(as_pointer<const void>(src), bytes, dst_pe, as_stream(stream), timeout);
           }, py::arg("src"), py::arg("bytes"), py::arg("dst_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("recv", [](SendRecvEngine& self, std::uintptr_t dst, std::size_t bytes, int src_pe,
                      std::uintptr_t stream, double timeout) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.recv(as_pointer<void>(dst), bytes, src_pe, as_stream(stream), timeout);
           }, py::arg("dst"), py::arg("bytes"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("sendrecv", [](SendRecvEngine& self, std::uintptr_t src, std::size_t send_bytes, int dst_pe,
                          std::uintptr_t dst, std::size_t recv_bytes, int src_pe, std::uintptr_t stream,
                          double timeout) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.sendrecv(as_pointer<const void>(src), send_bytes, dst_pe, as_pointer<void>(dst),
                           recv_bytes, src_pe, as_stream(stream), timeout);
           }, py::arg("src"), py::arg("send_bytes"), py::arg("dst_pe"), py::arg("dst"),
           py::arg("recv_bytes"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("batch", [](SendRecvEngine& self, const std::vector<std::tuple<bool, std::uintptr_t, std::size_t, int>>& ops,
                       std::uintptr_t stream, double timeout) {
             std::vector<SendRecvEngine::Operation> list;
             for (const auto& [send, buffer, bytes, peer] : ops)
               list.push_back({send, as_pointer<void>(buffer), bytes, peer});
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.batch(list, as_stream(stream), timeout);
           }, py::arg("ops"), py::arg("stream"), py::arg("timeout"), release_gil(),
           "ops: (is_send, address, bytes, peer) tuples, run in one launch")
      .def_property_readonly("zero_copy_min_bytes", [](SendRecvEngine& self) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             return self.zero_copy_min_bytes();
           }, "messages of at least this many bytes between load/store peers move once (0: never)")
      .def("set_zero_copy_min_bytes", [](SendRecvEngine& self, std::size_t bytes) {
             // The agreement is a blocking barrier: outside the lock (a peer's transfer may need it).
             SendRecvEngine::agree_zero_copy_min_bytes(bytes);
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             self.set_zero_copy_min_bytes_agreed(bytes);
           }, py::arg("bytes"), release_gil(),
           "collective: every PE, the same value, between calls (bench and tests: 0 turns zero-copy off)")
      .def("service_zero_copy", [](SendRecvEngine& self) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             if (self.initialized()) self.service_zero_copy();
           }, release_gil(), "serve the peers' zero-copy mapping requests (never blocks)")
      .def("zero_copy_counters", [](SendRecvEngine& self) {
             std::lock_guard<std::mutex> lock(g_send_recv_mutex);
             const std::vector<uint64_t> v = self.zero_copy_counters();
             static const char* names[] = {"send_staged", "send_zero_copy", "recv_staged", "recv_zero_copy",
                                           "map_requests", "acked", "refused", "not_exportable",
                                           "stale_dropped", "evicted", "opened", "closed"};
             py::dict out;
             for (std::size_t i = 0; i < v.size() && i < sizeof(names) / sizeof(names[0]); ++i)
               out[names[i]] = v[i];
             return out;
           }, "test hook: ops finished by mode (counted on the device: synchronise first) and the "
              "mapping bookkeeping, since init");
}
