// Zero-copy send/recv between PEs that reach each other by load/store: the host side.
//
// The protocol on the device is in send_recv.hpp. This file holds the bookkeeping that lets a
// sender's kernel write straight into its receiver's tensor: which of the receiver's CUDA
// allocations the sender has mapped (CUDA IPC), at which index of the sender's table, and the
// mailbox through which the two host processes agree on it. It is plain C++ behind a small
// backend (the CUDA calls), so that it runs, and is tested, without a GPU
// (tests/cpp/test_zero_copy.cpp); send_recv.cpp supplies the CUDA backend.
//
// Roles, per ordered pair of PEs (sender S, receiver R):
// - R is the exporter. At each recv at or above the threshold, R's host finds the allocation
//   holding the destination (base, size, buffer ID). When S has acknowledged a mapping of that
//   allocation at index j, the recv is posted as ZERO_COPY at (j, offset into the allocation);
//   otherwise it is posted STAGED, and R asks S (once per allocation) to map it: a request with
//   the allocation's cudaIpcMemHandle and the index R chose. Memory that cannot be exported
//   (cudaIpcGetMemHandle fails: torch's expandable segments, cudaMallocAsync pools) is
//   remembered and stays staged.
// - S is the importer. At its calls it drains R's requests without blocking: it opens the handle,
//   writes the mapped address into its table at index j (host-mapped memory its kernels read),
//   and acknowledges. An unmap request clears the table entry at once and closes the handle only
//   once S's send channel to R is idle (no launch that could still use it is in flight).
// - An index is never reused while a launch that R posted with it may still run: R frees an
//   index only when R's receive channel from S is idle (cudaEventQuery on its last launch, never a
//   host wait), and then no kernel of either PE can use the old mapping any more (a recv posted
//   ZERO_COPY completes only after S's writes landed). A base seen with a new buffer ID (freed and
//   reused memory) drops the old entry at once: the stale mapping is never posted again; and
//   before each new mapping every mapped entry is asked afresh, so that S does not hold freed
//   allocations open until they are evicted.
// - Entries used while capturing a CUDA graph are pinned: a graph freezes its index in the
//   kernel parameters, and its lifetime is not known here, so they are never evicted and their
//   index is never reused until cleanup. A pinned entry whose memory was freed is dropped (an
//   unmap clears S's table entry); a replay that still posts its index finds the entry empty and
//   the sender refuses the channel instead of writing anywhere.
//
// - Memory made by the CUDA driver's virtual memory API whose physical chunks export as POSIX file
//   descriptors (torch's expandable segments: one address reservation per segment, 20 MiB chunks
//   mapped into it as it grows) is mapped chunk by chunk. The unit of an entry is then the whole
//   reservation: S reserves as much address space (its mirror, at the entry's table index) and
//   maps each chunk R asks for at the chunk's offset, so that a recv spanning several chunks is
//   one contiguous range on both sides. R exports a chunk's handle as a file descriptor and passes
//   it over a Unix socket (fd_channel.hpp) with a sequence number; the request in the ring names
//   that number, and S takes the descriptor with it. A recv goes zero-copy once every chunk under
//   it is acknowledged, each known by its physical allocation's ID: a chunk that torch unmapped
//   and mapped again (another ID) is unmapped at S first (once S's send channel is idle, S stops
//   reading requests until then, so that the new chunk never lands on an address still mapped).
//
// The mailbox is two single-producer single-consumer rings (requests R -> S, acknowledgements
// S -> R) in POSIX shared memory, one segment per ordered pair of PEs on one node. Pushes that
// find a ring full wait in a local queue, in order, for the next call.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "registration/registration_cache.hpp"  // Allocation

