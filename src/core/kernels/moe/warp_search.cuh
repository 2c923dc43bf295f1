// Device-side search and warp scan shared by the all-to-all and MoE layout kernels.
#pragma once

#include <cstdint>

namespace pydatacopy::kernels {

// The position i in [0, n) with prefix[i] <= value < prefix[i + 1] (prefix nondecreasing, n >= 1;
// with equal entries, the last): which piece, source or slot a running index falls in.
__device__ __forceinline__ int find_slot(const int64_t* prefix, int n, int64_t value) {
  int lo = 0, hi = n;  // prefix[lo] <= value < prefix[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= value) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Inclusive scan over a warp (every lane calls it).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T value, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

}  // namespace pydatacopy::kernels
