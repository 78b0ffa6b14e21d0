#include "server/call/proto_convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"

namespace lossd::server {
namespace {

bool IsFiniteAtLeast(double value, double low) { return std::isfinite(value) && value >= low; }

}  // namespace

absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field,
                                std::optional<DType> fallback) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    case v1::DTYPE_UNSPECIFIED:
      if (fallback.has_value()) return *fallback;
      break;
    default: break;
  }
  return InvalidField(
      field, "DTYPE_FLOAT32, DTYPE_BFLOAT16 or DTYPE_FLOAT16",
      v1::DType_IsValid(dtype) ? v1::DType_Name(dtype) : absl::StrCat(static_cast<int>(dtype)));
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<LossOptions> FromProto(const v1::LossOptions& p) {
  LossOptions o;
  switch (p.reduction()) {
    case v1::REDUCTION_MEAN: o.reduction = Reduction::kMean; break;
    case v1::REDUCTION_SUM: o.reduction = Reduction::kSum; break;
    case v1::REDUCTION_NONE: o.reduction = Reduction::kNone; break;
    case v1::REDUCTION_SEQUENCE_MEAN_TOKEN_SUM:
      o.reduction = Reduction::kSequenceMeanTokenSum;
      break;
    case v1::REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN:
      o.reduction = Reduction::kSequenceMeanTokenMean;
      break;
    default:
      return InvalidField("options.reduction",
                          "REDUCTION_MEAN, REDUCTION_SUM, REDUCTION_NONE, "
                          "REDUCTION_SEQUENCE_MEAN_TOKEN_SUM or REDUCTION_SEQUENCE_MEAN_TOKEN_MEAN",
                          absl::StrCat(static_cast<int>(p.reduction())));
  }
  switch (p.objective()) {
    case v1::OBJECTIVE_CROSS_ENTROPY: o.objective = Objective::kCrossEntropy; break;
    case v1::OBJECTIVE_IMPORTANCE_SAMPLING: o.objective = Objective::kImportanceSampling; break;
    case v1::OBJECTIVE_PPO: o.objective = Objective::kPpo; break;
    case v1::OBJECTIVE_CISPO: o.objective = Objective::kCispo; break;
    case v1::OBJECTIVE_LOGPROB_GRADIENT: o.objective = Objective::kLogprobGradient; break;
    case v1::OBJECTIVE_DISTILL: o.objective = Objective::kDistill; break;
    case v1::OBJECTIVE_DRO: o.objective = Objective::kDro; break;
    case v1::OBJECTIVE_SAPO: o.objective = Objective::kSapo; break;
    // ppo's, against sampling log-probabilities the server rewrites once it has measured each
    // sequence's ratio (CallSpec::ratio_sequences).
    case v1::OBJECTIVE_GSPO: o.objective = Objective::kPpo; break;
    default:
      return InvalidField("options.objective",
                          "OBJECTIVE_CROSS_ENTROPY, OBJECTIVE_IMPORTANCE_SAMPLING, OBJECTIVE_PPO, "
                          "OBJECTIVE_CISPO, OBJECTIVE_LOGPROB_GRADIENT, OBJECTIVE_DISTILL, "
                          "OBJECTIVE_DRO, OBJECTIVE_SAPO or OBJECTIVE_GSPO",
                          absl::StrCat(static_cast<int>(p.objective())));
  }
  const v1::DistillOptions& distill = p.distill();
  switch (distill.sparse_teacher_mass()) {
    case v1::SPARSE_TEACHER_RENORMALIZE:
      o.distill.sparse_mass = SparseTeacherMass::kRenormalize;
      break;
    case v1::SPARSE_TEACHER_SPREAD: o.distill.sparse_mass = SparseTeacherMass::kSpread; break;
    case v1::SPARSE_TEACHER_TAIL_BUCKET:
      o.distill.sparse_mass = SparseTeacherMass::kTailBucket;
      break;
    default:
      return InvalidField("options.distill.sparse_teacher_mass",
                          "SPARSE_TEACHER_RENORMALIZE, SPARSE_TEACHER_SPREAD or "
                          "SPARSE_TEACHER_TAIL_BUCKET",
                          absl::StrCat(static_cast<int>(distill.sparse_teacher_mass())));
  }
  o.distill.beta = distill.beta();
  o.distill.alpha = distill.alpha();
  if (distill.has_temperature()) o.distill.temperature = distill.temperature();
  o.distill.teacher_logit_softcap = distill.teacher_logit_softcap();
  if (distill.has_teacher_temperature()) {
    o.distill.teacher_temperature = distill.teacher_temperature();
  }
  const v1::PolicyOptions& policy = p.policy();
  switch (policy.kl_estimator()) {
    case v1::KL_ESTIMATOR_NONE: o.policy.kl_estimator = KlEstimator::kNone; break;
    case v1::KL_ESTIMATOR_K1: o.policy.kl_estimator = KlEstimator::kK1; break;
    case v1::KL_ESTIMATOR_K2: o.policy.kl_estimator = KlEstimator::kK2; break;
    case v1::KL_ESTIMATOR_K3: o.policy.kl_estimator = KlEstimator::kK3; break;
    default:
      return InvalidField("options.policy.kl_estimator",
                          "KL_ESTIMATOR_NONE, KL_ESTIMATOR_K1, KL_ESTIMATOR_K2 or KL_ESTIMATOR_K3",
                          absl::StrCat(static_cast<int>(policy.kl_estimator())));
  }
  if (policy.has_clip_low()) o.policy.clip_low = policy.clip_low();
  if (policy.has_clip_high()) o.policy.clip_high = policy.clip_high();
  o.policy.dual_clip = policy.dual_clip();
  o.policy.log_ratio_clamp = policy.log_ratio_clamp();
  o.policy.dro_beta = policy.dro_beta();
  o.policy.kl_ratio_weighted = policy.kl_ratio_weighted();
  if (policy.has_sapo_tau_positive()) o.policy.sapo_tau_positive = policy.sapo_tau_positive();
  if (policy.has_sapo_tau_negative()) o.policy.sapo_tau_negative = policy.sapo_tau_negative();
  o.policy.kl_coef = policy.kl_coef();
  o.policy.entropy_coef = policy.entropy_coef();
  if (p.has_ignore_index()) o.ignore_index = p.ignore_index();
  o.label_smoothing = p.label_smoothing();
  o.z_loss_scale = p.z_loss_scale();
  o.logit_softcap = p.logit_softcap();
  if (p.has_temperature()) o.temperature = p.temperature();
  if (p.has_grad_scale()) o.grad_scale = p.grad_scale();
  o.mean_denominator = p.mean_denominator();
  o.allow_tf32 = p.allow_tf32();
  absl::Status status = ValidateOptions(o);
  if (!status.ok()) {
    // The kernels name the option; on the wire it sits in ComputeStart.options.
    const std::string field = FieldOf(status);
    absl::Status named = absl::InvalidArgumentError(absl::StrCat("options.", status.message()));
    return field.empty() ? named : WithField(std::move(named), absl::StrCat("options.", field));
  }
  return o;
}

