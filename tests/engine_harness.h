// Shared pieces of the engine tests: random problems rounded to their dtypes, one engine run with
// poisoned outputs, and error measures against the float64 reference.
#ifndef LOSSD_TESTS_ENGINE_HARNESS_H_
#define LOSSD_TESTS_ENGINE_HARNESS_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "lossd/kernels/backend.h"
#include "tests/reference.h"

namespace lossd::testing {

// The backends this machine can run: always "cpu", plus "cuda" when a GPU and the module are found.
std::vector<std::string> AvailableBackends();
// The backend, or the status CreateBackend returned: a test that skips for want of a backend says
// why (no driver, no device, a module built for other GPUs, a cuBLAS that would not start).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& name);

// A seed from std::random_device, or $LOSSD_TEST_SEED to replay a failure.
uint64_t FreshSeed();

struct ProblemSpec {
  int64_t num_tokens = 1;
  int64_t hidden_size = 16;
  int64_t vocab_size = 100;
  DType hidden_dtype = DType::kFloat32;
  DType weight_dtype = DType::kFloat32;
  double logit_scale = 3.0;      // standard deviation of the raw logits
  double ignore_fraction = 0.0;  // share of labels set to ignore_index
  bool token_weights = false;    // random weights in [-1, 2], negatives included
  LossOptions options;
  int top_k = 0;
  // Hidden states in {-2, ..., 2} and W in {-1, 0, 1} instead of normals: every logit is a small
  // integer, exact in any dtype and summation order, and most tie with many others.
  bool integer_values = false;
  // Inputs of the objectives, made where options ask for them. Sampling log-probabilities are
  // q_i = logp_i - log t_i, logp_i the exact log-probability and the ratio t_i taken in turn from
  // ratio_targets (so that a case puts ratios on both sides of each clip bound, far enough from
  // it that float rounding cannot move them across); advantages uniform in [-2, 2] with every
  // fifth exactly 0; reference log-probabilities logp_i + N(0, 0.5); logprob_grads N(0, 1).
  std::vector<double> ratio_targets = {1.0};
  // > 0, a sequence reduction or a sequence ratio: the batch is sequences of random lengths in
  // [1, max_sequence_length] (8 when 0), the second of them entirely ignored.
  int64_t max_sequence_length = 0;
  // The teacher of a distill call (options.objective kDistill): a head of its own, with hidden
  // rows of teacher_hidden_size (0: the student's) in these dtypes and logits of standard deviation
  // teacher_logit_scale; with teacher_top_k > 0, the top-k of such a head's log-probabilities, a
  // sparse teacher; with teacher_is_student, the student's own head and rows (or the top-k of its
  // own log-probabilities).
  int64_t teacher_hidden_size = 0;
  DType teacher_hidden_dtype = DType::kFloat32;
  DType teacher_weight_dtype = DType::kFloat32;
  double teacher_logit_scale = 3.0;
  int teacher_top_k = 0;
  // > 0: the sparse teacher's top-k probabilities are rescaled to sum to this, leaving the rest.
  double teacher_top_k_mass = 0.0;
  bool teacher_is_student = false;
  bool no_labels = false;  // a distill call without labels
};

// A problem in the engine's wire form (typed bytes) and as doubles of the same rounded values.
struct Problem {
  ProblemSpec spec;
  std::vector<uint8_t> hidden_bytes;
  std::vector<uint8_t> weight_bytes;
  std::vector<float> token_weights;
  // The objectives' inputs as the engine takes them (the reference holds the same values).
  std::vector<float> sampling_logprobs, advantages, reference_logprobs, logprob_grads;
  // A distill call's teacher as the engine takes it.
  std::vector<uint8_t> teacher_hidden_bytes;
  std::vector<uint8_t> teacher_weight_bytes;
  std::vector<int32_t> teacher_top_k_tokens;
  std::vector<float> teacher_top_k_logprobs;
  ReferenceProblem reference;
};

Problem MakeProblem(const ProblemSpec& spec, std::mt19937_64& rng);

struct EngineRun {
  BatchSummary summary;
  // One vector per output of LOSSD_TOKEN_OUTPUTS, named as it is.
#define LOSSD_RUN_OUTPUT(type, name) std::vector<type> name;
  LOSSD_TOKEN_OUTPUTS(LOSSD_RUN_OUTPUT)
#undef LOSSD_RUN_OUTPUT
  std::vector<float> top_k_logprob;
  std::vector<int32_t> top_k_token;
  std::vector<float> grad_hidden;  // converted to fp32 from grad_hidden_dtype
  std::vector<float> grad_weight;
};

struct RunRequest {
  bool grad_hidden = true;
  bool grad_weight = true;
  DType grad_hidden_dtype = DType::kFloat32;
  size_t budget_bytes = 64u << 20;
  // Of the per-token outputs only the loss, so that the engine may skip the work of the others
  // (argmax, entropy, top-k); the others stay NaN / -7.
  bool loss_only = false;
  // The rows and dL/dh in the backend's HostBuffers (page-locked memory on a GPU, which the CUDA
  // backend copies directly instead of staging) rather than in plain host memory.
  bool host_buffers = false;
};

// Uploads W, runs one Compute with every per-token output requested (unless loss_only), the
// outputs and the workspace NaN-poisoned, and reads everything back; a sequence reduction's per-row
// factors come from SequenceReductionScales. Returns the engine's error status when Compute fails.
absl::StatusOr<EngineRun> RunEngine(Backend& backend, const Problem& problem,
                                    const RunRequest& request);

// The policy objectives' losses are r A or clip(r) A logp: a logp carrying the fp32 logits' error
// (about 1e-6 at the tests' scales) moves r by as much relative to itself, and a term
// -clip(r) A logp near logp = 0 by as much relative to a small value, where cross-entropy's
// lse - z_y stays well away from 0.
inline constexpr double kPolicyLossBound = 2e-5;

// Ratios on both sides of 1 - eps_low = 0.8 and 1 + eps_high = 1.28, inside and far outside the
// trust region, and past the dual-clip bound 3 (ProblemSpec::ratio_targets).
inline const std::vector<double> kRatioTargets = {0.3,  0.79, 0.81, 1.0, 1.1,
                                                  1.27, 1.29, 2.5,  3.2, 0.95};

// Relative error of the reduced loss. It is a positive multiple of the sum of the per-token
// losses, each carrying fp32 error relative to the size of its terms (ReferenceResult::
// token_loss_scale); negative token weights, or terms of one row of opposite signs, make them
// cancel, so the sum's relative error grows by sum s_i / |sum l_i| (1 without cancellation).
double LossError(double loss, const ReferenceResult& ref);

// The per-token losses' error relative to the size of their terms: ||l - ref||_F / ||s||_F with
// s = ref.token_loss_scale (RelativeError's where no row's terms cancel).
double TokenLossError(const std::vector<float>& token_loss, const ReferenceResult& ref);

// How much the gradients' relative error grows where a row's policy term and KL penalty pull
// against each other: ||s|| / ||c|| over the rows' logprob_coefficient_scale s and
// logprob_coefficient c (ReferenceResult), at least 1 (1 without cancellation or penalty).
double GradientCancellation(const ReferenceResult& ref);

// ||a - b||_F / ||b||_F, or ||a||_F when b is all zeros.
double RelativeError(const std::vector<float>& actual, const std::vector<double>& expected);
double MaxAbsError(const std::vector<float>& actual, const std::vector<double>& expected);

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_ENGINE_HARNESS_H_
