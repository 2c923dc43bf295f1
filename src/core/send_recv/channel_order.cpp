#include "pydatacopy/detail/channel_order.hpp"

#include <utility>

#include "pydatacopy/error.hpp"

namespace pydatacopy {

ChannelOrder::ChannelOrder(int channels) {
  PDC_REQUIRE(channels >= 0, "ChannelOrder: the channel count must not be negative, got " << channels);
  ChannelOrder made;  // released by its destructor if a later event cannot be created
  made.channels_.resize(static_cast<std::size_t>(channels));
  for (Channel& channel : made.channels_)
    PDC_CHECK_CUDA(cudaEventCreateWithFlags(&channel.captured, cudaEventDisableTiming));
  made.pool_.assign(channels == 0 ? 0 : static_cast<std::size_t>(channels) + 1, nullptr);  // none: no CUDA asked
  made.holders_.assign(made.pool_.size(), 0);
  for (cudaEvent_t& event : made.pool_) PDC_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  *this = std::move(made);
}

ChannelOrder::~ChannelOrder() { release(); }

ChannelOrder::ChannelOrder(ChannelOrder&& other) noexcept
    : channels_(std::move(other.channels_)), pool_(std::move(other.pool_)), holders_(std::move(other.holders_)) {
  other.channels_.clear();
  other.pool_.clear();
  other.holders_.clear();
}

ChannelOrder& ChannelOrder::operator=(ChannelOrder&& other) noexcept {
  if (this != &other) {
    release();
    channels_ = std::move(other.channels_);
    pool_ = std::move(other.pool_);
    holders_ = std::move(other.holders_);
    other.channels_.clear();
    other.pool_.clear();
    other.holders_.clear();
  }
  return *this;
}

void ChannelOrder::release() noexcept {
  // Destroying an event that pending work will still record or wait on is allowed: the
  // driver frees it once that work is done.
  for (Channel& channel : channels_)
    if (channel.captured != nullptr) cudaEventDestroy(channel.captured);
  for (cudaEvent_t event : pool_)
    if (event != nullptr) cudaEventDestroy(event);
  channels_.clear();
  pool_.clear();
  holders_.clear();
}

const ChannelOrder::Channel& ChannelOrder::at(int channel) const {
  PDC_REQUIRE(channel >= 0 && channel < channels(),
              "ChannelOrder: channel " << channel << " is out of range [0, " << channels() << ")");
  return channels_[static_cast<std::size_t>(channel)];
}

StreamId ChannelOrder::eager_stream_id(cudaStream_t stream, unsigned long long capture) {
  if (capture != 0) return std::nullopt;  // refused on a capturing stream, and not needed there
  // The per-thread default stream: one handle, a stream per thread. Its ids are per thread too,
  // but its launches (rare: torch makes none) are left to the event rather than rely on that.
  if (stream == cudaStreamPerThread) return std::nullopt;
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
  if (stream == nullptr) return std::nullopt;  // handle 0 is the per-thread stream in such a build
#endif
  unsigned long long id = 0;
  PDC_CHECK_CUDA(cudaStreamGetId(stream, &id));
  return id;
}

void ChannelOrder::order_after_last(int channel, cudaStream_t stream, unsigned long long capture,
                                    StreamId stream_id) const {
  const Channel& c = at(channel);
  switch (c.slots.before_launch(capture, stream_id)) {
    case ChannelSlots::Wait::kEager:
      PDC_CHECK_CUDA(cudaStreamWaitEvent(stream, pool_[static_cast<std::size_t>(c.eager)], 0));
      break;
    case ChannelSlots::Wait::kCaptured:
      PDC_CHECK_CUDA(cudaStreamWaitEvent(stream, c.captured, 0));
      break;
    case ChannelSlots::Wait::kNone:
      break;
  }
}

void ChannelOrder::record_launch(const int* channels, int count, cudaStream_t stream, unsigned long long capture,
                                 StreamId stream_id) {
  for (int i = 0; i < count; ++i) at(channels[i]);  // every channel checked before anything changes
  if (capture != 0) {
    // A record inside a capture goes to the capture's own slot: the eager slot keeps the last
    // eager launch, which the next eager launch (on any other stream) must still wait for.
    for (int i = 0; i < count; ++i) {
      Channel& c = channels_[static_cast<std::size_t>(channels[i])];
      PDC_CHECK_CUDA(cudaEventRecord(c.captured, stream));
      c.slots.recorded(capture, stream_id);
    }
    return;
  }
  // A pool event no channel holds (there is one: each channel holds at most one of channels + 1).
  // Re-recording it leaves the waits enqueued on its earlier record as they were.
  std::size_t free = 0;
  while (free < holders_.size() && holders_[free] != 0) ++free;
  PDC_REQUIRE(free < holders_.size(), "ChannelOrder: no free event (a bookkeeping error)");
  PDC_CHECK_CUDA(cudaEventRecord(pool_[free], stream));
  for (int i = 0; i < count; ++i) {
    Channel& c = channels_[static_cast<std::size_t>(channels[i])];
    if (c.eager >= 0) --holders_[static_cast<std::size_t>(c.eager)];
    c.eager = static_cast<int>(free);
    ++holders_[free];
    c.slots.recorded(capture, stream_id);
  }
}

bool ChannelOrder::idle(int channel) const {
  const Channel& c = at(channel);
  if (!c.slots.eager_recorded) return true;
  const cudaError_t status = cudaEventQuery(pool_[static_cast<std::size_t>(c.eager)]);
  if (status == cudaSuccess) return true;
  if (status != cudaErrorNotReady) PDC_CHECK_CUDA(status);
  return false;
}

}  // namespace pydatacopy
