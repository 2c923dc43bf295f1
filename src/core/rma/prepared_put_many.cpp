#include "pydatacopy/prepared_put_many.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <utility>

#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {

// ---- the plain-C++ part ----

std::vector<PreparedRow> plan_prepared_rows(const TransferDescriptor* rows, std::size_t count,
                                            const RouteLookup& lookup, bool direct,
                                            uint64_t piece_bytes, const char* call) {
  PDC_REQUIRE(piece_bytes > 0, call << ": piece_bytes must be positive");
  std::vector<PreparedRow> table;
  table.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const TransferDescriptor& row = rows[i];
    if (row.bytes == 0) continue;
    PDC_REQUIRE(row.dst + row.bytes > row.dst && row.src + row.bytes > row.src,
                call << ": row " << i << " (" << row.bytes << " bytes) runs past the end of the "
                     "address space; check its addresses and size");
    const DestinationRoute route = lookup(row.dst, row.bytes);
    PDC_REQUIRE(route.symmetric,
                call << ": row " << i << ": the destination, " << row.bytes << " bytes at 0x"
                     << std::hex << row.dst << std::dec
                     << ", does not lie in one symmetric allocation (pydatacopy.empty): every "
                        "destination must be a symmetric tensor or a slice of one");
    const uint64_t peer = direct ? route.peer : 0;
    for (uint64_t offset = 0; offset < row.bytes; offset += piece_bytes) {
      const uint64_t bytes = std::min(piece_bytes, row.bytes - offset);
      table.push_back({row.dst + offset, peer == 0 ? 0 : peer + offset, row.src + offset, bytes});
    }
  }
  return table;
}

StreamOrderedMemory::StreamOrderedMemory(Backend& backend, std::size_t bytes) : backend_(&backend) {
  memory_ = backend.allocate(bytes);
}

StreamOrderedMemory::StreamOrderedMemory(StreamOrderedMemory&& other) noexcept
    : backend_(other.backend_), memory_(other.memory_), streams_(std::move(other.streams_)) {
  other.memory_ = nullptr;
  other.streams_.clear();
}

StreamOrderedMemory& StreamOrderedMemory::operator=(StreamOrderedMemory&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = other.backend_;
    memory_ = other.memory_;
    streams_ = std::move(other.streams_);
    other.memory_ = nullptr;
    other.streams_.clear();
  }
  return *this;
}

void StreamOrderedMemory::used_on(cudaStream_t stream) {
  // Usually one stream, the first entry: the scan costs nothing on the hot path.
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
}

void StreamOrderedMemory::reset() noexcept {
  if (memory_ == nullptr) return;
  void* memory = memory_;
  memory_ = nullptr;
  backend_->release(memory, streams_);
  streams_.clear();
}

namespace {

class CudaStreamOrderedBackend final : public StreamOrderedMemory::Backend {
 public:
  void* allocate(std::size_t bytes) override {
    bytes = std::max<std::size_t>(bytes, 1);
    void* memory = nullptr;
    if (!pools_unsupported_.load(std::memory_order_relaxed)) {
      cudaStream_t stream = nullptr;
      PDC_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      const cudaError_t status = cudaMallocAsync(&memory, bytes, stream);
      // The allocation is usable from any stream once its own stream got there.
      const cudaError_t synced = status == cudaSuccess ? cudaStreamSynchronize(stream) : status;
      cudaStreamDestroy(stream);
      if (status == cudaSuccess) {
        PDC_CHECK_CUDA(synced);
        return memory;
      }
      if (status != cudaErrorNotSupported) PDC_CHECK_CUDA(status);
      cudaGetLastError();  // not sticky; cleared so that later checks do not see it
      pools_unsupported_.store(true, std::memory_order_relaxed);
    }
    PDC_CHECK_CUDA(cudaMalloc(&memory, bytes));
    return memory;
  }

  // Errors are not thrown (a destructor calls this); the worst case is memory kept until exit.
  void release(void* memory, const std::vector<cudaStream_t>& streams) noexcept override {
    // A release can come at any time (the garbage collector's), also while another stream of this
    // thread is being captured in global mode: its calls then must not invalidate that capture.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    release_relaxed(memory, streams);
    cudaThreadExchangeStreamCaptureMode(&mode);
  }

