// Can a copy-engine send be decided on the device? (issues 35 item 2b and 36: the copy engine from 64 MiB)
//
// The sender's host does not know where its receiver's buffer is when it issues a send (only the
// receiver's descriptor, in device memory, says so). A CUDA graph with a conditional node can let a
// kernel that reads the descriptor decide: kernel (compare the descriptor with the host's guess, set
// the condition) -> IF { memcpy into the guessed, mapped address } -> kernel. This probe asks the
// driver what that costs and whether it is allowed, across two processes (CUDA IPC, as the zero-copy
// path maps a receiver's allocation):
//   - a memcpy node in an IF body, its destination in another process's IPC-mapped memory;
//   - the body skipped when the kernel sets the condition to 0 (the destination untouched);
//   - per-call updates of the kernel and memcpy nodes (the source, destination and size change per
//     call), and the host time of update + launch;
//   - the GPU time per call beside a bare cudaMemcpyAsync of the same bytes into the same memory;
//   - whether cudaGraphLaunch is allowed into a stream that is being captured.
// Build and run on the GPU machine (two processes under MPS or not):
//   nvcc -arch=sm_90 -O2 -o /tmp/ce_probe scripts/ce_conditional_probe.cu
//   /tmp/ce_probe export /tmp/ce_probe.handle & sleep 2; /tmp/ce_probe import /tmp/ce_probe.handle; wait
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CHECK(call)                                                                            \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

constexpr size_t kMaxBytes = size_t{256} << 20;

