// Zero-copy send/recv bookkeeping (zero_copy.hpp) against a fake CUDA, without a GPU: the
// exporter/importer handshake through the mailbox, freed and reused memory (buffer IDs),
// eviction, closes deferred until the channel is idle, memory that cannot be exported, captures,
// and the rings' wraparound.
#include <chrono>
#include <cstdint>
#include <deque>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include <unistd.h>

#include "check.hpp"
#include "send_recv/zero_copy.hpp"

namespace {

using pydatacopy_test::check;
namespace zc = pydatacopy::zero_copy;

const void* at(std::uintptr_t address) { return reinterpret_cast<const void*>(address); }

// The range of `ranges` (start -> a value whose size `bytes_of` gives) holding `address`, or end().
template <class Map, class BytesOf>
typename Map::const_iterator holding(const Map& ranges, std::uintptr_t address, BytesOf bytes_of) {
  auto it = ranges.upper_bound(address);
  if (it == ranges.begin()) return ranges.end();
  --it;
  return address < it->first + bytes_of(it->second) ? it : ranges.end();
}

// One fake for both processes of a pair: the receiver's allocations (buffer IDs, exportable or
// not), the sender's opened handles, and each side's channel idle or busy.
class FakeCuda final : public zc::Backend {
 public:
  struct Live {
    std::size_t bytes;
    unsigned long long id;
    bool exportable;
  };
  std::map<std::uintptr_t, Live> allocations;
  std::map<uintptr_t, int> open;  // mapped address -> the allocation id it maps
  int exports = 0, opens = 0, closes = 0;
  bool fail_open = false;
  bool send_idle = true, recv_idle = true;
  unsigned long long next_id = 1;
  std::uintptr_t next_mapping = 0x7000'0000'0000;

  void allocate(std::uintptr_t base, std::size_t bytes, bool exportable = true) {
    allocations[base] = Live{bytes, next_id++, exportable};
  }
  void release(std::uintptr_t base) { allocations.erase(base); }

  pydatacopy::Allocation query(const void* ptr) override {
    pydatacopy::Allocation a;
    a.queried = ptr;
    const auto it = holding(allocations, reinterpret_cast<std::uintptr_t>(ptr), [](const Live& l) { return l.bytes; });
    if (it == allocations.end()) return a;
    a.base = it->first;
    a.bytes = it->second.bytes;
    a.buffer_id = it->second.id;
    a.cuda_memory = true;
    return a;
  }
  bool export_handle(std::uintptr_t base, zc::IpcHandle* handle) override {
    ++exports;
    auto it = allocations.find(base);
    if (it == allocations.end() || !it->second.exportable) return false;
    std::memset(handle->bytes, 0, sizeof(handle->bytes));
    std::memcpy(handle->bytes, &it->second.id, sizeof(it->second.id));
    return true;
  }
  void* open_handle(const zc::IpcHandle& handle) override {
    ++opens;
    if (fail_open) return nullptr;
    int id = 0;
    std::memcpy(&id, handle.bytes, sizeof(id));
    for (const auto& entry : open)
      if (entry.second == id) return nullptr;  // CUDA: a handle opens once per process
    const std::uintptr_t mapped = next_mapping;
    next_mapping += 1 << 30;
    open[mapped] = id;
    return reinterpret_cast<void*>(mapped);
  }
  void close_handle(void* mapped) override {
    ++closes;
    open.erase(reinterpret_cast<std::uintptr_t>(mapped));
  }
  bool channel_idle(bool send, int) override { return send ? send_idle : recv_idle; }
};

// The driver's virtual memory as both processes of a pair see it: the receiver's reservations
// and the chunks mapped into them (torch's expandable segments), the descriptors in flight, and
// the sender's mirrors and the chunks it mapped there.
class FakeVmm final : public zc::Backend {
 public:
  struct Mapped {
    std::size_t bytes;
    uint64_t id;
  };
  std::map<std::uintptr_t, std::size_t> reservations;  // the receiver's: base -> bytes
  std::map<std::uintptr_t, Mapped> chunk_map;           // the receiver's chunks: address -> chunk
  std::map<uint64_t, uint64_t> in_flight;               // sequence -> the chunk id its descriptor holds
  std::map<int, uint64_t> fds;                          // the sender's descriptors taken: fd -> chunk id
  std::map<uint64_t, Mapped> sender_map;                // the sender's mapped ranges: address -> chunk
  std::set<uint64_t> sender_reserved;
  bool exportable = true, send_idle = true, recv_idle = true;
  bool socket_ready = true;  // can_send_chunks
  int fail_maps = 0;  // the next so many map_chunk calls fail
  int exports = 0, maps = 0, unmaps = 0, reservations_freed = 0, next_fd = 100;
  uint64_t next_id = 1, next_reservation = 0x7f00'0000'0000;

  void reserve_at(std::uintptr_t base, std::size_t bytes) { reservations[base] = bytes; }
  void map_at(std::uintptr_t address, std::size_t bytes) { chunk_map[address] = Mapped{bytes, next_id++}; }
  void unmap_at(std::uintptr_t address) { chunk_map.erase(address); }

