// The slices a send/recv message moves on (SendRecvEngine::message_slices), without a GPU: both
// sides of a message apply this rule to its size, so what it gives is the staging's layout.
#include <cstddef>
#include <cstdio>

#include "check.hpp"
#include "pydatacopy/send_recv.hpp"
#include "pydatacopy/settings.hpp"

namespace {

using pydatacopy::SendRecvEngine;
using pydatacopy_test::check;

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;
constexpr std::size_t kChunk = 8 * MiB;
constexpr int kPages = static_cast<int>(kChunk / (32 * KiB));  // 32 KiB pages
constexpr int kBlocks = static_cast<int>(pydatacopy::settings::kDefaultSendBlocks);
constexpr int kNarrow = 32;  // PYDATACOPY_NARROW_SEND_BLOCKS as measured (docs/perf-notes.md v25)
constexpr std::size_t kCut = static_cast<std::size_t>(pydatacopy::settings::kNarrowMessageBytes);

int slices(std::size_t bytes, int blocks = kBlocks, int narrow = kNarrow, int resident = 66) {
  return SendRecvEngine::message_slices(bytes, kChunk, kPages, blocks, narrow, resident);
}

void test_the_defaults() {
  // The measured narrow count is the default; 1024 (the most blocks) turns the cut off: min(blocks,
  // narrow) is then blocks for every block count, so every size takes the rule from before the cut.
  check(pydatacopy::settings::kDefaultNarrowSendBlocks == kNarrow, "the default narrow count is the measured 32");
  const int off = static_cast<int>(pydatacopy::settings::kMaxSendBlocks);
  check(slices(4 * MiB, kBlocks, off) == kBlocks, "narrow 1024: 4 MiB on 128 slices, as before the cut");
  check(slices(1 * MiB, kBlocks, off) == 32, "narrow 1024: 1 MiB on its 32 pages");
  check(slices(4 * MiB, 256, off) == 128 && slices(16 * MiB, 256, off) == 256,
        "narrow 1024, blocks=256: 4 MiB on its 128 pages, 16 MiB on 256 slices, as before the cut");
}

void test_the_most_slices_bound_every_message() {
  // A send writes the header of each page below most_message_slices: every count a message can
  // have, or a batch can raise it to, is at most that.
  for (int narrow : {1, 8, 32, 128, 1024})
    for (int blocks : {1, 32, 128, 256, 1024})
      for (std::size_t bytes : {std::size_t{0}, 4 * KiB, 1 * MiB, 4 * MiB + 3, kCut - 1, kCut, 256 * MiB})
        check(slices(bytes, blocks, narrow) <= SendRecvEngine::most_message_slices(kPages, blocks, 66),
              "no message has more slices than most_message_slices");
  check(SendRecvEngine::most_message_slices(kPages, 128, 66) == 128, "the defaults: 128");
  check(SendRecvEngine::most_message_slices(kPages, 1024, 1) == 32, "one resident block: 32");
}

void test_a_narrow_count() {
  check(kBlocks == 128 && kCut == 64 * MiB, "the defaults this test was written for");
  check(slices(0) == 1, "an empty message: one slice (its header)");
  check(slices(4 * KiB) == 1, "4 KiB: one slice (32 KiB a slice at least)");
  check(slices(256 * KiB) == 8, "256 KiB: 8 slices of 32 KiB");
  check(slices(1 * MiB) == 32, "1 MiB: 32 slices");
  check(slices(4 * MiB) == kNarrow, "4 MiB: the narrow count, not 128");
  check(slices(16 * MiB) == kNarrow, "16 MiB: the narrow count");
  check(slices(kCut - 1) == kNarrow, "one byte under the cut: narrow");
  check(slices(kCut) == kBlocks, "at the cut: PYDATACOPY_SEND_BLOCKS");
  check(slices(256 * MiB) == kBlocks, "256 MiB: PYDATACOPY_SEND_BLOCKS");
}

void test_settings_bound_each_other() {
  check(slices(4 * MiB, 128, 128) == 128, "narrow = blocks: every size as before the cut existed");
  check(slices(4 * MiB, 16, 32) == 16, "blocks under the narrow count: blocks bounds every size");
  check(slices(kCut, 16, 32) == 16, "blocks at the cut");
  check(slices(4 * MiB, 128, 8) == 8, "a smaller narrow count");
  check(slices(kCut, 128, 8) == 128, "a smaller narrow count leaves the large messages alone");
}

void test_the_grid_and_the_pages_bound_it() {
  check(slices(kCut, 1024, 32, 1) == 32, "one resident block drives at most 32 slices");
  check(slices(256 * MiB, 1024, 1024, 66) == kPages, "no more slices than a chunk's pages");
  check(SendRecvEngine::message_slices(4 * MiB, 64 * KiB, 2, 128, 32, 66) == 2, "a 64 KiB chunk has 2 pages");
}

void test_zero_copy_slices() {
  // A zero-copy message is not narrowed: one contiguous part per resident block, on every SM the
  // PE may use (the narrow count left half of one H100's 66 idle at 4-32 MiB).
  const auto zc = [](std::size_t bytes, int blocks = kBlocks, int resident = 66) {
    return SendRecvEngine::zero_copy_slices(bytes, kChunk, kPages, blocks, resident);
  };
  check(zc(4 * MiB) == 66 && zc(16 * MiB) == 66 && zc(kCut - 1) == 66,
        "4 MiB to the cut: one slice per resident block");
  check(zc(256 * MiB) == 66, "above the cut: one slice per resident block");
  check(zc(1 * MiB) == 32, "1 MiB: its 32 slices of 32 KiB, as staged");
  check(zc(4 * KiB) == 1, "4 KiB: one slice");
  check(zc(16 * MiB, 16) == 16, "PYDATACOPY_SEND_BLOCKS still bounds it");
  check(zc(16 * MiB, kBlocks, 1) == 1, "one resident block: one slice");
  for (std::size_t bytes : {std::size_t{0}, 4 * KiB, 1 * MiB, 4 * MiB + 3, kCut - 1, kCut, 256 * MiB})
    for (int resident : {1, 8, 66, 132})
      check(zc(bytes, kBlocks, resident) >= 1 && zc(bytes, kBlocks, resident) <= resident &&
                zc(bytes, kBlocks, resident) <= SendRecvEngine::most_message_slices(kPages, kBlocks, resident),
            "a zero-copy message: between 1 and the resident blocks, within most_message_slices (a send's "
            "staged fallback on these slices writes every header a receiver slice reads)");
}

}  // namespace

int main() {
  test_the_defaults();
  test_the_most_slices_bound_every_message();
  test_a_narrow_count();
  test_settings_bound_each_other();
  test_the_grid_and_the_pages_bound_it();
  test_zero_copy_slices();
  std::printf("test_message_slices: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
