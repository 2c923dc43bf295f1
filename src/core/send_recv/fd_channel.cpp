#include "send_recv/fd_channel.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <thread>

namespace pydatacopy::zero_copy {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kKeyWait(100);  // a connector sends its key at once

// The peer of a connected socket runs as this process's user (the kernel's word, not forgeable).
bool same_user(int socket) {
  ucred credentials{};
  socklen_t size = sizeof(credentials);
  return ::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &credentials, &size) == 0 && credentials.uid == ::geteuid();
}

// The abstract-namespace address of `name` (a leading NUL, no file); false when it is too long.
bool address_of(const std::string& name, sockaddr_un* address, socklen_t* length) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof(address->sun_path)) return false;
  std::memcpy(address->sun_path + 1, name.data(), name.size());
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return true;
}

UniqueFd new_socket() {
  return UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
}

// Milliseconds left until `deadline` (0 once past it), for poll().
int left_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left < 1000000 ? left : 1000000);
}

// Waits until `fd` is ready for `events` or `deadline`; false on the deadline or an error.
bool ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, left_ms(deadline));
    if (n > 0) return (p.revents & events) != 0;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string fd_listener_name(uint64_t job, int pe) {
  char text[64];
  std::snprintf(text, sizeof(text), "pydatacopy-fds-%016llx-%d", static_cast<unsigned long long>(job), pe);
  return text;
}

FdListener FdListener::open(const std::string& name, uint64_t key) {
  FdListener listener;
  sockaddr_un address;
  socklen_t length = 0;
  if (!address_of(name, &address, &length)) return listener;
  UniqueFd socket = new_socket();
  if (!socket.valid()) return listener;
  if (::bind(socket.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) return listener;
  if (::listen(socket.get(), SOMAXCONN) != 0) return listener;  // a full backlog refuses the job's own peers
  listener.socket_ = std::move(socket);
  listener.key_ = key;
  return listener;
}

std::optional<FdConnection> FdListener::accept(std::chrono::milliseconds wait) {
  if (!valid()) return std::nullopt;
  const auto deadline = Clock::now() + wait;
  for (;;) {
    UniqueFd peer(::accept4(socket_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!peer.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return std::nullopt;
      if (!ready(socket_.get(), POLLIN, deadline)) return std::nullopt;
      continue;
    }
    // The peer's user, then the job's key.
    const bool trusted = same_user(peer.get());
    FdConnection connection(std::move(peer));
    uint64_t key = 0;
    std::vector<UniqueFd> none;
    // The key is the connector's first act: a connection that says nothing for kKeyWait is
    // dropped, so that it cannot hold the peers queued behind it for the whole wait. A connection
    // taken gets that long even past `wait` (accept(0) polls for connections, and one taken just
    // as its connector is between connect() and sending its key must not be refused for it).
    if (trusted && connection.receive(&key, sizeof(key), &none, kKeyWait) &&
        key == key_ && none.empty())
      return connection;
    ++refused_;  // closed as it goes out of scope
    if (left_ms(deadline) == 0) return std::nullopt;
  }
}

std::optional<FdConnection> FdConnection::connect(const std::string& name, uint64_t key,
                                                  std::chrono::milliseconds wait) {
  sockaddr_un address;
  socklen_t length = 0;
  if (!address_of(name, &address, &length)) return std::nullopt;
  const auto deadline = Clock::now() + wait;
  for (;;) {
    UniqueFd socket = new_socket();
    if (!socket.valid()) return std::nullopt;
    if (::connect(socket.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0) {
      // The listener too must be this user's: the key (and later descriptors) go to no other.
      if (!same_user(socket.get())) return std::nullopt;
      FdConnection connection(std::move(socket));
      if (!connection.send(&key, sizeof(key), {}, std::chrono::milliseconds(left_ms(deadline)))) return std::nullopt;
      return connection;
    }
    // No listener yet (a late peer: ECONNREFUSED), or its backlog full (EAGAIN): again, briefly.
    if (errno != ECONNREFUSED && errno != EAGAIN && errno != ENOENT && errno != EINTR) return std::nullopt;
    if (left_ms(deadline) == 0) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool FdConnection::send(const void* payload, std::size_t payload_bytes, const std::vector<int>& fds,
                        std::chrono::milliseconds wait) {
  if (!valid() || fds.size() > static_cast<std::size_t>(kMaxFds)) return false;
  iovec vector{const_cast<void*>(payload), payload_bytes};
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof(control));
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
  }
  const auto deadline = Clock::now() + wait;
  for (;;) {
    // MSG_NOSIGNAL: a peer that closed gives EPIPE here, never a SIGPIPE that ends the process.
    const ssize_t sent = ::sendmsg(socket_.get(), &message, MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(payload_bytes)) return true;
    if (sent >= 0) return false;  // a sequenced packet goes whole or not at all
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    if (!ready(socket_.get(), POLLOUT, deadline)) return false;
  }
}

bool FdConnection::receive(void* payload, std::size_t payload_bytes, std::vector<UniqueFd>* fds,
                           std::chrono::milliseconds wait) {
  fds->clear();
  if (!valid()) return false;
  const auto deadline = Clock::now() + wait;
  for (;;) {
    iovec vector{payload, payload_bytes};
    msghdr message{};
    message.msg_iov = &vector;
    message.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t got = ::recvmsg(socket_.get(), &message, MSG_CMSG_CLOEXEC);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      if (!ready(socket_.get(), POLLIN, deadline)) return false;
      continue;
    }
    // Every descriptor that came is owned from here, so that a refused message leaks none.
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
      if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
        fds->emplace_back(fd);
      }
    }
    // A short message (0 bytes: the peer closed) or one cut short is refused, its descriptors closed.
    const bool whole = got == static_cast<ssize_t>(payload_bytes) && (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0;
    if (!whole) fds->clear();
    return whole;
  }
}

}  // namespace pydatacopy::zero_copy
