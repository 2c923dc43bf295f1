#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <utility>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/double_buffer_manager.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

constexpr int64_t kAlignment = 256;

int64_t align_up(int64_t value) { return (value + kAlignment - 1) / kAlignment * kAlignment; }

// Symmetric layout of one manager, in bytes from base_.
struct Layout {
  int64_t buffer_bytes, signal_bytes, credit_bytes;
  Layout(int64_t n_tokens, int64_t token_size, int pes)
      : buffer_bytes(align_up(n_tokens * token_size)),
        signal_bytes(align_up(n_tokens * static_cast<int64_t>(sizeof(uint64_t)))),
        credit_bytes(align_up(pes * static_cast<int64_t>(sizeof(uint64_t)))) {}
  int64_t send(int set) const { return set * buffer_bytes; }
  int64_t recv(int set) const { return (2 + set) * buffer_bytes; }
  int64_t signals(int set) const { return 4 * buffer_bytes + set * signal_bytes; }
  int64_t credits(int set) const { return 4 * buffer_bytes + 2 * signal_bytes + set * credit_bytes; }
  int64_t total() const { return credits(2); }
};

}  // namespace

void DoubleBufferManager::require_initialized(const char* what) const {
  pydatacopy::require_initialized(what);
  PDC_REQUIRE(base_ != nullptr,
              "DoubleBufferManager." << what << ": call init(n_tokens, token_size) first "
                                        "(or it was cleaned up)");
}

std::size_t DoubleBufferManager::symmetric_bytes_needed(int64_t n_tokens, int64_t token_size, int n_pes) {
  return static_cast<std::size_t>(Layout(n_tokens, token_size, n_pes).total());
}

void DoubleBufferManager::init(int64_t n_tokens, int64_t token_size) {
  pydatacopy::require_initialized("DoubleBufferManager.init");
  PDC_REQUIRE(base_ == nullptr,
              "DoubleBufferManager.init: already initialised; call cleanup() first");
  PDC_REQUIRE(n_tokens > 0, "n_tokens must be positive, got " << n_tokens);
  PDC_REQUIRE(token_size > 0, "token_size must be positive (bytes per token), got " << token_size);
  PDC_REQUIRE(n_tokens <= INT32_MAX, "n_tokens must be below 2^31, got " << n_tokens);
  PDC_REQUIRE(n_tokens <= kMaxBufferBytes / token_size,
              "n_tokens x token_size = " << n_tokens << " x " << token_size
                                         << " is larger than 1 TiB per buffer");
  const std::size_t total = symmetric_bytes_needed(n_tokens, token_size, n_pes());
  ChannelOrder order(kChannels);  // local, before anything collective can need undoing
  void* counters = nullptr;
  PDC_CHECK_CUDA(cudaMalloc(&counters, 2 * (sizeof(uint64_t) + sizeof(unsigned int))));
  PDC_CHECK_CUDA(cudaMemset(counters, 0, 2 * (sizeof(uint64_t) + sizeof(unsigned int))));
  void* base = nullptr;
  try {
    base = symmetric_malloc(total);
  } catch (...) {
    cudaFree(counters);
    throw;
  }
  uses_ = static_cast<uint64_t*>(counters);
  done_ = reinterpret_cast<unsigned int*>(uses_ + 2);
  order_ = std::move(order);
  // Zeroed signals and credits mean "nothing yet"; the barrier keeps peers from writing before.
  PDC_CHECK_CUDA(cudaMemset(base, 0, total));
  base_ = static_cast<uint8_t*>(base);
  PDC_CHECK_CUDA(cudaDeviceSynchronize());
  barrier_all_blocking("DoubleBufferManager.init", default_timeout_seconds());
  n_tokens_ = n_tokens;
  token_size_ = token_size;
  next_round_ = 0;
  last_waited_round_ = -1;
}

