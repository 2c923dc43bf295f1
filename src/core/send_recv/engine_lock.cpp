// SendRecvEngine's public entry points: each takes the engine's lock around the unlocked part in
// send_recv.cpp, and the collective init() and cleanup() hold it only to check and swap the
// state in or out, never across their barriers (send_recv.hpp: the class comment).
#include "pydatacopy/send_recv.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "pydatacopy/error.hpp"
#include "send_recv/progress_thread.hpp"
#include "send_recv/zero_copy_state.hpp"

namespace pydatacopy {

using Lock = std::lock_guard<std::mutex>;

// The progress thread's pace (PYDATACOPY_ZERO_COPY_PROGRESS): 100 us between rounds while requests
// come, 1 ms while the mailboxes are empty (an open takes 0.4-1.4 ms on an H200: the wait of a
// recv's second call, 20 ms at most, covers both).
constexpr std::chrono::microseconds kProgressBusy{100}, kProgressIdle{1000};

void SendRecvEngine::init(std::size_t chunk_bytes, int num_chunks, int blocks) {
  {
    Lock lock(mutex_);
    PDC_REQUIRE(base_ == nullptr, "SendRecvEngine.init: already initialised; call cleanup() first");
  }
  int device = -1;  // the progress thread's (asked here: nothing may throw once the state is in)
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError(), device = -1;
  SendRecvEngine fresh;  // built (collectively) outside the lock, seen by no other thread
  fresh.build(chunk_bytes, num_chunks, blocks);
  bool lost = false;  // another thread's init won the race
  {
    Lock lock(mutex_);
    if (base_ != nullptr) {
      lost = true;
    } else {
      swap_state(fresh);
      // PYDATACOPY_ZERO_COPY_PROGRESS, voted by every PE at build(). The state is in and this PE's
      // peers have theirs: a thread that cannot start leaves this PE without it (its recvs wait for
      // no answer: staged, as before), never an exception here.
      zero_copy_progress_on_ = false;
      if (zero_copy_progress_wanted_ && zero_copy_ != nullptr && device >= 0 && zero_copy_progress_ == nullptr) {
        try {
          // Its first round finds the lock held (here) and waits its turn; cleanup() stops it.
          zero_copy_progress_ = std::make_unique<zero_copy::ProgressThread>(
              [this] { return serve_zero_copy_progress(); }, kProgressBusy, kProgressIdle,
              [device] { PDC_CHECK_CUDA(cudaSetDevice(device)); });
          zero_copy_progress_on_ = true;
        } catch (const std::exception&) {
          zero_copy_progress_.reset();
        }
      }
    }
  }
  if (lost) {
    fresh.release();  // collective, like the init every PE made; outside the lock
    PDC_REQUIRE(false, "SendRecvEngine.init: initialised by another thread meanwhile; call cleanup() first");
  }
}

void SendRecvEngine::cleanup() {
  std::unique_ptr<zero_copy::ProgressThread> progress;
  SendRecvEngine old = [this, &progress] {
    Lock lock(mutex_);
    progress = std::move(zero_copy_progress_);
    zero_copy_progress_on_ = false;
    return detach();
  }();
  progress.reset();  // joined outside the lock: its round takes the lock only when free
  old.release();  // collective (barrier, symmetric free) outside the lock
}

bool SendRecvEngine::initialized() const {
  Lock lock(mutex_);
  return base_ != nullptr;
}

std::size_t SendRecvEngine::chunk_bytes() const {
  Lock lock(mutex_);
  return chunk_bytes_;
}

int SendRecvEngine::num_chunks() const {
  Lock lock(mutex_);
  return num_chunks_;
}

int SendRecvEngine::blocks() const {
  Lock lock(mutex_);
  return blocks_;
}

int SendRecvEngine::narrow_blocks() const {
  Lock lock(mutex_);
  return narrow_blocks_;
}

int SendRecvEngine::max_grid() const {
  Lock lock(mutex_);
  return resident_blocks_;
}

int SendRecvEngine::slices_for(std::size_t bytes) const {
  Lock lock(mutex_);
  PDC_REQUIRE(base_ != nullptr, "slices_for: the send/recv engine is not set up (call init first)");
  return active_blocks(bytes);
}

std::size_t SendRecvEngine::symmetric_bytes() const {
  Lock lock(mutex_);
  return symmetric_bytes_;
}

void SendRecvEngine::send(const void* src, std::size_t bytes, int dst_pe, cudaStream_t stream,
                          double timeout_seconds) {
  Lock lock(mutex_);
  batch_locked({{true, const_cast<void*>(src), bytes, dst_pe}}, stream, timeout_seconds);
}

void SendRecvEngine::recv(void* dst, std::size_t bytes, int src_pe, cudaStream_t stream,
                          double timeout_seconds) {
  Lock lock(mutex_);
  batch_locked({{false, dst, bytes, src_pe}}, stream, timeout_seconds);
}

void SendRecvEngine::sendrecv(const void* src, std::size_t send_bytes, int dst_pe, void* dst,
                              std::size_t recv_bytes, int src_pe, cudaStream_t stream,
                              double timeout_seconds) {
  const std::vector<Operation> ops = {{true, const_cast<void*>(src), send_bytes, dst_pe},
                                      {false, dst, recv_bytes, src_pe}};
  Lock lock(mutex_);
  batch_locked(ops, stream, timeout_seconds);
}

void SendRecvEngine::batch(const std::vector<Operation>& ops, cudaStream_t stream, double timeout_seconds) {
  Lock lock(mutex_);
  batch_locked(ops, stream, timeout_seconds);
}

void SendRecvEngine::set_host_phases(bool on) {
  Lock lock(mutex_);
  host_phases_on_ = on;
  host_phase_calls_ = 0;
  std::fill(std::begin(host_phase_ns_), std::end(host_phase_ns_), 0);
}

std::vector<uint64_t> SendRecvEngine::host_phases() {
  Lock lock(mutex_);
  std::vector<uint64_t> out{host_phase_calls_};
  out.insert(out.end(), std::begin(host_phase_ns_), std::end(host_phase_ns_));
  host_phase_calls_ = 0;
  std::fill(std::begin(host_phase_ns_), std::end(host_phase_ns_), 0);
  return out;
}

void SendRecvEngine::check_refusals() {
  Lock lock(mutex_);
  check_refusals_locked();
}

std::size_t SendRecvEngine::zero_copy_min_bytes() const {
  Lock lock(mutex_);
  return zero_copy_min_bytes_;
}

void SendRecvEngine::set_zero_copy_min_bytes(std::size_t bytes) {
  agree_zero_copy_min_bytes(bytes);  // a blocking barrier: outside the lock (a peer's transfer may need it)
  set_zero_copy_min_bytes_agreed(bytes);
}

void SendRecvEngine::set_zero_copy_min_bytes_agreed(std::size_t bytes) {
  Lock lock(mutex_);
  zero_copy_min_bytes_ = bytes;
}

std::size_t SendRecvEngine::low_latency_max_bytes() const {
  Lock lock(mutex_);
  return low_latency_max_bytes_;
}

void SendRecvEngine::set_low_latency_max_bytes(std::size_t bytes) {
  agree_low_latency_max_bytes(bytes, "");  // a blocking barrier: outside the lock, as above
  Lock lock(mutex_);
  low_latency_max_bytes_ = bytes;
}

void SendRecvEngine::set_zero_copy_wait_seconds(double seconds) {
  PDC_REQUIRE(seconds >= 0 && seconds <= 3600, "set_zero_copy_wait_seconds: " << seconds
                                                                              << " s is not between 0 and 3600");
  Lock lock(mutex_);
  zero_copy_wait_seconds_ = seconds;
}

void SendRecvEngine::service_zero_copy() {
  Lock lock(mutex_);
  if (base_ != nullptr) service_zero_copy_locked();
}

std::vector<uint64_t> SendRecvEngine::zero_copy_counters() {
  Lock lock(mutex_);
  return zero_copy_counters_locked();
}

std::vector<SendRecvEngine::PeerStats> SendRecvEngine::stats() {
  Lock lock(mutex_);
  return peer_stats_locked();
}

std::size_t SendRecvEngine::copy_engine_min_bytes() const {
  Lock lock(mutex_);
  return copy_engine_min_bytes_;
}

void SendRecvEngine::set_copy_engine_min_bytes(std::size_t bytes) {
  Lock lock(mutex_);
  PDC_REQUIRE(base_ != nullptr, "set_copy_engine_min_bytes: the send/recv engine is not set up");
  copy_engine_min_bytes_ = bytes;
}

std::string SendRecvEngine::copy_engine_status() {
  Lock lock(mutex_);
  if (base_ == nullptr) return "off: the send/recv engine is not set up";
  if (copy_engine_min_bytes_ == 0) return "off: PYDATACOPY_COPY_ENGINE_MIN_BYTES=0";
  if (zero_copy_min_bytes_ == 0) return "off: zero-copy is off (PYDATACOPY_ZERO_COPY_MIN_BYTES=0)";
  if (zero_copy_ != nullptr && !zero_copy_->copy_engine_off.empty())
    return "off: CUDA refused its graph (" + zero_copy_->copy_engine_off + ")";
  return "on from " + std::to_string(copy_engine_min_bytes_) + " bytes";
}

}  // namespace pydatacopy
