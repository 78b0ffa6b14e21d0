// Every engine option and output against the float64 reference, on every available backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_plan.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"

namespace lossd::testing {
namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

// Error bounds, relative Frobenius unless noted, for fp32 or 16-bit inputs with fp32 outputs.
constexpr double kLossBound = 1e-6;
constexpr double kGradBound = 2e-5;
// Absolute bound on logprob, lse, entropy and top-k values: fp32 logits carry an absolute error
// proportional to their magnitude, so the bound scales with max |z|.
double LogitBound(double max_abs_logit) { return 1e-5 * (1.0 + max_abs_logit); }
// dL/dh returned in bf16 is rounded to 8 significant bits: a relative error of at most 2^-9 per
// element on top of the engine's own, so 2^-8 bounds the whole.
constexpr double kBf16GradBound = 1.0 / 256;
// The CUDA backend's default gradients for 16-bit products: dL/da, exact in fp32, rounded once to
// the products' dtype, a relative error of at most 2^-9 per element in bf16 (2^-12 in fp16). The
// gradients sum such terms with independent errors, about 2^-9 / sqrt(3) ~ 1.1e-3 relative to
// their norm where the terms do not cancel; 2^-8 leaves a factor of 3.5.
constexpr double kRoundedGradBound = 1.0 / 256;
// The CUDA backend's 16-bit products run on tensor cores, whose fp32 accumulation is a little
// coarser than the CPU's sums: on an H100 (2026-11-26) a bf16 loss at H = 2048 erred by 1.3e-6
// against float64, and cuBLAS's logits by 2e-6 to 4e-6 relative at K = 2048 to 4096
// (cuda_gemm_probe_test). 1e-5 keeps a factor of 2.5 over the logits' error.
constexpr double kTensorCoreLossBound = 1e-5;

// Whether the CUDA backend runs a spec's products in 16 bits on tensor cores, in either gradient
// mode.
bool TensorCoreProducts(const std::string& backend_name, const ProblemSpec& spec) {
  return backend_name == "cuda" && spec.hidden_dtype == spec.weight_dtype &&
         spec.hidden_dtype != DType::kFloat32;
}

// Whether the CUDA backend runs a spec's products in 16 bits (rows and head in one 16-bit dtype)
// and so rounds its dL/da to 16 bits unless the call asks for exact gradients.
bool RoundsGradients(const std::string& backend_name, const ProblemSpec& spec) {
  return TensorCoreProducts(backend_name, spec) && !spec.options.exact_gradients;
}

// kWindows: on the CUDA backend, windows of rows finished in pieces (FinishesRowsInWindows), the
// last window and its last piece shorter than the rest; kOneWindow: the call one such window, its
// last piece shorter; elsewhere chunks that hold their logits.
enum class Tiling { kAny, kTokenChunks, kVocabTiles, kWindows, kOneWindow };

struct EngineCase {
  const char* name;
  const char* why;
  ProblemSpec spec;
  size_t budget = 64 * kMiB;
  Tiling tiling = Tiling::kAny;
  bool gradients = true;
  DType grad_hidden_dtype = DType::kFloat32;
  double grad_bound = kGradBound;
  double loss_bound = kLossBound;
};

void PrintTo(const EngineCase& c, std::ostream* os) { *os << c.name; }

// At logit scale 1e3 the fp32 product itself carries an absolute error of about
// |z| 2^-24 sqrt(H) ~ 5e-4, and p - onehot inherits it wherever two logits nearly tie; the float64
// reference does not round there, so the gradient bound grows with the logits (observed up to
// 2.1e-5 over many seeds, bounded here with a 5x margin).
constexpr double kExtremeLogitGradBound = 1e-4;

LossOptions With(Reduction reduction) {
  LossOptions o;
  o.reduction = reduction;
  return o;
}

LossOptions SmoothingOptions() {
  LossOptions o;
  o.label_smoothing = 0.1;
  return o;
}

LossOptions ZLossSoftcapOptions() {
  LossOptions o;
  o.z_loss_scale = 1e-3;
  o.logit_softcap = 30.0;
  return o;
}

LossOptions TemperatureOptions() {
  LossOptions o;
  o.temperature = 0.7;
  return o;
}

LossOptions SumWithGradScale() {
  LossOptions o = With(Reduction::kSum);
  o.grad_scale = 0.5;
  return o;
}

LossOptions EverythingOptions() {
  LossOptions o;
  o.label_smoothing = 0.05;
  o.logit_softcap = 20.0;
  o.temperature = 1.3;
  o.z_loss_scale = 1e-4;
  return o;
}

// Rows and head in bf16.
void InBf16(ProblemSpec& s) {
  s.hidden_dtype = DType::kBFloat16;
  s.weight_dtype = DType::kBFloat16;
}

// bf16 with every cross-entropy option, token weights, ignored rows and logits large enough to
// reach the soft cap.
void EverythingInBf16(ProblemSpec& s) {
  InBf16(s);
  s.options = EverythingOptions();
  s.token_weights = true;
  s.ignore_fraction = 0.1;
  s.logit_scale = 25.0;
}

LossOptions SliceOfBatch() {
  LossOptions o;
  o.mean_denominator = 1000.0;
  return o;
}

LossOptions Policy(Objective objective, Reduction reduction) {
  LossOptions o;
  o.objective = objective;
  o.reduction = reduction;
  o.policy.clip_low = 0.2;
  o.policy.clip_high = 0.28;
  return o;
}

LossOptions PpoDualClip() {
  LossOptions o = Policy(Objective::kPpo, Reduction::kSum);
  o.policy.dual_clip = 3.0;
  return o;
}

LossOptions PpoKlEntropy(KlEstimator estimator, Reduction reduction) {
  LossOptions o = Policy(Objective::kPpo, reduction);
  o.policy.kl_estimator = estimator;
  o.policy.kl_coef = 0.05;
  o.policy.entropy_coef = 0.01;
  return o;
}

LossOptions GspoOptions(Reduction reduction) {
  LossOptions o = Policy(Objective::kPpo, reduction);
  o.policy.sequence_ratio = true;
  return o;
}

LossOptions CispoOptions() {
  LossOptions o = Policy(Objective::kCispo, Reduction::kSequenceMeanTokenSum);
  o.policy.clip_low = 1.0;  // MiniMax-M1's setting: the weight is clipped from above only
  return o;
}

LossOptions DroOptions(Reduction reduction) {
  LossOptions o = Policy(Objective::kDro, reduction);
  o.policy.dro_beta = 0.7;
  return o;
}

LossOptions SapoOptions(Reduction reduction) {
  LossOptions o = Policy(Objective::kSapo, reduction);
  o.policy.sapo_tau_positive = 0.8;
  o.policy.sapo_tau_negative = 1.6;
  return o;
}

LossOptions CrossEntropyWithKlAndEntropy() {
  LossOptions o;
  o.policy.kl_estimator = KlEstimator::kK2;
  o.policy.kl_coef = 0.1;
  o.policy.entropy_coef = 0.02;
  o.label_smoothing = 0.05;
  return o;
}

LossOptions Distill(double beta, double alpha = 0.0, double tau = 1.0) {
  LossOptions o;
  o.objective = Objective::kDistill;
  o.distill.beta = beta;
  o.distill.alpha = alpha;
  o.distill.temperature = tau;
  return o;
}

// Soft caps and temperatures on both heads, tau != 1, smoothing, z-loss.
LossOptions DistillEverything() {
  LossOptions o = Distill(0.3, 0.4, 2.0);
  o.logit_softcap = 30.0;
  o.temperature = 1.2;
  o.label_smoothing = 0.05;
  o.z_loss_scale = 1e-4;
  o.distill.teacher_logit_softcap = 20.0;
  o.distill.teacher_temperature = 0.8;
  return o;
}

// KD sums V probabilities times log-ratios whose error is the logits' (LogitBound), so its
// absolute error is of the logits' size too, divided by tau inside and multiplied by tau^2
// outside.
constexpr double kDistillLossBound = 1e-5;
// At logits of 1e3 a KD of thousands carries fp32's spacing near the logits relative to itself,
// about 1e-4 (see the KD check in MatchesFloat64Reference).
constexpr double kExtremeLogitDistillLossBound = 3e-4;

ProblemSpec Spec(int64_t n, int64_t h, int64_t v) {
  ProblemSpec s;
  s.num_tokens = n;
  s.hidden_size = h;
  s.vocab_size = v;
  s.top_k = 5;
  return s;
}

template <typename Fn>
ProblemSpec Spec(int64_t n, int64_t h, int64_t v, Fn customize) {
  ProblemSpec s = Spec(n, h, v);
  customize(s);
  return s;
}

// The table keeps one case per entry, its lambda in place: clang-format would split them.
// clang-format off
const EngineCase kCases[] = {
    {"basic", "a small fp32 batch with every output", Spec(37, 64, 1000)},
    {"chunk_crossing", "several token chunks; N and V are multiples of no chunk size",
     Spec(701, 96, 5003), 8 * kMiB, Tiling::kTokenChunks},
    {"vocab_tiled", "two passes over vocabulary tiles; V is not a multiple of the tile",
     Spec(301, 96, 5003), 256 * kKiB, Tiling::kVocabTiles},
    {"single_token", "N = 1", Spec(1, 64, 3001)},
    {"all_ignored", "every label ignored: loss 0, zero gradients, row statistics still filled",
     Spec(33, 32, 700, [](ProblemSpec& s) { s.ignore_fraction = 1.0; })},
    {"extreme_logits", "logits of scale 1e3: the max shift must carry the whole lse",
     Spec(40, 64, 2000, [](ProblemSpec& s) { s.logit_scale = 1e3; }), 64 * kMiB, Tiling::kAny,
     /*gradients=*/true, DType::kFloat32, kExtremeLogitGradBound},
    {"large_vocab", "V = 128256 (Llama 3) in one pass, top-20",
     Spec(12, 32, 128256, [](ProblemSpec& s) { s.top_k = 20; })},
    {"large_vocab_tiled", "V = 152064 (Qwen 2) tiled by a 1 MiB budget", Spec(12, 32, 152064),
     1 * kMiB, Tiling::kVocabTiles},
    {"smoothing_ignore", "label smoothing with ignored rows: the mean counts only kept rows",
     Spec(64, 48, 1500, [](ProblemSpec& s) {
       s.options = SmoothingOptions();
       s.ignore_fraction = 0.3;
     })},
    {"zloss_softcap", "z-loss through a soft cap, with logits large enough to saturate it",
     Spec(50, 48, 1200, [](ProblemSpec& s) {
       s.options = ZLossSoftcapOptions();
       s.logit_scale = 40.0;
     })},
    {"temperature", "temperature != 1 scales z and the gradient",
     Spec(50, 48, 1200, [](ProblemSpec& s) { s.options = TemperatureOptions(); })},
    {"weights_none", "per-token weights (negative ones too) with reduction none",
     Spec(45, 48, 900, [](ProblemSpec& s) {
       s.options = With(Reduction::kNone);
       s.token_weights = true;
       s.ignore_fraction = 0.2;
     })},
    {"sum_grad_scale", "reduction sum with an upstream gradient of 0.5",
     Spec(45, 48, 900, [](ProblemSpec& s) { s.options = SumWithGradScale(); })},
    {"bf16_inputs", "bf16 hidden states and head, fp32 outputs", Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
     })},
    {"bf16_inputs_exact", "bf16 hidden states and head with exact gradients: dL/da as hi + lo",
     Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.options.exact_gradients = true;
     })},
    {"fp16_inputs", "fp16 hidden states and head: dL/da rounded to fp16 under a power-of-two scale",
     Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kFloat16;
       s.weight_dtype = DType::kFloat16;
       s.options = SumWithGradScale();
     })},
    {"bf16_head_in_slabs", "a bf16 head converted in three fp32 slabs of 2048 rows at H = 2048",
     Spec(33, 2048, 5000, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
     })},
    {"fp16_hidden_fp32_head", "fp16 hidden states against an fp32 head",
     Spec(70, 64, 2100, [](ProblemSpec& s) { s.hidden_dtype = DType::kFloat16; })},
    // fp32 rows against a 16-bit head: fp32 products, the head widened a slab at a time (4096
    // rows on the GPU), so the products walk three whole slabs and a part.
    {"fp32_hidden_bf16_head_slabs", "fp32 rows, a bf16 head widened in slabs of 4096 rows",
     Spec(70, 64, 13000, [](ProblemSpec& s) { s.weight_dtype = DType::kBFloat16; })},
    {"fp32_hidden_fp16_head_slabs_tiled", "fp32 rows, an fp16 head widened tile by tile",
     Spec(150, 64, 13000, [](ProblemSpec& s) {
       s.weight_dtype = DType::kFloat16;
       s.options = TemperatureOptions();
     }),
     1 * kMiB, Tiling::kVocabTiles},
    {"top_k_max", "the largest top-k the engine offers", Spec(20, 32, 777, [](ProblemSpec& s) {
       s.top_k = kMaxTopK;
     })},
    {"everything_tiled", "bf16, smoothing, soft cap, temperature, z-loss, weights over vocab tiles",
     Spec(150, 64, 3333, EverythingInBf16), 256 * kKiB, Tiling::kVocabTiles},
    {"everything_tiled_exact", "as everything_tiled, with exact gradients",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       EverythingInBf16(s);
       s.options.exact_gradients = true;
     }),
     256 * kKiB, Tiling::kVocabTiles},
    {"slice_of_batch", "a slice of a larger batch: the mean divides by the caller's count",
     Spec(40, 32, 800, [](ProblemSpec& s) { s.options = SliceOfBatch(); })},
    {"scoring_only", "no gradients wanted: one pass even over vocabulary tiles",
     Spec(90, 64, 6000, [](ProblemSpec& s) { s.top_k = 10; }), 256 * kKiB, Tiling::kVocabTiles,
     /*gradients=*/false},
    {"bf16_scoring_tiled", "scoring on a bf16 head: the batch in one chunk over vocabulary tiles",
     Spec(301, 64, 5003, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.top_k = 10;
     }),
     4 * kMiB, Tiling::kVocabTiles, /*gradients=*/false},
    // Windows: 24 MiB holds 768 rows (512 exact) of bf16 dL/da beside two pieces of 256 rows of
    // logits, where chunks holding their logits would get 512 (384 exact); scoring at 16 MiB, all
    // 1500 rows in pieces of 256.
    {"bf16_windows", "a window's rows finished piece by piece; the last window and piece short",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.ignore_fraction = 0.1;
     }), 24 * kMiB, Tiling::kWindows},
    {"bf16_windows_exact", "both halves of dL/da carried for a window's pieces",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.options.exact_gradients = true;
     }), 24 * kMiB, Tiling::kWindows},
    {"bf16_windows_everything", "smoothing, soft cap, temperature, z-loss, weights, piece by piece",
     Spec(1500, 64, 5003, EverythingInBf16), 24 * kMiB, Tiling::kWindows},
    {"scoring_one_window", "scoring: the call one window of logits pieces, top-k",
     Spec(1500, 64, 5003), 16 * kMiB, Tiling::kOneWindow, /*gradients=*/false},
    {"bf16_scoring_one_window", "bf16 scoring in pieces, with the transforms",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.options = EverythingOptions();
     }), 16 * kMiB, Tiling::kOneWindow, /*gradients=*/false},
    {"bf16_windows_ppo_k3_entropy", "every per-row policy input read at its piece's rows",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kSequenceMeanTokenMean);
       s.ratio_targets = kRatioTargets;
       s.max_sequence_length = 150;
       s.ignore_fraction = 0.1;
     }), 24 * kMiB, Tiling::kWindows, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"bf16_grad_hidden", "dL/dh returned in bf16", Spec(64, 64, 1000), 64 * kMiB, Tiling::kAny,
     /*gradients=*/true, DType::kBFloat16},
    // The policy objectives: ratios from kRatioTargets, advantages of both signs and zero.
    {"importance_sampling", "-r A with a token mean over the kept rows",
     Spec(61, 48, 1500, [](ProblemSpec& s) {
       s.options = Policy(Objective::kImportanceSampling, Reduction::kMean);
       s.ratio_targets = kRatioTargets;
       s.ignore_fraction = 0.2;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_clip_both_sides", "ratios just inside and outside both clip bounds, zero advantages",
     Spec(80, 48, 1200, [](ProblemSpec& s) {
       s.options = Policy(Objective::kPpo, Reduction::kSum);
       s.ratio_targets = kRatioTargets;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_dual_clip", "negative advantages with ratios past c = 3 are held at -c A",
     Spec(80, 48, 1200, [](ProblemSpec& s) {
       s.options = PpoDualClip();
       s.ratio_targets = {2.9, 3.2, 5.0, 0.5, 1.5};
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"cispo_sequence_token_sum", "the clipped weight held constant; verl's seq-mean-token-sum",
     Spec(90, 48, 1300, [](ProblemSpec& s) {
       s.options = CispoOptions();
       s.ratio_targets = kRatioTargets;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"dro_sequence_token_sum", "Tinker's DRO: no ratio, the penalty's pull toward q both ways",
     Spec(211, 48, 1700, [](ProblemSpec& s) {
       s.options = DroOptions(Reduction::kSequenceMeanTokenSum);
       s.ratio_targets = {0.05, 0.7, 1.0, 1.3, 20.0};
       s.max_sequence_length = 40;
       s.ignore_fraction = 0.1;
     }), 1 * kMiB, Tiling::kTokenChunks, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"dro_bf16_tiled_kl", "dro on a bf16 head over vocabulary tiles, with a k2 KL penalty",
     Spec(97, 64, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.options = DroOptions(Reduction::kMean);
       s.options.policy.kl_estimator = KlEstimator::kK2;
       s.options.policy.kl_coef = 0.1;
       s.ratio_targets = kRatioTargets;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_ratio_weighted_k3", "DeepSeek-V3.2's unbiased KL: r k3, differentiated through r too",
     Spec(120, 48, 1500, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kMean);
       s.options.policy.kl_ratio_weighted = true;
       s.ratio_targets = kRatioTargets;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"sapo_gates_both_signs", "SAPO's soft gate, its own temperature on each side of A = 0",
     Spec(150, 48, 1500, [](ProblemSpec& s) {
       s.options = SapoOptions(Reduction::kSum);
       s.ratio_targets = {0.3, 0.9, 1.0, 1.2, 4.0};
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"sapo_clamped_sequence_token_mean", "the log-ratio clamp holds r at e^c with no gradient",
     Spec(259, 48, 1700, [](ProblemSpec& s) {
       s.options = SapoOptions(Reduction::kSequenceMeanTokenMean);
       s.options.policy.log_ratio_clamp = 1.0;
       s.ratio_targets = {0.1, 0.5, 1.0, 2.0, 9.0};
       s.max_sequence_length = 60;
     }), 1 * kMiB, Tiling::kTokenChunks, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_k3_entropy_sequence_token_mean",
     "k3 KL and entropy bonus, seq-mean-token-mean, sequences across token chunks",
     Spec(701, 96, 5003, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kSequenceMeanTokenMean);
       s.ratio_targets = kRatioTargets;
       s.max_sequence_length = 150;
       s.ignore_fraction = 0.1;
     }), 8 * kMiB, Tiling::kTokenChunks, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    // GSPO-token: each sequence's ratio from its rows' statistics, then its rows finished, in the
    // chunk's one pass; every chunk ends at a sequence's end.
    {"gspo_sequences_across_chunks", "chunks cut at sequence ends, rows finished in the tile",
     Spec(333, 64, 2100, [](ProblemSpec& s) {
       s.options = GspoOptions(Reduction::kSequenceMeanTokenMean);
       s.ratio_targets = kRatioTargets;
       s.max_sequence_length = 60;
       s.ignore_fraction = 0.1;
     }), 1 * kMiB, Tiling::kTokenChunks, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"gspo_tiled_k3_entropy", "vocabulary tiles: ratios measured before the rows' second pass",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       s.options = GspoOptions(Reduction::kSequenceMeanTokenSum);
       s.options.policy.kl_estimator = KlEstimator::kK3;
       s.options.policy.kl_coef = 0.05;
       s.options.policy.entropy_coef = 0.01;
       s.ratio_targets = kRatioTargets;
       s.max_sequence_length = 12;
       s.ignore_fraction = 0.1;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"gspo_bf16_softcap_clamp", "bf16, z read back after the pass (soft cap), the clamp on log s",
     Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.options = GspoOptions(Reduction::kMean);
       s.options.logit_softcap = 30.0;
       s.options.policy.log_ratio_clamp = 1.0;
       s.ratio_targets = {0.1, 0.79, 1.0, 1.29, 9.0};
       s.max_sequence_length = 30;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"gspo_single_token", "N = 1: one sequence of one row",
     Spec(1, 64, 3001, [](ProblemSpec& s) {
       s.options = GspoOptions(Reduction::kMean);
       s.ratio_targets = {1.29};
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"importance_sampling_k1_tiled", "k1 KL over vocabulary tiles (two passes)",
     Spec(301, 96, 5003, [](ProblemSpec& s) {
       s.options = Policy(Objective::kImportanceSampling, Reduction::kMean);
       s.options.policy.kl_estimator = KlEstimator::kK1;
       s.options.policy.kl_coef = 0.2;
       s.ratio_targets = kRatioTargets;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_k2_entropy_softcap_temperature", "soft cap and temperature chained under every term",
     Spec(70, 48, 1200, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK2, Reduction::kMean);
       s.options.logit_softcap = 20.0;
       s.options.temperature = 0.7;
       s.logit_scale = 25.0;
       s.ratio_targets = kRatioTargets;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_entropy_tiled", "the entropy bonus's per-logit factor over vocabulary tiles",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kSum);
       s.options.logit_softcap = 30.0;
       s.ratio_targets = kRatioTargets;
       s.token_weights = true;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"logprob_gradient_none", "a caller's dL/dlogp backpropagated, with weights, reduction none",
     Spec(64, 48, 1100, [](ProblemSpec& s) {
       s.options.objective = Objective::kLogprobGradient;
       s.options.reduction = Reduction::kNone;
       s.token_weights = true;
       s.ignore_fraction = 0.2;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_single_token", "N = 1",
     Spec(1, 64, 3001, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kMean);
       s.ratio_targets = {1.29};
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_all_ignored", "no kept rows: loss 0, zero gradients, every sequence left out",
     Spec(33, 32, 700, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK1, Reduction::kSequenceMeanTokenMean);
       s.ignore_fraction = 1.0;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_large_vocab", "V = 128256 with the entropy bonus and k3",
     Spec(12, 32, 128256, [](ProblemSpec& s) {
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kMean);
       s.ratio_targets = kRatioTargets;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"ppo_bf16", "bf16 hidden states and head under ppo, k3 and the entropy bonus",
     Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kSequenceMeanTokenSum);
       s.ratio_targets = kRatioTargets;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    {"cross_entropy_kl_entropy", "KL and entropy terms compose with cross-entropy and smoothing",
     Spec(64, 48, 1500, [](ProblemSpec& s) {
       s.options = CrossEntropyWithKlAndEntropy();
       s.ignore_fraction = 0.2;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kPolicyLossBound},
    // Distillation against a teacher head of another hidden size (48 for 64), or a sparse one.
    {"distill_forward_kl", "beta 0: KL(p || q), classic distillation",
     Spec(37, 64, 1000, [](ProblemSpec& s) {
       s.options = Distill(0.0);
       s.teacher_hidden_size = 48;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_reverse_kl", "beta 1: KL(q || p), on-policy distillation",
     Spec(37, 64, 1000, [](ProblemSpec& s) {
       s.options = Distill(1.0);
       s.teacher_hidden_size = 48;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_jsd_alpha_ignored", "JSD at beta 0.5 with a third of cross-entropy, ignored rows",
     Spec(64, 64, 1200, [](ProblemSpec& s) {
       s.options = Distill(0.5, 1.0 / 3);
       s.teacher_hidden_size = 80;
       s.ignore_fraction = 0.2;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_everything", "tau 2, both heads soft-capped and tempered, smoothing, z-loss, weights",
     Spec(50, 48, 1300, [](ProblemSpec& s) {
       s.options = DistillEverything();
       s.logit_scale = 25.0;
       s.teacher_logit_scale = 25.0;
       s.token_weights = true;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_chunk_crossing", "forward KL over several token chunks of two tiles each",
     Spec(701, 96, 5003, [](ProblemSpec& s) {
       s.options = Distill(0.0, 0.5);
       s.teacher_hidden_size = 64;
     }), 16 * kMiB, Tiling::kTokenChunks, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_jsd_vocab_tiled", "JSD over vocabulary tiles: three phases recompute both tiles",
     Spec(301, 96, 5003, [](ProblemSpec& s) {
       s.options = DistillEverything();
       s.teacher_hidden_size = 64;
       s.logit_scale = 10.0;
       s.ignore_fraction = 0.1;
     }), 512 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_reverse_vocab_tiled", "reverse KL over vocabulary tiles, sequence token mean",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       s.options = Distill(1.0, 0.2);
       s.options.reduction = Reduction::kSequenceMeanTokenMean;
       s.max_sequence_length = 40;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_single_token", "N = 1", Spec(1, 64, 3001, [](ProblemSpec& s) {
       s.options = Distill(0.7, 0.1, 1.5);
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_all_ignored", "every label ignored: loss 0, zero gradients",
     Spec(33, 32, 700, [](ProblemSpec& s) {
       s.options = Distill(0.5, 0.5);
       s.ignore_fraction = 1.0;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_extreme_logits", "logits of scale 1e3 on both heads: one-hot distributions",
     Spec(40, 64, 2000, [](ProblemSpec& s) {
       s.options = Distill(0.0, 0.5);
       s.logit_scale = 1e3;
       s.teacher_logit_scale = 1e3;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kExtremeLogitGradBound,
     kExtremeLogitDistillLossBound},
    {"distill_large_vocab", "V = 128256 in one pass, JSD", Spec(12, 32, 128256, [](ProblemSpec& s) {
       s.options = Distill(0.5, 0.5);
       s.teacher_hidden_size = 40;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_large_vocab_tiled", "V = 152064 tiled by a 1 MiB budget, reverse KL",
     Spec(12, 32, 152064, [](ProblemSpec& s) { s.options = Distill(1.0, 0.3, 0.7); }), 1 * kMiB,
     Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_bf16", "bf16 student and teacher, rows and heads, reverse KL",
     Spec(129, 128, 4099, [](ProblemSpec& s) {
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
       s.teacher_hidden_dtype = DType::kBFloat16;
       s.teacher_weight_dtype = DType::kBFloat16;
       s.teacher_hidden_size = 96;
       s.options = Distill(1.0);
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_bf16_teacher_fp32_student",
     "a bf16 teacher head with fp16 rows beside an fp32 student",
     Spec(70, 64, 2100, [](ProblemSpec& s) {
       s.teacher_hidden_dtype = DType::kFloat16;
       s.teacher_weight_dtype = DType::kBFloat16;
       s.options = Distill(0.5);
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_sparse_renormalize", "a sparse top-20 teacher renormalized, forward KL",
     Spec(64, 48, 1500, [](ProblemSpec& s) {
       s.options = Distill(0.0, 0.5);
       s.teacher_top_k = 20;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_sparse_spread_reverse_tiled", "a sparse top-32 teacher spread, reverse KL, tiled",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       s.options = Distill(1.0, 0.0, 1.3);
       s.options.distill.sparse_mass = SparseTeacherMass::kSpread;
       s.teacher_top_k = 32;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_sparse_jsd", "a sparse top-8 teacher under JSD, renormalized (zero p is fine)",
     Spec(64, 48, 1500, [](ProblemSpec& s) {
       s.options = Distill(0.4, 0.2);
       s.teacher_top_k = 8;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_tail_bucket_forward", "top-20 + tail bucket, forward KL, ignored labels",
     Spec(64, 48, 1500, [](ProblemSpec& s) {
       s.options = Distill(0.0, 0.3);
       s.options.distill.sparse_mass = SparseTeacherMass::kTailBucket;
       s.teacher_top_k = 20;
       s.ignore_fraction = 0.1;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_tail_bucket_reverse_tiled",
     "top-32 + tail bucket, reverse KL: the tail's statistics merge across vocabulary tiles",
     Spec(150, 64, 3333, [](ProblemSpec& s) {
       s.options = Distill(1.0);
       s.options.distill.sparse_mass = SparseTeacherMass::kTailBucket;
       s.teacher_top_k = 32;
     }), 256 * kKiB, Tiling::kVocabTiles, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_tail_bucket_extreme_logits",
     "the student's own top-4 given mass 0.8 at logit scale 300: q_tail ~ e^-180 (far below "
     "fp32's range) against p_tail = 0.2",
     Spec(40, 32, 2000, [](ProblemSpec& s) {
       s.options = Distill(0.0);
       s.options.distill.sparse_mass = SparseTeacherMass::kTailBucket;
       s.logit_scale = 300.0;
       s.teacher_is_student = true;
       s.teacher_top_k = 4;
       s.teacher_top_k_mass = 0.8;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kExtremeLogitGradBound,
     kExtremeLogitDistillLossBound},
    {"distill_tail_bucket_jsd_bf16", "top-8 + tail bucket under JSD, a bf16 student",
     Spec(70, 64, 2100, [](ProblemSpec& s) {
       s.options = Distill(0.3, 0.1);
       s.options.distill.sparse_mass = SparseTeacherMass::kTailBucket;
       s.teacher_top_k = 8;
       s.hidden_dtype = DType::kBFloat16;
       s.weight_dtype = DType::kBFloat16;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
    // Windows of a bf16 student (see the cross-entropy windows above), a teacher's tile beside
    // each piece's.
    {"distill_bf16_windows", "a dense bf16 teacher beside each piece, JSD with cross-entropy",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.teacher_hidden_dtype = DType::kBFloat16;
       s.teacher_weight_dtype = DType::kBFloat16;
       s.teacher_hidden_size = 48;
       s.options = DistillEverything();
       s.ignore_fraction = 0.1;
     }), 28 * kMiB, Tiling::kWindows, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_tail_bucket_windows", "a sparse top-16 teacher with its tail, filled per piece",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       InBf16(s);
       s.options = Distill(1.0, 0.2);
       s.options.distill.sparse_mass = SparseTeacherMass::kTailBucket;
       s.teacher_top_k = 16;
     }), 28 * kMiB, Tiling::kWindows, true, DType::kFloat32, kGradBound, kDistillLossBound},
    {"distill_scoring_one_window", "fp32 distillation scoring, the call one window of pieces",
     Spec(1500, 64, 5003, [](ProblemSpec& s) {
       s.options = Distill(0.5);
       s.options.reduction = Reduction::kNone;
       s.teacher_hidden_size = 48;
     }), 48 * kMiB, Tiling::kOneWindow, /*gradients=*/false, DType::kFloat32, kGradBound,
     kDistillLossBound},
    {"distill_scoring_no_labels", "monitoring: reverse KL per token, no labels, no gradients",
     Spec(90, 64, 6000, [](ProblemSpec& s) {
       s.options = Distill(1.0);
       s.options.reduction = Reduction::kNone;
       s.teacher_hidden_size = 48;
       s.no_labels = true;
     }), 512 * kKiB, Tiling::kVocabTiles, /*gradients=*/false, DType::kFloat32, kGradBound,
     kDistillLossBound},
    {"distill_no_labels_training", "no labels: every row counts, KD alone",
     Spec(60, 48, 1100, [](ProblemSpec& s) {
       s.options = Distill(0.0);
       s.no_labels = true;
       s.token_weights = true;
     }), 64 * kMiB, Tiling::kAny, true, DType::kFloat32, kGradBound, kDistillLossBound},
};
// clang-format on

// A window case's plan on the CUDA backend (Tiling::kWindows, kOneWindow).
void ExpectWindows(const EngineCase& c, int64_t token_chunk, int64_t vocab_chunk,
                   int64_t logit_rows) {
  const int64_t n = c.spec.num_tokens;
  ASSERT_GT(logit_rows, 0);
  EXPECT_EQ(vocab_chunk, c.spec.vocab_size);
  EXPECT_LT(logit_rows, token_chunk);
  if (c.tiling == Tiling::kOneWindow) {
    EXPECT_EQ(token_chunk, n);
  } else {
    EXPECT_NE(n % token_chunk, 0);
  }
  const int64_t last_window = n % token_chunk != 0 ? n % token_chunk : token_chunk;
  EXPECT_NE(last_window % logit_rows, 0) << "the last piece is whole";
}

class EngineCaseTest : public ::testing::TestWithParam<std::tuple<std::string, EngineCase>> {};

TEST_P(EngineCaseTest, MatchesFloat64Reference) {
  // Named, not a structured binding: clang before 16 cannot capture bindings in lambdas.
  const std::string& backend_name = std::get<0>(GetParam());
  const EngineCase& c = std::get<1>(GetParam());
  auto made = MakeBackend(backend_name);
  if (!made.ok()) GTEST_SKIP() << backend_name << " backend not available: " << made.status();
  const std::unique_ptr<Backend> backend = std::move(made).value();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << c.name << " (" << c.why << "), LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const Problem problem = MakeProblem(c.spec, rng);
  const ReferenceResult ref = ComputeReference(problem.reference);
  const double loss_bound = TensorCoreProducts(backend_name, c.spec)
                                ? std::max(c.loss_bound, kTensorCoreLossBound)
                                : c.loss_bound;

  RunRequest request;
  request.grad_hidden = c.gradients;
  request.grad_weight = c.gradients;
  request.grad_hidden_dtype = c.grad_hidden_dtype;
  request.budget_bytes = c.budget;
  auto run_or = RunEngine(*backend, problem, request);
  ASSERT_TRUE(run_or.ok()) << run_or.status();
  const EngineRun& run = *run_or;
  const BatchSummary& s = run.summary;
  const int64_t n = c.spec.num_tokens;
  const int k = c.spec.top_k;

  switch (c.tiling) {
    case Tiling::kTokenChunks:
      EXPECT_LT(s.token_chunk, n);
      EXPECT_NE(n % s.token_chunk, 0);
      EXPECT_EQ(s.vocab_chunk, c.spec.vocab_size);
      break;
    case Tiling::kVocabTiles:
      EXPECT_LT(s.vocab_chunk, c.spec.vocab_size);
      EXPECT_NE(c.spec.vocab_size % s.vocab_chunk, 0);
      break;
    case Tiling::kWindows:
    case Tiling::kOneWindow:
      if (backend_name == "cuda") {
        ExpectWindows(c, s.token_chunk, s.vocab_chunk, s.logit_rows);
      } else {
        EXPECT_EQ(s.logit_rows, s.token_chunk);
      }
      break;
    case Tiling::kAny: break;
  }
  EXPECT_LE(static_cast<size_t>(s.workspace_bytes), c.budget);
  EXPECT_TRUE(s.all_finite);
  EXPECT_EQ(s.counted_tokens, ref.counted_tokens);

  if (ref.loss == 0.0) {
    EXPECT_EQ(s.loss, 0.0);
  } else {
    EXPECT_LE(LossError(s.loss, ref), loss_bound) << "loss " << s.loss << " vs " << ref.loss;
  }
  EXPECT_LE(TokenLossError(run.token_loss, ref), loss_bound);

  const double logit_bound = LogitBound(ref.max_abs_logit);
  EXPECT_LE(MaxAbsError(run.logprob, ref.logprob), logit_bound);
  EXPECT_LE(MaxAbsError(run.lse, ref.lse), logit_bound);
  EXPECT_LE(MaxAbsError(run.entropy, ref.entropy), logit_bound);

  // The policy objectives' per-token outputs: r moves relative to itself by logp's error; the
  // KL estimates by it times |dKL/dlogp| (at most e^|delta| for k3, about 5 here); the clip
  // states exactly, since kRatioTargets keep every ratio 1% from a bound.
  EXPECT_LE(RelativeError(run.ratio, ref.ratio), logit_bound);
  EXPECT_LE(MaxAbsError(run.kl, ref.kl), 5 * logit_bound);
  EXPECT_EQ(run.clip, ref.clip);
  EXPECT_EQ(s.clipped_tokens, ref.clipped_tokens);
  EXPECT_NEAR(s.kl_sum, ref.kl_sum, 5 * logit_bound * static_cast<double>(n));

  if (c.spec.options.objective == Objective::kDistill) {
    // KD = tau^2 sum_v p_v (log p_v - log q_v) (or its reverse and JSD forms). Each log-probability
    // at tau carries the logits' error eps = LogitBound(max |z| / tau), which moves each p_v by
    // eps relative to itself: KD's error is about eps (tau^2 + |KD|) (at logits of 1e3, fp32's
    // spacing alone is 2.4e-4 near |z| = 3000, times a KD of thousands).
    const double tau = c.spec.options.distill.temperature;
    double max_abs_teacher = 0.0;
    for (const double z : ref.teacher_logits) {
      if (std::isfinite(z)) max_abs_teacher = std::max(max_abs_teacher, std::abs(z));
    }
    const double eps = LogitBound(std::max(ref.max_abs_logit, max_abs_teacher) / tau);
    double kd_sum_bound = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double bound = 4 * eps * (tau * tau + std::abs(ref.kd[i]));
      EXPECT_NEAR(run.kd[i], ref.kd[i], bound) << "row " << i;
      kd_sum_bound += bound;
    }
    EXPECT_NEAR(s.kd_sum, ref.kd_sum, kd_sum_bound);
    EXPECT_LE(MaxAbsError(run.ce, ref.ce), logit_bound);
    EXPECT_NEAR(s.ce_sum, ref.ce_sum, logit_bound * static_cast<double>(n));
  }

  // argmax and top-k may differ from the reference only between logits closer than the bound;
  // a row is correct exactly where it counts and the argmax the engine reports is its label.
  const int64_t v = c.spec.vocab_size;
  const std::vector<int64_t>& labels = problem.reference.labels;
  int64_t correct_rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(run.argmax[i], 0);
    ASSERT_LT(run.argmax[i], v);
    EXPECT_GE(ref.logits[i * v + run.argmax[i]], ref.logits[i * v + ref.argmax[i]] - logit_bound)
        << "row " << i;
    const bool counted = labels.empty() || labels[i] != c.spec.options.ignore_index;
    EXPECT_EQ(run.correct[i],
              static_cast<int32_t>(counted && !labels.empty() && run.argmax[i] == labels[i]))
        << "row " << i;
    correct_rows += run.correct[i];
    for (int j = 0; j < k; ++j) {
      const int32_t token = run.top_k_token[i * k + j];
      ASSERT_GE(token, 0);
      ASSERT_LT(token, v);
      EXPECT_NEAR(run.top_k_logprob[i * k + j], ref.top_k_logprob[i * k + j], logit_bound);
      EXPECT_NEAR(ref.logits[i * v + token] - ref.lse[i], ref.top_k_logprob[i * k + j],
                  logit_bound);
    }
  }

  EXPECT_EQ(correct_rows, s.correct_tokens);

  // Rows whose policy term and KL penalty nearly cancel have gradients small against their errors.
  const double grad_bound =
      GradientCancellation(ref) * (RoundsGradients(backend_name, c.spec)
                                       ? std::max(c.grad_bound, kRoundedGradBound)
                                       : c.grad_bound);
  const auto expect_gradients = [&](const EngineRun& r) {
    if (!c.gradients) return;
    const double grad_hidden_bound =
        c.grad_hidden_dtype == DType::kFloat32 ? grad_bound : grad_bound + kBf16GradBound;
    EXPECT_LE(RelativeError(r.grad_hidden, ref.grad_hidden), grad_hidden_bound);
    EXPECT_LE(RelativeError(r.grad_weight, ref.grad_weight), grad_bound);
  };
  expect_gradients(run);
  if (c.gradients) {
    // The bound callers use to skip checking dL/dW for overflow must hold; a backend that
    // computes none reports +inf.
    double max_grad_weight = 0.0;
    for (double g : ref.grad_weight) max_grad_weight = std::max(max_grad_weight, std::abs(g));
    EXPECT_GE(s.grad_weight_bound, max_grad_weight * (1.0 - 1e-6));
    if (backend_name == "cpu") {
      EXPECT_TRUE(std::isfinite(s.grad_weight_bound));
    }
  }

  // Asked for the loss alone, the engine skips the entropy and label-smoothing sums (unless the
  // loss needs them) and the top-k; the loss and the gradients must not change beyond the bounds.
  request.loss_only = true;
  auto lean_or = RunEngine(*backend, problem, request);
  ASSERT_TRUE(lean_or.ok()) << lean_or.status();
  const EngineRun& lean = *lean_or;
  EXPECT_TRUE(lean.summary.all_finite);
  EXPECT_LE(TokenLossError(lean.token_loss, ref), loss_bound);
  if (ref.counted_tokens > 0) {
    EXPECT_LE(LossError(lean.summary.loss, ref), loss_bound);
  }
  EXPECT_EQ(lean.summary.correct_tokens, s.correct_tokens);
  expect_gradients(lean);
}

std::string CaseName(const ::testing::TestParamInfo<EngineCaseTest::ParamType>& info) {
  return std::get<0>(info.param) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Cases, EngineCaseTest,
                         ::testing::Combine(::testing::Values("cpu", "cuda"),
                                            ::testing::ValuesIn(kCases)),
                         CaseName);

// The window cases plan windows on the CUDA backend, checked on any machine: the GPU run of the
// table asserts the same of the plan it got.
TEST(EngineCaseTableTest, WindowCasesGetWindowsFromTheCudaPlanner) {
  for (const EngineCase& c : kCases) {
    if (c.tiling != Tiling::kWindows && c.tiling != Tiling::kOneWindow) continue;
    SCOPED_TRACE(c.name);
    ProblemShape shape;
    shape.num_tokens = c.spec.num_tokens;
    shape.hidden_size = c.spec.hidden_size;
    shape.vocab_size = c.spec.vocab_size;
    shape.hidden_dtype = c.spec.hidden_dtype;
    shape.weight_dtype = c.spec.weight_dtype;
    shape.grad_hidden = shape.grad_weight = c.gradients;
    shape.grad_hidden_dtype = c.grad_hidden_dtype;
    shape.top_k = c.spec.top_k;
    shape.exact_gradients = c.spec.options.exact_gradients;
    shape.sequence_ratio = c.spec.options.policy.sequence_ratio;
    if (c.spec.options.objective == Objective::kDistill && c.spec.teacher_top_k > 0) {
      shape.teacher.kind = TeacherKind::kSparse;
      shape.teacher.top_k = c.spec.teacher_top_k;
    } else if (c.spec.options.objective == Objective::kDistill) {
      shape.teacher.kind = TeacherKind::kDense;
      shape.teacher.hidden_size =
          c.spec.teacher_hidden_size > 0 ? c.spec.teacher_hidden_size : c.spec.hidden_size;
      shape.teacher.hidden_dtype = c.spec.teacher_hidden_dtype;
      shape.teacher.weight_dtype = c.spec.teacher_weight_dtype;
    }
    auto plan = cuda::PlanCudaCall(shape, c.budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectWindows(c, plan->token_chunk, plan->vocab_chunk, plan->logit_rows);
  }
}

// dL/dh of the reference's loss by central differences of step 1e-5, in double, rounded to float.
std::vector<float> NumericGradHidden(const ReferenceProblem& problem) {
  constexpr double kStep = 1e-5;
  std::vector<float> numeric(problem.hidden.size());
  ReferenceProblem moved = problem;
  for (size_t j = 0; j < moved.hidden.size(); ++j) {
    const double x = moved.hidden[j];
    moved.hidden[j] = x + kStep;
    const double up = ReferenceLoss(moved);
    moved.hidden[j] = x - kStep;
    const double down = ReferenceLoss(moved);
    moved.hidden[j] = x;
    numeric[j] = static_cast<float>((up - down) / (2 * kStep));
  }
  return numeric;
}

// The engine is measured against the reference, so the reference's own derivatives are checked
// against central differences of its loss, for every objective and term (ppo's branches, dual
// clip, the KL estimators, the entropy bonus, sequence reductions). cispo holds its weight
// constant, so its gradient is not its loss's: it must be logprob_gradient's with
// g_i = -clip(r_i) A_i, which the differences check.
TEST(ReferenceTest, GradientsMatchFiniteDifferences) {
  LossOptions softcapped = PpoKlEntropy(KlEstimator::kK2, Reduction::kMean);
  softcapped.logit_softcap = 4.0;
  softcapped.temperature = 0.8;
  LossOptions custom;
  custom.objective = Objective::kLogprobGradient;
  custom.reduction = Reduction::kSum;
  const LossOptions cases[] = {
      Policy(Objective::kImportanceSampling, Reduction::kMean),
      Policy(Objective::kPpo, Reduction::kSum),
      PpoDualClip(),
      PpoKlEntropy(KlEstimator::kK3, Reduction::kSequenceMeanTokenMean),
      PpoKlEntropy(KlEstimator::kK1, Reduction::kSequenceMeanTokenSum),
      softcapped,
      CrossEntropyWithKlAndEntropy(),
      custom,
  };
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (const LossOptions& options : cases) {
    SCOPED_TRACE(::testing::Message()
                 << ObjectiveName(options.objective) << ", " << ReductionName(options.reduction)
                 << ", KL " << KlEstimatorName(options.policy.kl_estimator));
    ProblemSpec spec = Spec(20, 5, 23);
    spec.options = options;
    spec.ratio_targets = kRatioTargets;
    spec.token_weights = true;
    spec.ignore_fraction = 0.1;
    spec.max_sequence_length = 6;
    const Problem problem = MakeProblem(spec, rng);
    const ReferenceResult ref = ComputeReference(problem.reference);
    const std::vector<float> numeric = NumericGradHidden(problem.reference);
    // float rounding of the differences (2^-24) and the O(step^2) truncation.
    EXPECT_LE(RelativeError(numeric, ref.grad_hidden), 1e-5);
  }

  ProblemSpec spec = Spec(20, 5, 23);
  spec.options = CispoOptions();
  spec.ratio_targets = kRatioTargets;
  spec.ignore_fraction = 0.1;
  const Problem problem = MakeProblem(spec, rng);
  const ReferenceResult cispo = ComputeReference(problem.reference);
  ReferenceProblem linear = problem.reference;
  linear.options = custom;
  linear.options.reduction = spec.options.reduction;
  const double high = 1 + spec.options.policy.clip_high;
  const double low = 1 - spec.options.policy.clip_low;
  for (int64_t i = 0; i < spec.num_tokens; ++i) {
    const double clipped = std::min(std::max(cispo.ratio[i], low), high);
    linear.logprob_grads.push_back(-clipped * linear.advantages[i]);
  }
  const ReferenceResult expected = ComputeReference(linear);
  std::vector<float> cispo_grad(cispo.grad_hidden.begin(), cispo.grad_hidden.end());
  EXPECT_LE(RelativeError(cispo_grad, expected.grad_hidden), 1e-6);  // compared in float
}

// Llama 3 8B's head (H = 4096, V = 128256) and 4096 tokens in bf16, against float64: at 256 MiB,
// where the vocabulary comes in tiles (two passes), at 1 GiB, where the CUDA backend finishes
// windows of rows in pieces, and at the backend's default budget, where
// each token chunk's products run at their full lengths (K = H for the logits, K = V in blocks
// for dL/dh, K = the chunk for dL/dW) and an accumulation that truncates instead of rounding would
// show most; in the default gradient mode (dL/da rounded to bf16 once) and the exact one. The
// exact mode and the forward results keep the small cases' bounds, the default mode's gradients
// kRoundedGradBound. GPU only: its float64 reference takes about a minute on 16 cores and 20 GB,
// and the CPU engine minutes more. The errors are printed and recorded as properties.
class EngineAtScaleTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineAtScaleTest, Llama3HeadInBf16MatchesFloat64) {
  auto made = MakeBackend(GetParam());
  if (!made.ok()) GTEST_SKIP() << GetParam() << " backend not available: " << made.status();
  const std::unique_ptr<Backend> backend = std::move(made).value();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  ProblemSpec spec = Spec(4096, 4096, 128256);
  spec.hidden_dtype = DType::kBFloat16;
  spec.weight_dtype = DType::kBFloat16;
  // Each stage's time goes to stderr as it ends, so that a run cut short says where it was.
  absl::Time stage_start = absl::Now();
  const auto stage_done = [&stage_start](const char* stage) {
    std::fprintf(stderr, "%s: %.1f s\n", stage, absl::ToDoubleSeconds(absl::Now() - stage_start));
    std::fflush(stderr);
    stage_start = absl::Now();
  };
  Problem problem = MakeProblem(spec, rng);
  stage_done("inputs drawn");
  const ReferenceResult ref = ComputeReference(problem.reference);
  stage_done("float64 reference");
  struct Setting {
    size_t budget;
    bool exact;
  };
  const size_t default_budget = backend->DefaultWorkspaceBudget();
  for (const Setting setting :
       {Setting{256 * kMiB, false}, Setting{1024 * kMiB, false}, Setting{1024 * kMiB, true},
        Setting{default_budget, false}, Setting{default_budget, true}}) {
    const char* mode = setting.exact ? "exact" : "default";
    SCOPED_TRACE(::testing::Message()
                 << "budget " << setting.budget / kMiB << " MiB, " << mode << " gradients");
    problem.spec.options.exact_gradients = setting.exact;
    RunRequest request;
    request.budget_bytes = setting.budget;
    auto run = RunEngine(*backend, problem, request);
    ASSERT_TRUE(run.ok()) << run.status();
    stage_done("engine run");

    const double loss_error = LossError(run->summary.loss, ref);
    const double token_loss_error = TokenLossError(run->token_loss, ref);
    const double logprob_error = MaxAbsError(run->logprob, ref.logprob);
    const double grad_hidden_error = RelativeError(run->grad_hidden, ref.grad_hidden);
    const double grad_weight_error = RelativeError(run->grad_weight, ref.grad_weight);
    std::printf(
        "N=%ld H=%ld V=%ld bf16, budget %zu MiB (chunk %ld x %ld, logits of %ld rows), %s "
        "gradients: loss "
        "%.2e, token loss %.2e, logprob max abs %.2e, dL/dh %.2e, dL/dW %.2e relative to "
        "float64; device %.4f s\n",
        static_cast<long>(spec.num_tokens), static_cast<long>(spec.hidden_size),
        static_cast<long>(spec.vocab_size), setting.budget / kMiB,
        static_cast<long>(run->summary.token_chunk), static_cast<long>(run->summary.vocab_chunk),
        static_cast<long>(run->summary.logit_rows), mode, loss_error, token_loss_error,
        logprob_error, grad_hidden_error, grad_weight_error, run->summary.device_seconds);
    const std::string suffix = absl::StrCat("_", setting.budget / kMiB, "mib_", mode);
    RecordProperty("loss_rel_error" + suffix, absl::StrFormat("%.3e", loss_error));
    RecordProperty("grad_hidden_rel_error" + suffix, absl::StrFormat("%.3e", grad_hidden_error));
    RecordProperty("grad_weight_rel_error" + suffix, absl::StrFormat("%.3e", grad_weight_error));
    RecordProperty("device_seconds" + suffix, absl::StrFormat("%.4f", run->summary.device_seconds));
    const double grad_bound = setting.exact ? kGradBound : kRoundedGradBound;
    EXPECT_TRUE(run->summary.all_finite);
    EXPECT_LE(static_cast<size_t>(run->summary.workspace_bytes), setting.budget);
    EXPECT_LE(loss_error, kTensorCoreLossBound);
    EXPECT_LE(token_loss_error, kTensorCoreLossBound);
    EXPECT_LE(logprob_error, LogitBound(ref.max_abs_logit));
    EXPECT_LE(grad_hidden_error, grad_bound);
    EXPECT_LE(grad_weight_error, grad_bound);
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, EngineAtScaleTest, ::testing::Values("cuda"),
                         [](const auto& info) { return info.param; });

// The reference's distillation gradient, taken through the softmax's Jacobian, against central
// differences of its loss: every divergence, tau, soft caps on both heads, smoothing, z-loss, a
// sparse teacher of both kinds, and a call without labels.
TEST(ReferenceTest, DistillGradientsMatchFiniteDifferences) {
  struct Case {
    LossOptions options;
    int top_k;
    bool no_labels;
  };
  LossOptions spread = Distill(1.0, 0.0, 1.4);
  spread.distill.sparse_mass = SparseTeacherMass::kSpread;
  const auto tail_bucket = [](double beta, double alpha) {
    LossOptions o = Distill(beta, alpha);
    o.distill.sparse_mass = SparseTeacherMass::kTailBucket;
    return o;
  };
  const Case cases[] = {
      {Distill(0.0, 0.3), 0, false},     {Distill(1.0, 0.0, 2.0), 0, false},
      {DistillEverything(), 0, false},   {Distill(0.5, 0.0, 0.8), 0, true},
      {Distill(0.0, 0.5), 6, false},     {spread, 6, false},
      {Distill(0.6, 0.2), 4, false},     {tail_bucket(0.0, 0.2), 5, false},
      {tail_bucket(1.0, 0.0), 5, false}, {tail_bucket(0.35, 0.0), 3, true},
  };
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "beta " << c.options.distill.beta << ", alpha "
                                      << c.options.distill.alpha << ", top-k " << c.top_k);
    ProblemSpec spec = Spec(12, 5, 23);
    spec.options = c.options;
    spec.logit_scale = 2.0;
    spec.teacher_hidden_size = 7;
    spec.teacher_top_k = c.top_k;
    spec.no_labels = c.no_labels;
    spec.token_weights = true;
    spec.ignore_fraction = c.no_labels ? 0.0 : 0.1;
    const Problem problem = MakeProblem(spec, rng);
    const ReferenceResult ref = ComputeReference(problem.reference);
    const std::vector<float> numeric = NumericGradHidden(problem.reference);
    EXPECT_LE(RelativeError(numeric, ref.grad_hidden), 1e-5);
  }
}

class EngineBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto made = MakeBackend(GetParam());
    if (!made.ok()) GTEST_SKIP() << GetParam() << " backend not available: " << made.status();
    backend_ = std::move(made).value();
  }
  std::unique_ptr<Backend> backend_;
};

void ExpectBitwiseEqual(const EngineRun& a, const EngineRun& b) {
  // An output the call did not ask for is empty on both sides, and memcmp may not see its null.
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  EXPECT_EQ(a.summary.loss, b.summary.loss);
#define LOSSD_EXPECT_SAME_OUTPUT(type, name) EXPECT_TRUE(same(a.name, b.name)) << #name;
  LOSSD_TOKEN_OUTPUTS(LOSSD_EXPECT_SAME_OUTPUT)
#undef LOSSD_EXPECT_SAME_OUTPUT
  EXPECT_TRUE(same(a.top_k_logprob, b.top_k_logprob));
  EXPECT_TRUE(same(a.top_k_token, b.top_k_token));
  EXPECT_TRUE(same(a.grad_hidden, b.grad_hidden));
  EXPECT_TRUE(same(a.grad_weight, b.grad_weight));
  EXPECT_EQ(a.summary.kl_sum, b.summary.kl_sum);
  EXPECT_EQ(a.summary.kd_sum, b.summary.kd_sum);
}

TEST_P(EngineBackendTest, IdenticalCallsGiveIdenticalBits) {
  std::mt19937_64 rng(FreshSeed());
  // One pass, then vocabulary tiles; cross-entropy with every option, ppo with every term, then
  // JSD distillation with every option.
  for (const Objective objective : {Objective::kCrossEntropy, Objective::kPpo, Objective::kDistill})
    for (size_t budget : {64 * kMiB, objective == Objective::kDistill ? 1 * kMiB : 256 * kKiB}) {
      ProblemSpec spec = Spec(333, 128, 7001);
      switch (objective) {
        case Objective::kPpo:
          spec.options = PpoKlEntropy(KlEstimator::kK3, Reduction::kSequenceMeanTokenMean);
          break;
        case Objective::kDistill:
          spec.options = DistillEverything();
          spec.teacher_hidden_size = 96;
          break;
        default: spec.options = EverythingOptions();
      }
      spec.ratio_targets = kRatioTargets;
      spec.token_weights = true;
      const Problem problem = MakeProblem(spec, rng);
      RunRequest request;
      request.budget_bytes = budget;
      auto first = RunEngine(*backend_, problem, request);
      auto second = RunEngine(*backend_, problem, request);
      ASSERT_TRUE(first.ok()) << first.status();
      ASSERT_TRUE(second.ok()) << second.status();
      ExpectBitwiseEqual(*first, *second);
    }
  // bf16 cross-entropy with every option, training and scoring, in windows on the CUDA backend
  // (each piece's row kernels on a stream of their own beside the next piece's product).
  for (const bool gradients : {true, false}) {
    SCOPED_TRACE(gradients ? "bf16 training" : "bf16 scoring");
    ProblemSpec spec = Spec(1500, 64, 5003);
    spec.hidden_dtype = DType::kBFloat16;
    spec.weight_dtype = DType::kBFloat16;
    spec.options = EverythingOptions();
    spec.token_weights = true;
    spec.top_k = 5;
    const Problem problem = MakeProblem(spec, rng);
    RunRequest request;
    request.grad_hidden = request.grad_weight = gradients;
    request.budget_bytes = 24 * kMiB;
    auto first = RunEngine(*backend_, problem, request);
    auto second = RunEngine(*backend_, problem, request);
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(second.ok()) << second.status();
    if (GetParam() == "cuda") {
      EXPECT_LT(first->summary.logit_rows, first->summary.token_chunk);
    }
    ExpectBitwiseEqual(*first, *second);
  }
}

// Rows read from, and dL/dh written into, the backend's HostBuffers (page-locked on a GPU, copied
// without staging) give the same bits as plain host memory, over several token chunks (so that
// both input and both output slots are reused), in one pass, over vocabulary tiles and, on the
// CUDA backend, in windows (whose rows from plain memory are staged a piece at a time), with dL/dh
// in fp32 and in bf16.
TEST_P(EngineBackendTest, HostBuffersGiveTheSameBitsAsPlainMemory) {
  std::mt19937_64 rng(FreshSeed());
  for (const size_t budget : {8 * kMiB, 512 * kKiB, 24 * kMiB})
    for (const DType grad_hidden_dtype : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "budget " << budget / kKiB << " KiB, dL/dh in "
                                        << DTypeName(grad_hidden_dtype));
      const bool windows = budget == 24 * kMiB;
      ProblemSpec spec = windows ? Spec(1500, 64, 5003) : Spec(701, 96, 5003);
      spec.hidden_dtype = DType::kBFloat16;
      spec.weight_dtype = DType::kBFloat16;
      spec.options = EverythingOptions();
      const Problem problem = MakeProblem(spec, rng);
      RunRequest request;
      request.budget_bytes = budget;
      request.grad_hidden_dtype = grad_hidden_dtype;
      auto plain = RunEngine(*backend_, problem, request);
      request.host_buffers = true;
      auto page_locked = RunEngine(*backend_, problem, request);
      ASSERT_TRUE(plain.ok()) << plain.status();
      ASSERT_TRUE(page_locked.ok()) << page_locked.status();
      EXPECT_LT(plain->summary.token_chunk, spec.num_tokens);
      if (windows && GetParam() == "cuda") {
        EXPECT_LT(plain->summary.logit_rows, plain->summary.token_chunk);
      }
      ExpectBitwiseEqual(*plain, *page_locked);
    }
}

// A teacher that is the student (the same head, rows and logit transform) gives KD = 0 and a zero
// gradient exactly, whatever the divergence and tau, in one pass and over vocabulary tiles: the
// two distributions' statistics and log-probabilities are computed by the same code on the same
// values, and log m_v = log q_v exactly where p_v = q_v (distill_math.h).
TEST_P(EngineBackendTest, DistillFromItselfIsExactlyZero) {
  std::mt19937_64 rng(FreshSeed());
  for (const double beta : {0.0, 1.0, 0.35})
    for (const double tau : {1.0, 2.5})
      for (const size_t budget : {64 * kMiB, 256 * kKiB}) {
        SCOPED_TRACE(::testing::Message()
                     << "beta " << beta << ", tau " << tau << ", budget " << budget);
        ProblemSpec spec = Spec(70, 32, 3001);
        spec.options = Distill(beta, 0.0, tau);
        spec.options.logit_softcap = 20.0;
        spec.options.temperature = 0.9;
        spec.options.distill.teacher_logit_softcap = 20.0;
        spec.options.distill.teacher_temperature = 0.9;
        spec.logit_scale = 15.0;
        spec.teacher_is_student = true;
        spec.ignore_fraction = 0.1;
        const Problem problem = MakeProblem(spec, rng);
        RunRequest request;
        request.budget_bytes = budget;
        auto run = RunEngine(*backend_, problem, request);
        ASSERT_TRUE(run.ok()) << run.status();
        EXPECT_TRUE(run->summary.all_finite);
        EXPECT_EQ(run->summary.loss, 0.0);
        EXPECT_EQ(run->summary.kd_sum, 0.0);
        for (int64_t i = 0; i < spec.num_tokens; ++i) EXPECT_EQ(run->kd[i], 0.0f) << "row " << i;
        const auto all_zero = [](const std::vector<float>& values) {
          return std::all_of(values.begin(), values.end(), [](float x) { return x == 0.0f; });
        };
        EXPECT_TRUE(all_zero(run->grad_hidden));
        EXPECT_TRUE(all_zero(run->grad_weight));
      }
}

// The summary's correct_tokens (the token accuracy that fused cross-entropy users read) counts the
// counted rows whose argmax is their label. Random logits almost never make a label the argmax, so
// half the rows get their float64 argmax as the label where it leads the runner-up by more than
// twice the logits' error, the other kept rows their row's smallest logit, and every fifth row is
// ignored: the count and each row's `correct` output are then known exactly on any backend.
TEST_P(EngineBackendTest, CorrectTokensCountTheRowsWhoseArgmaxIsTheLabel) {
  std::mt19937_64 rng(FreshSeed());
  Problem problem = MakeProblem(Spec(90, 48, 700), rng);
  const ReferenceResult first = ComputeReference(problem.reference);
  const int64_t n = problem.spec.num_tokens;
  const int64_t v = problem.spec.vocab_size;
  const double bound = LogitBound(first.max_abs_logit);
  std::vector<int64_t>& labels = problem.reference.labels;
  int64_t expected = 0;
  std::vector<int32_t> expected_correct(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    const double* z = &first.logits[i * v];
    const int64_t best = first.argmax[i];
    double runner_up = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < v; ++t) {
      if (t != best) runner_up = std::max(runner_up, z[t]);
    }
    if (i % 5 == 4) {
      labels[i] = problem.spec.options.ignore_index;
    } else if (i % 2 == 0 && z[best] - runner_up > 2 * bound) {
      labels[i] = best;
      ++expected;
      expected_correct[i] = 1;
    } else {
      labels[i] = std::min_element(z, z + v) - z;
    }
  }
  ASSERT_GT(expected, n / 5);
  auto run = RunEngine(*backend_, problem, RunRequest{});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->summary.counted_tokens, n - n / 5);
  EXPECT_EQ(run->summary.correct_tokens, expected);
  EXPECT_EQ(run->correct, expected_correct);
  RunRequest lean;
  lean.loss_only = true;  // no argmax output asked for: the count must not depend on it
  auto lean_run = RunEngine(*backend_, problem, lean);
  ASSERT_TRUE(lean_run.ok()) << lean_run.status();
  EXPECT_EQ(lean_run->summary.correct_tokens, expected);
}

// Exact ties, which random normal logits never produce: argmax is the lowest of the tied ids and
// top-k ranks equal values by the lower token, within a tile and across tiles, exactly as the
// reference's stable sort does.
TEST_P(EngineBackendTest, ExactTiesRankTheLowerTokenFirst) {
  std::mt19937_64 rng(FreshSeed());
  for (size_t budget : {64 * kMiB, 256 * kKiB}) {  // one pass, then vocabulary tiles
    SCOPED_TRACE(budget);
    ProblemSpec spec = Spec(64, 16, 7001);
    spec.integer_values = true;
    spec.top_k = kMaxTopK;
    const Problem problem = MakeProblem(spec, rng);
    RunRequest request;
    request.budget_bytes = budget;
    request.grad_hidden = false;
    request.grad_weight = false;
    auto run = RunEngine(*backend_, problem, request);
    ASSERT_TRUE(run.ok()) << run.status();
    const ReferenceResult ref = ComputeReference(problem.reference);
    const int k = spec.top_k;
    for (int64_t i = 0; i < spec.num_tokens; ++i) {
      EXPECT_EQ(run->argmax[i], ref.argmax[i]) << "row " << i;
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(run->top_k_token[i * k + j], ref.top_k_token[i * k + j])
            << "row " << i << ", rank " << j;
      }
    }
  }
}

TEST_P(EngineBackendTest, GradWeightAccumulatesAcrossCalls) {
  std::mt19937_64 rng(FreshSeed());
  const Problem problem = MakeProblem(Spec(50, 32, 600), rng);
  const ReferenceResult ref = ComputeReference(problem.reference);
  auto weight = backend_->Allocate(problem.weight_bytes.size());
  auto grad = backend_->Allocate(600 * 32 * sizeof(float));
  ASSERT_TRUE(weight.ok() && grad.ok());
  ASSERT_TRUE(
      backend_->CopyToDevice(problem.weight_bytes.data(), problem.weight_bytes.size(), *weight, 0)
          .ok());
  ASSERT_TRUE(backend_->Zero(*grad).ok());
  auto workspace = backend_->Allocate(8 * kMiB);
  ASSERT_TRUE(workspace.ok());
  BatchInputs in;
  in.hidden = problem.hidden_bytes.data();
  in.num_tokens = 50;
  in.hidden_size = 32;
  in.labels = problem.reference.labels.data();
  const WeightView view{&*weight, DType::kFloat32, 600, 32};
  for (int call = 0; call < 3; ++call) {
    auto summary =
        backend_->Compute(in, view, problem.spec.options, TokenOutputs{}, &*grad, *workspace);
    ASSERT_TRUE(summary.ok()) << summary.status();
  }
  std::vector<float> accumulated(600 * 32);
  ASSERT_TRUE(
      backend_->CopyToHost(*grad, 0, accumulated.size() * sizeof(float), accumulated.data()).ok());
  std::vector<double> expected = ref.grad_weight;
  for (double& x : expected) x *= 3;
  EXPECT_LE(RelativeError(accumulated, expected), kGradBound);
}

// overwrite_grad_weight stores the call's dL/dW over whatever the buffer held (NaN here), with the
// whole vocabulary in one tile and with several token chunks and vocabulary tiles, where only the
// first chunk may store; the next call without it adds.
TEST_P(EngineBackendTest, OverwriteStoresTheCallsGradWeight) {
  std::mt19937_64 rng(FreshSeed());
  const int64_t n = 301, h = 96, v = 5003;
  const Problem problem = MakeProblem(Spec(n, h, v), rng);
  const ReferenceResult ref = ComputeReference(problem.reference);
  auto weight = backend_->Allocate(problem.weight_bytes.size());
  auto grad = backend_->Allocate(v * h * sizeof(float));
  ASSERT_TRUE(weight.ok() && grad.ok());
  ASSERT_TRUE(
      backend_->CopyToDevice(problem.weight_bytes.data(), problem.weight_bytes.size(), *weight, 0)
          .ok());
  const WeightView view{&*weight, DType::kFloat32, v, h};
  BatchInputs in;
  in.hidden = problem.hidden_bytes.data();
  in.num_tokens = n;
  in.hidden_size = h;
  in.labels = problem.reference.labels.data();
  for (const size_t budget : {8 * kMiB, 256 * kKiB}) {
    SCOPED_TRACE(::testing::Message() << "budget " << budget);
    auto workspace = backend_->Allocate(budget);
    ASSERT_TRUE(workspace.ok());
    const std::vector<float> poison(v * h, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(
        backend_->CopyToDevice(poison.data(), poison.size() * sizeof(float), *grad, 0).ok());
    LossOptions options = problem.spec.options;
    options.overwrite_grad_weight = true;
    auto stored = backend_->Compute(in, view, options, TokenOutputs{}, &*grad, *workspace);
    ASSERT_TRUE(stored.ok()) << stored.status();
    if (budget < kMiB) {
      EXPECT_LT(stored->token_chunk, n) << "the small budget must split the tokens";
      EXPECT_LT(stored->vocab_chunk, v) << "the small budget must tile the vocabulary";
    }
    std::vector<float> values(v * h);
    ASSERT_TRUE(backend_->CopyToHost(*grad, 0, values.size() * sizeof(float), values.data()).ok());
    EXPECT_LE(RelativeError(values, ref.grad_weight), kGradBound);

    options.overwrite_grad_weight = false;
    ASSERT_TRUE(backend_->Compute(in, view, options, TokenOutputs{}, &*grad, *workspace).ok());
    ASSERT_TRUE(backend_->CopyToHost(*grad, 0, values.size() * sizeof(float), values.data()).ok());
    std::vector<double> twice = ref.grad_weight;
    for (double& x : twice) x *= 2;
    EXPECT_LE(RelativeError(values, twice), kGradBound);
  }
}

// The buffer arithmetic and optimizer updates that the server runs beside Compute (committing a
// call's dL/dW, clipping by the global norm, steps), against float64 with torch's formulas; on a
// count that fills no block size evenly.
TEST_P(EngineBackendTest, BufferArithmeticAndOptimizerStepsMatchFloat64) {
  constexpr int64_t kCount = 1'000'003;
  std::mt19937_64 rng(FreshSeed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](float scale) {
    std::vector<float> x(kCount);
    for (float& e : x) e = scale * normal(rng);
    return x;
  };
  auto upload = [&](const std::vector<float>& host) {
    auto buffer = backend_->Allocate(kCount * sizeof(float));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(backend_->CopyToDevice(host.data(), kCount * sizeof(float), *buffer, 0).ok());
    return std::move(buffer).value();
  };
  auto download = [&](const DeviceBuffer& buffer) {
    std::vector<float> host(kCount);
    EXPECT_TRUE(backend_->CopyToHost(buffer, 0, kCount * sizeof(float), host.data()).ok());
    return host;
  };

  const std::vector<float> x = random(1.0f), y = random(3.0f);
  DeviceBuffer sum = upload(x);
  const DeviceBuffer addend = upload(y);
  ASSERT_TRUE(backend_->AddFloat32(sum, addend, kCount).ok());
  const std::vector<float> added = download(sum);
  double sum_squares = 0.0;
  for (int64_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(added[i], x[i] + y[i]) << i;  // one fp32 addition, rounded alike everywhere
    sum_squares += static_cast<double>(added[i]) * added[i];
  }
  auto squares = backend_->SumSquaresFloat32(sum, kCount);
  ASSERT_TRUE(squares.ok()) << squares.status();
  EXPECT_NEAR(*squares, sum_squares, 1e-12 * sum_squares);

  for (const auto kind : {OptimizerConfig::Kind::kSgd, OptimizerConfig::Kind::kAdamW}) {
    SCOPED_TRACE(kind == OptimizerConfig::Kind::kSgd ? "SGD" : "AdamW");
    OptimizerConfig config;
    config.kind = kind;
    config.learning_rate = 1e-2;
    config.momentum = 0.9;
    config.weight_decay = 0.1;
    config.grad_multiplier = 0.5;
    const std::vector<float> w0 = random(1.0f);
    DeviceBuffer weight = upload(w0);
    DeviceBuffer state1 = upload(std::vector<float>(kCount, 0.0f));
    DeviceBuffer state2 = upload(std::vector<float>(kCount, 0.0f));
    std::vector<double> w(w0.begin(), w0.end()), m(kCount, 0.0), v(kCount, 0.0);
    for (int64_t step = 1; step <= 2; ++step) {
      config.step = step;
      const std::vector<float> g = random(1e-2f);
      const DeviceBuffer grad = upload(g);
      OptimizerTensors tensors{&weight,
                               DType::kFloat32,
                               &grad,
                               &state1,
                               kind == OptimizerConfig::Kind::kAdamW ? &state2 : nullptr,
                               kCount};
      const absl::StatusOr<OptimizerStepResult> applied = backend_->OptimizerStep(config, tensors);
      ASSERT_TRUE(applied.ok()) << applied.status();
      ASSERT_TRUE(applied->applied());
      const double lr = config.learning_rate, wd = config.weight_decay;
      for (int64_t i = 0; i < kCount; ++i) {
        const double gi = config.grad_multiplier * g[i];
        if (kind == OptimizerConfig::Kind::kSgd) {  // g += wd w; b = momentum b + g; w -= lr b
          m[i] = config.momentum * m[i] + gi + wd * w[i];
          w[i] -= lr * m[i];
        } else {  // torch.optim.AdamW
          w[i] *= 1 - lr * wd;
          m[i] = config.beta1 * m[i] + (1 - config.beta1) * gi;
          v[i] = config.beta2 * v[i] + (1 - config.beta2) * gi * gi;
          const double bias1 = 1 - std::pow(config.beta1, step);
          const double bias2 = 1 - std::pow(config.beta2, step);
          w[i] -= lr / bias1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bias2) + config.epsilon);
        }
      }
    }
    // fp32 updates are within 6e-8 of float64's after two steps.
    EXPECT_LE(RelativeError(download(weight), w), 1e-6);
    EXPECT_LE(RelativeError(download(state1), m), 1e-6);
    if (kind == OptimizerConfig::Kind::kAdamW) {
      EXPECT_LE(RelativeError(download(state2), v), 1e-6);
    }
  }
}

// An update whose result would not be finite writes nothing, and names the first element at
// fault and the buffer it was to go to: the weight as stored (3.4e38 fits fp32, not bf16; 1e5 not
// fp16), AdamW's second moment ((1 - beta2) g g past fp32 for a gradient entry of 1e22, W finite).
TEST_P(EngineBackendTest, AnOptimizerStepThatWouldNotBeFiniteWritesNothing) {
  constexpr int64_t kCount = 70'001;  // more elements than the check's blocks, in uneven ranges
  std::mt19937_64 rng(FreshSeed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case {
    const char* name;
    OptimizerConfig::Kind kind;
    DType dtype;
    double learning_rate;
    double momentum;
    float big_grad;  // at the faulty elements
    OptimizerStepResult::NonFinite expected;
  };
  const Case cases[] = {
      {"sgd_lr_1e38_fp32", OptimizerConfig::Kind::kSgd, DType::kFloat32, 1e38, 0.0, 1e3f,
       OptimizerStepResult::NonFinite::kWeight},
      {"sgd_bf16_overflows_as_stored", OptimizerConfig::Kind::kSgd, DType::kBFloat16, 1.0, 0.0,
       -3.4e38f, OptimizerStepResult::NonFinite::kWeight},
      {"sgd_fp16_overflows_as_stored", OptimizerConfig::Kind::kSgd, DType::kFloat16, 1.0, 0.0,
       -1e5f, OptimizerStepResult::NonFinite::kWeight},
      {"adamw_second_moment_overflows", OptimizerConfig::Kind::kAdamW, DType::kFloat32, 1e-3, 0.0,
       1e22f, OptimizerStepResult::NonFinite::kState2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> w(kCount), g(kCount), s1(kCount), s2(kCount);
    for (int64_t i = 0; i < kCount; ++i) {
      w[i] = normal(rng);
      g[i] = 1e-3f * normal(rng);
      s1[i] = c.kind == OptimizerConfig::Kind::kAdamW ? 1e-4f * normal(rng) : normal(rng);
      s2[i] = 1e-6f * std::fabs(normal(rng));
    }
    // Two faulty elements: the first one in the order is named.
    const int64_t first = std::uniform_int_distribution<int64_t>(0, kCount / 2)(rng);
    const int64_t later = std::uniform_int_distribution<int64_t>(first + 1, kCount - 1)(rng);
    g[first] = g[later] = c.big_grad;
    std::vector<uint8_t> stored(kCount * DTypeSize(c.dtype));
    for (int64_t i = 0; i < kCount; ++i) StoreFromFloat(stored.data(), c.dtype, i, w[i]);
    auto upload = [&](const void* host, size_t bytes) {
      auto buffer = backend_->Allocate(bytes);
      EXPECT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_TRUE(backend_->CopyToDevice(host, bytes, *buffer, 0).ok());
      return std::move(buffer).value();
    };
    DeviceBuffer weight = upload(stored.data(), stored.size());
    const DeviceBuffer grad = upload(g.data(), kCount * sizeof(float));
    DeviceBuffer state1 = upload(s1.data(), kCount * sizeof(float));
    DeviceBuffer state2 = upload(s2.data(), kCount * sizeof(float));
    const bool adamw = c.kind == OptimizerConfig::Kind::kAdamW;
    OptimizerConfig config;
    config.kind = c.kind;
    config.learning_rate = c.learning_rate;
    config.momentum = c.momentum;
    const bool has_state1 = adamw || c.momentum != 0.0;
    OptimizerTensors tensors{
        &weight, c.dtype, &grad, has_state1 ? &state1 : nullptr, adamw ? &state2 : nullptr, kCount};
    const absl::StatusOr<OptimizerStepResult> result = backend_->OptimizerStep(config, tensors);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(result->applied());
    EXPECT_EQ(result->non_finite, c.expected);
    EXPECT_EQ(result->element, first);
    std::vector<uint8_t> weight_after(stored.size());
    std::vector<float> state1_after(kCount), state2_after(kCount);
    ASSERT_TRUE(backend_->CopyToHost(weight, 0, stored.size(), weight_after.data()).ok());
    ASSERT_TRUE(backend_->CopyToHost(state1, 0, kCount * sizeof(float), state1_after.data()).ok());
    ASSERT_TRUE(backend_->CopyToHost(state2, 0, kCount * sizeof(float), state2_after.data()).ok());
    EXPECT_EQ(weight_after, stored) << "W was written";
    EXPECT_EQ(std::memcmp(state1_after.data(), s1.data(), kCount * sizeof(float)), 0)
        << "state1 was written";
    EXPECT_EQ(std::memcmp(state2_after.data(), s2.data(), kCount * sizeof(float)), 0)
        << "state2 was written";

    // Without the faulty elements the same step applies.
    g[first] = g[later] = 0.0f;
    const DeviceBuffer tame = upload(g.data(), kCount * sizeof(float));
    tensors.grad = &tame;
    config.learning_rate = std::min(c.learning_rate, 1e-3);
    const absl::StatusOr<OptimizerStepResult> applied = backend_->OptimizerStep(config, tensors);
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_TRUE(applied->applied());
    EXPECT_EQ(applied->element, -1);
  }
}

TEST_P(EngineBackendTest, RejectsBadCallsNamingTheField) {
  std::mt19937_64 rng(FreshSeed());
  Problem problem = MakeProblem(Spec(4, 8, 50), rng);
  problem.reference.labels[3] = 50;  // one past the vocabulary
  auto status = RunEngine(*backend_, problem, RunRequest{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("labels[3]"), std::string::npos) << status;

  problem = MakeProblem(Spec(4, 8, 50), rng);
  problem.spec.options.temperature = 0.0;
  status = RunEngine(*backend_, problem, RunRequest{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("temperature"), std::string::npos) << status;

  // An objective without the inputs it reads, and a sequence reduction without sequences.
  problem = MakeProblem(Spec(4, 8, 50), rng);
  problem.spec.options.objective = Objective::kPpo;
  status = RunEngine(*backend_, problem, RunRequest{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("sampling_logprobs"), std::string::npos) << status;

  problem = MakeProblem(Spec(4, 8, 50), rng);
  problem.spec.options.reduction = Reduction::kSequenceMeanTokenSum;
  status = RunEngine(*backend_, problem, RunRequest{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("sequence_lengths"), std::string::npos) << status;

  problem = MakeProblem(Spec(4, 8, 50), rng);
  problem.spec.top_k = kMaxTopK + 1;
  status = RunEngine(*backend_, problem, RunRequest{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("top_k"), std::string::npos) << status;
}

// A sequence ratio needs every row of a sequence in one chunk, its sequences, and ppo.
TEST_P(EngineBackendTest, RefusesSequenceRatiosItCannotComputeNamingTheField) {
  std::mt19937_64 rng(FreshSeed());
  const ProblemSpec gspo = Spec(300, 16, 2000, [](ProblemSpec& s) {
    s.options = GspoOptions(Reduction::kSum);
    s.max_sequence_length = 20;
  });
  const auto refusal = [&](auto change, size_t budget_bytes = 64 * kMiB) {
    Problem problem = MakeProblem(gspo, rng);
    change(problem);
    RunRequest request;
    request.budget_bytes = budget_bytes;
    return RunEngine(*backend_, problem, request).status();
  };
  // 256 KiB holds far fewer than 300 rows of 2000 fp32 logits.
  absl::Status status =
      refusal([](Problem& p) { p.reference.sequence_lengths = {300}; }, 256 * kKiB);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("ratio_sequence_lengths[0]"), std::string::npos) << status;
  EXPECT_NE(status.message().find("token chunk"), std::string::npos) << status;

  status = refusal([](Problem& p) { p.reference.sequence_lengths = {100, 100}; });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("ratio_sequence_lengths: expected lengths summing to 300"),
            std::string::npos)
      << status;

  status = refusal([](Problem& p) { p.reference.sequence_lengths.clear(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("ratio_sequence_lengths"), std::string::npos) << status;

  status = refusal([](Problem& p) { p.spec.options.objective = Objective::kCispo; });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("policy.sequence_ratio"), std::string::npos) << status;

  status = refusal([](Problem& p) {
    p.spec.options.policy.kl_estimator = KlEstimator::kK3;
    p.spec.options.policy.kl_ratio_weighted = true;
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("policy.kl_ratio_weighted"), std::string::npos) << status;
}

TEST_P(EngineBackendTest, NonFiniteHiddenStatesAreReported) {
  std::mt19937_64 rng(FreshSeed());
  Problem problem = MakeProblem(Spec(8, 16, 300), rng);
  float* hidden = reinterpret_cast<float*>(problem.hidden_bytes.data());
  hidden[5 * 16 + 3] = std::numeric_limits<float>::quiet_NaN();
  auto run = RunEngine(*backend_, problem, RunRequest{});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->summary.all_finite);
  hidden[5 * 16 + 3] = std::numeric_limits<float>::infinity();
  run = RunEngine(*backend_, problem, RunRequest{});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->summary.all_finite);
}

// A logit that overflows to -inf from finite inputs is as untrustworthy as a NaN, although its
// probability would come out as 0: it is reported whichever outputs the call asks for, also when
// none of them needs the sum of the logits that would carry the -inf.
TEST_P(EngineBackendTest, OverflowedLogitsAreReportedWhateverTheOutputs) {
  std::mt19937_64 rng(FreshSeed());
  Problem problem = MakeProblem(Spec(8, 16, 300), rng);
  float* hidden = reinterpret_cast<float*>(problem.hidden_bytes.data());
  float* weight = reinterpret_cast<float*>(problem.weight_bytes.data());
  hidden[5 * 16 + 3] = 1e30f;
  weight[123 * 16 + 3] = -1e10f;  // z[5, 123] = -inf; every other logit stays finite
  for (const bool loss_only : {false, true}) {
    RunRequest request;
    request.loss_only = loss_only;
    auto run = RunEngine(*backend_, problem, request);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_FALSE(run->summary.all_finite) << "loss_only " << loss_only;
  }
}

TEST_P(EngineBackendTest, PlansStayWithinTheBudget) {
  // Without a teacher, with a bf16 teacher head of another H (two logits tiles per chunk), and
  // with a sparse teacher.
  for (const TeacherKind teacher : {TeacherKind::kNone, TeacherKind::kDense, TeacherKind::kSparse})
    for (int64_t v : {1000, 32000, 128256, 256000}) {
      for (size_t budget : {64 * kKiB, 1 * kMiB, 16 * kMiB, 256 * kMiB}) {
        ProblemShape shape;
        shape.teacher.kind = teacher;
        shape.teacher.hidden_size = 4096;
        shape.teacher.hidden_dtype = DType::kBFloat16;
        shape.teacher.weight_dtype = DType::kBFloat16;
        shape.teacher.top_k = teacher == TeacherKind::kSparse ? 64 : 0;
        shape.num_tokens = 16384;
        shape.hidden_size = 2048;
        shape.vocab_size = v;
        shape.hidden_dtype = DType::kBFloat16;
        shape.weight_dtype = DType::kBFloat16;
        shape.grad_hidden = true;
        shape.grad_weight = true;
        shape.grad_hidden_dtype = DType::kBFloat16;
        shape.top_k = 20;
        auto plan = backend_->Plan(shape, budget);
        if (!plan.ok()) {
          EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
          continue;
        }
        EXPECT_LE(plan->workspace_bytes, budget) << "V=" << v << " budget=" << budget;
        EXPECT_GE(plan->token_chunk, 1);
        EXPECT_GE(plan->vocab_chunk, 1);
        EXPECT_LE(plan->vocab_chunk, v);
      }
    }
  ProblemShape tiny;
  tiny.num_tokens = 10;
  tiny.hidden_size = 4096;
  tiny.vocab_size = 128256;
  auto refused = backend_->Plan(tiny, 1000);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("workspace budget"), std::string::npos);
}

// ChooseChunkPlan on a backend-free workspace model of rows * cols * 4 bytes, V = 1000 columns,
// with a budget of `rows_that_fit` full-vocabulary rows.
constexpr int64_t kModelVocab = 1000;

absl::StatusOr<ChunkPlan> PlanOnModel(ProblemShape shape, int64_t rows_that_fit,
                                      int64_t forward_token_chunk) {
  const TileLimits limits = {
      /*max_token_chunk=*/4096,     /*min_single_pass_rows=*/16,
      /*two_pass_token_chunk=*/256, /*min_vocab_chunk=*/256,
      /*vocab_chunk_multiple=*/256, /*token_chunk_multiple=*/64,
      forward_token_chunk};
  shape.hidden_size = 8;
  shape.vocab_size = kModelVocab;
  return ChooseChunkPlan(shape, rows_that_fit * kModelVocab * 4, limits,
                         [](int64_t rows, int64_t cols) { return size_t(rows * cols * 4); });
}

struct TokenChunkCase {
  const char* name;
  int64_t num_tokens;
  int64_t rows_that_fit;
  int64_t expected_chunk;
};

class TokenChunkTest : public ::testing::TestWithParam<TokenChunkCase> {};

TEST_P(TokenChunkTest, AlignsAndBalancesChunksThatSplitTheBatch) {
  const TokenChunkCase& c = GetParam();
  ProblemShape shape;
  shape.num_tokens = c.num_tokens;
  const auto plan = PlanOnModel(shape, c.rows_that_fit, /*forward_token_chunk=*/0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->token_chunk, c.expected_chunk);
  EXPECT_EQ(plan->vocab_chunk, kModelVocab);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, TokenChunkTest,
    ::testing::Values(
        // 523 rows fit: eight aligned chunks of 512 cover 4096 exactly.
        TokenChunkCase{"rounds_down_to_the_multiple", 4096, 523, 512},
        // 1100 rows need three chunks of at most 512; 384 + 384 + 332 beats 512 + 512 + 76.
        TokenChunkCase{"evens_out_the_chunks", 1100, 523, 384},
        // The whole batch fits: one chunk of exactly N, whatever N is.
        TokenChunkCase{"whole_batch_unaligned", 300, 523, 300},
        // Fewer rows fit than one multiple: alignment would leave nothing, so take what fits.
        TokenChunkCase{"below_one_multiple", 4096, 40, 40},
        // Already aligned and even: unchanged.
        TokenChunkCase{"already_aligned", 2048, 1024, 1024}),
    [](const auto& info) { return std::string(info.param.name); });

// Calls without gradients, planned on the same model for a backend that pays for W once per token
// chunk (forward_token_chunk = 1024).
struct ChunkEndsCase {
  const char* name;
  int64_t num_tokens;
  int64_t chunk_rows;
  std::vector<int64_t> sequence_lengths;
  std::vector<int64_t> expected_ends;
};

class TokenChunkEndsTest : public ::testing::TestWithParam<ChunkEndsCase> {};

TEST_P(TokenChunkEndsTest, CutsChunksWhereItShould) {
  const ChunkEndsCase& c = GetParam();
  EXPECT_EQ(TokenChunkEnds(c.num_tokens, c.chunk_rows, c.sequence_lengths.data(),
                           static_cast<int64_t>(c.sequence_lengths.size())),
            c.expected_ends);
}

INSTANTIATE_TEST_SUITE_P(
    Ends, TokenChunkEndsTest,
    ::testing::Values(
        // Without sequences: every chunk_rows rows, the last chunk the rest.
        ChunkEndsCase{"fixed", 10, 4, {}, {4, 8, 10}},
        // An empty batch has no chunks.
        ChunkEndsCase{"empty", 0, 4, {}, {}},
        // As many whole sequences as fit: 3 + 1, then 2 + 2, then 4.
        ChunkEndsCase{"whole_sequences", 12, 4, {3, 1, 2, 2, 4}, {4, 8, 12}},
        // A sequence that would cross the chunk's end starts the next chunk.
        ChunkEndsCase{"no_sequence_split", 10, 4, {3, 2, 3, 2}, {3, 5, 8, 10}},
        // A sequence longer than a chunk is a chunk of its own (the engine refuses it later).
        ChunkEndsCase{"oversized_alone", 9, 4, {1, 6, 2}, {1, 7, 9}},
        // One sequence, the whole batch.
        ChunkEndsCase{"one_sequence", 4, 4, {4}, {4}}),
    [](const auto& info) { return std::string(info.param.name); });

struct ForwardPlanCase {
  const char* name;
  bool gradients;
  int64_t num_tokens;
  int64_t rows_that_fit;  // full-vocabulary rows within the budget
  int64_t expected_chunk;
  int64_t expected_tile;
};

class ForwardPlanTest : public ::testing::TestWithParam<ForwardPlanCase> {};

TEST_P(ForwardPlanTest, TilesTheVocabularyForLongerChunks) {
  const ForwardPlanCase& c = GetParam();
  ProblemShape shape;
  shape.num_tokens = c.num_tokens;
  shape.grad_hidden = c.gradients;
  const auto plan = PlanOnModel(shape, c.rows_that_fit, /*forward_token_chunk=*/1024);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->token_chunk, c.expected_chunk);
  EXPECT_EQ(plan->vocab_chunk, c.expected_tile);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, ForwardPlanTest,
    ::testing::Values(
        // 1024 rows in the budget of 300 full ones: tiles of 292 columns, rounded to 256.
        ForwardPlanCase{"scoring", false, 4096, 300, 1024, 256},
        // Fewer rows than the target: the whole batch in one chunk, 1.2 MB / 2800 B -> 256 columns.
        ForwardPlanCase{"scoring_short_batch", false, 700, 300, 700, 256},
        // The whole batch fits in one full-vocabulary chunk: nothing to gain from tiles.
        ForwardPlanCase{"scoring_batch_fits", false, 200, 300, 200, 1000},
        // 1024 rows would leave tiles of 97 columns, under min_vocab_chunk: full-vocabulary chunks.
        ForwardPlanCase{"scoring_tile_too_narrow", false, 4096, 100, 64, 1000},
        // Tiles would make a training call compute its logits twice.
        ForwardPlanCase{"training", true, 4096, 300, 256, 1000}),
    [](const auto& info) { return std::string(info.param.name); });

// The CPU backend at the default budget and a Llama 3 head [128256, 2048], in bf16 (widened per
// token chunk) and fp32 (packed by OpenBLAS per GEMM): scoring takes the longest token chunks over
// vocabulary tiles, training keeps one pass per chunk.
TEST(CpuPlanTest, ScoringTakesLongChunksOverTiles) {
  auto made = MakeBackend("cpu");
  ASSERT_TRUE(made.ok()) << made.status();
  const std::unique_ptr<Backend> cpu = std::move(made).value();
  for (const DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(dtype));
    ProblemShape shape;
    shape.num_tokens = 8192;
    shape.hidden_size = 2048;
    shape.vocab_size = 128256;
    shape.hidden_dtype = dtype;
    shape.weight_dtype = dtype;
    shape.top_k = 20;
    constexpr size_t kBudget = 256 * kMiB;
    auto scoring = cpu->Plan(shape, kBudget);
    ASSERT_TRUE(scoring.ok()) << scoring.status();
    EXPECT_EQ(scoring->token_chunk, 4096);
    EXPECT_LT(scoring->vocab_chunk, shape.vocab_size);
    EXPECT_LE(scoring->workspace_bytes, kBudget);

    shape.grad_hidden = true;
    auto training = cpu->Plan(shape, kBudget);
    ASSERT_TRUE(training.ok()) << training.status();
    EXPECT_EQ(training->vocab_chunk, shape.vocab_size);
    EXPECT_LT(training->token_chunk, 1024);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineBackendTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace lossd::testing
