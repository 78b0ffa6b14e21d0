#include "tests/reference.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace lossd::testing {
namespace {

// The objective's term of one token and its derivative by logp, straight from the definitions in
// lossd/kernels/types.h. ppo is -min(r A, clip(r) A), whose derivative is that of the smaller
// branch (ties take the unclipped one, whose derivative -A r is the clipped one's inside the
// region); with dual clip c a negative advantage's term is min(that, -c A).
struct Term {
  double value = 0.0;
  double derivative = 0.0;
  double ratio = 0.0;
  int32_t clip = 0;
};

Term ObjectiveOf(const LossOptions& o, double logp, double q, double advantage, double given) {
  Term t;
  const PolicyOptions& p = o.policy;
  if (o.objective == Objective::kLogprobGradient) {
    t.value = given * logp;
    t.derivative = given;
    return t;
  }
  const double r = std::exp(logp - q);
  const double low = 1 - p.clip_low;
  const double high = 1 + p.clip_high;
  const double clipped = std::min(std::max(r, low), high);
  const double dclipped = (r > low && r < high) ? r : 0.0;  // d clip(r) / dlogp
  t.ratio = r;
  if (o.objective == Objective::kImportanceSampling) {
    t.value = -r * advantage;
    t.derivative = -r * advantage;
  } else if (o.objective == Objective::kPpo) {
    const double unclipped_branch = r * advantage;
    const double clipped_branch = clipped * advantage;
    if (clipped_branch < unclipped_branch) {
      t.value = -clipped_branch;
      t.derivative = -dclipped * advantage;
      t.clip = static_cast<int32_t>(r > high ? ClipState::kHigh : ClipState::kLow);
    } else {
      t.value = -unclipped_branch;
      t.derivative = -r * advantage;
    }
    if (p.dual_clip > 0 && advantage < 0 && -p.dual_clip * advantage < t.value) {
      t.value = -p.dual_clip * advantage;
      t.derivative = 0.0;
      t.clip = static_cast<int32_t>(ClipState::kDual);
    }
  } else if (o.objective == Objective::kCispo) {
    t.value = -clipped * advantage * logp;
    t.derivative = -clipped * advantage;
    if (r > high) t.clip = static_cast<int32_t>(ClipState::kHigh);
    if (r < low) t.clip = static_cast<int32_t>(ClipState::kLow);
  }
  return t;
}

// KL(policy || reference) estimated at the sampled token, and its derivative by logp.
Term KlOf(KlEstimator estimator, double logp, double reference) {
  Term t;
  const double log_ratio = logp - reference;  // log pi / pi_ref
  switch (estimator) {
    case KlEstimator::kK1:
      t.value = log_ratio;
      t.derivative = 1.0;
      break;
    case KlEstimator::kK2:
      t.value = 0.5 * log_ratio * log_ratio;
      t.derivative = log_ratio;
      break;
    case KlEstimator::kK3:
      t.value = std::exp(-log_ratio) + log_ratio - 1.0;
      t.derivative = 1.0 - std::exp(-log_ratio);
      break;
    case KlEstimator::kNone:
      break;
  }
  return t;
}

// Each row's factor in the reduced loss: 1 / D for the mean, 1 for sum and none; for the sequence
// reductions 1 / S or 1 / (S L_s) from the sequences' counted rows.
std::vector<double> ReductionFactors(const ReferenceProblem& p, int64_t counted_tokens) {
  const LossOptions& o = p.options;
  const int64_t n = p.num_tokens;
  if (o.reduction == Reduction::kMean) {
    const double d = o.mean_denominator > 0 ? o.mean_denominator : counted_tokens;
    return std::vector<double>(n, d > 0 ? 1.0 / d : 0.0);
  }
  if (!IsSequenceReduction(o.reduction)) return std::vector<double>(n, 1.0);
  std::vector<double> factors(n, 0.0);
  std::vector<int64_t> first(1, 0);
  for (int64_t length : p.sequence_lengths) first.push_back(first.back() + length);
  int64_t sequences = 0;
  std::vector<int64_t> counted(p.sequence_lengths.size(), 0);
  for (size_t s = 0; s < p.sequence_lengths.size(); ++s) {
    for (int64_t i = first[s]; i < first[s + 1]; ++i) counted[s] += p.labels[i] != o.ignore_index;
    sequences += counted[s] > 0;
  }
  const double denominator = o.mean_denominator > 0 ? o.mean_denominator : sequences;
  for (size_t s = 0; s < p.sequence_lengths.size(); ++s) {
    for (int64_t i = first[s]; i < first[s + 1]; ++i) {
      if (p.labels[i] == o.ignore_index) continue;
      factors[i] = o.reduction == Reduction::kSequenceMeanTokenSum
                       ? 1.0 / denominator
                       : 1.0 / (denominator * counted[s]);
    }
  }
  return factors;
}

}  // namespace

