#include "client/cpp/compute_socket_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lossd/client/client.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {
namespace {

constexpr size_t kMaxIdleConnections = 8;
// A connection that does not open within this is not worth holding a call for: a port the network
// drops would otherwise take the call's whole deadline.
constexpr absl::Duration kConnectLimit = absl::Seconds(10);
// After the socket could not be reached, calls go another way for this long before it is tried
// again.
constexpr absl::Duration kUnreachableFor = absl::Seconds(60);

// A result message at least this long has its dL/dh received straight where it goes, found from
// its first kHeadBytes (the server writes a result's other fields first).
constexpr uint64_t kPlacedMinBytes = 256 << 10;
constexpr uint64_t kHeadBytes = 64 << 10;

struct Frame {
  uint32_t kind = 0;
  grpc::Slice body;
  // A message whose result's dL/dh was received into place: its bytes before dL/dh, then dL/dh
  // where it lies (body is then unused).
  std::vector<grpc::Slice> placed;
};

absl::Status IoError(wire::SocketIo io, absl::string_view what, absl::string_view where) {
  if (io == wire::SocketIo::kTimedOut) {
    return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed while ", what,
                                                    " (Compute socket at ", where, ")"));
  }
  return absl::UnavailableError(
      absl::StrCat("the connection to the Compute socket at ", where, " ended while ", what));
}

// Reads the `length` bytes of a message frame into `frame`: into its body, but for a result's
// dL/dh, which goes where `place` says when it is the message's last field.
wire::SocketIo ReadMessage(wire::SocketConnection& connection, uint64_t length, absl::Time deadline,
                           GradHiddenPlace place, Frame& frame) {
  auto* const body = const_cast<uint8_t*>(frame.body.begin());
  if (length < kPlacedMinBytes) return connection.ReadExact(body, length, deadline);
  const uint64_t head = std::min(length, kHeadBytes);
  const wire::SocketIo io = connection.ReadExact(body, head, deadline);
  if (io != wire::SocketIo::kDone) return io;
  const std::optional<wire::BulkFieldAt> grad =
      wire::FindBulkField({body, head}, length, wire::ComputeResponseFrame::kSpec,
                          v1::ComputeResult::kGradHiddenFieldNumber);
  v1::ComputeResult before;  // the result's fields before dL/dh: where its rows go
  uint8_t* into = nullptr;
  if (grad.has_value() && grad->value_offset + grad->value_size == length &&
      before.ParseFromArray(body + grad->member_offset,
                            static_cast<int>(grad->key_offset - grad->member_offset))) {
    into = place(before, static_cast<int64_t>(grad->value_size));
  }
  if (into == nullptr) return connection.ReadExact(body + head, length - head, deadline);
  const uint64_t in_head = head - grad->value_offset;
  std::memcpy(into, body + grad->value_offset, in_head);
  frame.placed = {frame.body.sub(0, grad->value_offset),
                  grpc::Slice(into, grad->value_size, grpc::Slice::STATIC_SLICE)};
  return connection.ReadExact(into + in_head, grad->value_size - in_head, deadline);
}

// Reads one frame into a slice (pooled when `pool` is given and it is a message): a status of
// at most kComputeSocketMaxStatusBytes, else of at most `max_message_bytes`; a result's dL/dh
// where `place` (when given) says.
absl::StatusOr<Frame> ReadFrame(wire::SocketConnection& connection, int64_t max_message_bytes,
                                wire::MessageBufferPool* pool, absl::Time deadline,
                                absl::string_view where, int64_t* bytes_received,
                                const GradHiddenPlace* place = nullptr) {
  wire::FrameHeader header;
  const wire::SocketIo io = connection.ReadExact(&header, sizeof(header), deadline);
  if (io != wire::SocketIo::kDone) return IoError(io, "reading results", where);
  const uint64_t limit = header.kind == v1::FRAME_STATUS ? wire::kComputeSocketMaxStatusBytes
                                                         : static_cast<uint64_t>(max_message_bytes);
  if (const absl::Status checked = wire::CheckFrameHeader(header, limit); !checked.ok()) {
    return absl::InternalError(
        absl::StrCat("the Compute socket at ", where, " sent a bad frame: ", checked.message()));
  }
  Frame frame;
  frame.kind = header.kind;
  frame.body = pool != nullptr && header.kind == v1::FRAME_MESSAGE
                   ? pool->Allocate(static_cast<size_t>(header.length))
                   : grpc::Slice(static_cast<size_t>(header.length));
  const wire::SocketIo body_io =
      place != nullptr && header.kind == v1::FRAME_MESSAGE
          ? ReadMessage(connection, header.length, deadline, *place, frame)
          : connection.ReadExact(const_cast<uint8_t*>(frame.body.begin()), frame.body.size(),
                                 deadline);
  if (body_io != wire::SocketIo::kDone) return IoError(body_io, "reading results", where);
  if (bytes_received != nullptr) {
    *bytes_received += static_cast<int64_t>(sizeof(header) + header.length);
  }
  return frame;
}

