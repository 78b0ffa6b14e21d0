// The head's gradient accumulator through a real server on loopback: it never takes a call that
// would make it non-finite, and a call_id reaches it at most once per accumulator epoch. What each
// case sends, gets back and checks afterwards: tests/ROBUSTNESS.md, "The accumulator".
#include <google/protobuf/unknown_field_set.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/call/call_spec.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using grpc::StatusCode;

// The engine's bounds against the float64 reference (engine_test.cc); the server adds no error.
constexpr double kLossBound = 1e-6;
constexpr double kGradBound = 2e-5;

bool AllFinite(const std::vector<float>& values) {
  return std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); });
}

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// An unlabelled counter of the server's metrics; 0 before its first event.
double CounterValue(server::LossServer& server, const std::string& name) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name == name && !family.metric.empty()) return family.metric[0].counter.value;
  }
  return 0.0;
}

v1::HeadInfo GetHead(v1::LossService::Stub& stub, const std::string& head) {
  grpc::ClientContext context;
  v1::GetHeadRequest request;
  request.set_head(head);
  v1::HeadInfo info;
  EXPECT_TRUE(stub.GetHead(&context, request, &info).ok());
  return info;
}

grpc::Status ZeroGrad(v1::LossService::Stub& stub, const std::string& head) {
  grpc::ClientContext context;
  v1::ZeroGradWeightRequest request;
  request.set_head(head);
  v1::ZeroGradWeightResponse response;
  return stub.ZeroGradWeight(&context, request, &response);
}

grpc::Status SgdStep(v1::LossService::Stub& stub, const std::string& head, bool keep_grad,
                     double max_grad_norm, v1::StepResponse* response) {
  grpc::ClientContext context;
  v1::StepRequest request;
  request.set_head(head);
  request.mutable_sgd()->set_learning_rate(0.1);
  request.set_keep_grad(keep_grad);
  request.set_max_grad_norm(max_grad_norm);
  return stub.Step(&context, request, response);
}

// A training call under `call_id` that also asks for log-probabilities.
v1::ComputeStart TrainingStart(const std::string& head, const Batch& batch, int64_t hidden_size,
                               const std::string& call_id = "") {
  v1::ComputeStart start = StartFor(head, batch, hidden_size, /*training=*/true);
  start.mutable_outputs()->set_logprob(true);
  start.set_call_id(call_id);
  return start;
}

// ---------------------------------------------------------------------------------------------
// Overflow: calls that are each valid, whose dL/dW is finite on its own, but whose sum with the
// accumulator is not. The one that would overflow it is refused and changes nothing.

constexpr char kOverflowHead[] = "overflow";
constexpr int64_t kOverflowVocab = 50;
constexpr int64_t kOverflowHidden = 8;
constexpr int64_t kOverflowLabel = 3;

// One token with label 3 and the hidden row (hidden_value, 0, ..., 0), reduction sum: dL/dW is
// zero outside column 0, and dL/dW[v, 0] = grad_scale * hidden_value * (p_v - [v == 3]). The demo
// head's logits stay within +-0.71 here, so p_3 < 0.05 and the label's entry is below
// -0.95 * grad_scale * hidden_value.
struct OverflowCase {
  const char* name;
  const char* why;
  double grad_scale;
  float hidden_value;
  int committed;  // calls the accumulator takes before the next would overflow it
};

void PrintTo(const OverflowCase& c, std::ostream* os) { *os << c.name; }

const OverflowCase kOverflowCases[] = {
    {"second_call", "each call's dL/dW reaches -1.9e38 (finite), two of them -3.9e38", 1e38, 2.0f,
     1},
    {"third_call",
     "-1.15e38 per call: the sum of two is not provably finite from the bounds, is formed, read "
     "back and taken; a third would reach -3.5e38",
     1.2e38, 1.0f, 2},
};

class OverflowTest : public ::testing::TestWithParam<OverflowCase> {};

