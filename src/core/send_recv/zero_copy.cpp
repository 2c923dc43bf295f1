#include "send_recv/zero_copy.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <iterator>
#include <limits>
#include <set>

namespace pydatacopy::zero_copy {

// ---- exporter (the receiver's side) -----------------------------------------------------------

void Exporter::send(const Request& request) {
  outgoing_.push_back(request);
  flush();
}

void Exporter::flush() {
  while (!outgoing_.empty() && mailbox_->requests.push(outgoing_.front())) outgoing_.pop_front();
}

void Exporter::poll() {
  if (!usable()) return;
  flush();
  Ack ack{};
  while (mailbox_->acks.pop(&ack)) {
    auto it = entries_.find(static_cast<std::uintptr_t>(ack.base));
    if (ack.chunk != 0) {
      // A chunk's answer: its descriptor is no longer in flight, whatever became of its entry. It
      // counts for the reservation still at that index, the chunk still asked for by that request.
      unanswered_.erase(ack.sequence);
      if (it == entries_.end() || !it->second.vmm || it->second.index != ack.index) continue;
      auto chunk = it->second.chunks.find(ack.chunk_offset);
      if (chunk == it->second.chunks.end() || chunk->second.id != ack.buffer_id || chunk->second.acked ||
          chunk->second.sequence != ack.sequence)
        continue;
      if (ack.mapped != 0) {
        chunk->second.acked = true;
        it->second.chunk_failures = 0;
        ++stats_.chunks_acked;
      } else {
        // The sender could not map it (out of descriptors, a reservation refused...): asked again
        // at a later recv, until kMaxChunkFailures such failures make the reservation staged.
        ++stats_.refused;
        it->second.chunks.erase(chunk);
        chunk_failed(it);
      }
      continue;
    }
    // An answer for an entry dropped since (its unmap follows the map in the ring): nothing to do.
    if (it == entries_.end() || it->second.buffer_id != ack.buffer_id || it->second.index != ack.index ||
        it->second.state != State::kRequested)
      continue;
    if (ack.mapped != 0) {
      it->second.state = State::kAcked;
      ++stats_.acked;
    } else {
      // The sender could not open it: staged for good. The sender holds nothing at the index.
      in_use_[static_cast<std::size_t>(it->second.index)] = false;
      it->second.index = -1;
      it->second.state = State::kNotExportable;
      ++stats_.refused;
    }
  }
}

void Exporter::drop(std::map<std::uintptr_t, Entry>::iterator it) {
  const int index = it->second.index;
  if (index >= 0) {
    send(Request{kUnmap, index, it->first, it->second.buffer_id, it->second.bytes, IpcHandle{}});
    in_use_[static_cast<std::size_t>(index)] = false;
    // A capture may still post this index: never hand it out again (the sender's entry is
    // cleared, so such a replay is refused, not written through a stale mapping).
    if (it->second.pinned) pinned_[static_cast<std::size_t>(index)] = true;
    else retired_[static_cast<std::size_t>(index)] = true;
  }
  entries_.erase(it);
}

// Entries that overlap the allocation `a` without being it: their memory was freed (allocations
// never overlap), perhaps reused at the same base with a new buffer ID.
void Exporter::drop_overlapping(const Allocation& a) {
  auto first = entries_.lower_bound(a.base);
  if (first != entries_.begin() && std::prev(first)->first + std::prev(first)->second.bytes > a.base) --first;
  drop_stale(first, entries_.lower_bound(a.base + a.bytes), [&](std::uintptr_t base, const Entry& e) {
    return base == a.base && e.bytes == a.bytes && e.buffer_id == a.buffer_id;
  });
}

void Exporter::sweep() {
  drop_stale(entries_.begin(), entries_.end(), [&](std::uintptr_t base, Entry& e) {
    if (e.index < 0) return true;  // nothing held at the sender
    if (!e.vmm) {
      const Allocation now = backend_.query(reinterpret_cast<const void*>(base));
      return now.cuda_memory && now.base == base && now.bytes == e.bytes && now.buffer_id == e.buffer_id;
    }
    // A reservation used by this very call (not launched yet), or while a launch of this PE's
    // receive channel from the peer may still post its index: left as it is until the next sweep
    // (dropping it would clear the sender's table word under that launch: a refused channel).
    if (e.decided_at > call_start_ || !backend_.channel_idle(false, peer_)) return true;
    // First the chunks torch unmapped or mapped again since.
    std::vector<std::map<uint64_t, ChunkEntry>::iterator> gone;
    for (auto chunk = e.chunks.begin(); chunk != e.chunks.end(); ++chunk) {
      std::vector<Chunk> here;
      const bool same = backend_.chunks(reinterpret_cast<const void*>(base + chunk->first), 1, &here) &&
                        here.size() == 1 && here[0].base == base + chunk->first &&
                        here[0].bytes == chunk->second.bytes && here[0].id == chunk->second.id;
      if (!same) gone.push_back(chunk);
    }
    // A captured recv keeps its index and offset for the graph's life: a hole under it in the
    // mirror would be written through (an illegal address), so then the whole entry goes (its
    // table word cleared: a replay is refused, as for any freed capture buffer).
    // Any other reservation: the whole entry goes too, so that the chunks mapped there next come
    // into a new mirror (a new index), never onto an address the sender must first unmap, which it
    // can do only once its send channel is idle (a sender streaming back to back may not be for long).
    // Only a captured entry keeps its index: there a chunk outside the captured ranges goes alone.
    if (!gone.empty() && !e.pinned) return false;
    for (auto chunk : gone)
      if (e.under_capture(chunk->first, chunk->second.bytes)) return false;
    for (auto chunk : gone) drop_chunk(base, e, chunk);
    // Then the reservation, asked through a chunk still mapped (the driver knows no unmapped
    // address, not even inside a reservation). With none left, the entry goes (its mirror too).
    if (e.chunks.empty()) return false;
    const Allocation now = backend_.query(reinterpret_cast<const void*>(base + e.chunks.begin()->first));
    return now.cuda_memory && now.vmm_fd && now.base == base && now.bytes == e.bytes;
  });
}

void Exporter::chunk_failed(std::map<std::uintptr_t, Entry>::iterator it) {
  if (++it->second.chunk_failures < kMaxChunkFailures) return;
  if (it->second.pinned || it->second.decided_at > call_start_ || !backend_.channel_idle(false, peer_)) {
    // A capture may post its index at any replay, an earlier op of this call was given it, or a
    // launch may still post it: the entry stays (what it maps stays mapped) and asks for no new
    // chunk, so recvs over chunks not mapped yet stay staged.
    it->second.given_up = true;
    return;
  }
  Allocation a;
  a.base = it->first;
  a.bytes = it->second.bytes;
  a.vmm_fd = true;
  drop(it);
  remember_not_exportable(a);
}

bool Exporter::sweep_if_due(std::chrono::steady_clock::time_point now) {
  if (!usable() || now < next_sweep_) return false;
  next_sweep_ = now + kSweepPeriod;
  call_start_ = tick_;  // between calls (the engine's lock): whatever a call was given is launched
  poll();
  sweep();
  return true;
}

void Exporter::drop_chunk(std::uintptr_t base, Entry& e, std::map<uint64_t, ChunkEntry>::iterator chunk) {
  Request request{kUnmapChunk, e.index, base, 0, e.bytes, IpcHandle{}};
  request.chunk_offset = chunk->first;
  request.chunk_bytes = chunk->second.bytes;
  request.chunk_id = chunk->second.id;
  send(request);
  ++stats_.chunks_dropped;
  e.chunks.erase(chunk);
}

void Exporter::remember_not_exportable(const Allocation& a) {
  // Remembered, so that the export is not tried at every recv; bounded, oldest out first.
  std::size_t remembered = 0;
  auto oldest = entries_.end();
  for (auto e = entries_.begin(); e != entries_.end(); ++e) {
    if (e->second.state != State::kNotExportable) continue;
    ++remembered;
    if (oldest == entries_.end() || e->second.last_use < oldest->second.last_use) oldest = e;
  }
  if (remembered >= static_cast<std::size_t>(kMaxNotExportable) && oldest != entries_.end()) entries_.erase(oldest);
  Entry& e = entries_[a.base];
  e = Entry{};
  e.bytes = a.bytes;
  e.buffer_id = a.buffer_id;
  e.vmm = a.vmm_fd;
  e.state = State::kNotExportable;
  e.last_use = ++tick_;
  ++stats_.not_exportable;
}

int Exporter::take_index() {
  auto free_index = [this] {
    for (int i = 0; i < kTableEntries; ++i)
      if (!in_use_[i] && !retired_[i] && !pinned_[i]) return i;
    return -1;
  };
  int index = free_index();
  if (index >= 0) return index;
  // Retired indices, and evicting an entry, need this PE's receive channel from the peer idle:
  // then no launch that posted an index is in flight, and none of the sender's writes either.
  if (!backend_.channel_idle(false, peer_)) return -1;
  for (int i = 0; i < kTableEntries; ++i) retired_[i] = false;
  index = free_index();
  if (index >= 0) return index;
  auto lru = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (it->second.index >= 0 && !it->second.pinned && it->second.last_use <= call_start_ &&
        (lru == entries_.end() || it->second.last_use < lru->second.last_use))
      lru = it;
  if (lru == entries_.end()) return -1;  // every index is pinned by captures or in this call
  index = lru->second.index;
  ++stats_.evicted;
  drop(lru);
  retired_[static_cast<std::size_t>(index)] = false;  // the channel is idle: free at once
  return index;
}

Exporter::Decision Exporter::prepare(const void* dst, std::size_t bytes, bool capturing) {
  Decision staged;
  if (!usable()) return staged;
  poll();
  const Allocation a = backend_.query(dst);
  if (!a.covers(dst, bytes) || a.managed) return staged;
  if (a.vmm_fd) return prepare_vmm(a, dst, bytes, capturing);
  drop_overlapping(a);
  const uint64_t offset = reinterpret_cast<std::uintptr_t>(dst) - a.base;
  auto it = entries_.find(a.base);
  if (it != entries_.end()) {
    Entry& e = it->second;
    e.last_use = ++tick_;
    if (e.index >= 0) e.pinned = e.pinned || capturing;
    if (e.state == State::kAcked) return Decision{true, e.index, offset};
    return staged;
  }
  IpcHandle handle{};
  if (!backend_.export_handle(a.base, &handle)) {
    remember_not_exportable(a);
    return staged;
  }
  // A new mapping: first let go of every mapped entry whose memory was freed since (asked
  // afresh), so that the sender does not hold freed allocations open until they are evicted.
  sweep();
  const int index = take_index();
  if (index < 0) return staged;  // the table is full and busy: staged this time, asked again later
  Entry& e = entries_[a.base];
  e.bytes = a.bytes;
  e.buffer_id = a.buffer_id;
  e.state = State::kRequested;
  e.index = index;
  e.last_use = ++tick_;
  e.requested_at = e.last_use;
  e.pinned = capturing;
  in_use_[static_cast<std::size_t>(index)] = true;
  ++stats_.requests;
  send(Request{kMap, index, a.base, a.buffer_id, a.bytes, handle});
  return staged;
}

void Exporter::pin(Entry& e, const Allocation& a, const void* dst, std::size_t bytes) {
  e.pinned = true;
  e.captured.emplace_back(reinterpret_cast<std::uintptr_t>(dst) - a.base, bytes);
}

Exporter::Decision Exporter::prepare_vmm(const Allocation& a, const void* dst, std::size_t bytes, bool capturing) {
  Decision staged;
  // Entries over this reservation's range that are not this reservation: freed memory.
  auto first = entries_.lower_bound(a.base);
  if (first != entries_.begin() && std::prev(first)->first + std::prev(first)->second.bytes > a.base) --first;
  drop_stale(first, entries_.lower_bound(a.base + a.bytes), [&](std::uintptr_t base, const Entry& e) {
    return base == a.base && e.vmm && e.bytes == a.bytes;
  });
  auto it = entries_.find(a.base);
  if (it != entries_.end() && it->second.state == State::kNotExportable) {
    it->second.last_use = ++tick_;
    return staged;
  }
  std::vector<Chunk> now;
  if (!backend_.chunks(dst, bytes, &now) || now.empty() || now.size() > static_cast<std::size_t>(kMaxChunksPerMessage))
    return staged;
  // Known chunks over the range of these that are not them: torch unmapped them (and mapped others
  // there). The sender unmaps the old one before it maps the new one.
  std::set<uint64_t> gone;  // offsets of known chunks
  if (it != entries_.end() && it->second.given_up) {
    Entry& e = it->second;
    e.last_use = ++tick_;
    for (const Chunk& c : now) {
      auto k = it->second.chunks.find(c.base - a.base);
      if (k == it->second.chunks.end() || !k->second.acked || k->second.id != c.id || k->second.bytes != c.bytes)
        return staged;
    }
    if (capturing) pin(e, a, dst, bytes);  // as below
    e.decided_at = e.last_use;
    return Decision{true, e.index, reinterpret_cast<std::uintptr_t>(dst) - a.base};
  }
  if (it != entries_.end()) {
    const auto& known = it->second.chunks;
    for (const Chunk& c : now) {
      const uint64_t offset = c.base - a.base;
      auto k = known.lower_bound(offset);
      if (k != known.begin() && std::prev(k)->first + std::prev(k)->second.bytes > offset) --k;
      for (; k != known.end() && k->first < offset + c.bytes; ++k)
        if (k->first != offset || k->second.bytes != c.bytes || k->second.id != c.id) gone.insert(k->first);
    }
    // A chunk changed under an entry that an earlier op of this call was given, or that a launch
    // of the receive channel from the peer may still post: this op is staged, nothing dropped yet
    // (a drop clears the sender's table word, and that op or launch would be refused).
    if (!gone.empty() && (it->second.decided_at > call_start_ || !backend_.channel_idle(false, peer_))) {
      it->second.last_use = ++tick_;
      return staged;
    }
    bool under_capture = false;
    for (uint64_t offset : gone) under_capture = under_capture || it->second.under_capture(offset, known.at(offset).bytes);
    if (!gone.empty() && (under_capture || !it->second.pinned)) {
      // The new chunks go into a new mirror at a new index (see sweep()), and a captured recv, which
      // may post its index at any replay, never meets a hole: the whole entry goes (a captured
      // one's index is never handed out again); this recv starts a new one.
      ++stats_.stale_dropped;
      drop(it);
      it = entries_.end();
      gone.clear();
    }
  }
  if (it == entries_.end()) {
    sweep();  // a new mapping: let go of what was freed since (as for a new allocation)
    const int index = take_index();
    if (index < 0) return staged;
    Entry& e = entries_[a.base];
    e.bytes = a.bytes;
    e.vmm = true;
    e.state = State::kAcked;  // the mirror is made with the first chunk at the sender
    e.index = index;
    in_use_[static_cast<std::size_t>(index)] = true;
    it = entries_.find(a.base);
  }
  Entry& e = it->second;
  e.last_use = ++tick_;
  if (capturing) pin(e, a, dst, bytes);
  for (uint64_t offset : gone) drop_chunk(a.base, e, e.chunks.find(offset));
  // Descriptors travel ahead of their requests: a bounded number unanswered per peer (counted by
  // number, also those of entries dropped since), and none while requests wait for room in the
  // ring, so that the sender's process never holds more than kMaxUnansweredChunks of this PE's
  // descriptors it cannot serve yet.
  const bool can_send = backend_.can_send_chunks(peer_);
  bool every_chunk_acked = true;
  for (const Chunk& c : now) {
    const uint64_t offset = c.base - a.base;
    auto chunk = e.chunks.find(offset);
    if (chunk != e.chunks.end()) {
      every_chunk_acked = every_chunk_acked && chunk->second.acked;
      continue;
    }
    every_chunk_acked = false;
    if (!can_send || static_cast<int>(unanswered_.size()) >= kMaxUnansweredChunks || !outgoing_.empty())
      break;  // the rest at a later recv
    const uint64_t sequence = ++sequence_;
    if (!backend_.send_chunk(peer_, c.base, sequence)) {
      // No descriptor or no socket this time: asked again at a later recv (bounded).
      chunk_failed(it);
      return staged;
    }
    Request request{kMapChunk, e.index, a.base, 0, a.bytes, IpcHandle{}};
    request.chunk_offset = offset;
    request.chunk_bytes = c.bytes;
    request.chunk_id = c.id;
    request.sequence = sequence;
    send(request);
    e.chunks[offset] = ChunkEntry{c.bytes, c.id, false, sequence};
    unanswered_.insert(sequence);
    e.requested_at = e.last_use;
    e.waited = false;  // a new request may be waited for once
    ++stats_.chunk_requests;
  }
  if (!every_chunk_acked) return staged;
  e.decided_at = e.last_use;
  return Decision{true, e.index, reinterpret_cast<std::uintptr_t>(dst) - a.base};
}

Exporter::Entry* Exporter::entry_of(const void* dst, bool same_size) {
  const Allocation a = backend_.query(dst);
  auto it = entries_.find(a.base);
  if (it == entries_.end()) return nullptr;
  if (a.vmm_fd || it->second.vmm)
    return a.vmm_fd && it->second.vmm && it->second.bytes == a.bytes ? &it->second : nullptr;
  if (it->second.buffer_id != a.buffer_id || (same_size && it->second.bytes != a.bytes)) return nullptr;
  return &it->second;
}

namespace {
// Whether the entry waits for the sender's answer: a request, or a reservation's chunk.
template <class Entry>
bool awaiting_answer(const Entry& e, bool requested) {
  return e.vmm ? e.index >= 0 && e.awaiting_chunks() : requested;
}
}  // namespace

bool Exporter::acked(const void* dst) {
  if (!usable()) return false;
  poll();
  const Entry* e = entry_of(dst, true);
  if (e == nullptr || e->state != State::kAcked) return false;
  return !e->vmm || !e->awaiting_chunks();  // a reservation: every chunk asked for is mapped
}

bool Exporter::awaiting(const void* dst) {
  if (!usable()) return false;
  const Entry* e = entry_of(dst, false);
  return e != nullptr && awaiting_answer(*e, e->state == State::kRequested);
}

bool Exporter::claim_wait(const void* dst) {
  if (!usable()) return false;
  Entry* e = entry_of(dst, false);
  if (e == nullptr || !awaiting_answer(*e, e->state == State::kRequested) || e->waited ||
      e->requested_at > call_start_)
    return false;  // (requested_at > call_start_: requested by this very call)
  e->waited = true;
  return true;
}

// ---- importer (the sender's side) -------------------------------------------------------------

void Importer::flush() {
  while (!outgoing_.empty() && mailbox_->acks.push(outgoing_.front())) outgoing_.pop_front();
}

void Importer::unmap_index(int index) {
  const Key key = index_key_[static_cast<std::size_t>(index)];
  table_[index] = 0;  // a late post of this index is refused by the kernel, never written through
  index_key_[static_cast<std::size_t>(index)] = Key{0, 0};
  cancel_deferred(index, [](const Request&) { return true; });
  auto mirror = mirrors_.find(index);
  if (mirror != mirrors_.end()) {
    retire(mirror->second);  // its chunks and address space go once the send channel is idle
    mirrors_.erase(mirror);
  } else {
    auto it = mappings_.find(key);
    if (it != mappings_.end() && it->second.refs > 0) --it->second.refs;  // closed once idle
  }
  ++stats_.unmapped;
}

bool Importer::serve(const Request& request) {
  if (request.index < 0 || request.index >= kTableEntries) {  // not from our exporter
    if (request.kind == kMapChunk) {  // its descriptor closed, its number answered
      const int fd = backend_.take_chunk_fd(peer_, request.sequence);
      if (fd >= 0) backend_.map_chunk(fd, 0, 0);
      outgoing_.push_back(Ack{request.index, 0, request.base, request.chunk_id, request.chunk_offset, 1, request.sequence});
    }
    return true;
  }
  const std::size_t index = static_cast<std::size_t>(request.index);
  if (request.kind == kUnmap) {
    if (index_key_[index] == Key{request.base, request.buffer_id}) unmap_index(request.index);
    return true;
  }
  if (request.kind == kMapChunk) return serve_chunk(request);
  if (request.kind == kUnmapChunk) {
    serve_unmap_chunk(request);
    return true;
  }
  if (request.kind != kMap) return true;
  if (index_key_[index] != Key{0, 0}) unmap_index(request.index);
  const Key key{request.base, request.buffer_id};
  Ack ack{request.index, 0, request.base, request.buffer_id};
  auto it = mappings_.find(key);
  if (it == mappings_.end()) {
    // A handle opens once per process: an allocation unmapped but not closed yet is reused.
    void* mapped = backend_.open_handle(request.handle);
    if (mapped == nullptr) {
      ++stats_.open_failed;
      outgoing_.push_back(ack);
      return true;
    }
    ++stats_.opened;
    it = mappings_.emplace(key, Mapping{mapped, 0, static_cast<std::size_t>(request.bytes)}).first;
  }
  ++it->second.refs;
  table_[request.index] = reinterpret_cast<uint64_t>(it->second.mapped);
  index_key_[index] = key;
  ack.mapped = 1;
  outgoing_.push_back(ack);
  return true;
}

bool Importer::serve_chunk(const Request& request) {
  const std::size_t index = static_cast<std::size_t>(request.index);
  const Key key{request.base, 0};
  const int fd = backend_.take_chunk_fd(peer_, request.sequence);
  auto mirror = mirrors_.find(request.index);
  if (fd >= 0 && mirror != mirrors_.end() && index_key_[index] == key && mirror->second.bytes == request.bytes &&
      request.chunk_offset < request.bytes && request.chunk_bytes <= request.bytes - request.chunk_offset) {
    // The chunk's range must be free in the mirror, also of chunks unmapped but not closed yet:
    // those close once the send channel is idle. Until then this request waits aside (with its
    // descriptor), and the requests behind it are served meanwhile.
    const uint64_t begin = mirror->second.address + request.chunk_offset, end = begin + request.chunk_bytes;
    for (const ChunkClose& c : chunk_closing_) {
      if (c.address < end && begin < c.address + c.bytes) {
        if (!backend_.channel_idle(true, peer_)) {
          deferred_.push_back(Deferred{request, fd});
          return true;
        }
        close_idle();
        break;
      }
    }
  }
  map_chunk(request, fd);
  return true;
}

void Importer::map_chunk(const Request& request, int fd) {
  const std::size_t index = static_cast<std::size_t>(request.index);
  const Key key{request.base, 0};
  Ack ack{request.index, 0, request.base, request.chunk_id, request.chunk_offset, 1, request.sequence};
  const auto refuse = [&] {
    if (fd >= 0) backend_.map_chunk(fd, 0, 0);  // closes it
    ++stats_.chunk_failed;
    outgoing_.push_back(ack);
  };
  const bool fits = request.chunk_bytes != 0 && request.chunk_offset < request.bytes &&
                    request.chunk_bytes <= request.bytes - request.chunk_offset;
  if (!fits || fd < 0) return refuse();
  auto mirror = mirrors_.find(request.index);
  if (mirror == mirrors_.end() || index_key_[index] != key || mirror->second.bytes != request.bytes) {
    // The reservation's first chunk at this index: its mirror.
    if (index_key_[index] != Key{0, 0}) unmap_index(request.index);
    const uint64_t address = backend_.reserve(request.bytes);
    if (address == 0) return refuse();
    mirror = mirrors_.emplace(request.index, Mirror{address, request.bytes, {}}).first;
    index_key_[index] = key;
    table_[request.index] = address;
  }
  Mirror& m = mirror->second;
  // A chunk still mapped over this range (the receiver's unmap not seen: not from our exporter).
  for (const auto& chunk : m.chunks)
    if (chunk.first < request.chunk_offset + request.chunk_bytes && request.chunk_offset < chunk.first + chunk.second.bytes)
      return refuse();
  const uint64_t handle = backend_.map_chunk(fd, m.address + request.chunk_offset, request.chunk_bytes);
  if (handle == 0) {
    ++stats_.chunk_failed;  // (map_chunk closed the descriptor)
    outgoing_.push_back(ack);
    return;
  }
  m.chunks[request.chunk_offset] = MappedChunk{request.chunk_bytes, request.chunk_id, handle};
  ++stats_.chunks_mapped;
  ack.mapped = 1;
  outgoing_.push_back(ack);
}

template <class Match>
void Importer::cancel_deferred(int index, Match match) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (it->request.index == index && match(it->request)) {
      if (it->fd >= 0) backend_.map_chunk(it->fd, 0, 0);  // closes it; the receiver dropped the chunk
      const Request& r = it->request;
      outgoing_.push_back(Ack{r.index, 0, r.base, r.chunk_id, r.chunk_offset, 1, r.sequence});  // its number answered
      it = deferred_.erase(it);
    } else {
      ++it;
    }
  }
}

