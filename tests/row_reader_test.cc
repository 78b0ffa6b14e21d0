// The Compute call's row reader: chunks cut by the engine's plan whatever the client's message
// sizes, reading ahead by one chunk and no more, every malformed stream named, waits for the
// client bounded by the idle limit, and a stop that ends the stream with the call's status.
#include "server/call/row_reader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace lossd::server {
namespace {

constexpr int64_t kHidden = 3;
constexpr int64_t kRowBytes = kHidden * sizeof(float);

// The client side: a fixed list of messages, each after `pause`, then the end of the stream, or
// silence until the call is ended.
class ScriptedStream final : public ComputeStream {
 public:
  explicit ScriptedStream(std::vector<v1::ComputeRequest> requests, bool silent_at_end = false,
                          absl::Duration pause = absl::ZeroDuration())
      : requests_(std::move(requests)), silent_at_end_(silent_at_end), pause_(pause) {}

  bool Read(wire::ComputeRequestFrame* request) override {
    absl::MutexLock lock(&mu_);
    const auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_ || ended_; };
    if (next_ == requests_.size() && silent_at_end_) {
      waiting_in_silence_ = true;
      mu_.Await(absl::Condition(&over));
    } else if (pause_ > absl::ZeroDuration()) {
      mu_.AwaitWithTimeout(absl::Condition(&over), pause_);
    }
    if (over() || next_ == requests_.size()) return false;
    *request = wire::ComputeRequestFrame::FromMessage(requests_[next_++]);
    return true;
  }
  bool Write(const v1::ComputeResponse&, const wire::BulkBytes&) override { return true; }
  bool IsCancelled() const override {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }
  void End(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (!ended_) ended_status_ = status;
    ended_ = true;
  }
  bool PeerIsLocal() const override { return false; }

  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  // The status the stream was ended with; OK while it was not.
  absl::Status ended_status() const {
    absl::MutexLock lock(&mu_);
    return ended_status_;
  }

  // Waits until a Read waits for a message that will never come.
  void AwaitSilence() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&waiting_in_silence_));
  }

  // Waits until `count` messages were read, or `timeout` passed; the number read.
  size_t AwaitReads(size_t count, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto reached = [this, count]()
                             ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return next_ >= count; };
    mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
    return next_;
  }

 private:
  const std::vector<v1::ComputeRequest> requests_;
  const bool silent_at_end_;
  const absl::Duration pause_;
  mutable absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status ended_status_ ABSL_GUARDED_BY(mu_);
  bool waiting_in_silence_ ABSL_GUARDED_BY(mu_) = false;
};

std::vector<float> RandomRows(int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> data(rows * kHidden);
  for (float& x : data) x = value(rng);
  return data;
}

v1::ComputeRequest Message(const std::vector<float>& data, int64_t first_row, int64_t rows) {
  v1::ComputeRequest request;
  request.mutable_chunk()->set_hidden(
      reinterpret_cast<const char*>(data.data() + first_row * kHidden), rows * kRowBytes);
  return request;
}

// `rows_per_message` rows in each message, the last one shorter.
std::vector<v1::ComputeRequest> Split(const std::vector<float>& data, int64_t rows_per_message) {
  const int64_t rows = static_cast<int64_t>(data.size()) / kHidden;
  std::vector<v1::ComputeRequest> requests;
  for (int64_t first = 0; first < rows; first += rows_per_message) {
    requests.push_back(Message(data, first, std::min(rows_per_message, rows - first)));
  }
  return requests;
}

RowLayout Layout(int64_t num_tokens, int64_t chunk_rows) {
  RowLayout layout;
  layout.num_tokens = num_tokens;
  layout.hidden_size = kHidden;
  layout.dtype = DType::kFloat32;
  layout.chunk_rows = chunk_rows;
  return layout;
}

// Row buffers from a cache that keeps nothing: every reader gets fresh memory.
BufferCache& FreshHostBuffers() {
  static HostAllocator host;
  static MemoryLedger ledger;
  static BufferCache cache(host, ledger, /*capacity_bytes=*/0);
  return cache;
}