TEST_P(OverflowTest, TheCallThatWouldOverflowIsRefusedAndChangesNothing) {
  const OverflowCase& c = GetParam();
  SCOPED_TRACE(c.why);
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config;
  config.demo = {kOverflowHead, kOverflowVocab, kOverflowHidden, 3};
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());

  Batch big;
  big.hidden.assign(kOverflowHidden, 0.0f);
  big.hidden[0] = c.hidden_value;
  big.labels = {kOverflowLabel};
  v1::ComputeStart big_start = TrainingStart(kOverflowHead, big, kOverflowHidden);
  big_start.mutable_options()->set_reduction(v1::REDUCTION_SUM);
  big_start.mutable_options()->set_grad_scale(c.grad_scale);
  LossOptions big_options;
  big_options.reduction = Reduction::kSum;
  big_options.grad_scale = c.grad_scale;
  const std::vector<float> weight = Fetch(*stub, kOverflowHead, false).values;
  const ReferenceResult big_ref =
      Reference(weight, kOverflowVocab, kOverflowHidden, big, big_options);
  const double label_entry = big_ref.grad_weight[kOverflowLabel * kOverflowHidden];
  ASSERT_LT(std::abs(label_entry) * c.committed, 3.4e38) << "the accumulated calls must be finite";
  ASSERT_GT(std::abs(label_entry) * (c.committed + 1), 3.41e38) << "one more must overflow";

  std::vector<double> expected(big_ref.grad_weight.size());
  for (int i = 1; i <= c.committed; ++i) {
    const ComputeOutcome out = CallCompute(*stub, big_start, FloatBytes(big.hidden), 1);
    ASSERT_TRUE(out.status.ok()) << "call " << i << ": " << out.status.error_message();
    EXPECT_EQ(GetHead(*stub, kOverflowHead).accumulated_calls(), i);
  }
  for (size_t j = 0; j < expected.size(); ++j) expected[j] = c.committed * big_ref.grad_weight[j];
  const FetchedTensor before = Fetch(*stub, kOverflowHead, true);
  ASSERT_TRUE(AllFinite(before.values));
  EXPECT_LE(RelativeError(before.values, expected), kGradBound);

  const double nonfinite_before = CounterValue(*server, "lossd_nonfinite_calls_total");
  const ComputeOutcome refused = CallCompute(*stub, big_start, FloatBytes(big.hidden), 1);
  EXPECT_EQ(refused.status.error_code(), StatusCode::FAILED_PRECONDITION)
      << refused.status.error_message();
  EXPECT_TRUE(Contains(refused.status.error_message(), "overflow"));
  EXPECT_TRUE(Contains(refused.status.error_message(), "nothing was accumulated"));
  EXPECT_TRUE(Contains(refused.status.error_message(), "options.grad_scale"));
  const std::optional<v1::ErrorInfo> info_of_refusal = ErrorInfoIn(refused.status);
  ASSERT_TRUE(info_of_refusal.has_value()) << "no ErrorInfo in the status details";
  EXPECT_EQ(info_of_refusal->reason(), v1::ErrorInfo::NON_FINITE_GRADIENT);
  const FetchedTensor after = Fetch(*stub, kOverflowHead, true);
  EXPECT_TRUE(BitwiseEqual(after.values, before.values))
      << "the refused call changed the accumulator";
  EXPECT_EQ(CounterValue(*server, "lossd_nonfinite_calls_total"), nonfinite_before + 1);
  const v1::HeadInfo info = GetHead(*stub, kOverflowHead);
  EXPECT_EQ(info.accumulated_calls(), c.committed);
  EXPECT_EQ(info.accumulated_tokens(), c.committed);

  // An ordinary call still commits, onto the accumulator as it was.
  const Batch normal = RandomBatch(20, kOverflowVocab, kOverflowHidden, rng);
  const ReferenceResult normal_ref = Reference(weight, kOverflowVocab, kOverflowHidden, normal);
  const ComputeOutcome committed = CallCompute(
      *stub, TrainingStart(kOverflowHead, normal, kOverflowHidden), FloatBytes(normal.hidden), 7);
  ASSERT_TRUE(committed.status.ok()) << committed.status.error_message();
  EXPECT_LE(std::abs(committed.summary.loss() - normal_ref.loss) / normal_ref.loss, kLossBound);
  EXPECT_EQ(GetHead(*stub, kOverflowHead).accumulated_calls(), c.committed + 1);
  const FetchedTensor sum = Fetch(*stub, kOverflowHead, true);
  double max_normal = 0.0;
  for (double g : normal_ref.grad_weight) max_normal = std::max(max_normal, std::abs(g));
  for (size_t j = 0; j < sum.values.size(); ++j) {
    // Both terms rounded to fp32 once each: half a unit of 2^-24 of the large one, the engine's
    // bound of the small one.
    const double want = before.values[j] + normal_ref.grad_weight[j];
    ASSERT_LE(std::abs(sum.values[j] - want), 0x1p-24 * std::abs(want) + kGradBound * max_normal)
        << "entry " << j;
  }

  // Step still works on the accumulator, clipped to a unit norm, and empties it.
  v1::StepResponse step;
  ASSERT_TRUE(SgdStep(*stub, kOverflowHead, false, 1.0, &step).ok());
  EXPECT_TRUE(std::isfinite(step.grad_norm()));
  EXPECT_GT(step.grad_norm(), 1e37);
  EXPECT_EQ(step.head_version(), before.version + 1);
  EXPECT_TRUE(AllFinite(Fetch(*stub, kOverflowHead, false).values));
  EXPECT_EQ(GetHead(*stub, kOverflowHead).accumulated_calls(), 0);
  // And the big call commits again into the emptied accumulator.
  EXPECT_TRUE(CallCompute(*stub, big_start, FloatBytes(big.hidden), 1).status.ok());
  EXPECT_TRUE(AllFinite(Fetch(*stub, kOverflowHead, true).values));
}

