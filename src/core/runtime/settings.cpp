// The settings table and its parsers (include/pydatacopy/settings.hpp). The texts are the ones
// the Python layer has always given (tests/test_settings.py checks them through _C).
#include "pydatacopy/settings.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace pydatacopy::settings {

namespace {

constexpr const char* kSizeHowto =
    "a byte count with an optional k, M, G or T suffix, e.g. 2G, 1536M or 1073741824";

// The ASCII characters Python's str.strip() and re's \s take for blanks.
bool is_space(char c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f');
}
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

std::string_view strip(std::string_view text) {
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

bool starts_with_nocase(std::string_view text, std::size_t at, std::string_view word) {
  if (text.size() - at < word.size()) return false;
  for (std::size_t i = 0; i < word.size(); ++i)
    if (lower(text[at + i]) != word[i]) return false;
  return true;
}

std::size_t digits(std::string_view text, std::size_t at, bool (*digit)(char)) {
  std::size_t end = at;
  while (end < text.size() && digit(text[end])) ++end;
  return end;
}

std::size_t sign(std::string_view text, std::size_t at) {
  return at < text.size() && (text[at] == '+' || text[at] == '-') ? at + 1 : at;
}

// [pP]/[eE][+-]?\d+ at `at`: the end of the exponent, or `at` where there is none.
std::size_t exponent(std::string_view text, std::size_t at, char letter) {
  if (at >= text.size() || lower(text[at]) != letter) return at;
  const std::size_t i = sign(text, at + 1);
  const std::size_t end = digits(text, i, is_digit);
  return end > i ? end : at;
}

// (?:D+\.?D*|\.D+) at `at`, D the digits `digit` takes: its end, or `at` where none.
std::size_t mantissa(std::string_view text, std::size_t at, bool (*digit)(char)) {
  const std::size_t end = digits(text, at, digit);
  if (end > at) return end < text.size() && text[end] == '.' ? digits(text, end + 1, digit) : end;
  if (at < text.size() && text[at] == '.' && digits(text, at + 1, digit) > at + 1)
    return digits(text, at + 1, digit);
  return at;
}

// [+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)? at `at`: its end, or `at` where none.
std::size_t decimal(std::string_view text, std::size_t at) {
  const std::size_t i = sign(text, at), end = mantissa(text, i, is_digit);
  return end > i ? exponent(text, end, 'e') : at;
}

// [+-]?0[xX](?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:[pP][+-]?\d+)? at `at`.
std::size_t hexadecimal(std::string_view text, std::size_t at) {
  const std::size_t i = sign(text, at);
  if (!(i + 1 < text.size() && text[i] == '0' && lower(text[i + 1]) == 'x')) return at;
  const std::size_t end = mantissa(text, i + 2, is_hex);
  return end > i + 2 ? exponent(text, end, 'p') : at;
}

bool is_word_char(char c) { return is_digit(c) || (lower(c) >= 'a' && lower(c) <= 'z') || c == '_'; }

// [+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?) at `at`, case-insensitively.
std::size_t special(std::string_view text, std::size_t at) {
  std::size_t i = at;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  if (starts_with_nocase(text, i, "inf")) {
    i += 3;
    return starts_with_nocase(text, i, "inity") ? i + 5 : i;
  }
  if (!starts_with_nocase(text, i, "nan")) return at;
  i += 3;
  if (i < text.size() && text[i] == '(') {
    const std::size_t close = digits(text, i + 1, is_word_char);
    if (close < text.size() && text[close] == ')') return close + 1;
  }
  return i;
}

double to_double(std::string_view literal) {
  const std::string copy(literal);
  return std::strtod(copy.c_str(), nullptr);  // C's strtod reads decimal, hex, inf and nan alike
}

std::string shown(std::string_view name, std::string_view text) {
  return std::string(name) + "=" + python_repr(text);
}

std::string format_g(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%g", value);
  return buffer;
}

// Python's float() grammar, underscores between digits included.
std::size_t py_digitpart(std::string_view text, std::size_t at) {
  if (at >= text.size() || !is_digit(text[at])) return at;
  std::size_t i = at + 1;
  while (i < text.size()) {
    if (is_digit(text[i])) ++i;
    else if (text[i] == '_' && i + 1 < text.size() && is_digit(text[i + 1])) i += 2;
    else break;
  }
  return i;
}

bool python_float(std::string_view text, double* value) {
  text = strip(text);
  std::size_t i = 0;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  std::size_t end = py_digitpart(text, i);
  if (end > i) {
    if (end < text.size() && text[end] == '.') end = py_digitpart(text, end + 1);
  } else if (i < text.size() && text[i] == '.' && py_digitpart(text, i + 1) > i + 1) {
    end = py_digitpart(text, i + 1);
  } else {
    const std::size_t word = special(text, 0);  // inf, infinity, nan (no parenthesis in Python)
    if (word != text.size() || text.find('(') != std::string_view::npos || word == 0) return false;
    *value = to_double(text);
    return true;
  }
  if (end < text.size() && lower(text[end]) == 'e') {
    std::size_t j = end + 1;
    if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
    const std::size_t stop = py_digitpart(text, j);
    if (stop == j) return false;
    end = stop;
  }
  if (end != text.size()) return false;
  std::string plain;
  for (char c : text)
    if (c != '_') plain += c;
  *value = to_double(plain);
  return true;
}

[[noreturn]] void refuse(const std::string& text) { throw SettingError(text); }

}  // namespace

std::string python_repr(std::string_view text) {
  const bool single = text.find('\'') != std::string_view::npos;
  const bool dbl = text.find('"') != std::string_view::npos;
  const char quote = single && !dbl ? '"' : '\'';
  std::string out(1, quote);
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const auto byte = static_cast<unsigned char>(c);
    char buffer[16];
    if (byte >= 0x80) {
      // UTF-8 (the Python layer passes lone surrogates through as their 3-byte forms): what
      // Python prints as an escape (C1 controls, no-break space, soft hyphen, surrogates) as one.
      const std::size_t length = byte >= 0xf0 ? 4 : byte >= 0xe0 ? 3 : byte >= 0xc0 ? 2 : 1;
      uint32_t point = length == 1 ? byte : byte & (0x7f >> length);
      for (std::size_t k = 1; k < length && i + k < text.size(); ++k)
        point = (point << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
      if (length == 1 || (point >= 0x80 && point <= 0xa0) || point == 0xad) {
        std::snprintf(buffer, sizeof buffer, "\\x%02x", static_cast<unsigned>(point & 0xff));
        out += buffer;
      } else if (point >= 0xd800 && point <= 0xdfff) {
        std::snprintf(buffer, sizeof buffer, "\\u%04x", static_cast<unsigned>(point));
        out += buffer;
      } else {
        out.append(text.substr(i, length));
      }
      i += length - 1;
    } else if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (byte < 0x20 || byte == 0x7f) {
      std::snprintf(buffer, sizeof buffer, "\\x%02x", byte);
      out += buffer;
    } else {
      out += c;
    }
  }
  out += quote;
  return out;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSeconds: return "seconds";
    case Kind::kSwitch: return "switch";
    case Kind::kInt: return "int";
    case Kind::kPercentage: return "percentage";
    case Kind::kNvshmemSize: return "nvshmem_size";
  }
  return "unknown";
}

