// What every binding file shares: pointers and streams cross as integers, the GIL is released
// around core calls, and the METH_FASTCALL entries of the hot paths convert their arguments here.
// Torch stays in the Python layer: this module links neither libtorch nor libpython.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>

#include <cuda_runtime.h>

#include "pydatacopy/error.hpp"
#include "pydatacopy/transfer.hpp"
#include "rma/transfer_internal.hpp"

namespace pydatacopy::bindings {

namespace py = pybind11;
using release_gil = py::call_guard<py::gil_scoped_release>;

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
template <typename T>
T* as_pointer(std::uintptr_t address) { return reinterpret_cast<T*>(address); }
inline std::uintptr_t as_address(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }
inline Path as_path(int path) {
  PDC_REQUIRE(path >= static_cast<int>(Path::kAuto) && path <= static_cast<int>(Path::kRMA), "path must be one of auto, copy_engine, sm, rma");
  return static_cast<Path>(path);
}

// ---- METH_FASTCALL entries of the hot paths ----
//
// pybind11's dispatch of put's six integers, with its GIL release, cost 167 ns per call on the
// CPU where it was measured, a METH_FASTCALL function 60-90 ns (scripts/profile_host_path.py):
// the Python layer's fast paths call these, positionally, after its own checks.
extern PyObject* g_error;          // pydatacopy.Error
extern PyObject* g_timeout_error;  // pydatacopy.TimeoutError

inline bool unsigned_argument(PyObject* value, unsigned long long& out) {
  out = PyLong_AsUnsignedLongLong(value);
  return !(out == static_cast<unsigned long long>(-1) && PyErr_Occurred());
}

inline bool int_argument(PyObject* value, int& out) {
  const long wide = PyLong_AsLong(value);
  if (wide == -1 && PyErr_Occurred()) return false;
  if (wide < INT_MIN || wide > INT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "an int argument does not fit a C int");
    return false;
  }
  out = static_cast<int>(wide);
  return true;
}

inline bool double_argument(PyObject* value, double& out) {
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

template <typename Function>
PyMethodDef fast_call(const char* name, Function* function, const char* doc) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function)), METH_FASTCALL, doc};
}

// A getter that takes an engine's lock, read without the GIL: a hot call on another thread may
// hold that lock for a while (a capture's rendezvous, a first-use registration), and must not
// stall every Python thread meanwhile.
template <typename Class, typename T>
py::cpp_function without_gil_getter(T (Class::*getter)() const) {
  return py::cpp_function([getter](const Class& self) { return (self.*getter)(); }, release_gil());
}

// Adds METH_FASTCALL functions to the module; `defs` must outlive it (static storage).
void add_fast_calls(py::module_& m, PyMethodDef* defs, std::size_t count);

// One per feature, each in its own file, called in this order by module.cpp.
void bind_runtime(py::module_& m);
void bind_rma(py::module_& m);
void bind_registration(py::module_& m);
void bind_token_exchange(py::module_& m);
void bind_send_recv(py::module_& m);
void bind_moe(py::module_& m);
void bind_settings(py::module_& m);
void bind_torch_backend_api(py::module_& m);
// Launch what the torch.distributed backend's native queue holds for this thread, if anything
// (set through its C table): the direct send/recv calls do first, keeping each channel in order.
void flush_torch_backend_queue();

}  // namespace pydatacopy::bindings