 private:
  void release_relaxed(void* memory, const std::vector<cudaStream_t>& streams) noexcept {
    if (pools_unsupported_.load(std::memory_order_relaxed)) {
      // No stream-ordered pools on this device: cudaFree waits for the device's work.
      cudaFree(memory);
      return;
    }
    // Where the order after a stream cannot be had, the memory is kept (until exit) rather than
    // freed while that stream's work may still read it.
    cudaStream_t freeing = nullptr;
    if (cudaStreamCreateWithFlags(&freeing, cudaStreamNonBlocking) != cudaSuccess) return;
    bool ordered = true;
    for (cudaStream_t stream : streams) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        cudaGetLastError();
        ordered = false;
        break;
      }
      if (capture != cudaStreamCaptureStatusNone)
        continue;  // an event recorded there would join the capture; its replays are the caller's
      cudaEvent_t done = nullptr;
      ordered = cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess &&
                cudaEventRecord(done, stream) == cudaSuccess && cudaStreamWaitEvent(freeing, done, 0) == cudaSuccess;
      if (done != nullptr) cudaEventDestroy(done);  // its resources go once the recorded work completes
      if (!ordered) {
        cudaGetLastError();
        break;
      }
    }
    if (ordered) cudaFreeAsync(memory, freeing);
    cudaStreamDestroy(freeing);  // returns at once; the stream goes when its work is done
  }

  std::atomic<bool> pools_unsupported_{false};  // cudaMallocAsync said cudaErrorNotSupported
};

}  // namespace

StreamOrderedMemory::Backend& cuda_stream_ordered_backend() {
  static CudaStreamOrderedBackend* backend = new CudaStreamOrderedBackend;  // never destroyed
  return *backend;
}

// ---- the prepared table ----

struct PreparedPutMany::State {
  std::mutex mutex;  // run() and release() from several threads
  std::vector<PreparedRow> host;  // the table as on the device: for the checking mode and RMA
  StreamOrderedMemory device;
  std::size_t rows = 0;
  uint64_t bytes = 0;
  int pe = -1;
  Path path = Path::kAuto;
  bool direct = false;
  bool sources_registered = false;  // every src made ready for NVSHMEM RMA
  bool released = false;
};

PreparedPutMany::PreparedPutMany() = default;
PreparedPutMany::~PreparedPutMany() { release(); }
PreparedPutMany::PreparedPutMany(PreparedPutMany&&) noexcept = default;
PreparedPutMany& PreparedPutMany::operator=(PreparedPutMany&& other) noexcept {
  if (this != &other) {
    release();
    state_ = std::move(other.state_);
  }
  return *this;
}

namespace {

void register_sources(const std::vector<PreparedRow>& table) {
  for (const PreparedRow& row : table)
    prepare_rma_local(reinterpret_cast<const void*>(row.src), row.bytes, "put_many (prepared): every src");
}

// On a private non-blocking stream, waited for: not on the legacy default stream, where the copy
// would queue behind the caller's work (a recv waiting for its peer among it).
void upload(void* device, const void* host, std::size_t bytes) {
  cudaStream_t stream = nullptr;
  PDC_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaError_t status = cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  PDC_CHECK_CUDA(status);
}

void check_rows_for_rma(const std::vector<PreparedRow>& table) {
  for (const PreparedRow& row : table) {
    check_rma_local(reinterpret_cast<const void*>(row.src), row.bytes, "put_many (prepared): every src");
    check_rma_remote(reinterpret_cast<const void*>(row.dst), row.bytes, "put_many (prepared): every dst");
  }
}

}  // namespace

PreparedPutMany PreparedPutMany::build(const TransferDescriptor* rows, std::size_t count, int pe,
                                       Path path, const char* call) {
  require_valid_pe(pe, call);
  check_peer_timeouts(pe, call);
  PDC_REQUIRE(path == Path::kAuto || path == Path::kSM || path == Path::kRMA,
              call << ": path must be auto, sm or rma (one kernel moves the rows)");
  // Every dst lies on one heap and goes to one PE: reachable for all or for none (the first row
  // that moves anything tells; plan_prepared_rows refuses one off the heap).
  bool direct = path != Path::kRMA && !rma_forced();
  for (std::size_t i = 0; direct && i < count; ++i) {
    if (rows[i].bytes == 0) continue;
    direct = symmetric_route(reinterpret_cast<const void*>(rows[i].dst), 0, pe).peer != nullptr;
    break;
  }
  const RouteLookup lookup = [pe](uint64_t dst, uint64_t bytes) {
    const SymmetricRoute route = symmetric_route(reinterpret_cast<const void*>(dst), bytes, pe);
    return DestinationRoute{route.symmetric, reinterpret_cast<uint64_t>(route.peer)};
  };
  auto state = std::make_unique<State>();
  state->host = plan_prepared_rows(rows, count, lookup, direct, kPreparedPieceBytes, call);
  for (std::size_t i = 0; direct && i < state->host.size(); ++i)
    PDC_REQUIRE(state->host[i].peer != 0, call << ": the destinations are reachable by load/store "
                                                  "only in part; this should not happen, please report it");
  state->rows = count;
  for (const PreparedRow& row : state->host) state->bytes += row.bytes;
  state->pe = pe;
  state->path = path;
  state->direct = direct;
  if (!direct) {
    register_sources(state->host);
    state->sources_registered = true;
  }
  if (!state->host.empty()) {
    const std::size_t table_bytes = state->host.size() * sizeof(PreparedRow);
    state->device = StreamOrderedMemory(cuda_stream_ordered_backend(), table_bytes);
    upload(state->device.data(), state->host.data(), table_bytes);
  }
  PreparedPutMany prepared;
  prepared.state_ = std::move(state);
  return prepared;
}

