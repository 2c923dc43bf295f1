#include "send_recv/copy_engine.hpp"

#include <utility>

namespace pydatacopy::copy_engine {

Graph::~Graph() {
  // A launch in flight completes first (the driver defers the release of an executing graph).
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
}

void Graph::swap(Graph& other) noexcept {
  std::swap(graph_, other.graph_);
  std::swap(exec_, other.exec_);
  std::swap(handle_, other.handle_);
  std::swap(probe_, other.probe_);
  std::swap(copy_, other.copy_);
  std::swap(copied_, other.copied_);
  std::swap(ordinary_, other.ordinary_);
}

namespace {
void set_handle(kernels::ChunkBatch& batch, cudaGraphConditionalHandle handle) {
  for (int i = 0; i < batch.count; ++i) batch.ops[i].ce_handle = handle;
}
// A step CUDA refused: named in `why`, the thread's last error cleared.
cudaError_t refused(cudaError_t e, const char* step, std::string& why) {
  why = step;
  cudaGetLastError();
  return e;
}
}  // namespace

cudaError_t Graph::build(Call& call, std::string& why) {
  const auto failed = [&](cudaError_t e, const char* step) {
    Graph gone;
    swap(gone);  // whatever was made goes
    return refused(e, step, why);
  };
  cudaError_t e = cudaGraphCreate(&graph_, 0);
  if (e != cudaSuccess) return failed(e, "cudaGraphCreate");
  // Reset to 0 at every launch: only a probe that found the guess right sets it.
  e = cudaGraphConditionalHandleCreate(&handle_, graph_, 0, cudaGraphCondAssignDefault);
  if (e != cudaSuccess) return failed(e, "cudaGraphConditionalHandleCreate");
  set_handle(call.probe, handle_);
  kernels::ChunkBatchNode node;
  kernels::chunk_batch_node(call.probe, node);
  e = cudaGraphAddKernelNode(&probe_, graph_, nullptr, 0, &node.node);
  if (e != cudaSuccess) return failed(e, "cudaGraphAddKernelNode (probe)");
  cudaGraphNodeParams branch{};
  branch.type = cudaGraphNodeTypeConditional;
  branch.conditional.handle = handle_;
  branch.conditional.type = cudaGraphCondTypeIf;
  branch.conditional.size = 2;  // [0]: the guess was right, [1]: it was not
  cudaGraphNode_t conditional = nullptr;
  e = cudaGraphAddNode(&conditional, graph_, &probe_, nullptr, 1, &branch);
  if (e != cudaSuccess) return failed(e, "cudaGraphAddNode (IF/ELSE)");
  cudaGraph_t right = branch.conditional.phGraph_out[0], wrong = branch.conditional.phGraph_out[1];
  e = cudaGraphAddMemcpyNode1D(&copy_, right, nullptr, 0, call.target, call.src, call.bytes, cudaMemcpyDeviceToDevice);
  if (e != cudaSuccess) return failed(e, "cudaGraphAddMemcpyNode1D");
  kernels::chunk_batch_node(call.copied, node);
  e = cudaGraphAddKernelNode(&copied_, right, &copy_, 1, &node.node);
  if (e != cudaSuccess) return failed(e, "cudaGraphAddKernelNode (copied)");
  kernels::chunk_batch_node(call.ordinary, node);
  e = cudaGraphAddKernelNode(&ordinary_, wrong, nullptr, 0, &node.node);
  if (e != cudaSuccess) return failed(e, "cudaGraphAddKernelNode (ordinary)");
  e = cudaGraphInstantiate(&exec_, graph_, 0);
  if (e != cudaSuccess) return failed(e, "cudaGraphInstantiate");
  return cudaSuccess;
}

cudaError_t Graph::set(Call& call, std::string& why) {
  set_handle(call.probe, handle_);
  kernels::ChunkBatchNode node;
  kernels::chunk_batch_node(call.probe, node);
  cudaError_t e = cudaGraphExecKernelNodeSetParams(exec_, probe_, &node.node);
  if (e != cudaSuccess) return refused(e, "cudaGraphExecKernelNodeSetParams (probe)", why);
  e = cudaGraphExecMemcpyNodeSetParams1D(exec_, copy_, call.target, call.src, call.bytes, cudaMemcpyDeviceToDevice);
  if (e != cudaSuccess) return refused(e, "cudaGraphExecMemcpyNodeSetParams1D", why);
  kernels::chunk_batch_node(call.copied, node);
  e = cudaGraphExecKernelNodeSetParams(exec_, copied_, &node.node);
  if (e != cudaSuccess) return refused(e, "cudaGraphExecKernelNodeSetParams (copied)", why);
  kernels::chunk_batch_node(call.ordinary, node);
  e = cudaGraphExecKernelNodeSetParams(exec_, ordinary_, &node.node);
  if (e != cudaSuccess) return refused(e, "cudaGraphExecKernelNodeSetParams (ordinary)", why);
  return cudaSuccess;
}

cudaError_t Graph::launch(Call& call, cudaStream_t stream, std::string& why) {
  // Not stream work of a capture (the caller's stream is not capturing: batch.cpp): neither
  // refused by nor invalidating a global-mode capture on another thread. (Not RelaxedCaptureMode,
  // which throws: the caller has ordered its channels already, and must launch something.)
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) return refused(e, "cudaThreadExchangeStreamCaptureMode", why);
  // A graph built for this call holds its nodes already; one built before is set for it.
  e = exec_ == nullptr ? build(call, why) : set(call, why);
  if (e == cudaSuccess) {
    e = cudaGraphLaunch(exec_, stream);
    if (e != cudaSuccess) refused(e, "cudaGraphLaunch", why);
  }
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) cudaGetLastError();  // the thread's mode as it was
  return e;
}

}  // namespace pydatacopy::copy_engine
