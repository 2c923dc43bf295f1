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

// ---- symmetric_malloc's room vote, as plain arithmetic (tested without a GPU) ----
//
// NVSHMEM grows each PE's heap into its GPU's free memory, and when it cannot it ends every
// process. So before nvshmem_malloc every PE votes, in one blocking barrier word, the room it
// has: the unused part of its heap (NVSHMEM_SYMMETRIC_SIZE less live allocations; 0 when
// another library started NVSHMEM, whose allocations are not visible here) and the room
// on its GPU (free memory less a reserve). PEs on one GPU share that GPU's free memory: a
// request fits when, for every GPU, the growth beyond each heap's unused part, summed over the
// PEs on that GPU, fits the GPU's room. Every PE sees every vote and every PE's GPU (gathered by
// init_nvshmem), so all decide alike.
struct RoomVote {
  uint64_t heap_room_mib = 0;  // the heap's unused part, rounded down to MiB
  uint64_t gpu_room_mib = 0;   // the GPU's free memory less the reserve, rounded down to MiB
};
// Packs both into one word, 32 bits each (MiB: up to 4 PiB, saturated beyond).
uint64_t pack_room_vote(std::size_t heap_room_bytes, std::size_t gpu_room_bytes);
RoomVote unpack_room_vote(uint64_t word);
// The reserve kept free on a GPU that `pes_on_gpu` PEs share: 1 GiB or 2% of the GPU, whichever
// is more, for the CUDA contexts' working memory, plus NVSHMEM's growth granularity (512 MiB,
// NVSHMEM_CUMEM_GRANULARITY's default) for each further PE, since each rounds its own growth up.
std::size_t gpu_reserve_bytes(std::size_t gpu_total_bytes, int pes_on_gpu);
// A PE's heap room: NVSHMEM_SYMMETRIC_SIZE less pydatacopy's live allocations when pydatacopy
// started NVSHMEM; 0 when it joined one another library started (torch's symmetric memory),
// whose allocations it cannot see: every request then counts as heap growth.
std::size_t heap_room_bytes(std::size_t configured_bytes, std::size_t live_bytes, bool owns_nvshmem);
// Empty when every PE asked the same size (`sizes`, indexed by PE, gathered in a barrier before
// the room vote); else the refusal, naming the sizes and which PEs asked each.
std::string symmetric_size_refusal(const std::vector<uint64_t>& sizes);
// Empty when `bytes` on every PE fits; else the refusal, listing the room per GPU and per PE
// and what to do. `gpu_of_pe` and `votes` are indexed by PE (same length).
std::string symmetric_room_refusal(std::size_t bytes, const std::vector<uint64_t>& gpu_of_pe,
                                   const std::vector<uint64_t>& votes);

namespace detail {
std::string gib(std::size_t bytes);  // "1.5 GiB", three significant digits
}  // namespace detail

// Collective: waits for this PE's device work to finish, then frees on every PE.
void symmetric_free(void* ptr);

// True when [ptr, ptr + bytes) lies inside one live pydatacopy symmetric allocation.
bool is_symmetric(const void* ptr, std::size_t bytes);

// Address at which this process can load/store `pe`'s copy of the symmetric `ptr`, or null when
// `pe` is not directly reachable (another node, or PYDATACOPY_FORCE_RMA=1).
void* peer_pointer(const void* ptr, int pe);

// A transfer's symmetric side in one lookup: whether [ptr, ptr + bytes) lies in one live
// pydatacopy allocation and, if so, `pe`'s copy of ptr through load/store (null when `pe` is not
// directly reachable, under PYDATACOPY_FORCE_RMA, or out of range: the caller checks the range).
// Every PE's copy of an allocation is resolved once, by symmetric_malloc.
struct SymmetricRoute {
  bool symmetric = false;
  void* peer = nullptr;
};
SymmetricRoute symmetric_route(const void* ptr, std::size_t bytes, int pe);

// PYDATACOPY_FORCE_RMA=1 makes every path behave as if no peer were directly reachable, so the
// NVSHMEM RMA path a peer on another server takes is exercised on one machine.
// Read from the environment once, at load and again by init_nvshmem (it is asked on every put
// and send); set_rma_forced changes it at run time (tests).
bool rma_forced();
void set_rma_forced(bool forced);
void read_rma_forced_from_environment();
// init: NVSHMEM_SYMMETRIC_SIZE, read once (symmetric_malloc's room vote counts with it).
void read_symmetric_size_from_environment();

// Number of streaming multiprocessors of the bound device (cached).
int multiprocessor_count();

}  // namespace pydatacopy
