// The all-to-all-v's two kernels (protocol: include/pydatacopy/all_to_all.hpp) and MoE combine's
// weighted reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../device_status.cuh"
#include "api.cuh"
#include "copy.cuh"
#include "pydatacopy/all_to_all.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPes = AllToAllLayout::kMaxPes;
// Bytes a warp moves per piece (whole rows): large enough for full-speed stores, small enough
// that a few hundred rows of a small width spread over the grid.
constexpr int64_t kPieceBytes = 16384;
static_assert(kAllToAllMaxFields == AllToAllLayout::kMaxFields, "one field limit");

__device__ __forceinline__ uint64_t* word(const AllToAllArgs& a, int64_t array, int pe) {
  return reinterpret_cast<uint64_t*>(a.base + array) + pe;
}

__device__ __forceinline__ uint64_t* peer_word(uint8_t* peer_base, int64_t array, int pe) {
  return reinterpret_cast<uint64_t*>(peer_base + array) + pe;
}

__device__ __forceinline__ int64_t rows_per_piece(int64_t row_bytes) {
  const int64_t rows = kPieceBytes / (row_bytes > 0 ? row_bytes : 1);
  return rows > 0 ? rows : 1;
}

// The position i in [0, n) with prefix[i] <= piece < prefix[i + 1] (prefix nondecreasing).
__device__ __forceinline__ int find_slot(const int64_t* prefix, int n, int64_t piece) {
  int lo = 0, hi = n;  // prefix[lo] <= piece < prefix[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= piece) lo = mid;
    else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ void refuse(const AllToAllArgs& a, detail::WaitOp op, int peer,
                                       int64_t asked, int64_t limit) {
  detail::record_error(&a.status->all_to_all, detail::kBadInput, op, peer, a.my_pe,
                       static_cast<uint64_t>(asked), static_cast<uint64_t>(limit));
}

// The last block of a launch to finish runs `last` (every block counts itself, also after a
// timeout, so that the counter is back at zero for the next launch).
template <typename Last>
__device__ __forceinline__ void after_every_block(unsigned int* done, Last last) {
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(done, 1u) + 1 == gridDim.x;
    if (is_last) *done = 0;
  }
  __syncthreads();
  if (is_last) {
    __threadfence();
    last();
  }
}

