// What a training run needs beyond single calls, through a real server on loopback: gradients
// staged by forwards and committed by their backward times its upstream gradient, steps that the
// ranks of a job take together once, and a 16-bit head whose updates add up in fp32 master
// weights. The rendezvous of ranks is tested alone first, with threads as ranks.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "lossd/kernels/half.h"
#include "server/replicas/rank_rendezvous.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/scratch_files.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using grpc::StatusCode;
using server::RankRendezvous;
using server::RendezvousOptions;

constexpr double kGradBound = 2e-5;  // the engine's dL/dW bound against float64 (engine_test.cc)

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// ---------------------------------------------------------------------------------------------
// The rendezvous alone. Waits that a test expects to end in success are long (a loaded machine
// may start a thread late); waits that it expects to run out are short.

constexpr absl::Duration kPatient = absl::Seconds(120);

struct Joined {
  absl::StatusOr<std::string> result = std::string();
};

// `world` ranks joining `key` on threads; the action counts how often it ran.
std::vector<Joined> JoinAll(RankRendezvous& rendezvous, const std::string& key, int world,
                            std::atomic<int>& actions, const std::vector<int>& ranks) {
  std::vector<Joined> joined(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      joined[i].result = rendezvous.Join(
          key, world, ranks[i], 7, [] { return false; },
          [&]() -> absl::StatusOr<std::string> {
            ++actions;
            return std::string("stepped");
          });
    });
  }
  for (std::thread& t : threads) t.join();
  return joined;
}

TEST(RankRendezvousTest, TheLastRankActsOnceAndEveryRankGetsItsOutcome) {
  RankRendezvous rendezvous({.wait = kPatient});
  std::atomic<int> actions = 0;
  for (const Joined& j : JoinAll(rendezvous, "step v1", 4, actions, {0, 1, 2, 3})) {
    ASSERT_TRUE(j.result.ok()) << j.result.status();
    EXPECT_EQ(*j.result, "stepped");
  }
  EXPECT_EQ(actions, 1);
  // A rank that lost its answer and asks again gets the same outcome; nothing acts again.
  const absl::StatusOr<std::string> retry = rendezvous.Join(
      "step v1", 4, 2, 7, [] { return false; },
      [&]() -> absl::StatusOr<std::string> {
        ++actions;
        return std::string("again");
      });
  ASSERT_TRUE(retry.ok());
  EXPECT_EQ(*retry, "stepped");
  EXPECT_EQ(actions, 1);
  EXPECT_EQ(rendezvous.waiting_meetings(), 0);
}

TEST(RankRendezvousTest, ARankThatNeverComesFailsTheMeetingForAllAndNothingActs) {
  RankRendezvous rendezvous({.wait = absl::Milliseconds(300)});
  std::atomic<int> actions = 0;
  for (const Joined& j : JoinAll(rendezvous, "step v2", 3, actions, {0, 2})) {
    ASSERT_EQ(j.result.status().code(), absl::StatusCode::kAborted);
    EXPECT_TRUE(Contains(std::string(j.result.status().message()), "rank(s) 1 of 3"));
    EXPECT_TRUE(Contains(std::string(j.result.status().message()), "nothing was applied"));
  }
  EXPECT_EQ(actions, 0);
  // The latecomer hears the same failure, and does not act alone.
  const absl::StatusOr<std::string> late = rendezvous.Join(
      "step v2", 3, 1, 7, [] { return false; },
      [&]() -> absl::StatusOr<std::string> {
        ++actions;
        return std::string("stepped");
      });
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(actions, 0);
}

TEST(RankRendezvousTest, ACancelledRankFailsTheOthersAfterTheGrace) {
  RankRendezvous rendezvous(
      {.wait = kPatient, .grace = absl::Milliseconds(200), .poll = absl::Milliseconds(10)});
  std::atomic<bool> cancel = false;
  absl::StatusOr<std::string> rank1;
  std::thread leaver([&] {
    rank1 = rendezvous.Join(
        "step v3", 3, 1, 7, [&] { return cancel.load(); },
        []() -> absl::StatusOr<std::string> { return std::string("x"); });
  });
  ASSERT_TRUE(Eventually([&] { return rendezvous.waiting_meetings() == 1; }));
  cancel = true;  // its process died while it waited
  leaver.join();
  EXPECT_EQ(rank1.status().code(), absl::StatusCode::kCancelled);
  std::atomic<int> actions = 0;
  const absl::Time start = absl::Now();
  for (const Joined& j : JoinAll(rendezvous, "step v3", 3, actions, {0, 2})) {
    ASSERT_EQ(j.result.status().code(), absl::StatusCode::kAborted);
    EXPECT_TRUE(Contains(std::string(j.result.status().message()), "its call was cancelled"));
  }
  EXPECT_EQ(actions, 0);
  EXPECT_LT(absl::Now() - start, kPatient) << "the grace, not the whole wait";
}

