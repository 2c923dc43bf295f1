#include "pydatacopy/transfer.hpp"
#include "rma/transfer_internal.hpp"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <chrono>

#include "common/device_status.cuh"
#include "common/stream_memops.hpp"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

// The copy engine won at every size measured, 4 KiB to 1 GiB (docs/perf-notes.md, v3), and costs
// the least host time per call; SM stores remain a choice (path="sm").
constexpr std::size_t kCopyEngineMinBytes = 0;

void refuse_not_symmetric(const void* ptr, std::size_t bytes, const char* what) {
  PDC_REQUIRE(false, what << " must lie in symmetric memory (pydatacopy.empty / symmetric_malloc): "
                          << bytes << " bytes at " << ptr << " do not");
}

void require_symmetric(const void* ptr, std::size_t bytes, const char* what) {
  if (!is_symmetric(ptr, bytes)) refuse_not_symmetric(ptr, bytes, what);
}

// The symmetric side of a transfer with `pe` (refused unless symmetric) and its route: `pe`'s copy
// through load/store, or null for NVSHMEM RMA. One lookup (symmetric_route).
void* require_symmetric_route(const void* ptr, std::size_t bytes, int pe, const char* what) {
  const SymmetricRoute route = symmetric_route(ptr, bytes, pe);
  if (!route.symmetric) refuse_not_symmetric(ptr, bytes, what);
  return route.peer;
}

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::kAuto: return "auto";
    case Path::kCopyEngine: return "copy_engine";
    case Path::kSM: return "sm";
    case Path::kRMA: return "rma";
  }
  return "unknown";
}

Path resolve_path(Path requested, bool peer_reachable, std::size_t bytes) {
  if (!peer_reachable) {
    PDC_REQUIRE(requested == Path::kAuto || requested == Path::kRMA,
                "path '" << path_name(requested)
                         << "' needs a directly reachable peer (nvshmem_ptr), and this one is not "
                            "(another node, or PYDATACOPY_FORCE_RMA=1); use path='auto' or 'rma'");
    return Path::kRMA;
  }
  if (requested != Path::kAuto) return requested;
  return bytes >= kCopyEngineMinBytes ? Path::kCopyEngine : Path::kSM;
}

namespace {
// put and get: `remote` is the symmetric address on `pe`, `local` this PE's buffer; the bytes
// go local -> remote for a put and remote -> local for a get.
void one_sided_copy(bool is_put, void* local, void* remote, std::size_t bytes, int pe,
                    cudaStream_t stream, Path path) {
  const char* op = is_put ? "put" : "get";
  require_valid_pe(pe, op);
  check_peer_timeouts(pe, op);
  void* peer = require_symmetric_route(remote, bytes, pe, is_put ? "put: dst" : "get: src");
  if (bytes == 0) return;
  void* dst = is_put ? peer : local;
  const void* src = is_put ? local : peer;
  switch (resolve_path(path, peer != nullptr, bytes)) {
    case Path::kCopyEngine:
      PDC_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
      break;
    case Path::kSM: kernels::launch_copy(dst, src, bytes, stream); break;
    default:
      prepare_rma_local(local, bytes, is_put ? "put: src" : "get: dst");
      check_rma_remote(remote, bytes, is_put ? "put: dst" : "get: src");
      if (is_put)
        nvshmemx_putmem_on_stream(remote, local, bytes, pe, stream);
      else
        nvshmemx_getmem_on_stream(local, remote, bytes, pe, stream);
      break;
  }
}
}  // namespace

void put(void* dst, const void* src, std::size_t bytes, int pe, cudaStream_t stream, Path path) {
  one_sided_copy(true, const_cast<void*>(src), dst, bytes, pe, stream, path);
}

void get(void* dst, const void* src, std::size_t bytes, int pe, cudaStream_t stream, Path path) {
  one_sided_copy(false, dst, const_cast<void*>(src), bytes, pe, stream, path);
}

