// The vocabulary of the lossd engine: element types, loss options, one batch's inputs and outputs.
//
// Semantics (z are the logits after soft-capping and temperature, logp_i = z_{i,y_i} - lse_i; see
// loss_math.h for the formulas and gradients):
//   loss_i     = w_i * [ term_i + beta KL_i - c_H H_i + s lse_i^2 ]
//   term_i     = cross_entropy:       (1 - eps) (lse_i - z_{i,y_i}) + eps (lse_i - mean_v z_{i,v})
//                importance_sampling: -r_i A_i,  r_i = exp(logp_i - q_i)
//                ppo:                 -min(r_i A_i, clip(r_i, 1 - eps_low, 1 + eps_high) A_i), and
//                                     with dual clip c, for A_i < 0: min(that, -c A_i)
//                cispo:               -sg(clip(r_i, 1 - eps_low, 1 + eps_high)) A_i logp_i
//                dro:                 -(A_i logp_i - beta_dro / 2 (logp_i - q_i)^2)  (Tinker's DRO)
//                sapo:                -(4 / tau) sigmoid(tau (r_i - 1)) A_i, tau = tau_+ where
//                                     A_i > 0 and tau_- elsewhere (SAPO's soft gate)
//                logprob_gradient:    g_i logp_i, so that dL/dlogp_i = g_i (a caller's own loss)
//                distill:             alpha CE_i + (1 - alpha) KD_i against a teacher (see
//                                     DistillOptions), without the KL and entropy terms
//   reduction  = sum: sum_i loss_i;  mean: sum_i loss_i / D;  none: the vector loss_i;
//                sequence_mean_token_sum: sum_i loss_i / S;
//                sequence_mean_token_mean: sum_i loss_i / (S L_s(i)).
// Rows whose label equals ignore_index contribute 0 to the loss and get a zero gradient.
// D, the mean's denominator, is the number of non-ignored rows of the whole batch (torch's
// F.cross_entropy convention). Per-token weights w_i scale each row's loss and gradient but do not
// enter D, so negative weights (RL advantages) and masks behave the same way under every reduction.
// The sequence reductions are verl's agg_loss modes "seq-mean-token-sum" and "seq-mean-token-mean":
// S counts the sequences with a non-ignored row, L_s a sequence's non-ignored rows; the caller
// resolves them into per-row factors (SequenceReductionScales in backend_common.h).
#ifndef LOSSD_KERNELS_TYPES_H_
#define LOSSD_KERNELS_TYPES_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

