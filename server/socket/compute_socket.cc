#include "server/socket/compute_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "lossd/common/status_macros.h"
#include "server/shm/shared_memory.h"
#include "server/status/grpc_status.h"

namespace lossd::server {
namespace {

// How long a connection that ends after a failed call keeps reading what its client still sends,
// so that the kernel does not reset the connection (and drop the status the client has yet to
// read) over unread bytes; a client closes its end once it has read the status.
constexpr absl::Duration kLingerAfterFailure = absl::Seconds(2);
// How long a status may take to leave: a few hundred bytes, which a client that reads at all
// takes at once.
constexpr absl::Duration kStatusSendLimit = absl::Seconds(2);

// The peer as gRPC's ServerContext::peer() would name it ("ipv4:127.0.0.1:5000",
// "ipv6:[::1]:5000"), so that what keys on peers (pending memory's shares, IsLocalPeer) treats
// both transports alike.
std::string PeerName(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    inet_ntop(AF_INET, &v4.sin_addr, text, sizeof(text));
    return absl::StrCat("ipv4:", text, ":", ntohs(v4.sin_port));
  }
  const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
  inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof(text));
  return absl::StrCat("ipv6:[", text, "]:", ntohs(v6.sin6_port));
}

// Sends `status` as a FRAME_STATUS on a connection no stream writes on.
bool SendStatus(SocketConnection& connection, const absl::Status& status) {
  return wire::SendStatusFrame(connection, ToRpcStatus(status), absl::Now() + kStatusSendLimit);
}

// Closes a connection whose client may still be sending: our end first, then what comes is read
// and dropped until the client closes or the linger ends.
void CloseAfterFailure(SocketConnection& connection) {
  shutdown(connection.fd(), SHUT_WR);
  const absl::Time deadline = absl::Now() + kLingerAfterFailure;
  std::array<char, 1 << 16> scratch;
  while (connection.WaitReadable(deadline) == SocketIo::kDone) {
    const ssize_t n = recv(connection.fd(), scratch.data(), scratch.size(), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
  }
}

}  // namespace

SocketComputeStream::SocketComputeStream(SocketConnection& connection, std::string peer,
                                         bool peer_is_local, Limits limits,
                                         std::shared_ptr<wire::MessageBufferPool> receive_buffers)
    : lanes_{&connection},
      peer_(std::move(peer)),
      peer_is_local_(peer_is_local),
      limits_(limits),
      receive_buffers_(std::move(receive_buffers)),
      ended_fd_(wire::NewEventFd()) {
  absl::MutexLock read_lock(&read_mu_);
  lane_half_closed_.assign(1, false);
  absl::MutexLock write_lock(&write_mu_);
  lane_writes_broken_.assign(1, false);
}

void SocketComputeStream::AddLanes(const std::vector<SocketConnection*>& lanes) {
  lanes_.insert(lanes_.end(), lanes.begin(), lanes.end());
  absl::MutexLock read_lock(&read_mu_);
  lane_half_closed_.assign(lanes_.size(), false);
  absl::MutexLock write_lock(&write_mu_);
  lane_writes_broken_.assign(lanes_.size(), false);
}

SocketComputeStream::Opening SocketComputeStream::ReadOpening(absl::Duration limit) {
  absl::MutexLock lock(&read_mu_);
  if (!ended_fd_.valid()) {
    // Without it nothing could end a read that waits on a silent client.
    first_taken_ = true;
    End(absl::ResourceExhaustedError(
        "the server is out of file descriptors; retry, or send the call over gRPC"));
    return Opening::kRefused;
  }
  // Lanes are asked for once, before the call's first message.
  const bool lanes_may_come = lanes_.size() == 1 && lanes_asked_.lanes() == 0;
  switch (ReadFrame(0, &first_, absl::Now() + limit, {ended_fd_.get()}, {}, lanes_may_come)) {
    case FrameRead::kMessage:
    case FrameRead::kHalfClose: return Opening::kCall;
    case FrameRead::kLanes: return Opening::kLanes;
    case FrameRead::kJoin: return Opening::kJoin;
    case FrameRead::kFailed: break;
  }
  first_taken_ = true;
  if (last_io_ == SocketIo::kTimedOut) End(StreamIdleError("the call's first message", limit));
  absl::MutexLock write_lock(&write_mu_);
  return ended_ ? Opening::kRefused : Opening::kGone;
}

