// The settings table's parsers (settings.hpp): good and bad values of each kind, and the texts the
// Python layer shows (tests/test_settings.py checks the same texts through _C).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "check.hpp"
#include "pydatacopy/settings.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;
namespace s = pydatacopy::settings;

// The call must throw SettingError (not only Error) whose text is exactly `text`.
template <typename Call>
void check_text(Call call, const std::string& text, const char* what) {
  try {
    call();
  } catch (const s::SettingError& e) {
    const bool ok = e.what() == text;
    if (!ok) std::printf("  message was: %s\n  expected:    %s\n", e.what(), text.c_str());
    return check(ok, what);
  } catch (...) {
  }
  check(false, what);
}

const std::string kHowto = "a byte count with an optional k, M, G or T suffix, e.g. 2G, 1536M or 1073741824";

}  // namespace

int main() {
  // Seconds.
  check(s::parse_seconds("2.5", "T", 60) == 2.5, "seconds: decimal");
  check(s::parse_seconds(" 0x10", "T", 60) == 16, "seconds: hexadecimal after blanks");
  check(s::parse_seconds("1e9", "T", 60) == 1e9, "seconds: the most");
  for (const char* bad : {"soon", "", "0", "-1", "1e10", "inf", "nan", "5 ", "1s"})
    check_throws([&] { s::parse_seconds(bad, "T", 60); }, "is not a positive number of seconds", bad);
  check_text([] { s::parse_seconds("soon", "PYDATACOPY_TIMEOUT_S", 60); },
             "PYDATACOPY_TIMEOUT_S='soon' is not a positive number of seconds (at most 1e+09): set it to "
             "e.g. 60, or unset it for the default 60", "seconds: the text");

  // Switches.
  check(!s::parse_switch("", "S", "m") && !s::parse_switch("0", "S", "m") && s::parse_switch("1", "S", "m"),
        "switch: '', 0, 1");
  for (const char* bad : {"true", " 0", "2", "on"})
    check_throws([&] { s::parse_switch(bad, "S", "m"); }, "must be 1", bad);
  check_text([] { s::parse_switch("yes", "PYDATACOPY_FORCE_RMA", "a test switch"); },
             "PYDATACOPY_FORCE_RMA='yes' must be 1 (a test switch) or 0 (or unset)", "switch: the text");

  // Whole numbers.
  check(s::parse_int(" +007 ", "N", 1, 10, "2", "m") == 7, "int: blanks, plus and zeros");
  check(s::parse_int("9223372036854775807", "N", 0, INT64_MAX, "2", "m") == INT64_MAX, "int: int64 max");
  check_text([] { s::parse_int("two", "N", 1, 64, "2", "ranks"); },
             "N='two' is not a whole number (ranks): set it to e.g. 2, or unset it", "int: not a number");
  check_text([] { s::parse_int("-1", "N", 1, 64, "2", "ranks"); },
             "N='-1' is not a whole number (ranks): set it to e.g. 2, or unset it", "int: negative");
  check_text([] { s::parse_int("+065", "N", 1, 64, "2", "ranks"); },
             "N=65 is out of range: ranks must be in [1, 64]; set it to e.g. 2, or unset it", "int: too big");
  check_text([] { s::parse_int("99999999999999999999999", "N", 0, INT64_MAX, "1", "m"); },
             "N=99999999999999999999999 is out of range: m must be in [0, 9223372036854775807]; set it to "
             "e.g. 1, or unset it", "int: past int64");
  check_throws([] { s::parse_int("", "N", 0, 1, "1", "m"); }, "is not a whole number", "int: empty");

  // Percentages.
  check(s::parse_percentage(" 50 ", "P") == 50 && s::parse_percentage("1_0", "P") == 10 &&
        s::parse_percentage("100", "P") == 100 && s::parse_percentage(".5e1", "P") == 5, "percentage: good");
  for (const char* bad : {"0", "101", "half", "inf", "nan", "", "1__0", "_1", "50%"})
    check_throws([&] { s::parse_percentage(bad, "P"); }, "is not a percentage in (0, 100]", bad);
  check_text([] { s::parse_percentage("x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"); },
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='x' is not a percentage in (0, 100]: the share of the GPU's "
             "SMs this MPS client may use; with K ranks on one GPU set it to 100/K or less (e.g. 50 for two), "
             "or unset it", "percentage: the text");

  // NVSHMEM sizes.
  const char* n = "NVSHMEM_SYMMETRIC_SIZE";
  check(s::parse_nvshmem_size("2G", n) == (uint64_t{2} << 30), "size: 2G");
  check(s::parse_nvshmem_size("1536m", n) == (uint64_t{1536} << 20), "size: 1536m");
  check(s::parse_nvshmem_size("2GiB", n) == (uint64_t{2} << 30) && s::parse_nvshmem_size("2gb ", n) == (uint64_t{2} << 30),
        "size: GiB, gb");
  check(s::parse_nvshmem_size("0.5k", n) == 512 && s::parse_nvshmem_size("1.0000001", n) == 2, "size: rounded up");
  check(s::parse_nvshmem_size("0x10", n) == 16 && s::parse_nvshmem_size("1e3", n) == 1000, "size: hex, exponent");
  check(s::parse_nvshmem_size("0", "NVSHMEM_CUMEM_GRANULARITY", true) == 0, "size: 0 allowed");
  check_text([] { s::parse_nvshmem_size("lots", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='lots' is not a size: write " + kHowto, "size: no number");
  check_text([] { s::parse_nvshmem_size("1024 ", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='1024 ' has blanks after the number, which NVSHMEM cannot read (it would "
             "end the process): write " + kHowto, "size: blanks");
  check_text([] { s::parse_nvshmem_size("1024B", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='1024B' has 'B' after the number, which NVSHMEM cannot read (it would end "
             "the process): write " + kHowto, "size: 1024B");
  check_text([] { s::parse_nvshmem_size("20kk", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='20kk' means 20k to NVSHMEM, which reads only the first letter after the "
             "number and ignores 'k': write " + kHowto, "size: 20kk");
  check_text([] { s::parse_nvshmem_size("-1G", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='-1G' is negative: write " + kHowto, "size: negative");
  check_text([] { s::parse_nvshmem_size("nan", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='nan' is not a finite size: write " + kHowto, "size: nan");
  check_text([] { s::parse_nvshmem_size("16777216T", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='16777216T' is more than 2^64 - 1 bytes: write " + kHowto, "size: 2^64");
  check_text([] { s::parse_nvshmem_size("0", "NVSHMEM_SYMMETRIC_SIZE"); },
             "NVSHMEM_SYMMETRIC_SIZE='0' leaves no room: pydatacopy.init() takes its send/recv staging from "
             "this heap; write " + kHowto + ", or unset it for NVSHMEM's 1G", "size: zero heap");
  for (const char* bad : {"", "1 G", "inf", "1Gx", "0x"})
    check_throws([&] { s::parse_nvshmem_size(bad, "S"); }, "S=", bad);

  // Python's repr of the value.
  check(s::python_repr("it's") == "\"it's\"" && s::python_repr("a\tb\\") == "'a\\tb\\\\'" &&
        s::python_repr("\x01'\"") == "'\\x01\\'\"'", "repr: quotes and escapes");
  check(s::python_repr("\xc2\xa0\xc3\xa9\xed\xb3\xbf") == "'\\xa0\xc3\xa9\\udcff'", "repr: no-break space, e acute, a surrogate");

  // The table: every default parses, by its own row, and the environment is read through it.
  for (const s::Setting& row : s::table())
    if (!row.default_text.empty()) s::parse(row.name, row.default_text);
  check(s::find("PYDATACOPY_CHUNK_BYTES").maximum == s::kMaxChunkBytes, "table: chunk bytes' range");
  check(s::parse("PYDATACOPY_SEND_BLOCKS", "1024").integer == s::kMaxSendBlocks, "table: send blocks");
  check_throws([] { s::parse("PYDATACOPY_SEND_BLOCKS", "1025"); }, "must be in [1, 1024]", "table: 1025 blocks");
  check_throws([] { s::find("NO_SUCH_VARIABLE"); }, "no setting named", "table: unknown name");
  unsetenv("PYDATACOPY_NUM_CHUNKS");
  check(s::value("PYDATACOPY_NUM_CHUNKS").integer == s::kDefaultNumChunks, "value: the default");
  setenv("PYDATACOPY_NUM_CHUNKS", "8", 1);
  check(s::value("PYDATACOPY_NUM_CHUNKS").integer == 8 && *s::read("PYDATACOPY_NUM_CHUNKS") == "8", "value: set");
  setenv("PYDATACOPY_NUM_CHUNKS", "1", 1);
  check_throws([] { s::value("PYDATACOPY_NUM_CHUNKS"); }, "must be in [2, 2147483647]", "value: out of range");
  unsetenv("PYDATACOPY_NUM_CHUNKS");
  unsetenv("NVSHMEM_SYMMETRIC_SIZE");
  check(s::value("NVSHMEM_SYMMETRIC_SIZE").bytes == s::kNvshmemDefaultSymmetricSize, "value: 1G heap");
  check(s::value("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").number == 0 || std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "value: unset percentage is 0");

  std::printf("%d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed == 0 ? 0 : 1;
}
