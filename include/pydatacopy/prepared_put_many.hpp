// put_many prepared once: the rows are checked and their routes resolved once, the table is kept
// in device memory, and every run is one kernel launch that reads it there (no host work per
// row, capturable in a CUDA graph). The model is NIXL's prepared descriptor lists.
//
// The rows' memory is the caller's to keep alive while the table runs (the Python layer holds
// the tensors). The table's own device memory is freed stream-ordered after the work of every
// stream it ran on (as torch's record_stream does): releasing it never waits for the GPU or a
// peer, and it is local (no other PE takes part).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "pydatacopy/transfer.hpp"

namespace pydatacopy {

// One row of a prepared table, as the kernel reads it from device memory.
struct PreparedRow {
  uint64_t dst;    // the symmetric destination (this PE's address): NVSHMEM RMA's target
  uint64_t peer;   // the same through load/store (the peer's memory), 0: NVSHMEM RMA
  uint64_t src;    // local device memory
  uint64_t bytes;
};

// ---- the plain-C++ part (tests/cpp/test_prepared_put_many.cpp) ----
//
// A row's destination as the symmetric heap knows it (symmetric_route): whether it lies in one
// live allocation and its address at the peer through load/store (0: NVSHMEM RMA).
struct DestinationRoute {
  bool symmetric = false;
  uint64_t peer = 0;
};
using RouteLookup = std::function<DestinationRoute(uint64_t dst, uint64_t bytes)>;

// Rows longer than this are cut into pieces of this many bytes (the last one shorter): a warp
// moves each piece, so one long row does not leave the other warps idle.
constexpr uint64_t kPreparedPieceBytes = uint64_t{64} << 10;

// The table for `rows` (empty rows left out, long ones cut into pieces of at most piece_bytes at
// the same offsets in dst and src, so both keep their alignment). Every destination must be
// symmetric (throws naming `call`, the row's index and its address); `direct`: the peer address
// of each piece is kept (else 0: every piece takes NVSHMEM RMA).
std::vector<PreparedRow> plan_prepared_rows(const TransferDescriptor* rows, std::size_t count,
                                            const RouteLookup& lookup, bool direct,
                                            uint64_t piece_bytes, const char* call);

// Device memory owned by a table, freed after every stream it was used on is done with it.
class StreamOrderedMemory {
 public:
  struct Backend {
    virtual ~Backend() = default;
    virtual void* allocate(std::size_t bytes) = 0;
    // Frees `memory` once the work each of `streams` holds now is done; never waits. A stream
    // being captured into a graph is skipped (its work runs at replay, which must not outlive
    // the memory: the caller's rule, as for any graph input).
    virtual void release(void* memory, const std::vector<cudaStream_t>& streams) noexcept = 0;
  };

  StreamOrderedMemory() = default;
  StreamOrderedMemory(Backend& backend, std::size_t bytes);
  StreamOrderedMemory(StreamOrderedMemory&& other) noexcept;
  StreamOrderedMemory& operator=(StreamOrderedMemory&& other) noexcept;
  StreamOrderedMemory(const StreamOrderedMemory&) = delete;
  StreamOrderedMemory& operator=(const StreamOrderedMemory&) = delete;
  ~StreamOrderedMemory() { reset(); }

  void* data() const { return memory_; }
  // Remembers that work on `stream` uses the memory (each stream once).
  void used_on(cudaStream_t stream);
  const std::vector<cudaStream_t>& streams() const { return streams_; }
  // Hands the memory to the backend's release (after the streams' work); idempotent.
  void reset() noexcept;

 private:
  Backend* backend_ = nullptr;
  void* memory_ = nullptr;
  std::vector<cudaStream_t> streams_;
};

// The CUDA backend: cudaMallocAsync from the device's default pool; the release makes a private
// stream wait for an event recorded on each stream and frees there.
StreamOrderedMemory::Backend& cuda_stream_ordered_backend();

// ---- the prepared table ----
class PreparedPutMany {
 public:
  PreparedPutMany();
  ~PreparedPutMany();
  PreparedPutMany(PreparedPutMany&&) noexcept;
  PreparedPutMany& operator=(PreparedPutMany&&) noexcept;
  PreparedPutMany(const PreparedPutMany&) = delete;
  PreparedPutMany& operator=(const PreparedPutMany&) = delete;

  // From a host table (each src already known to be device memory of this process's device, as
  // the tensors' checks make sure). Checks every dst (symmetric), resolves each row's route for
  // `pe` (`path`: auto, sm or rma), registers the sources where NVSHMEM RMA needs it, and copies
  // the table to device memory. Blocks until the table is there; not capturable. `call` names
  // the public function in errors.
  static PreparedPutMany prepare(const TransferDescriptor* rows, std::size_t count, int pe, Path path,
                                 const char* call);
  // From three int64 arrays of `count` entries in device memory (destination and source
  // addresses, byte counts), read in order after `stream`'s work (it is synchronised). Every
  // source must lie in device memory of this process's device (asked of the driver, once per
  // allocation); sizes must not be negative.
  static PreparedPutMany prepare_from_device(const int64_t* dst_addresses, const int64_t* src_addresses,
                                             const int64_t* sizes, int64_t count, int pe, Path path,
                                             cudaStream_t stream, const char* call);

  // One launch on `stream` (stream-ordered, capturable). PYDATACOPY_FORCE_RMA set since prepare
  // turns every row to NVSHMEM RMA (the sources are registered first, once); under
  // PYDATACOPY_CHECK_RMA every row's addresses are checked before the launch. `stream` must stay
  // valid until the table is released: the release orders the free after each stream it ran on.
  void run(cudaStream_t stream);
  // Frees the table (see StreamOrderedMemory); run() refuses afterwards. Idempotent, local.
  void release() noexcept;

  bool released() const;
  std::size_t rows() const;    // rows given to prepare (the tensor form gives only those with bytes)
  std::size_t pieces() const;  // rows of the device table (empty ones out, long ones cut)
  uint64_t bytes() const;      // moved by one run
  int pe() const;
  bool direct() const;         // prepared for load/store (false: NVSHMEM RMA)

 private:
  struct State;
  static PreparedPutMany build(const TransferDescriptor* rows, std::size_t count, int pe, Path path,
                               const char* call);
  std::unique_ptr<State> state_;
};

}  // namespace pydatacopy
