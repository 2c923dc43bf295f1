// The C table the torch.distributed backend extension calls the core through
// (include/pydatacopy/torch_backend_api.h): the backend is built against the installed torch at
// first use, and reaches this module's engine and runtime without linking the core a second time.
#include "bindings.hpp"

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <cstring>
#include <vector>

#include "pydatacopy/runtime.hpp"
#include "pydatacopy/send_recv.hpp"
#include "pydatacopy/symmetric.hpp"
#include "pydatacopy/torch_backend_api.h"

namespace pydatacopy::bindings {

namespace {

// The engine pydatacopy.send uses (send_recv.py's setup_send_recv/teardown_send_recv set it, with
// the GIL): a backend's group made before a setup_send_recv() launches on the new one.
// Launches hold the lock shared; the swap holds it alone, so an engine is never freed under a
// launch (the setter holds the GIL while it waits: the readers never take the GIL).
PyObject* g_engine_owner = nullptr;  // a strong reference, left at exit
SendRecvEngine* g_engine = nullptr;
std::shared_mutex g_engine_mutex;

SendRecvEngine& current_engine() {
  PDC_REQUIRE(g_engine != nullptr, "send/recv staging is not set up: pydatacopy.init()/init_nvshmem() do it, "
                                   "or call pydatacopy.setup_send_recv() on every PE");
  return *g_engine;
}

int fail(int status, const char* what, char* message, std::size_t message_bytes) {
  if (message != nullptr && message_bytes > 0) {
    const std::size_t n = std::min(std::strlen(what), message_bytes - 1);
    std::memcpy(message, what, n);
    message[n] = '\0';
  }
  return status;
}

// `work()` as a pydatacopy_status: no C++ exception leaves this module.
template <typename Work>
int as_status(Work&& work, char* message, std::size_t message_bytes) noexcept {
  try {
    work();
    return PYDATACOPY_OK;
  } catch (const TimeoutError& e) {
    return fail(PYDATACOPY_TIMEOUT, e.what(), message, message_bytes);
  } catch (const std::exception& e) {
    return fail(PYDATACOPY_ERROR, e.what(), message, message_bytes);
  } catch (...) {
    return fail(PYDATACOPY_ERROR, "pydatacopy: an unknown C++ exception in the core", message, message_bytes);
  }
}

int launch(const pydatacopy_p2p_op* ops, int count, void* stream, double timeout_s, char* message,
           std::size_t message_bytes) {
  return as_status([&] {
    std::shared_lock<std::shared_mutex> engine_in_use(g_engine_mutex);
    SendRecvEngine& sender = current_engine();
    const cudaStream_t on = static_cast<cudaStream_t>(stream);
    if (count == 1) {  // the engine's one-op path, as pydatacopy.send/recv take it
      const pydatacopy_p2p_op& op = ops[0];
      if (op.is_send)
        sender.send(op.buffer, op.bytes, op.peer, on, timeout_s);
      else
        sender.recv(op.buffer, op.bytes, op.peer, on, timeout_s);
      return;
    }
    std::vector<SendRecvEngine::Operation> list;
    list.reserve(static_cast<std::size_t>(std::max(count, 0)));
    for (int i = 0; i < count; ++i)
      list.push_back({ops[i].is_send != 0, ops[i].buffer, static_cast<std::size_t>(ops[i].bytes), ops[i].peer});
    sender.batch(list, on, timeout_s);
  }, message, message_bytes);
}

int device_errors(char* message, std::size_t message_bytes) {
  return as_status([] { check_device_errors(); }, message, message_bytes);
}

int check_errors(char* message, std::size_t message_bytes) {
  return as_status([&] {  // the order of pydatacopy.check_errors()
    std::shared_lock<std::shared_mutex> engine_in_use(g_engine_mutex);
    SendRecvEngine* sender = g_engine;
    if (sender != nullptr && sender->initialized()) sender->service_zero_copy();
    check_device_errors();
    if (sender != nullptr && sender->initialized()) sender->check_refusals();
  }, message, message_bytes);
}

int stream_capturing(void* stream, int* capturing, char* message, std::size_t message_bytes) {
  return as_status([&] {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    PDC_CHECK_CUDA(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
    *capturing = status != cudaStreamCaptureStatusNone;
  }, message, message_bytes);
}

int symmetric(const void* address, int* is_in_heap, char* message, std::size_t message_bytes) {
  return as_status([&] { *is_in_heap = is_symmetric(address, 1); }, message, message_bytes);
}

thread_local void (*t_flush)(void) = nullptr;  // this thread's backend queue (set_thread_flush)

void set_thread_flush(void (*flush)(void)) { t_flush = flush; }

const pydatacopy_torch_backend_api kApi = {PYDATACOPY_TORCH_BACKEND_API_VERSION, &launch, &device_errors,
                                           &check_errors, &stream_capturing, &symmetric, &set_thread_flush};

}  // namespace

void flush_torch_backend_queue() {
  if (t_flush != nullptr) t_flush();
}

void bind_torch_backend_api(py::module_& m) {
  m.def("torch_backend_api", [] {
          return py::capsule(const_cast<pydatacopy_torch_backend_api*>(&kApi), PYDATACOPY_TORCH_BACKEND_API_CAPSULE);
        }, "the C table the torch.distributed backend extension calls the core through (torch_backend_api.h)");
  m.def("set_current_engine", [](py::object engine) {
          SendRecvEngine* pointer = engine.is_none() ? nullptr : engine.cast<SendRecvEngine*>();
          PyObject* previous = g_engine_owner;
          {
            std::unique_lock<std::shared_mutex> swap(g_engine_mutex);
            g_engine_owner = engine.is_none() ? nullptr : engine.inc_ref().ptr();
            g_engine = pointer;
          }
          Py_XDECREF(previous);
        }, py::arg("engine"),
        "the engine the torch.distributed backend launches on (None: none); send_recv.py sets it");
  m.def("flush_torch_backend_queue", [] {
          if (t_flush == nullptr) return;  // no native queue on this thread: not worth the GIL's release
          py::gil_scoped_release unlocked;
          t_flush();
        }, "launch what the torch.distributed backend queued on this thread (the direct calls do first)");
}

}  // namespace pydatacopy::bindings
