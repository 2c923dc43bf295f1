// MoeDispatcher(expand=False)'s two small layouts, one element at a time: the same functions run
// in the kernels (kernels/moe/token_layout.cu, one thread an element) and in the host tests
// (tests/cpp/test_token_layout.cpp, a loop over the elements against references written apart).
// Their torch references are token_destinations and local_topk (python/pydatacopy/moe/layout.py).
#pragma once

#include <cstdint>

#include "pydatacopy/all_to_all.hpp"  // PDC_ALL_TO_ALL_HOST_DEVICE

namespace pydatacopy::token_layout {

// How many distinct PEs of a token's pairs (pair_pe_row[topk]: the PE of each, n_pes or more for
// none) are below `pe`: with pe = n_pes, how many PEs the token goes to; for a PE it goes to,
// that PE's column among its PEs in ascending order.
PDC_ALL_TO_ALL_HOST_DEVICE inline int pes_below(const int64_t* pair_pe_row, int64_t topk, int64_t pe) {
  int below = 0;
  for (int64_t k = 0; k < topk; ++k) {
    const int64_t p = pair_pe_row[k];
    if (p < 0 || p >= pe) continue;
    bool first = true;  // several experts on one PE: the PE once
    for (int64_t j = 0; j < k; ++j) {
      if (pair_pe_row[j] == p) {
        first = false;
        break;
      }
    }
    below += first ? 1 : 0;
  }
  return below;
}

// Element i of token_destinations, i in [0, n_pes x tokens): send_prefix[n_pes + 1] the running
// sum of send_counts (send_prefix[0] = 0), send_index the sender's layout's (PE-major: PE p's
// tokens at [send_prefix[p], send_prefix[p + 1]), each in token order). Entry i < the rows sent
// is the i-th row sent: its token t goes to PE p at rank i - send_prefix[p] among the tokens
// sent there, and lands in t's column pes_below(t, p). Element i < tokens also pads token i's
// columns past its PEs (token_pe n_pes, token_rank -1). Every cell of token_pe / token_rank
// [tokens, width] is written by exactly one element; width = min(topk, n_pes).
PDC_ALL_TO_ALL_HOST_DEVICE inline void token_destination(int64_t i, const int64_t* send_prefix, const int64_t* send_index,
                                                         const int64_t* pair_pe, int64_t tokens, int64_t topk,
                                                         int n_pes, int64_t width, int64_t* token_pe,
                                                         int64_t* token_rank) {
  if (i < send_prefix[n_pes]) {
    int p = 0;  // the last PE whose rows start at or before i (its count is above 0)
    while (p + 1 < n_pes && send_prefix[p + 1] <= i) ++p;
    const int64_t t = send_index[i];
    if (t >= 0 && t < tokens) {
      const int64_t column = pes_below(pair_pe + t * topk, topk, p);
      if (column < width) {
        token_pe[t * width + column] = p;
        token_rank[t * width + column] = i - send_prefix[p];
      }
    }
  }
  if (i < tokens) {
    for (int64_t column = pes_below(pair_pe + i * topk, topk, n_pes); column < width; ++column) {
      token_pe[i * width + column] = n_pes;
      token_rank[i * width + column] = -1;
    }
  }
}

// Element i of local_topk, i in [0, rows x topk) (row i / topk, slot i % topk): recv_meta
// [rows, topk + 1] int32 as received (global expert ids, -1 for none; the source's token), the
// first num_rows rows data (no others read). recv_topk_idx[i]: the local id (global - my_pe x
// experts_per_pe), -1 for an expert elsewhere, none, or a row past num_rows; recv_topk_weights
// (null: none) in place: the received weight kept where the id is local, else 0; source_token
// [rows] (slot 0's element): the source's token, -1 past num_rows.
PDC_ALL_TO_ALL_HOST_DEVICE inline void local_topk(int64_t i, int64_t num_rows, const int32_t* recv_meta, int64_t topk,
                                                  int my_pe, int64_t experts_per_pe, int64_t* recv_topk_idx,
                                                  float* recv_topk_weights, int64_t* source_token) {
  const int64_t row = i / topk, slot = i % topk;
  const bool in_use = row < num_rows;
  const int32_t* meta = recv_meta + row * (topk + 1);
  int64_t local = -1;
  if (in_use) {
    const int64_t id = meta[slot];
    const int64_t mine = id - static_cast<int64_t>(my_pe) * experts_per_pe;
    if (id >= 0 && mine >= 0 && mine < experts_per_pe) local = mine;
  }
  recv_topk_idx[i] = local;
  if (recv_topk_weights != nullptr && local < 0) recv_topk_weights[i] = 0.0f;
  if (slot == 0) source_token[row] = in_use ? meta[topk] : -1;
}

}  // namespace pydatacopy::token_layout
