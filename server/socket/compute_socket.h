// The Compute socket (ComputeSocket in lossd.proto): Compute calls over plain TCP connections of
// their own, framed as lossd.proto says, beside gRPC's port. A call's messages are Compute's own,
// so the call runs exactly as over gRPC (the same ComputeStream, admission, limits and metrics);
// only HTTP/2 is left out, which on loopback moved a call's rows at about a third of what the
// same TCP connection carries.
//
// A call may spread over several connections (its lanes): the connection that begins it claims
// the others from a LaneRegistry, where they wait after their FRAME_JOIN, and runs the call over
// all of them on its own thread, handing them back when it ends.
//
// Each connection has a thread of its own, which also runs its calls, one after another; the
// threads are bounded (Options::max_connections, and max_connections_per_host from one host, past
// which a HELLO is answered RESOURCE_EXHAUSTED). Every wait on a peer is bounded: the HELLO and a
// call's first message by the stream idle limit, the wait between calls by the connection idle
// limit, a call's rows and results by the call's own limits (RowReader, the write stall limit).
// Nothing a peer sends is trusted: frames are checked (magic, kind, length within the message
// limit) before anything is allocated for them, and a connection that breaks the framing gets a
// FRAME_STATUS naming what was wrong and is closed.
#ifndef LOSSD_SERVER_SOCKET_COMPUTE_SOCKET_H_
#define LOSSD_SERVER_SOCKET_COMPUTE_SOCKET_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "lossd/common/unique_fd.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/compute_socket_io.h"
#include "server/call/compute_reactor.h"
#include "server/call/compute_stream.h"
#include "server/socket/lane_registry.h"

namespace lossd::server {

using wire::FrameHeader;
using wire::SocketConnection;
using wire::SocketIo;

// One Compute call on a connection, or on several (its lanes), as the call sees its stream. Read
// takes the client's frames (the first one read by ReadOpening already); Write sends
// FRAME_MESSAGEs; End records the call's status, which goes to the client as one FRAME_STATUS on
// each lane as soon as no message is half sent (else the connection is closed: a peer that does
// not read cannot take a status either). With lanes, the client's message m comes on lane
// m mod lanes, and the call's message r leaves on lane r mod lanes.
class SocketComputeStream final : public ComputeStream {
 public:
  struct Limits {
    int64_t max_message_bytes = 0;
    absl::Duration write_stall;  // --stream_idle_seconds, as for gRPC's writes
    // Messages from this size up have their rows received straight where the call copies them
    // (ReadRowsInto); below it the extra read of a message's head is not worth it.
    int64_t rows_in_place_min_bytes = 256 << 10;
  };

  // `receive_buffers` holds the messages read (pooled: megabytes each, reused call after call).
  SocketComputeStream(SocketConnection& connection, std::string peer, bool peer_is_local,
                      Limits limits, std::shared_ptr<wire::MessageBufferPool> receive_buffers);
  SocketComputeStream(const SocketComputeStream&) = delete;
  SocketComputeStream& operator=(const SocketComputeStream&) = delete;

  enum class Opening {
    kCall,     // the first frame is in: run the call, whose first Read takes it
    kGone,     // the client closed the connection (or the server stops) before sending one
    kRefused,  // the frame was malformed or late: the stream has ended, saying why
    kLanes,    // a FRAME_LANES (lanes_asked()): the call's lanes are to be claimed (AddLanes),
               // then its first message read by ReadOpening again
    kJoin,     // a FRAME_JOIN (join_asked()): the connection is a lane of another's call
  };
  // Reads the call's first frame, which must be whole within `limit` (the stream idle limit),
  // before the call costs anything.
  Opening ReadOpening(absl::Duration limit);
  const v1::ComputeSocketLanes& lanes_asked() const { return lanes_asked_; }
  const v1::ComputeSocketJoin& join_asked() const { return join_asked_; }
  // Lanes 1 .. n - 1 of the call, after a kLanes opening and before the call's first message.
  void AddLanes(const std::vector<SocketConnection*>& lanes);

