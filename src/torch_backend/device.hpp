// The torch.distributed backend's errors and its device (src/torch_backend/backend.cpp includes
// it; built with it at first use): refusals raised into Python as pydatacopy.Error or
// TimeoutError, and the device a group's queue launches on - torch's CUDA through c10 and _C's C
// table, or the CPU tests' fake.
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pydatacopy/torch_backend_api.h"

namespace pydatacopy::torch_backend {

namespace py = pybind11;

// ---- errors: pydatacopy.Error and pydatacopy.TimeoutError, raised into Python --------------

inline PyObject* g_error = nullptr;          // set by init()
inline PyObject* g_timeout_error = nullptr;  // set by init()
inline std::map<std::string, std::string> g_messages;  // work.py's MESSAGES, set by init()

// A refusal: kept by a batch, so that every Work of it raises it.
struct Failure {
  int status = PYDATACOPY_ERROR;
  std::string message;
};

inline const std::string& message(const char* key) {
  static const std::string missing = "pydatacopy: (message missing: init() was not given it)";
  const auto found = g_messages.find(key);
  return found == g_messages.end() ? missing : found->second;
}

// Raise into Python: torch's bindings release the GIL around a backend's calls and translate a
// py::error_already_set back into the Python exception set here.
[[noreturn]] inline void raise(const Failure& failure) {
  py::gil_scoped_acquire gil;
  PyErr_SetString(failure.status == PYDATACOPY_TIMEOUT ? g_timeout_error : g_error, failure.message.c_str());
  throw py::error_already_set();
}
[[noreturn]] inline void raise(const std::string& text) { raise(Failure{PYDATACOPY_ERROR, text}); }

inline bool python_alive();

// A refusal as an exception_ptr that torch's bindings raise as the Python exception it was
// (a failed Work's future, exception()): pydatacopy.Error or TimeoutError, not a RuntimeError.
inline std::exception_ptr as_exception(const Failure& failure) {
  if (!python_alive()) return std::make_exception_ptr(std::runtime_error(failure.message));
  py::gil_scoped_acquire gil;
  PyErr_SetString(failure.status == PYDATACOPY_TIMEOUT ? g_timeout_error : g_error, failure.message.c_str());
  ::python_error error;  // torch/csrc/Exceptions.h
  error.persist();
  return std::make_exception_ptr(std::move(error));
}

inline bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// A strong reference to a Python object held by C++ that may be destroyed without the GIL (torch
// frees a backend from C++); at interpreter exit the reference is left, never touched unlocked.
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::handle object) : object_(object.inc_ref().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (object_ != nullptr && python_alive()) {
      const PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(object_);
      PyGILState_Release(state);
    }
  }
  py::handle get() const { return object_; }

 private:
  PyObject* object_ = nullptr;
};

// ---- the device: torch's CUDA through c10 and _C's table; a fake for the CPU tests -----------

// "The GPU has run what was launched before this point of a stream."
class Completion {
 public:
  virtual ~Completion() = default;
  virtual bool query() = 0;
  virtual void block(const c10::Stream& stream) = 0;  // `stream` waits for it; the host does not
};

class Device {
 public:
  virtual ~Device() = default;
  virtual int index() const = 0;
  virtual bool accepts(const at::Tensor& tensor) const = 0;  // on this process's device
  virtual c10::Stream current_stream() = 0;
  virtual bool capturing(const c10::Stream& stream) = 0;  // `stream` captures a CUDA graph
  bool capturing() { return capturing(current_stream()); }  // the current stream does
  virtual void launch(const std::vector<pydatacopy_p2p_op>& ops, const c10::Stream& stream, double timeout_s) = 0;
  virtual void check_device_errors() = 0;  // raises what the device reported (host memory only)
  virtual void check_errors() = 0;         // also the engine's refusals (reads the device: not in a capture)
  // Records each storage for `stream`; raises nothing (a storage the allocator refuses needs no record).
  virtual void keep_alive(const std::vector<c10::Storage>& storages, const c10::Stream& stream) = 0;
  virtual std::shared_ptr<Completion> completion_after(const c10::Stream& stream) = 0;
  virtual std::vector<c10::Device> future_devices() const = 0;
};

class CudaCompletion final : public Completion {
 public:
  explicit CudaCompletion(const c10::Stream& stream) : event_(c10::DeviceType::CUDA) { event_.record(stream); }
  bool query() override { return event_.query(); }
  void block(const c10::Stream& stream) override { event_.block(stream); }

