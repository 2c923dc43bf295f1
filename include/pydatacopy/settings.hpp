// pydatacopy: the environment variables pydatacopy and NVSHMEM read, in one table, and the one
// parser of each kind. Plain C++ (no CUDA): the Python layer (runtime/settings.py, through _C)
// checks the environment with these same parsers before NVSHMEM starts, and every read of the
// environment in the core goes through read() below.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pydatacopy/error.hpp"

namespace pydatacopy::settings {

// One variable's value is wrong; what() says why and what to set (pydatacopy._C.SettingError,
// which runtime/settings.py raises as its SettingError, a ValueError).
class SettingError : public Error {
 public:
  using Error::Error;
};

// The limits and defaults the settings are held to.
constexpr double kMaxTimeoutSeconds = 1e9;  // the core counts nanoseconds in 64 bits: ~31 years
constexpr double kDefaultTimeoutSeconds = 60;
constexpr double kDefaultInitTimeoutSeconds = 300;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 40;
constexpr int64_t kMaxSendBlocks = 1024;  // one thread block per slice of a chunk
constexpr int64_t kDefaultChunkBytes = int64_t{8} << 20;
constexpr int64_t kDefaultNumChunks = 4;
constexpr int64_t kDefaultSendBlocks = 128;
// Messages under kNarrowMessageBytes move on at most PYDATACOPY_NARROW_SEND_BLOCKS slices (and
// at most PYDATACOPY_SEND_BLOCKS): a slice then holds several of a chunk's pages, whose copies in
// and out of the staging overlap, where 128 slices gave each slice one page and took two slices
// per resident block. Measured on one H100 with 2 PEs at 50% (docs/perf-notes.md v25), 32 against
// 128: a 4 MiB staged sendrecv both ways 27.5 against 55 us, 16 MiB 75-85 against 122-128 us; from
// 64 MiB no better, at 256 MiB both ways 3% slower, so larger messages keep PYDATACOPY_SEND_BLOCKS.
// PYDATACOPY_NARROW_SEND_BLOCKS=1024 (kMaxSendBlocks) cuts every size as before the cut existed.
constexpr int64_t kNarrowMessageBytes = int64_t{64} << 20;
constexpr int64_t kDefaultNarrowSendBlocks = 32;
// MPS serves at most 48 clients per GPU on Volta and up to 60 on later GPUs; without MPS every
// one more rank is one more time slice.
constexpr int64_t kMaxRanksPerGpu = 64;
// Messages of at least this many bytes between load/store peers move once (measured:
// docs/zero-copy.md, docs/perf-notes.md v26: 16 MiB zero-copy 0.75x of staged's time one way, 0.73x
// both ways, on one H100 with 2 PEs); SendRecvEngine::kDefaultZeroCopyMinBytes.
constexpr int64_t kDefaultZeroCopyMinBytes = int64_t{16} << 20;
// A zero-copy send of at least this many bytes is copied by the copy engine when its sender's host
// guessed the receiver's address right (the device checks the guess and skips the copy engine when
// it is wrong: send_recv.hpp, "The copy engine"); 0: off. Off by default: the copy engine with a
// stream handshake measured 1.15x a local copy at 64 MiB one way against the SM kernel's 1.31x
// (2026-12-07, one H100, 2 PEs), but a graph that lets the device choose the copy measured 1.39x
// at 64 MiB and 1.20x at 256 MiB in scripts/ce_conditional_probe.cu, and the engine's own path has
// not run on a GPU yet (docs/perf-notes.md v29). Only the sender decides: its receiver's recv is a
// zero-copy recv either way.
constexpr int64_t kDefaultCopyEngineMinBytes = 0;
// A send of such a message that fits the staging (its chunks <= PYDATACOPY_NUM_CHUNKS) that has
// waited this long for its receiver's descriptor moves staged if the receiver is itself held in a
// send/recv kernel (zero_copy.cuh, fall_back_to_staged): so `send(); recv()` on two PEs without a
// group completes, as it does below the threshold, where a wait without end would hold both
// streams. Long against a receiver whose recv is issued with its send (a group, or the same order
// on both PEs: a few microseconds), short against a staged message of that size.
constexpr int64_t kZeroCopyFallbackWaitNs = 100'000;
// ... and after this long whatever holds its receiver (pydatacopy.barrier(), a host barrier after a
// synchronize, a dead peer): such a send completed before zero-copy reached its size, and must not
// now wait until the timeout. Long against a receiver whose stream is busy (a layer's compute),
// which is otherwise waited for so that its message moves once.
constexpr int64_t kZeroCopyFallbackLongWaitNs = 10'000'000;
// A recv below the zero-copy threshold posts its rendezvous descriptor only after this long
// without progress: a sender of its size never reads it (it moves staged or low-latency without
// waiting), and one of another size above the threshold waits for it to learn the mismatch (a
// refusal at both ends instead of a timeout). Posting it at once cost every such message a
// release at system scope on the receiver's path: the default row at 1 MiB one way was 13.0 us
// against the staged row's 11.6 (2026-12-07, same call). Well under kZeroCopyFallbackWaitNs, so a
// mismatched sender that fits the staging still learns it from the descriptor.
constexpr int64_t kLatePostNs = 20'000;
// The low-latency protocol (send_recv.hpp): messages of at most the cut between load/store peers
// travel with their flags in the same 8-byte stores. The capacity is what each slot of its ring
// holds (the cut's most); the default cut is measured (docs/perf-notes.md v13). With 8 line pairs
// in flight per thread, a single 64 KiB sendrecv took 12.4 us one way and 17.1 both ways against
// staged's 13.8 and 20.0 (2026-12-07, one H100, 2 PEs at 50%: v30), but every low-latency op of a
// launch moves on one block, where a group of many such messages (an all-to-all of 64 KiB pieces)
// moves staged on many: the cut stays until a group's row measures it. Messages of several
// blocks' parts were tried up to 1 MiB and were no faster than staged (v30).
constexpr int64_t kLowLatencyCapacityBytes = int64_t{64} << 10;
constexpr int64_t kDefaultLowLatencyMaxBytes = int64_t{16} << 10;
constexpr uint64_t kNvshmemDefaultSymmetricSize = uint64_t{1} << 30;
// Sends and recvs of one group() (one kernel launch): kernels::kMaxBatchOps (api.cuh says why).
constexpr int kMaxGroupOps = 64;

enum class Kind : int {
  kSeconds = 0,      // a positive, finite number of seconds, at most kMaxTimeoutSeconds
  kSwitch = 1,       // 0/1 (empty: 0)
  kInt = 2,          // a whole number in decimal digits, in [minimum, maximum]
  kPercentage = 3,   // a number in (0, 100]
  kNvshmemSize = 4,  // NVSHMEM's size grammar (parse_nvshmem_size)
};
const char* kind_name(Kind kind);

struct Setting {
  const char* name;
  Kind kind;
  std::string default_text;  // "" where unset means "not given" (no default value)
  int64_t minimum;           // kInt only
  int64_t maximum;           // kInt only
  const char* meaning;
  std::string example;
};

// Every row, in the order the Python layer checks (and reports) them.
const std::vector<Setting>& table();
// The row of `name`; Error when the table has none.
const Setting& find(std::string_view name);

// A parsed value: the kind says which member holds it.
struct Value {
  Kind kind = Kind::kInt;
  bool on = false;         // kSwitch
  int64_t integer = 0;     // kInt
  uint64_t bytes = 0;      // kNvshmemSize
  double number = 0;       // kSeconds, kPercentage
};

// ---- the parsers, one per kind; SettingError with today's text for anything else ----
// The number parse_seconds reads in `text` (blanks, then a decimal or hexadecimal number, and
// nothing after it), before its range check; nullopt where there is none.
std::optional<double> read_number(std::string_view text);
double parse_seconds(std::string_view text, std::string_view name, double fallback);
bool parse_switch(std::string_view text, std::string_view name, std::string_view meaning);
int64_t parse_int(std::string_view text, std::string_view name, int64_t minimum, int64_t maximum,
                  std::string_view example, std::string_view meaning);
double parse_percentage(std::string_view text, std::string_view name);
uint64_t parse_nvshmem_size(std::string_view text, std::string_view name, bool allow_zero = false);

// `text` as the row of `name` reads it (NVSHMEM_SYMMETRIC_SIZE refuses 0, the other sizes not).
Value parse(std::string_view name, std::string_view text);

// The environment's text of `name` (the core's one getenv), nullopt when unset.
std::optional<std::string> read(const char* name);
// The value of `name` from the environment, else its row's default (parse(name, default)).
Value value(const char* name);

// Python's repr() of a str holding `text`, UTF-8 (ASCII exactly; of the rest, C1 controls, no-break
// space, soft hyphen and lone surrogates escaped as Python does, the others passed through).
std::string python_repr(std::string_view text);

}  // namespace pydatacopy::settings