PreparedPutMany PreparedPutMany::prepare(const TransferDescriptor* rows, std::size_t count, int pe,
                                         Path path, const char* call) {
  return build(rows, count, pe, path, call);
}

PreparedPutMany PreparedPutMany::prepare_from_device(const int64_t* dst_addresses, const int64_t* src_addresses,
                                                     const int64_t* sizes, int64_t count, int pe, Path path,
                                                     cudaStream_t stream, const char* call) {
  require_valid_pe(pe, call);
  PDC_REQUIRE(count >= 0, call << ": count must not be negative, got " << count);
  const std::size_t n = static_cast<std::size_t>(count);
  std::vector<int64_t> dsts(n), srcs(n), bytes(n);
  if (n > 0) {
    // On the caller's stream, after whatever wrote the arrays.
    PDC_CHECK_CUDA(cudaMemcpyAsync(dsts.data(), dst_addresses, n * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    PDC_CHECK_CUDA(cudaMemcpyAsync(srcs.data(), src_addresses, n * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    PDC_CHECK_CUDA(cudaMemcpyAsync(bytes.data(), sizes, n * sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    PDC_CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  std::vector<TransferDescriptor> rows(n);
  const int device = cuda_device();
  DeviceAllocation known;  // the last source allocation asked about: rows usually share a few
  for (std::size_t i = 0; i < n; ++i) {
    PDC_REQUIRE(bytes[i] >= 0, call << ": sizes[" << i << "] is " << bytes[i] << "; sizes must not be negative");
    rows[i] = {static_cast<uint64_t>(dsts[i]), static_cast<uint64_t>(srcs[i]), static_cast<uint64_t>(bytes[i])};
    if (rows[i].bytes == 0) continue;
    const uint64_t src = rows[i].src, end = src + rows[i].bytes;
    if (!(src >= known.base && end <= known.base + known.bytes && end > src)) {
      known = device_allocation(reinterpret_cast<const void*>(src), device);
      PDC_REQUIRE(known.bytes > 0 && end > src && end <= known.base + known.bytes,
                  call << ": row " << i << ": the source, " << rows[i].bytes << " bytes at 0x" << std::hex
                       << src << std::dec << ", does not lie in one allocation of device memory on cuda:"
                       << device << " (this process's device); pass addresses of CUDA tensors on it");
    }
  }
  return build(rows.data(), n, pe, path, call);
}

void PreparedPutMany::run(cudaStream_t stream) {
  PDC_REQUIRE(state_ != nullptr, "put_many (prepared): this table was moved from or released; prepare another");
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  PDC_REQUIRE(!s.released, "put_many (prepared): the table was released; prepare another");
  check_peer_timeouts(s.pe, "put_many (prepared)");
  if (s.host.empty()) return;
  const bool rma = s.path == Path::kRMA || !s.direct || rma_forced();
  if (rma && !s.sources_registered) {  // PYDATACOPY_FORCE_RMA set since prepare
    register_sources(s.host);
    s.sources_registered = true;
  }
  if (rma && rma_check_enabled()) check_rows_for_rma(s.host);
  s.device.used_on(stream);
  kernels::launch_prepared_put_many(static_cast<const PreparedRow*>(s.device.data()),
                                    static_cast<int64_t>(s.host.size()), s.pe, rma, stream);
}

void PreparedPutMany::release() noexcept {
  if (state_ == nullptr) return;
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->released = true;
  state_->device.reset();
  state_->host.clear();
  state_->host.shrink_to_fit();
  state_->bytes = 0;
}

bool PreparedPutMany::released() const { return state_ == nullptr || state_->released; }
std::size_t PreparedPutMany::rows() const { return state_ ? state_->rows : 0; }
std::size_t PreparedPutMany::pieces() const { return state_ ? state_->host.size() : 0; }
uint64_t PreparedPutMany::bytes() const { return state_ ? state_->bytes : 0; }
int PreparedPutMany::pe() const { return state_ ? state_->pe : -1; }
bool PreparedPutMany::direct() const { return state_ && state_->direct; }

}  // namespace pydatacopy
