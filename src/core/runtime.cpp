#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "device_status.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/runtime.hpp"

namespace pydatacopy {
namespace {

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes,
              "nvshmemx_uniqueid_t changed size: update kUniqueIdBytes");

struct RuntimeState {
  std::mutex mutex;
  bool initialized = false;
  bool owns_nvshmem = false;  // false when NVSHMEM was started by someone else in this process
  int device = -1;
  int my_pe = -1;
  int n_pes = 0;
  std::vector<uint8_t> unique_id;
  detail::DeviceStatus* status_host = nullptr;
  detail::DeviceStatus* status_device = nullptr;
};

RuntimeState& state() {
  static RuntimeState s;
  return s;
}

void check_init_args(const std::vector<uint8_t>& id, int rank, int world_size, int device) {
  PDC_REQUIRE(id.size() == kUniqueIdBytes,
              "root_unique_id must be the " << kUniqueIdBytes << " bytes from get_unique_id(), got "
                                            << id.size() << " bytes");
  bool all_zero = true;
  for (uint8_t b : id) all_zero = all_zero && b == 0;
  PDC_REQUIRE(!all_zero, "root_unique_id is all zeros: pass the ID that get_unique_id() made on rank 0");
  PDC_REQUIRE(world_size >= 1, "world_size must be at least 1, got " << world_size);
  PDC_REQUIRE(rank >= 0 && rank < world_size,
              "rank must be in [0, world_size=" << world_size << "), got " << rank);
  int device_count = 0;
  PDC_CHECK_CUDA(cudaGetDeviceCount(&device_count));
  PDC_REQUIRE(device_count > 0, "no CUDA device is visible to this process");
  PDC_REQUIRE(device < device_count,
              "CUDA device " << device << " does not exist: this process sees " << device_count
                             << " device(s); check LOCAL_RANK and CUDA_VISIBLE_DEVICES");
}

}  // namespace

namespace detail {

DeviceStatus* device_status() { return state().status_device; }

const char* wait_op_name(WaitOp op) {
  switch (op) {
    case WaitOp::kTokenCredit: return "token exchange (waiting for the peer to release its receive buffers)";
    case WaitOp::kTokenArrival: return "token exchange (waiting for the peer's tokens)";
    case WaitOp::kSignal: return "signal_wait";
    case WaitOp::kChunkCredit: return "send (waiting for the receiver to free a staging chunk)";
    case WaitOp::kChunkArrival: return "recv (waiting for the sender's next chunk)";
    case WaitOp::kBlockIndex: return "put_blocks";
    default: return "wait";
  }
}

}  // namespace detail

std::string Version::str() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Version built_nvshmem_version() {
  return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

Version loaded_nvshmem_version() {
  Version v;
  nvshmemx_vendor_get_version_info(&v.major, &v.minor, &v.patch);
  return v;
}

void check_nvshmem_version() { check_nvshmem_versions(built_nvshmem_version(), loaded_nvshmem_version()); }

void check_nvshmem_versions(const Version& built, const Version& loaded) {
  PDC_REQUIRE(built.major == loaded.major && built.minor == loaded.minor,
              "pydatacopy was built against NVSHMEM " << built.str() << " but NVSHMEM "
                  << loaded.str() << " is loaded in this process; reinstall pydatacopy against "
                  "the nvidia-nvshmem-cu13 that torch uses (pip install --force-reinstall "
                  "--no-build-isolation pydatacopy)");
}

std::vector<uint8_t> get_unique_id() {
  nvshmemx_uniqueid_t id;
  std::memset(&id, 0, sizeof(id));
  PDC_CHECK_NVSHMEM(nvshmemx_get_uniqueid(&id));
  std::vector<uint8_t> bytes(kUniqueIdBytes);
  std::memcpy(bytes.data(), &id, kUniqueIdBytes);
  return bytes;
}

int init_nvshmem(const std::vector<uint8_t>& root_unique_id, int rank, int world_size, int device) {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) {
    PDC_REQUIRE(root_unique_id == s.unique_id,
                "pydatacopy is already initialised with another unique ID; call finalize() on "
                "every rank before joining a new job");
    PDC_REQUIRE(rank == s.my_pe && world_size == s.n_pes,
                "pydatacopy is already initialised as rank " << s.my_pe << " of " << s.n_pes
                    << ", not rank " << rank << " of " << world_size);
    return s.my_pe;
  }
  check_init_args(root_unique_id, rank, world_size, device);
  check_nvshmem_version();
  if (device >= 0) PDC_CHECK_CUDA(cudaSetDevice(device));
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  PDC_CHECK_CUDA(cudaFree(nullptr));  // create the primary context NVSHMEM will use

  bool owns = false;
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    // Another component (torch's symmetric memory, say) started NVSHMEM: one process has one.
    PDC_REQUIRE(nvshmem_my_pe() == rank && nvshmem_n_pes() == world_size,
                "NVSHMEM is already running in this process as PE " << nvshmem_my_pe() << " of "
                    << nvshmem_n_pes() << ", which does not match rank " << rank << " of "
                    << world_size);
  } else {
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, root_unique_id.data(), kUniqueIdBytes);
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    PDC_CHECK_NVSHMEM(nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr));
    // nvshmemx_init_attr() is an inline wrapper that exit()s on failure; call what it wraps so
    // that a failure becomes an exception.
    nvshmemx_init_init_attr_ver_only(attr);
    int provided = 0;
    nvshmemi_version_t app_version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
    PDC_CHECK_NVSHMEM(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                           NVSHMEMX_INIT_WITH_UNIQUEID, &attr, app_version));
    owns = true;
    PDC_REQUIRE(nvshmem_my_pe() == rank,
                "NVSHMEM made this process PE " << nvshmem_my_pe() << " instead of rank " << rank
                    << ": every rank must pass its own torch.distributed rank");
  }

  if (s.status_host == nullptr) {
    void* host = nullptr;
    PDC_CHECK_CUDA(cudaHostAlloc(&host, sizeof(detail::DeviceStatus), cudaHostAllocMapped));
    std::memset(host, 0, sizeof(detail::DeviceStatus));
    void* dev = nullptr;
    PDC_CHECK_CUDA(cudaHostGetDevicePointer(&dev, host, 0));
    s.status_host = static_cast<detail::DeviceStatus*>(host);
    s.status_device = static_cast<detail::DeviceStatus*>(dev);
  }
  s.initialized = true;
  s.owns_nvshmem = owns;
  s.device = device;
  s.my_pe = rank;
  s.n_pes = world_size;
  s.unique_id = root_unique_id;
  return rank;
}

