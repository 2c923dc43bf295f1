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

struct RegistrationStats {
  uint64_t registrations = 0;       // nvshmemx_buffer_register calls made
  uint64_t stale_dropped = 0;       // entries dropped because their allocation had gone
  std::size_t live_entries = 0;
  std::size_t registered_bytes = 0;
  uint64_t check_violations = 0;    // addresses PYDATACOPY_CHECK_RMA refused (any kind)
};
RegistrationStats registration_stats();

}  // namespace pydatacopy