TEST(RankRendezvousTest, ARankThatComesBackAfterItsCallWasCancelledCompletesTheMeeting) {
  RankRendezvous rendezvous(
      {.wait = kPatient, .grace = absl::Seconds(60), .poll = absl::Milliseconds(10)});
  std::atomic<bool> cancel = false;
  std::thread first_attempt([&] {
    (void)rendezvous.Join(
        "step v4", 2, 1, 7, [&] { return cancel.load(); },
        []() -> absl::StatusOr<std::string> { return std::string("x"); });
  });
  ASSERT_TRUE(Eventually([&] { return rendezvous.waiting_meetings() == 1; }));
  cancel = true;  // its client's deadline expired; the client retries
  first_attempt.join();
  std::atomic<int> actions = 0;
  for (const Joined& j : JoinAll(rendezvous, "step v4", 2, actions, {0, 1})) {
    ASSERT_TRUE(j.result.ok()) << j.result.status();
  }
  EXPECT_EQ(actions, 1);
}

TEST(RankRendezvousTest, RanksThatDisagreeAreRefusedByName) {
  RankRendezvous rendezvous({.wait = absl::Milliseconds(300)});
  absl::StatusOr<std::string> first;
  std::thread waiting([&] {
    first = rendezvous.Join(
        "step v5", 2, 0, 7, [] { return false; },
        []() -> absl::StatusOr<std::string> { return std::string("x"); });
  });
  ASSERT_TRUE(Eventually([&] { return rendezvous.waiting_meetings() == 1; }));
  const auto act = []() -> absl::StatusOr<std::string> { return std::string("x"); };
  const absl::StatusOr<std::string> other_request = rendezvous.Join(
      "step v5", 2, 1, 8, [] { return false; }, act);
  EXPECT_EQ(other_request.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(std::string(other_request.status().message()), "differs"));
  const absl::StatusOr<std::string> other_world = rendezvous.Join(
      "step v5", 3, 1, 7, [] { return false; }, act);
  EXPECT_TRUE(Contains(std::string(other_world.status().message()), "ranks.world_size: 3"));
  const absl::StatusOr<std::string> bad_rank = rendezvous.Join(
      "step v5", 2, 2, 7, [] { return false; }, act);
  EXPECT_TRUE(Contains(std::string(bad_rank.status().message()), "ranks.rank: expected 0 to 1"));
  waiting.join();
  EXPECT_EQ(first.status().code(), absl::StatusCode::kAborted);
}

// ---------------------------------------------------------------------------------------------
// Staged gradients through a server.

constexpr int64_t kVocab = 150;
constexpr int64_t kHidden = 12;
constexpr int64_t kRows = 37;

v1::HeadInfo GetHead(v1::LossService::Stub& stub, const std::string& head) {
  grpc::ClientContext context;
  v1::GetHeadRequest request;
  request.set_head(head);
  v1::HeadInfo info;
  EXPECT_TRUE(stub.GetHead(&context, request, &info).ok());
  return info;
}

grpc::Status Commit(v1::LossService::Stub& stub, const std::string& head,
                    const std::string& call_id, double scale,
                    v1::CommitGradWeightResponse* response = nullptr) {
  grpc::ClientContext context;
  v1::CommitGradWeightRequest request;
  request.set_head(head);
  request.set_call_id(call_id);
  request.set_scale(scale);
  v1::CommitGradWeightResponse unused;
  return stub.CommitGradWeight(&context, request, response != nullptr ? response : &unused);
}

v1::StepRequest SgdRequest(const std::string& head, double learning_rate) {
  v1::StepRequest request;
  request.set_head(head);
  request.mutable_sgd()->set_learning_rate(learning_rate);
  return request;
}

grpc::Status Step(v1::LossService::Stub& stub, const v1::StepRequest& request,
                  v1::StepResponse* response = nullptr) {
  grpc::ClientContext context;
  v1::StepResponse unused;
  return stub.Step(&context, request, response != nullptr ? response : &unused);
}

