#include "pydatacopy/registration.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"

namespace pydatacopy {
namespace {

// One CUDA allocation as the driver reports it for an address.
struct Allocation {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  unsigned long long buffer_id = 0;  // unique per allocation over the process's lifetime
  unsigned int memory_type = 0;      // CU_MEMORYTYPE_*; 0: not CUDA memory
  const void* queried = nullptr;     // the address asked about
};

struct Entry {
  std::size_t bytes = 0;
  unsigned long long buffer_id = 0;
  int explicit_refs = 0;  // register_memory() calls not yet undone
  bool used = false;      // a transfer relied on it (perhaps a captured graph's): keep it cached
};

struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Entry> entries;  // allocation base -> entry; never overlapping
  RegistrationStats stats;
};

Registry& registry() {
  static Registry r;
  return r;
}

std::atomic<bool> g_check{false};
std::atomic<bool> g_auto_register{true};

// Driver functions through the runtime's entry point: the core links no libcuda.
template <typename Function>
Function driver_function(const char* name) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  PDC_CHECK_CUDA(cudaGetDriverEntryPointByVersion(name, &symbol, 12000, cudaEnableDefault, &found));
  PDC_REQUIRE(found == cudaDriverEntryPointSuccess && symbol != nullptr,
              "the CUDA driver has no " << name << ": update the NVIDIA driver");
  return reinterpret_cast<Function>(symbol);
}

Allocation query_allocation(const void* ptr) {
  using GetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
  static const GetAttributes get_attributes = driver_function<GetAttributes>("cuPointerGetAttributes");
  Allocation a;
  void* start = nullptr;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
  void* values[] = {&start, &a.bytes, &a.buffer_id, &a.memory_type};
  // Not an error for memory CUDA does not know: the attributes stay zero.
  const CUresult status = get_attributes(4, attributes, values, reinterpret_cast<CUdeviceptr>(ptr));
  PDC_REQUIRE(status == CUDA_SUCCESS, "cuPointerGetAttributes failed with CUDA driver status "
                                          << static_cast<int>(status) << " for " << ptr);
  a.base = reinterpret_cast<std::uintptr_t>(start);
  a.queried = ptr;
  return a;
}

// Memory mapped through CUDA's virtual memory API (torch's expandable segments): the driver
// reports the whole reserved range and a buffer ID per mapped piece, so an allocation cannot be
// told from its neighbours, nor registered as one.
bool mapped_through_vmm(const void* ptr) {
  using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  static const Retain retain = driver_function<Retain>("cuMemRetainAllocationHandle");
  static const Release release = driver_function<Release>("cuMemRelease");
  CUmemGenericAllocationHandle handle{};
  if (retain(&handle, const_cast<void*>(ptr)) != CUDA_SUCCESS) return false;
  release(handle);
  return true;
}

bool in_symmetric_heap(const void* ptr, std::size_t bytes) {
  const int me = nvshmem_my_pe();
  const auto* last = static_cast<const uint8_t*>(ptr) + bytes - 1;
  return nvshmem_ptr(ptr, me) != nullptr && nvshmem_ptr(last, me) != nullptr;
}

bool covers(const Allocation& a, const void* ptr, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  return a.memory_type != 0 && begin >= a.base && begin + bytes <= a.base + a.bytes;
}

bool same_allocation(std::uintptr_t base, const Entry& e, const Allocation& a) {
  return base == a.base && e.bytes == a.bytes && e.buffer_id == a.buffer_id;
}

// NVSHMEM's (un)registration makes CUDA calls (a synchronous copy of its device state) that a
// global-mode graph capture forbids: this thread makes them in relaxed mode. A buffer first used
// inside a capture (a tensor of the graph's own pool) is thus registered at capture time; its
// address stays the same for every replay.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { PDC_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

int nvshmem_unregister(std::uintptr_t base) {
  RelaxedCaptureMode relaxed;
  return nvshmemx_buffer_unregister(reinterpret_cast<void*>(base));
}