INSTANTIATE_TEST_SUITE_P(Table, OverflowTest, ::testing::ValuesIn(kOverflowCases),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Call ids: a repeated call_id is committed once per head and accumulator epoch; its repeat is
// computed again and answered with the same bits, as a replay.

constexpr int64_t kIdVocab = 3000;
constexpr int64_t kIdHidden = 32;
constexpr int64_t kIdRows = 150;

class CallIdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // About 80 rows of a [3000, 32] head per engine chunk: a call runs as two.
    server_ = StartTestServer(MultiChunkDemoConfig("unused", 100, kIdHidden, 1)).release();
    ASSERT_NE(server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // A head of its own for each test, with a random W.
  void SetUp() override {
    rng_.seed(FreshSeed());
    stub_ = ConnectTo(server_->port());
    head_ = absl::StrReplaceAll(::testing::UnitTest::GetInstance()->current_test_info()->name(),
                                {{"/", "_"}});
    weight_ = RandomWeight(kIdVocab, kIdHidden, rng_);
    ASSERT_TRUE(Upload(*stub_, head_, kIdVocab, kIdHidden, weight_, true).ok());
    batch_ = RandomBatch(kIdRows, kIdVocab, kIdHidden, rng_);
    ref_ = Reference(weight_, kIdVocab, kIdHidden, batch_);
  }

  ComputeOutcome Train(const std::string& call_id, int64_t rows_per_message = 40) {
    return CallCompute(*stub_, TrainingStart(head_, batch_, kIdHidden, call_id),
                       FloatBytes(batch_.hidden), rows_per_message);
  }

  // The accumulator holds one copy of the batch's dL/dW, from `calls` calls in all.
  void ExpectOneCopy(const std::vector<double>& reference, int64_t calls = 1) {
    const FetchedTensor grad = Fetch(*stub_, head_, true);
    ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
    EXPECT_LE(RelativeError(grad.values, reference), kGradBound);
    EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), calls);
  }

  static server::LossServer* server_;
  std::mt19937_64 rng_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  std::string head_;
  std::vector<float> weight_;
  Batch batch_;
  ReferenceResult ref_;
};

server::LossServer* CallIdTest::server_ = nullptr;

