// The one binding file: pydatacopy._C. Pointers and streams cross as integers; torch stays in
// the Python layer, so this module links neither libtorch nor libpython.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "pydatacopy/double_buffer_manager.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "pydatacopy/symmetric.hpp"

namespace py = pybind11;
using namespace pydatacopy;

namespace {

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
template <typename T>
T* as_pointer(std::uintptr_t address) { return reinterpret_cast<T*>(address); }
std::uintptr_t as_address(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pydatacopy native core (private: use the pydatacopy package)";
  m.attr("__version__") = PYDATACOPY_VERSION;
  m.attr("UNIQUE_ID_BYTES") = kUniqueIdBytes;

  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<TimeoutError> timeout_error(m, "TimeoutError", error.ptr());
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
  m.def("get_unique_id", &get_unique_id,
        "Create an NVSHMEM unique ID (128 bytes, as a list of ints). Needs no GPU.");
  m.def("init_nvshmem", &init_nvshmem, py::arg("root_unique_id"), py::arg("rank"),
        py::arg("world_size"), py::arg("device") = -1, release_gil(),
        "Join the NVSHMEM job named by root_unique_id (collective). Returns this PE.");
  m.def("finalize", &finalize, release_gil(), "Collective NVSHMEM finalize; harmless twice.");
  m.def("is_initialized", &is_initialized);
  m.def("my_pe", &my_pe);
  m.def("n_pes", &n_pes);
  m.def("cuda_device", &cuda_device);
  m.def("built_nvshmem_version", [] { return built_nvshmem_version().str(); });
  m.def("loaded_nvshmem_version", [] { return loaded_nvshmem_version().str(); });
  m.def("check_nvshmem_version", &check_nvshmem_version);
  m.def("default_timeout_seconds", &default_timeout_seconds);
  m.def("check_device_errors", &check_device_errors);

  // Symmetric memory.
  m.def("symmetric_malloc", [](std::size_t bytes) { return as_address(symmetric_malloc(bytes)); },
        py::arg("bytes"), release_gil());
  m.def("symmetric_free", [](std::uintptr_t ptr) { symmetric_free(as_pointer<void>(ptr)); },
        py::arg("ptr"), release_gil());
  m.def("is_symmetric",
        [](std::uintptr_t ptr, std::size_t bytes) { return is_symmetric(as_pointer<void>(ptr), bytes); },
        py::arg("ptr"), py::arg("bytes"));
  m.def("peer_pointer",
        [](std::uintptr_t ptr, int pe) { return as_address(peer_pointer(as_pointer<void>(ptr), pe)); },
        py::arg("ptr"), py::arg("pe"));
  m.def("rma_forced", &rma_forced);

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
              double timeout) { return self.exchange(dst_pe, src_pe, as_stream(stream), timeout); },
           py::arg("dst_pe"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"))
      .def("wait",
           [](DoubleBufferManager& self, int64_t round, int src_pe, std::uintptr_t stream,
              double timeout) { self.wait(round, src_pe, as_stream(stream), timeout); },
           py::arg("round"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"))
      .def_static("default_dst_pe", &DoubleBufferManager::default_dst_pe, py::arg("pe"),
                  py::arg("n_pes"))
      .def_static("default_src_pe", &DoubleBufferManager::default_src_pe, py::arg("pe"),
                  py::arg("n_pes"));
}
