// One-sided operations on symmetric memory, stream-ordered on the caller's stream.
//
// Visibility: when a put's work on `stream` has completed, the source may be reused. The data
// is guaranteed visible at the peer after quiet(stream) has completed on that stream; tell the
// peer with put_signal (the signal is raised only after the data is visible) or barrier().
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pydatacopy {

// How the bytes move. kAuto picks the copy engine for large puts to a directly reachable peer,
// SM stores for small ones, and NVSHMEM RMA when the peer is not directly reachable (another
// server, or PYDATACOPY_FORCE_RMA=1).
enum class Path : int { kAuto = 0, kCopyEngine = 1, kSM = 2, kRMA = 3 };
const char* path_name(Path path);
// The path kAuto takes for `bytes` to a peer that is (or is not) directly reachable.
Path resolve_path(Path requested, bool peer_reachable, std::size_t bytes);

// Writes `bytes` from local device memory `src` into PE `pe`'s copy of symmetric `dst`.
void put(void* dst, const void* src, std::size_t bytes, int pe, cudaStream_t stream,
         Path path = Path::kAuto);
// Reads `bytes` of PE `pe`'s copy of symmetric `src` into local device memory `dst`.
void get(void* dst, const void* src, std::size_t bytes, int pe, cudaStream_t stream,
         Path path = Path::kAuto);
// put, then sets PE `pe`'s copy of the symmetric uint64 `signal` to `value` once the data is
// visible there.
void put_signal(void* dst, const void* src, std::size_t bytes, uint64_t* signal, uint64_t value,
                int pe, cudaStream_t stream);
// Sets PE `pe`'s copy of `signal` to `value` (after this stream's earlier puts are visible: it
// quiets first).
void signal_set(uint64_t* signal, uint64_t value, int pe, cudaStream_t stream);
// Stream-ordered wait until the local symmetric `signal` is >= value; a timeout is reported by
// check_device_errors(). blocking: also waits on the host until the stream's work is done
// (wait_for_stream) and throws a timeout here.
void signal_wait(const uint64_t* signal, uint64_t value, cudaStream_t stream, double timeout_seconds,
                 bool blocking = false);
// Completes this PE's outstanding puts on `stream` (delivered at the peers).
void quiet(cudaStream_t stream);
// quiet + all PEs reach the barrier (stream-ordered, collective); a PE that does not arrive
// within timeout_seconds is reported by check_device_errors() as a TimeoutError. blocking: also
// waits on the host until the barrier is over on the GPU (wait_for_stream), raising a timeout
// here; a PE may then exit while its peers finish (they have all arrived).
void barrier(cudaStream_t stream, double timeout_seconds, bool blocking = false);

// Many puts to one PE in one kernel launch (descriptors in host memory; every dst checked).
struct TransferDescriptor {
  uint64_t dst;    // symmetric address (this PE's copy)
  uint64_t src;    // local device address
  uint64_t bytes;
};
void put_many(const TransferDescriptor* descriptors, int count, int pe, cudaStream_t stream,
              Path path = Path::kAuto);

// KV-cache blocks in one launch: block dst_indices[i] of PE `pe`'s copy of the symmetric
// dst_pool (dst_blocks blocks of block_bytes) receives block src_indices[i] of the local src_pool
// (src_blocks blocks). The index arrays are int64 in device memory; an index out of range is
// skipped and reported by check_device_errors() (a pydatacopy::Error).
void put_blocks(void* dst_pool, int64_t dst_blocks, const void* src_pool, int64_t src_blocks,
                std::size_t block_bytes, const int64_t* dst_indices, const int64_t* src_indices,
                int64_t count, int pe, cudaStream_t stream, Path path = Path::kAuto);

}  // namespace pydatacopy
