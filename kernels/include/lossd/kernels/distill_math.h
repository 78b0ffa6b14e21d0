// Scalar math of the distill objective (types.h, DistillOptions), shared by the CPU and CUDA
// backends as loss_math.h is.
//
// Per row, with u = z / tau the student's and t = z_t / tau the teacher's logits at the
// distillation temperature, log q_v = u_v - lse(u), log p_v = t_v - lse(t):
//   forward KL  D = sum_v p_v (log p_v - log q_v)
//               dD/du_v = q_v - p_v
//   reverse KL  D = sum_v q_v (log q_v - log p_v) = K
//               dD/du_v = q_v (log q_v - log p_v - K)
//   JSD         D = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
//               dD/du_v = (1 - beta) q_v (log q_v - log m_v - K),  K = KL(q || m)
// and KD = tau^2 D, so dKD/dz_v = tau dD/du_v. The row scalar K needs every column's log m_v, which
// no running statistic gives, hence three phases over a row's columns, each ending in per-row sums
// that merge across tiles (and, one day, across vocabulary shards):
//   1. statistics: max and sum-exp of u and of t (LseStats), beside the student's RowStats;
//   2. terms: sum_v of D's and K's summands given both lse (DistillElementTerms);
//   3. gradients: dL/da_v given D's row constants and K (DistillLogitGradient).
// log m_v is taken as log q_v + log(m_v / q_v) or log p_v + log(m_v / p_v), whichever of p_v, q_v
// is larger, with log(m / A) = log(a + b e^-|log p - log q|) (MixtureLogRatios): no exp underflows
// to a log of 0, and where p_v = q_v it is exactly log q_v, so that a teacher identical to the
// student gives D = 0 and a zero gradient exactly.
//
// A sparse teacher with a tail bucket (SparseTeacherMass::kTailBucket) gives its top-k S their
// probabilities and the rest one bucket, p_tail = 1 - sum_S p_v; the student's bucket is
// q_tail = sum_{v not in S} q_v, and D is taken over the k + 1 buckets. That is the dense D against
// a teacher p'_v = p_tail q_v / q_tail outside S (whose log-ratio to q, and to m, is constant
// there), and since sum_{v not in S} p'_v = p_tail is fixed, the dense gradient with p' held fixed
// is D's. So the columns outside S add nothing in phase 2: the bucket's terms are added once per
// row from log q_tail, whose statistics (of u over the columns outside S) phase 1 keeps beside the
// others, so that a q_tail far below 2^-126 still has its logarithm. In phase 3 a column v outside
// S has dD/du_v = q_v s_tail - exp(log q_v + l_tail), with the row constants
//   forward KL  s_tail = 1, l_tail = log p_tail - log q_tail: q_v - p'_v, with p'_v taken as
//               exp(log q_v + l_tail) <= p_tail where p_tail / q_tail alone would overflow
//   reverse KL  s_tail = log q_tail - log p_tail - K, l_tail = -inf
//   JSD         s_tail = (1 - beta) (log q_tail - log m_tail - K), l_tail = -inf,
//               m_tail = beta p_tail + (1 - beta) q_tail
#ifndef LOSSD_KERNELS_DISTILL_MATH_H_
#define LOSSD_KERNELS_DISTILL_MATH_H_

#include <cmath>
#include <cstdint>

#include "lossd/kernels/host_device.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/types.h"