void finalize() {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.initialized) return;
  s.initialized = false;
  // After a peer timed out, NVSHMEM's collective finalize would wait on the dead peer forever:
  // leave NVSHMEM as it is and let process exit reclaim it.
  if (s.owns_nvshmem && !peer_failed()) nvshmem_finalize();
  s.owns_nvshmem = false;
  s.unique_id.clear();
  s.my_pe = -1;
  s.n_pes = 0;
}

bool is_initialized() { return state().initialized; }

bool peer_failed() {
  const volatile detail::DeviceStatus* status = state().status_host;
  return status != nullptr && status->code == 1;
}

void require_initialized(const char* what) {
  PDC_REQUIRE(state().initialized, what << " needs NVSHMEM: call pydatacopy.init() (or "
                                           "init_nvshmem(id, rank, world_size)) first");
}

void require_valid_pe(int pe, const char* what) {
  require_initialized(what);
  PDC_REQUIRE(pe >= 0 && pe < state().n_pes,
              what << ": PE " << pe << " is out of range [0, " << state().n_pes << ")");
}

int my_pe() {
  require_initialized("my_pe()");
  return state().my_pe;
}

int n_pes() {
  require_initialized("n_pes()");
  return state().n_pes;
}

int cuda_device() {
  require_initialized("cuda_device()");
  return state().device;
}

double default_timeout_seconds() {
  if (const char* text = std::getenv("PYDATACOPY_TIMEOUT_S")) {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    PDC_REQUIRE(end != text && *end == '\0' && seconds > 0,
                "PYDATACOPY_TIMEOUT_S must be a positive number of seconds, got '" << text << "'");
    return seconds;
  }
  return 60.0;
}

uint64_t timeout_nanoseconds(double seconds) {
  PDC_REQUIRE(seconds > 0 && std::isfinite(seconds),
              "timeout must be a positive number of seconds, got " << seconds);
  return static_cast<uint64_t>(seconds * 1e9);
}

void check_device_errors() {
  const detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  const volatile detail::DeviceStatus* live = status;
  if (live->code == 0) return;
  if (live->code == 2) {
    // Bad input found on the device: NVSHMEM is fine, so report it once and carry on.
    std::ostringstream bad;
    bad << "put_blocks on PE " << live->pe << ": block index " << static_cast<int64_t>(live->expected)
        << " is out of range [0, " << live->seen << "); that block was skipped. Check the index "
           "tensors";
    state().status_host->code = 0;
    throw Error(bad.str());
  }
  std::ostringstream text;
  text << "PE " << live->pe << " timed out in "
       << detail::wait_op_name(static_cast<detail::WaitOp>(live->op)) << " on PE " << live->peer
       << " (expected signal >= " << live->expected << ", saw " << live->seen
       << "). The peer may have died, hung, or not made the matching call. NVSHMEM state is no "
          "longer usable in this process: exit it (finalize() will not wait on the peer).";
  throw TimeoutError(text.str());
}

}  // namespace pydatacopy
