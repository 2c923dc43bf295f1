#include "common/pointer_attributes.hpp"

#include <cuda.h>

#include "common/cuda_calls.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::detail {
namespace {

using GetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

GetAttributes get_attributes() {
  static const GetAttributes function = driver_function<GetAttributes>("cuPointerGetAttributes");
  return function;
}

CUresult query(const void* ptr, Ask ask, PointerAttributes& out) {
  void* start = nullptr;
  int managed = 0;
  PointerAttributes a;
  CUpointer_attribute identity[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                    CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    CU_POINTER_ATTRIBUTE_IS_MANAGED};
  void* identity_values[] = {&start, &a.bytes, &a.buffer_id, &a.memory_type, &managed};
  CUpointer_attribute device[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                  CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* device_values[] = {&start, &a.bytes, &a.memory_type, &a.device_ordinal};
  int legacy_ipc = 0;
  CUpointer_attribute zero_copy[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                     CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                     CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                     CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES};
  void* zero_copy_values[] = {&start, &a.bytes, &a.buffer_id, &a.memory_type, &managed, &legacy_ipc, &a.handle_types};
  const auto address = reinterpret_cast<CUdeviceptr>(ptr);
  const CUresult status = ask == Ask::kIdentity ? get_attributes()(5, identity, identity_values, address)
                          : ask == Ask::kZeroCopy ? get_attributes()(7, zero_copy, zero_copy_values, address)
                                                  : get_attributes()(4, device, device_values, address);
  if (status != CUDA_SUCCESS) return status;
  a.start = reinterpret_cast<std::uintptr_t>(start);
  a.managed = managed != 0;
  a.legacy_ipc = legacy_ipc != 0;
  out = a;
  return status;
}

}  // namespace

bool PointerAttributes::device_memory() const { return memory_type == CU_MEMORYTYPE_DEVICE; }
bool PointerAttributes::host_memory() const { return memory_type == CU_MEMORYTYPE_HOST; }

PointerAttributes pointer_attributes(const void* ptr, Ask ask) {
  PointerAttributes a;
  const CUresult status = query(ptr, ask, a);
  PDC_REQUIRE(status == CUDA_SUCCESS, "cuPointerGetAttributes failed with CUDA driver status "
                                          << static_cast<int>(status) << " for " << ptr);
  return a;
}

bool mapping_at(const void* ptr, std::uintptr_t* base, std::size_t* bytes, unsigned long long* block_id) {
  void* mapping_base = nullptr;
  std::size_t mapping_bytes = 0;
  unsigned long long id = 0;
  int mapped = 0;
  CUpointer_attribute asked[] = {CU_POINTER_ATTRIBUTE_MAPPED, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                 CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID};
  void* values[] = {&mapped, &mapping_base, &mapping_bytes, &id};
  if (get_attributes()(4, asked, values, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS || mapped == 0 ||
      mapping_base == nullptr || mapping_bytes == 0)
    return false;
  *base = reinterpret_cast<std::uintptr_t>(mapping_base);
  *bytes = mapping_bytes;
  *block_id = id;
  return true;
}

bool try_pointer_attributes(const void* ptr, Ask ask, PointerAttributes& out) {
  out = PointerAttributes();
  return query(ptr, ask, out) == CUDA_SUCCESS;
}

}  // namespace pydatacopy::detail