std::vector<double> Scaled(const std::vector<double>& values, double scale) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = values[i] * scale;
  return out;
}

class StagedGradientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = StartTestServer(MultiChunkDemoConfig("unused", 100, kHidden, 3)).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    rng_.seed(FreshSeed());
    stub_ = ConnectTo(server_->port());
    head_ = absl::StrReplaceAll(::testing::UnitTest::GetInstance()->current_test_info()->name(),
                                {{"/", "_"}});
    weight_ = RandomWeight(kVocab, kHidden, rng_);
    ASSERT_TRUE(Upload(*stub_, head_, kVocab, kHidden, weight_, true).ok());
    batch_ = RandomBatch(kRows, kVocab, kHidden, rng_);
    reference_ = Reference(weight_, kVocab, kHidden, batch_);
  }

  ComputeOutcome Stage(const std::string& call_id) {
    v1::ComputeStart start = StartFor(head_, batch_, kHidden, /*training=*/true);
    start.set_call_id(call_id);
    start.set_stage_grad_weight(true);
    return CallCompute(*stub_, start, FloatBytes(batch_.hidden), 16);
  }

  std::vector<float> Gradient() {
    const FetchedTensor grad = Fetch(*stub_, head_, true);
    EXPECT_TRUE(grad.status.ok()) << grad.status.error_message();
    return grad.values;
  }

  static server::LossServer* server_;
  std::mt19937_64 rng_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  std::string head_;
  std::vector<float> weight_;
  Batch batch_;
  ReferenceResult reference_;
};

server::LossServer* StagedGradientTest::server_ = nullptr;

TEST_F(StagedGradientTest, AddsNothingUntilItsCommitThenItsGradientTimesTheScale) {
  const ComputeOutcome staged = Stage("forward-1");
  ASSERT_TRUE(staged.status.ok()) << staged.status.error_message();
  EXPECT_TRUE(staged.summary.grad_weight_staged());
  EXPECT_FALSE(staged.summary.grad_weight_accumulated());
  EXPECT_EQ(GetHead(*stub_, head_).staged_gradients(), 1);
  for (float g : Gradient()) ASSERT_EQ(g, 0.0f) << "a staged gradient is not in the accumulator";
  // dL/dh came back as for any training call: the forward is complete but for dL/dW.
  EXPECT_LE(RelativeError(AsFloats(staged.grad_hidden), reference_.grad_hidden), kGradBound);

  ASSERT_TRUE(Commit(*stub_, head_, "forward-1", -0.75).ok());
  EXPECT_LE(RelativeError(Gradient(), Scaled(reference_.grad_weight, -0.75)), kGradBound);
  const v1::HeadInfo info = GetHead(*stub_, head_);
  EXPECT_EQ(info.staged_gradients(), 0);
  EXPECT_EQ(info.accumulated_calls(), 1);
  EXPECT_EQ(info.accumulated_tokens(), kRows);
}

TEST_F(StagedGradientTest, ARepeatedCommitIsAReplayAndOneWithAnotherScaleIsRefused) {
  ASSERT_TRUE(Stage("forward-2").status.ok());
  v1::CommitGradWeightResponse first, repeat;
  ASSERT_TRUE(Commit(*stub_, head_, "forward-2", 2.0, &first).ok());
  EXPECT_FALSE(first.replayed());
  ASSERT_TRUE(Commit(*stub_, head_, "forward-2", 2.0, &repeat).ok());
  EXPECT_TRUE(repeat.replayed());
  const grpc::Status other = Commit(*stub_, head_, "forward-2", 3.0);
  EXPECT_EQ(other.error_code(), StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(Contains(other.error_message(), "with scale 2"));
  EXPECT_LE(RelativeError(Gradient(), Scaled(reference_.grad_weight, 2.0)), kGradBound);
  // The forward computed again under its id (a retry whose first answer was lost) adds nothing.
  const ComputeOutcome again = Stage("forward-2");
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(again.summary.replayed());
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 1);
}

