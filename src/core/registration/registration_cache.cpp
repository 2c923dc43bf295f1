#include "registration/registration_cache.hpp"

#include <algorithm>
#include <iterator>
#include <vector>

#include "pydatacopy/error.hpp"

namespace pydatacopy {
namespace {

bool same_allocation(std::uintptr_t base, std::size_t bytes, unsigned long long buffer_id,
                     const Allocation& a) {
  return base == a.base && bytes == a.bytes && buffer_id == a.buffer_id;
}

}  // namespace

Allocation RegistrationCache::require_cuda_memory(const void* ptr, std::size_t bytes, const char* what) {
  const Allocation a = backend_.query(ptr);
  PDC_REQUIRE(!a.managed, what << ": " << ptr << " is managed memory (cudaMallocManaged), which "
                                  "NVSHMEM cannot register for its remote transports: use device "
                                  "memory (a torch CUDA tensor) or a symmetric tensor (pydatacopy.empty)");
  PDC_REQUIRE(a.cuda_memory, what << ": " << ptr << " is not CUDA memory (pageable host memory?): "
                                     "NVSHMEM can only use device memory or pinned host memory");
  PDC_REQUIRE(a.covers(ptr, bytes), what << ": " << bytes << " bytes at " << ptr
                                         << " run past the end of their CUDA allocation");
  return a;
}

// Caller holds the mutex. Unregisters and drops entries whose allocation is gone: those
// overlapping `a` without being it (live allocations never overlap), or with `a` null every
// entry whose base no longer starts the same allocation. No synchronisation here: a
// device-wide one would wait on kernels that wait on a peer (a recv whose sender sits behind
// the same wait on the other rank) and breaks graph captures on other threads. With torch's
// caching allocator an address comes back only after cudaFree, which has synchronised already;
// stream-ordered allocators (cudaMallocAsync) reuse addresses at once: docs/multinode.md.
void RegistrationCache::drop_stale(const Allocation* a) {
  std::vector<std::uintptr_t> stale;
  if (a != nullptr) {  // the hot path: only the entries overlapping `a` (at most one starts before it)
    auto it = entries_.lower_bound(a->base);
    if (it != entries_.begin() && std::prev(it)->first + std::prev(it)->second.bytes > a->base) --it;
    for (; it != entries_.end() && it->first < a->base + a->bytes; ++it)
      if (!same_allocation(it->first, it->second.bytes, it->second.buffer_id, *a)) stale.push_back(it->first);
  } else {
    for (const auto& [base, entry] : entries_)
      if (!same_allocation(base, entry.bytes, entry.buffer_id, backend_.query(reinterpret_cast<void*>(base))))
        stale.push_back(base);
  }
  for (std::uintptr_t base : stale) {
    backend_.unregister_buffer(base);  // the memory is gone: a failure leaves nothing to do
    entries_.erase(base);
    ++stats_.stale_dropped;
  }
}

// Caller holds the mutex. Returns the live entry for `a`, registering it when `may_register`.
RegistrationCache::Entry* RegistrationCache::find_or_register(const Allocation& a, bool may_register,
                                                              const char* what) {
  drop_stale(&a);
  auto it = entries_.find(a.base);
  if (it != entries_.end()) return &it->second;
  if (!may_register) return nullptr;
  if (entries_.size() >= sweep_at_) {
    drop_stale(nullptr);
    sweep_at_ = std::max(kFirstSweep, 2 * entries_.size());
  }
  PDC_REQUIRE(!backend_.mapped_through_vmm(a.queried),
              what << ": this buffer's memory is mapped through CUDA's virtual memory API "
                      "(torch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a custom "
                      "pool), which pydatacopy cannot register for NVSHMEM's remote transports: "
                      "send from a symmetric tensor (pydatacopy.empty), or turn "
                      "expandable_segments off");
  const RegistrationBackend::RegisterResult result = backend_.register_buffer(a.base, a.bytes);
  // NVSHMEM registers with each transport in turn and keeps those that succeeded: roll back.
  // Not when it refused the address itself: the registration there is someone else's.
  if (result.status != 0 && !result.address_refused) backend_.unregister_buffer(a.base);
  PDC_REQUIRE(result.status == 0,
              what << ": NVSHMEM could not register the CUDA allocation at "
                   << reinterpret_cast<void*>(a.base) << " (" << a.bytes
                   << " bytes, holding this buffer): nvshmemx_buffer_register returned " << result.status
                   << (result.address_refused ? " (NVSHMEM refused the range: registered already, "
                                                "perhaps by other code in this process, or inside "
                                                "another registration)"
                                              : "")
                   << "; rerun with NVSHMEM_DEBUG=INFO for NVSHMEM's own account");
  ++stats_.registrations;
  Entry& e = entries_[a.base];
  e.bytes = a.bytes;
  e.buffer_id = a.buffer_id;
  return &e;
}

bool RegistrationCache::prepare(const void* ptr, std::size_t bytes, bool may_register, const char* what) {
  const Allocation a = require_cuda_memory(ptr, bytes, what);
  std::lock_guard<std::mutex> lock(mutex_);
  Entry* e = find_or_register(a, may_register, what);
  if (e == nullptr) return false;
  e->used = true;
  return true;
}

void RegistrationCache::register_explicit(const void* ptr, std::size_t bytes) {
  const Allocation a = require_cuda_memory(ptr, bytes, "register");
  std::lock_guard<std::mutex> lock(mutex_);
  drop_stale(nullptr);  // an explicit call is the time to let freed memory go
  ++find_or_register(a, true, "register")->explicit_refs;
}

void RegistrationCache::unregister_explicit(const void* ptr) {
  const Allocation a = backend_.query(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  drop_stale(nullptr);  // also this buffer's registration if its memory was freed
  if (!a.cuda_memory) return;  // freed since: dropped just now
  auto it = entries_.find(a.base);
  PDC_REQUIRE(it != entries_.end() && it->second.explicit_refs > 0,
              "unregister: " << ptr << " was not registered with pydatacopy.register");
  // A registration a transfer relied on stays cached: a captured graph may replay that transfer.
  if (--it->second.explicit_refs > 0 || it->second.used) return;
  const int status = backend_.unregister_buffer(it->first);
  entries_.erase(it);
  PDC_REQUIRE(status == 0, "unregister: nvshmemx_buffer_unregister failed with NVSHMEM status "
                               << status << "; rerun with NVSHMEM_DEBUG=INFO");
}

bool RegistrationCache::is_ready(const void* ptr, std::size_t bytes) {
  const Allocation a = backend_.query(ptr);
  if (!a.covers(ptr, bytes)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(a.base);
  return it != entries_.end() && same_allocation(it->first, it->second.bytes, it->second.buffer_id, a);
}

RegistrationStats RegistrationCache::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  RegistrationStats s = stats_;
  s.live_entries = entries_.size();
  s.registered_bytes = 0;
  for (const auto& entry : entries_) s.registered_bytes += entry.second.bytes;
  return s;
}

void RegistrationCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& entry : entries_) backend_.unregister_buffer(entry.first);
  entries_.clear();
}

}  // namespace pydatacopy
