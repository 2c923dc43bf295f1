// File descriptors between the host processes of two PEs on one node (issue 36, item 2: exporting
// torch's expandable segments, whose CUDA handles are POSIX file descriptors, needs them passed to
// the peer; pidfd_getfd needs ptrace rights that containers often withhold, SCM_RIGHTS does not).
//
// A listener binds a Unix-domain socket in the abstract namespace (no file to clean up, gone with
// the process); a peer connects and, at once, sends the job's key: a random word PE 0 draws at init
// and every PE learns through the bootstrap, drawn apart from the word in the socket's name (names
// are readable by anyone in /proc/net/unix). The listener accepts only a connection whose
// SO_PEERCRED user is this process's and whose first message is the key within 100 ms; the
// connector talks only to a listener of its own user. Another user's process cannot connect, and
// one of the same user outside the job does not know the key. Then either side sends messages of a
// fixed payload with up to kMaxFds descriptors (SCM_RIGHTS).
//
// Nothing blocks beyond the wait a call is given; a failure (no socket, a closed peer, a
// refused connection) is a false or empty return, never an exception or an exit: the caller
// keeps the staged path. Plain POSIX, no CUDA: tests/cpp/test_fd_channel.cpp runs it between a
// process and its fork.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pydatacopy::zero_copy {

constexpr int kMaxFds = 16;  // descriptors per message

// A file descriptor owned: closed by the destructor; move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// One accepted or connected socket: messages of `payload_bytes` (the same on both sides) with
// descriptors.
class FdConnection {
 public:
  FdConnection() = default;
  // Connects to the listener `name` (abstract namespace) and sends `key`; empty when no listener
  // answers within `wait`.
  static std::optional<FdConnection> connect(const std::string& name, uint64_t key,
                                             std::chrono::milliseconds wait);

  bool valid() const { return socket_.valid(); }
  // One message: `payload` (payload_bytes) and `fds` (at most kMaxFds; this process keeps its
  // own copies). False when the peer is gone or the socket stays full for `wait`.
  bool send(const void* payload, std::size_t payload_bytes, const std::vector<int>& fds,
            std::chrono::milliseconds wait);
  // The next message into `payload` (payload_bytes) and `fds` (owned by the caller now). False
  // when none arrives within `wait`, the peer closed, or the message is not whole (its
  // descriptors, if any came, are closed).
  bool receive(void* payload, std::size_t payload_bytes, std::vector<UniqueFd>* fds,
               std::chrono::milliseconds wait);

 private:
  explicit FdConnection(UniqueFd socket) : socket_(std::move(socket)) {}
  friend class FdListener;
  UniqueFd socket_;
};

class FdListener {
 public:
  FdListener() = default;
  // Binds `name` in the abstract namespace; an invalid listener when that fails (the name taken,
  // no Unix sockets): the caller keeps the staged path.
  static FdListener open(const std::string& name, uint64_t key);

  bool valid() const { return socket_.valid(); }
  // The next connection that passes the checks (this process's user, the key as its first
  // message) within `wait`; connections that fail them are closed and counted in refused(). A
  // connection taken is given 100 ms for its key, past `wait` if need be (so accept(0) polls).
  std::optional<FdConnection> accept(std::chrono::milliseconds wait);
  int refused() const { return refused_; }

 private:
  UniqueFd socket_;
  uint64_t key_ = 0;
  int refused_ = 0;
};

// The socket name of PE `pe`'s listener in job `job` (the job's random word, in hex).
std::string fd_listener_name(uint64_t job, int pe);

}  // namespace pydatacopy::zero_copy