void ExpectSameResults(const ComputeOutcome& a, const ComputeOutcome& b) {
  EXPECT_EQ(a.summary.loss(), b.summary.loss());
  EXPECT_EQ(a.summary.loss_sum(), b.summary.loss_sum());
  EXPECT_EQ(a.summary.counted_tokens(), b.summary.counted_tokens());
  EXPECT_EQ(a.summary.correct_tokens(), b.summary.correct_tokens());
  EXPECT_EQ(a.summary.head_version(), b.summary.head_version());
  EXPECT_EQ(a.token_loss, b.token_loss);
  EXPECT_EQ(a.logprob, b.logprob);
  EXPECT_EQ(a.top_k_logprob, b.top_k_logprob);
  EXPECT_EQ(a.top_k_token, b.top_k_token);
  EXPECT_TRUE(a.grad_hidden == b.grad_hidden) << "dL/dh differs";
}

TEST_F(CallIdTest, ARepeatIsReplayedBitwiseAndAccumulatedOnce) {
  const ComputeOutcome first = Train("step-7/rank-0/micro-3");
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_TRUE(first.summary.grad_weight_accumulated());
  EXPECT_FALSE(first.summary.replayed());
  EXPECT_LE(std::abs(first.summary.loss() - ref_.loss) / ref_.loss, kLossBound);
  EXPECT_LE(RelativeError(AsFloats(first.grad_hidden), ref_.grad_hidden), kGradBound);
  const FetchedTensor once = Fetch(*stub_, head_, true);

  // Split into other messages, on another connection: the engine's results do not depend on it.
  stub_ = ConnectTo(server_->port());
  const double replays_before = CounterValue(*server_, "lossd_replayed_calls_total");
  const ComputeOutcome repeat = Train("step-7/rank-0/micro-3", 7);
  ASSERT_TRUE(repeat.status.ok()) << repeat.status.error_message();
  EXPECT_TRUE(repeat.summary.replayed());
  EXPECT_TRUE(repeat.summary.grad_weight_accumulated());
  ExpectSameResults(first, repeat);
  EXPECT_EQ(CounterValue(*server_, "lossd_replayed_calls_total"), replays_before + 1);
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, once.values));
  ExpectOneCopy(ref_.grad_weight);
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_tokens(), kIdRows);

  // The id names calls that accumulate only: a scoring call with it is an ordinary one.
  v1::ComputeStart scoring = TrainingStart(head_, batch_, kIdHidden, "step-7/rank-0/micro-3");
  scoring.mutable_outputs()->set_accumulate_grad_weight(false);
  const ComputeOutcome scored = CallCompute(*stub_, scoring, FloatBytes(batch_.hidden), 40);
  ASSERT_TRUE(scored.status.ok()) << scored.status.error_message();
  EXPECT_FALSE(scored.summary.replayed());
  EXPECT_FALSE(scored.summary.grad_weight_accumulated());
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, once.values));
}

// How an accumulator epoch ends. A retry that reaches the server after it (its first attempt
// committed, the answer was lost, a step came before the retry) must not count the call again.
struct EpochEnd {
  const char* name;
  const char* why;
  bool moves_version;
  void (*end)(v1::LossService::Stub& stub, const std::string& head,
              const std::vector<float>& weight);
};

void PrintTo(const EpochEnd& e, std::ostream* os) { *os << e.name; }

const EpochEnd kEpochEnds[] = {
    {"zero_grad", "ZeroGradWeight empties the accumulator; W stays", false,
     [](v1::LossService::Stub& stub, const std::string& head, const std::vector<float>&) {
       ASSERT_TRUE(ZeroGrad(stub, head).ok());
     }},
    {"step", "a step without keep_grad moves W and empties the accumulator", true,
     [](v1::LossService::Stub& stub, const std::string& head, const std::vector<float>&) {
       v1::StepResponse response;
       ASSERT_TRUE(SgdStep(stub, head, false, 0.0, &response).ok());
     }},
    {"upload", "an upload that replaces W empties the accumulator", true,
     [](v1::LossService::Stub& stub, const std::string& head, const std::vector<float>& weight) {
       std::vector<float> halved = weight;
       for (float& x : halved) x *= 0.5f;
       ASSERT_TRUE(Upload(stub, head, kIdVocab, kIdHidden, halved, true).ok());
     }},
};