// Caller holds the mutex. Unregisters and drops entries whose allocation is gone: those
// overlapping `a` without being it (live allocations never overlap), or with `a` null every
// entry whose base no longer starts the same allocation. No synchronisation here: a
// device-wide one would wait on kernels that wait on a peer (a recv whose sender sits behind
// the same wait on the other rank) and breaks graph captures on other threads. With torch's
// caching allocator an address comes back only after cudaFree, which has synchronised already;
// stream-ordered allocators (cudaMallocAsync) reuse addresses at once: docs/multinode.md.
void drop_stale(Registry& r, const Allocation* a) {
  std::vector<std::uintptr_t> stale;
  if (a != nullptr) {  // the hot path: only the entries overlapping `a` (at most one starts before it)
    auto it = r.entries.lower_bound(a->base);
    if (it != r.entries.begin() && std::prev(it)->first + std::prev(it)->second.bytes > a->base) --it;
    for (; it != r.entries.end() && it->first < a->base + a->bytes; ++it)
      if (!same_allocation(it->first, it->second, *a)) stale.push_back(it->first);
  } else {
    for (const auto& [base, entry] : r.entries)
      if (!same_allocation(base, entry, query_allocation(reinterpret_cast<void*>(base)))) stale.push_back(base);
  }
  for (std::uintptr_t base : stale) {
    nvshmem_unregister(base);  // the memory is gone: a failure leaves nothing the caller can do
    r.entries.erase(base);
    ++r.stats.stale_dropped;
  }
}

// Caller holds the mutex. Returns the live entry for `a`, registering it when `may_register`.
Entry* find_or_register(Registry& r, const Allocation& a, bool may_register, const char* what) {
  drop_stale(r, &a);
  auto it = r.entries.find(a.base);
  if (it != r.entries.end()) return &it->second;
  if (!may_register) return nullptr;
  int status = 0;
  {
    RelaxedCaptureMode relaxed;
    PDC_REQUIRE(!mapped_through_vmm(a.queried),
                what << ": this buffer's memory is mapped through CUDA's virtual memory API "
                        "(torch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a custom "
                        "pool), which pydatacopy cannot register for NVSHMEM's remote transports: "
                        "send from a symmetric tensor (pydatacopy.empty), or turn "
                        "expandable_segments off");
    status = nvshmemx_buffer_register(reinterpret_cast<void*>(a.base), a.bytes);
    // NVSHMEM registers with each transport in turn and keeps those that succeeded: roll back.
    // Not when it refused the address itself (already registered, or overlapping): the
    // registration there is someone else's.
    if (status != 0 && status != NVSHMEMX_ERROR_INVALID_VALUE)
      nvshmemx_buffer_unregister(reinterpret_cast<void*>(a.base));
  }
  PDC_REQUIRE(status == 0, what << ": NVSHMEM could not register the CUDA allocation at "
                                << reinterpret_cast<void*>(a.base) << " (" << a.bytes
                                << " bytes, holding this buffer): nvshmemx_buffer_register "
                                   "returned " << status << "; rerun with NVSHMEM_DEBUG=INFO for "
                                   "NVSHMEM's own account");
  ++r.stats.registrations;
  Entry& e = r.entries[a.base];
  e.bytes = a.bytes;
  e.buffer_id = a.buffer_id;
  return &e;
}

Allocation require_cuda_memory(const void* ptr, std::size_t bytes, const char* what) {
  const Allocation a = query_allocation(ptr);
  PDC_REQUIRE(a.memory_type == CU_MEMORYTYPE_DEVICE || a.memory_type == CU_MEMORYTYPE_HOST,
              what << ": " << ptr << " is not CUDA memory (pageable host memory?): NVSHMEM can "
                      "only use device memory or pinned host memory");
  PDC_REQUIRE(covers(a, ptr, bytes), what << ": " << bytes << " bytes at " << ptr
                                          << " run past the end of their CUDA allocation");
  return a;
}

}  // namespace