  // Set before the call runs (ComputeReactor::Hooks says what each is for).
  void SetHooks(ComputeReactor::Hooks hooks) { hooks_ = std::move(hooks); }

  bool Read(wire::ComputeRequestFrame* request) override;
  bool ReadRowsInto(wire::ComputeRequestFrame* request,
                    absl::Span<uint8_t> rows_destination) override;
  bool Write(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) override;
  bool WriteOrStall(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden,
                    absl::FunctionRef<void()> on_stall) override;
  bool WriteIsDoneOnReturn() const override { return true; }
  // With lanes, a round of messages (one per lane) holds what one message would: the call's thread
  // writes them in turn, and each lane keeps sending while the others are written only if its
  // message fits in its socket's send buffer (a few MiB).
  int64_t ResultMessageBytes(int64_t limit) const override;
  bool IsCancelled() const override;
  void End(const absl::Status& status) override;
  bool PeerIsLocal() const override { return peer_is_local_; }
  std::string Peer() const override { return peer_; }

  // After the call: whether its connections can take the client's next call (the call ended OK,
  // its status went out whole and the client's FRAME_HALF_CLOSE came on every lane). Reads the
  // half-closes not read yet, waiting up to `wait` for each.
  bool ReusableAfterCall(absl::Duration wait);
  // Whether End has been called (its eventfd fired).
  bool EndedFdFired() const;

 private:
  // What ReadFrame read.
  enum class FrameRead {
    kMessage,    // a well-formed FRAME_MESSAGE, decoded
    kHalfClose,  // the lane's FRAME_HALF_CLOSE (lane_half_closed_ then)
    kLanes,      // in the opening only: a FRAME_LANES (lanes_asked_)
    kJoin,       // in the opening only: a FRAME_JOIN (join_asked_)
    kFailed,     // the client's end (peer_closed_), a deadline or wake, or a frame at fault,
                 // which ends the call saying why; last_io_ says how the read ended
  };
  // Reads one frame from `lane` until `deadline` or one of `wake` is readable.
  FrameRead ReadFrame(size_t lane, wire::ComputeRequestFrame* request, absl::Time deadline,
                      const std::vector<int>& wake, absl::Span<uint8_t> rows_destination = {},
                      bool opening = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);
  // Reads a FRAME_MESSAGE's `length` bytes into `message`: into pooled memory, but for the
  // leading hidden rows of a chunk, which go into `rows_destination` as far as they fit.
  SocketIo ReadMessageBody(SocketConnection& connection, uint64_t length, absl::Time deadline,
                           const std::vector<int>& wake, absl::Span<uint8_t> rows_destination,
                           grpc::ByteBuffer& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);
  // Reads a FRAME_LANES' or FRAME_JOIN's small body into `message`.
  absl::Status ReadOpeningBody(SocketConnection& connection, const FrameHeader& header,
                               absl::Time deadline, const std::vector<int>& wake,
                               google::protobuf::MessageLite& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);

  // Lane 0 first; set before the call runs, fixed during it.
  std::vector<SocketConnection*> lanes_;
  const std::string peer_;
  const bool peer_is_local_;
  const Limits limits_;
  const std::shared_ptr<wire::MessageBufferPool> receive_buffers_;
  ComputeReactor::Hooks hooks_;
  UniqueFd ended_fd_;  // an eventfd made readable by End: every wait of the call returns

  // The call's thread and its reader take turns reading (the reader reads all but the first).
  absl::Mutex read_mu_;
  wire::ComputeRequestFrame first_ ABSL_GUARDED_BY(read_mu_);
  bool first_taken_ ABSL_GUARDED_BY(read_mu_) = false;
  // The client's messages have ended: the lane of the next one brought its FRAME_HALF_CLOSE.
  bool half_closed_ ABSL_GUARDED_BY(read_mu_) = false;
  std::vector<bool> lane_half_closed_ ABSL_GUARDED_BY(read_mu_);
  int64_t messages_read_ ABSL_GUARDED_BY(read_mu_) = 0;  // the next comes on this mod lanes
  bool reads_over_ ABSL_GUARDED_BY(read_mu_) = false;
  // The connection's thread alone touches these, before the call runs.
  v1::ComputeSocketLanes lanes_asked_;
  v1::ComputeSocketJoin join_asked_;
  std::atomic<bool> peer_closed_{false};  // read without the lock: IsCancelled never waits
  SocketIo last_io_ ABSL_GUARDED_BY(read_mu_) = SocketIo::kDone;

