// DoubleBufferManager: the design note's token exchange, made into a real pipeline.
//
// Two sets of symmetric buffers, each holding a send and a receive buffer of
// n_tokens x token_size bytes and one signal per token. Round r uses set r % 2:
//   fill send_buffer(r % 2)  ->  exchange()  ->  wait(r)  ->  read recv_buffer(r % 2)
// exchange() puts every token into the peer's receive buffer and raises that token's signal;
// round r + 1 can be filled and exchanged while round r is still in flight. Flow control: the
// put of round r waits (on the device) until the receiving PE has called exchange() for round r
// itself, which declares its receive buffer of round r - 2 free. So a receive buffer stays valid
// until its owner calls exchange() for two rounds later.
//
// All calls except init/cleanup/test_bandwidth are stream-ordered on the stream passed in.
// How often each set has been exchanged is counted on the device, so exchange() and wait()
// captured in a CUDA graph make a fresh round at every replay. exchange() and wait() may use
// different streams: wait() orders its stream after the round's exchange(), and exchange()
// orders its stream after the wait() for the set's previous round, before it frees that receive
// buffer to the peer (ChannelOrder: owned events, no stream of the caller is kept, so a caller
// may destroy its streams at any time). Work that reads a receive buffer after wait() on a
// stream other than the next exchange()'s must be ordered before that exchange() by the caller
// (the Python class does this for torch's own streams). (Between calls in the same state, both
// eager or both in one capture; a captured call and an eager one on other streams are ordered by
// the caller.)
//
// Threads: exchange() and wait() (and round(), last_waited_round(), test_bandwidth()'s rounds)
// may be called from any thread; the manager serialises them with a lock of its own (the Python
// layer calls them without the GIL). A blocking wait() holds it only for the launch, not for
// its host wait, so another thread's exchange() need not wait for that. init() and cleanup() are
// collective and not serialised with the other calls: make them while no other thread uses the
// manager.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "pydatacopy/detail/channel_order.hpp"

namespace pydatacopy {

class DoubleBufferManager {
 public:
  // The most bytes one buffer (n_tokens x token_size) holds: 1 TiB (_C.MAX_TOKEN_BUFFER_BYTES).
  static constexpr int64_t kMaxBufferBytes = int64_t{1} << 40;

  DoubleBufferManager() = default;
  // Never collective: a manager destroyed without cleanup() leaves its symmetric memory allocated
  // (freeing it would need every PE) until NVSHMEM is finalised.
  ~DoubleBufferManager() = default;
  DoubleBufferManager(const DoubleBufferManager&) = delete;
  DoubleBufferManager& operator=(const DoubleBufferManager&) = delete;

  // Collective and blocking: allocates both buffer sets on every PE.
  void init(int64_t n_tokens, int64_t token_size);
  // Collective and blocking; harmless when not initialised.
  void cleanup();

  // The note's benchmark: one round with the default peers, blocking until this PE's tokens have
  // been delivered and the peer's have arrived. Returns GB/s sent by this PE (10^9 bytes/s).
  double test_bandwidth(int rank, int world_size, cudaStream_t stream = nullptr);

  bool initialized() const { return base_ != nullptr; }
  int64_t n_tokens() const { return n_tokens_; }
  int64_t token_size() const { return token_size_; }
  int64_t buffer_bytes() const { return n_tokens_ * token_size_; }
  // Rounds exchanged so far; the next exchange() is round `round()` and uses set round() % 2.
  int64_t round() const;
  int64_t last_waited_round() const;
  uint8_t* send_buffer(int set) const;
  uint8_t* recv_buffer(int set) const;

  // Symmetric bytes init(n_tokens, token_size) takes on each of n_pes PEs (no GPU needed).
  static std::size_t symmetric_bytes_needed(int64_t n_tokens, int64_t token_size, int n_pes);
  // Default peers: 1 PE: itself; an even number: pairs (pe ^ 1); odd: a ring, sending to
  // pe + 1 and receiving from pe - 1.
  static int default_dst_pe(int pe, int n_pes);
  static int default_src_pe(int pe, int n_pes);

  // Puts this round's send buffer to dst_pe and releases this PE's receive set of two rounds
  // ago to src_pe (the PE that sends to us). Returns the round number. Stream-ordered.
  int64_t exchange(int dst_pe, int src_pe, cudaStream_t stream, double timeout_seconds);
  // Waits on `stream` until every token of `round` from src_pe has arrived. Stream-ordered: a
  // timeout is reported by check_device_errors() (blocking callers check it for you).
  // blocking: also waits on the host until the wait is over on the GPU (wait_for_stream) and
  // throws its timeout here; refused while `stream` is being captured.
  void wait(int64_t round, int src_pe, cudaStream_t stream, double timeout_seconds, bool blocking = false);

 private:
  // exchange() and wait()'s stream work, under mutex_.
  int64_t exchange_locked(int dst_pe, int src_pe, cudaStream_t stream, double timeout_seconds);
  void wait_locked(int64_t round, int src_pe, cudaStream_t stream, double timeout_seconds);
  uint64_t* signals(int set) const;
  uint64_t* credits(int set) const;
  void require_initialized(const char* what) const;

  uint8_t* base_ = nullptr;  // one symmetric allocation holding everything
  uint64_t* uses_ = nullptr;          // device [2]: exchanges of each set so far
  unsigned int* done_ = nullptr;      // device [2]: blocks finished in the exchange in flight
  // Channels: each set's last exchange() and last wait(); no stream of the caller is kept.
  static constexpr int kChannels = 4;
  static int exchanged(int set) { return set; }
  static int waited(int set) { return 2 + set; }
  ChannelOrder order_;
  int64_t n_tokens_ = 0;
  int64_t token_size_ = 0;
  int64_t next_round_ = 0;
  int64_t last_waited_round_ = -1;
  mutable std::mutex mutex_;  // exchange() and wait() (see above)
};

}  // namespace pydatacopy
