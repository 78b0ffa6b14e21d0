#include "server/call/call_spec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "server/call/proto_convert.h"

namespace lossd::server {
namespace {

// A protobuf output stream that hashes what is serialized into it instead of keeping it, so that
// a start message of any size is fingerprinted in a fixed 64 KiB. Equal bytes are cut into equal
// chunks, so equal messages hash equal.
class HashingOutputStream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  bool Next(void** data, int* size) override {
    Absorb();
    *data = buffer_.data();
    *size = static_cast<int>(buffer_.size());
    filled_ = buffer_.size();
    return true;
  }
  void BackUp(int count) override { filled_ -= static_cast<size_t>(count); }
  int64_t ByteCount() const override { return static_cast<int64_t>(absorbed_ + filled_); }

  uint64_t Finish() {
    Absorb();
    return state_;
  }

 private:
  void Absorb() {
    if (filled_ == 0) return;
    state_ = absl::HashOf(state_, absl::string_view(buffer_.data(), filled_));
    absorbed_ += filled_;
    filled_ = 0;
  }

  std::array<char, 64 << 10> buffer_;
  size_t filled_ = 0;
  size_t absorbed_ = 0;
  uint64_t state_ = 0;
};

// The call's objective by the name its client gave it, lossd.v1.Objective's in lower case without
// its prefix: gspo runs as ppo, and is gspo to the client.
std::string ObjectiveNameOf(const v1::ComputeStart& start) {
  absl::string_view name = v1::Objective_Name(start.options().objective());
  absl::ConsumePrefix(&name, "OBJECTIVE_");
  return absl::AsciiStrToLower(name);
}

// A client's name for one call, so that a retry of it is recognized: printable ASCII, no spaces,
// short enough that the ids a head keeps stay small (a UUID takes 32 or 36 characters).
absl::Status ValidateCallId(const std::string& call_id) {
  if (call_id.size() > kMaxCallIdBytes) {
    return InvalidField("call_id", absl::StrCat("at most ", kMaxCallIdBytes, " characters"),
                        absl::StrCat(call_id.size()));
  }
  for (size_t i = 0; i < call_id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(call_id[i]);
    if (c < 0x21 || c > 0x7e) {
      return InvalidField("call_id", "printable ASCII without spaces",
                          absl::StrCat("byte ", static_cast<int>(c), " at offset ", i));
    }
  }
  return absl::OkStatus();
}

// verl's rollout correction (truncated importance sampling between the engine that sampled and the
// old policy): rho_i = min(exp(l_i), C) with l_i = q_i - mu_i per token, or the sum or the mean of
// q - mu over the counted rows of row i's sequence. For the objectives it applies to, rho_i > 0
// multiplies the whole policy term, so it multiplies A_i: -r (rho A), -min(r rho A, clip(r) rho A),
// -clip(r) rho A logp and SAPO's gate (whose temperature follows A's sign, which rho keeps) are the
// weighted terms exactly, with rho constant in the gradient, and the KL and entropy terms are left
// as they are.
absl::Status ApplyRolloutCorrection(const v1::ComputeStart& start, CallSpec& spec) {
  const v1::PolicyOptions& policy = start.options().policy();
  const v1::RolloutCorrection correction = policy.rollout_correction();
  if (correction == v1::ROLLOUT_CORRECTION_NONE) {
    if (start.rollout_logprobs_size() > 0) {
      return InvalidField("rollout_logprobs", "no values without options.policy.rollout_correction",
                          absl::StrCat(start.rollout_logprobs_size(), " values"));
    }
    if (policy.has_rollout_is_cap()) {
      return InvalidField("options.policy.rollout_is_cap", "unset without a rollout_correction",
                          absl::StrCat(policy.rollout_is_cap()));
    }
    return absl::OkStatus();
  }
  if (!v1::RolloutCorrection_IsValid(correction)) {
    return InvalidField("options.policy.rollout_correction",
                        "ROLLOUT_CORRECTION_NONE, _TOKEN, _SEQUENCE or _GEOMETRIC",
                        absl::StrCat(static_cast<int>(correction)));
  }
  if (!UsesRatio(spec.options.objective)) {
    return InvalidField(
        "options.policy.rollout_correction",
        absl::StrCat("ROLLOUT_CORRECTION_NONE unless the objective is ", kRatioObjectiveNames),
        absl::StrCat(v1::RolloutCorrection_Name(correction), " with objective ",
                     ObjectiveNameOf(start)));
  }
  const double cap = policy.has_rollout_is_cap() ? policy.rollout_is_cap() : 2.0;
  if (!(cap >= 1.0 && cap <= FLT_MAX)) {
    return InvalidField("options.policy.rollout_is_cap",
                        absl::StrCat("a value in [1, ", FLT_MAX, "]"), absl::StrCat(cap));
  }
  const int64_t n = spec.num_tokens;
  if (start.rollout_logprobs_size() != n) {
    return InvalidField("rollout_logprobs",
                        absl::StrCat(n, " entries (num_tokens) with a rollout_correction"),
                        absl::StrCat(start.rollout_logprobs_size()));
  }
  std::vector<double> log_weight(n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (!spec.counted(i)) continue;
    const float mu = start.rollout_logprobs(i);
    if (!std::isfinite(mu)) {
      return InvalidField(absl::StrCat("rollout_logprobs[", i, "]"), "a finite value",
                          absl::StrCat(mu));
    }
    log_weight[i] = static_cast<double>(spec.sampling_logprobs[i]) - mu;
  }
  if (correction != v1::ROLLOUT_CORRECTION_TOKEN) {
    // Sequences as the sequence reductions take them (already checked); none: one sequence.
    std::vector<int64_t> lengths(start.sequence_lengths().begin(), start.sequence_lengths().end());
    if (lengths.empty()) lengths.push_back(n);
    for (int64_t first = 0; const int64_t length : lengths) {
      double sum = 0.0;
      int64_t kept = 0;
      for (int64_t i = first; i < first + length; ++i) {
        sum += log_weight[i];
        kept += spec.counted(i);
      }
      const double sequence_log_weight =
          correction == v1::ROLLOUT_CORRECTION_SEQUENCE ? sum : sum / std::max<int64_t>(kept, 1);
      std::fill(log_weight.begin() + first, log_weight.begin() + first + length,
                sequence_log_weight);
      first += length;
    }
  }
  const double log_cap = std::log(cap);
  double weight_sum = 0.0;
  int64_t truncated = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!spec.counted(i)) continue;
    const bool capped = log_weight[i] > log_cap;
    const double rho = capped ? cap : std::exp(log_weight[i]);
    spec.advantages[i] = static_cast<float>(rho * spec.advantages[i]);
    weight_sum += rho;
    truncated += capped;
    ++counted;
  }
  spec.mean_rollout_is_weight = counted > 0 ? weight_sum / counted : 0.0;
  spec.rollout_is_truncated_fraction = counted > 0 ? static_cast<double>(truncated) / counted : 0.0;
  return absl::OkStatus();
}

