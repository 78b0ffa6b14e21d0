// Pending memory: calls not yet admitted (waiting for their rows or in the queue) hold their start
// message while it is parsed, their labels and token weights, and rows read ahead, within one
// server-wide bound; beyond it a call is refused with RESOURCE_EXHAUSTED naming the bound.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

// A training start of `tokens` labels, its rows never made (2^21 of them would be 512 MiB).
v1::ComputeRequest LargeStart(int64_t tokens, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> token(0, kStallVocab - 1);
  Batch labels_only;
  labels_only.labels.resize(tokens);
  for (int64_t& y : labels_only.labels) y = token(rng);
  v1::ComputeRequest request;
  *request.mutable_start() = StartFor(kStallHead, labels_only, kStallHidden, true);
  return request;
}

TEST(PendingMemoryTest, CallsNotYetAdmittedStayWithinTheBound) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();
  config.pending_memory_bytes = 16 << 20;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  const int64_t bound = config.pending_memory_bytes;

  // One start alone over the bound: 2^21 labels are 16 MiB once copied, beside the message.
  {
    OpenStream call(server->port());
    ASSERT_TRUE(call.Write(LargeStart(1 << 21, rng)));
    const grpc::Status status = call.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_NE(status.error_message().find("--pending_memory_mib"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find(std::to_string(bound)), std::string::npos)
        << status.error_message();
  }

  // Starts of 2^18 labels (2 MiB once copied) that send no rows wait for them, each holding its
  // labels, until one more does not fit.
  constexpr int64_t kTokens = 1 << 18;
  constexpr int64_t kLabelBytes = kTokens * sizeof(int64_t);
  std::vector<std::unique_ptr<OpenStream>> waiting;
  grpc::Status refused;
  int64_t peak = 0;
  for (int i = 0; i < 16 && refused.ok(); ++i) {
    const int64_t held_before = server->pending_memory().held_bytes();
    auto call = std::make_unique<OpenStream>(server->port());
    ASSERT_TRUE(call->Write(LargeStart(kTokens, rng)));
    // Parsed once it holds its labels and a few rows' buffers, no longer the message as well
    // (whose labels alone take kLabelBytes); or refused.
    const auto parsed = [&] {
      const int64_t held = server->pending_memory().held_bytes() - held_before;
      return held >= kLabelBytes && held < 2 * kLabelBytes;
    };
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!parsed() && Total(CallsByCode(*server, "Compute")) < 2 && absl::Now() < deadline) {
      peak = std::max(peak, server->pending_memory().held_bytes());
      absl::SleepFor(absl::Milliseconds(1));
    }
    if (Total(CallsByCode(*server, "Compute")) == 2) {
      refused = call->Finish();
    } else {
      waiting.push_back(std::move(call));
    }
    peak = std::max(peak, server->pending_memory().held_bytes());
  }
  RecordProperty("calls_waiting_when_refused", static_cast<int>(waiting.size()));
  RecordProperty("peak_pending_bytes", std::to_string(peak));
  EXPECT_GE(waiting.size(), 2u);
  EXPECT_LE(waiting.size(), static_cast<size_t>(bound / kLabelBytes));
  EXPECT_LE(peak, bound);
  EXPECT_EQ(refused.error_code(), StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--pending_memory_mib"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(EventMetric(*server, "lossd_admission_rejected_total", {{"reason", "pending_memory"}}),
            2.0);
  for (const char* other : {"queue_full", "over_budget"}) {
    EXPECT_EQ(EventMetric(*server, "lossd_admission_rejected_total", {{"reason", other}}), 0.0)
        << other;
  }

  // A small call still fits beside them and is served.
  auto stub = ConnectTo(server->port());
  const Batch batch = RandomBatch(kStallRowsPerMessage, kStallVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, false),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();

  // Gone, they hold nothing.
  for (auto& call : waiting) call->Cancel();
  waiting.clear();
  EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
  EXPECT_TRUE(SettlesToIdle(*server, 0));
}