void put_signal(void* dst, const void* src, std::size_t bytes, uint64_t* signal, uint64_t value,
                int pe, cudaStream_t stream) {
  require_valid_pe(pe, "put_signal");
  check_peer_timeouts(pe, "put_signal");
  const bool reachable = require_symmetric_route(dst, bytes, pe, "put_signal: dst") != nullptr;
  require_symmetric(signal, sizeof(uint64_t), "put_signal: signal");
  // To a reachable peer NVSHMEM stores directly and src needs no registration; under
  // PYDATACOPY_FORCE_RMA it is registered and checked as for a peer on another server (NVSHMEM
  // itself still stores directly: docs/multinode.md).
  if (!reachable) prepare_rma_local(src, bytes, "put_signal: src");
  check_rma_remote(dst, bytes, "put_signal: dst");
  check_rma_remote(signal, sizeof(uint64_t), "put_signal: signal");
  nvshmemx_putmem_signal_on_stream(dst, src, bytes, signal, value, NVSHMEM_SIGNAL_SET, pe, stream);
}

void signal_set(uint64_t* signal, uint64_t value, int pe, cudaStream_t stream) {
  require_valid_pe(pe, "signal_set");
  check_peer_timeouts(pe, "signal_set");
  require_symmetric(signal, sizeof(uint64_t), "signal_set: signal");
  check_rma_remote(signal, sizeof(uint64_t), "signal_set: signal");
  nvshmemx_quiet_on_stream(stream);
  nvshmemx_signal_op_on_stream(signal, value, NVSHMEM_SIGNAL_SET, pe, stream);
}

void signal_wait(const uint64_t* signal, uint64_t value, cudaStream_t stream, double timeout_seconds,
                 bool blocking) {
  require_initialized("signal_wait");
  check_timeouts();
  require_symmetric(signal, sizeof(uint64_t), "signal_wait: signal");
  if (blocking) refuse_blocking_capture(stream, "signal_wait(blocking=True)");
  kernels::launch_signal_wait(signal, value, my_pe(), timeout_nanoseconds(timeout_seconds),
                              detail::device_status(), stream);
  if (blocking) wait_for_stream(stream);
}

void quiet(cudaStream_t stream) {
  require_initialized("quiet");
  nvshmemx_quiet_on_stream(stream);
}

void barrier(cudaStream_t stream, double timeout_seconds, bool blocking) {
  require_initialized("barrier");
  check_timeouts();
  timeout_nanoseconds(timeout_seconds);  // validate before anything is enqueued
  if (blocking) refuse_blocking_capture(stream, "barrier(blocking=True)");
  nvshmemx_quiet_on_stream(stream);
  enqueue_barrier(stream, timeout_seconds);
  if (blocking) wait_for_stream(stream);
}

void put_many(const TransferDescriptor* descriptors, int count, int pe, cudaStream_t stream,
              Path path) {
  require_valid_pe(pe, "put_many");
  check_peer_timeouts(pe, "put_many");
  PDC_REQUIRE(count >= 0, "put_many: count must not be negative, got " << count);
  PDC_REQUIRE(path == Path::kAuto || path == Path::kSM || path == Path::kRMA,
              "put_many moves many small tensors in one kernel: path must be auto, sm or rma");
  bool reachable = false;
  for (int i = 0; i < count; ++i) {
    const void* peer = require_symmetric_route(reinterpret_cast<const void*>(descriptors[i].dst),
                                               descriptors[i].bytes, pe, "put_many: every dst");
    if (i == 0) reachable = peer != nullptr;
  }
  if (count == 0) return;
  // Every dst is on one heap and goes to one PE: the first tells whether all take NVSHMEM RMA.
  const bool rma = path == Path::kRMA || !reachable;
  for (int i = 0; i < count && rma; ++i) {
    prepare_rma_local(reinterpret_cast<const void*>(descriptors[i].src), descriptors[i].bytes,
                      "put_many: every src");
    check_rma_remote(reinterpret_cast<const void*>(descriptors[i].dst), descriptors[i].bytes,
                     "put_many: every dst");
  }
  // The table travels in the launches' parameters (kernels::kPutManyRowsPerLaunch rows each):
  // no device allocation, no host-to-device copy; the caller's array may go as soon as this
  // returns, concurrent calls on other streams share nothing, and a capture bakes it in.
  kernels::launch_put_many(descriptors, count, pe, path == Path::kRMA || rma_forced(), stream);
}

