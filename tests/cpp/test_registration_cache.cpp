// The registration cache (registration_cache.hpp) against a fake driver and a fake NVSHMEM,
// without a GPU: what is registered, kept, rolled back and dropped, and every refusal an Error.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "pydatacopy/error.hpp"
#include "registration/registration_cache.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;

const void* at(std::uintptr_t address) { return reinterpret_cast<const void*>(address); }

// A driver that knows the allocations the test makes and frees, each with a fresh buffer ID,
// and an NVSHMEM that keeps a set of registrations and refuses overlapping ones, as the real
// one does. Failures and VMM memory are switched on per test.
class FakeBackend final : public pydatacopy::RegistrationBackend {
 public:
  struct Live {
    std::size_t bytes;
    unsigned long long id;
    bool vmm;
    bool managed;
  };
  std::map<std::uintptr_t, Live> allocations;
  std::map<std::uintptr_t, std::size_t> registered;  // what NVSHMEM holds
  int register_calls = 0, unregister_calls = 0;
  int fail_next_register = 0;    // a transport's failure status for the next register call
  int fail_next_unregister = 0;  // NVSHMEM's status for the next unregister call
  unsigned long long next_id = 1;

  void allocate(std::uintptr_t base, std::size_t bytes, bool vmm = false, bool managed = false) {
    allocations[base] = Live{bytes, next_id++, vmm, managed};
  }
  void release(std::uintptr_t base) { allocations.erase(base); }

  pydatacopy::Allocation query(const void* ptr) override {
    pydatacopy::Allocation a;
    a.queried = ptr;
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return a;
    --it;
    if (p >= it->first + it->second.bytes) return a;
    a.base = it->first;
    a.bytes = it->second.bytes;
    a.buffer_id = it->second.id;
    a.cuda_memory = true;
    a.managed = it->second.managed;
    return a;
  }
  bool mapped_through_vmm(const void* ptr) override {
    const auto a = query(ptr);
    return a.cuda_memory && allocations.at(a.base).vmm;
  }
  RegisterResult register_buffer(std::uintptr_t base, std::size_t bytes) override {
    ++register_calls;
    // As NVSHMEM 3.4.5 does: a range starting at or inside a registration is refused
    // (NVSHMEMX_ERROR_INVALID_VALUE); one starting below it is not looked at.
    for (const auto& [b, n] : registered)
      if (base >= b && base < b + n) return RegisterResult{7, true};
    if (fail_next_register != 0) {
      const int status = fail_next_register;
      fail_next_register = 0;
      registered[base] = bytes;  // one transport took it before another failed
      return RegisterResult{status, false};
    }
    registered[base] = bytes;
    return RegisterResult{0, false};
  }
  int unregister_buffer(std::uintptr_t base) override {
    ++unregister_calls;
    if (fail_next_unregister != 0) {
      const int status = fail_next_unregister;
      fail_next_unregister = 0;
      return status;
    }
    return registered.erase(base) == 1 ? 0 : 7;
  }
};

constexpr std::uintptr_t kA = 0x10000000, kB = 0x20000000;
constexpr std::size_t kMiB = 1 << 20;

void test_registers_whole_allocation_once() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, 4 * kMiB);
  check(!cache.is_ready(at(kA + 100), 10), "not ready before the first transfer");
  check(cache.prepare(at(kA + 100), 4096, true, "put"), "prepare registers");
  check(fake.registered.count(kA) == 1 && fake.registered[kA] == 4 * kMiB, "the whole allocation is registered");
  check(cache.prepare(at(kA + kMiB), kMiB, true, "put"), "another slice of it");
  check(fake.register_calls == 1, "one registration per allocation");
  check(cache.is_ready(at(kA), 4 * kMiB), "ready over the whole allocation");
  check(!cache.is_ready(at(kA + kMiB), 4 * kMiB), "not ready past its end");
  const auto s = cache.stats();
  check(s.registrations == 1 && s.live_entries == 1 && s.registered_bytes == 4 * kMiB, "stats count it");
}

void test_covers() {
  pydatacopy::Allocation a;
  a.base = kA;
  a.bytes = kMiB;
  check(!a.covers(at(kA), 1), "nothing is covered by memory CUDA does not know");
  a.cuda_memory = true;
  check(a.covers(at(kA), kMiB) && a.covers(at(kA + kMiB - 1), 1) && a.covers(at(kA + kMiB), 0),
        "covers up to the allocation's end");
  check(!a.covers(at(kA - 1), 2), "not below its base");
  check(!a.covers(at(kA + kMiB), 1) && !a.covers(at(kA + 1), kMiB), "not past its end");
  check(!a.covers(at(kA + 16), SIZE_MAX - 8), "a length that wraps the address space is not covered");
}