// Silent starts on one connection stop at its share of the pending memory
// (--pending_memory_per_connection_mib): a client that opens calls it never feeds does not lock
// the others out.
TEST(PendingMemoryTest, OneConnectionCannotTakeItAll) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();
  config.pending_memory_bytes = 32 << 20;
  config.pending_memory_per_connection_bytes = 8 << 20;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  // Starts of 2^18 labels: 2 MiB once copied, about 4 MiB while parsed.
  constexpr int64_t kTokens = 1 << 18;
  constexpr int64_t kLabelBytes = kTokens * sizeof(int64_t);

  // Opens silent starts on `channel` until one is refused; the ones left waiting.
  const auto fill = [&](const std::shared_ptr<grpc::Channel>& channel, grpc::Status* refused) {
    std::vector<std::unique_ptr<OpenStream>> waiting;
    for (int i = 0; i < 16; ++i) {
      const double ended = Total(CallsByCode(*server, "Compute"));
      const int64_t held_before = server->pending_memory().held_bytes();
      auto call = std::make_unique<OpenStream>(channel);
      if (!call->Write(LargeStart(kTokens, rng))) {
        *refused = call->Finish();
        return waiting;
      }
      // Parsed (holding its labels, no longer the message) or refused.
      int64_t held = 0;
      const bool settled = Eventually([&] {
        held = server->pending_memory().held_bytes() - held_before;
        return Total(CallsByCode(*server, "Compute")) > ended ||
               (held >= kLabelBytes && held < 2 * kLabelBytes);
      });
      EXPECT_TRUE(settled) << "the start was neither parsed nor refused; it holds " << held;
      if (Total(CallsByCode(*server, "Compute")) > ended) {
        *refused = call->Finish();
        return waiting;
      }
      waiting.push_back(std::move(call));
    }
    return waiting;
  };

  const std::shared_ptr<grpc::Channel> greedy = PrivateChannel(server->port());
  grpc::Status refused;
  std::vector<std::unique_ptr<OpenStream>> greedy_calls = fill(greedy, &refused);
  EXPECT_GE(greedy_calls.size(), 1u);
  EXPECT_LE(greedy_calls.size(),
            static_cast<size_t>(config.pending_memory_per_connection_bytes / kLabelBytes));
  EXPECT_EQ(refused.error_code(), StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--pending_memory_per_connection_mib"), std::string::npos)
      << refused.error_message();
  const std::optional<v1::ErrorInfo> info = ErrorInfoIn(refused);
  ASSERT_TRUE(info.has_value()) << "no ErrorInfo in the refusal's details";
  EXPECT_EQ(info->reason(), v1::ErrorInfo::PENDING_MEMORY);
  EXPECT_LE(server->pending_memory().held_bytes(), config.pending_memory_per_connection_bytes);
  EXPECT_EQ(EventMetric(*server, "lossd_admission_rejected_total", {{"reason", "pending_memory"}}),
            1.0);

  // Another connection gets as many waiting calls in as the first did, while it still holds its
  // own, and a call on a third connection is served.
  grpc::Status other_refused;
  std::vector<std::unique_ptr<OpenStream>> other_calls =
      fill(PrivateChannel(server->port()), &other_refused);
  EXPECT_EQ(other_calls.size(), greedy_calls.size());
  EXPECT_NE(other_refused.error_message().find("--pending_memory_per_connection_mib"),
            std::string::npos)
      << other_refused.error_message();
  auto stub = ConnectTo(server->port());
  const Batch batch = RandomBatch(kStallRowsPerMessage, kStallVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, false),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();

  for (auto& call : greedy_calls) call->Cancel();
  for (auto& call : other_calls) call->Cancel();
  greedy_calls.clear();
  other_calls.clear();
  EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
  EXPECT_TRUE(SettlesToIdle(*server, 0));
}

// What a call copies out of its start counts whatever reads it: a PPO call's sampling
// log-probabilities and advantages as well as its labels.
TEST(PendingMemoryTest, AnObjectivesPerTokenInputsCountWithTheLabels) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  auto server = StartTestServer(StallConfig());
  ASSERT_NE(server, nullptr);
  constexpr int64_t kTokens = 1 << 18;
  v1::ComputeRequest request = LargeStart(kTokens, rng);
  v1::ComputeStart& start = *request.mutable_start();
  start.mutable_options()->set_objective(v1::OBJECTIVE_PPO);
  for (int64_t i = 0; i < kTokens; ++i) {
    start.add_sampling_logprobs(-3.0f);
    start.add_advantages(i % 2 == 0 ? 1.0f : -1.0f);
  }
  OpenStream call(server->port());
  ASSERT_TRUE(call.Write(request));
  // Parsed: 8 bytes of label and two 4-byte inputs a token, and a few rows' buffers (64 KiB), no
  // longer the message.
  constexpr int64_t kCopied = kTokens * (sizeof(int64_t) + 2 * sizeof(float));
  int64_t held = 0;
  EXPECT_TRUE(Eventually([&] {
    held = server->pending_memory().held_bytes();
    return held >= kCopied && held < kCopied + (1 << 20);
  })) << "pending memory held: "
      << held << " bytes";
  call.Cancel();
  EXPECT_EQ(call.Finish().error_code(), StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
}

