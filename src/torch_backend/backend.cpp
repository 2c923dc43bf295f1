// The torch.distributed backend "pydatacopy" as a c10d::Backend (issue 38): dist.send / dist.recv /
// isend / irecv / batch_isend_irecv on CUDA tensors reach this code from torch's C++ dispatcher
// without entering Python, and their Works are C++.
//
// Built against the installed torch when first used (python/pydatacopy/distributed/native.py):
// a c10d::Backend is torch's C++ ABI. It links no CUDA and no core: the device is reached through
// c10 (streams, events) and the core through the C table pydatacopy._C hands it
// (include/pydatacopy/torch_backend_api.h), so one NVSHMEM state and one send/recv engine serve
// both this backend and pydatacopy.send/recv.
//
// The default since its GPU tests passed (2 and 4 PEs, 2026-12-07); PYDATACOPY_DISTRIBUTED_NATIVE=0
// asks for the Python group instead.
//
// What is not the hot path is the Python group's (python/pydatacopy/distributed/backend.py, the
// "delegate"): argument refusals and their texts, all_to_all_single, barrier, every other
// collective (gloo for CPU tensors, a refusal naming the alternative for CUDA ones). Those call
// back into this module's Queue, so the sends and recvs of a group go through one queue.
//
// The queue (the rules of python/pydatacopy/distributed/work.py, which the Python group uses when
// it is not the delegate): torch hands a backend one send()/recv() per operation; each is
// queued, and the queue is launched as one pydatacopy group (one kernel) when a Work's result is
// first asked for, at the end of a coalesced batch (batch_isend_irecv), or when another call of
// the backend comes. The queue is the calling thread's, shared by every group of the process.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "device.hpp"  // its errors and its device
#include "pydatacopy/torch_backend_api.h"

namespace pydatacopy::torch_backend {

namespace py = pybind11;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// ---- the queue --------------------------------------------------------------------------------

// Operations queued on one stream, launched once as one group.
struct Batch {
  Batch(std::shared_ptr<Device> on, const c10::Stream& launch_stream, double timeout, bool in_capture)
      : device(std::move(on)), stream(launch_stream), timeout_s(timeout), captured(in_capture) {}

  std::shared_ptr<Device> device;
  c10::Stream stream;
  double timeout_s;
  bool captured;  // queued during a CUDA graph capture: launched inside it, or refused
  std::vector<pydatacopy_p2p_op> ops;
  std::vector<at::Tensor> tensors;
  // The memory itself, until the batch goes: a caller may swap a queued tensor's storage out
  // (Megatron's deallocate_output_tensor: out.data = torch.empty(1)) before the launch.
  std::vector<c10::Storage> storages;