// The per-token inputs of the call's objective and terms, each num_tokens long and finite where
// read; inputs the call does not read are refused rather than ignored. With a sequence reduction,
// each row's factor from sequence_lengths.
absl::Status ParseObjectiveInputs(const v1::ComputeStart& start, CallSpec& spec) {
  const LossOptions& options = spec.options;
  struct Input {
    const char* field;
    const google::protobuf::RepeatedField<float>& values;
    bool read;
    const char* read_by;
    std::vector<float>* into;
  };
  const Input inputs[] = {
      {"sampling_logprobs", start.sampling_logprobs(), IsPolicyObjective(options.objective),
       kPolicyObjectiveNames, &spec.sampling_logprobs},
      {"advantages", start.advantages(), IsPolicyObjective(options.objective),
       kPolicyObjectiveNames, &spec.advantages},
      {"reference_logprobs", start.reference_logprobs(),
       options.policy.kl_estimator != KlEstimator::kNone, "a policy.kl_estimator",
       &spec.reference_logprobs},
      {"logprob_grads", start.logprob_grads(), options.objective == Objective::kLogprobGradient,
       "logprob_gradient", &spec.logprob_grads},
  };
  for (const Input& input : inputs) {
    const int64_t size = input.values.size();
    if (!input.read && size > 0) {
      return InvalidField(input.field,
                          absl::StrCat("no values with objective ", ObjectiveNameOf(start),
                                       " (only ", input.read_by, " read them)"),
                          absl::StrCat(size, " values"));
    }
    if (input.read && size != spec.num_tokens) {
      return InvalidField(input.field,
                          absl::StrCat(spec.num_tokens, " entries (num_tokens) for objective ",
                                       ObjectiveNameOf(start)),
                          absl::StrCat(size));
    }
    input.into->assign(input.values.begin(), input.values.end());
  }
  BatchInputs view;
  view.num_tokens = spec.num_tokens;
  view.labels = spec.labels_or_null();
  const auto or_null = [](const std::vector<float>& values) {
    return values.empty() ? nullptr : values.data();
  };
  view.sampling_logprobs = or_null(spec.sampling_logprobs);
  view.advantages = or_null(spec.advantages);
  view.reference_logprobs = or_null(spec.reference_logprobs);
  view.logprob_grads = or_null(spec.logprob_grads);
  if (IsSequenceReduction(options.reduction) || start.sequence_lengths_size() > 0) {
    ASSIGN_OR_RETURN(
        std::vector<double> scales,
        SequenceReductionScales(options, spec.labels_or_null(), spec.num_tokens,
                                start.sequence_lengths().data(), start.sequence_lengths_size()));
    if (IsSequenceReduction(options.reduction)) spec.reduction_scales = std::move(scales);
    view.reduction_scales = spec.reduction_scales.data();
  }
  RETURN_IF_ERROR(ValidateObjectiveInputs(view, options));
  return ApplyRolloutCorrection(start, spec);
}

