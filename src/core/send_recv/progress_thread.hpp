// A thread that keeps calling one function until it is stopped: zero-copy's progress thread
// (PYDATACOPY_ZERO_COPY_PROGRESS), which serves the peers' mapping requests between this
// process's own calls, so that a receive buffer's mapping does not wait for the sender's next
// send/recv (issue 36). Plain C++: tested without a GPU (tests/cpp/test_progress_thread.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <sys/types.h>
#include <unistd.h>

namespace pydatacopy::zero_copy {

class ProgressThread {
 public:
  // `serve` returns whether it did anything; the next call comes after `busy` when it did, else
  // after `idle` (a thread that polls an empty mailbox costs almost nothing). `on_start` runs once
  // on the thread first (the CUDA device of the engine).
  ProgressThread(std::function<bool()> serve, std::chrono::microseconds busy, std::chrono::microseconds idle,
                 std::function<void()> on_start = {});
  ~ProgressThread();  // stop()
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Ends the thread and joins it: bounded by one call of `serve`, never by a peer. Idempotent. In a
  // process forked from the one that started it (no such thread there, and its lock may have been
  // held at the fork), it lets the thread object go without locking or joining.
  void stop();
  // Calls of `serve` so far, and those that did something (tests, the doctor).
  uint64_t rounds() const { return rounds_.load(std::memory_order_relaxed); }
  uint64_t busy_rounds() const { return busy_rounds_.load(std::memory_order_relaxed); }
  // What ended the thread early ("" if nothing did): an exception of `serve` or `on_start`, kept
  // here (also after stop()) since a library thread must not end the process.
  std::string failure();

 private:
  void run(std::function<bool()> serve, std::function<void()> on_start);

  const std::chrono::microseconds busy_, idle_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;  // under mutex_
  std::string failure_;    // under mutex_
  std::atomic<uint64_t> rounds_{0}, busy_rounds_{0};
  const pid_t owner_ = getpid();  // the process the thread runs in
  // Last: started once every member above exists. On the heap, so that a forked child can let it go.
  std::unique_ptr<std::thread> thread_;
};

}  // namespace pydatacopy::zero_copy
