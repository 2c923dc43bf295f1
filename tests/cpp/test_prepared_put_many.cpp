// put_many prepared once (prepared_put_many.hpp), its plain-C++ parts without a GPU: the table
// plan (routes, refusals, long rows cut at equal offsets) against a fake symmetric heap, and the
// table memory's stream-ordered release against a fake backend. Plus the refusals a prepared
// table gives before init.
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/prepared_put_many.hpp"

namespace {

using pydatacopy::DestinationRoute;
using pydatacopy::PreparedRow;
using pydatacopy::TransferDescriptor;
using pydatacopy_test::check;
using pydatacopy_test::check_throws;

// Two symmetric allocations, each with the peer's copy at a fixed distance.
struct FakeHeap {
  struct Allocation {
    uint64_t bytes;
    uint64_t peer_base;  // 0: not reachable by load/store
  };
  std::map<uint64_t, Allocation> live{{0x10000, {0x1000, 0x9990000}}, {0x20000, {0x100, 0x9a00000}}};
  int lookups = 0;

  DestinationRoute operator()(uint64_t dst, uint64_t bytes) {
    ++lookups;
    auto it = live.upper_bound(dst);
    if (it == live.begin()) return {};
    --it;
    if (dst + bytes > it->first + it->second.bytes) return {};
    return {true, it->second.peer_base == 0 ? 0 : it->second.peer_base + (dst - it->first)};
  }
};

void test_plan_routes_every_row_once() {
  FakeHeap heap;
  const std::vector<TransferDescriptor> rows = {
      {0x10000, 0x500000, 4096}, {0x10100, 0x600003, 7}, {0x20000, 0x700000, 0}, {0x20010, 0x700010, 0xf0}};
  const auto table = pydatacopy::plan_prepared_rows(
      rows.data(), rows.size(), [&heap](uint64_t d, uint64_t b) { return heap(d, b); }, true, 1 << 16, "test");
  check(table.size() == 3, "the empty row is left out");
  check(heap.lookups == 3, "one lookup per row that moves bytes");
  check(table[0].dst == 0x10000 && table[0].peer == 0x9990000 && table[0].src == 0x500000 && table[0].bytes == 4096,
        "row 0: symmetric address, peer address by offset, source, size");
  check(table[1].peer == 0x9990100 && table[1].bytes == 7 && table[1].src == 0x600003, "an odd row keeps its offsets");
  check(table[2].dst == 0x20010 && table[2].peer == 0x9a00010 && table[2].bytes == 0xf0, "a row in the second allocation");
  const auto rma = pydatacopy::plan_prepared_rows(
      rows.data(), rows.size(), [&heap](uint64_t d, uint64_t b) { return heap(d, b); }, false, 1 << 16, "test");
  bool all_rma = true;
  for (const PreparedRow& row : rma) all_rma = all_rma && row.peer == 0 && row.dst != 0;
  check(rma.size() == 3 && all_rma, "not direct: every row keeps its symmetric address and no peer address");
}

void test_plan_cuts_long_rows_at_equal_offsets() {
  FakeHeap heap;
  heap.live[0x100000] = {1 << 20, 0x5000000};
  const std::vector<TransferDescriptor> rows = {{0x100003, 0x800005, 10000}};
  const auto table = pydatacopy::plan_prepared_rows(
      rows.data(), rows.size(), [&heap](uint64_t d, uint64_t b) { return heap(d, b); }, true, 4096, "test");
  check(table.size() == 3, "10000 bytes in pieces of 4096: three pieces");
  uint64_t total = 0;
  bool offsets_equal = true;
  for (std::size_t i = 0; i < table.size(); ++i) {
    total += table[i].bytes;
    offsets_equal = offsets_equal && table[i].dst - 0x100003 == i * 4096 && table[i].src - 0x800005 == i * 4096 &&
                    table[i].peer - 0x5000003 == i * 4096;
  }
  check(total == 10000 && table[2].bytes == 10000 - 2 * 4096, "the pieces add up to the row, the last one shorter");
  check(offsets_equal, "dst, peer and src advance together (alignment kept)");
}

void test_plan_refuses_a_row_off_the_heap() {
  FakeHeap heap;
  auto lookup = [&heap](uint64_t d, uint64_t b) { return heap(d, b); };
  const std::vector<TransferDescriptor> past_end = {{0x10000, 0x500000, 16}, {0x10ff0, 0x500000, 17}};
  check_throws([&] { pydatacopy::plan_prepared_rows(past_end.data(), 2, lookup, true, 1 << 16, "pydatacopy.x"); },
               "pydatacopy.x: row 1: the destination, 17 bytes at 0x10ff0, does not lie in one symmetric allocation",
               "a row one byte past its allocation is refused, naming the row");
  const std::vector<TransferDescriptor> local = {{0x30000, 0x500000, 16}};
  check_throws([&] { pydatacopy::plan_prepared_rows(local.data(), 1, lookup, true, 1 << 16, "pydatacopy.x"); },
               "every destination must be a symmetric tensor or a slice of one", "a local destination is refused");
  const std::vector<TransferDescriptor> wraps = {{0x10000, UINT64_MAX - 4, 16}};
  check_throws([&] { pydatacopy::plan_prepared_rows(wraps.data(), 1, lookup, true, 1 << 16, "pydatacopy.x"); },
               "runs past the end of the address space", "a source that wraps around is refused");
}

// Memory from a counter; a release remembers the streams it had to wait for.
struct FakeBackend final : pydatacopy::StreamOrderedMemory::Backend {
  uintptr_t next = 0x1000;
  std::vector<std::pair<void*, std::vector<cudaStream_t>>> released;
  void* allocate(std::size_t bytes) override {
    void* memory = reinterpret_cast<void*>(next);
    next += bytes;
    return memory;
  }
  void release(void* memory, const std::vector<cudaStream_t>& streams) noexcept override {
    released.emplace_back(memory, streams);
  }
};

cudaStream_t stream(uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

void test_memory_waits_for_every_stream_it_ran_on() {
  FakeBackend backend;
  {
    pydatacopy::StreamOrderedMemory memory(backend, 64);
    memory.used_on(stream(7));
    memory.used_on(stream(9));
    memory.used_on(stream(7));
    check(memory.streams().size() == 2, "each stream once");
  }
  check(backend.released.size() == 1 && backend.released[0].first == reinterpret_cast<void*>(0x1000),
        "released once, when it goes out of scope");
  check(backend.released[0].second == std::vector<cudaStream_t>{stream(7), stream(9)},
        "the release waits for both streams");
}

void test_memory_moves_and_resets_once() {
  FakeBackend backend;
  pydatacopy::StreamOrderedMemory a(backend, 16);
  a.used_on(stream(3));
  pydatacopy::StreamOrderedMemory b(std::move(a));
  check(a.data() == nullptr && b.data() != nullptr && b.streams().size() == 1, "a move hands memory and streams over");
  a.reset();
  check(backend.released.empty(), "the moved-from object releases nothing");
  pydatacopy::StreamOrderedMemory c(backend, 32);
  c = std::move(b);
  check(backend.released.size() == 1 && backend.released[0].first == reinterpret_cast<void*>(0x1010),
        "assigning over c releases c's own memory first");
  c.reset();
  c.reset();
  check(backend.released.size() == 2 && backend.released[1].second.size() == 1,
        "reset releases once, with the streams that came along");
}

void test_prepared_table_before_init() {
  const TransferDescriptor row{0x10000, 0x500000, 16};
  check_throws([&] { pydatacopy::PreparedPutMany::prepare(&row, 1, 0, pydatacopy::Path::kAuto, "pydatacopy.p"); },
               "pydatacopy.p needs NVSHMEM", "prepare before init names the call");
  pydatacopy::PreparedPutMany empty;
  check_throws([&] { empty.run(nullptr); }, "moved from or released", "an empty table refuses to run");
  check(empty.released() && empty.rows() == 0, "an empty table reports released, no rows");
  empty.release();
}

}  // namespace

int main() {
  test_plan_routes_every_row_once();
  test_plan_cuts_long_rows_at_equal_offsets();
  test_plan_refuses_a_row_off_the_heap();
  test_memory_waits_for_every_stream_it_ran_on();
  test_memory_moves_and_resets_once();
  test_prepared_table_before_init();
  std::printf("%d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
