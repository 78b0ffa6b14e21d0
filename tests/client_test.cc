// The C++ client library against a real lossd server on loopback, and the .npy reader/writer.
#include "lossd/client/client.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "client/cpp/npy.h"
#include "client/cpp/result_assembler.h"
#include "client/cpp/shared_buffer.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/half.h"
#include "server/call/proto_convert.h"
#include "server/shm/shared_memory.h"
#include "tests/engine_harness.h"
#include "tests/holding_relay.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using client::ChannelOptions;
using client::Client;
using client::ComputeRequest;
using client::ComputeResult;

constexpr int64_t kVocab = 2999;
constexpr int64_t kHidden = 48;
constexpr char kHead[] = "client";

// Engine bounds (see engine_test.cc): neither the server nor the client adds error of its own.
constexpr double kLossBound = 1e-6;
constexpr double kGradBound = 2e-5;

std::vector<float> RandomNormal(int64_t count, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

std::vector<int64_t> RandomLabels(int64_t count, int64_t vocab, double ignore_fraction,
                                  std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int64_t> labels(count);
  for (int64_t& label : labels) label = unit(rng) < ignore_fraction ? -100 : token(rng);
  return labels;
}

ReferenceProblem MakeReferenceProblem(const std::vector<float>& hidden,
                                      const std::vector<float>& weight,
                                      const std::vector<int64_t>& labels, int64_t hidden_size,
                                      int top_k) {
  ReferenceProblem problem;
  problem.num_tokens = static_cast<int64_t>(labels.size());
  problem.hidden_size = hidden_size;
  problem.vocab_size = static_cast<int64_t>(weight.size()) / hidden_size;
  problem.hidden.assign(hidden.begin(), hidden.end());
  problem.weight.assign(weight.begin(), weight.end());
  problem.labels = labels;
  problem.top_k = top_k;
  return problem;
}

// A repeated field's values, to compare with the reference's vectors.
template <typename T>
std::vector<T> Values(const google::protobuf::RepeatedField<T>& field) {
  return {field.begin(), field.end()};
}

// Every per-token output and summary field the same, bit for bit (equal values serialize alike).
void ExpectSameResults(const ComputeResult& a, const ComputeResult& b) {
  EXPECT_EQ(a.per_token.SerializeAsString(), b.per_token.SerializeAsString())
      << "per-token outputs differ";
  const double loss_a = a.summary.loss(), loss_b = b.summary.loss();
  EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof(double)), 0) << loss_a << " vs " << loss_b;
  EXPECT_EQ(a.summary.counted_tokens(), b.summary.counted_tokens());
  EXPECT_EQ(a.summary.correct_tokens(), b.summary.correct_tokens());
}

// Sets the bool field `name` of an OutputSelection, by the name the contract gives it.
void SelectOutput(v1::OutputSelection& outputs, const std::string& name) {
  const google::protobuf::FieldDescriptor* field = outputs.GetDescriptor()->FindFieldByName(name);
  ASSERT_NE(field, nullptr) << name;
  outputs.GetReflection()->SetBool(&outputs, field, true);
}

// A call on fp32 rows [labels.size(), hidden.size() / labels.size()]; the request views both
// vectors, which must outlive it.
ComputeRequest Fp32Request(const std::string& head, const std::vector<float>& hidden,
                           const std::vector<int64_t>& labels) {
  ComputeRequest request;
  request.head = head;
  const int64_t rows = static_cast<int64_t>(labels.size());
  request.hidden = {hidden.data(), client::DType::kFloat32, rows,
                    rows == 0 ? 0 : static_cast<int64_t>(hidden.size()) / rows};
  request.labels = labels;
  return request;
}

class ClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // About 80 rows of this head per engine chunk: a few-hundred-row batch runs as several.
    server_ = StartTestServer(MultiChunkDemoConfig(kHead, kVocab, kHidden, 11)).release();
    ASSERT_NE(server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { rng_.seed(FreshSeed()); }

  static ChannelOptions OptionsFor(int port) {
    ChannelOptions options;
    options.address = "127.0.0.1:" + std::to_string(port);
    // A hang is a failure here, not a stuck test run.
    options.deadline = absl::Seconds(20);
    return options;
  }
  static Client Connect(ChannelOptions options) {
    absl::StatusOr<Client> client = Client::Connect(std::move(options));
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(client).value();
  }
  // A fresh head of random W with this test's name, so tests do not share gradients or versions.
  std::vector<float> UploadRandomHead(const Client& client, const std::string& head,
                                      int64_t vocab = kVocab) {
    std::vector<float> weight =
        RandomNormal(vocab * kHidden, 1.0f / std::sqrt(static_cast<float>(kHidden)), rng_);
    absl::StatusOr<client::HeadInfo> info =
        client.UploadHead(head, {weight.data(), client::DType::kFloat32, vocab, kHidden});
    EXPECT_TRUE(info.ok()) << info.status();
    return weight;
  }

  static server::LossServer* server_;
  std::mt19937_64 rng_;
};

server::LossServer* ClientTest::server_ = nullptr;

TEST_F(ClientTest, ComputeMatchesFloat64Reference) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(client, "reference");
  const int64_t n = 300;
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  // Every third row labelled with its float64 argmax, so that `correct` has ones to report (the
  // argmax does not depend on the labels).
  const ReferenceResult unlabelled =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 5));
  for (int64_t i = 0; i < n; i += 3) labels[i] = unlabelled.argmax[i];
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 5));

  ComputeRequest request = Fp32Request("reference", hidden, labels);
  request.shared_memory = false;  // rows in messages, whose chunking this test checks too
  request.rows_per_message = 37;  // many chunk messages that do not line up with engine chunks
  for (const char* output : {"token_loss", "logprob", "lse", "entropy", "argmax", "correct",
                             "grad_hidden", "accumulate_grad_weight"}) {
    SelectOutput(request.outputs, output);
  }
  request.outputs.set_top_k(5);
  const absl::StatusOr<ComputeResult> result = client.Compute(request);
  ASSERT_TRUE(result.ok()) << result.status();

  EXPECT_EQ(result->messages_sent, 1 + (n + 36) / 37);
  EXPECT_GT(result->messages_received, 2);
  EXPECT_TRUE(result->summary.grad_weight_accumulated());
  EXPECT_EQ(result->summary.counted_tokens(), ref.counted_tokens);
  EXPECT_LE(std::abs(result->summary.loss() - ref.loss) / ref.loss, kLossBound);
  const v1::ComputeResult& per_token = result->per_token;
  EXPECT_EQ(per_token.row_offset(), 0);
  EXPECT_EQ(per_token.num_rows(), n);
  EXPECT_LE(TokenLossError(Values(per_token.token_loss()), ref), kLossBound);
  EXPECT_LE(MaxAbsError(Values(per_token.logprob()), ref.logprob), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(MaxAbsError(Values(per_token.lse()), ref.lse), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(MaxAbsError(Values(per_token.entropy()), ref.entropy), 1e-4);
  // The float64 argmax, except where the two best logits are closer than fp32 can tell apart
  // (random inputs make such a near tie now and then).
  // A row is correct where it counts and that argmax is its label.
  ASSERT_EQ(per_token.argmax_size(), n);
  ASSERT_EQ(per_token.correct_size(), n);
  int64_t correct_rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(per_token.correct(i), labels[i] != -100 && per_token.argmax(i) == labels[i] ? 1 : 0)
        << "row " << i;
    correct_rows += per_token.correct(i);
    if (per_token.argmax(i) == ref.argmax[i]) continue;
    const double gap = ref.top_k_logprob[i * 5] - ref.top_k_logprob[i * 5 + 1];
    EXPECT_LE(gap, 1e-5 * (1 + ref.max_abs_logit))
        << "row " << i << ": argmax " << per_token.argmax(i) << ", float64 " << ref.argmax[i];
  }
  EXPECT_EQ(correct_rows, result->summary.correct_tokens());
  EXPECT_GE(correct_rows, n / 4);  // the labelled third but for near ties and ignored rows
  ASSERT_EQ(per_token.top_k_logprob_size(), n * 5);
  ASSERT_EQ(per_token.top_k_token_size(), n * 5);
  EXPECT_LE(MaxAbsError(Values(per_token.top_k_logprob()), ref.top_k_logprob),
            1e-5 * (1 + ref.max_abs_logit));
  // Outputs not asked for stay empty.
  EXPECT_EQ(per_token.ratio_size() + per_token.kl_size() + per_token.kd_size(), 0);
  EXPECT_EQ(result->grad_hidden.rows, n);
  EXPECT_EQ(result->grad_hidden.cols, kHidden);
  EXPECT_EQ(result->grad_hidden.head_version, result->summary.head_version());
  EXPECT_LE(RelativeError(client::ToFloat32(result->grad_hidden), ref.grad_hidden), kGradBound);

  const absl::StatusOr<client::Tensor> grad = client.FetchGradWeight("reference");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->accumulated_tokens, ref.counted_tokens);
  EXPECT_LE(RelativeError(client::ToFloat32(*grad), ref.grad_weight), kGradBound);
}

// shift_labels and sequence_lengths reach the server: a shifted call gives exactly the bits of a
// call on labels shifted by hand; an unset soft cap is the head's (none here), 0 the same.
TEST_F(ClientTest, ShiftedLabelsAndTheHeadsSoftCapReachTheServer) {
  const Client client = Connect(OptionsFor(server_->port()));
  UploadRandomHead(client, "shifted");
  const int64_t n = 200;
  const std::vector<int64_t> lengths = {60, 1, 139};
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  std::vector<int64_t> by_hand(n);
  for (int64_t first = 0; const int64_t length : lengths) {
    for (int64_t i = first; i < first + length; ++i) {
      by_hand[i] = i + 1 < first + length ? labels[i + 1] : -100;
    }
    first += length;
  }
  ComputeRequest shifted = Fp32Request("shifted", hidden, labels);
  shifted.shift_labels = true;
  shifted.sequence_lengths = lengths;
  shifted.outputs.set_token_loss(true);
  shifted.outputs.set_grad_hidden(true);
  ComputeRequest reference = Fp32Request("shifted", hidden, by_hand);
  reference.outputs = shifted.outputs;
  reference.options.set_logit_softcap(0.0);
  const absl::StatusOr<ComputeResult> a = client.Compute(shifted);
  const absl::StatusOr<ComputeResult> b = client.Compute(reference);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSameResults(*a, *b);
  EXPECT_EQ(client::ToFloat32(a->grad_hidden), client::ToFloat32(b->grad_hidden));
}

// A rollout correction reaches the server through the C++ client, with verl's weights (computed
// here from their definition): a call with the engine's log-probabilities gives exactly the bits
// of the same call whose advantages the test multiplied by rho_i = min(exp(q_i - mu_i), C), summed
// or averaged over each sequence for the sequence levels.
TEST_F(ClientTest, RolloutCorrectionWeightsEachTokensPolicyTermByTheTruncatedRatio) {
  const Client client = Connect(OptionsFor(server_->port()));
  UploadRandomHead(client, "rollout");
  const int64_t n = 150;
  const std::vector<int64_t> lengths = {40, 1, 70, 39};
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  const std::vector<float> q = RandomNormal(n, 1.0f, rng_);
  std::vector<float> sampling(n), mu(n), advantages = RandomNormal(n, 1.0f, rng_);
  const std::vector<float> noise = RandomNormal(n, 0.3f, rng_);
  const int64_t last_sequence = n - lengths.back();
  for (int64_t i = 0; i < n; ++i) {
    sampling[i] = q[i] - 6.0f;
    // The first sequence's engine far below the old policy: its weights meet the cap at every
    // level; the last's far above: they stay under it at every level, so that some weights are
    // truncated and some not whatever the noise (a sequence's sum of log-ratios spreads with its
    // length); the middle two's near 1.
    mu[i] = sampling[i] + noise[i] - (i < lengths[0] ? 0.5f : 0.0f) +
            (i >= last_sequence ? 0.5f : 0.0f);
  }
  const double cap = 1.3;
  for (const auto correction : {v1::ROLLOUT_CORRECTION_TOKEN, v1::ROLLOUT_CORRECTION_SEQUENCE,
                                v1::ROLLOUT_CORRECTION_GEOMETRIC}) {
    SCOPED_TRACE(v1::RolloutCorrection_Name(correction));
    std::vector<double> log_rho(n, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      if (labels[i] != -100) log_rho[i] = static_cast<double>(sampling[i]) - mu[i];
    }
    if (correction != v1::ROLLOUT_CORRECTION_TOKEN) {
      for (int64_t first = 0; const int64_t length : lengths) {
        double sum = 0.0;
        int64_t kept = 0;
        for (int64_t i = first; i < first + length; ++i) {
          sum += log_rho[i];
          kept += labels[i] != -100;
        }
        const double geometric = sum / std::max<int64_t>(kept, 1);
        for (int64_t i = first; i < first + length; ++i) {
          log_rho[i] = correction == v1::ROLLOUT_CORRECTION_SEQUENCE ? sum : geometric;
        }
        first += length;
      }
    }
    std::vector<float> weighted(n);
    double rho_sum = 0.0;
    int64_t counted = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double rho = std::min(std::exp(log_rho[i]), cap);
      weighted[i] = labels[i] != -100 ? static_cast<float>(rho * advantages[i]) : advantages[i];
      if (labels[i] != -100) {
        rho_sum += rho;
        ++counted;
      }
    }
    ComputeRequest corrected = Fp32Request("rollout", hidden, labels);
    corrected.options.set_objective(v1::OBJECTIVE_PPO);
    corrected.options.set_reduction(v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN);
    corrected.sequence_lengths = lengths;
    corrected.sampling_logprobs = sampling;
    corrected.advantages = advantages;
    corrected.outputs.set_token_loss(true);
    corrected.outputs.set_grad_hidden(true);
    ComputeRequest by_hand = corrected;
    corrected.rollout_logprobs = mu;
    corrected.options.mutable_policy()->set_rollout_correction(correction);
    corrected.options.mutable_policy()->set_rollout_is_cap(cap);
    by_hand.advantages = weighted;
    const absl::StatusOr<ComputeResult> a = client.Compute(corrected);
    const absl::StatusOr<ComputeResult> b = client.Compute(by_hand);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ExpectSameResults(*a, *b);
    EXPECT_EQ(client::ToFloat32(a->grad_hidden), client::ToFloat32(b->grad_hidden));
    EXPECT_NEAR(a->summary.mean_rollout_is_weight(), rho_sum / counted, 1e-12);
    EXPECT_GT(a->summary.rollout_is_truncated_fraction(), 0.0);
    EXPECT_LT(a->summary.rollout_is_truncated_fraction(), 1.0);
  }
}