__global__ void __launch_bounds__(kThreads) all_to_all_send_kernel(const AllToAllArgs a) {
  __shared__ int64_t first_row[kMaxPes];   // send row (or index entry) of each destination's first
  __shared__ int64_t rows_to[kMaxPes];     // rows sent to each destination (0 when refused)
  __shared__ int64_t pieces[kMaxPes + 1];  // prefix, in send order: position i is PE my_pe + i
  __shared__ uint64_t round_value;
  __shared__ int failed;
  const int n = a.n_pes;
  const int lane = threadIdx.x % 32;
  const int64_t per_piece = rows_per_piece(a.row_bytes_total);
  if (threadIdx.x == 0) {
    // This use of the set: one more than the device count, which the last block moves on.
    round_value = *reinterpret_cast<volatile uint64_t*>(a.uses) + 1;
    failed = 0;
    const int64_t limit = a.send_index != nullptr ? a.index_rows : a.send_rows;
    int64_t offset = 0;
    for (int d = 0; d < n; ++d) {
      const int64_t asked = a.send_counts[d];
      first_row[d] = offset;
      int64_t rows = asked;
      if (asked < 0 || asked > limit - offset) {
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllCount, d, asked, limit);
        rows = 0;
      } else if (asked > a.capacity) {
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllCapacity, d, asked, a.capacity);
        rows = 0;
      }
      rows_to[d] = rows;
      // Saturated: counts past the rows never wrap the offset (later destinations are refused).
      if (asked > 0) offset = asked > limit - offset ? limit : offset + asked;
    }
    pieces[0] = 0;
    for (int i = 0; i < n; ++i) {
      const int d = (a.my_pe + i) % n;
      pieces[i + 1] = pieces[i] + (rows_to[d] + per_piece - 1) / per_piece;
    }
  }
  __syncthreads();
  const uint64_t round = round_value;
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  const int64_t my_region = a.regions + static_cast<int64_t>(a.my_pe) * a.region_bytes;

  // Block 0: every destination's meta word, once that destination has freed this set.
  if (blockIdx.x == 0) {
    for (int d = threadIdx.x; d < n; d += blockDim.x) {
      if (!detail::wait_until_at_least(word(a, a.credits, d), round - 1, deadline, a.status,
                                       detail::WaitOp::kAllToAllCredit, d, a.my_pe)) {
        failed = 1;
        continue;
      }
      const int64_t asked = a.send_counts[d];
      const bool refused = rows_to[d] != asked;
      const uint64_t meta = AllToAllLayout::pack_meta(asked, a.row_bytes_total, a.fields, refused);
      uint8_t* peer = a.direct ? a.peer_bases[d] : nullptr;
      if (peer != nullptr) {
        *reinterpret_cast<volatile uint64_t*>(peer_word(peer, a.metas, a.my_pe)) = meta;
        __threadfence_system();
        store_release_sys(peer_word(peer, a.meta_signals, a.my_pe), round);
      } else {
        uint64_t* outgoing = word(a, a.outgoing, d);  // symmetric: the RMA source
        *outgoing = meta;
        nvshmem_putmem_signal(word(a, a.metas, a.my_pe), outgoing, sizeof(uint64_t),
                              word(a, a.meta_signals, a.my_pe), round, NVSHMEM_SIGNAL_SET, d);
      }
    }
  }

  __syncwarp();  // block 0's lanes took their own paths above; the warp calls below need all

  // Rows, piece by piece: each warp takes whole pieces of one destination.
  const int64_t total = pieces[n];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int credited = -1;  // the destination whose credit this warp has seen
  for (int64_t piece = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; piece < total;
       piece += warps) {
    const int i = find_slot(pieces, n, piece);
    const int d = (a.my_pe + i) % n;
    if (d != credited) {
      int ok = 1;
      if (lane == 0)
        ok = detail::wait_until_at_least(word(a, a.credits, d), round - 1, deadline, a.status,
                                         detail::WaitOp::kAllToAllCredit, d, a.my_pe);
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (!ok) {
        failed = 1;
        break;
      }
      credited = d;
    }
    // Another warp may set `failed` at any time: one lane reads it, so that the warp stays whole.
    int stop = 0;
    if (lane == 0) stop = *reinterpret_cast<volatile int*>(&failed);
    if (__shfl_sync(0xffffffffu, stop, 0)) break;
    const int64_t first = (piece - pieces[i]) * per_piece;
    const int64_t rows = min(per_piece, rows_to[d] - first);
    uint8_t* peer = a.direct ? a.peer_bases[d] : nullptr;
    uint64_t* arrivals = word(a, a.arrivals, a.my_pe);  // d's counter for this source
    for (int f = 0; f < a.fields; ++f) {
      const int64_t width = a.row_bytes[f];
      const int64_t at = my_region + a.field_start[f] + first * width;
      if (a.send_index == nullptr) {
        const uint8_t* src = a.send[f] + (first_row[d] + first) * width;
        if (peer != nullptr) {
          warp_copy(peer + at, src, rows * width, lane);
        } else {
          nvshmemx_putmem_signal_warp(a.base + at, src, static_cast<size_t>(rows * width), arrivals,
                                      static_cast<uint64_t>(rows), NVSHMEM_SIGNAL_ADD, d);
        }
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t index = a.send_index[first_row[d] + first + r];
        const bool valid = index >= 0 && index < a.send_rows;
        if (!valid && lane == 0) refuse(a, detail::WaitOp::kAllToAllIndex, d, index, a.send_rows);
        const uint8_t* src = a.send[f] + index * width;
        if (peer != nullptr) {
          if (valid) warp_copy(peer + at + r * width, src, width, lane);
        } else if (valid) {
          nvshmemx_putmem_signal_warp(a.base + at + r * width, src, static_cast<size_t>(width),
                                      arrivals, 1, NVSHMEM_SIGNAL_ADD, d);
        } else if (lane == 0) {
          // The receiver counts every row: an unsent one still counts, its bytes stay stale.
          nvshmemx_signal_op(arrivals, 1, NVSHMEM_SIGNAL_ADD, d);
        }
      }
    }
    if (peer != nullptr) {
      // The piece's stores (every lane's) are visible at d before its count.
      __threadfence_system();
      __syncwarp();
      if (lane == 0) {
        atomicAdd_system(reinterpret_cast<unsigned long long*>(peer_word(peer, a.arrivals, a.my_pe)),
                         static_cast<unsigned long long>(rows * a.fields));
      }
    }
  }
  after_every_block(a.send_done, [&] {
    if (threadIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(a.uses) = round;
  });
}

