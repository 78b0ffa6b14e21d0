// Scalar math shared by the CPU and CUDA backends: logit transform, per-row statistics and their
// merge, the per-row loss, and the per-logit gradient. Written once so that the CPU tests cover the
// same formulas the GPU runs.
//
// Per row: a = h W^T, z = cap(a) / T with cap(a) = c tanh(a / c) (identity when c = 0),
//   lse = log sum_v exp z_v,  p_v = exp(z_v - lse),  logp = z_y - lse,  H = lse - sum_v p_v z_v,
//   loss = w [ term + beta KL + s lse^2 - c_H H ]   (term and KL as in types.h),
//   dL/dz_v = g [ p_v (1 + 2 s lse) - eps / V - (1 - eps) [v = y] ]   (cross-entropy)
//           + g d ([v = y] - p_v)                  (d = dL/dlogp of the policy term and beta KL)
//           + g c_H p_v (z_v - lse + H)            (the entropy bonus: dH/dz_v = -p_v (z_v - E_p
//           z))
//           + g 2 s lse p_v                        (z-loss, with any objective),
//   g = w * reduction scale * grad_scale,
//   dL/da_v = dL/dz_v * (1 / T) * (1 - (z_v T / c)^2)   (the last factor only with a soft cap).
// All of it is a per-row transform of the row's statistics, so that a row's logits are read the
// same way whatever the objective: dL/dz_v = p_v (scale_p + entropy_scale (z_v - lse)) - offset
// - label_term [v = y] (RowGradient).
#ifndef LOSSD_KERNELS_LOSS_MATH_H_
#define LOSSD_KERNELS_LOSS_MATH_H_

#include <cmath>
#include <cstdint>

#include "lossd/kernels/half.h"
#include "lossd/kernels/host_device.h"
#include "lossd/kernels/types.h"

namespace lossd {

// exp(x) for x <= 88. On the host a branch-free Cephes-style polynomial (about 2 ulp) that the
// compiler vectorizes inside row loops; on the device CUDA's expf.
LOSSD_HD float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  x = x < -87.33654f ? -87.33654f : (x > 88.37626f ? 88.37626f : x);
  // Round x / ln 2 to the nearest integer n with the 1.5 * 2^23 trick (exact for |n| < 2^22).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // A NaN x (a NaN or infinite logit in the row) leaves n NaN, and converting NaN to an integer is
  // undefined; p is already NaN then, so any exponent keeps the result NaN.
  const int32_t biased = static_cast<int32_t>(n == n ? n : 0.0f) + 127;
  return p * BitsToFloat(static_cast<uint32_t>(biased) << 23);
#endif
}

