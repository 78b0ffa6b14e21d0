// A plain float64 implementation of linear cross-entropy that materializes the [N, V] logits (and
// a distill call's teacher's).
// Written from the definitions, independently of kernels/include/lossd/kernels/loss_math.h, so
// that the engine is checked against the math rather than against itself.
#ifndef LOSSD_TESTS_REFERENCE_H_
#define LOSSD_TESTS_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "lossd/kernels/types.h"

namespace lossd::testing {

struct ReferenceProblem {
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  std::vector<double> hidden;         // [N, H], the values the engine sees after rounding
  std::vector<double> weight;         // [V, H]
  std::vector<int64_t> labels;        // [N]
  std::vector<double> token_weights;  // [N] or empty
  // Per-token inputs of the objectives ([N] or empty) and the batch's sequences (lengths, one
  // after another), as in lossd/kernels/types.h.
  std::vector<double> sampling_logprobs;
  std::vector<double> advantages;
  std::vector<double> reference_logprobs;
  std::vector<double> logprob_grads;
  std::vector<int64_t> sequence_lengths;
  LossOptions options;
  // OBJECTIVE_GSPO, which the server runs as options' ppo: every token's ratio is its sequence's,
  // exp of the mean of logp - q over the sequence's counted tokens, with d r / d logp = r.
  bool sequence_ratio = false;
  int top_k = 0;
  // A distill call's teacher: a head [V, H_t] with its hidden rows [N, H_t] (dense), or the top-k
  // of its log-probabilities per row (sparse). Empty labels: a distill call without labels.
  int64_t teacher_hidden_size = 0;
  std::vector<double> teacher_hidden;
  std::vector<double> teacher_weight;
  int teacher_top_k = 0;
  std::vector<int64_t> teacher_top_k_tokens;   // [N, k]
  std::vector<double> teacher_top_k_logprobs;  // [N, k]
};

struct ReferenceResult {
  double loss = 0.0;  // reduced
  double loss_sum = 0.0;
  int64_t counted_tokens = 0;
  std::vector<double> token_loss;  // [N]
  // [N] the sum of |term| over the terms that make token_loss[i] (the objective's, the KL and
  // entropy penalties, the z-loss, a distillation's two): the size its fp32 error scales with,
  // where the terms of one row cancel (a ppo term against its KL penalty, say).
  std::vector<double> token_loss_scale;
  // [N] g_i d loss_i / d logp_i, the policy objective's and the KL penalty's together (g_i the
  // row's gradient factor), and the sum of the two parts' sizes: where they cancel, the row's
  // gradient is small against the fp32 error of its parts.
  std::vector<double> logprob_coefficient;
  std::vector<double> logprob_coefficient_scale;
  std::vector<double> logprob;        // [N], 0 for ignored rows
  std::vector<double> lse;            // [N]
  std::vector<double> entropy;        // [N]
  std::vector<int64_t> argmax;        // [N]
  std::vector<double> logits;         // [N, V] z after soft cap and temperature
  std::vector<double> top_k_logprob;  // [N, k]
  std::vector<int64_t> top_k_token;   // [N, k]
  std::vector<double> grad_hidden;    // [N, H]
  std::vector<double> grad_weight;    // [V, H]
  double max_abs_logit = 0.0;
  std::vector<double> ratio;  // [N] exp(logp - q); 0 for ignored rows and cross-entropy
  std::vector<int32_t> clip;  // [N] ClipState
  std::vector<double> kl;     // [N] the KL estimate; 0 for ignored rows
  int64_t clipped_tokens = 0;
  double kl_sum = 0.0;
  std::vector<double> kd;              // [N] tau^2 D_beta; 0 for ignored rows
  std::vector<double> ce;              // [N] the label's cross-entropy under distill
  std::vector<double> teacher_logits;  // [N, V] z_t after the teacher's transform (or completed)
  double kd_sum = 0.0;
  double ce_sum = 0.0;
};

ReferenceResult ComputeReference(const ReferenceProblem& problem);

// The reduced loss alone, for finite-difference checks of the reference's own gradients.
double ReferenceLoss(const ReferenceProblem& problem);

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_REFERENCE_H_
