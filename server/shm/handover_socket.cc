#include "server/shm/handover_socket.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "lossd/common/status_macros.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::server {
namespace {

struct Connection {
  UniqueFd socket;
  uint64_t id = 0;
  uint32_t user = 0;  // the peer's uid, from the kernel (SO_PEERCRED)
};

socklen_t AbstractAddress(const std::string& name, sockaddr_un& address) {
  std::memset(&address, 0, sizeof address);
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// Sends one reply; false when the peer cannot take it (gone, or not reading its replies).
bool SendReply(int socket, const absl::StatusOr<std::string>& outcome) {
  v1::HandoverReply reply;
  reply.set_code(static_cast<int>(outcome.status().code()));
  if (outcome.ok()) {
    reply.set_handle(*outcome);
  } else {
    reply.set_message(std::string(outcome.status().message()));
  }
  const std::string bytes = reply.SerializeAsString();
  return send(socket, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(bytes.size());
}

// The answer to one request: the handle registered or released, or why it was refused.
absl::StatusOr<std::string> Answer(SharedMemoryMaps& maps, const Connection& connection,
                                   const char* data, size_t size, int flags,
                                   std::vector<UniqueFd> descriptors) {
  if ((flags & MSG_CTRUNC) != 0) {
    return InvalidField("request",
                        absl::StrCat("at most ", HandoverSocket::kMaxDescriptorsPerMessage,
                                     " descriptors (exactly one with register_memfd)"),
                        "more");
  }
  if ((flags & MSG_TRUNC) != 0) {
    return InvalidField(
        "request",
        absl::StrCat("a message of at most ", HandoverSocket::kMaxRequestBytes, " bytes"),
        "a longer one");
  }
  v1::HandoverRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) {
    return InvalidField("request", "a serialized lossd.v1.HandoverRequest",
                        absl::StrCat(size, " bytes that are not one"));
  }
  switch (request.kind_case()) {
    case v1::HandoverRequest::kRegisterMemfd:
      if (descriptors.size() != 1) {
        return InvalidField("register_memfd",
                            "exactly one descriptor, in an SCM_RIGHTS control message",
                            absl::StrCat(descriptors.size()));
      }
      return maps.Register(std::move(descriptors.front()), connection.id, connection.user);
    case v1::HandoverRequest::kReleaseHandle:
      if (!descriptors.empty()) {
        return InvalidField("release_handle", "no descriptor", absl::StrCat(descriptors.size()));
      }
      RETURN_IF_ERROR(maps.Release(request.release_handle().handle(), connection.id));
      return request.release_handle().handle();
    default: return InvalidField("request", "register_memfd or release_handle", "neither");
  }
}

// Reads one message from `connection` and answers it; false when the connection is to be closed.
bool ServeMessage(SharedMemoryMaps& maps, const Connection& connection) {
  char data[HandoverSocket::kMaxRequestBytes];
  constexpr size_t kControlBytes =
      CMSG_SPACE(sizeof(int) * HandoverSocket::kMaxDescriptorsPerMessage);
  alignas(cmsghdr) char control[kControlBytes];
  iovec vector{data, sizeof data};
  msghdr message{};
  message.msg_iov = &vector;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  const ssize_t received =
      recvmsg(connection.socket.get(), &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (received < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  // Every descriptor that came is owned here, and closed unless it is registered.
  std::vector<UniqueFd> descriptors;
  for (cmsghdr* part = CMSG_FIRSTHDR(&message); part != nullptr;
       part = CMSG_NXTHDR(&message, part)) {
    if (part->cmsg_level != SOL_SOCKET || part->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (part->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(part) + i * sizeof(int), sizeof fd);
      descriptors.emplace_back(fd);
    }
  }
  // The end of the stream (a SOCK_SEQPACKET peer that closes reads as an empty message).
  if (received == 0 && descriptors.empty() && (message.msg_flags & MSG_CTRUNC) == 0) return false;
  return SendReply(connection.socket.get(),
                   Answer(maps, connection, data, static_cast<size_t>(received), message.msg_flags,
                          std::move(descriptors)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HandoverSocket>> HandoverSocket::Open(SharedMemoryMaps& maps,
                                                                     Limits limits) {
  UniqueFd listener(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listener.valid()) return ErrnoError("shared memory: handover socket", errno);
  // A name no other process can know in advance, so none can have bound it first.
  std::string name;
  for (int attempt = 0;; ++attempt) {
    char random[16];
    if (getentropy(random, sizeof random) != 0) {
      return ErrnoError("shared memory: random name of the handover socket", errno);
    }
    name = absl::StrCat("lossd-shm-",
                        absl::BytesToHexString(absl::string_view(random, sizeof random)));
    sockaddr_un address;
    const socklen_t length = AbstractAddress(name, address);
    if (bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), length) == 0) break;
    if (errno != EADDRINUSE || attempt == 3) {
      return ErrnoError(absl::StrCat("shared memory: binding the handover socket @", name), errno);
    }
  }
  if (listen(listener.get(), SOMAXCONN) != 0) {
    return ErrnoError("shared memory: listening on the handover socket", errno);
  }
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoError("shared memory: eventfd of the handover socket", errno);
  return std::unique_ptr<HandoverSocket>(
      new HandoverSocket(maps, limits, std::move(listener), std::move(wake), std::move(name)));
}

HandoverSocket::HandoverSocket(SharedMemoryMaps& maps, Limits limits, UniqueFd listener,
                               UniqueFd wake, std::string abstract_name)
    : maps_(maps),
      limits_(limits),
      listener_(std::move(listener)),
      wake_(std::move(wake)),
      abstract_name_(std::move(abstract_name)),
      thread_([this] { Serve(); }) {}

HandoverSocket::~HandoverSocket() {
  const uint64_t one = 1;
  // An eventfd's counter cannot overflow from one write; nothing else writes it.
  (void)!write(wake_.get(), &one, sizeof one);
  thread_.join();
}

void HandoverSocket::Serve() {
  std::vector<Connection> connections;
  uint64_t next_id = 1;
  auto close_connection = [&](size_t index) {
    maps_.RevokeConnection(connections[index].id);
    connections.erase(connections.begin() + static_cast<std::ptrdiff_t>(index));
  };
  std::vector<pollfd> polled;
  while (true) {
    polled.assign({{wake_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}});
    for (const Connection& connection : connections) {
      polled.push_back({connection.socket.get(), POLLIN, 0});
    }
    if (poll(polled.data(), polled.size(), -1) < 0) {
      if (errno != EINTR) absl::SleepFor(absl::Milliseconds(10));  // ENOMEM: try again shortly
      continue;
    }
    if (polled[0].revents != 0) break;

    // Connections first, by index from the back, so that closing one leaves the others' places.
    for (size_t i = connections.size(); i-- > 0;) {
      const short events = polled[i + 2].revents;
      if (events == 0) continue;
      const bool keep = (events & POLLIN) != 0 ? ServeMessage(maps_, connections[i]) : false;
      if (!keep) close_connection(i);
    }
    if ((polled[1].revents & POLLIN) != 0) {
      UniqueFd accepted(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!accepted.valid()) {
        // No descriptor to spare (EMFILE): the connection waits, and the loop must not spin on it.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          absl::SleepFor(absl::Milliseconds(10));
        }
        continue;  // or the peer left already
      }
      if (connections.size() >= limits_.max_connections) {
        SendReply(accepted.get(),
                  absl::ResourceExhaustedError(
                      absl::StrCat("connection: expected at most ", limits_.max_connections,
                                   " open handover connections, got one more; try again later")));
        continue;
      }
      ucred peer{};
      socklen_t peer_size = sizeof peer;
      if (getsockopt(accepted.get(), SOL_SOCKET, SO_PEERCRED, &peer, &peer_size) != 0) {
        SendReply(accepted.get(), ErrnoError("connection: SO_PEERCRED of the peer", errno));
        continue;
      }
      const size_t of_user =
          std::count_if(connections.begin(), connections.end(),
                        [&](const Connection& open) { return open.user == peer.uid; });
      if (of_user >= limits_.max_connections_per_user) {
        SendReply(accepted.get(),
                  absl::ResourceExhaustedError(absl::StrCat(
                      "connection: expected at most ", limits_.max_connections_per_user,
                      " open handover connections per local user (uid ", peer.uid,
                      "), got one more; try again later")));
        continue;
      }
      connections.push_back({std::move(accepted), next_id++, static_cast<uint32_t>(peer.uid)});
    }
  }
  while (!connections.empty()) close_connection(connections.size() - 1);
}

}  // namespace lossd::server