class CallIdEpochTest : public CallIdTest, public ::testing::WithParamInterface<EpochEnd> {};

TEST_P(CallIdEpochTest, ARepeatAfterTheEpochEndedIsRefused) {
  SCOPED_TRACE(GetParam().why);
  ASSERT_TRUE(Train("epoch").status.ok());
  const uint64_t committed_at = GetHead(*stub_, head_).version();
  GetParam().end(*stub_, head_, weight_);
  const uint64_t now = GetHead(*stub_, head_).version();
  EXPECT_EQ(now != committed_at, GetParam().moves_version);
  const FetchedTensor emptied = Fetch(*stub_, head_, true);

  const ComputeOutcome again = Train("epoch");
  const std::string& message = again.status.error_message();
  EXPECT_EQ(again.status.error_code(), StatusCode::ALREADY_EXISTS) << message;
  EXPECT_TRUE(Contains(message, "'epoch'")) << message;
  EXPECT_TRUE(Contains(message, absl::StrCat("at version ", committed_at))) << message;
  EXPECT_TRUE(Contains(message, absl::StrCat("now at version ", now))) << message;
  EXPECT_EQ(again.result_messages, 0) << "refused before it was computed";
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, emptied.values));
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 0);
  // A fresh id is a new call in the new epoch.
  const std::vector<float> weight = Fetch(*stub_, head_, false).values;
  const ComputeOutcome fresh = Train("epoch-2");
  ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  EXPECT_FALSE(fresh.summary.replayed());
  ExpectOneCopy(Reference(weight, kIdVocab, kIdHidden, batch_).grad_weight);
}

INSTANTIATE_TEST_SUITE_P(Table, CallIdEpochTest, ::testing::ValuesIn(kEpochEnds),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_F(CallIdTest, AFailedFirstAttemptLeavesTheIdFree) {
  // Cancelled after its first chunk of rows.
  const ComputeOutcome cancelled =
      CallCompute(*stub_, TrainingStart(head_, batch_, kIdHidden, "failed"),
                  FloatBytes(batch_.hidden), 40, /*cancel_after=*/1);
  EXPECT_EQ(cancelled.status.error_code(), StatusCode::CANCELLED);
  // Refused for a NaN in its last rows, after its first engine chunks were computed and staged.
  std::string poisoned = FloatBytes(batch_.hidden);
  const float nan = std::nanf("");
  std::memcpy(poisoned.data() + poisoned.size() - sizeof(float), &nan, sizeof(float));
  const ComputeOutcome refused =
      CallCompute(*stub_, TrainingStart(head_, batch_, kIdHidden, "failed"), poisoned, 40);
  EXPECT_EQ(refused.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 0);

  const ComputeOutcome fresh = Train("failed");
  ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  EXPECT_FALSE(fresh.summary.replayed());
  ExpectOneCopy(ref_.grad_weight);
}

TEST_F(CallIdTest, ConcurrentDuplicatesCommitOnce) {
  constexpr int kDuplicates = 4;
  std::vector<ComputeOutcome> outcomes(kDuplicates);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kDuplicates; ++i) {
    threads.emplace_back([&, i] {
      auto stub = ConnectTo(server_->port());
      ++ready;
      while (ready < kDuplicates) std::this_thread::yield();
      outcomes[i] = CallCompute(*stub, TrainingStart(head_, batch_, kIdHidden, "concurrent"),
                                FloatBytes(batch_.hidden), 10 + 10 * i);
    });
  }
  for (auto& thread : threads) thread.join();
  int committed = 0;
  for (const ComputeOutcome& out : outcomes) {
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_TRUE(out.summary.grad_weight_accumulated());
    committed += !out.summary.replayed();
    ExpectSameResults(outcomes[0], out);
  }
  EXPECT_EQ(committed, 1);
  ExpectOneCopy(ref_.grad_weight);
}