  std::mutex mutex;  // held through the launch: a Work waited on by another thread waits for it
  bool launched = false;
  std::optional<Failure> failure;
  std::shared_ptr<Completion> completion;  // recorded after the launch when first asked for
};

thread_local std::shared_ptr<Batch> t_batch;  // this thread's queue
// The backend whose coalesced batch (batch_isend_irecv) this thread is in, between torch's
// startCoalescing and endCoalescing; still set after a batch that raised (torch does not end it).
thread_local const void* t_coalescing = nullptr;
// Whether a pydatacopy.group() is open on this thread (send_recv.py's group_hooks say): its calls
// launch at its end, so an operation queued here meanwhile would reach a peer out of order.
thread_local bool t_in_group = false;

// What a batch holds of its tensors is not needed once it is launched or refused (recorded on the
// launch's stream by then; each Work keeps its own tensor): let it go, since the queuing thread may
// name the batch until it queues again (another thread's wait launched it), which may be never.
// Taken out under the batch's lock and freed after it: freeing a tensor may take the GIL, which a
// thread waiting for that lock may hold.
struct Released {
  std::vector<at::Tensor> tensors;
  std::vector<c10::Storage> storages;
};
Released release_memory_locked(Batch& batch) {  // batch.mutex held
  Released released;
  released.tensors.swap(batch.tensors);
  released.storages.swap(batch.storages);
  return released;
}

void launch_locked(const std::shared_ptr<Batch>& batch);

void launch(const std::shared_ptr<Batch>& batch) {
  if (t_batch == batch) t_batch.reset();  // also when another thread launched it
  Released released;  // freed after the lock
  std::lock_guard<std::mutex> lock(batch->mutex);
  if (batch->launched) return;
  batch->launched = true;
  launch_locked(batch);
  released = release_memory_locked(*batch);
}

// Whether each operation's bytes still lie in the memory queued with it: a storage resized or
// freed in place since (FSDP's storage.resize_(0), an offload) gave that memory back to the
// allocator before the launch could record it, and another tensor may own it now.
bool memory_still_held(const Batch& batch) {
  for (size_t i = 0; i < batch.ops.size(); ++i) {
    const pydatacopy_p2p_op& op = batch.ops[i];
    if (op.bytes == 0) continue;
    const auto base = reinterpret_cast<uintptr_t>(batch.storages[i].data());
    const auto address = reinterpret_cast<uintptr_t>(op.buffer);
    if (address < base || address - base + op.bytes > batch.storages[i].nbytes()) return false;
  }
  return true;
}

void launch_locked(const std::shared_ptr<Batch>& batch) {
  Device& device = *batch->device;
  try {
    // Whoever launches (a wait, a batch's end, another call's flush), the batch's own stream decides;
    // an eager batch is not launched from inside a capture either (on its stream it would be
    // recorded, not run; on another, a capture in global mode forbids what an eager launch may do).
    const bool capturing = device.capturing(batch->stream);
    if (batch->captured ? !capturing
                        : capturing || (device.current_stream() != batch->stream && device.capturing())) {
      batch->failure = Failure{PYDATACOPY_ERROR, message(batch->captured ? "captured_not_waited" : "pending_at_capture")};
      return;
    }
    if (!memory_still_held(*batch)) {
      batch->failure = Failure{PYDATACOPY_ERROR, message("memory_freed_before_launch")};
      return;
    }
    try {
      device.launch(batch->ops, batch->stream, batch->timeout_s);
    } catch (const Failure& failure) {
      batch->failure = failure;  // every Work of the batch reports it, not only this caller
    }
    // As NCCL does: the allocator keeps the memory until the launch's stream is done with it (a
    // no-op for memory allocated on that stream). After the launch; it raises nothing.
    device.keep_alive(batch->storages, batch->stream);
  } catch (const Failure& failure) {
    batch->failure = failure;
  } catch (const std::exception& error) {
    batch->failure = Failure{PYDATACOPY_ERROR, error.what()};
  }
}

// Refuse a batch not launched yet, whole: nothing of it is sent; its Works raise `why`. What it
// held is the caller's to free after the lock.
Released drop_locked(const std::shared_ptr<Batch>& batch, const Failure& why) {  // batch->mutex held
  if (t_batch == batch) t_batch.reset();
  if (batch->launched) return {};
  batch->launched = true;
  batch->failure = why;
  return release_memory_locked(*batch);
}
void drop(const std::shared_ptr<Batch>& batch, const Failure& why) {
  Released released;  // freed after the lock
  std::lock_guard<std::mutex> lock(batch->mutex);
  released = drop_locked(batch, why);
}

// launch() from a Work's method that torch's bindings call with the GIL held (is_completed,
// result, get_future): a launch may wait on the host for a peer's descriptor, and other Python
// threads go on meanwhile.
void launch_unlocked(const std::shared_ptr<Batch>& batch) {
  if (python_alive() && PyGILState_Check()) {
    py::gil_scoped_release unlocked;
    launch(batch);
  } else {
    launch(batch);
  }
}

std::shared_ptr<Completion> completion(const std::shared_ptr<Batch>& batch) {
  launch(batch);
  std::lock_guard<std::mutex> lock(batch->mutex);
  if (!batch->completion) batch->completion = batch->device->completion_after(batch->stream);
  return batch->completion;
}

void raise_known(const std::shared_ptr<Batch>& batch) {
  std::optional<Failure> failure;
  {
    std::lock_guard<std::mutex> lock(batch->mutex);
    failure = batch->failure;
  }
  if (failure) raise(*failure);
}

// Device calls that may throw a Failure, raised into Python.
template <typename Call>
auto raising(Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const Failure& failure) {
    raise(failure);
  }
}

