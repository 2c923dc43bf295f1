// Warp-cooperative byte copies used by the direct-store paths.
#pragma once

#include <cstdint>

namespace pydatacopy::kernels {

// Copies `bytes` from src to dst with the 32 lanes of a warp. dst and src must have the same
// alignment modulo 16 (true for equal offsets into 256-byte-aligned buffers): the unaligned head
// and tail go byte by byte, the body in 16-byte vectors, four in flight per lane.
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes,
                                          int lane) {
  const int64_t head = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  const int64_t head_bytes = head < bytes ? head : bytes;
  if (lane < head_bytes) dst[lane] = src[lane];
  dst += head_bytes;
  src += head_bytes;
  bytes -= head_bytes;
  const int64_t vectors = bytes / 16;
  auto* dst4 = reinterpret_cast<int4*>(dst);
  const auto* src4 = reinterpret_cast<const int4*>(src);
  constexpr int kUnroll = 4;
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < vectors; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(src4 + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst4[i + 32 * u] = v[u];
  }
  for (; i < vectors; i += 32) dst4[i] = __ldg(src4 + i);
  const int64_t tail_start = vectors * 16;
  for (int64_t b = tail_start + lane; b < bytes; b += 32) dst[b] = src[b];
}

__device__ __forceinline__ void store_release_sys(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

}  // namespace pydatacopy::kernels
