// The engines' own locks, without Python and without a GPU: threads racing init / cleanup / the
// hot calls on one SendRecvEngine (and exchange / wait on one DoubleBufferManager) before NVSHMEM
// is initialised each get pydatacopy::Error or the documented quiet return, never a crash, a
// std::terminate or a deadlock (a public method that called another under the engine's lock
// would hang here: the watchdog fails the test). Built with ThreadSanitizer the same test shows
// the engine's state is only touched under its lock (cleanup() swaps the state out even of an
// engine never set up).
//
// What needs NVSHMEM, and so is left to the GPU suite (tests/test_send_recv*.py): init() refused
// on an engine already set up, and the race's losing branch (two inits both build an engine;
// the second to swap its state in cleans it up, collectively, and throws "initialised by another
// thread meanwhile"). Here every init() fails in its collective part, on a fresh state that no
// other thread sees, and the engine is left as it was.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.hpp"
#include "pydatacopy/double_buffer_manager.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/send_recv.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;

// Outcomes of the threads, counted (check() itself is not thread-safe).
std::atomic<int> g_unexpected{0};
std::mutex g_print_mutex;

void unexpected(const char* what, const std::string& detail) {
  ++g_unexpected;
  std::lock_guard<std::mutex> lock(g_print_mutex);
  std::printf("FAILED (thread): %s: %s\n", what, detail.c_str());
}

// `call` must throw pydatacopy::Error whose text holds `words`.
template <typename Call>
void expect_error(const char* what, const char* words, Call&& call) {
  try {
    call();
  } catch (const pydatacopy::Error& e) {
    if (std::string(e.what()).find(words) == std::string::npos) unexpected(what, e.what());
    return;
  } catch (const std::exception& e) {
    return unexpected(what, std::string("not a pydatacopy::Error: ") + e.what());
  } catch (...) {
    return unexpected(what, "an unknown exception");
  }
  unexpected(what, "returned");
}

// `call` must return without throwing.
template <typename Call>
void expect_quiet(const char* what, Call&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    unexpected(what, e.what());
  } catch (...) {
    unexpected(what, "an unknown exception");
  }
}

constexpr const char* kNeedsInit = "call pydatacopy.init";

// One thread's share of the race on `engine`: every public method, `rounds` times.
void race_engine(pydatacopy::SendRecvEngine& engine, int seed, int rounds) {
  using pydatacopy::SendRecvEngine;
  char buffer[64] = {};
  for (int i = 0; i < rounds; ++i) {
    switch ((i + seed) % 8) {
      case 0:
        expect_error("init", kNeedsInit, [&] { engine.init(1 << 20, 4, 8); });
        break;
      case 1:
        expect_quiet("cleanup", [&] { engine.cleanup(); });  // harmless when not set up
        break;
      case 2:
        expect_error("send", kNeedsInit, [&] { engine.send(buffer, 8, 0, nullptr, 1.0); });
        expect_error("recv", kNeedsInit, [&] { engine.recv(buffer, 8, 0, nullptr, 1.0); });
        break;
      case 3:
        expect_error("sendrecv", kNeedsInit,
                     [&] { engine.sendrecv(buffer, 8, 0, buffer + 8, 8, 0, nullptr, 1.0); });
        expect_error("batch", kNeedsInit, [&] {
          engine.batch({{true, buffer, 8, 0}, {false, buffer + 8, 8, 0}}, nullptr, 1.0);
        });
        break;
      case 4:
        expect_quiet("check_refusals", [&] { engine.check_refusals(); });
        expect_quiet("service_zero_copy", [&] { engine.service_zero_copy(); });
        break;
      case 5:
        expect_error("zero_copy_counters", "not set up", [&] { engine.zero_copy_counters(); });
        expect_error("slices_for", "not set up", [&] { engine.slices_for(4096); });
        break;
      case 6:
        expect_error("set_zero_copy_min_bytes", kNeedsInit, [&] { engine.set_zero_copy_min_bytes(1 << 20); });
        break;
      default:
        expect_quiet("accessors", [&] {
          if (engine.initialized() || engine.chunk_bytes() != 0 || engine.num_chunks() != 0 ||
              engine.blocks() != 0 || engine.symmetric_bytes() != 0 || engine.max_grid() != 1 ||
              engine.zero_copy_min_bytes() != 0)
            unexpected("accessors", "an engine never set up shows state");
        });
        break;
    }
  }
}

