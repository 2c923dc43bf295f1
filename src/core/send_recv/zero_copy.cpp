#include "send_recv/zero_copy.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <iterator>
#include <limits>

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
  drop_stale(entries_.begin(), entries_.end(), [&](std::uintptr_t base, const Entry& e) {
    if (e.index < 0) return true;  // nothing held at the sender
    const Allocation now = backend_.query(reinterpret_cast<const void*>(base));
    return now.cuda_memory && now.base == base && now.bytes == e.bytes && now.buffer_id == e.buffer_id;
  });
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
    e.bytes = a.bytes;
    e.buffer_id = a.buffer_id;
    e.state = State::kNotExportable;
    e.last_use = ++tick_;
    ++stats_.not_exportable;
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

Exporter::Entry* Exporter::entry_of(const void* dst, bool same_size) {
  const Allocation a = backend_.query(dst);
  auto it = entries_.find(a.base);
  if (it == entries_.end() || it->second.buffer_id != a.buffer_id || (same_size && it->second.bytes != a.bytes))
    return nullptr;
  return &it->second;
}

bool Exporter::acked(const void* dst) {
  if (!usable()) return false;
  poll();
  const Entry* e = entry_of(dst, true);
  return e != nullptr && e->state == State::kAcked;
}

bool Exporter::awaiting(const void* dst) {
  if (!usable()) return false;
  const Entry* e = entry_of(dst, false);
  return e != nullptr && e->state == State::kRequested;
}

bool Exporter::claim_wait(const void* dst) {
  if (!usable()) return false;
  Entry* e = entry_of(dst, false);
  if (e == nullptr || e->state != State::kRequested || e->waited || e->requested_at > call_start_)
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
  auto it = mappings_.find(key);
  if (it != mappings_.end() && it->second.refs > 0) --it->second.refs;  // closed once idle
  ++stats_.unmapped;
}

void Importer::drain() {
  if (!usable()) return;
  flush();
  Request request{};
  while (mailbox_->requests.pop(&request)) {
    if (request.index < 0 || request.index >= kTableEntries) continue;  // not from our exporter
    if (request.kind == kUnmap) {
      if (index_key_[static_cast<std::size_t>(request.index)] != Key{0, 0}) unmap_index(request.index);
      continue;
    }
    if (request.kind != kMap) continue;
    if (index_key_[static_cast<std::size_t>(request.index)] != Key{0, 0}) unmap_index(request.index);
    const Key key{request.base, request.buffer_id};
    Ack ack{request.index, 0, request.base, request.buffer_id};
    auto it = mappings_.find(key);
    if (it == mappings_.end()) {
      // A handle opens once per process: an allocation unmapped but not closed yet is reused.
      void* mapped = backend_.open_handle(request.handle);
      if (mapped == nullptr) {
        ++stats_.open_failed;
        outgoing_.push_back(ack);
        continue;
      }
      ++stats_.opened;
      it = mappings_.emplace(key, Mapping{mapped, 0}).first;
    }
    ++it->second.refs;
    table_[request.index] = reinterpret_cast<uint64_t>(it->second.mapped);
    index_key_[static_cast<std::size_t>(request.index)] = key;
    ack.mapped = 1;
    outgoing_.push_back(ack);
  }
  flush();
  // Handles no index refers to any more close once no launch of the send channel is in flight.
  bool any_unused = false;
  for (const auto& entry : mappings_) any_unused = any_unused || entry.second.refs == 0;
  if (any_unused && backend_.channel_idle(true, peer_)) {
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
}

void Importer::close_all() {
  for (int i = 0; i < kTableEntries; ++i) table_[i] = 0;
  for (const auto& entry : mappings_) {
    backend_.close_handle(entry.second.mapped);
    ++stats_.closed;
  }
  mappings_.clear();
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
