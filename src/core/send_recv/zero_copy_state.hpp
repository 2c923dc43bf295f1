// The engine's zero-copy state (send_recv.cpp makes it, batch.cpp reads it per call).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_calls.hpp"
#include "common/pointer_attributes.hpp"
#include "pydatacopy/detail/channel_order.hpp"
#include "send_recv/zero_copy.hpp"

namespace pydatacopy {

// The host side of zero-copy (zero_copy.hpp), per engine: the CUDA backend, the mailboxes,
// each peer's exporter (this PE receiving) and importer (this PE sending), and the host-mapped
// table the send kernels read.
struct ZeroCopyState final : zero_copy::Backend {
  explicit ZeroCopyState(const ChannelOrder* order, int n_pes) : order_(order), n_pes_(n_pes) {}
  ~ZeroCopyState() override {
    for (zero_copy::Mailbox* m : created) zero_copy::unmap_mailbox(m);
    for (zero_copy::Mailbox* m : opened) zero_copy::unmap_mailbox(m);
    for (const std::string& name : names) zero_copy::unlink_mailbox(name);
  }

  Allocation query(const void* ptr) override {
    Allocation a;
    detail::PointerAttributes p;
    // A failed query only keeps the message staged.
    if (!detail::try_pointer_attributes(ptr, detail::Ask::kIdentity, p)) return a;
    a.base = p.start;
    a.bytes = p.bytes;
    a.buffer_id = p.buffer_id;
    a.cuda_memory = p.device_memory();  // zero-copy targets device memory only
    a.managed = p.managed;
    a.queried = ptr;
    return a;
  }
  bool export_handle(std::uintptr_t base, zero_copy::IpcHandle* handle) override {
    detail::RelaxedCaptureMode relaxed;
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)) != cudaSuccess) {
      cudaGetLastError();  // not exportable (VMM, pools): not an error of the caller's
      return false;
    }
    static_assert(sizeof(h) == sizeof(handle->bytes), "cudaIpcMemHandle_t is 64 bytes");
    std::memcpy(handle->bytes, &h, sizeof(h));
    return true;
  }
  void* open_handle(const zero_copy::IpcHandle& handle) override {
    detail::RelaxedCaptureMode relaxed;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.bytes, sizeof(h));
    void* mapped = nullptr;
    if (cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();  // that allocation stays staged
      return nullptr;
    }
    return mapped;
  }
  void close_handle(void* mapped) override {
    detail::RelaxedCaptureMode relaxed;
    if (cudaIpcCloseMemHandle(mapped) != cudaSuccess) cudaGetLastError();
  }
  bool channel_idle(bool send, int peer) override {
    detail::RelaxedCaptureMode relaxed;
    return order_->idle((send ? 0 : n_pes_) + peer);
  }

  const ChannelOrder* order_;
  int n_pes_;
  uint64_t* table_host = nullptr;    // cudaHostAlloc'd, mapped: [n_pes][kTableEntries]
  uint64_t* table_device = nullptr;  // the same memory as the kernels see it
  std::vector<std::unique_ptr<zero_copy::Exporter>> exporters;  // per sending peer
  std::vector<std::unique_ptr<zero_copy::Importer>> importers;  // per receiving peer
  std::vector<zero_copy::Mailbox*> created, opened;
  std::vector<std::string> names;  // created here, unlinked once every PE opened its own
};

}  // namespace pydatacopy
