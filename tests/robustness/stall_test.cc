// Stalled streams: a client that opens a Compute call and then sends nothing, or too little too
// slowly, holds no running slot while its call waits for its first rows; every wait for a client
// is bounded by --stream_idle_seconds, and the client is told so by a status naming the flag.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

TEST(StallTest, StreamsWaitingForRowsHoldNoRunningSlot) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const server::ServerConfig config = StallConfig();
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const FetchedTensor weight = Fetch(*stub, kStallHead, false);

  // As many clients as there are running slots send a training start, then nothing. Their
  // deadlines are far beyond the test: only the server could end them.
  std::vector<std::unique_ptr<OpenStream>> silent;
  for (int i = 0; i < config.max_running_calls; ++i) {
    silent.push_back(std::make_unique<OpenStream>(server->port(), absl::Hours(1)));
    const Batch batch = RandomBatch(kStallRows, kStallVocab, kStallHidden, rng);
    ASSERT_TRUE(silent.back()->Write(
        TrainingScript(kStallHead, batch, kStallHidden, kStallRowsPerMessage).front()));
  }
  // Both starts were read once both calls hold their labels.
  ASSERT_TRUE(Eventually([&] {
    return server->pending_memory().held_bytes() >=
           config.max_running_calls * kStallRows * static_cast<int64_t>(sizeof(int64_t));
  }));
  EXPECT_EQ(server->scheduler().running(), 0);
  EXPECT_EQ(server->scheduler().queued(), 0);

  // A third client's call is served while they wait: when it is done, neither silent call has
  // ended (their idle limit, --stream_idle_seconds, would end them and let it in).
  const Batch batch = RandomBatch(kStallRows, kStallVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  EXPECT_EQ(CallsByCode(*server, "Compute"), (std::map<std::string, int64_t>{{"OK", 1}}))
      << "the call was served only once a silent stream had ended";
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  const ReferenceResult ref = Reference(weight.values, kStallVocab, kStallHidden, batch);
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);

  // The silent calls were still waiting; cancelled now, they leave nothing behind.
  for (auto& call : silent) {
    call->Cancel();
    EXPECT_EQ(call->Finish().error_code(), StatusCode::CANCELLED);
  }
  EXPECT_TRUE(SettlesToIdle(*server, kStallVocab * kStallHidden * sizeof(float)));
  EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
}

struct StallCase {
  const char* name;
  const char* why;
  int64_t rows;            // announced in the start
  int64_t rows_at_once;    // sent at once, in messages of kStallRowsPerMessage rows
  absl::Duration trickle;  // then one row per message at this pace, up to `rows`
  bool half_close;         // after the last row
  bool reads_results;
  const char* waited_for;  // in the status message
};

void PrintTo(const StallCase& c, std::ostream* os) { *os << c.name; }

constexpr absl::Duration kStreamIdle = absl::Milliseconds(300);

const StallCase kStallCases[] = {
    {"start_only", "a start, then silence: the call ends before it is admitted", kStallRows, 0,
     absl::ZeroDuration(), false, true, "rows [0, "},
    {"silent_after_two_chunks", "admitted with its first chunks, then silent holding the device",
     kStallRows, 200, absl::ZeroDuration(), false, true, "rows ["},
    {"trickle", "a row every 40 ms: each chunk of 128 rows takes 5 s", kStallRows, 0,
     absl::Milliseconds(40), false, true, "rows [0, "},
    {"trickle_after_first_chunk", "admitted, then a row every 40 ms", kStallRows, 120,
     absl::Milliseconds(40), false, true, "rows ["},
    {"never_reads_results",
     "every row, half-closed, and not one result read: 4 MB of dL/dh, more "
     "than gRPC buffers for a client that reads nothing (4000 rows fit), so flow control holds "
     "the results back",
     16000, 16000, absl::ZeroDuration(), true, false, "read its results"},
};

class StalledStreamTest : public ::testing::TestWithParam<StallCase> {};