// A distill call's teacher: a served head whose vocabulary is the student's, with the size and
// dtype of its rows, or a sparse top-k; nothing of a teacher for another objective.
absl::Status ParseTeacher(const ComputeEnvironment& env, const v1::ComputeStart& start,
                          CallSpec& spec) {
  const bool distill = spec.options.objective == Objective::kDistill;
  const bool named = !start.teacher_head().empty();
  if (!distill) {
    if (named || start.has_teacher_head_version() || start.teacher_hidden_size() != 0 ||
        start.teacher_hidden_dtype() != v1::DTYPE_UNSPECIFIED || start.teacher_top_k() != 0) {
      return InvalidField("teacher_head/teacher_top_k",
                          "none unless options.objective is OBJECTIVE_DISTILL",
                          absl::StrCat("a teacher with objective ", ObjectiveNameOf(start)));
    }
    return absl::OkStatus();
  }
  const Head& student = *spec.head;
  if (named == (start.teacher_top_k() != 0)) {
    return InvalidField("teacher_head/teacher_top_k",
                        "a teacher head or a sparse teacher_top_k > 0 (OBJECTIVE_DISTILL)",
                        named ? "both" : "neither");
  }
  if (!named) {
    const int64_t max_k = std::min<int64_t>(student.vocab_size(), kMaxTeacherTopK);
    if (start.teacher_top_k() < 1 || start.teacher_top_k() > max_k) {
      return InvalidField("teacher_top_k", absl::StrCat("a value in [1, ", max_k, "]"),
                          absl::StrCat(start.teacher_top_k()));
    }
    if (start.has_teacher_head_version() || start.teacher_hidden_size() != 0 ||
        start.teacher_hidden_dtype() != v1::DTYPE_UNSPECIFIED) {
      return InvalidField("teacher_head_version/teacher_hidden_size/teacher_hidden_dtype",
                          "none with a sparse teacher_top_k", "a value");
    }
    RETURN_IF_ERROR(ValidateSparseTeacherOptions(spec.options.distill, "options.distill."));
    spec.teacher_top_k = start.teacher_top_k();
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<Head>> teacher = env.heads->Get(start.teacher_head());
  if (!teacher.ok()) {
    return absl::Status(teacher.status().code(),
                        absl::StrCat("teacher_head: ", teacher.status().message()));
  }
  spec.teacher = *std::move(teacher);
  const Head& t = *spec.teacher;
  if (!start.options().distill().has_teacher_logit_softcap()) {
    spec.options.distill.teacher_logit_softcap = t.logit_softcap();
  }
  if (t.vocab_size() != student.vocab_size()) {
    return InvalidField("teacher_head",
                        absl::StrCat("a head with the vocabulary of head '", student.name(),
                                     "' (V = ", student.vocab_size(), ")"),
                        absl::StrCat("head '", t.name(), "' with V = ", t.vocab_size()));
  }
  if (start.has_teacher_head_version()) spec.teacher_pinned_version = start.teacher_head_version();
  if (start.teacher_hidden_size() != t.hidden_size()) {
    return InvalidField("teacher_hidden_size",
                        absl::StrCat(t.hidden_size(), " (teacher head '", t.name(), "')"),
                        absl::StrCat(start.teacher_hidden_size()));
  }
  spec.teacher_hidden_size = t.hidden_size();
  ASSIGN_OR_RETURN(spec.teacher_hidden_dtype, FromProto(start.teacher_hidden_dtype(),
                                                        "teacher_hidden_dtype", spec.hidden_dtype));
  return absl::OkStatus();
}

}  // namespace