// Longer bounded waits are taken as this long: a deadline past it would overflow the clock.
constexpr std::chrono::milliseconds kLongestWait = std::chrono::hours(24 * 365 * 100);

std::string seconds(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", duration.count() / 1000.0);
  return text;
}

// NCCL's Work semantics for a queued send or recv: wait() launches the queue (if not yet) and
// makes the current stream wait for it, without blocking the host; isCompleted() says whether the
// GPU has finished it. A refusal is raised by wait(), isCompleted() and result().
class P2PWork final : public c10d::Work {
 public:
  P2PWork(std::shared_ptr<Batch> batch, std::vector<at::Tensor> result)
      : c10d::Work(-1, c10d::OpType::UNKNOWN), batch_(std::move(batch)), result_(std::move(result)) {}

  const std::shared_ptr<Batch>& batch() const { return batch_; }

  bool wait(std::chrono::milliseconds timeout) override {
    launch_unlocked(batch_);
    raise_known(batch_);
    Device& device = *batch_->device;
    raising([&] { device.check_device_errors(); });  // what the GPU reported since (a peer that timed out)
    const c10::Stream current = raising([&] { return device.current_stream(); });
    if (current != batch_->stream) {
      // An event of eager work waited on inside a capture: not something a graph can hold.
      if (!batch_->captured && raising([&] { return device.capturing(); })) raise(message("eager_waited_in_capture"));
      raising([&] { completion(batch_)->block(current); });
    }
    if (timeout.count() > 0 && !raising([&] { return device.capturing(); })) {
      // A bounded wait asked for: the host waits for the GPU, at most `timeout`.
      const auto done = raising([&] { return completion(batch_); });
      const auto deadline = std::chrono::steady_clock::now() + std::min(timeout, kLongestWait);
      while (!raising([&] { return done->query(); })) {
        if (std::chrono::steady_clock::now() > deadline)
          raise(Failure{PYDATACOPY_TIMEOUT, message("wait_timed_out") + " (" + seconds(timeout) + " s)"});
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      raising([&] { device.check_errors(); });
    }
    return true;
  }

  void synchronize() override { wait(std::chrono::milliseconds(0)); }
  // torch's own (a spin kernel) is not what this Work means: the current stream waits on an event.
  void blockCurrentStream() override { wait(std::chrono::milliseconds(0)); }

  bool isCompleted() override {
    launch_unlocked(batch_);
    raise_known(batch_);
    Device& device = *batch_->device;
    if (raising([&] { return device.capturing(); })) raise(message("completed_in_capture"));
    const bool done = raising([&] { return completion(batch_)->query(); });
    if (done) raising([&] { device.check_errors(); });
    return done;
  }

  bool isSuccess() const override {
    auto* self = const_cast<P2PWork*>(this);
    if (!self->isCompleted()) return false;
    std::lock_guard<std::mutex> lock(batch_->mutex);
    return !batch_->failure.has_value();
  }

  std::exception_ptr exception() const override {
    std::optional<Failure> failure;
    {
      std::lock_guard<std::mutex> lock(batch_->mutex);
      failure = batch_->failure;
    }
    return failure ? as_exception(*failure) : nullptr;
  }

  int sourceRank() const override { raise(message("no_source_rank")); }

  std::vector<at::Tensor> result() override {
    launch_unlocked(batch_);
    raise_known(batch_);
    return result_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    // Completed once the GPU has run the work (a CUDA-aware future: waiting on it orders the
    // current stream after the work).
    launch_unlocked(batch_);
    // Its completion is an event of eager work, which a capturing stream cannot wait on.
    if (!batch_->captured && raising([&] { return batch_->device->capturing(); }))
      raise(message("eager_waited_in_capture"));
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                           batch_->device->future_devices());
    std::optional<Failure> failure;
    {
      std::lock_guard<std::mutex> lock(batch_->mutex);
      failure = batch_->failure;
    }
    if (failure) {
      future->setError(as_exception(*failure));
      return future;
    }
    const c10::StreamGuard on_batch_stream(batch_->stream);
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::shared_ptr<Batch> batch_;
  std::vector<at::Tensor> result_;
};

// A Work already complete (a barrier's, an empty coalesced batch's).
class DoneWork final : public c10d::Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result)
      : c10d::Work(-1, c10d::OpType::UNKNOWN), result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