void DoubleBufferManager::cleanup() {
  if (base_ == nullptr) return;
  pydatacopy::require_initialized("DoubleBufferManager.cleanup");
  // symmetric_free settles every PE (bounded barrier) before freeing: peers may still be
  // putting into our receive buffers until then.
  uint8_t* base = base_;
  base_ = nullptr;
  n_tokens_ = token_size_ = 0;
  next_round_ = 0;
  last_waited_round_ = -1;
  symmetric_free(base);  // synchronises the device first: no kernel still uses the counters
  // Local releases; a failure here leaves nothing a later call depends on.
  cudaFree(uses_);
  uses_ = nullptr;
  done_ = nullptr;
  order_ = ChannelOrder();
}

uint8_t* DoubleBufferManager::send_buffer(int set) const {
  require_initialized("send_buffer");
  PDC_REQUIRE(set == 0 || set == 1, "buffer set must be 0 or 1, got " << set);
  return base_ + Layout(n_tokens_, token_size_, n_pes()).send(set);
}

uint8_t* DoubleBufferManager::recv_buffer(int set) const {
  require_initialized("recv_buffer");
  PDC_REQUIRE(set == 0 || set == 1, "buffer set must be 0 or 1, got " << set);
  return base_ + Layout(n_tokens_, token_size_, n_pes()).recv(set);
}

uint64_t* DoubleBufferManager::signals(int set) const {
  return reinterpret_cast<uint64_t*>(base_ + Layout(n_tokens_, token_size_, n_pes()).signals(set));
}

uint64_t* DoubleBufferManager::credits(int set) const {
  return reinterpret_cast<uint64_t*>(base_ + Layout(n_tokens_, token_size_, n_pes()).credits(set));
}

int DoubleBufferManager::default_dst_pe(int pe, int n_pes) {
  if (n_pes == 1) return pe;
  return n_pes % 2 == 0 ? (pe ^ 1) : (pe + 1) % n_pes;
}

int DoubleBufferManager::default_src_pe(int pe, int n_pes) {
  if (n_pes == 1) return pe;
  return n_pes % 2 == 0 ? (pe ^ 1) : (pe + n_pes - 1) % n_pes;
}

int64_t DoubleBufferManager::round() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_round_;
}

int64_t DoubleBufferManager::last_waited_round() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_waited_round_;
}

int64_t DoubleBufferManager::exchange(int dst_pe, int src_pe, cudaStream_t stream, double timeout_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  return exchange_locked(dst_pe, src_pe, stream, timeout_seconds);
}

void DoubleBufferManager::wait(int64_t round, int src_pe, cudaStream_t stream, double timeout_seconds,
                               bool blocking) {
  if (blocking) refuse_blocking_capture(stream, "DoubleBufferManager.wait(blocking=True)");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wait_locked(round, src_pe, stream, timeout_seconds);
  }
  // Outside the lock: another thread's exchange() need not wait for this host wait.
  if (blocking) wait_for_stream(stream);
}

int64_t DoubleBufferManager::exchange_locked(int dst_pe, int src_pe, cudaStream_t stream,
                                             double timeout_seconds) {
  require_initialized("exchange");
  require_valid_pe(dst_pe, "DoubleBufferManager.exchange dst_pe");
  require_valid_pe(src_pe, "DoubleBufferManager.exchange src_pe");
  check_timeouts();
  const int64_t round = next_round_;
  // Our receive set of round - 2 is released by this call: it must have been waited for.
  PDC_REQUIRE(round - 2 <= last_waited_round_,
              "DoubleBufferManager.exchange: round " << round - 2
                  << " was never waited for; call wait() for a round before exchanging two "
                     "rounds past it (its receive buffer would be overwritten)");
  const int set = static_cast<int>(round % 2);
  // This frees our receive set of two rounds ago to the peer: the wait() for it must be done
  // first, and the set's last exchange (its counters). Whatever the caller enqueued after that
  // wait() on another stream (the consumer) is the caller's to order (the Python class does it
  // for torch's streams): the engine keeps no stream of the caller's. See ChannelOrder for
  // captures.
  const unsigned long long capture = capture_id(stream);
  order_.order_after_last(waited(set), stream, capture);
  order_.order_after_last(exchanged(set), stream, capture);
  kernels::TokenExchangeArgs args{};
  args.send = send_buffer(set);
  args.recv = recv_buffer(set);
  args.signals = signals(set);
  args.credits = credits(set);
  args.peer_recv = static_cast<uint8_t*>(peer_pointer(args.recv, dst_pe));
  args.peer_signals = static_cast<uint64_t*>(peer_pointer(args.signals, dst_pe));
  if (args.peer_recv == nullptr || args.peer_signals == nullptr)  // both sides symmetric: no registration
    args.peer_recv = nullptr, args.peer_signals = nullptr;
  args.n_tokens = n_tokens_;
  args.token_bytes = token_size_;
  args.uses = uses_ + set;
  args.done = done_ + set;
  args.my_pe = my_pe();
  args.dst_pe = dst_pe;
  args.src_pe = src_pe;
  args.timeout_ns = timeout_nanoseconds(timeout_seconds);
  args.status = detail::device_status();
  const int64_t warps_needed = (n_tokens_ + 15) / 16;
  const int blocks = static_cast<int>(std::min<int64_t>(warps_needed, multiprocessor_count()));
  kernels::launch_token_exchange(args, blocks, stream);
  order_.record(exchanged(set), stream, capture);
  next_round_ = round + 1;
  return round;
}

