// The runtime's internals, for the core, its bindings and its C++ tests only (not installed):
// the bounded host barrier, the GPU identities, per-peer failure records, capture ids and the
// argument checks every engine makes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pydatacopy/runtime.hpp"

namespace pydatacopy {

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

// Throws naming both versions when they differ in major or minor (check_nvshmem_version).
void check_nvshmem_versions(const Version& built, const Version& loaded);

// A per-call timeout in nanoseconds for the device-side deadline; throws unless positive and finite.
uint64_t timeout_nanoseconds(double seconds);

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
// The id of the CUDA graph capture `stream` takes part in, 0 when it is not capturing. Calls
// order two streams with events only when both are in the same state (both eager, or both in
// one capture): an event recorded in a capture cannot be waited on outside it.
unsigned long long capture_id(cudaStream_t stream);

// Throws unless init_nvshmem() has run in this process; `what` names the caller's operation.
void require_initialized(const char* what);

// Throws unless 0 <= pe < n_pes(); `what` names the argument.
void require_valid_pe(int pe, const char* what);

}  // namespace pydatacopy