void Importer::serve_unmap_chunk(const Request& request) {
  // A chunk still waiting aside to be mapped is not mapped at all: forgotten with its descriptor.
  cancel_deferred(request.index, [&](const Request& r) {
    return r.base == request.base && r.chunk_offset == request.chunk_offset && r.chunk_id == request.chunk_id;
  });
  auto mirror = mirrors_.find(request.index);
  if (mirror == mirrors_.end() || index_key_[static_cast<std::size_t>(request.index)] != Key{request.base, 0}) return;
  auto chunk = mirror->second.chunks.find(request.chunk_offset);
  if (chunk == mirror->second.chunks.end() || chunk->second.id != request.chunk_id) return;
  // Out of the mirror's bookkeeping now; its address range is unmapped once the channel is idle
  // (a send in flight may still be past its last write into it).
  chunk_closing_.push_back(ChunkClose{mirror->second.address + chunk->first, chunk->second.bytes, chunk->second.handle});
  mirror->second.chunks.erase(chunk);
  ++stats_.chunks_unmapped;
}

void Importer::retire(const Mirror& mirror) {
  for (const auto& chunk : mirror.chunks)
    chunk_closing_.push_back(ChunkClose{mirror.address + chunk.first, chunk.second.bytes, chunk.second.handle});
  reservations_closing_.emplace_back(mirror.address, mirror.bytes);
}

