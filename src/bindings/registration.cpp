// Bindings of registered memory for NVSHMEM's remote transports (registration.hpp).
#include "bindings.hpp"

#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"

namespace pydatacopy::bindings {

void bind_registration(py::module_& m) {
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

}

}  // namespace pydatacopy::bindings
