// Symmetric memory: allocations on the NVSHMEM heap that every PE holds at the same offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pydatacopy {

// Collective: every PE calls it with the same size, in the same order. Throws, on every PE
// alike with nothing allocated anywhere, when the PEs asked different sizes
// (symmetric_size_refusal) or when the PEs sharing some GPU cannot hold the request together
// (see symmetric_room_refusal); and (naming NVSHMEM_SYMMETRIC_SIZE and the bytes needed) when
// the heap is too small. Never returns null.
void* symmetric_malloc(std::size_t bytes);

// Collective: waits for this PE's device work to finish, then frees on every PE.
void symmetric_free(void* ptr);

// True when [ptr, ptr + bytes) lies inside one live pydatacopy symmetric allocation.
bool is_symmetric(const void* ptr, std::size_t bytes);

// Address at which this process can load/store `pe`'s copy of the symmetric `ptr`, or null when
// `pe` is not directly reachable (another node, or PYDATACOPY_FORCE_RMA=1).
void* peer_pointer(const void* ptr, int pe);

// PYDATACOPY_FORCE_RMA=1 makes every path behave as if no peer were directly reachable, so the
// NVSHMEM RMA path a peer on another server takes is exercised on one machine.
// Read from the environment once, at load and again by init_nvshmem (it is asked on every put
// and send); set_rma_forced changes it at run time (tests).
bool rma_forced();
void set_rma_forced(bool forced);

}  // namespace pydatacopy