  pydatacopy::Allocation query(const void* ptr) override {
    pydatacopy::Allocation a;
    a.queried = ptr;
    const auto r = holding(reservations, reinterpret_cast<std::uintptr_t>(ptr), [](std::size_t bytes) { return bytes; });
    std::vector<zc::Chunk> here;
    if (r == reservations.end() || !chunks(ptr, 1, &here)) return a;  // unmapped: CUDA does not know it
    a.base = r->first;
    a.bytes = r->second;
    a.buffer_id = here[0].id;
    a.cuda_memory = true;
    a.vmm_fd = true;
    return a;
  }
  bool chunks(const void* ptr, std::size_t bytes, std::vector<zc::Chunk>* out) override {
    out->clear();
    const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
    for (std::uintptr_t at = begin; at < begin + (bytes == 0 ? 1 : bytes);) {
      const auto c = holding(chunk_map, at, [](const Mapped& m) { return m.bytes; });
      if (c == chunk_map.end()) return false;
      out->push_back(zc::Chunk{c->first, c->second.bytes, c->second.id});
      at = c->first + c->second.bytes;
    }
    return true;
  }
  bool can_send_chunks(int) override { return socket_ready; }
  bool send_chunk(int, std::uintptr_t chunk_base, uint64_t sequence) override {
    ++exports;
    auto c = chunk_map.find(chunk_base);
    if (!exportable || c == chunk_map.end()) return false;
    in_flight[sequence] = c->second.id;
    return true;
  }
  int take_chunk_fd(int, uint64_t sequence) override {
    auto it = in_flight.find(sequence);
    if (it == in_flight.end()) return -1;
    fds[next_fd] = it->second;
    in_flight.erase(it);
    return next_fd++;
  }
  uint64_t reserve(std::size_t bytes) override {
    const uint64_t address = next_reservation;
    next_reservation += bytes + (1ull << 30);
    sender_reserved.insert(address);
    return address;
  }
  void free_reservation(uint64_t address, std::size_t) override {
    sender_reserved.erase(address);
    ++reservations_freed;
  }
  uint64_t map_chunk(int fd, uint64_t address, std::size_t bytes) override {
    auto it = fds.find(fd);
    if (it == fds.end()) return 0;
    const uint64_t id = it->second;
    fds.erase(it);  // closed either way
    if (address == 0) return 0;
    if (fail_maps > 0) {
      --fail_maps;
      return 0;
    }
    for (const auto& m : sender_map)
      check(!(m.first < address + bytes && address < m.first + m.second.bytes),
            "the driver never maps over an address still mapped");
    sender_map[address] = Mapped{bytes, id};
    ++maps;
    return 0x1000 + id;
  }
  void unmap_chunk(uint64_t address, std::size_t, uint64_t) override {
    check(last_send_answer, "a chunk is unmapped only once the send channel was found idle");
    sender_map.erase(address);
    ++unmaps;
  }
  void* open_handle(const zc::IpcHandle&) override { return nullptr; }
  bool export_handle(std::uintptr_t, zc::IpcHandle*) override { return false; }
  void close_handle(void*) override {}
  std::deque<bool> send_idle_script;  // the next answers about the send channel, then send_idle
  bool last_send_answer = true;
  bool channel_idle(bool send, int) override {
    if (!send) return recv_idle;
    last_send_answer = send_idle;
    if (!send_idle_script.empty()) {
      last_send_answer = send_idle_script.front();
      send_idle_script.pop_front();
    }
    return last_send_answer;
  }
};

struct Pair {
  FakeCuda cuda;
  std::unique_ptr<zc::Mailbox> mailbox{new zc::Mailbox()};  // value-initialised: empty rings
  uint64_t table[zc::kTableEntries] = {};
  zc::Exporter exporter{cuda, mailbox.get(), 1};
  zc::Importer importer{cuda, mailbox.get(), 0, table};
};

constexpr std::uintptr_t kBase = 0x10000000;
constexpr std::size_t kBytes = 64 << 20;

void test_handshake_then_zero_copy() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  const void* dst = at(kBase + 4096 + 3);
  zc::Exporter::Decision d = p.exporter.prepare(dst, 1 << 20, false);
  check(!d.zero_copy, "the first recv into an allocation is staged (the mapping is only requested)");
  check(p.exporter.stats().requests == 1, "one map request posted");
  d = p.exporter.prepare(dst, 1 << 20, false);
  check(!d.zero_copy && p.exporter.stats().requests == 1, "no second request while the first is unanswered");
  check(p.exporter.awaiting(dst), "awaiting the sender's answer");
  p.importer.drain();
  check(p.cuda.opens == 1 && p.importer.open_handles() == 1, "the sender opened the handle once");
  d = p.exporter.prepare(dst, 1 << 20, false);
  check(d.zero_copy, "after the acknowledgement the recv goes zero-copy");
  check(d.offset == 4096 + 3, "the offset into the allocation");
  check(d.index >= 0 && p.table[d.index] != 0, "the sender's table holds the mapping at the posted index");
  check(p.cuda.exports == 1, "exported once");
  check(p.exporter.acked(dst), "acked() agrees");
}

// PYDATACOPY_ZERO_COPY_PROGRESS: a recv may wait once for the answer to a request an earlier call
// made, never in the call that made it, and never twice for one request.
void test_a_second_call_may_wait_once() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  const void* dst = at(kBase + 128);
  p.exporter.begin_call();
  check(!p.exporter.prepare(dst, 1 << 20, false).zero_copy, "the first call requests the mapping");
  check(!p.exporter.claim_wait(dst), "the call that requested it does not wait for it");
  p.exporter.begin_call();
  check(!p.exporter.prepare(dst, 1 << 20, false).zero_copy, "unanswered: still staged");
  check(p.exporter.claim_wait(dst), "a later call may wait once");
  check(!p.exporter.claim_wait(dst), "and only once per request");
  p.importer.drain();
  check(p.exporter.acked(dst) && p.exporter.prepare(dst, 1 << 20, false).zero_copy, "answered: zero-copy");
  check(!p.exporter.claim_wait(dst), "nothing to wait for once answered");
  const void* other = at(kBase + kBytes + 4096);
  p.cuda.allocate(kBase + kBytes, kBytes, /*exportable=*/false);
  p.exporter.begin_call();
  p.exporter.prepare(other, 1 << 20, false);
  p.exporter.begin_call();
  check(!p.exporter.claim_wait(other), "memory that cannot be exported is never waited for");
}

void test_stale_buffer_id_drops_the_mapping() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  const void* dst = at(kBase);
  p.exporter.prepare(dst, 1 << 20, false);
  p.importer.drain();
  const zc::Exporter::Decision first = p.exporter.prepare(dst, 1 << 20, false);
  check(first.zero_copy, "mapped");
  const uint64_t old_mapping = p.table[first.index];
  // Freed and reallocated at the same base: a new buffer ID, other memory.
  p.cuda.release(kBase);
  p.cuda.allocate(kBase, kBytes);
  p.cuda.send_idle = false;  // the sender still has a send to this peer in flight
  zc::Exporter::Decision d = p.exporter.prepare(dst, 1 << 20, false);
  check(!d.zero_copy, "a reused base is not posted with the stale mapping");
  check(p.exporter.stats().stale_dropped == 1, "the stale entry was dropped");
  p.importer.drain();
  check(p.table[first.index] == 0, "the sender cleared the stale index at once");
  check(p.cuda.closes == 0, "but closes the stale handle only once its send channel is idle");
  d = p.exporter.prepare(dst, 1 << 20, false);
  check(d.zero_copy && d.index != first.index, "the new allocation maps at another index");
  check(p.table[d.index] != 0 && p.table[d.index] != old_mapping, "through a new mapping");
  p.cuda.send_idle = true;
  p.importer.drain();
  check(p.cuda.closes == 1 && p.importer.open_handles() == 1, "closed once the send channel is idle");
}