absl::StatusOr<v1::RpcStatus> ParseStatus(const grpc::Slice& body, absl::string_view where) {
  v1::RpcStatus status;
  if (!status.ParseFromArray(body.begin(), static_cast<int>(body.size()))) {
    return absl::InternalError(
        absl::StrCat("the Compute socket at ", where, " sent a status that does not parse"));
  }
  return status;
}

// The call's frames onto the connection; after the last, the half-close.
class SocketSink final : public RequestSink {
 public:
  SocketSink(wire::SocketConnection& connection, absl::Time deadline, int cancel_fd,
             int64_t* bytes_sent)
      : connection_(connection), deadline_(deadline), cancel_fd_(cancel_fd), bytes_(bytes_sent) {}

  bool Send(const wire::ComputeRequestFrame& frame) override {
    return Write(v1::FRAME_MESSAGE, frame.Encode());
  }
  bool HalfClose() { return Write(v1::FRAME_HALF_CLOSE, grpc::ByteBuffer()); }
  bool failed() const { return failed_; }

 private:
  bool Write(uint32_t kind, const grpc::ByteBuffer& message) {
    if (failed_) return false;
    std::vector<grpc::Slice> slices;
    wire::FrameHeader header;
    const wire::SocketIo io = connection_.WriteAll(wire::FrameParts(kind, message, slices, header),
                                                   deadline_, {cancel_fd_});
    failed_ = io != wire::SocketIo::kDone;
    if (!failed_ && bytes_ != nullptr) {
      *bytes_ += static_cast<int64_t>(sizeof(header) + header.length);
    }
    return !failed_;
  }

  wire::SocketConnection& connection_;
  const absl::Time deadline_;
  const int cancel_fd_;
  int64_t* const bytes_;
  bool failed_ = false;
};

}  // namespace

ComputeSocketPool::ComputeSocketPool(std::string host, int port, std::string token,
                                     int64_t max_message_bytes)
    : host_(std::move(host)),
      port_(port),
      token_(std::move(token)),
      max_message_bytes_(max_message_bytes) {}

std::string ComputeSocketPool::address() const {
  return absl::StrContains(host_, ':') ? absl::StrCat("[", host_, "]:", port_)
                                       : absl::StrCat(host_, ":", port_);
}

absl::StatusOr<std::unique_ptr<wire::SocketConnection>> ComputeSocketPool::Connect(
    absl::Time deadline, bool* unusable) {
  const std::string where = address();
  {
    absl::MutexLock lock(&mu_);
    if (absl::Now() < unreachable_until_) {
      if (unusable != nullptr) *unusable = true;
      return absl::UnavailableError(
          absl::StrCat("the Compute socket at ", where, " could not be reached lately"));
    }
  }
  const absl::Time connect_deadline = std::min(deadline, absl::Now() + kConnectLimit);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(port_);
  if (const int resolved = getaddrinfo(host_.c_str(), port.c_str(), &hints, &found);
      resolved != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve the Compute socket at ", where, ": ", gai_strerror(resolved)));
  }
  UniqueFd fd;
  int error = 0;
  for (const addrinfo* a = found; a != nullptr && !fd.valid(); a = a->ai_next) {
    UniqueFd attempt(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!attempt.valid()) {
      error = errno;
      continue;
    }
    if (connect(attempt.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      error = errno;
      continue;
    }
    // Connected (or refused) once writable; a refusal shows in SO_ERROR.
    pollfd p{attempt.get(), POLLOUT, 0};
    const int wait_ms = static_cast<int>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(connect_deadline - absl::Now()) + 1));
    if (poll(&p, 1, wait_ms) != 1) {
      error = ETIMEDOUT;
      continue;
    }
    socklen_t size = sizeof(error);
    getsockopt(attempt.get(), SOL_SOCKET, SO_ERROR, &error, &size);
    if (error == 0) fd = std::move(attempt);
  }
  freeaddrinfo(found);
  if (!fd.valid()) {
    absl::MutexLock lock(&mu_);
    unreachable_until_ = absl::Now() + kUnreachableFor;
    if (unusable != nullptr) *unusable = true;
  }
  if (!fd.valid()) {
    if (error == ETIMEDOUT) {
      return absl::UnavailableError(absl::StrCat("no connection to the Compute socket at ", where,
                                                 " within ", absl::FormatDuration(kConnectLimit)));
    }
    return absl::UnavailableError(
        absl::StrCat("cannot reach the Compute socket at ", where, ": ", std::strerror(error)));
  }
  const int on = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
  auto connection = std::make_unique<wire::SocketConnection>(std::move(fd), std::vector<int>{});

  v1::ComputeSocketHello hello;
  hello.set_token(token_);
  std::string payload = hello.SerializeAsString();
  wire::FrameHeader header;
  header.kind = v1::FRAME_HELLO;
  header.length = payload.size();
  if (const wire::SocketIo io = connection->WriteAll(
          {iovec{&header, sizeof(header)}, iovec{payload.data(), payload.size()}}, deadline);
      io != wire::SocketIo::kDone) {
    return IoError(io, "saying hello", where);
  }
  ASSIGN_OR_RETURN(const Frame answer,
                   ReadFrame(*connection, max_message_bytes_, nullptr, deadline, where, nullptr));
  if (answer.kind != v1::FRAME_STATUS) {
    return absl::InternalError(absl::StrCat("the Compute socket at ", where,
                                            " answered its hello with a ",
                                            wire::FrameKindName(answer.kind)));
  }
  ASSIGN_OR_RETURN(const v1::RpcStatus status, ParseStatus(answer.body, where));
  const absl::Status answered = FromRpcStatus(status);
  if (absl::IsResourceExhausted(answered) && unusable != nullptr) *unusable = true;
  RETURN_IF_ERROR(answered);
  return connection;
}