__global__ void __launch_bounds__(kThreads) all_to_all_recv_kernel(const AllToAllArgs a) {
  __shared__ int64_t rows_from[kMaxPes];    // rows taken from each source (0 when refused)
  __shared__ int64_t offset_of[kMaxPes];    // first row of each source in the outputs
  __shared__ uint64_t expected[kMaxPes];    // each source's arrival counter once its rows are in
  __shared__ int64_t pieces[kMaxPes + 1];   // prefix over sources
  __shared__ int meta_seen[kMaxPes];
  const int n = a.n_pes;
  const int lane = threadIdx.x % 32;
  const int64_t per_piece = rows_per_piece(a.row_bytes_total);
  // The send kernel of this call has moved the set's round count on.
  const uint64_t round = *reinterpret_cast<volatile uint64_t*>(a.uses);
  const uint64_t deadline = detail::globaltimer_ns() + a.timeout_ns;
  for (int s = threadIdx.x; s < n; s += blockDim.x) {
    const bool seen = detail::wait_until_at_least(word(a, a.meta_signals, s), round, deadline,
                                                  a.status, detail::WaitOp::kAllToAllArrival, s,
                                                  a.my_pe);
    meta_seen[s] = seen;
    int64_t rows = 0;
    uint64_t units = 0;
    if (seen) {
      const uint64_t meta = *reinterpret_cast<volatile uint64_t*>(word(a, a.metas, s));
      const int64_t count = AllToAllLayout::meta_count(meta);
      const bool refused = AllToAllLayout::meta_refused(meta);
      // What the sender added to our counter for this round, whether we take its rows or not.
      units = refused ? 0 : static_cast<uint64_t>(count) * AllToAllLayout::meta_fields(meta);
      if (refused) {
        if (blockIdx.x == 0 && count > a.capacity)
          refuse(a, detail::WaitOp::kAllToAllCapacityFrom, s, count, a.capacity);
      } else if (count < 0 || count > a.capacity) {  // never past this PE's region (init votes alike)
        if (blockIdx.x == 0) refuse(a, detail::WaitOp::kAllToAllCapacityFrom, s, count, a.capacity);
      } else if (AllToAllLayout::meta_fields(meta) != a.fields ||
                 AllToAllLayout::meta_row_bytes(meta) != a.row_bytes_total) {
        if (blockIdx.x == 0)
          refuse(a, detail::WaitOp::kAllToAllLayout, s, AllToAllLayout::meta_row_bytes(meta),
                 a.row_bytes_total);
      } else {
        rows = count;
      }
    }
    rows_from[s] = rows;
    expected[s] = a.consumed[s] + units;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t offset = 0;
    pieces[0] = 0;
    for (int s = 0; s < n; ++s) {
      offset_of[s] = offset;
      offset += rows_from[s];
      pieces[s + 1] = pieces[s] + (rows_from[s] + per_piece - 1) / per_piece;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      a.recv_counts[s] = rows_from[s];
      a.recv_offsets[s] = offset_of[s];
    }
  }
  const int64_t total = pieces[n];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int arrived = -1;  // the source whose rows this warp has seen arrive
  for (int64_t piece = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; piece < total;
       piece += warps) {
    const int s = find_slot(pieces, n, piece);
    if (s != arrived) {
      int ok = 1;
      if (lane == 0)
        ok = detail::wait_until_at_least(word(a, a.arrivals, s), expected[s], deadline, a.status,
                                         detail::WaitOp::kAllToAllArrival, s, a.my_pe);
      if (!__shfl_sync(0xffffffffu, ok, 0)) break;
      // Every lane's reads of the region come after lane 0 saw the rows' count.
      __syncwarp();
      __threadfence();
      arrived = s;
    }
    const int64_t first = (piece - pieces[s]) * per_piece;
    const int64_t rows = min(per_piece, rows_from[s] - first);
    const uint8_t* region = a.base + a.regions + static_cast<int64_t>(s) * a.region_bytes;
    for (int f = 0; f < a.fields; ++f) {
      const int64_t width = a.row_bytes[f];
      warp_copy(a.recv[f] + (offset_of[s] + first) * width, region + a.field_start[f] + first * width,
                rows * width, lane);
    }
  }
  after_every_block(a.recv_done, [&] {
    // Every block has read what it copies: free the set's region to every source (after the
    // rows of a source whose rows were dropped have landed too).
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      if (!meta_seen[s]) continue;
      if (!detail::wait_until_at_least(word(a, a.arrivals, s), expected[s], deadline, a.status,
                                       detail::WaitOp::kAllToAllArrival, s, a.my_pe))
        continue;
      a.consumed[s] = expected[s];
      nvshmemx_signal_op(word(a, a.credits, a.my_pe), round, NVSHMEM_SIGNAL_SET, s);
    }
  });
}

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }
template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

