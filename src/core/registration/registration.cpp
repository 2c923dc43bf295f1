#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "registration/registration_cache.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "common/cuda_calls.hpp"
#include "common/pointer_attributes.hpp"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"

namespace pydatacopy {
namespace {

std::atomic<bool> g_check{false};
std::atomic<bool> g_auto_register{true};
std::atomic<uint64_t> g_check_violations{0};

// refuse_rma_checks_for_tests(): the prefix of the checks to refuse (none when the flag is off).
std::atomic<bool> g_refusing{false};
std::mutex g_refused_mutex;
std::string g_refused_prefix;

bool refused_for_tests(const char* what) {
  if (!g_refusing.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  return std::strncmp(what, g_refused_prefix.c_str(), g_refused_prefix.size()) == 0;
}

// NVSHMEM's (un)registration makes CUDA calls (a synchronous copy of its device state) that a
// global-mode graph capture forbids: this thread makes them in relaxed mode. A buffer first used
// inside a capture (a tensor of the graph's own pool) is thus registered at capture time; its
// address stays the same for every replay.
using detail::driver_function;
using detail::RelaxedCaptureMode;

// The CUDA driver and NVSHMEM behind the registration cache.
class NvshmemBackend final : public RegistrationBackend {
 public:
  Allocation query(const void* ptr) override {
    // Not an error for memory CUDA does not know: the attributes stay zero.
    const detail::PointerAttributes p = detail::pointer_attributes(ptr, detail::Ask::kIdentity);
    Allocation a;
    a.base = p.start;
    a.bytes = p.bytes;
    a.buffer_id = p.buffer_id;
    a.cuda_memory = p.device_memory() || p.host_memory();
    a.managed = p.managed;
    a.queried = ptr;
    return a;
  }

  bool mapped_through_vmm(const void* ptr) override {
    using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
    using Release = CUresult (*)(CUmemGenericAllocationHandle);
    static const Retain retain = driver_function<Retain>("cuMemRetainAllocationHandle");
    static const Release release = driver_function<Release>("cuMemRelease");
    RelaxedCaptureMode relaxed;
    CUmemGenericAllocationHandle handle{};
    if (retain(&handle, const_cast<void*>(ptr)) != CUDA_SUCCESS) return false;
    release(handle);
    return true;
  }

  RegisterResult register_buffer(std::uintptr_t base, std::size_t bytes) override {
    RelaxedCaptureMode relaxed;
    RegisterResult result;
    result.status = nvshmemx_buffer_register(reinterpret_cast<void*>(base), bytes);
    result.address_refused = result.status == NVSHMEMX_ERROR_INVALID_VALUE;
    return result;
  }

  int unregister_buffer(std::uintptr_t base) override {
    RelaxedCaptureMode relaxed;
    return nvshmemx_buffer_unregister(reinterpret_cast<void*>(base));
  }
};

// Never destroyed: a thread still in a transfer while the process exits must not meet a
// destroyed mutex or map.
RegistrationCache& cache() {
  static RegistrationCache* c = new RegistrationCache(*new NvshmemBackend);
  return *c;
}

bool in_symmetric_heap(const void* ptr, std::size_t bytes) {
  const int me = nvshmem_my_pe();
  const auto* last = static_cast<const uint8_t*>(ptr) + bytes - 1;
  return nvshmem_ptr(ptr, me) != nullptr && nvshmem_ptr(last, me) != nullptr;
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
  cache().register_explicit(ptr, bytes);
}

void unregister_memory(const void* ptr) {
  require_initialized("unregister");
  if (ptr == nullptr || in_symmetric_heap(ptr, 1)) return;
  cache().unregister_explicit(ptr);
}

bool is_rma_ready(const void* ptr, std::size_t bytes) {
  require_initialized("is_registered");
  if (bytes == 0 || in_symmetric_heap(ptr, bytes)) return true;
  return cache().is_ready(ptr, bytes);
}

void prepare_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (bytes == 0 || in_symmetric_heap(ptr, bytes)) return;
  PDC_REQUIRE(cache().prepare(ptr, bytes, g_auto_register, what),
              what << ": " << bytes << " bytes at " << ptr << " are neither symmetric nor "
                   "registered, and PYDATACOPY_AUTO_REGISTER=0: NVSHMEM's remote transports "
                   "need the local side of an RMA registered. Call pydatacopy.register(tensor) "
                   "once for this buffer, or unset PYDATACOPY_AUTO_REGISTER");
  // The checking mode verifies afresh (range and buffer ID) what NVSHMEM is about to be given.
  if (g_check.load(std::memory_order_relaxed)) verify_rma_local(ptr, bytes, what);
}

void verify_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (!refused_for_tests(what) && is_rma_ready(ptr, bytes)) return;
  g_check_violations.fetch_add(1, std::memory_order_relaxed);
  PDC_REQUIRE(false, "PYDATACOPY_CHECK_RMA: " << what << ": " << bytes << " bytes at " << ptr
                         << " go to an NVSHMEM RMA call but lie neither in the symmetric heap nor in "
                            "live registered memory: a remote transport would fail on them. This is a "
                            "pydatacopy bug if you did not turn off registration; please report it");
}

void check_rma_remote(const void* ptr, std::size_t bytes, const char* what) {
  if (!g_check.load(std::memory_order_relaxed) || bytes == 0) return;
  if (!refused_for_tests(what) && is_initialized() && in_symmetric_heap(ptr, bytes)) return;
  g_check_violations.fetch_add(1, std::memory_order_relaxed);
  PDC_REQUIRE(false, "PYDATACOPY_CHECK_RMA: " << what << ": " << bytes << " bytes at " << ptr
                         << " are given to NVSHMEM as the peer's side of an RMA or signal call but "
                            "do not lie on NVSHMEM's symmetric heap (nvshmem_ptr(address, my_pe) is "
                            "null): NVSHMEM would write or read the peer's memory at a wrong address. "
                            "This is a pydatacopy bug unless you passed that address yourself; "
                            "please report it");
}

void check_rma_local(const void* ptr, std::size_t bytes, const char* what) {
  if (!g_check.load(std::memory_order_relaxed) || bytes == 0) return;
  verify_rma_local(ptr, bytes, what);
}

void refuse_rma_checks_for_tests(const char* what_prefix) {
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  g_refused_prefix = what_prefix;
  g_refusing = !g_refused_prefix.empty();
}

void prepare_rma_chunk_stream(const kernels::ChunkStreamArgs& op, bool send) {
  const std::size_t slots = static_cast<std::size_t>(op.num_slots);
  const std::size_t signal_bytes = slots * static_cast<std::size_t>(op.pages) * sizeof(uint64_t);
  if (send) {
    if (op.peer_staging != nullptr) return;  // direct stores into the peer's staging
    prepare_rma_local(op.src, static_cast<std::size_t>(op.bytes), "send: the tensor sent");
    check_rma_remote(op.staging, slots * static_cast<std::size_t>(op.chunk_bytes),
                     "send: the receiver's staging slots");
    check_rma_remote(op.arrivals, signal_bytes, "send: the receiver's arrival signals");
    const std::size_t header_bytes =
        slots * static_cast<std::size_t>(op.pages) * sizeof(kernels::SlotHeader);
    check_rma_remote(op.headers, header_bytes, "send: the receiver's slot headers");
    check_rma_local(op.outgoing, header_bytes, "send: the slot headers put from here");
  } else if (op.peer_credits == nullptr) {
    check_rma_remote(op.credits, signal_bytes, "recv: the sender's credit signals");
    check_rma_remote(op.remote_broken, sizeof(uint64_t), "recv: the sender's refusal word");
    check_rma_remote(op.remote_refused_bytes, sizeof(uint64_t), "recv: the sender's refused-size word");
  }
}

DeviceAllocation device_allocation(const void* ptr, int device) {
  // Memory CUDA does not know is no error here: its attributes stay zero.
  const detail::PointerAttributes p = detail::pointer_attributes(ptr, detail::Ask::kDevice);
  DeviceAllocation a;
  if (!p.device_memory() || p.device_ordinal != device || p.start == 0) return a;
  a.base = p.start;
  a.bytes = p.bytes;
  return a;
}

RegistrationStats registration_stats() {
  RegistrationStats stats = cache().stats();
  stats.check_violations = g_check_violations.load(std::memory_order_relaxed);
  return stats;
}

void unregister_all_memory() { cache().clear(); }

}  // namespace pydatacopy
