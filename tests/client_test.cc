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
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "client/cpp/npy.h"
#include "client/cpp/shared_buffer.h"
#include "lossd/kernels/half.h"
#include "server/shared_memory.h"
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

ReferenceProblem MakeReferenceProblem(const std::vector<float>& hidden, const std::vector<float>& weight,
                                      const std::vector<int64_t>& labels, int64_t hidden_size, int top_k) {
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

std::vector<double> AsDoubles(const std::vector<int32_t>& values) { return {values.begin(), values.end()}; }

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
  std::vector<float> UploadRandomHead(const Client& client, const std::string& head, int64_t vocab = kVocab) {
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
  const std::vector<int64_t> labels = RandomLabels(n, kVocab, 0.1, rng_);
  const ReferenceResult ref = ComputeReference(MakeReferenceProblem(hidden, weight, labels, kHidden, 5));

  ComputeRequest request = Fp32Request("reference", hidden, labels);
  request.rows_per_message = 37;  // many chunk messages that do not line up with engine chunks
  request.outputs = {.token_loss = true,
                     .logprob = true,
                     .lse = true,
                     .entropy = true,
                     .argmax = true,
                     .top_k = 5,
                     .grad_hidden = true,
                     .accumulate_grad_weight = true};
  const absl::StatusOr<ComputeResult> result = client.Compute(request);
  ASSERT_TRUE(result.ok()) << result.status();

  EXPECT_EQ(result->messages_sent, 1 + (n + 36) / 37);
  EXPECT_GT(result->messages_received, 2);
  EXPECT_TRUE(result->summary.grad_weight_accumulated);
  EXPECT_EQ(result->summary.counted_tokens, ref.counted_tokens);
  EXPECT_LE(std::abs(result->summary.loss - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(result->token_loss, ref.token_loss), kLossBound);
  EXPECT_LE(MaxAbsError(result->logprob, ref.logprob), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(MaxAbsError(result->lse, ref.lse), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_LE(MaxAbsError(result->entropy, ref.entropy), 1e-4);
  EXPECT_EQ(AsDoubles(result->argmax), std::vector<double>(ref.argmax.begin(), ref.argmax.end()));
  EXPECT_EQ(result->top_k, 5);
  ASSERT_EQ(result->top_k_logprob.size(), static_cast<size_t>(n * 5));
  EXPECT_LE(MaxAbsError(result->top_k_logprob, ref.top_k_logprob), 1e-5 * (1 + ref.max_abs_logit));
  EXPECT_EQ(result->grad_hidden.rows, n);
  EXPECT_EQ(result->grad_hidden.cols, kHidden);
  EXPECT_EQ(result->grad_hidden.head_version, result->summary.head_version);
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
  shifted.outputs = {.token_loss = true, .grad_hidden = true};
  ComputeRequest reference = Fp32Request("shifted", hidden, by_hand);
  reference.outputs = shifted.outputs;
  reference.options.logit_softcap = 0.0;
  const absl::StatusOr<ComputeResult> a = client.Compute(shifted);
  const absl::StatusOr<ComputeResult> b = client.Compute(reference);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->summary.counted_tokens, b->summary.counted_tokens);
  EXPECT_EQ(a->summary.loss, b->summary.loss);
  EXPECT_EQ(a->token_loss, b->token_loss);
  EXPECT_EQ(client::ToFloat32(a->grad_hidden), client::ToFloat32(b->grad_hidden));
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
  request.outputs.grad_hidden = true;
  request.outputs.token_loss = true;
  const absl::StatusOr<ComputeResult> result = client.Compute(request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GE(result->messages_sent, 1 + 16);  // no message above 1 MiB
  EXPECT_GE(result->messages_received, 16);
  EXPECT_GE(result->bytes_sent, n * hidden_size * 4);

  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(hidden, client::ToFloat32(*weight), labels, hidden_size, 0));
  EXPECT_LE(std::abs(result->summary.loss - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(result->token_loss, ref.token_loss), kLossBound);
  EXPECT_LE(RelativeError(client::ToFloat32(result->grad_hidden), ref.grad_hidden), kGradBound);

  // An error in the first rows ends the call while most rows are still unsent: the writer must
  // notice and stop rather than block, and the server's status must come through.
  std::vector<float> poisoned = hidden;
  poisoned[0] = std::numeric_limits<float>::quiet_NaN();
  request.hidden.data = poisoned.data();
  const absl::StatusOr<ComputeResult> failed = client.Compute(request);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(failed.status().message().find("non-finite"), absl::string_view::npos) << failed.status();
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
  EXPECT_NE(result.status().message().find("no-such-head"), absl::string_view::npos) << result.status();

  const std::vector<float> rows = RandomNormal(4 * kHidden, 1.0f, rng_);
  request.head = kHead;
  request.hidden = {rows.data(), client::DType::kFloat32, 4, kHidden};
  request.head_version = 12345;
  result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_NE(result.status().message().find("pinned to version 12345"), absl::string_view::npos)
      << result.status();

  // Caught before anything is sent.
  request.head_version.reset();
  request.labels = absl::MakeConstSpan(labels).subspan(0, 3);
  result = client.Compute(request);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(result.status().message(), "labels: expected 4 entries (hidden.rows), got 3");

  EXPECT_EQ(client.GetHead("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      client.Step({.head = kHead, .optimizer = client::SgdOptions{.learning_rate = -1.0}}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client.SaveCheckpoint().status().code(), absl::StatusCode::kFailedPrecondition);

  ChannelOptions unreachable = OptionsFor(1);  // nothing listens on port 1
  unreachable.deadline = absl::Seconds(5);
  EXPECT_EQ(Connect(unreachable).ListHeads().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ClientTest, BearerTokenIsSentOnEveryCall) {
  const std::filesystem::path token_file =
      std::filesystem::temp_directory_path() / ("lossd-client-token-" + std::to_string(FreshSeed()));
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
  const absl::StatusOr<ComputeResult> result = client.Compute(
      {.head = "secured", .hidden = {hidden.data(), client::DType::kFloat32, 1, 16}, .labels = labels});
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
  const absl::StatusOr<client::Tensor> as_bf16 = client.FetchWeight("roundtrip", client::DType::kBFloat16);
  ASSERT_TRUE(as_bf16.ok()) << as_bf16.status();
  EXPECT_EQ(as_bf16->bytes, client::EncodeFromFloat32(weight, client::DType::kBFloat16));

  // Replacing needs `replace`; the bfloat16 upload is stored as float32 exactly.
  const std::string bf16 = client::EncodeFromFloat32(weight, client::DType::kBFloat16);
  const client::TensorView bf16_view{bf16.data(), client::DType::kBFloat16, vocab, kHidden};
  EXPECT_EQ(client.UploadHead("roundtrip", bf16_view).status().code(), absl::StatusCode::kAlreadyExists);
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
  request.outputs.accumulate_grad_weight = true;
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
  request.outputs.accumulate_grad_weight = false;
  const absl::StatusOr<ComputeResult> after = client.Compute(request);
  ASSERT_TRUE(after.ok());
  EXPECT_LT(after->summary.loss, before->summary.loss);
  EXPECT_EQ(after->summary.head_version, step->head_version);
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
  request.outputs = {.token_loss = true, .grad_hidden = true, .accumulate_grad_weight = true};

  const absl::StatusOr<ComputeResult> first = client.Compute(request);
  const absl::StatusOr<ComputeResult> second = client.Compute(request);
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << " / " << second.status();
  EXPECT_EQ(first->call_id.size(), 32u);
  EXPECT_NE(first->call_id, second->call_id) << "each call gets its own id";
  EXPECT_FALSE(first->summary.replayed || second->summary.replayed);
  EXPECT_EQ(first->attempts, 1);
  EXPECT_EQ(client.GetHead("ids")->accumulated_calls, 2) << "two calls, two ids, two commits";

  request.call_id = first->call_id;
  const absl::StatusOr<ComputeResult> repeat = client.Compute(request);
  ASSERT_TRUE(repeat.ok()) << repeat.status();
  EXPECT_TRUE(repeat->summary.replayed);
  EXPECT_TRUE(repeat->summary.grad_weight_accumulated);
  EXPECT_EQ(repeat->summary.loss, first->summary.loss);
  EXPECT_EQ(repeat->token_loss, first->token_loss);
  EXPECT_EQ(repeat->grad_hidden.bytes, first->grad_hidden.bytes);
  EXPECT_EQ(client.GetHead("ids")->accumulated_calls, 2);

  // A scoring call carries no id: there is nothing to count twice.
  request.call_id.clear();
  request.outputs.accumulate_grad_weight = false;
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
  request.outputs = {.token_loss = true, .grad_hidden = true, .accumulate_grad_weight = true};
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
  EXPECT_TRUE(by_hand->summary.replayed);
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
  EXPECT_TRUE(retried->summary.replayed);
  EXPECT_LE(std::abs(retried->summary.loss - ref.loss) / ref.loss, kLossBound);
  EXPECT_LE(RelativeError(client::ToFloat32(retried->grad_hidden), ref.grad_hidden), kGradBound);
  expect_one_copy("the client's retry");
}

// A server that is not there yet is UNAVAILABLE; the client retries until it answers.
TEST_F(ClientTest, UnavailableIsRetriedWithBackoff) {
  const Client direct = Connect(OptionsFor(server_->port()));
  UploadRandomHead(direct, "unavailable", 300);
  const std::vector<float> hidden = RandomNormal(8 * kHidden, 1.0f, rng_);
  const std::vector<int64_t> labels = RandomLabels(8, 300, 0.0, rng_);
  ComputeRequest request = Fp32Request("unavailable", hidden, labels);
  request.outputs.accumulate_grad_weight = true;

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
// Rows and dL/dh through shared memory (ComputeStart.shared_memory).

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

struct SharedMemoryCase {
  const char* name;
  int64_t rows;
  client::DType hidden_dtype;
  std::optional<client::DType> grad_dtype;
  double ignore_fraction;
};

void PrintTo(const SharedMemoryCase& c, std::ostream* os) { *os << c.name; }

class SharedMemoryTest : public ClientTest, public ::testing::WithParamInterface<SharedMemoryCase> {};

// The same call through messages and through shared memory, on two heads with the same W: every
// output and the accumulated dL/dW agree bit for bit, and with the float64 reference.
TEST_P(SharedMemoryTest, MatchesMessagesBitwiseAndTheReference) {
  const SharedMemoryCase& c = GetParam();
  const Client client = Connect(OptionsFor(server_->port()));
  const std::string by_messages = absl::StrCat("messages-", c.name);
  const std::string by_memory = absl::StrCat("memory-", c.name);
  const std::vector<float> weight = UploadRandomHead(client, by_messages);
  ASSERT_TRUE(client.UploadHead(by_memory, {weight.data(), client::DType::kFloat32, kVocab, kHidden}).ok());
  const std::string hidden_bytes =
      client::EncodeFromFloat32(RandomNormal(c.rows * kHidden, 1.0f, rng_), c.hidden_dtype);
  const std::vector<int64_t> labels = RandomLabels(c.rows, kVocab, c.ignore_fraction, rng_);

  ComputeRequest request;
  request.hidden = {hidden_bytes.data(), c.hidden_dtype, c.rows, kHidden};
  request.labels = labels;
  request.outputs = {.token_loss = true,
                     .logprob = true,
                     .lse = true,
                     .entropy = true,
                     .argmax = true,
                     .top_k = 3,
                     .grad_hidden = true,
                     .grad_hidden_dtype = c.grad_dtype,
                     .accumulate_grad_weight = true};
  request.head = by_messages;
  const absl::StatusOr<ComputeResult> sent = client.Compute(request);
  ASSERT_TRUE(sent.ok()) << sent.status();
  request.head = by_memory;
  request.shared_memory = true;
  const absl::StatusOr<ComputeResult> shared = client.Compute(request);
  ASSERT_TRUE(shared.ok()) << shared.status();

  EXPECT_TRUE(SameBits(shared->summary.loss, sent->summary.loss))
      << shared->summary.loss << " vs " << sent->summary.loss;
  EXPECT_EQ(shared->summary.counted_tokens, sent->summary.counted_tokens);
  EXPECT_EQ(shared->summary.correct_tokens, sent->summary.correct_tokens);
  EXPECT_EQ(shared->token_loss, sent->token_loss);
  EXPECT_EQ(shared->logprob, sent->logprob);
  EXPECT_EQ(shared->lse, sent->lse);
  EXPECT_EQ(shared->entropy, sent->entropy);
  EXPECT_EQ(shared->argmax, sent->argmax);
  EXPECT_EQ(shared->top_k_logprob, sent->top_k_logprob);
  EXPECT_EQ(shared->top_k_token, sent->top_k_token);
  EXPECT_EQ(shared->grad_hidden.dtype, sent->grad_hidden.dtype);
  EXPECT_EQ(shared->grad_hidden.rows, c.rows);
  EXPECT_TRUE(shared->grad_hidden.bytes == sent->grad_hidden.bytes) << "dL/dh differs";
  // Only the start message goes out; dL/dh does not come back in messages.
  EXPECT_EQ(shared->messages_sent, 1);
  if (c.rows > 0) EXPECT_LT(shared->bytes_received, sent->bytes_received);
  const absl::StatusOr<client::Tensor> grad_sent = client.FetchGradWeight(by_messages);
  const absl::StatusOr<client::Tensor> grad_shared = client.FetchGradWeight(by_memory);
  ASSERT_TRUE(grad_sent.ok() && grad_shared.ok());
  EXPECT_TRUE(grad_shared->bytes == grad_sent->bytes) << "dL/dW differs";

  client::Tensor hidden_tensor{hidden_bytes, c.hidden_dtype, c.rows, kHidden};
  const ReferenceResult ref =
      ComputeReference(MakeReferenceProblem(client::ToFloat32(hidden_tensor), weight, labels, kHidden, 3));
  EXPECT_EQ(shared->summary.counted_tokens, ref.counted_tokens);
  if (ref.counted_tokens > 0) {
    EXPECT_LE(std::abs(shared->summary.loss - ref.loss) / ref.loss, kLossBound);
    EXPECT_LE(RelativeError(client::ToFloat32(*grad_shared), ref.grad_weight), kGradBound);
    if (shared->grad_hidden.dtype == client::DType::kFloat32) {
      EXPECT_LE(RelativeError(client::ToFloat32(shared->grad_hidden), ref.grad_hidden), kGradBound);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SharedMemoryTest,
    ::testing::Values(
        // About 80 rows per engine chunk: each chunk reads and writes its own slice of the memfd.
        SharedMemoryCase{"fp32_multi_chunk", 300, client::DType::kFloat32, std::nullopt, 0.1},
        // Rows and dL/dh of different sizes, so the two regions are laid out unequally.
        SharedMemoryCase{"bf16_rows_fp32_grad", 300, client::DType::kBFloat16, client::DType::kFloat32, 0.1},
        SharedMemoryCase{"one_row", 1, client::DType::kFloat32, std::nullopt, 0.0},
        // Nothing counts: dL/dh is all zeros, still written into the memfd.
        SharedMemoryCase{"all_ignored", 50, client::DType::kFloat32, std::nullopt, 1.0},
        // Nothing to map at all.
        SharedMemoryCase{"no_rows", 0, client::DType::kFloat32, std::nullopt, 0.0}),
    [](const ::testing::TestParamInfo<SharedMemoryCase>& info) { return std::string(info.param.name); });

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
  EXPECT_TRUE(std::all_of(target.begin() + bytes, target.end(), [](uint8_t b) { return b == 0xA5; }));
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, ParallelCopyTest,
    ::testing::Values(
        CopyCase{"empty", 0},
        CopyCase{"one_byte", 1},
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
    request.outputs.grad_hidden = true;
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
  request.outputs.grad_hidden = true;
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
}

TEST(SharedMemoryPeerTest, OnlyLoopbackAndUnixPeersAreLocal) {
  EXPECT_TRUE(server::IsLocalPeer("ipv4:127.0.0.1:50051"));
  EXPECT_TRUE(server::IsLocalPeer("ipv4:127.1.2.3:9"));
  EXPECT_TRUE(server::IsLocalPeer("ipv6:[::1]:50051"));
  EXPECT_TRUE(server::IsLocalPeer("ipv6:[::ffff:127.0.0.1]:50051"));
  EXPECT_TRUE(server::IsLocalPeer("unix:/run/lossd.sock"));
  EXPECT_FALSE(server::IsLocalPeer("ipv4:10.0.0.7:50051"));
  EXPECT_FALSE(server::IsLocalPeer("ipv4:128.0.0.1:50051"));  // not 127/8
  EXPECT_FALSE(server::IsLocalPeer("ipv6:[::12]:50051"));      // not ::1
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
}

// The client's conversions, independent code, agree with the engine's half.h bit for bit.
TEST(TensorTest, ConversionsMatchTheEngine) {
  std::string all_halves(2 * 65536, '\0');
  for (uint32_t bits = 0; bits < 65536; ++bits) std::memcpy(&all_halves[2 * bits], &bits, 2);
  const std::vector<float> from_fp16 = client::DecodeToFloat32(all_halves, client::DType::kFloat16);
  const std::vector<float> from_bf16 = client::DecodeToFloat32(all_halves, client::DType::kBFloat16);
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

std::string NpyFile(absl::string_view version_and_length, absl::string_view header, absl::string_view data) {
  return absl::StrCat("\x93NUMPY", version_and_length, header, data);
}

// A version 1.0 file with this header text (padded with a newline) and data.
std::string NpyV1(const std::string& header, absl::string_view data) {
  const std::string text = header + "\n";
  const char length[2] = {static_cast<char>(text.size() & 0xff), static_cast<char>(text.size() >> 8)};
  return NpyFile(absl::StrCat(absl::string_view("\x01\x00", 2), absl::string_view(length, 2)), text, data);
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

  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("lossd-npy-" + std::to_string(FreshSeed()) + ".npy");
  client::NpyArray array{client::NpyDType::kFloat32, {2, 2}, std::string(16, '\x01')};
  ASSERT_TRUE(client::WriteNpyFile(path.string(), array.dtype, array.shape, array.data).ok());
  const absl::StatusOr<client::NpyArray> read = client::ReadNpyFile(path.string());
  std::filesystem::remove(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->data, array.data);
  EXPECT_EQ(client::ReadNpyFile(path.string()).status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(client::SerializeNpy(client::NpyDType::kInt64, {3}, std::string(16, '\0')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, ReadsHeadersAsNumPyWritesThem) {
  // Version 2.0 (4-byte header length), double quotes, other key order, 1-tuples, no trailing comma.
  const std::string header = "{\"shape\": (2,), 'fortran_order': False, 'descr': '<i4'}\n";
  const char length[4] = {static_cast<char>(header.size()), 0, 0, 0};
  const std::string v2 = NpyFile(absl::StrCat(absl::string_view("\x02\x00", 2), absl::string_view(length, 4)),
                                 header, std::string(8, '\x02'));
  const absl::StatusOr<client::NpyArray> parsed = client::ParseNpy(v2, "v2.npy");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->dtype, client::NpyDType::kInt32);
  EXPECT_EQ(parsed->shape, std::vector<int64_t>{2});
  const std::string spaced = NpyV1("{'descr':'<f2','fortran_order':False,'shape':( 1 , 2 , ),}   ", "abcd");
  EXPECT_TRUE(client::ParseNpy(spaced, "spaced.npy").ok()) << client::ParseNpy(spaced, "spaced.npy").status();
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
      {"cut inside the preamble", std::string("\x93NUMPY\x01\x00\x10", 9), absl::StatusCode::kDataLoss},
      {"version 3.0", NpyFile(absl::string_view("\x03\x00\x00\x00\x00\x00", 6), "", ""),
       absl::StatusCode::kInvalidArgument},
      {"header length past the end", NpyFile(absl::string_view("\x01\x00\xff\x00", 4), "{}", ""),
       absl::StatusCode::kDataLoss},
      {"header longer than the limit", NpyFile(absl::string_view("\x02\x00\x00\x00\x01\x00", 6), "", ""),
       absl::StatusCode::kInvalidArgument},
      {"header not a dictionary", NpyV1("['<f4', False, (2,)]", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"missing shape", NpyV1("{'descr': '<f4', 'fortran_order': False}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"unknown key", NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"duplicate key",
       NpyV1("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"big-endian data", NpyV1("{'descr': '>f4', 'fortran_order': False, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"float64 data", NpyV1("{'descr': '<f8', 'fortran_order': False, 'shape': (1,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"Fortran order", NpyV1("{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"fortran_order not a bool", NpyV1("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"negative dimension", NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"shape (2) is not a tuple",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"dimension overflows int64",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"element count overflows",
       NpyV1("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", eight_bytes),
       absl::StatusCode::kInvalidArgument},
      {"bytes overflow",
       NpyV1("{'descr': '<i8', 'fortran_order': False, 'shape': (2305843009213693952,)}", ""),
       absl::StatusCode::kInvalidArgument},
      {"unterminated string", NpyV1("{'descr: '<f4'}", eight_bytes), absl::StatusCode::kInvalidArgument},
      {"text after the dictionary", NpyV1(f4 + " junk", eight_bytes), absl::StatusCode::kInvalidArgument},
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
