#include "lossd/kernels/backend_common.h"
#include "kernels/backend_impl.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/loss_math.h"

namespace lossd {
namespace {

bool IsKnownDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

// Whether fp32 holds x without overflow or a loss of precision: a normal number.
bool IsNormalFloat(double x) {
  const double magnitude = std::fabs(x);
  return magnitude >= FLT_MIN && magnitude <= FLT_MAX;
}

std::string NormalFloatRange() { return absl::StrCat("[", FLT_MIN, ", ", FLT_MAX, "]"); }

}  // namespace

absl::Status ValidateSoftcap(absl::string_view field, double value) {
  if (value == 0.0 || (value > 0.0 && IsNormalFloat(value))) return absl::OkStatus();
  return InvalidField(
      field, absl::StrCat("0 (off) or a value in ", NormalFloatRange(), " (a normal fp32 number)"),
      absl::StrCat(value));
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

absl::string_view ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean: return "mean";
    case Reduction::kSum: return "sum";
    case Reduction::kNone: return "none";
    case Reduction::kSequenceMeanTokenSum: return "sequence_mean_token_sum";
    case Reduction::kSequenceMeanTokenMean: return "sequence_mean_token_mean";
  }
  return "unknown";
}

absl::string_view ObjectiveName(Objective objective) {
  switch (objective) {
    case Objective::kCrossEntropy: return "cross_entropy";
    case Objective::kImportanceSampling: return "importance_sampling";
    case Objective::kPpo: return "ppo";
    case Objective::kCispo: return "cispo";
    case Objective::kLogprobGradient: return "logprob_gradient";
    case Objective::kDistill: return "distill";
    case Objective::kDro: return "dro";
    case Objective::kSapo: return "sapo";
  }
  return "unknown";
}

absl::string_view SparseTeacherMassName(SparseTeacherMass mass) {
  switch (mass) {
    case SparseTeacherMass::kRenormalize: return "renormalize";
    case SparseTeacherMass::kSpread: return "spread";
    case SparseTeacherMass::kTailBucket: return "tail_bucket";
  }
  return "unknown";
}

absl::string_view KlEstimatorName(KlEstimator estimator) {
  switch (estimator) {
    case KlEstimator::kNone: return "none";
    case KlEstimator::kK1: return "k1";
    case KlEstimator::kK2: return "k2";
    case KlEstimator::kK3: return "k3";
  }
  return "unknown";
}