bool SocketComputeStream::Read(wire::ComputeRequestFrame* request) {
  return ReadRowsInto(request, {});
}

bool SocketComputeStream::ReadRowsInto(wire::ComputeRequestFrame* request,
                                       absl::Span<uint8_t> rows_destination) {
  absl::MutexLock lock(&read_mu_);
  if (!first_taken_) {
    first_taken_ = true;
    if (half_closed_) return false;  // an empty call: the half-close came first
    *request = std::move(first_);
    return true;
  }
  if (reads_over_ || half_closed_ || EndedFdFired()) return false;
  return ReadFrame(messages_read_ % lanes_.size(), request, absl::InfiniteFuture(),
                   {ended_fd_.get()}, rows_destination) == FrameRead::kMessage;
}

SocketIo SocketComputeStream::ReadMessageBody(SocketConnection& connection, uint64_t length,
                                              absl::Time deadline, const std::vector<int>& wake,
                                              absl::Span<uint8_t> rows_destination,
                                              grpc::ByteBuffer& message) {
  // Rows come in messages of megabytes, mostly of one size: pooled, their pages stay mapped
  // from call to call instead of being faulted in again for every message.
  constexpr uint64_t kPooledMessageBytes = 256 << 10;
  // Enough for a chunk's key and length and its hidden rows' (at most 22 bytes), which both
  // clients write first.
  constexpr uint64_t kHeadBytes = 32;
  grpc::Slice slice = length >= kPooledMessageBytes
                          ? receive_buffers_->Allocate(static_cast<size_t>(length))
                          : grpc::Slice(static_cast<size_t>(length));
  uint8_t* const body = const_cast<uint8_t*>(slice.begin());
  uint64_t head = 0;  // bytes read so far
  std::optional<wire::BulkFieldAt> rows;
  if (static_cast<int64_t>(length) >= limits_.rows_in_place_min_bytes &&
      rows_destination.size() >= kHeadBytes) {
    head = std::min(length, kHeadBytes);
    const SocketIo io = connection.ReadExact(body, head, deadline, wake);
    if (io != SocketIo::kDone) return io;
    rows = wire::FindBulkField({body, head}, length, wire::ComputeRequestFrame::kSpec,
                               v1::ComputeChunk::kHiddenFieldNumber);
  }
  if (!rows.has_value()) {
    const SocketIo io = connection.ReadExact(body + head, length - head, deadline, wake);
    message = grpc::ByteBuffer(&slice, 1);
    return io;
  }
  // The rows' first bytes came with the head; the rest of those that fit are read in place, and
  // everything after them into the pooled slice, at their offsets in the message.
  const uint64_t placed = std::min<uint64_t>(rows->value_size, rows_destination.size());
  const uint64_t in_head = head - rows->value_offset;  // < kHeadBytes <= placed
  std::memcpy(rows_destination.data(), body + rows->value_offset, in_head);
  SocketIo io =
      connection.ReadExact(rows_destination.data() + in_head, placed - in_head, deadline, wake);
  const uint64_t after = rows->value_offset + placed;
  if (io == SocketIo::kDone) {
    io = connection.ReadExact(body + after, length - after, deadline, wake);
  }
  const grpc::Slice pieces[] = {
      slice.sub(0, rows->value_offset),
      grpc::Slice(rows_destination.data(), placed, grpc::Slice::STATIC_SLICE),
      slice.sub(after, length),
  };
  message = grpc::ByteBuffer(pieces, 3);
  return io;
}

absl::Status SocketComputeStream::ReadOpeningBody(SocketConnection& connection,
                                                  const FrameHeader& header, absl::Time deadline,
                                                  const std::vector<int>& wake,
                                                  google::protobuf::MessageLite& message) {
  if (header.length > static_cast<uint64_t>(wire::kComputeSocketMaxHelloBytes)) {
    return InvalidField("frame.length",
                        absl::StrCat("at most ", wire::kComputeSocketMaxHelloBytes, " bytes for a ",
                                     wire::FrameKindName(header.kind)),
                        absl::StrCat(header.length));
  }
  std::string body(header.length, '\0');
  last_io_ = connection.ReadExact(body.data(), body.size(), deadline, wake);
  if (last_io_ != SocketIo::kDone) return absl::OkStatus();  // the caller reads last_io_
  if (!message.ParseFromString(body)) {
    return InvalidField(header.kind == v1::FRAME_LANES ? "lanes" : "join",
                        absl::StrCat("a ", message.GetTypeName()),
                        "bytes that do not parse as one");
  }
  return absl::OkStatus();
}