TEST_F(CallIdTest, ARepeatAfterTheHeadMovedIsRefused) {
  ASSERT_TRUE(Train("moved").status.ok());
  v1::StepResponse step;
  ASSERT_TRUE(SgdStep(*stub_, head_, /*keep_grad=*/true, 0.0, &step).ok());
  const FetchedTensor kept = Fetch(*stub_, head_, true);

  const ComputeOutcome repeat = Train("moved");
  const std::string& message = repeat.status.error_message();
  EXPECT_EQ(repeat.status.error_code(), StatusCode::ALREADY_EXISTS) << message;
  EXPECT_TRUE(Contains(message, "'moved'"));
  EXPECT_TRUE(Contains(message, absl::StrCat("version ", step.head_version() - 1)));
  EXPECT_TRUE(Contains(message, absl::StrCat("version ", step.head_version())));
  EXPECT_EQ(repeat.result_messages, 0) << "refused before it was computed";
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, kept.values));
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 1);
  // Another id is a new call, on the new W.
  EXPECT_TRUE(Train("after-the-step").status.ok());
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 2);
}

TEST_F(CallIdTest, AnIdReusedForAnotherCallIsRefused) {
  ASSERT_TRUE(Train("reused").status.ok());
  const FetchedTensor once = Fetch(*stub_, head_, true);
  const Batch other = RandomBatch(kIdRows, kIdVocab, kIdHidden, rng_);

  // Other labels: seen in the start message, before anything is computed.
  const ComputeOutcome other_labels = CallCompute(
      *stub_, TrainingStart(head_, other, kIdHidden, "reused"), FloatBytes(batch_.hidden), 40);
  EXPECT_EQ(other_labels.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(other_labels.status.error_message(), "call_id"));
  EXPECT_EQ(other_labels.result_messages, 0);
  // The same labels with other rows: seen in the loss, at the commit.
  const ComputeOutcome other_rows = CallCompute(
      *stub_, TrainingStart(head_, batch_, kIdHidden, "reused"), FloatBytes(other.hidden), 40);
  EXPECT_EQ(other_rows.status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(other_rows.status.error_message(), "call_id"));
  EXPECT_TRUE(Contains(other_rows.status.error_message(), "hidden rows"));
  // Other loss options.
  v1::ComputeStart scaled = TrainingStart(head_, batch_, kIdHidden, "reused");
  scaled.mutable_options()->set_grad_scale(2.0);
  const ComputeOutcome other_options = CallCompute(*stub_, scaled, FloatBytes(batch_.hidden), 40);
  EXPECT_EQ(other_options.status.error_code(), StatusCode::INVALID_ARGUMENT);

  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, once.values));
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 1);
}

// Whatever in a start decides dL/dW, a repeat of its id must send again: each row changes one
// field of the first call's start, and the repeat is refused naming call_id with nothing
// accumulated, before any result. The fingerprint covers the whole start but the fields that say
// how rows travel, what the call is pinned to or what comes back, so a field added later counts
// without being listed anywhere.
struct StartChange {
  const char* name;
  const char* why;
  std::function<void(v1::ComputeStart&)> change;
};

class CallIdFingerprintTest : public CallIdTest,
                              public ::testing::WithParamInterface<StartChange> {};

TEST_P(CallIdFingerprintTest, ARepeatWithAnotherStartIsRefused) {
  ASSERT_TRUE(Train("changed").status.ok());
  const FetchedTensor once = Fetch(*stub_, head_, true);
  v1::ComputeStart start = TrainingStart(head_, batch_, kIdHidden, "changed");
  GetParam().change(start);
  const ComputeOutcome repeat = CallCompute(*stub_, start, FloatBytes(batch_.hidden), 40);
  EXPECT_EQ(repeat.status.error_code(), StatusCode::INVALID_ARGUMENT)
      << repeat.status.error_message();
  EXPECT_TRUE(Contains(repeat.status.error_message(), "call_id")) << repeat.status.error_message();
  EXPECT_EQ(repeat.result_messages, 0);
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, once.values));
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 1);
}

