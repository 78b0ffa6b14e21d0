// End-to-end: a real lossd server on loopback, called over gRPC.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "lossd/kernels/half.h"
#include "lossd/storage/safetensors.h"
#include "server/call/row_reader.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

constexpr int64_t kVocab = 2999;
constexpr int64_t kHidden = 48;
constexpr char kHead[] = "e2e";

// Engine bounds (see engine_test.cc): the server adds no error of its own.
constexpr double kLossBound = 1e-6;
constexpr double kGradBound = 2e-5;

struct Batch {
  std::vector<float> hidden;
  std::vector<int64_t> labels;
};

Batch RandomBatch(int64_t n, std::mt19937_64& rng, double ignore_fraction = 0.0) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> token(0, kVocab - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Batch b;
  b.hidden.resize(n * kHidden);
  for (float& x : b.hidden) x = normal(rng);
  b.labels.resize(n);
  for (int64_t& y : b.labels) y = unit(rng) < ignore_fraction ? -100 : token(rng);
  return b;
}

v1::ComputeStart TrainingStart(const std::string& head, const Batch& batch) {
  v1::ComputeStart start;
  start.set_head(head);
  start.set_num_tokens(static_cast<int64_t>(batch.labels.size()));
  start.set_hidden_size(kHidden);
  start.set_hidden_dtype(v1::DTYPE_FLOAT32);
  for (int64_t y : batch.labels) start.add_labels(y);
  v1::OutputSelection& out = *start.mutable_outputs();
  out.set_token_loss(true);
  out.set_logprob(true);
  out.set_lse(true);
  out.set_entropy(true);
  out.set_argmax(true);
  out.set_top_k(5);
  out.set_grad_hidden(true);
  out.set_accumulate_grad_weight(true);
  return start;
}

ReferenceResult Reference(const std::vector<float>& weight, const Batch& batch,
                          int64_t vocab = kVocab) {
  ReferenceProblem p;
  p.num_tokens = static_cast<int64_t>(batch.labels.size());
  p.hidden_size = kHidden;
  p.vocab_size = vocab;
  p.hidden.assign(batch.hidden.begin(), batch.hidden.end());
  p.weight.assign(weight.begin(), weight.end());
  p.labels = batch.labels;
  p.top_k = 5;
  return ComputeReference(p);
}

std::vector<float> AsFloats(const std::string& bytes) {
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

std::vector<float> RandomWeight(int64_t vocab, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(kHidden)));
  std::vector<float> w(vocab * kHidden);
  for (float& x : w) x = normal(rng);
  return w;
}

class ServerE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // About 80 rows of this head per engine chunk: a few-hundred-row batch runs as several.
    server_ = StartTestServer(MultiChunkDemoConfig(kHead, kVocab, kHidden, 7)).release();
    ASSERT_NE(server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    rng_.seed(FreshSeed());
    stub_ = ConnectTo(server_->port());
  }
  grpc::Status ZeroGrad(const std::string& head) {
    grpc::ClientContext context;
    v1::ZeroGradWeightRequest request;
    request.set_head(head);
    v1::ZeroGradWeightResponse response;
    return stub_->ZeroGradWeight(&context, request, &response);
  }

  static server::LossServer* server_;
  std::mt19937_64 rng_;
  std::unique_ptr<v1::LossService::Stub> stub_;
};

server::LossServer* ServerE2eTest::server_ = nullptr;

