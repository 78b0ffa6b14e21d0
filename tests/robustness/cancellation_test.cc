// Cancellations and disconnects: clients that cancel, drop their connection or stop sending at
// random points of a training stream leave no workspace, staging gradient or scheduler slot
// behind, never reach the accumulator, and later calls are still right.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

constexpr char kCancelHead[] = "abandoned";
constexpr int64_t kCancelVocab = 2000;
constexpr int64_t kCancelHidden = 64;
constexpr int64_t kCancelRows = 480;
constexpr int64_t kCancelRowsPerMessage = 20;
constexpr int kCancelTrials = 100;
constexpr int kCancelClients = 4;  // over 2 running slots, so that some calls wait in the queue
constexpr absl::Duration kStallDeadline = absl::Milliseconds(150);

enum class Abandon { kCancel, kDisconnect, kStall };

const char* AbandonName(Abandon how) {
  switch (how) {
    case Abandon::kCancel: return "cancel";
    case Abandon::kDisconnect: return "disconnect";
    case Abandon::kStall: return "stall";
  }
  return "?";
}

// Opens a training stream on a connection of its own, writes the first `messages` of `script`
// (the start, then chunks), waits `pause` and abandons the call without half-closing it: cancels
// it, drops stream, context and channel, or stops sending until its deadline passes. Returns the
// status the client saw, or nothing for a disconnect.
std::optional<grpc::Status> AbandonCall(int port, const std::vector<v1::ComputeRequest>& script,
                                        int messages, absl::Duration pause, Abandon how) {
  auto channel = PrivateChannel(port);
  auto stub = v1::LossService::NewStub(channel);
  auto context = std::make_unique<grpc::ClientContext>();
  if (how == Abandon::kStall) context->set_deadline(In(kStallDeadline));
  auto stream = stub->Compute(context.get());
  for (int i = 0; i < messages && stream->Write(script[i]); ++i) continue;
  absl::SleepFor(pause);
  switch (how) {
    case Abandon::kCancel: context->TryCancel(); break;
    case Abandon::kDisconnect:
      stream.reset();
      context.reset();
      stub.reset();
      channel.reset();
      return std::nullopt;
    case Abandon::kStall: absl::SleepFor(kStallDeadline); break;
  }
  v1::ComputeResponse response;
  while (stream->Read(&response)) continue;
  return stream->Finish();
}