TEST_F(StagedGradientTest, AStepDropsWhatIsStagedAndALateCommitSaysWhy) {
  ASSERT_TRUE(Stage("evaluation-forward").status.ok());
  ASSERT_TRUE(Step(*stub_, SgdRequest(head_, 0.5)).ok());
  EXPECT_EQ(GetHead(*stub_, head_).staged_gradients(), 0);
  const FetchedTensor weight = Fetch(*stub_, head_, false);
  EXPECT_TRUE(BitwiseEqual(weight.values, weight_)) << "SGD on a gradient of zeros moves nothing";
  const grpc::Status late = Commit(*stub_, head_, "evaluation-forward", 1.0);
  EXPECT_EQ(late.error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(Contains(late.error_message(), "stepped"));
}

TEST_F(StagedGradientTest, DiscardDropsAStagedGradient) {
  ASSERT_TRUE(Stage("never-backpropagated").status.ok());
  grpc::ClientContext context;
  v1::DiscardGradWeightRequest request;
  request.set_head(head_);
  request.add_call_ids("never-backpropagated");
  request.add_call_ids("unknown");
  v1::DiscardGradWeightResponse response;
  ASSERT_TRUE(stub_->DiscardGradWeight(&context, request, &response).ok());
  EXPECT_EQ(response.discarded(), 1);
  const grpc::Status late = Commit(*stub_, head_, "never-backpropagated", 1.0);
  EXPECT_EQ(late.error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(Contains(late.error_message(), "discarded"));
}

TEST_F(StagedGradientTest, BadStagesAndCommitsAreRefusedByName) {
  v1::ComputeStart start = StartFor(head_, batch_, kHidden, /*training=*/true);
  start.set_stage_grad_weight(true);
  start.set_call_id("");
  ComputeOutcome no_id = CallCompute(*stub_, start, FloatBytes(batch_.hidden), 16);
  EXPECT_EQ(no_id.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(no_id.status.error_message(), "call_id"));
  start.set_call_id("scoring");
  start.mutable_outputs()->set_accumulate_grad_weight(false);
  ComputeOutcome scoring = CallCompute(*stub_, start, FloatBytes(batch_.hidden), 16);
  EXPECT_EQ(scoring.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(scoring.status.error_message(), "stage_grad_weight"));
  ASSERT_TRUE(Stage("forward-3").status.ok());
  const grpc::Status infinite = Commit(*stub_, head_, "forward-3", HUGE_VAL);
  EXPECT_EQ(infinite.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(infinite.error_message(), "scale"));
}

TEST(StagedGradientRoomTest, AFullRoomGivesWayToTheNewestAndAGradientLargerThanItCommitsAtOnce) {
  // Room for two of this head's gradients.
  server::ServerConfig config = MultiChunkDemoConfig("small", kVocab, kHidden, 5);
  config.staged_grad_bytes = 2 * kVocab * kHidden * static_cast<int64_t>(sizeof(float));
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);
  const auto stage = [&](const std::string& head, const std::string& id) {
    v1::ComputeStart start = StartFor(head, batch, kHidden, /*training=*/true);
    start.set_call_id(id);
    start.set_stage_grad_weight(true);
    return CallCompute(*stub, start, FloatBytes(batch.hidden), 64);
  };
  for (const char* id : {"a", "b", "c"}) {
    const ComputeOutcome outcome = stage("small", id);
    ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
    EXPECT_TRUE(outcome.summary.grad_weight_staged()) << id;
  }
  EXPECT_EQ(GetHead(*stub, "small").staged_gradients(), 2);
  const grpc::Status evicted = Commit(*stub, "small", "a", 1.0);
  EXPECT_EQ(evicted.error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(Contains(evicted.error_message(), "took its room"));
  EXPECT_TRUE(Commit(*stub, "small", "c", 1.0).ok());

  // A head whose gradient alone is larger than the room: the call commits as if unstaged.
  const std::vector<float> big = RandomWeight(3 * kVocab, kHidden, rng);
  ASSERT_TRUE(Upload(*stub, "big", 3 * kVocab, kHidden, big, false).ok());
  const ComputeOutcome outcome = stage("big", "d");
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_FALSE(outcome.summary.grad_weight_staged());
  EXPECT_TRUE(outcome.summary.grad_weight_accumulated());
  EXPECT_EQ(GetHead(*stub, "big").accumulated_calls(), 1);
}

TEST(StagedGradientExpiryTest, AGradientNeverCommittedExpires) {
  server::ServerConfig config = MultiChunkDemoConfig("head", kVocab, kHidden, 6);
  config.staged_grad_ttl = absl::Milliseconds(100);
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);
  v1::ComputeStart start = StartFor("head", batch, kHidden, /*training=*/true);
  start.set_call_id("forgotten");
  start.set_stage_grad_weight(true);
  ASSERT_TRUE(CallCompute(*stub, start, FloatBytes(batch.hidden), 64).status.ok());
  ASSERT_TRUE(Eventually([&] { return GetHead(*stub, "head").staged_gradients() == 0; }));
  const grpc::Status late = Commit(*stub, "head", "forgotten", 1.0);
  EXPECT_EQ(late.error_code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(Contains(late.error_message(), "expired"));
}

// ---------------------------------------------------------------------------------------------
// Collective steps: threads as the ranks of a job, each with its own connection.

struct RankReply {
  grpc::Status status;
  v1::StepResponse response;
};

std::vector<RankReply> StepAsRanks(int port, v1::StepRequest request, int world,
                                   const std::vector<int>& ranks) {
  std::vector<RankReply> replies(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      auto stub = ConnectTo(port);
      v1::StepRequest mine = request;
      mine.mutable_ranks()->set_world_size(world);
      mine.mutable_ranks()->set_rank(ranks[i]);
      replies[i].status = Step(*stub, mine, &replies[i].response);
    });
  }
  for (std::thread& t : threads) t.join();
  return replies;
}