void test_eviction_waits_for_an_idle_channel() {
  Pair p;
  for (int i = 0; i < zc::kTableEntries; ++i) {
    p.cuda.allocate(kBase + static_cast<std::uintptr_t>(i) * kBytes, kBytes);
    p.exporter.prepare(at(kBase + static_cast<std::uintptr_t>(i) * kBytes), 1 << 20, false);
  }
  p.importer.drain();
  for (int i = 0; i < zc::kTableEntries; ++i)
    check(p.exporter.prepare(at(kBase + static_cast<std::uintptr_t>(i) * kBytes), 1 << 20, false).zero_copy,
          "every allocation of a full table goes zero-copy");
  // Allocation 0 is now the least recently used.
  const std::uintptr_t extra = kBase + static_cast<std::uintptr_t>(zc::kTableEntries) * kBytes;
  p.cuda.allocate(extra, kBytes);
  p.cuda.recv_idle = false;
  check(!p.exporter.prepare(at(extra), 1 << 20, false).zero_copy, "a full table: staged");
  check(p.exporter.stats().evicted == 0 && p.exporter.stats().requests == zc::kTableEntries,
        "nothing is evicted while a recv from the peer may still use an index");
  p.cuda.recv_idle = true;
  p.exporter.begin_call();  // a new call: the entries used so far belong to launches that are done
  p.exporter.prepare(at(extra), 1 << 20, false);
  check(p.exporter.stats().evicted == 1, "the least recently used entry is evicted once the channel is idle");
  check(!p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "the evicted allocation is no longer posted zero-copy");
  p.importer.drain();  // unmap then map at the same index, in that order
  check(p.exporter.prepare(at(extra), 1 << 20, false).zero_copy, "the new allocation took the freed index");
  check(p.importer.open_handles() <= zc::kTableEntries, "the sender holds no more handles than the table");
}

// Review finding: an op of one call was given index j, and a later op of the same call (not yet
// launched either) evicted j's entry because the channel's last launch was idle; the sender then
// wrote the first op's message through a table entry that now mapped the second op's buffer.
void test_an_entry_used_in_this_call_is_not_evicted_by_it() {
  Pair p;
  for (int i = 0; i < zc::kTableEntries; ++i) {
    p.cuda.allocate(kBase + static_cast<std::uintptr_t>(i) * kBytes, kBytes);
    p.exporter.prepare(at(kBase + static_cast<std::uintptr_t>(i) * kBytes), 1 << 20, false);
  }
  p.importer.drain();
  p.exporter.begin_call();
  for (int i = 0; i < zc::kTableEntries; ++i)  // one call whose ops use every entry
    check(p.exporter.prepare(at(kBase + static_cast<std::uintptr_t>(i) * kBytes), 1 << 20, false).zero_copy,
          "every allocation of a full table goes zero-copy");
  const std::uintptr_t extra = kBase + static_cast<std::uintptr_t>(zc::kTableEntries) * kBytes;
  p.cuda.allocate(extra, kBytes);
  p.cuda.recv_idle = true;
  check(!p.exporter.prepare(at(extra), 1 << 20, false).zero_copy, "the same call's next op: staged");
  check(p.exporter.stats().evicted == 0, "no entry used by this call is evicted by it");
  p.exporter.begin_call();  // the next call: the last one's entries may go
  p.exporter.prepare(at(extra), 1 << 20, false);
  check(p.exporter.stats().evicted == 1, "evicted in a later call");
}

void test_freed_allocations_are_let_go_at_the_next_new_one() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  p.exporter.prepare(at(kBase), 1 << 20, false);
  p.importer.drain();
  check(p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "mapped");
  p.cuda.release(kBase);  // freed, its address not reused
  const std::uintptr_t other = kBase + 4 * kBytes;
  p.cuda.allocate(other, kBytes);
  p.exporter.prepare(at(other), 1 << 20, false);  // a new allocation: the sweep runs first
  check(p.exporter.stats().stale_dropped == 1, "the freed allocation's entry was dropped");
  p.importer.drain();
  check(p.cuda.closes == 1 && p.importer.open_handles() == 1, "and its handle closed at the sender");
  check(p.exporter.prepare(at(other), 1 << 20, false).zero_copy, "the new one maps");
}

void test_not_exportable_memory_stays_staged() {
  Pair p;
  p.cuda.allocate(kBase, kBytes, false);  // expandable segments, cudaMallocAsync pools
  for (int i = 0; i < 5; ++i) check(!p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "staged");
  p.importer.drain();
  check(!p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "staged for good");
  check(p.cuda.exports == 1, "the export is tried once per allocation");
  check(p.exporter.stats().not_exportable == 1 && p.exporter.stats().requests == 0, "no request posted");
  // Freed and reallocated as exportable memory: tried afresh.
  p.cuda.release(kBase);
  p.cuda.allocate(kBase, kBytes, true);
  p.exporter.prepare(at(kBase), 1 << 20, false);
  p.importer.drain();
  check(p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "a new exportable allocation at the base maps");
}

void test_a_failed_open_is_staged_for_good() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  p.cuda.fail_open = true;  // e.g. another container's process
  p.exporter.prepare(at(kBase), 1 << 20, false);
  p.importer.drain();
  check(!p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "refused by the sender: staged");
  check(p.exporter.stats().refused == 1 && p.exporter.stats().requests == 1, "asked once");
  check(p.exporter.live_entries() == 1, "remembered");
}

void test_unmap_waits_for_the_send_channel() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  p.exporter.prepare(at(kBase), 1 << 20, false);
  p.importer.drain();
  p.cuda.release(kBase);
  p.cuda.allocate(kBase + kBytes, kBytes);  // a neighbour; kBase's memory is gone
  p.cuda.allocate(kBase, kBytes / 2);       // and kBase reused, smaller
  p.exporter.prepare(at(kBase), 1 << 10, false);
  p.cuda.send_idle = false;
  for (int i = 0; i < 3; ++i) p.importer.drain();
  check(p.cuda.closes == 0 && p.importer.open_handles() == 2, "no close while the send channel is busy");
  p.cuda.send_idle = true;
  p.importer.drain();
  check(p.cuda.closes == 1 && p.importer.open_handles() == 1, "closed at the first idle drain");
}

void test_captured_entries_are_pinned() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  p.exporter.prepare(at(kBase), 1 << 20, true);
  p.importer.drain();
  const zc::Exporter::Decision captured = p.exporter.prepare(at(kBase), 1 << 20, true);
  check(captured.zero_copy, "a capture after the handshake is zero-copy");
  // Fill the rest of the table and ask for more: the pinned entry is never the one evicted.
  for (int i = 1; i <= zc::kTableEntries + 4; ++i) {
    const std::uintptr_t base = kBase + static_cast<std::uintptr_t>(i) * kBytes;
    p.cuda.allocate(base, kBytes);
    p.exporter.prepare(at(base), 1 << 20, false);
    p.importer.drain();
  }
  check(p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy && p.table[captured.index] != 0,
        "the captured entry survives eviction");
  // Its memory freed (the graph is gone): dropped, and its index never handed out again.
  p.cuda.release(kBase);
  p.cuda.allocate(kBase, kBytes);
  p.exporter.prepare(at(kBase), 1 << 20, false);
  p.importer.drain();
  check(p.table[captured.index] == 0, "the stale pinned mapping is cleared at the sender");
  for (int i = 0; i < 3 * zc::kTableEntries; ++i) {
    const std::uintptr_t base = kBase + static_cast<std::uintptr_t>(100 + i) * kBytes;
    p.cuda.allocate(base, kBytes);
    const zc::Exporter::Decision d = p.exporter.prepare(at(base), 1 << 20, false);
    p.importer.drain();
    const zc::Exporter::Decision again = p.exporter.prepare(at(base), 1 << 20, false);
    check(d.index != captured.index && again.index != captured.index, "a pinned index is never reused");
  }
}

