// fd_channel.hpp between this process and its fork, without a GPU: a memfd's descriptor passed
// with SCM_RIGHTS reads the same bytes on the other side; a connection with the wrong key is
// refused and the next right one accepted; no listener, a taken name, a closed peer and too many
// descriptors are false or empty returns within the wait, never a hang or a SIGPIPE.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "send_recv/fd_channel.hpp"

namespace {

using pydatacopy_test::check;
namespace zc = pydatacopy::zero_copy;
using std::chrono::milliseconds;

constexpr uint64_t kKey = 0x5eedf00dcafe1234ull;

struct Message {
  uint64_t tag;
  uint64_t bytes;
};

uint64_t random_job() { return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}(); }

// The child's side: connect with `key`, send a memfd holding `text`, wait for the parent's
// answer. Exit code 0 when every step went as expected (a refused connection expects no answer).
[[noreturn]] void child(const std::string& name, uint64_t key, const char* text, bool expect_answer) {
  std::optional<zc::FdConnection> connection = zc::FdConnection::connect(name, key, milliseconds(5000));
  if (!connection) _exit(10);
  const int memory = memfd_create("pydatacopy-test", MFD_CLOEXEC);
  if (memory < 0) _exit(11);
  const std::size_t bytes = std::strlen(text);
  if (write(memory, text, bytes) != static_cast<ssize_t>(bytes)) _exit(12);
  const Message sent{7, bytes};
  // A refused connection may already be closed by the listener: a false send is then fine.
  const bool delivered = connection->send(&sent, sizeof(sent), {memory}, milliseconds(5000));
  close(memory);
  if (!expect_answer) _exit(0);
  if (!delivered) _exit(13);
  Message answer{};
  std::vector<zc::UniqueFd> none;
  if (!connection->receive(&answer, sizeof(answer), &none, milliseconds(5000))) _exit(14);
  _exit(answer.tag == 8 && none.empty() ? 0 : 15);
}

int wait_child(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

void test_a_descriptor_crosses_and_reads_the_same_bytes() {
  const std::string name = zc::fd_listener_name(random_job(), 0);
  zc::FdListener listener = zc::FdListener::open(name, kKey);
  check(listener.valid(), "the listener binds its abstract name");
  const pid_t pid = fork();
  if (pid == 0) child(name, kKey, "expandable segment", true);
  std::optional<zc::FdConnection> connection = listener.accept(milliseconds(5000));
  check(connection.has_value(), "the child's connection, with the key, is accepted");
  if (connection) {
    Message got{};
    std::vector<zc::UniqueFd> fds;
    check(connection->receive(&got, sizeof(got), &fds, milliseconds(5000)), "the message arrives");
    check(got.tag == 7 && got.bytes == 18 && fds.size() == 1, "its payload and one descriptor");
    if (fds.size() == 1) {
      char text[32] = {};
      check(pread(fds[0].get(), text, sizeof(text), 0) == 18 && std::string(text) == "expandable segment",
            "the descriptor reads the child's bytes");
    }
    const Message answer{8, 0};
    check(connection->send(&answer, sizeof(answer), {}, milliseconds(5000)), "the answer goes back");
  }
  check(wait_child(pid) == 0, "the child saw every step");
  check(listener.refused() == 0, "nothing refused");
}

void test_a_wrong_key_is_refused_and_the_next_right_one_accepted() {
  const std::string name = zc::fd_listener_name(random_job(), 1);
  zc::FdListener listener = zc::FdListener::open(name, kKey);
  const pid_t wrong = fork();
  if (wrong == 0) child(name, kKey + 1, "x", false);
  check(wait_child(wrong) == 0, "the wrong-key child connected and left");
  check(!listener.accept(milliseconds(300)).has_value(), "the wrong key is not accepted");
  check(listener.refused() == 1, "and counted as refused");
  const pid_t right = fork();
  if (right == 0) child(name, kKey, "y", true);
  std::optional<zc::FdConnection> connection = listener.accept(milliseconds(5000));
  check(connection.has_value(), "the right key after it is accepted");
  if (connection) {
    Message got{};
    std::vector<zc::UniqueFd> fds;
    check(connection->receive(&got, sizeof(got), &fds, milliseconds(5000)) && fds.size() == 1, "its message");
    const Message answer{8, 0};
    connection->send(&answer, sizeof(answer), {}, milliseconds(5000));
  }
  check(wait_child(right) == 0, "the right-key child saw every step");
}

void test_a_silent_connection_does_not_hold_the_next_one() {
  const std::string name = zc::fd_listener_name(random_job(), 3);
  zc::FdListener listener = zc::FdListener::open(name, kKey);
  int ready_pipe[2];
  check(pipe(ready_pipe) == 0, "a pipe");
  const pid_t silent = fork();
  if (silent == 0) {  // connects at the socket level and says nothing for a second
    const int socket = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    const int connected = ::connect(socket, reinterpret_cast<const sockaddr*>(&address),
                                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size()));
    const char byte = connected == 0 ? 1 : 0;
    if (write(ready_pipe[1], &byte, 1) != 1) _exit(2);
    sleep(1);
    _exit(connected == 0 ? 0 : 1);
  }
  char byte = 0;
  check(read(ready_pipe[0], &byte, 1) == 1 && byte == 1, "the silent peer connected first");
  const pid_t right = fork();
  if (right == 0) child(name, kKey, "z", true);
  const auto began = std::chrono::steady_clock::now();
  std::optional<zc::FdConnection> connection = listener.accept(milliseconds(3000));
  check(connection.has_value(), "the peer behind the silent one is accepted");
  check(std::chrono::steady_clock::now() - began < milliseconds(900), "before the silent one gives up");
  check(listener.refused() == 1, "the silent one counted as refused");
  if (connection) {
    Message got{};
    std::vector<zc::UniqueFd> fds;
    connection->receive(&got, sizeof(got), &fds, milliseconds(5000));
    const Message answer{8, 0};
    connection->send(&answer, sizeof(answer), {}, milliseconds(5000));
  }
  check(wait_child(right) == 0, "the peer behind saw every step");
  check(wait_child(silent) == 0, "the silent peer left");
  close(ready_pipe[0]);
  close(ready_pipe[1]);
}

