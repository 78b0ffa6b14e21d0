// Robustness of a real lossd server on loopback: malformed requests, abandoned and stalled
// streams, many concurrent clients, admission bounds, handlers that fail, authentication and TLS.
// Crash safety of checkpoints is checked against the real binary in
// tests/python/test_crash_safety.py. Figures are recorded as test properties (--gtest_output=xml)
// and summarized in tests/ROBUSTNESS.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/status/grpc_status.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using grpc::StatusCode;
using server::MemoryPurpose;

// The engine's bounds against the float64 reference (engine_test.cc); the server adds no error.
constexpr double kLossBound = 1e-6;
constexpr double kGradBound = 2e-5;

// A whole training call for `batch` as messages: its start, then its rows `rows_per_message` at a
// time.
std::vector<v1::ComputeRequest> TrainingScript(const std::string& head, const Batch& batch,
                                               int64_t hidden_size, int64_t rows_per_message) {
  std::vector<v1::ComputeRequest> script(1);
  *script.front().mutable_start() = StartFor(head, batch, hidden_size, true);
  const std::string rows = FloatBytes(batch.hidden);
  const size_t message_bytes = rows_per_message * hidden_size * sizeof(float);
  for (size_t offset = 0; offset < rows.size(); offset += message_bytes) {
    script.emplace_back();
    script.back().mutable_chunk()->set_hidden(rows.substr(offset, message_bytes));
  }
  return script;
}

// The engine's loss bound relative to the loss or, where training made the loss small next to the
// logits, to the largest logit: fp32 logits carry an error that scales with their magnitude.
bool LossMatches(double actual, const ReferenceResult& ref) {
  return std::abs(actual - ref.loss) <=
         kLossBound * std::max(std::abs(ref.loss), 1.0 + ref.max_abs_logit);
}

std::chrono::system_clock::time_point In(absl::Duration duration) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(duration);
}

