#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/settings.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

// A live allocation with every PE's copy of it through load/store, resolved once when it was
// made: a transfer then finds its peer address by offset, in the one lookup that also checks
// symmetry (nvshmem_ptr is linear within an allocation).
struct Allocation {
  std::size_t bytes = 0;
  std::vector<std::uintptr_t> peer_base;  // [pe]: nvshmem_ptr(base, pe), 0 when not reachable
};

struct Allocations {
  std::mutex mutex;
  std::map<std::uintptr_t, Allocation> live;  // base address -> allocation
};

Allocations& allocations() {
  static Allocations a;
  return a;
}

// NVSHMEM_SYMMETRIC_SIZE in bytes, as init read it (NVSHMEM reads it once, at its start, too):
// never parsed again between symmetric_malloc's two barriers, where a refusal on one PE would
// leave its peers waiting. NVSHMEM's default (1 GiB) until init.
std::atomic<std::size_t> g_configured_heap_bytes{settings::kNvshmemDefaultSymmetricSize};

std::size_t configured_heap_bytes() { return g_configured_heap_bytes.load(std::memory_order_relaxed); }

std::size_t live_symmetric_bytes() {
  std::lock_guard<std::mutex> lock(allocations().mutex);
  std::size_t total = 0;
  for (const auto& entry : allocations().live) total += entry.second.bytes;
  return total;
}

}  // namespace

void* symmetric_malloc(std::size_t bytes) {
  require_initialized("symmetric_malloc");
  // nvshmem_malloc waits for every PE with no deadline: meet them in bounded barriers first.
  // First the size: nvshmem_malloc must see the same size on every PE, and a PE asking another
  // size could take another decision below (refuse while the others allocate, and hang them).
  // Every PE sees every size, so all refuse alike (the 0-byte check comes after, for the same
  // reason).
  const std::vector<uint64_t> sizes = barrier_all_blocking(
      "symmetric_malloc (collective: every PE must allocate, the same size)",
      default_timeout_seconds(), static_cast<uint64_t>(bytes));
  const std::string size_refusal = symmetric_size_refusal(sizes);
  PDC_REQUIRE(size_refusal.empty(), size_refusal);
  PDC_REQUIRE(bytes > 0, "cannot allocate 0 bytes of symmetric memory");
  // NVSHMEM grows its heap into free GPU memory, and when it cannot it ends every process (seen
  // asking for 200 GiB and 1 TiB, and with two PEs on one GPU each asking 0.6x its free
  // memory), so a request the PEs of some GPU cannot hold together is refused here, on every PE
  // alike: in a second barrier each PE votes its room (see symmetric.hpp) and all PEs see all
  // votes.
  std::size_t free_bytes = 0, total_bytes = 0;
  PDC_CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const bool owns = owns_nvshmem();
  const std::size_t heap = configured_heap_bytes(), live = live_symmetric_bytes();
  // An NVSHMEM someone else started (torch's symmetric memory) holds their allocations too,
  // which we cannot see: count its heap as full, so that every request is checked as growth
  // (a growth that fails is NVSHMEM's exit()).
  const std::size_t heap_room = heap_room_bytes(heap, live, owns);
  const std::size_t reserve = gpu_reserve_bytes(total_bytes, pes_sharing_my_gpu());
  const std::size_t gpu_room = free_bytes > reserve ? free_bytes - reserve : 0;
  const std::vector<uint64_t> votes = barrier_all_blocking(
      "symmetric_malloc (collective: every PE must allocate)", default_timeout_seconds(),
      pack_room_vote(heap_room, gpu_room));
  const std::string refusal = symmetric_room_refusal(bytes, gpu_identities(), votes);
  if (!refusal.empty()) {
    using detail::gib;
    std::ostringstream here;
    here << ". On PE " << my_pe() << ": heap " << gib(heap) << " (NVSHMEM_SYMMETRIC_SIZE) with "
         << gib(live) << " in live pydatacopy symmetric allocations";
    if (!owns) {
      here << " (NVSHMEM was started by another library in this process, such as torch's "
              "symmetric memory, whose allocations pydatacopy cannot see: its heap counts as "
              "having no unused part)";
    }
    here << ", GPU memory free " << gib(free_bytes) << " of " << gib(total_bytes) << ", reserve "
         << gib(reserve) << " for " << pes_sharing_my_gpu() << " PE(s) on this GPU";
    PDC_REQUIRE(false, refusal << here.str());
  }
  void* ptr = nvshmem_malloc(bytes);
  if (ptr == nullptr) {
    const std::optional<std::string> configured = settings::read("NVSHMEM_SYMMETRIC_SIZE");
    PDC_REQUIRE(false, "the NVSHMEM symmetric heap has no room for "
                           << bytes << " more bytes (NVSHMEM_SYMMETRIC_SIZE is "
                           << (configured ? *configured : std::string("unset, default 1G"))
                           << "); set NVSHMEM_SYMMETRIC_SIZE on every rank before init to at least "
                              "the sum of all live symmetric buffers plus this one, e.g. "
                           << ((bytes >> 20) + 1025) << "M");
  }
  Allocation allocation;
  allocation.bytes = bytes;
  allocation.peer_base.resize(static_cast<std::size_t>(n_pes()));
  for (int pe = 0; pe < n_pes(); ++pe)
    allocation.peer_base[static_cast<std::size_t>(pe)] = reinterpret_cast<std::uintptr_t>(nvshmem_ptr(ptr, pe));
  std::lock_guard<std::mutex> lock(allocations().mutex);
  allocations().live[reinterpret_cast<std::uintptr_t>(ptr)] = std::move(allocation);
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
  return address + bytes <= it->first + it->second.bytes;
}