TEST_F(StagedGradientTest, RanksStepOnceTogetherAndARetryGetsThatStep) {
  // Three ranks' shares of one batch's gradient, each committed by its backward.
  for (const char* id : {"rank0", "rank1", "rank2"}) {
    ASSERT_TRUE(Stage(id).status.ok());
    ASSERT_TRUE(Commit(*stub_, head_, id, 1.0 / 3.0).ok());
  }
  v1::StepRequest request = SgdRequest(head_, 0.5);
  request.set_head_version(GetHead(*stub_, head_).version());
  const std::vector<RankReply> replies = StepAsRanks(server_->port(), request, 3, {0, 1, 2});
  for (const RankReply& reply : replies) {
    ASSERT_TRUE(reply.status.ok()) << reply.status.error_message();
    EXPECT_EQ(reply.response.head_version(), request.head_version() + 1);
    EXPECT_EQ(reply.response.grad_norm(), replies[0].response.grad_norm());
  }
  EXPECT_EQ(GetHead(*stub_, head_).steps(), 1);
  // W moved by one step of the averaged gradient: lr * (3 * g / 3).
  const FetchedTensor weight = Fetch(*stub_, head_, false);
  std::vector<double> expected(weight_.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    expected[i] = weight_[i] - 0.5 * reference_.grad_weight[i];
  }
  EXPECT_LE(RelativeError(weight.values, expected), 1e-6);
  // A rank whose answer was lost asks again: the same step, not a second one.
  const std::vector<RankReply> retry = StepAsRanks(server_->port(), request, 3, {1});
  ASSERT_TRUE(retry[0].status.ok()) << retry[0].status.error_message();
  EXPECT_EQ(retry[0].response.head_version(), request.head_version() + 1);
  EXPECT_EQ(GetHead(*stub_, head_).steps(), 1);
}

TEST_F(StagedGradientTest, ACollectiveStepNeedsTheVersionAndSameRequests) {
  v1::StepRequest request = SgdRequest(head_, 0.5);
  request.mutable_ranks()->set_world_size(2);
  const grpc::Status unversioned = Step(*stub_, request);
  EXPECT_EQ(unversioned.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(unversioned.error_message(), "head_version"));
  request.clear_ranks();
  request.mutable_ranks()->set_rank(1);
  const grpc::Status lone_rank = Step(*stub_, request);
  EXPECT_EQ(lone_rank.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(lone_rank.error_message(), "ranks"));
}

TEST(CollectiveStepTest, ARankThatNeverComesFailsTheStepOnEveryRankAndNothingChanges) {
  server::ServerConfig config = MultiChunkDemoConfig("head", kVocab, kHidden, 7);
  config.step_wait = absl::Milliseconds(500);
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  const FetchedTensor before = Fetch(*stub, "head", false);
  v1::StepRequest request = SgdRequest("head", 0.5);
  request.set_head_version(before.version);
  for (const RankReply& reply : StepAsRanks(server->port(), request, 3, {0, 1})) {
    EXPECT_EQ(reply.status.error_code(), StatusCode::ABORTED);
    EXPECT_TRUE(Contains(reply.status.error_message(), "rank(s) 2 of 3 did not arrive"));
  }
  const FetchedTensor after = Fetch(*stub, "head", false);
  EXPECT_EQ(after.version, before.version);
  EXPECT_TRUE(BitwiseEqual(after.values, before.values));
}

