// The symmetric heap's internals, for the core, its bindings and its C++ tests only (not
// installed): symmetric_malloc's room vote as plain arithmetic, a transfer's route lookup, and
// what init reads once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pydatacopy/symmetric.hpp"

namespace pydatacopy {

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

// A transfer's symmetric side in one lookup: whether [ptr, ptr + bytes) lies in one live
// pydatacopy allocation and, if so, `pe`'s copy of ptr through load/store (null when `pe` is not
// directly reachable, under PYDATACOPY_FORCE_RMA, or out of range: the caller checks the range).
// Every PE's copy of an allocation is resolved once, by symmetric_malloc.
struct SymmetricRoute {
  bool symmetric = false;
  void* peer = nullptr;
};
SymmetricRoute symmetric_route(const void* ptr, std::size_t bytes, int pe);

// init: PYDATACOPY_FORCE_RMA and NVSHMEM_SYMMETRIC_SIZE, each read once (the room vote counts
// with the heap size NVSHMEM started with).
void read_rma_forced_from_environment();
void read_symmetric_size_from_environment();

// Number of streaming multiprocessors of the bound device (cached).
int multiprocessor_count();

}  // namespace pydatacopy