void test_ring_wraparound_and_backlog() {
  auto box = std::make_unique<zc::Mailbox>();
  std::memset(static_cast<void*>(box.get()), 0, sizeof(zc::Mailbox));
  zc::Ack ack{};
  for (int round = 0; round < 3 * zc::kRingEntries + 7; ++round) {
    check(box->acks.push(zc::Ack{round % 64, 1, static_cast<uint64_t>(round), 0}), "push");
    check(box->acks.pop(&ack) && ack.base == static_cast<uint64_t>(round), "pop in order across the wrap");
  }
  for (int i = 0; i < zc::kRingEntries; ++i) box->acks.push(zc::Ack{0, 1, static_cast<uint64_t>(i), 0});
  check(!box->acks.push(zc::Ack{}), "a full ring refuses a push");
  check(box->acks.pop(&ack) && ack.base == 0, "the oldest first");

  // More requests than a ring holds: the exporter queues the rest and sends them in order.
  Pair p;
  const int many = zc::kRingEntries + 10;
  for (int i = 0; i < many; ++i) {
    p.cuda.allocate(kBase + static_cast<std::uintptr_t>(i) * kBytes, kBytes, true);
    // Churn one base: map, free, remap... each a map and an unmap request.
    p.exporter.prepare(at(kBase), 1 << 20, false);
    p.cuda.release(kBase);
    p.cuda.allocate(kBase, kBytes, true);
  }
  p.exporter.prepare(at(kBase), 1 << 20, false);  // the live allocation, requested last
  for (int i = 0; i < 4; ++i) {
    p.importer.drain();
    p.exporter.poll();
  }
  check(p.exporter.prepare(at(kBase), 1 << 20, false).zero_copy, "after the backlog drained, the live allocation maps");
  int live = 0;
  for (uint64_t entry : p.table) live += entry != 0;
  check(live == 1, "exactly one index mapped at the sender");
}

// The two processes of a pair, as two threads: every message arrives once, in order, whole
// (ThreadSanitizer checks the rings' memory ordering in CI).
void test_ring_between_threads() {
  auto box = std::make_unique<zc::Mailbox>();
  std::memset(static_cast<void*>(box.get()), 0, sizeof(zc::Mailbox));
  constexpr int kMessages = 20000;
  std::thread producer([&] {
    for (int i = 0; i < kMessages;) {
      zc::Request r{};
      r.kind = zc::kMap;
      r.index = i % zc::kTableEntries;
      r.base = static_cast<uint64_t>(i);
      r.buffer_id = ~static_cast<uint64_t>(i);
      std::memset(r.handle.bytes, i & 0xff, sizeof(r.handle.bytes));
      if (box->requests.push(r)) ++i;
      else std::this_thread::yield();
    }
  });
  int received = 0;
  bool in_order = true, whole = true;
  while (received < kMessages) {
    zc::Request r{};
    if (!box->requests.pop(&r)) {
      std::this_thread::yield();
      continue;
    }
    in_order = in_order && r.base == static_cast<uint64_t>(received);
    whole = whole && r.buffer_id == ~r.base && r.handle.bytes[63] == static_cast<unsigned char>(r.base & 0xff);
    ++received;
  }
  producer.join();
  check(in_order, "every message in order across threads");
  check(whole, "every message whole across threads");
}

void test_shared_memory_mailbox() {
  const std::string name = zc::mailbox_name(0x1234abcdULL ^ static_cast<uint64_t>(getpid()), 0, 1);
  zc::Mailbox* created = zc::create_mailbox(name);
  if (created == nullptr) {
    std::printf("note: no POSIX shared memory here; the mailbox test is skipped\n");
    return;
  }
  zc::Mailbox* opened = zc::open_mailbox(name);
  check(opened != nullptr, "the peer opens the receiver's segment by name");
  zc::unlink_mailbox(name);
  check(zc::open_mailbox("/pydatacopy-zc-does-not-exist-0-1") == nullptr, "a missing segment: null");
  if (opened != nullptr) {
    zc::Request r{};
    r.kind = zc::kMap;
    r.index = 5;
    r.base = 42;
    check(created->requests.push(r), "push through one mapping");
    zc::Request got{};
    check(opened->requests.pop(&got) && got.index == 5 && got.base == 42, "pop through the other");
    zc::unmap_mailbox(opened);
  }
  zc::unmap_mailbox(created);
}

struct VmmPair {
  FakeVmm vmm;
  std::unique_ptr<zc::Mailbox> mailbox{new zc::Mailbox()};
  uint64_t table[zc::kTableEntries] = {};
  zc::Exporter exporter{vmm, mailbox.get(), 1};
  zc::Importer importer{vmm, mailbox.get(), 0, table};
  // The receiver's reservation at kReservation with its first `chunks` chunks mapped.
  void reservation_with(int chunks, std::size_t chunk_bytes);
  // A call with one recv, as the engine makes it: the exporter told a call begins, then the recv.
  zc::Exporter::Decision call(const void* dst, std::size_t bytes, bool capturing = false) {
    exporter.begin_call();
    return exporter.prepare(dst, bytes, capturing);
  }
};

constexpr std::uintptr_t kReservation = 0x2000'0000'0000;
constexpr std::size_t kReservationBytes = std::size_t(64) << 30;
constexpr std::size_t kChunk = 20 << 20;  // torch's expandable segments map 20 MiB at a time

void VmmPair::reservation_with(int chunks, std::size_t chunk_bytes = kChunk) {
  vmm.reserve_at(kReservation, kReservationBytes);
  for (int i = 0; i < chunks; ++i) vmm.map_at(kReservation + i * chunk_bytes, chunk_bytes);
}


