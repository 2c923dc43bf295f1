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
};

struct Entry {
  std::size_t bytes = 0;
  unsigned long long buffer_id = 0;
  int explicit_refs = 0;  // register_memory() calls not yet undone
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

// cuPointerGetAttributes through the runtime's driver entry point: the core links no libcuda.
using PointerGetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

PointerGetAttributes pointer_get_attributes() {
  static PointerGetAttributes fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    PDC_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &symbol, 12000,
                                                    cudaEnableDefault, &found));
    PDC_REQUIRE(found == cudaDriverEntryPointSuccess && symbol != nullptr,
                "the CUDA driver has no cuPointerGetAttributes: update the NVIDIA driver");
    return reinterpret_cast<PointerGetAttributes>(symbol);
  }();
  return fn;
}

Allocation query_allocation(const void* ptr) {
  Allocation a;
  void* start = nullptr;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
  void* values[] = {&start, &a.bytes, &a.buffer_id, &a.memory_type};
  // Not an error for memory CUDA does not know: the attributes stay zero.
  const CUresult status = pointer_get_attributes()(4, attributes, values, reinterpret_cast<CUdeviceptr>(ptr));
  PDC_REQUIRE(status == CUDA_SUCCESS, "cuPointerGetAttributes failed with CUDA driver status "
                                          << static_cast<int>(status) << " for " << ptr);
  a.base = reinterpret_cast<std::uintptr_t>(start);
  return a;
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

// Caller holds the registry's mutex. Entries overlapping `a` but not it belong to allocations
// that are gone (live allocations never overlap): unregister and drop them.
void drop_stale(Registry& r, const Allocation& a) {
  auto it = r.entries.lower_bound(a.base);
  if (it != r.entries.begin() && std::prev(it)->first + std::prev(it)->second.bytes > a.base) --it;
  while (it != r.entries.end() && it->first < a.base + a.bytes) {
    if (it->first == a.base && it->second.bytes == a.bytes && it->second.buffer_id == a.buffer_id) {
      ++it;
      continue;
    }
    // The allocation is freed: NVSHMEM's registration of it can only be dropped; a failure here
    // changes nothing the caller can act on.
    nvshmemx_buffer_unregister(reinterpret_cast<void*>(it->first));
    it = r.entries.erase(it);
    ++r.stats.stale_dropped;
  }
}

// Caller holds the mutex. Returns the live entry for `a`, registering it when `may_register`.
Entry* find_or_register(Registry& r, const Allocation& a, bool may_register, const char* what) {
  drop_stale(r, a);
  auto it = r.entries.find(a.base);
  if (it != r.entries.end()) return &it->second;
  if (!may_register) return nullptr;
  // A buffer first used inside a CUDA graph capture (a tensor of the graph's own memory pool, say)
  // is registered at capture time: its address stays the same for every replay. NVSHMEM's
  // registration makes CUDA calls that a global-mode capture forbids on this thread, so this
  // thread runs it in relaxed mode.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  PDC_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  const int status = nvshmemx_buffer_register(reinterpret_cast<void*>(a.base), a.bytes);
  PDC_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  PDC_REQUIRE(status == 0, what << ": nvshmemx_buffer_register of the " << a.bytes
                                << "-byte CUDA allocation at " << reinterpret_cast<void*>(a.base)
                                << " failed with NVSHMEM status " << status
                                << "; rerun with NVSHMEM_DEBUG=INFO for NVSHMEM's own account");
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
  ++find_or_register(r, a, true, "register")->explicit_refs;
}

void unregister_memory(const void* ptr) {
  require_initialized("unregister");
  if (ptr == nullptr || in_symmetric_heap(ptr, 1)) return;
  const Allocation a = query_allocation(ptr);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  drop_stale(r, a);
  auto it = r.entries.find(a.base);
  PDC_REQUIRE(a.memory_type != 0 && it != r.entries.end() && it->second.explicit_refs > 0,
              "unregister: " << ptr << " was not registered with pydatacopy.register (or its "
                                "memory was freed since)");
  if (--it->second.explicit_refs > 0) return;
  const int status = nvshmemx_buffer_unregister(reinterpret_cast<void*>(it->first));
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
  return it != r.entries.end() && it->second.bytes == a.bytes && it->second.buffer_id == a.buffer_id;
}

void prepare_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (bytes == 0 || in_symmetric_heap(ptr, bytes)) return;
  const Allocation a = require_cuda_memory(ptr, bytes, what);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  PDC_REQUIRE(find_or_register(r, a, g_auto_register, what) != nullptr,
              what << ": " << bytes << " bytes at " << ptr << " are neither symmetric nor "
                   "registered, and PYDATACOPY_AUTO_REGISTER=0: NVSHMEM's remote transports "
                   "need the local side of an RMA registered. Call pydatacopy.register(tensor) "
                   "once for this buffer, or unset PYDATACOPY_AUTO_REGISTER");
}

void verify_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  PDC_REQUIRE(is_rma_ready(ptr, bytes),
              "PYDATACOPY_CHECK_RMA: " << what << ": " << bytes << " bytes at " << ptr
                  << " go to an NVSHMEM RMA call but lie neither in the symmetric heap nor in "
                     "live registered memory: a remote transport would fail on them. This is a "
                     "pydatacopy bug if you did not turn off registration; please report it");
}

void check_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (g_check) verify_rma_local(ptr, bytes, what);
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
  for (const auto& entry : r.entries) nvshmemx_buffer_unregister(reinterpret_cast<void*>(entry.first));
  r.entries.clear();
}

}  // namespace pydatacopy
