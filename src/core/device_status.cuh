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
};

const char* wait_op_name(WaitOp op);

struct DeviceStatus {
  int code;  // 0: no error; 1: a wait timed out; 2: bad input found on the device
  int op;    // WaitOp
  int peer;  // the PE waited on
  int pe;    // the PE that waited
  unsigned long long expected;  // the value waited for
  unsigned long long seen;      // the last value read
};

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

// Spins until *address >= expected. Returns false (after recording the error once) when the
// deadline passes or another thread of this process already recorded an error.
__device__ __forceinline__ bool wait_until_at_least(const uint64_t* address, uint64_t expected,
                                                    uint64_t deadline_ns, DeviceStatus* status,
                                                    WaitOp op, int peer, int my_pe) {
  uint64_t seen = load_acquire_sys(address);
  for (uint32_t spins = 0; seen < expected; ++spins) {
    if ((spins & 1023u) == 1023u) {
      if (*reinterpret_cast<volatile int*>(&status->code) != 0) return false;
      if (globaltimer_ns() > deadline_ns) {
        if (atomicCAS(&status->code, 0, 1) == 0) {
          status->op = static_cast<int>(op);
          status->peer = peer;
          status->pe = my_pe;
          status->expected = expected;
          status->seen = seen;
          __threadfence_system();
        }
        return false;
      }
    }
    seen = load_acquire_sys(address);
  }
  return true;
}
// Records a bad-input error found on the device (the first one wins).
__device__ __forceinline__ void report_bad_input(DeviceStatus* status, WaitOp op, int my_pe,
                                                 uint64_t value, uint64_t limit) {
  if (atomicCAS(&status->code, 0, 2) == 0) {
    status->op = static_cast<int>(op);
    status->pe = my_pe;
    status->peer = my_pe;
    status->expected = value;
    status->seen = limit;
    __threadfence_system();
  }
}
#endif

}  // namespace pydatacopy::detail
