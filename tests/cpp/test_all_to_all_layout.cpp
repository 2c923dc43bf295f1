// The all-to-all's symmetric layout and meta word (include/pydatacopy/all_to_all.hpp), without a
// GPU: every array inside the allocation and apart from the others, each field's rows inside its
// region, the meta word's round trip and saturation, init's argument checks, and those of the MoE
// layout and region kernels (refused before any launch).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"
#include "pydatacopy/all_to_all.hpp"

namespace {

using pydatacopy::AllToAllLayout;
using pydatacopy_test::check;
using pydatacopy_test::check_throws;

// [begin, end) ranges must not overlap.
bool disjoint(std::vector<std::pair<int64_t, int64_t>> ranges) {
  for (std::size_t i = 0; i < ranges.size(); ++i)
    for (std::size_t j = i + 1; j < ranges.size(); ++j)
      if (ranges[i].first < ranges[j].second && ranges[j].first < ranges[i].second) {
        std::printf("  [%lld, %lld) overlaps [%lld, %lld)\n", (long long)ranges[i].first,
                    (long long)ranges[i].second, (long long)ranges[j].first, (long long)ranges[j].second);
        return false;
      }
  return true;
}

void layout_of(int64_t capacity, int64_t row_bytes, int pes) {
  const AllToAllLayout layout(capacity, row_bytes, pes);
  const int64_t words = static_cast<int64_t>(pes) * 8;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int set = 0; set < 2; ++set) {
    ranges.push_back({layout.regions(set), layout.regions(set) + pes * layout.region_bytes()});
    for (int64_t start : {layout.meta_signals(set), layout.arrivals(set), layout.credits(set), layout.places(set)}) {
      ranges.push_back({start, start + words});
      check(start % 8 == 0, "every word array is 8-byte aligned");
    }
    // (meta, tag) pairs: one 16-byte put each.
    for (int64_t start : {layout.metas(set), layout.outgoing(set)}) {
      ranges.push_back({start, start + pes * AllToAllLayout::kMetaBytes});
      check(start % 16 == 0, "every pair array is 16-byte aligned");
    }
  }
  check(disjoint(ranges), "regions and word arrays of both sets do not overlap");
  int64_t end = 0;
  for (const auto& range : ranges) end = range.second > end ? range.second : end;
  check(end <= layout.total(), "everything lies inside the allocation");
  check(layout.region_bytes() % AllToAllLayout::kAlignment == 0, "regions are 256-byte multiples");
  // Any split of the row into up to four fields fits its region.
  const int64_t splits[][4] = {{row_bytes, 0, 0, 0},
                               {1, row_bytes - 1, 0, 0},
                               {row_bytes / 4 + 1, row_bytes / 4 + 1, row_bytes / 4 + 1,
                                row_bytes - 3 * (row_bytes / 4 + 1)}};
  for (const auto& split : splits) {
    int fields = 0;
    for (int64_t width : split) fields += width > 0;
    if (split[fields - 1] <= 0) continue;
    const int64_t last = AllToAllLayout::field_start(capacity, split, fields - 1);
    check(last + capacity * split[fields - 1] <= layout.region_bytes(), "every field fits the region");
    for (int f = 0; f < fields; ++f)
      check(AllToAllLayout::field_start(capacity, split, f) % 16 == 0, "fields start 16-byte aligned");
    // A compact call: field f's packed rows of all sources (n_pes x capacity of them) at
    // n_pes x field_start(f) in the set, apart from each other and inside the set's regions.
    std::vector<std::pair<int64_t, int64_t>> packed;
    for (int f = 0; f < fields; ++f) {
      const int64_t start = pes * AllToAllLayout::field_start(capacity, split, f);
      packed.push_back({start, start + pes * capacity * split[f]});
      check(start % 16 == 0, "compact: packed fields start 16-byte aligned");
    }
    check(disjoint(packed), "compact: the packed fields do not overlap");
    check(packed.back().second <= pes * layout.region_bytes(), "compact: every packed field fits the set");
  }
}

