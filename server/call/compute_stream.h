// A Compute call's stream as the server sees it: a gRPC callback reactor in the service, a script
// in tests. One thread may Read while another Writes, as gRPC allows. Rows arrive, and dL/dh
// leaves, apart from the rest of their messages (proto/wire/compute_frames.h).
#ifndef LOSSD_SERVER_CALL_COMPUTE_STREAM_H_
#define LOSSD_SERVER_CALL_COMPUTE_STREAM_H_

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/compute_frames.h"

namespace lossd::server {

class ComputeStream {
 public:
  virtual ~ComputeStream() = default;
  virtual bool Read(wire::ComputeRequestFrame* request) = 0;
  // Read, where the next message's hidden rows may go straight into `rows_destination` (free
  // memory where the reader copies them next), as far as they fit: a stream that receives them
  // there leaves those bytes of request->rows[kHiddenRows] lying in it, which copying them there
  // then skips (BulkBytes::CopyTo). The message is checked as any other after.
  virtual bool ReadRowsInto(wire::ComputeRequestFrame* request,
                            absl::Span<uint8_t> /*rows_destination*/) {
    return Read(request);
  }
  // `response`, with `grad_hidden` as its result's dL/dh.
  virtual bool Write(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) = 0;
  // Write, calling `on_stall` once, on this thread and before waiting on, if the client has not
  // taken the message soon after it was sent (flow control holds it back): a call gives its
  // running slot back while its client is slow to read. A stream that never waits on its client
  // just writes.
  virtual bool WriteOrStall(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden,
                            absl::FunctionRef<void()> /*on_stall*/) {
    return Write(response, grad_hidden);
  }
  // Whether Write is done with grad_hidden's bytes when it returns (they are in the kernel's
  // socket buffer, or the write failed), so that a call may lend it bytes it still holds
  // (wire::BulkBytes::Borrow) instead of copying them; gRPC keeps them until it has sent them.
  virtual bool WriteIsDoneOnReturn() const { return false; }
  // How many bytes a result message should hold at most, given the server's `limit`.
  virtual int64_t ResultMessageBytes(int64_t limit) const { return limit; }
  virtual bool IsCancelled() const = 0;
  // Ends the RPC now with `status`, unless it has ended already (the first status given is the
  // one the client sees): a Read or Write waiting on a client that sends or reads nothing returns
  // false, and every later one fails at once.
  virtual void End(const absl::Status& status) = 0;
  // Whether the client runs on the server's host (loopback or Unix socket): only such a client
  // may hand its rows over in shared memory.
  virtual bool PeerIsLocal() const = 0;
  // The client's connection (gRPC's peer address): calls not yet admitted share out the pending
  // memory by it.
  virtual std::string Peer() const { return ""; }
};

// The status of a call ended because its client kept it waiting for `limit` (--stream_idle_seconds)
// for `what` ("rows [0, 128)", "the end of the stream", "the client to read its results").
inline absl::Status StreamIdleError(absl::string_view what, absl::Duration limit) {
  return absl::DeadlineExceededError(absl::StrCat("stream idle: the call waited ",
                                                  absl::FormatDuration(limit), " for ", what,
                                                  " (--stream_idle_seconds) and was ended"));
}

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_COMPUTE_STREAM_H_
