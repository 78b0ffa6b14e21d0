// Writes a Compute call's result messages on a thread of its own, in the order they were queued,
// so that the engine computes the next chunk while the last chunk's results leave: a write waits
// for the client to take its bytes (flow control), which would otherwise keep the device idle.
//
// A message's dL/dh is borrowed: its bytes must stay as they are until AwaitWritten for that
// message has returned. Where the stream keeps the bytes past the write (gRPC), the writer copies
// them into pooled memory first, on its own thread.
#ifndef LOSSD_SERVER_CALL_RESULT_WRITER_H_
#define LOSSD_SERVER_CALL_RESULT_WRITER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/bulk_fields.h"
#include "server/call/compute_stream.h"
#include "server/metrics.h"

namespace lossd::server {

class ResultWriter {
 public:
  // `stream` and `metrics` (may be null) must outlive the writer.
  ResultWriter(ComputeStream& stream, Metrics* metrics);
  ResultWriter(const ResultWriter&) = delete;
  ResultWriter& operator=(const ResultWriter&) = delete;
  // Stops as Stop does, with CANCELLED, if the call has not.
  ~ResultWriter();

  // A message to fill and Queue: one the writer has written before, cleared (its buffers kept,
  // so that filling it allocates nothing new), or a fresh one.
  std::unique_ptr<v1::ComputeResponse> NewMessage();
  // Queues `message` with `grad_hidden` as its result's dL/dh (empty: none) and returns its
  // number, 1 for the first message, for AwaitWritten.
  int64_t Queue(std::unique_ptr<v1::ComputeResponse> message, absl::string_view grad_hidden);
  // Waits until every message up to number `message` (0: none) has been written, calling
  // `on_stall` once, on this thread and before waiting on, if they are not written within
  // `stall_grace`. False once a write has failed (the client went away, or took too long and the
  // stream ended); the messages after it are dropped.
  bool AwaitWritten(int64_t message, absl::Duration stall_grace,
                    absl::FunctionRef<void()> on_stall);
  // The number of the last message queued (0: none).
  int64_t queued() const;
  // Ends the writing because the call failed with `reason`: queued messages are dropped, a write
  // in progress ends the stream with `reason` (so that it returns), and the thread is joined.
  // Idempotent.
  void Stop(const absl::Status& reason);

 private:
  struct Pending {
    std::unique_ptr<v1::ComputeResponse> message;
    absl::string_view grad_hidden;
  };

  void WriteAll();

  ComputeStream& stream_;
  Metrics* const metrics_;
  // dL/dh copied here where the stream keeps the bytes past the write.
  const std::shared_ptr<wire::MessageBufferPool> send_buffers_ = wire::MessageBufferPool::Create();
  mutable absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<v1::ComputeResponse>> spare_ ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write is in progress on the thread
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_RESULT_WRITER_H_