void race_manager(pydatacopy::DoubleBufferManager& manager, int seed, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    switch ((i + seed) % 3) {
      case 0:
        expect_error("exchange", kNeedsInit, [&] { manager.exchange(0, 0, nullptr, 1.0); });
        break;
      case 1:
        expect_error("wait", kNeedsInit, [&] { manager.wait(0, 0, nullptr, 1.0); });
        break;
      default:
        expect_quiet("manager accessors", [&] {
          if (manager.round() != 0 || manager.last_waited_round() != -1)
            unexpected("manager accessors", "a manager never set up shows rounds");
        });
        break;
    }
  }
}

// Runs `body(seed)` on `threads` threads at once. Not done within `seconds`: a deadlock, and the
// process exits at once with a failure (the threads may hold the engine's lock: nothing may
// touch the engine, nor destroy it, any more).
template <typename Body>
void run_threads(const char* what, int threads, double seconds, Body body) {
  std::atomic<int> done{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      body(t);
      ++done;
    });
  go = true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (done.load() < threads && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (done.load() < threads) {
    std::printf("FAILED: %s: not done after %.0f s (a deadlock)\n", what, seconds);
    std::fflush(stdout);
    std::_Exit(1);
  }
  for (std::thread& thread : pool) thread.join();
}

}  // namespace

int main() {
  using namespace pydatacopy;
  // One thread first: what each call does on an engine never set up, and after a failed init.
  {
    SendRecvEngine engine;
    check_throws([&] { engine.init(1 << 20, 4, 8); }, kNeedsInit, "init before NVSHMEM");
    check(!engine.initialized(), "a failed init leaves the engine not set up");
    // Not "already initialised": the failed attempt built its state aside, never in the engine.
    check_throws([&] { engine.init(1 << 20, 4, 8); }, kNeedsInit, "init again: the same refusal");
    engine.cleanup();
    engine.cleanup();  // harmless twice
    check_throws([&] { engine.set_zero_copy_min_bytes(0); }, kNeedsInit, "the threshold's vote needs NVSHMEM");
    check(engine.zero_copy_min_bytes() == 0, "a refused vote changes nothing");
    engine.set_zero_copy_min_bytes_agreed(1 << 20);  // the local half alone
    check(engine.zero_copy_min_bytes() == std::size_t{1} << 20, "the agreed threshold is stored");
    SendRecvEngine moved(std::move(engine));  // takes the state, not the lock
    check(moved.zero_copy_min_bytes() == std::size_t{1} << 20 && engine.zero_copy_min_bytes() == 0,
          "a move takes the state and leaves the source empty");
    check_throws([&] { moved.send(nullptr, 8, 0, nullptr, 1.0); }, kNeedsInit, "the moved-to engine's lock works");
    check_throws([&] { engine.send(nullptr, 8, 0, nullptr, 1.0); }, kNeedsInit, "the moved-from engine's lock works");
    DoubleBufferManager manager;
    check_throws([&] { manager.wait(0, 0, nullptr, 1.0, true); }, "", "a blocking wait before NVSHMEM throws");
    check(manager.round() == 0 && manager.last_waited_round() == -1, "a refused wait changes no round");
  }
  // Then threads racing every call on one engine, and on one manager.
  constexpr int kThreads = 8, kRounds = 4000;
  constexpr double kSeconds = 60;  // well under a second without sanitizers
  {
    SendRecvEngine engine;
    run_threads("threads racing one SendRecvEngine", kThreads, kSeconds,
                [&](int seed) { race_engine(engine, seed, kRounds); });
    check(g_unexpected.load() == 0, "every racing SendRecvEngine call threw pydatacopy::Error or returned quietly");
    check(!engine.initialized(), "the raced engine is still not set up");
  }
  {
    const int before = g_unexpected.load();
    DoubleBufferManager manager;
    run_threads("threads racing one DoubleBufferManager", kThreads, kSeconds,
                [&](int seed) { race_manager(manager, seed, kRounds); });
    check(g_unexpected.load() == before, "every racing DoubleBufferManager call threw pydatacopy::Error or returned");
  }
  std::printf("test_engine_lock: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