TEST_F(ClientTest, BatchLargerThanTheMessageLimitStreamsBothWaysAtOnce) {
  // Both ends limited to 1 MiB messages; 16 MiB of hidden rows go out and 16 MiB of dL/dh come
  // back. Results stream back while rows are still being sent; a client that sent everything before
  // reading would stall once the flow-control windows on both sides filled up.
  server::ServerConfig config;
  config.demo = {"wide", 64, 512, 3};
  config.max_message_bytes = 1 << 20;
  // Engine chunks of about a thousand rows, so that the server answers early rows before it has
  // read the later ones.
  config.workspace_budget_bytes = 1 << 20;
  std::unique_ptr<server::LossServer> small_messages = StartTestServer(config);
  ASSERT_NE(small_messages, nullptr);
  ChannelOptions options = OptionsFor(small_messages->port());
  options.max_message_bytes = 1 << 20;
  const Client client = Connect(options);
  const absl::StatusOr<client::Tensor> weight = client.FetchWeight("wide");
  ASSERT_TRUE(weight.ok()) << weight.status();

  const int64_t n = 8192, hidden_size = 512;
  const std::vector<float> hidden = RandomNormal(n * hidden_size, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, 64, 0.0, rng_);
  ComputeRequest request = Fp32Request("wide", hidden, labels);
  request.outputs.set_grad_hidden(true);
  request.outputs.set_token_loss(true);
  request.shared_memory = false;  // the messages are what this test is about
  const absl::StatusOr<ComputeResult> result = client.Compute(request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GE(result->messages_sent, 1 + 16);  // no message above 1 MiB
  EXPECT_GE(result->messages_received, 16);
  EXPECT_GE(result->bytes_sent, n * hidden_size * 4);

  const ReferenceResult ref = ComputeReference(
      MakeReferenceProblem(hidden, client::ToFloat32(*weight), labels, hidden_size, 0));
  EXPECT_LE(std::abs(result->summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(TokenLossError(Values(result->per_token.token_loss()), ref), kLossBound);
  EXPECT_LE(RelativeError(client::ToFloat32(result->grad_hidden), ref.grad_hidden), kGradBound);

  // An error in the first rows ends the call while most rows are still unsent: the writer must
  // notice and stop rather than block, and the server's status must come through.
  std::vector<float> poisoned = hidden;
  poisoned[0] = std::numeric_limits<float>::quiet_NaN();
  request.hidden.data = poisoned.data();
  const absl::StatusOr<ComputeResult> failed = client.Compute(request);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(failed.status().message().find("non-finite"), absl::string_view::npos)
      << failed.status();
}

TEST_F(ClientTest, ErrorsKeepTheServersCodeAndMessage) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> hidden = RandomNormal(4 * 8, 1.0f, rng_);
  const std::vector<int64_t> labels = {1, 2, 3, 4};
  ComputeRequest request = Fp32Request(kHead, hidden, labels);
  absl::StatusOr<ComputeResult> result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result.status().message(), "hidden_size: expected 48 (head 'client'), got 8");

  request.head = "no-such-head";
  result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound) << result.status();
  EXPECT_NE(result.status().message().find("no-such-head"), absl::string_view::npos)
      << result.status();

  const std::vector<float> rows = RandomNormal(4 * kHidden, 1.0f, rng_);
  request.head = kHead;
  request.hidden = {rows.data(), client::DType::kFloat32, 4, kHidden};
  request.head_version = 12345;
  result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_NE(result.status().message().find("pinned to version 12345"), absl::string_view::npos)
      << result.status();
  // What the server says to code arrives typed: why, and which field.
  const std::optional<v1::ErrorInfo> moved = client::ErrorInfoOf(result.status());
  ASSERT_TRUE(moved.has_value()) << result.status();
  EXPECT_EQ(moved->reason(), v1::ErrorInfo::HEAD_MOVED);
  EXPECT_EQ(moved->field(), "head_version");
  EXPECT_EQ(FieldOf(result.status()), "head_version");
  EXPECT_FALSE(client::ErrorInfoOf(absl::NotFoundError("no details")).has_value());

  // Caught before anything is sent.
  request.head_version.reset();
  request.labels = absl::MakeConstSpan(labels).subspan(0, 3);
  result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result.status().message(), "labels: expected 4 entries (hidden.rows), got 3");

  EXPECT_EQ(client.GetHead("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client.Step({.head = kHead, .optimizer = client::SgdOptions{.learning_rate = -1.0}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.SaveCheckpoint().status().code(), absl::StatusCode::kFailedPrecondition);

  ChannelOptions unreachable = OptionsFor(1);  // nothing listens on port 1
  unreachable.deadline = absl::Seconds(5);
  EXPECT_EQ(Connect(unreachable).ListHeads().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientTest, BearerTokenIsSentOnEveryCall) {
  const std::filesystem::path token_file = std::filesystem::temp_directory_path() /
                                           ("lossd-client-token-" + std::to_string(FreshSeed()));
  std::ofstream(token_file) << "s3cret\n";
  server::ServerConfig config;
  config.demo = {"secured", 100, 16, 1};
  config.token_file = token_file.string();
  std::unique_ptr<server::LossServer> secured = StartTestServer(config);
  std::filesystem::remove(token_file);
  ASSERT_NE(secured, nullptr);

  ChannelOptions options = OptionsFor(secured->port());
  const absl::Status refused = Connect(options).ListHeads().status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  options.bearer_token = "s3cret";
  const Client client = Connect(options);
  EXPECT_TRUE(client.ListHeads().ok());
  const std::vector<float> hidden(16, 0.5f);
  const std::vector<int64_t> labels = {7};
  const absl::StatusOr<ComputeResult> result =
      client.Compute({.head = "secured",
                      .hidden = {hidden.data(), client::DType::kFloat32, 1, 16},
                      .labels = labels});
  EXPECT_TRUE(result.ok()) << result.status();
}

TEST_F(ClientTest, UploadAndFetchRoundTrip) {
  // 1 MiB messages: the fetch arrives in several chunks and the upload in several pieces.
  ChannelOptions options = OptionsFor(server_->port());
  options.max_message_bytes = 1 << 20;
  const Client client = Connect(options);
  const int64_t vocab = 7001;  // 7001 rows of 192 bytes: 1.3 MiB, not a whole number of chunks
  const std::vector<float> weight = UploadRandomHead(client, "roundtrip", vocab);

  const absl::StatusOr<client::Tensor> fetched = client.FetchWeight("roundtrip");
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->rows, vocab);
  EXPECT_EQ(fetched->cols, kHidden);
  EXPECT_EQ(fetched->dtype, client::DType::kFloat32);
  EXPECT_EQ(client::ToFloat32(*fetched), weight);

  // The server rounds to bfloat16 exactly as the client's own conversion does.
  const absl::StatusOr<client::Tensor> as_bf16 =
      client.FetchWeight("roundtrip", client::DType::kBFloat16);
  ASSERT_TRUE(as_bf16.ok()) << as_bf16.status();
  EXPECT_EQ(as_bf16->bytes, client::EncodeFromFloat32(weight, client::DType::kBFloat16));

  // Replacing needs `replace`; the bfloat16 upload is stored as float32 exactly.
  const std::string bf16 = client::EncodeFromFloat32(weight, client::DType::kBFloat16);
  const client::TensorView bf16_view{bf16.data(), client::DType::kBFloat16, vocab, kHidden};
  EXPECT_EQ(client.UploadHead("roundtrip", bf16_view).status().code(),
            absl::StatusCode::kAlreadyExists);
  const absl::StatusOr<client::HeadInfo> replaced =
      client.UploadHead("roundtrip", bf16_view, client::DType::kFloat32, /*replace=*/true);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_GT(replaced->version, fetched->head_version);
  const absl::StatusOr<client::Tensor> refetched = client.FetchWeight("roundtrip");
  ASSERT_TRUE(refetched.ok());
  EXPECT_EQ(client::ToFloat32(*refetched), client::DecodeToFloat32(bf16, client::DType::kBFloat16));

  const absl::StatusOr<client::HeadList> list = client.ListHeads();
  ASSERT_TRUE(list.ok());
  EXPECT_FALSE(list->backend.empty());
  EXPECT_TRUE(std::any_of(list->heads.begin(), list->heads.end(), [](const client::HeadInfo& h) {
    return h.name == "roundtrip" && h.vocab_size == 7001;
  }));
}

TEST_F(ClientTest, SgdStepMovesWeightAgainstTheGradient) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(client, "train");
  const int64_t n = 64;
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.0, rng_);
  ComputeRequest request = Fp32Request("train", hidden, labels);
  request.outputs.set_accumulate_grad_weight(true);
  const absl::StatusOr<ComputeResult> before = client.Compute(request);
  ASSERT_TRUE(before.ok()) << before.status();
  const absl::StatusOr<client::Tensor> grad = client.FetchGradWeight("train");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->accumulated_tokens, n);

  const absl::StatusOr<client::StepResult> step =
      client.Step({.head = "train",
                   .optimizer = client::SgdOptions{.learning_rate = 0.5},
                   .head_version = grad->head_version});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->head_version, grad->head_version + 1);
  EXPECT_EQ(step->accumulated_tokens, n);
  EXPECT_EQ(step->clip_multiplier, 1.0);
  const std::vector<float> g = client::ToFloat32(*grad);
  double norm = 0.0;
  for (float value : g) norm += static_cast<double>(value) * value;
  EXPECT_NEAR(step->grad_norm, std::sqrt(norm), 1e-5 * std::sqrt(norm));

  const absl::StatusOr<client::Tensor> stepped = client.FetchWeight("train");
  ASSERT_TRUE(stepped.ok());
  const std::vector<float> w = client::ToFloat32(*stepped);
  for (size_t i = 0; i < w.size(); ++i) ASSERT_NEAR(w[i], weight[i] - 0.5f * g[i], 1e-6f) << i;

  // The step zeroed the accumulator; the loss of the same batch went down.
  const absl::StatusOr<client::Tensor> zeroed = client.FetchGradWeight("train");
  ASSERT_TRUE(zeroed.ok());
  EXPECT_EQ(zeroed->accumulated_tokens, 0);
  request.outputs.set_accumulate_grad_weight(false);
  const absl::StatusOr<ComputeResult> after = client.Compute(request);
  ASSERT_TRUE(after.ok());
  EXPECT_LT(after->summary.loss(), before->summary.loss());
  EXPECT_EQ(after->summary.head_version(), step->head_version);
  const absl::StatusOr<uint64_t> version = client.ZeroGrad("train");
  ASSERT_TRUE(version.ok());
  EXPECT_EQ(*version, step->head_version);
}

// ---------------------------------------------------------------------------------------------
// Call ids and retries: a training call carries a fresh id, and a retry of it (by the client
// after UNAVAILABLE or DEADLINE_EXCEEDED, or by the caller with the same id) never adds its
// dL/dW twice.

TEST_F(ClientTest, TrainingCallsCarryAFreshIdAndARepeatedIdIsAReplay) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(client, "ids", 300);
  const std::vector<float> hidden = RandomNormal(40 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(40, 300, 0.0, rng_);
  ComputeRequest request = Fp32Request("ids", hidden, labels);
  for (const char* output : {"token_loss", "grad_hidden", "accumulate_grad_weight"}) {
    SelectOutput(request.outputs, output);
  }

  const absl::StatusOr<ComputeResult> first = client.Compute(request);
  const absl::StatusOr<ComputeResult> second = client.Compute(request);
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << " / " << second.status();
  EXPECT_EQ(first->call_id.size(), 32u);
  EXPECT_NE(first->call_id, second->call_id) << "each call gets its own id";
  EXPECT_FALSE(first->summary.replayed() || second->summary.replayed());
  EXPECT_EQ(first->attempts, 1);
  EXPECT_EQ(client.GetHead("ids")->accumulated_calls, 2) << "two calls, two ids, two commits";

  request.call_id = first->call_id;
  const absl::StatusOr<ComputeResult> repeat = client.Compute(request);
  ASSERT_TRUE(repeat.ok()) << repeat.status();
  EXPECT_TRUE(repeat->summary.replayed());
  EXPECT_TRUE(repeat->summary.grad_weight_accumulated());
  ExpectSameResults(*repeat, *first);
  EXPECT_EQ(repeat->grad_hidden.bytes, first->grad_hidden.bytes);
  EXPECT_EQ(client.GetHead("ids")->accumulated_calls, 2);

  // A scoring call carries no id: there is nothing to count twice.
  request.call_id.clear();
  request.outputs.set_accumulate_grad_weight(false);
  const absl::StatusOr<ComputeResult> scored = client.Compute(request);
  ASSERT_TRUE(scored.ok()) << scored.status();
  EXPECT_TRUE(scored->call_id.empty());
}

// The server commits a call and answers, the answer is held back until the client's deadline has
// passed: the client cannot tell whether the call took effect. Without retries the caller sees
// DEADLINE_EXCEEDED with the gradient already accumulated; with them the client sends the call
// again under its id and gets the results, and the accumulator still holds one copy.
TEST_F(ClientTest, ARetryAfterALostAnswerAccumulatesOnce) {
  const Client direct = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(direct, "lost_answer", 400);
  const int64_t n = 24;
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, 400, 0.0, rng_);
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 0));
  ComputeRequest request = Fp32Request("lost_answer", hidden, labels);
  for (const char* output : {"token_loss", "grad_hidden", "accumulate_grad_weight"}) {
    SelectOutput(request.outputs, output);
  }
  auto expect_one_copy = [&](const char* after) {
    const absl::StatusOr<client::Tensor> grad = direct.FetchGradWeight("lost_answer");
    ASSERT_TRUE(grad.ok()) << grad.status();
    EXPECT_LE(RelativeError(client::ToFloat32(*grad), ref.grad_weight), kGradBound) << after;
    EXPECT_EQ(direct.GetHead("lost_answer")->accumulated_calls, 1) << after;
  };

  const std::unique_ptr<HoldingRelay> relay = HoldingRelay::Start(server_->port());
  ASSERT_NE(relay, nullptr);
  // Breaks the relayed connection once the server has committed `calls` calls: the held answer is
  // lost for sure, however long the call took (a client deadline would race the call).
  auto drop_once_committed = [&](int64_t calls) {
    return std::thread([&, calls] {
      Eventually([&] { return direct.GetHead("lost_answer")->accumulated_calls >= calls; });
      relay->Drop();
    });
  };
  ChannelOptions options = OptionsFor(relay->port());
  options.deadline = absl::Minutes(10);  // a hang guard: the drop ends the call
  // Over gRPC through the relay: a first call would otherwise ask for the Compute socket through
  // it while it holds.
  options.compute_socket = false;
  // Rows in messages: a local target would otherwise ask for the shared-memory socket at the
  // first call, through the relay while it holds.
  request.shared_memory = false;
  options.compute_retry.max_attempts = 1;
  const Client once = Connect(options);
  ASSERT_TRUE(once.GetHead("lost_answer").ok());  // the connection is up before the hold
  relay->Hold();
  request.call_id = "lost-answer-1";
  std::thread dropper = drop_once_committed(1);
  const absl::StatusOr<ComputeResult> lost = once.Compute(request);
  dropper.join();
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
  expect_one_copy("the lost answer: the server committed the call");
  relay->Release();
  // The caller's own retry, with the same id.
  const absl::StatusOr<ComputeResult> by_hand = once.Compute(request);
  ASSERT_TRUE(by_hand.ok()) << by_hand.status();
  EXPECT_TRUE(by_hand->summary.replayed());
  expect_one_copy("a repeat by hand");

  // The same with the client's retries, from a fresh accumulator and a fresh id.
  ASSERT_TRUE(direct.ZeroGrad("lost_answer").ok());
  options.compute_retry.max_attempts = 3;
  options.compute_retry.initial_backoff = absl::Milliseconds(20);
  std::vector<absl::Status> failures;
  options.compute_retry.on_retry = [&](const absl::Status& failure, int, absl::Duration) {
    failures.push_back(failure);
    relay->Release();
  };
  const Client retrying = Connect(options);
  ASSERT_TRUE(retrying.GetHead("lost_answer").ok());
  relay->Hold();
  request.call_id.clear();
  dropper = drop_once_committed(1);
  const absl::StatusOr<ComputeResult> retried = retrying.Compute(request);
  dropper.join();
  ASSERT_TRUE(retried.ok()) << retried.status();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].code(), absl::StatusCode::kUnavailable) << failures[0];
  EXPECT_EQ(retried->attempts, 2);
  EXPECT_TRUE(retried->summary.replayed());
  EXPECT_LE(std::abs(retried->summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(client::ToFloat32(retried->grad_hidden), ref.grad_hidden), kGradBound);
  expect_one_copy("the client's retry");
}

