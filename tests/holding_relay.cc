#include "tests/holding_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace lossd::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

bool WriteAll(int fd, const char* data, ssize_t size) {
  while (size > 0) {
    const ssize_t written = send(fd, data, static_cast<size_t>(size), MSG_NOSIGNAL);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return false;
    data += written;
    size -= written;
  }
  return true;
}

}  // namespace

std::unique_ptr<HoldingRelay> HoldingRelay::Start(int server_port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  sockaddr_in address = Loopback(0);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, 16) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    return nullptr;
  }
  std::unique_ptr<HoldingRelay> relay(new HoldingRelay(fd, ntohs(address.sin_port), server_port));
  relay->acceptor_ = std::thread([relay = relay.get()] { relay->AcceptConnections(); });
  return relay;
}

HoldingRelay::HoldingRelay(int listen_fd, int port, int server_port)
    : listen_fd_(listen_fd), port_(port), server_port_(server_port) {}

HoldingRelay::~HoldingRelay() {
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    holding_ = false;
    // Wakes every blocked accept, recv and send.
    shutdown(listen_fd_, SHUT_RDWR);
    for (int fd : sockets_) shutdown(fd, SHUT_RDWR);
  }
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    pumps.swap(pumps_);
  }
  for (std::thread& pump : pumps) pump.join();
  absl::MutexLock lock(&mu_);
  for (int fd : sockets_) close(fd);
  close(listen_fd_);
}

void HoldingRelay::Hold() {
  absl::MutexLock lock(&mu_);
  holding_ = true;
}

void HoldingRelay::Release() {
  absl::MutexLock lock(&mu_);
  holding_ = false;
}

void HoldingRelay::Drop() {
  absl::MutexLock lock(&mu_);
  // Shut first: a pump released below can then deliver nothing more.
  for (int fd : sockets_) shutdown(fd, SHUT_RDWR);
  holding_ = false;
}

void HoldingRelay::AcceptConnections() {
  while (true) {
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // shut down
    }
    const int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in address = Loopback(server_port_);
    if (server < 0 ||
        connect(server, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
      close(client);
      if (server >= 0) close(server);
      continue;
    }
    const int one = 1;
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    absl::MutexLock lock(&mu_);
    sockets_.push_back(client);
    sockets_.push_back(server);
    if (stopping_) {
      shutdown(client, SHUT_RDWR);
      shutdown(server, SHUT_RDWR);
    }
    pumps_.emplace_back([this, client, server] { Pump(client, server, false); });
    pumps_.emplace_back([this, client, server] { Pump(server, client, true); });
  }
}

void HoldingRelay::Pump(int from, int to, bool from_server) {
  char buffer[64 * 1024];
  while (true) {
    const ssize_t received = recv(from, buffer, sizeof(buffer), 0);
    if (received < 0 && errno == EINTR) continue;
    if (received <= 0) break;
    if (from_server) {
      absl::MutexLock lock(&mu_);
      auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !holding_; };
      mu_.Await(absl::Condition(&released));
    }
    if (!WriteAll(to, buffer, received)) break;
  }
  // Passes the end on, so that the other side sees the connection close.
  shutdown(to, SHUT_WR);
}

int HoldingRelay::connections() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sockets_.size() / 2);
}

}  // namespace lossd::testing
