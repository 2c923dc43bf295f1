// PEs sharing a GPU, without a GPU: the GPU identity hash and symmetric_malloc's room vote
// (src/core/shared_gpu.cpp). The vote must refuse what the PEs of one GPU cannot hold together
// (the old vote, whole-GPU free memory per PE, let k PEs on one GPU each ask up to "free", and
// NVSHMEM then ended every process), and must not refuse what fits.
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "check.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;

constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;

bool contains_silently(const std::string& text, const std::string& words) {
  return text.find(words) != std::string::npos;
}

bool contains(const std::string& text, const std::string& words) {
  const bool found = text.find(words) != std::string::npos;
  if (!found) std::printf("  '%s' not in: %s\n", words.c_str(), text.c_str());
  return found;
}

}  // namespace

int main() {
  using namespace pydatacopy;

  // ---- the vote word ----
  const RoomVote vote = unpack_room_vote(pack_room_vote(3 * GiB + 5, 100 * GiB + MiB - 1));
  check(vote.heap_room_mib == 3 * 1024, "heap room rounds down to MiB");
  check(vote.gpu_room_mib == 100 * 1024, "GPU room rounds down to MiB");
  const RoomVote huge = unpack_room_vote(pack_room_vote(~std::size_t{0}, ~std::size_t{0}));
  check(huge.heap_room_mib == 0xffffffffull && huge.gpu_room_mib == 0xffffffffull,
        "rooms past 4 PiB saturate instead of wrapping into each other");
  check(unpack_room_vote(pack_room_vote(0, 7 * MiB)).heap_room_mib == 0, "halves stay apart");

  // ---- the reserve ----
  check(gpu_reserve_bytes(16 * GiB, 1) == GiB, "small GPU, one PE: 1 GiB");
  check(gpu_reserve_bytes(150 * GiB, 1) == 3 * GiB, "large GPU, one PE: 2%");
  check(gpu_reserve_bytes(150 * GiB, 4) == 3 * GiB + 3 * 512 * MiB, "each further PE: 512 MiB");

  // ---- the decision ----
  const std::size_t free_room = 100 * GiB;  // per GPU, after the reserve
  const uint64_t gpu_a = 0xa, gpu_b = 0xb;
  const uint64_t one_gib_heap = pack_room_vote(GiB, free_room);
  const std::size_t ask = 60 * GiB;  // 0.6 x the room: fits one PE, not two on one GPU

  check(symmetric_room_refusal(ask, {gpu_a, gpu_b}, {one_gib_heap, one_gib_heap}).empty(),
        "one PE per GPU, 0.6 x free each: granted");
  const std::string two = symmetric_room_refusal(ask, {gpu_a, gpu_a}, {one_gib_heap, one_gib_heap});
  check(!two.empty(), "two PEs on one GPU, 0.6 x free each: refused (the old vote granted it)");
  check(contains(two, "GPU of PEs 0, 1: 100 GiB free after the reserve, 118 GiB needed together"),
        "the refusal gives the GPU's room and what its PEs need together");
  check(contains(two, "PE 0 heap unused 1 GiB, grows 59 GiB; PE 1 heap unused 1 GiB, grows 59 GiB"),
        "the refusal gives each PE's part");
  check(contains(two, "Nothing was allocated on any PE") &&
            contains(two, "PYDATACOPY_RANKS_PER_GPU") && contains(two, "pydatacopy.free"),
        "the refusal says what to do");
  const std::vector<uint64_t> four(4, one_gib_heap);
  check(!symmetric_room_refusal(ask, {gpu_a, gpu_a, gpu_a, gpu_a}, four).empty(),
        "four PEs on one GPU, 0.6 x free each: refused");
  check(symmetric_room_refusal(24 * GiB, {gpu_a, gpu_a, gpu_a, gpu_a}, four).empty(),
        "four PEs on one GPU, 24 GiB each (23 GiB growth each, 92 of 100 GiB): granted");
  check(!symmetric_room_refusal(27 * GiB, {gpu_a, gpu_a, gpu_a, gpu_a}, four).empty(),
        "four PEs on one GPU, 27 GiB each (104 of 100 GiB): refused");
  check(symmetric_room_refusal(ask, {gpu_a, gpu_b, gpu_a, gpu_b}, four).empty() == false,
        "two GPUs with two PEs each, interleaved: refused");
  check(symmetric_room_refusal(49 * GiB, {gpu_a, gpu_b, gpu_a, gpu_b}, four).empty(),
        "two GPUs with two PEs each, 49 GiB each (96 of 100 GiB per GPU): granted");
  const std::string mixed =
      symmetric_room_refusal(ask, {gpu_a, gpu_b, gpu_b}, {one_gib_heap, one_gib_heap, one_gib_heap});
  check(contains(mixed, "the PEs of 1 of 2 GPU(s)") && contains(mixed, "GPU of PEs 1, 2") &&
            contains(mixed, "the other GPU(s) have room") && !contains_silently(mixed, "GPU of PE 0:"),
        "only the GPU short of room is listed");

  // The heap's unused part needs no GPU memory: a request inside it is granted on a full GPU.
  const uint64_t full_gpu = pack_room_vote(4 * GiB, 0);
  check(symmetric_room_refusal(2 * GiB, {gpu_a, gpu_a}, {full_gpu, full_gpu}).empty(),
        "inside every heap's unused part: granted with no free GPU memory");
  check(!symmetric_room_refusal(4 * GiB + MiB, {gpu_a, gpu_a}, {full_gpu, full_gpu}).empty(),
        "one MiB past the heap on a full GPU: refused");
  // The least room a PE of the GPU saw counts (they measured at slightly different moments).
  check(!symmetric_room_refusal(40 * GiB, {gpu_a, gpu_a},
                                {pack_room_vote(0, 100 * GiB), pack_room_vote(0, 70 * GiB)}).empty(),
        "the smaller of two measurements of one GPU's room counts");
  // Sums that would overflow 64 bits saturate.
  check(!symmetric_room_refusal(~std::size_t{0}, {gpu_a, gpu_a}, {one_gib_heap, one_gib_heap}).empty(),
        "2 x (2^64 - 1) bytes on one GPU: refused, not wrapped around");
  check(symmetric_room_refusal(ask, {}, {}).empty(), "no PEs: nothing to refuse");
  check_throws([&] { symmetric_room_refusal(ask, {gpu_a}, {one_gib_heap, one_gib_heap}); },
               "1 GPU identities for 2 votes", "mismatched lengths: an error, not a read past the end");

  // ---- the heap's unused part ----
  check(heap_room_bytes(4 * GiB, GiB, true) == 3 * GiB, "our NVSHMEM: configured less live");
  check(heap_room_bytes(GiB, 2 * GiB, true) == 0, "live past the configured size: no room, no wrap");
  check(heap_room_bytes(4 * GiB, 0, false) == 0,
        "NVSHMEM started by torch (its allocations unseen): no unused part counted");
  // With torch's NVSHMEM, a request inside the configured heap on a GPU with no room left: the
  // old vote (configured - live) granted it, and the heap growth it needs is NVSHMEM's exit().
  const uint64_t joined_full_gpu = pack_room_vote(heap_room_bytes(4 * GiB, 0, false), 0);
  check(!symmetric_room_refusal(GiB, {gpu_a, gpu_b}, {joined_full_gpu, joined_full_gpu}).empty(),
        "joined NVSHMEM, full GPU, 1 GiB asked: refused");

  // ---- the sizes asked ----
  check(symmetric_size_refusal({4096, 4096, 4096}).empty(), "one size on every PE: agreed");
  check(symmetric_size_refusal({}).empty() && symmetric_size_refusal({7}).empty(), "0 or 1 PE: agreed");
  const std::string sizes = symmetric_size_refusal({4096, 8192, 4096, 0});
  check(!sizes.empty(), "different sizes: refused on every PE (the old vote let some PEs allocate)");
  check(contains(sizes, "3 different sizes: 4096 bytes on PEs 0, 2; 8192 bytes on PE 1; 0 bytes on PE 3"),
        "the refusal names every size and its PEs");
  check(contains(sizes, "Nothing was allocated on any PE"), "the refusal says nothing was allocated");
  std::vector<uint64_t> many(20, 64);
  many[19] = 65;
  check(contains(symmetric_size_refusal(many), "64 bytes on PEs 0, 1, 2, 3, 4, 5, 6, 7 and 11 more; 65 bytes on PE 19"),
        "many PEs: the first 8 of a size named, the rest counted");

  // ---- the GPU identity ----
  unsigned char uuid[16] = {0x1f, 0x2e, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  unsigned char other[16] = {0x1f, 0x2e, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17};
  unsigned char none[16] = {};
  check(gpu_identity_of(uuid, "host-a") == gpu_identity_of(uuid, "host-b"),
        "one UUID, one GPU, whichever host name (containers of one machine share the GPU)");
  check(gpu_identity_of(uuid, "x") != gpu_identity_of(other, "x"), "two UUIDs, two GPUs");
  check(gpu_identity_of(none, "host-a/boot/pci:0:1:0") != gpu_identity_of(none, "host-a/boot/pci:0:2:0"),
        "no UUID: the PCI address tells GPUs apart");
  check(gpu_identity_of(none, "a") != gpu_identity_of(uuid, "a"), "no UUID is not a UUID");

  std::printf("test_shared_gpu: %d passed, %d failed\n", pydatacopy_test::passed,
              pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