void test_refusals() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  check_throws([&] { cache.prepare(at(kB), 8, true, "put src"); }, "put src: 0x20000000 is not CUDA memory",
               "unknown memory refused, naming the operation");
  check_throws([&] { cache.prepare(at(kA + kMiB - 4), 8, true, "get dst"); }, "run past the end",
               "a range past its allocation refused");
  fake.allocate(kB, 64 * kMiB, /*vmm=*/true);
  check_throws([&] { cache.prepare(at(kB), 8, true, "send"); }, "expandable_segments",
               "VMM memory refused with the remedy");
  fake.allocate(kB + 128 * kMiB, kMiB, /*vmm=*/false, /*managed=*/true);
  check_throws([&] { cache.prepare(at(kB + 128 * kMiB), 8, true, "put src"); }, "managed memory",
               "managed memory refused by name");
  check(fake.register_calls == 0 && cache.stats().live_entries == 0, "nothing registered after refusals");
  check(!cache.prepare(at(kA), 8, false, "put"), "auto registration off: not prepared");
  check(fake.register_calls == 0, "auto registration off: nothing registered");
}

void test_failed_registration_rolled_back() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  fake.fail_next_register = 3;
  check_throws([&] { cache.prepare(at(kA), 8, true, "put"); }, "nvshmemx_buffer_register returned 3",
               "a failed registration raises with NVSHMEM's status");
  check(fake.registered.empty(), "a partial registration is rolled back");
  check(cache.stats().live_entries == 0, "no entry for a failed registration");
  check(cache.prepare(at(kA), 8, true, "put"), "the next try registers");
  check(fake.register_calls == 2, "registered on the second try");
}

void test_someone_elses_registration_kept() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  fake.registered[kA] = kMiB;  // other code in the process registered it
  check_throws([&] { cache.prepare(at(kA), 8, true, "put"); }, "registered already",
               "NVSHMEM refusing the address is reported");
  check(fake.registered.count(kA) == 1 && fake.unregister_calls == 0, "someone else's registration is left alone");
}

void test_freed_allocation_dropped() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, 2 * kMiB);
  check(cache.prepare(at(kA), 8, true, "put"), "first allocation registered");
  // Freed, and a new allocation at the same address (a new buffer ID): registered afresh.
  fake.release(kA);
  fake.allocate(kA, 2 * kMiB);
  check(!cache.is_ready(at(kA), 8), "a new allocation at an old address is not ready");
  check(cache.prepare(at(kA), 8, true, "put"), "the new allocation registered");
  check(fake.register_calls == 2 && fake.unregister_calls == 1, "old one unregistered, new one registered");
  // Freed, and a larger allocation starting below it that overlaps it.
  fake.release(kA);
  fake.allocate(kA - kMiB, 4 * kMiB);
  check(cache.prepare(at(kA - kMiB), 8, true, "put"), "an overlapping allocation registered");
  check(fake.registered.size() == 1 && fake.registered.count(kA - kMiB) == 1, "the overlapped entry dropped");
  // Freed, and a smaller one inside it, starting after its base.
  fake.release(kA - kMiB);
  fake.allocate(kA + kMiB, kMiB);
  check(cache.prepare(at(kA + kMiB), 8, true, "put"), "an allocation inside an old one registered");
  check(fake.registered.size() == 1 && fake.registered.count(kA + kMiB) == 1, "the enclosing entry dropped");
  const auto s = cache.stats();
  check(s.stale_dropped == 3 && s.live_entries == 1, "three stale entries dropped");
  // Neighbours are not stale: a second allocation beside the first.
  fake.allocate(kB, kMiB);
  check(cache.prepare(at(kB), 8, true, "put"), "a neighbour registered");
  check(cache.stats().live_entries == 2 && cache.stats().stale_dropped == 3, "a neighbour drops nothing");
}

