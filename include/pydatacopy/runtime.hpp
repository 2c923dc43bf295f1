// pydatacopy runtime: NVSHMEM start-up from a unique ID, PE queries, versions, timeouts.
//
// Usable from C++ without Python: the caller moves the 128-byte ID between processes by any
// means (the Python layer uses torch.distributed), then every process calls init_nvshmem().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pydatacopy {

// Size of nvshmemx_uniqueid_t; checked against the header at compile time in runtime.cpp.
constexpr std::size_t kUniqueIdBytes = 128;

// Creates a fresh NVSHMEM unique ID. Needs no GPU; call it on one process (rank 0) only.
std::vector<uint8_t> get_unique_id();

// Seconds init_nvshmem waits for every rank: PYDATACOPY_INIT_TIMEOUT_S, else 300.
double default_init_timeout_seconds();

// Joins the NVSHMEM job named by `root_unique_id` as `rank` of `world_size` on CUDA `device`
// (device < 0: keep the calling thread's current device). Collective over all ranks.
// Returns this process's PE (equal to rank). Calling it again with the same ID is harmless;
// with another ID it throws. If NVSHMEM was already initialised by someone else in this process
// (for example torch's symmetric memory), it checks that rank and world size agree and joins
// it, registering this library's device-side NVSHMEM state.
// Throws TimeoutError when not every rank joined within `timeout_seconds`; NVSHMEM cannot be
// started again in that process afterwards (its bootstrap cannot be cancelled): exit it.
// Once started, every PE tells the others which GPU it uses (gpu_identities()), in a barrier
// bounded by the same timeout.
int init_nvshmem(const std::vector<uint8_t>& root_unique_id, int rank, int world_size,
                 int device = -1, double timeout_seconds = default_init_timeout_seconds());

// Collective: every PE must call it. Harmless when not initialised. Ends NVSHMEM only when this
// library started it and `end_nvshmem` (false: another user in the process, such as torch's
// symmetric memory, still needs it); an NVSHMEM someone else started is theirs. NVSHMEM cannot
// start twice in one process: after finalize() has ended it, init_nvshmem() throws. Meets the
// peers in a bounded barrier first: when one does not come, it skips NVSHMEM's teardown (which
// would wait for ever) and throws TimeoutError; the process should then exit.
void finalize(bool end_nvshmem = true);

// Collective barrier with a deadline, enqueued on `stream`: a device-side wait, reported by
// check_device_errors() when it times out. Does not quiet (transfer.hpp's barrier() does).
void enqueue_barrier(cudaStream_t stream, double timeout_seconds);

// Host-blocking, with no peer of its own: returns only once every piece of work enqueued on
// `stream` before the call has finished on the GPU, then throws the timeout a device-side wait
// reported (check_timeouts). Any handle works: a created stream, the legacy default stream (0,
// torch's default stream), cudaStreamPerThread. The one way the blocking calls (barrier,
// signal_wait, DoubleBufferManager::wait with blocking=true) wait, so that the host work after
// them runs after the wait is over on the GPU. Callers release the GIL around it.
void wait_for_stream(cudaStream_t stream);
// Throws when `stream` is being captured into a CUDA graph: `what` blocks, and a capture has no
// work to wait for. Called before anything is enqueued.
void refuse_blocking_capture(cudaStream_t stream, const char* what);

// How many PEs (this one included) use this PE's GPU.
int pes_sharing_my_gpu();

bool is_initialized();
// True when this library started NVSHMEM (false: it joined one another library started, such as
// torch's symmetric memory, whose symmetric allocations it cannot see).
bool owns_nvshmem();
int my_pe();
int n_pes();
int cuda_device();  // the CUDA device bound at init

struct Version {
  int major = 0, minor = 0, patch = 0;
  std::string str() const;
};
Version built_nvshmem_version();   // headers this library was compiled against
Version loaded_nvshmem_version();  // libnvshmem_host loaded in this process
// Throws naming both versions when they differ in major or minor (init_nvshmem checks this).
void check_nvshmem_version();

// Seconds a blocking wait may take before it raises TimeoutError: PYDATACOPY_TIMEOUT_S, else 60.
double default_timeout_seconds();

// The symmetric bytes init_nvshmem takes for its barriers among n_pes PEs (4 arrays of n_pes
// 64-bit signals).
std::size_t barrier_symmetric_bytes(int n_pes);

// Failure is per peer where that is sound. A device-side wait that times out marks the PE it
// waited on. check_timeouts() throws once any PE is marked: for what needs every PE (barriers,
// allocation, setup_send_recv, the token exchange). check_peer_timeouts(pe) throws only when
// `pe` is marked: send/recv and the one-sided calls check it, so that transfers between live PEs
// go on after one peer died, while calls with the dead PE raise at once. A mark stays for the
// rest of the process (the channels with that PE are out of step); check_device_errors()
// reports the timeout itself once.
//
// Throws the TimeoutError a device-side wait reported (naming the operation and the peer). Sticky.
void check_timeouts();
// check_timeouts(), check_size_mismatch(), check_all_to_all_refusal(), then the bad input a kernel found on the device (an
// index out of range), which is reported once and cleared.
void check_device_errors();

// True once a device-side wait has timed out: a peer is presumed dead, so collective teardown
// (barriers, nvshmem_free, nvshmem_finalize) is skipped instead of waiting on it forever.
bool peer_failed();
// True once a device-side wait on `pe` has timed out.
bool peer_timed_out(int pe);

}  // namespace pydatacopy
