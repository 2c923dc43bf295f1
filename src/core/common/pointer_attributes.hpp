// What the CUDA driver knows of an address's allocation: one cuPointerGetAttributes call for the
// registration cache, zero-copy's exporter and put_many's source check (internal).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pydatacopy::detail {

struct PointerAttributes {
  std::uintptr_t start = 0;          // the allocation's first byte (0: memory CUDA does not know)
  std::size_t bytes = 0;             // the allocation's size
  unsigned long long buffer_id = 0;  // unique per allocation over the process's lifetime
  unsigned int memory_type = 0;      // a CUmemorytype (0: unknown to CUDA)
  bool managed = false;              // cudaMallocManaged
  int device_ordinal = -1;           // asked only with Ask::kDevice
  // Asked only with Ask::kZeroCopy:
  bool legacy_ipc = false;           // cudaIpcGetMemHandle can export it
  unsigned long long handle_types = 0;  // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES (VMM memory)
  bool device_memory() const;        // memory_type is CU_MEMORYTYPE_DEVICE
  bool host_memory() const;          // memory_type is CU_MEMORYTYPE_HOST (pinned or registered)
};

// The attributes one query asks: the range, its memory type and either its buffer ID and
// managed flag (kIdentity), those and how it may be exported (kZeroCopy), or its device (kDevice).
enum class Ask { kIdentity, kZeroCopy, kDevice };

// The physical chunk of virtual-memory memory mapped at `ptr` (CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
// _MAPPING_SIZE, _MEMORY_BLOCK_ID); false when the driver cannot say (not mapped, not VMM).
bool mapping_at(const void* ptr, std::uintptr_t* base, std::size_t* bytes, unsigned long long* block_id);

// Memory CUDA does not know is no failure: its attributes stay zero. A failure of the driver
// call throws pydatacopy::Error naming the status and the address.
PointerAttributes pointer_attributes(const void* ptr, Ask ask);
// As pointer_attributes, but a failure of the driver call returns false (`out` then stays zero).
bool try_pointer_attributes(const void* ptr, Ask ask, PointerAttributes& out);

}  // namespace pydatacopy::detail
