#include "tests/engine_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/half.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::testing {

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> names = {"cpu"};
  if (CreateBackend("cuda").ok()) names.push_back("cuda");
  return names;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& name) {
  return CreateBackend(name);
}

uint64_t FreshSeed() {
  if (const char* replay = std::getenv("LOSSD_TEST_SEED"))
    return std::strtoull(replay, nullptr, 10);
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

namespace {

// What an output buffer holds before the engine writes it, so that a value it never wrote shows:
// NaN where a float, -7 (no token, no ClipState, no count) where an int.
template <typename T>
T PoisonValue() {
  if constexpr (std::is_floating_point_v<T>) {
    return std::numeric_limits<T>::quiet_NaN();
  } else {
    return T{-7};
  }
}

// Rounds `values` to `dtype`, writing the typed bytes and replacing values by what they became.
std::vector<uint8_t> RoundToDType(std::vector<double>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromFloat(bytes.data(), dtype, static_cast<int64_t>(i), static_cast<float>(values[i]));
    values[i] = LoadAsFloat(bytes.data(), dtype, static_cast<int64_t>(i));
  }
  return bytes;
}

// A distill call's teacher (ProblemSpec): a random head and rows, or the top-k of their
// log-probabilities at temperature 1, or the student's own.
void MakeTeacher(const ProblemSpec& spec, std::mt19937_64& rng, Problem& p) {
  ReferenceProblem& r = p.reference;
  if (spec.teacher_is_student && spec.teacher_top_k == 0) {
    r.teacher_hidden_size = r.hidden_size;
    r.teacher_hidden = r.hidden;
    r.teacher_weight = r.weight;
    return;
  }
  const int64_t n = spec.num_tokens;
  const int64_t v = spec.vocab_size;
  int64_t ht = spec.teacher_hidden_size > 0 ? spec.teacher_hidden_size : spec.hidden_size;
  std::vector<double> hidden;
  std::vector<double> weight;
  if (spec.teacher_is_student) {  // the top-k of the student's own distribution
    ht = r.hidden_size;
    hidden = r.hidden;
    weight = r.weight;
  } else {
    std::normal_distribution<double> normal(0.0, 1.0);
    hidden.resize(n * ht);
    for (double& x : hidden) x = normal(rng);
    weight.resize(v * ht);
    const double scale = spec.teacher_logit_scale / std::sqrt(static_cast<double>(ht));
    for (double& x : weight) x = normal(rng) * scale;
  }
  if (spec.teacher_top_k == 0) {
    p.teacher_hidden_bytes = RoundToDType(hidden, spec.teacher_hidden_dtype);
    p.teacher_weight_bytes = RoundToDType(weight, spec.teacher_weight_dtype);
    r.teacher_hidden_size = ht;
    r.teacher_hidden = hidden;
    r.teacher_weight = weight;
    return;
  }
  const int k = spec.teacher_top_k;
  r.teacher_top_k = k;
  std::vector<double> logits(v);
  std::vector<int64_t> order(v);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < v; ++t) {
      double a = 0.0;
      for (int64_t j = 0; j < ht; ++j) a += hidden[i * ht + j] * weight[t * ht + j];
      logits[t] = a;
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (double a : logits) sum += std::exp(a - m);
    const double lse = m + std::log(sum);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    double shift = -lse;
    if (spec.teacher_top_k_mass > 0) {  // the top-k's own log-sum-exp, then the mass asked for
      double top = 0.0;
      for (int j = 0; j < k; ++j) top += std::exp(logits[order[j]] - m);
      shift = -(m + std::log(top)) + std::log(spec.teacher_top_k_mass);
    }
    for (int j = 0; j < k; ++j) {
      const float logprob = static_cast<float>(logits[order[j]] + shift);
      p.teacher_top_k_tokens.push_back(static_cast<int32_t>(order[j]));
      p.teacher_top_k_logprobs.push_back(logprob);
      r.teacher_top_k_tokens.push_back(order[j]);
      r.teacher_top_k_logprobs.push_back(logprob);
    }
  }
}

}  // namespace

