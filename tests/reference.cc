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
  if (o.objective == Objective::kDro) {
    // Tinker's DRO (tinker-docs.thinkingmachines.ai/tinker/losses/dro):
    //   dro_objective = target_logprobs * advantages - 0.5 * beta * (target_logprobs - q)^2,
    //   loss = -dro_objective; no ratio.
    const double gap = logp - q;
    t.value = -(logp * advantage - 0.5 * p.dro_beta * gap * gap);
    t.derivative = -advantage + p.dro_beta * gap;
    return t;
  }
  // verl's log-ratio clamp: log r = clamp(logp - q, -c, c), whose derivative is 0 where it holds.
  double log_ratio = logp - q;
  double dr = 1.0;  // d r / dlogp = dr * r
  if (p.log_ratio_clamp > 0 && std::abs(log_ratio) > p.log_ratio_clamp) {
    log_ratio = std::copysign(p.log_ratio_clamp, log_ratio);
    dr = 0.0;
  }
  const double r = std::exp(log_ratio);
  const double low = 1 - p.clip_low;
  const double high = 1 + p.clip_high;
  const double clipped = std::min(std::max(r, low), high);
  const double dclipped = (r > low && r < high) ? dr * r : 0.0;  // d clip(r) / dlogp
  t.ratio = r;
  if (o.objective == Objective::kImportanceSampling) {
    t.value = -r * advantage;
    t.derivative = -dr * r * advantage;
  } else if (o.objective == Objective::kPpo) {
    const double unclipped_branch = r * advantage;
    const double clipped_branch = clipped * advantage;
    if (clipped_branch < unclipped_branch) {
      t.value = -clipped_branch;
      t.derivative = -dclipped * advantage;
      t.clip = static_cast<int32_t>(r > high ? ClipState::kHigh : ClipState::kLow);
    } else {
      t.value = -unclipped_branch;
      t.derivative = -dr * r * advantage;
    }
    if (p.dual_clip > 0 && advantage < 0 && -p.dual_clip * advantage < t.value) {
      t.value = -p.dual_clip * advantage;
      t.derivative = 0.0;
      t.clip = static_cast<int32_t>(ClipState::kDual);
    }
  } else if (o.objective == Objective::kSapo) {
    // SAPO (Gao et al. 2025, arXiv 2511.20347, eq. of the soft gate; verl's policy loss "sapo"):
    //   tau = tau_pos if A > 0 else tau_neg, gate = sigmoid(tau (r - 1)) * 4 / tau,
    //   loss = -gate * A; d gate / dlogp = 4 sigmoid' r = 4 s (1 - s) r.
    const double tau = advantage > 0 ? p.sapo_tau_positive : p.sapo_tau_negative;
    const double s = 1.0 / (1.0 + std::exp(-tau * (r - 1.0)));
    t.value = -s * 4.0 / tau * advantage;
    t.derivative = -4.0 * s * (1.0 - s) * dr * r * advantage;
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
    case KlEstimator::kNone: break;
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
    for (int64_t i = first[s]; i < first[s + 1]; ++i) {
      counted[s] += p.labels.empty() || p.labels[i] != o.ignore_index;
    }
    sequences += counted[s] > 0;
  }
  const double denominator = o.mean_denominator > 0 ? o.mean_denominator : sequences;
  for (size_t s = 0; s < p.sequence_lengths.size(); ++s) {
    for (int64_t i = first[s]; i < first[s + 1]; ++i) {
      if (!p.labels.empty() && p.labels[i] == o.ignore_index) continue;
      factors[i] = o.reduction == Reduction::kSequenceMeanTokenSum
                       ? 1.0 / denominator
                       : 1.0 / (denominator * counted[s]);
    }
  }
  return factors;
}

// z = softcap(a) / temperature for `count` raw logits a (no cap where cap is 0); in place allowed.
void TransformLogits(const double* a, int64_t count, double cap, double temperature, double* z) {
  for (int64_t t = 0; t < count; ++t) {
    z[t] = (cap > 0 ? cap * std::tanh(a[t] / cap) : a[t]) / temperature;
  }
}

