// pydatacopy._C: one module, bound feature by feature (runtime.cpp, rma.cpp, registration.cpp,
// token_exchange.cpp, send_recv.cpp, moe.cpp, settings.cpp); this file makes the error types and joins them.
#include "bindings.hpp"

#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/settings.hpp"

namespace pydatacopy::bindings {

PyObject* g_error = nullptr;
PyObject* g_timeout_error = nullptr;

void add_fast_calls(py::module_& m, PyMethodDef* defs, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    PyObject* function = PyCFunction_NewEx(&defs[i], nullptr, m.attr("__name__").ptr());
    if (function == nullptr) throw py::error_already_set();
    m.add_object(defs[i].ml_name, py::reinterpret_steal<py::object>(function));
  }
}

}  // namespace pydatacopy::bindings

PYBIND11_MODULE(_C, m) {
  using namespace pydatacopy;
  using namespace pydatacopy::bindings;
  m.doc() = "pydatacopy native core (private: use the pydatacopy package)";
  m.attr("__version__") = PYDATACOPY_VERSION;
  m.attr("UNIQUE_ID_BYTES") = kUniqueIdBytes;

  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<TimeoutError> timeout_error(m, "TimeoutError", error.ptr());
  // A bad environment variable (settings.hpp); runtime/settings.py raises it as its SettingError.
  static py::exception<settings::SettingError> setting_error(m, "SettingError", error.ptr());
  g_error = error.ptr();
  g_timeout_error = timeout_error.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const settings::SettingError& e) {
      py::set_error(setting_error, e.what());
    } catch (const TimeoutError& e) {
      py::set_error(timeout_error, e.what());
    } catch (const Error& e) {
      py::set_error(error, e.what());
    }
  });

  bind_runtime(m);
  bind_rma(m);
  bind_registration(m);
  bind_token_exchange(m);
  bind_send_recv(m);
  bind_moe(m);
  bind_settings(m);
  bind_torch_backend_api(m);
}