void DoubleBufferManager::wait_locked(int64_t round, int src_pe, cudaStream_t stream,
                                      double timeout_seconds) {
  require_initialized("wait");
  require_valid_pe(src_pe, "DoubleBufferManager.wait src_pe");
  check_timeouts();
  PDC_REQUIRE(round >= 0 && round < next_round_,
              "DoubleBufferManager.wait: round " << round << " has not been exchanged (rounds 0.."
                                                 << next_round_ - 1 << " have)");
  PDC_REQUIRE(round >= next_round_ - 2,
              "DoubleBufferManager.wait: round " << round
                  << " is too old; its buffer set has been reused (only the last two rounds can "
                     "be waited for)");
  const int set = static_cast<int>(round % 2);
  const uint64_t timeout_ns = timeout_nanoseconds(timeout_seconds);
  // The wait reads the set's use count, which the round's exchange() advances on the device.
  const unsigned long long capture = capture_id(stream);
  order_.order_after_last(exchanged(set), stream, capture);
  const int blocks = static_cast<int>(
      std::min<int64_t>((n_tokens_ + 255) / 256, multiprocessor_count()));
  kernels::launch_token_wait(signals(set), n_tokens_, uses_ + set, my_pe(), src_pe, timeout_ns,
                             detail::device_status(), blocks, stream);
  order_.record(waited(set), stream, capture);
  last_waited_round_ = std::max(last_waited_round_, round);
}

double DoubleBufferManager::test_bandwidth(int rank, int world_size, cudaStream_t stream) {
  require_initialized("test_bandwidth");
  PDC_REQUIRE(rank == my_pe() && world_size == n_pes(),
              "test_bandwidth(rank=" << rank << ", world_size=" << world_size
                                     << ") does not match this process: PE " << my_pe() << " of "
                                     << n_pes());
  const int dst = default_dst_pe(rank, world_size), src = default_src_pe(rank, world_size);
  const double timeout = default_timeout_seconds();
  cudaEvent_t start = nullptr, stop = nullptr;
  PDC_CHECK_CUDA(cudaEventCreate(&start));
  PDC_CHECK_CUDA(cudaEventCreate(&stop));
  float milliseconds = 0;
  try {
    PDC_CHECK_CUDA(cudaEventRecord(start, stream));
    const int64_t round = exchange(dst, src, stream, timeout);
    wait(round, src, stream, timeout);
    // Our puts are complete at the peer too, not only issued.
    nvshmemx_quiet_on_stream(stream);
    PDC_CHECK_CUDA(cudaEventRecord(stop, stream));
    PDC_CHECK_CUDA(cudaEventSynchronize(stop));
    PDC_CHECK_CUDA(cudaEventElapsedTime(&milliseconds, start, stop));
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  PDC_CHECK_CUDA(cudaEventDestroy(start));
  PDC_CHECK_CUDA(cudaEventDestroy(stop));
  check_timeouts();
  return static_cast<double>(buffer_bytes()) / (static_cast<double>(milliseconds) * 1e6);
}

}  // namespace pydatacopy