 private:
  c10::Event event_;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, const pydatacopy_torch_backend_api* api) : index_(index), api_(api) {}

  int index() const override { return index_; }
  bool accepts(const at::Tensor& tensor) const override {
    return tensor.is_cuda() && tensor.get_device() == index_;
  }
  c10::Stream current_stream() override {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
        ->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index_)));
  }
  bool capturing(const c10::Stream& stream) override {
    int capturing = 0;
    check(api_->stream_capturing(stream.native_handle(), &capturing, text_, sizeof text_));
    return capturing != 0;
  }
  void launch(const std::vector<pydatacopy_p2p_op>& ops, const c10::Stream& stream, double timeout_s) override {
    check(api_->launch(ops.data(), static_cast<int>(ops.size()), stream.native_handle(), timeout_s, text_,
                       sizeof text_));
  }
  void check_device_errors() override { check(api_->check_device_errors(text_, sizeof text_)); }
  void check_errors() override { check(api_->check_errors(text_, sizeof text_)); }
  void keep_alive(const std::vector<c10::Storage>& storages, const c10::Stream& stream) override {
    // As NCCL's groups do (record_stream): torch's allocator keeps memory handed to work on
    // another stream until that work is done. The storages, not the tensors: a caller may have
    // swapped a tensor's storage out since it was queued. Symmetric memory is not the allocator's.
    for (const c10::Storage& storage : storages) {
      // Each on its own: cudaMallocAsync's allocator refuses memory not its own (which needs no
      // record), and the storages after such a one still need theirs.
      try {
        int symmetric = 0;
        check(api_->is_symmetric(storage.data(), &symmetric, text_, sizeof text_));
        if (symmetric || storage.nbytes() == 0) continue;
        // The allocator's own record (what Tensor.record_stream does), without a dispatch.
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->recordDataPtrOnStream(storage.data_ptr(), stream);
      } catch (...) {
      }
    }
  }
  std::shared_ptr<Completion> completion_after(const c10::Stream& stream) override {
    return std::make_shared<CudaCompletion>(stream);
  }
  std::vector<c10::Device> future_devices() const override {
    return {c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index_))};
  }

 private:
  void check(int status) {
    if (status != PYDATACOPY_OK) throw Failure{status, text_};
  }
  int index_;
  const pydatacopy_torch_backend_api* api_;
  inline static thread_local char text_[4096];
};

// The CPU tests' device (tests/test_distributed_native_cpu.py): CPU tensors stand for CUDA ones,
// streams are numbers the test sets, a launch is recorded, completion is what the test says.
class FakeDevice final : public Device {
 public:
  int index() const override { return 0; }
  // CPU tensors stand for CUDA ones, unless a test of the CPU path (gloo) says they are CPU.
  bool accepts(const at::Tensor& tensor) const override { return cpu_is_cuda.load() && tensor.device().is_cpu(); }
  c10::Stream current_stream() override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CPU), stream_id.load());
  }
  // `capturing` (the test's) says whether the current stream captures; no other stream does.
  bool capturing(const c10::Stream& stream) override {
    return is_capturing.load() && stream.id() == stream_id.load();
  }
  void launch(const std::vector<pydatacopy_p2p_op>& ops, const c10::Stream& stream, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::tuple<bool, std::uintptr_t, unsigned long long, int>> list;
    for (const auto& op : ops)
      list.emplace_back(op.is_send != 0, reinterpret_cast<std::uintptr_t>(op.buffer), op.bytes, op.peer);
    launches.emplace_back(std::move(list), stream.id(), timeout_s);
    gil_at_launch.push_back(python_alive() && PyGILState_Check());
    if (!fail_next_launch.empty()) {
      Failure failure{PYDATACOPY_ERROR, fail_next_launch};
      fail_next_launch.clear();
      throw failure;
    }
  }
  void check_device_errors() override {}
  void check_errors() override {}
  void keep_alive(const std::vector<c10::Storage>& storages, const c10::Stream& stream) override {
    std::lock_guard<std::mutex> lock(mutex);
    kept_alive.emplace_back(static_cast<int>(storages.size()), stream.id());
  }
  std::shared_ptr<Completion> completion_after(const c10::Stream&) override {
    return std::make_shared<FakeCompletion>(this);
  }
  std::vector<c10::Device> future_devices() const override { return {}; }

  std::atomic<bool> cpu_is_cuda{true};
  std::atomic<c10::StreamId> stream_id{0};
  std::atomic<bool> is_capturing{false};
  std::atomic<bool> done{true};  // what a completion's query() answers
  std::mutex mutex;
  std::vector<std::tuple<std::vector<std::tuple<bool, std::uintptr_t, unsigned long long, int>>, c10::StreamId, double>>
      launches;
  std::vector<std::pair<int, c10::StreamId>> kept_alive;   // (tensors, stream) per keep_alive
  std::vector<c10::StreamId> blocked;                       // streams made to wait, in order
  std::vector<bool> gil_at_launch;                          // whether each launch held the GIL
  std::string fail_next_launch;

 private:
  class FakeCompletion final : public Completion {
   public:
    explicit FakeCompletion(FakeDevice* device) : device_(device) {}
    bool query() override { return device_->done.load(); }
    void block(const c10::Stream& stream) override {
      std::lock_guard<std::mutex> lock(device_->mutex);
      device_->blocked.push_back(stream.id());
    }

   private:
    FakeDevice* device_;
  };
};

}  // namespace pydatacopy::torch_backend