absl::StatusOr<OptimizerConfig> FromProto(const v1::StepRequest& request) {
  OptimizerConfig c;
  switch (request.optimizer_case()) {
    case v1::StepRequest::kSgd: {
      const v1::SgdConfig& sgd = request.sgd();
      c.kind = OptimizerConfig::Kind::kSgd;
      // Unset keeps torch.optim.SGD's default learning rate, OptimizerConfig's 1e-3.
      if (sgd.has_learning_rate()) c.learning_rate = sgd.learning_rate();
      c.momentum = sgd.momentum();
      c.weight_decay = sgd.weight_decay();
      if (!IsFiniteAtLeast(c.momentum, 0.0)) {
        return InvalidField("sgd.momentum", "a finite value >= 0", absl::StrCat(c.momentum));
      }
      break;
    }
    case v1::StepRequest::kAdamw: {
      const v1::AdamWConfig& adamw = request.adamw();
      c.kind = OptimizerConfig::Kind::kAdamW;
      // What the request leaves unset keeps torch.optim.AdamW's default: OptimizerConfig's for
      // the learning rate, betas and epsilon; 0.01 for the weight decay (SGD's default is 0).
      c.weight_decay = adamw.has_weight_decay() ? adamw.weight_decay() : 0.01;
      if (adamw.has_learning_rate()) c.learning_rate = adamw.learning_rate();
      if (adamw.has_beta1()) c.beta1 = adamw.beta1();
      if (adamw.has_beta2()) c.beta2 = adamw.beta2();
      if (adamw.has_epsilon()) c.epsilon = adamw.epsilon();
      if (!(c.beta1 >= 0.0 && c.beta1 < 1.0)) {
        return InvalidField("adamw.beta1", "a value in [0, 1)", absl::StrCat(c.beta1));
      }
      if (!(c.beta2 >= 0.0 && c.beta2 < 1.0)) {
        return InvalidField("adamw.beta2", "a value in [0, 1)", absl::StrCat(c.beta2));
      }
      if (!(std::isfinite(c.epsilon) && c.epsilon > 0.0)) {
        return InvalidField("adamw.epsilon", "a finite value > 0", absl::StrCat(c.epsilon));
      }
      break;
    }
    default: return InvalidField("optimizer", "sgd or adamw", "neither");
  }
  if (!IsFiniteAtLeast(c.learning_rate, 0.0)) {
    return InvalidField("learning_rate", "a finite value >= 0", absl::StrCat(c.learning_rate));
  }
  if (!IsFiniteAtLeast(c.weight_decay, 0.0)) {
    return InvalidField("weight_decay", "a finite value >= 0", absl::StrCat(c.weight_decay));
  }
  if (!IsFiniteAtLeast(request.max_grad_norm(), 0.0)) {
    return InvalidField("max_grad_norm", "0 (off) or a finite value > 0",
                        absl::StrCat(request.max_grad_norm()));
  }
  return c;
}

v1::HeadInfo ToProto(const HeadSummary& s) {
  v1::HeadInfo info;
  info.set_name(s.name);
  info.set_vocab_size(s.vocab_size);
  info.set_hidden_size(s.hidden_size);
  info.set_dtype(ToProto(s.dtype));
  info.set_version(s.version);
  info.set_source(s.source);
  info.set_accumulated_tokens(s.accumulated_tokens);
  info.set_accumulated_calls(s.accumulated_calls);
  info.set_optimizer(static_cast<v1::OptimizerState::Kind>(s.optimizer));
  info.set_steps(s.steps);
  info.set_tied_embeddings(s.tied_embeddings);
  info.set_logit_softcap(s.logit_softcap);
  info.set_weight_sha256(s.weight_sha256);
  info.set_master_weights(s.master_weights);
  info.set_staged_gradients(s.staged_gradients);
  return info;
}

}  // namespace lossd::server
