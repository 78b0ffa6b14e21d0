// Distillation through a real lossd server on loopback: a student head and a teacher head of
// another hidden size served side by side, the teacher's rows streamed beside the student's in
// every message, against the float64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

constexpr int64_t kVocab = 2003;
constexpr int64_t kHidden = 48;
constexpr int64_t kTeacherHidden = 32;
constexpr int64_t kRows = 301;
constexpr char kStudent[] = "student";
constexpr char kTeacher[] = "teacher";

// The engine's distill bounds (engine_test.cc): the server adds no error of its own.
constexpr double kLossBound = 1e-5;
constexpr double kGradBound = 2e-5;
// KD and CE per token, absolute, at logits of a few units.
constexpr double kTermBound = 2e-4;

v1::DistillOptions& DistillOf(v1::ComputeStart& start) {
  return *start.mutable_options()->mutable_distill();
}

class DistillServerTest : public ::testing::Test {
 protected:
  // The student is the demo head behind a 1 MiB workspace, so that a call runs as several engine
  // chunks of two logits tiles each; the teacher is uploaded with logits about twice as large.
  static void SetUpTestSuite() {
    std::mt19937_64 rng(FreshSeed());
    server_ = StartTestServer(MultiChunkDemoConfig(kStudent, kVocab, kHidden, 17)).release();
    ASSERT_NE(server_, nullptr);
    auto stub = ConnectTo(server_->port());
    teacher_weight_ = new std::vector<float>(RandomWeight(kVocab, kTeacherHidden, rng));
    for (float& w : *teacher_weight_) w *= 2.0f;
    ASSERT_TRUE(Upload(*stub, kTeacher, kVocab, kTeacherHidden, *teacher_weight_, false).ok());
    const FetchedTensor student = Fetch(*stub, kStudent, false);
    ASSERT_TRUE(student.status.ok());
    student_weight_ = new std::vector<float>(student.values);
  }
  static void TearDownTestSuite() {
    delete server_;
    delete teacher_weight_;
    delete student_weight_;
  }

  void SetUp() override {
    stub_ = ConnectTo(server_->port());
    rng_.seed(FreshSeed());
  }

  // A batch with 10% of its labels ignored, and the teacher's rows for it.
  Batch MakeBatch() {
    Batch batch = RandomBatch(kRows, kVocab, kHidden, rng_);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (int64_t& y : batch.labels) {
      if (unit(rng_) < 0.1) y = -100;
    }
    return batch;
  }
  std::vector<float> MakeTeacherRows() {
    return RandomBatch(kRows, kVocab, kTeacherHidden, rng_).hidden;
  }

  // A training (or scoring) distill start against the teacher head, asking for every per-token
  // result.
  static v1::ComputeStart DistillStart(const Batch& batch, bool training) {
    v1::ComputeStart start = StartFor(kStudent, batch, kHidden, training);
    start.mutable_options()->set_objective(v1::OBJECTIVE_DISTILL);
    start.set_teacher_head(kTeacher);
    start.set_teacher_hidden_size(kTeacherHidden);
    start.mutable_outputs()->set_kd(true);
    start.mutable_outputs()->set_ce(true);
    start.mutable_outputs()->set_logprob(true);
    return start;
  }

  static LossOptions OptionsOf(const v1::ComputeStart& start) {
    const v1::DistillOptions& d = start.options().distill();
    LossOptions o;
    o.objective = Objective::kDistill;
    o.reduction = static_cast<Reduction>(start.options().reduction());
    o.distill.beta = d.beta();
    o.distill.alpha = d.alpha();
    o.distill.temperature = d.has_temperature() ? d.temperature() : 1.0;
    o.distill.teacher_temperature = d.has_teacher_temperature() ? d.teacher_temperature() : 1.0;
    o.distill.sparse_mass = static_cast<SparseTeacherMass>(d.sparse_teacher_mass());
    return o;
  }

  // The float64 reference problem of a batch on the student, without its teacher yet.
  static ReferenceProblem StudentProblem(const Batch& batch, const LossOptions& options) {
    ReferenceProblem p;
    p.num_tokens = kRows;
    p.hidden_size = kHidden;
    p.vocab_size = kVocab;
    p.hidden.assign(batch.hidden.begin(), batch.hidden.end());
    p.weight.assign(student_weight_->begin(), student_weight_->end());
    p.labels = batch.labels;
    p.options = options;
    return p;
  }

  // The float64 reference of a dense-teacher call.
  static ReferenceResult DenseReference(const Batch& batch, const std::vector<float>& teacher_rows,
                                        const LossOptions& options) {
    ReferenceProblem p = StudentProblem(batch, options);
    p.teacher_hidden_size = kTeacherHidden;
    p.teacher_hidden.assign(teacher_rows.begin(), teacher_rows.end());
    p.teacher_weight.assign(teacher_weight_->begin(), teacher_weight_->end());
    return ComputeReference(p);
  }

