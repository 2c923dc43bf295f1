// The C table the torch.distributed backend extension calls the core through
// (include/pydatacopy/torch_backend_api.h): the backend is built against the installed torch at
// first use, and reaches this module's engine and runtime without linking the core a second time.
#include "bindings.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "pydatacopy/runtime.hpp"
#include "pydatacopy/send_recv.hpp"
#include "pydatacopy/settings.hpp"
#include "pydatacopy/symmetric.hpp"
#include "pydatacopy/torch_backend_api.h"

namespace pydatacopy::bindings {

namespace {

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

int launch(void* engine, const pydatacopy_p2p_op* ops, int count, void* stream, double timeout_s,
           char* message, std::size_t message_bytes) {
  return as_status([&] {
    auto& sender = *static_cast<SendRecvEngine*>(engine);
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

int check_errors(void* engine, char* message, std::size_t message_bytes) {
  return as_status([&] {  // the order of pydatacopy.check_errors()
    auto* sender = static_cast<SendRecvEngine*>(engine);
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

const pydatacopy_torch_backend_api kApi = {PYDATACOPY_TORCH_BACKEND_API_VERSION, settings::kMaxGroupOps, &launch,
                                           &device_errors, &check_errors, &stream_capturing, &symmetric};

}  // namespace

void bind_torch_backend_api(py::module_& m) {
  m.def("torch_backend_api", [] {
          return py::capsule(const_cast<pydatacopy_torch_backend_api*>(&kApi), PYDATACOPY_TORCH_BACKEND_API_CAPSULE);
        }, "the C table the torch.distributed backend extension calls the core through (torch_backend_api.h)");
  m.def("engine_address", [](SendRecvEngine& engine) { return as_address(&engine); }, py::arg("engine"),
        "the engine's address, for the backend extension's launches (the caller keeps the engine alive)");
}

}  // namespace pydatacopy::bindings