namespace pydatacopy::zero_copy {

constexpr int kTableEntries = 64;   // mappings per peer (the sender's table, the receiver's index space)
constexpr int kRingEntries = 256;   // messages per mailbox ring
constexpr int kMaxNotExportable = 256;  // remembered non-exportable allocations per peer
// Chunks under one recv of virtual-memory (expandable) memory that may move zero-copy: 1,024
// chunks of torch's 20 MiB are 20 GiB. A larger message stays staged.
constexpr int kMaxChunksPerMessage = 1024;
// Chunk descriptors sent to a peer and not answered yet (the sender's process holds them open).
constexpr int kMaxUnansweredChunks = 64;
// Failures to export or map chunks of one reservation before it stays staged for good.
constexpr int kMaxChunkFailures = 8;
// How often the progress thread asks the driver whether mapped receive memory was given back.
constexpr std::chrono::milliseconds kSweepPeriod{50};

struct IpcHandle {
  unsigned char bytes[64];  // cudaIpcMemHandle_t
};

struct Request {
  uint32_t kind;  // kMap, kUnmap, kMapChunk or kUnmapChunk
  int32_t index;
  uint64_t base;       // the allocation's (a reservation's) address in the receiver's process
  uint64_t buffer_id;  // its CU_POINTER_ATTRIBUTE_BUFFER_ID (0 for a reservation)
  uint64_t bytes;
  IpcHandle handle;    // kMap only
  // kMapChunk and kUnmapChunk: one physical chunk of the reservation at `base`.
  uint64_t chunk_offset = 0, chunk_bytes = 0;
  uint64_t chunk_id = 0;   // CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID
  uint64_t sequence = 0;   // kMapChunk: the file descriptor's number on the socket
};
constexpr uint32_t kMap = 1, kUnmap = 2, kMapChunk = 3, kUnmapChunk = 4;

struct Ack {
  int32_t index;
  int32_t mapped;  // 1: table[index] holds the allocation (the chunk); 0: the sender could not open it
  uint64_t base;
  uint64_t buffer_id;  // a chunk's: its chunk_id
  uint64_t chunk_offset = 0;
  uint32_t chunk = 0;  // 1: the answer to a kMapChunk
  uint64_t sequence = 0;  // a kMapChunk's: its descriptor's number
};

// A physical chunk of virtual-memory memory as the receiver's process maps it.
struct Chunk {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  uint64_t id = 0;  // unique per physical allocation over the process's life
};

// A single-producer single-consumer ring that lives in shared memory (all zero: empty). The
// producer owns `tail`, the consumer `head`; a slot is published by the release store of tail
// and freed by the release store of head.
template <typename T, int N>
struct Ring {
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the mailbox needs lock-free 64-bit atomics");
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) T slots[N];

  bool push(const T& value) {
    const uint64_t t = tail.load(std::memory_order_relaxed);
    if (t - head.load(std::memory_order_acquire) >= static_cast<uint64_t>(N)) return false;
    slots[t % N] = value;
    tail.store(t + 1, std::memory_order_release);
    return true;
  }
  bool pop(T* value) {
    if (!peek(value)) return false;
    drop_front();
    return true;
  }
  // The oldest entry, left in the ring (drop_front() takes it out).
  bool peek(T* value) const {
    const uint64_t h = head.load(std::memory_order_relaxed);
    if (h == tail.load(std::memory_order_acquire)) return false;
    *value = slots[h % N];
    return true;
  }
  void drop_front() { head.store(head.load(std::memory_order_relaxed) + 1, std::memory_order_release); }
};

struct Mailbox {
  Ring<Request, kRingEntries> requests;  // receiver -> sender
  Ring<Ack, kRingEntries> acks;          // sender -> receiver
};