namespace {
bool forced_by_environment() { return settings::value("PYDATACOPY_FORCE_RMA").on; }
// Read on every put and send: a getenv each was a scan of the environment per call. At load a
// bad value reads as off (a throw here would end the process); init refuses it.
bool forced_at_load() {
  try {
    return forced_by_environment();
  } catch (const Error&) {
    return false;
  }
}
std::atomic<bool> g_rma_forced{forced_at_load()};
}  // namespace

bool rma_forced() { return g_rma_forced.load(std::memory_order_relaxed); }

void set_rma_forced(bool forced) { g_rma_forced.store(forced, std::memory_order_relaxed); }

void read_rma_forced_from_environment() { set_rma_forced(forced_by_environment()); }

void read_symmetric_size_from_environment() {
  g_configured_heap_bytes.store(static_cast<std::size_t>(settings::value("NVSHMEM_SYMMETRIC_SIZE").bytes),
                                std::memory_order_relaxed);
}

void* peer_pointer(const void* ptr, int pe) {
  require_valid_pe(pe, "peer_pointer");
  if (rma_forced()) return nullptr;
  return nvshmem_ptr(ptr, pe);
}

SymmetricRoute symmetric_route(const void* ptr, std::size_t bytes, int pe) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  SymmetricRoute route;
  std::lock_guard<std::mutex> lock(allocations().mutex);
  auto& live = allocations().live;
  auto it = live.upper_bound(address);
  if (it == live.begin()) return route;
  --it;
  const Allocation& allocation = it->second;
  if (address + bytes > it->first + allocation.bytes) return route;
  route.symmetric = true;
  if (pe < 0 || static_cast<std::size_t>(pe) >= allocation.peer_base.size() || rma_forced()) return route;
  const std::uintptr_t base = allocation.peer_base[static_cast<std::size_t>(pe)];
  if (base != 0) route.peer = reinterpret_cast<void*>(base + (address - it->first));
  return route;
}

int multiprocessor_count() {
  // The current device's count, cached per device: read from several threads at once (two
  // buffers exchanging concurrently, say), so each entry is an atomic (0: not read yet; a race
  // only reads the same attribute twice). Devices past the cache are asked each time.
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cached[kCachedDevices];  // static storage: zero-initialised
  int device = 0;
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  const bool cacheable = device >= 0 && device < kCachedDevices;
  if (cacheable) {
    const int count = cached[device].load(std::memory_order_relaxed);
    if (count > 0) return count;
  }
  int count = 0;
  PDC_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (cacheable) cached[device].store(count, std::memory_order_relaxed);
  return count;
}

}  // namespace pydatacopy
