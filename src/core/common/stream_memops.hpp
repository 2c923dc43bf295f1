// Stream memory operations (CUDA 12's cuStreamWaitValue64 and cuStreamWriteValue64): a stream
// waits for, or writes, a 64-bit word of device memory with no kernel and no SM, so that a copy
// engine's copy can be ordered against another process's stream (internal).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pydatacopy::detail {

// The stream waits until *word >= value (64-bit, wrapping as the driver compares: the word never
// runs 2^63 ahead of a wait). A stream wait has no timeout: whoever enqueues one must be able to
// release it (write the word itself) when its writer is gone.
void stream_wait_at_least(cudaStream_t stream, const uint64_t* word, uint64_t value);
// The stream writes `value` into *word once its work before it has finished, after a fence that
// makes that work's writes visible to the system first (the driver's default; the word may be a
// peer's, mapped by NVSHMEM or CUDA IPC).
void stream_write_word(cudaStream_t stream, uint64_t* word, uint64_t value);

}  // namespace pydatacopy::detail