// A lone caller keeps to the client's one connection; scoring calls in flight at once each take
// another, up to compute_connections, and each gets its own rows' results. Training calls in
// flight at once share one connection, which reaches one server.
TEST_F(ClientTest, ConcurrentScoringCallsTakeConnectionsOfTheirOwn) {
  const Client direct = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(direct, "spread", 300);
  struct Batch {
    std::vector<float> hidden;
    std::vector<int64_t> labels;
    ReferenceResult ref;
  };
  std::vector<Batch> batches(4);
  for (size_t i = 0; i < batches.size(); ++i) {
    const int64_t n = 20 + 7 * static_cast<int64_t>(i);
    batches[i].hidden = RandomNormal(n * kHidden, 1.0f, rng_);
    batches[i].labels = RandomLabels(n, 300, 0.0, rng_);
    batches[i].ref = ComputeReference(
        MakeReferenceProblem(batches[i].hidden, weight, batches[i].labels, kHidden, 0));
  }
  const auto request_for = [](const Batch& batch) {
    ComputeRequest request = Fp32Request("spread", batch.hidden, batch.labels);
    request.shared_memory = false;  // the rows in messages, over the connections counted
    SelectOutput(request.outputs, "grad_hidden");
    return request;
  };

  const std::unique_ptr<HoldingRelay> relay = HoldingRelay::Start(server_->port());
  ASSERT_NE(relay, nullptr);
  ChannelOptions options = OptionsFor(relay->port());
  options.deadline = absl::Minutes(10);  // a hang guard
  options.compute_connections = 3;
  // gRPC's connections are what is counted: no call asks for a Compute socket (through the relay,
  // while it holds everything, that question would wait too).
  options.compute_socket = false;
  const Client client = Connect(options);
  ASSERT_TRUE(client.GetHead("spread").ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(client.Compute(request_for(batches[0])).ok());
  EXPECT_EQ(relay->connections(), 1) << "one caller at a time needs no connection more";

  relay->Hold();  // no call ends until the release: each new one finds the others in flight
  std::vector<absl::StatusOr<ComputeResult>> results(batches.size(),
                                                     absl::UnknownError("not called"));
  std::vector<std::thread> callers;
  for (size_t i = 0; i < batches.size(); ++i) {
    callers.emplace_back([&, i] { results[i] = client.Compute(request_for(batches[i])); });
  }
  Eventually([&] { return relay->connections() >= 3; });
  relay->Release();
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(relay->connections(), 3) << "four calls, three connections at most";
  for (size_t i = 0; i < batches.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_LE(std::abs(results[i]->summary.loss() - batches[i].ref.loss) / batches[i].ref.loss,
              kLossBound);
    EXPECT_LE(RelativeError(client::ToFloat32(results[i]->grad_hidden), batches[i].ref.grad_hidden),
              kGradBound);
  }

  // Three training calls at once from a fresh client: the server commits all three (their answers
  // held) over the one connection of its training channel (which gRPC may share with the first).
  const Client trainer = Connect(options);
  ASSERT_TRUE(trainer.GetHead("spread").ok());
  const int connections_before = relay->connections();
  relay->Hold();
  callers.clear();
  for (size_t i = 0; i < 3; ++i) {
    callers.emplace_back([&, i] {
      ComputeRequest request = request_for(batches[i]);
      request.outputs.set_accumulate_grad_weight(true);
      results[i] = trainer.Compute(request);
    });
  }
  EXPECT_TRUE(Eventually([&] { return direct.GetHead("spread")->accumulated_calls == 3; }));
  EXPECT_LE(relay->connections(), connections_before + 1) << "one connection for training";
  relay->Release();
  for (std::thread& caller : callers) caller.join();
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(results[i].ok()) << results[i].status();
}

// A server that is not there yet is UNAVAILABLE; the client retries until it answers.
TEST_F(ClientTest, UnavailableIsRetriedWithBackoff) {
  const Client direct = Connect(OptionsFor(server_->port()));
  UploadRandomHead(direct, "unavailable", 300);
  const std::vector<float> hidden = RandomNormal(8 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(8, 300, 0.0, rng_);
  ComputeRequest request = Fp32Request("unavailable", hidden, labels);
  request.outputs.set_accumulate_grad_weight(true);

  // A port nobody listens on: every attempt fails at once.
  std::unique_ptr<HoldingRelay> closed = HoldingRelay::Start(server_->port());
  ASSERT_NE(closed, nullptr);
  const int dead_port = closed->port();
  closed.reset();
  ChannelOptions options = OptionsFor(dead_port);
  options.compute_retry.max_attempts = 3;
  options.compute_retry.initial_backoff = absl::Milliseconds(10);
  std::vector<absl::Duration> waits;
  options.compute_retry.on_retry = [&](const absl::Status& failure, int attempt,
                                       absl::Duration wait) {
    EXPECT_EQ(failure.code(), absl::StatusCode::kUnavailable) << failure;
    EXPECT_EQ(attempt, static_cast<int>(waits.size()) + 1);
    waits.push_back(wait);
  };
  const absl::StatusOr<ComputeResult> result = Connect(options).Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  ASSERT_EQ(waits.size(), 2u) << "three attempts, two waits";
  EXPECT_GE(waits[0], absl::Milliseconds(5));
  EXPECT_LE(waits[0], absl::Milliseconds(10));
  EXPECT_GE(waits[1], absl::Milliseconds(10));
  EXPECT_LE(waits[1], absl::Milliseconds(20));
  EXPECT_EQ(direct.GetHead("unavailable")->accumulated_calls, 0);
}

// ---------------------------------------------------------------------------------------------
// Objectives, their terms and distillation through the client, against the float64 reference.
// The options travel as the contract's own LossOptions; the reference gets the same options
// through the server's conversion of them.

constexpr int64_t kTeacherHidden = 32;
constexpr int kTeacherTopK = 8;
// KD and CE per token, absolute, at logits of a few units (as distill_server_test.cc).
constexpr double kTermBound = 2e-4;

enum class Teacher { kNone, kDense, kSparse };

struct ObjectiveCase {
  const char* name;
  int64_t rows = 300;  // about 80 rows per engine chunk (40 with a dense teacher): several chunks
  double ignore_fraction = 0.1;
  void (*options)(v1::LossOptions&) = nullptr;
  Teacher teacher = Teacher::kNone;
  bool no_labels = false;
  bool token_weights = false;
  bool shift_labels = false;
  int64_t max_sequence_length =
      0;  // > 0: the rows are sequences (the sequence reductions make some)
};

void PrintTo(const ObjectiveCase& c, std::ostream* os) { *os << c.name; }

void SetPolicy(v1::LossOptions& o, v1::Objective objective, v1::Reduction reduction) {
  o.set_objective(objective);
  o.set_reduction(reduction);
  o.mutable_policy()->set_clip_low(0.2);
  o.mutable_policy()->set_clip_high(0.28);
}

void SetDistill(v1::LossOptions& o, double beta, double alpha, double tau) {
  o.set_objective(v1::OBJECTIVE_DISTILL);
  o.mutable_distill()->set_beta(beta);
  o.mutable_distill()->set_alpha(alpha);
  o.mutable_distill()->set_temperature(tau);
}

bool IsPolicy(v1::Objective objective) {
  return objective == v1::OBJECTIVE_IMPORTANCE_SAMPLING || objective == v1::OBJECTIVE_PPO ||
         objective == v1::OBJECTIVE_CISPO || objective == v1::OBJECTIVE_GSPO;
}

const ObjectiveCase kObjectiveCases[] = {
    {.name = "importance_sampling_weighted_mean",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_IMPORTANCE_SAMPLING, v1::REDUCTION_MEAN);
         },
     .token_weights = true},
    // Ratios past 3 with negative advantages meet the dual-clip bound.
    {.name = "ppo_dual_clip_sum",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_PPO, v1::REDUCTION_SUM);
           o.mutable_policy()->set_dual_clip(3.0);
         }},
    {.name = "ppo_k3_entropy_sequence_mean_token_mean",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_PPO, v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN);
           o.mutable_policy()->set_kl_estimator(v1::KL_ESTIMATOR_K3);
           o.mutable_policy()->set_kl_coef(0.05);
           o.mutable_policy()->set_entropy_coef(0.01);
         }},
    // MiniMax-M1's setting: the weight is clipped from above only.
    {.name = "cispo_sequence_mean_token_sum",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_CISPO, v1::REDUCTION_SEQUENCE_MEAN_TOKEN_SUM);
           o.mutable_policy()->set_clip_low(1.0);
         }},
    // Each sequence's ratio measured in a first pass, then ppo's; sequences cross the engine's
    // chunks and the messages.
    {.name = "gspo_sequence_mean_token_mean",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_GSPO, v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN);
         }},
    {.name = "logprob_gradient_sum",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_LOGPROB_GRADIENT, v1::REDUCTION_SUM);
         }},
    // Tinker's DRO as Tinker reduces it: summed.
    {.name = "dro_sum",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_DRO, v1::REDUCTION_SUM);
           o.mutable_policy()->set_dro_beta(0.3);
         },
     .token_weights = true},
    {.name = "sapo_sequence_mean_token_mean",
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_SAPO, v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN);
           o.mutable_policy()->set_sapo_tau_positive(0.7);
           o.mutable_policy()->set_sapo_tau_negative(1.3);
         }},
    // The KL and entropy terms on cross-entropy, with label smoothing.
    {.name = "cross_entropy_k2_entropy",
     .options =
         [](v1::LossOptions& o) {
           o.set_label_smoothing(0.05);
           o.mutable_policy()->set_kl_estimator(v1::KL_ESTIMATOR_K2);
           o.mutable_policy()->set_kl_coef(0.1);
           o.mutable_policy()->set_entropy_coef(0.02);
         }},
    {.name = "ppo_k1_one_row",
     .rows = 1,
     .ignore_fraction = 0.0,
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_PPO, v1::REDUCTION_MEAN);
           o.mutable_policy()->set_kl_estimator(v1::KL_ESTIMATOR_K1);
           o.mutable_policy()->set_kl_coef(0.1);
         }},
    // Nothing counts: loss 0, every gradient 0, statistics 0.
    {.name = "ppo_all_ignored",
     .ignore_fraction = 1.0,
     .options =
         [](v1::LossOptions& o) {
           SetPolicy(o, v1::OBJECTIVE_PPO, v1::REDUCTION_MEAN);
           o.mutable_policy()->set_kl_estimator(v1::KL_ESTIMATOR_K3);
         }},
    // Labels sent as the model's input ids, shifted by the server within each sequence.
    {.name = "ppo_shift_labels",
     .options = [](v1::LossOptions& o) { SetPolicy(o, v1::OBJECTIVE_PPO, v1::REDUCTION_MEAN); },
     .shift_labels = true,
     .max_sequence_length = 40},
    {.name = "dense_forward_kl_with_labels",
     .options = [](v1::LossOptions& o) { SetDistill(o, 0.0, 0.3, 2.0); },
     .teacher = Teacher::kDense},
    {.name = "dense_jsd_without_labels",
     .options = [](v1::LossOptions& o) { SetDistill(o, 0.5, 0.0, 1.0); },
     .teacher = Teacher::kDense,
     .no_labels = true},
    // Soft caps and temperatures on both heads.
    {.name = "dense_reverse_kl_sum_capped",
     .options =
         [](v1::LossOptions& o) {
           SetDistill(o, 1.0, 0.5, 1.5);
           o.set_reduction(v1::REDUCTION_SUM);
           o.set_logit_softcap(30.0);
           o.set_temperature(1.2);
           o.mutable_distill()->set_teacher_logit_softcap(20.0);
           o.mutable_distill()->set_teacher_temperature(0.8);
         },
     .teacher = Teacher::kDense},
    {.name = "dense_one_row",
     .rows = 1,
     .ignore_fraction = 0.0,
     .options = [](v1::LossOptions& o) { SetDistill(o, 0.5, 0.5, 1.0); },
     .teacher = Teacher::kDense},
    {.name = "sparse_forward_kl_without_labels",
     .options = [](v1::LossOptions& o) { SetDistill(o, 0.0, 0.0, 1.0); },
     .teacher = Teacher::kSparse,
     .no_labels = true},
    // The reverse KL needs the mass outside the top-k spread, not dropped.
    {.name = "sparse_reverse_kl_spread_with_labels",
     .options =
         [](v1::LossOptions& o) {
           SetDistill(o, 1.0, 0.4, 2.0);
           o.mutable_distill()->set_sparse_teacher_mass(v1::SPARSE_TEACHER_SPREAD);
         },
     .teacher = Teacher::kSparse},
    {.name = "sparse_jsd_with_labels",
     .options = [](v1::LossOptions& o) { SetDistill(o, 0.5, 0.2, 1.0); },
     .teacher = Teacher::kSparse},
};

class ClientObjectiveTest : public ClientTest,
                            public ::testing::WithParamInterface<ObjectiveCase> {};

// Labels that the server's shift turns into `targets`: row i of each sequence is scored against
// label i + 1, so label i + 1 is target i; the sequence's first label is never scored, and its last
// target becomes ignore_index, as the server ignores that row.
std::vector<int64_t> UnshiftedLabels(std::vector<int64_t>& targets,
                                     const std::vector<int64_t>& lengths) {
  std::vector<int64_t> labels(targets.size(), 0);
  for (int64_t first = 0; const int64_t length : lengths) {
    for (int64_t i = first; i + 1 < first + length; ++i) labels[i + 1] = targets[i];
    targets[first + length - 1] = -100;
    first += length;
  }
  return labels;
}

TEST_P(ClientObjectiveTest, MatchesTheFloat64Reference) {
  const ObjectiveCase& c = GetParam();
  const Client client = Connect(OptionsFor(server_->port()));
  v1::LossOptions options;
  c.options(options);
  const absl::StatusOr<LossOptions> engine_options = server::FromProto(options);
  ASSERT_TRUE(engine_options.ok()) << engine_options.status();

  ProblemSpec spec;
  spec.num_tokens = c.rows;
  spec.hidden_size = kHidden;
  spec.vocab_size = kVocab;
  spec.options = *engine_options;
  spec.ignore_fraction = c.ignore_fraction;
  spec.token_weights = c.token_weights;
  spec.ratio_targets = kRatioTargets;
  spec.max_sequence_length = c.max_sequence_length;
  spec.teacher_hidden_size = kTeacherHidden;
  spec.teacher_top_k = c.teacher == Teacher::kSparse ? kTeacherTopK : 0;
  spec.no_labels = c.no_labels;
  Problem problem = MakeProblem(spec, rng_);
  ReferenceProblem& r = problem.reference;
  r.sequence_ratio = options.objective() == v1::OBJECTIVE_GSPO;
  std::vector<int64_t> labels = r.labels;
  if (c.shift_labels) labels = UnshiftedLabels(r.labels, r.sequence_lengths);
  const ReferenceResult ref = ComputeReference(r);

  const std::string head = absl::StrCat("objective-", c.name);
  ASSERT_TRUE(
      client
          .UploadHead(head, {problem.weight_bytes.data(), client::DType::kFloat32, kVocab, kHidden})
          .ok());
  ComputeRequest request;
  request.head = head;
  request.options = options;
  request.hidden = {problem.hidden_bytes.data(), client::DType::kFloat32, c.rows, kHidden};
  request.labels = labels;
  request.token_weights = problem.token_weights;
  request.sampling_logprobs = problem.sampling_logprobs;
  request.advantages = problem.advantages;
  request.reference_logprobs = problem.reference_logprobs;
  request.logprob_grads = problem.logprob_grads;
  request.sequence_lengths = r.sequence_lengths;
  request.shift_labels = c.shift_labels;
  request.shared_memory = false;
  request.rows_per_message = 37;  // messages that do not line up with engine chunks
  if (c.teacher == Teacher::kDense) {
    request.teacher_head = head + "-teacher";
    ASSERT_TRUE(
        client
            .UploadHead(request.teacher_head, {problem.teacher_weight_bytes.data(),
                                               client::DType::kFloat32, kVocab, kTeacherHidden})
            .ok());
    request.teacher_hidden = {problem.teacher_hidden_bytes.data(), client::DType::kFloat32, c.rows,
                              kTeacherHidden};
  } else if (c.teacher == Teacher::kSparse) {
    request.teacher_top_k = kTeacherTopK;
    request.teacher_top_k_tokens = problem.teacher_top_k_tokens;
    request.teacher_top_k_logprobs = problem.teacher_top_k_logprobs;
  }
  const bool policy = IsPolicy(options.objective());
  const bool kl = options.policy().kl_estimator() != v1::KL_ESTIMATOR_NONE;
  const bool distill = options.objective() == v1::OBJECTIVE_DISTILL;
  request.outputs.set_token_loss(true);
  request.outputs.set_logprob(true);
  request.outputs.set_ratio(policy);
  request.outputs.set_clip(policy);
  request.outputs.set_kl(kl);
  request.outputs.set_kd(distill);
  request.outputs.set_ce(distill);
  request.outputs.set_grad_hidden(true);
  request.outputs.set_accumulate_grad_weight(true);
  const absl::StatusOr<ComputeResult> result = client.Compute(request);
  ASSERT_TRUE(result.ok()) << result.status();
  const v1::ComputeSummary& s = result->summary;
  const v1::ComputeResult& t = result->per_token;

  const int64_t counted = ref.counted_tokens;
  EXPECT_EQ(s.counted_tokens(), counted);
  if (counted == 0) {
    EXPECT_EQ(s.loss(), 0.0);
  } else {
    EXPECT_LE(LossError(s.loss(), ref), distill ? 1e-5 : kPolicyLossBound)
        << s.loss() << " vs " << ref.loss;
  }
  EXPECT_LE(TokenLossError(Values(t.token_loss()), ref), kPolicyLossBound);
  const double logit_bound = 1e-5 * (1 + ref.max_abs_logit);
  EXPECT_LE(MaxAbsError(Values(t.logprob()), ref.logprob), logit_bound);
  ASSERT_EQ(t.ratio_size(), policy ? c.rows : 0);
  if (policy) {
    // kRatioTargets keep every ratio 1% from a bound, so the clip states are exact.
    EXPECT_LE(RelativeError(Values(t.ratio()), ref.ratio), logit_bound);
    EXPECT_EQ(std::vector<int32_t>(t.clip().begin(), t.clip().end()), ref.clip);
    EXPECT_EQ(s.clipped_tokens(), ref.clipped_tokens);
    EXPECT_DOUBLE_EQ(s.clip_fraction(),
                     counted > 0 ? static_cast<double>(ref.clipped_tokens) / counted : 0.0);
  }
  ASSERT_EQ(t.kl_size(), kl ? c.rows : 0);
  if (kl) {
    // The estimates carry logp's error times |dKL/dlogp|, at most about 5 here.
    EXPECT_LE(MaxAbsError(Values(t.kl()), ref.kl), 5 * logit_bound);
    EXPECT_NEAR(s.mean_kl(), counted > 0 ? ref.kl_sum / counted : 0.0, 5 * logit_bound);
  }
  ASSERT_EQ(t.kd_size(), distill ? c.rows : 0);
  ASSERT_EQ(t.ce_size(), distill ? c.rows : 0);
  if (distill) {
    EXPECT_LE(MaxAbsError(Values(t.kd()), ref.kd), kTermBound);
    EXPECT_LE(MaxAbsError(Values(t.ce()), ref.ce), kTermBound);
    EXPECT_NEAR(s.mean_kd(), ref.kd_sum / counted, kTermBound);
    EXPECT_NEAR(s.mean_ce(), ref.ce_sum / counted, kTermBound);
    EXPECT_EQ(s.teacher_head_version() > 0, c.teacher == Teacher::kDense);
  }
  // A row whose ppo term and KL penalty nearly cancel has a gradient small against their errors.
  const double grad_bound = kGradBound * GradientCancellation(ref);
  EXPECT_LE(RelativeError(client::ToFloat32(result->grad_hidden), ref.grad_hidden), grad_bound);
  const absl::StatusOr<client::Tensor> grad = client.FetchGradWeight(head);
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_LE(RelativeError(client::ToFloat32(*grad), ref.grad_weight), grad_bound);
}

INSTANTIATE_TEST_SUITE_P(Cases, ClientObjectiveTest, ::testing::ValuesIn(kObjectiveCases),
                         [](const ::testing::TestParamInfo<ObjectiveCase>& info) {
                           return std::string(info.param.name);
                         });