void Importer::close_idle() {
  for (const ChunkClose& c : chunk_closing_) backend_.unmap_chunk(c.address, c.bytes, c.handle);
  stats_.closed += chunk_closing_.size();  // a chunk's imported handle is released with its mapping
  chunk_closing_.clear();
  for (const auto& r : reservations_closing_) backend_.free_reservation(r.first, r.second);
  reservations_closing_.clear();
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (it->second.refs != 0) {
      ++it;
      continue;
    }
    backend_.close_handle(it->second.mapped);
    ++stats_.closed;
    it = mappings_.erase(it);
  }
}

void Importer::drain() {
  if (!usable()) return;
  flush();
  if (!deferred_.empty()) serve_deferred(backend_.channel_idle(true, peer_));
  Request request{};
  // In order; a request that must wait for the send channel to be idle stays first in the ring.
  while (mailbox_->requests.peek(&request)) {
    if (!serve(request)) break;
    mailbox_->requests.drop_front();
  }
  flush();
  // Handles no index refers to any more close once no launch of the send channel is in flight.
  bool any_unused = !chunk_closing_.empty() || !reservations_closing_.empty();
  for (const auto& entry : mappings_) any_unused = any_unused || entry.second.refs == 0;
  if (any_unused && backend_.channel_idle(true, peer_)) close_idle();
  // Chunks that waited for ranges closed just now (the channel went idle during this drain): mapped
  // now, not at the next idle moment, which a sender streaming back to back may not have for long.
  if (!deferred_.empty()) serve_deferred(false);
  flush();
}