ReferenceResult ComputeReference(const ReferenceProblem& p) {
  const int64_t n = p.num_tokens;
  const int64_t h = p.hidden_size;
  const int64_t v = p.vocab_size;
  const LossOptions& o = p.options;
  const double eps = o.label_smoothing;
  const double cap = o.logit_softcap;
  const double temperature = o.temperature;

  ReferenceResult r;
  r.token_loss.assign(n, 0.0);
  r.logprob.assign(n, 0.0);
  r.lse.assign(n, 0.0);
  r.entropy.assign(n, 0.0);
  r.argmax.assign(n, 0);
  r.logits.assign(n * v, 0.0);
  r.top_k_logprob.assign(n * p.top_k, 0.0);
  r.top_k_token.assign(n * p.top_k, 0);
  r.grad_hidden.assign(n * h, 0.0);
  r.grad_weight.assign(v * h, 0.0);
  std::vector<double> row_max_abs(n, 0.0);

  // The products run through BLAS's dgemm, in float64 like everything here, so that the largest
  // cases (N = 4096, H = 4096, V = 128256: three products of 2.1e12 multiply-adds) take a minute
  // on 16 cores rather than hours; the rows are independent, and each is done by one thread.
  std::vector<double> raw(n * v);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, h, 1.0, p.hidden.data(), h,
              p.weight.data(), h, 0.0, raw.data(), v);
  r.ratio.assign(n, 0.0);
  r.clip.assign(n, 0);
  r.kl.assign(n, 0.0);
  for (int64_t i = 0; i < n; ++i) r.counted_tokens += p.labels[i] != o.ignore_index;
  const std::vector<double> factor = ReductionFactors(p, r.counted_tokens);
  const bool cross_entropy = o.objective == Objective::kCrossEntropy;
  const auto input = [](const std::vector<double>& values, int64_t i) {
    return values.empty() ? 0.0 : values[i];
  };

  // Per row: z, its statistics and top-k, its loss, then d loss_i / d a in place of a.
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t i = 0; i < n; ++i) {
    double* a = &raw[i * v];
    double* z = &r.logits[i * v];
    double max_abs = 0.0;
    for (int64_t t = 0; t < v; ++t) {
      const double capped = cap > 0 ? cap * std::tanh(a[t] / cap) : a[t];
      z[t] = capped / temperature;
      max_abs = std::max(max_abs, std::abs(z[t]));
    }
    row_max_abs[i] = max_abs;
    const double m = *std::max_element(z, z + v);
    double sum_exp = 0.0;
    for (int64_t t = 0; t < v; ++t) sum_exp += std::exp(z[t] - m);
    const double lse = m + std::log(sum_exp);
    double expected_z = 0.0;
    double sum_z = 0.0;
    for (int64_t t = 0; t < v; ++t) {
      expected_z += std::exp(z[t] - lse) * z[t];
      sum_z += z[t];
    }
    const double entropy = lse - expected_z;
    r.lse[i] = lse;
    r.entropy[i] = entropy;
    r.argmax[i] = std::max_element(z, z + v) - z;  // first maximum: the lowest id

    // The k best, equal values ranked by the lower id (a stable sort's order).
    std::vector<int64_t> order(p.top_k > 0 ? v : 0);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(),
                      [&](int64_t x, int64_t y) { return z[x] > z[y] || (z[x] == z[y] && x < y); });
    for (int j = 0; j < p.top_k; ++j) {
      r.top_k_token[i * p.top_k + j] = order[j];
      r.top_k_logprob[i * p.top_k + j] = z[order[j]] - lse;
    }

    const int64_t y = p.labels[i];
    if (y == o.ignore_index) {
      std::fill(a, a + v, 0.0);
      continue;
    }
    const double w = p.token_weights.empty() ? 1.0 : p.token_weights[i];
    const double logp = z[y] - lse;
    r.logprob[i] = logp;
    double loss = o.z_loss_scale * lse * lse;
    double dloss_dlogp = 0.0;  // of the objective's term and the KL penalty
    if (cross_entropy) {
      loss += (1 - eps) * (lse - z[y]) + eps * (lse - sum_z / v);
    } else {
      const Term term = ObjectiveOf(o, logp, input(p.sampling_logprobs, i),
                                    input(p.advantages, i), input(p.logprob_grads, i));
      loss += term.value;
      dloss_dlogp += term.derivative;
      r.ratio[i] = term.ratio;
      r.clip[i] = term.clip;
    }
    if (o.policy.kl_estimator != KlEstimator::kNone) {
      const Term kl = KlOf(o.policy.kl_estimator, logp, input(p.reference_logprobs, i));
      r.kl[i] = kl.value;
      loss += o.policy.kl_coef * kl.value;
      dloss_dlogp += o.policy.kl_coef * kl.derivative;
    }
    loss -= o.policy.entropy_coef * entropy;
    r.token_loss[i] = w * loss;

    // d loss_i / d z_t, then through z = cap(a) / T to the raw logit a.
    const double g = w * factor[i] * o.grad_scale;
    for (int64_t t = 0; t < v; ++t) {
      const double prob = std::exp(z[t] - lse);
      const double onehot = t == y ? 1.0 : 0.0;
      double d = 2 * o.z_loss_scale * lse * prob + dloss_dlogp * (onehot - prob);
      if (cross_entropy) d += prob - eps / v - (1 - eps) * onehot;
      const double dentropy = -prob * (z[t] - expected_z);  // dH / dz_t
      d -= o.policy.entropy_coef * dentropy;
      d /= temperature;
      if (cap > 0) {
        const double th = std::tanh(a[t] / cap);
        d *= 1 - th * th;
      }
      a[t] = g * d;
    }
  }
  // The sums over rows, in row order.
  for (int64_t i = 0; i < n; ++i) {
    r.max_abs_logit = std::max(r.max_abs_logit, row_max_abs[i]);
    r.loss_sum += r.token_loss[i];
    r.loss += factor[i] * r.token_loss[i];
    r.kl_sum += r.kl[i];
    r.clipped_tokens += r.clip[i] != 0;
  }
  // dL/dh = dA W and dL/dW = dA^T h, with dA = d loss / d a now in `raw`.
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, v, 1.0, raw.data(), v,
              p.weight.data(), h, 0.0, r.grad_hidden.data(), h);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, n, 1.0, raw.data(), v,
              p.hidden.data(), h, 0.0, r.grad_weight.data(), h);
  if (o.reduction == Reduction::kSum || o.reduction == Reduction::kNone) r.loss = r.loss_sum;
  return r;
}

double ReferenceLoss(const ReferenceProblem& problem) { return ComputeReference(problem).loss; }

}  // namespace lossd::testing