// Compact calls' placing rules (the send kernel's place_sources and the receive kernel's
// counts, offsets and awaited units read the same meta words with placed_rows; the place word
// carries the round).
void compact_words() {
  using L = AllToAllLayout;
  const int64_t capacity = 100, width = 64;
  const uint64_t tag = 77;
  const int compact = 2 | L::kCompactFields;
  const auto placed_as = [&](uint64_t meta, uint64_t source_tag, int fields) {
    return L::placed_rows(meta, source_tag, capacity, fields, width, tag);
  };
  const auto placed = [&](uint64_t meta) { return placed_as(meta, tag, 2); };
  check(placed(L::pack_meta(37, width, compact, false)) == 37, "placed: a compact meta of this call is placed");
  check(placed(L::pack_meta(0, width, compact, false)) == 0, "placed: 0 rows");
  check(placed(L::pack_meta(capacity, width, compact, false)) == capacity, "placed: a full region");
  check(placed(L::pack_meta(37, width, compact, true)) == 0, "placed: a refused pair takes no room");
  check(placed(L::pack_call_refused(pydatacopy::kRefusedByCaller)) == 0, "placed: a refused call takes no room");
  check(placed(L::pack_meta(capacity + 1, width, compact, false)) == 0, "placed: past the capacity, no room");
  check(placed(L::pack_meta(37, width, 2, false)) == 0, "placed: a plain call's meta takes no room");
  check(placed(L::pack_meta(37, width + 1, compact, false)) == 0, "placed: another row width, no room");
  check(placed(L::pack_meta(37, width, 3 | L::kCompactFields, false)) == 0, "placed: other fields, no room");
  check(placed_as(L::pack_meta(37, width, compact, false), tag + 1, 2) == 0, "placed: another call's tag, no room");
  check(placed_as(L::pack_meta(37, width, compact, false), tag, 0) == 0, "placed: refuse mode places nobody");
  // What a sender's rows add to the receiver's counter: rows x fields, whatever the kind.
  check(L::meta_field_count(L::pack_meta(5, width, compact, false)) == 2, "units: a compact meta's fields");
  check(L::meta_field_count(L::pack_meta(5, width, 2, false)) == 2, "units: a plain meta's fields");
  check(L::meta_compact(L::pack_meta(5, width, compact, false)), "compact: the flag travels in the meta word");
  check(!L::meta_compact(L::pack_meta(5, width, 2, false)), "compact: a plain meta is not");
  check(!L::meta_compact(L::pack_call_refused(pydatacopy::kRefusedArguments)), "compact: a refused call is not");
  for (int fields = 1; fields <= L::kMaxFields; ++fields)
    check((fields | L::kCompactFields) != L::kCallRefusedFields && ((fields | L::kCompactFields) & 0x7f) ==
                                                                       (fields | L::kCompactFields),
          "compact: the flagged field count fits the meta word and is no refused call");
  check(L::kMaxCompactRows < L::kDroppedRow, "place: no first row reads as dropped");
  for (uint64_t round : {uint64_t{1}, uint64_t{2}, uint64_t{77777}, uint64_t{0xfffffffe}, uint64_t{0xffffffff},
                         uint64_t{1} << 32, (uint64_t{1} << 32) + 1, (uint64_t{3} << 32) + 5}) {
    for (int64_t row : {int64_t{0}, int64_t{1}, int64_t{123456}, L::kMaxCompactRows, L::kDroppedRow}) {
      const uint64_t place = L::pack_place(round, row);
      check(L::place_row(place) == row, "place: the row round-trips");
      // The sender waits for a place word of its round: met by this round's, whatever its row,
      // never by the one the set's previous round left (round - 1), across the 2^32 wrap too.
      check(L::place_is_round(place, round), "place: this round's is this round's");
      check(!L::place_is_round(L::pack_place(round - 1, row), round), "place: the previous round's is not");
      check(!L::place_is_round(L::pack_place(round + 1, row), round), "place: the next round's is not");
    }
  }
}