// A channel with its own connection (gRPC shares connections between channels to one address
// unless told otherwise), so that dropping it closes that connection.
std::shared_ptr<grpc::Channel> PrivateChannel(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// What calls hold on the server now: workspace, gradient memory (the heads' accumulators plus the
// staging gradients of running training calls), scheduler slots and admitted bytes, and the idle
// call buffers kept for reuse.
struct CallResources {
  int64_t workspace_bytes = 0;
  int64_t gradient_bytes = 0;
  int running = 0;
  int queued = 0;
  int64_t admitted_bytes = 0;
  int64_t cache_bytes = 0;
};

CallResources ReadCallResources(server::LossServer& server) {
  return {server.ledger().current(MemoryPurpose::kWorkspace),
          server.ledger().current(MemoryPurpose::kGradients),
          server.scheduler().running(),
          server.scheduler().queued(),
          server.scheduler().admitted_bytes(),
          server.ledger().current(MemoryPurpose::kCache)};
}

// Whether the server comes to hold nothing for calls beyond the heads' accumulators
// (`accumulator_bytes`) and idle buffers within the compute budget. A call's server side may still
// be unwinding when its client sees the status (a cancelled client sees it at once), so this polls
// for up to kEventually.
::testing::AssertionResult SettlesToIdle(server::LossServer& server, int64_t accumulator_bytes) {
  const absl::Time deadline = absl::Now() + kEventually;
  CallResources state;
  while (true) {
    state = ReadCallResources(server);
    if (state.workspace_bytes == 0 && state.gradient_bytes == accumulator_bytes &&
        state.running == 0 && state.queued == 0 && state.admitted_bytes == 0 &&
        state.cache_bytes <= server.scheduler().capacity_bytes() &&
        state.cache_bytes == server.buffers().idle_bytes()) {
      return ::testing::AssertionSuccess();
    }
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return ::testing::AssertionFailure()
         << "after " << kEventually << " the server still holds workspace " << state.workspace_bytes
         << " B, gradients " << state.gradient_bytes << " B (accumulators: " << accumulator_bytes
         << " B), running " << state.running << ", queued " << state.queued << ", admitted "
         << state.admitted_bytes << " B, idle buffers " << state.cache_bytes << " B (capacity "
         << server.scheduler().capacity_bytes() << " B)";
}

int64_t Total(const std::map<std::string, int64_t>& counts) {
  int64_t total = 0;
  for (const auto& [unused, count] : counts) total += count;
  return total;
}

// Engine chunks computed so far, from the compute-seconds histogram.
int64_t EngineChunksComputed(server::LossServer& server) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name == "lossd_compute_seconds") {
      return static_cast<int64_t>(family.metric.at(0).histogram.sample_count);
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Bad input: every malformed request gets its code and a message naming the field, and changes
// nothing: W, the accumulated gradient, the heads and the server's memory stay as they were.

constexpr char kHead[] = "robust";
constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 32;
constexpr int64_t kRows = 12;
constexpr int64_t kRowsPerMessage = 4;
constexpr uint64_t kHeadVersion = 2;  // the suite's set-up steps the head once
constexpr char kUploadHead[] = "fresh";
constexpr int64_t kUploadVocab = 50;
// Teachers of distill calls beside kHead: one with its vocabulary and another hidden size, one
// whose vocabulary is a token short.
constexpr char kTeacher[] = "teacher";
constexpr char kShortTeacher[] = "teacher_299";
constexpr int64_t kTeacherHidden = 24;
constexpr int kSparseTopK = 4;
constexpr size_t kHeadsAtStart = 3;

enum class Rpc { kCompute, kUpload, kStep, kFetchWeight };

// One valid call of each kind, which a row spoils.
struct Script {
  std::vector<v1::ComputeRequest> compute;    // a training start, then kRows rows in 3 chunks
  std::vector<v1::UploadHeadRequest> upload;  // a new head kUploadHead [50, 32], in 2 pieces
  v1::StepRequest step;                       // SGD on kHead
  v1::FetchTensorRequest fetch;               // W of kHead
};

v1::ComputeStart& StartOf(Script& s) { return *s.compute.front().mutable_start(); }
std::string& ChunkOf(Script& s, size_t message) {
  return *s.compute.at(message).mutable_chunk()->mutable_hidden();
}
v1::UploadHeadStart& UploadStartOf(Script& s) { return *s.upload.front().mutable_start(); }
void SetValue(std::string& rows, int64_t row, int64_t column, float value) {
  std::memcpy(rows.data() + (row * kHidden + column) * sizeof(float), &value, sizeof(float));
}

// Makes the script's call a ppo call with every per-token input it reads: sampling
// log-probabilities, advantages, and (with a KL estimator) reference log-probabilities.
void MakePpo(Script& s, v1::KlEstimator kl = v1::KL_ESTIMATOR_NONE) {
  v1::ComputeStart& start = StartOf(s);
  start.mutable_options()->set_objective(v1::OBJECTIVE_PPO);
  start.mutable_options()->mutable_policy()->set_kl_estimator(kl);
  for (int i = 0; i < kRows; ++i) {
    start.add_sampling_logprobs(-3.0f);
    start.add_advantages(i % 2 == 0 ? 1.0f : -1.0f);
    if (kl != v1::KL_ESTIMATOR_NONE) start.add_reference_logprobs(-3.5f);
  }
}

v1::PolicyOptions& PolicyOf(Script& s) { return *StartOf(s).mutable_options()->mutable_policy(); }

v1::DistillOptions& DistillOf(Script& s) {
  return *StartOf(s).mutable_options()->mutable_distill();
}
v1::ComputeChunk& MessageOf(Script& s, size_t message) {
  return *s.compute.at(message).mutable_chunk();
}

// Makes the script's call a distill call against kTeacher, a JSD with a quarter of cross-entropy:
// every message carries the teacher's rows (0.25 each) for its rows.
void MakeDistill(Script& s) {
  v1::ComputeStart& start = StartOf(s);
  start.mutable_options()->set_objective(v1::OBJECTIVE_DISTILL);
  DistillOf(s).set_beta(0.5);
  DistillOf(s).set_alpha(0.25);
  start.set_teacher_head(kTeacher);
  start.set_teacher_hidden_size(kTeacherHidden);
  const std::vector<float> rows(kRowsPerMessage * kTeacherHidden, 0.25f);
  for (size_t m = 1; m < s.compute.size(); ++m) {
    MessageOf(s, m).set_teacher_hidden(FloatBytes(rows));
  }
}

// Makes it a distill call against a sparse teacher: tokens 3r, 3r + 1, ... of row r with
// probability 0.2 each, in every message.
void MakeSparse(Script& s) {
  v1::ComputeStart& start = StartOf(s);
  start.mutable_options()->set_objective(v1::OBJECTIVE_DISTILL);
  start.set_teacher_top_k(kSparseTopK);
  for (size_t m = 1; m < s.compute.size(); ++m) {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    for (int64_t r = 0; r < kRowsPerMessage; ++r) {
      for (int j = 0; j < kSparseTopK; ++j) {
        tokens.push_back(static_cast<int32_t>(3 * ((m - 1) * kRowsPerMessage + r) + j));
        logprobs.push_back(std::log(0.2f));
      }
    }
    MessageOf(s, m).set_teacher_top_k_tokens(
        std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4));
    MessageOf(s, m).set_teacher_top_k_logprobs(FloatBytes(logprobs));
  }
}

// Sets entry j of row r (of the call) in a sparse teacher's field.
template <typename T>
void SetSparse(Script& s, bool tokens, int64_t row, int j, T value) {
  v1::ComputeChunk& chunk = MessageOf(s, 1 + row / kRowsPerMessage);
  std::string& field =
      tokens ? *chunk.mutable_teacher_top_k_tokens() : *chunk.mutable_teacher_top_k_logprobs();
  std::memcpy(field.data() + ((row % kRowsPerMessage) * kSparseTopK + j) * 4, &value, 4);
}

struct BadRow {
  const char* name;
  const char* why;
  Rpc rpc;
  StatusCode code;
  const char* field;  // the message must contain it
  void (*spoil)(Script&);
};

void PrintTo(const BadRow& row, std::ostream* os) { *os << row.name; }

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;

const BadRow kBadRows[] = {
    // Compute: the order and shape of the stream.
    {"chunk_before_start", "rows arrive before any ComputeStart", Rpc::kCompute, kInvalid, "start",
     [](Script& s) { s.compute.erase(s.compute.begin()); }},
    {"start_twice", "a second ComputeStart right after the first", Rpc::kCompute, kInvalid, "start",
     [](Script& s) { s.compute.insert(s.compute.begin() + 1, s.compute.front()); }},
    {"duplicate_start_mid_stream", "a ComputeStart between chunks", Rpc::kCompute, kInvalid, "start",
     [](Script& s) { s.compute.insert(s.compute.begin() + 2, s.compute.front()); }},
    {"empty_stream", "half-closed without a message", Rpc::kCompute, kInvalid, "start",
     [](Script& s) { s.compute.clear(); }},
    {"start_without_rows", "12 tokens declared, none sent", Rpc::kCompute, kInvalid, "chunk.hidden",
     [](Script& s) { s.compute.resize(1); }},
    {"truncated_row", "a message ends 3 bytes into a row", Rpc::kCompute, kInvalid, "chunk.hidden",
     [](Script& s) { ChunkOf(s, 1).resize(ChunkOf(s, 1).size() - 3); }},
    {"stray_byte", "one byte past whole rows", Rpc::kCompute, kInvalid, "chunk.hidden",
     [](Script& s) { ChunkOf(s, 2).push_back('\0'); }},
    {"missing_rows", "the stream ends a message early", Rpc::kCompute, kInvalid, "chunk.hidden",
     [](Script& s) { s.compute.pop_back(); }},
    {"extra_row", "one row more than num_tokens", Rpc::kCompute, kInvalid, "chunk.hidden",
     [](Script& s) { ChunkOf(s, 3).append(kHidden * sizeof(float), '\0'); }},
    {"fp32_bytes_declared_bf16", "float32 rows sent as bfloat16 are twice the rows", Rpc::kCompute,
     kInvalid, "chunk.hidden", [](Script& s) { StartOf(s).set_hidden_dtype(v1::DTYPE_BFLOAT16); }},
    // Compute: the start message, field by field.
    {"unknown_head", "no head of that name", Rpc::kCompute, StatusCode::NOT_FOUND, "head",
     [](Script& s) { StartOf(s).set_head("missing"); }},
    {"empty_head", "the head must be named", Rpc::kCompute, StatusCode::NOT_FOUND, "head",
     [](Script& s) { StartOf(s).set_head(""); }},
    {"stale_pinned_version", "pinned to version 1, which the head has left",
     Rpc::kCompute, StatusCode::FAILED_PRECONDITION, "head_version",
     [](Script& s) { StartOf(s).set_head_version(kHeadVersion - 1); }},
    {"future_pinned_version", "pinned to a version the head never had", Rpc::kCompute,
     StatusCode::FAILED_PRECONDITION, "head_version",
     [](Script& s) { StartOf(s).set_head_version(kHeadVersion + 1000); }},
    {"num_tokens_negative", "a negative row count", Rpc::kCompute, kInvalid, "num_tokens",
     [](Script& s) { StartOf(s).set_num_tokens(-1); }},
    {"num_tokens_1e12", "a trillion rows, far over the per-call limit", Rpc::kCompute, kInvalid,
     "num_tokens", [](Script& s) { StartOf(s).set_num_tokens(1'000'000'000'000); }},
    {"hidden_size_mismatch", "H differs from the head's", Rpc::kCompute, kInvalid, "hidden_size",
     [](Script& s) { StartOf(s).set_hidden_size(kHidden + 1); }},
    {"hidden_size_huge", "2^40 columns", Rpc::kCompute, kInvalid, "hidden_size",
     [](Script& s) { StartOf(s).set_hidden_size(int64_t{1} << 40); }},
    {"hidden_dtype_unspecified", "the dtype must be said", Rpc::kCompute, kInvalid, "hidden_dtype",
     [](Script& s) { StartOf(s).set_hidden_dtype(v1::DTYPE_UNSPECIFIED); }},
    {"hidden_dtype_7", "an enum value the contract does not define", Rpc::kCompute, kInvalid,
     "hidden_dtype", [](Script& s) { StartOf(s).set_hidden_dtype(static_cast<v1::DType>(7)); }},
    {"labels_one_short", "one label fewer than num_tokens", Rpc::kCompute, kInvalid, "labels",
     [](Script& s) { StartOf(s).mutable_labels()->RemoveLast(); }},
    {"labels_one_extra", "one label more than num_tokens", Rpc::kCompute, kInvalid, "labels",
     [](Script& s) { StartOf(s).add_labels(0); }},
    {"label_vocab_size", "the first id past the vocabulary", Rpc::kCompute, kInvalid, "labels[5]",
     [](Script& s) { StartOf(s).set_labels(5, kVocab); }},
    {"label_minus_one", "negative, and not the default ignore_index -100", Rpc::kCompute, kInvalid,
     "labels[5]", [](Script& s) { StartOf(s).set_labels(5, -1); }},
    {"label_default_ignore_under_other_ignore", "-100 is no longer ignored with ignore_index -1",
     Rpc::kCompute, kInvalid, "labels[5]",
     [](Script& s) {
       StartOf(s).mutable_options()->set_ignore_index(-1);
       StartOf(s).set_labels(5, -100);
     }},
    {"label_int64_min", "the most negative id", Rpc::kCompute, kInvalid, "labels[5]",
     [](Script& s) { StartOf(s).set_labels(5, std::numeric_limits<int64_t>::min()); }},
    {"token_weights_count", "weights are all or nothing", Rpc::kCompute, kInvalid, "token_weights",
     [](Script& s) { StartOf(s).add_token_weights(1.0f); }},
    {"token_weight_nan", "a NaN weight", Rpc::kCompute, kInvalid, "token_weights[2]",
     [](Script& s) {
       for (int i = 0; i < kRows; ++i) StartOf(s).add_token_weights(i == 2 ? std::nanf("") : 1.0f);
     }},
    {"token_weight_inf", "an infinite weight", Rpc::kCompute, kInvalid, "token_weights[2]",
     [](Script& s) {
       for (int i = 0; i < kRows; ++i) StartOf(s).add_token_weights(i == 2 ? INFINITY : 1.0f);
     }},
    {"reduction_9", "an enum value the contract does not define", Rpc::kCompute, kInvalid,
     "options.reduction",
     [](Script& s) { StartOf(s).mutable_options()->set_reduction(static_cast<v1::Reduction>(9)); }},
    {"label_smoothing_negative", "smoothing below 0", Rpc::kCompute, kInvalid,
     "options.label_smoothing",
     [](Script& s) { StartOf(s).mutable_options()->set_label_smoothing(-1); }},
    {"label_smoothing_2", "smoothing above 1", Rpc::kCompute, kInvalid, "options.label_smoothing",
     [](Script& s) { StartOf(s).mutable_options()->set_label_smoothing(2); }},
    {"label_smoothing_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid,
     "options.label_smoothing",
     [](Script& s) { StartOf(s).mutable_options()->set_label_smoothing(kNaN); }},
    {"temperature_0", "division by zero", Rpc::kCompute, kInvalid, "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(0); }},
    {"temperature_negative", "flips the logits", Rpc::kCompute, kInvalid, "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(-1); }},
    {"temperature_inf", "flattens every logit to 0", Rpc::kCompute, kInvalid, "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(kInf); }},
    {"temperature_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid,
     "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(kNaN); }},
    {"z_loss_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid, "options.z_loss_scale",
     [](Script& s) { StartOf(s).mutable_options()->set_z_loss_scale(kNaN); }},
    {"z_loss_negative", "rewards large logits", Rpc::kCompute, kInvalid, "options.z_loss_scale",
     [](Script& s) { StartOf(s).mutable_options()->set_z_loss_scale(-1); }},
    {"softcap_negative", "a cap of -3", Rpc::kCompute, kInvalid, "options.logit_softcap",
     [](Script& s) { StartOf(s).mutable_options()->set_logit_softcap(-3); }},
    {"softcap_inf", "an infinite cap", Rpc::kCompute, kInvalid, "options.logit_softcap",
     [](Script& s) { StartOf(s).mutable_options()->set_logit_softcap(kInf); }},
    {"shifted_sequence_length_negative", "-1 and one more row than the call has make num_tokens",
     Rpc::kCompute, kInvalid, "sequence_lengths[0]",
     [](Script& s) {
       StartOf(s).set_shift_labels(true);
       for (int64_t length : {int64_t{-1}, kRows + 1}) StartOf(s).add_sequence_lengths(length);
     }},
    {"shifted_sequence_lengths_short", "one row left out of the shifted sequences", Rpc::kCompute,
     kInvalid, "sequence_lengths",
     [](Script& s) {
       StartOf(s).set_shift_labels(true);
       StartOf(s).add_sequence_lengths(kRows - 1);
     }},
    {"shifted_sequence_lengths_int64_max", "a length that overflows the sum", Rpc::kCompute,
     kInvalid, "sequence_lengths[1]",
     [](Script& s) {
       StartOf(s).set_shift_labels(true);
       StartOf(s).add_sequence_lengths(1);
       StartOf(s).add_sequence_lengths(std::numeric_limits<int64_t>::max());
     }},
    {"grad_scale_inf", "an infinite upstream gradient", Rpc::kCompute, kInvalid,
     "options.grad_scale", [](Script& s) { StartOf(s).mutable_options()->set_grad_scale(kInf); }},
    {"grad_scale_nan", "a NaN upstream gradient", Rpc::kCompute, kInvalid, "options.grad_scale",
     [](Script& s) { StartOf(s).mutable_options()->set_grad_scale(kNaN); }},
    // Options fp32 cannot carry: refused up front, naming the option, not left to fail later on
    // the hidden states or silently changed.
    {"softcap_1e_minus_300", "rounds to 0 in fp32, which would turn the cap off", Rpc::kCompute,
     kInvalid, "options.logit_softcap",
     [](Script& s) { StartOf(s).mutable_options()->set_logit_softcap(1e-300); }},
    {"softcap_1e39", "Inf in fp32", Rpc::kCompute, kInvalid, "options.logit_softcap",
     [](Script& s) { StartOf(s).mutable_options()->set_logit_softcap(1e39); }},
    {"temperature_1e_minus_45", "1 / T is Inf in fp32", Rpc::kCompute, kInvalid,
     "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(1e-45); }},
    {"temperature_1e39", "T is Inf in fp32", Rpc::kCompute, kInvalid, "options.temperature",
     [](Script& s) { StartOf(s).mutable_options()->set_temperature(1e39); }},
    {"z_loss_1e39", "Inf in fp32", Rpc::kCompute, kInvalid, "options.z_loss_scale",
     [](Script& s) { StartOf(s).mutable_options()->set_z_loss_scale(1e39); }},
    {"grad_scale_1e39", "Inf in fp32", Rpc::kCompute, kInvalid, "options.grad_scale",
     [](Script& s) { StartOf(s).mutable_options()->set_grad_scale(1e39); }},
    {"mean_denominator_1e_minus_300", "grad_scale / D is Inf in fp32", Rpc::kCompute, kInvalid,
     "mean_denominator",
     [](Script& s) { StartOf(s).mutable_options()->set_mean_denominator(1e-300); }},
    {"mean_denominator_negative", "a denominator of -1", Rpc::kCompute, kInvalid,
     "options.mean_denominator",
     [](Script& s) { StartOf(s).mutable_options()->set_mean_denominator(-1); }},
    {"mean_denominator_inf", "an infinite denominator", Rpc::kCompute, kInvalid,
     "options.mean_denominator",
     [](Script& s) { StartOf(s).mutable_options()->set_mean_denominator(kInf); }},
    {"top_k_negative", "k of -1", Rpc::kCompute, kInvalid, "outputs.top_k",
     [](Script& s) { StartOf(s).mutable_outputs()->set_top_k(-1); }},
    {"top_k_65", "one above the largest k offered", Rpc::kCompute, kInvalid, "outputs.top_k",
     [](Script& s) { StartOf(s).mutable_outputs()->set_top_k(65); }},
    {"grad_hidden_dtype_7", "an enum value the contract does not define", Rpc::kCompute, kInvalid,
     "outputs.grad_hidden_dtype",
     [](Script& s) {
       StartOf(s).mutable_outputs()->set_grad_hidden_dtype(static_cast<v1::DType>(7));
     }},
    {"call_id_65_chars", "one character past the longest call id", Rpc::kCompute, kInvalid,
     "call_id", [](Script& s) { StartOf(s).set_call_id(std::string(65, 'c')); }},
    {"call_id_space", "ids are printable ASCII without spaces, safe to quote in messages",
     Rpc::kCompute, kInvalid, "call_id", [](Script& s) { StartOf(s).set_call_id("step 1"); }},
    {"call_id_nul", "a NUL byte in the id", Rpc::kCompute, kInvalid, "call_id",
     [](Script& s) { StartOf(s).set_call_id(std::string("a\0b", 3)); }},
    // Compute: the objectives, their options and their per-token inputs.
    {"objective_9", "an enum value the contract does not define", Rpc::kCompute, kInvalid,
     "options.objective",
     [](Script& s) { StartOf(s).mutable_options()->set_objective(static_cast<v1::Objective>(9)); }},
    {"ppo_without_sampling_logprobs", "ppo reads q_i and none came", Rpc::kCompute, kInvalid,
     "sampling_logprobs",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).clear_sampling_logprobs();
     }},
    {"ppo_without_advantages", "ppo reads A_i and none came", Rpc::kCompute, kInvalid,
     "advantages",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).clear_advantages();
     }},
    {"sampling_logprobs_one_short", "one entry fewer than num_tokens", Rpc::kCompute, kInvalid,
     "sampling_logprobs",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_sampling_logprobs()->RemoveLast();
     }},
    {"advantages_one_extra", "one entry more than num_tokens", Rpc::kCompute, kInvalid,
     "advantages",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).add_advantages(1.0f);
     }},
    {"advantage_nan", "a NaN advantage on a counted row", Rpc::kCompute, kInvalid, "advantages[3]",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).set_advantages(3, std::nanf(""));
     }},
    {"sampling_logprob_inf", "an infinite sampling log-probability", Rpc::kCompute, kInvalid,
     "sampling_logprobs[7]",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).set_sampling_logprobs(7, -INFINITY);
     }},
    {"ratio_overflows", "q = -1000 puts exp(logp - q) past any double", Rpc::kCompute, kInvalid,
     "sampling_logprobs",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_IMPORTANCE_SAMPLING);
       StartOf(s).set_sampling_logprobs(kRows - 1, -1000.0f);
     }},
    {"ratio_overflows_under_dual_clip", "q = -300: the dual-clip bound keeps the term finite, but "
     "r = e^(logp + 300) is Inf in fp32 and would be answered", Rpc::kCompute, kInvalid,
     "sampling_logprobs[10] = -300",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_dual_clip(3.0);
       StartOf(s).set_advantages(10, -1.0f);
       StartOf(s).set_sampling_logprobs(10, -300.0f);
     }},
    {"ratio_overflows_clipped_ppo", "q = -300 with A > 0: the clipped term is finite, r is not",
     Rpc::kCompute, kInvalid, "sampling_logprobs[10] = -300",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).set_sampling_logprobs(10, -300.0f);
     }},
    {"ratio_overflows_cispo", "q = -300 under cispo: a clipped weight, an Inf ratio",
     Rpc::kCompute, kInvalid, "sampling_logprobs[10] = -300",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_CISPO);
       StartOf(s).set_sampling_logprobs(10, -300.0f);
     }},
    {"ratio_overflows_zero_advantage", "q = -300 with A = 0 under importance sampling: a term of "
     "0 * Inf", Rpc::kCompute, kInvalid, "sampling_logprobs[10] = -300",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_IMPORTANCE_SAMPLING);
       StartOf(s).set_advantages(10, 0.0f);
       StartOf(s).set_sampling_logprobs(10, -300.0f);
     }},
    {"log_ratio_clamp_negative", "a clamp of -20", Rpc::kCompute, kInvalid,
     "policy.log_ratio_clamp",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_log_ratio_clamp(-20.0);
     }},
    {"log_ratio_clamp_100", "e^100 is Inf in fp32", Rpc::kCompute, kInvalid,
     "policy.log_ratio_clamp",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_log_ratio_clamp(100.0);
     }},
    {"log_ratio_clamp_under_cross_entropy", "cross-entropy has no ratio", Rpc::kCompute, kInvalid,
     "policy.log_ratio_clamp", [](Script& s) { PolicyOf(s).set_log_ratio_clamp(20.0); }},
    {"advantages_under_cross_entropy", "an input the objective does not read is refused",
     Rpc::kCompute, kInvalid, "advantages",
     [](Script& s) {
       for (int i = 0; i < kRows; ++i) StartOf(s).add_advantages(1.0f);
     }},
    {"logprob_gradient_without_grads", "the custom objective reads dL/dlogp and none came",
     Rpc::kCompute, kInvalid, "logprob_grads",
     [](Script& s) {
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_LOGPROB_GRADIENT);
     }},
    {"kl_without_reference_logprobs", "a KL estimator reads the reference's log-probabilities",
     Rpc::kCompute, kInvalid, "reference_logprobs",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K3);
       StartOf(s).clear_reference_logprobs();
     }},
    {"reference_logprob_nan", "a NaN reference log-probability", Rpc::kCompute, kInvalid,
     "reference_logprobs[0]",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K1);
       StartOf(s).set_reference_logprobs(0, std::nanf(""));
     }},
    {"kl_coef_without_estimator", "a KL penalty needs an estimator", Rpc::kCompute, kInvalid,
     "options.policy.kl_estimator",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_kl_coef(0.1);
     }},
    {"kl_estimator_7", "an enum value the contract does not define", Rpc::kCompute, kInvalid,
     "options.policy.kl_estimator",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_kl_estimator(static_cast<v1::KlEstimator>(7));
     }},
    {"kl_coef_negative", "rewards moving away from the reference", Rpc::kCompute, kInvalid,
     "options.policy.kl_coef",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K2);
       PolicyOf(s).set_kl_coef(-0.1);
     }},
    {"clip_low_negative", "1 - eps_low above 1", Rpc::kCompute, kInvalid, "options.policy.clip_low",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_clip_low(-0.2);
     }},
    {"clip_low_1_5", "a negative lower ratio bound", Rpc::kCompute, kInvalid,
     "options.policy.clip_low",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_clip_low(1.5);
     }},
    {"clip_high_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid,
     "options.policy.clip_high",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_clip_high(kNaN);
     }},
    {"dual_clip_0_5", "a dual-clip bound must exceed 1", Rpc::kCompute, kInvalid,
     "options.policy.dual_clip",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_dual_clip(0.5);
     }},
    {"dual_clip_under_cispo", "dual clip is ppo's alone", Rpc::kCompute, kInvalid,
     "options.policy.dual_clip",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_CISPO);
       PolicyOf(s).set_dual_clip(3.0);
     }},
    {"entropy_coef_inf", "an infinite entropy bonus", Rpc::kCompute, kInvalid,
     "options.policy.entropy_coef",
     [](Script& s) { PolicyOf(s).set_entropy_coef(kInf); }},
    {"label_smoothing_under_ppo", "smoothing is cross-entropy's alone", Rpc::kCompute, kInvalid,
     "options.label_smoothing",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_label_smoothing(0.1);
     }},
    {"sequence_reduction_without_lengths", "a sequence mean needs the sequences", Rpc::kCompute,
     kInvalid, "sequence_lengths",
     [](Script& s) {
       StartOf(s).mutable_options()->set_reduction(v1::REDUCTION_SEQUENCE_MEAN_TOKEN_SUM);
     }},
    {"sequence_lengths_short", "lengths summing to 11 of 12 rows", Rpc::kCompute, kInvalid,
     "sequence_lengths",
     [](Script& s) {
       StartOf(s).mutable_options()->set_reduction(v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN);
       for (int64_t length : {5, 6}) StartOf(s).add_sequence_lengths(length);
     }},
    {"sequence_length_zero", "an empty sequence", Rpc::kCompute, kInvalid, "sequence_lengths[1]",
     [](Script& s) {
       for (int64_t length : {6, 0, 6}) StartOf(s).add_sequence_lengths(length);
     }},
    {"sequence_length_past_the_batch", "a sequence reaching past num_tokens", Rpc::kCompute,
     kInvalid, "sequence_lengths[1]",
     [](Script& s) {
       for (int64_t length : {6, 7}) StartOf(s).add_sequence_lengths(length);
     }},
    // Compute: rows whose values make the results non-finite, in the last chunk so that earlier
    // chunks were computed and staged.
    {"nan_row", "a NaN hidden value, named by its place in the call", Rpc::kCompute, kInvalid,
     "chunk.hidden[10, 5]: expected a finite float32 value, got nan",
     [](Script& s) { SetValue(ChunkOf(s, 3), 2, 5, std::nanf("")); }},
    {"inf_row", "an infinite hidden value, named by its place in the call", Rpc::kCompute,
     kInvalid, "chunk.hidden[10, 5]: expected a finite float32 value, got inf",
     [](Script& s) { SetValue(ChunkOf(s, 3), 2, 5, INFINITY); }},
    {"token_weight_3e38", "finite, but the row's weighted loss overflows fp32: blame the weight",
     Rpc::kCompute, kInvalid, "token_weights[10] = 3e+38: rows [0, 12) of chunk.hidden are finite",
     [](Script& s) {
       for (int i = 0; i < kRows; ++i) StartOf(s).add_token_weights(i == 10 ? 3e38f : 1.0f);
     }},
    {"temperature_overflows_logits", "T = 1e-37 is carried, but 1 / T takes these logits past "
     "fp32: blame the temperature", Rpc::kCompute, kInvalid, "options.temperature = 1e-37",
     [](Script& s) {
       StartOf(s).mutable_options()->set_temperature(1e-37);
       for (int64_t c = 0; c < kHidden; ++c) SetValue(ChunkOf(s, 3), 1, c, 1e3f);
     }},
    {"z_loss_overflows", "a z-loss scale fp32 carries, but s lse^2 is past it: blame the z-loss",
     Rpc::kCompute, kInvalid,
     "options.z_loss_scale = 3e+38: rows [0, 12) of chunk.hidden are finite",
     [](Script& s) { StartOf(s).mutable_options()->set_z_loss_scale(3e38); }},
    {"mean_denominator_overflows_grad", "D = 1e-37 is carried, but grad_scale / D takes dL/dW past "
     "fp32", Rpc::kCompute, kInvalid, "options.mean_denominator = 1e-37",
     [](Script& s) {
       StartOf(s).mutable_options()->set_mean_denominator(1e-37);
       for (int64_t c = 0; c < kHidden; ++c) SetValue(ChunkOf(s, 3), 1, c, 1e3f);
     }},
    {"hidden_3e38_row", "finite rows whose logits overflow fp32 with no option to blame: name the "
     "largest |h|", Rpc::kCompute, kInvalid,
     "chunk.hidden: rows [0, 12) are finite, but their logits h W^T overflow fp32 (the largest |h| "
     "is 3e+38, at chunk.hidden[9, 0]",
     [](Script& s) {
       for (int64_t c = 0; c < kHidden; ++c) SetValue(ChunkOf(s, 3), 1, c, 3e38f);
     }},
    // ... and per-token inputs whose products leave fp32, named rather than the rows.
    {"advantage_3e38", "a clipped PPO term 1.2 A with A = 3e38 overflows: blame the advantage",
     Rpc::kCompute, kInvalid, "advantages[10] = 3e+38",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).set_advantages(10, 3e38f);
       StartOf(s).set_sampling_logprobs(10, -10.0f);  // ratio e^(logp + 10) > 1.2: clipped
     }},
    {"logprob_grad_3e38", "g logp with g = 3e38 overflows: blame dL/dlogp", Rpc::kCompute,
     kInvalid, "logprob_grads[10] = 3e+38",
     [](Script& s) {
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_LOGPROB_GRADIENT);
       for (int i = 0; i < kRows; ++i) StartOf(s).add_logprob_grads(i == 10 ? 3e38f : 0.5f);
     }},
    {"k3_reference_plus_1000", "k3's e^(logp_ref - logp) overflows: blame the reference",
     Rpc::kCompute, kInvalid, "reference_logprobs[10] = 1000 (under k3)",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K3);
       PolicyOf(s).set_kl_coef(0.1);
       StartOf(s).set_reference_logprobs(10, 1000.0f);
     }},
    {"teacher_rows_3e38", "finite teacher rows whose logits overflow: blame the teacher's rows",
     Rpc::kCompute, kInvalid,
     "chunk.teacher_hidden: rows [0, 12) are finite, but the teacher's logits overflow fp32 (the "
     "largest |h| of the teacher's rows is 3e+38, at chunk.teacher_hidden[10, 0]",
     [](Script& s) {
       MakeDistill(s);
       std::string& rows = *MessageOf(s, 3).mutable_teacher_hidden();
       const float big = 3e38f;
       for (int64_t c = 0; c < kTeacherHidden; ++c) {
         rows.replace((2 * kTeacherHidden + c) * sizeof(float), sizeof(float),
                      reinterpret_cast<const char*>(&big), sizeof(float));
       }
     }},
    {"inf_under_softcap", "the cap keeps the logits finite, but dL/dW = 0 * Inf is NaN",
     Rpc::kCompute, kInvalid, "an Inf in chunk.hidden under options.logit_softcap = 30",
     [](Script& s) {
       StartOf(s).mutable_options()->set_logit_softcap(30);
       SetValue(ChunkOf(s, 3), 2, 5, INFINITY);
     }},
    // Compute: distillation, its teacher, options and rows.
    {"teacher_unknown", "no teacher head of that name", Rpc::kCompute, StatusCode::NOT_FOUND,
     "teacher_head",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_head("missing");
     }},
    {"teacher_vocabulary_mismatch", "a teacher a token short: both heads named with their V",
     Rpc::kCompute, kInvalid,
     "teacher_head: expected a head with the vocabulary of head 'robust' (V = 300), got head "
     "'teacher_299' with V = 299",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_head(kShortTeacher);
     }},
    {"teacher_hidden_size_mismatch", "the teacher's H, not the student's", Rpc::kCompute, kInvalid,
     "teacher_hidden_size",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_hidden_size(kHidden);
     }},
    {"teacher_hidden_dtype_7", "an enum value the contract does not define", Rpc::kCompute,
     kInvalid, "teacher_hidden_dtype",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_hidden_dtype(static_cast<v1::DType>(7));
     }},
    {"teacher_stale_pinned_version", "pinned to version 2 of a teacher at version 1",
     Rpc::kCompute, StatusCode::FAILED_PRECONDITION, "teacher_head_version",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_head_version(2);
     }},
    {"teacher_rows_one_short", "a message's teacher rows one row fewer than its student rows",
     Rpc::kCompute, kInvalid, "chunk.teacher_hidden",
     [](Script& s) {
       MakeDistill(s);
       std::string& rows = *MessageOf(s, 2).mutable_teacher_hidden();
       rows.resize(rows.size() - kTeacherHidden * sizeof(float));
     }},
    {"teacher_rows_missing", "a message without the teacher's rows", Rpc::kCompute, kInvalid,
     "chunk.teacher_hidden",
     [](Script& s) {
       MakeDistill(s);
       MessageOf(s, 3).clear_teacher_hidden();
     }},
    {"teacher_rows_without_teacher", "teacher rows in a cross-entropy call are refused, not "
     "ignored", Rpc::kCompute, kInvalid, "chunk.teacher_hidden",
     [](Script& s) {
       MessageOf(s, 1).set_teacher_hidden(std::string(kRowsPerMessage * kTeacherHidden * 4, '\0'));
     }},
    {"teacher_row_nan", "a NaN in the teacher's rows, named by its place in the call",
     Rpc::kCompute, kInvalid, "chunk.teacher_hidden[10, 3]: expected a finite float32 value",
     [](Script& s) {
       MakeDistill(s);
       const float nan = std::nanf("");
       MessageOf(s, 3).mutable_teacher_hidden()->replace((2 * kTeacherHidden + 3) * 4, 4,
                                                         reinterpret_cast<const char*>(&nan), 4);
     }},
    {"teacher_with_shared_memory", "teacher rows travel in messages only", Rpc::kCompute, kInvalid,
     "shared_memory",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).mutable_shared_memory()->set_handle(std::string(16, 'h'));
     }},
    {"teacher_under_cross_entropy", "a teacher for an objective that reads none", Rpc::kCompute,
     kInvalid, "teacher_head",
     [](Script& s) { StartOf(s).set_teacher_head(kTeacher); }},
    {"distill_without_teacher", "the distill objective needs a teacher", Rpc::kCompute, kInvalid,
     "teacher_head/teacher_top_k",
     [](Script& s) { StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_DISTILL); }},
    {"teacher_head_and_top_k", "a dense and a sparse teacher at once", Rpc::kCompute, kInvalid,
     "teacher_head/teacher_top_k",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).set_teacher_top_k(4);
     }},
    {"distill_beta_1_5", "past reverse KL", Rpc::kCompute, kInvalid, "options.distill.beta",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_beta(1.5);
     }},
    {"distill_beta_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid,
     "options.distill.beta",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_beta(kNaN);
     }},
    {"distill_alpha_negative", "a negative weight of cross-entropy", Rpc::kCompute, kInvalid,
     "options.distill.alpha",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_alpha(-0.1);
     }},
    {"distill_alpha_1_5", "more than all of the loss", Rpc::kCompute, kInvalid,
     "options.distill.alpha",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_alpha(1.5);
     }},
    {"distill_temperature_0", "tau divides the logits", Rpc::kCompute, kInvalid,
     "options.distill.temperature",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_temperature(0);
     }},
    {"distill_temperature_1e39", "Inf in fp32", Rpc::kCompute, kInvalid,
     "options.distill.temperature",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_temperature(1e39);
     }},
    {"teacher_temperature_inf", "the teacher's own temperature", Rpc::kCompute, kInvalid,
     "options.distill.teacher_temperature",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_teacher_temperature(kInf);
     }},
    {"teacher_softcap_negative", "the teacher's own soft cap", Rpc::kCompute, kInvalid,
     "options.distill.teacher_logit_softcap",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_teacher_logit_softcap(-3);
     }},
    {"distill_options_under_cross_entropy", "a beta where no teacher is read is refused, not "
     "ignored", Rpc::kCompute, kInvalid, "options.distill.beta",
     [](Script& s) { StartOf(s).mutable_options()->mutable_distill()->set_beta(0.5); }},
    {"distill_alpha_without_labels", "alpha > 0 reads the labels, and none came", Rpc::kCompute,
     kInvalid, "labels",
     [](Script& s) {
       MakeDistill(s);
       StartOf(s).clear_labels();
     }},
    {"distill_shift_without_labels", "alpha 0 needs no labels, but there are none to shift",
     Rpc::kCompute, kInvalid, "shift_labels",
     [](Script& s) {
       MakeDistill(s);
       DistillOf(s).set_alpha(0.0);
       StartOf(s).clear_labels();
       StartOf(s).set_shift_labels(true);
     }},
    {"distill_entropy_bonus", "the policy terms are not distillation's", Rpc::kCompute, kInvalid,
     "options.policy.entropy_coef",
     [](Script& s) {
       MakeDistill(s);
       PolicyOf(s).set_entropy_coef(0.01);
     }},
    {"kd_output_under_cross_entropy", "a KD output where no teacher is read", Rpc::kCompute,
     kInvalid, "outputs.kd", [](Script& s) { StartOf(s).mutable_outputs()->set_kd(true); }},
    {"sparse_teacher_mass_9", "an enum value the contract does not define", Rpc::kCompute,
     kInvalid, "options.distill.sparse_teacher_mass",
     [](Script& s) {
       MakeSparse(s);
       DistillOf(s).set_sparse_teacher_mass(static_cast<v1::SparseTeacherMass>(9));
     }},
    {"sparse_top_k_301", "k past the vocabulary", Rpc::kCompute, kInvalid, "teacher_top_k",
     [](Script& s) {
       MakeSparse(s);
       StartOf(s).set_teacher_top_k(301);
     }},
    {"sparse_tokens_one_short", "a message's top-k ids a row short", Rpc::kCompute, kInvalid,
     "chunk.teacher_top_k_tokens",
     [](Script& s) {
       MakeSparse(s);
       std::string& tokens = *MessageOf(s, 2).mutable_teacher_top_k_tokens();
       tokens.resize(tokens.size() - kSparseTopK * 4);
     }},
    {"sparse_token_past_vocabulary", "an id of 300, named by row and rank", Rpc::kCompute,
     kInvalid, "chunk.teacher_top_k_tokens[9, 1]",
     [](Script& s) {
       MakeSparse(s);
       SetSparse<int32_t>(s, true, 9, 1, static_cast<int32_t>(kVocab));
     }},
    {"sparse_token_repeated", "an id twice in one row would count its mass twice", Rpc::kCompute,
     kInvalid, "chunk.teacher_top_k_tokens[5, 0]",
     [](Script& s) {
       MakeSparse(s);
       SetSparse<int32_t>(s, true, 5, 3, 15);  // row 5 holds 15, 16, 17, 18
     }},
    {"sparse_logprob_positive", "a probability above 1", Rpc::kCompute, kInvalid,
     "chunk.teacher_top_k_logprobs[7, 2]",
     [](Script& s) {
       MakeSparse(s);
       SetSparse<float>(s, false, 7, 2, 0.5f);
     }},
    {"sparse_logprob_nan", "NaN passes naive range checks", Rpc::kCompute, kInvalid,
     "chunk.teacher_top_k_logprobs[0, 0]",
     [](Script& s) {
       MakeSparse(s);
       SetSparse<float>(s, false, 0, 0, std::nanf(""));
     }},
    {"sparse_mass_past_one", "probabilities 0.2, 0.2, 0.2, 0.9: not a distribution's",
     Rpc::kCompute, kInvalid, "chunk.teacher_top_k_logprobs[11]",
     [](Script& s) {
       MakeSparse(s);
       SetSparse<float>(s, false, 11, 3, std::log(0.9f));
     }},
    {"sparse_reverse_kl_renormalized", "zero probabilities make KL(q || p) infinite",
     Rpc::kCompute, kInvalid, "options.distill.beta",
     [](Script& s) {
       MakeSparse(s);
       DistillOf(s).set_beta(1.0);
     }},
    {"sparse_with_teacher_temperature", "a sparse teacher's log-probabilities are final",
     Rpc::kCompute, kInvalid, "options.distill.teacher_logit_softcap/teacher_temperature",
     [](Script& s) {
       MakeSparse(s);
       DistillOf(s).set_teacher_temperature(2.0);
     }},
    {"grad_scale_overflow", "finite logits, but grad_scale 1e38 overflows dL/dW to Inf",
     Rpc::kCompute, kInvalid,
     "dL/dW has non-finite values in fp32, from options.grad_scale = 1e+38",
     [](Script& s) {
       StartOf(s).mutable_options()->set_grad_scale(1e38);
       for (size_t m = 1; m < s.compute.size(); ++m) {
         std::string& rows = ChunkOf(s, m);
         for (int64_t r = 0; r < kRowsPerMessage; ++r) SetValue(rows, r, 0, 1e4f);
       }
     }},
    // UploadHead.
    {"upload_onto_existing_head", "replacing a head must be asked for", Rpc::kUpload,
     StatusCode::ALREADY_EXISTS, "head", [](Script& s) { UploadStartOf(s).set_head(kHead); }},
    {"upload_name_empty", "a head needs a name", Rpc::kUpload, kInvalid, "head",
     [](Script& s) { UploadStartOf(s).set_head(""); }},
    {"upload_name_parent_path", "\"../x\" would escape the checkpoint directory", Rpc::kUpload,
     kInvalid, "head", [](Script& s) { UploadStartOf(s).set_head("../x"); }},
    {"upload_name_200_chars", "longer than a checkpoint file name allows", Rpc::kUpload, kInvalid,
     "head", [](Script& s) { UploadStartOf(s).set_head(std::string(200, 'h')); }},
    {"upload_name_nul", "a NUL byte in the name", Rpc::kUpload, kInvalid, "head",
     [](Script& s) { UploadStartOf(s).set_head(std::string("a\0b", 3)); }},
    {"upload_softcap_negative", "a head's soft cap of -30", Rpc::kUpload, kInvalid, "logit_softcap",
     [](Script& s) { UploadStartOf(s).set_logit_softcap(-30); }},
    {"upload_softcap_nan", "NaN passes naive range checks", Rpc::kUpload, kInvalid, "logit_softcap",
     [](Script& s) { UploadStartOf(s).set_logit_softcap(kNaN); }},
    {"upload_softcap_1e_minus_300", "0 in fp32: the head would refuse its own default calls",
     Rpc::kUpload, kInvalid, "logit_softcap: expected 0 (off) or a value in",
     [](Script& s) { UploadStartOf(s).set_logit_softcap(1e-300); }},
    {"upload_softcap_1e39", "Inf in fp32", Rpc::kUpload, kInvalid,
     "logit_softcap: expected 0 (off) or a value in",
     [](Script& s) { UploadStartOf(s).set_logit_softcap(1e39); }},
    {"upload_vocab_zero", "an empty head", Rpc::kUpload, kInvalid, "vocab_size",
     [](Script& s) { UploadStartOf(s).set_vocab_size(0); }},
    {"upload_hidden_negative", "a negative H", Rpc::kUpload, kInvalid, "hidden_size",
     [](Script& s) { UploadStartOf(s).set_hidden_size(-32); }},
    {"upload_sizes_1e12", "10^24 elements", Rpc::kUpload, StatusCode::RESOURCE_EXHAUSTED,
     "vocab_size",
     [](Script& s) {
       UploadStartOf(s).set_vocab_size(1'000'000'000'000);
       UploadStartOf(s).set_hidden_size(1'000'000'000'000);
     }},
    {"upload_product_wraps_to_zero", "2^32 x 2^32 is 0 in int64 arithmetic", Rpc::kUpload,
     StatusCode::RESOURCE_EXHAUSTED, "vocab_size",
     [](Script& s) {
       UploadStartOf(s).set_vocab_size(int64_t{1} << 32);
       UploadStartOf(s).set_hidden_size(int64_t{1} << 32);
     }},
    {"upload_product_wraps_negative", "2^32 x (2^31 + 1) is negative in int64 arithmetic",
     Rpc::kUpload, StatusCode::RESOURCE_EXHAUSTED, "vocab_size",
     [](Script& s) {
       UploadStartOf(s).set_vocab_size(int64_t{1} << 32);
       UploadStartOf(s).set_hidden_size((int64_t{1} << 31) + 1);
     }},
    {"upload_dtype_unspecified", "the bytes' dtype must be said", Rpc::kUpload, kInvalid, "dtype",
     [](Script& s) { UploadStartOf(s).set_dtype(v1::DTYPE_UNSPECIFIED); }},
    {"upload_dtype_7", "an enum value the contract does not define", Rpc::kUpload, kInvalid,
     "dtype", [](Script& s) { UploadStartOf(s).set_dtype(static_cast<v1::DType>(7)); }},
    {"upload_storage_dtype_9", "an enum value the contract does not define", Rpc::kUpload,
     kInvalid, "storage_dtype",
     [](Script& s) { UploadStartOf(s).set_storage_dtype(static_cast<v1::DType>(9)); }},
    {"upload_more_bytes", "one float more than V x H", Rpc::kUpload, kInvalid, "weight",
     [](Script& s) { s.upload.back().mutable_weight()->append(4, '\0'); }},
    {"upload_fewer_bytes", "the last piece is missing", Rpc::kUpload, kInvalid, "weight",
     [](Script& s) { s.upload.pop_back(); }},
    {"upload_partial_float", "one byte short of V x H floats", Rpc::kUpload, kInvalid, "weight",
     [](Script& s) { s.upload.back().mutable_weight()->pop_back(); }},
    {"upload_nan_weight", "a NaN in W would fail every later call on the head", Rpc::kUpload,
     kInvalid, "weight[",
     [](Script& s) {
       const float nan = std::numeric_limits<float>::quiet_NaN();
       s.upload.back().mutable_weight()->replace(8, 4, reinterpret_cast<const char*>(&nan), 4);
     }},
    {"upload_overflows_float16", "finite in the float32 sent, 1e5 is Inf in float16 storage",
     Rpc::kUpload, kInvalid, "weight[25, 2]: expected a finite float16 value, got inf",
     [](Script& s) {
       UploadStartOf(s).set_storage_dtype(v1::DTYPE_FLOAT16);
       const float large = 1e5f;
       s.upload.back().mutable_weight()->replace(8, 4, reinterpret_cast<const char*>(&large), 4);
     }},
    {"upload_replace_with_inf", "a same-shape replacement takes another path into the head",
     Rpc::kUpload, kInvalid, "weight[299, 31]: expected a finite float32 value, got inf",
     [](Script& s) {
       UploadStartOf(s).set_head(kHead);
       UploadStartOf(s).set_vocab_size(kVocab);
       UploadStartOf(s).set_replace(true);
       std::vector<float> weight(kVocab * kHidden, 0.5f);
       weight.back() = INFINITY;
       s.upload.resize(2);
       s.upload.back().set_weight(FloatBytes(weight));
     }},
    {"upload_replace_short", "replacing the test head with too few bytes must not touch it",
     Rpc::kUpload, kInvalid, "weight",
     [](Script& s) {
       UploadStartOf(s).set_head(kHead);
       UploadStartOf(s).set_vocab_size(kVocab);
       UploadStartOf(s).set_replace(true);
     }},
    {"upload_weight_before_start", "bytes before any UploadHeadStart", Rpc::kUpload, kInvalid,
     "start", [](Script& s) { std::swap(s.upload[0], s.upload[1]); }},
    {"upload_start_twice", "a second UploadHeadStart", Rpc::kUpload, kInvalid, "start",
     [](Script& s) { s.upload.insert(s.upload.begin() + 1, s.upload.front()); }},
    {"upload_empty_stream", "half-closed without a message", Rpc::kUpload, kInvalid, "start",
     [](Script& s) { s.upload.clear(); }},
    // Step.
    {"step_no_optimizer", "neither sgd nor adamw", Rpc::kStep, kInvalid, "optimizer",
     [](Script& s) { s.step.clear_optimizer(); }},
    {"step_unknown_head", "no head of that name", Rpc::kStep, StatusCode::NOT_FOUND, "head",
     [](Script& s) { s.step.set_head("missing"); }},
    {"step_stale_version", "pinned to version 1, which the head has left", Rpc::kStep,
     StatusCode::FAILED_PRECONDITION, "head_version",
     [](Script& s) { s.step.set_head_version(kHeadVersion - 1); }},
    {"sgd_negative_lr", "ascends the loss", Rpc::kStep, kInvalid, "learning_rate",
     [](Script& s) { s.step.mutable_sgd()->set_learning_rate(-0.1); }},
    {"sgd_nan_lr", "NaN passes naive range checks", Rpc::kStep, kInvalid, "learning_rate",
     [](Script& s) { s.step.mutable_sgd()->set_learning_rate(kNaN); }},
    {"sgd_negative_momentum", "momentum of -1", Rpc::kStep, kInvalid, "sgd.momentum",
     [](Script& s) { s.step.mutable_sgd()->set_momentum(-1); }},
    {"sgd_inf_weight_decay", "an infinite decay", Rpc::kStep, kInvalid, "weight_decay",
     [](Script& s) { s.step.mutable_sgd()->set_weight_decay(kInf); }},
    {"adamw_negative_lr", "ascends the loss", Rpc::kStep, kInvalid, "learning_rate",
     [](Script& s) { s.step.mutable_adamw()->set_learning_rate(-1e-3); }},
    {"adamw_beta1_1", "the bias correction divides by 1 - beta1^t = 0", Rpc::kStep, kInvalid,
     "adamw.beta1",
     [](Script& s) {
       s.step.mutable_adamw()->set_learning_rate(1e-3);
       s.step.mutable_adamw()->set_beta1(1);
     }},
    {"adamw_beta2_nan", "NaN passes naive range checks", Rpc::kStep, kInvalid, "adamw.beta2",
     [](Script& s) {
       s.step.mutable_adamw()->set_learning_rate(1e-3);
       s.step.mutable_adamw()->set_beta2(kNaN);
     }},
    {"adamw_epsilon_0", "divides by zero where the second moment is 0", Rpc::kStep, kInvalid,
     "adamw.epsilon",
     [](Script& s) {
       s.step.mutable_adamw()->set_learning_rate(1e-3);
       s.step.mutable_adamw()->set_epsilon(0);
     }},
    {"max_grad_norm_negative", "a clip norm of -1", Rpc::kStep, kInvalid, "max_grad_norm",
     [](Script& s) { s.step.set_max_grad_norm(-1); }},
    // Valid steps whose result is not finite: refused, W, the optimizer state and the version as
    // they were (a step that wrote Inf into W would fail every later call and be checkpointed).
    {"sgd_step_overflows_w", "lr 1e38 with an L2 decay of 1e10: every |update| past fp32",
     Rpc::kStep, StatusCode::FAILED_PRECONDITION, "the step would make weight[",
     [](Script& s) {
       s.step.mutable_sgd()->set_learning_rate(1e38);
       s.step.mutable_sgd()->set_weight_decay(1e10);
     }},
    {"adamw_step_overflows_w", "a switch to AdamW whose decoupled decay overflows: the head's "
     "SGD momentum is kept, no AdamW state is left", Rpc::kStep, StatusCode::FAILED_PRECONDITION,
     "W, the optimizer state and the version are unchanged",
     [](Script& s) {
       s.step.mutable_adamw()->set_learning_rate(1e38);
       s.step.mutable_adamw()->set_weight_decay(1e10);
     }},
    // FetchWeight.
    {"fetch_unknown_head", "no head of that name", Rpc::kFetchWeight, StatusCode::NOT_FOUND, "head",
     [](Script& s) { s.fetch.set_head("missing"); }},
    {"fetch_dtype_7", "an enum value the contract does not define", Rpc::kFetchWeight, kInvalid,
     "dtype", [](Script& s) { s.fetch.set_dtype(static_cast<v1::DType>(7)); }},
    {"fetch_negative_chunk", "a chunk of -1 bytes", Rpc::kFetchWeight, kInvalid, "max_chunk_bytes",
     [](Script& s) { s.fetch.set_max_chunk_bytes(-1); }},
};

