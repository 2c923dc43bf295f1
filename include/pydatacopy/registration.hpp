// Local memory for NVSHMEM's remote transports.
//
// On a remote transport (InfiniBand RC or GDA, UCX, libfabric) the local side of an RMA call (the
// source of a put, the destination of a get) must lie in the symmetric heap or in memory
// registered with nvshmemx_buffer_register: an unregistered buffer has no memory key, and the
// transfer fails on the NIC. Every core path that hands NVSHMEM a user buffer calls
// prepare_rma_local() first. Registration covers a whole CUDA allocation (what the driver reports
// for the address) and is keyed by the driver's buffer ID, so that an allocation freed and
// another made at the same address are told apart (torch's caching allocator keeps its segments,
// so a segment is registered once; after empty_cache() a new segment at an old address is
// registered afresh). Memory
// mapped through CUDA's virtual memory API (torch's expandable segments) cannot be registered
// this way and is refused with an Error.
//
// Registration and unregistration block (NVSHMEM updates its device state) and are local: no
// peer takes part. With IBGDA that update is a cudaMemcpy on the legacy default stream, which
// waits behind kernels on blocking streams, a recv waiting for its peer among them: register
// (pydatacopy.register) the buffers of a job before launching work that waits on peers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pydatacopy {

namespace kernels {
struct ChunkStreamArgs;
}

// PYDATACOPY_CHECK_RMA=1 (`check`): every address the library passes to an NVSHMEM RMA or signal
// call is verified just before the call (check_rma_remote, check_rma_local below), and Error is
// raised if it is wrong. PYDATACOPY_AUTO_REGISTER=0 (`auto_register` false): a buffer that is
// neither symmetric nor registered by register_memory() raises Error instead of being registered.
void set_rma_options(bool check, bool auto_register);
bool rma_check_enabled();
bool auto_register_enabled();

// Registers the CUDA allocation holding [ptr, ptr + bytes) for as long as the caller wants
// (counted: each call needs one unregister_memory). Symmetric memory needs none: a no-op.
void register_memory(const void* ptr, std::size_t bytes);
// Drops one register_memory() of the allocation holding ptr; unregisters it from NVSHMEM when
// none is left, unless a transfer relied on it (a captured graph may replay that transfer: it
// then stays cached until its memory is freed or finalize). Memory freed since registering is
// released. Throws when ptr's allocation was not registered by register_memory().
void unregister_memory(const void* ptr);
// True when [ptr, ptr + bytes) is symmetric or lies in a live registration.
bool is_rma_ready(const void* ptr, std::size_t bytes);

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

struct RegistrationStats {
  uint64_t registrations = 0;       // nvshmemx_buffer_register calls made
  uint64_t stale_dropped = 0;       // entries dropped because their allocation had gone
  std::size_t live_entries = 0;
  std::size_t registered_bytes = 0;
  uint64_t check_violations = 0;    // addresses PYDATACOPY_CHECK_RMA refused (any kind)
};
RegistrationStats registration_stats();

// Unregisters everything (finalize calls it while NVSHMEM is still up).
void unregister_all_memory();

}  // namespace pydatacopy
