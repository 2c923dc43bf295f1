// Bindings of the runtime (runtime.hpp): init, finalize, the PE's facts, barriers, device errors.
#include "bindings.hpp"

#include "pydatacopy/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "kernels/api.cuh"

namespace pydatacopy::bindings {

void bind_runtime(py::module_& m) {
  // Runtime.
  m.def("get_unique_id", &get_unique_id, release_gil(),
        "Create an NVSHMEM unique ID (128 bytes, as a list of ints). Needs no GPU.");
  m.def("init_nvshmem", &init_nvshmem, py::arg("root_unique_id"), py::arg("rank"),
        py::arg("world_size"), py::arg("device") = -1,
        py::arg("timeout_seconds"), release_gil(),
        "Join the NVSHMEM job named by root_unique_id (collective). Returns this PE.");
  m.def("finalize", &finalize, py::arg("end_nvshmem") = true, release_gil(),
        "Collective finalize; harmless twice. end_nvshmem=False leaves NVSHMEM running for "
        "another user in the process.");
  m.def("is_initialized", &is_initialized);
  m.def("my_pe", &my_pe);
  m.def("n_pes", &n_pes);
  m.def("pes_sharing_my_gpu", &pes_sharing_my_gpu, "PEs on this PE's GPU (itself included), as init() learned");
  m.def("send_recv_blocks_per_sm", &kernels::chunk_batch_blocks_per_sm,
        "blocks of the send/recv kernel one SM holds at once (the grid cap is SMs x this)");
  m.def("cuda_device", &cuda_device);
  m.def("built_nvshmem_version", [] { return built_nvshmem_version().str(); });
  m.def("loaded_nvshmem_version", [] { return loaded_nvshmem_version().str(); });
  m.def("check_nvshmem_version", &check_nvshmem_version);
  m.def("default_timeout_seconds", &default_timeout_seconds);
  m.def("barrier_symmetric_bytes", &barrier_symmetric_bytes, py::arg("n_pes"),
        "the symmetric bytes init_nvshmem takes for its barriers among n_pes PEs");
  m.def("default_init_timeout_seconds", &default_init_timeout_seconds);
  m.def("barrier_all_blocking",
        [](const std::string& what, double timeout_seconds, uint64_t vote) {
          return barrier_all_blocking(what.c_str(), timeout_seconds, vote);
        }, py::arg("what"), py::arg("timeout_seconds"), py::arg("vote") = 0, release_gil());
  m.def("check_device_errors", &check_device_errors);
  m.def("check_timeouts", &check_timeouts);
  m.def("is_capturing", [](std::uintptr_t stream) {
          cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
          PDC_CHECK_CUDA(cudaStreamIsCapturing(as_stream(stream), &status));
          return status != cudaStreamCaptureStatusNone;
        }, py::arg("stream"), "True while `stream` is being captured into a CUDA graph.");

  // Test support (tests/gpu): a kernel that holds most SMs until a flag is set or a deadline.
  m.def("_test_occupy_sms", [](int blocks, int threads, std::size_t shared_bytes, std::uintptr_t release,
                               std::uintptr_t released_by_flag, double seconds, std::uintptr_t stream) {
          kernels::launch_occupy_sms(blocks, threads, shared_bytes, as_pointer<const int>(release),
                                     as_pointer<int>(released_by_flag), timeout_nanoseconds(seconds),
                                     as_stream(stream));
        }, py::arg("blocks"), py::arg("threads"), py::arg("shared_bytes"), py::arg("release"),
        py::arg("released_by_flag"), py::arg("seconds"), py::arg("stream"));

}

}  // namespace pydatacopy::bindings