void Importer::serve_deferred(bool idle) {
  if (idle) close_idle();
  std::deque<Deferred> waiting;
  waiting.swap(deferred_);  // (map_chunk may touch deferred_: never while iterating it)
  for (const Deferred& d : waiting) {
    const auto mirror = mirrors_.find(d.request.index);
    bool blocked = false;
    if (mirror != mirrors_.end()) {
      const uint64_t begin = mirror->second.address + d.request.chunk_offset, end = begin + d.request.chunk_bytes;
      for (const ChunkClose& c : chunk_closing_) blocked = blocked || (c.address < end && begin < c.address + c.bytes);
    }
    if (blocked) {
      deferred_.push_back(d);
    } else {
      map_chunk(d.request, d.fd);  // in order among those that can go now
    }
  }
}

bool Importer::maps(uint64_t address, std::size_t bytes) const {
  const uint64_t end = address + bytes;
  if (end < address) return false;
  for (const auto& entry : mappings_) {  // CUDA IPC: whole allocations
    const Mapping& m = entry.second;
    const auto base = reinterpret_cast<uint64_t>(m.mapped);
    if (m.refs > 0 && m.mapped != nullptr && address >= base && end <= base + m.bytes) return true;
  }
  for (const auto& entry : mirrors_) {  // virtual-memory chunks: every byte's chunk mapped
    const Mirror& mirror = entry.second;
    if (address < mirror.address || end > mirror.address + mirror.bytes) continue;
    uint64_t at = address;
    for (const auto& chunk : mirror.chunks) {
      const uint64_t from = mirror.address + chunk.first, to = from + chunk.second.bytes;
      if (to <= at) continue;
      if (from > at) return false;  // a hole
      at = to;
      if (at >= end) return true;
    }
    return false;
  }
  return false;
}