TEST(CancellationTest, AbandonedStreamsLeakNothingAndAccumulateNothing) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config;
  config.demo = {kCancelHead, kCancelVocab, kCancelHidden, 5};
  config.workspace_budget_bytes = 1 << 20;  // about 100 rows per engine chunk
  config.max_running_calls = 2;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const Batch committed = RandomBatch(kCancelRows, kCancelVocab, kCancelHidden, rng);
  ASSERT_TRUE(CallCompute(*stub, StartFor(kCancelHead, committed, kCancelHidden, true),
                          FloatBytes(committed.hidden), kCancelRowsPerMessage)
                  .status.ok());
  const FetchedTensor weight = Fetch(*stub, kCancelHead, false);
  const FetchedTensor grad_before = Fetch(*stub, kCancelHead, true);
  const int64_t accumulator_bytes = server->ledger().current(MemoryPurpose::kGradients);

  // Every write point from "nothing sent" to "all but the last message of rows sent", each way
  // of leaving. (A call whose rows are all in is complete: it computes and commits without
  // waiting for the half-close, so leaving after the last row is no abandonment.)
  struct Trial {
    Abandon how;
    int messages;
    absl::Duration pause;
    std::vector<v1::ComputeRequest> script;
  };
  const int script_messages = 1 + static_cast<int>(kCancelRows / kCancelRowsPerMessage);
  std::uniform_int_distribution<int> how(0, 2), messages(0, script_messages - 1), pause_ms(0, 30);
  std::vector<Trial> trials;
  for (int i = 0; i < kCancelTrials; ++i) {
    trials.push_back(
        {static_cast<Abandon>(how(rng)), messages(rng), absl::Milliseconds(pause_ms(rng)),
         TrainingScript(kCancelHead, RandomBatch(kCancelRows, kCancelVocab, kCancelHidden, rng),
                        kCancelHidden, kCancelRowsPerMessage)});
  }
  const std::map<std::string, int64_t> calls_before = CallsByCode(*server, "Compute");
  const int64_t chunks_before = EngineChunksComputed(*server);
  std::vector<std::optional<grpc::Status>> seen(kCancelTrials);
  std::atomic<int> next{0};
  const absl::Time start = absl::Now();
  std::vector<std::thread> clients;
  for (int c = 0; c < kCancelClients; ++c) {
    clients.emplace_back([&] {
      for (int i = next++; i < kCancelTrials; i = next++) {
        seen[i] = AbandonCall(server->port(), trials[i].script, trials[i].messages, trials[i].pause,
                              trials[i].how);
      }
    });
  }
  for (auto& client : clients) client.join();
  RecordProperty("abandon_trials_seconds",
                 absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start)));

  std::map<std::string, int> counts;
  for (int i = 0; i < kCancelTrials; ++i) {
    const Trial& trial = trials[i];
    ++counts[AbandonName(trial.how)];
    SCOPED_TRACE(::testing::Message() << "trial " << i << ": " << AbandonName(trial.how)
                                      << " after " << trial.messages << " messages");
    if (trial.how == Abandon::kDisconnect) continue;
    ASSERT_TRUE(seen[i].has_value());
    const StatusCode code = seen[i]->error_code();
    const std::string message = seen[i]->error_message();
    if (trial.how == Abandon::kCancel) {
      EXPECT_EQ(code, StatusCode::CANCELLED) << message;
    } else {
      // The status a stalled call ends with is up to gRPC's transport: under ASan one ended
      // UNAVAILABLE instead of DEADLINE_EXCEEDED. What matters here is that it failed and, as
      // checked below, left nothing behind on the server.
      EXPECT_TRUE(code == StatusCode::DEADLINE_EXCEEDED || code == StatusCode::UNAVAILABLE)
          << "code " << code << ": " << message;
    }
  }
  for (const auto& [name, count] : counts) RecordProperty(absl::StrCat(name, "_trials"), count);

  EXPECT_TRUE(SettlesToIdle(*server, accumulator_bytes));
  EXPECT_EQ(server->ledger().current(MemoryPurpose::kWorkspace), 0);
  // The server ends every abandoned call it received once, never as a success. A call cancelled or
  // disconnected before gRPC hands it to a handler is dropped by gRPC unseen (rare, more so under
  // sanitizers), so only the stalled calls, open for their whole deadline, must all be counted.
  const int64_t stalled = counts[AbandonName(Abandon::kStall)];
  EXPECT_TRUE(Eventually(
      [&] { return Total(CallsByCode(*server, "Compute")) >= Total(calls_before) + stalled; }));
  std::map<std::string, int64_t> calls = CallsByCode(*server, "Compute");
  EXPECT_LE(Total(calls), Total(calls_before) + kCancelTrials);
  EXPECT_GE(Total(calls), Total(calls_before) + stalled);
  RecordProperty("calls_dropped_before_a_handler",
                 Total(calls_before) + kCancelTrials - Total(calls));
  EXPECT_EQ(calls["OK"], calls_before.at("OK"));
  for (const auto& [code, count] : calls) {
    const auto before = calls_before.find(code);
    RecordProperty(absl::StrCat("server_", code),
                   count - (before == calls_before.end() ? 0 : before->second));
  }
  RecordProperty("engine_chunks_computed_in_abandoned_calls",
                 EngineChunksComputed(*server) - chunks_before);
  const FetchedTensor grad_after = Fetch(*stub, kCancelHead, true);
  EXPECT_TRUE(BitwiseEqual(grad_after.values, grad_before.values))
      << "an abandoned call accumulated";

  // A later call computes and commits exactly what the reference says.
  const Batch fresh = RandomBatch(kCancelRows, kCancelVocab, kCancelHidden, rng);
  const ReferenceResult ref = Reference(weight.values, kCancelVocab, kCancelHidden, fresh);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kCancelHead, fresh, kCancelHidden, true),
                                         FloatBytes(fresh.hidden), kCancelRowsPerMessage);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  const FetchedTensor grad_committed = Fetch(*stub, kCancelHead, true);
  std::vector<float> added(grad_committed.values.size());
  for (size_t i = 0; i < added.size(); ++i) {
    added[i] = grad_committed.values[i] - grad_before.values[i];
  }
  EXPECT_LE(RelativeError(added, ref.grad_weight), kGradBound);
}

}  // namespace
}  // namespace lossd::testing
