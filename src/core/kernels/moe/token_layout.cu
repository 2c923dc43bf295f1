// MoeDispatcher(expand=False)'s two small layouts (token_destinations on the sender, local_topk
// on the receiver), one thread an element of kernels/moe/token_layout.hpp: one launch each in
// place of the dozen torch ops each took.
#include <algorithm>

#include "kernels/api.cuh"
#include "kernels/moe/token_layout.hpp"
#include "pydatacopy/error.hpp"

namespace pydatacopy::kernels {
namespace {

constexpr int kTokenLayoutThreads = 256;

// Every block sums the counts itself (n_pes is at most kMoeLayoutMaxPes: cheaper than a launch).
__global__ void __launch_bounds__(kTokenLayoutThreads)
    moe_token_destinations_kernel(const int64_t* send_counts, const int64_t* send_index, const int64_t* pair_pe,
                                  int64_t tokens, int64_t topk, int n_pes, int64_t width, int64_t* token_pe,
                                  int64_t* token_rank) {
  __shared__ int64_t prefix[kMoeLayoutMaxPes + 1];
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int p = 0; p < n_pes; ++p) prefix[p + 1] = prefix[p] + max(send_counts[p], int64_t{0});
  }
  __syncthreads();
  const int64_t elements = static_cast<int64_t>(n_pes) * tokens;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    token_layout::token_destination(i, prefix, send_index, pair_pe, tokens, topk, n_pes, width, token_pe,
                                    token_rank);
}

__global__ void __launch_bounds__(kTokenLayoutThreads)
    moe_local_topk_kernel(const int32_t* recv_meta, int64_t rows, int64_t topk, const int64_t* recv_counts,
                          int n_pes, int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx,
                          float* recv_topk_weights, int64_t* source_token, int64_t* num_rows) {
  __shared__ int64_t received;
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (int p = 0; p < n_pes; ++p) sum += max(recv_counts[p], int64_t{0});
    received = min(sum, rows);
    if (blockIdx.x == 0) *num_rows = received;
  }
  __syncthreads();
  const int64_t elements = rows * topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    token_layout::local_topk(i, received, recv_meta, topk, my_pe, experts_per_pe, recv_topk_idx,
                             recv_topk_weights, source_token);
}

int blocks_for(int64_t elements, int max_blocks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((elements + kTokenLayoutThreads - 1) / kTokenLayoutThreads,
                                                                  max_blocks)));
}

}  // namespace

void launch_moe_token_destinations(const int64_t* send_counts, const int64_t* send_index, const int64_t* pair_pe,
                                   int64_t tokens, int64_t topk, int n_pes, int64_t* token_pe, int64_t* token_rank,
                                   int max_blocks, cudaStream_t stream) {
  if (tokens == 0) return;
  const int64_t width = std::min<int64_t>(topk, n_pes);
  moe_token_destinations_kernel<<<blocks_for(static_cast<int64_t>(n_pes) * tokens, max_blocks), kTokenLayoutThreads, 0,
                                  stream>>>(send_counts, send_index, pair_pe, tokens, topk, n_pes, width, token_pe,
                                            token_rank);
  PDC_CHECK_CUDA(cudaGetLastError());
}

void launch_moe_local_topk(const int32_t* recv_meta, int64_t rows, int64_t topk, const int64_t* recv_counts,
                           int n_pes, int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx,
                           float* recv_topk_weights, int64_t* source_token, int64_t* num_rows, int max_blocks,
                           cudaStream_t stream) {
  // (rows 0: still one block, num_rows is written.)
  moe_local_topk_kernel<<<blocks_for(rows * topk, max_blocks), kTokenLayoutThreads, 0, stream>>>(
      recv_meta, rows, topk, recv_counts, n_pes, my_pe, experts_per_pe, recv_topk_idx, recv_topk_weights,
      source_token, num_rows);
  PDC_CHECK_CUDA(cudaGetLastError());
}

}  // namespace pydatacopy::kernels