TEST_P(StalledStreamTest, IsEndedAfterTheIdleLimitNamingTheFlag) {
  const StallCase& c = GetParam();
  SCOPED_TRACE(c.why);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();
  config.stream_idle = kStreamIdle;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  const Batch batch = RandomBatch(c.rows, kStallVocab, kStallHidden, rng);
  const std::vector<v1::ComputeRequest> script =
      TrainingScript(kStallHead, batch, kStallHidden, kStallRowsPerMessage);
  const std::string rows = FloatBytes(batch.hidden);
  const size_t row_bytes = kStallHidden * sizeof(float);

  OpenStream call(server->port(), absl::Seconds(30));
  const absl::Time start = absl::Now();
  // Written on a thread of its own: a client that reads nothing may find its writes held back.
  std::thread writer([&] {
    if (!call.Write(script.front())) return;
    for (int64_t m = 0; m < c.rows_at_once / kStallRowsPerMessage; ++m) {
      if (!call.Write(script[1 + m])) return;
    }
    for (int64_t row = c.rows_at_once; c.trickle > absl::ZeroDuration() && row < c.rows; ++row) {
      absl::SleepFor(c.trickle);
      v1::ComputeRequest one;
      one.mutable_chunk()->set_hidden(rows.substr(row * row_bytes, row_bytes));
      if (!call.Write(one)) return;
    }
    if (c.half_close) call.WritesDone();
  });
  // A client that reads nothing sees nothing: the server's own count says how the call ended.
  if (!c.reads_results) {
    EXPECT_TRUE(Eventually([&] { return Total(CallsByCode(*server, "Compute")) == 1; }));
  }
  const grpc::Status status = call.Finish();
  const absl::Duration took = absl::Now() - start;
  writer.join();
  RecordProperty("client_saw", server::GrpcCodeName(status.error_code()));
  RecordProperty("seconds", absl::StrCat(absl::ToDoubleSeconds(took)));

  // Counted before the client could hear its status.
  EXPECT_EQ(CallsByCode(*server, "Compute"),
            (std::map<std::string, int64_t>{{"DEADLINE_EXCEEDED", 1}}));
  if (c.reads_results) {
    EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED) << status.error_message();
    EXPECT_NE(status.error_message().find("--stream_idle_seconds"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find(c.waited_for), std::string::npos)
        << status.error_message();
  }
  EXPECT_GE(took, kStreamIdle);
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_TRUE(SettlesToIdle(*server, 0));
  EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
  const FetchedTensor grad = Fetch(*ConnectTo(server->port()), kStallHead, true);
  ASSERT_TRUE(grad.status.ok());
  EXPECT_TRUE(std::all_of(grad.values.begin(), grad.values.end(), [](float g) { return g == 0; }))
      << "a stalled call accumulated";
}

INSTANTIATE_TEST_SUITE_P(Table, StalledStreamTest, ::testing::ValuesIn(kStallCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The threads of this process.
int64_t ThreadCount() {
  return std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                       std::filesystem::directory_iterator());
}

// Streams that open and send no start message cost no thread and are ended at the idle limit
// (DEADLINE_EXCEEDED naming the start message); past the bound on such streams a new one is
// refused with RESOURCE_EXHAUSTED.
TEST(StallTest, StreamsWithoutAStartCostNoThreadAndEndAtTheIdleLimit) {
  server::ServerConfig config = StallConfig();
  config.stream_idle = absl::Seconds(1);
  config.max_unstarted_streams = 64;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto channel = PrivateChannel(server->port());
  ASSERT_TRUE(channel->WaitForConnected(In(absl::Hours(1))));
  auto stub = v1::LossService::NewStub(channel);
  struct Silent {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::ComputeRequest, v1::ComputeResponse>> stream;
  };
  const int64_t threads_before = ThreadCount();
  std::vector<std::unique_ptr<Silent>> silent;
  for (int64_t i = 0; i < config.max_unstarted_streams; ++i) {
    silent.push_back(std::make_unique<Silent>());
    silent.back()->stream = stub->Compute(&silent.back()->context);
  }
  // The server holds all of them (or has ended the first at their limit already).
  ASSERT_TRUE(Eventually([&] {
    return EventMetric(*server, "lossd_inflight_calls") + Total(CallsByCode(*server, "Compute")) >=
           config.max_unstarted_streams;
  }));
  const int64_t threads_added = ThreadCount() - threads_before;
  RecordProperty("threads_added", threads_added);
  EXPECT_LT(threads_added, 16) << "a thread per silent stream";
  for (auto& s : silent) {
    v1::ComputeResponse response;
    while (s->stream->Read(&response)) continue;
    const grpc::Status status = s->stream->Finish();
    EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED) << status.error_message();
    EXPECT_NE(status.error_message().find("its start message (ComputeStart)"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("--stream_idle_seconds"), std::string::npos)
        << status.error_message();
  }
  EXPECT_EQ(CallsByCode(*server, "Compute"),
            (std::map<std::string, int64_t>{{"DEADLINE_EXCEEDED", config.max_unstarted_streams}}));
  EXPECT_TRUE(Eventually([&] { return EventMetric(*server, "lossd_inflight_calls") == 0.0; }));

  // Past the bound: one stream more than it, while all wait (a server whose limit is far off).
  config.stream_idle = absl::Hours(1);
  auto patient = StartTestServer(config);
  ASSERT_NE(patient, nullptr);
  auto patient_channel = PrivateChannel(patient->port());
  ASSERT_TRUE(patient_channel->WaitForConnected(In(absl::Hours(1))));
  auto patient_stub = v1::LossService::NewStub(patient_channel);
  std::vector<std::unique_ptr<Silent>> full;
  for (int64_t i = 0; i < config.max_unstarted_streams; ++i) {
    full.push_back(std::make_unique<Silent>());
    full.back()->stream = patient_stub->Compute(&full.back()->context);
  }
  ASSERT_TRUE(Eventually([&] {
    return EventMetric(*patient, "lossd_inflight_calls") >= config.max_unstarted_streams;
  }));
  Silent extra;
  extra.stream = patient_stub->Compute(&extra.context);
  v1::ComputeResponse response;
  while (extra.stream->Read(&response)) continue;
  const grpc::Status refused = extra.stream->Finish();
  EXPECT_EQ(refused.error_code(), StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("wait for their start message"), std::string::npos)
      << refused.error_message();
  for (auto& s : full) s->context.TryCancel();
  for (auto& s : full) {
    while (s->stream->Read(&response)) continue;
    s->stream->Finish();
  }
  EXPECT_TRUE(Eventually([&] { return EventMetric(*patient, "lossd_inflight_calls") == 0.0; }));
  // The server still serves.
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(8, kStallVocab, kStallHidden, rng);
  EXPECT_TRUE(CallCompute(*ConnectTo(server->port()),
                          StartFor(kStallHead, batch, kStallHidden, true), FloatBytes(batch.hidden),
                          8)
                  .status.ok());
}

// The rows a call announced are the whole call: once they are in, it computes, commits and
// answers without waiting for the client to half-close (which the server would otherwise wait
// for up to its idle limit, holding a running slot).
TEST(StallTest, ACallWhoseRowsAreAllInNeedsNoHalfClose) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();
  config.stream_idle = absl::Hours(1);
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  const FetchedTensor weight = Fetch(*ConnectTo(server->port()), kStallHead, false);
  const Batch batch = RandomBatch(kStallRows, kStallVocab, kStallHidden, rng);
  OpenStream call(server->port(), absl::Hours(1));
  for (const v1::ComputeRequest& message :
       TrainingScript(kStallHead, batch, kStallHidden, kStallRowsPerMessage)) {
    ASSERT_TRUE(call.Write(message));
  }
  // No WritesDone: the status comes all the same.
  const grpc::Status status = call.Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  const FetchedTensor grad = Fetch(*ConnectTo(server->port()), kStallHead, true);
  const ReferenceResult ref = Reference(weight.values, kStallVocab, kStallHidden, batch);
  EXPECT_LE(RelativeError(grad.values, ref.grad_weight), kGradBound);
  EXPECT_TRUE(SettlesToIdle(*server, kStallVocab * kStallHidden * sizeof(float)));
}

