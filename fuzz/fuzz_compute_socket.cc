// The Compute socket's server end (server/socket/compute_socket.h) driven by untrusted bytes: a
// connection whose client sends whatever the input holds, then closes its sending side. Whatever
// it sends, the connection must end (no hang: every wait is bounded or sees the end of input), and
// what the server sent back must be whole frames of lossd's framing, each a FRAME_STATUS that
// parses as an RpcStatus or a FRAME_MESSAGE that parses as a ComputeResponse, perhaps cut short
// only at the very end (a connection closed mid-frame); the first an answer to the HELLO.
//
// Input layout: [0] what each call does, bit 0: ends with an error instead of OK; bit 1: answers
// with one result message before its end; bit 2: the server asks for the token "t"; bit 3: the
// call offers 64 bytes for rows received in place instead of 4 KiB. Then the bytes the client
// sends (a HELLO frame, calls' frames, and anything else).
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "lossd/common/unique_fd.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/compute_socket_io.h"
#include "server/socket/compute_socket.h"

namespace lossd::server {
namespace {

void Require(bool condition, const char* what) {
  if (condition) return;
  std::fprintf(stderr, "invariant broken: %s\n", what);
  std::abort();
}

// What the server sent: whole frames of the framing, the last perhaps cut short.
void CheckServerBytes(const std::string& out) {
  size_t at = 0;
  bool first = true;
  while (out.size() - at >= sizeof(wire::FrameHeader)) {
    wire::FrameHeader header;
    std::memcpy(&header, out.data() + at, sizeof(header));
    Require(header.magic == wire::kComputeSocketMagic, "a frame without lossd's magic");
    Require(header.kind == v1::FRAME_STATUS || header.kind == v1::FRAME_MESSAGE,
            "a server frame that is neither a status nor a message");
    Require(!first || header.kind == v1::FRAME_STATUS, "the HELLO answered by something else");
    first = false;
    at += sizeof(header);
    if (out.size() - at < header.length) return;  // closed mid-frame
    const std::string body = out.substr(at, header.length);
    at += header.length;
    if (header.kind == v1::FRAME_STATUS) {
      v1::RpcStatus status;
      Require(status.ParseFromString(body), "a status that does not parse");
    } else {
      v1::ComputeResponse response;
      Require(response.ParseFromString(body), "a message that does not parse");
    }
  }
}

struct Harness {
  uint8_t mode = 0;
  std::unique_ptr<ComputeSocketServer> plain;
  std::unique_ptr<ComputeSocketServer> with_token;

  static void RunCall(const Harness* self, SocketComputeStream& stream) {
    wire::ComputeRequestFrame frame;
    // Rows go straight into memory of their own (ASan sees a write past it), 64 bytes or 4 KiB.
    std::vector<uint8_t> rows((self->mode & 8) != 0 ? 64 : 4096);
    while (stream.ReadRowsInto(&frame, absl::MakeSpan(rows))) {
      // As a row reader does next: the rows copied to where they were offered, which skips what
      // already lies there and must never copy between overlapping places (ASan checks memcpy).
      const wire::BulkBytes& hidden = frame.rows[wire::kHiddenRows];
      hidden.CopyTo(0, std::min<int64_t>(hidden.size(), static_cast<int64_t>(rows.size())),
                    rows.data());
    }
    if ((self->mode & 2) != 0) {
      v1::ComputeResponse response;
      response.mutable_result()->set_num_rows(1);
      stream.Write(response, wire::BulkBytes::Copy("grad"));
    }
    stream.End((self->mode & 1) != 0 ? absl::InvalidArgumentError("the call refused its rows")
                                     : absl::OkStatus());
  }

  Harness() {
    ComputeSocketServer::Options options;
    options.max_message_bytes = 1 << 20;
    // Short, so that an input that stops mid-frame costs little; the end of input ends most waits.
    options.stream_idle = absl::Milliseconds(50);
    options.connection_idle = absl::Milliseconds(50);
    options.rows_in_place_min_bytes = 0;  // every message with rows takes that path
    auto run = [this](SocketComputeStream& stream) { RunCall(this, stream); };
    plain = *ComputeSocketServer::Start("127.0.0.1:0", options, run);
    options.bearer_token = "t";
    with_token = *ComputeSocketServer::Start("127.0.0.1:0", options, run);
  }
};

}  // namespace
}  // namespace lossd::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossd::server;  // NOLINT: the harness's own namespace
  static Harness* const harness = new Harness();
  if (size < 1) return 0;
  harness->mode = data[0];
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 0;
  lossd::UniqueFd server_end(fds[0]);
  lossd::UniqueFd client_end(fds[1]);
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string out;
  // The client sends everything, then closes its sending side; meanwhile it reads what comes back
  // (the server must never wait on a client that does not read, here or elsewhere).
  std::thread sender([&] {
    size_t sent = 0;
    while (sent < input.size()) {
      const ssize_t n =
          send(client_end.get(), input.data() + sent, input.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    shutdown(client_end.get(), SHUT_WR);
  });
  std::thread reader([&] {
    char buffer[1 << 16];
    while (true) {
      const ssize_t n = recv(client_end.get(), buffer, sizeof(buffer), 0);
      if (n <= 0) break;
      out.append(buffer, static_cast<size_t>(n));
    }
  });
  ComputeSocketServer& server = (harness->mode & 4) != 0 ? *harness->with_token : *harness->plain;
  server.ServeConnection(std::move(server_end), "unix:fuzz");
  sender.join();
  reader.join();
  CheckServerBytes(out);
  return 0;
}