// Sizes are checked before anything is sent, naming the field and what it expected.
TEST_F(ClientTest, RequestSizesAreCheckedNamingTheField) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> hidden = RandomNormal(4 * kHidden, 1.0f, rng_);
  const std::vector<float> teacher_rows = RandomNormal(4 * 8, 1.0f, rng_);
  const std::vector<int64_t> labels = {1, 2, 3, 4};
  const std::vector<float> three(3, 0.0f), eight(8, -1.0f);
  const std::vector<int32_t> tokens(8, 1);
  struct Case {
    const char* reason;
    std::function<void(ComputeRequest&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"a per-token input of another length",
       [&](ComputeRequest& r) { r.sampling_logprobs = three; },
       "sampling_logprobs: expected 0 or 4 entries (hidden.rows), got 3"},
      {"labels left out where the objective reads them", [&](ComputeRequest& r) { r.labels = {}; },
       "labels: expected 4 entries (hidden.rows), got 0"},
      {"labels left out of distill with alpha > 0",
       [&](ComputeRequest& r) {
         SetDistill(r.options, 0.0, 0.5, 1.0);
         r.labels = absl::MakeConstSpan(labels).subspan(0, 2);
       },
       "labels: expected 4 entries (hidden.rows), got 2"},
      {"distill with alpha 0 takes all labels or none",
       [&](ComputeRequest& r) {
         SetDistill(r.options, 0.0, 0.0, 1.0);
         r.labels = absl::MakeConstSpan(labels).subspan(0, 2);
       },
       "labels: expected 4 entries (hidden.rows), or none, got 2"},
      {"teacher rows for other positions",
       [&](ComputeRequest& r) {
         r.teacher_head = kHead;
         r.teacher_hidden = {teacher_rows.data(), client::DType::kFloat32, 2, 16};
       },
       "teacher_hidden.rows: expected 4 (hidden.rows), got 2"},
      {"teacher rows without a teacher head",
       [&](ComputeRequest& r) {
         r.teacher_hidden = {teacher_rows.data(), client::DType::kFloat32, 4, 8};
       },
       "teacher_hidden: expected no rows without a teacher_head, got 4 rows"},
      {"two teachers",
       [&](ComputeRequest& r) {
         r.teacher_head = kHead;
         r.teacher_top_k = 2;
       },
       "teacher_head/teacher_top_k: expected one teacher, got both"},
      {"a sparse teacher short of a row",
       [&](ComputeRequest& r) {
         r.teacher_top_k = 3;
         r.teacher_top_k_tokens = tokens;
         r.teacher_top_k_logprobs = eight;
       },
       "teacher_top_k_tokens: expected 12 entries (hidden.rows x teacher_top_k, 4 x 3), got 8"},
      {"a sparse teacher without k",
       [&](ComputeRequest& r) {
         r.teacher_top_k_tokens = tokens;
         r.teacher_top_k_logprobs = eight;
       },
       "teacher_top_k: expected k >= 1 beside teacher_top_k_tokens/logprobs, got 0"},
      {"teacher rows cannot travel through shared memory",
       [&](ComputeRequest& r) {
         r.teacher_head = kHead;
         r.teacher_hidden = {teacher_rows.data(), client::DType::kFloat32, 4, 8};
         r.shared_memory = true;
       },
       "shared_memory: expected false for a call with a teacher, whose rows travel in messages, "
       "got true"},
      {"more top-k than the client sizes for", [&](ComputeRequest& r) { r.outputs.set_top_k(65); },
       "outputs.top_k: expected a value in [0, 64], got 65"},
      {"a dtype the contract does not have",
       [&](ComputeRequest& r) { r.outputs.set_grad_hidden_dtype(static_cast<v1::DType>(9)); },
       "outputs.grad_hidden_dtype: expected a lossd.v1.DType, got 9"},
  };
  for (const Case& c : cases) {
    ComputeRequest request = Fp32Request(kHead, hidden, labels);
    c.change(request);
    const absl::StatusOr<ComputeResult> result = client.Compute(request);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << c.reason;
    EXPECT_EQ(result.status().message(), c.message) << c.reason;
  }
}

// ---------------------------------------------------------------------------------------------
// Training RPCs: staged gradients, collective steps, the norm, master weights.

// A call stages its dL/dW; a commit adds it times a scale, once however often it is repeated;
// a discarded one can no longer be committed.
TEST_F(ClientTest, AStagedGradientIsCommittedOnceTimesItsScale) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(client, "staged");
  const int64_t n = 200;
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 0));
  ComputeRequest request = Fp32Request("staged", hidden, labels);
  request.outputs.set_accumulate_grad_weight(true);
  request.stage_grad_weight = true;
  const absl::StatusOr<ComputeResult> staged = client.Compute(request);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(staged->summary.grad_weight_staged());
  EXPECT_FALSE(staged->summary.grad_weight_accumulated());
  absl::StatusOr<client::HeadInfo> info = client.GetHead("staged");
  EXPECT_EQ(info->staged_gradients, 1);
  EXPECT_EQ(info->accumulated_calls, 0);

  constexpr double kScale = 0.25;
  absl::StatusOr<client::CommitResult> commit =
      client.CommitGradWeight("staged", staged->call_id, kScale);
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_FALSE(commit->replayed);
  EXPECT_EQ(commit->accumulated_tokens, ref.counted_tokens);
  commit = client.CommitGradWeight("staged", staged->call_id, kScale);
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_TRUE(commit->replayed) << "a repeated commit adds nothing again";
  std::vector<double> scaled = ref.grad_weight;
  for (double& g : scaled) g *= kScale;
  const absl::StatusOr<client::Tensor> grad = client.FetchGradWeight("staged");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_LE(RelativeError(client::ToFloat32(*grad), scaled), kGradBound);
  EXPECT_EQ(grad->accumulated_tokens, ref.counted_tokens);

  const absl::StatusOr<ComputeResult> dropped = client.Compute(request);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  const std::vector<std::string> ids = {dropped->call_id, "never-staged"};
  const absl::StatusOr<int> discarded = client.DiscardGradWeight("staged", ids);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(*discarded, 1);
  EXPECT_EQ(client.CommitGradWeight("staged", dropped->call_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client.CommitGradWeight("staged", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.GetHead("staged")->staged_gradients, 0);
}

// The server commits, the answer is lost: the client sends the commit again, and the server
// answers it as the first without adding the gradient twice.
TEST_F(ClientTest, ACommitIsRetriedAfterALostAnswer) {
  const Client direct = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(direct, "lost_commit", 400);
  const std::vector<float> hidden = RandomNormal(30 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(30, 400, 0.0, rng_);
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 0));
  ComputeRequest request = Fp32Request("lost_commit", hidden, labels);
  request.outputs.set_accumulate_grad_weight(true);
  request.stage_grad_weight = true;
  const absl::StatusOr<ComputeResult> staged = direct.Compute(request);
  ASSERT_TRUE(staged.ok()) << staged.status();

  const std::unique_ptr<HoldingRelay> relay = HoldingRelay::Start(server_->port());
  ASSERT_NE(relay, nullptr);
  ChannelOptions options = OptionsFor(relay->port());
  options.deadline = absl::Seconds(1);
  options.compute_retry.max_attempts = 3;
  options.compute_retry.initial_backoff = absl::Milliseconds(20);
  std::vector<absl::Status> failures;
  options.compute_retry.on_retry = [&](const absl::Status& failure, int, absl::Duration) {
    failures.push_back(failure);
    relay->Release();
  };
  const Client retrying = Connect(options);
  ASSERT_TRUE(retrying.GetHead("lost_commit").ok());  // the connection is up before the hold
  relay->Hold();
  const absl::StatusOr<client::CommitResult> commit =
      retrying.CommitGradWeight("lost_commit", staged->call_id, 2.0);
  ASSERT_TRUE(commit.ok()) << commit.status();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].code(), absl::StatusCode::kDeadlineExceeded) << failures[0];
  EXPECT_TRUE(commit->replayed);
  std::vector<double> doubled = ref.grad_weight;
  for (double& g : doubled) g *= 2.0;
  const absl::StatusOr<client::Tensor> grad = direct.FetchGradWeight("lost_commit");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_LE(RelativeError(client::ToFloat32(*grad), doubled), kGradBound);
}

// Two ranks, each a thread with a client of its own, train on halves of one batch: the norm and
// the step meet once both have called, both get the same answer, and W moves by the whole batch's
// gradient times the multiplier.
TEST_F(ClientTest, RanksStepTogether) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = UploadRandomHead(client, "ranks");
  const uint64_t version = client.GetHead("ranks")->version;
  const int64_t n = 240;
  const std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 0));
  constexpr double kMultiplier = 0.5, kLearningRate = 0.5;

  std::vector<absl::StatusOr<client::GradNormResult>> norms(2, absl::UnknownError("not run"));
  std::vector<absl::StatusOr<client::StepResult>> steps(2, absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      const Client own = Connect(OptionsFor(server_->port()));
      const int64_t first = rank * n / 2;
      ComputeRequest request;
      request.head = "ranks";
      request.hidden = {hidden.data() + first * kHidden, client::DType::kFloat32, n / 2, kHidden};
      request.labels = absl::MakeConstSpan(labels).subspan(first, n / 2);
      // The mean over the whole batch: each rank's share of it.
      request.options.set_mean_denominator(static_cast<double>(ref.counted_tokens));
      request.outputs.set_accumulate_grad_weight(true);
      const absl::StatusOr<ComputeResult> computed = own.Compute(request);
      if (!computed.ok()) {
        norms[rank] = computed.status();
        return;
      }
      const client::RankGroup group{.world_size = 2, .rank = rank};
      norms[rank] = own.GradWeightNorm({.head = "ranks",
                                        .head_version = version,
                                        .ranks = group,
                                        .grad_multiplier = kMultiplier});
      steps[rank] = own.Step({.head = "ranks",
                              .optimizer = client::SgdOptions{.learning_rate = kLearningRate},
                              .head_version = version,
                              .ranks = group,
                              .grad_multiplier = kMultiplier});
    });
  }
  for (std::thread& rank : ranks) rank.join();
  double norm = 0.0;
  for (double g : ref.grad_weight) norm += g * g;
  norm = kMultiplier * std::sqrt(norm);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(norms[rank].ok()) << rank << ": " << norms[rank].status();
    ASSERT_TRUE(steps[rank].ok()) << rank << ": " << steps[rank].status();
    EXPECT_NEAR(norms[rank]->grad_norm, norm, 1e-5 * norm);
    EXPECT_EQ(norms[rank]->accumulated_calls, 2);
    EXPECT_EQ(steps[rank]->head_version, version + 1) << "one step, however many ranks";
    EXPECT_EQ(steps[rank]->grad_norm, steps[0]->grad_norm);
    EXPECT_FALSE(steps[rank]->skipped);
  }
  const absl::StatusOr<client::Tensor> stepped = client.FetchWeight("ranks");
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  std::vector<double> expected(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) {
    expected[i] = weight[i] - kLearningRate * kMultiplier * ref.grad_weight[i];
  }
  EXPECT_LE(RelativeError(client::ToFloat32(*stepped), expected), 1e-6);

  // A rank outside the group is refused before it waits on the server; so is a collective call
  // that names no step.
  EXPECT_EQ(
      client.Step({.head = "ranks", .ranks = {.world_size = 2, .rank = 2}}).status().message(),
      "ranks.rank: expected a rank in [0, 2), got 2");
  EXPECT_EQ(
      client.GradWeightNorm({.head = "ranks", .ranks = {.world_size = 2, .rank = 0}})
          .status()
          .message(),
      "head_version: expected the version the ranks trained on (ranks.world_size > 1), got none");
}

// A multiplier that takes the gradient past float32 skips the step instead of failing it; a
// 16-bit head that steps trains from fp32 master weights, which FetchWeight reads on request.
TEST_F(ClientTest, SkippedStepsAndMasterWeights) {
  const Client client = Connect(OptionsFor(server_->port()));
  const std::vector<float> weight = RandomNormal(300 * kHidden, 0.2f, rng_);
  ASSERT_TRUE(client
                  .UploadHead("master", {weight.data(), client::DType::kFloat32, 300, kHidden},
                              client::DType::kBFloat16)
                  .ok());
  const std::vector<float> hidden = RandomNormal(50 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(50, 300, 0.0, rng_);
  ComputeRequest request = Fp32Request("master", hidden, labels);
  request.outputs.set_accumulate_grad_weight(true);
  request.options.set_grad_scale(1e3);  // a norm far above 1, which 3e38 takes past float32
  ASSERT_TRUE(client.Compute(request).ok());
  const uint64_t version = client.GetHead("master")->version;
  const absl::StatusOr<client::StepResult> skipped =
      client.Step({.head = "master",
                   .optimizer = client::SgdOptions{.learning_rate = 0.1},
                   .keep_grad = true,
                   .grad_multiplier = 3e38,
                   .skip_nonfinite = true});
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->skipped) << "grad norm " << skipped->grad_norm;
  EXPECT_EQ(skipped->head_version, version);
  EXPECT_FALSE(client.GetHead("master")->master_weights) << "nothing stepped yet";

  const absl::StatusOr<client::StepResult> step =
      client.Step({.head = "master",
                   .optimizer = client::SgdOptions{.learning_rate = 0.1},
                   .grad_multiplier = 1e-3});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_FALSE(step->skipped);
  EXPECT_EQ(step->head_version, version + 1);
  EXPECT_TRUE(client.GetHead("master")->master_weights);
  const absl::StatusOr<client::Tensor> master =
      client.FetchWeight("master", client::DType::kFloat32, true);
  const absl::StatusOr<client::Tensor> rounded =
      client.FetchWeight("master", client::DType::kBFloat16);
  ASSERT_TRUE(master.ok() && rounded.ok()) << master.status() << " / " << rounded.status();
  // W is the master weights rounded, and the master weights keep what rounding dropped.
  EXPECT_EQ(client::EncodeFromFloat32(client::ToFloat32(*master), client::DType::kBFloat16),
            rounded->bytes);
  EXPECT_NE(client::ToFloat32(*master), client::ToFloat32(*rounded));
}

// ---------------------------------------------------------------------------------------------
// Per-token results, put together by the contract's rule rather than field by field.

// A distinct value per (field, position), in the field's own type, and read back as a double.
void AddValue(google::protobuf::Message& message, const google::protobuf::FieldDescriptor* field,
              int64_t value) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection& r = *message.GetReflection();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      r.AddInt32(&message, field, static_cast<int32_t>(value));
      break;
    case FieldDescriptor::CPPTYPE_INT64: r.AddInt64(&message, field, value); break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r.AddUInt32(&message, field, static_cast<uint32_t>(value));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      r.AddUInt64(&message, field, static_cast<uint64_t>(value));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r.AddFloat(&message, field, static_cast<float>(value));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r.AddDouble(&message, field, static_cast<double>(value));
      break;
    case FieldDescriptor::CPPTYPE_BOOL: r.AddBool(&message, field, value % 2 == 1); break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r.AddEnumValue(&message, field, static_cast<int>(value));
      break;
    case FieldDescriptor::CPPTYPE_STRING: r.AddString(&message, field, absl::StrCat(value)); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: FAIL() << field->full_name() << " holds messages";
  }
}

double GetValue(const google::protobuf::Message& message,
                const google::protobuf::FieldDescriptor* field, int index) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection& r = *message.GetReflection();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return r.GetRepeatedInt32(message, field, index);
    case FieldDescriptor::CPPTYPE_INT64:
      return static_cast<double>(r.GetRepeatedInt64(message, field, index));
    case FieldDescriptor::CPPTYPE_UINT32: return r.GetRepeatedUInt32(message, field, index);
    case FieldDescriptor::CPPTYPE_UINT64:
      return static_cast<double>(r.GetRepeatedUInt64(message, field, index));
    case FieldDescriptor::CPPTYPE_FLOAT: return r.GetRepeatedFloat(message, field, index);
    case FieldDescriptor::CPPTYPE_DOUBLE: return r.GetRepeatedDouble(message, field, index);
    case FieldDescriptor::CPPTYPE_BOOL: return r.GetRepeatedBool(message, field, index) ? 1 : 0;
    case FieldDescriptor::CPPTYPE_ENUM: return r.GetRepeatedEnumValue(message, field, index);
    case FieldDescriptor::CPPTYPE_STRING:
      return std::stod(r.GetRepeatedString(message, field, index));
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
  return std::nan("");
}

// Field f's value j of row `row`: rows, fields and positions all tell apart (and small enough
// for every type, floats included, to hold exactly).
int64_t Encoded(int field_number, int64_t row, int64_t j) {
  return field_number * 100000 + row * 100 + j;
}

// A result message for rows [offset, offset + count) that fills every field asked for.
std::unique_ptr<google::protobuf::Message> Piece(const google::protobuf::Message& prototype,
                                                 const std::vector<client::PerTokenField>& fields,
                                                 int64_t offset, int64_t count) {
  std::unique_ptr<google::protobuf::Message> piece(prototype.New());
  const google::protobuf::Descriptor& type = *piece->GetDescriptor();
  piece->GetReflection()->SetInt64(piece.get(), type.FindFieldByName("row_offset"), offset);
  piece->GetReflection()->SetInt64(piece.get(), type.FindFieldByName("num_rows"), count);
  for (const client::PerTokenField& f : fields) {
    for (int64_t row = offset; row < offset + count; ++row) {
      for (int64_t j = 0; j < f.values_per_row; ++j)
        AddValue(*piece, f.field, Encoded(f.field->number(), row, j));
    }
  }
  return piece;
}

// Every repeated field of `per_token` holds its rows in order, as Piece encoded them.
void ExpectRowsInOrder(const google::protobuf::Message& per_token,
                       const std::vector<client::PerTokenField>& fields, int64_t rows) {
  for (const client::PerTokenField& f : fields) {
    const int size = per_token.GetReflection()->FieldSize(per_token, f.field);
    ASSERT_EQ(size, rows * f.values_per_row) << f.field->name();
    for (int i = 0; i < size; ++i) {
      ASSERT_EQ(GetValue(per_token, f.field, i),
                Encoded(f.field->number(), i / f.values_per_row, i % f.values_per_row))
          << f.field->name() << "[" << i << "]";
    }
  }
}

// Every bool of an OutputSelection set, and top_k.
void SelectEverything(google::protobuf::Message& selection, int top_k) {
  const google::protobuf::Descriptor& type = *selection.GetDescriptor();
  for (int i = 0; i < type.field_count(); ++i) {
    if (type.field(i)->type() == google::protobuf::FieldDescriptor::TYPE_BOOL) {
      selection.GetReflection()->SetBool(&selection, type.field(i), true);
    }
  }
  selection.GetReflection()->SetInt32(&selection, type.FindFieldByName("top_k"), top_k);
}