namespace lossd {

// Which of D_beta's three forms a call computes: beta 0 and 1 are the two KLs (types.h).
enum class DivergenceKind : int32_t { kForwardKl = 0, kReverseKl = 1, kJsd = 2 };

LOSSD_HD DivergenceKind DivergenceOf(double beta) {
  return beta == 0.0 ? DivergenceKind::kForwardKl
                     : (beta == 1.0 ? DivergenceKind::kReverseKl : DivergenceKind::kJsd);
}

// Running statistics of the values x_v seen so far: m = max_v x_v, sum_v exp(x_v - m) (merged as
// RowStats' are), and min_v x_v, which bounds the reverse KL's gradient. Empty: m = -inf, sum 0.
// A NaN value leaves the sum NaN; columns at -inf add nothing (a sparse teacher's outside its
// top-k).
struct LseStats {
  float max;
  float sum_exp;
  float min;
};

LOSSD_HD LseStats EmptyLseStats() {
  LseStats s;
  s.max = -INFINITY;
  s.sum_exp = 0.0f;
  s.min = INFINITY;
  return s;
}

LOSSD_HD void MergeLseStats(LseStats& into, const LseStats& other) {
  into.min = MinStep(into.min, other.min);
  const float m = into.max > other.max ? into.max : other.max;
  if (m == -INFINITY) {  // both hold only -inf columns, or none: nothing to rescale
    into.sum_exp += other.sum_exp;
    return;
  }
  into.sum_exp = into.sum_exp * Exp(into.max - m) + other.sum_exp * Exp(other.max - m);
  into.max = m;
}

// lse = m + log sum_v exp(x_v - m), in double.
LOSSD_HD double LseOf(const LseStats& s) {
  return static_cast<double>(s.max) + std::log(static_cast<double>(s.sum_exp));
}

// The distill statistics of a row beside the student's RowStats (which hold z at the student's
// own temperature, for the cross-entropy and the outputs): u's and t's.
struct DistillStats {
  LseStats student;       // of u = z / tau
  LseStats teacher;       // of t = z_t / tau, a tail bucket's log p_tail among them
  LseStats student_tail;  // of u over the columns outside a tail-bucket teacher's top-k
  float teacher_tail;     // log p_tail of a tail-bucket teacher; -inf without one
  // The least of a tail-bucket teacher's top-k log-probabilities and log p_tail: teacher.min
  // counts the -inf of the columns that are the bucket's.
  float teacher_floor;
};

LOSSD_HD DistillStats EmptyDistillStats() {
  DistillStats s;
  s.student = EmptyLseStats();
  s.teacher = EmptyLseStats();
  s.student_tail = EmptyLseStats();
  s.teacher_tail = -INFINITY;
  s.teacher_floor = -INFINITY;
  return s;
}

// What a sparse teacher's row gives the tokens outside its top-k, from its log-probabilities:
// rest_logit fills them in the teacher's logits tile, tail_logit is log p_tail for a tail bucket.
struct SparseTeacherRow {
  // log((1 - sum_j p_j) / (V - k)) (spread); -inf otherwise, or when nothing is left.
  float rest_logit;
  // log(1 - sum_j p_j) (tail bucket); -inf otherwise, when nothing is left, or when no token is
  // outside the top-k (k = V: the bucket is empty on both sides).
  float tail_logit;
  // The least of the top-k log-probabilities and tail_logit (spread and tail bucket; +inf for a
  // renormalized teacher, which no bound reads: its reverse KL is refused).
  float floor_logit;
};

// In double.
LOSSD_HD SparseTeacherRow SparseTeacherRowOf(const float* logprobs, int k, int64_t vocab_size,
                                             SparseTeacherMass mass) {
  SparseTeacherRow row;
  row.rest_logit = -INFINITY;
  row.tail_logit = -INFINITY;
  row.floor_logit = INFINITY;
  if (mass == SparseTeacherMass::kRenormalize) return row;
  double top_mass = 0.0;
  for (int j = 0; j < k; ++j) {
    top_mass += std::exp(static_cast<double>(logprobs[j]));
    row.floor_logit = MinStep(row.floor_logit, logprobs[j]);
  }
  const double rest = 1.0 - top_mass;
  if (vocab_size <= k || !(rest > 0.0)) return row;
  if (mass == SparseTeacherMass::kSpread) {
    row.rest_logit = static_cast<float>(std::log(rest / static_cast<double>(vocab_size - k)));
  } else {
    row.tail_logit = static_cast<float>(std::log(rest));
    row.floor_logit = MinStep(row.floor_logit, row.tail_logit);
  }
  return row;
}

// A sparse teacher's row's statistics before its first tile: a tail bucket is one of its values.
LOSSD_HD DistillStats StartDistillStats(const SparseTeacherRow& row) {
  DistillStats s = EmptyDistillStats();
  s.teacher_tail = row.tail_logit;
  s.teacher_floor = row.floor_logit;
  if (row.tail_logit > -INFINITY) {
    s.teacher.max = row.tail_logit;
    s.teacher.sum_exp = 1.0f;
    s.teacher.min = row.tail_logit;
  }
  return s;
}

// Tiles of the same row; teacher_tail is the row's and stays.
LOSSD_HD void MergeDistillStats(DistillStats& into, const DistillStats& other) {
  MergeLseStats(into.student, other.student);
  MergeLseStats(into.teacher, other.teacher);
  MergeLseStats(into.student_tail, other.student_tail);
}

// What phases 2 and 3 read of a row's columns once its statistics are complete.
struct DistillRowConstants {
  float inv_tau;
  float student_lse;     // lse(u)
  float teacher_lse;     // lse(t)
  float beta;            // p's weight in m
  float one_minus_beta;  // q's weight in m, rounded from 1 - beta in double
  DivergenceKind kind;
  // A tail-bucket teacher: columns outside its top-k (teacher logit -inf) are the bucket's.
  bool tail_bucket;
  float log_teacher_tail;  // log p_tail
  float log_student_tail;  // log q_tail
};

// The teacher head's soft cap and temperature (DistillOptions) as a LogitTransform.
inline LogitTransform MakeTeacherTransform(const LossOptions& options) {
  LossOptions teacher;
  teacher.logit_softcap = options.distill.teacher_logit_softcap;
  teacher.temperature = options.distill.teacher_temperature;
  return MakeLogitTransform(teacher);
}

LOSSD_HD DistillRowConstants MakeDistillRowConstants(const DistillStats& s,
                                                     const DistillOptions& options) {
  DistillRowConstants c;
  c.inv_tau = static_cast<float>(1.0 / options.temperature);
  c.student_lse = static_cast<float>(LseOf(s.student));
  c.teacher_lse = static_cast<float>(LseOf(s.teacher));
  c.beta = static_cast<float>(options.beta);
  c.one_minus_beta = static_cast<float>(1.0 - options.beta);
  c.kind = DivergenceOf(options.beta);
  c.tail_bucket = options.sparse_mass == SparseTeacherMass::kTailBucket;
  c.log_teacher_tail = static_cast<float>(static_cast<double>(s.teacher_tail) - LseOf(s.teacher));
  c.log_student_tail = static_cast<float>(LseOf(s.student_tail) - LseOf(s.student));
  return c;
}

// log p_v - log m_v and log q_v - log m_v. With A the larger of p_v, q_v, B the other, a and b
// their weights in m (a + b = 1) and e = B / A = exp(-|log p - log q|) in (0, 1]:
// log(m / A) = log(a + b e) = log1p(b (e - 1)). log1p(x) = log(u) x / (u - 1), u = 1 + x, is
// accurate near 0 (and exactly 0 at e = 1); where u < 1/2, log(a + b e) directly is.
struct MixtureLogRatios {
  float teacher;  // log p - log m
  float student;  // log q - log m
};

LOSSD_HD MixtureLogRatios MixtureRatios(float log_p, float log_q, const DistillRowConstants& c) {
  const float d = log_p - log_q;
  const bool teacher_larger = d > 0.0f;
  const float b = teacher_larger ? c.one_minus_beta : c.beta;  // the smaller one's weight
  const float a = teacher_larger ? c.beta : c.one_minus_beta;
  const float e = Exp(teacher_larger ? -d : d);
  const float x = b * (e - 1.0f);
  const float u = 1.0f + x;
  const float near_one = u == 1.0f ? x : Log(u) * (x / (u - 1.0f));
  const float log_m_over_a = u < 0.5f ? Log(a + b * e) : near_one;
  const float below = (teacher_larger ? -d : d) - log_m_over_a;  // log B - log m
  MixtureLogRatios r;
  r.teacher = teacher_larger ? -log_m_over_a : below;
  r.student = teacher_larger ? below : -log_m_over_a;
  return r;
}

// One column's summands of D and of K (phase 2). Columns where the teacher has no mass (a sparse
// teacher's outside its top-k, renormalized) add nothing to p log p.
struct DistillSummands {
  float divergence;
  float k;
};

// kTailBucket: c.tail_bucket, a template argument so that the other calls' loops carry no test
// of it per element.
template <DivergenceKind kKind, bool kTailBucket = false>
LOSSD_HD DistillSummands DistillElementTerms(float z, float z_teacher,
                                             const DistillRowConstants& c) {
  const float log_q = RoundedProduct(z, c.inv_tau) - c.student_lse;
  const float log_p = RoundedProduct(z_teacher, c.inv_tau) - c.teacher_lse;
  const bool teacher_mass = log_p > -INFINITY;
  DistillSummands s;
  if constexpr (kTailBucket) {
    if (!teacher_mass) {  // the bucket's, added per row (FinishDistillRow)
      s.divergence = 0.0f;
      s.k = 0.0f;
      return s;
    }
  }
  if constexpr (kKind == DivergenceKind::kForwardKl) {
    s.divergence = teacher_mass ? Exp(log_p) * (log_p - log_q) : 0.0f;
    s.k = 0.0f;
  } else if constexpr (kKind == DivergenceKind::kReverseKl) {
    s.divergence = Exp(log_q) * (log_q - log_p);
    s.k = s.divergence;
  } else {
    const MixtureLogRatios r = MixtureRatios(log_p, log_q, c);
    const float student = Exp(log_q) * r.student;
    s.divergence =
        (teacher_mass ? c.beta * Exp(log_p) * r.teacher : 0.0f) + c.one_minus_beta * student;
    s.k = student;
  }
  return s;
}

// A row's sums of phase 2, in double.
struct DistillRowTerms {
  double divergence;  // D
  double k;           // K (reverse KL and JSD)
};

// A distill row's results (RowResult's loss is the whole weighted loss).
struct DistillRowResult {
  RowResult row;
  float kd;          // tau^2 D; 0 for ignored rows
  float ce;          // the label's cross-entropy; 0 for ignored rows and without labels
  float k;           // K, for the gradient
  float tail_scale;  // s_tail and l_tail of a tail bucket (the header's)
  float tail_shift;
  // max_v |dD/du_v| over the row: 1 (forward), 1/e + 2 (lse(t) - min t) (reverse: q |log q| <=
  // 1/e, q |log p| and K at most lse(t) - min t), (1 - beta)(max(1/e, L) + L) with
  // L = -log(1 - beta) (JSD: |log q - log m| <= L above and q log(q / m) >= q log q >= -1/e).
  double gradient_bound;
};

// log(e^a + e^b) in double; -inf when both are.
LOSSD_HD double LogAddExp(double a, double b) {
  const double m = a > b ? a : b;
  if (m == -INFINITY) return -INFINITY;
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

// A tail bucket's part of a row: its summands of D and K, and s_tail (the header's), from
// log p_tail and log q_tail; K is the row's whole K, the bucket's included.
struct TailBucketTerms {
  double divergence;
  double k;
};

LOSSD_HD TailBucketTerms TailBucketTermsOf(const DistillRowConstants& c) {
  const double log_p = c.log_teacher_tail;
  const double log_q = c.log_student_tail;
  const double p = std::exp(log_p);
  const double q = std::exp(log_q);
  TailBucketTerms t{0.0, 0.0};
  switch (c.kind) {
    case DivergenceKind::kForwardKl:
      if (p > 0.0) t.divergence = p * (log_p - log_q);
      break;
    case DivergenceKind::kReverseKl:
      if (q > 0.0) t.divergence = q * (log_q - log_p);
      t.k = t.divergence;
      break;
    default: {
      const double beta = c.beta;
      const double log_m = LogAddExp(std::log(beta) + log_p, std::log1p(-beta) + log_q);
      if (p > 0.0) t.divergence += beta * p * (log_p - log_m);
      if (q > 0.0) {
        t.k = q * (log_q - log_m);
        t.divergence += (1.0 - beta) * t.k;
      }
    }
  }
  return t;
}

LOSSD_HD double TailBucketScale(const DistillRowConstants& c, double k) {
  const double log_p = c.log_teacher_tail;
  const double log_q = c.log_student_tail;
  if (!(log_q > -INFINITY)) return 0.0;  // no column is the bucket's
  switch (c.kind) {
    case DivergenceKind::kForwardKl: return 1.0;
    case DivergenceKind::kReverseKl: return log_q - log_p - k;
    default: {
      const double beta = c.beta;
      const double log_m = LogAddExp(std::log(beta) + log_p, std::log1p(-beta) + log_q);
      return (1.0 - beta) * (log_q - log_m - k);
    }
  }
}

// The row's results from its complete statistics, constants and terms. `has_label` is false for
// rows of a call without labels (they count, without a cross-entropy); `dense_teacher` flags a -inf
// teacher logit (an overflow) as non-finite, as the student's are.
LOSSD_HD DistillRowResult FinishDistillRow(const RowStats& s, const DistillStats& ds,
                                           const DistillRowConstants& c, DistillRowTerms terms,
                                           bool counted, bool has_label, float weight,
                                           const LossTerms& loss, const DistillOptions& options,
                                           bool dense_teacher) {
  const RowSummary summary = SummarizeRow(s, loss.vocab_size);
  const double tau = options.temperature;
  DistillRowResult r;
  r.row = StartRowResult(summary);
  RowResult& row = r.row;
  r.kd = 0.0f;
  r.ce = 0.0f;
  r.tail_scale = 0.0f;
  r.tail_shift = -INFINITY;
  if (c.tail_bucket) {
    const TailBucketTerms tail = TailBucketTermsOf(c);
    terms.divergence += tail.divergence;
    terms.k += tail.k;
    r.tail_scale = static_cast<float>(TailBucketScale(c, terms.k));
    if (c.kind == DivergenceKind::kForwardKl && c.log_student_tail > -INFINITY) {
      r.tail_shift = c.log_teacher_tail - c.log_student_tail;
    }
  }
  r.k = static_cast<float>(terms.k);
  const double kd = tau * tau * terms.divergence;
  if (counted) {
    double ce = 0.0;
    if (has_label) {
      row.logprob = static_cast<float>(summary.logprob);
      ce = RowCrossEntropy(summary, loss.label_smoothing);
    }
    const double term = options.alpha * ce + (1.0 - options.alpha) * kd +
                        loss.z_loss_scale * summary.lse * summary.lse;
    row.loss = static_cast<float>(weight * term);
    r.kd = static_cast<float>(kd);
    r.ce = static_cast<float>(ce);
  }
  constexpr double kInvE = 0.36787944117144233;
  switch (DivergenceOf(options.beta)) {
    case DivergenceKind::kForwardKl: r.gradient_bound = 1.0; break;
    case DivergenceKind::kReverseKl: {
      const float lowest = c.tail_bucket ? ds.teacher_floor : ds.teacher.min;
      r.gradient_bound = kInvE + 2.0 * (LseOf(ds.teacher) - static_cast<double>(lowest));
      break;
    }
    default: {
      const double l = -std::log1p(-options.beta);
      r.gradient_bound = (1.0 - options.beta) * ((l > kInvE ? l : kInvE) + l);
    }
  }
  const bool teacher_finite =
      IsFinite(LseOf(ds.teacher)) && !(dense_teacher && ds.teacher.min == -INFINITY);
  row.finite = IsFinite(summary.lse) && IsFinite(summary.mean_z) && IsFinite(summary.entropy) &&
               IsFinite(LseOf(ds.student)) && teacher_finite && IsFinite(terms.divergence) &&
               IsFinite(terms.k) && IsFinite(row.loss);
  return r;
}

// The per-row constants of a distill row's dL/dz_v = ce.scale_p exp(z_v - lse) - ce.offset
// - ce.label_term [v = y] + kd_scale dD/du_v: the cross-entropy's part (alpha CE and the z-loss,
// as in RowGradient) and the divergence's.
struct DistillRowGradient {
  RowGradient ce;
  DistillRowConstants c;
  float kd_scale;  // g (1 - alpha) tau
  float k;
  float tail_scale;  // DistillRowResult's
  float tail_shift;
};

// g = weight * multiplier (the reduction's scale and grad_scale), as for MakeRowGradient.
LOSSD_HD DistillRowGradient MakeDistillRowGradient(const DistillRowResult& r,
                                                   const DistillRowConstants& c, int64_t label,
                                                   bool counted, float weight, double multiplier,
                                                   const LossTerms& loss,
                                                   const DistillOptions& options) {
  const double g = counted ? static_cast<double>(weight) * multiplier : 0.0;
  const double alpha = options.alpha;
  const double lse = r.row.lse;
  DistillRowGradient d;
  d.ce.lse = r.row.lse;
  d.ce.scale_p = static_cast<float>(g * (alpha + 2.0 * loss.z_loss_scale * lse));
  d.ce.entropy_scale = 0.0f;
  d.ce.offset =
      static_cast<float>(g * alpha * loss.label_smoothing / static_cast<double>(loss.vocab_size));
  d.ce.label_term = static_cast<float>(g * alpha * (1.0 - loss.label_smoothing));
  d.ce.label = counted ? label : -1;
  d.c = c;
  d.kd_scale = static_cast<float>(g * (1.0 - alpha) * options.temperature);
  d.k = r.k;
  d.tail_scale = r.tail_scale;
  d.tail_shift = r.tail_shift;
  return d;
}

// FinishDistillRow and MakeDistillRowGradient of row `row` of a call (RowFinishConstants and
// RowInputArrays as in loss_math.h), on the host or the device.
LOSSD_HD DistillRowResult FinishDistillRowAt(const RowInputArrays& a, const RowFinishConstants& c,
                                             const DistillOptions& options, bool dense_teacher,
                                             int64_t row, const RowStats& stats,
                                             const DistillStats& distill,
                                             const DistillRowConstants& constants,
                                             const DistillRowTerms& terms) {
  return FinishDistillRow(stats, distill, constants, terms, RowCounted(a, c, row),
                          a.labels != nullptr, RowWeight(a, row), c.terms, options, dense_teacher);
}
LOSSD_HD DistillRowGradient DistillRowGradientAt(const RowInputArrays& a,
                                                 const RowFinishConstants& c,
                                                 const DistillOptions& options, int64_t row,
                                                 const DistillRowResult& result,
                                                 const DistillRowConstants& constants) {
  return MakeDistillRowGradient(result, constants, RowLabel(a, row), RowCounted(a, c, row),
                                RowWeight(a, row), RowMultiplier(a, c, row), c.terms, options);
}

// dD/du_v of one column (phase 3); kTailBucket as for DistillElementTerms.
template <DivergenceKind kKind, bool kTailBucket = false>
LOSSD_HD float DivergenceGradient(float z, float z_teacher, const DistillRowGradient& g) {
  const DistillRowConstants& c = g.c;
  const float log_q = RoundedProduct(z, c.inv_tau) - c.student_lse;
  const float log_p = RoundedProduct(z_teacher, c.inv_tau) - c.teacher_lse;
  if constexpr (kTailBucket) {
    if (!(log_p > -INFINITY)) return Exp(log_q) * g.tail_scale - Exp(log_q + g.tail_shift);
  }
  if constexpr (kKind == DivergenceKind::kForwardKl) {
    return Exp(log_q) - Exp(log_p);
  } else if constexpr (kKind == DivergenceKind::kReverseKl) {
    return Exp(log_q) * (log_q - log_p - g.k);
  } else {
    return c.one_minus_beta * Exp(log_q) * (MixtureRatios(log_p, log_q, c).student - g.k);
  }
}

// dL/da_v of one student logit; the one-hot term in fp32 as for cross-entropy.
template <DivergenceKind kKind, bool kTailBucket = false>
LOSSD_HD float DistillLogitGradient(float z, float z_teacher, bool is_label,
                                    const DistillRowGradient& g, const LogitTransform& t) {
  const float ce =
      g.ce.scale_p * Exp(z - g.ce.lse) - g.ce.offset - (is_label ? g.ce.label_term : 0.0f);
  const float dz = ce + g.kd_scale * DivergenceGradient<kKind, kTailBucket>(z, z_teacher, g);
  return dz * TransformDerivative(z, t);
}

template <bool kTailBucket>
LOSSD_HD float DistillLogitGradientOfKind(float z, float z_teacher, bool is_label,
                                          const DistillRowGradient& g, const LogitTransform& t) {
  switch (g.c.kind) {
    case DivergenceKind::kForwardKl:
      return DistillLogitGradient<DivergenceKind::kForwardKl, kTailBucket>(z, z_teacher, is_label,
                                                                           g, t);
    case DivergenceKind::kReverseKl:
      return DistillLogitGradient<DivergenceKind::kReverseKl, kTailBucket>(z, z_teacher, is_label,
                                                                           g, t);
    default:
      return DistillLogitGradient<DivergenceKind::kJsd, kTailBucket>(z, z_teacher, is_label, g, t);
  }
}

// The row's divergence and tail bucket resolved at run time, for single elements.
LOSSD_HD float DistillLogitGradientOf(float z, float z_teacher, bool is_label,
                                      const DistillRowGradient& g, const LogitTransform& t) {
  return g.c.tail_bucket ? DistillLogitGradientOfKind<true>(z, z_teacher, is_label, g, t)
                         : DistillLogitGradientOfKind<false>(z, z_teacher, is_label, g, t);
}

// max_v |dL/da_v| <= (|scale_p| + |offset| + |label_term| + |kd_scale| max_v |dD/du_v|) / T.
LOSSD_HD double DistillLogitGradientBound(const DistillRowGradient& g, double divergence_bound,
                                          const LogitTransform& t) {
  return LogitGradientBound(g.ce, t) + std::fabs(static_cast<double>(g.kd_scale)) *
                                           divergence_bound *
                                           static_cast<double>(t.inv_temperature);
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_DISTILL_MATH_H_