// Long enough never to end a call that is not stalled, on a loaded machine.
constexpr absl::Duration kPatient = absl::Seconds(60);

std::unique_ptr<RowReader> StartReader(ComputeStream& stream, const RowLayout& layout,
                                       absl::Duration idle_limit = kPatient,
                                       BufferCache& host_buffers = FreshHostBuffers()) {
  absl::StatusOr<std::unique_ptr<RowReader>> reader =
      RowReader::Start(stream, nullptr, layout, host_buffers, idle_limit);
  EXPECT_TRUE(reader.ok()) << reader.status();
  return reader.ok() ? *std::move(reader) : nullptr;
}

struct SplitCase {
  const char* why;
  int64_t num_tokens;
  int64_t chunk_rows;
  int64_t rows_per_message;
};

const SplitCase kSplits[] = {
    {"one message per chunk", 12, 4, 4},
    {"messages smaller than chunks, not dividing them", 13, 5, 3},
    {"messages larger than chunks: one message fills several", 13, 3, 7},
    {"one message for the whole call", 10, 4, 10},
    {"one chunk for the whole call", 6, 8, 2},
    {"one row", 1, 4, 1},
    {"row-by-row messages across chunks", 9, 4, 1},
};

class RowReaderSplitTest : public ::testing::TestWithParam<SplitCase> {};

TEST_P(RowReaderSplitTest, ChunksFollowThePlanNotTheMessages) {
  const SplitCase& c = GetParam();
  SCOPED_TRACE(c.why);
  const std::vector<float> data = RandomRows(c.num_tokens, 7);
  ScriptedStream stream(Split(data, c.rows_per_message));
  const auto reader = StartReader(stream, Layout(c.num_tokens, c.chunk_rows));
  for (int64_t first = 0; first < c.num_tokens; first += c.chunk_rows) {
    absl::StatusOr<RowChunk> chunk = reader->Next();
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->first_row, first);
    EXPECT_EQ(chunk->num_rows, std::min(c.chunk_rows, c.num_tokens - first));
    EXPECT_EQ(std::memcmp(chunk->rows, data.data() + first * kHidden, chunk->num_rows * kRowBytes),
              0);
    reader->Release();
  }
  EXPECT_TRUE(reader->Finish().ok());
}

// Chunks cut at sequence ends (RowLayout::chunk_ends) are of any size up to chunk_rows, whatever
// the messages' split: 3 + 2 rows, then 4, then 1, from messages of 3 rows.
TEST(RowReaderTest, ChunksOfUnequalSizeFollowTheirEnds) {
  const std::vector<int64_t> ends = {5, 9, 10};
  const std::vector<float> data = RandomRows(10, 8);
  ScriptedStream stream(Split(data, 3));
  RowLayout layout = Layout(10, 5);
  layout.chunk_ends = ends;
  const auto reader = StartReader(stream, layout);
  for (int64_t first = 0; const int64_t end : ends) {
    absl::StatusOr<RowChunk> chunk = reader->Next();
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->first_row, first);
    EXPECT_EQ(chunk->num_rows, end - first);
    EXPECT_EQ(std::memcmp(chunk->rows, data.data() + first * kHidden, chunk->num_rows * kRowBytes),
              0);
    reader->Release();
    first = end;
  }
  EXPECT_TRUE(reader->Finish().ok());
}