Problem MakeProblem(const ProblemSpec& spec, std::mt19937_64& rng) {
  Problem p;
  p.spec = spec;
  ReferenceProblem& r = p.reference;
  r.num_tokens = spec.num_tokens;
  r.hidden_size = spec.hidden_size;
  r.vocab_size = spec.vocab_size;
  r.options = spec.options;
  r.top_k = spec.top_k;

  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_int_distribution<int> sign(-1, 1);
  const double weight_scale = spec.logit_scale / std::sqrt(static_cast<double>(spec.hidden_size));
  r.hidden.resize(spec.num_tokens * spec.hidden_size);
  for (double& x : r.hidden) x = spec.integer_values ? small(rng) : normal(rng);
  r.weight.resize(spec.vocab_size * spec.hidden_size);
  for (double& x : r.weight) x = spec.integer_values ? sign(rng) : normal(rng) * weight_scale;
  p.hidden_bytes = RoundToDType(r.hidden, spec.hidden_dtype);
  p.weight_bytes = RoundToDType(r.weight, spec.weight_dtype);

  std::uniform_int_distribution<int64_t> token(0, spec.vocab_size - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  r.labels.resize(spec.num_tokens);
  for (int64_t& y : r.labels) {
    y = unit(rng) < spec.ignore_fraction ? spec.options.ignore_index : token(rng);
  }
  if (spec.token_weights) {
    for (int64_t i = 0; i < spec.num_tokens; ++i) {
      p.token_weights.push_back(static_cast<float>(-1.0 + 3.0 * unit(rng)));
      r.token_weights.push_back(p.token_weights.back());
    }
  }
  r.sequence_ratio = spec.options.policy.sequence_ratio;
  if (spec.max_sequence_length > 0 || IsSequenceReduction(spec.options.reduction) ||
      r.sequence_ratio) {
    std::uniform_int_distribution<int64_t> length(
        1, spec.max_sequence_length > 0 ? spec.max_sequence_length : 8);
    int64_t first = 0;
    while (first < spec.num_tokens) {
      const int64_t sequence = std::min(length(rng), spec.num_tokens - first);
      if (r.sequence_lengths.size() == 1) {
        std::fill_n(r.labels.begin() + first, sequence, spec.options.ignore_index);
      }
      r.sequence_lengths.push_back(sequence);
      first += sequence;
    }
  }

  const LossOptions& o = spec.options;
  const bool policy = IsPolicyObjective(o.objective);
  const bool kl = o.policy.kl_estimator != KlEstimator::kNone;
  if (policy || kl) {
    // The exact log-probabilities, from the reference's logits under plain cross-entropy.
    ReferenceProblem plain = r;
    plain.options = LossOptions();
    plain.sequence_ratio = false;
    plain.options.logit_softcap = o.logit_softcap;
    plain.options.temperature = o.temperature;
    plain.options.ignore_index = o.ignore_index;
    plain.top_k = 0;
    const ReferenceResult exact = ComputeReference(plain);
    const int64_t v = spec.vocab_size;
    std::normal_distribution<double> reference_noise(0.0, 0.5);
    std::uniform_real_distribution<double> advantage(-2.0, 2.0);
    // log t_i: the targets in turn, or under a sequence ratio target j for sequence j, its
    // counted tokens' log-ratios spread by +-0.5 in pairs around it (0 for an odd one out), so that
    // the sequence's ratio (the geometric mean of its tokens') is target j, as far from a clip
    // bound as the targets are, while its tokens' ratios are not.
    std::vector<double> log_target(spec.num_tokens);
    for (int64_t i = 0; i < spec.num_tokens; ++i) {
      log_target[i] = std::log(spec.ratio_targets[i % spec.ratio_targets.size()]);
    }
    if (o.policy.sequence_ratio) {
      for (size_t j = 0, first = 0; j < r.sequence_lengths.size();
           first += r.sequence_lengths[j++]) {
        const double center = std::log(spec.ratio_targets[j % spec.ratio_targets.size()]);
        std::vector<int64_t> counted;
        for (size_t i = first; i < first + r.sequence_lengths[j]; ++i) {
          log_target[i] = center;
          if (r.labels[i] != o.ignore_index) counted.push_back(static_cast<int64_t>(i));
        }
        for (size_t k = 0; k + 1 < counted.size(); k += 2) {
          log_target[counted[k]] += 0.5;
          log_target[counted[k + 1]] -= 0.5;
        }
      }
    }
    for (int64_t i = 0; i < spec.num_tokens; ++i) {
      const int64_t y = r.labels[i] == o.ignore_index ? 0 : r.labels[i];
      const double logp = exact.logits[i * v + y] - exact.lse[i];
      if (policy) {
        p.sampling_logprobs.push_back(static_cast<float>(logp - log_target[i]));
        p.advantages.push_back(i % 5 == 4 ? 0.0f : static_cast<float>(advantage(rng)));
      }
      if (kl) p.reference_logprobs.push_back(static_cast<float>(logp + reference_noise(rng)));
    }
  }
  if (o.objective == Objective::kLogprobGradient) {
    for (int64_t i = 0; i < spec.num_tokens; ++i) {
      p.logprob_grads.push_back(static_cast<float>(normal(rng)));
    }
  }
  if (o.objective == Objective::kDistill) MakeTeacher(spec, rng, p);
  if (spec.no_labels) r.labels.clear();
  r.sampling_logprobs.assign(p.sampling_logprobs.begin(), p.sampling_logprobs.end());
  r.advantages.assign(p.advantages.begin(), p.advantages.end());
  r.reference_logprobs.assign(p.reference_logprobs.begin(), p.reference_logprobs.end());
  r.logprob_grads.assign(p.logprob_grads.begin(), p.logprob_grads.end());
  return p;
}

double LossError(double loss, const ReferenceResult& ref) {
  double sum = 0.0;
  double magnitude = 0.0;
  for (size_t i = 0; i < ref.token_loss.size(); ++i) {
    sum += ref.token_loss[i];
    magnitude += ref.token_loss_scale[i];
  }
  const double cancellation = sum == 0.0 ? 1.0 : magnitude / std::abs(sum);
  return std::abs(loss - ref.loss) / std::abs(ref.loss) / std::max(1.0, cancellation);
}

absl::StatusOr<EngineRun> RunEngine(Backend& backend, const Problem& problem,
                                    const RunRequest& request) {
  const ProblemSpec& s = problem.spec;
  const int64_t n = s.num_tokens;
  const int64_t h = s.hidden_size;
  const int64_t v = s.vocab_size;
  const int k = request.loss_only ? 0 : s.top_k;
  const float nan = std::numeric_limits<float>::quiet_NaN();

  ASSIGN_OR_RETURN(DeviceBuffer weight_buffer, backend.Allocate(problem.weight_bytes.size()));
  RETURN_IF_ERROR(backend.CopyToDevice(problem.weight_bytes.data(), problem.weight_bytes.size(),
                                       weight_buffer, 0));
  DeviceBuffer grad_weight_buffer;
  if (request.grad_weight) {
    ASSIGN_OR_RETURN(grad_weight_buffer, backend.Allocate(v * h * sizeof(float)));
    RETURN_IF_ERROR(backend.Zero(grad_weight_buffer));
  }

  ProblemShape shape;
  shape.num_tokens = n;
  shape.hidden_size = h;
  shape.vocab_size = v;
  shape.hidden_dtype = s.hidden_dtype;
  shape.weight_dtype = s.weight_dtype;
  shape.grad_hidden = request.grad_hidden;
  shape.grad_weight = request.grad_weight;
  shape.grad_hidden_dtype = request.grad_hidden_dtype;
  shape.top_k = k;
  shape.exact_gradients = s.options.exact_gradients;
  ASSIGN_OR_RETURN(const ChunkPlan plan, backend.Plan(shape, request.budget_bytes));
  ASSIGN_OR_RETURN(DeviceBuffer workspace, backend.Allocate(plan.workspace_bytes));
  // All bits set: NaN as fp32 and 16-bit floats, so that whatever the engine reads of its
  // workspace before writing it shows in the outputs (fresh device memory is often zeros).
  const std::vector<uint8_t> poison(plan.workspace_bytes, 0xff);
  RETURN_IF_ERROR(backend.CopyToDevice(poison.data(), poison.size(), workspace, 0));

  EngineRun run;
#define LOSSD_POISON_OUTPUT(type, name) run.name.assign(n, PoisonValue<type>());
  LOSSD_TOKEN_OUTPUTS(LOSSD_POISON_OUTPUT)
#undef LOSSD_POISON_OUTPUT
  run.top_k_logprob.assign(n * k, nan);
  run.top_k_token.assign(n * k, -7);
  std::vector<uint8_t> grad_hidden_bytes(n * h * DTypeSize(request.grad_hidden_dtype), 0xff);
  void* grad_hidden_target = grad_hidden_bytes.data();
  const void* hidden_source = problem.hidden_bytes.data();
  DeviceBuffer host_rows;
  DeviceBuffer host_grad_hidden;
  if (request.host_buffers) {
    ASSIGN_OR_RETURN(host_rows, backend.HostBuffers().Allocate(problem.hidden_bytes.size()));
    std::memcpy(host_rows.data(), problem.hidden_bytes.data(), problem.hidden_bytes.size());
    hidden_source = host_rows.data();
    ASSIGN_OR_RETURN(host_grad_hidden, backend.HostBuffers().Allocate(grad_hidden_bytes.size()));
    std::memset(host_grad_hidden.data(), 0xff, grad_hidden_bytes.size());
    grad_hidden_target = host_grad_hidden.data();
  }

  BatchInputs in;
  in.hidden = hidden_source;
  in.hidden_dtype = s.hidden_dtype;
  in.num_tokens = n;
  in.hidden_size = h;
  in.labels = problem.reference.labels.empty() ? nullptr : problem.reference.labels.data();
  in.token_weights = problem.token_weights.empty() ? nullptr : problem.token_weights.data();
  const auto or_null = [](const std::vector<float>& values) {
    return values.empty() ? nullptr : values.data();
  };
  in.sampling_logprobs = or_null(problem.sampling_logprobs);
  in.advantages = or_null(problem.advantages);
  in.reference_logprobs = or_null(problem.reference_logprobs);
  in.logprob_grads = or_null(problem.logprob_grads);
  std::vector<double> reduction_scales;
  if (IsSequenceReduction(s.options.reduction)) {
    const ReferenceProblem& r = problem.reference;
    ASSIGN_OR_RETURN(reduction_scales,
                     SequenceReductionScales(s.options, in.labels, n, r.sequence_lengths.data(),
                                             static_cast<int64_t>(r.sequence_lengths.size())));
    in.reduction_scales = reduction_scales.data();
  }
  if (s.options.policy.sequence_ratio) {
    in.ratio_sequence_lengths = problem.reference.sequence_lengths.data();
    in.num_ratio_sequences = static_cast<int64_t>(problem.reference.sequence_lengths.size());
  }

  // A distill call's teacher: a head of its own (uploaded as the student's is), the student's, or a
  // sparse top-k.
  DeviceBuffer teacher_weight_buffer;
  WeightView teacher_view;
  if (s.options.objective == Objective::kDistill) {
    TeacherInputs& t = in.teacher;
    if (s.teacher_top_k > 0) {
      t.top_k = s.teacher_top_k;
      t.top_k_tokens = problem.teacher_top_k_tokens.data();
      t.top_k_logprobs = problem.teacher_top_k_logprobs.data();
    } else if (s.teacher_is_student) {
      t.hidden = problem.hidden_bytes.data();
      t.hidden_dtype = s.hidden_dtype;
      t.hidden_size = h;
    } else {
      const int64_t ht = problem.reference.teacher_hidden_size;
      ASSIGN_OR_RETURN(teacher_weight_buffer,
                       backend.Allocate(problem.teacher_weight_bytes.size()));
      RETURN_IF_ERROR(backend.CopyToDevice(problem.teacher_weight_bytes.data(),
                                           problem.teacher_weight_bytes.size(),
                                           teacher_weight_buffer, 0));
      teacher_view = WeightView{&teacher_weight_buffer, s.teacher_weight_dtype, v, ht};
      t.weight = &teacher_view;
      t.hidden = problem.teacher_hidden_bytes.data();
      t.hidden_dtype = s.teacher_hidden_dtype;
      t.hidden_size = ht;
    }
  }

  TokenOutputs out;
  if (request.loss_only) {
    out.token_loss = run.token_loss.data();
  } else {
#define LOSSD_BIND_OUTPUT(type, name) out.name = run.name.data();
    LOSSD_TOKEN_OUTPUTS(LOSSD_BIND_OUTPUT)
#undef LOSSD_BIND_OUTPUT
  }
  out.top_k = k;
  out.top_k_logprob = k > 0 ? run.top_k_logprob.data() : nullptr;
  out.top_k_token = k > 0 ? run.top_k_token.data() : nullptr;
  out.grad_hidden = request.grad_hidden ? grad_hidden_target : nullptr;
  out.grad_hidden_dtype = request.grad_hidden_dtype;

  const WeightView weight{&weight_buffer, s.weight_dtype, v, h};
  if (s.teacher_is_student && s.teacher_top_k == 0) in.teacher.weight = &weight;
  ASSIGN_OR_RETURN(run.summary,
                   backend.Compute(in, weight, s.options, out,
                                   request.grad_weight ? &grad_weight_buffer : nullptr, workspace));
  if (request.grad_hidden) {
    run.grad_hidden.resize(n * h);
    for (int64_t i = 0; i < n * h; ++i) {
      run.grad_hidden[i] = LoadAsFloat(grad_hidden_target, request.grad_hidden_dtype, i);
    }
  }
  if (request.grad_weight) {
    run.grad_weight.resize(v * h);
    RETURN_IF_ERROR(
        backend.CopyToHost(grad_weight_buffer, 0, v * h * sizeof(float), run.grad_weight.data()));
  }
  return run;
}

double GradientCancellation(const ReferenceResult& ref) {
  double scale = 0.0;
  double coefficient = 0.0;
  for (size_t i = 0; i < ref.logprob_coefficient.size(); ++i) {
    scale += ref.logprob_coefficient_scale[i] * ref.logprob_coefficient_scale[i];
    coefficient += ref.logprob_coefficient[i] * ref.logprob_coefficient[i];
  }
  return coefficient > 0 ? std::max(1.0, std::sqrt(scale / coefficient)) : 1.0;
}

namespace {

// ||a - b||_F / ||scale||_F, or ||a - b||_F when scale is all zeros.
double ErrorAgainstScale(const std::vector<float>& actual, const std::vector<double>& expected,
                         const std::vector<double>& scale) {
  if (actual.size() != expected.size() || scale.size() != expected.size()) {
    return std::numeric_limits<double>::infinity();
  }
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    diff += d * d;
    norm += scale[i] * scale[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace

double TokenLossError(const std::vector<float>& token_loss, const ReferenceResult& ref) {
  return ErrorAgainstScale(token_loss, ref.token_loss, ref.token_loss_scale);
}

double RelativeError(const std::vector<float>& actual, const std::vector<double>& expected) {
  return ErrorAgainstScale(actual, expected, expected);
}

double MaxAbsError(const std::vector<float>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double worst = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (!(d <= worst)) worst = d;  // NaN propagates as the worst error
  }
  return worst;
}

}  // namespace lossd::testing
