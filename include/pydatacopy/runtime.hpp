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

// Host-blocking collective barrier with a deadline: returns once every PE arrived, else throws
// TimeoutError naming `what` and the missing PE. Runs before NVSHMEM's own collectives
// (nvshmem_malloc, nvshmem_free, finalize), which have no deadline. Every PE contributes `vote`
// and gets back every PE's vote, indexed by PE (so that all can take the same decision). Its
// arrivals are counted apart from the stream-ordered barrier's, so neither satisfies the other.
std::vector<uint64_t> barrier_all_blocking(const char* what, double timeout_seconds, uint64_t vote = 0);

// A 64-bit identity of CUDA `device`'s GPU: a hash of its UUID, which is the same in every
// process and container that uses that GPU (and differs per MIG instance), so PEs with equal
// identities share that GPU's memory and SMs. Falls back to the host (hostname and boot ID) with
// the PCI address when the driver reports no UUID.
uint64_t gpu_identity(int device);
// The hash behind it: FNV-1a over the 16 UUID bytes, or over `fallback` when they are all zero.
uint64_t gpu_identity_of(const unsigned char (&uuid)[16], const std::string& fallback);
// Every PE's gpu_identity, indexed by PE, gathered by init_nvshmem in a bounded barrier.
std::vector<uint64_t> gpu_identities();
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
void check_nvshmem_versions(const Version& built, const Version& loaded);

// Seconds a blocking wait may take before it raises TimeoutError: PYDATACOPY_TIMEOUT_S, else 60.
double default_timeout_seconds();

// The symmetric bytes init_nvshmem takes for its barriers among n_pes PEs (4 arrays of n_pes
// 64-bit signals).
std::size_t barrier_symmetric_bytes(int n_pes);
// A per-call timeout in nanoseconds for the device-side deadline; throws unless positive and finite.
uint64_t timeout_nanoseconds(double seconds);

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
// Throws TimeoutError when a wait on `pe` timed out; `what` names the caller's operation.
void check_peer_timeouts(int pe, const char* what);
// Throws (once) the size mismatch a send/recv found on the device (send_recv.hpp): the two sides
// of a message disagreed on its byte count. Cleared when reported; the channel stays refused on
// the device until setup_send_recv() rebuilds it. Recorded per peer and direction: check_size_mismatch(pe)
// throws only that peer's (send/recv check it, so a mismatch with one PE does not stop calls
// with others); check_size_mismatch() throws any peer's (check_errors()).
void check_size_mismatch(int pe);
void check_size_mismatch();
// Forgets an unreported size mismatch (SendRecvEngine::init: the channels start afresh).
void clear_size_mismatch();
// The refusal of this PE's send channel to `pe` is reported once, by whichever comes first: a
// device record of this PE's send (check_size_mismatch) or SendRecvEngine::check_refusals (the
// receiver's word, read from the host). claim_send_refusal_report() returns true to the first
// caller since the channels were last rebuilt; send_refusal_recorded() says whether such a
// device record is waiting to be reported (check_refusals then leaves it to that record).
bool claim_send_refusal_report(int pe);
bool send_refusal_recorded(int pe);
// Throws (once) an all-to-all refusal recorded on the device (a count over the capacity, at the
// sender and at the receiver; a bad count or index; rows of another width): all_to_all.hpp.
void check_all_to_all_refusal();
// check_timeouts(), check_size_mismatch(), check_all_to_all_refusal(), then the bad input a kernel found on the device (an
// index out of range), which is reported once and cleared.
void check_device_errors();

// True once a device-side wait has timed out: a peer is presumed dead, so collective teardown
// (barriers, nvshmem_free, nvshmem_finalize) is skipped instead of waiting on it forever.
bool peer_failed();
// True once a device-side wait on `pe` has timed out.
bool peer_timed_out(int pe);

// The id of the CUDA graph capture `stream` takes part in, 0 when it is not capturing. Calls
// order two streams with events only when both are in the same state (both eager, or both in
// one capture): an event recorded in a capture cannot be waited on outside it.
unsigned long long capture_id(cudaStream_t stream);

// Throws unless init_nvshmem() has run in this process; `what` names the caller's operation.
void require_initialized(const char* what);

// Throws unless 0 <= pe < n_pes(); `what` names the argument.
void require_valid_pe(int pe, const char* what);

}  // namespace pydatacopy
