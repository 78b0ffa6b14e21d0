#include "client/cpp/compute_socket_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
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

// The call's frames onto its lanes: frame m on lane m mod lanes, each lane written by a thread of
// its own, so that every lane keeps sending while another waits for its peer to take bytes. Send
// waits only until the lane's previous frame has left; the frames lend the caller's rows, which
// outlive the call.
class LanedSink final : public RequestSink {
 public:
  LanedSink(const std::vector<wire::SocketConnection*>& lanes, absl::Time deadline, int cancel_fd)
      : deadline_(deadline), cancel_fd_(cancel_fd), lanes_(lanes.size()) {
    for (size_t i = 0; i < lanes.size(); ++i) {
      lanes_[i].connection = lanes[i];
      lanes_[i].thread = std::thread([this, i] { Run(lanes_[i]); });
    }
  }
  LanedSink(const LanedSink&) = delete;
  LanedSink& operator=(const LanedSink&) = delete;
  ~LanedSink() { Close(); }

  // Waits until every frame posted has left (or failed), and ends the lanes' threads.
  void Close() {
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
    }
    for (Lane& lane : lanes_) {
      if (lane.thread.joinable()) lane.thread.join();
    }
  }

  bool Send(const wire::ComputeRequestFrame& frame) override {
    return Post(sent_++ % lanes_.size(), v1::FRAME_MESSAGE, frame.Encode());
  }
  // After the last frame: a half-close on every lane.
  void HalfCloseAll() {
    for (size_t i = 0; i < lanes_.size(); ++i) Post(i, v1::FRAME_HALF_CLOSE, grpc::ByteBuffer());
  }
  bool failed() const {
    absl::MutexLock lock(&mu_);
    return failed_;
  }
  int64_t bytes_sent() const {
    absl::MutexLock lock(&mu_);
    return bytes_;
  }

 private:
  struct Lane {
    wire::SocketConnection* connection = nullptr;
    std::optional<std::pair<uint32_t, grpc::ByteBuffer>> next;  // the frame to send next
    std::thread thread;
  };

  bool Post(size_t index, uint32_t kind, grpc::ByteBuffer message) {
    Lane& lane = lanes_[index];
    absl::MutexLock lock(&mu_);
    const auto free = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return failed_ || !lane.next.has_value();
    };
    mu_.Await(absl::Condition(&free));
    if (failed_) return false;
    lane.next.emplace(kind, std::move(message));
    return true;
  }

  void Run(Lane& lane) {
    while (true) {
      std::pair<uint32_t, grpc::ByteBuffer> frame;
      {
        absl::MutexLock lock(&mu_);
        const auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return closing_ || lane.next.has_value();
        };
        mu_.Await(absl::Condition(&ready));
        if (!lane.next.has_value()) return;  // closing, nothing left to send
        frame = std::move(*lane.next);
      }
      std::vector<grpc::Slice> slices;
      wire::FrameHeader header;
      const wire::SocketIo io = lane.connection->WriteAll(
          wire::FrameParts(frame.first, frame.second, slices, header), deadline_, {cancel_fd_});
      absl::MutexLock lock(&mu_);
      lane.next.reset();  // Post may fill it again: the frame has left (or never will)
      if (io == wire::SocketIo::kDone) {
        bytes_ += static_cast<int64_t>(sizeof(header) + header.length);
      } else {
        failed_ = true;
      }
    }
  }

  const absl::Time deadline_;
  const int cancel_fd_;
  size_t sent_ = 0;  // frames handed to Send: the sending thread's alone
  mutable absl::Mutex mu_;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Lane> lanes_;  // each Lane's `next` under mu_
};