ComputeSocketPool::Outcome ComputeSocketPool::CallOn(
    wire::SocketConnection& connection, absl::FunctionRef<void(RequestSink&)> send,
    absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take, GradHiddenPlace place,
    absl::Time deadline, int64_t* bytes_sent, int64_t* bytes_received) {
  const std::string where = address();
  const UniqueFd cancel = wire::NewEventFd();
  if (!cancel.valid()) return {ErrnoError("eventfd", errno), false};
  // The sender runs beside the reader: the server stops reading rows while its results wait to
  // be read, so one thread doing both could wait on itself for a large batch.
  std::thread sender([&] {
    SocketSink sink(connection, deadline, cancel.get(), bytes_sent);
    send(sink);
    if (!sink.failed()) sink.HalfClose();
  });
  Outcome outcome;
  while (true) {
    absl::StatusOr<Frame> frame = ReadFrame(connection, max_message_bytes_, receive_buffers_.get(),
                                            deadline, where, bytes_received, &place);
    if (!frame.ok()) {
      outcome.status = frame.status();
      break;
    }
    outcome.answered = true;
    if (frame->kind == v1::FRAME_STATUS) {
      absl::StatusOr<v1::RpcStatus> status = ParseStatus(frame->body, where);
      outcome.status = status.ok() ? FromRpcStatus(*status) : status.status();
      break;
    }
    if (frame->kind != v1::FRAME_MESSAGE) {
      outcome.status = absl::InternalError(absl::StrCat("the Compute socket at ", where, " sent a ",
                                                        wire::FrameKindName(frame->kind)));
      break;
    }
    wire::ComputeResponseFrame response;
    const grpc::ByteBuffer message =
        frame->placed.empty() ? grpc::ByteBuffer(&frame->body, 1)
                              : grpc::ByteBuffer(frame->placed.data(), frame->placed.size());
    outcome.status = response.Decode(message);
    if (outcome.status.ok()) outcome.status = take(response);
    if (!outcome.status.ok()) break;
  }
  if (!outcome.status.ok()) {
    // The sender may wait on a server that stopped reading: it stops now.
    wire::SignalEventFd(cancel.get());
  }
  sender.join();
  return outcome;
}

absl::Status ComputeSocketPool::Call(
    absl::FunctionRef<void()> begin, absl::FunctionRef<void(RequestSink&)> send,
    absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take, GradHiddenPlace place,
    absl::Time deadline, int64_t* bytes_sent, int64_t* bytes_received, bool* unusable) {
  if (unusable != nullptr) *unusable = false;
  std::unique_ptr<wire::SocketConnection> connection;
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      connection = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (connection != nullptr) {
    begin();
    Outcome kept = CallOn(*connection, send, take, place, deadline, bytes_sent, bytes_received);
    // A kept connection the server closed while it sat idle: the call never began there.
    if (kept.answered || !absl::IsUnavailable(kept.status)) {
      if (kept.status.ok()) {
        absl::MutexLock lock(&mu_);
        if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(connection));
      }
      return kept.status;
    }
  }
  ASSIGN_OR_RETURN(connection, Connect(deadline, unusable));
  begin();
  Outcome fresh = CallOn(*connection, send, take, place, deadline, bytes_sent, bytes_received);
  if (fresh.status.ok()) {
    absl::MutexLock lock(&mu_);
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(connection));
  }
  return fresh.status;
}

}  // namespace lossd::client