// At least the host memory ParseStart's copies of `start` take (CallSpec::copied_bytes), before
// it has run: given sequence lengths, it makes each row's factor in the reduction, kept or not,
// so one is counted per announced row (at most max_tokens).
int64_t StartCopiesBound(const v1::ComputeStart& start, int64_t max_tokens) {
  const int64_t floats = start.token_weights_size() + start.sampling_logprobs_size() +
                         start.advantages_size() + start.reference_logprobs_size() +
                         start.logprob_grads_size();
  const int64_t scales = start.sequence_lengths_size() > 0
                             ? std::clamp<int64_t>(start.num_tokens(), 0, max_tokens)
                             : 0;
  return start.labels_size() * static_cast<int64_t>(sizeof(int64_t)) +
         floats * static_cast<int64_t>(sizeof(float)) +
         scales * static_cast<int64_t>(sizeof(double));
}

// Sets spec.version (and a teacher head's spec.teacher_version) to the head's current version,
// which a pinned call must match; with a pinned hash, to the version whose W has it, so that a
// step after the check fails the call (ABORTED) rather than letting it compute on another W.
absl::Status CheckPinnedWeights(CallSpec& spec) {
  if (spec.pinned_sha256.empty()) {
    spec.version = spec.head->version();
  } else {
    ASSIGN_OR_RETURN(const WeightDigest digest, spec.head->Digest());
    spec.version = digest.version;
    if (digest.sha256 != spec.pinned_sha256) {
      return HeadMovedError(
          "weight_sha256",
          absl::StrCat("the call is pinned to W with SHA-256 ", spec.pinned_sha256, ", but head '",
                       spec.head->name(), "' on this server holds W with SHA-256 ", digest.sha256,
                       " (version ", digest.version,
                       "): this replica serves another W; nothing was computed"));
    }
  }
  if (spec.pinned_version.has_value() && *spec.pinned_version != spec.version) {
    return HeadMovedError(
        "head_version",
        absl::StrCat("the call is pinned to version ", *spec.pinned_version, " of head '",
                     spec.head->name(), "', which is now at version ", spec.version));
  }
  if (spec.teacher == nullptr) return absl::OkStatus();
  spec.teacher_version = spec.teacher->version();
  if (spec.teacher_pinned_version.has_value() &&
      *spec.teacher_pinned_version != spec.teacher_version) {
    return HeadMovedError(
        "teacher_head_version",
        absl::StrCat("the call is pinned to version ", *spec.teacher_pinned_version,
                     " of teacher head '", spec.teacher->name(), "', which is now at version ",
                     spec.teacher_version));
  }
  return absl::OkStatus();
}

// What decides a call's dL/dW besides its rows and W: the start message's deterministic
// serialization without the fields that only name the call (call_id), say how its rows travel
// (shared_memory), pin what it may run against (head_version, teacher_head_version,
// weight_sha256) or choose what comes back (outputs). Every other field, present or added later,
// counts, so a retry must send it again. Equal for a retry of the call, different for another
// call with the id (within a process: absl::Hash is seeded per process, and ids live no longer
// than the process). The set-aside fields are put back before it returns.
uint64_t StartFingerprint(v1::ComputeStart& start) {
  const google::protobuf::Descriptor& descriptor = *v1::ComputeStart::descriptor();
  std::vector<const google::protobuf::FieldDescriptor*> set_aside;
  for (const int number :
       {v1::ComputeStart::kCallIdFieldNumber, v1::ComputeStart::kSharedMemoryFieldNumber,
        v1::ComputeStart::kHeadVersionFieldNumber, v1::ComputeStart::kTeacherHeadVersionFieldNumber,
        v1::ComputeStart::kWeightSha256FieldNumber, v1::ComputeStart::kOutputsFieldNumber}) {
    set_aside.push_back(descriptor.FindFieldByNumber(number));
  }
  v1::ComputeStart aside;
  const google::protobuf::Reflection& reflection = *start.GetReflection();
  reflection.SwapFields(&start, &aside, set_aside);
  HashingOutputStream hashed;
  {
    google::protobuf::io::CodedOutputStream coded(&hashed);
    coded.SetSerializationDeterministic(true);
    start.ByteSizeLong();  // the sizes that serialization reads, of the message as it is now
    start.SerializeWithCachedSizes(&coded);
  }
  reflection.SwapFields(&start, &aside, set_aside);
  return hashed.Finish();
}

