// A Compute call's stream as the server sees it: gRPC's ServerReaderWriter in the service, a
// script in tests. One thread may Read while another Writes, as gRPC allows.
#ifndef LOSSD_SERVER_COMPUTE_STREAM_H_
#define LOSSD_SERVER_COMPUTE_STREAM_H_

#include "lossd/v1/lossd.pb.h"

namespace lossd::server {

class ComputeStream {
 public:
  virtual ~ComputeStream() = default;
  virtual bool Read(v1::ComputeRequest* request) = 0;
  virtual bool Write(const v1::ComputeResponse& response) = 0;
  virtual bool IsCancelled() const = 0;
  // Ends the call as cancelled, so that a Read waiting on a client that sends nothing returns
  // false. The client then sees CANCELLED rather than the call's own error.
  virtual void Cancel() = 0;
  // Whether the client runs on the server's host (loopback or Unix socket): only such a client
  // may hand its rows over in shared memory.
  virtual bool PeerIsLocal() const = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_COMPUTE_STREAM_H_
