// PEs sharing a GPU, as plain C++ (no CUDA, no NVSHMEM; tested by tests/cpp/test_shared_gpu.cpp):
// the GPU identity hash init_nvshmem gathers, and symmetric_malloc's room vote.
#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kGrowthGranularity = std::size_t{512} << 20;  // NVSHMEM_CUMEM_GRANULARITY's default
constexpr uint64_t kMaxVoteMib = 0xffffffffull;  // a vote's half: 32 bits of MiB

}  // namespace

namespace detail {

std::string gib(std::size_t bytes) {
  std::ostringstream text;
  text.precision(3);
  text << static_cast<double>(bytes) / static_cast<double>(kGiB) << " GiB";
  return text.str();
}

}  // namespace detail

uint64_t gpu_identity_of(const unsigned char (&uuid)[16], const std::string& fallback) {
  uint64_t hash = 14695981039346656037ull;  // FNV-1a, 64 bits
  const auto mix = [&hash](unsigned char byte) {
    hash ^= byte;
    hash *= 1099511628211ull;
  };
  bool all_zero = true;
  for (unsigned char byte : uuid) all_zero = all_zero && byte == 0;
  if (all_zero) {
    for (char c : fallback) mix(static_cast<unsigned char>(c));
  } else {
    for (unsigned char byte : uuid) mix(byte);
  }
  return hash;
}

uint64_t pack_room_vote(std::size_t heap_room_bytes, std::size_t gpu_room_bytes) {
  const auto mib = [](std::size_t bytes) {
    return std::min<uint64_t>(static_cast<uint64_t>(bytes) >> 20, kMaxVoteMib);
  };
  return mib(heap_room_bytes) << 32 | mib(gpu_room_bytes);
}

RoomVote unpack_room_vote(uint64_t word) {
  RoomVote vote;
  vote.heap_room_mib = word >> 32;
  vote.gpu_room_mib = word & kMaxVoteMib;
  return vote;
}

std::size_t gpu_reserve_bytes(std::size_t gpu_total_bytes, int pes_on_gpu) {
  const std::size_t further = pes_on_gpu > 1 ? static_cast<std::size_t>(pes_on_gpu - 1) : 0;
  return std::max<std::size_t>(kGiB, gpu_total_bytes / 50) + further * kGrowthGranularity;
}

std::size_t heap_room_bytes(std::size_t configured_bytes, std::size_t live_bytes, bool owns_nvshmem) {
  return owns_nvshmem && configured_bytes > live_bytes ? configured_bytes - live_bytes : 0;
}

std::string symmetric_size_refusal(const std::vector<uint64_t>& sizes) {
  std::vector<std::pair<uint64_t, std::vector<std::size_t>>> groups;  // in the order of first PE
  for (std::size_t pe = 0; pe < sizes.size(); ++pe) {
    auto same = std::find_if(groups.begin(), groups.end(),
                             [&](const auto& group) { return group.first == sizes[pe]; });
    if (same == groups.end()) {
      groups.push_back({sizes[pe], {}});
      same = groups.end() - 1;
    }
    same->second.push_back(pe);
  }
  if (groups.size() <= 1) return {};
  constexpr std::size_t kPesNamed = 8;  // per size: a job of thousands of PEs stays readable
  std::ostringstream text;
  text << "pydatacopy.empty / symmetric_malloc is collective and needs the same size on every "
          "PE, but the PEs asked " << groups.size() << " different sizes:";
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& pes = groups[i].second;
    text << (i ? ";" : "") << " " << groups[i].first << " bytes on PE" << (pes.size() > 1 ? "s" : "");
    for (std::size_t j = 0; j < pes.size() && j < kPesNamed; ++j) text << (j ? "," : "") << " " << pes[j];
    if (pes.size() > kPesNamed) text << " and " << pes.size() - kPesNamed << " more";
  }
  text << ". Nothing was allocated on any PE. Allocate the same shape and dtype on every PE, in "
          "the same order (a PE that skipped or added an allocation asks the next one's size)";
  return text.str();
}

std::string symmetric_room_refusal(std::size_t bytes, const std::vector<uint64_t>& gpu_of_pe,
                                   const std::vector<uint64_t>& votes) {
  PDC_REQUIRE(gpu_of_pe.size() == votes.size(),
              "symmetric_room_refusal: " << gpu_of_pe.size() << " GPU identities for "
                                         << votes.size() << " votes");
  struct Gpu {
    std::vector<std::size_t> pes;
    uint64_t need = 0;                  // bytes the PEs on it grow their heaps by, together
    uint64_t room = ~uint64_t{0};       // the least room a PE on it saw, in bytes
  };
  std::vector<Gpu> gpus;  // in the order of their first PE
  std::map<uint64_t, std::size_t> index_of;
  std::vector<uint64_t> growth(votes.size(), 0), heap_room(votes.size(), 0);
  for (std::size_t pe = 0; pe < votes.size(); ++pe) {
    const RoomVote vote = unpack_room_vote(votes[pe]);
    heap_room[pe] = vote.heap_room_mib << 20;
    growth[pe] = bytes > heap_room[pe] ? bytes - heap_room[pe] : 0;
    auto found = index_of.emplace(gpu_of_pe[pe], gpus.size());
    if (found.second) gpus.emplace_back();
    Gpu& gpu = gpus[found.first->second];
    gpu.pes.push_back(pe);
    gpu.need = gpu.need > ~uint64_t{0} - growth[pe] ? ~uint64_t{0} : gpu.need + growth[pe];
    gpu.room = std::min<uint64_t>(gpu.room, vote.gpu_room_mib << 20);
  }
  std::size_t short_gpus = 0;
  for (const Gpu& gpu : gpus) short_gpus += gpu.need > gpu.room;
  if (short_gpus == 0) return {};

  std::ostringstream text;
  text << "pydatacopy.empty / symmetric_malloc: " << bytes << " bytes (" << detail::gib(bytes)
       << ") of symmetric memory asked on every PE, and the PEs of " << short_gpus << " of "
       << gpus.size() << " GPU(s) cannot hold them together (PEs on one GPU share its memory). "
          "Each PE takes what its NVSHMEM heap has unused first, and grows the heap by the rest "
          "into its GPU's free memory, less a reserve. Room per GPU:";
  bool shared = false;
  for (const Gpu& gpu : gpus) {
    if (gpu.need <= gpu.room) continue;
    shared = shared || gpu.pes.size() > 1;
    text << " GPU of PE" << (gpu.pes.size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < gpu.pes.size(); ++i) text << (i ? "," : "") << " " << gpu.pes[i];
    text << ": " << detail::gib(gpu.room) << " free after the reserve, " << detail::gib(gpu.need)
         << " needed together (per PE:";
    for (std::size_t i = 0; i < gpu.pes.size(); ++i) {
      const std::size_t pe = gpu.pes[i];
      text << (i ? ";" : "") << " PE " << pe << " heap unused " << detail::gib(heap_room[pe])
           << ", grows " << detail::gib(growth[pe]);
    }
    text << ");";
  }
  if (short_gpus < gpus.size()) text << " the other GPU(s) have room;";
  text << " Nothing was allocated on any PE. Ask for less";
  if (shared) text << " (PEs sharing a GPU can each have about its room divided by their number)";
  text << ", free symmetric tensors (pydatacopy.free), release GPU memory "
          "(torch.cuda.empty_cache()) on every PE";
  if (shared) text << ", or put fewer ranks on each GPU (PYDATACOPY_RANKS_PER_GPU)";
  return text.str();
}

}  // namespace pydatacopy