// The rule covers every repeated field of the contract's ComputeResult: each has its
// OutputSelection bool, or follows top_k.
TEST(ClientPerTokenRuleTest, CoversEveryRepeatedFieldOfTheContract) {
  const google::protobuf::Descriptor& result = *v1::ComputeResult::descriptor();
  v1::OutputSelection everything;
  SelectEverything(everything, 3);
  const absl::StatusOr<std::vector<client::PerTokenField>> fields =
      client::PerTokenFields(everything, result);
  ASSERT_TRUE(fields.ok()) << fields.status();
  int repeated = 0;
  for (int i = 0; i < result.field_count(); ++i) repeated += result.field(i)->is_repeated();
  ASSERT_EQ(static_cast<int>(fields->size()), repeated);
  for (const client::PerTokenField& f : *fields) {
    EXPECT_EQ(f.values_per_row, f.matrix ? 3 : 1) << f.field->name();
    EXPECT_EQ(f.matrix, absl::StartsWith(f.field->name(), "top_k_")) << f.field->name();
  }
  const absl::StatusOr<std::vector<client::PerTokenField>> none =
      client::PerTokenFields(v1::OutputSelection(), result);
  ASSERT_TRUE(none.ok());
  for (const client::PerTokenField& f : *none) EXPECT_EQ(f.values_per_row, 0) << f.field->name();
}

// The server's side of the same rule: the engine produces exactly the one-value outputs the
// contract names (LOSSD_TOKEN_OUTPUTS against ComputeResult's repeated fields that are not
// top_k_*), so that no output can be asked for that nothing fills.
TEST(ClientPerTokenRuleTest, TheEngineProducesEveryOneValueOutputOfTheContract) {
  std::vector<std::string> engine;
#define LOSSD_OUTPUT_NAME(type, name) engine.push_back(#name);
  LOSSD_TOKEN_OUTPUTS(LOSSD_OUTPUT_NAME)
#undef LOSSD_OUTPUT_NAME
  std::vector<std::string> contract;
  const google::protobuf::Descriptor& result = *v1::ComputeResult::descriptor();
  for (int i = 0; i < result.field_count(); ++i) {
    const google::protobuf::FieldDescriptor& field = *result.field(i);
    if (field.is_repeated() && !absl::StartsWith(field.name(), "top_k_")) {
      contract.push_back(field.name());
    }
  }
  std::sort(engine.begin(), engine.end());
  std::sort(contract.begin(), contract.end());
  EXPECT_EQ(engine, contract);
}

TEST(ClientPerTokenAssemblerTest, PlacesEveryFieldInRowOrderFromMessagesInAnyOrder) {
  v1::OutputSelection everything;
  SelectEverything(everything, 2);
  v1::ComputeResult per_token;
  absl::StatusOr<client::PerTokenAssembler> assembler =
      client::PerTokenAssembler::Create(everything, 10, &per_token);
  ASSERT_TRUE(assembler.ok()) << assembler.status();
  // Out of order, with an empty message: rows wait until the gap before them is filled.
  for (const auto& [offset, count] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 3}, {3, 4}, {5, 0}, {0, 3}}) {
    std::unique_ptr<google::protobuf::Message> piece =
        Piece(v1::ComputeResult::default_instance(), assembler->fields(), offset, count);
    ASSERT_TRUE(assembler->Add(*piece).ok());
  }
  ASSERT_TRUE(assembler->Finish().ok());
  EXPECT_EQ(per_token.row_offset(), 0);
  EXPECT_EQ(per_token.num_rows(), 10);
  ExpectRowsInOrder(per_token, assembler->fields(), 10);
}

using google::protobuf::DescriptorProto;
using google::protobuf::FieldDescriptorProto;

void AddField(DescriptorProto& message, const std::string& name, int number,
              FieldDescriptorProto::Type type, FieldDescriptorProto::Label label) {
  FieldDescriptorProto& field = *message.add_field();
  field.set_name(name);
  field.set_number(number);
  field.set_type(type);
  field.set_label(label);
}

// The contract's file, its messages changed by `grow` (given each message), built into a pool of
// its own.
const google::protobuf::FileDescriptor* GrownContract(
    google::protobuf::DescriptorPool& pool, const std::function<void(DescriptorProto&)>& grow) {
  // The files the contract imports (google/protobuf/any.proto) first.
  const google::protobuf::FileDescriptor* contract = v1::ComputeResult::descriptor()->file();
  for (int i = 0; i < contract->dependency_count(); ++i) {
    google::protobuf::FileDescriptorProto dependency;
    contract->dependency(i)->CopyTo(&dependency);
    if (pool.BuildFile(dependency) == nullptr) return nullptr;
  }
  google::protobuf::FileDescriptorProto file;
  contract->CopyTo(&file);
  for (DescriptorProto& message : *file.mutable_message_type()) grow(message);
  return pool.BuildFile(file);
}

// The contract grows a per-token output (a field of ComputeResult and its OutputSelection bool)
// and a top_k_* field: a client built from it assembles and checks both with no code of its own.
// Here the grown contract is built at run time, and the messages are dynamic ones of it.
TEST(ClientPerTokenAssemblerTest, AssemblesAnOutputTheClientHasNeverHeardOf) {
  google::protobuf::DescriptorPool pool;
  const google::protobuf::FileDescriptor* grown = GrownContract(pool, [](DescriptorProto& message) {
    if (message.name() == "OutputSelection") {
      AddField(message, "novel_score", 90, FieldDescriptorProto::TYPE_BOOL,
               FieldDescriptorProto::LABEL_OPTIONAL);
    }
    if (message.name() == "ComputeResult") {
      AddField(message, "novel_score", 90, FieldDescriptorProto::TYPE_DOUBLE,
               FieldDescriptorProto::LABEL_REPEATED);
      AddField(message, "top_k_novel_rank", 91, FieldDescriptorProto::TYPE_INT64,
               FieldDescriptorProto::LABEL_REPEATED);
    }
  });
  ASSERT_NE(grown, nullptr);
  google::protobuf::DynamicMessageFactory factory(&pool);
  const google::protobuf::Message& result_type =
      *factory.GetPrototype(grown->FindMessageTypeByName("ComputeResult"));
  std::unique_ptr<google::protobuf::Message> selection(
      factory.GetPrototype(grown->FindMessageTypeByName("OutputSelection"))->New());
  const google::protobuf::Descriptor& selection_type = *selection->GetDescriptor();
  selection->GetReflection()->SetBool(selection.get(),
                                      selection_type.FindFieldByName("novel_score"), true);
  selection->GetReflection()->SetBool(selection.get(), selection_type.FindFieldByName("logprob"),
                                      true);
  selection->GetReflection()->SetInt32(selection.get(), selection_type.FindFieldByName("top_k"), 2);

  std::unique_ptr<google::protobuf::Message> per_token(result_type.New());
  absl::StatusOr<client::PerTokenAssembler> assembler =
      client::PerTokenAssembler::Create(*selection, 6, per_token.get());
  ASSERT_TRUE(assembler.ok()) << assembler.status();
  std::vector<std::string> wanted;
  for (const client::PerTokenField& f : assembler->fields()) {
    if (f.values_per_row > 0)
      wanted.push_back(absl::StrCat(f.field->name(), " x", f.values_per_row));
  }
  EXPECT_EQ(wanted, (std::vector<std::string>{"logprob x1", "top_k_logprob x2", "top_k_token x2",
                                              "novel_score x1", "top_k_novel_rank x2"}));
  for (const auto& [offset, count] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {0, 4}}) {
    ASSERT_TRUE(assembler->Add(*Piece(result_type, assembler->fields(), offset, count)).ok());
  }
  ASSERT_TRUE(assembler->Finish().ok());
  ExpectRowsInOrder(*per_token, assembler->fields(), 6);

  // And checks it: a message short of one novel_score is the server's fault.
  std::unique_ptr<google::protobuf::Message> again(result_type.New());
  assembler = client::PerTokenAssembler::Create(*selection, 6, again.get());
  ASSERT_TRUE(assembler.ok());
  std::unique_ptr<google::protobuf::Message> short_piece =
      Piece(result_type, assembler->fields(), 0, 6);
  short_piece->GetReflection()->RemoveLast(
      short_piece.get(), short_piece->GetDescriptor()->FindFieldByName("novel_score"));
  const absl::Status refused = assembler->Add(*short_piece);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused.message(), "server sent 5 values of novel_score for 6 rows, expected 6");
}

// A repeated field no OutputSelection field speaks for breaks the rule: the client says so
// rather than guess how many values it carries.
TEST(ClientPerTokenAssemblerTest, RefusesAContractThatBreaksTheRule) {
  google::protobuf::DescriptorPool pool;
  const google::protobuf::FileDescriptor* grown = GrownContract(pool, [](DescriptorProto& message) {
    if (message.name() == "ComputeResult") {
      AddField(message, "orphan", 92, FieldDescriptorProto::TYPE_FLOAT,
               FieldDescriptorProto::LABEL_REPEATED);
    }
  });
  ASSERT_NE(grown, nullptr);
  const absl::StatusOr<std::vector<client::PerTokenField>> fields =
      client::PerTokenFields(v1::OutputSelection(), *grown->FindMessageTypeByName("ComputeResult"));
  EXPECT_EQ(fields.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(absl::StrContains(fields.status().message(), "lossd.v1.ComputeResult.orphan"))
      << fields.status();
}

// What a server that breaks the contract sends is refused, never placed.
TEST(ClientPerTokenAssemblerTest, RefusesResultsThatBreakTheContract) {
  v1::OutputSelection selection;
  selection.set_logprob(true);
  selection.set_top_k(2);
  struct Case {
    const char* reason;
    std::function<void(v1::ComputeResult&)> spoil;  // applied to the message of rows [2, 5)
    std::string message;                            // of Add, or of Finish when Add passes
  };
  const std::vector<Case> cases = {
      {"a value short", [](v1::ComputeResult& r) { r.mutable_logprob()->RemoveLast(); },
       "server sent 2 values of logprob for 3 rows, expected 3"},
      {"one value per row of a top_k field",
       [](v1::ComputeResult& r) { r.mutable_top_k_token()->Truncate(3); },
       "server sent 3 values of top_k_token for 3 rows, expected 6"},
      {"an output not asked for", [](v1::ComputeResult& r) { r.add_entropy(1.0f); },
       "server sent 1 values of entropy for 3 rows, expected 0"},
      {"rows past the end", [](v1::ComputeResult& r) { r.set_row_offset(4); },
       "server sent rows [4, 7) of a 5-row result"},
      {"a negative offset", [](v1::ComputeResult& r) { r.set_row_offset(-1); },
       "server sent rows [-1, 2) of a 5-row result"},
      {"a row twice", [](v1::ComputeResult& r) { r.set_row_offset(1); }, "server sent row 1 twice"},
      {"a row missing",
       [](v1::ComputeResult& r) {
         r.set_num_rows(2);
         r.mutable_logprob()->RemoveLast();
         r.mutable_top_k_logprob()->Truncate(4);
         r.mutable_top_k_token()->Truncate(4);
       },
       "server sent results for 4 of 5 rows"},
  };
  for (const Case& c : cases) {
    v1::ComputeResult per_token;
    absl::StatusOr<client::PerTokenAssembler> assembler =
        client::PerTokenAssembler::Create(selection, 5, &per_token);
    ASSERT_TRUE(assembler.ok());
    std::unique_ptr<google::protobuf::Message> first =
        Piece(v1::ComputeResult::default_instance(), assembler->fields(), 0, 2);
    ASSERT_TRUE(assembler->Add(*first).ok()) << c.reason;
    std::unique_ptr<google::protobuf::Message> rest =
        Piece(v1::ComputeResult::default_instance(), assembler->fields(), 2, 3);
    c.spoil(static_cast<v1::ComputeResult&>(*rest));
    absl::Status status = assembler->Add(*rest);
    if (status.ok()) status = assembler->Finish();
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << c.reason;
    EXPECT_EQ(status.message(), c.message) << c.reason;
  }
}

// ---------------------------------------------------------------------------------------------
// Rows and dL/dh through shared memory (ComputeStart.shared_memory).

struct SharedMemoryCase {
  const char* name;
  int64_t rows;
  client::DType hidden_dtype;
  std::optional<client::DType> grad_dtype;
  double ignore_fraction;
  bool rows_in_region = false;  // the rows lie in a SharedRegion, 64 bytes from its start
  int64_t rows_per_piece = 0;   // > 0: copied after the start, announced piece by piece
};

// Whether this process (the test server's side included) maps a memfd named `name` read-only.
bool MapsMemfdReadOnly(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, absl::StrCat("/memfd:", name, " ")) &&
        absl::StrContains(line, " r--s ")) {
      return true;
    }
  }
  return false;
}

void PrintTo(const SharedMemoryCase& c, std::ostream* os) { *os << c.name; }

// A call's loss, its accumulated dL/dW and (when float32) its dL/dh against the float64 reference
// of its rows, with top-3 outputs.
void ExpectMatchesTheReference(const ComputeResult& result, const client::Tensor& grad_weight,
                               const client::Tensor& grad_hidden, const client::Tensor& hidden,
                               const std::vector<float>& weight,
                               const std::vector<int64_t>& labels) {
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(client::ToFloat32(hidden), weight, labels, kHidden, 3));
  EXPECT_EQ(result.summary.counted_tokens(), ref.counted_tokens);
  if (ref.counted_tokens == 0) return;
  EXPECT_LE(std::abs(result.summary.loss() - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(client::ToFloat32(grad_weight), ref.grad_weight), kGradBound);
  if (grad_hidden.dtype == client::DType::kFloat32) {
    EXPECT_LE(RelativeError(client::ToFloat32(grad_hidden), ref.grad_hidden), kGradBound);
  }
}

class SharedMemoryTest : public ClientTest,
                         public ::testing::WithParamInterface<SharedMemoryCase> {};

// The same call through messages and through shared memory, on two heads with the same W: every
// output and the accumulated dL/dW agree bit for bit, and with the float64 reference.
TEST_P(SharedMemoryTest, MatchesMessagesBitwiseAndTheReference) {
  const SharedMemoryCase& c = GetParam();
  const Client client = Connect(OptionsFor(server_->port()));
  const std::string by_messages = absl::StrCat("messages-", c.name);
  const std::string by_memory = absl::StrCat("memory-", c.name);
  const std::vector<float> weight = UploadRandomHead(client, by_messages);
  ASSERT_TRUE(
      client.UploadHead(by_memory, {weight.data(), client::DType::kFloat32, kVocab, kHidden}).ok());
  const std::string hidden_bytes =
      client::EncodeFromFloat32(RandomNormal(c.rows * kHidden, 1.0f, rng_), c.hidden_dtype);
  const std::vector<int64_t> labels = RandomLabels(c.rows, kVocab, c.ignore_fraction, rng_);

  ComputeRequest request;
  request.hidden = {hidden_bytes.data(), c.hidden_dtype, c.rows, kHidden};
  std::optional<client::SharedRegion> region;
  if (c.rows_in_region) {
    constexpr uint64_t kRowsOffset = 64;
    absl::StatusOr<client::SharedRegion> created =
        client.NewSharedRegion(kRowsOffset + hidden_bytes.size());
    ASSERT_TRUE(created.ok()) << created.status();
    region = *std::move(created);
    std::memcpy(region->data() + kRowsOffset, hidden_bytes.data(), hidden_bytes.size());
    request.hidden.data = region->data() + kRowsOffset;
  }
  request.labels = labels;
  for (const char* output : {"token_loss", "logprob", "lse", "entropy", "argmax", "grad_hidden",
                             "accumulate_grad_weight"}) {
    SelectOutput(request.outputs, output);
  }
  request.outputs.set_top_k(3);
  if (c.grad_dtype.has_value())
    request.outputs.set_grad_hidden_dtype(client::ToProto(*c.grad_dtype));
  request.head = by_messages;
  request.shared_memory = false;
  const absl::StatusOr<ComputeResult> sent = client.Compute(request);
  ASSERT_TRUE(sent.ok()) << sent.status();
  request.head = by_memory;
  request.shared_memory = true;
  request.shared_rows_per_piece = c.rows_per_piece;
  // Rows in a region: dL/dh left in shared memory too, nothing copied.
  request.lend_grad_hidden = c.rows_in_region;
  const absl::StatusOr<ComputeResult> shared = client.Compute(request);
  ASSERT_TRUE(shared.ok()) << shared.status();
  if (c.rows_in_region) {
    // The server read the rows in the region itself: no copy went through a pooled memfd.
    EXPECT_TRUE(MapsMemfdReadOnly("lossd-region"));
    EXPECT_TRUE(std::memcmp(region->data() + 64, hidden_bytes.data(), hidden_bytes.size()) == 0)
        << "the rows changed";
  }

  ExpectSameResults(*shared, *sent);
  EXPECT_EQ(shared->per_token.top_k_token_size(), c.rows * 3);
  EXPECT_EQ(shared->grad_hidden.dtype, sent->grad_hidden.dtype);
  EXPECT_EQ(shared->grad_hidden.rows, c.rows);
  client::Tensor shared_grad_hidden = shared->grad_hidden;
  if (c.rows_in_region && c.rows > 0) {
    ASSERT_NE(shared->grad_hidden_shared, nullptr) << "dL/dh was not lent";
    EXPECT_TRUE(shared->grad_hidden.bytes.empty());
    shared_grad_hidden.bytes.assign(reinterpret_cast<const char*>(shared->grad_hidden_shared.get()),
                                    sent->grad_hidden.bytes.size());
  }
  EXPECT_TRUE(shared_grad_hidden.bytes == sent->grad_hidden.bytes) << "dL/dh differs";
  // Only the start message goes out (and with rows that follow it, one announcement a piece); dL/dh
  // does not come back in messages.
  const int64_t pieces = c.rows_per_piece > 0 && c.rows_per_piece < c.rows
                             ? (c.rows + c.rows_per_piece - 1) / c.rows_per_piece
                             : 0;
  EXPECT_EQ(shared->messages_sent, 1 + pieces);
  if (c.rows > 0) {
    EXPECT_LT(shared->bytes_received, sent->bytes_received);
  }
  const absl::StatusOr<client::Tensor> grad_sent = client.FetchGradWeight(by_messages);
  const absl::StatusOr<client::Tensor> grad_shared = client.FetchGradWeight(by_memory);
  ASSERT_TRUE(grad_sent.ok() && grad_shared.ok());
  EXPECT_TRUE(grad_shared->bytes == grad_sent->bytes) << "dL/dW differs";

  ExpectMatchesTheReference(*shared, *grad_shared, shared_grad_hidden,
                            {hidden_bytes, c.hidden_dtype, c.rows, kHidden}, weight, labels);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SharedMemoryTest,
    ::testing::Values(
        // About 80 rows per engine chunk: each chunk reads and writes its own slice of the memfd.
        SharedMemoryCase{"fp32_multi_chunk", 300, client::DType::kFloat32, std::nullopt, 0.1},
        // Rows and dL/dh of different sizes, so the two regions are laid out unequally.
        SharedMemoryCase{"bf16_rows_fp32_grad", 300, client::DType::kBFloat16,
                         client::DType::kFloat32, 0.1},
        SharedMemoryCase{"one_row", 1, client::DType::kFloat32, std::nullopt, 0.0},
        // Nothing counts: dL/dh is all zeros, still written into the memfd.
        SharedMemoryCase{"all_ignored", 50, client::DType::kFloat32, std::nullopt, 1.0},
        // Nothing to map at all.
        SharedMemoryCase{"no_rows", 0, client::DType::kFloat32, std::nullopt, 0.0},
        // Rows read where they lie, dL/dh in a memfd of its own (grad_hidden_handle).
        SharedMemoryCase{"fp32_rows_in_a_region", 300, client::DType::kFloat32, std::nullopt, 0.1,
                         true},
        SharedMemoryCase{"bf16_rows_in_a_region_fp32_grad", 300, client::DType::kBFloat16,
                         client::DType::kFloat32, 0.1, true},
        // Rows copied after the start in pieces of 37 and 128 rows (SharedMemory.rows_follow),
        // ending inside and across engine chunks.
        SharedMemoryCase{"fp32_rows_follow", 300, client::DType::kFloat32, std::nullopt, 0.1, false,
                         37},
        SharedMemoryCase{"bf16_rows_follow", 300, client::DType::kBFloat16, client::DType::kFloat32,
                         0.1, false, 128}),
    [](const ::testing::TestParamInfo<SharedMemoryCase>& info) {
      return std::string(info.param.name);
    });