  absl::Mutex write_mu_;  // one frame at a time; End waits for a write in progress
  bool writing_ ABSL_GUARDED_BY(write_mu_) = false;        // a frame is being sent, unlocked
  bool writes_broken_ ABSL_GUARDED_BY(write_mu_) = false;  // a frame went out in part
  std::vector<bool> lane_writes_broken_ ABSL_GUARDED_BY(write_mu_);  // on which lanes
  int64_t messages_written_ ABSL_GUARDED_BY(write_mu_) = 0;
  bool ended_ ABSL_GUARDED_BY(write_mu_) = false;
  bool status_sent_ ABSL_GUARDED_BY(write_mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(write_mu_);
};

// The listening socket and its connections.
class ComputeSocketServer {
 public:
  struct Options {
    std::string bearer_token;  // empty: none asked for
    int64_t max_message_bytes = 256 << 20;
    absl::Duration stream_idle = absl::Seconds(60);
    // How long a connection may wait for its next call before the server closes it.
    absl::Duration connection_idle = absl::Minutes(5);
    int max_connections = 256;  // each holds a thread
    // So that one host's idle connections cannot lock the others out.
    int max_connections_per_host = 64;
    // Bytes per second each connection sends at most, paced by the kernel; 0: no limit.
    int64_t max_flow_bytes_per_second = 0;
    // SocketComputeStream::Limits; the fuzz target lowers it so that small inputs reach that path.
    int64_t rows_in_place_min_bytes = 256 << 10;
  };
  // Runs one call: refuses it (stream.End) or sets its hooks and runs it, on this thread.
  using RunCall = std::function<void(SocketComputeStream& stream)>;

  // Listens on `address` (HOST:PORT, port 0 for any free one) and starts accepting.
  static absl::StatusOr<std::unique_ptr<ComputeSocketServer>> Start(const std::string& address,
                                                                    Options options,
                                                                    RunCall run_call);
  ComputeSocketServer(const ComputeSocketServer&) = delete;
  ComputeSocketServer& operator=(const ComputeSocketServer&) = delete;
  // Close().
  ~ComputeSocketServer();

  int port() const { return port_; }
  // Stops accepting and ends every connection: idle ones close, calls in flight end with
  // UNAVAILABLE at their next read or write. The service drains its calls before this.
  void Stop();
  // Stop(), then waits for every connection's thread to end. Idempotent.
  void Close();
  int64_t connections() const;
  // Calls whose lanes are meeting or lent now.
  int64_t lane_meetings() const { return lanes_.meetings(); }
  // Serves one connected stream socket on this thread as an accepted connection is served (made
  // non-blocking first): for tests and fuzzing, which bring their own peer.
  void ServeConnection(UniqueFd fd, std::string peer);

 private:
  ComputeSocketServer(Options options, RunCall run_call, UniqueFd listener, UniqueFd stop,
                      int port);
  void Accept();
  void Serve(UniqueFd fd, std::string peer);

  const Options options_;
  const RunCall run_call_;
  const UniqueFd listener_;
  const UniqueFd stop_;  // an eventfd: readable once the server stops
  const int port_;
  const std::shared_ptr<wire::MessageBufferPool> receive_buffers_ =
      wire::MessageBufferPool::Create();
  LaneRegistry lanes_;
  CallThreads threads_;
  mutable absl::Mutex mu_;
  int64_t connections_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int> connections_of_host_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<std::thread> acceptor_;  // last
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SOCKET_COMPUTE_SOCKET_H_