const StartChange kStartChanges[] = {
    StartChange{"grad_scale", "scales dL/dW",
                [](v1::ComputeStart& s) { s.mutable_options()->set_grad_scale(2.0); }},
    StartChange{"label_smoothing", "another loss",
                [](v1::ComputeStart& s) { s.mutable_options()->set_label_smoothing(0.1f); }},
    StartChange{"z_loss_scale", "another term",
                [](v1::ComputeStart& s) { s.mutable_options()->set_z_loss_scale(1e-4f); }},
    StartChange{"temperature", "other logits",
                [](v1::ComputeStart& s) { s.mutable_options()->set_temperature(2.0f); }},
    StartChange{"reduction_sum", "another normalizer",
                [](v1::ComputeStart& s) { s.mutable_options()->set_reduction(v1::REDUCTION_SUM); }},
    StartChange{"one_label", "one token's target",
                [](v1::ComputeStart& s) { s.set_labels(0, (s.labels(0) + 1) % kIdVocab); }},
    StartChange{"token_weights", "weights where there were none",
                [](v1::ComputeStart& s) {
                  for (int64_t i = 0; i < s.num_tokens(); ++i) s.add_token_weights(0.5f);
                }},
    StartChange{"shift_labels", "every token's target moves by one",
                [](v1::ComputeStart& s) { s.set_shift_labels(true); }},
    StartChange{"unknown_field", "a field this server does not know is still the call's",
                [](v1::ComputeStart& s) {
                  s.GetReflection()->MutableUnknownFields(&s)->AddVarint(1000, 1);
                }},
};

INSTANTIATE_TEST_SUITE_P(Table, CallIdFingerprintTest, ::testing::ValuesIn(kStartChanges),
                         [](const ::testing::TestParamInfo<StartChange>& info) {
                           return info.param.name;
                         });

// What does not decide dL/dW may differ on a repeat, which is then recognised as the same call.
TEST_F(CallIdTest, ARepeatMayDifferInOutputsAndPins) {
  ASSERT_TRUE(Train("same").status.ok());
  const FetchedTensor once = Fetch(*stub_, head_, true);
  v1::ComputeStart start = TrainingStart(head_, batch_, kIdHidden, "same");
  start.mutable_outputs()->set_logprob(false);
  start.mutable_outputs()->set_token_loss(true);
  start.set_head_version(GetHead(*stub_, head_).version());
  const ComputeOutcome repeat = CallCompute(*stub_, start, FloatBytes(batch_.hidden), 40);
  ASSERT_TRUE(repeat.status.ok()) << repeat.status.error_message();
  EXPECT_TRUE(repeat.summary.replayed());
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub_, head_, true).values, once.values));
  EXPECT_EQ(GetHead(*stub_, head_).accumulated_calls(), 1);
}

// StartFingerprint on messages alone: what a repeat may change (its id, pins, outputs, how its
// rows travel) leaves the fingerprint as it is, every change of the table above moves it, and the
// start comes back from hashing as it went in.
TEST(StartFingerprintTest, IgnoresOnlyWhatARepeatMayChangeAndRestoresTheStart) {
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(6, kIdVocab, kIdHidden, rng);
  v1::ComputeStart start = TrainingStart("fingerprinted", batch, kIdHidden, "an id");
  const std::string serialized = start.SerializeAsString();
  const uint64_t fingerprint = server::StartFingerprint(start);
  EXPECT_EQ(start.SerializeAsString(), serialized);

  v1::ComputeStart repeat = start;
  repeat.set_call_id("another id");
  repeat.set_head_version(7);
  repeat.set_teacher_head_version(3);
  repeat.set_weight_sha256(std::string(64, 'a'));
  repeat.mutable_outputs()->set_token_loss(!start.outputs().token_loss());
  repeat.mutable_shared_memory()->set_handle(std::string(16, 'h'));
  EXPECT_EQ(server::StartFingerprint(repeat), fingerprint);

  for (const StartChange& change : kStartChanges) {
    v1::ComputeStart changed = start;
    change.change(changed);
    EXPECT_NE(server::StartFingerprint(changed), fingerprint) << change.name << ": " << change.why;
  }
}