void test_expandable_recv_spanning_chunks_moves_once() {
  VmmPair p;
  p.reservation_with(4);
  const std::size_t offset = 5 << 20, bytes = 50 << 20;  // chunks 0, 1 and 2
  const void* dst = at(kReservation + offset);
  zc::Exporter::Decision d = p.call(dst, bytes, false);
  check(!d.zero_copy, "the first recv into expandable memory is staged");
  check(!p.exporter.claim_wait(dst), "the call that asked does not wait for its own request");
  check(p.exporter.stats().chunk_requests == 3 && p.vmm.exports == 3, "each chunk under the recv asked for once");
  check(p.exporter.awaiting(dst) && !p.exporter.acked(dst), "awaiting the sender's chunks");
  d = p.call(dst, bytes, false);
  check(!d.zero_copy && p.vmm.exports == 3, "no second request while unanswered");
  check(p.exporter.claim_wait(dst) && !p.exporter.claim_wait(dst), "the next call may wait once for the chunks");
  p.importer.drain();
  check(p.importer.mapped_chunks() == 3 && p.vmm.maps == 3, "the sender mapped the three chunks");
  d = p.call(dst, bytes, false);
  check(d.zero_copy, "then the recv moves once");
  check(d.offset == offset, "at its offset into the reservation");
  const uint64_t mirror = p.table[d.index];
  check(mirror != 0 && p.vmm.sender_reserved.count(mirror) == 1, "the table holds the sender's mirror of the reservation");
  for (int i = 0; i < 3; ++i) {
    auto m = p.vmm.sender_map.find(mirror + i * kChunk);
    check(m != p.vmm.sender_map.end() && m->second.id == p.vmm.chunk_map[kReservation + i * kChunk].id,
          "each chunk at its own offset in the mirror: one contiguous range");
  }
  check(p.exporter.acked(dst), "acked() agrees");
  // A recv that reaches into chunk 3 asks for that chunk alone, at the same index.
  d = p.call(at(kReservation + 2 * kChunk), 2 * kChunk, false);
  check(!d.zero_copy && p.vmm.exports == 4, "a new chunk under a recv is asked for");
  p.importer.drain();
  d = p.call(at(kReservation + 2 * kChunk), 2 * kChunk, false);
  check(d.zero_copy && p.table[d.index] == mirror && p.vmm.sender_reserved.size() == 1, "into the same mirror");
}

// The copy engine's guess (send_recv.hpp, "The copy engine") is used only where the sender maps
// the receiver's memory now: an allocation in the table, whole; never one that was unmapped.
void test_maps_says_where_the_sender_maps_the_receiver() {
  Pair p;
  p.cuda.allocate(kBase, kBytes);
  const void* dst = at(kBase + 4096);
  p.exporter.prepare(dst, 1 << 20, false);
  check(!p.importer.maps(0x7000, 16), "nothing is mapped before the first answer");
  p.importer.drain();
  const zc::Exporter::Decision d = p.exporter.prepare(dst, 1 << 20, false);
  check(d.zero_copy, "mapped");
  const uint64_t mapped = p.table[d.index];
  check(p.importer.maps(mapped, kBytes), "the whole allocation");
  check(p.importer.maps(mapped + 4096, 1 << 20), "a range inside it");
  check(!p.importer.maps(mapped + kBytes - 16, 17), "not one byte past its end");
  check(!p.importer.maps(mapped - 1, 2), "nor before its start");
  check(!p.importer.maps(~uint64_t{0} - 4, 16), "a range that wraps is no range");
  // Freed and reused (another buffer ID): the sender clears the entry; the mapping waits, unmapped,
  // for an idle channel before it closes, and is no target meanwhile.
  p.cuda.release(kBase);
  p.cuda.allocate(kBase, kBytes);
  p.cuda.send_idle = false;
  p.exporter.prepare(dst, 1 << 20, false);
  p.importer.drain();
  check(p.table[d.index] == 0, "the stale entry is cleared");
  check(!p.importer.maps(mapped, 1 << 20), "an unmapped allocation is no target, closed or not");
}

void test_maps_needs_every_chunk_of_a_mirror_range() {
  VmmPair p;
  p.reservation_with(4);
  const void* dst = at(kReservation);
  p.call(dst, 2 * kChunk, false);  // chunks 0 and 1
  p.importer.drain();
  const zc::Exporter::Decision d = p.call(dst, 2 * kChunk, false);
  check(d.zero_copy, "two chunks mapped");
  const uint64_t mirror = p.table[d.index];
  check(p.importer.maps(mirror, 2 * kChunk), "the two chunks mapped, one range");
  check(p.importer.maps(mirror + kChunk - 8, 16), "a range across the two");
  check(!p.importer.maps(mirror + kChunk, kChunk + 1), "not into chunk 2, which is not mapped");
  check(!p.importer.maps(mirror + 3 * kChunk, 16), "nor chunk 3");
}

void test_expandable_chunk_mapped_again_moves_to_a_new_mirror() {
  VmmPair p;
  p.reservation_with(2);
  const void* dst = at(kReservation);
  p.call(dst, 2 * kChunk, false);
  p.importer.drain();
  const zc::Exporter::Decision mapped = p.call(dst, 2 * kChunk, false);
  check(mapped.zero_copy, "mapped");
  const uint64_t old_mirror = p.table[mapped.index];
  // torch gives the second chunk back (empty_cache) and maps a new one there as the segment grows.
  p.vmm.unmap_at(kReservation + kChunk);
  p.vmm.map_at(kReservation + kChunk, kChunk);
  p.vmm.send_idle = false;  // the sender streams: its send channel is never idle for a while
  zc::Exporter::Decision d = p.call(dst, 2 * kChunk, false);
  check(!d.zero_copy, "a chunk mapped again is not written through the old mapping");
  check(p.exporter.stats().stale_dropped == 1 && p.exporter.stats().chunk_requests == 4,
        "the entry goes; both chunks asked for anew");
  p.importer.drain();
  check(p.table[mapped.index] == 0, "the old index cleared at once");
  check(p.vmm.unmaps == 0 && p.vmm.maps == 4, "the new chunks mapped in a new mirror at once, the old ones kept until idle");
  d = p.call(dst, 2 * kChunk, false);
  check(d.zero_copy && d.index != mapped.index && p.table[d.index] != old_mirror, "moves once again, busy sender or not");
  p.vmm.send_idle = true;
  p.importer.drain();
  check(p.vmm.unmaps == 2 && p.vmm.reservations_freed == 1 && p.vmm.sender_reserved.count(old_mirror) == 0,
        "once idle: the old mirror's chunks unmapped and its address space freed");
}
void test_expandable_memory_that_cannot_be_exported_stays_staged() {
  VmmPair p;
  p.vmm.exportable = false;  // no socket to the sender, or the export refused
  p.reservation_with(1);
  for (int i = 0; i < 2 * zc::kMaxChunkFailures; ++i)
    check(!p.call(at(kReservation), kChunk, false).zero_copy, "staged");
  check(p.vmm.exports == zc::kMaxChunkFailures, "the export is tried a few times (a failure may pass), not at every recv");
  check(p.exporter.stats().not_exportable == 1, "then remembered as not exportable");
  p.importer.drain();
  check(p.vmm.maps == 0 && p.vmm.sender_reserved.empty(), "the sender holds nothing");
}

void test_expandable_recv_over_unmapped_memory_is_staged() {
  VmmPair p;
  p.vmm.reserve_at(kReservation, kReservationBytes);
  p.vmm.map_at(kReservation, kChunk);  // the next chunk is not mapped
  check(!p.call(at(kReservation), 2 * kChunk, false).zero_copy, "staged");
  check(p.vmm.exports == 0 && p.exporter.stats().chunk_requests == 0, "nothing asked for");
}