namespace lossd {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
absl::string_view DTypeName(DType dtype);

enum class Reduction : int {
  kMean = 0,
  kSum = 1,
  kNone = 2,
  kSequenceMeanTokenSum = 3,
  kSequenceMeanTokenMean = 4,
};
absl::string_view ReductionName(Reduction reduction);
constexpr bool IsSequenceReduction(Reduction reduction) {
  return reduction == Reduction::kSequenceMeanTokenSum ||
         reduction == Reduction::kSequenceMeanTokenMean;
}

// The per-token term of the loss (see the top of this file).
enum class Objective : int {
  kCrossEntropy = 0,
  kImportanceSampling = 1,
  kPpo = 2,
  kCispo = 3,
  kLogprobGradient = 4,
  kDistill = 5,
  kDro = 6,
  kSapo = 7,
};
absl::string_view ObjectiveName(Objective objective);
// Whether the objective reads sampling log-probabilities and advantages.
constexpr bool IsPolicyObjective(Objective objective) {
  return objective == Objective::kImportanceSampling || objective == Objective::kPpo ||
         objective == Objective::kCispo || objective == Objective::kDro ||
         objective == Objective::kSapo;
}
// Whether the objective's term goes through the ratio r_i (dro's does not: it reads logp_i - q_i
// in its quadratic penalty, and reports no ratio).
constexpr bool UsesRatio(Objective objective) {
  return IsPolicyObjective(objective) && objective != Objective::kDro;
}
// The policy objectives, and those with a ratio, by name, for messages.
inline constexpr char kPolicyObjectiveNames[] = "importance_sampling, ppo, cispo, dro or sapo";
inline constexpr char kRatioObjectiveNames[] = "importance_sampling, ppo, cispo or sapo";

// Estimators of KL(policy || reference) at the sampled token from delta = logp_ref - logp
// (Schulman's k1, k2, k3; verl's "kl", "mse", "low_var_kl" without its clamp):
//   k1 = -delta,  k2 = delta^2 / 2,  k3 = e^delta - delta - 1.
enum class KlEstimator : int { kNone = 0, kK1 = 1, kK2 = 2, kK3 = 3 };
absl::string_view KlEstimatorName(KlEstimator estimator);

// Where a token's ratio met the trust region: its objective term was clipped at 1 + eps_high
// (ppo: A > 0; cispo: the weight), at 1 - eps_low (ppo: A < 0), or held at the dual-clip bound.
// PPO counts a token as clipped when the clipped branch strictly wins (verl's pg_clipfrac), so
// that its gradient is cut; CISPO when its weight was clipped.
enum class ClipState : int32_t { kNone = 0, kHigh = 1, kLow = 2, kDual = 3 };

// The options of the policy objectives and the terms any objective may add.
struct PolicyOptions {
  double clip_low = 0.2;   // eps_low in [0, 1]: ratios below 1 - eps_low are clipped
  double clip_high = 0.2;  // eps_high >= 0: ratios above 1 + eps_high are clipped
  double dual_clip = 0.0;  // c > 1: ppo's loss of a negative advantage is at most -c A; 0 off
  KlEstimator kl_estimator = KlEstimator::kNone;
  double kl_coef = 0.0;  // beta >= 0: adds beta KL_i; needs a KL estimator
  // KL_i is the estimate times r_i = exp(logp_i - q_i), its gradient taken through both (the
  // unbiased KL estimate of DeepSeek-V3.2, whose samples come from the old policy q); the
  // objectives with a ratio only.
  bool kl_ratio_weighted = false;
  double entropy_coef = 0.0;  // c_H: subtracts c_H H_i (an entropy bonus for c_H > 0)
  // c > 0: log r = logp - q is clamped to [-c, c] before exp (verl's 20), and r is constant in
  // logp where the clamp holds; 0: none (a non-finite r fails the row).
  double log_ratio_clamp = 0.0;
  double dro_beta = 0.0;            // dro: the quadratic penalty's beta >= 0 (Tinker's "beta")
  double sapo_tau_positive = 1.0;   // sapo: the gate's temperature where A > 0 (verl's 1.0)
  double sapo_tau_negative = 1.05;  // sapo: where A <= 0 (verl's 1.05)
  // GSPO-token (ppo only): every counted row's ratio is its sequence's, s = exp of the mean of
  // logp_t - q_t over the sequence's counted rows, with dr/dlogp_t = r (the stop-gradient form, so
  // that each token's advantage weighs its own gradient); BatchInputs::ratio_sequence_lengths says
  // which rows make a sequence. A sequence's ratio needs all its rows' statistics before any of
  // their gradients, so no sequence may be longer than the call's token chunk.
  bool sequence_ratio = false;
};

// What a sparse teacher's distribution does with the mass outside its top-k (DistillOptions).
enum class SparseTeacherMass : int {
  // Dropped: the teacher's top-k probabilities are renormalized to sum to 1 over the k tokens
  // (log-probabilities -inf elsewhere).
  kRenormalize = 0,
  // The mass 1 - sum_j p_j left by the top-k is spread evenly over the other V - k tokens.
  kSpread = 1,
  // The mass left by the top-k stays one bucket, p_tail, compared with the student's q_tail, its
  // mass outside the same k tokens: D over the k + 1 buckets (distill_math.h).
  kTailBucket = 2,
};

// Knowledge distillation against a teacher's distribution over the same vocabulary. With z the
// student's logits after its soft cap and temperature (LossOptions), z_t the teacher's after its
// own, and the distillation temperature tau: q = softmax(z / tau), p = softmax(z_t / tau).
//   D_beta = KL(p || q)                           beta = 0  (forward KL: classic distillation)
//          = KL(q || p)                           beta = 1  (reverse KL: on-policy distillation)
//          = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q,  otherwise
// the generalized JSD in the convention of TRL's generalized_jsd_loss and Liger-Kernel's JSD
// (which special-case beta 0 and 1 the same way). KD_i = tau^2 D_beta (Hinton's scaling, which
// keeps the gradient's size independent of tau; TRL and Liger do not scale: divide by tau^2 to
// compare). CE_i is the cross-entropy of the label under the student at its own temperature
// (label smoothing applies), and term_i = alpha CE_i + (1 - alpha) KD_i. The teacher gets no
// gradient.
struct DistillOptions {
  double beta = 0.0;                   // in [0, 1]
  double alpha = 0.0;                  // in [0, 1]; > 0 needs labels
  double temperature = 1.0;            // tau > 0
  double teacher_logit_softcap = 0.0;  // the teacher head's soft cap c_t (0: off)
  double teacher_temperature = 1.0;    // the teacher head's temperature T_t
  SparseTeacherMass sparse_mass = SparseTeacherMass::kRenormalize;
};
absl::string_view SparseTeacherMassName(SparseTeacherMass mass);

// The largest k a caller may ask for in top-k log-probabilities.
inline constexpr int kMaxTopK = 64;
// The largest k of a sparse teacher's top-k.
inline constexpr int kMaxTeacherTopK = 1024;

struct LossOptions {
  Reduction reduction = Reduction::kMean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // eps in [0, 1]
  double z_loss_scale = 0.0;     // s >= 0; adds s * lse^2 per token (PaLM's z-loss)
  double logit_softcap = 0.0;    // c > 0 applies a <- c tanh(a / c); 0 turns it off
  double temperature = 1.0;      // T > 0; z = a / T, applied after the soft cap
  // Multiplies every gradient (dL/dh and dL/dW), not the loss: the upstream gradient of a scalar
  // loss, or a loss-scaling factor.
  double grad_scale = 1.0;
  // The mean's denominator D for this call; 0 counts the non-ignored rows of this call. A caller
  // that splits one batch into several calls passes the whole batch's count to each of them.
  double mean_denominator = 0.0;
  // Lets GPU backends run fp32 products on TF32 tensor cores (about 10 bits of mantissa).
  bool allow_tf32 = false;
  // How a GPU backend's 16-bit products (hidden states and head in the same 16-bit dtype) take
  // dL/da for dL/dh = dL/da W and dL/dW = dL/da^T h. By default dL/da, computed in fp32 with the
  // target-class term, is rounded once to the products' dtype: one GEMM each, and bf16's 8
  // significant bits give the gradients a relative error near 1e-3 (the loss, log-probabilities
  // and row statistics stay fp32). Exact: dL/da enters as two 16-bit halves, S dL/da = hi + lo,
  // two GEMMs each, about 16 significant bits, gradients as close to float64 as fp32 products
  // give. fp32 products, and the CPU backend, are exact either way.
  bool exact_gradients = false;
  // Stores this call's dL/dW into grad_weight instead of adding it, so that a caller staging one
  // call's gradient need not zero the buffer first. Every entry is written when the call has rows.
  bool overwrite_grad_weight = false;
  Objective objective = Objective::kCrossEntropy;
  PolicyOptions policy;
  DistillOptions distill;
};

struct WeightView;

// The teacher of a distill call, for the same rows as the student's hidden states: a head on the
// backend's device with its own hidden rows (a dense teacher; its hidden size may differ from the
// student's, its vocabulary may not), or the top-k of its log-probabilities per row (a sparse
// teacher, from cached outputs). Host memory owned by the caller, but for the head.
struct TeacherInputs {
  const WeightView* weight = nullptr;  // dense: [V, H_t]
  const void* hidden = nullptr;        // dense: [num_tokens, H_t] in hidden_dtype
  DType hidden_dtype = DType::kFloat32;
  int64_t hidden_size = 0;
  int top_k = 0;                          // sparse: k in [1, min(V, kMaxTeacherTopK)]
  const int32_t* top_k_tokens = nullptr;  // [num_tokens, k], distinct ids per row
  const float* top_k_logprobs = nullptr;  // [num_tokens, k], each <= 0, finite
  bool dense() const { return weight != nullptr; }
  bool sparse() const { return top_k > 0; }
};

// One batch of tokens. All pointers are host memory owned by the caller.
struct BatchInputs {
  const void* hidden = nullptr;  // [num_tokens, hidden_size], row-major, hidden_dtype
  DType hidden_dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  // [num_tokens], in [0, V) or ignore_index; null only under distill with alpha = 0, where every
  // row counts.
  const int64_t* labels = nullptr;
  const float* token_weights = nullptr;  // [num_tokens] or null for all ones
  // Per-token inputs of the objectives, [num_tokens] each, read only where the objective or term
  // uses them and only on rows that are not ignored.
  const float* sampling_logprobs = nullptr;   // q_i: the policy objectives
  const float* advantages = nullptr;          // A_i: the policy objectives
  const float* reference_logprobs = nullptr;  // logp_ref_i: with a KL estimator
  const float* logprob_grads = nullptr;       // g_i: logprob_gradient
  // [num_tokens] with a sequence reduction: each row's factor in the reduced loss, 1 / S or
  // 1 / (S L_s), as SequenceReductionScales computes them for the whole batch.
  const double* reduction_scales = nullptr;
  // With PolicyOptions::sequence_ratio: the batch's rows as consecutive sequences, by length
  // (each >= 1, summing to num_tokens).
  const int64_t* ratio_sequence_lengths = nullptr;
  int64_t num_ratio_sequences = 0;
  TeacherInputs teacher;  // distill only
};

// The per-token outputs of one value a row, listed once: X(type, name). Everything that handles
// them one by one is derived from this list: TokenOutputs' slots and TokenValues' members below,
// the row finisher's writes and sums (RowFinisher::Emit), the server's binding and streaming, and
// the test harness's buffers. `name` is also the output's pair of fields in lossd.proto
// (OutputSelection's bool and ComputeResult's repeated field of the same 4-byte type), from which
// the clients derive theirs. A new output is one line here, its two proto fields and its value in
// RowFinisher::ValuesOf (backend_impl.h).
//   token_loss  loss_i as defined above (weighted, before the reduction)
//   logprob     log p(y_i) = z_y - lse
//   lse         log sum_v exp z_v
//   entropy     lse - sum_v p_v z_v
//   argmax      the most likely token (lowest id on ties)
//   correct     1 where the row counts and its argmax is its label, else 0 (token accuracy)
//   ratio       r_i = exp(logp_i - q_i) of the policy objectives
//   clip        the row's ClipState
//   kl          KL_i by the call's estimator
//   kd          KD_i = tau^2 D_beta of distill, before alpha and the weight
//   ce          CE_i of distill, before alpha and the weight (0 without labels)
// Ignored rows get 0 in every output but lse, entropy and argmax, which every row gets; an output
// an objective does not define (ratio outside the policy objectives, kd outside distill) is 0.
#define LOSSD_TOKEN_OUTPUTS(X) \
  X(float, token_loss)         \
  X(float, logprob)            \
  X(float, lse)                \
  X(float, entropy)            \
  X(int32_t, argmax)           \
  X(int32_t, correct)          \
  X(float, ratio)              \
  X(int32_t, clip)             \
  X(float, kl)                 \
  X(float, kd)                 \
  X(float, ce)

// One row's values of the outputs above.
struct TokenValues {
#define LOSSD_TOKEN_VALUE(type, name) type name = 0;
  LOSSD_TOKEN_OUTPUTS(LOSSD_TOKEN_VALUE)
#undef LOSSD_TOKEN_VALUE
};

// Which per-token results to produce: a null pointer means "not wanted". Host memory, caller-owned.
struct TokenOutputs {
  // [N] each, as LOSSD_TOKEN_OUTPUTS describes them.
#define LOSSD_TOKEN_SLOT(type, name) type* name = nullptr;
  LOSSD_TOKEN_OUTPUTS(LOSSD_TOKEN_SLOT)
#undef LOSSD_TOKEN_SLOT
  int top_k = 0;                   // k in [0, kMaxTopK]; filled for every row
  float* top_k_logprob = nullptr;  // [N, k], best first
  int32_t* top_k_token = nullptr;  // [N, k]
  void* grad_hidden = nullptr;     // [N, H] dL/dh in grad_hidden_dtype, overwritten
  DType grad_hidden_dtype = DType::kFloat32;
};

struct BatchSummary {
  double loss_sum = 0.0;       // sum_i loss_i over this call's rows, summed in double
  double loss = 0.0;           // the reduced loss (sum and none report loss_sum)
  int64_t counted_tokens = 0;  // rows whose label is not ignore_index
  int64_t correct_tokens = 0;  // counted rows whose argmax equals the label
  int64_t clipped_tokens = 0;  // counted rows whose ClipState is not kNone
  double kl_sum = 0.0;         // sum of KL_i over counted rows (with a KL estimator)
  double kd_sum = 0.0;         // sum of KD_i over counted rows (distill)
  double ce_sum = 0.0;         // sum of CE_i over counted rows (distill)
  // False when any row's logits were not finite (NaN/Inf in h or W, or overflow); the caller then
  // must not trust, or commit, the gradients of this call.
  bool all_finite = true;
  int64_t token_chunk = 0;      // rows per chunk the plan chose
  int64_t vocab_chunk = 0;      // vocabulary columns per tile the plan chose
  int64_t logit_rows = 0;       // rows of logits held at once (ChunkPlan::logit_rows)
  int64_t workspace_bytes = 0;  // peak workspace used by the call
  // With dL/dW: a bound on |entry| of this call's contribution to it,
  // sum_i max_v |dL/da_iv| * max_j |h_ij|; +inf when the backend does not compute one. A caller
  // that must know the contribution is finite can skip reading it when the bound is far below
  // FLT_MAX.
  double grad_weight_bound = HUGE_VAL;
  // Seconds from the call's first operation on the device to its last, read from the device's own
  // clock (CUDA events), copies between host and device included where the call waits for them;
  // 0 where the backend has no such clock (the CPU, whose wall time is the caller's to take).
  double device_seconds = 0.0;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_TYPES_H_
