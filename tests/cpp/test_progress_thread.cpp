// zero_copy::ProgressThread (PYDATACOPY_ZERO_COPY_PROGRESS) without a GPU: its rounds, its stop, a
// failure that ends the thread and not the process, and the handshake it exists for: a receiver's
// second call that waits once for the answer the sender's thread gives between the sender's own
// calls (the engine's lock taken only when free, as SendRecvEngine::serve_zero_copy_progress does).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.hpp"
#include "send_recv/progress_thread.hpp"
#include "send_recv/zero_copy.hpp"

namespace {

using pydatacopy_test::check;
namespace zc = pydatacopy::zero_copy;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

void test_it_serves_until_stopped() {
  std::atomic<int> calls{0};
  std::atomic<bool> started_first{false};
  std::atomic<std::thread::id> on_start_thread{}, serve_thread{};
  zc::ProgressThread progress(
      [&] {
        serve_thread = std::this_thread::get_id();
        started_first = started_first || calls == 0;
        ++calls;
        return false;
      },
      100us, 1ms, [&] { on_start_thread = std::this_thread::get_id(); });
  const auto until = Clock::now() + 30s;  // a liveness bound, not a timing: rounds come every 1 ms
  while (calls < 5 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  check(calls >= 5, "serve is called again and again");
  progress.stop();  // joins: a thread that did not stop would hang the test here
  const int after = calls;
  std::this_thread::sleep_for(20ms);
  check(calls == after, "no call after stop()");
  check(on_start_thread.load() == serve_thread.load() && on_start_thread.load() != std::this_thread::get_id(),
        "on_start runs on the thread itself");
  check(progress.rounds() == static_cast<uint64_t>(after) && progress.busy_rounds() == 0, "rounds counted");
  progress.stop();  // idempotent
  check(progress.failure().empty(), "no failure");
}

void test_a_failure_ends_the_thread_not_the_process() {
  std::atomic<int> calls{0};
  zc::ProgressThread progress(
      [&]() -> bool {
        ++calls;
        throw std::runtime_error("the mailbox broke");
      },
      100us, 100us);
  const auto until = Clock::now() + 30s;  // liveness only
  while (progress.failure().empty() && Clock::now() < until) std::this_thread::sleep_for(1ms);
  check(progress.failure() == "the mailbox broke", "the failure is kept for whoever asks");
  std::this_thread::sleep_for(10ms);
  check(calls == 1, "the thread ended at its failure");
  progress.stop();
}

// A process forked while the thread runs has no such thread: stop() (the engine's destructor at the
// child's exit) must return there, not join what does not exist. (Not under ThreadSanitizer, which
// does not support a fork of a process with threads.)
void test_a_forked_child_lets_the_thread_go() {
#if defined(__SANITIZE_THREAD__)
  std::printf("note: the fork test is skipped under ThreadSanitizer\n");
#else
  zc::ProgressThread progress([] { return false; }, 100us, 1ms);
  const pid_t child = fork();
  if (child == 0) {
    progress.stop();
    _exit(0);
  }
  check(child > 0, "fork");
  int status = -1;
  const auto until = Clock::now() + 30s;  // liveness only: a child that hangs in stop() is killed
  while (child > 0 && waitpid(child, &status, WNOHANG) == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
  if (child > 0 && Clock::now() >= until) kill(child, SIGKILL), waitpid(child, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's stop() returned and it exited");
  progress.stop();
#endif
}

// A fake CUDA for one sender/receiver pair (as test_zero_copy.cpp's, smaller): every allocation
// exports, every open succeeds after `open_delay`.
class FakeCuda final : public zc::Backend {
 public:
  std::map<std::uintptr_t, std::size_t> allocations;
  std::chrono::microseconds open_delay{0};
  std::atomic<int> opens{0};
  pydatacopy::Allocation query(const void* ptr) override {
    pydatacopy::Allocation a;
    a.queried = ptr;
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    for (const auto& [base, bytes] : allocations)
      if (p >= base && p < base + bytes) a.base = base, a.bytes = bytes, a.buffer_id = base, a.cuda_memory = true;
    return a;
  }
  bool export_handle(std::uintptr_t base, zc::IpcHandle* handle) override {
    std::memset(handle->bytes, 0, sizeof(handle->bytes));
    std::memcpy(handle->bytes, &base, sizeof(base));
    return true;
  }
  void* open_handle(const zc::IpcHandle& handle) override {
    std::this_thread::sleep_for(open_delay);
    ++opens;
    std::uintptr_t base = 0;
    std::memcpy(&base, handle.bytes, sizeof(base));
    return reinterpret_cast<void*>(base + (std::uintptr_t{1} << 40));
  }
  void close_handle(void*) override {}
  bool channel_idle(bool, int) override { return true; }
};

// The receiver's calls on this thread; the sender's process as a progress thread that serves its
// importer when the sender's "engine lock" is free. The receiver's second call waits (once, as
// batch.cpp's decide_recv_mode; 20 ms there, a liveness bound here, so that a slow machine does not
// fail a test of the protocol) and then moves zero-copy.
void test_the_second_call_moves_once() {
  FakeCuda receiver_cuda, sender_cuda;
  receiver_cuda.allocations[0x10000000] = 64 << 20;
  sender_cuda.open_delay = 1ms;  // an IPC open's time, about
  auto mailbox = std::make_unique<zc::Mailbox>();
  std::memset(static_cast<void*>(mailbox.get()), 0, sizeof(zc::Mailbox));
  uint64_t table[zc::kTableEntries] = {};
  zc::Exporter exporter(receiver_cuda, mailbox.get(), 1);
  zc::Importer importer(sender_cuda, mailbox.get(), 0, table);
  std::mutex sender_lock;
  zc::ProgressThread progress(
      [&] {
        std::unique_lock<std::mutex> lock(sender_lock, std::try_to_lock);
        if (!lock.owns_lock()) return false;
        const uint64_t before = importer.stats().opened;
        importer.drain();
        return importer.stats().opened != before;
      },
      100us, 1ms);
  const void* dst = reinterpret_cast<const void*>(0x10000000 + 4096);
  zc::Exporter::Decision d;
  {
    // The sender is busy in its own call meanwhile: its thread tries the lock, never blocks on
    // it, and cannot answer before the receiver's second call has decided to wait.
    std::lock_guard<std::mutex> busy(sender_lock);
    exporter.begin_call();
    check(!exporter.prepare(dst, 1 << 20, false).zero_copy, "the first call: staged, the mapping asked for");
    exporter.begin_call();
    d = exporter.prepare(dst, 1 << 20, false);
    check(!d.zero_copy, "the second call, before any answer: staged");
  }
  const bool waits = exporter.claim_wait(dst);
  check(waits, "the second call waits for the answer (once)");
  if (waits) {
    const auto deadline = Clock::now() + 30s;
    while (Clock::now() < deadline && !exporter.acked(dst) && exporter.awaiting(dst)) std::this_thread::sleep_for(50us);
    d = exporter.prepare(dst, 1 << 20, false);
  }
  check(d.zero_copy, "the second call moves zero-copy: the sender's thread answered between its calls");
  check(d.index >= 0 && table[d.index] != 0, "at the index the sender's table holds");
  check(sender_cuda.opens == 1, "opened once");
  progress.stop();
  check(progress.busy_rounds() >= 1, "the round that opened it counted as busy");
}

}  // namespace

int main() {
  test_it_serves_until_stopped();
  test_a_failure_ends_the_thread_not_the_process();
  test_a_forked_child_lets_the_thread_go();
  test_the_second_call_moves_once();
  std::printf("test_progress_thread: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
