// MoeDispatcher(expand=False)'s two small layouts (src/core/kernels/moe/token_layout.hpp), without
// a GPU: the elements the kernels run, each once and in a shuffled order (no element may depend on
// another's write), against references written apart from them; and the core entry points'
// argument checks (refused before any launch).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "check.hpp"
#include "kernels/moe/token_layout.hpp"
#include "pydatacopy/all_to_all.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;
namespace tl = pydatacopy::token_layout;

std::vector<int64_t> shuffled(int64_t count, std::mt19937& random) {
  std::vector<int64_t> order(static_cast<std::size_t>(count));
  for (int64_t i = 0; i < count; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), random);
  return order;
}

// The sender's side, for `tokens` tokens of `topk` pairs each over n_pes PEs (some pairs none,
// some tokens with several experts on one PE, some with none at all).
void destinations_case(int64_t tokens, int64_t topk, int n_pes, std::mt19937& random) {
  std::uniform_int_distribution<int> pick(0, n_pes + 1);  // n_pes and above: none
  std::vector<int64_t> pair_pe(static_cast<std::size_t>(tokens * topk));
  for (auto& pe : pair_pe) pe = std::min(pick(random), n_pes);
  // The sender's layout as moe_dispatch_layout defines it: send_counts per PE, send_index PE-major
  // with each PE's tokens in order, zeros past the rows sent.
  std::vector<int64_t> send_counts(static_cast<std::size_t>(n_pes), 0), send_index(static_cast<std::size_t>(n_pes * tokens + 1), 0);
  std::vector<std::set<int64_t>> pes_of(static_cast<std::size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < topk; ++k)
      if (pair_pe[static_cast<std::size_t>(t * topk + k)] < n_pes) pes_of[static_cast<std::size_t>(t)].insert(pair_pe[static_cast<std::size_t>(t * topk + k)]);
  int64_t at = 0;
  for (int p = 0; p < n_pes; ++p)
    for (int64_t t = 0; t < tokens; ++t)
      if (pes_of[static_cast<std::size_t>(t)].count(p)) {
        send_index[static_cast<std::size_t>(at++)] = t;
        ++send_counts[static_cast<std::size_t>(p)];
      }
  std::vector<int64_t> prefix(static_cast<std::size_t>(n_pes + 1), 0);
  for (int p = 0; p < n_pes; ++p) prefix[static_cast<std::size_t>(p + 1)] = prefix[static_cast<std::size_t>(p)] + send_counts[static_cast<std::size_t>(p)];
  const int64_t width = std::min<int64_t>(topk, n_pes);
  std::vector<int64_t> token_pe(static_cast<std::size_t>(tokens * width), 777), token_rank(static_cast<std::size_t>(tokens * width), 777);
  for (int64_t i : shuffled(n_pes * tokens, random))
    tl::token_destination(i, prefix.data(), send_index.data(), pair_pe.data(), tokens, topk, n_pes, width,
                          token_pe.data(), token_rank.data());
  // Reference: a token's PEs ascending; its rank at PE p = the earlier tokens that also go to p.
  bool ok = true;
  for (int64_t t = 0; t < tokens && ok; ++t) {
    int64_t column = 0;
    for (int64_t p : pes_of[static_cast<std::size_t>(t)]) {
      int64_t rank = 0;
      for (int64_t u = 0; u < t; ++u) rank += pes_of[static_cast<std::size_t>(u)].count(p);
      ok = ok && token_pe[static_cast<std::size_t>(t * width + column)] == p && token_rank[static_cast<std::size_t>(t * width + column)] == rank;
      ++column;
    }
    for (; column < width; ++column)
      ok = ok && token_pe[static_cast<std::size_t>(t * width + column)] == n_pes && token_rank[static_cast<std::size_t>(t * width + column)] == -1;
    if (!ok) std::printf("  token %lld of %lld (topk %lld, %d PEs) differs\n", (long long)t, (long long)tokens, (long long)topk, n_pes);
  }
  check(ok, "token_destination: each token's PEs ascending with its rank at each, pads after");
}