SocketComputeStream::FrameRead SocketComputeStream::ReadFrame(
    size_t lane, wire::ComputeRequestFrame* request, absl::Time deadline,
    const std::vector<int>& wake, absl::Span<uint8_t> rows_destination, bool opening) {
  SocketConnection& connection = *lanes_[lane];
  FrameHeader header;
  SocketIo io = connection.ReadExact(&header, sizeof(header), deadline, wake);
  last_io_ = io;
  absl::Status broken;
  if (io == SocketIo::kDone) {
    broken = wire::CheckFrameHeader(header, static_cast<uint64_t>(limits_.max_message_bytes));
    const bool lanes_or_join = header.kind == v1::FRAME_LANES || header.kind == v1::FRAME_JOIN;
    if (broken.ok() && header.kind == v1::FRAME_HALF_CLOSE) {
      if (header.length == 0) {
        lane_half_closed_[lane] = true;
        if (lane == messages_read_ % lanes_.size()) half_closed_ = true;
        return FrameRead::kHalfClose;
      }
      broken = InvalidField("frame.length", "0 for FRAME_HALF_CLOSE", absl::StrCat(header.length));
    } else if (broken.ok() && opening && lanes_or_join) {
      const bool lanes = header.kind == v1::FRAME_LANES;
      broken = lanes ? ReadOpeningBody(connection, header, deadline, wake, lanes_asked_)
                     : ReadOpeningBody(connection, header, deadline, wake, join_asked_);
      io = last_io_;
      if (broken.ok() && io == SocketIo::kDone) return lanes ? FrameRead::kLanes : FrameRead::kJoin;
    } else if (broken.ok() && header.kind != v1::FRAME_MESSAGE) {
      broken = InvalidField("frame.kind",
                            opening ? "FRAME_MESSAGE, FRAME_HALF_CLOSE, FRAME_LANES or FRAME_JOIN "
                                      "to begin a call"
                                    : "FRAME_MESSAGE or FRAME_HALF_CLOSE during a call",
                            wire::FrameKindName(header.kind));
    }
    if (broken.ok() && header.kind == v1::FRAME_MESSAGE) {
      grpc::ByteBuffer message;
      io = ReadMessageBody(connection, header.length, deadline, wake, rows_destination, message);
      last_io_ = io;
      if (io == SocketIo::kDone) {
        broken = request->Decode(message);
        if (broken.ok()) {
          ++messages_read_;
          return FrameRead::kMessage;
        }
      }
    }
  }
  reads_over_ = true;
  switch (io) {
    case SocketIo::kDone: break;  // `broken` says why
    case SocketIo::kPeerClosed:
      peer_closed_.store(true, std::memory_order_release);
      return FrameRead::kFailed;
    case SocketIo::kStopped:
      broken = absl::UnavailableError("the server is shutting down; the call was ended");
      break;
    case SocketIo::kTimedOut:
    case SocketIo::kEnded: return FrameRead::kFailed;
  }
  End(broken);
  return FrameRead::kFailed;
}

bool SocketComputeStream::Write(const v1::ComputeResponse& response,
                                const wire::BulkBytes& grad_hidden) {
  return WriteOrStall(response, grad_hidden, [] {});
}

