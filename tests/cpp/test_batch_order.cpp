// The order of a send/recv batch's ops on their channels (src/core/kernels/send_recv/batch_order.hpp),
// without a GPU: random batches run step by step under the rule written out in full (an op waits
// while any earlier op of its channel is not done; it gives up when any other op of its channel
// gave up), and at every step the kernels' one-op answers must agree with it for every op.
#include <cstdio>
#include <random>
#include <vector>

#include "check.hpp"
#include "kernels/send_recv/batch_order.hpp"

namespace {

using pydatacopy_test::check;
namespace order = pydatacopy::kernels::batch_order;

struct Batch {
  std::vector<int> channel;
  std::vector<signed char> before;
};

Batch random_batch(std::mt19937& random) {
  const int count = std::uniform_int_distribution<int>(1, 64)(random);
  const int channels = std::uniform_int_distribution<int>(1, 4)(random);
  Batch b;
  b.channel.resize(static_cast<std::size_t>(count));
  for (int& c : b.channel) c = std::uniform_int_distribution<int>(0, channels - 1)(random);
  b.before.resize(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i)
    b.before[static_cast<std::size_t>(i)] = static_cast<signed char>(
        order::previous_on_channel(i, [&](int e, int op) { return b.channel[static_cast<std::size_t>(e)] == b.channel[static_cast<std::size_t>(op)]; }));
  return b;
}

// chunk_batch_kernel: slices of ops, some done from the start (idle, past the op's slices, given up
// at the start); each step one slice that may move finishes (moved or gave up: the same to the order).
void chunk_kernel_run(std::mt19937& random, int& disagreements) {
  const Batch b = random_batch(random);
  const int count = static_cast<int>(b.channel.size());
  constexpr int kSlices = 4;
  std::bernoulli_distribution done_at_start(0.35);
  std::vector<std::vector<bool>> done(static_cast<std::size_t>(count), std::vector<bool>(kSlices));
  for (auto& op : done)
    for (int j = 0; j < kSlices; ++j) op[j] = done_at_start(random);
  signed char waits_for[64][kSlices];
  for (int j = 0; j < kSlices; ++j)
    order::slice_waits_for(b.before.data(), count, [&](int e) { return !done[static_cast<std::size_t>(e)][j]; },
                           waits_for, j);
  for (;;) {
    std::vector<std::pair<int, int>> movable;
    for (int i = 0; i < count; ++i)
      for (int j = 0; j < kSlices; ++j) {
        if (done[static_cast<std::size_t>(i)][j]) continue;
        bool waits_old = false;
        for (int e = 0; e < i; ++e)
          waits_old = waits_old || (b.channel[static_cast<std::size_t>(e)] == b.channel[static_cast<std::size_t>(i)] &&
                                    !done[static_cast<std::size_t>(e)][j]);
        const bool waits_new = order::waits(waits_for[i][j], [&](int e) { return bool(done[static_cast<std::size_t>(e)][j]); });
        if (waits_old != waits_new) ++disagreements;
        if (!waits_old) movable.emplace_back(i, j);
      }
    if (movable.empty()) break;
    const auto [i, j] = movable[std::uniform_int_distribution<std::size_t>(0, movable.size() - 1)(random)];
    done[static_cast<std::size_t>(i)][j] = true;
  }
}

// low_latency_batch_kernel: ops over and given up; a refused channel's ops all start given up
// (its word read once, by its first op); each step one op that may move finishes, gives up, or
// gives up because its channel failed.
void low_latency_kernel_run(std::mt19937& random, int& disagreements) {
  const Batch b = random_batch(random);
  const int count = static_cast<int>(b.channel.size());
  const auto same = [&](int e, int i) { return b.channel[static_cast<std::size_t>(e)] == b.channel[static_cast<std::size_t>(i)]; };
  bool over[64] = {}, gave_up[64] = {};
  std::bernoulli_distribution refused(0.15), fails(0.15);
  std::vector<bool> channel_refused(4);
  for (std::size_t c = 0; c < channel_refused.size(); ++c) channel_refused[c] = refused(random);
  for (int i = 0; i < count; ++i) {
    const int head = order::channel_head(b.before.data(), i);
    int first = 0;
    while (!same(first, i)) ++first;
    if (head != first) ++disagreements;
    const bool broken = channel_refused[static_cast<std::size_t>(b.channel[static_cast<std::size_t>(head)])];
    over[i] = gave_up[i] = broken;
  }
  for (;;) {
    std::vector<std::pair<int, bool>> movable;  // an op that may move, and whether its channel failed
    for (int i = 0; i < count; ++i) {
      if (over[i]) continue;
      bool waits_old = false, failed_old = false;
      for (int e = 0; e < count; ++e) {
        if (e == i || !same(e, i)) continue;
        waits_old = waits_old || (e < i && !over[e]);
        failed_old = failed_old || gave_up[e];
      }
      const int before = b.before[static_cast<std::size_t>(i)];
      const bool waits_new = order::waits(before, [&](int e) { return over[e]; });
      const bool failed_new = order::failed_before(before, gave_up);
      if (waits_old != waits_new || (!waits_old && failed_old != failed_new)) ++disagreements;
      if (!waits_old) movable.emplace_back(i, failed_old);
    }
    if (movable.empty()) break;
    const auto [i, failed] = movable[std::uniform_int_distribution<std::size_t>(0, movable.size() - 1)(random)];
    over[i] = true;
    gave_up[i] = failed || fails(random);
  }
  // The counters: an op counts unless some op of its channel gave up.
  bool failed[64], known[64];
  order::channel_failed(b.before.data(), gave_up, count, failed, known);
  for (int i = 0; i < count; ++i) {
    bool any = false;
    for (int e = 0; e < count; ++e) any = any || (same(e, i) && gave_up[e]);
    if (failed[i] != any) ++disagreements;
  }
}

}  // namespace

int main() {
  std::mt19937 random(20261207);
  int chunk_disagreements = 0, low_latency_disagreements = 0;
  for (int run = 0; run < 1500; ++run) {
    chunk_kernel_run(random, chunk_disagreements);
    low_latency_kernel_run(random, low_latency_disagreements);
  }
  if (chunk_disagreements) std::printf("  chunk kernel: %d disagreements\n", chunk_disagreements);
  if (low_latency_disagreements) std::printf("  low-latency kernel: %d disagreements\n", low_latency_disagreements);
  check(chunk_disagreements == 0, "chunk_batch_kernel: waits_for answers as the scan of every earlier op, every step");
  check(low_latency_disagreements == 0,
        "low_latency_batch_kernel: the op before answers as the scans (waits, channel failed, the counters)");
  std::printf("test_batch_order: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