// Works that finish together (a coalesced batch's launch and what gloo ran in it).
class AllOfWork final : public c10d::Work {
 public:
  explicit AllOfWork(std::vector<WorkPtr> parts) : c10d::Work(-1, c10d::OpType::UNKNOWN), parts_(std::move(parts)) {}
  bool isCompleted() override {
    for (auto& part : parts_)
      if (!part->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override {
    for (const auto& part : parts_)
      if (!part->isSuccess()) return false;
    return true;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    // One deadline for all the parts (0: no bound, NCCL's default).
    timeout = std::min(timeout, kLongestWait);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& part : parts_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      part->wait(timeout.count() > 0 ? std::max(left, std::chrono::milliseconds(1)) : timeout);
    }
    return true;
  }
  void synchronize() override {
    for (auto& part : parts_) part->synchronize();
  }
  void blockCurrentStream() override {
    for (auto& part : parts_) part->blockCurrentStream();
  }
  std::exception_ptr exception() const override {
    for (const auto& part : parts_)
      if (auto error = part->exception()) return error;
    return nullptr;
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> all;
    for (auto& part : parts_)
      for (auto& tensor : part->result()) all.push_back(tensor);
    return all;
  }

 private:
  std::vector<WorkPtr> parts_;
};

// The queue as the Python group (the delegate) and this backend's hot path see it.
class Queue {
 public:
  explicit Queue(std::shared_ptr<Device> device) : device_(std::move(device)) {}

  // Launch this thread's queued operations, if any. A batch still open here was abandoned (it
  // raised, and torch does not end such a batch; nothing else flushes inside one): dropped.
  static void flush() {
    if (t_coalescing != nullptr) abandon_batch();
    if (std::shared_ptr<Batch> batch = t_batch) launch(batch);
  }

  // A batch that raised before its end sends nothing (sending part of it would pair wrongly with
  // the peers' batches): what it queued is refused, its Works raise.
  static void abandon_batch() {
    if (std::shared_ptr<Batch> batch = t_batch) drop(batch, Failure{PYDATACOPY_ERROR, message("abandoned_batch")});
    t_coalescing = nullptr;
  }

  // Forget this thread's queue without launching it (native.py, at interpreter exit: a batch
  // freed after Python has gone could not free the Python-owned memory it holds).
  static void discard() { t_batch.reset(); }

  // One send or recv of a checked, contiguous tensor on this process's device: the Work that
  // launches it when asked.
  WorkPtr queue(bool is_send, const at::Tensor& tensor, int pe, double timeout_s) {
    if (t_in_group) raise(message("inside_group"));
    Device& device = *device_;
    const c10::Stream stream = raising([&] { return device.current_stream(); });
    const bool capturing = raising([&] { return device.capturing(); });
    if (std::shared_ptr<Batch> batch = t_batch) {
      std::optional<Failure> refusal;
      Released released;  // freed after the lock
      {
        // Under the batch's lock: a Work of it waited on another thread launches it meanwhile,
        // and an operation appended after that launch would never run.
        std::lock_guard<std::mutex> lock(batch->mutex);
        if (!batch->launched && batch->stream == stream && capturing && !batch->captured) {
          // Launched now it would enter the capture; launched later, after it: never in order.
          refusal = Failure{PYDATACOPY_ERROR, message("pending_at_capture")};
        } else if (!batch->launched && batch->stream == stream && batch->captured == capturing) {
          // Over the limit, the whole batch, not the operations past it: its first part sent
          // alone would pair with the wrong operations of the peers' batches.
          if (static_cast<int>(batch->ops.size()) < max_ops()) return append(*batch, batch, is_send, tensor, pe, timeout_s);
          refusal = Failure{PYDATACOPY_ERROR, message("too_many_queued")};
        }
        if (refusal) released = drop_locked(batch, *refusal);
      }
      if (refusal) raise(*refusal);
      launch(batch);  // on its own stream (a captured one that its capture left is refused there)
    }
    auto batch = t_batch = std::make_shared<Batch>(device_, stream, timeout_s, capturing);
    announce_thread();
    std::lock_guard<std::mutex> lock(batch->mutex);
    return append(*batch, batch, is_send, tensor, pe, timeout_s);
  }

