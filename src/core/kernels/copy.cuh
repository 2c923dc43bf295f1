// Cooperative byte copies used by the direct-store (SM) paths.
#pragma once

#include <cstdint>

namespace pydatacopy::kernels {

// One vector load; through the read-only (non-coherent) cache when the source is not written by
// anyone while the kernel runs (a user's send buffer), never for staging or receive regions that
// a peer fills during the kernel.
template <typename Vector, bool kReadOnlySource>
__device__ __forceinline__ Vector load_vector(const Vector* address) {
  if constexpr (kReadOnlySource && sizeof(Vector) > 1) return __ldg(address);
  else return *address;
}

// Copies `bytes` with `threads` cooperating threads (this one is `thread`), in the widest vector
// both pointers allow: 16 bytes when dst and src share their alignment modulo 16 (equal offsets
// into 256-byte-aligned buffers, the usual case), else 8, 4 or 1. The unaligned head and the tail
// go byte by byte; the body keeps kUnroll vectors in flight per thread. No __restrict__: with it
// nvcc may read any source through the non-coherent cache (kReadOnlySource says where that holds).
template <typename Vector, int kUnroll, bool kReadOnlySource>
__device__ __forceinline__ void copy_vectors(uint8_t* dst, const uint8_t* src, int64_t bytes, int thread,
                                             int threads) {
  constexpr int64_t kWidth = sizeof(Vector);
  const int64_t head = static_cast<int64_t>(
      (kWidth - (reinterpret_cast<uintptr_t>(dst) & (kWidth - 1))) & (kWidth - 1));
  const int64_t head_bytes = head < bytes ? head : bytes;
  for (int64_t b = thread; b < head_bytes; b += threads) dst[b] = src[b];
  dst += head_bytes;
  src += head_bytes;
  bytes -= head_bytes;
  const int64_t vectors = bytes / kWidth;
  auto* dst_v = reinterpret_cast<Vector*>(dst);
  const auto* src_v = reinterpret_cast<const Vector*>(src);
  int64_t i = thread;
  for (; i + static_cast<int64_t>(threads) * (kUnroll - 1) < vectors; i += threads * kUnroll) {
    Vector v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = load_vector<Vector, kReadOnlySource>(src_v + i + static_cast<int64_t>(threads) * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst_v[i + static_cast<int64_t>(threads) * u] = v[u];
  }
  for (; i < vectors; i += threads) dst_v[i] = load_vector<Vector, kReadOnlySource>(src_v + i);
  for (int64_t b = vectors * kWidth + thread; b < bytes; b += threads) dst[b] = src[b];
}

// kUnroll: vectors in flight per thread (4 for page-sized pieces; 8 where a block streams through
// megabytes, as zero-copy does). kReadOnlySource: see load_vector.
template <int kUnroll = 4, bool kReadOnlySource = false>
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t bytes,
                                           int thread, int threads) {
  const uintptr_t misalignment = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((misalignment & 15) == 0) copy_vectors<int4, kUnroll, kReadOnlySource>(dst, src, bytes, thread, threads);
  else if ((misalignment & 7) == 0) copy_vectors<uint64_t, kUnroll, kReadOnlySource>(dst, src, bytes, thread, threads);
  else if ((misalignment & 3) == 0) copy_vectors<uint32_t, kUnroll, kReadOnlySource>(dst, src, bytes, thread, threads);
  else copy_vectors<uint8_t, kUnroll, kReadOnlySource>(dst, src, bytes, thread, threads);
}

__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  copy_bytes(dst, src, bytes, lane, 32);
}

__device__ __forceinline__ void store_release_sys(uint64_t* address, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// A strong store for the thread that has just issued __threadfence_system() (fence.sc.sys): the
// fence and this store are a release pattern at system scope (PTX ISA, memory consistency model,
// "release patterns": a fence.sc or fence.acq_rel followed by a strong write), so a reader that
// acquires the word sees every write the fence ordered. st.release.sys there would add a second
// system fence with nothing left for it to order.
__device__ __forceinline__ void store_after_fence_sys(uint64_t* address, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// Between blocks of one launch (device memory only this GPU's kernels touch).
__device__ __forceinline__ void store_release_gpu(uint64_t* address, uint64_t value) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_gpu(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

}  // namespace pydatacopy::kernels
