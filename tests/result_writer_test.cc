// The Compute call's result writer: messages leave in the order queued while the caller goes on,
// a wait that outlasts the grace calls its stall hook once, a failed write fails every wait and
// drops what follows it, a stop ends a write in progress with the call's status, and dL/dh is
// copied where the stream keeps it past the write.
#include "server/call/result_writer.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace lossd::server {
namespace {

// The client side: takes each message once let through (Release), or at once when never held;
// fails writes from the `fail_at`-th on (1-based; 0: none fails).
class RecordingStream final : public ComputeStream {
 public:
  RecordingStream(bool done_on_return, bool hold_writes = false, int fail_at = 0)
      : done_on_return_(done_on_return), held_(hold_writes), fail_at_(fail_at) {}

  bool Read(wire::ComputeRequestFrame*) override { return false; }
  bool Write(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) override {
    absl::MutexLock lock(&mu_);
    writing_ = true;
    const auto go = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !held_ || ended_; };
    mu_.Await(absl::Condition(&go));
    writing_ = false;
    if (ended_ || (fail_at_ > 0 && static_cast<int>(offsets_.size()) + 1 >= fail_at_)) {
      return false;
    }
    offsets_.push_back(response.result().row_offset());
    grads_.push_back(grad_hidden);  // kept past the write, as gRPC keeps its slices
    return true;
  }
  bool WriteIsDoneOnReturn() const override { return done_on_return_; }
  bool IsCancelled() const override { return false; }
  void End(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (!ended_) end_status_ = status;
    ended_ = true;
  }
  bool PeerIsLocal() const override { return true; }

  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  void AwaitWriting() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&writing_));
  }
  std::vector<int64_t> offsets() {
    absl::MutexLock lock(&mu_);
    return offsets_;
  }
  std::vector<wire::BulkBytes> grads() {
    absl::MutexLock lock(&mu_);
    return grads_;
  }
  absl::Status end_status() {
    absl::MutexLock lock(&mu_);
    return end_status_;
  }

 private:
  const bool done_on_return_;
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_);
  const int fail_at_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> offsets_ ABSL_GUARDED_BY(mu_);
  std::vector<wire::BulkBytes> grads_ ABSL_GUARDED_BY(mu_);
};

// Queues a result message for row `offset` with `grad` as its dL/dh.
int64_t QueueRow(ResultWriter& writer, int64_t offset, absl::string_view grad = "") {
  std::unique_ptr<v1::ComputeResponse> message = writer.NewMessage();
  EXPECT_FALSE(message->has_result()) << "a reused message was not cleared";
  message->mutable_result()->set_row_offset(offset);
  return writer.Queue(std::move(message), grad);
}

constexpr absl::Duration kLongGrace = absl::Hours(1);

TEST(ResultWriterTest, WritesInTheOrderQueuedAndNumbersTheMessages) {
  RecordingStream stream(/*done_on_return=*/true);
  ResultWriter writer(stream, nullptr);
  std::vector<int64_t> expected;
  for (int64_t offset = 0; offset < 50; ++offset) {
    EXPECT_EQ(QueueRow(writer, offset), offset + 1);
    expected.push_back(offset);
  }
  EXPECT_EQ(writer.queued(), 50);
  int stalls = 0;
  EXPECT_TRUE(writer.AwaitWritten(50, kLongGrace, [&] { ++stalls; }));
  EXPECT_EQ(stalls, 0);
  EXPECT_EQ(stream.offsets(), expected);
  EXPECT_TRUE(writer.AwaitWritten(0, kLongGrace, [] {}));  // nothing to wait for
}

TEST(ResultWriterTest, QueueReturnsAtOnceAndAWaitPastTheGraceStallsOnce) {
  RecordingStream stream(/*done_on_return=*/true, /*hold_writes=*/true);
  ResultWriter writer(stream, nullptr);
  const int64_t first = QueueRow(writer, 0);
  const int64_t second = QueueRow(writer, 1);  // queued while the first write waits on its client
  stream.AwaitWriting();
  // The client takes the messages only once the wait has counted as stalled.
  int stalls = 0;
  EXPECT_TRUE(writer.AwaitWritten(second, absl::Milliseconds(1), [&] {
    ++stalls;
    stream.Release();
  }));
  EXPECT_EQ(stalls, 1);
  EXPECT_EQ(stream.offsets(), (std::vector<int64_t>{0, 1}));
  EXPECT_LT(first, second);
}

TEST(ResultWriterTest, AFailedWriteFailsEveryWaitAndDropsWhatFollows) {
  RecordingStream stream(/*done_on_return=*/true, /*hold_writes=*/false, /*fail_at=*/2);
  ResultWriter writer(stream, nullptr);
  const int64_t first = QueueRow(writer, 0);
  QueueRow(writer, 1);
  const int64_t third = QueueRow(writer, 2);
  EXPECT_FALSE(writer.AwaitWritten(third, kLongGrace, [] {}));
  EXPECT_FALSE(writer.AwaitWritten(first, kLongGrace, [] {})) << "the call failed: no wait is ok";
  EXPECT_EQ(stream.offsets(), (std::vector<int64_t>{0}));
}

TEST(ResultWriterTest, StopEndsAWriteInProgressWithTheCallsStatus) {
  RecordingStream stream(/*done_on_return=*/true, /*hold_writes=*/true);
  ResultWriter writer(stream, nullptr);
  QueueRow(writer, 0);
  QueueRow(writer, 1);
  stream.AwaitWriting();
  writer.Stop(absl::DataLossError("the call's own failure"));
  EXPECT_EQ(stream.end_status(), absl::DataLossError("the call's own failure"));
  EXPECT_TRUE(stream.offsets().empty());
  writer.Stop(absl::InternalError("a second stop changes nothing"));
  EXPECT_EQ(stream.end_status(), absl::DataLossError("the call's own failure"));
}

TEST(ResultWriterTest, StopOfAnIdleWriterLeavesTheStreamAlone) {
  RecordingStream stream(/*done_on_return=*/true);
  {
    ResultWriter writer(stream, nullptr);
    QueueRow(writer, 0);
    ASSERT_TRUE(writer.AwaitWritten(1, kLongGrace, [] {}));
  }
  EXPECT_TRUE(stream.end_status().ok());
  EXPECT_EQ(stream.offsets(), (std::vector<int64_t>{0}));
}

// dL/dh is borrowed until its message is written: a stream that keeps the bytes past the write
// gets a copy (what it holds stays as sent once the caller reuses its buffer), one that is done
// with them on return gets them where they lie.
TEST(ResultWriterTest, DlDhIsCopiedOnlyWhereTheStreamKeepsIt) {
  for (const bool done_on_return : {false, true}) {
    RecordingStream stream(done_on_return);
    ResultWriter writer(stream, nullptr);
    std::string buffer = "dL/dh of chunk 0";
    ASSERT_TRUE(writer.AwaitWritten(QueueRow(writer, 0, buffer), kLongGrace, [] {}));
    buffer.replace(0, buffer.size(), std::string(buffer.size(), 'x'));  // the next chunk's dL/dh
    const std::vector<wire::BulkBytes> grads = stream.grads();
    ASSERT_EQ(grads.size(), 1u);
    if (done_on_return) {
      EXPECT_EQ(grads[0].ToString(), buffer) << "borrowed bytes were copied";
    } else {
      EXPECT_EQ(grads[0].ToString(), "dL/dh of chunk 0");
    }
  }
}

}  // namespace
}  // namespace lossd::server