void put_blocks(void* dst_pool, int64_t dst_blocks, const void* src_pool, int64_t src_blocks,
                std::size_t block_bytes, const int64_t* dst_indices, const int64_t* src_indices,
                int64_t count, int pe, cudaStream_t stream, Path path) {
  require_valid_pe(pe, "put_blocks");
  check_peer_timeouts(pe, "put_blocks");
  PDC_REQUIRE(count >= 0 && dst_blocks >= 0 && src_blocks >= 0,
              "put_blocks: counts must not be negative");
  PDC_REQUIRE(block_bytes > 0, "put_blocks: block_bytes must be positive");
  PDC_REQUIRE(path == Path::kAuto || path == Path::kSM || path == Path::kRMA,
              "put_blocks moves many small blocks in one kernel: path must be auto, sm or rma");
  const bool reachable = require_symmetric_route(dst_pool, static_cast<std::size_t>(dst_blocks) * block_bytes,
                                                 pe, "put_blocks: dst_pool") != nullptr;
  const kernels::BlockCopyArgs a{/*dst_pool=*/static_cast<uint8_t*>(dst_pool),
                                 /*src_pool=*/static_cast<const uint8_t*>(src_pool),
                                 /*block_bytes=*/static_cast<int64_t>(block_bytes),
                                 dst_indices, src_indices, count, dst_blocks, src_blocks, pe,
                                 /*my_pe=*/my_pe(),
                                 /*force_rma=*/path == Path::kRMA || rma_forced(),
                                 /*status=*/detail::device_status()};
  if (path == Path::kRMA || !reachable) {
    prepare_rma_local(src_pool, static_cast<std::size_t>(src_blocks) * block_bytes,
                      "put_blocks: src_pool");
    check_rma_remote(dst_pool, static_cast<std::size_t>(dst_blocks) * block_bytes, "put_blocks: dst_pool");
  }
  kernels::launch_put_blocks(a, stream);
  // After this call's own work is enqueued (the peer counts on it): a bad index that an earlier
  // put_blocks found on the device.
  check_device_errors();
}

void signal_pingpong(uint64_t* signal, int peer, int iterations, bool initiator,
                     cudaStream_t stream, double timeout_seconds) {
  require_valid_pe(peer, "signal_pingpong");
  check_peer_timeouts(peer, "signal_pingpong");
  require_symmetric(signal, sizeof(uint64_t), "signal_pingpong: signal");
  PDC_REQUIRE(iterations > 0, "iterations must be positive, got " << iterations);
  check_rma_remote(signal, sizeof(uint64_t), "signal_pingpong: signal");
  kernels::launch_pingpong(signal, my_pe(), peer, iterations, initiator, timeout_nanoseconds(timeout_seconds),
                           detail::device_status(), stream);
}

void bench_kernel_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  kernels::launch_copy(dst, src, bytes, stream);
}

void bench_copy_engine_handoff(const CopyEngineHandoff& h, uint64_t message, cudaStream_t stream) {
  PDC_REQUIRE(message >= 1, "bench_copy_engine_handoff: messages count from 1");
  constexpr int kReady = 0, kDone = 1;
  if (h.receives) detail::stream_write_word(stream, h.peer_words + kReady, message);
  if (h.sends) {
    detail::stream_wait_at_least(stream, h.my_words + kReady, message);
    PDC_CHECK_CUDA(cudaMemcpyAsync(h.peer_dst, h.src, h.bytes, cudaMemcpyDeviceToDevice, stream));
    detail::stream_write_word(stream, h.peer_words + kDone, message);
  }
  if (h.receives) detail::stream_wait_at_least(stream, h.my_words + kDone, message);
}