// The teacher's logits over the whole batch, [N, V]: its head's a = h_t W_t^T (one dgemm) after
// its own soft cap and temperature, or a sparse teacher's log-probabilities completed over the
// vocabulary: -inf outside its top-k (renormalize; a tail bucket, whose mass TailBucketDistillation
// takes from the top-k's), or the mass the top-k leaves spread evenly there (spread).
std::vector<double> TeacherLogits(const ReferenceProblem& p) {
  const int64_t n = p.num_tokens;
  const int64_t v = p.vocab_size;
  const DistillOptions& d = p.options.distill;
  std::vector<double> zt(n * v);
  if (p.teacher_top_k == 0) {
    const int64_t ht = p.teacher_hidden_size;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, ht, 1.0, p.teacher_hidden.data(), ht,
                p.teacher_weight.data(), ht, 0.0, zt.data(), v);
    TransformLogits(zt.data(), n * v, d.teacher_logit_softcap, d.teacher_temperature, zt.data());
    return zt;
  }
  const int k = p.teacher_top_k;
  for (int64_t i = 0; i < n; ++i) {
    double top_mass = 0.0;
    for (int j = 0; j < k; ++j) top_mass += std::exp(p.teacher_top_k_logprobs[i * k + j]);
    const double rest = 1.0 - top_mass;
    const double rest_logit = d.sparse_mass == SparseTeacherMass::kSpread && rest > 0 && v > k
                                  ? std::log(rest / (v - k))
                                  : -INFINITY;
    std::fill(zt.begin() + i * v, zt.begin() + (i + 1) * v, rest_logit);
    for (int j = 0; j < k; ++j) {
      zt[i * v + p.teacher_top_k_tokens[i * k + j]] = p.teacher_top_k_logprobs[i * k + j];
    }
  }
  return zt;
}

// log softmax(x / tau); -inf stays -inf.
std::vector<double> LogSoftmax(const double* x, int64_t v, double tau) {
  double m = -INFINITY;
  for (int64_t t = 0; t < v; ++t) m = std::max(m, x[t] / tau);
  double sum = 0.0;
  for (int64_t t = 0; t < v; ++t) sum += std::exp(x[t] / tau - m);
  const double lse = m + std::log(sum);
  std::vector<double> out(v);
  for (int64_t t = 0; t < v; ++t) out[t] = x[t] / tau - lse;
  return out;
}

// KD = tau^2 D_beta(p, q) of one row from its definition (types.h, DistillOptions), and
// dKD/dz_v. The gradient goes through the softmax's Jacobian: with s_w = q_w dD/dq_w,
// dD/du_v = s_v - q_v sum_w s_w, and dz = du / tau.
struct KdRow {
  double kd = 0.0;
  std::vector<double> dkd_dz;
};

KdRow Distillation(const double* z, const double* zt, int64_t v, const DistillOptions& d) {
  const double tau = d.temperature;
  const double beta = d.beta;
  const std::vector<double> log_q = LogSoftmax(z, v, tau);
  const std::vector<double> log_p = LogSoftmax(zt, v, tau);
  std::vector<double> s(v);
  double divergence = 0.0;
  for (int64_t t = 0; t < v; ++t) {
    const double q = std::exp(log_q[t]);
    const double p = std::exp(log_p[t]);  // 0 at -inf
    if (beta == 0.0) {
      if (p > 0) divergence += p * (log_p[t] - log_q[t]);
      s[t] = -p;
    } else if (beta == 1.0) {
      divergence += q * (log_q[t] - log_p[t]);
      s[t] = q * (log_q[t] - log_p[t] + 1.0);
    } else {
      const double log_m = std::log(beta * p + (1.0 - beta) * q);
      if (p > 0) divergence += beta * p * (log_p[t] - log_m);
      divergence += (1.0 - beta) * q * (log_q[t] - log_m);
      s[t] = (1.0 - beta) * q * (log_q[t] - log_m);
    }
  }
  double s_sum = 0.0;
  for (int64_t t = 0; t < v; ++t) s_sum += s[t];
  KdRow row;
  row.kd = tau * tau * divergence;
  row.dkd_dz.resize(v);
  for (int64_t t = 0; t < v; ++t) {
    row.dkd_dz[t] = tau * tau * (s[t] - std::exp(log_q[t]) * s_sum) / tau;
  }
  return row;
}