  uint64_t TeacherVersion() {
    grpc::ClientContext context;
    v1::GetHeadRequest request;
    request.set_head(kTeacher);
    v1::HeadInfo info;
    EXPECT_TRUE(stub_->GetHead(&context, request, &info).ok());
    return info.version();
  }

  static void ExpectPerToken(const ComputeOutcome& outcome, const ReferenceResult& ref) {
    EXPECT_LE(MaxAbsError(outcome.kd, ref.kd), kTermBound);
    EXPECT_LE(MaxAbsError(outcome.ce, ref.ce), kTermBound);
    EXPECT_LE(MaxAbsError(outcome.logprob, ref.logprob), kTermBound);
    EXPECT_LE(TokenLossError(outcome.token_loss, ref), kLossBound);
  }

  static server::LossServer* server_;
  static std::vector<float>* teacher_weight_;
  static std::vector<float>* student_weight_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  std::mt19937_64 rng_;
};

server::LossServer* DistillServerTest::server_ = nullptr;
std::vector<float>* DistillServerTest::teacher_weight_ = nullptr;
std::vector<float>* DistillServerTest::student_weight_ = nullptr;

// JSD at tau 2 against a teacher of its own temperature, a quarter of cross-entropy: the loss,
// every per-token result, dL/dh and the accumulated dL/dW against the reference; the summary's
// means and both heads' versions.
TEST_F(DistillServerTest, TrainingMatchesTheReference) {
  ASSERT_TRUE(Fetch(*stub_, kStudent, true).status.ok());
  {
    grpc::ClientContext context;
    v1::ZeroGradWeightRequest zero;
    zero.set_head(kStudent);
    v1::ZeroGradWeightResponse zeroed;
    ASSERT_TRUE(stub_->ZeroGradWeight(&context, zero, &zeroed).ok());
  }
  const Batch batch = MakeBatch();
  const std::vector<float> teacher_rows = MakeTeacherRows();
  v1::ComputeStart start = DistillStart(batch, true);
  DistillOf(start).set_beta(0.4);
  DistillOf(start).set_alpha(0.25);
  DistillOf(start).set_temperature(2.0);
  DistillOf(start).set_teacher_temperature(1.5);
  const ReferenceResult ref = DenseReference(batch, teacher_rows, OptionsOf(start));
  TeacherRows teacher{FloatBytes(teacher_rows), "", ""};
  const ComputeOutcome outcome =
      CallCompute(*stub_, start, FloatBytes(batch.hidden), 64, -1, "", &teacher);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_NEAR(outcome.summary.loss(), ref.loss, kLossBound * std::abs(ref.loss));
  EXPECT_EQ(outcome.summary.counted_tokens(), ref.counted_tokens);
  const double counted = static_cast<double>(ref.counted_tokens);
  EXPECT_NEAR(outcome.summary.mean_kd(), ref.kd_sum / counted, kTermBound);
  EXPECT_NEAR(outcome.summary.mean_ce(), ref.ce_sum / counted, kTermBound);
  EXPECT_EQ(outcome.summary.teacher_head_version(), TeacherVersion());
  ExpectPerToken(outcome, ref);
  EXPECT_LE(RelativeError(AsFloats(outcome.grad_hidden), ref.grad_hidden), kGradBound);
  const FetchedTensor grad = Fetch(*stub_, kStudent, true);
  ASSERT_TRUE(grad.status.ok());
  EXPECT_LE(RelativeError(grad.values, ref.grad_weight), kGradBound);
  // The teacher is read, never trained.
  const FetchedTensor teacher_grad = Fetch(*stub_, kTeacher, true);
  ASSERT_TRUE(teacher_grad.status.ok());
  EXPECT_TRUE(std::all_of(teacher_grad.values.begin(), teacher_grad.values.end(),
                          [](float g) { return g == 0.0f; }));
}

