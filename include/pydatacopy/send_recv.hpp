// Two-sided copies of any device buffer, neither side needing symmetric memory.
//
// A message streams through `num_chunks` symmetric staging chunks per sending peer, held at the
// receiver, with flow control: the sender's blocks put chunk k into slot k % num_chunks and raise
// its arrival signals; the receiver's blocks copy the slot out and return credits, so the put of
// chunk k + 1 overlaps the receiver draining chunk k. Slots are cut into 32 KiB pages with a
// signal each; a block owns a fixed set of pages and waits only for their signals, so no block
// needs any other block of either launch to be resident (any block count, any free SM count).
// Chunk sequence numbers are counted on the device, so a call captured in a CUDA graph moves a
// fresh message at every replay, and replays mix freely with eager calls on the same channel.
// Launches on one channel must not overlap: between eager calls on different streams (and
// between calls of one capture) the engine orders them itself, through one owned event per
// channel (ChannelOrder; no stream of the caller is kept); a graph replayed on one stream and
// eager calls on another must be ordered by the caller, as with NCCL.
//
// Both sides must move the same number of bytes, in the same order per peer pair. Every call is
// stream-ordered and runs until its whole message has moved, so a PE that sends and receives at
// once issues both in one batch() (or sendrecv()): one kernel launch, in which all of them are
// guaranteed to run at the same time. Two launches on two streams are not (the hardware may
// serialise them), which could deadlock.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pydatacopy/channel_order.hpp"

namespace pydatacopy {
namespace kernels {
struct ChunkStreamArgs;
}


class SendRecvEngine {
 public:
  SendRecvEngine() = default;
  ~SendRecvEngine() = default;  // never collective: call cleanup() on every PE
  SendRecvEngine(const SendRecvEngine&) = delete;
  SendRecvEngine& operator=(const SendRecvEngine&) = delete;

  // Collective and blocking. chunk_bytes is rounded up to a multiple of the 32 KiB page; a
  // message moves on up to `blocks` thread blocks on each side (fewer for small messages).
  void init(std::size_t chunk_bytes, int num_chunks, int blocks);
  void cleanup();  // collective and blocking; harmless twice
  bool initialized() const { return base_ != nullptr; }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  int num_chunks() const { return num_chunks_; }
  int blocks() const { return blocks_; }
  // Symmetric bytes one PE holds for staging and signals.
  std::size_t symmetric_bytes() const { return symmetric_bytes_; }
  // What init(chunk_bytes, num_chunks, blocks) takes on each of n_pes PEs (no GPU needed).
  static std::size_t symmetric_bytes_needed(int n_pes, std::size_t chunk_bytes, int num_chunks,
                                            int blocks);

  void send(const void* src, std::size_t bytes, int dst_pe, cudaStream_t stream,
            double timeout_seconds);
  void recv(void* dst, std::size_t bytes, int src_pe, cudaStream_t stream, double timeout_seconds);

  struct Operation {
    bool send;          // true: send `bytes` from `buffer` to `peer`; false: receive into it
    void* buffer;
    std::size_t bytes;
    int peer;
  };
  // Up to 16 sends and recvs (any peers) in one launch.
  void batch(const std::vector<Operation>& ops, cudaStream_t stream, double timeout_seconds);
  // A send and a recv at once: batch() of the two.
  void sendrecv(const void* src, std::size_t send_bytes, int dst_pe, void* dst,
                std::size_t recv_bytes, int src_pe, cudaStream_t stream, double timeout_seconds);

 private:
  void require_ready(const char* what, int pe) const;
  int active_blocks(std::size_t bytes) const;
  kernels::ChunkStreamArgs prepare(bool send, void* buffer, std::size_t bytes, int peer, double timeout);
  int pages() const { return static_cast<int>(chunk_bytes_ / page_bytes_); }
  uint8_t* staging(int src_pe) const;
  uint64_t* arrivals(int src_pe) const;
  uint64_t* credits(int dst_pe) const;

  uint8_t* base_ = nullptr;
  std::size_t chunk_bytes_ = 0, page_bytes_ = 0, symmetric_bytes_ = 0;
  int num_chunks_ = 0, blocks_ = 0, n_pes_ = 0;
  uint64_t* sequences_ = nullptr;  // device [2][n_pes]: next chunk of each send / recv channel
  // Channels [2][n_pes] as sequences_: a launch waits for the channel's last one, on any stream.
  ChannelOrder order_;
  unsigned int* done_ = nullptr;   // device [2][n_pes]: blocks finished in the launch in flight
};

}  // namespace pydatacopy