template <typename T>
__global__ void __launch_bounds__(256)
    combine_reduce_kernel(T* out, const T* rows, int64_t row_count, const int64_t* slots,
                          const float* weights, int64_t tokens, int64_t topk, int64_t hidden) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float sum = 0.0f;
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t slot = slots[t * topk + k];
        if (slot < 0 || slot >= row_count) continue;
        // Rounded separately, in k order: the float32 reference's arithmetic exactly.
        sum = __fadd_rn(sum, __fmul_rn(weights[t * topk + k], to_float(rows[slot * hidden + h])));
      }
      out[t * hidden + h] = from_float<T>(sum);
    }
  }
}

// out[i] = src[index[i]] for i < min(*count, rows): one warp per row; rows past the count are
// left as they are (the count is read on the device, so a captured launch follows it).
__global__ void __launch_bounds__(256)
    gather_rows_kernel(uint8_t* out, const uint8_t* src, const int64_t* index, const int64_t* count,
                       int64_t rows, int64_t src_rows, int64_t row_bytes) {
  const int64_t used = min(*count, rows);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; row < used;
       row += warps) {
    const int64_t from = index[row];
    if (from < 0 || from >= src_rows) continue;  // not a row of src: left as it is
    warp_copy(out + row * row_bytes, src + from * row_bytes, row_bytes, lane);
  }
}

}  // namespace

void launch_gather_rows(void* out, const void* src, const int64_t* index, const int64_t* count,
                        int64_t rows, int64_t src_rows, int64_t row_bytes, int blocks,
                        cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  gather_rows_kernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(src),
                                                 index, count, rows, src_rows, row_bytes);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_all_to_all(const AllToAllArgs& args, int blocks, cudaStream_t stream) {
  all_to_all_send_kernel<<<blocks, kThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
  all_to_all_recv_kernel<<<blocks, kThreads, 0, stream>>>(args);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_moe_combine_reduce(void* out, const void* rows, int64_t row_count, const int64_t* slots,
                               const float* weights, int64_t tokens, int64_t topk, int64_t hidden,
                               int dtype, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  const int blocks = static_cast<int>(tokens < 65535 ? tokens : 65535);
  switch (dtype) {
    case 0:
      combine_reduce_kernel<<<blocks, 256, 0, stream>>>(static_cast<float*>(out), static_cast<const float*>(rows),
                                                        row_count, slots, weights, tokens, topk, hidden);
      break;
    case 1:
      combine_reduce_kernel<<<blocks, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(out),
                                                        static_cast<const __nv_bfloat16*>(rows), row_count,
                                                        slots, weights, tokens, topk, hidden);
      break;
    case 2:
      combine_reduce_kernel<<<blocks, 256, 0, stream>>>(static_cast<__half*>(out), static_cast<const __half*>(rows),
                                                        row_count, slots, weights, tokens, topk, hidden);
      break;
    default:
      PDC_REQUIRE(false, "moe_combine_reduce: dtype code " << dtype << " is not float32 (0), bfloat16 (1) or float16 (2)");
  }
  PDC_CHECK_CUDA(cudaGetLastError());
}

void preload_all_to_all_kernels() {
  cudaFuncAttributes attributes;
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_send_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, all_to_all_recv_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, gather_rows_kernel));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_kernel<float>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_kernel<__nv_bfloat16>));
  PDC_CHECK_CUDA(cudaFuncGetAttributes(&attributes, combine_reduce_kernel<__half>));
}

}  // namespace pydatacopy::kernels