// Draws a call's key for its lanes (ComputeSocketLanes.call_key): unguessable to other clients.
absl::StatusOr<std::string> NewCallKey() {
  std::string key(32, '\0');
  size_t got = 0;
  while (got < key.size()) {
    const ssize_t n = getrandom(key.data() + got, key.size() - got, 0);
    if (n < 0 && errno != EINTR) return ErrnoError("getrandom", errno);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return key;
}

// Sends one small frame of `kind` carrying `message`.
wire::SocketIo SendSmallFrame(wire::SocketConnection& connection, uint32_t kind,
                              const google::protobuf::MessageLite& message, absl::Time deadline) {
  const std::string payload = message.SerializeAsString();
  wire::FrameHeader header;
  header.kind = kind;
  header.length = payload.size();
  return connection.WriteAll(
      {iovec{&header, sizeof(header)}, iovec{const_cast<char*>(payload.data()), payload.size()}},
      deadline);
}

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
  if (const wire::SocketIo io = SendSmallFrame(*connection, v1::FRAME_HELLO, hello, deadline);
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
    const std::vector<wire::SocketConnection*>& lanes, absl::FunctionRef<void(RequestSink&)> send,
    absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take, GradHiddenPlace place,
    absl::Time deadline, int64_t* bytes_sent, int64_t* bytes_received) {
  const std::string where = address();
  const UniqueFd cancel = wire::NewEventFd();
  if (!cancel.valid()) return {ErrnoError("eventfd", errno), false};
  if (lanes.size() > 1) {
    absl::StatusOr<std::string> key = NewCallKey();
    if (!key.ok()) return {key.status(), false};
    v1::ComputeSocketLanes asked;
    asked.set_call_key(*key);
    asked.set_lanes(static_cast<uint32_t>(lanes.size()));
    wire::SocketIo io = SendSmallFrame(*lanes[0], v1::FRAME_LANES, asked, deadline);
    for (size_t lane = 1; lane < lanes.size() && io == wire::SocketIo::kDone; ++lane) {
      v1::ComputeSocketJoin join;
      join.set_call_key(*key);
      join.set_lane(static_cast<uint32_t>(lane));
      io = SendSmallFrame(*lanes[lane], v1::FRAME_JOIN, join, deadline);
    }
    if (io != wire::SocketIo::kDone) return {IoError(io, "opening the call's lanes", where), false};
  }
  // The sender runs beside the reader: the server stops reading rows while its results wait to
  // be read, so one thread doing both could wait on itself for a large batch.
  std::thread sender([&] {
    if (lanes.size() == 1) {
      SocketSink sink(*lanes[0], deadline, cancel.get(), bytes_sent);
      send(sink);
      if (!sink.failed()) sink.HalfClose();
      return;
    }
    LanedSink sink(lanes, deadline, cancel.get());
    send(sink);
    if (!sink.failed()) sink.HalfCloseAll();
    sink.Close();
    if (bytes_sent != nullptr) *bytes_sent += sink.bytes_sent();
  });
  Outcome outcome;
  // The server's message r comes on lane r mod lanes; its status on every lane.
  size_t read = 0;
  while (true) {
    absl::StatusOr<Frame> frame =
        ReadFrame(*lanes[read % lanes.size()], max_message_bytes_, receive_buffers_.get(), deadline,
                  where, bytes_received, &place);
    if (!frame.ok()) {
      outcome.status = frame.status();
      break;
    }
    outcome.answered = true;
    if (frame->kind == v1::FRAME_STATUS) {
      absl::StatusOr<v1::RpcStatus> status = ParseStatus(frame->body, where);
      outcome.status = status.ok() ? FromRpcStatus(*status) : status.status();
      for (size_t other = 1; other < lanes.size() && outcome.status.ok(); ++other) {
        // Read, so that each lane is clean for the next call.
        absl::StatusOr<Frame> copy =
            ReadFrame(*lanes[(read + other) % lanes.size()], max_message_bytes_, nullptr, deadline,
                      where, bytes_received);
        if (!copy.ok()) {
          outcome.status = copy.status();
        } else if (copy->kind != v1::FRAME_STATUS) {
          outcome.status = absl::InternalError(
              absl::StrCat("the Compute socket at ", where, " sent a ",
                           wire::FrameKindName(copy->kind), " after the call's status"));
        }
      }
      break;
    }
    if (frame->kind != v1::FRAME_MESSAGE) {
      outcome.status = absl::InternalError(absl::StrCat("the Compute socket at ", where, " sent a ",
                                                        wire::FrameKindName(frame->kind)));
      break;
    }
    ++read;
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

void ComputeSocketPool::KeepIdle(std::vector<std::unique_ptr<wire::SocketConnection>> connections) {
  absl::MutexLock lock(&mu_);
  for (auto& connection : connections) {
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(connection));
  }
}

absl::Status ComputeSocketPool::Call(
    absl::FunctionRef<void()> begin, absl::FunctionRef<void(RequestSink&)> send,
    absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take, GradHiddenPlace place,
    absl::Time deadline, int64_t* bytes_sent, int64_t* bytes_received, bool* unusable, int lanes) {
  if (unusable != nullptr) *unusable = false;
  const size_t count = static_cast<size_t>(std::clamp(lanes, 1, wire::kComputeSocketMaxLanes));
  std::vector<std::unique_ptr<wire::SocketConnection>> connections;
  {
    absl::MutexLock lock(&mu_);
    while (!idle_.empty() && connections.size() < count) {
      connections.push_back(std::move(idle_.back()));
      idle_.pop_back();
    }
  }
  // Those the server closed while they sat idle are no use: a lane among them would keep the call
  // waiting for it to join.
  std::erase_if(connections, [](const auto& connection) { return connection->PeerGone(); });
  const auto run = [&]() -> absl::StatusOr<Outcome> {
    while (connections.size() < count) {
      ASSIGN_OR_RETURN(std::unique_ptr<wire::SocketConnection> fresh, Connect(deadline, unusable));
      connections.push_back(std::move(fresh));
    }
    std::vector<wire::SocketConnection*> used;
    for (const auto& connection : connections) used.push_back(connection.get());
    begin();
    return CallOn(used, send, take, place, deadline, bytes_sent, bytes_received);
  };
  if (!connections.empty()) {
    ASSIGN_OR_RETURN(const Outcome kept, run());
    // A kept connection the server closed while it sat idle: the call never began there.
    if (kept.answered || !absl::IsUnavailable(kept.status)) {
      if (kept.status.ok()) KeepIdle(std::move(connections));
      return kept.status;
    }
    connections.clear();
  }
  ASSIGN_OR_RETURN(const Outcome fresh, run());
  if (fresh.status.ok()) KeepIdle(std::move(connections));
  return fresh.status;
}

}  // namespace lossd::client
