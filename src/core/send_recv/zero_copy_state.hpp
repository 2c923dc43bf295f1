// The engine's zero-copy state (send_recv.cpp makes it, batch.cpp reads it per call).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_calls.hpp"
#include "common/pointer_attributes.hpp"
#include "pydatacopy/detail/channel_order.hpp"
#include "send_recv/copy_engine.hpp"
#include "send_recv/fd_channel.hpp"
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
    if (!detail::try_pointer_attributes(ptr, detail::Ask::kZeroCopy, p)) return a;
    a.base = p.start;
    a.bytes = p.bytes;
    a.buffer_id = p.buffer_id;
    a.cuda_memory = p.device_memory();  // zero-copy targets device memory only
    a.managed = p.managed;
    a.queried = ptr;
    // Virtual-memory memory whose chunks export as file descriptors (torch's expandable segments;
    // cudaMallocAsync's pools allow no handle type and stay staged).
    a.vmm_fd = a.cuda_memory && !p.legacy_ipc && (p.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    return a;
  }

  // ---- virtual-memory chunks (zero_copy.hpp) ----
  bool chunks(const void* ptr, std::size_t bytes, std::vector<zero_copy::Chunk>* out) override {
    out->clear();
    const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uintptr_t end = begin + (bytes == 0 ? 1 : bytes);
    for (std::uintptr_t at = begin; at < end;) {
      zero_copy::Chunk c;
      unsigned long long id = 0;
      if (!detail::mapping_at(reinterpret_cast<const void*>(at), &c.base, &c.bytes, &id) || c.base > at ||
          c.base + c.bytes <= at || out->size() >= static_cast<std::size_t>(zero_copy::kMaxChunksPerMessage))
        return false;
      c.id = id;
      out->push_back(c);
      at = c.base + c.bytes;
    }
    return true;
  }
  // Not while a failed connection waits to be tried again; the attempt itself is send_chunk's (a
  // failure there counts against the memory, so that a listener that never comes costs a few
  // attempts, not one 200 ms connect a second forever).
  bool can_send_chunks(int peer) override {
    const auto p = static_cast<std::size_t>(peer);
    return p < to_sender_.size() && (to_sender_[p].has_value() || std::chrono::steady_clock::now() >= connect_retry_at_[p]);
  }
  bool send_chunk(int peer, std::uintptr_t chunk_base, uint64_t sequence) override {
    detail::RelaxedCaptureMode relaxed;
    if (!fd_channel_ready(peer)) return false;
    using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
    using Export = CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
    using Release = CUresult (*)(CUmemGenericAllocationHandle);
    static const Retain retain = detail::driver_function<Retain>("cuMemRetainAllocationHandle");
    static const Export export_handle = detail::driver_function<Export>("cuMemExportToShareableHandle");
    static const Release release = detail::driver_function<Release>("cuMemRelease");
    CUmemGenericAllocationHandle handle{};
    if (retain(&handle, reinterpret_cast<void*>(chunk_base)) != CUDA_SUCCESS) return false;
    int fd = -1;
    const CUresult exported = export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    release(handle);  // the exported descriptor holds the chunk from here
    if (exported != CUDA_SUCCESS) return false;
    zero_copy::UniqueFd owned(fd);  // this process's copy, closed once sent
    const ChunkMessage message{my_pe_, 0, sequence};
    return to_sender_[static_cast<std::size_t>(peer)]->send(&message, sizeof(message), {owned.get()}, kSendWait);
  }
  int take_chunk_fd(int peer, uint64_t sequence) override {
    collect_chunk_fds();
    auto it = chunk_fds_.find({peer, sequence});
    if (it == chunk_fds_.end()) return -1;
    const int fd = it->second.release();
    chunk_fds_.erase(it);
    return fd;
  }
  uint64_t reserve(std::size_t bytes) override {
    detail::RelaxedCaptureMode relaxed;  // the progress thread runs it while a user thread may capture
    using Reserve = CUresult (*)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long);
    static const Reserve reserve_range = detail::driver_function<Reserve>("cuMemAddressReserve");
    CUdeviceptr address = 0;
    return reserve_range(&address, bytes, 0, 0, 0) == CUDA_SUCCESS ? static_cast<uint64_t>(address) : 0;
  }
  void free_reservation(uint64_t address, std::size_t bytes) override {
    detail::RelaxedCaptureMode relaxed;
    using Free = CUresult (*)(CUdeviceptr, std::size_t);
    static const Free free_range = detail::driver_function<Free>("cuMemAddressFree");
    free_range(static_cast<CUdeviceptr>(address), bytes);  // a failure leaks address space only
  }
  uint64_t map_chunk(int fd, uint64_t address, std::size_t bytes) override {
    zero_copy::UniqueFd owned(fd);
    if (address == 0 || bytes == 0 || fd < 0 || device_ < 0) return 0;
    detail::RelaxedCaptureMode relaxed;
    using Import = CUresult (*)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
    using Map = CUresult (*)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle, unsigned long long);
    using Unmap = CUresult (*)(CUdeviceptr, std::size_t);
    using SetAccess = CUresult (*)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t);
    using Release = CUresult (*)(CUmemGenericAllocationHandle);
    static const Import import_handle = detail::driver_function<Import>("cuMemImportFromShareableHandle");
    static const Map map = detail::driver_function<Map>("cuMemMap");
    static const Unmap unmap = detail::driver_function<Unmap>("cuMemUnmap");
    static const SetAccess set_access = detail::driver_function<SetAccess>("cuMemSetAccess");
    static const Release release = detail::driver_function<Release>("cuMemRelease");
    CUmemGenericAllocationHandle handle{};
    if (import_handle(&handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(owned.get())),
                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS)
      return 0;
    const auto at = static_cast<CUdeviceptr>(address);
    if (map(at, bytes, 0, handle, 0) != CUDA_SUCCESS) {
      release(handle);
      return 0;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (set_access(at, bytes, &access, 1) != CUDA_SUCCESS || handle == 0) {
      unmap(at, bytes);
      release(handle);
      return 0;
    }
    return static_cast<uint64_t>(handle);
  }
  void unmap_chunk(uint64_t address, std::size_t bytes, uint64_t handle) override {
    detail::RelaxedCaptureMode relaxed;
    using Unmap = CUresult (*)(CUdeviceptr, std::size_t);
    using Release = CUresult (*)(CUmemGenericAllocationHandle);
    static const Unmap unmap = detail::driver_function<Unmap>("cuMemUnmap");
    static const Release release = detail::driver_function<Release>("cuMemRelease");
    unmap(static_cast<CUdeviceptr>(address), bytes);
    release(static_cast<CUmemGenericAllocationHandle>(handle));  // the chunk goes back once its owner lets go too
  }

  // The descriptor channel: this PE's listener (its senders' side) and, per peer, the connection
  // to that peer's listener (this PE receiving from it), made at the first chunk it exports.
  void open_fd_channel(uint64_t job, uint64_t key, int me, int device) {
    job_ = job, key_ = key, my_pe_ = me, device_ = device;
    listener_ = zero_copy::FdListener::open(zero_copy::fd_listener_name(job, me), key);
    to_sender_.clear();
    to_sender_.resize(static_cast<std::size_t>(n_pes_));
    connect_retry_at_.assign(static_cast<std::size_t>(n_pes_), std::chrono::steady_clock::time_point{});
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

  // One descriptor on the socket: who sent it, and the number its ring request names.
  struct ChunkMessage {
    int32_t from_pe;
    uint32_t reserved;
    uint64_t sequence;
  };
  static constexpr std::chrono::milliseconds kConnectWait{200}, kSendWait{200}, kConnectRetry{1000};

  bool fd_channel_ready(int peer) {
    const auto p = static_cast<std::size_t>(peer);
    if (p >= to_sender_.size()) return false;
    if (!to_sender_[p]) {
      // A connection that failed is tried again a while later (a peer's backlog full for a moment);
      // meanwhile that peer's expandable memory stays staged.
      const auto now = std::chrono::steady_clock::now();
      if (now < connect_retry_at_[p]) return false;
      to_sender_[p] = zero_copy::FdConnection::connect(zero_copy::fd_listener_name(job_, peer), key_, kConnectWait);
      if (!to_sender_[p]) connect_retry_at_[p] = now + kConnectRetry;
    }
    return to_sender_[p].has_value();
  }
  // Takes every connection and descriptor that has come (never waits): descriptors by (PE, number).
  void collect_chunk_fds() {
    for (;;) {  // past connections refused (another process of this user, without the key)
      const int refused = listener_.refused();
      auto connection = listener_.accept(std::chrono::milliseconds(0));
      if (connection) {
        incoming_.push_back(std::move(*connection));
      } else if (listener_.refused() == refused) {
        break;
      }
    }
    for (zero_copy::FdConnection& connection : incoming_) {
      ChunkMessage message{};
      std::vector<zero_copy::UniqueFd> fds;
      while (connection.receive(&message, sizeof(message), &fds, std::chrono::milliseconds(0))) {
        if (fds.size() != 1 || message.from_pe < 0 || message.from_pe >= n_pes_) continue;  // closed
        chunk_fds_[{message.from_pe, message.sequence}] = std::move(fds[0]);
      }
    }
  }

  const ChannelOrder* order_;
  int n_pes_;
  uint64_t job_ = 0, key_ = 0;
  int my_pe_ = -1, device_ = -1;
  zero_copy::FdListener listener_;
  std::vector<std::optional<zero_copy::FdConnection>> to_sender_;
  std::vector<std::chrono::steady_clock::time_point> connect_retry_at_;
  std::vector<zero_copy::FdConnection> incoming_;
  std::map<std::pair<int, uint64_t>, zero_copy::UniqueFd> chunk_fds_;
  uint64_t* table_host = nullptr;    // cudaHostAlloc'd, mapped: [n_pes][kTableEntries]
  uint64_t* table_device = nullptr;  // the same memory as the kernels see it
  std::vector<std::unique_ptr<zero_copy::Exporter>> exporters;  // per sending peer
  std::vector<std::unique_ptr<zero_copy::Importer>> importers;  // per receiving peer
  std::vector<zero_copy::Mailbox*> created, opened;
  std::vector<std::string> names;  // created here, unlinked once every PE opened its own
  // The copy engine (send_recv.hpp), per send channel: the last zero-copy target its kernels
  // resolved (host-mapped, the host's next guess), the probe's verdict (device), and the graph,
  // built at the channel's first copy-engine send. A graph that cannot be built, set or launched
  // turns the copy engine off until the next setup (copy_engine_off says why; those sends move by
  // the SM kernel, as with the copy engine off). Freed by release(), after the device is idle, as
  // the table is (never by a destructor: cudaFree would wait for kernels still in flight).
  uint64_t* ce_last_target_host = nullptr;  // cudaHostAlloc'd, mapped: [n_pes]
  uint64_t* ce_last_target_device = nullptr;
  unsigned int* ce_state = nullptr;         // device [n_pes]
  std::vector<copy_engine::Graph> ce_graphs;
  std::string copy_engine_off;
};

}  // namespace pydatacopy