// The Compute socket (ComputeSocket in lossd.proto): a server that offers it, the same calls over
// it and over gRPC.
class ComputeSocketTest : public ClientTest {
 protected:
  // Beside the suite's server, which offers no socket.
  static void SetUpTestSuite() {
    ClientTest::SetUpTestSuite();
    server::ServerConfig config = MultiChunkDemoConfig(kHead, kVocab, kHidden, 11);
    config.compute_socket_listen = "127.0.0.1:0";
    config.compute_socket_idle = absl::Seconds(1);
    config.shared_memory = false;
    socket_server_ = StartTestServer(config).release();
    ASSERT_NE(socket_server_, nullptr);
  }
  static void TearDownTestSuite() {
    delete socket_server_;
    socket_server_ = nullptr;
    ClientTest::TearDownTestSuite();
  }
  static ChannelOptions SocketOptions(std::optional<bool> use) {
    ChannelOptions options = OptionsFor(socket_server_->port());
    options.compute_socket = use;
    return options;
  }
  // A server of its own with a Compute socket on `listen`.
  static std::unique_ptr<server::LossServer> StartSocketServer(const std::string& listen,
                                                               int max_connections_per_host = 64) {
    server::ServerConfig config = MultiChunkDemoConfig(kHead, kVocab, kHidden, 11);
    config.compute_socket_listen = listen;
    config.compute_socket_max_connections_per_host = max_connections_per_host;
    config.shared_memory = false;
    return StartTestServer(config);
  }
  // A scoring call of `rows` random float32 rows on the demo head, with dL/dh; the request's views
  // point into the rest.
  struct DemoCall {
    std::string hidden_bytes;
    std::vector<int64_t> labels;
    ComputeRequest request;
  };
  std::unique_ptr<DemoCall> NewDemoCall(int64_t rows) {
    auto call = std::make_unique<DemoCall>();
    call->hidden_bytes = client::EncodeFromFloat32(RandomNormal(rows * kHidden, 1.0f, rng_),
                                                   client::DType::kFloat32);
    call->labels = RandomLabels(rows, kVocab, 0.0, rng_);
    call->request.head = kHead;
    call->request.hidden = {call->hidden_bytes.data(), client::DType::kFloat32, rows, kHidden};
    call->request.labels = call->labels;
    SelectOutput(call->request.outputs, "grad_hidden");
    return call;
  }
  static server::LossServer* socket_server_;
};

server::LossServer* ComputeSocketTest::socket_server_ = nullptr;

struct SocketCase {
  const char* name;
  int64_t rows;
  client::DType hidden_dtype;
  double ignore_fraction;
  int64_t rows_per_message = 0;  // 0: the client's default
  Teacher teacher = Teacher::kNone;
  int lanes = 1;  // ChannelOptions::compute_socket_lanes
};

void PrintTo(const SocketCase& c, std::ostream* os) { *os << c.name; }

class ComputeSocketCaseTest : public ComputeSocketTest,
                              public ::testing::WithParamInterface<SocketCase> {};

// The same call over gRPC and over the socket, on two heads with the same W: every output and the
// accumulated dL/dW agree bit for bit, and with the float64 reference.
TEST_P(ComputeSocketCaseTest, MatchesGrpcBitwiseAndTheReference) {
  const SocketCase& c = GetParam();
  const Client over_grpc = Connect(SocketOptions(false));
  ChannelOptions socket_options = SocketOptions(true);
  socket_options.compute_socket_lanes = c.lanes;
  const Client over_socket = Connect(socket_options);
  const std::string by_grpc = absl::StrCat("grpc-", c.name);
  const std::string by_socket = absl::StrCat("socket-", c.name);
  const std::vector<float> weight = UploadRandomHead(over_grpc, by_grpc);
  ASSERT_TRUE(
      over_grpc.UploadHead(by_socket, {weight.data(), client::DType::kFloat32, kVocab, kHidden})
          .ok());
  const std::string hidden_bytes =
      client::EncodeFromFloat32(RandomNormal(c.rows * kHidden, 1.0f, rng_), c.hidden_dtype);
  const std::vector<int64_t> labels = RandomLabels(c.rows, kVocab, c.ignore_fraction, rng_);
  ComputeRequest request;
  request.hidden = {hidden_bytes.data(), c.hidden_dtype, c.rows, kHidden};
  request.labels = labels;
  request.rows_per_message = c.rows_per_message;
  for (const char* output : {"token_loss", "logprob", "lse", "entropy", "argmax", "grad_hidden",
                             "accumulate_grad_weight"}) {
    SelectOutput(request.outputs, output);
  }
  request.outputs.set_top_k(3);
  std::string teacher_hidden;
  if (c.teacher == Teacher::kDense) {
    // The teacher's rows travel beside the student's in every chunk message.
    teacher_hidden =
        client::EncodeFromFloat32(RandomNormal(c.rows * kHidden, 1.0f, rng_), c.hidden_dtype);
    request.teacher_head = kHead;
    request.teacher_hidden = {teacher_hidden.data(), c.hidden_dtype, c.rows, kHidden};
    request.options.set_objective(v1::OBJECTIVE_DISTILL);
    request.options.mutable_distill()->set_alpha(0.5);
  }
  request.head = by_grpc;
  const absl::StatusOr<ComputeResult> sent = over_grpc.Compute(request);
  ASSERT_TRUE(sent.ok()) << sent.status();
  request.head = by_socket;
  const absl::StatusOr<ComputeResult> socketed = over_socket.Compute(request);
  ASSERT_TRUE(socketed.ok()) << socketed.status();

  EXPECT_EQ(socketed->transport, ComputeResult::Transport::kComputeSocket);
  EXPECT_EQ(sent->transport, ComputeResult::Transport::kGrpc);
  ExpectSameResults(*socketed, *sent);
  EXPECT_TRUE(socketed->grad_hidden.bytes == sent->grad_hidden.bytes) << "dL/dh differs";
  EXPECT_EQ(socketed->messages_sent, sent->messages_sent);
  const absl::StatusOr<client::Tensor> grad_sent = over_grpc.FetchGradWeight(by_grpc);
  const absl::StatusOr<client::Tensor> grad_socketed = over_grpc.FetchGradWeight(by_socket);
  ASSERT_TRUE(grad_sent.ok() && grad_socketed.ok());
  EXPECT_TRUE(grad_socketed->bytes == grad_sent->bytes) << "dL/dW differs";
  if (c.teacher != Teacher::kNone) return;  // the distillation references are the engine test's
  ExpectMatchesTheReference(*socketed, *grad_socketed, socketed->grad_hidden,
                            {hidden_bytes, c.hidden_dtype, c.rows, kHidden}, weight, labels);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ComputeSocketCaseTest,
    ::testing::Values(
        // About 80 rows per engine chunk, 50 per message: chunks and messages misalign.
        SocketCase{"fp32_multi_chunk", 300, client::DType::kFloat32, 0.1, 50},
        SocketCase{"bf16_rows", 300, client::DType::kBFloat16, 0.1},  // dL/dh back in bf16
        SocketCase{"one_row", 1, client::DType::kFloat32, 0.0},
        SocketCase{"all_ignored", 50, client::DType::kFloat32, 1.0},  // loss 0, dL/dh zero
        SocketCase{"no_rows", 0, client::DType::kFloat32, 0.0},       // the start alone
        SocketCase{"dense_teacher", 130, client::DType::kFloat32, 0.0, 40, Teacher::kDense},
        // Messages above 256 KiB: the server receives rows straight into its chunk buffers,
        // each message's spanning many chunks; beside a teacher's rows, which it copies.
        SocketCase{"rows_received_in_place", 3000, client::DType::kFloat32, 0.1, 1500},
        SocketCase{"teacher_beside_rows_in_place", 3000, client::DType::kFloat32, 0.0, 1400,
                   Teacher::kDense},
        // Lanes: message m on lane m mod lanes, results likewise, each lane sent by its own
        // thread; 12 messages of rows over 3 lanes, the last round part-filled.
        SocketCase{"three_lanes", 300, client::DType::kFloat32, 0.1, 25, Teacher::kNone, 3},
        SocketCase{"lanes_in_bf16", 300, client::DType::kBFloat16, 0.1, 40, Teacher::kNone, 4},
        // Two messages of rows: two lanes of the eight allowed.
        SocketCase{"more_lanes_than_messages", 100, client::DType::kFloat32, 0.0, 50,
                   Teacher::kNone, 8},
        SocketCase{"lanes_with_a_teacher", 130, client::DType::kFloat32, 0.0, 20, Teacher::kDense,
                   3},
        SocketCase{"lanes_received_in_place", 3000, client::DType::kFloat32, 0.1, 1100,
                   Teacher::kNone, 3}),
    [](const ::testing::TestParamInfo<SocketCase>& info) { return std::string(info.param.name); });

TEST_F(ComputeSocketTest, ErrorsAndConcurrentCallsAreAsOverGrpc) {
  const Client over_grpc = Connect(SocketOptions(false));
  const Client over_socket = Connect(SocketOptions(std::nullopt));  // chosen by itself
  UploadRandomHead(over_grpc, "socket-errors");
  const std::string hidden_bytes =
      client::EncodeFromFloat32(RandomNormal(40 * kHidden, 1.0f, rng_), client::DType::kFloat32);
  std::vector<int64_t> labels = RandomLabels(40, kVocab, 0.0, rng_);
  labels[3] = kVocab + 7;
  ComputeRequest request;
  request.head = "socket-errors";
  request.hidden = {hidden_bytes.data(), client::DType::kFloat32, 40, kHidden};
  request.labels = labels;
  SelectOutput(request.outputs, "grad_hidden");
  std::vector<float> out(40 * kHidden, 7.0f);
  request.grad_hidden_out = out.data();
  const absl::StatusOr<ComputeResult> by_grpc = over_grpc.Compute(request);
  const absl::StatusOr<ComputeResult> by_socket = over_socket.Compute(request);
  ASSERT_FALSE(by_grpc.ok());
  EXPECT_EQ(by_socket.status(), by_grpc.status());
  ASSERT_TRUE(client::ErrorInfoOf(by_socket.status()).has_value());
  EXPECT_EQ(client::ErrorInfoOf(by_socket.status())->field(), "labels[3]");
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }))
      << "a failed call wrote grad_hidden_out";

  // The next calls run, several at once, each on a connection of its own, and a kept
  // connection that the server closed while idle (after 1 s) is replaced unseen.
  labels[3] = 0;
  std::vector<std::thread> callers;
  std::vector<absl::Status> outcomes(4);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      ComputeRequest mine = request;
      mine.grad_hidden_out = nullptr;
      outcomes[i] = over_socket.Compute(mine).status();
    });
  }
  for (std::thread& caller : callers) caller.join();
  for (const absl::Status& outcome : outcomes) EXPECT_TRUE(outcome.ok()) << outcome;
  absl::SleepFor(absl::Seconds(2));
  const absl::StatusOr<ComputeResult> after_idle = over_socket.Compute(request);
  ASSERT_TRUE(after_idle.ok()) << after_idle.status();
  EXPECT_EQ(after_idle->attempts, 1);
  EXPECT_EQ(after_idle->transport, ComputeResult::Transport::kComputeSocket);
  EXPECT_FALSE(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }));
}

// Lanes: a call refused by the server fails as over gRPC (every lane then closed), the next one
// opens fresh lanes, calls of several callers each take their own, and kept lanes the server
// closed while idle are replaced unseen.
TEST_F(ComputeSocketTest, LanesFailAsOverGrpcAndAreReplaced) {
  const Client over_grpc = Connect(SocketOptions(false));
  ChannelOptions options = SocketOptions(true);
  options.compute_socket_lanes = 3;
  const Client over_lanes = Connect(options);
  UploadRandomHead(over_grpc, "lanes-errors");
  std::unique_ptr<DemoCall> call = NewDemoCall(200);
  call->request.head = "lanes-errors";
  call->request.rows_per_message = 20;
  call->labels[3] = kVocab + 7;
  const absl::StatusOr<ComputeResult> by_grpc = over_grpc.Compute(call->request);
  const absl::StatusOr<ComputeResult> by_lanes = over_lanes.Compute(call->request);
  ASSERT_FALSE(by_grpc.ok());
  EXPECT_EQ(by_lanes.status(), by_grpc.status());
  call->labels[3] = 0;
  const absl::StatusOr<ComputeResult> expected = over_grpc.Compute(call->request);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<std::thread> callers;
  std::vector<absl::StatusOr<ComputeResult>> outcomes(3, absl::UnknownError("not run"));
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&, i] { outcomes[i] = over_lanes.Compute(call->request); });
  }
  for (std::thread& caller : callers) caller.join();
  for (const absl::StatusOr<ComputeResult>& outcome : outcomes) {
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->transport, ComputeResult::Transport::kComputeSocket);
    EXPECT_TRUE(outcome->grad_hidden.bytes == expected->grad_hidden.bytes);
  }
  absl::SleepFor(absl::Seconds(2));  // past the socket's idle limit of 1 s
  const absl::StatusOr<ComputeResult> after_idle = over_lanes.Compute(call->request);
  ASSERT_TRUE(after_idle.ok()) << after_idle.status();
  EXPECT_EQ(after_idle->attempts, 1);
  EXPECT_TRUE(after_idle->grad_hidden.bytes == expected->grad_hidden.bytes);

  // Some kept lanes closed by the server, one still open (a call of one message kept it busy):
  // the closed ones are replaced at once, not waited on for a join that can never come.
  absl::SleepFor(absl::Milliseconds(600));
  ComputeRequest one_message = call->request;
  one_message.rows_per_message = 0;
  ASSERT_TRUE(over_lanes.Compute(one_message).ok());
  absl::SleepFor(absl::Milliseconds(600));
  const absl::Time started = absl::Now();
  const absl::StatusOr<ComputeResult> some_closed = over_lanes.Compute(call->request);
  ASSERT_TRUE(some_closed.ok()) << some_closed.status();
  EXPECT_EQ(some_closed->attempts, 1);
  EXPECT_LT(absl::Now() - started, absl::Seconds(30));  // the server waits 60 s for a lane
}