// Clients that never read their results (one of them not half-closing either) do not keep a
// third client's call waiting: a call whose client has not taken its results holds no running
// slot, and one that has committed frees the device before its summary goes out.
TEST(StallTest, ClientsThatReadNothingHoldNoRunningSlot) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();
  config.stream_idle = absl::Hours(1);  // only the server's scheduling may let the third call in
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const FetchedTensor weight = Fetch(*stub, kStallHead, false);

  // 16000 rows of dL/dh (4 MB) each: more than gRPC buffers for a client that reads nothing, so
  // flow control holds the results back.
  constexpr int64_t kUnreadRows = 16000;
  // All streams open before any writer starts: the writers index the vector.
  std::vector<std::unique_ptr<OpenStream>> unread;
  for (int i = 0; i < config.max_running_calls; ++i) {
    unread.push_back(std::make_unique<OpenStream>(server->port(), absl::Hours(1)));
  }
  std::vector<std::thread> writers;
  for (int i = 0; i < config.max_running_calls; ++i) {
    writers.emplace_back([&, i, batch = RandomBatch(kUnreadRows, kStallVocab, kStallHidden, rng)] {
      for (const v1::ComputeRequest& message :
           TrainingScript(kStallHead, batch, kStallHidden, 400)) {
        if (!unread[i]->Write(message)) return;
      }
      if (i == 0) unread[i]->WritesDone();  // the other never half-closes
    });
  }
  // Both hold the device before the third call comes.
  ASSERT_TRUE(Eventually([&] { return EngineChunksComputed(*server) >= 2; }));

  const Batch batch = RandomBatch(4, kStallVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), 4);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_TRUE(
      LossMatches(out.summary.loss(), Reference(weight.values, kStallVocab, kStallHidden, batch)));
  // Neither unread call had ended when the third was served.
  EXPECT_EQ(CallsByCode(*server, "Compute"), (std::map<std::string, int64_t>{{"OK", 1}}));
  for (auto& call : unread) call->Cancel();
  for (auto& writer : writers) writer.join();
  for (auto& call : unread) EXPECT_EQ(call->Finish().error_code(), StatusCode::CANCELLED);
  EXPECT_TRUE(SettlesToIdle(*server, kStallVocab * kStallHidden * sizeof(float)));
}

}  // namespace
}  // namespace lossd::testing