// What the bookkeeping needs from CUDA and from the engine.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Allocation query(const void* ptr) = 0;
  // cudaIpcGetMemHandle on the allocation's base; false when the memory cannot be exported.
  virtual bool export_handle(std::uintptr_t base, IpcHandle* handle) = 0;
  // cudaIpcOpenMemHandle; null when it fails.
  virtual void* open_handle(const IpcHandle& handle) = 0;
  virtual void close_handle(void* mapped) = 0;
  // No launch of this PE's channel (send to / receive from `peer`) is in flight (event query).
  virtual bool channel_idle(bool send, int peer) = 0;

  // Virtual-memory (expandable) memory. The defaults: none of it moves zero-copy.
  // The receiver: the physical chunks mapped over [ptr, ptr + bytes), in address order; false
  // when a part is not mapped or cannot be asked (the recv stays staged).
  virtual bool chunks(const void* /*ptr*/, std::size_t /*bytes*/, std::vector<Chunk>* /*out*/) { return false; }
  // The receiver: whether a descriptor can be sent to `peer` now (false, for instance, while a
  // failed connection waits to be tried again: no failure of the chunk's own).
  virtual bool can_send_chunks(int /*peer*/) { return true; }
  // The receiver: exports the chunk mapped at `chunk_base` as a file descriptor and sends it to
  // `peer`'s process under `sequence`; false when either fails (the reservation stays staged).
  virtual bool send_chunk(int /*peer*/, std::uintptr_t /*chunk_base*/, uint64_t /*sequence*/) { return false; }
  // The sender: the descriptor `peer` sent under `sequence` (owned by the caller now), or -1.
  virtual int take_chunk_fd(int /*peer*/, uint64_t /*sequence*/) { return -1; }
  // The sender: `bytes` of address space (0 when the driver refuses), and its release.
  virtual uint64_t reserve(std::size_t /*bytes*/) { return 0; }
  virtual void free_reservation(uint64_t /*address*/, std::size_t /*bytes*/) {}
  // The sender: imports `fd` (closed here either way), maps it at [address, address + bytes)
  // and gives this device access; the imported handle, or 0 when a step fails (undone).
  virtual uint64_t map_chunk(int /*fd*/, uint64_t /*address*/, std::size_t /*bytes*/) { return 0; }
  virtual void unmap_chunk(uint64_t /*address*/, std::size_t /*bytes*/, uint64_t /*handle*/) {}
};

// The receiver's side for one sending peer. Not thread-safe (the engine's lock covers it).
class Exporter {
 public:
  struct Decision {
    bool zero_copy = false;
    int index = -1;
    uint64_t offset = 0;
  };
  struct Stats {
    uint64_t requests = 0, acked = 0, refused = 0, not_exportable = 0, stale_dropped = 0, evicted = 0;
    uint64_t chunk_requests = 0, chunks_acked = 0, chunks_dropped = 0;  // virtual-memory chunks
  };

  Exporter(Backend& backend, Mailbox* mailbox, int peer) : backend_(backend), mailbox_(mailbox), peer_(peer) {}
  bool usable() const { return mailbox_ != nullptr; }

  // Reads the sender's acknowledgements and flushes queued requests (never blocks).
  void poll();
  // A call (one launch) begins: entries its ops are given from now on are in flight with it,
  // so a later op of the same call must not evict them (the channel's last launch being idle
  // says nothing about this one, not launched yet).
  void begin_call() { call_start_ = tick_; }
  // The mode of a recv into [dst, dst + bytes) at or above the threshold. `capturing`: the
  // recv is being captured into a CUDA graph (the entry is pinned, see above).
  Decision prepare(const void* dst, std::size_t bytes, bool capturing);
  // Whether prepare() would answer ZERO_COPY for dst now (no side effects but polling).
  bool acked(const void* dst);
  // Requests still waiting for the sender's answer (a capture may wait for them briefly).
  bool awaiting(const void* dst);
  // Whether an eager recv into dst should wait (briefly, once) for the sender's answer: the
  // allocation's mapping was requested by an earlier call and is still unanswered, and no call
  // waited for it yet. True once per request (this marks it), so that a sender that never
  // answers costs one bounded wait, not one per call.
  bool claim_wait(const void* dst);
  // The progress thread's round, between calls: at most every kSweepPeriod, lets go of mapped entries (chunks)
  // whose memory was given back since (torch's empty_cache), so that the sender closes its
  // mappings and the memory returns to the driver without waiting for a new mapping. True when
  // it ran.
  bool sweep_if_due(std::chrono::steady_clock::time_point now);
  const Stats& stats() const { return stats_; }
  int live_entries() const { return static_cast<int>(entries_.size()); }