  // A Work of the same batch as `work` whose result is `tensor` (all_to_all_single's output).
  static WorkPtr batch_work(const WorkPtr& work, const at::Tensor& tensor) {
    auto* p2p = dynamic_cast<P2PWork*>(work.get());
    if (p2p == nullptr) raise("pydatacopy: batch_work() takes a Work of this backend's queue");
    return c10::make_intrusive<P2PWork>(p2p->batch(), std::vector<at::Tensor>{tensor});
  }

  static WorkPtr done_work(std::vector<at::Tensor> result) { return c10::make_intrusive<DoneWork>(std::move(result)); }

  const std::shared_ptr<Device>& device() const { return device_; }

  static int max_ops() { return s_max_ops; }
  static int s_max_ops;
  static void (*s_set_thread_flush)(void (*)(void));  // the core's (init())

 private:
  // The core launches this thread's queue before a direct pydatacopy.send/recv (torch_backend_api.h):
  // said once per thread.
  static void announce_thread() {
    static thread_local bool announced = false;
    if (announced || s_set_thread_flush == nullptr) return;
    s_set_thread_flush(&flush_from_core);
    announced = true;
  }
  static void flush_from_core() noexcept {
    try {
      flush();  // a refusal stays in the batch, for its Works
    } catch (...) {
    }
  }

  // Called with the batch's lock held.
  static WorkPtr append(Batch& locked, const std::shared_ptr<Batch>& batch, bool is_send, const at::Tensor& tensor,
                        int pe, double timeout_s) {
    locked.ops.push_back({is_send ? 1 : 0, tensor.data_ptr(), static_cast<unsigned long long>(tensor.nbytes()), pe});
    locked.tensors.push_back(tensor);
    locked.storages.push_back(tensor.storage());
    if (timeout_s > locked.timeout_s) locked.timeout_s = timeout_s;
    return c10::make_intrusive<P2PWork>(batch, std::vector<at::Tensor>{tensor});
  }

  std::shared_ptr<Device> device_;
};
int Queue::s_max_ops = 0;  // init() sets the core's (pydatacopy._C.MAX_GROUP_OPS)
void (*Queue::s_set_thread_flush)(void (*)(void)) = nullptr;

// ---- the backend ------------------------------------------------------------------------------

// torch 2.14 added gather_into_tensor (and gather_single, which forwards to it) to c10d::Backend;
// 2.11 has neither. The override exists where the virtual does: a base layer chosen by a trait.
template <typename B, typename = void>
struct HasGatherIntoTensor : std::false_type {};
template <typename B>
struct HasGatherIntoTensor<B, std::void_t<decltype(&B::gather_into_tensor)>> : std::true_type {};

class DelegatingBackend : public c10d::Backend {
 public:
  using c10d::Backend::Backend;
  virtual WorkPtr delegate_collective(const char* method, at::Tensor& output, at::Tensor& input,
                                      const c10d::GatherOptions& opts) = 0;
};

template <typename Base, bool = HasGatherIntoTensor<c10d::Backend>::value>
struct WithGatherIntoTensor : Base {
  using Base::Base;
};
template <typename Base>
struct WithGatherIntoTensor<Base, true> : Base {
  using Base::Base;
  WorkPtr gather_into_tensor(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) override {
    return this->delegate_collective("gather_into_tensor", output, input, opts);
  }
};

class Backend final : public WithGatherIntoTensor<DelegatingBackend> {
 public:
  Backend(int rank, int size, std::vector<int> pes, double timeout_s, std::shared_ptr<Device> device,
          py::handle delegate)
      : WithGatherIntoTensor<DelegatingBackend>(rank, size),
        pes_(std::move(pes)),
        timeout_s_(timeout_s),
        queue_(std::move(device)),
        delegate_(delegate) {}

  const std::string getBackendName() const override { return "pydatacopy"; }

  // ---- point to point: the hot path, in C++ --------------------------------------------------
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    return p2p(true, tensors, dst_rank, tag);
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    return p2p(false, tensors, src_rank, tag);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return delegate("recv_anysource", tensors, tag);
  }

