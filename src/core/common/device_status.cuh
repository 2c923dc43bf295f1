// Device-side error reporting and bounded waits (internal to the core).
//
// A wait on a peer must never hang: device code polls with a deadline taken from %globaltimer
// and, when it passes, records what it was waiting for in a host-mapped status word that the
// host checks (runtime.cpp: check_device_errors). The kernel then returns instead of spinning.
#pragma once

#include <cstdint>

namespace pydatacopy::detail {

enum class WaitOp : int {
  kNone = 0,
  kTokenCredit = 1,   // DoubleBufferManager: the peer releasing its receive set
  kTokenArrival = 2,  // DoubleBufferManager: the peer's tokens arriving
  kSignal = 3,        // signal_wait
  kChunkCredit = 4,   // send(): the receiver freeing a staging chunk
  kChunkArrival = 5,  // recv(): the sender filling a staging chunk
  kBlockIndex = 6,    // put_blocks(): an index out of range (code 2, not a timeout)
  kBarrier = 7,       // barrier(): a PE not arriving
  kChannelRefused = 8,  // send/recv on a channel refused since a size mismatch (not a wait)
  kRendezvous = 9,      // send: the receiver's zero-copy rendezvous descriptor
  kZeroCopyDone = 10,   // recv: the sender's zero-copy writes into the receive buffer
  kZeroCopyMapping = 11,  // send: the receiver posted a mapping this PE no longer holds (refusal)
  kAllToAllCredit = 12,   // all_to_all: the receiver freeing its region of this PE's rows
  kAllToAllArrival = 13,  // all_to_all: a source's count or rows arriving
  // all_to_all refusals (record `all_to_all`, code kBadInput; not waits). peer: the other PE,
  // expected: the rows asked (or the index found), seen: the limit.
  kAllToAllCapacity = 14,       // this PE's count for `peer` is over the capacity (sender side)
  kAllToAllCapacityFrom = 15,   // `peer` asked to send this PE more rows than the capacity
  kAllToAllCount = 16,          // a negative count, or counts past the rows (or index) sent
  kAllToAllIndex = 17,          // a gather index out of range (that row was not sent)
  kAllToAllLayout = 18,         // `peer` sent rows of another width or field count than this PE's
  kAllToAllRefusedBy = 19,      // `peer` refused the whole call (expected: its AllToAllRefusal)
  kAllToAllTag = 20,            // `peer`'s call had another tag (MoE: another dispatch's handle)
};

const char* wait_op_name(WaitOp op);

// One error record. `code` is claimed with a compare-and-swap (0 -> kWriting), the fields are
// written, then `code` is published; the host clears a published bad-input record with a
// compare-and-swap too, so that no update is lost to a plain store.
struct ErrorRecord {
  int code;  // 0: none; kWriting: being filled; kTimedOut, kBadInput or kMismatch: published
  int op;    // WaitOp
  int peer;  // the PE waited on
  int pe;    // the PE that waited
  unsigned long long expected;  // the value waited for (bad input: the value found)
  unsigned long long seen;      // the last value read (bad input: the limit)
};
constexpr int kWriting = 3, kTimedOut = 1, kBadInput = 2, kMismatch = 4;

// Timeouts, bad inputs and size mismatches are kept apart: a bad index reported by put_blocks
// must not cancel a wait in flight on another stream, and clearing it must not lose a timeout.
// A timeout also marks its peer in timed_out_pes (PEs beyond kTrackedPes share the last entry),
// so that the host refuses only the operations that involve a failed peer (runtime.hpp).
constexpr int kTrackedPes = 4096;
struct DeviceStatus {
  ErrorRecord timeout;    // sticky: a peer did not answer in time (the first one, for its message)
  ErrorRecord bad_input;  // reported once, by the next put_blocks or check_errors()
  // Reported once, by the next send/recv or check_errors(); op kChunkArrival (found by this
  // PE's recv), kChunkCredit (this PE's send, told by the receiver) or kChannelRefused (a later
  // call on the refused channel), peer: the other side, expected: this call's bytes, seen: the
  // other side's bytes in the mismatched message. The channel itself
  // stays refused on the device until setup_send_recv() rebuilds it (send_recv.hpp). One record
  // per peer (tracked_pe_index) and direction: a mismatch with one PE neither refuses nor hides
  // another's, nor one direction the other.
  // [0]: this PE's send channel to the peer, [1]: its recv channel from the peer: both
  // directions of a pair can be refused, and each is reported once.
  ErrorRecord mismatch[2][kTrackedPes];
  // Reported once, by check_errors() or after the next all-to-all call's launch: a refusal of
  // the all-to-all (kAllToAllCapacity..kAllToAllLayout); the first one wins until reported.
  ErrorRecord all_to_all;
  int timed_out_pes[kTrackedPes];  // nonzero: a wait on that PE timed out
};

#ifdef __CUDACC__
#define PDC_HOST_DEVICE __host__ __device__
#else
#define PDC_HOST_DEVICE
#endif
PDC_HOST_DEVICE inline int tracked_pe_index(int pe) {
  return pe < 0 ? kTrackedPes - 1 : (pe < kTrackedPes ? pe : kTrackedPes - 1);
}

// Host-mapped status of this process (valid after init_nvshmem).
DeviceStatus* device_status();

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

// Records an error unless one of its kind is already recorded (the first one wins).
__device__ __forceinline__ void record_error(ErrorRecord* record, int code, WaitOp op, int peer,
                                             int my_pe, uint64_t expected, uint64_t seen) {
  // Device-scope atomics: the record lives in host-mapped memory, where compute-sanitizer
  // rejects system-scope atomics on this platform (no native host atomics over the bus); only
  // GPU threads race for the claim, and the host clears only a published record.
  if (atomicCAS(&record->code, 0, kWriting) != 0) return;
  record->op = static_cast<int>(op);
  record->peer = peer;
  record->pe = my_pe;
  record->expected = expected;
  record->seen = seen;
  __threadfence_system();
  atomicExch(&record->code, code);
}

// A wait on `peer` ran out of time: the first such record wins; the peer is marked either way.
__device__ __forceinline__ void record_timeout(DeviceStatus* status, WaitOp op, int peer, int my_pe,
                                               uint64_t expected, uint64_t seen) {
  // Mark before the record is published: a host that sees the record also sees the mark.
  atomicExch(&status->timed_out_pes[tracked_pe_index(peer)], 1);
  __threadfence_system();
  record_error(&status->timeout, kTimedOut, op, peer, my_pe, expected, seen);
}

// Spins until *address >= expected. Returns false (after recording the timeout) when this
// wait's own deadline passes; other calls' errors never end it early.
__device__ __forceinline__ bool wait_until_at_least(const uint64_t* address, uint64_t expected,
                                                    uint64_t deadline_ns, DeviceStatus* status,
                                                    WaitOp op, int peer, int my_pe) {
  uint64_t seen = load_acquire_sys(address);
  for (uint32_t spins = 0; seen < expected; ++spins) {
    if ((spins & 1023u) == 1023u && globaltimer_ns() > deadline_ns) {
      record_timeout(status, op, peer, my_pe, expected, seen);
      return false;
    }
    seen = load_acquire_sys(address);
  }
  return true;
}

// Records a bad-input error found on the device (the first one wins until it is reported).
__device__ __forceinline__ void report_bad_input(DeviceStatus* status, WaitOp op, int my_pe,
                                                 uint64_t value, uint64_t limit) {
  record_error(&status->bad_input, kBadInput, op, my_pe, my_pe, value, limit);
}
#endif

}  // namespace pydatacopy::detail
