// The vocabulary of the lossd engine: element types, loss options, one batch's inputs and outputs.
//
// Semantics (z are the logits after soft-capping and temperature; see loss_math.h for formulas):
//   loss_i     = w_i * [ (1 - eps) (lse_i - z_{i,y_i}) + eps (lse_i - mean_v z_{i,v}) + s lse_i^2 ]
//   reduction  = sum: sum_i loss_i;  mean: sum_i loss_i / D;  none: the vector loss_i.
// Rows whose label equals ignore_index contribute 0 to the loss and get a zero gradient.
// D, the mean's denominator, is the number of non-ignored rows of the whole batch (torch's
// F.cross_entropy convention). Per-token weights w_i scale each row's loss and gradient but do not
// enter D, so negative weights (RL advantages) and masks behave the same way under every reduction.
#ifndef LOSSD_KERNELS_TYPES_H_
#define LOSSD_KERNELS_TYPES_H_

#include <cstddef>
#include <cmath>
#include <cstdint>
#include "absl/strings/string_view.h"

namespace lossd {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
absl::string_view DTypeName(DType dtype);

enum class Reduction : int { kMean = 0, kSum = 1, kNone = 2 };
absl::string_view ReductionName(Reduction reduction);

// The largest k a caller may ask for in top-k log-probabilities.
inline constexpr int kMaxTopK = 64;

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
  // Stores this call's dL/dW into grad_weight instead of adding it, so that a caller staging one
  // call's gradient need not zero the buffer first. Every entry is written when the call has rows.
  bool overwrite_grad_weight = false;
};

// One batch of tokens. All pointers are host memory owned by the caller.
struct BatchInputs {
  const void* hidden = nullptr;  // [num_tokens, hidden_size], row-major, hidden_dtype
  DType hidden_dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  const int64_t* labels = nullptr;         // [num_tokens], in [0, V) or ignore_index
  const float* token_weights = nullptr;    // [num_tokens] or null for all ones
};

// Which per-token results to produce: a null pointer means "not wanted". Host memory, caller-owned.
// Ignored rows get loss 0 and logprob 0; lse, entropy, argmax and top-k are filled for every row.
struct TokenOutputs {
  float* loss = nullptr;        // [N] loss_i as defined above (weighted, before the reduction)
  float* logprob = nullptr;     // [N] log p(y_i) = z_y - lse
  float* lse = nullptr;         // [N]
  float* entropy = nullptr;     // [N] lse - sum_v p_v z_v
  int32_t* argmax = nullptr;    // [N] the most likely token (lowest id on ties)
  int top_k = 0;                // k in [0, kMaxTopK]
  float* top_k_logprob = nullptr;  // [N, k], best first
  int32_t* top_k_token = nullptr;  // [N, k]
  void* grad_hidden = nullptr;     // [N, H] dL/dh in grad_hidden_dtype, overwritten
  DType grad_hidden_dtype = DType::kFloat32;
};

struct BatchSummary {
  double loss_sum = 0.0;        // sum_i loss_i over this call's rows, summed in double
  double loss = 0.0;            // the reduced loss (sum and none report loss_sum)
  int64_t counted_tokens = 0;   // rows whose label is not ignore_index
  int64_t correct_tokens = 0;   // counted rows whose argmax equals the label
  // False when any row's logits were not finite (NaN/Inf in h or W, or overflow); the caller then
  // must not trust, or commit, the gradients of this call.
  bool all_finite = true;
  int64_t token_chunk = 0;      // rows per chunk the plan chose
  int64_t vocab_chunk = 0;      // vocabulary columns per tile the plan chose
  int64_t workspace_bytes = 0;  // peak workspace used by the call
  // With dL/dW: a bound on |entry| of this call's contribution to it,
  // sum_i max_v |dL/da_iv| * max_j |h_ij|; +inf when the backend does not compute one. A caller
  // that must know the contribution is finite can skip reading it when the bound is far below
  // FLT_MAX.
  double grad_weight_bound = HUGE_VAL;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_TYPES_H_