// With the server's default workspace a call of 8000 rows computes in one chunk, whose results
// come in messages of megabytes: their dL/dh is received straight into the result, and into the
// caller's grad_hidden_out only once the call has succeeded (it is kept as received until then).
// Either way the bits are gRPC's, and match the float64 reference.
TEST_F(ComputeSocketTest, LargeResultsLandWhereTheyGoWithTheSameBits) {
  server::ServerConfig config = MultiChunkDemoConfig(kHead, kVocab, kHidden, 11);
  config.workspace_budget_bytes = 256 << 20;
  config.compute_socket_listen = "127.0.0.1:0";
  config.shared_memory = false;
  const std::unique_ptr<server::LossServer> wide = StartTestServer(config);
  ASSERT_NE(wide, nullptr);
  ChannelOptions options = OptionsFor(wide->port());
  options.compute_socket = false;
  const Client over_grpc = Connect(options);
  options.compute_socket = true;
  const Client over_socket = Connect(options);
  const std::vector<float> weight = UploadRandomHead(over_grpc, "large-results");
  constexpr int64_t kRows = 8000;
  const std::string hidden_bytes =
      client::EncodeFromFloat32(RandomNormal(kRows * kHidden, 1.0f, rng_), client::DType::kFloat32);
  const std::vector<int64_t> labels = RandomLabels(kRows, kVocab, 0.1, rng_);
  ComputeRequest request;
  request.head = "large-results";
  request.hidden = {hidden_bytes.data(), client::DType::kFloat32, kRows, kHidden};
  request.labels = labels;
  SelectOutput(request.outputs, "grad_hidden");
  SelectOutput(request.outputs, "logprob");
  const absl::StatusOr<ComputeResult> by_grpc = over_grpc.Compute(request);
  ASSERT_TRUE(by_grpc.ok()) << by_grpc.status();
  request.outputs.set_accumulate_grad_weight(true);  // this call's dL/dW alone, for the reference
  const absl::StatusOr<ComputeResult> by_socket = over_socket.Compute(request);
  ASSERT_TRUE(by_socket.ok()) << by_socket.status();
  request.outputs.set_accumulate_grad_weight(false);
  EXPECT_EQ(by_socket->transport, ComputeResult::Transport::kComputeSocket);
  ExpectSameResults(*by_socket, *by_grpc);
  EXPECT_TRUE(by_socket->grad_hidden.bytes == by_grpc->grad_hidden.bytes) << "dL/dh differs";
  const absl::StatusOr<client::Tensor> grad_weight = over_grpc.FetchGradWeight("large-results");
  ASSERT_TRUE(grad_weight.ok()) << grad_weight.status();
  ExpectMatchesTheReference(*by_socket, *grad_weight, by_socket->grad_hidden,
                            {hidden_bytes, client::DType::kFloat32, kRows, kHidden}, weight,
                            labels);

  std::vector<float> out(kRows * kHidden, 7.0f);
  request.grad_hidden_out = out.data();
  const absl::StatusOr<ComputeResult> into_caller = over_socket.Compute(request);
  ASSERT_TRUE(into_caller.ok()) << into_caller.status();
  EXPECT_EQ(std::memcmp(out.data(), by_grpc->grad_hidden.bytes.data(), out.size() * sizeof(float)),
            0);
}

// A server whose socket takes one connection from a host: a second client's call, refused at its
// HELLO, goes over gRPC instead of failing where the client chose the socket by itself, and fails
// with RESOURCE_EXHAUSTED where it was asked for.
TEST_F(ComputeSocketTest, AFullSocketSendsTheCallOverGrpc) {
  const std::unique_ptr<server::LossServer> narrow =
      StartSocketServer("127.0.0.1:0", /*max_connections_per_host=*/1);
  ASSERT_NE(narrow, nullptr);
  ChannelOptions options = OptionsFor(narrow->port());
  const Client first = Connect(options);
  const Client second = Connect(options);
  options.compute_socket = true;
  const Client insisting = Connect(options);
  const std::unique_ptr<DemoCall> call = NewDemoCall(20);
  // The first client keeps its connection, the one this host may hold.
  const absl::StatusOr<ComputeResult> holding = first.Compute(call->request);
  ASSERT_TRUE(holding.ok()) << holding.status();
  EXPECT_EQ(holding->transport, ComputeResult::Transport::kComputeSocket);
  const absl::StatusOr<ComputeResult> refused = second.Compute(call->request);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->transport, ComputeResult::Transport::kGrpc);
  ExpectSameResults(*refused, *holding);
  EXPECT_TRUE(refused->grad_hidden.bytes == holding->grad_hidden.bytes);
  const absl::Status insisted = insisting.Compute(call->request).status();
  EXPECT_EQ(insisted.code(), absl::StatusCode::kResourceExhausted) << insisted;
}

// A socket the client cannot reach (bound to another address than the one the client reached
// gRPC at): its calls go over gRPC where it chose the socket by itself; asked for, they fail.
TEST_F(ComputeSocketTest, AnUnreachableSocketSendsTheCallOverGrpc) {
  const std::unique_ptr<server::LossServer> elsewhere = StartSocketServer("127.0.0.2:0");
  ASSERT_NE(elsewhere, nullptr);
  ChannelOptions options = OptionsFor(elsewhere->port());  // 127.0.0.1
  const Client automatic = Connect(options);
  options.compute_socket = true;
  const Client insisting = Connect(options);
  const std::unique_ptr<DemoCall> call = NewDemoCall(20);
  for (int attempt = 0; attempt < 2; ++attempt) {  // the second without trying the socket again
    const absl::StatusOr<ComputeResult> result = automatic.Compute(call->request);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->transport, ComputeResult::Transport::kGrpc);
  }
  const absl::Status insisted = insisting.Compute(call->request).status();
  EXPECT_EQ(insisted.code(), absl::StatusCode::kUnavailable) << insisted;
  EXPECT_TRUE(absl::StrContains(insisted.message(), "Compute socket")) << insisted;
}

TEST_F(ComputeSocketTest, AServerWithoutOneKeepsAutoOnGrpcAndRefusesTrue) {
  ChannelOptions options = OptionsFor(server_->port());  // the suite's server offers none
  const Client automatic = Connect(options);
  options.compute_socket = true;
  const Client insisting = Connect(options);
  const std::unique_ptr<DemoCall> call = NewDemoCall(8);
  ComputeRequest& request = call->request;
  request.shared_memory = false;
  const absl::StatusOr<ComputeResult> over_grpc = automatic.Compute(request);
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  EXPECT_EQ(over_grpc->transport, ComputeResult::Transport::kGrpc);
  const absl::Status refused = insisting.Compute(request).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "--compute_socket_listen")) << refused;
}

// How a call's dL/dh comes back to be lent (ComputeRequest::lend_grad_hidden).
struct LendCase {
  const char* name;
  ComputeResult::Transport transport;
  // Whether a failed call's buffer serves the next calls: in messages it was the client's alone;
  // a shared memfd is dropped, since a server still running the call might yet write into it.
  bool failed_call_returns_buffer;
  int lanes = 1;  // ChannelOptions::compute_socket_lanes
};

void PrintTo(const LendCase& c, std::ostream* os) { *os << c.name; }

class LentGradHiddenTest : public ComputeSocketTest,
                           public ::testing::WithParamInterface<LendCase> {};

// A lent dL/dh has the bits of one the call copies out, and stays as the call left it while the
// caller holds it: the next calls write into other buffers. Dropped, its buffer serves calls
// again; a failed call gives its buffer back without lending it; with kMaxLent (4) out, dL/dh is
// copied.
TEST_P(LentGradHiddenTest, IsTheCallersUntilDroppedWithTheSameBits) {
  const LendCase& c = GetParam();
  const bool over_socket = c.transport == ComputeResult::Transport::kComputeSocket;
  ChannelOptions options = over_socket ? SocketOptions(true) : OptionsFor(server_->port());
  if (!over_socket) options.compute_socket = false;
  options.compute_socket_lanes = c.lanes;
  const Client client = Connect(options);
  const std::string head = std::string("lent-grad-hidden-") + c.name;
  UploadRandomHead(client, head);
  constexpr int64_t kRows = 300;  // several engine chunks and result messages
  const std::string first_rows =
      client::EncodeFromFloat32(RandomNormal(kRows * kHidden, 1.0f, rng_), client::DType::kFloat32);
  const std::string other_rows =
      client::EncodeFromFloat32(RandomNormal(kRows * kHidden, 1.0f, rng_), client::DType::kFloat32);
  std::vector<int64_t> labels = RandomLabels(kRows, kVocab, 0.1, rng_);
  ComputeRequest request;
  request.head = head;
  request.labels = labels;
  request.outputs.set_grad_hidden(true);
  request.shared_memory = c.transport == ComputeResult::Transport::kSharedMemory;
  request.rows_per_message = 37;
  request.lend_grad_hidden = true;
  auto call = [&](const std::string& rows) {
    request.hidden = {rows.data(), client::DType::kFloat32, kRows, kHidden};
    absl::StatusOr<ComputeResult> result = client.Compute(request);
    EXPECT_TRUE(result.ok()) << result.status();
    if (result.ok()) EXPECT_EQ(result->transport, c.transport);
    return result.ok() ? *std::move(result) : ComputeResult();
  };
  const size_t grad_bytes = kRows * kHidden * sizeof(float);

  request.lend_grad_hidden = false;
  const std::string copied_grad = call(first_rows).grad_hidden.bytes;
  ASSERT_EQ(copied_grad.size(), grad_bytes);
  request.lend_grad_hidden = true;
  ComputeResult first = call(first_rows);
  ASSERT_NE(first.grad_hidden_shared, nullptr);
  EXPECT_TRUE(first.grad_hidden.bytes.empty());
  EXPECT_EQ(first.grad_hidden.rows, kRows);
  EXPECT_EQ(first.grad_hidden.dtype, client::DType::kFloat32);
  const std::string first_grad(reinterpret_cast<const char*>(first.grad_hidden_shared.get()),
                               grad_bytes);
  EXPECT_TRUE(first_grad == copied_grad) << "lent and copied dL/dh differ";
  ComputeResult second = call(other_rows);
  ASSERT_NE(second.grad_hidden_shared, nullptr);
  EXPECT_NE(second.grad_hidden_shared.get(), first.grad_hidden_shared.get());
  EXPECT_TRUE(std::memcmp(first.grad_hidden_shared.get(), first_grad.data(), grad_bytes) == 0)
      << "a later call wrote into a lent dL/dh";
  const uint8_t* first_memory = first.grad_hidden_shared.get();
  const uint8_t* second_memory = second.grad_hidden_shared.get();
  first.grad_hidden_shared.reset();
  second.grad_hidden_shared.reset();
  // Back in the pool: the next call takes one of the two buffers again.
  ComputeResult third = call(first_rows);
  ASSERT_NE(third.grad_hidden_shared, nullptr);
  EXPECT_TRUE(third.grad_hidden_shared.get() == first_memory ||
              third.grad_hidden_shared.get() == second_memory);
  EXPECT_TRUE(std::memcmp(third.grad_hidden_shared.get(), first_grad.data(), grad_bytes) == 0);
  third.grad_hidden_shared.reset();

  // A label past the vocabulary in the last rows fails the call after results have come.
  const int64_t last_label = labels.back();
  labels.back() = kVocab;
  request.hidden = {first_rows.data(), client::DType::kFloat32, kRows, kHidden};
  const absl::Status failed = client.Compute(request).status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument) << failed;
  labels.back() = last_label;
  std::vector<ComputeResult> kept;
  for (int i = 0; i < 5; ++i) kept.push_back(call(first_rows));
  if (c.failed_call_returns_buffer) {
    // Both buffers were idle again after the failed call, and serve the next two.
    std::set<const uint8_t*> reused = {kept[0].grad_hidden_shared.get(),
                                       kept[1].grad_hidden_shared.get()};
    EXPECT_EQ(reused, (std::set<const uint8_t*>{first_memory, second_memory}));
  }
  // The first four are lent; the fifth is copied.
  EXPECT_NE(kept[3].grad_hidden_shared, nullptr);
  EXPECT_EQ(kept[4].grad_hidden_shared, nullptr);
  EXPECT_TRUE(kept[4].grad_hidden.bytes == copied_grad);
}

INSTANTIATE_TEST_SUITE_P(
    Transports, LentGradHiddenTest,
    ::testing::Values(
        // Left where the server wrote it in the call's memfd.
        LendCase{"shared_memory", ComputeResult::Transport::kSharedMemory, false},
        // Copied once out of gRPC's slices, into pages an earlier call touched.
        LendCase{"grpc_messages", ComputeResult::Transport::kGrpc, true},
        // Received straight from the connection into the buffer.
        LendCase{"compute_socket", ComputeResult::Transport::kComputeSocket, true},
        // Each lane's results received into their rows of the one buffer.
        LendCase{"compute_socket_lanes", ComputeResult::Transport::kComputeSocket, true, 3}),
    [](const ::testing::TestParamInfo<LendCase>& info) { return std::string(info.param.name); });

struct CopyCase {
  const char* name;
  size_t bytes;
};

void PrintTo(const CopyCase& c, std::ostream* os) { *os << c.name << " (" << c.bytes << " bytes)"; }

class ParallelCopyTest : public ::testing::TestWithParam<CopyCase> {};

// Every byte arrives, in place, and nothing past the end is written.
TEST_P(ParallelCopyTest, CopiesEveryByteAndNoMore) {
  const size_t bytes = GetParam().bytes;
  constexpr size_t kGuard = 64;
  std::mt19937_64 rng(FreshSeed());
  std::vector<uint8_t> source(bytes);
  for (uint8_t& b : source) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> target(bytes + kGuard, 0xA5);
  client::CopyInParallel(target.data(), source.data(), bytes);
  EXPECT_TRUE(std::equal(source.begin(), source.end(), target.begin()));
  EXPECT_TRUE(
      std::all_of(target.begin() + bytes, target.end(), [](uint8_t b) { return b == 0xA5; }));
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, ParallelCopyTest,
    ::testing::Values(
        CopyCase{"empty", 0}, CopyCase{"one_byte", 1},
        // Just under two threads' worth: one thread.
        CopyCase{"one_thread", (size_t{16} << 20) - 1},
        // Two threads, a length that is no multiple of the pieces' page alignment.
        CopyCase{"two_threads_odd", (size_t{16} << 20) + 4097},
        // As many threads as cores (up to four), the last piece shorter than the others.
        CopyCase{"most_threads", (size_t{40} << 20) + 3}),
    [](const ::testing::TestParamInfo<CopyCase>& info) { return std::string(info.param.name); });

