// ChannelOrder: successive launches on one channel (staging, counters or buffers that two
// launches must not use at once) run one after the other, whatever streams they come on.
//
// One owned event per channel, recorded on the launch's stream after each launch; the next
// launch, on any stream, waits on it first (cudaStreamWaitEvent: free on the same stream, and
// next to free when the event has completed). No stream is remembered: a caller may destroy
// its stream right after a call, and nothing here touches that stream again.
//
// CUDA graph capture: an event recorded inside a capture cannot be waited on outside it, nor
// one recorded outside a capture from inside it. So each channel keeps two slots: the eager one
// (the last eager launch) and the capture one (the last captured launch, with its capture_id()),
// and a launch waits on the slot of its own state: eager after eager, or within one capture. A
// captured call never replaces the eager record, so eager calls on several streams stay ordered
// around a capture made in between. A captured call and an eager one on other streams are
// ordered by the caller, as with NCCL.
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace pydatacopy {

class ChannelOrder {
 public:
  ChannelOrder() = default;
  explicit ChannelOrder(int channels);  // creates one event per channel
  ~ChannelOrder();                      // never throws; local handles only
  ChannelOrder(ChannelOrder&& other) noexcept;
  ChannelOrder& operator=(ChannelOrder&& other) noexcept;
  ChannelOrder(const ChannelOrder&) = delete;
  ChannelOrder& operator=(const ChannelOrder&) = delete;

  int channels() const { return static_cast<int>(channels_.size()); }
  // Before a launch on `stream` (`capture`: capture_id(stream)): order it after the channel's
  // last launch, when that one was recorded in the same capture state.
  void order_after_last(int channel, cudaStream_t stream, unsigned long long capture) const;
  // After a launch on `stream`: the channel's next launch waits for this one.
  void record(int channel, cudaStream_t stream, unsigned long long capture);
  // True when the channel's last eager launch has finished (or none was made): a query, never a
  // wait. Captured launches are not seen here (their graphs replay when the caller says).
  bool idle(int channel) const;

 private:
  struct Channel {
    cudaEvent_t eager = nullptr;     // recorded after the last eager launch
    cudaEvent_t captured = nullptr;  // recorded after the last captured launch
    bool eager_recorded = false;     // false until the first eager launch
    unsigned long long capture = 0;  // capture_id of `captured`'s record (0: none yet)
  };
  const Channel& at(int channel) const;
  void release() noexcept;

  std::vector<Channel> channels_;
};

}  // namespace pydatacopy