// A distill call's teacher data rides in the same messages as the hidden rows: each chunk's side
// streams hold the chunk's rows, whatever the split.
TEST_P(RowReaderSplitTest, SideStreamsFollowTheHiddenRows) {
  const SplitCase& c = GetParam();
  SCOPED_TRACE(c.why);
  const std::vector<float> data = RandomRows(c.num_tokens, 7);
  const std::vector<float> tokens = RandomRows(c.num_tokens, 8);
  const std::vector<float> logprobs = RandomRows(c.num_tokens, 9);
  std::vector<v1::ComputeRequest> requests = Split(data, c.rows_per_message);
  for (size_t m = 0; m < requests.size(); ++m) {
    const int64_t first = static_cast<int64_t>(m) * c.rows_per_message;
    const v1::ComputeRequest rows =
        Message(tokens, first, std::min(c.rows_per_message, c.num_tokens - first));
    const v1::ComputeRequest more =
        Message(logprobs, first, std::min(c.rows_per_message, c.num_tokens - first));
    requests[m].mutable_chunk()->set_teacher_top_k_tokens(rows.chunk().hidden());
    requests[m].mutable_chunk()->set_teacher_top_k_logprobs(more.chunk().hidden());
  }
  ScriptedStream stream(requests);
  RowLayout layout = Layout(c.num_tokens, c.chunk_rows);
  layout.side = {{SideField::kTeacherTopKTokens, kRowBytes, "3 ids"},
                 {SideField::kTeacherTopKLogprobs, kRowBytes, "3 values"}};
  const auto reader = StartReader(stream, layout);
  for (int64_t first = 0; first < c.num_tokens; first += c.chunk_rows) {
    absl::StatusOr<RowChunk> chunk = reader->Next();
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    const size_t bytes = chunk->num_rows * kRowBytes;
    EXPECT_EQ(std::memcmp(chunk->rows, data.data() + first * kHidden, bytes), 0);
    EXPECT_EQ(std::memcmp(chunk->side_rows[0], tokens.data() + first * kHidden, bytes), 0);
    EXPECT_EQ(std::memcmp(chunk->side_rows[1], logprobs.data() + first * kHidden, bytes), 0);
    reader->Release();
  }
  EXPECT_TRUE(reader->Finish().ok());
}

// The host memory a call charges for its reader before admission is what the reader leases: each
// buffer holds a chunk of every stream, side streams included.
TEST_P(RowReaderSplitTest, BufferBytesAreWhatTheReaderLeases) {
  const SplitCase& c = GetParam();
  SCOPED_TRACE(c.why);
  RowLayout layout = Layout(c.num_tokens, c.chunk_rows);
  for (const size_t sides : {0, 1, 2}) {
    SCOPED_TRACE(::testing::Message() << sides << " side streams");
    layout.side.resize(sides, {SideField::kTeacherTopKTokens, 5 * kRowBytes, "15 ids"});
    HostAllocator host;
    MemoryLedger ledger;
    BufferCache host_buffers(host, ledger, /*capacity_bytes=*/0);
    ScriptedStream stream({}, /*silent_at_end=*/true);
    const auto reader = StartReader(stream, layout, kPatient, host_buffers);
    ASSERT_NE(reader, nullptr);
    EXPECT_EQ(ledger.current(MemoryPurpose::kWorkspace), RowReader::BufferBytes(layout));
    reader->Stop(absl::CancelledError("the test is done"));
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, RowReaderSplitTest, ::testing::ValuesIn(kSplits));

// Every call length up to past four minimum chunks, and some far beyond: the call in at most
// four chunks of equal length but the last, none under the minimum unless the call is one
// chunk, and as many as that allows.
TEST(OverlappedChunkRowLimitTest, CutsUpToFourEqualChunksOfTheMinimumOrMore) {
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 5 * kMinOverlappedChunkRows; ++n) lengths.push_back(n);
  for (const int64_t n : {int64_t{65536}, int64_t{131071}, int64_t{1} << 24}) lengths.push_back(n);
  for (const int64_t n : lengths) {
    const int64_t limit = OverlappedChunkRowLimit(n);
    const int64_t chunks = (n + limit - 1) / limit;
    const int64_t last = n - (chunks - 1) * limit;
    ASSERT_LE(chunks, kOverlappedChunksPerCall) << n;
    ASSERT_TRUE(chunks == 1 || last >= kMinOverlappedChunkRows - chunks) << n;
    ASSERT_LT(limit - last, chunks) << n << ": chunks of unequal length";
    const int64_t more = std::min(chunks + 1, kOverlappedChunksPerCall);
    ASSERT_TRUE(more == chunks || n / more < kMinOverlappedChunkRows)
        << n << ": " << more << " chunks would fit";
  }
  EXPECT_EQ(OverlappedChunkRowLimit(16384), 4096);  // the Llama benchmark's call: four chunks
  EXPECT_EQ(OverlappedChunkRowLimit(4095), 4095);   // shorter than two minimum chunks: whole
}