TEST(CollectiveStepTest, GradWeightNormAnswersEveryRankOnceAllHaveSentTheirPart) {
  server::ServerConfig config = MultiChunkDemoConfig("head", kVocab, kHidden, 8);
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);
  ASSERT_TRUE(
      CallCompute(*stub, StartFor("head", batch, kHidden, true), FloatBytes(batch.hidden), 64)
          .status.ok());
  const FetchedTensor grad = Fetch(*stub, "head", true);
  double sum_squares = 0.0;
  for (float g : grad.values) sum_squares += static_cast<double>(g) * g;
  std::vector<std::optional<v1::GradWeightNormResponse>> replies(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      auto mine = ConnectTo(server->port());
      grpc::ClientContext context;
      v1::GradWeightNormRequest request;
      request.set_head("head");
      request.set_head_version(grad.version);
      request.set_grad_multiplier(0.5);
      request.mutable_ranks()->set_world_size(2);
      request.mutable_ranks()->set_rank(rank);
      v1::GradWeightNormResponse response;
      if (mine->GradWeightNorm(&context, request, &response).ok()) replies[rank] = response;
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const auto& reply : replies) {
    ASSERT_TRUE(reply.has_value());
    EXPECT_NEAR(reply->grad_norm(), 0.5 * std::sqrt(sum_squares), 1e-9 * std::sqrt(sum_squares));
    EXPECT_EQ(reply->accumulated_tokens(), kRows);
  }
  EXPECT_EQ(GetHead(*stub, "head").version(), grad.version) << "a norm changes nothing";
}

// ---------------------------------------------------------------------------------------------
// Step options and master weights.

TEST(StepOptionsTest, GradMultiplierScalesTheGradientAndSkipNonfiniteSkipsAnOverflow) {
  server::ServerConfig config = MultiChunkDemoConfig("head", kVocab, kHidden, 9);
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);
  const auto accumulate = [&] {
    ASSERT_TRUE(
        CallCompute(*stub, StartFor("head", batch, kHidden, true), FloatBytes(batch.hidden), 64)
            .status.ok());
  };
  accumulate();
  const FetchedTensor before = Fetch(*stub, "head", false);
  const FetchedTensor grad = Fetch(*stub, "head", true);
  v1::StepRequest request = SgdRequest("head", 1.0);
  request.set_grad_multiplier(0.25);
  v1::StepResponse response;
  ASSERT_TRUE(Step(*stub, request, &response).ok());
  const FetchedTensor after = Fetch(*stub, "head", false);
  std::vector<double> expected(before.values.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    expected[i] = before.values[i] - 0.25 * grad.values[i];
  }
  EXPECT_LE(RelativeError(after.values, expected), 1e-6);

  // A gradient that overflows float32 once multiplied (as a loss scale that was too large leaves
  // it): the step is skipped, not failed. The call's grad_scale makes |dL/dW| about 1e6.
  v1::ComputeStart large = StartFor("head", batch, kHidden, true);
  large.mutable_options()->set_grad_scale(1e6);
  ASSERT_TRUE(CallCompute(*stub, large, FloatBytes(batch.hidden), 64).status.ok());
  request.set_grad_multiplier(1e34);
  request.set_skip_nonfinite(true);
  ASSERT_TRUE(Step(*stub, request, &response).ok());
  EXPECT_TRUE(response.skipped());
  EXPECT_EQ(response.head_version(), after.version);
  const FetchedTensor unchanged = Fetch(*stub, "head", false);
  EXPECT_EQ(unchanged.version, after.version);
  EXPECT_TRUE(BitwiseEqual(unchanged.values, after.values));
  EXPECT_EQ(GetHead(*stub, "head").accumulated_tokens(), 0) << "the overflowed gradient is dropped";
  for (const double bad : {-1.0, 1e39}) {
    request.set_grad_multiplier(bad);
    const grpc::Status refused = Step(*stub, request);
    EXPECT_EQ(refused.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(refused.error_message(), "grad_multiplier")) << bad;
  }
}

