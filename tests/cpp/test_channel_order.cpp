// ChannelOrder's bookkeeping (ChannelSlots), without a GPU: which record a launch waits on.
// Stream ids stand for cudaStreamGetId's (unique for the process's life, so a new stream that
// reuses a destroyed stream's handle has another id); capture ids for capture_id()'s (0: eager).
#include <cstdio>
#include <string>

#include "check.hpp"
#include "pydatacopy/detail/channel_order.hpp"

namespace {

using pydatacopy::ChannelSlots;
using pydatacopy::StreamId;
using pydatacopy_test::check;
using Wait = ChannelSlots::Wait;

constexpr StreamId kUnknown = std::nullopt;

void test_first_launch_waits_on_nothing() {
  const ChannelSlots slots;
  check(slots.before_launch(0, 7) == Wait::kNone, "first eager launch: nothing to wait for");
  check(slots.before_launch(0, kUnknown) == Wait::kNone, "first eager launch, id unknown: nothing");
  check(slots.before_launch(3, kUnknown) == Wait::kNone, "first captured launch: nothing");
}

void test_same_stream_skips_another_waits() {
  ChannelSlots slots;
  slots.recorded(0, 7);
  check(slots.before_launch(0, 7) == Wait::kNone, "the stream of the last launch: stream order suffices");
  check(slots.before_launch(0, 8) == Wait::kEager, "another stream waits for the last launch");
  check(slots.before_launch(0, kUnknown) == Wait::kEager, "a launch whose stream id is not known waits");
  // A destroyed stream 7, its handle taken by a new stream: the new stream has another id.
  slots.recorded(0, 8);
  check(slots.before_launch(0, 7) == Wait::kEager, "back to the first stream after another: waits");
  check(slots.before_launch(0, 8) == Wait::kNone, "the last launch's stream is now 8");
}

void test_a_record_without_id_leaves_the_next_launch_waiting() {
  ChannelSlots slots;
  slots.recorded(0, 7);
  slots.recorded(0, kUnknown);  // a caller that gives no id (all-to-all, token exchange)
  check(slots.before_launch(0, 7) == Wait::kEager, "after a record of unknown stream: waits");
  check(slots.before_launch(0, kUnknown) == Wait::kEager, "unknown after unknown: waits");
}

void test_captures_keep_their_own_slot() {
  ChannelSlots slots;
  check(slots.before_launch(5, kUnknown) == Wait::kNone, "a capture with no captured record yet: no wait");
  slots.recorded(0, 7);
  check(slots.before_launch(5, kUnknown) == Wait::kNone,
        "a captured launch never waits on the eager record (it cannot, across capture states)");
  slots.recorded(5, kUnknown);
  check(slots.before_launch(5, kUnknown) == Wait::kCaptured, "within one capture: waits on its record");
  check(slots.before_launch(5, 7) == Wait::kCaptured, "within one capture, an id changes nothing");
  check(slots.before_launch(6, kUnknown) == Wait::kNone, "another capture: not this capture's record");
  // The captured record did not replace the eager one: eager launches keep their order.
  check(slots.before_launch(0, 7) == Wait::kNone, "eager on the last eager launch's stream: no wait");
  check(slots.before_launch(0, 9) == Wait::kEager, "eager on another stream: waits on the eager record");
  slots.recorded(6, 7);  // a capture's record never takes the eager slot, whatever id it is given
  check(slots.before_launch(0, 9) == Wait::kEager, "still the eager record's stream, 7");
  check(slots.before_launch(6, kUnknown) == Wait::kCaptured, "the newer capture's own record");
}

void test_without_a_gpu_the_id_is_an_error_captures_and_per_thread_streams_ask_nothing() {
  check(!pydatacopy::ChannelOrder::eager_stream_id(nullptr, 4).has_value(),
        "capturing: no id asked, none given");
  check(!pydatacopy::ChannelOrder::eager_stream_id(cudaStreamPerThread, 0).has_value(),
        "the per-thread default stream (a stream per thread behind one handle): no id, always ordered");
  pydatacopy_test::check_throws([] { pydatacopy::ChannelOrder::eager_stream_id(nullptr, 0); },
                                "cudaStreamGetId", "no GPU: pydatacopy::Error naming the call");
  pydatacopy::ChannelOrder none(0);  // no channel, no event: nothing asked of CUDA
  check(none.channels() == 0, "an order of no channels");
}

}  // namespace

int main() {
  test_first_launch_waits_on_nothing();
  test_same_stream_skips_another_waits();
  test_a_record_without_id_leaves_the_next_launch_waiting();
  test_captures_keep_their_own_slot();
  test_without_a_gpu_the_id_is_an_error_captures_and_per_thread_streams_ask_nothing();
  std::printf("test_channel_order: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