// A default or example as the table shows it: "60", not "60.000000".
static std::string number(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
}

const std::vector<Setting>& table() {
  static const std::vector<Setting> rows = {
      {"PYDATACOPY_TIMEOUT_S", Kind::kSeconds, number(kDefaultTimeoutSeconds), 0, 0,
       "the timeout of blocking calls, in seconds", number(kDefaultTimeoutSeconds)},
      {"PYDATACOPY_INIT_TIMEOUT_S", Kind::kSeconds, number(kDefaultInitTimeoutSeconds), 0, 0,
       "the timeout of init(), in seconds", number(kDefaultInitTimeoutSeconds)},
      {"PYDATACOPY_FORCE_RMA", Kind::kSwitch, "0", 0, 1,
       "every transfer takes NVSHMEM's RMA path, a test switch", "1"},
      {"PYDATACOPY_IBGDA", Kind::kSwitch, "0", 0, 1,
       "turn on NVSHMEM's GPU-initiated InfiniBand transport", "1"},
      {"PYDATACOPY_CHECK_RMA", Kind::kSwitch, "0", 0, 1,
       "verify every local address handed to an NVSHMEM RMA call", "1"},
      {"PYDATACOPY_AUTO_REGISTER", Kind::kSwitch, "1", 0, 1,
       "register local buffers with NVSHMEM on first use", "0"},
      {"PYDATACOPY_RANKS_PER_GPU", Kind::kInt, "1", 1, kMaxRanksPerGpu,
       "how many ranks of a node share one GPU: local rank r uses CUDA device r // it", "2"},
      {"PYDATACOPY_ZERO_COPY_MIN_BYTES", Kind::kInt, std::to_string(kDefaultZeroCopyMinBytes), 0, INT64_MAX,
       "the smallest send/recv message that moves zero-copy between load/store peers, 0: off", "1048576"},
      {"PYDATACOPY_COPY_ENGINE_MIN_BYTES", Kind::kInt, std::to_string(kDefaultCopyEngineMinBytes), 0, INT64_MAX,
       "the smallest zero-copy send (a sendrecv or a send alone, not captured) that the copy engine moves when "
       "the device finds its guess of the receiver's address right, 0: off",
       "67108864"},  // (an example value; the default is off)
      {"PYDATACOPY_ZERO_COPY_PROGRESS", Kind::kSwitch, "1", 0, 1,
       "a thread that serves the peers' zero-copy mapping requests between this process's calls, and a "
       "recv's one bounded wait for its buffer's mapping (zero-copy from a receive buffer's second call "
       "whenever the hosts' calls meet; 0: mappings answered only inside calls, as before 2026-12-06)",
       "0"},
      {"PYDATACOPY_LOW_LATENCY_MAX_BYTES", Kind::kInt, std::to_string(kDefaultLowLatencyMaxBytes), 0,
       kLowLatencyCapacityBytes,
       "the largest send/recv message that moves by the low-latency protocol between load/store peers, 0: off",
       "16384"},
      {"PYDATACOPY_PROGRAMMATIC_LAUNCH", Kind::kSwitch, "1", 0, 1,
       "send/recv kernels start while the previous kernel on the stream ends, sm_90+, the default", "0"},
      {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", Kind::kPercentage, "", 0, 0,
       "the share of the GPU's SMs this MPS client may use (init() sums it over the ranks of a GPU)", "50"},
      {"PYDATACOPY_CHUNK_BYTES", Kind::kInt, std::to_string(kDefaultChunkBytes), 1, kMaxChunkBytes,
       "bytes per send/recv staging chunk", std::to_string(kDefaultChunkBytes)},
      {"PYDATACOPY_NUM_CHUNKS", Kind::kInt, std::to_string(kDefaultNumChunks), 2, INT32_MAX,
       "staging chunks per peer", std::to_string(kDefaultNumChunks)},
      {"PYDATACOPY_SEND_BLOCKS", Kind::kInt, std::to_string(kDefaultSendBlocks), 1, kMaxSendBlocks,
       "thread blocks per send or recv", std::to_string(kDefaultSendBlocks)},
      {"PYDATACOPY_NARROW_SEND_BLOCKS", Kind::kInt, std::to_string(kDefaultNarrowSendBlocks), 1, kMaxSendBlocks,
       "thread blocks per send or recv of a message under 64 MiB (at most PYDATACOPY_SEND_BLOCKS)", "32"},
      {"NVSHMEM_SYMMETRIC_SIZE", Kind::kNvshmemSize, "1G", 0, 0,
       "the symmetric heap NVSHMEM reserves per PE", "2G"},
      {"NVSHMEM_MAX_MEMORY_PER_GPU", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2G"},
      {"NVSHMEM_CUMEM_GRANULARITY", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2M"},
      {"NVSHMEM_FCOLLECT_LL_THRESHOLD", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2K"},
      {"NVSHMEM_FCOLLECT_LL128_THRESHOLD", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2K"},
      {"NVSHMEM_FCOLLECT_NVLS_THRESHOLD", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2K"},
      {"NVSHMEM_REDUCESCATTER_NVLS_THRESHOLD", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "2K"},
      {"NVSHMEM_REDUCE_SCRATCH_SIZE", Kind::kNvshmemSize, "", 0, 0, "NVSHMEM's size variable", "512K"},
  };
  return rows;
}

const Setting& find(std::string_view name) {
  for (const Setting& row : table())
    if (name == row.name) return row;
  PDC_REQUIRE(false, "no setting named " << std::string(name) << " in pydatacopy's settings table");
  throw Error("unreachable");
}

std::optional<double> read_number(std::string_view text) {
  std::size_t at = 0;
  while (at < text.size() && is_space(text[at])) ++at;
  const bool whole = at < text.size() && (decimal(text, at) == text.size() || hexadecimal(text, at) == text.size());
  if (!whole) return std::nullopt;
  return to_double(text.substr(at));
}

double parse_seconds(std::string_view text, std::string_view name, double fallback) {
  const std::optional<double> seconds = read_number(text);
  if (seconds && *seconds > 0 && *seconds <= kMaxTimeoutSeconds) return *seconds;
  char most[32];
  std::snprintf(most, sizeof most, "%.0e", kMaxTimeoutSeconds);
  refuse(shown(name, text) + " is not a positive number of seconds (at most " + most + "): set it to e.g. " +
         format_g(fallback) + ", or unset it for the default " + format_g(fallback));
}

bool parse_switch(std::string_view text, std::string_view name, std::string_view meaning) {
  if (text.empty() || text == "0") return false;
  if (text == "1") return true;
  refuse(shown(name, text) + " must be 1 (" + std::string(meaning) + ") or 0 (or unset)");
}

int64_t parse_int(std::string_view text, std::string_view name, int64_t minimum, int64_t maximum,
                  std::string_view example, std::string_view meaning) {
  std::string_view stripped = strip(text);
  if (!stripped.empty() && stripped.front() == '+') stripped.remove_prefix(1);
  if (stripped.empty() || digits(stripped, 0, is_digit) != stripped.size())
    refuse(shown(name, text) + " is not a whole number (" + std::string(meaning) + "): set it to e.g. " +
           std::string(example) + ", or unset it");
  while (stripped.size() > 1 && stripped.front() == '0') stripped.remove_prefix(1);
  const bool fits = stripped.size() <= 18 ||
                    (stripped.size() == 19 && stripped <= std::string_view("9223372036854775807"));
  const int64_t value = fits ? std::strtoll(std::string(stripped).c_str(), nullptr, 10) : 0;
  if (!fits || value < minimum || value > maximum) {
    std::ostringstream out;
    out << name << "=" << stripped << " is out of range: " << meaning << " must be in [" << minimum << ", "
        << maximum << "]; set it to e.g. " << example << ", or unset it";
    refuse(out.str());
  }
  return value;
}

double parse_percentage(std::string_view text, std::string_view name) {
  double value = NAN;
  if (!python_float(text, &value)) value = NAN;
  if (!(value > 0 && value <= 100))
    refuse(shown(name, text) + " is not a percentage in (0, 100]: the share of the GPU's SMs this MPS "
           "client may use; with K ranks on one GPU set it to 100/K or less (e.g. 50 for two), or unset it");
  return value;
}

uint64_t parse_nvshmem_size(std::string_view text, std::string_view name, bool allow_zero) {
  const std::string here = shown(name, text);
  std::size_t at = 0;
  while (at < text.size() && is_space(text[at])) ++at;
  std::size_t end = hexadecimal(text, at);
  if (end == at) end = decimal(text, at);
  if (end == at) end = special(text, at);
  if (end == at) refuse(here + " is not a size: write " + kSizeHowto);
  const double value = to_double(text.substr(at, end - at));
  const std::string_view rest = text.substr(end);
  int scale = 0;
  if (!rest.empty()) {
    const char letter = lower(rest.front());
    const std::string_view trailer = rest.substr(1);
    const char* scales = "kmgt";
    const char* found = letter == '\0' ? nullptr : std::strchr(scales, letter);
    if (found == nullptr) {
      bool blanks = true;
      for (char c : rest) blanks = blanks && is_space(c);
      refuse(here + " has " + (blanks ? std::string("blanks") : python_repr(rest)) +
             " after the number, which NVSHMEM cannot read (it would end the process): write " + kSizeHowto);
    }
    std::string tail(strip(trailer));
    for (char& c : tail) c = lower(c);
    if (!(tail.empty() || tail == "b" || tail == "ib")) {
      const std::string meant(strip(text.substr(0, end + 1)));
      refuse(here + " means " + meant + " to NVSHMEM, which reads only the first letter after the number and "
             "ignores " + python_repr(trailer) + ": write " + kSizeHowto);
    }
    scale = 10 * static_cast<int>(found - scales + 1);
  }
  if (std::isnan(value) || std::isinf(value)) refuse(here + " is not a finite size: write " + kSizeHowto);
  if (value < 0) refuse(here + " is negative: write " + kSizeHowto);
  const double nbytes = std::ceil(value * std::ldexp(1.0, scale));
  if (nbytes >= 18446744073709551616.0) refuse(here + " is more than 2^64 - 1 bytes: write " + kSizeHowto);
  if (nbytes == 0 && !allow_zero)
    refuse(here + " leaves no room: pydatacopy.init() takes its send/recv staging from this heap; write " +
           kSizeHowto + ", or unset it for NVSHMEM's 1G");
  return static_cast<uint64_t>(nbytes);
}

Value parse(std::string_view name, std::string_view text) {
  const Setting& row = find(name);
  Value v;
  v.kind = row.kind;
  switch (row.kind) {
    case Kind::kSeconds:
      v.number = parse_seconds(text, row.name, to_double(row.default_text));
      break;
    case Kind::kSwitch:
      v.on = parse_switch(text, row.name, row.meaning);
      break;
    case Kind::kInt:
      v.integer = parse_int(text, row.name, row.minimum, row.maximum, row.example, row.meaning);
      break;
    case Kind::kPercentage:
      v.number = parse_percentage(text, row.name);
      break;
    case Kind::kNvshmemSize:
      v.bytes = parse_nvshmem_size(text, row.name, std::strcmp(row.name, "NVSHMEM_SYMMETRIC_SIZE") != 0);
      break;
  }
  return v;
}

std::optional<std::string> read(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return std::nullopt;
  return std::string(text);
}

Value value(const char* name) {
  const Setting& row = find(name);
  const std::optional<std::string> text = read(name);
  if (text) return parse(name, *text);
  if (row.default_text.empty()) {
    Value unset;
    unset.kind = row.kind;
    return unset;
  }
  return parse(name, row.default_text);
}

}  // namespace pydatacopy::settings