// `start_fingerprint`: StartFingerprint(start) when it has a call_id.
absl::StatusOr<CallSpec> ParseStart(const ComputeEnvironment& env, const v1::ComputeStart& start,
                                    uint64_t start_fingerprint) {
  CallSpec spec;
  ASSIGN_OR_RETURN(spec.head, env.heads->Get(start.head()));
  const Head& head = *spec.head;
  if (start.has_head_version()) spec.pinned_version = start.head_version();
  if (!start.weight_sha256().empty() && !IsWeightDigest(start.weight_sha256())) {
    const std::string& pin = start.weight_sha256();
    return InvalidField(
        "weight_sha256", "64 lowercase hex digits (a HeadInfo.weight_sha256) or empty",
        absl::StrCat("'", absl::CHexEscape(pin.substr(0, 80)), "'", pin.size() > 80 ? "..." : ""));
  }
  spec.pinned_sha256 = start.weight_sha256();
  ASSIGN_OR_RETURN(spec.options, FromProto(start.options()));
  if (!start.options().has_logit_softcap()) spec.options.logit_softcap = head.logit_softcap();
  if (start.num_tokens() < 0 || start.num_tokens() > env.limits.max_tokens_per_call) {
    return InvalidField("num_tokens",
                        absl::StrCat("a count in [0, ", env.limits.max_tokens_per_call, "]"),
                        absl::StrCat(start.num_tokens()));
  }
  spec.num_tokens = start.num_tokens();
  if (start.hidden_size() != head.hidden_size()) {
    return InvalidField("hidden_size",
                        absl::StrCat(head.hidden_size(), " (head '", head.name(), "')"),
                        absl::StrCat(start.hidden_size()));
  }
  spec.hidden_size = start.hidden_size();
  ASSIGN_OR_RETURN(spec.hidden_dtype, FromProto(start.hidden_dtype(), "hidden_dtype"));
  RETURN_IF_ERROR(ParseTeacher(env, start, spec));
  RETURN_IF_ERROR(CheckPinnedWeights(spec));
  // Only distill with alpha 0 reads no label.
  spec.has_labels =
      !(spec.options.objective == Objective::kDistill && spec.options.distill.alpha == 0.0 &&
        start.labels_size() == 0 && spec.num_tokens > 0);
  if (spec.has_labels && start.labels_size() != spec.num_tokens) {
    return InvalidField(
        "labels",
        absl::StrCat(
            spec.num_tokens, " entries (num_tokens)",
            spec.options.objective == Objective::kDistill ? ", or none with distill.alpha 0" : ""),
        absl::StrCat(start.labels_size()));
  }
  if (start.token_weights_size() != 0 && start.token_weights_size() != spec.num_tokens) {
    return InvalidField("token_weights",
                        absl::StrCat("0 or ", spec.num_tokens, " entries (num_tokens)"),
                        absl::StrCat(start.token_weights_size()));
  }
  spec.labels.assign(start.labels().begin(), start.labels().end());
  spec.token_weights.assign(start.token_weights().begin(), start.token_weights().end());
  if (spec.has_labels) {
    RETURN_IF_ERROR(ValidateLabels(spec.labels.data(), spec.num_tokens, head.vocab_size(),
                                   spec.options.ignore_index));
  }
  if (start.shift_labels()) {
    if (!spec.has_labels) {
      return InvalidField("shift_labels", "false in a call without labels", "true");
    }
    // Before the objective's inputs are read: a sequence reduction counts the shifted labels.
    RETURN_IF_ERROR(ValidateSequenceLengths(start.sequence_lengths().data(),
                                            start.sequence_lengths_size(), spec.num_tokens));
    ShiftLabelsWithinSequences(spec.labels.data(), spec.num_tokens, start.sequence_lengths().data(),
                               start.sequence_lengths_size(), spec.options.ignore_index);
  }
  RETURN_IF_ERROR(ValidateTokenWeights(spec.token_weights.data(),
                                       static_cast<int64_t>(spec.token_weights.size())));
  RETURN_IF_ERROR(ParseObjectiveInputs(start, spec));
  if (start.options().objective() == v1::OBJECTIVE_GSPO) {
    if (start.sequence_lengths_size() == 0) {
      return InvalidField("sequence_lengths",
                          "the call's sequences with OBJECTIVE_GSPO (a sequence's ratio is the "
                          "geometric mean of its tokens')",
                          "none");
    }
    if (spec.options.policy.kl_ratio_weighted) {
      return InvalidField("options.policy.kl_ratio_weighted",
                          "false with OBJECTIVE_GSPO (the unbiased KL weights by the token's own "
                          "ratio; gspo's is the sequence's)",
                          "true");
    }
    spec.ratio_sequences.assign(start.sequence_lengths().begin(), start.sequence_lengths().end());
  }

  spec.outputs = start.outputs();
  const int top_k = spec.outputs.top_k();
  if (top_k < 0 || top_k > kMaxTopK || top_k > head.vocab_size()) {
    return InvalidField(
        "outputs.top_k",
        absl::StrCat("a value in [0, ", std::min<int64_t>(kMaxTopK, head.vocab_size()), "]"),
        absl::StrCat(top_k));
  }
  ASSIGN_OR_RETURN(
      spec.grad_hidden_dtype,
      FromProto(spec.outputs.grad_hidden_dtype(), "outputs.grad_hidden_dtype", spec.hidden_dtype));
  if (spec.options.objective != Objective::kDistill && (spec.outputs.kd() || spec.outputs.ce())) {
    return InvalidField(spec.outputs.kd() ? "outputs.kd" : "outputs.ce",
                        "false unless the objective is distill",
                        absl::StrCat("true with objective ", ObjectiveNameOf(start)));
  }
  if (start.has_shared_memory()) spec.shared_memory = start.shared_memory();
  if (spec.shared_memory.has_value() && spec.options.objective == Objective::kDistill) {
    return InvalidField("shared_memory",
                        "none with a teacher (its rows travel in ComputeChunk messages only)",
                        "a memfd");
  }
  spec.counted_tokens =
      CountCountedRows(spec.labels_or_null(), spec.num_tokens, spec.options.ignore_index);
  // Every engine chunk divides by the whole batch's D (a sequence reduction's per-row factors
  // already hold the whole batch's S), so the chunks' gradients add up to the batch's.
  if (spec.options.reduction == Reduction::kMean && spec.options.mean_denominator == 0) {
    spec.options.mean_denominator = static_cast<double>(spec.counted_tokens);
  }
  RETURN_IF_ERROR(ValidateCallId(start.call_id()));
  if (start.stage_grad_weight()) {
    if (!spec.outputs.accumulate_grad_weight()) {
      return InvalidField("stage_grad_weight", "outputs.accumulate_grad_weight with it",
                          "a call that does not accumulate dL/dW");
    }
    if (start.call_id().empty()) {
      return InvalidField("call_id", "an id to stage dL/dW under (stage_grad_weight)", "none");
    }
    spec.stage_grad_weight = true;
  }
  if (spec.outputs.accumulate_grad_weight() && !start.call_id().empty()) {
    spec.call_id = start.call_id();
    spec.start_fingerprint = start_fingerprint;
    RETURN_IF_ERROR(
        head.CheckCallId(spec.call_id, spec.start_fingerprint, env.limits.max_call_ids));
  }
  return spec;
}

