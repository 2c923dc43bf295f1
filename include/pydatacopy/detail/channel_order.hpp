// ChannelOrder: successive launches on one channel (staging, counters or buffers that two
// launches must not use at once) run one after the other, whatever streams they come on.
//
// An owned event recorded on the launch's stream after each launch, one for all the channels the
// launch uses (a sendrecv's two: one cudaEventRecord, 0.4-0.7 us of host time under MPS, not
// two); the next launch of a channel, on any stream, waits on its channel's event first
// (cudaStreamWaitEvent). The eager events are a pool of channels + 1: each channel holds one,
// so a free one is always there for the next record. No stream handle is
// remembered: a caller may destroy its stream right after a call, and nothing here touches that
// stream again.
//
// The same stream, eager: a caller that passes the launch stream's cudaStreamGetId (eager_stream_id)
// skips the wait when the channel's last eager launch was recorded on the stream of that id: stream
// order already puts this launch after it (the wait cost 0.3-1.2 us of host time per channel,
// measured on an H200 under MPS, 2026-12-02). The id, not the handle: ids are unique for the
// process's life, so a new stream that reuses a destroyed one's handle is not taken for it; the
// legacy default stream (handle 0, torch's default stream) has one id. The per-thread default
// stream (cudaStreamPerThread: one handle, a stream per thread) is given no id, and neither is a
// launch of the other engines: such a launch waits as before, and leaves the next one waiting.
//
// CUDA graph capture: an event recorded inside a capture cannot be waited on outside it, nor
// one recorded outside a capture from inside it. So each channel keeps two slots: the eager one
// (the last eager launch) and the capture one (the last captured launch, with its capture_id()),
// and a launch waits on the slot of its own state: eager after eager, or within one capture
// (always: no stream id is asked while capturing). A captured call never replaces the eager
// record, so eager calls on several streams stay ordered around a capture made in between. A
// captured call and an eager one on other streams are ordered by the caller, as with NCCL.
#pragma once

#include <cuda_runtime.h>

#include <optional>
#include <vector>

namespace pydatacopy {

// cudaStreamGetId of an eager launch's stream; none: not known (the launch is always ordered by
// the event).
using StreamId = std::optional<unsigned long long>;

// The bookkeeping of one channel, plain C++ (no CUDA: tests/cpp/test_channel_order.cpp): which
// record a launch must wait on, and what its record leaves for the next.
struct ChannelSlots {
  enum class Wait { kNone, kEager, kCaptured };

  // Before a launch in capture state `capture` (0: eager) on the stream of id `stream`.
  Wait before_launch(unsigned long long capture, StreamId stream) const {
    if (capture != 0) return this->capture == capture ? Wait::kCaptured : Wait::kNone;
    if (!eager_recorded) return Wait::kNone;
    if (stream && eager_stream && *stream == *eager_stream) return Wait::kNone;  // stream order
    return Wait::kEager;
  }
  // After that launch's record.
  void recorded(unsigned long long capture, StreamId stream) {
    if (capture != 0) {
      this->capture = capture;
    } else {
      eager_recorded = true;
      eager_stream = stream;
    }
  }

  bool eager_recorded = false;     // false until the first eager launch
  StreamId eager_stream;           // the stream id of the last eager record, when known
  unsigned long long capture = 0;  // capture_id of the last captured record (0: none yet)
};

class ChannelOrder {
 public:
  ChannelOrder() = default;
  explicit ChannelOrder(int channels);  // creates one event per channel
  ~ChannelOrder();                      // never throws; local handles only
  ChannelOrder(ChannelOrder&& other) noexcept;
  ChannelOrder& operator=(ChannelOrder&& other) noexcept;
  ChannelOrder(const ChannelOrder&) = delete;
  ChannelOrder& operator=(const ChannelOrder&) = delete;

  // cudaStreamGetId of `stream` when `capture` (its capture_id()) is 0, else none (not asked
  // while capturing); none for the per-thread default stream. Ask it before anything a failure
  // would have to undo.
  static StreamId eager_stream_id(cudaStream_t stream, unsigned long long capture);

  int channels() const { return static_cast<int>(channels_.size()); }
  // Before a launch on `stream` (`capture`: capture_id(stream); `stream_id`: eager_stream_id()
  // or none): order it after the channel's last launch, when that one was recorded in the same
  // capture state and, eager, on another stream (or one whose id is not known).
  void order_after_last(int channel, cudaStream_t stream, unsigned long long capture,
                        StreamId stream_id = std::nullopt) const;
  // After a launch on `stream` (the same `stream_id` as order_after_last): the channel's next
  // launch waits for this one.
  void record(int channel, cudaStream_t stream, unsigned long long capture,
              StreamId stream_id = std::nullopt) {
    record_launch(&channel, 1, stream, capture, stream_id);
  }
  // The same for a launch that uses `count` channels (repeats allowed): one eager record for all.
  void record_launch(const int* channels, int count, cudaStream_t stream, unsigned long long capture,
                     StreamId stream_id = std::nullopt);
  // True when the channel's last eager launch has finished (or none was made): a query, never a
  // wait. Captured launches are not seen here (their graphs replay when the caller says).
  bool idle(int channel) const;

 private:
  struct Channel {
    int eager = -1;                  // the pool's event recorded after the last eager launch
    cudaEvent_t captured = nullptr;  // recorded after the last captured launch
    ChannelSlots slots;
  };
  const Channel& at(int channel) const;
  void release() noexcept;

  std::vector<Channel> channels_;
  std::vector<cudaEvent_t> pool_;  // eager events, channels + 1
  std::vector<int> holders_;       // per pool event: the channels that hold it
};

}  // namespace pydatacopy