// The decision kernel: the device's verdict (here: a word the host sets) becomes the condition.
__global__ void decide(cudaGraphConditionalHandle handle, const unsigned* verdict, unsigned long long* seen) {
  const unsigned v = *verdict;
  cudaGraphSetConditional(handle, v);
  atomicAdd(seen, 1ull);
}
// The finishing kernel (the real one would store the receiver's done words).
__global__ void finish(unsigned long long* count) { atomicAdd(count, 1ull); }

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static int run_export(const char* path) {
  void* buf = nullptr;
  CHECK(cudaMalloc(&buf, kMaxBytes));
  CHECK(cudaMemset(buf, 0, kMaxBytes));
  CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  CHECK(cudaIpcGetMemHandle(&h, buf));
  std::string tmp = std::string(path) + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  std::fwrite(&h, sizeof h, 1, f);
  std::fclose(f);
  std::rename(tmp.c_str(), path);
  std::string done = std::string(path) + ".done";
  for (int i = 0; i < 6000; ++i) {  // 60 s at most
    if (FILE* d = std::fopen(done.c_str(), "rb")) { std::fclose(d); break; }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(cudaFree(buf));
  std::printf("export: done\n");
  return 0;
}

static int run_import(const char* path) {
  cudaIpcMemHandle_t h;
  for (int i = 0;; ++i) {
    if (FILE* f = std::fopen(path, "rb")) {
      size_t n = std::fread(&h, sizeof h, 1, f);
      std::fclose(f);
      if (n == 1) break;
    }
    if (i > 3000) { std::fprintf(stderr, "import: no handle\n"); return 1; }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  uint8_t* peer = nullptr;
  CHECK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer), h, cudaIpcMemLazyEnablePeerAccess));
  uint8_t* src = nullptr;
  CHECK(cudaMalloc(&src, kMaxBytes));
  CHECK(cudaMemset(src, 0x5a, kMaxBytes));
  unsigned* verdict = nullptr;
  unsigned long long* counters = nullptr;
  CHECK(cudaMalloc(&verdict, sizeof(unsigned)));
  CHECK(cudaMalloc(&counters, 2 * sizeof(unsigned long long)));
  CHECK(cudaMemset(counters, 0, 2 * sizeof(unsigned long long)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // The graph: decide -> IF { memcpy } -> finish.
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  cudaGraphConditionalHandle handle;
  CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  cudaGraphNode_t decide_node, cond_node, copy_node, finish_node;
  cudaKernelNodeParams kp{};
  void* decide_args[] = {&handle, &verdict, &counters};
  kp.func = reinterpret_cast<void*>(decide);
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(1);
  kp.kernelParams = decide_args;
  CHECK(cudaGraphAddKernelNode(&decide_node, graph, nullptr, 0, &kp));
  cudaGraphNodeParams cp{};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = handle;
  cp.conditional.type = cudaGraphCondTypeIf;
  cp.conditional.size = 1;
  CHECK(cudaGraphAddNode(&cond_node, graph, &decide_node, nullptr, 1, &cp));
  cudaGraph_t body = cp.conditional.phGraph_out[0];
  cudaError_t add = cudaGraphAddMemcpyNode1D(&copy_node, body, nullptr, 0, peer, src, kMaxBytes, cudaMemcpyDeviceToDevice);
  std::printf("memcpy node into IPC memory in an IF body: %s\n", cudaGetErrorString(add));
  if (add != cudaSuccess) return 1;
  unsigned long long* finish_count = counters + 1;
  void* finish_args[] = {&finish_count};
  kp.func = reinterpret_cast<void*>(finish);
  kp.kernelParams = finish_args;
  CHECK(cudaGraphAddKernelNode(&finish_node, graph, &cond_node, 1, &kp));
  cudaGraphExec_t exec;
  cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  std::printf("instantiate: %s\n", cudaGetErrorString(inst));
  if (inst != cudaSuccess) return 1;

  // The same three steps without the conditional (kernel -> memcpy -> kernel): whether a memcpy
  // node inside a conditional body runs slower than one at the top of a graph (a body is launched
  // from the device; if its memcpy became a kernel, its time would grow with the bytes).
  cudaGraph_t plain_graph;
  CHECK(cudaGraphCreate(&plain_graph, 0));
  cudaGraphNode_t plain_first, plain_copy, plain_last;
  cudaKernelNodeParams fp{};
  fp.func = reinterpret_cast<void*>(finish);
  fp.gridDim = dim3(1);
  fp.blockDim = dim3(1);
  fp.kernelParams = finish_args;
  CHECK(cudaGraphAddKernelNode(&plain_first, plain_graph, nullptr, 0, &fp));
  CHECK(cudaGraphAddMemcpyNode1D(&plain_copy, plain_graph, &plain_first, 1, peer, src, kMaxBytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphAddKernelNode(&plain_last, plain_graph, &plain_copy, 1, &fp));
  cudaGraphExec_t plain_exec;
  CHECK(cudaGraphInstantiate(&plain_exec, plain_graph, 0));

  auto set_call = [&](uint8_t* dst, const uint8_t* from, size_t bytes) {
    // Per call: the decision kernel's arguments (as the real one's would change) and the copy.
    void* args[] = {&handle, &verdict, &counters};
    cudaKernelNodeParams p{};
    p.func = reinterpret_cast<void*>(decide);
    p.gridDim = dim3(1);
    p.blockDim = dim3(1);
    p.kernelParams = args;
    cudaError_t a = cudaGraphExecKernelNodeSetParams(exec, decide_node, &p);
    cudaError_t b = cudaGraphExecMemcpyNodeSetParams1D(exec, copy_node, dst, from, bytes, cudaMemcpyDeviceToDevice);
    return a != cudaSuccess ? a : b;
  };

  // Correctness: verdict 0 leaves the destination alone, verdict 1 copies.
  std::vector<uint8_t> host(4096);
  unsigned one = 1, zero = 0;
  CHECK(cudaMemcpy(verdict, &zero, sizeof zero, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(peer, 0, 1 << 20));
  CHECK(set_call(peer, src, 1 << 20));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaMemcpy(host.data(), peer + (1 << 20) - 4096, 4096, cudaMemcpyDeviceToHost));
  const bool skipped = std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; });
  CHECK(cudaMemcpy(verdict, &one, sizeof one, cudaMemcpyHostToDevice));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaMemcpy(host.data(), peer + (1 << 20) - 4096, 4096, cudaMemcpyDeviceToHost));
  const bool copied = std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0x5a; });
  // A size change through the update (1 MiB -> 3 bytes past 1 MiB, at odd offsets).
  CHECK(cudaMemset(peer, 0, 4 << 20));
  cudaError_t resize = set_call(peer + 7, src + 3, (2 << 20) + 3);
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> edge(16);
  CHECK(cudaMemcpy(edge.data(), peer + 7 + (2 << 20) - 8, 16, cudaMemcpyDeviceToHost));
  const bool resized = resize == cudaSuccess && edge[7] == 0x5a && edge[10] == 0x5a && edge[11] == 0;
  std::printf("verdict 0 skips the copy: %s; verdict 1 copies: %s; size/offset update: %s (%s)\n",
              skipped ? "yes" : "NO", copied ? "yes" : "NO", resized ? "yes" : "NO", cudaGetErrorString(resize));

  // Timing: GPU time per call (events around kReps calls) and host time per call (update + launch).
  constexpr int kReps = 20;
  for (size_t bytes : {size_t{4096}, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
    std::vector<double> bare, graphed, host_us, plain;
    for (int trial = 0; trial < 7; ++trial) {
      CHECK(cudaEventRecord(e0, stream));
      for (int i = 0; i < kReps; ++i) CHECK(cudaMemcpyAsync(peer, src, bytes, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      bare.push_back(ms * 1000.0 / kReps);
      CHECK(cudaEventRecord(e0, stream));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kReps; ++i) {
        // alternate the offsets so that every call is an update
        const size_t off = (i & 1) * 256;
        CHECK(set_call(peer + off, src + off, bytes - off));
        CHECK(cudaGraphLaunch(exec, stream));
      }
      const auto t1 = std::chrono::steady_clock::now();
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      graphed.push_back(ms * 1000.0 / kReps);
      host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kReps);
      CHECK(cudaEventRecord(e0, stream));
      for (int i = 0; i < kReps; ++i) {
        const size_t off = (i & 1) * 256;
        CHECK(cudaGraphExecMemcpyNodeSetParams1D(plain_exec, plain_copy, peer + off, src + off, bytes - off,
                                                 cudaMemcpyDeviceToDevice));
        CHECK(cudaGraphLaunch(plain_exec, stream));
      }
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      plain.push_back(ms * 1000.0 / kReps);
    }
    std::printf("bytes %10zu: kernel -> memcpy -> kernel, no conditional: %8.1f us (%.3fx)\n", bytes, median(plain),
                median(plain) / median(bare));
    // the host cost alone: updates + launches queued behind nothing long (GPU may be the limit for large sizes)
    std::printf("bytes %10zu: bare memcpy %8.1f us, decide+IF{memcpy}+finish %8.1f us (%.3fx), host update+launch %.2f us/call\n",
                bytes, median(bare), median(graphed), median(graphed) / median(bare), median(host_us));
  }
  // Host cost alone, with a small copy (GPU never the limit): 2000 calls.
  {
    CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) {
      CHECK(set_call(peer + (i & 1) * 256, src, 4096));
      CHECK(cudaGraphLaunch(exec, stream));
    }
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(cudaStreamSynchronize(stream));
    const auto t2 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) CHECK(cudaMemcpyAsync(peer + (i & 1) * 256, src, 4096, cudaMemcpyDeviceToDevice, stream));
    const auto t3 = std::chrono::steady_clock::now();
    CHECK(cudaStreamSynchronize(stream));
    std::printf("host per call, 4 KiB: update+graph launch %.2f us, bare cudaMemcpyAsync %.2f us\n",
                std::chrono::duration<double, std::micro>(t1 - t0).count() / 2000,
                std::chrono::duration<double, std::micro>(t3 - t2).count() / 2000);
  }
  // Into a stream being captured.
  {
    cudaStream_t cap;
    CHECK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
    CHECK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
    cudaError_t launched = cudaGraphLaunch(exec, cap);
    cudaGraph_t captured = nullptr;
    cudaError_t ended = cudaStreamEndCapture(cap, &captured);
    std::printf("cudaGraphLaunch into a capturing stream: %s (end capture: %s)\n", cudaGetErrorString(launched),
                cudaGetErrorString(ended));
    if (captured) cudaGraphDestroy(captured);
    cudaGetLastError();
  }
  unsigned long long c[2];
  CHECK(cudaMemcpy(c, counters, sizeof c, cudaMemcpyDeviceToHost));
  std::printf("decide ran %llu times, finish %llu times\n", c[0], c[1]);
  CHECK(cudaIpcCloseMemHandle(peer));
  FILE* d = std::fopen((std::string(path) + ".done").c_str(), "wb");
  std::fclose(d);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 3) { std::fprintf(stderr, "usage: %s export|import HANDLE_FILE\n", argv[0]); return 2; }
  if (std::strcmp(argv[1], "export") == 0) return run_export(argv[2]);
  return run_import(argv[2]);
}