// What in a call scales finite hidden states and a finite W past fp32's range, each named with
// its value, for the token rows [first, first + rows): a temperature below 1 multiplies the
// logits by 1 / T, a token weight its row's loss and gradient, the z-loss adds s lse^2; with
// `gradients`, grad_scale / D multiplies every dL/dh and dL/dW entry.
std::vector<std::string> OverflowSuspects(const CallSpec& spec, int64_t first, int64_t rows,
                                          bool gradients) {
  const LossOptions& o = spec.options;
  std::vector<std::string> suspects;
  if (o.temperature < 1.0) {
    suspects.push_back(absl::StrCat("options.temperature = ", o.temperature,
                                    " (the logits are multiplied by 1 / T = ", 1.0 / o.temperature,
                                    ")"));
  }
  if (!spec.token_weights.empty() && rows > 0) {
    const auto begin = spec.token_weights.begin() + first;
    const auto largest = std::max_element(
        begin, begin + rows, [](float a, float b) { return std::fabs(a) < std::fabs(b); });
    if (std::fabs(*largest) > 1.0f) {
      suspects.push_back(
          absl::StrCat("token_weights[", largest - spec.token_weights.begin(), "] = ", *largest));
    }
  }
  if (o.z_loss_scale > 1.0) {
    suspects.push_back(absl::StrCat("options.z_loss_scale = ", o.z_loss_scale));
  }
  if (o.objective == Objective::kDistill) {
    // The distillation temperature divides both heads' logits, the teacher's own its logits.
    if (o.distill.temperature < 1.0) {
      suspects.push_back(absl::StrCat("options.distill.temperature = ", o.distill.temperature));
    }
    if (spec.teacher != nullptr && o.distill.teacher_temperature < 1.0) {
      suspects.push_back(
          absl::StrCat("options.distill.teacher_temperature = ", o.distill.teacher_temperature));
    }
  }
  // A policy objective's ratio exp(logp - q) passes fp32's range (about e^88) where the sampling
  // log-probability q is far below any the head gives.
  if (IsPolicyObjective(o.objective)) {
    int64_t smallest_at = -1;
    for (int64_t i = first; i < first + rows; ++i) {
      if (!spec.counted(i)) continue;
      if (smallest_at < 0 || spec.sampling_logprobs[i] < spec.sampling_logprobs[smallest_at]) {
        smallest_at = i;
      }
    }
    if (smallest_at >= 0 && spec.sampling_logprobs[smallest_at] < -80.0f &&
        o.policy.log_ratio_clamp == 0.0) {
      suspects.push_back(absl::StrCat("sampling_logprobs[", smallest_at,
                                      "] = ", spec.sampling_logprobs[smallest_at],
                                      " (the ratio exp(logp - sampling_logprobs) overflows)"));
    }
  }
  // Per-token inputs that multiply a row's term or gradient (an advantage, dL/dlogp), or that
  // enter an exponential (k3's e^(logp_ref - logp)): the largest on counted rows, when it can
  // carry finite values past fp32.
  const auto largest_counted = [&](const std::vector<float>& values) {
    int64_t at = -1;
    for (int64_t i = first; i < first + rows && !values.empty(); ++i) {
      if (spec.counted(i) && (at < 0 || std::fabs(values[i]) > std::fabs(values[at]))) at = i;
    }
    return at;
  };
  for (const auto& [field, values] : {std::pair{"advantages", &spec.advantages},
                                      std::pair{"logprob_grads", &spec.logprob_grads}}) {
    const int64_t at = largest_counted(*values);
    if (at >= 0 && std::fabs((*values)[at]) > 1.0f) {
      suspects.push_back(absl::StrCat(field, "[", at, "] = ", (*values)[at]));
    }
  }
  if (o.policy.kl_estimator != KlEstimator::kNone) {
    const int64_t at = largest_counted(spec.reference_logprobs);
    // k3 exponentiates logp_ref - logp (logp <= 0), k2 squares it, k1 is linear in it.
    const double limit = o.policy.kl_estimator == KlEstimator::kK3   ? 80.0
                         : o.policy.kl_estimator == KlEstimator::kK2 ? 1e18
                                                                     : 1e37;
    if (at >= 0 && std::fabs(spec.reference_logprobs[at]) > limit) {
      suspects.push_back(absl::StrCat("reference_logprobs[", at,
                                      "] = ", spec.reference_logprobs[at], " (under ",
                                      KlEstimatorName(o.policy.kl_estimator), ")"));
    }
    if (o.policy.kl_coef > 1.0) {
      suspects.push_back(absl::StrCat("options.policy.kl_coef = ", o.policy.kl_coef));
    }
  }
  if (gradients && std::fabs(o.grad_scale) > 1.0) {
    suspects.push_back(absl::StrCat("options.grad_scale = ", o.grad_scale));
  }
  if (gradients && o.reduction == Reduction::kMean && o.mean_denominator > 0.0 &&
      o.mean_denominator < 1.0) {
    suspects.push_back(absl::StrCat("options.mean_denominator = ", o.mean_denominator,
                                    " (gradients are divided by it)"));
  }
  return suspects;
}

}  // namespace lossd::server