// The receiver's side: rows [rows, topk + 1] of which `received` are data (the rest garbage that
// must not be read into the outputs), on PE my_pe of n_pes with experts_per_pe experts each.
void local_topk_case(int64_t rows, int64_t received, int64_t topk, int n_pes, int my_pe, int64_t experts_per_pe,
                     bool weights, std::mt19937& random) {
  const int64_t experts = n_pes * experts_per_pe;
  std::uniform_int_distribution<int64_t> id(-1, experts - 1);
  std::vector<int32_t> meta(static_cast<std::size_t>(rows * (topk + 1)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < topk; ++k) meta[static_cast<std::size_t>(r * (topk + 1) + k)] = static_cast<int32_t>(r < received ? id(random) : 12345);
    meta[static_cast<std::size_t>(r * (topk + 1) + topk)] = static_cast<int32_t>(r < received ? (r * 7) % 1000 : 999999);
  }
  std::vector<float> received_weights(static_cast<std::size_t>(rows * topk));
  for (int64_t i = 0; i < rows * topk; ++i) received_weights[static_cast<std::size_t>(i)] = 0.25f + static_cast<float>(i % 13);
  std::vector<float> w = received_weights;
  std::vector<int64_t> idx(static_cast<std::size_t>(rows * topk), 777), source(static_cast<std::size_t>(rows), 777);
  for (int64_t i : shuffled(rows * topk, random))
    tl::local_topk(i, received, meta.data(), topk, my_pe, experts_per_pe, idx.data(), weights ? w.data() : nullptr,
                   source.data());
  bool ok = true;
  for (int64_t r = 0; r < rows; ++r) {
    const bool data = r < received;
    ok = ok && source[static_cast<std::size_t>(r)] == (data ? (r * 7) % 1000 : -1);
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t global = meta[static_cast<std::size_t>(r * (topk + 1) + k)];
      const bool here = data && global >= 0 && global / experts_per_pe == my_pe;
      const std::size_t i = static_cast<std::size_t>(r * topk + k);
      ok = ok && idx[i] == (here ? global % experts_per_pe : -1);
      if (weights) ok = ok && w[i] == (here ? received_weights[i] : 0.0f);
    }
  }
  if (!weights) ok = ok && w == received_weights;  // no weights: nothing written there
  check(ok, "local_topk: local ids, weights kept only there, source tokens, nothing past the rows received");
}

}  // namespace

int main() {
  std::mt19937 random(2026);
  for (int n_pes : {1, 2, 3, 4, 8, 64})
    for (int64_t topk : {1, 2, 8, 11})
      for (int64_t tokens : {0, 1, 5, 300}) destinations_case(tokens, topk, n_pes, random);
  for (int n_pes : {1, 2, 4, 8})
    for (int64_t topk : {1, 6, 8})
      for (int64_t rows : {0, 1, 64})
        for (int64_t received : {int64_t{0}, rows / 2, rows})
          for (bool weights : {false, true})
            local_topk_case(rows, received, topk, n_pes, n_pes - 1, 4, weights, random);
  local_topk_case(100, 60, 8, 4, 1, 64, true, random);

  // The entry points refuse on the host, before any launch.
  int64_t word = 0;
  check_throws([&] { pydatacopy::moe_token_destinations(&word, &word, &word, 1, 1, 0, &word, &word, nullptr); },
               "PEs", "moe_token_destinations: no PEs");
  check_throws([&] { pydatacopy::moe_token_destinations(&word, &word, &word, 1, 1, 65, &word, &word, nullptr); },
               "PEs", "moe_token_destinations: more PEs than the layouts take");
  check_throws([&] { pydatacopy::moe_token_destinations(&word, &word, &word, 1, 0, 2, &word, &word, nullptr); },
               "topk", "moe_token_destinations: topk 0");
  check_throws([&] { pydatacopy::moe_token_destinations(nullptr, &word, &word, 1, 1, 2, &word, &word, nullptr); },
               "GPU", "moe_token_destinations: a tensor missing");
  check_throws([&] { pydatacopy::moe_local_topk(nullptr, 1, 1, &word, 2, 2, 1, &word, nullptr, &word, &word, nullptr); },
               "PE 2", "moe_local_topk: my_pe outside the PEs");
  check_throws([&] { pydatacopy::moe_local_topk(nullptr, 1, 1, &word, 2, 0, 0, &word, nullptr, &word, &word, nullptr); },
               "experts_per_pe", "moe_local_topk: no experts per PE");
  check_throws([&] { pydatacopy::moe_local_topk(nullptr, 1, 1, &word, 2, 0, 1, &word, nullptr, &word, &word, nullptr); },
               "GPU", "moe_local_topk: recv_meta missing");
  std::printf("test_token_layout: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