void test_expandable_reservation_gone_frees_the_mirror() {
  VmmPair p;
  p.reservation_with(1);
  p.call(at(kReservation), kChunk, false);
  p.importer.drain();
  zc::Exporter::Decision d = p.call(at(kReservation), kChunk, false);
  check(d.zero_copy, "mapped");
  const uint64_t mirror = p.table[d.index];
  // The reservation goes; ordinary memory comes at its address.
  p.vmm.unmap_at(kReservation);
  p.vmm.reservations.erase(kReservation);
  p.vmm.send_idle = false;
  // A new reservation elsewhere: a new mapping lets go of what was freed (sweep).
  p.vmm.reserve_at(kReservation + kReservationBytes, kReservationBytes);
  p.vmm.map_at(kReservation + kReservationBytes, kChunk);
  check(!p.call(at(kReservation + kReservationBytes), kChunk, false).zero_copy, "a new reservation is staged first");
  check(p.exporter.stats().stale_dropped == 1, "the gone reservation is dropped");
  p.importer.drain();
  check(p.table[d.index] == 0, "its table entry is cleared at once");
  check(p.vmm.sender_reserved.count(mirror) == 1 && p.vmm.unmaps == 0, "its mirror goes once the send channel is idle");
  p.vmm.send_idle = true;
  p.importer.drain();
  check(p.vmm.sender_reserved.count(mirror) == 0 && p.vmm.unmaps == 1 && p.vmm.reservations_freed == 1, "then unmapped and freed");
  check(p.call(at(kReservation + kReservationBytes), kChunk, false).zero_copy, "the new one moves once");
}

void test_expandable_chunk_given_back_drops_the_entry_at_the_sweep() {
  VmmPair p;
  p.reservation_with(2);
  p.call(at(kReservation), 2 * kChunk, false);
  p.importer.drain();
  const zc::Exporter::Decision d = p.call(at(kReservation), 2 * kChunk, false);
  check(d.zero_copy, "mapped");
  p.vmm.unmap_at(kReservation + kChunk);  // given back (empty_cache), not mapped again yet
  check(p.exporter.sweep_if_due(std::chrono::steady_clock::now()), "the progress thread's sweep runs");
  check(p.exporter.stats().stale_dropped == 1, "the entry goes: a chunk mapped there later comes into a new mirror");
  p.importer.drain();
  check(p.table[d.index] == 0 && p.vmm.unmaps == 2 && p.vmm.reservations_freed == 1,
        "the sender lets go of both chunks and the mirror (idle), so the memory can go back");
}

void test_expandable_chunk_never_used_given_back_keeps_the_entry() {
  VmmPair p;
  p.reservation_with(2);
  p.call(at(kReservation + kChunk), kChunk, false);  // chunk 1 only
  p.importer.drain();
  const zc::Exporter::Decision d = p.call(at(kReservation + kChunk), kChunk, false);
  check(d.zero_copy, "mapped");
  // torch gives chunk 0 back: the driver then knows nothing at the reservation's base, but the
  // reservation is still there (asked through chunk 1). A recv elsewhere makes the exporter sweep.
  p.vmm.unmap_at(kReservation);
  p.vmm.reserve_at(kReservation + kReservationBytes, kReservationBytes);
  p.vmm.map_at(kReservation + kReservationBytes, kChunk);
  p.call(at(kReservation + kReservationBytes), kChunk, false);
  check(p.exporter.stats().stale_dropped == 0, "the reservation is not taken for gone");
  const zc::Exporter::Decision again = p.call(at(kReservation + kChunk + 7), 4096, false);
  check(again.zero_copy && again.index == d.index, "a recv into chunk 1 still moves once, at the same index");
}
void test_expandable_chunk_refused_is_asked_again() {
  VmmPair p;
  p.reservation_with(1);
  p.vmm.fail_maps = 1;  // the sender fails once (out of descriptors, say)
  p.call(at(kReservation), kChunk, false);
  p.importer.drain();
  check(!p.call(at(kReservation), kChunk, false).zero_copy, "refused: staged this time");
  check(p.exporter.stats().refused == 1 && p.exporter.stats().not_exportable == 0, "one failure, not for good");
  p.importer.drain();
  check(p.call(at(kReservation), kChunk, false).zero_copy, "asked again and mapped");
  check(p.vmm.exports == 2, "exported twice");
}

// A reservation of `chunks` chunks, mapped, with a recv over chunk 1 captured (the entry pinned).
zc::Exporter::Decision captured_over_chunk_1(VmmPair& p, int chunks = 2) {
  p.reservation_with(chunks);
  p.call(at(kReservation), chunks * kChunk, false);
  p.importer.drain();
  const zc::Exporter::Decision captured = p.call(at(kReservation + kChunk), kChunk, true);
  check(captured.zero_copy, "captured over chunk 1, moving once");
  return captured;
}

void test_expandable_chunk_waiting_aside_does_not_hold_the_ring() {
  VmmPair p;
  const zc::Exporter::Decision captured = captured_over_chunk_1(p);
  // Chunk 0, outside the capture, mapped again: it goes alone (the captured index stays), and its
  // successor must wait for the old one's range at the sender.
  p.vmm.unmap_at(kReservation);
  p.vmm.map_at(kReservation, kChunk);
  p.vmm.send_idle = false;
  p.call(at(kReservation), kChunk, false);  // unmap the old, map the new (deferred)
  const std::uintptr_t other = kReservation + kReservationBytes;
  p.vmm.reserve_at(other, kReservationBytes);
  p.vmm.map_at(other, kChunk);
  p.call(at(other), kChunk, false);  // a request behind it
  p.importer.drain();
  check(p.importer.deferred_chunks() == 1, "the new chunk waits aside for the idle channel");
  check(p.table[captured.index] != 0, "the captured index still maps");
  check(p.call(at(other), kChunk, false).zero_copy, "the request behind it was served meanwhile");
  check(!p.call(at(kReservation), kChunk, false).zero_copy, "the waiting one stays staged");
  // torch maps yet another chunk there before the channel went idle: the waiting one is forgotten.
  p.vmm.unmap_at(kReservation);
  p.vmm.map_at(kReservation, kChunk);
  p.call(at(kReservation), kChunk, false);
  p.importer.drain();
  check(p.importer.deferred_chunks() == 1, "the stale one cancelled, the newest one waiting");
  check(p.vmm.fds.size() == 1, "the cancelled one's descriptor closed; only the waiting one's held");
  p.vmm.send_idle = true;
  p.importer.drain();
  check(p.importer.deferred_chunks() == 0 && p.call(at(kReservation), kChunk, false).zero_copy,
        "once idle: the newest chunk mapped and used");
  check(p.vmm.sender_map.size() == 3, "the mirrors hold chunks 0 and 1, and the other reservation's");
}
void test_expandable_chunk_waiting_aside_goes_when_the_channel_idles_mid_drain() {
  VmmPair p;
  captured_over_chunk_1(p);
  p.vmm.unmap_at(kReservation);
  p.vmm.map_at(kReservation, kChunk);
  p.call(at(kReservation), kChunk, false);  // chunk 0 alone: unmap the old, map the new
  // The send channel is busy when the new chunk is looked at, idle by the end of the same drain
  // (its kernel ended meanwhile).
  p.vmm.send_idle = false;
  p.vmm.send_idle_script = {false, true};
  p.importer.drain();
  check(p.importer.deferred_chunks() == 0 && p.vmm.unmaps == 1, "the old chunk closed and the new one mapped in that drain");
  check(p.call(at(kReservation), kChunk, false).zero_copy, "so the next recv moves once");
  p.vmm.send_idle = true;
}
void test_expandable_captured_recv_never_meets_a_hole() {
  VmmPair p;
  const zc::Exporter::Decision captured = captured_over_chunk_1(p, 3);
  // A chunk outside the captured range changes: only that chunk goes.
  p.vmm.unmap_at(kReservation);
  p.vmm.map_at(kReservation, kChunk);
  p.call(at(kReservation), kChunk, false);
  check(p.exporter.stats().stale_dropped == 0 && p.exporter.stats().chunks_dropped == 1, "chunk 0 alone");
  p.importer.drain();
  check(p.table[captured.index] != 0, "the captured index still maps");
  // The captured chunk changes: the whole entry goes, its table word cleared, its index never reused.
  p.vmm.unmap_at(kReservation + kChunk);
  p.vmm.map_at(kReservation + kChunk, kChunk);
  const zc::Exporter::Decision d = p.call(at(kReservation + kChunk), kChunk, false);
  check(!d.zero_copy && p.exporter.stats().stale_dropped == 1, "the entry under the capture is dropped");
  p.importer.drain();
  check(p.table[captured.index] == 0, "a replay finds the index empty and is refused, never a hole");
  p.importer.drain();
  const zc::Exporter::Decision after = p.call(at(kReservation + kChunk), kChunk, false);
  check(after.zero_copy && after.index != captured.index, "the reservation moves once again at another index");
}