// Every length up to 2^17 and some beyond: never fewer rows, at most 1/8 more, never less for a
// longer call, at most eight planned lengths per power of two, and powers of two and lengths
// under 16 as they are.
TEST(PlannedCallRowsTest, RoundsUpToEightLengthsPerPowerOfTwo) {
  int64_t previous = 0;
  int64_t octave = 1;
  std::vector<int64_t> octave_lengths;  // planned lengths in [octave, 2 * octave)
  for (int64_t n = 1; n <= (int64_t{1} << 17); ++n) {
    const int64_t planned = PlannedCallRows(n);
    ASSERT_GE(planned, n);
    ASSERT_LE(planned, n + n / 8) << n;
    ASSERT_GE(planned, previous) << n;
    const bool power_of_two = (n & (n - 1)) == 0;
    if (n < 16 || power_of_two) ASSERT_EQ(planned, n);
    if (power_of_two) {
      octave = n;
      octave_lengths.clear();
    }
    if (planned < 2 * octave && (octave_lengths.empty() || octave_lengths.back() != planned)) {
      octave_lengths.push_back(planned);
    }
    ASSERT_LE(octave_lengths.size(), 8u)
        << "lengths planned in [" << octave << ", " << 2 * octave << ")";
    previous = planned;
  }
  EXPECT_EQ(PlannedCallRows(15000), 15360);
  EXPECT_EQ(PlannedCallRows((int64_t{1} << 40) + 1), (int64_t{1} << 40) + (int64_t{1} << 37));
}

TEST(RowReaderTest, ReadsTheNextChunkWhileOneIsHeldButNoFurther) {
  const int64_t chunk_rows = 4;
  const std::vector<float> data = RandomRows(4 * chunk_rows, 11);
  ScriptedStream stream(Split(data, 2));  // 8 messages, two per chunk
  const auto reader = StartReader(stream, Layout(4 * chunk_rows, chunk_rows));
  ASSERT_TRUE(reader->Next().ok());
  // Chunk 0 held: chunk 1 is read into the other buffer, then the first message of chunk 2
  // waits for a buffer.
  EXPECT_EQ(stream.AwaitReads(5, absl::Seconds(10)), 5u);
  EXPECT_EQ(stream.AwaitReads(6, absl::Milliseconds(100)), 5u) << "read past a free buffer";
  reader->Release();
  EXPECT_EQ(stream.AwaitReads(7, absl::Seconds(10)), 7u);
  reader->Stop(absl::CancelledError("test over"));
}

TEST(RowReaderTest, NextCallReadsIntoTheBuffersTheLastOneLeft) {
  HostAllocator host;
  MemoryLedger ledger;
  BufferCache cache(host, ledger, /*capacity_bytes=*/1 << 20);
  const RowLayout layout = Layout(10, 4);  // three chunks: both buffers in use
  for (uint32_t seed : {21u, 22u}) {
    const std::vector<float> data = RandomRows(10, seed);
    ScriptedStream stream(Split(data, 3));
    const auto reader = StartReader(stream, layout, kPatient, cache);
    // The second call takes both idle buffers, whose rows are the first call's until overwritten.
    EXPECT_EQ(cache.idle_bytes(), 0);
    for (int64_t first = 0; first < 10; first += 4) {
      absl::StatusOr<RowChunk> chunk = reader->Next();
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      EXPECT_EQ(
          std::memcmp(chunk->rows, data.data() + first * kHidden, chunk->num_rows * kRowBytes), 0);
      reader->Release();
    }
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(ledger.current(MemoryPurpose::kWorkspace), 2 * 4 * kRowBytes);
  }
  EXPECT_EQ(ledger.peak(MemoryPurpose::kCache), 2 * 4 * kRowBytes) << "a third buffer was made";
}