namespace {

// The policy options, fp32-carried as the others (ValidateOptions).
absl::Status ValidatePolicyOptions(const LossOptions& o) {
  const PolicyOptions& p = o.policy;
  const std::string fp32_max = absl::StrCat(FLT_MAX);
  if (!(p.clip_low >= 0.0 && p.clip_low <= 1.0)) {
    return InvalidField("policy.clip_low", "eps_low in [0, 1]", absl::StrCat(p.clip_low));
  }
  if (!(p.clip_high >= 0.0 && p.clip_high <= FLT_MAX)) {
    return InvalidField("policy.clip_high", absl::StrCat("eps_high in [0, ", fp32_max, "] (fp32)"),
                        absl::StrCat(p.clip_high));
  }
  if (!(p.dual_clip == 0.0 || (p.dual_clip > 1.0 && p.dual_clip <= FLT_MAX))) {
    return InvalidField("policy.dual_clip",
                        absl::StrCat("0 (off) or a bound in (1, ", fp32_max, "] (fp32)"),
                        absl::StrCat(p.dual_clip));
  }
  if (p.dual_clip != 0.0 && o.objective != Objective::kPpo) {
    return InvalidField("policy.dual_clip", "0 unless the objective is ppo",
                        absl::StrCat(p.dual_clip, " with objective ", ObjectiveName(o.objective)));
  }
  if (!(p.log_ratio_clamp >= 0.0 && p.log_ratio_clamp <= 80.0)) {
    return InvalidField("policy.log_ratio_clamp",
                        "0 (none) or a bound in (0, 80] on |log r| (e^80 is finite in fp32)",
                        absl::StrCat(p.log_ratio_clamp));
  }
  if (p.log_ratio_clamp != 0.0 && !UsesRatio(o.objective)) {
    return InvalidField(
        "policy.log_ratio_clamp", absl::StrCat("0 unless the objective is ", kRatioObjectiveNames),
        absl::StrCat(p.log_ratio_clamp, " with objective ", ObjectiveName(o.objective)));
  }
  if (!(p.dro_beta >= 0.0 && p.dro_beta <= FLT_MAX)) {
    return InvalidField("policy.dro_beta", absl::StrCat("a value in [0, ", fp32_max, "] (fp32)"),
                        absl::StrCat(p.dro_beta));
  }
  if (p.dro_beta != 0.0 && o.objective != Objective::kDro) {
    return InvalidField("policy.dro_beta", "0 unless the objective is dro",
                        absl::StrCat(p.dro_beta, " with objective ", ObjectiveName(o.objective)));
  }
  const PolicyOptions defaults;
  for (const auto& [field, tau, default_tau] :
       {std::tuple{"policy.sapo_tau_positive", p.sapo_tau_positive, defaults.sapo_tau_positive},
        std::tuple{"policy.sapo_tau_negative", p.sapo_tau_negative, defaults.sapo_tau_negative}}) {
    // 4 / tau and tau (r - 1) stay finite in fp32 for tau in [1e-6, 1e6] and r within fp32.
    if (!(tau >= 1e-6 && tau <= 1e6)) {
      return InvalidField(field, "a temperature in [1e-06, 1e+06]", absl::StrCat(tau));
    }
    if (tau != default_tau && o.objective != Objective::kSapo) {
      return InvalidField(field, "its default unless the objective is sapo",
                          absl::StrCat(tau, " with objective ", ObjectiveName(o.objective)));
    }
  }
  if (p.kl_estimator != KlEstimator::kNone && p.kl_estimator != KlEstimator::kK1 &&
      p.kl_estimator != KlEstimator::kK2 && p.kl_estimator != KlEstimator::kK3) {
    return InvalidField("policy.kl_estimator", "none, k1, k2 or k3",
                        absl::StrCat(static_cast<int>(p.kl_estimator)));
  }
  if (!(p.kl_coef >= 0.0 && p.kl_coef <= FLT_MAX)) {
    return InvalidField("policy.kl_coef", absl::StrCat("a value in [0, ", fp32_max, "] (fp32)"),
                        absl::StrCat(p.kl_coef));
  }
  if (p.kl_coef != 0.0 && p.kl_estimator == KlEstimator::kNone) {
    return InvalidField("policy.kl_estimator", "k1, k2 or k3 with a kl_coef", "none");
  }
  if (p.kl_ratio_weighted && (p.kl_estimator == KlEstimator::kNone || !UsesRatio(o.objective))) {
    return InvalidField("policy.kl_ratio_weighted",
                        absl::StrCat("false unless a kl_estimator is set and the objective is ",
                                     kRatioObjectiveNames),
                        absl::StrCat("true with estimator ", KlEstimatorName(p.kl_estimator),
                                     " and objective ", ObjectiveName(o.objective)));
  }
  if (p.sequence_ratio && o.objective != Objective::kPpo) {
    return InvalidField("policy.sequence_ratio", "false unless the objective is ppo",
                        absl::StrCat("true with objective ", ObjectiveName(o.objective)));
  }
  if (p.sequence_ratio && p.kl_ratio_weighted) {
    return InvalidField("policy.kl_ratio_weighted",
                        "false with policy.sequence_ratio (it weights by the token's own ratio)",
                        "true");
  }
  if (!(std::fabs(p.entropy_coef) <= FLT_MAX)) {
    return InvalidField("policy.entropy_coef",
                        absl::StrCat("a value in [", -FLT_MAX, ", ", fp32_max, "] (fp32)"),
                        absl::StrCat(p.entropy_coef));
  }
  return absl::OkStatus();
}

// A positive normal fp32 value (temperatures: T and 1 / T finite in fp32).
absl::Status ValidateTemperature(absl::string_view field, double value) {
  if (value > 0.0 && IsNormalFloat(value)) return absl::OkStatus();
  return InvalidField(field,
                      absl::StrCat("a value in ", NormalFloatRange(),
                                   " (a normal fp32 number: T and 1 / T finite in fp32)"),
                      absl::StrCat(value));
}

// The distill options: in range under the distill objective, at their defaults under any other.
absl::Status ValidateDistillOptions(const LossOptions& o) {
  const DistillOptions& d = o.distill;
  if (o.objective != Objective::kDistill) {
    const DistillOptions defaults;
    const struct {
      const char* field;
      bool at_default;
    } fields[] = {
        {"distill.beta", d.beta == defaults.beta},
        {"distill.alpha", d.alpha == defaults.alpha},
        {"distill.temperature", d.temperature == defaults.temperature},
        {"distill.teacher_logit_softcap",
         d.teacher_logit_softcap == defaults.teacher_logit_softcap},
        {"distill.teacher_temperature", d.teacher_temperature == defaults.teacher_temperature},
        {"distill.sparse_teacher_mass", d.sparse_mass == defaults.sparse_mass},
    };
    for (const auto& field : fields) {
      if (!field.at_default) {
        return InvalidField(field.field, "its default unless the objective is distill",
                            absl::StrCat("a value with objective ", ObjectiveName(o.objective)));
      }
    }
    return absl::OkStatus();
  }
  if (!(d.beta >= 0.0 && d.beta <= 1.0)) {
    return InvalidField("distill.beta",
                        "a value in [0, 1] (0: forward KL, 1: reverse KL, between: JSD)",
                        absl::StrCat(d.beta));
  }
  if (!(d.alpha >= 0.0 && d.alpha <= 1.0)) {
    return InvalidField("distill.alpha", "a value in [0, 1]", absl::StrCat(d.alpha));
  }
  RETURN_IF_ERROR(ValidateTemperature("distill.temperature", d.temperature));
  RETURN_IF_ERROR(ValidateSoftcap("distill.teacher_logit_softcap", d.teacher_logit_softcap));
  RETURN_IF_ERROR(ValidateTemperature("distill.teacher_temperature", d.teacher_temperature));
  if (d.sparse_mass != SparseTeacherMass::kRenormalize &&
      d.sparse_mass != SparseTeacherMass::kSpread &&
      d.sparse_mass != SparseTeacherMass::kTailBucket) {
    return InvalidField("distill.sparse_teacher_mass", "renormalize, spread or tail_bucket",
                        absl::StrCat(static_cast<int>(d.sparse_mass)));
  }
  // The policy terms read the label's log-probability against a reference; under distillation
  // the teacher is the reference.
  if (o.policy.kl_estimator != KlEstimator::kNone) {
    return InvalidField("policy.kl_estimator", "none with objective distill",
                        KlEstimatorName(o.policy.kl_estimator));
  }
  if (o.policy.entropy_coef != 0.0) {
    return InvalidField("policy.entropy_coef", "0 with objective distill",
                        absl::StrCat(o.policy.entropy_coef));
  }
  return absl::OkStatus();
}

// The first row of `values` that is not finite where the row is counted, named "<field>[i]".
absl::Status ValidateCountedFinite(absl::string_view field, const float* values,
                                   const int64_t* labels, int64_t count, int64_t ignore_index,
                                   int64_t first_index) {
  for (int64_t i = 0; i < count; ++i) {
    if ((labels == nullptr || labels[i] != ignore_index) && !std::isfinite(values[i])) {
      return InvalidField(absl::StrCat(field, "[", first_index + i, "]"), "a finite value",
                          absl::StrCat(values[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptions(const LossOptions& o) {
  // The engine computes in fp32: a value that it would round to 0 or to Inf there, changing what
  // the call means (a soft cap of 1e-300 would turn the cap off, a temperature of 1e-45 make 1 / T
  // infinite), is refused here rather than left to fail later on the hidden states.
  if (o.reduction != Reduction::kMean && o.reduction != Reduction::kSum &&
      o.reduction != Reduction::kNone && !IsSequenceReduction(o.reduction)) {
    return InvalidField("reduction",
                        "mean, sum, none, sequence_mean_token_sum or sequence_mean_token_mean",
                        absl::StrCat(static_cast<int>(o.reduction)));
  }
  if (o.objective != Objective::kCrossEntropy && !IsPolicyObjective(o.objective) &&
      o.objective != Objective::kLogprobGradient && o.objective != Objective::kDistill) {
    return InvalidField("objective",
                        "cross_entropy, importance_sampling, ppo, cispo, dro, sapo, "
                        "logprob_gradient or distill",
                        absl::StrCat(static_cast<int>(o.objective)));
  }
  if (o.objective != Objective::kCrossEntropy && o.objective != Objective::kDistill &&
      o.label_smoothing != 0.0) {
    return InvalidField(
        "label_smoothing", "0 unless the objective is cross_entropy or distill",
        absl::StrCat(o.label_smoothing, " with objective ", ObjectiveName(o.objective)));
  }
  RETURN_IF_ERROR(ValidatePolicyOptions(o));
  RETURN_IF_ERROR(ValidateDistillOptions(o));
  if (!(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0)) {
    return InvalidField("label_smoothing", "a value in [0, 1]", absl::StrCat(o.label_smoothing));
  }
  if (!(o.z_loss_scale >= 0.0 && o.z_loss_scale <= FLT_MAX)) {
    return InvalidField("z_loss_scale", absl::StrCat("a value in [0, ", FLT_MAX, "] (fp32)"),
                        absl::StrCat(o.z_loss_scale));
  }
  RETURN_IF_ERROR(ValidateSoftcap("logit_softcap", o.logit_softcap));
  RETURN_IF_ERROR(ValidateTemperature("temperature", o.temperature));
  if (!(std::fabs(o.grad_scale) <= FLT_MAX)) {
    return InvalidField("grad_scale",
                        absl::StrCat("a value in [", -FLT_MAX, ", ", FLT_MAX, "] (fp32)"),
                        absl::StrCat(o.grad_scale));
  }
  if (!(o.mean_denominator >= 0.0 && std::isfinite(o.mean_denominator))) {
    return InvalidField("mean_denominator", "0 (count this call) or a finite value > 0",
                        absl::StrCat(o.mean_denominator));
  }
  // Every row's gradient carries the factor grad_scale / D, in fp32.
  if (o.reduction == Reduction::kMean && o.mean_denominator > 0.0 &&
      !(std::fabs(o.grad_scale / o.mean_denominator) <= FLT_MAX)) {
    return InvalidField("grad_scale / mean_denominator",
                        absl::StrCat("a value in [", -FLT_MAX, ", ", FLT_MAX, "] (fp32)"),
                        absl::StrCat(o.grad_scale, " / ", o.mean_denominator));
  }
  return absl::OkStatus();
}

namespace {

// The teacher of a distill call (TeacherInputs), and none for any other objective.
absl::Status ValidateTeacher(const BatchInputs& in, const WeightView& weight,
                             const LossOptions& options) {
  const TeacherInputs& t = in.teacher;
  if (options.objective != Objective::kDistill) {
    if (t.dense() || t.sparse() || t.hidden != nullptr) {
      return InvalidField(
          "teacher", "none unless the objective is distill",
          absl::StrCat("a teacher with objective ", ObjectiveName(options.objective)));
    }
    return absl::OkStatus();
  }
  if (t.dense() == t.sparse()) {
    return InvalidField("teacher", "a teacher head with its hidden rows, or a sparse top-k",
                        t.dense() ? "both" : "neither");
  }
  if (t.sparse()) {
    const int64_t max_k = std::min<int64_t>(weight.vocab_size, kMaxTeacherTopK);
    if (t.top_k > max_k) {
      return InvalidField("teacher.top_k", absl::StrCat("a value in [1, ", max_k, "]"),
                          absl::StrCat(t.top_k));
    }
    RETURN_IF_ERROR(ValidateSparseTeacherOptions(options.distill, "distill."));
    if (in.num_tokens > 0 && (t.top_k_tokens == nullptr || t.top_k_logprobs == nullptr)) {
      return InvalidField("teacher.top_k_tokens/top_k_logprobs", "non-null buffers", "null");
    }
    return ValidateSparseTeacher(t, in.num_tokens, weight.vocab_size, options, in.labels);
  }
  const WeightView& tw = *t.weight;
  if (tw.data == nullptr || tw.vocab_size <= 0 || tw.hidden_size <= 0) {
    return absl::FailedPreconditionError("teacher.weight: expected a loaded [V, H] head");
  }
  if (!IsKnownDType(tw.dtype)) {
    return InvalidField("teacher.weight.dtype", "float32, bfloat16 or float16",
                        absl::StrCat(static_cast<int>(tw.dtype)));
  }
  if (tw.vocab_size != weight.vocab_size) {
    return InvalidField("teacher.vocab_size",
                        absl::StrCat(weight.vocab_size, " (the student head's V)"),
                        absl::StrCat(tw.vocab_size));
  }
  const size_t elements = static_cast<size_t>(tw.vocab_size) * tw.hidden_size;
  if (tw.data->bytes() < elements * DTypeSize(tw.dtype)) {
    return InvalidField("teacher.weight", absl::StrCat(elements * DTypeSize(tw.dtype), " bytes"),
                        absl::StrCat(tw.data->bytes()));
  }
  if (t.hidden_size != tw.hidden_size) {
    return InvalidField("teacher.hidden_size", absl::StrCat(tw.hidden_size, " (the teacher's H)"),
                        absl::StrCat(t.hidden_size));
  }
  if (!IsKnownDType(t.hidden_dtype)) {
    return InvalidField("teacher.hidden_dtype", "float32, bfloat16 or float16",
                        absl::StrCat(static_cast<int>(t.hidden_dtype)));
  }
  if (in.num_tokens > 0 && t.hidden == nullptr) {
    return InvalidField("teacher.hidden", "a non-null buffer", "null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSparseTeacherOptions(const DistillOptions& d, absl::string_view prefix) {
  if (d.teacher_logit_softcap != 0.0 || d.teacher_temperature != 1.0) {
    return InvalidField(absl::StrCat(prefix, "teacher_logit_softcap/teacher_temperature"),
                        "0 and 1 with a sparse teacher (its log-probabilities are final)",
                        absl::StrCat(d.teacher_logit_softcap, " and ", d.teacher_temperature));
  }
  if (DivergenceOf(d.beta) == DivergenceKind::kReverseKl &&
      d.sparse_mass == SparseTeacherMass::kRenormalize) {
    return InvalidField(absl::StrCat(prefix, "beta"),
                        "below 1 with a renormalized sparse teacher (its zero probabilities make "
                        "KL(q || p) infinite), or sparse_teacher_mass spread or tail_bucket",
                        "1 (reverse KL)");
  }
  if (d.sparse_mass == SparseTeacherMass::kTailBucket && d.temperature != 1.0) {
    return InvalidField(absl::StrCat(prefix, "temperature"),
                        "1 with sparse_teacher_mass tail_bucket (the teacher's top-k and tail "
                        "probabilities are final; the tail has no logits to soften)",
                        absl::StrCat(d.temperature));
  }
  return absl::OkStatus();
}

absl::Status ValidateSparseTeacher(const TeacherInputs& t, int64_t count, int64_t vocab_size,
                                   const LossOptions& options, const int64_t* labels,
                                   int64_t first_index) {
  // Cached log-probabilities are rounded (bf16 keeps 8 bits): their probabilities may sum a
  // little past 1.
  constexpr double kMassTolerance = 1e-3;
  const int k = t.top_k;
  const bool needs_rest = options.distill.sparse_mass != SparseTeacherMass::kRenormalize &&
                          DivergenceOf(options.distill.beta) == DivergenceKind::kReverseKl &&
                          k < vocab_size;
  std::vector<int32_t> sorted(k);
  for (int64_t r = 0; r < count; ++r) {
    const int32_t* tokens = t.top_k_tokens + r * k;
    const float* logprobs = t.top_k_logprobs + r * k;
    const auto where = [&](int j) { return absl::StrCat("[", first_index + r, ", ", j, "]"); };
    double mass = 0.0;
    for (int j = 0; j < k; ++j) {
      if (tokens[j] < 0 || tokens[j] >= vocab_size) {
        return InvalidField(absl::StrCat("teacher_top_k_tokens", where(j)),
                            absl::StrCat("a token id in [0, ", vocab_size, ")"),
                            absl::StrCat(tokens[j]));
      }
      if (!(logprobs[j] <= 0.0f) || std::isinf(logprobs[j])) {
        return InvalidField(absl::StrCat("teacher_top_k_logprobs", where(j)),
                            "a finite log-probability <= 0", absl::StrCat(logprobs[j]));
      }
      mass += std::exp(static_cast<double>(logprobs[j]));
    }
    if (mass > 1.0 + kMassTolerance) {
      return InvalidField(absl::StrCat("teacher_top_k_logprobs[", first_index + r, "]"),
                          absl::StrCat("log-probabilities whose probabilities sum to at most 1 (+",
                                       kMassTolerance, ")"),
                          absl::StrCat("a sum of ", mass));
    }
    const bool counted = labels == nullptr || labels[r] != options.ignore_index;
    if (needs_rest && counted && !(1.0 - mass > 0.0)) {
      return InvalidField(
          absl::StrCat("teacher_top_k_logprobs[", first_index + r, "]"),
          "probabilities summing below 1 (the reverse KL needs a teacher with mass outside its "
          "top-k, spread or in a tail bucket)",
          absl::StrCat("a sum of ", mass));
    }
    std::copy(tokens, tokens + k, sorted.begin());
    std::sort(sorted.begin(), sorted.end());
    const auto repeated = std::adjacent_find(sorted.begin(), sorted.end());
    if (repeated != sorted.end()) {
      const int j = static_cast<int>(std::find(tokens, tokens + k, *repeated) - tokens);
      return InvalidField(absl::StrCat("teacher_top_k_tokens", where(j)),
                          "token ids distinct within a row", absl::StrCat(*repeated, " twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCall(const BatchInputs& in, const WeightView& weight,
                          const LossOptions& options, const TokenOutputs& out,
                          const DeviceBuffer* grad_weight) {
  RETURN_IF_ERROR(ValidateOptions(options));
  if (weight.data == nullptr || weight.vocab_size <= 0 || weight.hidden_size <= 0) {
    return absl::FailedPreconditionError("weight: expected a loaded [V, H] head");
  }
  if (!IsKnownDType(weight.dtype)) {
    return InvalidField("weight.dtype", "float32, bfloat16 or float16",
                        absl::StrCat(static_cast<int>(weight.dtype)));
  }
  const size_t weight_elements = static_cast<size_t>(weight.vocab_size) * weight.hidden_size;
  if (weight.data->bytes() < weight_elements * DTypeSize(weight.dtype)) {
    return InvalidField("weight", absl::StrCat(weight_elements * DTypeSize(weight.dtype), " bytes"),
                        absl::StrCat(weight.data->bytes()));
  }
  if (in.num_tokens < 0)
    return InvalidField("num_tokens", "a count >= 0", absl::StrCat(in.num_tokens));
  if (in.hidden_size != weight.hidden_size) {
    return InvalidField("hidden_size", absl::StrCat(weight.hidden_size, " (the head's H)"),
                        absl::StrCat(in.hidden_size));
  }
  if (!IsKnownDType(in.hidden_dtype)) {
    return InvalidField("hidden_dtype", "float32, bfloat16 or float16",
                        absl::StrCat(static_cast<int>(in.hidden_dtype)));
  }
  const bool distill = options.objective == Objective::kDistill;
  if (in.num_tokens > 0 && in.hidden == nullptr) {
    return InvalidField("hidden", "a non-null buffer", "null");
  }
  if (in.num_tokens > 0 && in.labels == nullptr && !(distill && options.distill.alpha == 0.0)) {
    return InvalidField(
        "labels", "a non-null buffer (only distill with alpha 0 may go without labels)", "null");
  }
  if (in.labels != nullptr) {
    RETURN_IF_ERROR(
        ValidateLabels(in.labels, in.num_tokens, weight.vocab_size, options.ignore_index));
  }
  RETURN_IF_ERROR(ValidateTeacher(in, weight, options));
  if (in.token_weights != nullptr)
    RETURN_IF_ERROR(ValidateTokenWeights(in.token_weights, in.num_tokens));
  RETURN_IF_ERROR(ValidateObjectiveInputs(in, options));
  if (out.top_k < 0 || out.top_k > kMaxTopK || out.top_k > weight.vocab_size) {
    return InvalidField(
        "top_k",
        absl::StrCat("a value in [0, ", std::min<int64_t>(kMaxTopK, weight.vocab_size), "]"),
        absl::StrCat(out.top_k));
  }
  if (out.top_k > 0 && (out.top_k_logprob == nullptr || out.top_k_token == nullptr)) {
    return InvalidField("top_k", "buffers for both log-probabilities and token ids", "null");
  }
  if (out.grad_hidden != nullptr && !IsKnownDType(out.grad_hidden_dtype)) {
    return InvalidField("grad_hidden_dtype", "float32, bfloat16 or float16",
                        absl::StrCat(static_cast<int>(out.grad_hidden_dtype)));
  }
  if (grad_weight != nullptr && grad_weight->bytes() < weight_elements * sizeof(float)) {
    return InvalidField("grad_weight",
                        absl::StrCat(weight_elements * sizeof(float), " bytes (fp32 [V, H])"),
                        absl::StrCat(grad_weight->bytes()));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabels(const int64_t* labels, int64_t count, int64_t vocab_size,
                            int64_t ignore_index, int64_t first_index) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t y = labels[i];
    if (y != ignore_index && (y < 0 || y >= vocab_size)) {
      return InvalidField(
          absl::StrCat("labels[", first_index + i, "]"),
          absl::StrCat("a token id in [0, ", vocab_size, ") or ignore_index ", ignore_index),
          absl::StrCat(y));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTokenWeights(const float* weights, int64_t count, int64_t first_index) {
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(weights[i])) {
      return InvalidField(absl::StrCat("token_weights[", first_index + i, "]"), "a finite value",
                          absl::StrCat(weights[i]));
    }
  }
  return absl::OkStatus();
}

namespace {

// The index of the first of `count` elements whose exponent bits (`exponent`) are all ones, an
// Inf or a NaN, or -1. Blocks are tested without an early exit, a loop the compiler vectorizes;
// only a block that holds one is searched again element by element.
template <typename Bits>
int64_t FirstWithExponentAllOnes(const void* data, int64_t count, Bits exponent) {
  constexpr int64_t kBlock = 4096;
  const auto bad = [data, exponent](int64_t i) {
    Bits bits;
    std::memcpy(&bits, static_cast<const char*>(data) + i * sizeof(Bits), sizeof(Bits));
    return (bits & exponent) == exponent;
  };
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t end = std::min(count, start + kBlock);
    bool any = false;
    for (int64_t i = start; i < end; ++i) any |= bad(i);
    if (!any) continue;
    for (int64_t i = start; i < end; ++i) {
      if (bad(i)) return i;
    }
  }
  return -1;
}

}  // namespace

absl::Status ValidateFiniteMatrix(absl::string_view field, const void* data, DType dtype,
                                  int64_t rows, int64_t cols, int64_t first_row) {
  const int64_t count = rows * cols;
  int64_t bad = -1;
  switch (dtype) {
    case DType::kFloat32: bad = FirstWithExponentAllOnes<uint32_t>(data, count, 0x7f800000u); break;
    case DType::kBFloat16: bad = FirstWithExponentAllOnes<uint16_t>(data, count, 0x7f80u); break;
    case DType::kFloat16: bad = FirstWithExponentAllOnes<uint16_t>(data, count, 0x7c00u); break;
  }
  if (bad < 0) return absl::OkStatus();
  return InvalidField(absl::StrCat(field, "[", first_row + bad / cols, ", ", bad % cols, "]"),
                      absl::StrCat("a finite ", DTypeName(dtype), " value"),
                      absl::StrCat(LoadAsFloat(data, dtype, bad)));
}

absl::Status ValidateObjectiveInputs(const BatchInputs& in, const LossOptions& options,
                                     int64_t first_index) {
  struct Input {
    const char* field;
    const float* values;
    bool needed;
  };
  const Input inputs[] = {
      {"sampling_logprobs", in.sampling_logprobs, IsPolicyObjective(options.objective)},
      {"advantages", in.advantages, IsPolicyObjective(options.objective)},
      {"reference_logprobs", in.reference_logprobs,
       options.policy.kl_estimator != KlEstimator::kNone},
      {"logprob_grads", in.logprob_grads, options.objective == Objective::kLogprobGradient},
  };
  for (const Input& input : inputs) {
    if (!input.needed || in.num_tokens == 0) continue;
    if (input.values == nullptr) {
      return InvalidField(
          input.field,
          absl::StrCat(in.num_tokens, " values (objective ", ObjectiveName(options.objective),
                       ", kl_estimator ", KlEstimatorName(options.policy.kl_estimator), ")"),
          "none");
    }
    RETURN_IF_ERROR(ValidateCountedFinite(input.field, input.values, in.labels, in.num_tokens,
                                          options.ignore_index, first_index));
  }
  if (options.policy.sequence_ratio && in.num_tokens > 0) {
    if (in.num_ratio_sequences == 0) {
      return InvalidField("ratio_sequence_lengths",
                          "the batch's sequences with policy.sequence_ratio", "none");
    }
    RETURN_IF_ERROR(ValidateSequenceLengths(in.ratio_sequence_lengths, in.num_ratio_sequences,
                                            in.num_tokens, "ratio_sequence_lengths"));
  }
  if (IsSequenceReduction(options.reduction) && in.num_tokens > 0) {
    if (in.reduction_scales == nullptr) {
      return InvalidField("reduction_scales",
                          absl::StrCat(in.num_tokens, " per-row factors (reduction ",
                                       ReductionName(options.reduction), ")"),
                          "none");
    }
    for (int64_t i = 0; i < in.num_tokens; ++i) {
      const double scale = in.reduction_scales[i];
      if (!(scale >= 0.0 && std::isfinite(scale))) {
        return InvalidField(absl::StrCat("reduction_scales[", first_index + i, "]"),
                            "a finite value >= 0", absl::StrCat(scale));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSequenceLengths(const int64_t* sequence_lengths, int64_t num_sequences,
                                     int64_t num_tokens, absl::string_view field) {
  if (num_sequences == 0) return absl::OkStatus();
  int64_t total = 0;
  for (int64_t s = 0; s < num_sequences; ++s) {
    const int64_t length = sequence_lengths[s];
    if (length < 1 || length > num_tokens - total) {
      return InvalidField(absl::StrCat(field, "[", s, "]"),
                          absl::StrCat("a length in [1, ", std::max<int64_t>(1, num_tokens - total),
                                       "] (the lengths sum to num_tokens, ", num_tokens, ")"),
                          absl::StrCat(length));
    }
    total += length;
  }
  if (total != num_tokens) {
    return InvalidField(field, absl::StrCat("lengths summing to ", num_tokens, " (num_tokens)"),
                        absl::StrCat("lengths summing to ", total));
  }
  return absl::OkStatus();
}

std::vector<int64_t> TokenChunkEnds(int64_t num_tokens, int64_t chunk_rows,
                                    const int64_t* sequence_lengths, int64_t num_sequences) {
  std::vector<int64_t> ends;
  if (num_sequences == 0) {
    for (int64_t end = chunk_rows; end < num_tokens; end += chunk_rows) ends.push_back(end);
    if (num_tokens > 0) ends.push_back(num_tokens);
    return ends;
  }
  int64_t chunk_start = 0;
  int64_t row = 0;
  for (int64_t s = 0; s < num_sequences; ++s) {
    if (row > chunk_start && row + sequence_lengths[s] - chunk_start > chunk_rows) {
      ends.push_back(row);
      chunk_start = row;
    }
    row += sequence_lengths[s];
  }
  ends.push_back(row);
  return ends;
}

int64_t LongestSequence(const int64_t* sequence_lengths, int64_t num_sequences) {
  int64_t longest = 0;
  for (int64_t s = 0; s < num_sequences; ++s) longest = std::max(longest, sequence_lengths[s]);
  return longest;
}

void ShiftLabelsWithinSequences(int64_t* labels, int64_t num_tokens,
                                const int64_t* sequence_lengths, int64_t num_sequences,
                                int64_t ignore_index) {
  for (int64_t s = 0, first = 0; first < num_tokens; ++s) {
    const int64_t length = num_sequences == 0 ? num_tokens : sequence_lengths[s];
    std::copy(labels + first + 1, labels + first + length, labels + first);
    labels[first + length - 1] = ignore_index;
    first += length;
  }
}

absl::StatusOr<std::vector<double>> SequenceReductionScales(const LossOptions& options,
                                                            const int64_t* labels,
                                                            int64_t num_tokens,
                                                            const int64_t* sequence_lengths,
                                                            int64_t num_sequences) {
  if (num_tokens > 0 && num_sequences == 0) {
    return InvalidField(
        "sequence_lengths",
        absl::StrCat("the lengths of the sequences in the batch (reduction ",
                     ReductionName(options.reduction), "), summing to ", num_tokens),
        "none");
  }
  RETURN_IF_ERROR(ValidateSequenceLengths(sequence_lengths, num_sequences, num_tokens));
  // Counted rows per sequence, and S: the sequences with at least one.
  std::vector<int64_t> counted(num_sequences, 0);
  int64_t sequences_counted = 0;
  for (int64_t s = 0, row = 0; s < num_sequences; ++s) {
    for (int64_t end = row + sequence_lengths[s]; row < end; ++row) {
      counted[s] += labels == nullptr || labels[row] != options.ignore_index;
    }
    sequences_counted += counted[s] > 0;
  }
  const double sequences = options.mean_denominator > 0 ? options.mean_denominator
                                                        : static_cast<double>(sequences_counted);
  std::vector<double> scales(num_tokens, 0.0);
  for (int64_t s = 0, row = 0; s < num_sequences; ++s) {
    const double per_sequence = options.reduction == Reduction::kSequenceMeanTokenMean
                                    ? static_cast<double>(counted[s])
                                    : 1.0;
    for (int64_t end = row + sequence_lengths[s]; row < end; ++row) {
      if ((labels == nullptr || labels[row] != options.ignore_index) && sequences > 0) {
        scales[row] = 1.0 / (sequences * per_sequence);
      }
    }
  }
  return scales;
}

ProblemShape ShapeOfCall(const BatchInputs& in, const WeightView& weight, const TokenOutputs& out,
                         bool grad_weight) {
  ProblemShape shape;
  shape.num_tokens = in.num_tokens;
  shape.hidden_size = weight.hidden_size;
  shape.vocab_size = weight.vocab_size;
  shape.hidden_dtype = in.hidden_dtype;
  shape.weight_dtype = weight.dtype;
  shape.grad_hidden = out.grad_hidden != nullptr;
  shape.grad_weight = grad_weight;
  shape.grad_hidden_dtype = out.grad_hidden_dtype;
  shape.top_k = out.top_k;
  const TeacherInputs& t = in.teacher;
  if (t.dense()) {
    shape.teacher.kind = TeacherKind::kDense;
    shape.teacher.hidden_size = t.weight->hidden_size;
    shape.teacher.hidden_dtype = t.hidden_dtype;
    shape.teacher.weight_dtype = t.weight->dtype;
  } else if (t.sparse()) {
    shape.teacher.kind = TeacherKind::kSparse;
    shape.teacher.top_k = t.top_k;
  }
  return shape;
}

int64_t CountCountedRows(const int64_t* labels, int64_t num_tokens, int64_t ignore_index) {
  if (labels == nullptr) return num_tokens;
  int64_t counted = 0;
  for (int64_t i = 0; i < num_tokens; ++i) counted += labels[i] != ignore_index;
  return counted;
}

int64_t AlignedTokenChunk(int64_t n, int64_t fitting, int64_t multiple) {
  if (fitting >= n || multiple <= 1 || fitting < multiple) return fitting;
  const int64_t aligned = fitting / multiple * multiple;
  const int64_t chunks = (n + aligned - 1) / aligned;
  const int64_t balanced = ((n + chunks - 1) / chunks + multiple - 1) / multiple * multiple;
  return std::min(aligned, balanced);
}

absl::StatusOr<ChunkPlan> ChooseChunkPlan(const ProblemShape& shape, size_t budget_bytes,
                                          const TileLimits& limits, WorkspaceBytesFn bytes_for) {
  const int64_t n = std::max<int64_t>(shape.num_tokens, 1);
  const int64_t v = shape.vocab_size;
  auto plan_of = [&](int64_t rows, int64_t cols) {
    return ChunkPlan{rows, cols, bytes_for(rows, cols)};
  };

  const int64_t multiple = std::max<int64_t>(limits.vocab_chunk_multiple, 1);
  const int64_t min_cols = std::min(v, limits.min_vocab_chunk);
  // The widest tile of `rows` rows that fits, if it is at least min_cols wide; else 0.
  const auto widest_tile = [&](int64_t rows) -> int64_t {
    const int64_t units = LargestFitting(1, (v + multiple - 1) / multiple, [&](int64_t u) {
      return bytes_for(rows, std::min(v, u * multiple)) <= budget_bytes;
    });
    const int64_t cols = std::min(v, units * multiple);
    return units >= 1 && cols >= min_cols ? cols : 0;
  };

  const int64_t max_rows = std::min(n, limits.max_token_chunk);
  const int64_t single_rows =
      LargestFitting(1, max_rows, [&](int64_t rows) { return bytes_for(rows, v) <= budget_bytes; });
  const bool long_forward = limits.forward_token_chunk > 0 && !WantsGradients(shape);
  if (long_forward && single_rows < std::min(max_rows, limits.forward_token_chunk)) {
    const int64_t rows = AlignedTokenChunk(n, std::min(max_rows, limits.forward_token_chunk),
                                           limits.token_chunk_multiple);
    if (const int64_t cols = widest_tile(rows); cols > 0) return plan_of(rows, cols);
  }

  // One pass over the whole vocabulary per token chunk.
  if (single_rows >= std::min(max_rows, limits.min_single_pass_rows)) {
    return plan_of(AlignedTokenChunk(n, single_rows, limits.token_chunk_multiple), v);
  }

  // Vocabulary tiles: keep a useful number of rows and take the widest tile that fits, trading rows
  // for width only when even the narrowest tile does not fit.
  for (int64_t rows = std::min(n, limits.two_pass_token_chunk); rows >= 1; rows /= 2) {
    if (const int64_t cols = widest_tile(rows); cols > 0) return plan_of(rows, cols);
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("workspace budget: expected at least ", bytes_for(1, min_cols),
                   " bytes for the smallest tile (1 token x ", min_cols,
                   " vocabulary columns), got ", budget_bytes));
}

absl::StatusOr<CallPlan> PlanCall(const Backend& backend, const BatchInputs& inputs,
                                  const WeightView& weight, const LossOptions& options,
                                  const TokenOutputs& outputs, const DeviceBuffer* grad_weight,
                                  const DeviceBuffer& workspace) {
  RETURN_IF_ERROR(ValidateCall(inputs, weight, options, outputs, grad_weight));
  CallPlan call;
  call.shape = ShapeOfCall(inputs, weight, outputs, grad_weight != nullptr);
  call.shape.exact_gradients = options.exact_gradients;
  call.shape.sequence_ratio = options.policy.sequence_ratio;
  ASSIGN_OR_RETURN(call.plan, backend.Plan(call.shape, workspace.bytes()));
  if (call.shape.sequence_ratio) {
    const int64_t* lengths = inputs.ratio_sequence_lengths;
    for (int64_t s = 0; s < inputs.num_ratio_sequences; ++s) {
      if (lengths[s] > call.plan.token_chunk) {
        return InvalidField(
            absl::StrCat("ratio_sequence_lengths[", s, "]"),
            absl::StrCat("at most the call's token chunk of ", call.plan.token_chunk,
                         " rows (a sequence's ratio completes within one chunk)"),
            absl::StrCat(lengths[s]));
      }
    }
  }
  return call;
}

BatchSummary PlannedSummary(const ChunkPlan& plan, size_t workspace_bytes) {
  BatchSummary summary;
  summary.token_chunk = plan.token_chunk;
  summary.vocab_chunk = plan.vocab_chunk;
  summary.logit_rows = plan.logit_rows > 0 ? plan.logit_rows : plan.token_chunk;
  summary.workspace_bytes = static_cast<int64_t>(workspace_bytes);
  return summary;
}

RowInputArrays RowInputArraysOf(const BatchInputs& inputs) {
  RowInputArrays a;
  a.labels = inputs.labels;
  a.token_weights = inputs.token_weights;
  a.sampling_logprobs = inputs.sampling_logprobs;
  a.advantages = inputs.advantages;
  a.reference_logprobs = inputs.reference_logprobs;
  a.logprob_grads = inputs.logprob_grads;
  a.reduction_scales = inputs.reduction_scales;
  return a;
}

RowFinisher::RowFinisher(const BatchInputs& inputs, int64_t vocab_size, const LossOptions& options,
                         const TokenOutputs& outputs, const float* sequence_log_ratios)
    : inputs_(inputs),
      options_(options),
      outputs_(outputs),
      counted_rows_(CountCountedRows(inputs.labels, inputs.num_tokens, options.ignore_index)),
      constants_(MakeRowFinishConstants(options, vocab_size, counted_rows_)),
      arrays_([&] {
        RowInputArrays arrays = RowInputArraysOf(inputs);
        arrays.sequence_log_ratios = sequence_log_ratios;
        return arrays;
      }()) {}

RowResult RowFinisher::Finish(int64_t row, const RowStats& stats) const {
  return FinishRowAt(arrays_, constants_, row, stats);
}

RowGradient RowFinisher::Gradient(int64_t row, const RowResult& result) const {
  return RowGradientAt(arrays_, constants_, row, result);
}

DistillRowResult RowFinisher::FinishDistill(int64_t row, const RowStats& stats,
                                            const DistillStats& distill,
                                            const DistillRowConstants& constants,
                                            const DistillRowTerms& terms) const {
  return FinishDistillRowAt(arrays_, constants_, options_.distill, inputs_.teacher.dense(), row,
                            stats, distill, constants, terms);
}

DistillRowGradient RowFinisher::DistillGradient(int64_t row, const DistillRowResult& result,
                                                const DistillRowConstants& constants) const {
  return DistillRowGradientAt(arrays_, constants_, options_.distill, row, result, constants);
}

TokenValues RowFinisher::ValuesOf(int64_t row, const RowResult& result,
                                  const RowStats& stats) const {
  TokenValues v;
  v.token_loss = result.loss;
  v.logprob = result.logprob;
  v.lse = result.lse;
  v.entropy = result.entropy;
  v.argmax = stats.argmax;
  v.correct = inputs_.labels != nullptr && counted(row) && stats.argmax == inputs_.labels[row];
  v.ratio = result.ratio;
  v.clip = static_cast<int32_t>(result.clip);
  v.kl = result.kl;
  return v;
}

void RowFinisher::Emit(int64_t row, const RowResult& result, const RowStats& stats,
                       const float* top_values, const int32_t* top_tokens,
                       BatchSummary& summary) const {
  Write(row, ValuesOf(row, result, stats), result.finite, top_values, top_tokens, summary);
}

void RowFinisher::EmitDistill(int64_t row, const DistillRowResult& result, const RowStats& stats,
                              const float* top_values, const int32_t* top_tokens,
                              BatchSummary& summary) const {
  TokenValues values = ValuesOf(row, result.row, stats);
  values.kd = result.kd;
  values.ce = result.ce;
  Write(row, values, result.row.finite, top_values, top_tokens, summary);
}

void RowFinisher::Write(int64_t row, const TokenValues& values, bool finite,
                        const float* top_values, const int32_t* top_tokens,
                        BatchSummary& summary) const {
  summary.all_finite = summary.all_finite && finite;
  summary.loss_sum += values.token_loss;
  if (IsSequenceReduction(options_.reduction)) {
    summary.loss += inputs_.reduction_scales[row] * values.token_loss;
  }
  summary.correct_tokens += values.correct;
  if (counted(row)) {
    summary.clipped_tokens += values.clip != static_cast<int32_t>(ClipState::kNone);
    summary.kl_sum += values.kl;
    summary.kd_sum += values.kd;
    summary.ce_sum += values.ce;
  }
#define LOSSD_WRITE_TOKEN_OUTPUT(type, name) \
  if (outputs_.name != nullptr) outputs_.name[row] = values.name;
  LOSSD_TOKEN_OUTPUTS(LOSSD_WRITE_TOKEN_OUTPUT)
#undef LOSSD_WRITE_TOKEN_OUTPUT
  const int k = outputs_.top_k;
  for (int j = 0; j < k; ++j) {
    outputs_.top_k_logprob[row * k + j] = top_values[j] - values.lse;
    outputs_.top_k_token[row * k + j] = top_tokens[j];
  }
}

void RowFinisher::Close(BatchSummary& summary) const {
  summary.counted_tokens = counted_rows_;
  if (!IsSequenceReduction(options_.reduction)) {
    summary.loss = ReducedLoss(options_, summary.loss_sum, counted_rows_);
  }
}

absl::StatusOr<DeviceBuffer> AllocateHostBuffer(BufferAllocator* owner, size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* data = std::aligned_alloc(256, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host memory: could not allocate ", bytes, " bytes"));
  }
  return DeviceBuffer(owner, data, bytes);
}

absl::StatusOr<DeviceBuffer> HostAllocator::Allocate(size_t bytes) {
  return AllocateHostBuffer(this, bytes);
}

void HostAllocator::Free(void* data, size_t) { std::free(data); }

namespace {

// The payload's type URL; its value is empty.
constexpr char kDeviceFaultPayload[] = "type.lossd.dev/lossd.DeviceFault";

}  // namespace

absl::Status DeviceFaultError(absl::string_view message) {
  absl::Status status = absl::UnavailableError(absl::StrCat("device fault: ", message));
  status.SetPayload(kDeviceFaultPayload, absl::Cord());
  return status;
}

bool IsDeviceFault(const absl::Status& status) {
  return status.GetPayload(kDeviceFaultPayload).has_value();
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = other.owner_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace lossd