// The engine's chunks follow the plan, never the messages: one row per message, 17, or the whole
// batch in one give the same bits, dL/dW included.
TEST_F(DistillServerTest, ResultsDoNotDependOnTheMessageSplit) {
  const Batch batch = MakeBatch();
  const std::vector<float> teacher_rows = MakeTeacherRows();
  v1::ComputeStart start = DistillStart(batch, true);
  DistillOf(start).set_beta(1.0);
  DistillOf(start).set_alpha(0.5);
  TeacherRows teacher{FloatBytes(teacher_rows), "", ""};
  std::vector<ComputeOutcome> outcomes;
  std::vector<std::vector<float>> grads;
  for (const int64_t rows_per_message : {int64_t{1}, int64_t{17}, kRows}) {
    grpc::ClientContext context;
    v1::ZeroGradWeightRequest zero;
    zero.set_head(kStudent);
    v1::ZeroGradWeightResponse zeroed;
    ASSERT_TRUE(stub_->ZeroGradWeight(&context, zero, &zeroed).ok());
    outcomes.push_back(
        CallCompute(*stub_, start, FloatBytes(batch.hidden), rows_per_message, -1, "", &teacher));
    ASSERT_TRUE(outcomes.back().status.ok()) << outcomes.back().status.error_message();
    const FetchedTensor grad = Fetch(*stub_, kStudent, true);
    ASSERT_TRUE(grad.status.ok());
    grads.push_back(grad.values);
  }
  for (size_t i = 1; i < outcomes.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(BitwiseEqual(outcomes[i].kd, outcomes[0].kd));
    EXPECT_TRUE(BitwiseEqual(outcomes[i].ce, outcomes[0].ce));
    EXPECT_TRUE(BitwiseEqual(outcomes[i].token_loss, outcomes[0].token_loss));
    EXPECT_EQ(outcomes[i].grad_hidden, outcomes[0].grad_hidden);
    EXPECT_EQ(outcomes[i].summary.loss(), outcomes[0].summary.loss());
    EXPECT_TRUE(BitwiseEqual(grads[i], grads[0]));
  }
}

// Cached teacher outputs: the top-16 of the teacher head's log-probabilities per row, the rest of
// the mass spread, under forward KL.
TEST_F(DistillServerTest, SparseTeacherMatchesTheReference) {
  const Batch batch = MakeBatch();
  const std::vector<float> teacher_rows = MakeTeacherRows();
  constexpr int kTopK = 16;
  // The teacher head's own log-probabilities, their top-16 as a sparse teacher.
  ReferenceProblem dense;
  dense.num_tokens = kRows;
  dense.hidden_size = kTeacherHidden;
  dense.vocab_size = kVocab;
  dense.hidden.assign(teacher_rows.begin(), teacher_rows.end());
  dense.weight.assign(teacher_weight_->begin(), teacher_weight_->end());
  dense.labels.assign(kRows, 0);
  const ReferenceResult teacher_ref = ComputeReference(dense);
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<int64_t> order(kVocab);
  for (int64_t i = 0; i < kRows; ++i) {
    const double* z = &teacher_ref.logits[i * kVocab];
    for (int64_t t = 0; t < kVocab; ++t) order[t] = t;
    std::partial_sort(order.begin(), order.begin() + kTopK, order.end(),
                      [&](int64_t a, int64_t b) { return z[a] > z[b]; });
    for (int j = 0; j < kTopK; ++j) {
      tokens.push_back(static_cast<int32_t>(order[j]));
      logprobs.push_back(static_cast<float>(z[order[j]] - teacher_ref.lse[i]));
    }
  }
  v1::ComputeStart start = DistillStart(batch, true);
  start.clear_teacher_head();
  start.clear_teacher_hidden_size();
  start.set_teacher_top_k(kTopK);
  DistillOf(start).set_alpha(0.5);
  DistillOf(start).set_sparse_teacher_mass(v1::SPARSE_TEACHER_SPREAD);
  ReferenceProblem p = StudentProblem(batch, OptionsOf(start));
  p.teacher_top_k = kTopK;
  p.teacher_top_k_tokens.assign(tokens.begin(), tokens.end());
  p.teacher_top_k_logprobs.assign(logprobs.begin(), logprobs.end());
  const ReferenceResult ref = ComputeReference(p);
  TeacherRows teacher{
      "",
      std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t)),
      FloatBytes(logprobs)};
  const ComputeOutcome outcome =
      CallCompute(*stub_, start, FloatBytes(batch.hidden), 50, -1, "", &teacher);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_NEAR(outcome.summary.loss(), ref.loss, kLossBound * std::abs(ref.loss));
  ExpectPerToken(outcome, ref);
  EXPECT_LE(RelativeError(AsFloats(outcome.grad_hidden), ref.grad_hidden), kGradBound);
}