// Every pairing of a source and a receiver in one round: the arrival units the receiver awaits
// (units_from, what its receive kernel computes) equal what the source's send kernel adds, as
// the kernels behave (written here apart from units_from): a plain source sends its rows unless
// its pair or call was refused; a compact one waits for its place and sends its rows only when
// the receiver placed it (a compact receiver's place_sources gives a row when placed_rows > 0,
// kDroppedRow otherwise; a plain receiver sends kDroppedRow). A mismatch would be a timeout
// (too many awaited) or a round whose counters drift (too few).
void compact_units() {
  using L = AllToAllLayout;
  const int64_t capacity = 50;
  int pairings = 0;
  for (bool source_compact : {false, true})
    for (bool receiver_compact : {false, true})
      for (bool source_refuses_call : {false, true})
        for (bool receiver_refuses_call : {false, true})
          for (int64_t count : {int64_t{0}, int64_t{7}, capacity, capacity + 1})
            for (int source_fields : {2, 3})
              for (int64_t source_bytes : {int64_t{96}, int64_t{100}})
                for (uint64_t source_tag : {uint64_t{5}, uint64_t{6}}) {
                  const int receiver_fields = receiver_refuses_call ? 0 : 2;  // refuse mode: no fields
                  const int64_t receiver_bytes = receiver_refuses_call ? 0 : 96;
                  const uint64_t receiver_tag = receiver_refuses_call ? 0 : 5;
                  const bool pair_refused = count > capacity;
                  const uint64_t meta =
                      source_refuses_call ? L::pack_call_refused(pydatacopy::kRefusedArguments)
                                          : L::pack_meta(count, source_bytes,
                                                         source_fields | (source_compact ? L::kCompactFields : 0),
                                                         pair_refused);
                  int64_t rows_sent = 0;
                  if (!source_refuses_call && !pair_refused) {
                    if (!source_compact) {
                      rows_sent = count;
                    } else if (receiver_compact) {
                      const bool placed = L::placed_rows(meta, source_tag, capacity, receiver_fields, receiver_bytes,
                                                         receiver_tag) > 0;
                      rows_sent = placed ? count : 0;
                    }  // (a plain receiver drops a compact source)
                  }
                  const uint64_t sent = static_cast<uint64_t>(rows_sent) * static_cast<uint64_t>(source_fields);
                  const uint64_t awaited = L::units_from(meta, source_tag, receiver_compact, capacity, receiver_fields,
                                                         receiver_bytes, receiver_tag);
                  if (sent != awaited)
                    std::printf("  source %s%s, receiver %s%s, count %lld, fields %d, bytes %lld, tag %llu: "
                                "sent %llu units, awaited %llu\n",
                                source_compact ? "compact" : "plain", source_refuses_call ? " refusing" : "",
                                receiver_compact ? "compact" : "plain", receiver_refuses_call ? " refusing" : "",
                                (long long)count, source_fields, (long long)source_bytes,
                                (unsigned long long)source_tag, (unsigned long long)sent,
                                (unsigned long long)awaited);
                  check(sent == awaited, "units: what a source sends is what its receiver awaits");
                  ++pairings;
                }
  check(pairings == 2 * 2 * 2 * 2 * 4 * 2 * 2 * 2, "units: every pairing checked");
}

}  // namespace

