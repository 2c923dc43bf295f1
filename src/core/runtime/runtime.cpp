#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "common/device_status.cuh"
#include "kernels/api.cuh"
#include "pydatacopy/error.hpp"
#include "pydatacopy/registration.hpp"
#include "registration/registration_internal.hpp"
#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "pydatacopy/settings.hpp"
#include "pydatacopy/symmetric.hpp"
#include "rma/symmetric_internal.hpp"

namespace pydatacopy {
namespace {

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes,
              "nvshmemx_uniqueid_t changed size: update kUniqueIdBytes");

struct RuntimeState {
  std::mutex mutex;
  bool initialized = false;
  bool owns_nvshmem = false;  // false when NVSHMEM was started by someone else in this process
  bool init_abandoned = false;  // an init timed out: its thread may still sit in NVSHMEM's bootstrap
  bool nvshmem_finalized = false;  // we ended NVSHMEM: it cannot start again in this process
  // Our device-side NVSHMEM state is known to the running NVSHMEM. Joining one started by someone
  // else registers it once per process: each registration adds to NVSHMEM's init count, which we
  // do not own and so never take back.
  bool device_state_registered = false;
  int device = -1;
  int my_pe = -1;
  int n_pes = 0;
  std::vector<uint8_t> unique_id;
  std::vector<uint64_t> gpu_of_pe;  // gpu_identity() of every PE, gathered at init
  detail::DeviceStatus* status_host = nullptr;
  // check_errors() reports each timed-out PE once; the PE stays marked (per-peer refusals,
  // collectives). Indexed by tracked_pe_index; guarded by reported_mutex.
  std::vector<char> timeout_reported;
  std::mutex reported_mutex;
  detail::DeviceStatus* status_device = nullptr;
  // Symmetric [4][n_pes]: arrivals of stream-ordered barriers, arrivals of host-blocking
  // barriers, and two arrays of the values PEs vote with in a blocking barrier (by the parity
  // of its count: a PE that runs ahead into the next blocking barrier writes the other array,
  // not the one a slower PE may still read). The two kinds of barrier count apart, so that one
  // can never satisfy the other.
  uint64_t* barrier_signals = nullptr;
  uint64_t blocking_barriers = 0;  // entered by this PE (host-blocking ones run one at a time)
  // Device [2]: how many stream-ordered / blocking barriers this PE has entered. Kernels take
  // their epoch from it with an atomic, so replays of a CUDA graph each get a fresh one.
  uint64_t* barrier_epochs = nullptr;
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

// Starts NVSHMEM, or joins the one already running (`init`: unless our device state is already
// registered with it), and allocates the barrier's signals: both wait on every other
// rank, and NVSHMEM's bootstrap has no deadline of its own. So the work runs on a helper thread
// and this one waits at most `timeout_seconds`. On a timeout the helper is left behind (it cannot
// be cancelled inside NVSHMEM), `abandoned` is set and TimeoutError raised.
uint64_t* start_nvshmem_bounded(const std::vector<uint8_t>& root_unique_id, int rank,
                                int world_size, int device, bool init, double timeout_seconds,
                                bool& abandoned) {
  struct Task {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::string error;
    uint64_t* barrier_signals = nullptr;
  };
  auto task = std::make_shared<Task>();
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, root_unique_id.data(), kUniqueIdBytes);
  std::thread helper([task, id, rank, world_size, device, init]() mutable {
    std::string error;
    uint64_t* signals = nullptr;
    try {
      PDC_CHECK_CUDA(cudaSetDevice(device));
      if (init) {
        // Also when someone else (torch's symmetric memory) started NVSHMEM: the call then joins
        // the running NVSHMEM without a new bootstrap and, what matters, hands this module's own
        // device-side NVSHMEM state to the host library. Skipped, our kernels would run on a
        // zeroed state (cudaErrorIllegalAddress at the first barrier, seen on the GPU machine).
        nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
        PDC_CHECK_NVSHMEM(nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr));
        // nvshmemx_init_attr() is an inline wrapper that exit()s on failure; call what it wraps
        // so that a failure becomes an exception.
        nvshmemx_init_init_attr_ver_only(attr);
        int provided = 0;
        nvshmemi_version_t app_version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                          NVSHMEM_VENDOR_PATCH_VERSION};
        PDC_CHECK_NVSHMEM(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                               NVSHMEMX_INIT_WITH_UNIQUEID, &attr, app_version));
        PDC_REQUIRE(nvshmem_my_pe() == rank,
                    "NVSHMEM made this process PE " << nvshmem_my_pe() << " instead of rank " << rank
                        << ": every rank must pass its own torch.distributed rank");
      }
      const std::size_t bytes = barrier_symmetric_bytes(world_size);
      signals = static_cast<uint64_t*>(nvshmem_malloc(bytes));
      PDC_REQUIRE(signals != nullptr, "the NVSHMEM symmetric heap has no room for the barrier's "
                                      << bytes << " bytes: raise NVSHMEM_SYMMETRIC_SIZE");
      PDC_CHECK_CUDA(cudaMemset(signals, 0, bytes));
      PDC_CHECK_CUDA(cudaDeviceSynchronize());
      nvshmem_barrier_all();  // no PE signals into a peer's array before the peer zeroed it
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(task->mutex);
    task->done = true;
    task->error = error;
    task->barrier_signals = signals;
    task->done_cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(task->mutex);
  const auto limit = std::chrono::duration<double>(timeout_seconds);
  if (!task->done_cv.wait_for(lock, limit, [&] { return task->done; })) {
    lock.unlock();
    helper.detach();
    abandoned = true;
    std::ostringstream text;
    text << "init_nvshmem: rank " << rank << " of " << world_size << " waited " << timeout_seconds
         << " s and not every rank joined NVSHMEM's bootstrap (a rank crashed, was not started, "
            "got another unique ID, or cannot reach rank 0's address: check "
            "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME). NVSHMEM cannot be started again in this process: "
            "exit it. Raise the limit with timeout= or PYDATACOPY_INIT_TIMEOUT_S.";
    throw TimeoutError(text.str());
  }
  lock.unlock();
  helper.join();
  if (!task->error.empty()) throw Error(task->error);
  return task->barrier_signals;
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
    case WaitOp::kBarrier: return "barrier (waiting for the PE to arrive)";
    case WaitOp::kChannelRefused: return "send/recv (a channel refused since a size mismatch)";
    case WaitOp::kRendezvous: return "send (waiting for the receiver's zero-copy rendezvous descriptor)";
    case WaitOp::kZeroCopyDone: return "recv (waiting for the sender's zero-copy writes)";
    case WaitOp::kZeroCopyMapping: return "send (a zero-copy mapping of the receiver's buffer was gone)";
    case WaitOp::kAllToAllCredit: return "all_to_all (waiting for the receiver to free its region)";
    case WaitOp::kAllToAllArrival: return "all_to_all (waiting for the source's count and rows)";
    case WaitOp::kAllToAllCapacity:
    case WaitOp::kAllToAllCapacityFrom:
    case WaitOp::kAllToAllCount:
    case WaitOp::kAllToAllIndex:
    case WaitOp::kAllToAllLayout:
    case WaitOp::kAllToAllRefusedBy:
    case WaitOp::kAllToAllTag: return "all_to_all";
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

int init_nvshmem(const std::vector<uint8_t>& root_unique_id, int rank, int world_size, int device,
                 double timeout_seconds) {
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
  PDC_REQUIRE(!s.init_abandoned,
              "an earlier init_nvshmem in this process timed out and NVSHMEM may still be waiting "
              "in its bootstrap: NVSHMEM cannot be started again here; exit this process and "
              "start a new job");
  PDC_REQUIRE(!s.nvshmem_finalized,
              "finalize() ended NVSHMEM in this process, and NVSHMEM cannot be started twice in "
              "one process: keep pydatacopy initialised for the process's lifetime, or start a "
              "new process for the new job");
  timeout_nanoseconds(timeout_seconds);  // validates it
  check_init_args(root_unique_id, rank, world_size, device);
  read_rma_forced_from_environment();  // once here, not per transfer
  read_symmetric_size_from_environment();  // before NVSHMEM reads it: a bad value refused here
  {
    // What the kernels' launch choices depend on: read here, in host code, and passed in.
    kernels::LaunchSettings launch;
    launch.programmatic_launch = settings::value("PYDATACOPY_PROGRAMMATIC_LAUNCH").on;
    launch.ranks_per_gpu = static_cast<int>(settings::value("PYDATACOPY_RANKS_PER_GPU").integer);
    launch.mps_thread_percentage = settings::value("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").number;  // 0: unset
    kernels::set_launch_settings(launch);
  }
  check_nvshmem_version();
  if (device >= 0) PDC_CHECK_CUDA(cudaSetDevice(device));
  PDC_CHECK_CUDA(cudaGetDevice(&device));
  PDC_CHECK_CUDA(cudaFree(nullptr));  // create the primary context NVSHMEM will use

  const bool owns = nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED;
  if (!owns) {
    // Another component (torch's symmetric memory, say) started NVSHMEM: one process has one.
    PDC_REQUIRE(nvshmem_my_pe() == rank && nvshmem_n_pes() == world_size,
                "NVSHMEM is already running in this process as PE " << nvshmem_my_pe() << " of "
                    << nvshmem_n_pes() << ", which does not match rank " << rank << " of "
                    << world_size);
  }
  uint64_t* barrier_signals = start_nvshmem_bounded(root_unique_id, rank, world_size, device,
                                                   owns || !s.device_state_registered,
                                                   timeout_seconds, s.init_abandoned);
  s.device_state_registered = true;
  if (s.status_host == nullptr) {
    void* host = nullptr;
    PDC_CHECK_CUDA(cudaHostAlloc(&host, sizeof(detail::DeviceStatus), cudaHostAllocMapped));
    std::memset(host, 0, sizeof(detail::DeviceStatus));
    void* dev = nullptr;
    PDC_CHECK_CUDA(cudaHostGetDevicePointer(&dev, host, 0));
    s.status_host = static_cast<detail::DeviceStatus*>(host);
    s.status_device = static_cast<detail::DeviceStatus*>(dev);
  }
  if (s.barrier_epochs == nullptr) {
    void* epochs = nullptr;
    PDC_CHECK_CUDA(cudaMalloc(&epochs, 2 * sizeof(uint64_t)));
    s.barrier_epochs = static_cast<uint64_t*>(epochs);
  }
  PDC_CHECK_CUDA(cudaMemset(s.barrier_epochs, 0, 2 * sizeof(uint64_t)));
  kernels::preload_kernels();
  PDC_CHECK_CUDA(cudaDeviceSynchronize());
  s.initialized = true;
  s.owns_nvshmem = owns;
  s.barrier_signals = barrier_signals;
  s.blocking_barriers = 0;
  s.device = device;
  s.my_pe = rank;
  s.n_pes = world_size;
  s.unique_id = root_unique_id;
  s.gpu_of_pe.assign(static_cast<std::size_t>(world_size), 0);
  // Which PEs share a GPU (symmetric_malloc's room vote needs it), in a bounded barrier: a PE
  // that died after NVSHMEM's bootstrap gives TimeoutError here, not a hang.
  s.gpu_of_pe = barrier_all_blocking("init_nvshmem (every PE tells which GPU it uses)",
                                     timeout_seconds, gpu_identity(device));
  return rank;
}

uint64_t gpu_identity(int device) {
  cudaDeviceProp prop;
  PDC_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  unsigned char uuid[16];
  static_assert(sizeof(prop.uuid.bytes) == sizeof(uuid), "cudaUUID_t is 16 bytes");
  std::memcpy(uuid, prop.uuid.bytes, sizeof(uuid));
  // Only without a UUID: the host (as the Python layer names it: hostname, then the boot ID)
  // and the PCI address.
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';  // then the boot ID and PCI address
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  std::ostringstream fallback;
  fallback << host << "/" << boot_id << "/pci:" << prop.pciDomainID << ":" << prop.pciBusID << ":"
           << prop.pciDeviceID;
  return gpu_identity_of(uuid, fallback.str());
}

std::vector<uint64_t> gpu_identities() {
  require_initialized("gpu_identities()");
  return state().gpu_of_pe;
}

int pes_sharing_my_gpu() {
  require_initialized("pes_sharing_my_gpu()");
  const RuntimeState& s = state();
  const uint64_t mine = s.gpu_of_pe.at(static_cast<std::size_t>(s.my_pe));
  int count = 0;
  for (uint64_t gpu : s.gpu_of_pe) count += gpu == mine;
  return count;
}

void enqueue_barrier(cudaStream_t stream, double timeout_seconds) {
  require_initialized("barrier");
  RuntimeState& s = state();
  kernels::launch_barrier(s.barrier_signals, s.barrier_epochs, nullptr, 0, s.my_pe, s.n_pes,
                          timeout_nanoseconds(timeout_seconds), s.status_device, stream);
}

std::vector<uint64_t> barrier_all_blocking(const char* what, double timeout_seconds, uint64_t vote) {
  require_initialized(what);
  check_timeouts();  // a pending bad-input report stays pending: collectives must not split PEs
  RuntimeState& s = state();
  const uint64_t timeout_ns = timeout_nanoseconds(timeout_seconds);
  uint64_t* votes = s.barrier_signals + (2 + s.blocking_barriers++ % 2) * s.n_pes;
  cudaStream_t stream = nullptr;
  PDC_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<uint64_t> votes_seen(s.n_pes, vote);
  try {
    kernels::launch_barrier(s.barrier_signals + s.n_pes, s.barrier_epochs + 1, votes, vote, s.my_pe,
                            s.n_pes, timeout_ns, s.status_device, stream);
    // On our own non-blocking stream: the legacy stream could be held by the caller's work.
    if (s.n_pes > 1)
      PDC_CHECK_CUDA(cudaMemcpyAsync(votes_seen.data(), votes, sizeof(uint64_t) * s.n_pes,
                                     cudaMemcpyDeviceToHost, stream));
    PDC_CHECK_CUDA(cudaStreamSynchronize(stream));
    votes_seen[s.my_pe] = vote;
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  PDC_CHECK_CUDA(cudaStreamDestroy(stream));
  try {
    check_timeouts();
  } catch (const TimeoutError& e) {
    throw TimeoutError(std::string(what) + ": " + e.what());
  }
  return votes_seen;
}

void finalize(bool end_nvshmem) {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.initialized) return;
  // NVSHMEM's finalize and free wait on every PE without a deadline: meet the peers in a
  // bounded barrier first, so that a dead or absent one gives TimeoutError, not a hang.
  bool peers_here = !peer_failed();
  std::string error;
  // This PE's own queued work first (every device-side wait has a deadline, so this ends): once
  // every PE has passed the barrier below, no PE has work in flight that writes into another's
  // heap, so each may free it and exit. A PE whose stream-ordered work (a barrier, a send) still
  // targeted a peer that left after the barrier would otherwise fault on the freed heap.
  if (peers_here) cudaDeviceSynchronize();  // a sticky error surfaces below or at NVSHMEM's teardown
  if (peers_here && peer_failed()) {  // that work timed out on a peer: say so, skip the collectives
    peers_here = false;
    try {
      check_timeouts();
    } catch (const TimeoutError& e) {
      error = e.what();
    }
  }
  if (peers_here) {
    try {
      barrier_all_blocking("finalize", default_timeout_seconds());
    } catch (const TimeoutError& e) {
      peers_here = false;
      error = e.what();
    }
  }
  if (peers_here) cudaDeviceSynchronize();  // queued transfers may still use a registration
  unregister_all_memory();  // local: NVSHMEM is still up
  s.initialized = false;
  // After a peer timed out, NVSHMEM's collective teardown would wait on the dead peer forever:
  // leave NVSHMEM as it is and let process exit reclaim it.
  if (peers_here) nvshmem_free(s.barrier_signals);
  s.barrier_signals = nullptr;
  if (s.barrier_epochs != nullptr) cudaFree(s.barrier_epochs);  // local; an error here changes nothing
  s.barrier_epochs = nullptr;
  if (s.owns_nvshmem && end_nvshmem && peers_here) {
    nvshmem_finalize();
    // Another user that joined it (torch) keeps it alive: NVSHMEM counts its initialisations.
    s.nvshmem_finalized = nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED;
    s.device_state_registered = false;  // nvshmem_finalize took our device state off its list
  }
  s.owns_nvshmem = false;
  s.unique_id.clear();
  s.gpu_of_pe.clear();
  s.my_pe = -1;
  s.n_pes = 0;
  if (!error.empty()) throw TimeoutError(error + " (finalize skipped NVSHMEM's collective teardown)");
}

bool is_initialized() { return state().initialized; }

bool owns_nvshmem() { return state().owns_nvshmem; }

void wait_for_stream(cudaStream_t stream) {
  // The raw handle, synchronised here: torch.cuda.ExternalStream(handle).synchronize() returned
  // at once for torch's default stream (handle 0) while the barrier enqueued there still waited.
  PDC_CHECK_CUDA(cudaStreamSynchronize(stream));
  check_timeouts();  // this call's own wait, if it timed out (a bad index is check_errors()'s)
}

void refuse_blocking_capture(cudaStream_t stream, const char* what) {
  PDC_REQUIRE(capture_id(stream) == 0,
              what << " blocks (it waits on the host until the GPU is done), so it cannot be "
                      "captured in a CUDA graph: call it before or after the capture, or use "
                      "blocking=False inside it");
}

unsigned long long capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  PDC_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &status, &id));
  // A capture already invalidated (by an unsupported call on this or another stream) would fail
  // this call's own stream queries with a less telling error.
  PDC_REQUIRE(status != cudaStreamCaptureStatusInvalidated,
              "the stream's CUDA graph capture was already invalidated by an earlier call that "
              "cannot be captured; end the capture (it will report the error) and capture again");
  return status == cudaStreamCaptureStatusActive ? id + 1 : 0;  // ids may start at 0
}