bool SocketComputeStream::WriteOrStall(const v1::ComputeResponse& response,
                                       const wire::BulkBytes& grad_hidden,
                                       absl::FunctionRef<void()> on_stall) {
  // As gRPC's writes: a message that has not left after this long counts as stalled.
  constexpr absl::Duration kStallGrace = absl::Milliseconds(20);
  const grpc::ByteBuffer message = wire::EncodeComputeResponse(response, grad_hidden);
  std::vector<grpc::Slice> slices;
  FrameHeader header;
  std::vector<iovec> parts = wire::FrameParts(v1::FRAME_MESSAGE, message, slices, header);
  size_t lane = 0;
  {
    absl::MutexLock lock(&write_mu_);
    write_mu_.Await(absl::Condition(
        +[](bool* writing) { return !*writing; }, &writing_));
    if (ended_ || writes_broken_) return false;
    writing_ = true;
    lane = static_cast<size_t>(messages_written_ % static_cast<int64_t>(lanes_.size()));
  }
  int64_t sent = 0;
  const SocketIo io = lanes_[lane]->WriteAll(std::move(parts), absl::Now() + limits_.write_stall,
                                             {ended_fd_.get()}, kStallGrace, on_stall, &sent);
  {
    absl::MutexLock lock(&write_mu_);
    writing_ = false;
    if (io == SocketIo::kDone) {
      ++messages_written_;
      return true;
    }
    // A frame cut short leaves the client mid-frame: nothing more can follow it there.
    if (sent > 0) writes_broken_ = lane_writes_broken_[lane] = true;
  }
  if (io == SocketIo::kTimedOut) {
    End(StreamIdleError("the client to read its results", limits_.write_stall));
  } else if (io == SocketIo::kStopped) {
    End(absl::UnavailableError("the server is shutting down; the call was ended"));
  }
  return false;
}

int64_t SocketComputeStream::ResultMessageBytes(int64_t limit) const {
  // Below this the messages' own cost begins to count.
  constexpr int64_t kLeastLaneMessageBytes = 256 << 10;
  const auto lanes = static_cast<int64_t>(lanes_.size());
  return lanes == 1 ? limit : std::min(limit, std::max(kLeastLaneMessageBytes, limit / lanes));
}

bool SocketComputeStream::EndedFdFired() const {
  pollfd p{ended_fd_.get(), POLLIN, 0};
  return poll(&p, 1, 0) == 1;
}

bool SocketComputeStream::IsCancelled() const {
  return peer_closed_.load(std::memory_order_acquire) ||
         std::any_of(lanes_.begin(), lanes_.end(),
                     [](const SocketConnection* lane) { return lane->PeerGone(); });
}

void SocketComputeStream::End(const absl::Status& status) {
  if (hooks_.ending) hooks_.ending(status);
  wire::SignalEventFd(ended_fd_.get());
  absl::MutexLock lock(&write_mu_);
  write_mu_.Await(absl::Condition(
      +[](bool* writing) { return !*writing; }, &writing_));
  if (ended_) return;
  ended_ = true;
  status_ = status;
  if (hooks_.finishing) hooks_.finishing(status);
  // Every lane whose frames are whole hears the status, so that a client reading any of them
  // learns how the call ended.
  bool sent_everywhere = true;
  for (size_t lane = 0; lane < lanes_.size(); ++lane) {
    sent_everywhere =
        !lane_writes_broken_[lane] && SendStatus(*lanes_[lane], status) && sent_everywhere;
  }
  status_sent_ = sent_everywhere;
}

bool SocketComputeStream::ReusableAfterCall(absl::Duration wait) {
  {
    absl::MutexLock lock(&write_mu_);
    if (!ended_ || !status_.ok() || !status_sent_ || writes_broken_) return false;
  }
  absl::MutexLock lock(&read_mu_);
  // The lane of the next message first (more than the call's rows is no clean end), then every
  // other lane's half-close.
  const size_t next = static_cast<size_t>(messages_read_ % static_cast<int64_t>(lanes_.size()));
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const size_t lane = (next + i) % lanes_.size();
    if (lane_half_closed_[lane]) continue;
    if (reads_over_) return false;
    wire::ComputeRequestFrame extra;
    // The stream has ended, so its ended_fd_ no longer bounds this read: only the wait does.
    if (ReadFrame(lane, &extra, absl::Now() + wait, {}) != FrameRead::kHalfClose) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<ComputeSocketServer>> ComputeSocketServer::Start(
    const std::string& address, Options options, RunCall run_call) {
  std::string host;
  std::string port_text = address;
  if (const size_t colon = address.rfind(':'); colon != std::string::npos) {
    host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int resolved =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &found);
      resolved != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--compute_socket_listen: cannot resolve ",
                                                   address, ": ", gai_strerror(resolved)));
  }
  UniqueFd listener;
  int error = 0;
  // Prefer the IPv6 wildcard, which takes IPv4 too, when the host is left out.
  for (const addrinfo* a = found; a != nullptr && !listener.valid(); a = a->ai_next) {
    UniqueFd fd(
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!fd.valid()) {
      error = errno;
      continue;
    }
    const int on = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || listen(fd.get(), SOMAXCONN) != 0) {
      error = errno;
      continue;
    }
    listener = std::move(fd);
  }
  freeaddrinfo(found);
  if (!listener.valid()) {
    return absl::UnavailableError(absl::StrCat("--compute_socket_listen: cannot listen on ",
                                               address, ": ", std::strerror(error)));
  }
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof(bound);
  if (getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &bound_size) != 0) {
    return ErrnoError("--compute_socket_listen: getsockname", errno);
  }
  const int port =
      ntohs(bound.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(bound).sin_port
                                       : reinterpret_cast<const sockaddr_in6&>(bound).sin6_port);
  UniqueFd stop = wire::NewEventFd();
  if (!stop.valid()) return ErrnoError("--compute_socket_listen: eventfd", errno);
  std::unique_ptr<ComputeSocketServer> server(new ComputeSocketServer(
      std::move(options), std::move(run_call), std::move(listener), std::move(stop), port));
  server->acceptor_ = std::make_unique<std::thread>([raw = server.get()] { raw->Accept(); });
  return server;
}