grpc::Status Send(v1::LossService::Stub& stub, Rpc rpc, const Script& script) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  switch (rpc) {
    case Rpc::kCompute: {
      auto stream = stub.Compute(&context);
      for (const auto& message : script.compute) {
        if (!stream->Write(message)) break;
      }
      stream->WritesDone();
      v1::ComputeResponse response;
      while (stream->Read(&response)) continue;
      return stream->Finish();
    }
    case Rpc::kUpload: {
      v1::HeadInfo info;
      auto writer = stub.UploadHead(&context, &info);
      for (const auto& message : script.upload) {
        if (!writer->Write(message)) break;
      }
      writer->WritesDone();
      return writer->Finish();
    }
    case Rpc::kStep: {
      v1::StepResponse response;
      return stub.Step(&context, script.step, &response);
    }
    case Rpc::kFetchWeight: {
      auto reader = stub.FetchWeight(&context, script.fetch);
      v1::TensorChunk chunk;
      while (reader->Read(&chunk)) continue;
      return reader->Finish();
    }
  }
  return grpc::Status(StatusCode::INTERNAL, "unknown rpc");
}

class BadInputTest : public ::testing::TestWithParam<BadRow> {
 protected:
  // A head with a version past 1, optimizer state and a non-zero accumulated gradient, so that a
  // row that moved any of them would show.
  static void SetUpTestSuite() {
    std::mt19937_64 rng(FreshSeed());
    server::ServerConfig config;
    config.demo = {kHead, kVocab, kHidden, 11};
    config.workspace_budget_bytes = 1 << 20;
    server_ = StartTestServer(config).release();
    ASSERT_NE(server_, nullptr);
    auto stub = ConnectTo(server_->port());
    const Batch first = RandomBatch(kRows, kVocab, kHidden, rng);
    ASSERT_TRUE(
        CallCompute(*stub, StartFor(kHead, first, kHidden, true), FloatBytes(first.hidden), kRows)
            .status.ok());
    grpc::ClientContext context;
    v1::StepRequest step;
    step.set_head(kHead);
    step.mutable_sgd()->set_learning_rate(0.1);
    step.mutable_sgd()->set_momentum(0.9);
    v1::StepResponse stepped;
    ASSERT_TRUE(stub->Step(&context, step, &stepped).ok());
    ASSERT_EQ(stepped.head_version(), kHeadVersion);
    batch_ = new Batch(RandomBatch(kRows, kVocab, kHidden, rng));
    ASSERT_TRUE(CallCompute(*stub, StartFor(kHead, *batch_, kHidden, true),
                            FloatBytes(batch_->hidden), kRows)
                    .status.ok());
    probe_ = new Batch(RandomBatch(kRows, kVocab, kHidden, rng));
    probe_ref_ =
        new ReferenceResult(Reference(Fetch(*stub, kHead, false).values, kVocab, kHidden, *probe_));
    upload_weight_ = new std::vector<float>(RandomWeight(kUploadVocab, kHidden, rng));
    ASSERT_TRUE(Upload(*stub, kTeacher, kVocab, kTeacherHidden,
                       RandomWeight(kVocab, kTeacherHidden, rng), false)
                    .ok());
    ASSERT_TRUE(Upload(*stub, kShortTeacher, kVocab - 1, kTeacherHidden,
                       RandomWeight(kVocab - 1, kTeacherHidden, rng), false)
                    .ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete batch_;
    delete probe_;
    delete probe_ref_;
    delete upload_weight_;
  }

  static Script ValidScript() {
    Script s;
    s.compute = TrainingScript(kHead, *batch_, kHidden, kRowsPerMessage);
    s.upload.emplace_back();
    v1::UploadHeadStart& start = *s.upload.back().mutable_start();
    start.set_head(kUploadHead);
    start.set_vocab_size(kUploadVocab);
    start.set_hidden_size(kHidden);
    start.set_dtype(v1::DTYPE_FLOAT32);
    const std::string weight = FloatBytes(*upload_weight_);
    for (const std::string& piece :
         {weight.substr(0, weight.size() / 2), weight.substr(weight.size() / 2)}) {
      s.upload.emplace_back();
      s.upload.back().set_weight(piece);
    }
    s.step.set_head(kHead);
    s.step.mutable_sgd()->set_learning_rate(0.1);
    s.fetch.set_head(kHead);
    return s;
  }

  static server::LossServer* server_;
  static Batch* batch_;  // the valid call's rows
  static Batch* probe_;  // a scoring call that shows the server still computes right
  static ReferenceResult* probe_ref_;
  static std::vector<float>* upload_weight_;
};

server::LossServer* BadInputTest::server_ = nullptr;
Batch* BadInputTest::batch_ = nullptr;
Batch* BadInputTest::probe_ = nullptr;
ReferenceResult* BadInputTest::probe_ref_ = nullptr;
std::vector<float>* BadInputTest::upload_weight_ = nullptr;

TEST_P(BadInputTest, GetsItsCodeNamesTheFieldAndChangesNothing) {
  const BadRow& row = GetParam();
  SCOPED_TRACE(row.why);
  auto stub = ConnectTo(server_->port());
  const FetchedTensor weight_before = Fetch(*stub, kHead, false);
  const FetchedTensor grad_before = Fetch(*stub, kHead, true);
  ASSERT_TRUE(weight_before.status.ok() && grad_before.status.ok());
  ASSERT_EQ(weight_before.version, kHeadVersion);
  const int64_t gradient_bytes = server_->ledger().current(MemoryPurpose::kGradients);
  const int64_t optimizer_bytes = server_->ledger().current(MemoryPurpose::kOptimizerState);

  Script script = ValidScript();
  row.spoil(script);
  const grpc::Status status = Send(*stub, row.rpc, script);
  EXPECT_EQ(status.error_code(), row.code) << status.error_message();
  EXPECT_NE(status.error_message().find(row.field), std::string::npos)
      << "the message does not name " << row.field << ": " << status.error_message();
  // A field in the status details is the one the message names first, for clients to act on.
  if (const std::optional<v1::ErrorInfo> info = ErrorInfoIn(status);
      info.has_value() && !info->field().empty()) {
    EXPECT_TRUE(absl::StartsWith(status.error_message(), info->field() + ":"))
        << info->field() << " vs " << status.error_message();
  }

  EXPECT_TRUE(SettlesToIdle(*server_, gradient_bytes));
  EXPECT_EQ(server_->ledger().current(MemoryPurpose::kOptimizerState), optimizer_bytes);
  const FetchedTensor weight_after = Fetch(*stub, kHead, false);
  const FetchedTensor grad_after = Fetch(*stub, kHead, true);
  EXPECT_EQ(weight_after.version, kHeadVersion);
  EXPECT_TRUE(BitwiseEqual(weight_after.values, weight_before.values)) << "W changed";
  EXPECT_TRUE(BitwiseEqual(grad_after.values, grad_before.values))
      << "the accumulated gradient changed";
  EXPECT_EQ(server_->heads().List().size(), kHeadsAtStart) << "a failed upload left a head behind";

  const ComputeOutcome probe =
      CallCompute(*stub, StartFor(kHead, *probe_, kHidden, false), FloatBytes(probe_->hidden), 5);
  ASSERT_TRUE(probe.status.ok()) << probe.status.error_message();
  EXPECT_TRUE(LossMatches(probe.summary.loss(), *probe_ref_));
}

INSTANTIATE_TEST_SUITE_P(Table, BadInputTest, ::testing::ValuesIn(kBadRows),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Cancellations and disconnects: clients that cancel, drop their connection or stop sending at
// random points of a training stream leave no workspace, staging gradient or scheduler slot
// behind, never reach the accumulator, and later calls are still right.

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

// ---------------------------------------------------------------------------------------------
// Load: 32 clients with 50 mixed calls each on the CPU backend. Every result is checked against
// the float64 reference for the W version it was computed on; the only error allowed is ABORTED
// for a training call on a head that a concurrent Step moved (retried); the scheduler and the
// memory ledger stay within their bounds throughout.

constexpr int kLoadClients = 32;
constexpr int kCallsPerClient = 50;
constexpr int64_t kLoadVocab = 512;
constexpr int64_t kLoadHidden = 64;
constexpr int64_t kLoadRows = 32;
constexpr int64_t kLoadRowsPerMessage = 8;
constexpr int kLoadBatches = 16;
constexpr int kLoadRunning = 2;
constexpr int kLoadQueued = 64;
constexpr size_t kLoadWorkspaceBudget = 1 << 20;
constexpr char kFrozenHead[] = "frozen";    // never stepped: one reference per batch
constexpr char kSteppedHead[] = "stepped";  // stepped while other clients train on it

enum class LoadCall { kScoreFrozen, kTrainFrozen, kTrainStepped, kFetchGrad, kStepStepped };
// Relative frequencies of the calls above.
const std::vector<double> kLoadMix = {32, 26, 26, 12, 4};

// The scheduler's and the ledger's bounds, checked by polling while the clients run.
struct BoundsWatch {
  int64_t samples = 0;
  int64_t violations = 0;
  std::string first_violation;
  int peak_queued = 0;
  int peak_running = 0;
  int64_t peak_admitted_bytes = 0;
  int64_t peak_workspace_bytes = 0;
};

void WatchBounds(server::LossServer& server, const std::atomic<bool>& done,
                 int64_t accumulator_bytes, BoundsWatch& watch) {
  while (!done) {
    const CallResources s = ReadCallResources(server);
    ++watch.samples;
    watch.peak_queued = std::max(watch.peak_queued, s.queued);
    watch.peak_running = std::max(watch.peak_running, s.running);
    watch.peak_admitted_bytes = std::max(watch.peak_admitted_bytes, s.admitted_bytes);
    watch.peak_workspace_bytes = std::max(watch.peak_workspace_bytes, s.workspace_bytes);
    const bool within =
        s.admitted_bytes <= server.scheduler().capacity_bytes() && s.running <= kLoadRunning &&
        s.queued <= kLoadQueued &&
        s.workspace_bytes <= kLoadRunning * static_cast<int64_t>(kLoadWorkspaceBudget) &&
        // Staging dL/dW: of the running calls and of those paused waiting for their clients,
        // all admitted against the budget.
        s.gradient_bytes <= accumulator_bytes + server.scheduler().capacity_bytes() &&
        s.cache_bytes <= server.scheduler().capacity_bytes();
    if (!within && watch.violations++ == 0) {
      watch.first_violation =
          absl::StrCat("admitted ", s.admitted_bytes, " B, running ", s.running, ", queued ",
                       s.queued, ", workspace ", s.workspace_bytes, " B, gradients ",
                       s.gradient_bytes, " B, idle buffers ", s.cache_bytes, " B");
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// What one client saw; merged after the run.
struct ClientLog {
  int64_t rpcs = 0;
  int64_t compute_calls = 0;
  int64_t tokens = 0;
  int64_t aborted = 0;
  int64_t steps = 0;
  std::vector<int> frozen_trained;  // per batch: committed training calls on kFrozenHead
  struct SteppedCall {
    uint64_t version;
    int batch;
    double loss;
  };
  std::vector<SteppedCall> stepped_calls;
  std::vector<std::string> failures;  // unexpected errors and wrong results
};

class LoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = FreshSeed();
    std::mt19937_64 rng(seed_);
    server::ServerConfig config;
    config.demo = {kFrozenHead, kLoadVocab, kLoadHidden, 3};
    config.workspace_budget_bytes = kLoadWorkspaceBudget;
    config.max_running_calls = kLoadRunning;
    config.max_queued_calls = kLoadQueued;
    server_ = StartTestServer(config);
    ASSERT_NE(server_, nullptr);
    auto stub = ConnectTo(server_->port());
    ASSERT_TRUE(Upload(*stub, kSteppedHead, kLoadVocab, kLoadHidden,
                       RandomWeight(kLoadVocab, kLoadHidden, rng), false)
                    .ok());
    frozen_weight_ = Fetch(*stub, kFrozenHead, false).values;
    const FetchedTensor stepped = Fetch(*stub, kSteppedHead, false);
    stepped_weights_[stepped.version] = stepped.values;
    for (int b = 0; b < kLoadBatches; ++b) {
      batches_.push_back(RandomBatch(kLoadRows, kLoadVocab, kLoadHidden, rng));
      frozen_refs_.push_back(Reference(frozen_weight_, kLoadVocab, kLoadHidden, batches_.back()));
    }
  }

  void RunClient(uint64_t seed, ClientLog& log) {
    std::mt19937_64 rng(seed);
    std::discrete_distribution<int> pick_call(kLoadMix.begin(), kLoadMix.end());
    std::uniform_int_distribution<int> pick_batch(0, kLoadBatches - 1);
    log.frozen_trained.assign(kLoadBatches, 0);
    // Calls fail fast while a channel is not connected, so a connection attempt lost to a
    // loaded machine would fail every call of the client: connect first, with gRPC's retries.
    auto channel = PrivateChannel(server_->port());
    if (!channel->WaitForConnected(In(absl::Seconds(30)))) {
      log.failures.push_back("could not connect within 30 s");
      return;
    }
    auto stub = v1::LossService::NewStub(channel);
    auto fail = [&](absl::string_view what, const grpc::Status& status) {
      log.failures.push_back(absl::StrCat(what, ": ", server::GrpcCodeName(status.error_code()),
                                          " ", status.error_message()));
    };
    for (int i = 0; i < kCallsPerClient; ++i) {
      const auto call = static_cast<LoadCall>(pick_call(rng));
      const int b = pick_batch(rng);
      const Batch& batch = batches_[b];
      const std::string hidden = FloatBytes(batch.hidden);
      switch (call) {
        case LoadCall::kScoreFrozen:
        case LoadCall::kTrainFrozen: {
          const bool training = call == LoadCall::kTrainFrozen;
          const ComputeOutcome out =
              CallCompute(*stub, StartFor(kFrozenHead, batch, kLoadHidden, training), hidden,
                          kLoadRowsPerMessage);
          ++log.rpcs;
          ++log.compute_calls;
          if (!out.status.ok()) {
            fail("frozen compute", out.status);
            break;
          }
          log.tokens += kLoadRows;
          const ReferenceResult& ref = frozen_refs_[b];
          if (!LossMatches(out.summary.loss(), ref) ||
              RelativeError(out.token_loss, ref.token_loss) > kLossBound ||
              (training &&
               RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden) > kGradBound)) {
            log.failures.push_back(absl::StrCat("frozen compute on batch ", b, ": loss ",
                                                out.summary.loss(), ", reference ", ref.loss));
          }
          if (training) ++log.frozen_trained[b];
          break;
        }
        case LoadCall::kTrainStepped: {
          ComputeOutcome out;
          do {
            out = CallCompute(*stub, StartFor(kSteppedHead, batch, kLoadHidden, true), hidden,
                              kLoadRowsPerMessage);
            ++log.rpcs;
            ++log.compute_calls;
            log.aborted += out.status.error_code() == StatusCode::ABORTED;
          } while (out.status.error_code() == StatusCode::ABORTED);
          if (!out.status.ok()) {
            fail("stepped compute", out.status);
            break;
          }
          log.tokens += kLoadRows;
          log.stepped_calls.push_back({out.summary.head_version(), b, out.summary.loss()});
          break;
        }
        case LoadCall::kFetchGrad: {
          const bool frozen = b % 2 == 0;
          const FetchedTensor grad = Fetch(*stub, frozen ? kFrozenHead : kSteppedHead, true);
          ++log.rpcs;
          if (!grad.status.ok()) {
            fail("fetch gradient", grad.status);
          } else if (grad.values.size() != static_cast<size_t>(kLoadVocab * kLoadHidden) ||
                     !std::all_of(grad.values.begin(), grad.values.end(),
                                  [](float x) { return std::isfinite(x); })) {
            log.failures.push_back("fetched gradient is not V x H finite values");
          }
          break;
        }
        case LoadCall::kStepStepped: {
          // Steps are serialized here (not in the server) so that W of every version is fetched
          // before the next step moves it.
          std::lock_guard<std::mutex> lock(step_mu_);
          grpc::ClientContext context;
          v1::StepRequest request;
          request.set_head(kSteppedHead);
          request.mutable_sgd()->set_learning_rate(0.05);
          request.mutable_sgd()->set_momentum(0.9);
          v1::StepResponse response;
          const grpc::Status status = stub->Step(&context, request, &response);
          const FetchedTensor weight = Fetch(*stub, kSteppedHead, false);
          log.rpcs += 2;
          log.steps += status.ok();
          if (!status.ok() || !weight.status.ok()) {
            fail("step", status.ok() ? weight.status : status);
          } else if (weight.version != response.head_version()) {
            log.failures.push_back("W moved between a step and its fetch");
          } else {
            stepped_weights_[weight.version] = weight.values;
          }
          break;
        }
      }
    }
  }

  uint64_t seed_ = 0;  // of the batches, the heads and the clients' call mixes
  std::unique_ptr<server::LossServer> server_;
  std::vector<Batch> batches_;
  std::vector<float> frozen_weight_;
  std::vector<ReferenceResult> frozen_refs_;
  std::mutex step_mu_;
  std::map<uint64_t, std::vector<float>> stepped_weights_;  // guarded by step_mu_ while clients run
};

TEST_F(LoadTest, ConcurrentMixedCallsAreAllCorrectAndStayWithinBounds) {
  // A head's accumulator exists from its first committed training call or step on.
  const int64_t accumulator_bytes = kLoadVocab * kLoadHidden * static_cast<int64_t>(sizeof(float));
  std::atomic<bool> done{false};
  BoundsWatch watch;
  // Two heads, so two accumulators at most.
  std::thread watcher([&] { WatchBounds(*server_, done, 2 * accumulator_bytes, watch); });
  std::vector<ClientLog> logs(kLoadClients);
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed_);
  std::mt19937_64 seeds(seed_ + 1);
  const absl::Time start = absl::Now();
  std::vector<std::thread> clients;
  for (int c = 0; c < kLoadClients; ++c) {
    clients.emplace_back([this, seed = seeds(), &log = logs[c]] { RunClient(seed, log); });
  }
  for (auto& client : clients) client.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  done = true;
  watcher.join();

  ClientLog total;
  total.frozen_trained.assign(kLoadBatches, 0);
  for (const ClientLog& log : logs) {
    total.rpcs += log.rpcs;
    total.compute_calls += log.compute_calls;
    total.tokens += log.tokens;
    total.aborted += log.aborted;
    total.steps += log.steps;
    for (int b = 0; b < kLoadBatches; ++b) total.frozen_trained[b] += log.frozen_trained[b];
    total.stepped_calls.insert(total.stepped_calls.end(), log.stepped_calls.begin(),
                               log.stepped_calls.end());
    total.failures.insert(total.failures.end(), log.failures.begin(), log.failures.end());
  }
  EXPECT_TRUE(total.failures.empty())
      << total.failures.size() << " failures, the first: " << total.failures.front();
  EXPECT_EQ(watch.violations, 0) << "over " << watch.samples
                                 << " samples; the first: " << watch.first_violation;
  const bool frozen_trained = std::any_of(total.frozen_trained.begin(), total.frozen_trained.end(),
                                          [](int calls) { return calls > 0; });
  const bool stepped_trained = !total.stepped_calls.empty() || total.steps > 0;
  EXPECT_TRUE(SettlesToIdle(*server_, (frozen_trained + stepped_trained) * accumulator_bytes));

  // Training calls on the stepped head match the reference for the version they report; one
  // reference per (version, batch), computed on every core.
  const absl::Time verify_start = absl::Now();
  std::map<std::pair<uint64_t, int>, ReferenceResult> stepped_refs;
  for (const ClientLog::SteppedCall& call : total.stepped_calls) {
    ASSERT_TRUE(stepped_weights_.count(call.version))
        << "no W recorded for version " << call.version;
    stepped_refs.try_emplace({call.version, call.batch});
  }
  std::vector<std::pair<const std::pair<uint64_t, int>, ReferenceResult>*> pending;
  for (auto& entry : stepped_refs) pending.push_back(&entry);
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  for (unsigned w = 0; w < std::max(2u, std::thread::hardware_concurrency()); ++w) {
    workers.emplace_back([&] {
      for (size_t i = next++; i < pending.size(); i = next++) {
        const auto& [version, batch] = pending[i]->first;
        pending[i]->second =
            Reference(stepped_weights_.at(version), kLoadVocab, kLoadHidden, batches_[batch]);
      }
    });
  }
  for (auto& worker : workers) worker.join();
  for (const ClientLog::SteppedCall& call : total.stepped_calls) {
    const ReferenceResult& ref = stepped_refs.at({call.version, call.batch});
    EXPECT_TRUE(LossMatches(call.loss, ref))
        << "version " << call.version << ", batch " << call.batch << ": loss " << call.loss
        << ", reference " << ref.loss << ", largest logit " << ref.max_abs_logit;
  }
  RecordProperty("verify_seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - verify_start)));

  // The frozen head's accumulator holds exactly the committed training calls.
  auto stub = ConnectTo(server_->port());
  std::vector<double> expected(kLoadVocab * kLoadHidden, 0.0);
  int64_t expected_tokens = 0;
  for (int b = 0; b < kLoadBatches; ++b) {
    for (size_t i = 0; i < expected.size(); ++i) {
      expected[i] += total.frozen_trained[b] * frozen_refs_[b].grad_weight[i];
    }
    expected_tokens += total.frozen_trained[b] * frozen_refs_[b].counted_tokens;
  }
  grpc::ClientContext context;
  v1::GetHeadRequest request;
  request.set_head(kFrozenHead);
  v1::HeadInfo info;
  ASSERT_TRUE(stub->GetHead(&context, request, &info).ok());
  EXPECT_EQ(info.accumulated_tokens(), expected_tokens);
  EXPECT_LE(RelativeError(Fetch(*stub, kFrozenHead, true).values, expected), kGradBound);

  RecordProperty("clients", kLoadClients);
  RecordProperty("rpcs", total.rpcs);
  RecordProperty("compute_calls", total.compute_calls);
  RecordProperty("aborted_and_retried", total.aborted);
  RecordProperty("steps", static_cast<int>(stepped_weights_.size()) - 1);
  RecordProperty("seconds", absl::StrCat(seconds));
  RecordProperty("rpcs_per_second", absl::StrCat(total.rpcs / seconds));
  RecordProperty("compute_calls_per_second", absl::StrCat(total.compute_calls / seconds));
  RecordProperty("tokens_per_second", absl::StrCat(total.tokens / seconds));
  RecordProperty("peak_queued", watch.peak_queued);
  RecordProperty("peak_running", watch.peak_running);
  RecordProperty("peak_admitted_bytes", absl::StrCat(watch.peak_admitted_bytes));
  RecordProperty("compute_budget_bytes", absl::StrCat(server_->scheduler().capacity_bytes()));
  RecordProperty("peak_workspace_bytes", absl::StrCat(watch.peak_workspace_bytes));
  RecordProperty("bound_samples", absl::StrCat(watch.samples));
}

// ---------------------------------------------------------------------------------------------
// Authentication and TLS: with a token configured, a call without it or with anything else in
// its place is UNAUTHENTICATED and reaches nothing; with a certificate, TLS clients that trust it
// are served and plaintext or untrusting clients cannot connect.

constexpr char kToken[] = "s3cret-token";
constexpr char kGuardedHead[] = "guarded";
constexpr int64_t kGuardedVocab = 200;

std::string WriteTokenFile(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/token";
  std::ofstream(path) << kToken << "\n";
  return path;
}

struct BadCredential {
  const char* name;
  const char* why;
  const char* authorization;  // the metadata value sent; null sends none
};

void PrintTo(const BadCredential& credential, std::ostream* os) { *os << credential.name; }

const BadCredential kBadCredentials[] = {
    {"none", "no authorization metadata at all", nullptr},
    {"empty_token", "the scheme without a token", "Bearer "},
    {"wrong_token", "another token", "Bearer wrong-token"},
    {"token_prefix", "a prefix of the token, as a byte-by-byte compare that stops early accepts",
     "Bearer s3cret"},
    {"token_extended", "the token with a byte more", "Bearer s3cret-token2"},
    {"bare_token", "the token without its scheme", "s3cret-token"},
    {"basic_scheme", "the token under another scheme", "Basic s3cret-token"},
};

void Authorize(grpc::ClientContext& context, const char* authorization) {
  if (authorization != nullptr) context.AddMetadata("authorization", authorization);
  context.set_deadline(In(absl::Seconds(20)));
}

// Each RPC of the service once, sent with `authorization`: the writing ones aim at kGuardedHead.
struct RpcOutcome {
  const char* rpc;
  grpc::Status status;
  int64_t messages_received = 0;  // stream messages that reached the client
};

std::vector<RpcOutcome> CallEveryRpc(v1::LossService::Stub& stub, const char* authorization,
                                     const Batch& batch, const std::vector<float>& other_weight) {
  std::vector<RpcOutcome> outcomes;
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    auto stream = stub.Compute(&context);
    v1::ComputeRequest request;
    *request.mutable_start() = StartFor(kGuardedHead, batch, kHidden, true);
    stream->Write(request);
    request.mutable_chunk()->set_hidden(FloatBytes(batch.hidden));
    stream->Write(request);
    stream->WritesDone();
    RpcOutcome outcome{"Compute", grpc::Status(), 0};
    v1::ComputeResponse response;
    while (stream->Read(&response)) ++outcome.messages_received;
    outcome.status = stream->Finish();
    outcomes.push_back(outcome);
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::HeadInfo info;
    auto writer = stub.UploadHead(&context, &info);
    v1::UploadHeadRequest request;
    v1::UploadHeadStart& start = *request.mutable_start();
    start.set_head(kGuardedHead);
    start.set_vocab_size(kGuardedVocab);
    start.set_hidden_size(kHidden);
    start.set_dtype(v1::DTYPE_FLOAT32);
    start.set_replace(true);
    writer->Write(request);
    request.set_weight(FloatBytes(other_weight));
    writer->Write(request);
    writer->WritesDone();
    outcomes.push_back({"UploadHead", writer->Finish()});
  }
  for (const bool gradient : {false, true}) {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::FetchTensorRequest request;
    request.set_head(kGuardedHead);
    auto reader =
        gradient ? stub.FetchGradWeight(&context, request) : stub.FetchWeight(&context, request);
    RpcOutcome outcome{gradient ? "FetchGradWeight" : "FetchWeight", grpc::Status(), 0};
    v1::TensorChunk chunk;
    while (reader->Read(&chunk)) ++outcome.messages_received;
    outcome.status = reader->Finish();
    outcomes.push_back(outcome);
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::ZeroGradWeightRequest request;
    request.set_head(kGuardedHead);
    v1::ZeroGradWeightResponse response;
    outcomes.push_back({"ZeroGradWeight", stub.ZeroGradWeight(&context, request, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::StepRequest request;
    request.set_head(kGuardedHead);
    request.mutable_sgd()->set_learning_rate(0.5);
    v1::StepResponse response;
    outcomes.push_back({"Step", stub.Step(&context, request, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::SaveCheckpointResponse response;
    outcomes.push_back({"SaveCheckpoint", stub.SaveCheckpoint(&context, {}, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::ListHeadsResponse response;
    outcomes.push_back({"ListHeads", stub.ListHeads(&context, {}, &response)});
  }
  {
    grpc::ClientContext context;
    Authorize(context, authorization);
    v1::GetHeadRequest request;
    request.set_head(kGuardedHead);
    v1::HeadInfo response;
    outcomes.push_back({"GetHead", stub.GetHead(&context, request, &response)});
  }
  return outcomes;
}

class AuthTest : public ::testing::TestWithParam<BadCredential> {
 protected:
  // W and the gradient are compared bitwise around every row, so a call that slipped through shows.
  static void SetUpTestSuite() {
    std::mt19937_64 rng(FreshSeed());
    dir_ = new std::string(::testing::TempDir() + "/lossd-auth-" + std::to_string(FreshSeed()));
    server::ServerConfig config;
    config.token_file = WriteTokenFile(*dir_);
    config.demo = {kGuardedHead, kGuardedVocab, kHidden, 13};
    server_ = StartTestServer(config).release();
    ASSERT_NE(server_, nullptr);
    batch_ = new Batch(RandomBatch(16, kGuardedVocab, kHidden, rng));
    other_weight_ = new std::vector<float>(RandomWeight(kGuardedVocab, kHidden, rng));
    auto stub = ConnectTo(server_->port());
    ASSERT_TRUE(CallCompute(*stub, StartFor(kGuardedHead, *batch_, kHidden, true),
                            FloatBytes(batch_->hidden), 16, -1, kToken)
                    .status.ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
    delete batch_;
    delete other_weight_;
  }

  static server::LossServer* server_;
  static std::string* dir_;
  static Batch* batch_;
  static std::vector<float>* other_weight_;  // what a slipped-through upload would write
};

server::LossServer* AuthTest::server_ = nullptr;
std::string* AuthTest::dir_ = nullptr;
Batch* AuthTest::batch_ = nullptr;
std::vector<float>* AuthTest::other_weight_ = nullptr;

TEST_P(AuthTest, RejectedCredentialsReachNothing) {
  const BadCredential& credential = GetParam();
  SCOPED_TRACE(credential.why);
  auto stub = ConnectTo(server_->port());
  const FetchedTensor weight_before = Fetch(*stub, kGuardedHead, false, kToken);
  const FetchedTensor grad_before = Fetch(*stub, kGuardedHead, true, kToken);
  ASSERT_TRUE(weight_before.status.ok() && grad_before.status.ok());

  for (const RpcOutcome& outcome :
       CallEveryRpc(*stub, credential.authorization, *batch_, *other_weight_)) {
    EXPECT_EQ(outcome.status.error_code(), StatusCode::UNAUTHENTICATED)
        << outcome.rpc << ": " << outcome.status.error_message();
    EXPECT_NE(outcome.status.error_message().find("authorization"), std::string::npos)
        << outcome.rpc;
    EXPECT_EQ(outcome.messages_received, 0) << outcome.rpc << " streamed data back";
  }

  const FetchedTensor weight_after = Fetch(*stub, kGuardedHead, false, kToken);
  const FetchedTensor grad_after = Fetch(*stub, kGuardedHead, true, kToken);
  EXPECT_EQ(weight_after.version, weight_before.version);
  EXPECT_TRUE(BitwiseEqual(weight_after.values, weight_before.values)) << "W changed";
  EXPECT_TRUE(BitwiseEqual(grad_after.values, grad_before.values)) << "the gradient changed";
}

INSTANTIATE_TEST_SUITE_P(Table, AuthTest, ::testing::ValuesIn(kBadCredentials),
                         [](const auto& info) { return std::string(info.param.name); });

// The same calls with the token all get through (SaveCheckpoint then fails on its own terms).
TEST_F(AuthTest, TheTokenOpensEveryRpc) {
  auto stub = ConnectTo(server_->port());
  const std::string authorization = std::string("Bearer ") + kToken;
  for (const RpcOutcome& outcome :
       CallEveryRpc(*stub, authorization.c_str(), *batch_, *other_weight_)) {
    const StatusCode expected = std::string(outcome.rpc) == "SaveCheckpoint"
                                    ? StatusCode::FAILED_PRECONDITION
                                    : StatusCode::OK;
    EXPECT_EQ(outcome.status.error_code(), expected)
        << outcome.rpc << ": " << outcome.status.error_message();
  }
}

std::unique_ptr<v1::LossService::Stub> ConnectWithTls(int port, const std::string& trusted_pem) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = trusted_pem;
  return v1::LossService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::SslCredentials(options)));
}

grpc::Status ListHeads(v1::LossService::Stub& stub, const char* authorization) {
  grpc::ClientContext context;
  Authorize(context, authorization);
  v1::ListHeadsResponse response;
  return stub.ListHeads(&context, {}, &response);
}

TEST(TlsTest, ServesTrustingTlsClientsOnly) {
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  const std::string dir = ::testing::TempDir() + "/lossd-tls-" + std::to_string(seed);
  const Certificate server_certificate = MakeCertificate(dir, "server");
  const Certificate other_certificate = MakeCertificate(dir, "other");
  ASSERT_FALSE(server_certificate.pem.empty() || other_certificate.pem.empty())
      << "the openssl CLI could not make test certificates";
  server::ServerConfig config;
  config.tls_cert_file = server_certificate.cert_file;
  config.tls_key_file = server_certificate.key_file;
  config.token_file = WriteTokenFile(dir);
  config.demo = {kGuardedHead, kGuardedVocab, kHidden, 17};
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  const std::string authorization = std::string("Bearer ") + kToken;

  // Trusting client: served, and right.
  auto tls = ConnectWithTls(server->port(), server_certificate.pem);
  EXPECT_TRUE(ListHeads(*tls, authorization.c_str()).ok());
  const FetchedTensor weight = Fetch(*tls, kGuardedHead, false, kToken);
  ASSERT_TRUE(weight.status.ok()) << weight.status.error_message();
  const Batch batch = RandomBatch(24, kGuardedVocab, kHidden, rng);
  const ComputeOutcome out = CallCompute(*tls, StartFor(kGuardedHead, batch, kHidden, true),
                                         FloatBytes(batch.hidden), 8, -1, kToken);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  const ReferenceResult ref = Reference(weight.values, kGuardedVocab, kHidden, batch);
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);
  // TLS does not replace the token.
  EXPECT_EQ(ListHeads(*tls, nullptr).error_code(), StatusCode::UNAUTHENTICATED);

  // Plaintext and untrusting clients never get a connection.
  EXPECT_EQ(ListHeads(*ConnectTo(server->port()), authorization.c_str()).error_code(),
            StatusCode::UNAVAILABLE);
  EXPECT_EQ(ListHeads(*ConnectWithTls(server->port(), other_certificate.pem), authorization.c_str())
                .error_code(),
            StatusCode::UNAVAILABLE);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Stalled streams: a client that opens a Compute call and then sends nothing, or too little too
// slowly, holds no running slot while its call waits for its first rows; every wait for a client
// is bounded by --stream_idle_seconds, and the client is told so by a status naming the flag.

constexpr char kStallHead[] = "stalled";
constexpr int64_t kStallVocab = 2000;
constexpr int64_t kStallHidden = 64;
// 128 rows per engine chunk of a training call under the 1 MiB workspace.
constexpr int64_t kStallRows = 480;
constexpr int64_t kStallRowsPerMessage = 20;

// A Compute stream on a connection of its own, written and read by the test.
class OpenStream {
 public:
  explicit OpenStream(int port, absl::Duration deadline = absl::Seconds(60))
      : OpenStream(PrivateChannel(port), deadline) {}
  // On `channel`'s connection, beside other streams.
  explicit OpenStream(std::shared_ptr<grpc::Channel> channel,
                      absl::Duration deadline = absl::Seconds(60))
      : channel_(std::move(channel)), stub_(v1::LossService::NewStub(channel_)) {
    context_.set_deadline(In(deadline));
    stream_ = stub_->Compute(&context_);
  }
  OpenStream(const OpenStream&) = delete;
  OpenStream& operator=(const OpenStream&) = delete;
  ~OpenStream() {
    if (finished_) return;
    context_.TryCancel();
    Finish();
  }

  bool Write(const v1::ComputeRequest& request) { return stream_->Write(request); }
  bool WritesDone() { return stream_->WritesDone(); }
  void Cancel() { context_.TryCancel(); }
  // Reads what is left, then the status.
  grpc::Status Finish() {
    v1::ComputeResponse response;
    while (stream_->Read(&response)) continue;
    finished_ = true;
    return stream_->Finish();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ComputeRequest, v1::ComputeResponse>> stream_;
  bool finished_ = false;
};

// A sample of one of the server's event metrics (counters, the in-flight gauge); 0 when absent.
double EventMetric(server::LossServer& server, const std::string& name,
                   const std::map<std::string, std::string>& labels = {}) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::map<std::string, std::string> have;
      for (const auto& label : metric.label) have[label.name] = label.value;
      bool match = true;
      for (const auto& [key, value] : labels) match = match && have[key] == value;
      if (match)
        return family.type == prometheus::MetricType::Gauge ? metric.gauge.value
                                                            : metric.counter.value;
    }
  }
  return 0.0;
}

server::ServerConfig StallConfig() {
  server::ServerConfig config;
  config.demo = {kStallHead, kStallVocab, kStallHidden, 11};
  config.workspace_budget_bytes = 1 << 20;
  config.max_running_calls = 2;
  return config;
}

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

// ---------------------------------------------------------------------------------------------
// Pending memory: calls not yet admitted (waiting for their rows or in the queue) hold their start
// message while it is parsed, their labels and token weights, and rows read ahead, within one
// server-wide bound; beyond it a call is refused with RESOURCE_EXHAUSTED naming the bound.

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

// ---------------------------------------------------------------------------------------------
// Handler failures: whatever a handler meets (here every allocation on the device throwing
// std::bad_alloc, as operator new does when memory runs out) ends the call with a status the
// client can act on, counted by code, with the in-flight count back down, so that a shutdown
// does not wait for calls that are gone.

// The CPU backend, except that Allocate throws std::bad_alloc while `failing` is set.
class ThrowingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  std::atomic<bool> failing{false};

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (failing.load()) throw std::bad_alloc();
    return ForwardingBackend::Allocate(bytes);
  }
};

TEST(HandlerFailureTest, ThrownAllocationsEndCallsAccountedAndShutdownIsPrompt) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto owned = std::make_unique<ThrowingBackend>(*std::move(cpu));
  ThrowingBackend& backend = *owned;
  server::ServerConfig config = StallConfig();
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.cache_call_buffers = false;  // every call allocates
  absl::StatusOr<std::unique_ptr<server::LossServer>> started =
      server::LossServer::Start(config, std::move(owned));
  ASSERT_TRUE(started.ok()) << started.status();
  server::LossServer& server = **started;
  auto stub = ConnectTo(server.port());
  const Batch batch = RandomBatch(kStallRows, kStallVocab, kStallHidden, rng);

  backend.failing = true;
  const grpc::Status upload =
      Upload(*stub, "fresh", 64, kStallHidden, RandomWeight(64, kStallHidden, rng), false);
  const ComputeOutcome compute = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                             FloatBytes(batch.hidden), kStallRowsPerMessage);
  grpc::Status step;
  {
    grpc::ClientContext context;
    v1::StepRequest request;
    request.set_head(kStallHead);
    request.mutable_adamw()->set_learning_rate(1e-3);  // its moments are allocated now
    v1::StepResponse response;
    step = stub->Step(&context, request, &response);
  }
  backend.failing = false;

  for (const auto& [method, status] :
       {std::pair{"UploadHead", upload}, std::pair{"Compute", compute.status},
        std::pair{"Step", step}}) {
    SCOPED_TRACE(method);
    EXPECT_EQ(status.error_code(), StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_NE(status.error_message().find("alloc"), std::string::npos) << status.error_message();
    // Counted before the client could hear its status.
    EXPECT_EQ(EventMetric(server, "lossd_requests_total",
                          {{"method", method}, {"code", "RESOURCE_EXHAUSTED"}}),
              1);
  }
  EXPECT_TRUE(Eventually([&] { return EventMetric(server, "lossd_inflight_calls") == 0.0; }));
  EXPECT_TRUE(SettlesToIdle(server, 0));

  // The server still serves, and right.
  const FetchedTensor weight = Fetch(*stub, kStallHead, false);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_TRUE(
      LossMatches(out.summary.loss(), Reference(weight.values, kStallVocab, kStallHidden, batch)));

  // No call is left in flight, so a shutdown returns long before its drain limit, which it would
  // wait out for a call still running.
  constexpr absl::Duration kDrain = absl::Seconds(300);
  const absl::Time start = absl::Now();
  server.Shutdown(kDrain);
  const absl::Duration shutdown = absl::Now() - start;
  RecordProperty("shutdown_seconds", absl::StrCat(absl::ToDoubleSeconds(shutdown)));
  EXPECT_LT(shutdown, kDrain);
}

// ---------------------------------------------------------------------------------------------
// The compute budget: with --compute_memory_mib 0 it follows the heads the server holds, so that
// a head added by an upload can be trained on; a call the budget cannot hold is told what would
// make it fit.

TEST(ComputeBudgetTest, FollowsTheHeadsWhenNotSet) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  server::ServerConfig config = StallConfig();  // a [2000, 64] head
  config.demo.vocab_size = 500;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  auto budget_for = [&](int64_t largest_vocab) {
    return config.max_running_calls *
           (static_cast<int64_t>(config.workspace_budget_bytes) +
            largest_vocab * kStallHidden * static_cast<int64_t>(sizeof(float)));
  };
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(500));

  // A head 40 times larger: its staging dL/dW alone is over the budget the demo head gave.
  constexpr int64_t kLargeVocab = 20000;
  const std::vector<float> weight = RandomWeight(kLargeVocab, kStallHidden, rng);
  ASSERT_TRUE(Upload(*stub, "large", kLargeVocab, kStallHidden, weight, false).ok());
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(kLargeVocab));
  const Batch batch = RandomBatch(60, kLargeVocab, kStallHidden, rng);
  const ComputeOutcome out = CallCompute(*stub, StartFor("large", batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  const ReferenceResult ref = Reference(weight, kLargeVocab, kStallHidden, batch);
  EXPECT_TRUE(LossMatches(out.summary.loss(), ref));
  EXPECT_LE(RelativeError(AsFloats(out.grad_hidden), ref.grad_hidden), kGradBound);

  // Replaced by a smaller head, it no longer sizes the budget.
  ASSERT_TRUE(
      Upload(*stub, "large", 1000, kStallHidden, RandomWeight(1000, kStallHidden, rng), true).ok());
  EXPECT_EQ(server->scheduler().capacity_bytes(), budget_for(1000));
  // The trained head went with its accumulator; no call holds anything.
  EXPECT_TRUE(SettlesToIdle(*server, 0));
}

struct OverBudgetCase {
  const char* name;
  const char* why;
  int64_t compute_memory_bytes;
  size_t workspace_budget_bytes;
  int64_t vocab;
  int64_t rows;
  bool training;
  std::vector<const char*> says;
  std::vector<const char*> never_says;
};

void PrintTo(const OverBudgetCase& c, std::ostream* os) { *os << c.name; }

const OverBudgetCase kOverBudgetCases[] = {
    {"staging_over_budget",
     "a 20000 x 64 staging dL/dW (5 MB) over a 1 MiB budget",
     1 << 20,
     1 << 20,
     20000,
     16,
     true,
     {"--compute_memory_mib of at least 6", "Fewer tokens cannot make it fit",
      "staging dL/dW of head 'stalled'"},
     {"fewer tokens per call", "--workspace_budget_mib"}},
    {"workspace_over_budget",
     "a 4 MiB workspace budget over a 3 MiB compute budget",
     3 << 20,
     4 << 20,
     4000,
     4000,
     true,
     {"--workspace_budget_mib of at most 2", "--compute_memory_mib of at least",
      "fewer tokens per call"},
     {"cannot"}},
    {"scoring_workspace_over_budget",
     "a scoring call with no staging, same budgets",
     3 << 20,
     4 << 20,
     4000,
     4000,
     false,
     {"--workspace_budget_mib of at most 3", "fewer tokens per call"},
     {"staging", "cannot"}},
};

class OverBudgetTest : public ::testing::TestWithParam<OverBudgetCase> {};

TEST_P(OverBudgetTest, RefusalSaysWhatWouldMakeTheCallFit) {
  const OverBudgetCase& c = GetParam();
  SCOPED_TRACE(c.why);
  std::mt19937_64 rng(FreshSeed());
  server::ServerConfig config = StallConfig();
  config.demo.vocab_size = c.vocab;
  config.compute_memory_bytes = c.compute_memory_bytes;
  config.workspace_budget_bytes = c.workspace_budget_bytes;
  auto server = StartTestServer(config);
  ASSERT_NE(server, nullptr);
  auto stub = ConnectTo(server->port());
  const Batch batch = RandomBatch(c.rows, c.vocab, kStallHidden, rng);
  const ComputeOutcome out =
      CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, c.training),
                  FloatBytes(batch.hidden), c.rows);
  const std::string& message = out.status.error_message();
  EXPECT_EQ(out.status.error_code(), StatusCode::RESOURCE_EXHAUSTED) << message;
  for (const char* text : c.says) EXPECT_NE(message.find(text), std::string::npos) << message;
  for (const char* text : c.never_says) EXPECT_EQ(message.find(text), std::string::npos) << message;
  // Typed in the status details, for clients to act on without reading the message.
  const std::optional<v1::ErrorInfo> info = ErrorInfoIn(out.status);
  ASSERT_TRUE(info.has_value()) << "no ErrorInfo in the refusal's details";
  EXPECT_EQ(info->reason(), v1::ErrorInfo::OVER_BUDGET);
  // Counted before the client could hear its status.
  EXPECT_EQ(EventMetric(*server, "lossd_admission_rejected_total", {{"reason", "over_budget"}}), 1);
}

INSTANTIATE_TEST_SUITE_P(Table, OverBudgetTest, ::testing::ValuesIn(kOverBudgetCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::testing
