// The copy engine's send (send_recv.hpp, "The copy engine"): one CUDA graph per send channel,
//   probe kernel -> IF (set by the probe) { memcpy into the guessed target -> copied kernel }
//                   ELSE { ordinary kernel }
// instantiated once, its nodes set for each call and launched on the caller's stream. Internal.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "kernels/api.cuh"

namespace pydatacopy::copy_engine {

// The three kernels' batches and the copy of one call.
struct Call {
  kernels::ChunkBatch probe, copied, ordinary;
  void* target;     // the guess: where the memcpy writes (the probe checks it first)
  const void* src;
  std::size_t bytes;
};

// Move-only; local (no peer is involved in building, setting or destroying it).
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&& other) noexcept { swap(other); }
  Graph& operator=(Graph&& other) noexcept {
    Graph gone(std::move(other));
    swap(gone);
    return *this;
  }
  void swap(Graph& other) noexcept;

  bool built() const { return exec_ != nullptr; }
  // Builds the graph for this call (its first), or sets the built graph's nodes for it, then
  // launches it. Returns the CUDA error of a step that failed (nothing launched, the thread's last
  // error cleared, `why` says which step), else cudaSuccess once launched. Never throws. The
  // probe's ce_handle is filled in here.
  cudaError_t launch(Call& call, cudaStream_t stream, std::string& why);

 private:
  cudaError_t build(Call& call, std::string& why);  // the graph, its nodes set for `call`
  cudaError_t set(Call& call, std::string& why);    // a built graph's nodes set for `call`
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaGraphConditionalHandle handle_ = 0;
  cudaGraphNode_t probe_ = nullptr, copy_ = nullptr, copied_ = nullptr, ordinary_ = nullptr;
};

}  // namespace pydatacopy::copy_engine
