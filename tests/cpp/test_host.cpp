// Host-side tests of the C++ core, without a GPU: every check below must throw
// pydatacopy::Error (never crash, never exit) or return the documented value.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "pydatacopy/double_buffer_manager.hpp"
#include "check.hpp"
#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/send_recv.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"
#include "pydatacopy/transfer.hpp"
#include "rma/transfer_internal.hpp"

namespace {

using pydatacopy_test::check;
using pydatacopy_test::check_throws;

}  // namespace

int main() {
  using namespace pydatacopy;
  const std::vector<uint8_t> id = get_unique_id();
  check(id.size() == kUniqueIdBytes, "unique ID is 128 bytes");
  check(get_unique_id() != id, "two unique IDs differ");
  check(built_nvshmem_version().str() == loaded_nvshmem_version().str(), "built == loaded NVSHMEM");
  check(!is_initialized(), "not initialised at start");
  check_nvshmem_versions({3, 4, 5}, {3, 4, 2});  // a patch difference is compatible
  check_throws([] { check_nvshmem_versions({3, 4, 5}, {3, 3, 0}); },
               "built against NVSHMEM 3.4.5 but NVSHMEM 3.3.0 is loaded", "version mismatch names both");

  check_throws([&] { init_nvshmem(std::vector<uint8_t>(127, 1), 0, 1); }, "128 bytes", "short ID");
  check_throws([&] { init_nvshmem(std::vector<uint8_t>(128, 0), 0, 1); }, "all zeros", "zero ID");
  check_throws([&] { init_nvshmem(id, 0, 0); }, "world_size must be at least 1", "world size 0");
  check_throws([&] { init_nvshmem(id, 2, 2); }, "rank must be in", "rank = world size");
  check_throws([&] { init_nvshmem(id, -1, 2); }, "rank must be in", "negative rank");
  check_throws([&] { init_nvshmem(id, 0, 1); }, "NVIDIA GPU", "no GPU: a clear error");
  check(!is_initialized(), "still not initialised after failed inits");

  check_throws([] { my_pe(); }, "call pydatacopy.init", "my_pe before init");
  check_throws([] { n_pes(); }, "call pydatacopy.init", "n_pes before init");
  check_throws([] { symmetric_malloc(64); }, "call pydatacopy.init", "malloc before init");
  check_throws([] { peer_pointer(nullptr, 0); }, "call pydatacopy.init", "peer_pointer before init");
  check_throws([] { put(nullptr, nullptr, 8, 0, nullptr); }, "call pydatacopy.init", "put before init");
  check_throws([] { get(nullptr, nullptr, 8, 0, nullptr); }, "call pydatacopy.init", "get before init");
  check_throws([] { quiet(nullptr); }, "call pydatacopy.init", "quiet before init");
  check_throws([] { barrier(nullptr, 1.0); }, "call pydatacopy.init", "barrier before init");
  check_throws([] { barrier_all_blocking("test", 1.0); }, "call pydatacopy.init", "blocking barrier before init");
  check_throws([&] { init_nvshmem(id, 0, 1, -1, 0.0); }, "positive number of seconds", "init timeout 0");
  check_throws([] { SendRecvEngine().init(1 << 20, 4, 8); }, "call pydatacopy.init", "engine before init");
  check_throws([] { SendRecvEngine().send(nullptr, 8, 0, nullptr, 1.0); }, "call pydatacopy.init", "send before init");
  check_throws([] { DoubleBufferManager().init(4, 16); }, "call pydatacopy.init", "DBM before init");
  check_throws([] { DoubleBufferManager().exchange(0, 0, nullptr, 1.0); }, "call pydatacopy.init", "exchange before init");
  DoubleBufferManager().cleanup();  // harmless when never initialised
  finalize();                       // harmless when not initialised
  finalize();
  check(!is_symmetric(&pydatacopy_test::passed, sizeof(int)), "host memory is not symmetric");

  check(DoubleBufferManager::default_dst_pe(0, 2) == 1 && DoubleBufferManager::default_src_pe(1, 2) == 0,
        "two PEs pair up");
  check(DoubleBufferManager::default_dst_pe(2, 3) == 0 && DoubleBufferManager::default_src_pe(0, 3) == 2,
        "three PEs form a ring");
  check(std::string(path_name(resolve_path(Path::kAuto, true, 4096))) == "copy_engine", "auto: copy engine");
  check(std::string(path_name(resolve_path(Path::kAuto, false, 4096))) == "rma", "unreachable: rma");
  check_throws([] { resolve_path(Path::kSM, false, 4096); }, "directly reachable", "sm to unreachable");

  setenv("PYDATACOPY_TIMEOUT_S", "2.5", 1);
  check(default_timeout_seconds() == 2.5, "timeout from the environment");
  setenv("PYDATACOPY_TIMEOUT_S", "-1", 1);
  check_throws([] { default_timeout_seconds(); }, "PYDATACOPY_TIMEOUT_S", "negative timeout");
  unsetenv("PYDATACOPY_TIMEOUT_S");
  check(default_timeout_seconds() == 60.0, "default timeout");
  check_device_errors();  // nothing reported

  std::printf("%d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed == 0 ? 0 : 1;
}