// AdamW updates of lr 1e-5 are about 1e-5 per entry: below half the bfloat16 spacing of entries
// of order 0.3 (2^-9), so a bfloat16 W that stepped itself would keep almost every entry as it
// was. The master weights take every update; W is their rounding.
TEST(MasterWeightsTest, ABfloat16HeadKeepsUpdatesBelowItsRoundingAndCheckpointsThem) {
  ScratchDir dir("master_weights");
  server::ServerConfig config = MultiChunkDemoConfig("unused", kVocab, kHidden, 10);
  config.checkpoint_dir = dir.path();
  auto server = StartTestServer(config);
  auto stub = ConnectTo(server->port());
  std::mt19937_64 rng(FreshSeed());
  std::vector<float> weight = RandomWeight(kVocab, kHidden, rng);
  for (float& w : weight) w = BFloat16ToFloat(FloatToBFloat16(w));
  v1::UploadHeadStart start;
  start.set_head("bf16");
  start.set_vocab_size(kVocab);
  start.set_hidden_size(kHidden);
  start.set_storage_dtype(v1::DTYPE_BFLOAT16);
  ASSERT_TRUE(UploadWithStart(*stub, start, weight).ok());
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);

  // The reference: AdamW in double on the same gradients, from W.
  std::vector<double> master(weight.begin(), weight.end()), m(weight.size()), v(weight.size());
  constexpr double kLr = 1e-5, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kDecay = 0.01;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(
        CallCompute(*stub, StartFor("bf16", batch, kHidden, true), FloatBytes(batch.hidden), 64)
            .status.ok());
    const FetchedTensor grad = Fetch(*stub, "bf16", true);
    v1::StepRequest request;
    request.set_head("bf16");
    request.mutable_adamw()->set_learning_rate(kLr);
    ASSERT_TRUE(Step(*stub, request).ok());
    for (size_t i = 0; i < master.size(); ++i) {
      const double g = grad.values[i];
      m[i] = kBeta1 * m[i] + (1 - kBeta1) * g;
      v[i] = kBeta2 * v[i] + (1 - kBeta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(kBeta1, step));
      const double v_hat = v[i] / (1 - std::pow(kBeta2, step));
      master[i] = master[i] * (1 - kLr * kDecay) - kLr * m_hat / (std::sqrt(v_hat) + kEps);
    }
  }
  const auto fetch_master = [&](v1::LossService::Stub& s) {
    grpc::ClientContext context;
    v1::FetchTensorRequest request;
    request.set_head("bf16");
    request.set_master(true);
    std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader(s.FetchWeight(&context, request));
    std::vector<float> values(kVocab * kHidden);
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) {
      std::memcpy(values.data() + chunk.row_offset() * kHidden, chunk.data().data(),
                  chunk.data().size());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return values;
  };
  const std::vector<float> served_master = fetch_master(*stub);
  // float32 master weights: each step rounds them twice in float32 (the decay, then the update),
  // three steps in all. The roundings are relative to the operands, the weight and lr times
  // Adam's normalized update (at most about 3 here), not to the result, which an update of the
  // weight's own size can cancel to near 0: the error is measured against that scale.
  double largest = 0.0;
  int64_t moved = 0;
  for (size_t i = 0; i < master.size(); ++i) {
    const double scale = std::fabs(weight[i]) + 3 * 3 * kLr;
    largest = std::max(largest, std::fabs(served_master[i] - master[i]) / scale);
    if (served_master[i] != weight[i]) ++moved;
  }
  EXPECT_LE(largest, 6 * 0x1p-24);
  EXPECT_GT(moved, static_cast<int64_t>(0.99 * master.size())) << "every update was kept";
  const FetchedTensor served = Fetch(*stub, "bf16", false);
  for (size_t i = 0; i < master.size(); ++i) {
    ASSERT_EQ(served.values[i], BFloat16ToFloat(FloatToBFloat16(served_master[i]))) << i;
  }
  EXPECT_TRUE(GetHead(*stub, "bf16").master_weights());

  // A checkpoint keeps them: a server started from it steps on from the same master weights.
  grpc::ClientContext context;
  v1::SaveCheckpointRequest save;
  save.set_head("bf16");
  v1::SaveCheckpointResponse saved;
  ASSERT_TRUE(stub->SaveCheckpoint(&context, save, &saved).ok());
  server.reset();
  auto resumed = StartTestServer(config);
  auto resumed_stub = ConnectTo(resumed->port());
  EXPECT_TRUE(GetHead(*resumed_stub, "bf16").master_weights());
  EXPECT_TRUE(BitwiseEqual(fetch_master(*resumed_stub), served_master));
}

}  // namespace
}  // namespace lossd::testing