// The ids a head keeps are bounded. Within an epoch a new id past the bound is refused rather
// than an old one forgotten (which a late repeat of it would then count twice); ids of earlier
// epochs are kept while they fit beside the current epoch's, oldest forgotten first.
TEST(CallIdBoundTest, ANewIdPastTheBoundIsRefusedNotAnOldOneForgotten) {
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config = MultiChunkDemoConfig("bounded", 400, kIdHidden, 2);
  config.max_call_ids = 3;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const Batch batch = RandomBatch(12, 400, kIdHidden, rng);
  auto train = [&](const std::string& call_id) {
    return CallCompute(*stub, TrainingStart("bounded", batch, kIdHidden, call_id),
                       FloatBytes(batch.hidden), 12);
  };
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(train(id).status.ok()) << id;
  const FetchedTensor three = Fetch(*stub, "bounded", true);

  const ComputeOutcome fourth = train("d");
  EXPECT_EQ(fourth.status.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Contains(fourth.status.error_message(), "--max_call_ids"));
  EXPECT_TRUE(BitwiseEqual(Fetch(*stub, "bounded", true).values, three.values));
  // The oldest id is still known: its repeat is a replay, not a second copy.
  const ComputeOutcome oldest = train("a");
  ASSERT_TRUE(oldest.status.ok()) << oldest.status.error_message();
  EXPECT_TRUE(oldest.summary.replayed());
  // Calls without an id are not limited.
  EXPECT_TRUE(train("").status.ok());
  EXPECT_EQ(GetHead(*stub, "bounded").accumulated_calls(), 4);
  // A new epoch has room again; its first id pushes out the oldest of the last epoch's.
  v1::StepResponse step;
  ASSERT_TRUE(SgdStep(*stub, "bounded", /*keep_grad=*/false, 0.0, &step).ok());
  EXPECT_TRUE(train("d").status.ok());
  for (const char* id : {"b", "c"}) {
    EXPECT_EQ(train(id).status.error_code(), StatusCode::ALREADY_EXISTS) << id;
  }
  EXPECT_EQ(GetHead(*stub, "bounded").accumulated_calls(), 1);
  // "a" had 3 later ids committed after it: forgotten, it is a new call.
  const ComputeOutcome forgotten = train("a");
  ASSERT_TRUE(forgotten.status.ok()) << forgotten.status.error_message();
  EXPECT_FALSE(forgotten.summary.replayed());
  EXPECT_EQ(GetHead(*stub, "bounded").accumulated_calls(), 2);
}

// SGD keeps a momentum buffer only once a step asks for momentum (torch's first buffer is that
// step's gradient, which momentum * 0 + g gives too): with momentum 0 a head holds, and would
// checkpoint, no V x H state.
TEST(OptimizerStateTest, SgdWithoutMomentumKeepsNoState) {
  server::ServerConfig config = MultiChunkDemoConfig("sgd", 400, kIdHidden, 2);
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const int64_t state_bytes = 400 * kIdHidden * static_cast<int64_t>(sizeof(float));
  auto step = [&](double momentum) {
    grpc::ClientContext context;
    v1::StepRequest request;
    request.set_head("sgd");
    request.mutable_sgd()->set_learning_rate(0.1);
    request.mutable_sgd()->set_momentum(momentum);
    v1::StepResponse response;
    return stub->Step(&context, request, &response);
  };
  ASSERT_TRUE(step(0.0).ok());
  EXPECT_EQ(server->ledger().current(server::MemoryPurpose::kOptimizerState), 0);
  ASSERT_TRUE(step(0.9).ok());
  EXPECT_EQ(server->ledger().current(server::MemoryPurpose::kOptimizerState), state_bytes);
  // The buffer, once there, stays (a later step with momentum 0 neither reads nor drops it).
  ASSERT_TRUE(step(0.0).ok());
  EXPECT_EQ(server->ledger().current(server::MemoryPurpose::kOptimizerState), state_bytes);
}

}  // namespace
}  // namespace lossd::testing