void Importer::close_all() {
  for (const Deferred& d : deferred_)
    if (d.fd >= 0) backend_.map_chunk(d.fd, 0, 0);  // closes it
  deferred_.clear();
  for (int i = 0; i < kTableEntries; ++i) table_[i] = 0;
  // Everything is unused now (the device is idle at cleanup): closed as close_idle() closes.
  for (auto& entry : mappings_) entry.second.refs = 0;
  for (const auto& mirror : mirrors_) retire(mirror.second);
  mirrors_.clear();
  close_idle();
  index_key_.assign(kTableEntries, Key{0, 0});
}

// ---- the shared-memory mailbox ----------------------------------------------------------------

std::string mailbox_name(uint64_t job, int receiver, int sender) {
  char name[96];
  std::snprintf(name, sizeof(name), "/pydatacopy-zc-%016llx-%d-%d", static_cast<unsigned long long>(job),
                receiver, sender);
  return name;
}

namespace {
Mailbox* map_segment(int fd) {
  void* memory = mmap(nullptr, sizeof(Mailbox), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return memory == MAP_FAILED ? nullptr : static_cast<Mailbox*>(memory);
}
}  // namespace

Mailbox* create_mailbox(const std::string& name) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {  // left by a process that died before unlinking it
    shm_unlink(name.c_str());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0) return nullptr;
  if (ftruncate(fd, static_cast<off_t>(sizeof(Mailbox))) != 0) {  // zero-filled: both rings empty
    close(fd);
    shm_unlink(name.c_str());
    return nullptr;
  }
  Mailbox* mailbox = map_segment(fd);
  if (mailbox == nullptr) shm_unlink(name.c_str());
  return mailbox;
}

Mailbox* open_mailbox(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600);
  if (fd < 0) return nullptr;
  struct stat status {};
  // Only a segment this user made, that no one else may open: a segment another user put under
  // this name could feed this PE requests to open arbitrary IPC handles (then: staged).
  if (fstat(fd, &status) != 0 || static_cast<std::size_t>(status.st_size) != sizeof(Mailbox) ||
      status.st_uid != geteuid() || (status.st_mode & 077) != 0) {
    close(fd);
    return nullptr;
  }
  return map_segment(fd);
}

void unlink_mailbox(const std::string& name) { shm_unlink(name.c_str()); }

void unmap_mailbox(Mailbox* mailbox) {
  if (mailbox != nullptr) munmap(mailbox, sizeof(Mailbox));
}

}  // namespace pydatacopy::zero_copy
