#include "send_recv/progress_thread.hpp"

#include <exception>
#include <string>
#include <utility>

namespace pydatacopy::zero_copy {

ProgressThread::ProgressThread(std::function<bool()> serve, std::chrono::microseconds busy,
                               std::chrono::microseconds idle, std::function<void()> on_start)
    : busy_(busy),
      idle_(idle),
      thread_(std::make_unique<std::thread>(&ProgressThread::run, this, std::move(serve), std::move(on_start))) {}

ProgressThread::~ProgressThread() { stop(); }

void ProgressThread::stop() {
  if (thread_ == nullptr) return;
  if (getpid() != owner_) {  // a forked child: the thread does not exist here
    static_cast<void>(thread_.release());  // never joined, never destroyed (std::terminate)
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_->get_id() == std::this_thread::get_id())
    thread_->detach();  // stopped from its own round: it ends when that round returns
  else if (thread_->joinable())
    thread_->join();
  thread_.reset();
}

void ProgressThread::run(std::function<bool()> serve, std::function<void()> on_start) {
  // A library thread must not end the process: what `on_start` or `serve` throws ends the
  // thread only (the calls of the engine serve the mailboxes as before).
  try {
    if (on_start) on_start();
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      lock.unlock();
      const bool worked = serve();
      rounds_.fetch_add(1, std::memory_order_relaxed);
      if (worked) busy_rounds_.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
      wake_.wait_for(lock, worked ? busy_ : idle_, [this] { return stopping_; });
    }
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = error.what();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = "an exception that is not a std::exception";
  }
}

std::string ProgressThread::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

}  // namespace pydatacopy::zero_copy