TEST_F(ServerE2eTest, ComputeMatchesFloat64Reference) {
  const std::string head = "reference";
  const std::vector<float> weight = RandomWeight(kVocab, rng_);
  ASSERT_TRUE(Upload(*stub_, head, kVocab, kHidden, weight, false).ok());
  const Batch batch = RandomBatch(300, rng_, 0.1);
  const ReferenceResult ref = Reference(weight, batch);

  const ComputeOutcome out =
      CallCompute(*stub_, TrainingStart(head, batch), FloatBytes(batch.hidden), 37);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_GT(out.result_messages, 1);
  EXPECT_TRUE(out.summary.grad_weight_accumulated());
  EXPECT_EQ(out.summary.counted_tokens(), ref.counted_tokens);
  EXPECT_LE(std::abs(out.summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(TokenLossError(out.token_loss, ref), kLossBound);
  EXPECT_LE(MaxAbsError(out.logprob, ref.logprob), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  const FetchedTensor grad = Fetch(*stub_, head, true);
  ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
  EXPECT_LE(RelativeError(grad.values, ref.grad_weight), kGradBound);
}

// The first call after a reset takes the accumulator's place (it held zeros), later ones add to
// it; either way the accumulator holds the sum of the calls since the reset.
TEST_F(ServerE2eTest, AccumulatorHoldsTheSumOfTheCallsSinceItsReset) {
  const std::string head = "accumulate";
  const std::vector<float> weight = RandomWeight(kVocab, rng_);
  ASSERT_TRUE(Upload(*stub_, head, kVocab, kHidden, weight, false).ok());
  const Batch first = RandomBatch(150, rng_);
  const Batch second = RandomBatch(90, rng_);
  const std::vector<double> first_ref = Reference(weight, first).grad_weight;
  const std::vector<double> second_ref = Reference(weight, second).grad_weight;
  std::vector<double> both_ref(first_ref.size());
  for (size_t i = 0; i < both_ref.size(); ++i) both_ref[i] = first_ref[i] + second_ref[i];
  auto train = [&](const Batch& batch) {
    const ComputeOutcome out =
        CallCompute(*stub_, TrainingStart(head, batch), FloatBytes(batch.hidden), 40);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  };
  auto expect_grad = [&](const std::vector<double>& expected, const char* after) {
    const FetchedTensor grad = Fetch(*stub_, head, true);
    ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
    EXPECT_LE(RelativeError(grad.values, expected), kGradBound) << "after " << after;
  };
  const int64_t before_training = server_->ledger().current(server::MemoryPurpose::kGradients);
  const int64_t accumulator_bytes = kVocab * kHidden * static_cast<int64_t>(sizeof(float));

  expect_grad(std::vector<double>(first_ref.size(), 0.0), "no call");  // error: ||grad||
  EXPECT_EQ(server_->ledger().current(server::MemoryPurpose::kGradients), before_training)
      << "a head holds no accumulator before it first trains";
  train(first);
  expect_grad(first_ref, "the first call");
  const int64_t gradient_bytes = server_->ledger().current(server::MemoryPurpose::kGradients);
  EXPECT_EQ(gradient_bytes, before_training + accumulator_bytes)
      << "the first call's staged dL/dW became the accumulator";
  train(second);
  expect_grad(both_ref, "a second call");
  ASSERT_TRUE(ZeroGrad(head).ok());
  expect_grad(std::vector<double>(first_ref.size(), 0.0), "a reset");  // error: ||grad||
  train(second);
  expect_grad(second_ref, "a reset and one call");
  EXPECT_EQ(server_->ledger().current(server::MemoryPurpose::kGradients), gradient_bytes)
      << "trading buffers must not change what is charged";
}

// ComputeStart.shift_labels, checked against the reference on labels shifted here: row i of a
// sequence against the label of row i + 1, the last row of each sequence ignored.
struct ShiftCase {
  std::string name;
  std::string reason;
  int64_t rows;
  std::vector<int64_t> sequence_lengths;  // empty: one sequence
  v1::Reduction reduction;
};

class ShiftLabelsTest : public ServerE2eTest, public ::testing::WithParamInterface<ShiftCase> {};

TEST_P(ShiftLabelsTest, MatchesTheReferenceOnShiftedLabels) {
  const ShiftCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  const std::string head = "shift-" + c.name;
  const std::vector<float> weight = RandomWeight(kVocab, rng_);
  ASSERT_TRUE(Upload(*stub_, head, kVocab, kHidden, weight, false).ok());
  const Batch batch = RandomBatch(c.rows, rng_, 0.1);
  Batch shifted = batch;
  std::vector<int64_t> lengths = c.sequence_lengths;
  if (lengths.empty()) lengths.push_back(c.rows);
  for (int64_t first = 0, s = 0; s < static_cast<int64_t>(lengths.size()); first += lengths[s++]) {
    for (int64_t i = first; i < first + lengths[s]; ++i) {
      shifted.labels[i] = i + 1 < first + lengths[s] ? batch.labels[i + 1] : -100;
    }
  }
  ReferenceProblem problem;
  problem.num_tokens = c.rows;
  problem.hidden_size = kHidden;
  problem.vocab_size = kVocab;
  problem.hidden.assign(batch.hidden.begin(), batch.hidden.end());
  problem.weight.assign(weight.begin(), weight.end());
  problem.labels = shifted.labels;
  problem.options.reduction = c.reduction == v1::REDUCTION_SUM ? Reduction::kSum : Reduction::kMean;
  const ReferenceResult ref = ComputeReference(problem);

  v1::ComputeStart start = TrainingStart(head, batch);  // the labels as given, unshifted
  start.set_shift_labels(true);
  for (int64_t length : c.sequence_lengths) start.add_sequence_lengths(length);
  start.mutable_options()->set_reduction(c.reduction);
  const ComputeOutcome out = CallCompute(*stub_, start, FloatBytes(batch.hidden), 41);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.summary.counted_tokens(), ref.counted_tokens);
  const FetchedTensor grad = Fetch(*stub_, head, true);
  ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
  if (ref.counted_tokens == 0) {
    const auto all_zero = [](const std::vector<float>& values) {
      return std::all_of(values.begin(), values.end(), [](float v) { return v == 0.0f; });
    };
    EXPECT_EQ(out.summary.loss(), 0.0);
    EXPECT_EQ(AsFloats(out.grad_hidden).size(), static_cast<size_t>(c.rows * kHidden));
    EXPECT_TRUE(all_zero(AsFloats(out.grad_hidden)));
    EXPECT_TRUE(all_zero(grad.values));
    return;
  }
  EXPECT_LE(std::abs(out.summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(TokenLossError(out.token_loss, ref), kLossBound);
  EXPECT_LE(MaxAbsError(out.logprob, ref.logprob), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  EXPECT_LE(RelativeError(grad.values, ref.grad_weight), kGradBound);
}

// About 80 rows per engine chunk (MultiChunkDemoConfig): sequences cross chunk boundaries.
INSTANTIATE_TEST_SUITE_P(
    Table, ShiftLabelsTest,
    ::testing::ValuesIn(std::vector<ShiftCase>{
        {"one_sequence", "no lengths: the call is one sequence", 300, {}, v1::REDUCTION_MEAN},
        {"uneven",
         "sequences of 1 (nothing to predict), 50, 7, 100 and 142 rows",
         300,
         {1, 50, 7, 100, 142},
         v1::REDUCTION_MEAN},
        {"batch_rows_sum",
         "a [4, 75] batch, each row its own sequence, summed",
         300,
         {75, 75, 75, 75},
         v1::REDUCTION_SUM},
        {"single_rows", "every sequence one row long: all labels ignored", 12,
         std::vector<int64_t>(12, 1), v1::REDUCTION_MEAN},
        {"one_row", "N = 1", 1, {}, v1::REDUCTION_MEAN},
    }),
    [](const auto& info) { return info.param.name; });

// A head's soft cap (from config.json, or an upload) applies to every call that does not set its
// own; a call's 0 turns it off, a call's value replaces it. A new cap makes a new head version.
TEST_F(ServerE2eTest, HeadSoftCapAppliesUnlessTheCallSaysOtherwise) {
  const std::string head = "capped";
  std::vector<float> weight = RandomWeight(kVocab, rng_);
  for (float& w : weight) w *= 4;  // logits of several units, where a cap of 2 or 5 matters
  v1::UploadHeadStart upload;
  upload.set_head(head);
  upload.set_vocab_size(kVocab);
  upload.set_hidden_size(kHidden);
  upload.set_logit_softcap(2.0);
  ASSERT_TRUE(UploadWithStart(*stub_, upload, weight).ok());
  const Batch batch = RandomBatch(120, rng_);
  const auto reference_loss = [&](double cap) {
    ReferenceProblem problem;
    problem.num_tokens = 120;
    problem.hidden_size = kHidden;
    problem.vocab_size = kVocab;
    problem.hidden.assign(batch.hidden.begin(), batch.hidden.end());
    problem.weight.assign(weight.begin(), weight.end());
    problem.labels = batch.labels;
    problem.options.logit_softcap = cap;
    return ComputeReference(problem).loss;
  };
  const auto call_loss = [&](std::optional<double> cap) {
    v1::ComputeStart start = TrainingStart(head, batch);
    start.mutable_outputs()->set_accumulate_grad_weight(false);
    if (cap.has_value()) start.mutable_options()->set_logit_softcap(*cap);
    const ComputeOutcome out = CallCompute(*stub_, start, FloatBytes(batch.hidden), 50);
    EXPECT_TRUE(out.status.ok()) << out.status.error_message();
    return out.summary.loss();
  };
  // The caps must change the loss for the test to tell them apart.
  ASSERT_GT(std::abs(reference_loss(2.0) - reference_loss(0.0)), 0.1);
  ASSERT_GT(std::abs(reference_loss(2.0) - reference_loss(5.0)), 0.1);
  for (const auto& [asked, applied] :
       {std::pair<std::optional<double>, double>{std::nullopt, 2.0}, {0.0, 0.0}, {5.0, 5.0}}) {
    SCOPED_TRACE(asked.has_value() ? absl::StrCat("call cap ", *asked) : "call cap unset");
    EXPECT_LE(std::abs(call_loss(asked) - reference_loss(applied)) / reference_loss(applied),
              kLossBound);
  }

  grpc::ClientContext context;
  v1::GetHeadRequest get;
  get.set_head(head);
  v1::HeadInfo before;
  ASSERT_TRUE(stub_->GetHead(&context, get, &before).ok());
  EXPECT_EQ(before.logit_softcap(), 2.0);
  upload.set_logit_softcap(3.0);
  upload.set_replace(true);
  ASSERT_TRUE(UploadWithStart(*stub_, upload, weight).ok());
  grpc::ClientContext again;
  v1::HeadInfo after;
  ASSERT_TRUE(stub_->GetHead(&again, get, &after).ok());
  EXPECT_EQ(after.logit_softcap(), 3.0);
  EXPECT_EQ(after.version(), before.version() + 1);
  EXPECT_LE(std::abs(call_loss(std::nullopt) - reference_loss(3.0)) / reference_loss(3.0),
            kLossBound);
}

TEST_F(ServerE2eTest, AnySplitOfTheBatchGivesIdenticalBits) {
  const Batch batch = RandomBatch(211, rng_);
  const std::string hidden = FloatBytes(batch.hidden);
  std::vector<ComputeOutcome> outcomes;
  std::vector<std::vector<float>> grads;
  for (int64_t rows_per_message : {211, 50, 7, 1}) {
    ASSERT_TRUE(ZeroGrad(kHead).ok());
    outcomes.push_back(CallCompute(*stub_, TrainingStart(kHead, batch), hidden, rows_per_message));
    ASSERT_TRUE(outcomes.back().status.ok()) << outcomes.back().status.error_message();
    grads.push_back(Fetch(*stub_, kHead, true).values);
  }
  for (size_t i = 1; i < outcomes.size(); ++i) {
    EXPECT_EQ(outcomes[i].summary.loss(), outcomes[0].summary.loss());
    EXPECT_EQ(outcomes[i].grad_hidden, outcomes[0].grad_hidden);
    EXPECT_EQ(outcomes[i].token_loss, outcomes[0].token_loss);
    EXPECT_EQ(outcomes[i].top_k_token, outcomes[0].top_k_token);
    EXPECT_EQ(0, std::memcmp(grads[i].data(), grads[0].data(), grads[0].size() * sizeof(float)));
  }
}

TEST_F(ServerE2eTest, FailedOrCancelledCallsLeaveTheGradientUntouched) {
  const Batch committed = RandomBatch(120, rng_);
  ASSERT_TRUE(ZeroGrad(kHead).ok());
  ASSERT_TRUE(CallCompute(*stub_, TrainingStart(kHead, committed), FloatBytes(committed.hidden), 40)
                  .status.ok());
  const std::vector<float> before = Fetch(*stub_, kHead, true).values;

  std::uniform_int_distribution<int> cancel_point(0, 12);
  for (int trial = 0; trial < 20; ++trial) {
    const Batch batch = RandomBatch(240, rng_);
    const int cancel_after = cancel_point(rng_);
    const ComputeOutcome out = CallCompute(*stub_, TrainingStart(kHead, batch),
                                           FloatBytes(batch.hidden), 20, cancel_after);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED)
        << "cancel after " << cancel_after;
  }
  Batch poisoned = RandomBatch(240, rng_);
  poisoned.hidden[201 * kHidden + 5] = std::nanf("");
  const ComputeOutcome nan_call =
      CallCompute(*stub_, TrainingStart(kHead, poisoned), FloatBytes(poisoned.hidden), 60);
  EXPECT_EQ(nan_call.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(nan_call.status.error_message().find("non-finite"), std::string::npos);

  const std::vector<float> after = Fetch(*stub_, kHead, true).values;
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(0, std::memcmp(after.data(), before.data(), before.size() * sizeof(float)));
}

struct BadStart {
  const char* name;
  const char* why;
  grpc::StatusCode code;
  const char* field;  // the message must name it
  void (*spoil)(v1::ComputeStart&, std::string& hidden);
};

const BadStart kBadStarts[] = {
    {"unknown_head", "no such head", grpc::StatusCode::NOT_FOUND, "head",
     [](v1::ComputeStart& s, std::string&) { s.set_head("missing"); }},
    {"hidden_size", "H differs from the head's", grpc::StatusCode::INVALID_ARGUMENT, "hidden_size",
     [](v1::ComputeStart& s, std::string&) { s.set_hidden_size(kHidden + 1); }},
    {"dtype_unspecified", "the dtype must be said", grpc::StatusCode::INVALID_ARGUMENT,
     "hidden_dtype",
     [](v1::ComputeStart& s, std::string&) { s.set_hidden_dtype(v1::DTYPE_UNSPECIFIED); }},
    {"labels_count", "one label per row", grpc::StatusCode::INVALID_ARGUMENT, "labels",
     [](v1::ComputeStart& s, std::string&) { s.mutable_labels()->RemoveLast(); }},
    {"label_range", "a label past the vocabulary", grpc::StatusCode::INVALID_ARGUMENT, "labels[3]",
     [](v1::ComputeStart& s, std::string&) { s.set_labels(3, kVocab); }},
    {"weights_count", "weights are all or nothing", grpc::StatusCode::INVALID_ARGUMENT,
     "token_weights", [](v1::ComputeStart& s, std::string&) { s.add_token_weights(1.0f); }},
    {"top_k", "above the largest k offered", grpc::StatusCode::INVALID_ARGUMENT, "top_k",
     [](v1::ComputeStart& s, std::string&) { s.mutable_outputs()->set_top_k(65); }},
    {"temperature", "zero temperature", grpc::StatusCode::INVALID_ARGUMENT, "temperature",
     [](v1::ComputeStart& s, std::string&) { s.mutable_options()->set_temperature(0.0); }},
    {"smoothing", "label smoothing above 1", grpc::StatusCode::INVALID_ARGUMENT, "label_smoothing",
     [](v1::ComputeStart& s, std::string&) { s.mutable_options()->set_label_smoothing(1.5); }},
    {"stale_version", "pinned to a version the head left", grpc::StatusCode::FAILED_PRECONDITION,
     "head_version", [](v1::ComputeStart& s, std::string&) { s.set_head_version(999999); }},
    {"partial_row", "bytes that are not whole rows", grpc::StatusCode::INVALID_ARGUMENT,
     "chunk.hidden", [](v1::ComputeStart&, std::string& h) { h.resize(h.size() - 3); }},
    {"missing_rows", "the stream ends early", grpc::StatusCode::INVALID_ARGUMENT, "chunk.hidden",
     [](v1::ComputeStart&, std::string& h) { h.resize(h.size() - kHidden * 4); }},
    {"extra_rows", "more rows than declared", grpc::StatusCode::INVALID_ARGUMENT, "chunk.hidden",
     [](v1::ComputeStart&, std::string& h) { h += std::string(kHidden * 4, '\0'); }},
    {"negative_count", "a negative row count", grpc::StatusCode::INVALID_ARGUMENT, "num_tokens",
     [](v1::ComputeStart& s, std::string&) { s.set_num_tokens(-4); }},
};

class BadComputeTest : public ServerE2eTest, public ::testing::WithParamInterface<BadStart> {};

TEST_P(BadComputeTest, GetsItsCodeAndNamesTheField) {
  const BadStart& bad = GetParam();
  SCOPED_TRACE(bad.why);
  ASSERT_TRUE(ZeroGrad(kHead).ok());
  const Batch batch = RandomBatch(10, rng_);
  v1::ComputeStart start = TrainingStart(kHead, batch);
  std::string hidden = FloatBytes(batch.hidden);
  bad.spoil(start, hidden);
  const ComputeOutcome out = CallCompute(*stub_, start, hidden, 4);
  EXPECT_EQ(out.status.error_code(), bad.code) << out.status.error_message();
  EXPECT_NE(out.status.error_message().find(bad.field), std::string::npos)
      << out.status.error_message();
  const FetchedTensor grad = Fetch(*stub_, kHead, true);
  EXPECT_TRUE(
      std::all_of(grad.values.begin(), grad.values.end(), [](float x) { return x == 0.0f; }));
  // The server still serves.
  EXPECT_TRUE(
      CallCompute(*stub_, TrainingStart(kHead, batch), FloatBytes(batch.hidden), 10).status.ok());
}

INSTANTIATE_TEST_SUITE_P(Table, BadComputeTest, ::testing::ValuesIn(kBadStarts),
                         [](const auto& info) { return std::string(info.param.name); });

// The server reads a chunk's rows where gRPC received them rather than through protobuf's parser
// (proto/wire): a chunk whose rows field is not bytes, which protobuf would have kept as an unknown
// field and the call then found no rows in, is refused by name, and changes nothing.
TEST_F(ServerE2eTest, ARowsFieldThatIsNotBytesIsRefusedByName) {
  ASSERT_TRUE(ZeroGrad(kHead).ok());
  const Batch batch = RandomBatch(4, rng_);
  v1::ComputeRequest chunk;
  chunk.mutable_chunk()
      ->GetReflection()
      ->MutableUnknownFields(chunk.mutable_chunk())
      ->AddVarint(v1::ComputeChunk::kHiddenFieldNumber, 7);
  const ComputeOutcome out = CallComputeWithMessages(*stub_, TrainingStart(kHead, batch), {chunk});
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << out.status.error_message();
  EXPECT_NE(out.status.error_message().find("lossd.v1.ComputeRequest"), std::string::npos)
      << out.status.error_message();
  EXPECT_NE(out.status.error_message().find("chunk.hidden is not bytes"), std::string::npos)
      << out.status.error_message();
  const FetchedTensor grad = Fetch(*stub_, kHead, true);
  EXPECT_TRUE(
      std::all_of(grad.values.begin(), grad.values.end(), [](float x) { return x == 0.0f; }));
  EXPECT_TRUE(
      CallCompute(*stub_, TrainingStart(kHead, batch), FloatBytes(batch.hidden), 2).status.ok());
}

TEST_F(ServerE2eTest, EightConcurrentStreamsAreAllCorrect) {
  const std::vector<float> weight = Fetch(*stub_, kHead, false).values;
  std::vector<Batch> batches;
  for (int i = 0; i < 8; ++i) batches.push_back(RandomBatch(90 + 13 * i, rng_));
  std::vector<ComputeOutcome> outcomes(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto stub = ConnectTo(server_->port());
      v1::ComputeStart start = TrainingStart(kHead, batches[i]);
      start.mutable_outputs()->set_accumulate_grad_weight(false);
      outcomes[i] = CallCompute(*stub, start, FloatBytes(batches[i].hidden), 16);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(outcomes[i].status.ok()) << outcomes[i].status.error_message();
    const ReferenceResult ref = Reference(weight, batches[i]);
    EXPECT_LE(std::abs(outcomes[i].summary.loss() - ref.loss) / ref.loss, kLossBound)
        << "stream " << i;
    EXPECT_LE(RelativeError(AsFloats(outcomes[i].grad_hidden), ref.grad_hidden), kGradBound);
  }
}

// The update torch.optim.SGD(momentum) / AdamW would make, in double.
void ReferenceSgd(std::vector<double>& w, const std::vector<float>& g, std::vector<double>& buf,
                  double lr, double momentum, double wd) {
  for (size_t i = 0; i < w.size(); ++i) {
    const double d = g[i] + wd * w[i];
    buf[i] = momentum * buf[i] + d;
    w[i] -= lr * buf[i];
  }
}

void ReferenceAdamW(std::vector<double>& w, const std::vector<float>& g, std::vector<double>& m,
                    std::vector<double>& v, int step, double lr, double b1, double b2, double eps,
                    double wd) {
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const double m_hat = m[i] / (1 - std::pow(b1, step));
    const double v_hat = v[i] / (1 - std::pow(b2, step));
    w[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
  }
}

TEST_F(ServerE2eTest, StepsMatchTorchOptimizerFormulas) {
  for (const bool adamw : {false, true}) {
    const std::string head = adamw ? "step-adamw" : "step-sgd";
    const int64_t vocab = 257;
    const std::vector<float> initial = RandomWeight(vocab, rng_);
    ASSERT_TRUE(Upload(*stub_, head, vocab, kHidden, initial, true).ok());
    std::vector<double> w(initial.begin(), initial.end());
    std::vector<double> state1(w.size(), 0.0), state2(w.size(), 0.0);
    for (int step = 1; step <= 3; ++step) {
      // The first step comes before any training call: it steps on zeros (weight decay still
      // moves W), with an accumulator the head allocates for it.
      if (step > 1) {
        Batch batch = RandomBatch(64, rng_);
        for (int64_t& y : batch.labels) y %= vocab;
        ASSERT_TRUE(CallCompute(*stub_, TrainingStart(head, batch), FloatBytes(batch.hidden), 64)
                        .status.ok());
      }
      const FetchedTensor grad = Fetch(*stub_, head, true);
      ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
      grpc::ClientContext context;
      v1::StepRequest request;
      request.set_head(head);
      if (adamw) {
        request.mutable_adamw()->set_learning_rate(1e-2);
        request.mutable_adamw()->set_weight_decay(0.1);
        ReferenceAdamW(w, grad.values, state1, state2, step, 1e-2, 0.9, 0.999, 1e-8, 0.1);
      } else {
        request.mutable_sgd()->set_learning_rate(0.5);
        request.mutable_sgd()->set_momentum(0.9);
        request.mutable_sgd()->set_weight_decay(0.01);
        ReferenceSgd(w, grad.values, state1, 0.5, 0.9, 0.01);
      }
      v1::StepResponse response;
      const grpc::Status status = stub_->Step(&context, request, &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(response.head_version(), grad.version + 1);
      const FetchedTensor updated = Fetch(*stub_, head, false);
      double diff = 0.0, norm = 0.0;
      for (size_t i = 0; i < w.size(); ++i) {
        diff += (updated.values[i] - w[i]) * (updated.values[i] - w[i]);
        norm += w[i] * w[i];
      }
      // fp32 updates of fp32 weights against float64 ones: each step rounds W a few times (decay,
      // update, subtraction), half a unit of 2^-24 each, adding up in RMS; about 0.65 units after
      // the first AdamW step and 1.3 after the third are typical. One unit per step plus one.
      EXPECT_LE(std::sqrt(diff / norm), (step + 1) * 0x1p-24) << head << " step " << step;
      // The accumulator was zeroed by the step.
      const FetchedTensor zeroed = Fetch(*stub_, head, true);
      EXPECT_TRUE(
          std::all_of(zeroed.values.begin(), zeroed.values.end(), [](float x) { return x == 0; }));
    }
  }
}

TEST_F(ServerE2eTest, PinnedCallsFailOnceTheHeadMoved) {
  const std::string head = "pinned";
  ASSERT_TRUE(Upload(*stub_, head, 300, kHidden, RandomWeight(300, rng_), true).ok());
  const FetchedTensor before = Fetch(*stub_, head, false);
  grpc::ClientContext context;
  v1::StepRequest request;
  request.set_head(head);
  request.mutable_sgd()->set_learning_rate(0.1);
  v1::StepResponse response;
  ASSERT_TRUE(stub_->Step(&context, request, &response).ok());
  Batch batch = RandomBatch(8, rng_);
  for (int64_t& y : batch.labels) y %= 300;
  v1::ComputeStart start = TrainingStart(head, batch);
  start.set_head_version(before.version);
  const ComputeOutcome out = CallCompute(*stub_, start, FloatBytes(batch.hidden), 8);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  start.set_head_version(response.head_version());
  EXPECT_TRUE(CallCompute(*stub_, start, FloatBytes(batch.hidden), 8).status.ok());
}

// A tied head's input embedding: LookupEmbedding and AccumulateEmbeddingGrad.
struct LookedUp {
  grpc::Status status;
  std::string data;  // the rows' bytes, in order
  int messages = 0;
  uint64_t version = 0;
};

LookedUp LookupEmbedding(v1::LossService::Stub& stub, const v1::LookupEmbeddingRequest& request) {
  LookedUp out;
  grpc::ClientContext context;
  auto reader = stub.LookupEmbedding(&context, request);
  v1::EmbeddingRows rows;
  while (reader->Read(&rows)) {
    EXPECT_EQ(rows.row_offset() * rows.hidden_size() * (rows.dtype() == v1::DTYPE_FLOAT32 ? 4 : 2),
              static_cast<int64_t>(out.data.size()));
    out.data += rows.data();
    out.version = rows.head_version();
    ++out.messages;
  }
  out.status = reader->Finish();
  return out;
}

struct EmbeddingGradOutcome {
  grpc::Status status;
  v1::AccumulateEmbeddingGradResponse response;
};

// Sends `start` and then `grad` in pieces of `piece` bytes (which need not hold whole rows).
EmbeddingGradOutcome SendEmbeddingGrad(v1::LossService::Stub& stub,
                                       const v1::EmbeddingGradStart& start, const std::string& grad,
                                       size_t piece = 1000) {
  EmbeddingGradOutcome out;
  grpc::ClientContext context;
  auto writer = stub.AccumulateEmbeddingGrad(&context, &out.response);
  v1::AccumulateEmbeddingGradRequest request;
  *request.mutable_start() = start;
  writer->Write(request);
  for (size_t offset = 0; offset < grad.size(); offset += piece) {
    v1::AccumulateEmbeddingGradRequest message;
    message.set_grad(grad.substr(offset, piece));
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  out.status = writer->Finish();
  return out;
}

class EmbeddingTest : public ServerE2eTest {
 protected:
  void SetUp() override {
    ServerE2eTest::SetUp();
    head_ = "tied-" + std::to_string(FreshSeed());
    weight_ = RandomWeight(kVocab, rng_);
    v1::UploadHeadStart upload;
    upload.set_head(head_);
    upload.set_vocab_size(kVocab);
    upload.set_hidden_size(kHidden);
    upload.set_tied_embeddings(true);
    ASSERT_TRUE(UploadWithStart(*stub_, upload, weight_).ok());
  }
  v1::EmbeddingGradStart GradStart(const std::vector<int64_t>& ids) const {
    v1::EmbeddingGradStart start;
    start.set_head(head_);
    start.set_hidden_size(kHidden);
    start.set_dtype(v1::DTYPE_FLOAT32);
    start.mutable_token_ids()->Add(ids.begin(), ids.end());
    return start;
  }
  std::vector<float> RandomRows(size_t rows) {
    std::normal_distribution<float> normal;
    std::vector<float> values(rows * kHidden);
    for (float& v : values) v = normal(rng_);
    return values;
  }

  std::string head_;
  std::vector<float> weight_;
};

TEST_F(EmbeddingTest, LookupReturnsTheRowsOfW) {
  const std::vector<int64_t> ids = {5, kVocab - 1, 0, 5, 1234, 77};  // repeats, any order
  v1::LookupEmbeddingRequest request;
  request.set_head(head_);
  request.mutable_token_ids()->Add(ids.begin(), ids.end());
  request.set_max_chunk_bytes(2 * kHidden * 4);  // two rows a message
  const LookedUp f32 = LookupEmbedding(*stub_, request);
  ASSERT_TRUE(f32.status.ok()) << f32.status.error_message();
  EXPECT_EQ(f32.messages, 3);
  const std::vector<float> rows = AsFloats(f32.data);
  ASSERT_EQ(rows.size(), ids.size() * kHidden);
  for (size_t r = 0; r < ids.size(); ++r) {
    const auto row_of = [](const std::vector<float>& m, int64_t i) {
      return std::vector<float>(m.begin() + i * kHidden, m.begin() + (i + 1) * kHidden);
    };
    EXPECT_EQ(row_of(rows, r), row_of(weight_, ids[r])) << "row " << r;
  }
  request.set_dtype(v1::DTYPE_BFLOAT16);
  request.set_head_version(f32.version);
  const LookedUp bf16 = LookupEmbedding(*stub_, request);
  ASSERT_TRUE(bf16.status.ok()) << bf16.status.error_message();
  ASSERT_EQ(bf16.data.size(), ids.size() * kHidden * 2);
  for (size_t i = 0; i < ids.size() * kHidden; ++i) {
    uint16_t bits;
    std::memcpy(&bits, bf16.data.data() + 2 * i, 2);
    ASSERT_EQ(bits, FloatToBFloat16(rows[i])) << i;
  }
}

// The embedding's gradient and Compute's dL/dW land in the one accumulator, in either order (the
// first Compute commit after a reset trades buffers with a zero accumulator: not with one that
// holds embedding rows), and one Step updates W with their sum.
TEST_F(EmbeddingTest, GradientJoinsComputesInOneAccumulatorAndOneStep) {
  const std::vector<int64_t> ids = {3, 7, 3, 0, kVocab - 1, 7, 7};
  const std::vector<float> grad = RandomRows(ids.size());
  std::vector<double> scattered(kVocab * kHidden, 0.0);
  for (size_t r = 0; r < ids.size(); ++r) {
    for (int64_t j = 0; j < kHidden; ++j) scattered[ids[r] * kHidden + j] += grad[r * kHidden + j];
  }
  Batch batch = RandomBatch(150, rng_);
  const std::vector<double> compute_grad = Reference(weight_, batch).grad_weight;
  std::vector<double> both(scattered.size());
  for (size_t i = 0; i < both.size(); ++i) both[i] = scattered[i] + compute_grad[i];

  for (const bool embedding_first : {true, false}) {
    SCOPED_TRACE(embedding_first ? "embedding gradient first" : "Compute first");
    ASSERT_TRUE(ZeroGrad(head_).ok());
    const auto send_embedding = [&] {
      const EmbeddingGradOutcome out =
          SendEmbeddingGrad(*stub_, GradStart(ids), FloatBytes(grad), 333);
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
      EXPECT_EQ(out.response.accumulated_rows(), 4);
    };
    const auto send_compute = [&] {
      const ComputeOutcome out =
          CallCompute(*stub_, TrainingStart(head_, batch), FloatBytes(batch.hidden), 64);
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    };
    if (embedding_first) {
      send_embedding();
      send_compute();
    } else {
      send_compute();
      send_embedding();
    }
    const FetchedTensor accumulated = Fetch(*stub_, head_, true);
    ASSERT_TRUE(accumulated.status.ok());
    EXPECT_LE(RelativeError(accumulated.values, both), kGradBound);
  }
  v1::StepRequest step;
  step.set_head(head_);
  step.mutable_sgd()->set_learning_rate(0.5);
  grpc::ClientContext context;
  v1::StepResponse stepped;
  ASSERT_TRUE(stub_->Step(&context, step, &stepped).ok());
  std::vector<double> expected(weight_.size());
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = weight_[i] - 0.5 * both[i];
  EXPECT_LE(RelativeError(Fetch(*stub_, head_, false).values, expected), 1e-6);
}

// The accumulator's bound covers the embedding rows too: a Compute call whose dL/dW is provably
// finite (grad_scale 1e37: entries near -1e37 in the label's row) but overflows against an
// embedding entry of -3.35e38 there (FLT_MAX is 3.40e38) must be read back and refused, not
// added in place.
TEST_F(EmbeddingTest, ComputeCommitSeesTheEmbeddingRowsInTheAccumulatorsBound) {
  Batch batch;
  batch.hidden.assign(kHidden, 1.0f);
  batch.labels = {17};
  std::vector<float> row(kHidden, 0.0f);
  row[0] = -3.35e38f;
  ASSERT_TRUE(SendEmbeddingGrad(*stub_, GradStart({17}), FloatBytes(row)).status.ok());
  const FetchedTensor before = Fetch(*stub_, head_, true);
  v1::ComputeStart start = TrainingStart(head_, batch);
  start.mutable_options()->set_grad_scale(1e37);
  const ComputeOutcome out = CallCompute(*stub_, start, FloatBytes(batch.hidden), 1);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << out.status.error_message();
  EXPECT_NE(out.status.error_message().find("overflow"), std::string::npos)
      << out.status.error_message();
  const FetchedTensor after = Fetch(*stub_, head_, true);
  EXPECT_EQ(0, std::memcmp(after.values.data(), before.values.data(), before.values.size() * 4));
}

// Every refusal names the field and leaves the accumulator, W and the version as they were.
struct EmbeddingRefusal {
  std::string name;
  std::string reason;
  grpc::StatusCode code;
  std::string fragment;
  // Alters the call (start, gradient bytes) or, for a lookup (`lookup`), the request.
  std::function<void(v1::EmbeddingGradStart&, std::string&)> damage;
  std::function<void(v1::LookupEmbeddingRequest&)> damage_lookup;
};

class EmbeddingRefusalTest : public EmbeddingTest,
                             public ::testing::WithParamInterface<EmbeddingRefusal> {};

TEST_P(EmbeddingRefusalTest, NamesTheFieldAndChangesNothing) {
  const EmbeddingRefusal& c = GetParam();
  SCOPED_TRACE(c.reason);
  // Something already accumulated, which must stay exactly as it is.
  const std::vector<int64_t> ids = {1, 2, 2, 40};
  ASSERT_TRUE(
      SendEmbeddingGrad(*stub_, GradStart(ids), FloatBytes(RandomRows(ids.size()))).status.ok());
  const FetchedTensor grad_before = Fetch(*stub_, head_, true);
  const FetchedTensor weight_before = Fetch(*stub_, head_, false);

  grpc::Status status;
  if (c.damage_lookup) {
    v1::LookupEmbeddingRequest request;
    request.set_head(head_);
    request.mutable_token_ids()->Add(ids.begin(), ids.end());
    c.damage_lookup(request);
    status = LookupEmbedding(*stub_, request).status;
  } else {
    v1::EmbeddingGradStart start = GradStart(ids);
    std::string bytes = FloatBytes(RandomRows(ids.size()));
    c.damage(start, bytes);
    status = SendEmbeddingGrad(*stub_, start, bytes).status;
  }
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  EXPECT_NE(status.error_message().find(c.fragment), std::string::npos) << status.error_message();
  const FetchedTensor grad_after = Fetch(*stub_, head_, true);
  const FetchedTensor weight_after = Fetch(*stub_, head_, false);
  EXPECT_EQ(0, std::memcmp(grad_after.values.data(), grad_before.values.data(),
                           grad_before.values.size() * 4));
  EXPECT_EQ(weight_after.values, weight_before.values);
  EXPECT_EQ(weight_after.version, weight_before.version);
}

void SetFloat(std::string& bytes, size_t index, float value) {
  std::memcpy(bytes.data() + 4 * index, &value, 4);
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Table, EmbeddingRefusalTest, ::testing::ValuesIn(std::vector<EmbeddingRefusal>{
    {"untied_head", "the demo head is an output projection only", grpc::StatusCode::FAILED_PRECONDITION,
     "is not tied", [](auto& start, auto&) { start.set_head(kHead); }, nullptr},
    {"lookup_untied_head", "nor can its rows be looked up", grpc::StatusCode::FAILED_PRECONDITION,
     "is not tied", nullptr, [](auto& request) { request.set_head(kHead); }},
    {"unknown_head", "no such head", grpc::StatusCode::NOT_FOUND, "no head named",
     [](auto& start, auto&) { start.set_head("nothing"); }, nullptr},
    {"id_vocab_size", "the first id past the vocabulary", grpc::StatusCode::INVALID_ARGUMENT,
     "token_ids[2]: expected an id in [0, 2999), got 2999", [](auto& start, auto&) { start.set_token_ids(2, kVocab); }, nullptr},
    {"lookup_id_negative", "a negative id", grpc::StatusCode::INVALID_ARGUMENT, "token_ids[0]",
     nullptr, [](auto& request) { request.set_token_ids(0, -1); }},
    {"lookup_dtype_7", "a dtype the contract does not define", grpc::StatusCode::INVALID_ARGUMENT, "dtype",
     nullptr, [](auto& request) { request.set_dtype(static_cast<v1::DType>(7)); }},
    {"lookup_stale_version", "a pinned version the head has left", grpc::StatusCode::FAILED_PRECONDITION,
     "head_version", nullptr, [](auto& request) { request.set_head_version(999); }},
    {"hidden_size", "H differs from the head's", grpc::StatusCode::INVALID_ARGUMENT, "hidden_size",
     [](auto& start, auto&) { start.set_hidden_size(kHidden + 1); }, nullptr},
    {"dtype_unspecified", "the gradient's dtype must be said", grpc::StatusCode::INVALID_ARGUMENT, "dtype",
     [](auto& start, auto&) { start.set_dtype(v1::DTYPE_UNSPECIFIED); }, nullptr},
    {"one_byte_short", "the last row is cut", grpc::StatusCode::INVALID_ARGUMENT, "grad",
     [](auto&, auto& bytes) { bytes.pop_back(); }, nullptr},
    {"one_row_extra", "more rows than ids", grpc::StatusCode::INVALID_ARGUMENT, "grad",
     [](auto&, auto& bytes) { bytes += bytes.substr(0, kHidden * 4); }, nullptr},
    {"nan_value", "a NaN in the last row", grpc::StatusCode::INVALID_ARGUMENT, "grad[3, 5]",
     [](auto&, auto& bytes) { SetFloat(bytes, 3 * kHidden + 5, std::nanf("")); }, nullptr},
    {"inf_value", "an infinity in the first row", grpc::StatusCode::INVALID_ARGUMENT, "grad[0, 0]",
     [](auto&, auto& bytes) { SetFloat(bytes, 0, -INFINITY); }, nullptr},
    {"sum_overflows", "two finite rows for one id whose sum is not", grpc::StatusCode::INVALID_ARGUMENT,
     "would not be finite",
     [](auto&, auto& bytes) { SetFloat(bytes, 1 * kHidden + 7, 3e38f); SetFloat(bytes, 2 * kHidden + 7, 3e38f); },
     nullptr},
    {"stale_version", "rows looked up at a version the head has left", grpc::StatusCode::FAILED_PRECONDITION,
     "head_version", [](auto& start, auto&) { start.set_head_version(999); }, nullptr},
}), [](const auto& info) { return info.param.name; });
// clang-format on

TEST_F(ServerE2eTest, HealthServiceReportsServing) {
  const HealthReply reply = CheckHealth(server_->port());
  ASSERT_TRUE(reply.status.ok()) << reply.status.error_message();
  EXPECT_EQ(reply.serving_status, kServing);
}

TEST(ServerCheckpointTest, RestartResumesBitwiseIdenticalWeightsAndOptimizerState) {
  const std::string dir = ::testing::TempDir() + "/lossd-ckpt-" + std::to_string(FreshSeed());
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config;
  config.checkpoint_dir = dir;
  config.demo = {"ckpt", 400, kHidden, 3};
  auto run_step = [&](v1::LossService::Stub& stub, const Batch& batch) {
    ASSERT_TRUE(
        CallCompute(stub, TrainingStart("ckpt", batch), FloatBytes(batch.hidden), 50).status.ok());
    grpc::ClientContext context;
    v1::StepRequest request;
    request.set_head("ckpt");
    request.mutable_adamw()->set_learning_rate(1e-2);
    v1::StepResponse response;
    ASSERT_TRUE(stub.Step(&context, request, &response).ok());
  };
  Batch first = RandomBatch(50, rng), second = RandomBatch(50, rng);
  for (Batch* b : {&first, &second})
    for (int64_t& y : b->labels) y %= 400;

  std::vector<float> continued;
  {
    auto server = StartTestServer(config);
    ASSERT_NE(server, nullptr);
    auto stub = ConnectTo(server->port());
    run_step(*stub, first);
    grpc::ClientContext context;
    v1::SaveCheckpointRequest request;
    v1::SaveCheckpointResponse response;
    ASSERT_TRUE(stub->SaveCheckpoint(&context, request, &response).ok());
    ASSERT_EQ(response.paths_size(), 1);
    run_step(*stub, second);
    continued = Fetch(*stub, "ckpt", false).values;
  }
  auto restarted = StartTestServer(config);
  ASSERT_NE(restarted, nullptr);
  auto stub = ConnectTo(restarted->port());
  const FetchedTensor resumed = Fetch(*stub, "ckpt", false);
  EXPECT_EQ(resumed.version, 2u);  // the demo head starts at 1; one step
  run_step(*stub, second);         // AdamW moments must have been restored for this to match
  const std::vector<float> replayed = Fetch(*stub, "ckpt", false).values;
  ASSERT_EQ(replayed.size(), continued.size());
  EXPECT_EQ(0, std::memcmp(replayed.data(), continued.data(), continued.size() * sizeof(float)));
  std::filesystem::remove_all(dir);
}

TEST(ServerAuthTest, TokenIsRequiredWhenConfigured) {
  const std::string token_file =
      ::testing::TempDir() + "/lossd-token-" + std::to_string(FreshSeed());
  { std::ofstream(token_file) << "s3cret-token\n"; }
  server::ServerConfig config;
  config.token_file = token_file;
  config.demo = {"auth", 100, kHidden, 1};
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  for (const std::string& token :
       {std::string(), std::string("wrong"), std::string("s3cret-token")}) {
    auto stub = ConnectTo(server->port());
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::ListHeadsResponse response;
    const grpc::Status status = stub->ListHeads(&context, v1::ListHeadsRequest(), &response);
    EXPECT_EQ(status.error_code(),
              token == "s3cret-token" ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);
  }
  std::filesystem::remove(token_file);
}

v1::HeadInfo GetHeadInfo(v1::LossService::Stub& stub, const std::string& head) {
  grpc::ClientContext context;
  v1::GetHeadRequest request;
  request.set_head(head);
  v1::HeadInfo info;
  EXPECT_TRUE(stub.GetHead(&context, request, &info).ok()) << head;
  return info;
}

// Hugging Face checkpoints: a sharded untied model serves lm_head.weight from its last shard, a
// tied one its embedding with its soft cap, any tensor on request; bf16 on disk becomes the
// configured storage dtype. Heads report where W came from, the tie and the cap, and keep the
// two through a checkpoint and a restart.
TEST(ServerStartupTest, LoadsHeadsFromHuggingFaceCheckpoints) {
  std::mt19937_64 rng(FreshSeed());
  const std::string dir = ::testing::TempDir() + "/lossd-heads-" + std::to_string(FreshSeed());
  const std::string untied = dir + "/untied", tied = dir + "/tied",
                    checkpoints = dir + "/checkpoints";
  std::filesystem::create_directories(untied);
  std::filesystem::create_directories(tied);
  const int64_t vocab = 321;
  const std::vector<float> lm_head = RandomWeight(vocab, rng);
  const std::vector<float> embedding = RandomWeight(vocab, rng);
  std::vector<uint16_t> lm_head_bf16(lm_head.size());
  std::vector<float> lm_head_rounded(lm_head.size());
  for (size_t i = 0; i < lm_head.size(); ++i) {
    lm_head_bf16[i] = FloatToBFloat16(lm_head[i]);
    lm_head_rounded[i] = BFloat16ToFloat(lm_head_bf16[i]);
  }
  const std::vector<int64_t> shape = {vocab, kHidden};
  const auto write_json = [](const std::string& path, const std::string& text) {
    std::ofstream(path) << text;
  };
  ASSERT_TRUE(
      storage::WriteSafetensorsAtomically(
          untied + "/model-00001-of-00002.safetensors",
          {{"model.embed_tokens.weight", "F32", shape, embedding.data(), embedding.size() * 4}}, {})
          .ok());
  ASSERT_TRUE(storage::WriteSafetensorsAtomically(
                  untied + "/model-00002-of-00002.safetensors",
                  {{"lm_head.weight", "BF16", shape, lm_head_bf16.data(), lm_head_bf16.size() * 2}},
                  {})
                  .ok());
  write_json(untied + "/model.safetensors.index.json",
             R"({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                "lm_head.weight": "model-00002-of-00002.safetensors"}})");
  write_json(untied + "/config.json", R"({"model_type": "llama", "tie_word_embeddings": false})");
  ASSERT_TRUE(
      storage::WriteSafetensorsAtomically(
          tied + "/model.safetensors",
          {{"model.embed_tokens.weight", "F32", shape, embedding.data(), embedding.size() * 4}}, {})
          .ok());
  write_json(tied + "/config.json", R"({"model_type": "gemma2", "final_logit_softcapping": 30.0})");

  server::ServerConfig config;
  config.checkpoint_dir = checkpoints;
  config.heads = {"untied=" + untied, "tied=" + tied,
                  "chosen=" + untied + "/model.safetensors.index.json#model.embed_tokens.weight"};
  {
    auto server = StartTestServer(config);
    ASSERT_NE(server, nullptr);
    auto stub = ConnectTo(server->port());
    EXPECT_EQ(Fetch(*stub, "untied", false).values, lm_head_rounded);
    EXPECT_EQ(Fetch(*stub, "tied", false).values, embedding);
    EXPECT_EQ(Fetch(*stub, "chosen", false).values, embedding);
    EXPECT_EQ(Fetch(*stub, "demo", false).status.error_code(), grpc::StatusCode::NOT_FOUND);
    const v1::HeadInfo untied_info = GetHeadInfo(*stub, "untied");
    EXPECT_EQ(untied_info.source(),
              untied + "/model-00002-of-00002.safetensors#lm_head.weight (BF16)");
    EXPECT_FALSE(untied_info.tied_embeddings());
    EXPECT_EQ(untied_info.logit_softcap(), 0.0);
    const v1::HeadInfo tied_info = GetHeadInfo(*stub, "tied");
    EXPECT_EQ(tied_info.source(), tied + "/model.safetensors#model.embed_tokens.weight (F32)");
    EXPECT_TRUE(tied_info.tied_embeddings());
    EXPECT_EQ(tied_info.logit_softcap(), 30.0);
    EXPECT_FALSE(GetHeadInfo(*stub, "chosen").tied_embeddings());  // the model itself is untied

    grpc::ClientContext context;
    v1::SaveCheckpointRequest save;
    v1::SaveCheckpointResponse saved;
    ASSERT_TRUE(stub->SaveCheckpoint(&context, save, &saved).ok());
  }
  // Resumed from its checkpoint, a head keeps its tie and cap.
  config.heads.clear();
  auto resumed = StartTestServer(config);
  ASSERT_NE(resumed, nullptr);
  auto stub = ConnectTo(resumed->port());
  const v1::HeadInfo tied_info = GetHeadInfo(*stub, "tied");
  EXPECT_TRUE(tied_info.tied_embeddings());
  EXPECT_EQ(tied_info.logit_softcap(), 30.0);
  EXPECT_EQ(Fetch(*stub, "tied", false).values, embedding);
  EXPECT_FALSE(GetHeadInfo(*stub, "untied").tied_embeddings());

  // The first shard of the untied model alone holds only its embedding: refused, not served.
  config.checkpoint_dir.clear();
  config.heads = {"shard=" + untied + "/model-00001-of-00002.safetensors"};
  auto refused = server::LossServer::Start(config, CreateBackend("cpu").value());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("'lm_head.weight'"), std::string::npos)
      << refused.status();
  config.heads = {"broken=" + untied + "#no.such.tensor"};
  refused = server::LossServer::Start(config, CreateBackend("cpu").value());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("no.such.tensor"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// A GPU host that fell back to the CPU without a word (a module built for other GPUs, a missing
// driver) would look healthy: "auto" logs why CUDA was not taken, and logs nothing when it was.
// The reason is in plain words: a CUDA module on a machine without the NVIDIA driver says so,
// where CUDA's own error claims that the driver is too old for the runtime.
TEST(ServerStartupTest, AutoDeviceSaysWhyItServesOnTheCpu) {
  server::ServerConfig config;
  config.device = "auto";
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.demo = {"small", 500, kHidden, 1};
  auto server = server::LossServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string prefix = "device auto: CPU (CUDA unavailable: ";
  std::vector<std::string> explanations;
  for (const std::string& line : (*server)->startup_log()) {
    if (line.rfind(prefix, 0) == 0) explanations.push_back(line.substr(prefix.size()));
  }
  ASSERT_EQ(explanations.size(), (*server)->backend().kind() == "cpu" ? 1u : 0u);
  if (explanations.empty() || std::getenv("LOSSD_CUDA_MODULE") != nullptr) return;
  const bool module_built = std::filesystem::exists(
      std::filesystem::read_symlink("/proc/self/exe").parent_path() / "liblossd_cuda.so");
  if (!module_built) {
    EXPECT_EQ(explanations[0].rfind("CUDA backend module not found (", 0), 0u) << explanations[0];
  } else if (!std::filesystem::exists("/proc/driver/nvidia/version")) {
    EXPECT_EQ(explanations[0].rfind("cuda:0: no GPU found (no NVIDIA driver; "
                                    "cudaErrorInsufficientDriver: ",
                                    0),
              0u)
        << explanations[0];
  }
}

TEST(ServerLimitsTest, OverBudgetCallsAndOversizedMessagesAreResourceExhausted) {
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config;
  config.demo = {"small", 500, kHidden, 1};
  config.compute_memory_bytes = 1 << 16;  // smaller than one call's workspace and staging gradient
  config.max_message_bytes = 1 << 20;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  Batch batch = RandomBatch(16, rng);
  for (int64_t& y : batch.labels) y %= 500;
  const ComputeOutcome over_budget =
      CallCompute(*stub, TrainingStart("small", batch), FloatBytes(batch.hidden), 16);
  EXPECT_EQ(over_budget.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(over_budget.status.error_message().find("budget"), std::string::npos);

  Batch large = RandomBatch(8000, rng);  // 1.5 MiB in one message, over the 1 MiB limit
  for (int64_t& y : large.labels) y %= 500;
  const ComputeOutcome oversized =
      CallCompute(*stub, TrainingStart("small", large), FloatBytes(large.hidden), 8000);
  EXPECT_EQ(oversized.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// ---------------------------------------------------------------------------------------------
// How a call is cut into engine chunks: into up to four, so that its rows arrive, compute and
// leave at once (OverlappedChunkRowLimit), unless the workspace budget cuts shorter ones; planned
// for its length rounded up (PlannedCallRows), so that calls of nearby lengths share buffers.

// The CPU backend, recording the rows of every engine chunk it is given and the workspace each
// computes in.
class ChunkRecordingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::StatusOr<BatchSummary> Compute(const BatchInputs& in, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& out,
                                       DeviceBuffer* grad_weight,
                                       DeviceBuffer& workspace) override {
    {
      absl::MutexLock lock(&mutex_);
      chunk_rows_.push_back(in.num_tokens);
      workspaces_.emplace_back(workspace.data(), workspace.bytes());
    }
    return ForwardingBackend::Compute(in, weight, options, out, grad_weight, workspace);
  }
  std::vector<int64_t> TakeChunkRows() {
    absl::MutexLock lock(&mutex_);
    return std::exchange(chunk_rows_, {});
  }
  std::vector<std::pair<const void*, size_t>> TakeWorkspaces() {
    absl::MutexLock lock(&mutex_);
    return std::exchange(workspaces_, {});
  }

 private:
  absl::Mutex mutex_;
  std::vector<int64_t> chunk_rows_ ABSL_GUARDED_BY(mutex_);
  std::vector<std::pair<const void*, size_t>> workspaces_ ABSL_GUARDED_BY(mutex_);
};

struct ChunkingCase {
  const char* name;
  int64_t rows;
  int64_t budget_bytes;
  // The engine chunks' rows in order; empty: those of the CPU's own plan under the budget.
  std::vector<int64_t> chunk_rows;
};

void PrintTo(const ChunkingCase& c, std::ostream* os) { *os << c.name; }

constexpr int64_t kChunkingVocab = 64;
constexpr int64_t kRoomyBudget = int64_t{64} << 20;  // the CPU's plan alone: chunks of 4096 rows

const ChunkingCase kChunkingCases[] = {
    // The CPU's plan alone would take two chunks of 4096: four of the 2048-row minimum overlap
    // more.
    {"four_chunks_of_the_minimum", 8192, kRoomyBudget, {2048, 2048, 2048, 2048}},
    // Never more than four, however long the call.
    {"four_chunks_at_most", 16384, kRoomyBudget, {4096, 4096, 4096, 4096}},
    // Fewer than four minimum chunks' rows: as many as fit, cut as for 5120 rows, its plan's.
    {"two_chunks", 5000, kRoomyBudget, {2560, 2440}},
    // Planned as 3072 rows, shorter than two minimum chunks: one chunk.
    {"too_short_to_cut", 3000, kRoomyBudget, {3000}},
    // Planned as 15360 rows: four chunks of 3840 but the last.
    {"planned_for_its_rounded_length", 15000, kRoomyBudget, {3840, 3840, 3840, 3480}},
    {"one_row", 1, kRoomyBudget, {1}},
    // A budget that fits fewer rows than the overlap asks for: its own chunks stay.
    {"the_budget_cuts_shorter_chunks", 8192, int64_t{1} << 18, {}},
};

// A CPU server whose backend records its chunks (in `backend`, which the server owns), or null.
std::unique_ptr<server::LossServer> StartRecordingServer(int64_t budget_bytes,
                                                         ChunkRecordingBackend** backend) {
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend("cpu");
  if (!cpu.ok()) return nullptr;
  auto recording = std::make_unique<ChunkRecordingBackend>(*std::move(cpu));
  *backend = recording.get();
  server::ServerConfig config;
  config.workspace_budget_bytes = budget_bytes;
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  absl::StatusOr<std::unique_ptr<server::LossServer>> server =
      server::LossServer::Start(config, std::move(recording));
  return server.ok() ? *std::move(server) : nullptr;
}

class ChunkingTest : public ::testing::TestWithParam<ChunkingCase> {};

TEST_P(ChunkingTest, CallIsComputedInOverlappedChunksAndMatchesTheReference) {
  const ChunkingCase& c = GetParam();
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<int64_t> expected = c.chunk_rows;
  if (expected.empty()) {
    ProblemShape shape;
    shape.num_tokens = c.rows;
    shape.hidden_size = kHidden;
    shape.vocab_size = kChunkingVocab;
    shape.grad_hidden = true;
    shape.grad_weight = true;
    shape.top_k = 5;
    const absl::StatusOr<ChunkPlan> plan = (*cpu)->Plan(shape, c.budget_bytes);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_LT(plan->token_chunk, server::OverlappedChunkRowLimit(c.rows))
        << "the budget cuts nothing";
    for (int64_t first = 0; first < c.rows; first += plan->token_chunk) {
      expected.push_back(std::min(plan->token_chunk, c.rows - first));
    }
  }
  ChunkRecordingBackend* backend = nullptr;
  const std::unique_ptr<server::LossServer> server = StartRecordingServer(c.budget_bytes, &backend);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const std::vector<float> weight = RandomWeight(kChunkingVocab, rng);
  ASSERT_TRUE(Upload(*stub, "chunked", kChunkingVocab, kHidden, weight, false).ok());
  Batch batch = RandomBatch(c.rows, rng);
  for (int64_t& y : batch.labels) y %= kChunkingVocab;

  const ComputeOutcome out = CallCompute(*stub, TrainingStart("chunked", batch),
                                         FloatBytes(batch.hidden), /*rows_per_message=*/1000);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(backend->TakeChunkRows(), expected);

  const ReferenceResult ref = Reference(weight, batch, kChunkingVocab);
  EXPECT_LE(std::abs(out.summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  const FetchedTensor grad = Fetch(*stub, "chunked", /*gradient=*/true);
  ASSERT_TRUE(grad.status.ok()) << grad.status.error_message();
  EXPECT_LE(RelativeError(grad.values, ref.grad_weight), kGradBound);
}

INSTANTIATE_TEST_SUITE_P(Calls, ChunkingTest, ::testing::ValuesIn(kChunkingCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Calls of 15000 and 15300 rows, both planned as 15360, compute in the same workspace, kept
// between them; one of 16384 rows, planned as itself, in a workspace of its own size.
TEST(ChunkingTest, CallsOfNearbyLengthsComputeInTheSameWorkspace) {
  std::mt19937_64 rng(FreshSeed());
  ChunkRecordingBackend* backend = nullptr;
  const std::unique_ptr<server::LossServer> server = StartRecordingServer(kRoomyBudget, &backend);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  ASSERT_TRUE(
      Upload(*stub, "chunked", kChunkingVocab, kHidden, RandomWeight(kChunkingVocab, rng), false)
          .ok());
  std::vector<std::pair<const void*, size_t>> workspaces;
  for (const int64_t rows : {15000, 15300, 16384}) {
    Batch batch = RandomBatch(rows, rng);
    for (int64_t& y : batch.labels) y %= kChunkingVocab;
    const ComputeOutcome out = CallCompute(*stub, TrainingStart("chunked", batch),
                                           FloatBytes(batch.hidden), /*rows_per_message=*/1000);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    const std::vector<std::pair<const void*, size_t>> used = backend->TakeWorkspaces();
    ASSERT_FALSE(used.empty());
    for (const auto& chunk : used) EXPECT_EQ(chunk, used.front()) << rows << " rows";
    workspaces.push_back(used.front());
  }
  EXPECT_EQ(workspaces[1], workspaces[0]) << "15300 rows did not reuse the workspace of 15000";
  EXPECT_NE(workspaces[2].second, workspaces[0].second);
}

}  // namespace
}  // namespace lossd::testing