void test_expandable_captured_chunk_given_back_drops_the_entry_at_the_sweep() {
  VmmPair p;
  const zc::Exporter::Decision captured = captured_over_chunk_1(p);
  p.vmm.unmap_at(kReservation + kChunk);  // given back, not mapped again: found by the sweep
  p.exporter.sweep_if_due(std::chrono::steady_clock::now());
  check(p.exporter.stats().stale_dropped == 1, "the entry under the capture is dropped whole");
  p.importer.drain();
  check(p.table[captured.index] == 0, "its table word cleared: a replay is refused");
}

void test_expandable_descriptors_in_flight_are_bounded() {
  VmmPair p;
  const int chunks = zc::kMaxUnansweredChunks + 36;
  p.vmm.reserve_at(kReservation, kReservationBytes);
  for (int i = 0; i < chunks; ++i) p.vmm.map_at(kReservation + i * (2 << 20), 2 << 20);
  const std::size_t bytes = std::size_t(chunks) * (2 << 20);
  p.call(at(kReservation), bytes, false);
  check(p.vmm.exports == zc::kMaxUnansweredChunks, "at most kMaxUnansweredChunks descriptors unanswered");
  p.importer.drain();
  check(!p.call(at(kReservation), bytes, false).zero_copy && p.vmm.exports == chunks, "the rest next");
  p.importer.drain();
  check(p.call(at(kReservation), bytes, false).zero_copy, "then the whole range moves once");
}

void test_expandable_entry_given_to_an_earlier_op_of_the_call_is_not_dropped() {
  VmmPair p;
  p.reservation_with(4);
  p.call(at(kReservation), 4 * kChunk);
  p.importer.drain();
  check(p.call(at(kReservation), 4 * kChunk).zero_copy, "mapped");
  p.vmm.unmap_at(kReservation + 3 * kChunk);  // torch replaces chunk 3 between calls
  p.vmm.map_at(kReservation + 3 * kChunk, kChunk);
  // One call, two recvs from the peer: the first over chunks 0-1, the second over chunks 2-3.
  p.exporter.begin_call();
  const zc::Exporter::Decision first = p.exporter.prepare(at(kReservation), 2 * kChunk, false);
  const zc::Exporter::Decision second = p.exporter.prepare(at(kReservation + 2 * kChunk), 2 * kChunk, false);
  check(first.zero_copy, "the first op moves once");
  check(!second.zero_copy && p.exporter.stats().stale_dropped == 0, "the second is staged, nothing dropped under the first");
  p.importer.drain();
  check(p.table[first.index] != 0, "the first op's table word stays");
  // While a launch of the receive channel may still post the index: still nothing dropped.
  p.vmm.recv_idle = false;
  check(!p.call(at(kReservation + 2 * kChunk), 2 * kChunk).zero_copy && p.exporter.stats().stale_dropped == 0,
        "nothing dropped under a launch in flight");
  check(p.exporter.sweep_if_due(std::chrono::steady_clock::now()) && p.exporter.stats().stale_dropped == 0,
        "nor by the progress thread's sweep");
  p.vmm.recv_idle = true;
  check(!p.call(at(kReservation + 2 * kChunk), 2 * kChunk).zero_copy && p.exporter.stats().stale_dropped == 1,
        "the next call, the channel idle: the entry goes");
  p.importer.drain();
  check(p.call(at(kReservation + 2 * kChunk), 2 * kChunk).zero_copy, "chunks 2-3 move once again, in a new mirror");
  p.call(at(kReservation), 4 * kChunk);  // chunks 0-1 asked for there too
  p.importer.drain();
  check(p.call(at(kReservation), 4 * kChunk).zero_copy, "then the whole range");
}

void test_expandable_failures_never_drop_an_entry_given_in_the_call() {
  VmmPair p;
  p.reservation_with(2);
  p.call(at(kReservation), kChunk);  // chunk 0 only
  p.importer.drain();
  check(p.call(at(kReservation), kChunk).zero_copy, "chunk 0 mapped");
  p.vmm.exportable = false;  // from now on chunk 1 cannot be sent
  for (int i = 0; i < zc::kMaxChunkFailures - 1; ++i) p.call(at(kReservation + kChunk), kChunk);
  // The last failure comes in a call whose first op was given chunk 0 at the entry's index.
  p.exporter.begin_call();
  const zc::Exporter::Decision first = p.exporter.prepare(at(kReservation), kChunk, false);
  const zc::Exporter::Decision second = p.exporter.prepare(at(kReservation + kChunk), kChunk, false);
  check(first.zero_copy && !second.zero_copy, "the first op moves once, the second is staged");
  p.importer.drain();
  check(p.table[first.index] != 0 && p.exporter.stats().not_exportable == 0, "the first op's index is not dropped under it");
  check(p.call(at(kReservation), kChunk).zero_copy, "chunk 0 keeps moving once");
  const int exports = p.vmm.exports;
  check(!p.call(at(kReservation + kChunk), kChunk).zero_copy && p.vmm.exports == exports, "chunk 1 no longer asked for");
}

