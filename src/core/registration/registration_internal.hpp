// Registration's internals, for the core, its bindings and its C++ tests only (not installed):
// what each engine calls before it hands NVSHMEM an address, and the checking mode.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pydatacopy/registration.hpp"

namespace pydatacopy {

namespace kernels {
struct ChunkStreamArgs;
}

// Makes [ptr, ptr + bytes) usable as the local side of an NVSHMEM RMA call (see above); `what`
// names the caller's operation and argument in errors. Throws when the memory is not CUDA
// memory or is mapped through the virtual memory API, or when auto registration is off and
// nobody registered it. Inside a CUDA graph capture it registers too (the buffer keeps its
// address for every replay). In checking mode it then verifies the result (verify_rma_local).
void prepare_rma_local(const void* ptr, std::size_t bytes, const char* what);

// The checking mode's verification: throws naming `what` unless [ptr, ptr + bytes) lies in the
// symmetric heap or in a live registration (range and buffer ID queried afresh). Counted as a
// violation when it throws.
void verify_rma_local(const void* ptr, std::size_t bytes, const char* what);

// The checking mode, one call before each NVSHMEM RMA or signal call of the core; a relaxed load
// and a return when PYDATACOPY_CHECK_RMA is off. A failure is counted
// (RegistrationStats::check_violations) and thrown as Error naming `what` and the address.
// check_rma_remote: the peer's side (a put's dst, a get's src, a signal, staging, the token
// exchange's receive set) must lie on NVSHMEM's symmetric heap: nvshmem_ptr(address, my_pe) is
// non-null for its first and last byte (pydatacopy's allocations, and torch's symmetric memory
// when it shares NVSHMEM). Not is_symmetric(): this asks NVSHMEM what it will be given.
void check_rma_remote(const void* ptr, std::size_t bytes, const char* what);
// check_rma_local: this PE's side of an RMA that leaves through NVSHMEM's transport (a put's
// src, a get's dst) must be symmetric or in a live registration (verify_rma_local).
void check_rma_local(const void* ptr, std::size_t bytes, const char* what);

// Test support: the checking mode refuses every check whose `what` starts with `what_prefix`, as
// if its address were wrong (empty: none), so that a test can show that a path checks before it
// calls NVSHMEM; real addresses cannot be made wrong through the public API.
void refuse_rma_checks_for_tests(const char* what_prefix);

// One op of a send/recv batch (send_recv.cpp) on the RMA path: a send's buffer is made RMA-ready
// (prepare_rma_local) and, in checking mode, the staging slots and arrival signals it puts into
// are checked; a recv's credits, which it raises at the sender through NVSHMEM, likewise. A
// direct (load/store) op hands NVSHMEM nothing: a no-op.
void prepare_rma_chunk_stream(const kernels::ChunkStreamArgs& op, bool send);

// The CUDA allocation holding ptr when it is device memory of CUDA `device`, as the driver
// reports it: [base, base + bytes); bytes 0 when it is not (host memory, another device, memory
// CUDA does not know). prepared put_many's check of sources given as raw addresses.
struct DeviceAllocation {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
};
DeviceAllocation device_allocation(const void* ptr, int device);

// Unregisters everything (finalize calls it while NVSHMEM is still up).
void unregister_all_memory();

}  // namespace pydatacopy