// A queued call whose reader has filled both its buffers holds the message it read next until the
// engine frees one, which it does only once the call is admitted: that message counts as pending
// memory, and one that does not fit ends the call at once rather than leaving it in the queue.
TEST(PendingMemoryTest, AMessageHeldForAQueuedCallCounts) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  constexpr int64_t kRows = 8192;  // 2 MiB of rows in one message; 128 rows a buffer
  constexpr int64_t kMessageBytes = kRows * kStallHidden * sizeof(float);
  for (const bool fits : {true, false}) {
    SCOPED_TRACE(fits ? "the message fits the bound" : "the message does not fit the bound");
    server::ServerConfig config = StallConfig();
    config.max_running_calls = 1;
    // Room for one training call: a silent one, which gives its slot and workspace back while it
    // waits for rows, keeps its staging dL/dW admitted, and the next training call must queue.
    config.compute_memory_bytes =
        (int64_t{1} << 20) + kStallVocab * kStallHidden * static_cast<int64_t>(sizeof(float));
    config.pending_memory_bytes = fits ? 64 << 20 : 1 << 20;
    auto server = StartTestServer(config);
    ASSERT_NE(server, nullptr);
    auto stub = ConnectTo(server->port());
    const FetchedTensor weight = Fetch(*stub, kStallHead, false);

    // Admitted with its first 200 rows, then silent: it holds the device's memory.
    OpenStream blocker(server->port());
    const std::vector<v1::ComputeRequest> blocking = TrainingScript(
        kStallHead, RandomBatch(kStallRows, kStallVocab, kStallHidden, rng), kStallHidden, 200);
    ASSERT_TRUE(blocker.Write(blocking[0]));
    ASSERT_TRUE(blocker.Write(blocking[1]));
    ASSERT_TRUE(Eventually([&] { return server->scheduler().admitted_bytes() > 0; }));

    const Batch batch = RandomBatch(kRows, kStallVocab, kStallHidden, rng);
    auto queued = std::async(std::launch::async, [&] {
      return CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                         FloatBytes(batch.hidden), kRows);
    });
    if (fits) {
      int64_t held = 0;
      EXPECT_TRUE(Eventually([&] {
        held = server->pending_memory().held_bytes();
        return server->scheduler().queued() == 1 && held >= kMessageBytes;
      })) << "pending memory held: "
          << held << " bytes";
      blocker.Cancel();
    }
    // Not fitting, it is refused while the blocker still holds the device (checked below): had
    // it waited in the queue instead, it would run once the blocker's idle limit ended it.
    const ComputeOutcome out = queued.get();
    if (fits) {
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
      const ReferenceResult ref = Reference(weight.values, kStallVocab, kStallHidden, batch);
      EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
      EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
    } else {
      EXPECT_EQ(out.status.error_code(), StatusCode::RESOURCE_EXHAUSTED)
          << out.status.error_message();
      EXPECT_NE(out.status.error_message().find("--pending_memory_mib"), std::string::npos)
          << out.status.error_message();
      EXPECT_GT(server->scheduler().admitted_bytes(), 0)
          << "the call was refused while the blocker held the device";
      EXPECT_EQ(
          EventMetric(*server, "lossd_admission_rejected_total", {{"reason", "pending_memory"}}),
          1.0);
      blocker.Cancel();
    }
    EXPECT_TRUE(Eventually([&] { return server->pending_memory().held_bytes() == 0; }));
    EXPECT_TRUE(SettlesToIdle(*server, fits ? kStallVocab * kStallHidden * sizeof(float) : 0));
  }
}

}  // namespace
}  // namespace lossd::testing