  // batch_isend_irecv: one launch at the end of the batch; the batch's Work also covers what the
  // Python group issued in it (CPU tensors, through gloo).
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {
    Queue::flush();  // (a batch left open is dropped there, not sent ahead of this one)
    t_coalescing = this;
    t_delegated.clear();
  }
  WorkPtr endCoalescing() override {
    std::vector<WorkPtr> parts;
    parts.swap(t_delegated);
    t_coalescing = nullptr;
    if (std::shared_ptr<Batch> batch = t_batch) {
      std::vector<at::Tensor> tensors;
      {
        std::lock_guard<std::mutex> lock(batch->mutex);  // (the launch lets the batch's go)
        tensors = batch->tensors;
      }
      launch(batch);  // a refusal is raised by the batch's Works, as for any launch
      parts.push_back(c10::make_intrusive<P2PWork>(batch, std::move(tensors)));
    }
    if (parts.empty()) return Queue::done_work({});
    if (parts.size() == 1) return parts[0];
    return c10::make_intrusive<AllOfWork>(std::move(parts));
  }

  // ---- the Python group's --------------------------------------------------------------------
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
                        std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) override {
    return collective("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts);
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override { return collective("barrier", opts); }

  void shutdown() override { Queue::flush(); }  // peers may be waiting for what this thread queued

  // TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend and compares this number across ranks before
  // each collective: the collectives this group was called for (every rank calls the same ones).
  void setSequenceNumberForGroup() override { sequence_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }

  void setTimeout(std::chrono::milliseconds timeout) override {
    // The Python group clamps it as the creator did (<= 0: the default; at most the core's
    // maximum); this group takes the value it kept.
    delegate("set_timeout", timeout);
    py::gil_scoped_acquire gil;
    timeout_s_.store(delegate_.get().attr("_timeout_s").cast<double>());
  }

  // ---- every other collective: the Python group's (gloo for CPU tensors; for CUDA ones, a
  // refusal that names what to use instead) --------------------------------------------------
#define PYDATACOPY_DELEGATE2(method, A, B) \
  WorkPtr method(A a, B b) override { return collective(#method, a, b); }
#define PYDATACOPY_DELEGATE3(method, A, B, C) \
  WorkPtr method(A a, B b, C c) override { return collective(#method, a, b, c); }
  PYDATACOPY_DELEGATE2(broadcast, std::vector<at::Tensor>&, const c10d::BroadcastOptions&)
  PYDATACOPY_DELEGATE2(allreduce, std::vector<at::Tensor>&, const c10d::AllreduceOptions&)
  PYDATACOPY_DELEGATE2(allreduce_sparse, std::vector<at::Tensor>&, const c10d::AllreduceOptions&)
  PYDATACOPY_DELEGATE2(allreduce_coalesced, std::vector<at::Tensor>&, const c10d::AllreduceCoalescedOptions&)
  PYDATACOPY_DELEGATE2(reduce, std::vector<at::Tensor>&, const c10d::ReduceOptions&)
  PYDATACOPY_DELEGATE3(allgather, std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                       const c10d::AllgatherOptions&)
  PYDATACOPY_DELEGATE3(_allgather_base, at::Tensor&, at::Tensor&, const c10d::AllgatherOptions&)
  PYDATACOPY_DELEGATE3(allgather_coalesced, std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                       const c10d::AllgatherOptions&)
  PYDATACOPY_DELEGATE3(allgather_into_tensor_coalesced, std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                       const c10d::AllgatherOptions&)
  PYDATACOPY_DELEGATE3(gather, std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                       const c10d::GatherOptions&)
  PYDATACOPY_DELEGATE3(scatter, std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                       const c10d::ScatterOptions&)
  PYDATACOPY_DELEGATE3(reduce_scatter, std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                       const c10d::ReduceScatterOptions&)
  PYDATACOPY_DELEGATE3(_reduce_scatter_base, at::Tensor&, at::Tensor&, const c10d::ReduceScatterOptions&)
  PYDATACOPY_DELEGATE3(reduce_scatter_tensor_coalesced, std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                       const c10d::ReduceScatterOptions&)
  PYDATACOPY_DELEGATE3(alltoall, std::vector<at::Tensor>&, std::vector<at::Tensor>&, const c10d::AllToAllOptions&)
#undef PYDATACOPY_DELEGATE2
#undef PYDATACOPY_DELEGATE3
  WorkPtr delegate_collective(const char* method, at::Tensor& output, at::Tensor& input,
                              const c10d::GatherOptions& opts) override {
    return collective(method, output, input, opts);
  }
  // A plain "pydatacopy" group's CPU side: gloo's (the Python group's), after this thread's queue.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    collective("monitored_barrier", opts.timeout, wait_all_ranks);
  }

  const std::vector<int>& pes() const { return pes_; }
  double timeout_s() const { return timeout_s_.load(); }

 private:
  // One contiguous tensor on this process's device, a peer in the group that is not this rank:
  // queued here; anything else goes to the delegate, whose checks raise the right refusal.
  bool fast(const std::vector<at::Tensor>& tensors, int peer) const {
    return tensors.size() == 1 && peer >= 0 && peer < static_cast<int>(pes_.size()) && peer != getRank() &&
           queue_.device()->accepts(tensors[0]) && tensors[0].is_contiguous();
  }

  // A send or recv: one contiguous tensor on this process's device to a peer of the group is
  // queued here; anything else goes to the delegate (CPU tensors: gloo; else its checks refuse).
  WorkPtr p2p(bool is_send, std::vector<at::Tensor>& tensors, int peer, int tag) {
    const bool in_batch = t_coalescing == this;
    try {
      if (fast(tensors, peer)) return queue_.queue(is_send, tensors[0], pes_[peer], timeout_s_.load());
      // Inside a batch the delegate sends CPU tensors without launching this thread's queue:
      // the batch's CUDA operations stay one launch.
      return coalesced(delegate(is_send ? (in_batch ? "send_in_batch" : "send") : (in_batch ? "recv_in_batch" : "recv"),
                                tensors, peer, tag));
    } catch (...) {
      if (in_batch) Queue::abandon_batch();  // the caller's batch raised: nothing of it is sent
      throw;
    }
  }

  template <typename... Args>
  WorkPtr delegate(const char* method, Args&&... args) {
    py::gil_scoped_acquire gil;
    py::object work = delegate_.get().attr(method)(std::forward<Args>(args)...);
    if (work.is_none()) return Queue::done_work({});
    return work.cast<WorkPtr>();
  }

  // A collective: counted (getSequenceNumberForGroup), then the delegate's (which flushes first).
  template <typename... Args>
  WorkPtr collective(const char* method, Args&&... args) {
    Queue::flush();  // (and a batch left open is dropped)
    ++sequence_;
    return delegate(method, std::forward<Args>(args)...);
  }

  WorkPtr coalesced(WorkPtr work) {
    if (t_coalescing == this) t_delegated.push_back(work);
    return work;
  }

  // The Python group's Works issued in this thread's coalesced batch (t_coalescing: which backend's).
  static thread_local std::vector<WorkPtr> t_delegated;

  std::vector<int> pes_;  // the group's ranks as PEs
  std::atomic<double> timeout_s_;
  std::atomic<uint64_t> sequence_{0};  // collectives called (getSequenceNumberForGroup)
  Queue queue_;
  PyRef delegate_;
};

thread_local std::vector<WorkPtr> Backend::t_delegated;

const pydatacopy_torch_backend_api* core_api(py::capsule api_capsule) {
  const auto* api = static_cast<const pydatacopy_torch_backend_api*>(
      PyCapsule_GetPointer(api_capsule.ptr(), PYDATACOPY_TORCH_BACKEND_API_CAPSULE));
  if (api == nullptr) throw py::error_already_set();
  if (api->version != PYDATACOPY_TORCH_BACKEND_API_VERSION)
    raise("pydatacopy.distributed: the backend extension was built for another pydatacopy._C (table version " +
          std::to_string(api->version) + ", expected " + std::to_string(PYDATACOPY_TORCH_BACKEND_API_VERSION) +
          "); remove its build cache (pydatacopy.distributed.native.cache_dir()) and import again");
  return api;
}

std::shared_ptr<Device> cuda_device(int index, py::capsule api_capsule) {
  return std::make_shared<CudaDevice>(index, core_api(api_capsule));
}

}  // namespace pydatacopy::torch_backend

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pydatacopy::torch_backend;
  m.doc() = "pydatacopy's torch.distributed backend (private: pydatacopy.distributed uses it)";
  m.def("init", [](py::object error, py::object timeout_error, std::map<std::string, std::string> messages,
                   int max_group_ops, py::capsule api) {
    g_error = error.release().ptr();  // module lifetime; first: core_api() raises through it
    g_timeout_error = timeout_error.release().ptr();
    g_messages = std::move(messages);
    Queue::s_max_ops = max_group_ops;
    Queue::s_set_thread_flush = core_api(api)->set_thread_flush;
  }, py::arg("error"), py::arg("timeout_error"), py::arg("messages"), py::arg("max_group_ops"), py::arg("api"));

  py::class_<Device, std::shared_ptr<Device>>(m, "Device");
  m.def("cuda_device", &cuda_device, py::arg("index"), py::arg("api"),
        "the device of this process (CUDA `index`), its core calls through _C's table");
  py::class_<FakeDevice, Device, std::shared_ptr<FakeDevice>>(m, "FakeDevice")
      .def(py::init<>())
      .def_property("stream", [](FakeDevice& d) { return d.stream_id.load(); },
                    [](FakeDevice& d, c10::StreamId id) { d.stream_id = id; })
      .def_property("capturing", [](FakeDevice& d) { return d.is_capturing.load(); },
                    [](FakeDevice& d, bool on) { d.is_capturing = on; })
      .def_property("done", [](FakeDevice& d) { return d.done.load(); }, [](FakeDevice& d, bool on) { d.done = on; })
      .def_property("cpu_is_cuda", [](FakeDevice& d) { return d.cpu_is_cuda.load(); },
                    [](FakeDevice& d, bool on) { d.cpu_is_cuda = on; })
      .def_property("fail_next_launch", [](FakeDevice& d) { std::lock_guard<std::mutex> l(d.mutex); return d.fail_next_launch; },
                    [](FakeDevice& d, std::string text) { std::lock_guard<std::mutex> l(d.mutex); d.fail_next_launch = std::move(text); })
      .def_property_readonly("launches", [](FakeDevice& d) { std::lock_guard<std::mutex> l(d.mutex); return d.launches; })
      .def_property_readonly("kept_alive", [](FakeDevice& d) { std::lock_guard<std::mutex> l(d.mutex); return d.kept_alive; })
      .def_property_readonly("blocked", [](FakeDevice& d) { std::lock_guard<std::mutex> l(d.mutex); return d.blocked; })
      .def_property_readonly("gil_at_launch", [](FakeDevice& d) { std::lock_guard<std::mutex> l(d.mutex); return d.gil_at_launch; });

  py::class_<Queue, std::shared_ptr<Queue>>(m, "Queue")
      .def(py::init<std::shared_ptr<Device>>(), py::arg("device"))
      .def_static("flush", &Queue::flush, py::call_guard<py::gil_scoped_release>())
      .def_static("discard", &Queue::discard)
      .def_static("set_group_open", [](bool open) { t_in_group = open; }, py::arg("open"))
      .def("queue", &Queue::queue, py::arg("is_send"), py::arg("tensor"), py::arg("pe"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_static("batch_work", &Queue::batch_work, py::arg("work"), py::arg("tensor"))
      .def_static("done_work", &Queue::done_work, py::arg("result") = std::vector<at::Tensor>{});

  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init([](int rank, int size, std::vector<int> pes, double timeout_s, std::shared_ptr<Device> device,
                       py::object delegate) {
             return c10::make_intrusive<Backend>(rank, size, std::move(pes), timeout_s, std::move(device), delegate);
           }),
           py::arg("rank"), py::arg("size"), py::arg("pes"), py::arg("timeout_s"), py::arg("device"),
           py::arg("delegate"))
      .def_property_readonly("pes", &Backend::pes, "the group's ranks as PEs")
      .def_property_readonly("timeout_s", &Backend::timeout_s, "the timeout of the group's calls");
}
