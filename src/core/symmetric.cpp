#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "pydatacopy/symmetric.hpp"

namespace pydatacopy {
namespace {

struct Allocations {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> live;  // base address -> bytes
};

Allocations& allocations() {
  static Allocations a;
  return a;
}

}  // namespace

void* symmetric_malloc(std::size_t bytes) {
  require_initialized("symmetric_malloc");
  PDC_REQUIRE(bytes > 0, "cannot allocate 0 bytes of symmetric memory");
  // nvshmem_malloc waits for every PE with no deadline: meet them in a bounded barrier first.
  barrier_all_blocking("symmetric_malloc (collective: every PE must allocate)", default_timeout_seconds());
  void* ptr = nvshmem_malloc(bytes);
  if (ptr == nullptr) {
    const char* configured = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
    PDC_REQUIRE(false, "the NVSHMEM symmetric heap has no room for "
                           << bytes << " more bytes (NVSHMEM_SYMMETRIC_SIZE is "
                           << (configured ? configured : "unset, default 1G")
                           << "); set NVSHMEM_SYMMETRIC_SIZE on every rank before init to at least "
                              "the sum of all live symmetric buffers plus this one, e.g. "
                           << ((bytes >> 20) + 1025) << "M");
  }
  std::lock_guard<std::mutex> lock(allocations().mutex);
  allocations().live[reinterpret_cast<std::uintptr_t>(ptr)] = bytes;
  return ptr;
}

void symmetric_free(void* ptr) {
  require_initialized("symmetric_free");
  {
    std::lock_guard<std::mutex> lock(allocations().mutex);
    auto it = allocations().live.find(reinterpret_cast<std::uintptr_t>(ptr));
    PDC_REQUIRE(it != allocations().live.end(),
                "symmetric_free: " << ptr << " is not a live pydatacopy symmetric allocation");
    allocations().live.erase(it);
  }
  if (peer_failed()) return;  // nvshmem_free is collective: it would wait on the dead peer
  // The caller's streams may still read or write the buffer; nvshmem_free synchronises PEs but
  // not this device's queued work.
  PDC_CHECK_CUDA(cudaDeviceSynchronize());
  // Also keeps a peer from writing into the buffer after we free it.
  barrier_all_blocking("symmetric_free (collective: every PE must free)", default_timeout_seconds());
  nvshmem_free(ptr);
}

bool is_symmetric(const void* ptr, std::size_t bytes) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(allocations().mutex);
  auto& live = allocations().live;
  auto it = live.upper_bound(address);
  if (it == live.begin()) return false;
  --it;
  return address + bytes <= it->first + it->second;
}

bool rma_forced() {
  const char* value = std::getenv("PYDATACOPY_FORCE_RMA");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

void* peer_pointer(const void* ptr, int pe) {
  require_valid_pe(pe, "peer_pointer");
  if (rma_forced()) return nullptr;
  return nvshmem_ptr(ptr, pe);
}

int multiprocessor_count() {
  static int cached_device = -1, cached_count = 0;
  int device = 0;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  if (device != cached_device) {
    PDC_CHECK_CUDA(cudaDeviceGetAttribute(&cached_count, cudaDevAttrMultiProcessorCount, device));
    cached_device = device;
  }
  return cached_count;
}

}  // namespace pydatacopy
