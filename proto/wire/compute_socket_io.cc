#include "proto/wire/compute_socket_io.h"

#include <endian.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lossd/common/status_macros.h"

namespace lossd::wire {
namespace {

static_assert(__BYTE_ORDER == __LITTLE_ENDIAN, "the Compute socket's headers are little-endian");

int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, INT_MAX));
}

}  // namespace

std::string FrameKindName(uint32_t kind) {
  return v1::ComputeSocketFrame_IsValid(static_cast<int>(kind))
             ? v1::ComputeSocketFrame_Name(static_cast<v1::ComputeSocketFrame>(kind))
             : absl::StrCat(kind);
}

absl::Status CheckFrameHeader(const FrameHeader& header, uint64_t max_length) {
  if (header.magic != kComputeSocketMagic) {
    return InvalidField("frame.magic", absl::StrFormat("0x%08x", kComputeSocketMagic),
                        absl::StrFormat("0x%08x (not a Compute socket frame)", header.magic));
  }
  if (header.length > max_length) {
    return WithField(
        absl::ResourceExhaustedError(absl::StrCat(
            "frame.length: expected at most ", max_length, " bytes for a ",
            FrameKindName(header.kind), " frame (the message limit), got ", header.length)),
        "frame.length");
  }
  return absl::OkStatus();
}

void SignalEventFd(int event_fd) {
  const uint64_t one = 1;
  // An eventfd's counter cannot overflow from a handful of writes; the result needs no check.
  [[maybe_unused]] const ssize_t written = write(event_fd, &one, sizeof(one));
}

UniqueFd NewEventFd() { return UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)); }

std::vector<iovec> FrameParts(uint32_t kind, const grpc::ByteBuffer& message,
                              std::vector<grpc::Slice>& slices, FrameHeader& header) {
  slices.clear();
  if (message.Length() > 0) (void)message.Dump(&slices);
  header.kind = kind;
  header.length = message.Length();
  std::vector<iovec> parts{{&header, sizeof(header)}};
  for (const grpc::Slice& slice : slices) {
    parts.push_back({const_cast<uint8_t*>(slice.begin()), slice.size()});
  }
  return parts;
}

bool SendStatusFrame(SocketConnection& connection, const v1::RpcStatus& status,
                     absl::Time deadline) {
  std::string payload = status.SerializeAsString();
  FrameHeader header;
  header.kind = v1::FRAME_STATUS;
  header.length = payload.size();
  return connection.WriteAll(
             {iovec{&header, sizeof(header)}, iovec{payload.data(), payload.size()}}, deadline) ==
         SocketIo::kDone;
}

SocketConnection::SocketConnection(UniqueFd fd, std::vector<int> wake_fds)
    : fd_(std::move(fd)), wake_fds_(std::move(wake_fds)) {}

SocketIo SocketConnection::Wait(short events, absl::Time deadline,
                                const std::vector<int>& extra_wake) {
  std::vector<pollfd> fds;
  fds.push_back({fd_.get(), events, 0});
  for (int fd : wake_fds_) fds.push_back({fd, POLLIN, 0});
  for (int fd : extra_wake) fds.push_back({fd, POLLIN, 0});
  while (true) {
    const int ready = poll(fds.data(), fds.size(), PollTimeoutMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return SocketIo::kPeerClosed;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) return i <= wake_fds_.size() ? SocketIo::kStopped : SocketIo::kEnded;
    }
    if (fds[0].revents != 0) return SocketIo::kDone;
    if (ready == 0 && absl::Now() >= deadline) return SocketIo::kTimedOut;
  }
}

SocketIo SocketConnection::WaitReadable(absl::Time deadline, const std::vector<int>& extra_wake) {
  return Wait(POLLIN, deadline, extra_wake);
}

SocketIo SocketConnection::ReadExact(void* out, size_t bytes, absl::Time deadline,
                                     const std::vector<int>& extra_wake) {
  auto* at = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = recv(fd_.get(), at + got, bytes - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return SocketIo::kPeerClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return SocketIo::kPeerClosed;
    const SocketIo waited = Wait(POLLIN, deadline, extra_wake);
    if (waited != SocketIo::kDone) return waited;
  }
  return SocketIo::kDone;
}

SocketIo SocketConnection::WriteAll(std::vector<iovec> parts, absl::Time deadline,
                                    const std::vector<int>& extra_wake, absl::Duration slow_after,
                                    absl::FunctionRef<void()> on_slow, int64_t* sent) {
  size_t first = 0;
  int64_t total = 0;
  bool slow_reported = slow_after <= absl::ZeroDuration();
  const absl::Time slow_at = absl::Now() + slow_after;
  while (first < parts.size()) {
    if (parts[first].iov_len == 0) {
      ++first;
      continue;
    }
    msghdr message{};
    message.msg_iov = parts.data() + first;
    message.msg_iovlen = std::min<size_t>(parts.size() - first, IOV_MAX);
    const ssize_t n = sendmsg(fd_.get(), &message, MSG_NOSIGNAL);
    if (n >= 0) {
      total += n;
      for (size_t left = static_cast<size_t>(n); left > 0;) {
        const size_t take = std::min(left, parts[first].iov_len);
        parts[first].iov_base = static_cast<uint8_t*>(parts[first].iov_base) + take;
        parts[first].iov_len -= take;
        left -= take;
        if (parts[first].iov_len == 0) ++first;
      }
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      if (sent != nullptr) *sent = total;
      return SocketIo::kPeerClosed;
    }
    SocketIo waited =
        Wait(POLLOUT, slow_reported ? deadline : std::min(deadline, slow_at), extra_wake);
    if (waited == SocketIo::kTimedOut && !slow_reported && absl::Now() < deadline) {
      slow_reported = true;
      on_slow();
      continue;
    }
    if (waited != SocketIo::kDone) {
      if (sent != nullptr) *sent = total;
      return waited;
    }
  }
  if (sent != nullptr) *sent = total;
  return SocketIo::kDone;
}

bool SocketConnection::PeerGone() const {
  pollfd p{fd_.get(), POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

bool SocketConnection::Readable() const {
  pollfd p{fd_.get(), POLLIN, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

}  // namespace lossd::wire