void bench_kernel_handoff(const CopyEngineHandoff& h, uint64_t message, unsigned variant, cudaStream_t stream) {
  PDC_REQUIRE(message >= 1, "bench_kernel_handoff: messages count from 1");
  PDC_REQUIRE(variant <= (kernels::kHandoffBegin | kernels::kHandoffResolve | kernels::kHandoffTwoBlocksPerSm |
                          kernels::kHandoffMessageOnDevice),
              "bench_kernel_handoff: variant " << variant << " is not a combination of the kHandoff* flags");
  // A benchmark's bound: a wait that reaches it sets the timed-out word, which fails the row's check.
  constexpr uint64_t kWaitNs = 5'000'000'000;
  // The word kHandoffResolve reads over the bus: host memory mapped into the device, as the
  // zero-copy table (made once, kept for the process's life: a benchmark probe's 8 bytes), and its
  // device address (looked up once: not on every timed call).
  static const uint64_t* device_word = [] {
    uint64_t* word = nullptr;
    PDC_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&word), sizeof(uint64_t), cudaHostAllocMapped));
    *word = 0;
    uint64_t* mapped = nullptr;
    PDC_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), word, 0));
    return mapped;
  }();
  kernels::launch_handoff_copy(h.peer_dst, h.src, h.bytes, h.my_words, h.peer_words, h.sends, h.receives, message,
                               kWaitNs, variant, device_word, stream);
}

std::vector<std::pair<std::string, double>> bench_host_call_costs(void* dst, const void* src, std::size_t bytes,
                                                                  cudaStream_t stream, int calls) {
  PDC_REQUIRE(calls > 0, "bench_host_call_costs: calls must be positive, got " << calls);
  cudaEvent_t event = nullptr;
  PDC_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  std::vector<std::pair<std::string, double>> costs;
  auto time = [&](const char* name, auto&& call) {
    for (int i = 0; i < 20; ++i) call();  // warm-up
    PDC_CHECK_CUDA(cudaStreamSynchronize(stream));
    const auto begin = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) call();
    const auto end = std::chrono::steady_clock::now();
    PDC_CHECK_CUDA(cudaStreamSynchronize(stream));
    costs.emplace_back(name, std::chrono::duration<double, std::micro>(end - begin).count() / calls);
  };
  try {
    time("cudaMemcpyAsync", [&] {
      PDC_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    });
    // The copy-engine path's two stream memory operations, on a word of dst (the wait is satisfied at
    // once); before dst is cleared for the kernel's copy, which the caller checks.
    uint64_t* word = static_cast<uint64_t*>(dst);
    if (bytes >= sizeof(uint64_t)) {
      time("cuStreamWriteValue64", [&] { detail::stream_write_word(stream, word, 1); });
      time("cuStreamWaitValue64 (satisfied)", [&] { detail::stream_wait_at_least(stream, word, 1); });
    }
    // Cleared between the two copies (off the clock): the caller's check of dst then sees the
    // kernel's bytes, not the memcpy's.
    PDC_CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, stream));
    time("copy kernel (put's SM kernel)", [&] { kernels::launch_copy(dst, src, bytes, stream); });
    time("empty kernel, 16 B of parameters", [&] { kernels::launch_empty_probe(16, false, stream); });
    time("empty kernel, 16 B, programmatic", [&] { kernels::launch_empty_probe(16, true, stream); });
    time("empty kernel, 1 KiB, programmatic", [&] { kernels::launch_empty_probe(1024, true, stream); });
    time("empty kernel, 8 KiB, programmatic", [&] { kernels::launch_empty_probe(8192, true, stream); });
    time("cudaEventRecord", [&] { PDC_CHECK_CUDA(cudaEventRecord(event, stream)); });
    time("cudaStreamWaitEvent", [&] { PDC_CHECK_CUDA(cudaStreamWaitEvent(stream, event, 0)); });
    time("cudaStreamGetCaptureInfo", [&] {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      unsigned long long id = 0;
      PDC_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &status, &id));
    });
    time("cudaStreamGetId", [&] {
      unsigned long long id = 0;
      PDC_CHECK_CUDA(cudaStreamGetId(stream, &id));
    });
    time("cudaGetDevice", [&] {
      int device = 0;
      PDC_CHECK_CUDA(cudaGetDevice(&device));
    });
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  PDC_CHECK_CUDA(cudaEventDestroy(event));
  return costs;
}

}  // namespace pydatacopy