void set_rma_options(bool check, bool auto_register) {
  g_check = check;
  g_auto_register = auto_register;
}

bool rma_check_enabled() { return g_check; }
bool auto_register_enabled() { return g_auto_register; }

void register_memory(const void* ptr, std::size_t bytes) {
  require_initialized("register");
  PDC_REQUIRE(ptr != nullptr && bytes > 0, "register: the buffer is empty");
  if (in_symmetric_heap(ptr, bytes)) return;
  const Allocation a = require_cuda_memory(ptr, bytes, "register");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  drop_stale(r, nullptr);  // an explicit call is the time to let freed memory go
  ++find_or_register(r, a, true, "register")->explicit_refs;
}

void unregister_memory(const void* ptr) {
  require_initialized("unregister");
  if (ptr == nullptr || in_symmetric_heap(ptr, 1)) return;
  const Allocation a = query_allocation(ptr);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  drop_stale(r, nullptr);  // also the registration of this buffer if its memory was freed
  if (a.memory_type == 0) return;     // freed since: dropped just now
  auto it = r.entries.find(a.base);
  PDC_REQUIRE(it != r.entries.end() && it->second.explicit_refs > 0,
              "unregister: " << ptr << " was not registered with pydatacopy.register");
  // A registration a transfer relied on stays cached: a captured graph may replay that transfer.
  if (--it->second.explicit_refs > 0 || it->second.used) return;
  const int status = nvshmem_unregister(it->first);
  r.entries.erase(it);
  PDC_REQUIRE(status == 0, "unregister: nvshmemx_buffer_unregister failed with NVSHMEM status "
                               << status << "; rerun with NVSHMEM_DEBUG=INFO");
}

bool is_rma_ready(const void* ptr, std::size_t bytes) {
  require_initialized("is_registered");
  if (bytes == 0 || in_symmetric_heap(ptr, bytes)) return true;
  const Allocation a = query_allocation(ptr);
  if (!covers(a, ptr, bytes)) return false;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(a.base);
  return it != r.entries.end() && same_allocation(it->first, it->second, a);
}

void prepare_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (bytes == 0 || in_symmetric_heap(ptr, bytes)) return;
  const Allocation a = require_cuda_memory(ptr, bytes, what);
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    Entry* e = find_or_register(r, a, g_auto_register, what);
    PDC_REQUIRE(e != nullptr,
                what << ": " << bytes << " bytes at " << ptr << " are neither symmetric nor "
                     "registered, and PYDATACOPY_AUTO_REGISTER=0: NVSHMEM's remote transports "
                     "need the local side of an RMA registered. Call pydatacopy.register(tensor) "
                     "once for this buffer, or unset PYDATACOPY_AUTO_REGISTER");
    e->used = true;
  }
  // The checking mode verifies afresh (range and buffer ID) what NVSHMEM is about to be given.
  if (g_check) verify_rma_local(ptr, bytes, what);
}

void verify_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  PDC_REQUIRE(is_rma_ready(ptr, bytes),
              "PYDATACOPY_CHECK_RMA: " << what << ": " << bytes << " bytes at " << ptr
                  << " go to an NVSHMEM RMA call but lie neither in the symmetric heap nor in "
                     "live registered memory: a remote transport would fail on them. This is a "
                     "pydatacopy bug if you did not turn off registration; please report it");
}

RegistrationStats registration_stats() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  RegistrationStats s = r.stats;
  s.live_entries = r.entries.size();
  s.registered_bytes = 0;
  for (const auto& entry : r.entries) s.registered_bytes += entry.second.bytes;
  return s;
}

void unregister_all_memory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& entry : r.entries) nvshmem_unregister(entry.first);
  r.entries.clear();
}

}  // namespace pydatacopy
