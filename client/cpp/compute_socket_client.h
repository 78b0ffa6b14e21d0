// The C++ client's end of the Compute socket (ComputeSocket in lossd.proto): Compute calls'
// messages on plain TCP connections of their own, kept between calls (one per call in flight, or
// one per lane of a call spread over several). The Python client's lossd/_compute_socket.py is the
// same for Python.
#ifndef LOSSD_CLIENT_COMPUTE_SOCKET_CLIENT_H_
#define LOSSD_CLIENT_COMPUTE_SOCKET_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/bulk_fields.h"
#include "proto/wire/compute_frames.h"
#include "proto/wire/compute_socket_io.h"

namespace lossd::client {

// Where a call's frames go: Send is false once the call can take no more (the server ended it,
// or the connection broke); the reader learns why.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual bool Send(const wire::ComputeRequestFrame& frame) = 0;
};

// Where a result's dL/dh of `bytes` bytes goes, for a reader that can receive it straight there
// (null: with the rest of its message). `result` holds the message's other fields.
using GradHiddenPlace = absl::FunctionRef<uint8_t*(const v1::ComputeResult& result, int64_t bytes)>;

class ComputeSocketPool {
 public:
  ComputeSocketPool(std::string host, int port, std::string token, int64_t max_message_bytes);
  ComputeSocketPool(const ComputeSocketPool&) = delete;
  ComputeSocketPool& operator=(const ComputeSocketPool&) = delete;

  // One Compute call: `send` hands the call's request frames to its sink in order, on a thread
  // of its own, while each response goes to `take` as it arrives. `begin` runs on this thread
  // before each try: a kept connection that turns out closed before the call began is replaced
  // and the call tried again from the start. The call's status as the server sent
  // it (FromRpcStatus), `take`'s first error, or UNAVAILABLE / DEADLINE_EXCEEDED when the
  // connection fails or `deadline` passes. Counts bytes into `bytes_sent` and `bytes_received`.
  // `*unusable` (when given) says whether the socket could not take the call, which never began
  // there: it refused a new connection for want of room (its HELLO answered RESOURCE_EXHAUSTED),
  // or could not be reached (now, or within the last minute: a port the network does not pass).
  // Such a call may go another way. A large result's dL/dh is received where `place` says (the
  // response `take` gets then holds it there, and copying it there is nothing to do:
  // BulkBytes::CopyTo). With `lanes` > 1 the call's frames spread over that many connections
  // (ComputeSocketLanes), each lane sent by a thread of its own.
  absl::Status Call(absl::FunctionRef<void()> begin, absl::FunctionRef<void(RequestSink&)> send,
                    absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take,
                    GradHiddenPlace place, absl::Time deadline, int64_t* bytes_sent,
                    int64_t* bytes_received, bool* unusable = nullptr, int lanes = 1);

  std::string address() const;

 private:
  struct Outcome {
    absl::Status status;
    bool answered = false;  // a frame of the call came back: it ran, and is not to be repeated
  };
  // A new connection, its HELLO answered; `*unusable` as for Call.
  absl::StatusOr<std::unique_ptr<wire::SocketConnection>> Connect(absl::Time deadline,
                                                                  bool* unusable);
  // The call on `lanes` (lane 0 first).
  Outcome CallOn(const std::vector<wire::SocketConnection*>& lanes,
                 absl::FunctionRef<void(RequestSink&)> send,
                 absl::FunctionRef<absl::Status(wire::ComputeResponseFrame&)> take,
                 GradHiddenPlace place, absl::Time deadline, int64_t* bytes_sent,
                 int64_t* bytes_received);
  // Keeps `connections` for later calls, as far as there is room.
  void KeepIdle(std::vector<std::unique_ptr<wire::SocketConnection>> connections);

  const std::string host_;
  const int port_;
  const std::string token_;
  const int64_t max_message_bytes_;
  // Results are read into pooled slices: megabytes each, reused call after call.
  const std::shared_ptr<wire::MessageBufferPool> receive_buffers_ =
      wire::MessageBufferPool::Create();
  absl::Mutex mu_;
  std::vector<std::unique_ptr<wire::SocketConnection>> idle_ ABSL_GUARDED_BY(mu_);
  absl::Time unreachable_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_COMPUTE_SOCKET_CLIENT_H_
