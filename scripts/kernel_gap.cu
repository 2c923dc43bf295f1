// The gap between back-to-back kernels on one stream (last block's end -> next kernel's first block start), by
// %globaltimer, plain / programmatic (PDL) / graph-replayed. Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o /tmp/kernel_gap scripts/kernel_gap.cu && /tmp/kernel_gap
//   /tmp/kernel_gap shapes   (128 registers per thread; a system fence and release store before the end)
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

#include "../src/core/kernels/launch.cuh"

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Big { uint64_t words[100]; };  // 800 bytes of parameters

template <bool kPdl>
__global__ void __launch_bounds__(512) stamp(unsigned long long* out, int i, Big big) {
  if (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint64_t t0 = now_ns();
  if (threadIdx.x == 0) atomicMin(out + 2 * i, t0);
  if (i == 0) while (now_ns() - t0 < 5000000) {}  // 5 ms: the other launches queue up behind
  // a little work, so that blocks overlap
  __shared__ int x;
  if (threadIdx.x == 0) x = static_cast<int>(big.words[i % 100]);
  __syncthreads();
  if (kPdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(out + 2 * i + 1, now_ns() + (x & 0));
}

// 128 registers (as chunk_batch_kernel): 28 vectors live at once, loaded only when `go` (never).
__global__ void __launch_bounds__(512) heavy(unsigned long long* out, int i, const int4* src, int4* dst, int go) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) atomicMin(out + 2 * i, now_ns());
  if (i == 0) { const uint64_t t0 = now_ns(); while (now_ns() - t0 < 5000000) {} }
  if (go) {
    int4 v[28];
#pragma unroll
    for (int u = 0; u < 28; ++u) v[u] = src[threadIdx.x + 512 * u];
#pragma unroll
    for (int u = 0; u < 28; ++u) dst[threadIdx.x + 512 * u] = v[u];
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(out + 2 * i + 1, now_ns());
}

// A system-scope fence and release store before the end (as a send/recv block's last steps).
__global__ void __launch_bounds__(512) fenced(unsigned long long* out, int i, unsigned long long* flag) {
  if (threadIdx.x == 0) atomicMin(out + 2 * i, now_ns());
  if (i == 0) { const uint64_t t0 = now_ns(); while (now_ns() - t0 < 5000000) {} }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"((unsigned long long)i) : "memory");
    atomicMax(out + 2 * i + 1, now_ns());
  }
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

int run(const char* name, int blocks, int threads, bool pdl, bool graph, int kind = 0, int n = 200) {
  static void* scratch = nullptr;
  if (!scratch) CK(cudaMalloc(&scratch, 1 << 24));
  unsigned long long* out;
  CK(cudaMalloc(&out, 2 * n * sizeof(unsigned long long)));
  std::vector<unsigned long long> init(2 * n);
  for (int i = 0; i < n; ++i) init[2 * i] = ~0ull, init[2 * i + 1] = 0;
  CK(cudaMemcpy(out, init.data(), init.size() * 8, cudaMemcpyHostToDevice));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Big big{};
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  if (graph) CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  // a long first kernel, so that the rest queue up behind it
  for (int i = 0; i < n; ++i) {
    using pydatacopy::kernels::launch_kernel;  // the library's own launch, so the gap measured is its gap
    const dim3 grid(blocks), block(threads);
    if (kind == 1) CK(launch_kernel(heavy, grid, block, 0, s, pdl, out, i, (const int4*)scratch, (int4*)scratch, 0));
    else if (kind == 2) CK(launch_kernel(fenced, grid, block, 0, s, pdl, out, i, (unsigned long long*)scratch));
    else if (pdl) CK(launch_kernel(stamp<true>, grid, block, 0, s, pdl, out, i, big));
    else CK(launch_kernel(stamp<false>, grid, block, 0, s, pdl, out, i, big));
  }
  if (graph) {
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<unsigned long long> h(2 * n);
  CK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<double> gaps, lens;
  for (int i = 2; i + 1 < n; ++i) {
    gaps.push_back((double)((long long)h[2 * (i + 1)] - (long long)h[2 * i + 1]) / 1000.0);
    lens.push_back((double)(h[2 * i + 1] - h[2 * i]) / 1000.0);
  }
  std::sort(gaps.begin(), gaps.end());
  std::sort(lens.begin(), lens.end());
  printf("%-34s blocks %4d threads %4d: gap median %6.2f us (min %6.2f), kernel %6.2f us, period %6.2f us\n", name, blocks,
         threads, gaps[gaps.size() / 2], gaps[0], lens[lens.size() / 2],
         (double)(h[2 * (n - 1)] - h[2 * 2]) / 1000.0 / (n - 3));
  cudaFree(out);
  cudaStreamDestroy(s);
  if (ge) cudaGraphExecDestroy(ge);
  if (g) cudaGraphDestroy(g);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1) {  // the shapes of chunk_batch_kernel
    run("heavy (128 regs)", 1, 512, false, false, 1);
    run("heavy (128 regs)", 66, 512, false, false, 1);
    run("heavy (128 regs) pdl", 66, 512, true, false, 1);
    run("fenced (fence.sys + st.release.sys)", 1, 512, false, false, 2);
    run("fenced (fence.sys + st.release.sys)", 66, 512, false, false, 2);
    run("plain", 1, 32, false, false);
    return 0;
  }
  run("plain", 1, 32, false, false);
  run("plain", 66, 512, false, false);
  run("pdl", 1, 32, true, false);
  run("pdl", 66, 512, true, false);
  run("graph plain", 1, 32, false, true);
  run("graph plain", 66, 512, false, true);
  run("graph pdl", 1, 32, true, true);
  run("graph pdl", 66, 512, true, true);
  run("plain", 1, 32, false, false);
  run("pdl", 1, 32, true, false);
  return 0;
}