void test_explicit_register_counted() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  cache.register_explicit(at(kA), 16);
  cache.register_explicit(at(kA + 64), 16);
  check(fake.register_calls == 1, "two register() calls, one registration");
  cache.unregister_explicit(at(kA));
  check(fake.registered.count(kA) == 1, "still registered after one of two unregister() calls");
  cache.unregister_explicit(at(kA));
  check(fake.registered.empty() && cache.stats().live_entries == 0, "unregistered after the second");
  check_throws([&] { cache.unregister_explicit(at(kA)); }, "was not registered with pydatacopy.register",
               "a third unregister() raises");
  // Registered by a transfer only: unregister() is not the caller's to make.
  check(cache.prepare(at(kA), 8, true, "put"), "registered by a transfer");
  check_throws([&] { cache.unregister_explicit(at(kA)); }, "was not registered", "unregister of a transfer's registration raises");
}

void test_used_registration_kept_on_unregister() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  cache.register_explicit(at(kA), 16);
  check(cache.prepare(at(kA), 16, false, "put"), "explicitly registered: ready with auto registration off");
  cache.unregister_explicit(at(kA));
  check(fake.registered.count(kA) == 1 && cache.is_ready(at(kA), 16),
        "a registration a transfer used stays after unregister()");
  // Its memory freed: the next explicit call lets it go.
  fake.release(kA);
  fake.allocate(kB, kMiB);
  cache.register_explicit(at(kB), 16);
  check(fake.registered.count(kA) == 0 && fake.registered.count(kB) == 1, "freed memory released by register()");
  fake.release(kB);
  cache.unregister_explicit(at(kB));  // freed since: no complaint
  check(fake.registered.empty() && cache.stats().live_entries == 0, "unregister() of freed memory releases it");
}

void test_failed_unregister_reported() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  cache.register_explicit(at(kA), 8);
  fake.fail_next_unregister = 5;
  check_throws([&] { cache.unregister_explicit(at(kA)); }, "nvshmemx_buffer_unregister failed with NVSHMEM status 5",
               "a failed unregistration raises with NVSHMEM's status");
  check(cache.stats().live_entries == 0, "and the entry is gone: a retry could not succeed either");
}

void test_unreused_freed_memory_swept() {
  // cudaMallocAsync-like: allocations freed at addresses nothing reuses. A new registration
  // sweeps once the cache holds kFirstSweep entries.
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  const std::size_t n = pydatacopy::RegistrationCache::kFirstSweep;
  for (std::size_t i = 0; i < n; ++i) {
    fake.allocate(kA + i * kMiB, kMiB);
    cache.prepare(at(kA + i * kMiB), 8, true, "put");
  }
  check(cache.stats().live_entries == n && cache.stats().stale_dropped == 0, "no sweep below the threshold");
  for (std::size_t i = 0; i + 1 < n; ++i) fake.release(kA + i * kMiB);
  fake.allocate(kB, kMiB);
  cache.prepare(at(kB), 8, true, "put");
  const auto s = cache.stats();
  check(s.stale_dropped == n - 1 && s.live_entries == 2, "a new registration sweeps the freed ones");
  check(fake.registered.size() == 2, "and NVSHMEM holds only the live two");
}

void test_clear() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  fake.allocate(kA, kMiB);
  fake.allocate(kB, kMiB);
  cache.prepare(at(kA), 8, true, "put");
  cache.register_explicit(at(kB), 8);
  cache.clear();
  check(fake.registered.empty() && cache.stats().live_entries == 0, "clear() unregisters everything");
}

void test_threads() {
  FakeBackend fake;
  pydatacopy::RegistrationCache cache(fake);
  for (int i = 0; i < 8; ++i) fake.allocate(kA + i * 4 * kMiB, 4 * kMiB);
  // The fake's maps are only read here (registration writes them under the cache's mutex).
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      try {
        for (int round = 0; round < 200; ++round)
          for (int i = 0; i < 8; ++i) ok[t] += cache.prepare(at(kA + i * 4 * kMiB + round), 64, true, "put");
      } catch (const std::exception& e) {
        std::printf("  thread %d: %s\n", t, e.what());
        ok[t] = -1;
      }
    });
  for (auto& thread : threads) thread.join();
  check(ok == std::vector<int>(4, 1600), "every concurrent prepare succeeds");
  check(fake.register_calls == 8 && cache.stats().live_entries == 8, "each allocation registered once across threads");
}

}  // namespace

int main() {
  test_covers();
  test_registers_whole_allocation_once();
  test_refusals();
  test_failed_registration_rolled_back();
  test_someone_elses_registration_kept();
  test_freed_allocation_dropped();
  test_explicit_register_counted();
  test_used_registration_kept_on_unregister();
  test_failed_unregister_reported();
  test_unreused_freed_memory_swept();
  test_clear();
  test_threads();
  std::printf("registration cache: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed == 0 ? 0 : 1;
}