// Monitoring a policy against its reference: KL(q || p) per token, no labels, nothing trained.
TEST_F(DistillServerTest, ScoresTheKlPerTokenWithoutLabels) {
  const FetchedTensor before = Fetch(*stub_, kStudent, true);
  ASSERT_TRUE(before.status.ok());
  Batch batch = MakeBatch();
  const std::vector<float> teacher_rows = MakeTeacherRows();
  v1::ComputeStart start = DistillStart(batch, false);
  start.clear_labels();
  start.mutable_options()->set_reduction(v1::REDUCTION_NONE);
  start.mutable_outputs()->set_ce(false);
  DistillOf(start).set_beta(1.0);
  batch.labels.clear();
  const ReferenceResult ref = DenseReference(batch, teacher_rows, OptionsOf(start));
  TeacherRows teacher{FloatBytes(teacher_rows), "", ""};
  const ComputeOutcome outcome =
      CallCompute(*stub_, start, FloatBytes(batch.hidden), 100, -1, "", &teacher);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_EQ(outcome.summary.counted_tokens(), kRows);
  EXPECT_LE(MaxAbsError(outcome.kd, ref.kd), kTermBound);
  EXPECT_TRUE(outcome.ce.empty());
  EXPECT_NEAR(outcome.summary.mean_kd(), ref.kd_sum / kRows, kTermBound);
  EXPECT_FALSE(outcome.summary.grad_weight_accumulated());
  const FetchedTensor after = Fetch(*stub_, kStudent, true);
  EXPECT_TRUE(BitwiseEqual(after.values, before.values));
}

// A head that is its own teacher, on the same rows: KL exactly 0 and dL/dh exactly 0.
TEST_F(DistillServerTest, SelfDistillationIsExactlyZero) {
  const Batch batch = MakeBatch();
  v1::ComputeStart start = DistillStart(batch, false);
  start.mutable_outputs()->set_grad_hidden(true);
  start.set_teacher_head(kStudent);
  start.set_teacher_hidden_size(kHidden);
  DistillOf(start).set_beta(0.5);
  DistillOf(start).set_temperature(1.7);
  TeacherRows teacher{FloatBytes(batch.hidden), "", ""};
  const ComputeOutcome outcome =
      CallCompute(*stub_, start, FloatBytes(batch.hidden), 64, -1, "", &teacher);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_EQ(outcome.summary.loss(), 0.0);
  EXPECT_TRUE(std::all_of(outcome.kd.begin(), outcome.kd.end(), [](float x) { return x == 0.0f; }));
  const std::vector<float> grad = AsFloats(outcome.grad_hidden);
  EXPECT_TRUE(std::all_of(grad.begin(), grad.end(), [](float x) { return x == 0.0f; }));
}

// The teacher is read at one version for the whole call: an upload that replaces it after the
// first engine chunk was computed aborts the call, and the student's accumulator keeps nothing of
// it.
TEST_F(DistillServerTest, TeacherReplacedDuringTheCallAbortsIt) {
  const FetchedTensor before = Fetch(*stub_, kStudent, true);
  ASSERT_TRUE(before.status.ok());
  const Batch batch = MakeBatch();
  const std::vector<float> teacher_rows = MakeTeacherRows();
  const v1::ComputeStart start = DistillStart(batch, true);
  grpc::ClientContext context;
  auto stream = stub_->Compute(&context);
  v1::ComputeRequest request;
  *request.mutable_start() = start;
  ASSERT_TRUE(stream->Write(request));
  // Rows enough for the first engine chunk (its plan holds fewer than 200 rows of two tiles).
  const auto send_rows = [&](int64_t first, int64_t rows) {
    v1::ComputeRequest chunk;
    chunk.mutable_chunk()->set_hidden(FloatBytes(
        {batch.hidden.begin() + first * kHidden, batch.hidden.begin() + (first + rows) * kHidden}));
    chunk.mutable_chunk()->set_teacher_hidden(
        FloatBytes({teacher_rows.begin() + first * kTeacherHidden,
                    teacher_rows.begin() + (first + rows) * kTeacherHidden}));
    return stream->Write(chunk);
  };
  ASSERT_TRUE(send_rows(0, 200));
  v1::ComputeResponse first_result;
  ASSERT_TRUE(stream->Read(&first_result));
  ASSERT_TRUE(first_result.has_result());
  std::vector<float> replaced = *teacher_weight_;
  for (float& w : replaced) w = -w;
  ASSERT_TRUE(Upload(*stub_, kTeacher, kVocab, kTeacherHidden, replaced, true).ok());
  send_rows(200, kRows - 200);
  stream->WritesDone();
  v1::ComputeResponse response;
  while (stream->Read(&response)) continue;
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  const FetchedTensor after = Fetch(*stub_, kStudent, true);
  EXPECT_TRUE(BitwiseEqual(after.values, before.values)) << "the aborted call accumulated";
  // Put the teacher back for the other tests (its version moves on).
  ASSERT_TRUE(Upload(*stub_, kTeacher, kVocab, kTeacherHidden, *teacher_weight_, true).ok());
}

}  // namespace
}  // namespace lossd::testing