ComputeSocketServer::ComputeSocketServer(Options options, RunCall run_call, UniqueFd listener,
                                         UniqueFd stop, int port)
    : options_(std::move(options)),
      run_call_(std::move(run_call)),
      listener_(std::move(listener)),
      stop_(std::move(stop)),
      port_(port) {}

ComputeSocketServer::~ComputeSocketServer() { Close(); }

void ComputeSocketServer::Close() {
  Stop();
  if (acceptor_ != nullptr && acceptor_->joinable()) acceptor_->join();
  threads_.JoinAll();
}

void ComputeSocketServer::Stop() {
  wire::SignalEventFd(stop_.get());
  lanes_.Stop();
}

int64_t ComputeSocketServer::connections() const {
  absl::MutexLock lock(&mu_);
  return connections_;
}

void ComputeSocketServer::Accept() {
  std::array<pollfd, 2> fds{pollfd{listener_.get(), POLLIN, 0}, pollfd{stop_.get(), POLLIN, 0}};
  while (true) {
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    sockaddr_storage address{};
    socklen_t size = sizeof(address);
    UniqueFd fd(accept4(listener_.get(), reinterpret_cast<sockaddr*>(&address), &size,
                        SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      // Out of descriptors: the pending connection stays readable, so wait a little rather
      // than spin on it. Any other failure is the peer's (it left already).
      if (errno == EMFILE || errno == ENFILE) absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    const int on = 1;
    setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
    if (options_.max_flow_bytes_per_second > 0) {
      // TCP paces itself (Linux 4.13 on) once a socket asks for a rate; where it cannot, the
      // connection goes unpaced rather than refused.
      const unsigned long rate = static_cast<unsigned long>(options_.max_flow_bytes_per_second);
      setsockopt(fd.get(), SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate));
    }
    std::string peer = PeerName(address);
    // The host part: one host's connections count together, whatever their ports.
    std::string host = peer.substr(0, peer.rfind(':'));
    absl::Status refusal;
    {
      absl::MutexLock lock(&mu_);
      if (connections_ >= options_.max_connections) {
        refusal = absl::ResourceExhaustedError(
            absl::StrCat("the Compute socket holds its limit of ", options_.max_connections,
                         " connections; retry, or send the call over gRPC"));
      } else if (connections_of_host_[host] >= options_.max_connections_per_host) {
        refusal = absl::ResourceExhaustedError(absl::StrCat(
            "the Compute socket holds its limit of ", options_.max_connections_per_host,
            " connections from one host (", host, "); retry, or send the call over gRPC"));
      } else {
        ++connections_;
        ++connections_of_host_[host];
      }
    }
    if (!refusal.ok()) {
      SocketConnection refused(std::move(fd), {stop_.get()});
      SendStatus(refused, refusal);
      continue;
    }
    const auto forget = [this](const std::string& host) {
      absl::MutexLock lock(&mu_);
      --connections_;
      if (--connections_of_host_[host] == 0) connections_of_host_.erase(host);
    };
    const absl::Status started =
        threads_.Start([this, forget, fd = std::move(fd), peer = std::move(peer), host]() mutable {
          Serve(std::move(fd), std::move(peer));
          forget(host);
        });
    if (!started.ok()) forget(host);
  }
}

void ComputeSocketServer::ServeConnection(UniqueFd fd, std::string peer) {
  const int flags = fcntl(fd.get(), F_GETFL);
  if (flags < 0 || fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) return;
  Serve(std::move(fd), std::move(peer));
}

void ComputeSocketServer::Serve(UniqueFd fd, std::string peer) {
  SocketConnection connection(std::move(fd), {stop_.get()});
  const bool peer_is_local = IsLocalPeer(peer);

  // The HELLO: within the stream idle limit, small, and with the token if the server has one.
  FrameHeader header;
  const absl::Time hello_deadline = absl::Now() + options_.stream_idle;
  if (connection.ReadExact(&header, sizeof(header), hello_deadline) != SocketIo::kDone) return;
  absl::Status hello = wire::CheckFrameHeader(header, wire::kComputeSocketMaxHelloBytes);
  if (hello.ok() && header.kind != v1::FRAME_HELLO) {
    hello = InvalidField("frame.kind", "FRAME_HELLO first on a connection",
                         wire::FrameKindName(header.kind));
  }
  if (hello.ok()) {
    std::string body(header.length, '\0');
    if (connection.ReadExact(body.data(), body.size(), hello_deadline) != SocketIo::kDone) return;
    v1::ComputeSocketHello message;
    if (!message.ParseFromString(body)) {
      hello = InvalidField("hello", "a ComputeSocketHello", "bytes that do not parse as one");
    } else if (!options_.bearer_token.empty() &&
               !TokenMatches(message.token(), options_.bearer_token)) {
      hello = absl::UnauthenticatedError(
          "hello.token: expected the server's bearer token (lossd_server --token_file)");
    }
  }
  if (!SendStatus(connection, hello) || !hello.ok()) {
    CloseAfterFailure(connection);
    return;
  }

  const SocketComputeStream::Limits limits{
      .max_message_bytes = options_.max_message_bytes,
      .write_stall = options_.stream_idle,
      .rows_in_place_min_bytes = options_.rows_in_place_min_bytes};
  // One host's lanes meet: "ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1".
  const std::string host = peer.substr(0, peer.rfind(':'));
  while (true) {
    // Between calls: the connection waits for its client's next one, or closes.
    if (connection.WaitReadable(absl::Now() + options_.connection_idle) != SocketIo::kDone) return;
    if (connection.PeerGone() && !connection.Readable()) return;
    // A call's first message is read here, within the stream idle limit, before it costs a call.
    SocketComputeStream stream(connection, peer, peer_is_local, limits, receive_buffers_);
    SocketComputeStream::Opening opening = stream.ReadOpening(options_.stream_idle);
    if (opening == SocketComputeStream::Opening::kJoin) {
      // A lane of another connection's call, which uses this connection until it hands it back.
      const absl::StatusOr<bool> reusable =
          lanes_.Join(host, stream.join_asked(), connection, absl::Now() + options_.stream_idle);
      if (!reusable.ok()) SendStatus(connection, reusable.status());
      if (!reusable.ok() || !*reusable) {
        CloseAfterFailure(connection);
        return;
      }
      continue;
    }
    std::unique_ptr<LaneRegistry::Loan> loan;  // returned before `stream` goes
    if (opening == SocketComputeStream::Opening::kLanes) {
      absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> claimed =
          lanes_.Claim(host, stream.lanes_asked(), connection, absl::Now() + options_.stream_idle);
      if (!claimed.ok()) {
        stream.End(claimed.status());
        CloseAfterFailure(connection);
        return;
      }
      loan = *std::move(claimed);
      stream.AddLanes(loan->connections());
      opening = stream.ReadOpening(options_.stream_idle);
    }
    switch (opening) {
      case SocketComputeStream::Opening::kCall: break;
      case SocketComputeStream::Opening::kGone: return;
      case SocketComputeStream::Opening::kRefused: CloseAfterFailure(connection); return;
      case SocketComputeStream::Opening::kLanes:
      case SocketComputeStream::Opening::kJoin:
        // ReadOpening takes neither after lanes; nor before, where both are handled above.
        stream.End(absl::InternalError("a call's lanes were asked for twice"));
        CloseAfterFailure(connection);
        return;
    }
    run_call_(stream);
    const bool reusable = stream.ReusableAfterCall(options_.stream_idle);
    if (loan != nullptr) loan->Return(reusable);
    if (!reusable) {
      CloseAfterFailure(connection);
      return;
    }
  }
}

}  // namespace lossd::server
