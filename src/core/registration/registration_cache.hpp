// The bookkeeping behind registration.hpp, kept apart from the CUDA driver and NVSHMEM so that
// it runs, and is tested, without a GPU (tests/cpp/test_registration_cache.cpp): which CUDA
// allocations are registered, which have gone since, and when one is registered, kept or
// unregistered. registration.cpp supplies the backend that asks the driver and calls NVSHMEM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "pydatacopy/registration.hpp"

namespace pydatacopy {

// One CUDA allocation as the driver reports it for an address.
struct Allocation {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  unsigned long long buffer_id = 0;  // unique per allocation over the process's lifetime
  bool cuda_memory = false;          // device or pinned host memory; false: CUDA does not know it
  bool managed = false;              // cudaMallocManaged: NVSHMEM cannot register it
  const void* queried = nullptr;     // the address asked about
  // Virtual-memory memory whose physical chunks export as POSIX file descriptors (torch's
  // expandable segments); base and bytes are then its address reservation's (zero-copy only).
  bool vmm_fd = false;

  bool covers(const void* ptr, std::size_t length) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
    return cuda_memory && begin >= base && begin - base <= bytes && length <= bytes - (begin - base);
  }
};

// What the cache needs from the driver and from NVSHMEM.
class RegistrationBackend {
 public:
  struct RegisterResult {
    int status = 0;                // nvshmemx_buffer_register's return value; 0: registered
    bool address_refused = false;  // NVSHMEM refused the range itself (NVSHMEMX_ERROR_INVALID_VALUE:
                                   // registered already, inside another registration, or in the
                                   // symmetric heap) before any transport took it
  };
  virtual ~RegistrationBackend() = default;
  virtual Allocation query(const void* ptr) = 0;
  // Mapped through CUDA's virtual memory API (torch's expandable segments): the driver reports
  // the whole reserved range, so one allocation cannot be told from its neighbours.
  virtual bool mapped_through_vmm(const void* ptr) = 0;
  virtual RegisterResult register_buffer(std::uintptr_t base, std::size_t bytes) = 0;
  virtual int unregister_buffer(std::uintptr_t base) = 0;
};

// Thread-safe. Entries are whole allocations keyed by base and never overlap.
class RegistrationCache {
 public:
  explicit RegistrationCache(RegistrationBackend& backend) : backend_(backend) {}
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  // The transfer path. Makes the allocation holding [ptr, ptr + bytes) registered (registering
  // it when `may_register`) and marks it used: a transfer, perhaps a captured graph's, relies on
  // it. Returns false when it is not registered and `may_register` is false. Throws when the
  // memory is not CUDA memory, runs past its allocation, is mapped through the virtual memory
  // API, or NVSHMEM refuses it; `what` names the caller's operation in the message.
  bool prepare(const void* ptr, std::size_t bytes, bool may_register, const char* what);
  // register(): counted, one unregister_explicit() each. Also lets every freed allocation go.
  void register_explicit(const void* ptr, std::size_t bytes);
  // unregister(): drops one count; unregisters from NVSHMEM when none is left, unless a transfer
  // used it. Throws when ptr's allocation was not registered through register_explicit().
  // Memory freed since is released without complaint.
  void unregister_explicit(const void* ptr);
  // True when [ptr, ptr + bytes) lies in a live registration (range and buffer ID asked afresh).
  bool is_ready(const void* ptr, std::size_t bytes);
  RegistrationStats stats();
  // Unregisters everything (at finalize, while NVSHMEM is still up).
  void clear();

 private:
  struct Entry {
    std::size_t bytes = 0;
    unsigned long long buffer_id = 0;
    int explicit_refs = 0;  // register_explicit() calls not yet undone
    bool used = false;      // a transfer relied on it: keep it until its memory goes
  };

  Allocation require_cuda_memory(const void* ptr, std::size_t bytes, const char* what);
  void drop_stale(const Allocation* a);
  Entry* find_or_register(const Allocation& a, bool may_register, const char* what);

  RegistrationBackend& backend_;
  std::mutex mutex_;
  std::map<std::uintptr_t, Entry> entries_;  // allocation base -> entry
  RegistrationStats stats_;
  // A new registration first sweeps every entry once there are this many: freed allocations
  // whose address nothing reuses (cudaMallocAsync's) do not pile up between explicit calls.
  std::size_t sweep_at_ = kFirstSweep;

 public:
  static constexpr std::size_t kFirstSweep = 64;
};

}  // namespace pydatacopy
