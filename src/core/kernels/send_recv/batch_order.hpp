// The order of a send/recv batch's ops on their channels, as send_recv.cu's two kernels keep it:
// ops of one channel (one peer, one direction) move in the batch's order and give up together.
// Each kernel looks at one op for that (the op before on the channel), not at every earlier op: a
// scan per op and round made a round of a 32-op group quadratic. The same functions run in the
// kernels and in the host tests (tests/cpp/test_batch_order.cpp: random runs against the rule
// written out as a scan of every op).
#pragma once

#if defined(__CUDACC__)
#define PDC_BATCH_ORDER_HOST_DEVICE __host__ __device__
#else
#define PDC_BATCH_ORDER_HOST_DEVICE
#endif

namespace pydatacopy::kernels::batch_order {

// The op before `op` on its channel (-1: none); same_channel(e, op) says whether ops e and op share one.
template <class SameChannel>
PDC_BATCH_ORDER_HOST_DEVICE inline int previous_on_channel(int op, SameChannel same_channel) {
  for (int e = op - 1; e >= 0; --e)
    if (same_channel(e, op)) return e;
  return -1;
}

// Whether an op waits for the op it looks at (`before`: the op before it on its channel, or its
// waits_for on a slice; -1: none), done(e) saying whether op e is done (over, or its slice done).
template <class Done>
PDC_BATCH_ORDER_HOST_DEVICE inline bool waits(int before, Done done) {
  return before >= 0 && !done(before);
}

// low_latency_batch_kernel: whether an op's channel failed before it (the op before it gave up: a
// failure reaches every later op of the channel, each giving up in turn).
PDC_BATCH_ORDER_HOST_DEVICE inline bool failed_before(int before, const bool* gave_up) {
  return before >= 0 && gave_up[before];
}

// The first op of op's channel in the batch.
PDC_BATCH_ORDER_HOST_DEVICE inline int channel_head(const signed char* before, int op) {
  while (before[op] >= 0) op = before[op];
  return op;
}

// chunk_batch_kernel, one slice: what each op waits for on it, set once after the slices' state
// is (next[op][slice]): the nearest earlier op of its channel whose slice has work at the start
// (-1: none), working(e) saying whether op e's does. An op's slice then moves once that op's slice
// is done: an op's slice finishes only in its own visit, made only once the one it waits for was
// done, so that one being done says every earlier op's is (a slice done at the start, an idle
// one, is passed over here). waits_for[op][slice] for op in [0, count).
template <int kSlices, class Working>
PDC_BATCH_ORDER_HOST_DEVICE inline void slice_waits_for(const signed char* before, int count, Working working,
                                                        signed char (*waits_for)[kSlices], int slice) {
  for (int i = 0; i < count; ++i) {
    const int e = before[i];
    waits_for[i][slice] = static_cast<signed char>(e < 0 || working(e) ? e : waits_for[e][slice]);
  }
}

// low_latency_batch_kernel's end: whether each op's channel failed in the launch (some op of it
// gave up). A failure reaches every later op of its channel (each gives up in turn, or started
// given up), so the channel's last op says it; walked from the end, each op learns it from the op
// after it. failed[op] for op in [0, count); known is scratch of the same size.
PDC_BATCH_ORDER_HOST_DEVICE inline void channel_failed(const signed char* before, const bool* gave_up, int count,
                                                       bool* failed, bool* known) {
  for (int i = 0; i < count; ++i) known[i] = false;
  for (int i = count - 1; i >= 0; --i) {
    if (!known[i]) failed[i] = gave_up[i], known[i] = true;
    if (before[i] >= 0) failed[before[i]] = failed[i], known[before[i]] = true;
  }
}

}  // namespace pydatacopy::kernels::batch_order