TEST(RowReaderTest, EmptyCallEndsWell) {
  ScriptedStream stream({});
  const auto reader = StartReader(stream, Layout(0, 4));
  EXPECT_TRUE(reader->Finish().ok());
}

struct StreamErrorCase {
  const char* why;
  std::vector<v1::ComputeRequest> (*script)(const std::vector<float>& data);
  absl::StatusCode code;
  const char* names;  // in the message
};

const StreamErrorCase kStreamErrors[] = {
    {"the stream ends one row short",
     [](const std::vector<float>& data) { return std::vector{Message(data, 0, 7)}; },
     absl::StatusCode::kInvalidArgument, "8 rows (num_tokens)"},
    {"one row more than announced, in the message of the last rows",
     [](const std::vector<float>& data) {
       v1::ComputeRequest request = Message(data, 0, 7);
       request.mutable_chunk()->mutable_hidden()->append(Message(data, 0, 2).chunk().hidden());
       return std::vector{request};
     },
     absl::StatusCode::kInvalidArgument, "8 rows in all"},
    {"a message that is not whole rows",
     [](const std::vector<float>& data) {
       v1::ComputeRequest request = Message(data, 0, 2);
       request.mutable_chunk()->mutable_hidden()->pop_back();
       return std::vector{request};
     },
     absl::StatusCode::kInvalidArgument, "whole rows of 3 float32 values (12 bytes each)"},
    {"a second start message after rows",
     [](const std::vector<float>& data) {
       v1::ComputeRequest start;
       start.mutable_start()->set_num_tokens(8);
       return std::vector{Message(data, 0, 4), start};
     },
     absl::StatusCode::kInvalidArgument, "exactly one ComputeStart"},
};

class RowReaderStreamErrorTest : public ::testing::TestWithParam<StreamErrorCase> {};

TEST_P(RowReaderStreamErrorTest, IsNamedAndEndsTheCall) {
  const StreamErrorCase& c = GetParam();
  SCOPED_TRACE(c.why);
  const std::vector<float> data = RandomRows(8, 3);
  ScriptedStream stream(c.script(data));
  const auto reader = StartReader(stream, Layout(8, 8));
  absl::StatusOr<RowChunk> chunk = reader->Next();
  absl::Status status = chunk.status();
  if (chunk.ok()) {  // the error came after the last row
    reader->Release();
    status = reader->Finish();
  }
  EXPECT_EQ(status.code(), c.code) << status;
  EXPECT_NE(status.message().find(c.names), std::string::npos) << status;
}

INSTANTIATE_TEST_SUITE_P(Errors, RowReaderStreamErrorTest, ::testing::ValuesIn(kStreamErrors));

// The rows a call announced are the whole call: once the last one is in, the reader is done. It
// reads nothing after it (a message that follows is never taken) and does not wait for the client
// to end its stream.
TEST(RowReaderTest, TheLastRowEndsTheReading) {
  const std::vector<float> data = RandomRows(8, 5);
  std::vector<v1::ComputeRequest> messages = Split(data, 4);
  messages.push_back(Message(data, 0, 1));  // a row too many, in a message of its own
  ScriptedStream stream(messages, /*silent_at_end=*/true);
  const auto reader = StartReader(stream, Layout(8, 4));
  for (int chunk = 0; chunk < 2; ++chunk) {
    ASSERT_TRUE(reader->Next().ok());
    reader->Release();
  }
  EXPECT_TRUE(reader->Finish().ok());
  // Finish joined the reading thread: no read can come later.
  EXPECT_EQ(stream.AwaitReads(3, absl::ZeroDuration()), 2u) << "read past the last row";
}

TEST(RowReaderTest, CancelledStreamIsReportedAsCancelled) {
  const std::vector<float> data = RandomRows(8, 5);
  ScriptedStream stream(Split(data, 2));
  stream.Cancel();
  const auto reader = StartReader(stream, Layout(8, 4));
  EXPECT_EQ(reader->Next().status().code(), absl::StatusCode::kCancelled);
}