 private:
  enum class State { kRequested, kAcked, kNotExportable };
  struct ChunkEntry {
    std::size_t bytes = 0;
    uint64_t id = 0;
    bool acked = false;
    uint64_t sequence = 0;  // its descriptor's number (the answer names it)
  };
  struct Entry {
    std::size_t bytes = 0;
    unsigned long long buffer_id = 0;
    State state = State::kRequested;
    int index = -1;
    uint64_t last_use = 0;
    uint64_t requested_at = 0;  // tick_ of the call that requested the mapping (the last chunk)
    bool pinned = false;
    bool waited = false;  // claim_wait() answered true for this request
    // A virtual-memory reservation (base, bytes): its state is kAcked while the sender holds its
    // mirror at `index`, and each chunk asked for is acknowledged by itself (offset -> chunk).
    bool vmm = false;
    std::map<uint64_t, ChunkEntry> chunks;
    int chunk_failures = 0;  // chunks the sender could not map, or not sent (kMaxChunkFailures)
    bool given_up = false;   // past kMaxChunkFailures and not droppable then: no new chunk asked for
    uint64_t decided_at = 0; // tick_ of the last op given ZERO_COPY at this index
    std::vector<std::pair<uint64_t, std::size_t>> captured;  // (offset, bytes) of captured recvs
    bool under_capture(uint64_t offset, std::size_t length) const {
      for (const auto& c : captured)
        if (c.first < offset + length && offset < c.first + c.second) return true;
      return false;
    }
    bool awaiting_chunks() const {
      for (const auto& c : chunks)
        if (!c.second.acked) return true;
      return false;
    }
  };
  // dst's allocation's entry, if it is the same allocation (buffer ID; and size, with same_size;
  // a reservation's by its range).
  Entry* entry_of(const void* dst, bool same_size);
  Decision prepare_vmm(const Allocation& a, const void* dst, std::size_t bytes, bool capturing);
  // A capture of [dst, dst + bytes) in reservation `a`: the entry pinned, the range recorded.
  void pin(Entry& e, const Allocation& a, const void* dst, std::size_t bytes);
  // Asks the sender to unmap the chunk at `offset` of the reservation at `base` and forgets it.
  void drop_chunk(std::uintptr_t base, Entry& e, std::map<uint64_t, ChunkEntry>::iterator chunk);
  // An entry remembered as staged for good (its memory cannot be exported), oldest out first.
  void remember_not_exportable(const Allocation& a);
  // One more chunk of the reservation could not be sent or mapped: staged for good at the limit.
  void chunk_failed(std::map<std::uintptr_t, Entry>::iterator it);
  void drop(std::map<std::uintptr_t, Entry>::iterator it);
  void drop_overlapping(const Allocation& a);
  void sweep();  // drops every mapped entry whose allocation is gone (asked afresh)
  // Drops the entries of [first, last) that `keep(base, entry)` does not keep, counting them
  // stale. `last` is never dropped, so it stays valid.
  template <class Keep>
  void drop_stale(std::map<std::uintptr_t, Entry>::iterator first,
                  std::map<std::uintptr_t, Entry>::iterator last, Keep keep) {
    while (first != last) {
      if (keep(first->first, first->second)) {
        ++first;
      } else {
        ++stats_.stale_dropped;
        drop(first++);
      }
    }
  }
  int take_index();
  void send(const Request& request);
  void flush();

  Backend& backend_;
  Mailbox* mailbox_;
  int peer_;
  std::map<std::uintptr_t, Entry> entries_;  // allocation base -> entry
  std::vector<bool> in_use_ = std::vector<bool>(kTableEntries, false);  // index held by an entry
  std::vector<bool> retired_ = std::vector<bool>(kTableEntries, false); // freed, not reusable yet
  std::vector<bool> pinned_ = std::vector<bool>(kTableEntries, false);  // never reusable again
  std::deque<Request> outgoing_;
  uint64_t tick_ = 0;
  uint64_t call_start_ = 0;  // tick_ when the current call began (begin_call)
  uint64_t sequence_ = 0;    // the last chunk descriptor sent to the peer
  std::set<uint64_t> unanswered_;  // descriptors sent and not answered yet, whatever became of their entry
  std::chrono::steady_clock::time_point next_sweep_{};
  Stats stats_;
};