// The client hands its memfd over once and the server keeps its mappings (the rows' range and
// dL/dh's) between calls; a failed call's memfd is released, not reused (a cancelled call could
// still write into it); a client that goes away takes its handles and the mappings with it.
TEST_F(ClientTest, SharedMemoryHandlesAndMappingsLiveAsLongAsTheClient) {
  server::SharedMemoryMaps& maps = server_->shared_memory_maps();
  ASSERT_TRUE(Eventually([&] { return maps.handles() == 0 && maps.mappings() == 0; }))
      << "earlier tests' clients left handles behind";
  const int64_t created_before = maps.mappings_created();
  {
    const Client client = Connect(OptionsFor(server_->port()));
    UploadRandomHead(client, "kept");
    std::vector<float> hidden = RandomNormal(100 * kHidden, 1.0f, rng_);
    const std::vector<int64_t> labels = RandomLabels(100, kVocab, 0.0, rng_);
    ComputeRequest request = Fp32Request("kept", hidden, labels);
    request.outputs.set_grad_hidden(true);
    request.shared_memory = true;
    ASSERT_TRUE(client.Compute(request).ok());
    ASSERT_TRUE(client.Compute(request).ok());
    EXPECT_EQ(maps.handles(), 1u);
    EXPECT_EQ(maps.mappings(), 2u);
    EXPECT_EQ(maps.mappings_created(), created_before + 2);
    // Rows and dL/dh of 100 x 48 floats each, page-aligned: 20 KiB apiece at 4 KiB pages.
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t region = (100 * kHidden * sizeof(float) + page - 1) / page * page;
    EXPECT_LE(maps.mapped_bytes(), 2 * (region + page));

    hidden[7] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(client.Compute(request).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(maps.handles(), 0u) << "the failed call's memfd was not released";
    hidden[7] = 0.0f;
    ASSERT_TRUE(client.Compute(request).ok());
    EXPECT_EQ(maps.handles(), 1u);
    EXPECT_EQ(maps.mappings(), 2u);
    EXPECT_EQ(maps.mappings_created(), created_before + 4);
  }
  EXPECT_TRUE(Eventually([&] { return maps.handles() == 0 && maps.mappings() == 0; }))
      << maps.handles() << " handles, " << maps.mappings() << " mappings left";
  EXPECT_EQ(maps.mapped_bytes(), 0u);
}

// dL/dh into the caller's buffer, through messages and through shared memory: the same bytes as
// in result.grad_hidden, a failed call leaves the buffer as it was, and the call after it is whole.
TEST_F(ClientTest, GradHiddenOutIsWrittenOnlyWhenTheCallSucceeds) {
  const Client client = Connect(OptionsFor(server_->port()));
  UploadRandomHead(client, "out");
  const int64_t n = 200;  // several engine chunks
  std::vector<float> hidden = RandomNormal(n * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  ComputeRequest request = Fp32Request("out", hidden, labels);
  request.outputs.set_grad_hidden(true);
  const absl::StatusOr<ComputeResult> reference = client.Compute(request);
  ASSERT_TRUE(reference.ok()) << reference.status();

  for (const bool shared_memory : {false, true}) {
    SCOPED_TRACE(shared_memory ? "shared memory" : "messages");
    std::string out(reference->grad_hidden.bytes.size(), '\x5a');
    request.shared_memory = shared_memory;
    request.grad_hidden_out = out.data();
    const absl::StatusOr<ComputeResult> written = client.Compute(request);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_TRUE(out == reference->grad_hidden.bytes) << "dL/dh differs";
    EXPECT_TRUE(written->grad_hidden.bytes.empty());
    EXPECT_EQ(written->grad_hidden.rows, n);

    const std::string untouched(out.size(), '\x5a');
    out = untouched;
    const float kept = hidden[150 * kHidden];
    hidden[150 * kHidden] = std::numeric_limits<float>::quiet_NaN();  // after a chunk or two went
    EXPECT_EQ(client.Compute(request).status().code(), absl::StatusCode::kInvalidArgument);
    hidden[150 * kHidden] = kept;
    EXPECT_TRUE(out == untouched) << "a failed call wrote into the caller's buffer";

    // The next call reuses the memory the failed one staged part of its dL/dh in.
    ASSERT_TRUE(client.Compute(request).ok());
    EXPECT_TRUE(out == reference->grad_hidden.bytes) << "dL/dh differs after a failed call";
  }
}

// dL/dh of more than 16 MiB into the caller's buffer over messages: the results kept as received
// are copied out by two threads once the call is done, every row in its place.
TEST_F(ClientTest, LargeGradHiddenOutIsWhole) {
  const Client client = Connect(OptionsFor(server_->port()));
  constexpr int64_t kWide = 1024;
  constexpr int64_t kFewTokens = 8;
  const std::vector<float> weight = RandomNormal(kFewTokens * kWide, 0.03f, rng_);
  ASSERT_TRUE(
      client.UploadHead("wide", {weight.data(), client::DType::kFloat32, kFewTokens, kWide}).ok());
  const int64_t n = 4200;  // 17.2 MB of float32 dL/dh, in several messages
  const std::vector<float> hidden = RandomNormal(n * kWide, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(n, kFewTokens, 0.1, rng_);
  ComputeRequest request = Fp32Request("wide", hidden, labels);
  request.outputs.set_grad_hidden(true);
  request.shared_memory = false;
  const absl::StatusOr<ComputeResult> reference = client.Compute(request);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->grad_hidden.bytes.size(), static_cast<size_t>(n * kWide * 4));
  std::string out(reference->grad_hidden.bytes.size(), '\x5a');
  request.grad_hidden_out = out.data();
  const absl::StatusOr<ComputeResult> written = client.Compute(request);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_GE(written->messages_received, 3);  // results in two messages or more, and the summary
  EXPECT_TRUE(out == reference->grad_hidden.bytes) << "dL/dh differs";
}

// A server started without shared memory says so, and the same client goes on with messages.
TEST_F(ClientTest, SharedMemoryCanBeTurnedOff) {
  server::ServerConfig config;
  config.demo = {"plain", 100, 16, 1};
  config.shared_memory = false;
  std::unique_ptr<server::LossServer> plain = StartTestServer(config);
  ASSERT_NE(plain, nullptr);
  const Client client = Connect(OptionsFor(plain->port()));
  const std::vector<float> hidden = RandomNormal(3 * 16, 1.0f, rng_);
  const std::vector<int64_t> labels = {5, 6, 7};
  ComputeRequest request = Fp32Request("plain", hidden, labels);
  request.shared_memory = true;
  const absl::StatusOr<ComputeResult> refused = client.Compute(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("--shared_memory=false"), absl::string_view::npos)
      << refused.status();
  request.shared_memory = false;
  EXPECT_TRUE(client.Compute(request).ok());
  // Left to the client, a call goes by messages to a server that offers no shared memory.
  request.shared_memory.reset();
  EXPECT_TRUE(client.Compute(request).ok());
}

// Left to the client (shared_memory unset), a call to one server on this host hands its rows over
// in shared memory, with the same bits as by messages; a call with a teacher, or to a target
// elsewhere, sends messages.
TEST_F(ClientTest, SharedMemoryIsChosenForALocalServer) {
  const Client client = Connect(OptionsFor(server_->port()));
  ASSERT_TRUE(client.target().local);
  UploadRandomHead(client, "auto");
  const std::vector<float> hidden = RandomNormal(40 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(40, kVocab, 0.1, rng_);
  ComputeRequest request = Fp32Request("auto", hidden, labels);
  request.outputs.set_grad_hidden(true);
  request.shared_memory = false;
  const absl::StatusOr<ComputeResult> by_messages = client.Compute(request);
  ASSERT_TRUE(by_messages.ok()) << by_messages.status();
  const size_t handles_before = server_->shared_memory_maps().handles();
  request.shared_memory.reset();
  const absl::StatusOr<ComputeResult> chosen = client.Compute(request);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_GT(server_->shared_memory_maps().handles(), handles_before) << "no memfd was handed over";
  EXPECT_TRUE(chosen->grad_hidden.bytes == by_messages->grad_hidden.bytes);
  EXPECT_EQ(chosen->summary.loss(), by_messages->summary.loss());

  for (const char* address :
       {"10.1.2.3:50051", "dns:///lossd.example.com:50051", "ipv4:127.0.0.1:1,127.0.0.1:2"}) {
    const absl::StatusOr<client::Target> target = client::ParseTarget(address);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_FALSE(target->local && target->listed_addresses == 1) << address;
  }
  for (const char* address : {"127.0.0.1:50051", "localhost:50051", "[::1]:50051",
                              "unix:/run/lossd.sock", "dns:///localhost:50051"}) {
    const absl::StatusOr<client::Target> target = client::ParseTarget(address);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_TRUE(target->local) << address;
  }
}

TEST(SharedMemoryPeerTest, OnlyLoopbackAndUnixPeersAreLocal) {
  EXPECT_TRUE(server::IsLocalPeer("ipv4:127.0.0.1:50051"));
  EXPECT_TRUE(server::IsLocalPeer("ipv4:127.1.2.3:9"));
  EXPECT_TRUE(server::IsLocalPeer("ipv6:[::1]:50051"));
  EXPECT_TRUE(server::IsLocalPeer("ipv6:[::ffff:127.0.0.1]:50051"));
  EXPECT_TRUE(server::IsLocalPeer("unix:/run/lossd.sock"));
  EXPECT_FALSE(server::IsLocalPeer("ipv4:10.0.0.7:50051"));
  EXPECT_FALSE(server::IsLocalPeer("ipv4:128.0.0.1:50051"));  // not 127/8
  EXPECT_FALSE(server::IsLocalPeer("ipv6:[::12]:50051"));     // not ::1
  EXPECT_FALSE(server::IsLocalPeer("ipv6:[fe80::1]:50051"));
  EXPECT_FALSE(server::IsLocalPeer(""));
}

TEST(ChannelOptionsTest, RejectsUnusableSettings) {
  ChannelOptions options;
  options.max_message_bytes = 1000;
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.max_message_bytes = int64_t{4} << 30;  // gRPC's limits are ints
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.address.clear();
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.deadline = absl::ZeroDuration();
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.compute_retry.max_attempts = 0;
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.compute_retry.max_backoff = absl::Milliseconds(1);  // below the initial backoff
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.compute_retry.backoff_multiplier = 0.5;
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ChannelOptions();
  options.compute_connections = 0;  // at least the client's own
  const absl::Status no_connections = Client::Connect(options).status();
  EXPECT_EQ(no_connections.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(no_connections.message(), "compute_connections")) << no_connections;
  for (const int lanes : {0, 9}) {  // a call on no connection; past the server's 8
    options = ChannelOptions();
    options.compute_socket_lanes = lanes;
    const absl::Status bad_lanes = Client::Connect(options).status();
    EXPECT_EQ(bad_lanes.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(FieldOf(bad_lanes), "compute_socket_lanes") << bad_lanes;
  }
  options = ChannelOptions();
  options.compute_socket = true;  // its rows would go in the clear beside a TLS channel
  options.tls_root_cert_pem = "-----BEGIN CERTIFICATE-----";
  const absl::Status socket_with_tls = Client::Connect(options).status();
  EXPECT_EQ(socket_with_tls.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(socket_with_tls.message(), "compute_socket")) << socket_with_tls;
}

TEST(TcpHostTest, NamesTheHostOfOneTcpServerOnly) {
  const struct {
    const char* address;
    std::optional<std::string> host;
  } cases[] = {
      {"localhost:5", "localhost"},
      {"dns:///lossd.svc:5", "lossd.svc"},
      {"dns://8.8.8.8/lossd.svc:5", "lossd.svc"},  // the authority is the DNS server's
      {"ipv4:10.0.0.1:5", "10.0.0.1"},
      {"ipv6:[::1]:5", "::1"},
      {"[::1]:5", "::1"},
      {"unix:/tmp/lossd.sock", std::nullopt},        // not TCP
      {"ipv4:10.0.0.1:5,10.0.0.2:5", std::nullopt},  // several servers
  };
  for (const auto& c : cases) {
    const absl::StatusOr<client::Target> target = client::ParseTarget(c.address);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_EQ(client::TcpHost(*target), c.host) << c.address;
  }
}

// The client's conversions, independent code, agree with the engine's half.h bit for bit.
TEST(TensorTest, ConversionsMatchTheEngine) {
  std::string all_halves(2 * 65536, '\0');
  for (uint32_t bits = 0; bits < 65536; ++bits) std::memcpy(&all_halves[2 * bits], &bits, 2);
  const std::vector<float> from_fp16 = client::DecodeToFloat32(all_halves, client::DType::kFloat16);
  const std::vector<float> from_bf16 =
      client::DecodeToFloat32(all_halves, client::DType::kBFloat16);
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float fp16 = Float16ToFloat(static_cast<uint16_t>(bits));
    const float bf16 = BFloat16ToFloat(static_cast<uint16_t>(bits));
    ASSERT_TRUE(std::memcmp(&from_fp16[bits], &fp16, 4) == 0) << bits;
    ASSERT_TRUE(std::memcmp(&from_bf16[bits], &bf16, 4) == 0) << bits;
  }

  std::mt19937_64 rng(FreshSeed());
  std::uniform_int_distribution<uint32_t> any_bits;
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               65504.0f,
                               65519.99f,
                               65520.0f,
                               5.96e-8f,
                               2.98e-8f,
                               1e-10f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::denorm_min(),
                               3.3895314e38f};
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = any_bits(rng);
    float value;
    std::memcpy(&value, &bits, 4);
    values.push_back(value);
  }
  const std::string fp16 = client::EncodeFromFloat32(values, client::DType::kFloat16);
  const std::string bf16 = client::EncodeFromFloat32(values, client::DType::kBFloat16);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t expected_fp16 = FloatToFloat16(values[i]);
    const uint16_t expected_bf16 = FloatToBFloat16(values[i]);
    ASSERT_EQ(std::memcmp(&fp16[2 * i], &expected_fp16, 2), 0) << values[i];
    ASSERT_EQ(std::memcmp(&bf16[2 * i], &expected_bf16, 2), 0) << values[i];
  }
  EXPECT_EQ(client::ParseDType("bf16").value(), client::DType::kBFloat16);
  EXPECT_EQ(client::ParseDType("FP16").value(), client::DType::kFloat16);
  EXPECT_FALSE(client::ParseDType("float64").ok());
}

// ---------------------------------------------------------------------------------------------
// .npy files

std::string NpyFile(absl::string_view version_and_length, absl::string_view header,
                    absl::string_view data) {
  return absl::StrCat("\x93NUMPY", version_and_length, header, data);
}

// A version 1.0 file with this header text (padded with a newline) and data.
std::string NpyV1(const std::string& header, absl::string_view data) {
  const std::string text = header + "\n";
  const char length[2] = {static_cast<char>(text.size() & 0xff),
                          static_cast<char>(text.size() >> 8)};
  return NpyFile(absl::StrCat(absl::string_view("\x01\x00", 2), absl::string_view(length, 2)), text,
                 data);
}

TEST(NpyTest, RoundTripsEveryDTypeAndShape) {
  const std::vector<std::pair<client::NpyDType, std::vector<int64_t>>> cases = {
      {client::NpyDType::kFloat32, {3, 5}},   {client::NpyDType::kFloat16, {7}},
      {client::NpyDType::kUInt16, {2, 3, 4}}, {client::NpyDType::kInt64, {}},
      {client::NpyDType::kInt32, {0, 9}},     {client::NpyDType::kFloat32, {1, 1, 1, 1}},
  };
  std::mt19937_64 rng(FreshSeed());
  for (const auto& [dtype, shape] : cases) {
    client::NpyArray array;
    array.dtype = dtype;
    array.shape = shape;
    array.data.resize(array.num_elements() * client::NpyItemSize(dtype));
    for (char& byte : array.data) byte = static_cast<char>(rng());
    const absl::StatusOr<std::string> bytes = client::SerializeNpy(dtype, shape, array.data);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    // NumPy's layout: the data starts at a multiple of 64 bytes, after a newline.
    EXPECT_EQ((bytes->size() - array.data.size()) % 64, 0u);
    EXPECT_EQ((*bytes)[bytes->size() - array.data.size() - 1], '\n');
    const absl::StatusOr<client::NpyArray> parsed = client::ParseNpy(*bytes, "test.npy");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->dtype, dtype);
    EXPECT_EQ(parsed->shape, shape);
    EXPECT_EQ(parsed->data, array.data);
  }

  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("lossd-npy-" + std::to_string(FreshSeed()) + ".npy");
  client::NpyArray array{client::NpyDType::kFloat32, {2, 2}, std::string(16, '\x01')};
  ASSERT_TRUE(client::WriteNpyFile(path.string(), array.dtype, array.shape, array.data).ok());
  const absl::StatusOr<client::NpyArray> read = client::ReadNpyFile(path.string());
  std::filesystem::remove(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->data, array.data);
  EXPECT_EQ(client::ReadNpyFile(path.string()).status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(
      client::SerializeNpy(client::NpyDType::kInt64, {3}, std::string(16, '\0')).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, ReadsHeadersAsNumPyWritesThem) {
  // Version 2.0 (4-byte header length), double quotes, other key order, 1-tuples, no trailing
  // comma.
  const std::string header = "{\"shape\": (2,), 'fortran_order': False, 'descr': '<i4'}\n";
  const char length[4] = {static_cast<char>(header.size()), 0, 0, 0};
  const std::string v2 =
      NpyFile(absl::StrCat(absl::string_view("\x02\x00", 2), absl::string_view(length, 4)), header,
              std::string(8, '\x02'));
  const absl::StatusOr<client::NpyArray> parsed = client::ParseNpy(v2, "v2.npy");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->dtype, client::NpyDType::kInt32);
  EXPECT_EQ(parsed->shape, std::vector<int64_t>{2});
  const std::string spaced =
      NpyV1("{'descr':'<f2','fortran_order':False,'shape':( 1 , 2 , ),}   ", "abcd");
  EXPECT_TRUE(client::ParseNpy(spaced, "spaced.npy").ok())
      << client::ParseNpy(spaced, "spaced.npy").status();
}

TEST(NpyTest, RejectsMalformedFiles) {
  const std::string f4 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const std::string eight_bytes(8, '\0');
  struct BadFile {
    std::string reason;
    std::string bytes;
    absl::StatusCode code;
  };
  const std::vector<BadFile> bad_files = {
      {"empty file", "", absl::StatusCode::kDataLoss},
      {"not an npy file", "PK\x03\x04 zip data", absl::StatusCode::kInvalidArgument},
      {"cut inside the preamble", std::string("\x93NUMPY\x01\x00\x10", 9),
       absl::StatusCode::kDataLoss},
      {"version 3.0", NpyFile(absl::string_view("\x03\x00\x00\x00\x00\x00", 6), "", ""),
       absl::StatusCode::kInvalidArgument},
      {"header length past the end", NpyFile(absl::string_view("\x01\x00\xff\x00", 4), "{}", ""),
       absl::StatusCode::kDataLoss},
      {"header longer than the limit",
       NpyFile(absl::string_view("\x02\x00\x00\x00\x01\x00", 6), "", ""),
       absl::StatusCode::kInvalidArgument},
      {"header not a dictionary", NpyV1("['<f4', False, (2,)]", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"missing shape", NpyV1("{'descr': '<f4', 'fortran_order': False}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"unknown key",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"duplicate key",
       NpyV1("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
             eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"big-endian data",
       NpyV1("{'descr': '>f4', 'fortran_order': False, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"float64 data",
       NpyV1("{'descr': '<f8', 'fortran_order': False, 'shape': (1,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"Fortran order",
       NpyV1("{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"fortran_order not a bool",
       NpyV1("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"negative dimension",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"shape (2) is not a tuple",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"dimension overflows int64",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
             eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"element count overflows",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}",
             eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"bytes overflow",
       NpyV1("{'descr': '<i8', 'fortran_order': False, 'shape': (2305843009213693952,)}", ""),
       absl::StatusCode::kInvalidArgument},
      {"unterminated string", NpyV1("{'descr: '<f4'}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"text after the dictionary", NpyV1(f4 + " junk", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"truncated data", NpyV1(f4, eight_bytes.substr(0, 7)), absl::StatusCode::kDataLoss},
      {"trailing bytes", NpyV1(f4, eight_bytes + "x"), absl::StatusCode::kInvalidArgument},
  };
  for (const BadFile& bad : bad_files) {
    const absl::StatusOr<client::NpyArray> parsed = client::ParseNpy(bad.bytes, "bad.npy");
    EXPECT_EQ(parsed.status().code(), bad.code) << bad.reason << ": " << parsed.status();
    EXPECT_TRUE(absl::StartsWith(parsed.status().message(), "bad.npy: "))
        << bad.reason << ": " << parsed.status();
  }
}

}  // namespace
}  // namespace lossd::testing