// log(x) for x >= 0 (-inf at 0, NaN below, +inf at +inf). On the host Cephes's logf (about 1
// ulp): x = m 2^e with m in [sqrt(1/2), sqrt(2)) from the bits, a polynomial in m - 1, branch-free
// so that row loops vectorize; on the device CUDA's logf.
LOSSD_HD float Log(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  // Subnormal x is scaled by 2^23 first, so that its exponent bits mean what they say.
  const bool subnormal = x < 1.17549435e-38f;
  const float normal = subnormal ? x * 8388608.0f : x;
  const uint32_t bits = FloatBits(normal);
  float exponent = static_cast<float>(static_cast<int32_t>((bits >> 23) & 0xffu) - 127) -
                   (subnormal ? 23.0f : 0.0f);
  float m = BitsToFloat((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  exponent = high ? exponent + 1.0f : exponent;
  const float f = m - 1.0f;
  const float f2 = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * f2;
  y += -2.12194440e-4f * exponent;
  y += -0.5f * f2;
  // ln 2 split in two as in Exp, so that exponent * 0.693359375 is exact.
  const float r = (f + y) + 0.693359375f * exponent;
  const float special = x == 0.0f ? -INFINITY : (x > 0.0f ? INFINITY : NAN);
  return x > 0.0f && x < INFINITY ? r : special;
#endif
}

// max(m, x), keeping m when x is NaN: the step of a running max. Written as a select on x > m,
// which GCC vectorizes inside `omp simd reduction(max : m)` loops; std::max(m, x), the same value,
// leaves such a loop scalar, one dependent vmaxss per element (about 5x slower over a row).
LOSSD_HD float MaxStep(float m, float x) { return x > m ? x : m; }
// min(m, x) likewise, for `omp simd reduction(min : m)`.
LOSSD_HD float MinStep(float m, float x) { return x < m ? x : m; }

// a * b rounded to float before any use. The device compiler otherwise fuses a product with the
// add that follows it into one FMA where it sees fit, so two equal inputs scaled in two places
// (a student's and its own teacher's logits at tau) could differ in their last bit; computed
// this way they cannot, and a teacher that is the student gives log p == log q exactly.
LOSSD_HD float RoundedProduct(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): no overflow, vectorizable on the host.
LOSSD_HD float Tanh(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  const float ax = x < 0.0f ? -x : x;
  const float e = Exp(-2.0f * ax);
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
#endif
}

LOSSD_HD bool IsFinite(double x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// The soft cap and temperature of one call, resolved from LossOptions.
struct LogitTransform {
  float softcap = 0.0f;          // c, 0 = off
  float temperature = 1.0f;      // T
  float inv_temperature = 1.0f;  // 1 / T
  bool identity() const { return softcap == 0.0f && temperature == 1.0f; }
};

inline LogitTransform MakeLogitTransform(const LossOptions& options) {
  LogitTransform t;
  t.softcap = static_cast<float>(options.logit_softcap);
  t.temperature = static_cast<float>(options.temperature);
  t.inv_temperature = static_cast<float>(1.0 / options.temperature);
  return t;
}

// z = cap(a) / T.
LOSSD_HD float TransformLogit(float a, const LogitTransform& t) {
  if (t.softcap > 0.0f) a = t.softcap * Tanh(a / t.softcap);
  return a * t.inv_temperature;
}

// dz/da expressed through z itself, so the raw logit need not be kept: tanh(a / c) = z T / c.
LOSSD_HD float TransformDerivative(float z, const LogitTransform& t) {
  float d = t.inv_temperature;
  if (t.softcap > 0.0f) {
    const float th = z * t.temperature / t.softcap;
    d *= 1.0f - th * th;
  }
  return d;
}

// Running statistics of one row over the vocabulary columns seen so far. Two partial statistics
// over disjoint column sets merge exactly (up to rounding), so tiles, threads and shards combine in
// any fixed order.
struct RowStats {
  float max;              // m = max_v z_v
  float sum_exp;          // sum_v exp(z_v - m)
  float sum_exp_shifted;  // sum_v exp(z_v - m) (z_v - m) <= 0, for the entropy
  float sum_z;            // sum_v z_v, for label smoothing
  float target;           // z_y, from the tile that holds the label (0 elsewhere)
  int32_t argmax;         // lowest id among the maxima
};

LOSSD_HD RowStats EmptyRowStats() {
  RowStats s;
  s.max = -INFINITY;
  s.sum_exp = 0.0f;
  s.sum_exp_shifted = 0.0f;
  s.sum_z = 0.0f;
  s.target = 0.0f;
  s.argmax = -1;
  return s;
}

// Folds `other` into `into`: m = max(m1, m2), s = s1 e^(m1 - m) + s2 e^(m2 - m), and the shifted
// sum moves to the new max as t' = (t + (m_i - m) s_i) e^(m_i - m).
LOSSD_HD void MergeRowStats(RowStats& into, const RowStats& other) {
  into.sum_z += other.sum_z;
  into.target += other.target;
  if (other.argmax < 0) return;
  if (into.argmax < 0) {
    into.max = other.max;
    into.sum_exp = other.sum_exp;
    into.sum_exp_shifted = other.sum_exp_shifted;
    into.argmax = other.argmax;
    return;
  }
  const float m = into.max > other.max ? into.max : other.max;
  const float d_into = into.max - m;
  const float d_other = other.max - m;
  const float c_into = Exp(d_into);
  const float c_other = Exp(d_other);
  into.sum_exp_shifted = (into.sum_exp_shifted + d_into * into.sum_exp) * c_into +
                         (other.sum_exp_shifted + d_other * other.sum_exp) * c_other;
  into.sum_exp = into.sum_exp * c_into + other.sum_exp * c_other;
  if (other.max > into.max || (other.max == into.max && other.argmax < into.argmax)) {
    into.argmax = other.argmax;
  }
  into.max = m;
}

// Loss terms of one call, resolved from LossOptions.
struct LossTerms {
  double label_smoothing = 0.0;
  double z_loss_scale = 0.0;
  int64_t vocab_size = 0;
  Objective objective = Objective::kCrossEntropy;
  PolicyOptions policy;
};

inline LossTerms MakeLossTerms(const LossOptions& options, int64_t vocab_size) {
  LossTerms t;
  t.label_smoothing = options.label_smoothing;
  t.z_loss_scale = options.z_loss_scale;
  t.vocab_size = vocab_size;
  t.objective = options.objective;
  t.policy = options.policy;
  return t;
}

// A row's per-token inputs of the objectives (0 where the call has none).
struct RowInputs {
  double sampling_logprob = 0.0;    // q
  double advantage = 0.0;           // A
  double reference_logprob = 0.0;   // logp_ref
  double logprob_grad = 0.0;        // g of logprob_gradient
  double sequence_log_ratio = 0.0;  // log s of the row's sequence, under sequence_ratio
};

// An objective's term at logp, and its derivative d = dterm/dlogp.
struct ObjectiveTerm {
  double value = 0.0;
  double logprob_grad = 0.0;
  double ratio = 0.0;
  double ratio_slope = 0.0;  // dr/dlogp / r: 1, or 0 where the log-ratio clamp holds r
  ClipState clip = ClipState::kNone;
};

// The term of a non-cross-entropy objective (types.h). With r = e^(logp - q), dr/dlogp = r (and
// under sequence_ratio r = s, its sequence's, with the same dr/dlogp = r):
// importance sampling d = -r A; ppo d = -r A where the unclipped branch is taken and 0 where the
// clipped one or the dual-clip bound is (both constant in logp); cispo d = -clip(r) A, its weight
// held constant; dro d = -(A - beta (logp - q)); sapo d = -4 s (1 - s) r A.
LOSSD_HD ObjectiveTerm PolicyObjectiveTerm(Objective objective, double logprob, const RowInputs& in,
                                           const PolicyOptions& p) {
  ObjectiveTerm t;
  if (objective == Objective::kLogprobGradient) {
    t.value = in.logprob_grad * logprob;
    t.logprob_grad = in.logprob_grad;
    return t;
  }
  if (objective == Objective::kDro) {
    const double gap = logprob - in.sampling_logprob;
    t.value = -(in.advantage * logprob - 0.5 * p.dro_beta * gap * gap);
    t.logprob_grad = -(in.advantage - p.dro_beta * gap);
    return t;
  }
  const double a = in.advantage;
  double log_ratio = p.sequence_ratio ? in.sequence_log_ratio : logprob - in.sampling_logprob;
  // dr/dlogp = r, or 0 where the clamp holds r at e^(+-c) (torch.clamp's gradient).
  double r_slope = 1.0;
  if (p.log_ratio_clamp > 0.0 &&
      (log_ratio > p.log_ratio_clamp || log_ratio < -p.log_ratio_clamp)) {
    log_ratio = log_ratio > 0.0 ? p.log_ratio_clamp : -p.log_ratio_clamp;
    r_slope = 0.0;
  }
  const double r = std::exp(log_ratio);
  const double low = 1.0 - p.clip_low;
  const double high = 1.0 + p.clip_high;
  const double clipped = r < low ? low : (r > high ? high : r);
  t.ratio = r;
  t.ratio_slope = r_slope;
  switch (objective) {
    case Objective::kImportanceSampling:
      t.value = -r * a;
      t.logprob_grad = -r * a * r_slope;
      break;
    case Objective::kPpo: {
      const double unclipped_loss = -r * a;
      const double clipped_loss = -clipped * a;
      if (clipped_loss > unclipped_loss) {
        t.value = clipped_loss;
        t.clip = r > high ? ClipState::kHigh : ClipState::kLow;
      } else {
        t.value = unclipped_loss;
        t.logprob_grad = -r * a * r_slope;
      }
      const double dual_bound = -p.dual_clip * a;
      if (p.dual_clip > 0.0 && a < 0.0 && t.value > dual_bound) {
        t.value = dual_bound;
        t.logprob_grad = 0.0;
        t.clip = ClipState::kDual;
      }
      break;
    }
    case Objective::kCispo:
      t.value = -clipped * a * logprob;
      t.logprob_grad = -clipped * a;
      t.clip = r > high ? ClipState::kHigh : (r < low ? ClipState::kLow : ClipState::kNone);
      break;
    case Objective::kSapo: {
      // f(r) = (4 / tau) s, s = sigmoid(tau (r - 1)); df/dlogp = 4 s (1 - s) r.
      const double tau = a > 0.0 ? p.sapo_tau_positive : p.sapo_tau_negative;
      const double s = 1.0 / (1.0 + std::exp(-tau * (r - 1.0)));
      t.value = -(4.0 / tau) * s * a;
      t.logprob_grad = -4.0 * s * (1.0 - s) * r * a * r_slope;
      break;
    }
    default: break;
  }
  return t;
}

// KL_i by the estimator at logp, and dKL_i/dlogp (types.h: delta = logp_ref - logp).
struct KlTerm {
  double value = 0.0;
  double logprob_grad = 0.0;
};

LOSSD_HD KlTerm KlEstimate(KlEstimator estimator, double logprob, double reference_logprob) {
  const double delta = reference_logprob - logprob;
  KlTerm k;
  switch (estimator) {
    case KlEstimator::kK1:
      k.value = -delta;
      k.logprob_grad = 1.0;
      break;
    case KlEstimator::kK2:
      k.value = 0.5 * delta * delta;
      k.logprob_grad = -delta;
      break;
    case KlEstimator::kK3: {
      const double e = std::exp(delta);
      k.value = e - delta - 1.0;
      k.logprob_grad = 1.0 - e;
      break;
    }
    default: break;
  }
  return k;
}

struct RowResult {
  float lse;
  float logprob;  // 0 for ignored rows
  float loss;     // weighted; 0 for ignored rows
  float entropy;
  float ratio;  // of the policy objectives; 0 for ignored rows
  float kl;     // with a KL estimator; 0 for ignored rows
  ClipState clip;
  bool finite;  // the row's logits, statistics and terms were all finite
  // d = dL/dlogp of the policy term and beta KL, before the weight; 0 for ignored rows.
  double logprob_grad;
};

// What complete statistics say of a row, in double so that lse - z_y does not cancel badly.
struct RowSummary {
  double log_sum;  // log sum_v exp(z_v - m)
  double lse;
  double entropy;
  double mean_z;
  // z_y - lse; meaningful only where the row's label is in the vocabulary.
  double logprob;
};

// (1 - eps)(lse - z_y) + eps (lse - mean_v z_v): the label's cross-entropy with smoothing eps.
LOSSD_HD double RowCrossEntropy(const RowSummary& r, double label_smoothing) {
  return (1.0 - label_smoothing) * (-r.logprob) + label_smoothing * (r.lse - r.mean_z);
}

// z_y - lse of a row.
LOSSD_HD double RowLogprob(const RowStats& s) {
  return (static_cast<double>(s.target) - s.max) - std::log(static_cast<double>(s.sum_exp));
}

LOSSD_HD RowSummary SummarizeRow(const RowStats& s, int64_t vocab_size) {
  RowSummary r;
  r.log_sum = std::log(static_cast<double>(s.sum_exp));
  r.lse = static_cast<double>(s.max) + r.log_sum;
  r.entropy = r.log_sum - static_cast<double>(s.sum_exp_shifted) / s.sum_exp;
  r.mean_z = static_cast<double>(s.sum_z) / static_cast<double>(vocab_size);
  r.logprob = RowLogprob(s);
  return r;
}

// GSPO's log s = (1 / |C|) sum_{t in C} (logp_t - q_t) over a sequence's counted rows C (0 when
// none count): a sequence's rows add their terms in row order, then Value divides. The same
// sums on every backend, in double.
struct SequenceLogRatio {
  double sum = 0.0;
  int64_t counted = 0;
  LOSSD_HD void Add(const RowStats& stats, double sampling_logprob) {
    sum += RowLogprob(stats) - sampling_logprob;
    ++counted;
  }
  LOSSD_HD float Value() const {
    return counted > 0 ? static_cast<float>(sum / static_cast<double>(counted)) : 0.0f;
  }
};

// A row's results before its terms: its lse and entropy, the rest 0.
LOSSD_HD RowResult StartRowResult(const RowSummary& summary) {
  RowResult r;
  r.lse = static_cast<float>(summary.lse);
  r.entropy = static_cast<float>(summary.entropy);
  r.logprob = 0.0f;
  r.loss = 0.0f;
  r.ratio = 0.0f;
  r.kl = 0.0f;
  r.clip = ClipState::kNone;
  r.finite = true;
  r.logprob_grad = 0.0;
  return r;
}

// Per-row results from complete statistics.
LOSSD_HD RowResult FinishRow(const RowStats& s, bool counted, float weight, const LossTerms& terms,
                             const RowInputs& in) {
  const RowSummary summary = SummarizeRow(s, terms.vocab_size);
  const double lse = summary.lse;
  const double entropy = summary.entropy;
  const double mean_z = summary.mean_z;
  RowResult r = StartRowResult(summary);
  if (counted) {
    const double logprob = summary.logprob;
    double loss;
    ObjectiveTerm term;
    if (terms.objective == Objective::kCrossEntropy) {
      loss = RowCrossEntropy(summary, terms.label_smoothing) + terms.z_loss_scale * lse * lse;
    } else {
      term = PolicyObjectiveTerm(terms.objective, logprob, in, terms.policy);
      loss = term.value + terms.z_loss_scale * lse * lse;
      r.logprob_grad = term.logprob_grad;
      r.ratio = static_cast<float>(term.ratio);
      r.clip = term.clip;
    }
    if (terms.policy.kl_estimator != KlEstimator::kNone) {
      KlTerm kl = KlEstimate(terms.policy.kl_estimator, logprob, in.reference_logprob);
      if (terms.policy.kl_ratio_weighted) {
        // r KL_i, r = e^(logp - q): d(r k)/dlogp = r (dk/dlogp + slope k).
        kl.logprob_grad = term.ratio * (kl.logprob_grad + term.ratio_slope * kl.value);
        kl.value *= term.ratio;
      }
      r.kl = static_cast<float>(kl.value);
      if (terms.policy.kl_coef != 0.0) {
        loss += terms.policy.kl_coef * kl.value;
        r.logprob_grad += terms.policy.kl_coef * kl.logprob_grad;
      }
    }
    if (terms.policy.entropy_coef != 0.0) loss -= terms.policy.entropy_coef * entropy;
    r.logprob = static_cast<float>(logprob);
    r.loss = static_cast<float>(weight * loss);
  }
  // The ratio is an output too: a row whose r overflows fp32 (even where its term is clipped and
  // finite) is not answered with Inf.
  r.finite = IsFinite(lse) && IsFinite(mean_z) && IsFinite(entropy) && IsFinite(r.loss) &&
             IsFinite(r.logprob_grad) && IsFinite(r.ratio);
  return r;
}

// The per-row constants of dL/dz_v = p_v (scale_p + entropy_scale (z_v - lse)) - offset
// - label_term [v = y].
struct RowGradient {
  float lse;
  float scale_p;        // g (1 + 2 s lse) for cross-entropy; g (2 s lse - d + c_H H) in general
  float entropy_scale;  // g c_H
  float offset;         // g eps / V
  float label_term;     // g (1 - eps) for cross-entropy; g (1 - eps - d) in general
  int64_t label;        // -1 when the row is ignored
};

// g = weight * multiplier, where the multiplier holds the reduction's scale and grad_scale.
LOSSD_HD RowGradient MakeRowGradient(const RowResult& row, int64_t label, bool counted,
                                     float weight, double multiplier, const LossTerms& terms) {
  RowGradient r;
  const double g = counted ? static_cast<double>(weight) * multiplier : 0.0;
  const bool cross_entropy = terms.objective == Objective::kCrossEntropy;
  const double lse = row.lse;
  const double d = row.logprob_grad;
  const double entropy_coef = terms.policy.entropy_coef;
  double p_factor = (cross_entropy ? 1.0 : 0.0) + 2.0 * terms.z_loss_scale * lse;
  double label_factor = cross_entropy ? 1.0 - terms.label_smoothing : 0.0;
  if (d != 0.0 || entropy_coef != 0.0) {
    p_factor += entropy_coef * static_cast<double>(row.entropy) - d;
    label_factor -= d;
  }
  r.lse = row.lse;
  r.scale_p = static_cast<float>(g * p_factor);
  r.entropy_scale = static_cast<float>(g * entropy_coef);
  r.offset =
      cross_entropy
          ? static_cast<float>(g * terms.label_smoothing / static_cast<double>(terms.vocab_size))
          : 0.0f;
  r.label_term = static_cast<float>(g * label_factor);
  r.label = counted ? label : -1;
  return r;
}

// dL/da for one logit; the one-hot term is applied in fp32 whatever the input dtype.
LOSSD_HD float LogitGradient(float z, bool is_label, const RowGradient& g,
                             const LogitTransform& t) {
  const float dz = g.scale_p * Exp(z - g.lse) - g.offset - (is_label ? g.label_term : 0.0f);
  return dz * TransformDerivative(z, t);
}

// The same with the entropy bonus's factor, for rows whose entropy_scale is not 0.
LOSSD_HD float EntropyLogitGradient(float z, bool is_label, const RowGradient& g,
                                    const LogitTransform& t) {
  const float shifted = z - g.lse;  // log p_v
  const float dz = (g.scale_p + g.entropy_scale * shifted) * Exp(shifted) - g.offset -
                   (is_label ? g.label_term : 0.0f);
  return dz * TransformDerivative(z, t);
}

// max_v |dL/da_v| <= (|scale_p| + |entropy_scale| / e + |offset| + |label_term|) / T, since
// 0 <= p_v <= 1, p_v |log p_v| <= 1 / e, and the soft cap's factor 1 - tanh^2 is at most 1.
LOSSD_HD double LogitGradientBound(const RowGradient& g, const LogitTransform& t) {
  constexpr double kMaxPLogP = 0.36787944117144233;  // max_p p |log p| = 1 / e
  return (std::fabs(static_cast<double>(g.scale_p)) +
          std::fabs(static_cast<double>(g.entropy_scale)) * kMaxPLogP +
          std::fabs(static_cast<double>(g.offset)) + std::fabs(static_cast<double>(g.label_term))) *
         static_cast<double>(t.inv_temperature);
}

// The same dL/da from e_v = exp(z_v - m), which a statistics pass over the whole row can leave in
// place: p_v = e_v / sum_exp, so scale_p p_v = exp_scale e_v with exp_scale = scale_p / sum_exp,
// and no second exp is needed. Only without a soft cap, where dz/da = 1 / T does not depend on z.
LOSSD_HD float ExpGradientScale(const RowGradient& g, float sum_exp) {
  return static_cast<float>(static_cast<double>(g.scale_p) / sum_exp);
}

LOSSD_HD float LogitGradientFromExp(float e, bool is_label, const RowGradient& g, float exp_scale,
                                    const LogitTransform& t) {
  const float dz = exp_scale * e - g.offset - (is_label ? g.label_term : 0.0f);
  return dz * t.inv_temperature;
}

// A power of two S with |S dL/da| < 2^max_exponent wherever |dL/da| <= bound, for carrying dL/da
// in 16 bits: fp16's largest value is about 2^16, and bf16's range is fp32's. Multiplying and
// dividing by a power of two is exact. A bound that is 0, not finite or NaN gives 1; S and 1/S
// stay normal floats.
LOSSD_HD float GradientSplitScale(double bound, int max_exponent) {
  if (!(bound > 0.0) || !IsFinite(bound)) return 1.0f;
  int exponent = 0;
  frexp(bound, &exponent);  // bound < 2^exponent
  int e = max_exponent - exponent;
  e = e < -126 ? -126 : (e > 126 ? 126 : e);
  return ldexpf(1.0f, e);
}

// A call's per-row inputs (BatchInputs) as pointers into host or device memory, null where the
// call has none; row indices are the pointers' own.
struct RowInputArrays {
  const int64_t* labels = nullptr;  // null: no labels, and every row counts
  const float* token_weights = nullptr;
  const float* sampling_logprobs = nullptr;
  const float* advantages = nullptr;
  const float* reference_logprobs = nullptr;
  const float* logprob_grads = nullptr;
  const double* reduction_scales = nullptr;    // a sequence reduction's per-row factors
  const float* sequence_log_ratios = nullptr;  // sequence_ratio: log s of each row's sequence
};

// What finishing any row of a call needs beside its own inputs, resolved once from its options.
struct RowFinishConstants {
  LossTerms terms;
  LogitTransform transform;
  int64_t ignore_index = -100;
  double multiplier = 1.0;  // every row's gradient factor under a token-level reduction
  double grad_scale = 1.0;  // a sequence reduction's rows: grad_scale times the row's factor
  bool sequence_reduction = false;
};

LOSSD_HD bool RowCounted(const RowInputArrays& a, const RowFinishConstants& c, int64_t row) {
  return a.labels == nullptr || a.labels[row] != c.ignore_index;
}
LOSSD_HD int64_t RowLabel(const RowInputArrays& a, int64_t row) {
  return a.labels != nullptr ? a.labels[row] : -1;
}
LOSSD_HD float RowWeight(const RowInputArrays& a, int64_t row) {
  return a.token_weights != nullptr ? a.token_weights[row] : 1.0f;
}
// g / w: the reduction's scale and grad_scale.
LOSSD_HD double RowMultiplier(const RowInputArrays& a, const RowFinishConstants& c, int64_t row) {
  return c.sequence_reduction ? c.grad_scale * a.reduction_scales[row] : c.multiplier;
}
LOSSD_HD RowInputs RowInputsAt(const RowInputArrays& a, int64_t row) {
  RowInputs in;
  in.sampling_logprob = a.sampling_logprobs != nullptr ? a.sampling_logprobs[row] : 0.0;
  in.advantage = a.advantages != nullptr ? a.advantages[row] : 0.0;
  in.reference_logprob = a.reference_logprobs != nullptr ? a.reference_logprobs[row] : 0.0;
  in.logprob_grad = a.logprob_grads != nullptr ? a.logprob_grads[row] : 0.0;
  in.sequence_log_ratio = a.sequence_log_ratios != nullptr ? a.sequence_log_ratios[row] : 0.0;
  return in;
}

// Row `row`'s results from its complete statistics, and its gradient constants: what every
// backend does with a row once its statistics are complete (the CPU on the host, the GPU on the
// device), from the same formulas.
LOSSD_HD RowResult FinishRowAt(const RowInputArrays& a, const RowFinishConstants& c, int64_t row,
                               const RowStats& stats) {
  return FinishRow(stats, RowCounted(a, c, row), RowWeight(a, row), c.terms, RowInputsAt(a, row));
}
LOSSD_HD RowGradient RowGradientAt(const RowInputArrays& a, const RowFinishConstants& c,
                                   int64_t row, const RowResult& result) {
  return MakeRowGradient(result, RowLabel(a, row), RowCounted(a, c, row), RowWeight(a, row),
                         RowMultiplier(a, c, row), c.terms);
}

// D of the mean: the caller's whole-batch count when given, else this call's counted rows.
inline double MeanDenominator(const LossOptions& options, int64_t counted_rows) {
  return options.mean_denominator > 0 ? options.mean_denominator
                                      : static_cast<double>(counted_rows);
}

// The factor every row's gradient is multiplied by: grad_scale / D for the mean, grad_scale else
// (a sequence reduction multiplies it by each row's own factor).
// A mean over zero counted rows is defined as 0 with a zero gradient (torch returns NaN there).
inline double GradientMultiplier(const LossOptions& options, int64_t counted_rows) {
  if (options.reduction != Reduction::kMean) return options.grad_scale;
  const double denominator = MeanDenominator(options, counted_rows);
  return denominator > 0 ? options.grad_scale / denominator : 0.0;
}

// The reduced loss of a token-level reduction; a sequence reduction's is the sum of its rows'
// scaled losses.
inline double ReducedLoss(const LossOptions& options, double loss_sum, int64_t counted_rows) {
  if (options.reduction != Reduction::kMean) return loss_sum;
  const double denominator = MeanDenominator(options, counted_rows);
  return denominator > 0 ? loss_sum / denominator : 0.0;
}

// A call's RowFinishConstants, from its options and its count of counted rows.
inline RowFinishConstants MakeRowFinishConstants(const LossOptions& options, int64_t vocab_size,
                                                 int64_t counted_rows) {
  RowFinishConstants c;
  c.terms = MakeLossTerms(options, vocab_size);
  c.transform = MakeLogitTransform(options);
  c.ignore_index = options.ignore_index;
  c.multiplier = GradientMultiplier(options, counted_rows);
  c.grad_scale = options.grad_scale;
  c.sequence_reduction = IsSequenceReduction(options.reduction);
  return c;
}

// Loads element i of a tensor of the given dtype as fp32.
LOSSD_HD float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat16: return Float16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

LOSSD_HD void StoreFromFloat(void* data, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = FloatToBFloat16(value); break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = FloatToFloat16(value); break;
    default: static_cast<float*>(data)[i] = value; break;
  }
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_LOSS_MATH_H_