// The sender's side for one receiving peer. Not thread-safe (the engine's lock covers it).
class Importer {
 public:
  struct Stats {
    uint64_t opened = 0, open_failed = 0, unmapped = 0, closed = 0;  // closed: IPC handles and chunks
    uint64_t chunks_mapped = 0, chunk_failed = 0, chunks_unmapped = 0;  // virtual-memory chunks
  };
  // `table`: kTableEntries words that this PE's kernels read (host-mapped memory).
  Importer(Backend& backend, Mailbox* mailbox, int peer, volatile uint64_t* table)
      : backend_(backend), mailbox_(mailbox), peer_(peer), table_(table) {}
  bool usable() const { return mailbox_ != nullptr; }
  // Serves the receiver's requests and closes handles no launch can use any more (never blocks).
  void drain();
  // Closes every handle (cleanup, after the device is idle).
  void close_all();
  const Stats& stats() const { return stats_; }
  int open_handles() const { return static_cast<int>(mappings_.size()); }
  // Whether [address, address + bytes) lies in what this PE maps of the receiver's memory now (an
  // allocation in the table, or chunks of a mirror, every byte's mapped): a guess of the copy
  // engine's target must, before a copy node is set to it (send_recv.hpp, "The copy engine").
  bool maps(uint64_t address, std::size_t bytes) const;
  int pending_closes() const { return static_cast<int>(closing_.size() + chunk_closing_.size()); }
  int deferred_chunks() const { return static_cast<int>(deferred_.size()); }
  int mapped_chunks() const {
    int n = 0;
    for (const auto& m : mirrors_) n += static_cast<int>(m.second.chunks.size());
    return n;
  }

 private:
  struct Mapping {
    void* mapped = nullptr;
    int refs = 0;            // table entries holding it (0: unmapped, not closed yet)
    std::size_t bytes = 0;   // the allocation's
  };
  struct MappedChunk {
    std::size_t bytes = 0;
    uint64_t id = 0;
    uint64_t handle = 0;
  };
  // The address space mirroring a receiver's reservation, and the chunks mapped into it.
  struct Mirror {
    uint64_t address = 0;
    std::size_t bytes = 0;
    std::map<uint64_t, MappedChunk> chunks;  // offset -> chunk
  };
  struct ChunkClose {
    uint64_t address = 0;
    std::size_t bytes = 0;
    uint64_t handle = 0;
  };
  using Key = std::pair<uint64_t, uint64_t>;  // the receiver's (base, buffer ID); a reservation's (base, 0)
  void unmap_index(int index);
  // A chunk whose range in the mirror still holds a chunk unmapped but not closed, waiting aside
  // (with its descriptor) for the send channel to be idle; the ring is served meanwhile.
  struct Deferred {
    Request request;
    int fd = -1;
  };
  // A request (true: taken out of the ring).
  bool serve(const Request& request);
  bool serve_chunk(const Request& request);
  void map_chunk(const Request& request, int fd);  // answers it; closes fd either way
  // Maps the deferred chunks whose ranges are free now (`idle`: closes the pending ones first).
  void serve_deferred(bool idle);
  void serve_unmap_chunk(const Request& request);
  // Forgets the deferred chunks of `index` that `match` (their descriptors closed).
  template <class Match>
  void cancel_deferred(int index, Match match);
  void retire(const Mirror& mirror);  // its chunks and address space closed at the next close_idle()
  void close_idle();
  void flush();

  Backend& backend_;
  Mailbox* mailbox_;
  int peer_;
  volatile uint64_t* table_;
  std::vector<Key> index_key_ = std::vector<Key>(kTableEntries, Key{0, 0});  // (0, 0): empty
  std::map<Key, Mapping> mappings_;
  std::vector<void*> closing_;  // unmapped, closed once the send channel is idle
  std::map<int, Mirror> mirrors_;  // table index -> the reservation mapped there
  std::vector<ChunkClose> chunk_closing_;  // unmapped at once from the table, closed once idle
  std::vector<std::pair<uint64_t, std::size_t>> reservations_closing_;  // freed once their chunks are
  std::deque<Deferred> deferred_;
  std::deque<Ack> outgoing_;
  Stats stats_;
};

// The shared-memory segment of one ordered pair: "/pydatacopy-zc-<job>-<receiver>-<sender>".
std::string mailbox_name(uint64_t job, int receiver, int sender);
// The receiver creates it (exclusive; a stale segment of the same name is replaced); null when
// the system refuses (no /dev/shm): zero-copy is then off for that peer.
Mailbox* create_mailbox(const std::string& name);
// The sender opens what the receiver created; null when it cannot (another container).
Mailbox* open_mailbox(const std::string& name);
void unlink_mailbox(const std::string& name);  // once both opened: nothing is left on a crash
void unmap_mailbox(Mailbox* mailbox);

}  // namespace pydatacopy::zero_copy