bool peer_failed() {
  const detail::DeviceStatus* status = state().status_host;
  return status != nullptr && __atomic_load_n(&status->timeout.code, __ATOMIC_ACQUIRE) == detail::kTimedOut;
}

bool peer_timed_out(int pe) {
  const detail::DeviceStatus* status = state().status_host;
  return status != nullptr &&
         __atomic_load_n(&status->timed_out_pes[detail::tracked_pe_index(pe)], __ATOMIC_ACQUIRE) != 0;
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

namespace {
// The table's rule (settings.hpp). What is no positive number at all gets the core's own message,
// which callers of default_timeout_seconds() have always seen; a number past the table's most
// (kMaxTimeoutSeconds), the table's.
double seconds_from_environment(const char* name) {
  if (const std::optional<std::string> text = settings::read(name)) {
    const std::optional<double> seconds = settings::read_number(*text);
    PDC_REQUIRE(seconds && *seconds > 0 && std::isfinite(*seconds),
                name << " must be a positive number of seconds, got '" << *text << "'");
  }
  return settings::value(name).number;
}
}  // namespace

std::size_t barrier_symmetric_bytes(int n_pes) {
  return 4 * sizeof(uint64_t) * static_cast<std::size_t>(std::max(n_pes, 0));
}

double default_timeout_seconds() { return seconds_from_environment("PYDATACOPY_TIMEOUT_S"); }

double default_init_timeout_seconds() { return seconds_from_environment("PYDATACOPY_INIT_TIMEOUT_S"); }

uint64_t timeout_nanoseconds(double seconds) {
  PDC_REQUIRE(seconds > 0 && std::isfinite(seconds),
              "timeout must be a positive number of seconds, got " << seconds);
  return static_cast<uint64_t>(seconds * 1e9);
}

namespace {
std::string timeout_text(const detail::ErrorRecord& r) {
  std::ostringstream text;
  text << "PE " << r.pe << " timed out in " << detail::wait_op_name(static_cast<detail::WaitOp>(r.op))
       << " on PE " << r.peer << " (expected signal >= " << r.expected << ", saw " << r.seen
       << ", no progress for the call's timeout)";
  return text.str();
}
}  // namespace

void check_timeouts() {
  const detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  if (__atomic_load_n(&status->timeout.code, __ATOMIC_ACQUIRE) != detail::kTimedOut) return;
  throw TimeoutError(timeout_text(status->timeout) +
                     ". The peer may have died, hung, or not made the matching call. Operations "
                     "that need every PE (barriers, allocation, setup_send_recv, the token "
                     "exchange) are refused from now on; send/recv and one-sided calls between "
                     "PEs that did not time out still work. To recover fully, exit the process "
                     "(finalize() will not wait on the peer).");
}

void check_peer_timeouts(int pe, const char* what) {
  if (!peer_timed_out(pe)) return;
  const detail::DeviceStatus* status = state().status_host;
  std::ostringstream text;
  text << what << " with PE " << pe << ": an earlier wait on PE " << pe << " timed out";
  if (__atomic_load_n(&status->timeout.code, __ATOMIC_ACQUIRE) == detail::kTimedOut &&
      status->timeout.peer == pe)
    text << " (" << timeout_text(status->timeout) << ")";
  text << ". The peer may have died, hung, or not made the matching call, and its channels "
          "are out of step: operations with PE "
       << pe << " are refused for the rest of this process (those with other PEs go on); exit "
                "the process to recover.";
  throw TimeoutError(text.str());
}

namespace {
// PEs with a mismatch record of their own (beyond kTrackedPes they share the last one).
int tracked_mismatch_records() { return std::min(state().n_pes, detail::kTrackedPes); }

// Send channels (by receiving PE) whose refusal was reported since the channels were last
// rebuilt: by a device record of this PE's send (kChunkCredit) or by
// SendRecvEngine::check_refusals, whichever came first; the other then stays silent.
std::vector<char>& send_refusal_reported() {
  static std::vector<char> reported(detail::kTrackedPes, 0);
  return reported;
}
std::mutex& send_refusal_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Clears a published record (reported, or found already reported).
void clear_record(detail::ErrorRecord& r) {
  int published = detail::kMismatch;
  __atomic_compare_exchange_n(&r.code, &published, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

// `send`: the record of this PE's send channel (mismatch[0]). That refusal is told once, by this
// record or by SendRecvEngine::check_refusals (whichever first); a later call refused on the
// channel (kChannelRefused) is told each time.
void throw_size_mismatch(detail::ErrorRecord& r, bool send) {
  if (send && !claim_send_refusal_report(r.peer) &&
      static_cast<detail::WaitOp>(r.op) != detail::WaitOp::kChannelRefused) {
    clear_record(r);  // check_refusals() told this send's refusal already
    return;
  }
  const auto why = static_cast<detail::WaitOp>(r.op);
  std::ostringstream text;
  // Equal sizes: the message found is another one than this call's (one between them went by
  // another path, low-latency or zero-copy: the two sides' sizes put it on either side of a cut).
  const bool another_message = r.seen == r.expected;
  if (why == detail::WaitOp::kChunkArrival && another_message)
    text << "recv on PE " << r.pe << " from PE " << r.peer << ": the sender's next staged message ("
         << r.seen << " bytes) is not the one this recv expected: a message between them took "
         << "another path (low-latency or zero-copy), so the two sides' sizes differ for it";
  else if (why == detail::WaitOp::kChunkArrival)
    text << "recv on PE " << r.pe << " from PE " << r.peer << ": the sender's message is " << r.seen
         << " bytes but this recv expected " << r.expected << " bytes";
  else if (why == detail::WaitOp::kChunkCredit && another_message)
    text << "send from PE " << r.pe << " to PE " << r.peer << ": the receiver expected " << r.seen
         << " bytes for another message than this one (" << r.expected << " bytes): a message "
         << "between them took another path (low-latency or zero-copy), so the two sides' sizes "
         << "differ for it";
  else if (why == detail::WaitOp::kChunkCredit)
    text << "send from PE " << r.pe << " to PE " << r.peer << ": the receiver expected " << r.seen
         << " bytes for a message this PE sent with another size (this call: " << r.expected
         << " bytes)";
  else if (why == detail::WaitOp::kZeroCopyMapping)
    text << "send from PE " << r.pe << " to PE " << r.peer << ": the receiver posted a zero-copy "
         << "mapping of its receive buffer that this PE no longer holds (its memory was freed: a "
         << "CUDA graph replayed after its receive buffer was freed?); nothing was written";
  else if (send)  // kChannelRefused: the receiver refused this or an earlier message (its size: seen)
    text << "send/recv between PE " << r.pe << " and PE " << r.peer << " refused: the receiver expected "
         << "another size, message or path than one this PE sent on this channel (the other side's: "
         << r.seen << " bytes; this call: " << r.expected << " bytes)";
  else  // kChannelRefused on a recv: the sender's size in seen
    text << "send/recv between PE " << r.pe << " and PE " << r.peer << " refused: the sender sent a message "
         << "on this channel with another size or by another path than a recv expected (the other "
         << "side's: " << r.seen << " bytes; this call: " << r.expected << " bytes)";
  text << ". Both sides must move the same number of bytes, in the same order, per pair of PEs. "
          "Nothing more was delivered on this channel (this direction between the two PEs), and "
          "every later send/recv on it is refused and raises: call pydatacopy.setup_send_recv() "
          "on every PE to rebuild the channels.";
  clear_record(r);
  throw Error(text.str());
}
}  // namespace

bool claim_send_refusal_report(int pe) {
  std::lock_guard<std::mutex> lock(send_refusal_mutex());
  char& reported = send_refusal_reported()[detail::tracked_pe_index(pe)];
  if (reported) return false;
  reported = 1;
  return true;
}

bool send_refusal_recorded(int pe) {
  const detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return false;
  const detail::ErrorRecord& r = status->mismatch[0][detail::tracked_pe_index(pe)];
  return __atomic_load_n(&r.code, __ATOMIC_ACQUIRE) == detail::kMismatch;
}

void clear_size_mismatch() {
  {
    std::lock_guard<std::mutex> lock(send_refusal_mutex());
    std::fill(send_refusal_reported().begin(), send_refusal_reported().end(), 0);
  }
  detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  for (int send = 0; send < 2; ++send)
    for (int i = 0; i < tracked_mismatch_records(); ++i) clear_record(status->mismatch[send][i]);
}

void check_size_mismatch(int pe) {
  detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  for (int send = 1; send >= 0; --send) {
    detail::ErrorRecord& r = status->mismatch[send][detail::tracked_pe_index(pe)];
    if (__atomic_load_n(&r.code, __ATOMIC_ACQUIRE) == detail::kMismatch) throw_size_mismatch(r, send == 0);
  }
}

void check_size_mismatch() {
  detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  for (int i = 0; i < tracked_mismatch_records(); ++i)
    for (int send = 1; send >= 0; --send)
      if (__atomic_load_n(&status->mismatch[send][i].code, __ATOMIC_ACQUIRE) == detail::kMismatch)
        throw_size_mismatch(status->mismatch[send][i], send == 0);
}

namespace {
// Each PE a device-side wait timed out on, once: the PE stays marked, and the calls that involve
// it (and the collectives) keep refusing, but calls between live PEs must not hear of it again,
// while a later timeout on another PE must be heard of.
void report_new_timeouts() {
  if (!peer_failed()) return;  // the common case costs one load
  RuntimeState& s = state();
  const detail::DeviceStatus* status = s.status_host;
  std::lock_guard<std::mutex> lock(s.reported_mutex);
  s.timeout_reported.resize(detail::kTrackedPes, 0);
  const int first = detail::tracked_pe_index(status->timeout.peer);
  if (!s.timeout_reported[first]) {  // the first timeout, with its record's details
    s.timeout_reported[first] = 1;
    check_timeouts();
  }
  const int tracked = std::min(s.n_pes, detail::kTrackedPes);
  for (int pe = 0; pe < tracked; ++pe) {
    if (s.timeout_reported[pe] || __atomic_load_n(&status->timed_out_pes[pe], __ATOMIC_ACQUIRE) == 0)
      continue;
    s.timeout_reported[pe] = 1;
    std::ostringstream text;
    text << "PE " << s.my_pe << ": a device-side wait on PE " << pe
         << " timed out (no progress for the call's timeout), after an earlier timeout on PE "
         << status->timeout.peer
         << ". The peer may have died, hung, or not made the matching call. Calls with PE " << pe
         << " are refused from now on; those with PEs that did not time out still work.";
    throw TimeoutError(text.str());
  }
}
}  // namespace

void check_all_to_all_refusal() {
  detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  detail::ErrorRecord& r = status->all_to_all;
  if (__atomic_load_n(&r.code, __ATOMIC_ACQUIRE) != detail::kBadInput) return;
  std::ostringstream text;
  text << "all_to_all on PE " << r.pe << ": ";
  const auto asked = static_cast<int64_t>(r.expected);
  const auto limit = static_cast<int64_t>(r.seen);
  switch (static_cast<detail::WaitOp>(r.op)) {
    case detail::WaitOp::kAllToAllCapacity:
    case detail::WaitOp::kAllToAllCapacityFrom: {
      // This PE's own send over the capacity, or a source's send to this PE.
      const bool own = static_cast<detail::WaitOp>(r.op) == detail::WaitOp::kAllToAllCapacity;
      if (own)
        text << "this PE asked to send " << asked << " rows to PE " << r.peer;
      else
        text << "PE " << r.peer << " asked to send this PE " << asked << " rows";
      text << ", more than the capacity of " << limit << " rows per source fixed at setup; ";
      if (own)
        text << "nothing was sent to PE " << r.peer << " in that round (it received 0 rows from this PE)";
      else
        text << "it sent none, and recv_counts[" << r.peer << "] was 0 in that round";
      text << ". Set up the buffer with a larger capacity (or send fewer rows per PE)";
      break;
    }
    case detail::WaitOp::kAllToAllCount:
      text << "send_counts[" << r.peer << "] = " << asked << " is negative or reaches past the "
           << limit << " rows (or index entries) given; nothing was sent to PE " << r.peer
           << " in that round. Counts must be >= 0 and sum to at most the rows of send";
      break;
    case detail::WaitOp::kAllToAllIndex:
      text << "a gather index of " << asked << " is out of range [0, " << limit
           << ") (rows for PE " << r.peer << "); that row was not sent (its bytes at PE " << r.peer
           << " are stale). Check the index";
      break;
    case detail::WaitOp::kAllToAllLayout:
      text << "PE " << r.peer << " sent rows of " << asked << " bytes in its fields where this PE "
           << "expects " << limit << "; its rows were dropped (recv_counts[" << r.peer
           << "] = 0). Every PE must move the same fields with the same row widths in each call";
      break;
    case detail::WaitOp::kAllToAllRefusedBy:  // (the refusing PE raised the details from its call)
      text << "PE " << r.peer << " refused that call (reason " << asked << ": 1 arguments, 2 a send tensor, "
           << "3 a release owed, 4 its caller's check; its own Error says what); it sent no PE anything then "
           << "(recv_counts[" << r.peer << "] was 0), the buffer stays usable. Fix the call on PE " << r.peer;
      break;
    case detail::WaitOp::kAllToAllTag:
      text << "PE " << r.peer << " made that call with another tag (" << r.expected << ", this PE " << r.seen
           << "; MoE combine: every PE must pass the handle of the same dispatch); its rows were dropped";
      break;
    default:
      text << "refused a round (op " << r.op << ")";
      break;
  }
  int published = detail::kBadInput;
  __atomic_compare_exchange_n(&r.code, &published, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  throw Error(text.str());
}

void check_device_errors() {
  report_new_timeouts();
  check_size_mismatch();
  check_all_to_all_refusal();
  detail::DeviceStatus* status = state().status_host;
  if (status == nullptr) return;
  detail::ErrorRecord& r = status->bad_input;
  if (__atomic_load_n(&r.code, __ATOMIC_ACQUIRE) != detail::kBadInput) return;
  // Bad input found on the device: NVSHMEM is fine, so report it once and carry on.
  std::ostringstream bad;
  bad << "put_blocks on PE " << r.pe << ": block index " << static_cast<int64_t>(r.expected)
      << " is out of range [0, " << r.seen << "); that block was skipped. Check the index "
         "tensors";
  int published = detail::kBadInput;
  __atomic_compare_exchange_n(&r.code, &published, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  throw Error(bad.str());
}

}  // namespace pydatacopy