TEST(RowReaderTest, StopEndsTheStreamOfAClientThatSendsNothingMoreWithTheCallsStatus) {
  const std::vector<float> data = RandomRows(8, 9);
  ScriptedStream stream(Split(data, 4), /*silent_at_end=*/true);
  const auto reader = StartReader(stream, Layout(12, 4));
  ASSERT_TRUE(reader->Next().ok());
  stream.AwaitSilence();
  const absl::Status own = absl::InvalidArgumentError("chunk.hidden: the call's own error");
  const absl::Time start = absl::Now();
  // The reader waits for a third message that never comes.
  reader->Stop(own);
  EXPECT_LT(absl::Now() - start, kPatient);
  EXPECT_EQ(stream.ended_status(), own);
}

TEST(RowReaderTest, StopOfAFinishedReaderLeavesTheStreamAlone) {
  const std::vector<float> data = RandomRows(4, 13);
  ScriptedStream stream(Split(data, 1));
  const auto reader = StartReader(stream, Layout(4, 4));
  ASSERT_TRUE(reader->Next().ok());
  reader->Release();
  ASSERT_TRUE(reader->Finish().ok());
  reader->Stop(absl::InternalError("after the end"));
  EXPECT_TRUE(stream.ended_status().ok()) << "the stream of a call that read everything was ended";
}

// Where the reader waits for the client, the idle limit bounds the wait, whether the client is
// silent or sends a row at a time too slowly to fill a chunk; the error names the flag.
struct IdleCase {
  const char* why;
  int64_t rows_sent;  // of 8, in messages of one row
  bool silent_at_end;
  absl::Duration pause;  // before each message
  int chunks_taken;      // Next calls that succeed before the one that waits
  enum { kFirstChunk, kNext, kFinish } waits_in;
  const char* names;  // what it waited for, in the message
};

const IdleCase kIdleCases[] = {
    {"a client that sends its start and nothing else", 0, true, absl::ZeroDuration(), 0,
     IdleCase::kFirstChunk, "rows [0, 4)"},
    {"a client trickling a row every 60 ms into chunks of 4 rows, with a limit of 150 ms", 8, false,
     absl::Milliseconds(60), 0, IdleCase::kFirstChunk, "rows [0, 4)"},
    {"a client silent after its first chunk", 4, true, absl::ZeroDuration(), 1, IdleCase::kNext,
     "rows [4, 8)"},
};

class RowReaderIdleTest : public ::testing::TestWithParam<IdleCase> {};

TEST_P(RowReaderIdleTest, WaitEndsAfterTheIdleLimitNamingTheFlag) {
  const IdleCase& c = GetParam();
  SCOPED_TRACE(c.why);
  const std::vector<float> data = RandomRows(8, 17);
  const std::vector<float> sent(data.begin(), data.begin() + c.rows_sent * kHidden);
  ScriptedStream stream(Split(sent, 1), c.silent_at_end, c.pause);
  constexpr absl::Duration kLimit = absl::Milliseconds(150);
  const auto reader = StartReader(stream, Layout(8, 4), kLimit);
  if (c.waits_in != IdleCase::kFirstChunk) {
    ASSERT_TRUE(reader->AwaitFirstChunk().ok());
  }
  for (int i = 0; i < c.chunks_taken; ++i) {
    ASSERT_TRUE(reader->Next().ok());
    reader->Release();
  }
  const absl::Time start = absl::Now();
  absl::Status status;
  switch (c.waits_in) {
    case IdleCase::kFirstChunk: status = reader->AwaitFirstChunk(); break;
    case IdleCase::kNext: status = reader->Next().status(); break;
    case IdleCase::kFinish: status = reader->Finish(); break;
  }
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("--stream_idle_seconds"), std::string::npos) << status;
  EXPECT_NE(status.message().find(c.names), std::string::npos) << status;
  EXPECT_GE(waited, kLimit);
  EXPECT_LT(waited, kPatient);  // ended by its limit, not by the stream's end
  reader->Stop(status);
  EXPECT_EQ(stream.ended_status(), status);
}