// KD = tau^2 D of one row against a tail-bucket teacher (SparseTeacherMass::kTailBucket), from
// the definition of top-k + tail distillation: both distributions over k + 1 buckets, the
// teacher's top-k S (its finite logits, which are log-probabilities) and the tail,
//   P_b = p_b / Z,  P_tail = max(0, 1 - sum_S p) / Z,  Z = sum_S p + max(0, 1 - sum_S p)
//   Q_b = q_b,      Q_tail = sum_{v not in S} q_v,      q = softmax(z / tau)
// and D_beta of P and Q as for a dense teacher. The gradient goes through the buckets: with
// G_b = dD/dQ_b and dQ_b/du_w = [w in b] q_w - Q_b q_w, dD/du_w = q_w G_b(w) - q_w sum_b G_b Q_b,
// q_w G_b(w) taken as -P_b exp(log q_w - log Q_b) under the forward KL (G_b = -P_b / Q_b alone
// overflows where Q_b underflows).
KdRow TailBucketDistillation(const double* z, const double* zt, int64_t v,
                             const DistillOptions& d) {
  const double tau = d.temperature;
  const double beta = d.beta;
  const std::vector<double> log_q = LogSoftmax(z, v, tau);
  // Buckets: 0 .. k-1 the top-k columns in column order, k the tail.
  std::vector<int64_t> bucket_of(v);
  std::vector<double> top_mass;
  double log_q_tail = -INFINITY;
  std::vector<double> log_q_bucket;
  for (int64_t t = 0; t < v; ++t) {
    if (zt[t] > -INFINITY) {
      bucket_of[t] = static_cast<int64_t>(top_mass.size());
      top_mass.push_back(std::exp(zt[t]));
      log_q_bucket.push_back(log_q[t]);
    } else {
      bucket_of[t] = -1;
      const double m = std::max(log_q_tail, log_q[t]);
      if (m > -INFINITY)
        log_q_tail = m + std::log(std::exp(log_q_tail - m) + std::exp(log_q[t] - m));
    }
  }
  const int64_t k = static_cast<int64_t>(top_mass.size());
  double sum_top = 0.0;
  for (double mass : top_mass) sum_top += mass;
  // No column outside the top-k (k = V): no tail on either side.
  const double tail = k < v ? std::max(0.0, 1.0 - sum_top) : 0.0;
  const double z_norm = sum_top + tail;
  std::vector<double> big_p(k + 1);
  for (int64_t b = 0; b < k; ++b) big_p[b] = top_mass[b] / z_norm;
  big_p[k] = tail / z_norm;
  log_q_bucket.push_back(log_q_tail);
  for (int64_t t = 0; t < v; ++t) {
    if (bucket_of[t] < 0) bucket_of[t] = k;
  }

  double divergence = 0.0;
  std::vector<double> g(k + 1, 0.0);  // G_b, but under the forward KL
  double g_dot_q = 0.0;
  for (int64_t b = 0; b <= k; ++b) {
    const double big_q = std::exp(log_q_bucket[b]);
    const double log_p = std::log(big_p[b]);
    if (beta == 0.0) {
      if (big_p[b] > 0) {
        divergence += big_p[b] * (log_p - log_q_bucket[b]);
        g_dot_q -= big_p[b];  // G_b Q_b
      }
      continue;
    } else if (beta == 1.0) {
      if (big_q > 0) {
        divergence += big_q * (log_q_bucket[b] - log_p);
        g[b] = log_q_bucket[b] - log_p + 1.0;
      }
    } else {
      const double log_m = std::log(beta * big_p[b] + (1.0 - beta) * big_q);
      if (big_p[b] > 0) divergence += beta * big_p[b] * (log_p - log_m);
      if (big_q > 0) {
        divergence += (1.0 - beta) * big_q * (log_q_bucket[b] - log_m);
        g[b] = (1.0 - beta) * (log_q_bucket[b] - log_m);
      }
    }
    if (big_q > 0) g_dot_q += g[b] * big_q;
  }
  KdRow row;
  row.kd = tau * tau * divergence;
  row.dkd_dz.resize(v);
  for (int64_t t = 0; t < v; ++t) {
    const int64_t b = bucket_of[t];
    const double q = std::exp(log_q[t]);
    const double q_g = beta == 0.0
                           ? (big_p[b] > 0 ? -big_p[b] * std::exp(log_q[t] - log_q_bucket[b]) : 0.0)
                           : q * g[b];
    row.dkd_dz[t] = tau * tau * (q_g - q * g_dot_q) / tau;
  }
  return row;
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
  r.token_loss_scale.assign(n, 0.0);
  r.logprob_coefficient.assign(n, 0.0);
  r.logprob_coefficient_scale.assign(n, 0.0);
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
  r.kd.assign(n, 0.0);
  r.ce.assign(n, 0.0);
  const bool distill = o.objective == Objective::kDistill;
  const bool has_labels = !p.labels.empty();
  if (distill) r.teacher_logits = TeacherLogits(p);
  for (int64_t i = 0; i < n; ++i) {
    r.counted_tokens += !has_labels || p.labels[i] != o.ignore_index;
  }
  const std::vector<double> factor = ReductionFactors(p, r.counted_tokens);
  const bool cross_entropy = o.objective == Objective::kCrossEntropy;
  const auto input = [](const std::vector<double>& values, int64_t i) {
    return values.empty() ? 0.0 : values[i];
  };
  // Under sequence_ratio, ppo against q'_i = logp_i - log s_j is GSPO-token: its ratio is s_j on
  // every token of sequence j, with d r / d logp_i = r.
  std::vector<double> sampling = p.sampling_logprobs;
  if (p.sequence_ratio) {
    std::vector<double> logp(n, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      if (!has_labels || p.labels[i] == o.ignore_index) continue;
      std::vector<double> z(v);
      TransformLogits(&raw[i * v], v, cap, temperature, z.data());
      const double m = *std::max_element(z.begin(), z.end());
      double sum_exp = 0.0;
      for (const double x : z) sum_exp += std::exp(x - m);
      logp[i] = z[p.labels[i]] - m - std::log(sum_exp);
    }
    for (int64_t first = 0; const int64_t length : p.sequence_lengths) {
      double sum = 0.0;
      int64_t counted = 0;
      for (int64_t i = first; i < first + length; ++i) {
        if (p.labels[i] == o.ignore_index) continue;
        sum += logp[i] - p.sampling_logprobs[i];
        ++counted;
      }
      const double log_ratio = counted > 0 ? sum / counted : 0.0;
      for (int64_t i = first; i < first + length; ++i) sampling[i] = logp[i] - log_ratio;
      first += length;
    }
  }

  // Per row: z, its statistics and top-k, its loss, then d loss_i / d a in place of a.
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t i = 0; i < n; ++i) {
    double* a = &raw[i * v];
    double* z = &r.logits[i * v];
    TransformLogits(a, v, cap, temperature, z);
    double max_abs = 0.0;
    for (int64_t t = 0; t < v; ++t) max_abs = std::max(max_abs, std::abs(z[t]));
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

    const int64_t y = has_labels ? p.labels[i] : -1;
    if (has_labels && y == o.ignore_index) {
      std::fill(a, a + v, 0.0);
      continue;
    }
    const double w = p.token_weights.empty() ? 1.0 : p.token_weights[i];
    const double logp = has_labels ? z[y] - lse : 0.0;
    r.logprob[i] = logp;
    double loss = o.z_loss_scale * lse * lse;
    double scale = std::abs(loss);   // the sum of |term| over loss's terms
    double dloss_dlogp = 0.0;        // of the objective's term and the KL penalty
    double dloss_dlogp_scale = 0.0;  // the sum of their sizes
    // Under distill: alpha, the cross-entropy's share, and dKD/dz.
    double ce_share = cross_entropy ? 1.0 : 0.0;
    std::vector<double> dkd_dz;
    if (distill) {
      const DistillOptions& d = o.distill;
      const KdRow kd = d.sparse_mass == SparseTeacherMass::kTailBucket && p.teacher_top_k > 0
                           ? TailBucketDistillation(z, &r.teacher_logits[i * v], v, d)
                           : Distillation(z, &r.teacher_logits[i * v], v, d);
      const double ce = has_labels ? (1 - eps) * (lse - z[y]) + eps * (lse - sum_z / v) : 0.0;
      r.kd[i] = kd.kd;
      r.ce[i] = ce;
      loss += d.alpha * ce + (1 - d.alpha) * kd.kd;
      scale += std::abs(d.alpha * ce) + std::abs((1 - d.alpha) * kd.kd);
      ce_share = d.alpha;
      dkd_dz = kd.dkd_dz;
      for (double& g : dkd_dz) g *= 1 - d.alpha;
    } else if (cross_entropy) {
      loss += (1 - eps) * (lse - z[y]) + eps * (lse - sum_z / v);
      scale += std::abs((1 - eps) * (lse - z[y])) + std::abs(eps * (lse - sum_z / v));
    } else {
      const Term term = ObjectiveOf(o, logp, input(sampling, i), input(p.advantages, i),
                                    input(p.logprob_grads, i));
      loss += term.value;
      scale += std::abs(term.value);
      dloss_dlogp += term.derivative;
      dloss_dlogp_scale += std::abs(term.derivative);
      r.ratio[i] = term.ratio;
      r.clip[i] = term.clip;
    }
    if (o.policy.kl_estimator != KlEstimator::kNone) {
      Term kl = KlOf(o.policy.kl_estimator, logp, input(p.reference_logprobs, i));
      if (o.policy.kl_ratio_weighted) {
        // DeepSeek-V3.2 (arXiv 2512.02556), the unbiased KL estimate: pi / pi_old times the
        // estimate, differentiated through both (without a log-ratio clamp here).
        const double ratio = std::exp(logp - input(p.sampling_logprobs, i));
        kl.derivative = ratio * (kl.value + kl.derivative);
        kl.value *= ratio;
      }
      r.kl[i] = kl.value;
      loss += o.policy.kl_coef * kl.value;
      scale += std::abs(o.policy.kl_coef * kl.value);
      dloss_dlogp += o.policy.kl_coef * kl.derivative;
      dloss_dlogp_scale += std::abs(o.policy.kl_coef * kl.derivative);
    }
    loss -= o.policy.entropy_coef * entropy;
    scale += std::abs(o.policy.entropy_coef * entropy);
    r.token_loss[i] = w * loss;
    r.token_loss_scale[i] = std::abs(w) * scale;

    // d loss_i / d z_t, then through z = cap(a) / T to the raw logit a.
    const double g = w * factor[i] * o.grad_scale;
    r.logprob_coefficient[i] = g * dloss_dlogp;
    r.logprob_coefficient_scale[i] = std::abs(g) * dloss_dlogp_scale;
    for (int64_t t = 0; t < v; ++t) {
      const double prob = std::exp(z[t] - lse);
      const double onehot = t == y ? 1.0 : 0.0;
      double d = 2 * o.z_loss_scale * lse * prob + dloss_dlogp * (onehot - prob);
      d += ce_share * (prob - eps / v - (1 - eps) * onehot);
      if (distill) d += dkd_dz[t];
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
    r.kd_sum += r.kd[i];
    r.ce_sum += r.ce[i];
  }
  // dL/dh = dA W and dL/dW = dA^T h, with dA = d loss / d a now in `raw`.
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, v, 1.0, raw.data(), v,
              p.weight.data(), h, 0.0, r.grad_hidden.data(), h);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, n, 1.0, raw.data(), v, p.hidden.data(),
              h, 0.0, r.grad_weight.data(), h);
  if (o.reduction == Reduction::kSum || o.reduction == Reduction::kNone) r.loss = r.loss_sum;
  return r;
}

double ReferenceLoss(const ReferenceProblem& problem) { return ComputeReference(problem).loss; }

}  // namespace lossd::testing