void test_failures_return_within_the_wait() {
  const std::string name = zc::fd_listener_name(random_job(), 2);
  auto began = std::chrono::steady_clock::now();
  check(!zc::FdConnection::connect(name, kKey, milliseconds(50)).has_value(), "no listener: no connection");
  check(std::chrono::steady_clock::now() - began < std::chrono::seconds(2), "and no hang");
  zc::FdListener first = zc::FdListener::open(name, kKey);
  check(first.valid(), "the name binds");
  check(!zc::FdListener::open(name, kKey).valid(), "a taken name gives an invalid listener");
  check(!first.accept(milliseconds(20)).has_value(), "no peer: accept returns empty");
  check(!zc::FdListener::open(std::string(200, 'n'), kKey).valid(), "a name too long: invalid, no overflow");

  // A peer that closes: receive is false at once, and a send neither hangs nor raises SIGPIPE.
  const pid_t pid = fork();
  if (pid == 0) {
    std::optional<zc::FdConnection> c = zc::FdConnection::connect(name, kKey, milliseconds(5000));
    _exit(c ? 0 : 1);  // closes the socket as it exits
  }
  std::optional<zc::FdConnection> connection = first.accept(milliseconds(5000));
  check(connection.has_value(), "the closing peer's connection");
  check(wait_child(pid) == 0, "the closing peer connected");
  if (connection) {
    Message got{};
    std::vector<zc::UniqueFd> fds;
    began = std::chrono::steady_clock::now();
    check(!connection->receive(&got, sizeof(got), &fds, milliseconds(2000)), "a closed peer: receive is false");
    check(std::chrono::steady_clock::now() - began < milliseconds(1500), "at once, not at the wait's end");
    const Message sent{1, 0};
    check(!connection->send(&sent, sizeof(sent), {}, milliseconds(100)), "a send to it is false (no SIGPIPE)");
    std::vector<int> many(zc::kMaxFds + 1, 0);
    check(!connection->send(&sent, sizeof(sent), many, milliseconds(100)), "more than kMaxFds: refused");
  }
}

}  // namespace

int main() {
  test_a_descriptor_crosses_and_reads_the_same_bytes();
  test_a_wrong_key_is_refused_and_the_next_right_one_accepted();
  test_a_silent_connection_does_not_hold_the_next_one();
  test_failures_return_within_the_wait();
  std::printf("test_fd_channel: %d passed, %d failed\n", pydatacopy_test::passed, pydatacopy_test::failed);
  return pydatacopy_test::failed != 0;
}
