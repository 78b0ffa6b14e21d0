// Bad input: every malformed request gets its code and a message naming the field, and changes
// nothing: W, the accumulated gradient, the heads and the server's memory stay as they were.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

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

// PPO with a token-level rollout correction and the engine's log-probabilities.
void MakeRolloutCorrected(Script& s) {
  MakePpo(s);
  PolicyOf(s).set_rollout_correction(v1::ROLLOUT_CORRECTION_TOKEN);
  for (int i = 0; i < kRows; ++i) StartOf(s).add_rollout_logprobs(-3.2f);
}

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
    {"dro_beta_negative", "a penalty that pushes logp away from q", Rpc::kCompute, kInvalid,
     "options.policy.dro_beta",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_DRO);
       PolicyOf(s).set_dro_beta(-0.5);
     }},
    {"dro_beta_under_ppo", "beta is dro's alone", Rpc::kCompute, kInvalid,
     "options.policy.dro_beta",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_dro_beta(0.5);
     }},
    {"log_ratio_clamp_under_dro", "dro has no ratio to clamp", Rpc::kCompute, kInvalid,
     "options.policy.log_ratio_clamp",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_DRO);
       PolicyOf(s).set_log_ratio_clamp(20.0);
     }},
    {"dro_without_advantages", "dro reads A", Rpc::kCompute, kInvalid, "advantages",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_DRO);
       StartOf(s).clear_advantages();
     }},
    {"sapo_tau_zero", "4 / tau would be Inf", Rpc::kCompute, kInvalid,
     "options.policy.sapo_tau_positive",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_SAPO);
       PolicyOf(s).set_sapo_tau_positive(0.0);
     }},
    {"sapo_tau_nan", "a NaN temperature", Rpc::kCompute, kInvalid,
     "options.policy.sapo_tau_negative",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_SAPO);
       PolicyOf(s).set_sapo_tau_negative(kNaN);
     }},
    {"sapo_tau_under_cispo", "the gate's temperatures are sapo's alone", Rpc::kCompute, kInvalid,
     "options.policy.sapo_tau_negative",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_CISPO);
       PolicyOf(s).set_sapo_tau_negative(2.0);
     }},
    {"kl_ratio_weighted_without_estimator", "no KL to weight", Rpc::kCompute, kInvalid,
     "options.policy.kl_ratio_weighted",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_kl_ratio_weighted(true);
     }},
    {"kl_ratio_weighted_under_cross_entropy", "cross-entropy has no ratio", Rpc::kCompute,
     kInvalid, "options.policy.kl_ratio_weighted",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K3);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_CROSS_ENTROPY);
       StartOf(s).clear_sampling_logprobs();
       StartOf(s).clear_advantages();
       PolicyOf(s).set_kl_ratio_weighted(true);
     }},
    {"rollout_logprobs_without_correction", "nothing reads them", Rpc::kCompute, kInvalid,
     "rollout_logprobs",
     [](Script& s) {
       MakeRolloutCorrected(s);
       PolicyOf(s).clear_rollout_correction();
     }},
    {"rollout_cap_without_correction", "a cap of nothing", Rpc::kCompute, kInvalid,
     "options.policy.rollout_is_cap",
     [](Script& s) {
       MakePpo(s);
       PolicyOf(s).set_rollout_is_cap(3.0);
     }},
    {"rollout_correction_under_dro", "dro's penalty is no ratio term to weight", Rpc::kCompute,
     kInvalid, "options.policy.rollout_correction",
     [](Script& s) {
       MakeRolloutCorrected(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_DRO);
     }},
    {"rollout_correction_9", "an enum value the contract does not define", Rpc::kCompute,
     kInvalid, "options.policy.rollout_correction",
     [](Script& s) {
       MakeRolloutCorrected(s);
       PolicyOf(s).set_rollout_correction(static_cast<v1::RolloutCorrection>(9));
     }},
    {"rollout_cap_below_one", "a cap below 1 would shrink on-policy tokens", Rpc::kCompute,
     kInvalid, "options.policy.rollout_is_cap",
     [](Script& s) {
       MakeRolloutCorrected(s);
       PolicyOf(s).set_rollout_is_cap(0.5);
     }},
    {"rollout_logprobs_short", "one value per token", Rpc::kCompute, kInvalid, "rollout_logprobs",
     [](Script& s) {
       MakeRolloutCorrected(s);
       StartOf(s).mutable_rollout_logprobs()->RemoveLast();
     }},
    {"rollout_logprob_nan", "a NaN on a counted row", Rpc::kCompute, kInvalid,
     "rollout_logprobs[5]",
     [](Script& s) {
       MakeRolloutCorrected(s);
       StartOf(s).set_rollout_logprobs(5, std::nanf(""));
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
    {"gspo_without_sequences", "a sequence's ratio needs the call's sequences", Rpc::kCompute,
     kInvalid, "sequence_lengths",
     [](Script& s) {
       MakePpo(s);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_GSPO);
     }},
    {"gspo_with_the_unbiased_kl", "the unbiased KL weights by the token's own ratio",
     Rpc::kCompute, kInvalid, "options.policy.kl_ratio_weighted",
     [](Script& s) {
       MakePpo(s, v1::KL_ESTIMATOR_K3);
       StartOf(s).mutable_options()->set_objective(v1::OBJECTIVE_GSPO);
       StartOf(s).add_sequence_lengths(kRows);
       PolicyOf(s).set_kl_coef(0.1);
       PolicyOf(s).set_kl_ratio_weighted(true);
     }},
    {"sparse_tail_bucket_tempered", "the tail has no logits for a temperature to soften",
     Rpc::kCompute, kInvalid, "options.distill.temperature",
     [](Script& s) {
       MakeSparse(s);
       DistillOf(s).set_sparse_teacher_mass(v1::SPARSE_TEACHER_TAIL_BUCKET);
       DistillOf(s).set_temperature(2.0);
     }},
    {"sparse_tail_bucket_empty_reverse_kl",
     "row 6's top-k holds all its mass (0.4005 + 3 x 0.2): KL(q || p) of its empty bucket is "
     "infinite",
     Rpc::kCompute, kInvalid, "chunk.teacher_top_k_logprobs[6]",
     [](Script& s) {
       MakeSparse(s);
       DistillOf(s).set_sparse_teacher_mass(v1::SPARSE_TEACHER_TAIL_BUCKET);
       DistillOf(s).set_beta(1.0);
       SetSparse<float>(s, false, 6, 0, std::log(0.4005f));
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

}  // namespace
}  // namespace lossd::testing