INSTANTIATE_TEST_SUITE_P(Idle, RowReaderIdleTest, ::testing::ValuesIn(kIdleCases));

TEST(RowReaderTest, FirstChunkIsThereOnceItsRowsAreInOrTheStreamEnded) {
  const std::vector<float> data = RandomRows(8, 19);
  ScriptedStream whole(Split(data, 3));
  EXPECT_TRUE(StartReader(whole, Layout(8, 4))->AwaitFirstChunk().ok());
  ScriptedStream empty({});
  EXPECT_TRUE(StartReader(empty, Layout(0, 4))->AwaitFirstChunk().ok());
  const std::vector<float> two_rows(data.begin(), data.begin() + 2 * kHidden);
  ScriptedStream short_stream(Split(two_rows, 1));
  EXPECT_EQ(StartReader(short_stream, Layout(8, 4))->AwaitFirstChunk().code(),
            absl::StatusCode::kInvalidArgument);
}

// Before admission only the engine can free a buffer: the message the reader holds meanwhile counts
// as pending memory, no longer once the call is admitted; one that does not fit fails the reader.
TEST(RowReaderTest, AMessageHeldBeforeAdmissionIsPendingMemory) {
  const std::vector<float> data = RandomRows(12, 23);
  const std::vector<v1::ComputeRequest> one_message = Split(data, 12);  // 3 chunks of 4 rows
  // The message as the reader holds it: its rows where they arrived, beside the rest.
  const int64_t message_bytes =
      wire::ComputeRequestFrame::FromMessage(one_message.front()).SpaceUsed();
  {
    PendingMemory pending(/*capacity_bytes=*/1 << 20, /*per_connection_bytes=*/1 << 20);
    ScriptedStream stream(one_message);
    absl::StatusOr<std::unique_ptr<RowReader>> reader =
        RowReader::Start(stream, nullptr, Layout(12, 4), FreshHostBuffers(), kPatient,
                         PendingAccount{&pending, "ipv4:127.0.0.1:1"});
    ASSERT_TRUE(reader.ok()) << reader.status();
    ASSERT_TRUE((*reader)->AwaitFirstChunk().ok());
    const absl::Time deadline = absl::Now() + kPatient;
    while (pending.held_bytes() == 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(pending.held_bytes(), message_bytes);
    (*reader)->Admitted();
    EXPECT_EQ(pending.held_bytes(), 0);
    for (int chunk = 0; chunk < 3; ++chunk) {
      ASSERT_TRUE((*reader)->Next().ok());
      (*reader)->Release();
    }
    EXPECT_TRUE((*reader)->Finish().ok());
    EXPECT_EQ(pending.held_bytes(), 0);
  }
  {
    PendingMemory pending(/*capacity_bytes=*/message_bytes - 1,
                          /*per_connection_bytes=*/message_bytes - 1);
    ScriptedStream stream(one_message, /*silent_at_end=*/true);
    absl::StatusOr<std::unique_ptr<RowReader>> reader =
        RowReader::Start(stream, nullptr, Layout(12, 4), FreshHostBuffers(), kPatient,
                         PendingAccount{&pending, "ipv4:127.0.0.1:1"});
    ASSERT_TRUE(reader.ok()) << reader.status();
    const absl::Time deadline = absl::Now() + kPatient;
    while ((*reader)->Error().ok() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    const absl::Status error = (*reader)->Error();
    EXPECT_EQ(error.code(), absl::StatusCode::kResourceExhausted) << error;
    EXPECT_EQ(AdmissionRefusalOf(error), AdmissionRefusal::kPendingMemory) << error;
    EXPECT_EQ((*reader)->Next().status(), error);
    EXPECT_EQ(pending.held_bytes(), 0);
  }
}

}  // namespace
}  // namespace lossd::server
