// Bindings of the design note's DoubleBufferManager (double_buffer_manager.hpp).
#include "bindings.hpp"

#include "pydatacopy/double_buffer_manager.hpp"

namespace pydatacopy::bindings {

void bind_token_exchange(py::module_& m) {
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
      .def_property_readonly("round", without_gil_getter(&DoubleBufferManager::round))
      .def_property_readonly("last_waited_round", without_gil_getter(&DoubleBufferManager::last_waited_round))
      .def("send_buffer", [](const DoubleBufferManager& self, int set) {
             return as_address(self.send_buffer(set)); }, py::arg("set"))
      .def("recv_buffer", [](const DoubleBufferManager& self, int set) {
             return as_address(self.recv_buffer(set)); }, py::arg("set"))
      .def("exchange",
           [](DoubleBufferManager& self, int dst_pe, int src_pe, std::uintptr_t stream,
              double timeout) {
             return self.exchange(dst_pe, src_pe, as_stream(stream), timeout);
           },
           py::arg("dst_pe"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"), release_gil())
      .def("wait",
           [](DoubleBufferManager& self, int64_t round, int src_pe, std::uintptr_t stream,
              double timeout, bool blocking) {
             self.wait(round, src_pe, as_stream(stream), timeout, blocking);
           },
           py::arg("round"), py::arg("src_pe"), py::arg("stream"), py::arg("timeout"),
           py::arg("blocking") = false, release_gil())
      .def_static("symmetric_bytes_needed", &DoubleBufferManager::symmetric_bytes_needed,
                  py::arg("n_tokens"), py::arg("token_size"), py::arg("n_pes"))
      .def_static("default_dst_pe", &DoubleBufferManager::default_dst_pe, py::arg("pe"),
                  py::arg("n_pes"))
      .def_static("default_src_pe", &DoubleBufferManager::default_src_pe, py::arg("pe"),
                  py::arg("n_pes"));

}

}  // namespace pydatacopy::bindings