void test_expandable_capture_into_an_entry_past_its_failures_is_pinned() {
  VmmPair p;
  p.reservation_with(2);
  p.call(at(kReservation), kChunk);
  p.importer.drain();
  check(p.call(at(kReservation), kChunk).zero_copy, "chunk 0 mapped");
  p.vmm.exportable = false;
  p.vmm.recv_idle = false;  // the failures come while a launch may post the index: the entry stays
  for (int i = 0; i < zc::kMaxChunkFailures; ++i) p.call(at(kReservation + kChunk), kChunk);
  p.vmm.recv_idle = true;
  const zc::Exporter::Decision captured = p.call(at(kReservation), kChunk, true);
  check(captured.zero_copy, "a capture over chunk 0 moves once");
  // torch maps chunk 0 again; the sweep must treat the entry as captured.
  p.vmm.unmap_at(kReservation);
  p.vmm.map_at(kReservation, kChunk);
  p.exporter.sweep_if_due(std::chrono::steady_clock::now());
  p.importer.drain();
  check(p.table[captured.index] == 0, "the captured entry dropped: a replay is refused");
  // Its index is never handed out again, however many reservations come (the table cycles).
  p.vmm.exportable = true;
  bool reused = false;
  for (int i = 1; i <= 2 * zc::kTableEntries; ++i) {
    const std::uintptr_t other = kReservation + i * kReservationBytes;
    p.vmm.reserve_at(other, kReservationBytes);
    p.vmm.map_at(other, kChunk);
    p.call(at(other), kChunk);
    p.importer.drain();
    const zc::Exporter::Decision d = p.call(at(other), kChunk);
    reused = reused || (d.zero_copy && d.index == captured.index);
  }
  check(!reused, "the captured index is not reused");
}

void test_expandable_socket_not_ready_is_no_failure() {
  VmmPair p;
  p.reservation_with(1);
  p.vmm.socket_ready = false;  // a connection waiting to be tried again
  for (int i = 0; i < 2 * zc::kMaxChunkFailures; ++i) check(!p.call(at(kReservation), kChunk).zero_copy, "staged");
  check(p.vmm.exports == 0 && p.exporter.stats().not_exportable == 0, "nothing sent, nothing counted against the memory");
  p.vmm.socket_ready = true;
  p.call(at(kReservation), kChunk);
  p.importer.drain();
  check(p.call(at(kReservation), kChunk).zero_copy, "moves once as soon as the socket is there");
}

void test_expandable_captured_entry_is_never_dropped_for_failures() {
  VmmPair p;
  const zc::Exporter::Decision captured = captured_over_chunk_1(p);
  p.vmm.map_at(kReservation + 2 * kChunk, kChunk);
  p.vmm.fail_maps = 1000;  // the sender cannot map anything more
  for (int i = 0; i < 2 * zc::kMaxChunkFailures; ++i) {
    p.call(at(kReservation + 2 * kChunk), kChunk);
    p.importer.drain();
  }
  check(p.table[captured.index] != 0, "the captured index still maps: its replays go on");
  check(p.call(at(kReservation + kChunk), kChunk).zero_copy, "and an eager recv over the captured range moves once");
  const int exports = p.vmm.exports;
  check(!p.call(at(kReservation + 2 * kChunk), kChunk).zero_copy && p.vmm.exports == exports,
        "past the limit, no new chunk is asked for");
}

void test_expandable_descriptors_bounded_across_dropped_entries() {
  VmmPair p;
  p.reservation_with(8);
  // The sender never serves (its process busy): the receiver remaps, drops, asks again...
  for (int round = 0; round < 40; ++round) {
    p.call(at(kReservation), 8 * kChunk);
    p.vmm.unmap_at(kReservation);
    p.vmm.map_at(kReservation, kChunk);
  }
  check(p.vmm.exports <= zc::kMaxUnansweredChunks, "never more than kMaxUnansweredChunks descriptors unanswered");
  p.importer.drain();
  p.call(at(kReservation), 8 * kChunk);
  p.importer.drain();
  check(p.call(at(kReservation), 8 * kChunk).zero_copy, "once the sender answers, the range moves once");
}

void test_close_all_releases_mirrors() {
  VmmPair p;
  p.reservation_with(2);
  p.call(at(kReservation), 2 * kChunk, false);
  p.importer.drain();
  p.importer.close_all();
  check(p.vmm.unmaps == 2 && p.vmm.reservations_freed == 1 && p.vmm.sender_map.empty(), "cleanup unmaps and frees all");
  for (uint64_t word : p.table) check(word == 0, "and clears the table");
}

}  // namespace

int main() {
  test_maps_says_where_the_sender_maps_the_receiver();
  test_maps_needs_every_chunk_of_a_mirror_range();
  test_expandable_recv_spanning_chunks_moves_once();
  test_expandable_chunk_mapped_again_moves_to_a_new_mirror();
  test_expandable_memory_that_cannot_be_exported_stays_staged();
  test_expandable_recv_over_unmapped_memory_is_staged();
  test_expandable_reservation_gone_frees_the_mirror();
  test_expandable_chunk_given_back_drops_the_entry_at_the_sweep();
  test_expandable_chunk_never_used_given_back_keeps_the_entry();
  test_expandable_chunk_refused_is_asked_again();
  test_expandable_chunk_waiting_aside_does_not_hold_the_ring();
  test_expandable_chunk_waiting_aside_goes_when_the_channel_idles_mid_drain();
  test_expandable_captured_recv_never_meets_a_hole();
  test_expandable_captured_chunk_given_back_drops_the_entry_at_the_sweep();
  test_expandable_descriptors_in_flight_are_bounded();
  test_expandable_entry_given_to_an_earlier_op_of_the_call_is_not_dropped();
  test_expandable_failures_never_drop_an_entry_given_in_the_call();
  test_expandable_capture_into_an_entry_past_its_failures_is_pinned();
  test_expandable_socket_not_ready_is_no_failure();
  test_expandable_captured_entry_is_never_dropped_for_failures();
  test_expandable_descriptors_bounded_across_dropped_entries();
  test_close_all_releases_mirrors();
  test_handshake_then_zero_copy();
  test_a_second_call_may_wait_once();
  test_stale_buffer_id_drops_the_mapping();
  test_eviction_waits_for_an_idle_channel();
  test_an_entry_used_in_this_call_is_not_evicted_by_it();
  test_freed_allocations_are_let_go_at_the_next_new_one();
  test_not_exportable_memory_stays_staged();
  test_a_failed_open_is_staged_for_good();
  test_unmap_waits_for_the_send_channel();
  test_captured_entries_are_pinned();
  test_ring_wraparound_and_backlog();
  test_ring_between_threads();
  test_shared_memory_mailbox();
  std::printf("test_zero_copy: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
