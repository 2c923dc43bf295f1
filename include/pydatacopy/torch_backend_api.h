/* What pydatacopy._C hands the torch.distributed backend extension: a table of C functions in
 * a PyCapsule (pydatacopy._C.torch_backend_api()).
 *
 * The backend (src/torch_backend/backend.cpp) is a c10d::Backend, so it is built against the
 * torch that is installed, when it is first used (python/pydatacopy/distributed/native.py); the
 * core stays in _C alone (one NVSHMEM state, one send/recv engine) and the backend reaches it
 * through this table. Plain C across the boundary: no C++ exception or type crosses it. */
#ifndef PYDATACOPY_TORCH_BACKEND_API_H
#define PYDATACOPY_TORCH_BACKEND_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Raised by the backend's version check: a table of another layout is refused. */
#define PYDATACOPY_TORCH_BACKEND_API_VERSION 4
#define PYDATACOPY_TORCH_BACKEND_API_CAPSULE "pydatacopy._C.torch_backend_api"

/* A call's outcome: its Python exception type (pydatacopy.Error, pydatacopy.TimeoutError). */
enum pydatacopy_status { PYDATACOPY_OK = 0, PYDATACOPY_ERROR = 1, PYDATACOPY_TIMEOUT = 2 };

/* One send (is_send != 0: `bytes` from `buffer` to PE `peer`) or recv (into `buffer`). */
typedef struct pydatacopy_p2p_op {
  int is_send;
  void* buffer;
  unsigned long long bytes;
  int peer;
} pydatacopy_p2p_op;

typedef struct pydatacopy_torch_backend_api {
  int version;       /* PYDATACOPY_TORCH_BACKEND_API_VERSION */
  /* Each returns a pydatacopy_status; on a failure, the message (NUL-terminated, cut to fit). */
  /* `ops` as one launch of this process's send/recv engine (the one pydatacopy.send uses, as
   * setup_send_recv() last made it) on `stream` (a cudaStream_t). */
  int (*launch)(const pydatacopy_p2p_op* ops, int count, void* stream, double timeout_s, char* message,
                size_t message_bytes);
  /* What device-side work reported since the last look, from host memory only (capture-safe:
   * pydatacopy._C.check_device_errors()). */
  int (*check_device_errors)(char* message, size_t message_bytes);
  /* All of pydatacopy.check_errors()'s native part: the peers' zero-copy requests served, device
   * errors, the engine's refusals (reads device words: not during a capture). */
  int (*check_errors)(char* message, size_t message_bytes);
  /* *capturing = whether `stream` is capturing a CUDA graph. */
  int (*stream_capturing)(void* stream, int* capturing, char* message, size_t message_bytes);
  /* *symmetric = whether `address` is in NVSHMEM's symmetric heap (memory torch's allocator does
   * not own: no record_stream for it). */
  int (*is_symmetric)(const void* address, int* symmetric, char* message, size_t message_bytes);
  /* The calling thread's queue: `flush` (which must not throw) launches what the backend queued
   * on this thread. pydatacopy.send/recv/sendrecv/group call it first, so a direct call never
   * overtakes an isend queued before it on the same channel. */
  void (*set_thread_flush)(void (*flush)(void));
} pydatacopy_torch_backend_api;

#ifdef __cplusplus
}
#endif

#endif /* PYDATACOPY_TORCH_BACKEND_API_H */