int main() {
  layout_of(24, 4108, 4);
  layout_of(1, 1, 1);
  layout_of(4096, 7168 * 2 + 36, 8);
  layout_of(333, 17, 1024);
  compact_words();
  compact_units();

  const uint64_t meta = AllToAllLayout::pack_meta(12345, 14372, 2, false);
  check(AllToAllLayout::meta_count(meta) == 12345, "meta: count");
  check(AllToAllLayout::meta_row_bytes(meta) == 14372, "meta: row bytes");
  check(AllToAllLayout::meta_fields(meta) == 2, "meta: fields");
  check(!AllToAllLayout::meta_refused(meta), "meta: not refused");
  const uint64_t refused = AllToAllLayout::pack_meta(int64_t{1} << 40, AllToAllLayout::kMaxRowBytes, 4, true);
  check(AllToAllLayout::meta_refused(refused), "meta: refused");
  check(AllToAllLayout::meta_count(refused) == 0xffffffffll, "meta: a huge count saturates");
  check(AllToAllLayout::meta_row_bytes(refused) == AllToAllLayout::kMaxRowBytes, "meta: the widest row");
  check(AllToAllLayout::meta_count(AllToAllLayout::pack_meta(-5, 1, 1, true)) == 0, "meta: a negative count is 0");
  // A whole call refused: told apart from every per-destination refusal, its reason kept.
  const uint64_t call_refused = AllToAllLayout::pack_call_refused(pydatacopy::kRefusedSendTensor);
  check(AllToAllLayout::meta_call_refused(call_refused), "meta: a call refused");
  check(AllToAllLayout::meta_count(call_refused) == pydatacopy::kRefusedSendTensor, "meta: the refusal's reason");
  check(!AllToAllLayout::meta_call_refused(refused), "meta: a refused pair is not a refused call");
  for (int fields = 0; fields <= AllToAllLayout::kMaxFields; ++fields)
    check(!AllToAllLayout::meta_call_refused(AllToAllLayout::pack_meta(int64_t{1} << 40, 7, fields, true)),
          "meta: no real field count reads as a refused call");

  check_throws([] { AllToAllLayout::check(0, 16, 2); }, "capacity", "capacity 0 refused");
  check_throws([] { AllToAllLayout::check(16, 0, 2); }, "max_row_bytes", "row bytes 0 refused");
  check_throws([] { AllToAllLayout::check(16, AllToAllLayout::kMaxRowBytes + 1, 2); }, "max_row_bytes",
               "rows wider than the meta word refused");
  check_throws([] { AllToAllLayout::check(16, 16, AllToAllLayout::kMaxPes + 1); }, "PEs", "too many PEs refused");
  check_throws([] { AllToAllLayout::check(AllToAllLayout::kMaxCapacity, AllToAllLayout::kMaxRowBytes, 1024); },
               "64 TiB", "a receive set beyond 64 TiB refused");
  // The MoE layout and region kernels' argument checks: refused before anything is launched.
  int64_t words[8] = {};
  int32_t ints[8] = {};
  int64_t* w = words;
  check_throws([&] { pydatacopy::moe_dispatch_layout(w, 8, 2, 2, 8, 0, w, w, ints, w, w, nullptr); }, "PEs",
               "dispatch layout: 0 PEs refused");
  check_throws([&] { pydatacopy::moe_dispatch_layout(w, 8, 2, 2, 130, pydatacopy::kMoeLayoutMaxPes + 1, w, w, ints,
                                                     w, w, nullptr); },
               "PEs", "dispatch layout: more PEs than the kernel's limit refused");
  check_throws([&] { pydatacopy::moe_dispatch_layout(w, 2, 2, 2, 8, 2, w, w, ints, w, w, nullptr); }, "int32 or int64",
               "dispatch layout: 2-byte ids refused");
  check_throws([&] { pydatacopy::moe_dispatch_layout(w, 8, 2, 2, 9, 2, w, w, ints, w, w, nullptr); }, "multiple",
               "dispatch layout: experts that do not split over the PEs refused");
  check_throws([&] { pydatacopy::moe_dispatch_layout(w, 8, int64_t{1} << 29, 8, 8, 2, w, w, ints, w, w, nullptr); },
               "2^31", "dispatch layout: 2^32 pairs refused");
  check_throws([&] { pydatacopy::moe_dispatch_layout(nullptr, 8, 2, 2, 8, 2, w, w, ints, w, w, nullptr); }, "GPU",
               "dispatch layout: tokens without ids refused");
  check_throws([&] { pydatacopy::moe_receive_layout(ints, 4, 2, w, 2, 2, 4, w, w, w, w, w, w, w, w, w, nullptr,
                                                    nullptr); },
               "PE 2", "receive layout: this PE outside the PEs refused");
  check_throws([&] { pydatacopy::moe_receive_layout(ints, 4, 2, w, 2, 0, pydatacopy::kMoeLayoutMaxExpertsPerPe + 1, w, w,
                                                    w, w, w, w, w, w, w, nullptr, nullptr); },
               "experts per PE", "receive layout: more local experts than the kernel's bins refused");
  check_throws([&] { pydatacopy::moe_receive_layout(ints, int64_t{1} << 28, 8, w, 2, 0, 4, w, w, w, w, w, w, w, w, w,
                                                    nullptr, nullptr); },
               "2^31", "receive layout: 2^31 pairs refused");
  check_throws([&] { pydatacopy::scatter_region_rows(w, 4, w, 256, w, w, 2, w, 2, 4, 130, nullptr); }, "16-byte",
               "scatter_region_rows: rows of 130 bytes refused (gather them)");
  check_throws([&] { pydatacopy::gather_region_rows(w, w, 256, w, w, 0, w, w, 4, 16, nullptr); }, "sources",
               "gather_region_rows: no sources refused");
  std::printf("test_all_to_all_layout: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
