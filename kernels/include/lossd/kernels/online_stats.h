// The online statistics a GPU thread keeps over its share of a row's columns, read once each, and
// how a block merges its threads' shares in a fixed order: for RowStats (loss_math.h) and for a
// distribution's LseStats (distill_math.h). Sums run in double. Host-and-device, so that the CPU
// tests check the math the CUDA backend's row kernels run.
#ifndef LOSSD_KERNELS_ONLINE_STATS_H_
#define LOSSD_KERNELS_ONLINE_STATS_H_

#include <cmath>
#include <cstdint>

#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/host_device.h"
#include "lossd/kernels/loss_math.h"

namespace lossd {

// A share of a row: m = max z, s = sum e^(z - m), t = sum e^(z - m)(z - m), sum z, and the first
// column holding m (-1 before the first non-NaN column; a NaN then goes into s).
struct PartialRowStats {
  float max;
  int32_t argmax;
  double sum_exp;
  double sum_shifted;
  double sum_z;
};

LOSSD_HD PartialRowStats EmptyPartialRowStats() {
  PartialRowStats p;
  p.max = -INFINITY;
  p.argmax = -1;
  p.sum_exp = 0.0;
  p.sum_shifted = 0.0;
  p.sum_z = 0.0;
  return p;
}

// Adds column c's z; a share's columns come in increasing order, so its first maximum is kept. A
// new maximum moves the sums to it as MergeRowStats does: t' = (t + (m - m') s) e^(m - m'),
// s' = s e^(m - m').
LOSSD_HD void AddColumn(PartialRowStats& p, float z, int32_t c) {
  p.sum_z += z;
  if (z > p.max || (p.argmax < 0 && z == p.max)) {
    if (p.argmax >= 0) {
      const float d = p.max - z;
      const float scale = Exp(d);
      p.sum_shifted = (p.sum_shifted + static_cast<double>(d) * p.sum_exp) * scale;
      p.sum_exp *= scale;
    }
    p.max = z;
    p.argmax = c;
  }
  if (p.argmax >= 0) {
    const float d = z - p.max;
    const float e = Exp(d);
    p.sum_exp += e;
    p.sum_shifted += e * d;
  } else {
    p.sum_exp += z;  // a NaN before any number: the sums carry it
  }
}

// The statistics of two disjoint column sets; the lower column wins a tie for the maximum.
LOSSD_HD PartialRowStats CombinePartialRowStats(const PartialRowStats& a,
                                                const PartialRowStats& b) {
  PartialRowStats r;
  r.sum_z = a.sum_z + b.sum_z;
  if (a.argmax < 0 || b.argmax < 0) {  // one side holds no column, or only NaN ones
    const bool keep_b = a.argmax < 0;
    r.max = keep_b ? b.max : a.max;
    r.argmax = keep_b ? b.argmax : a.argmax;
    r.sum_exp = a.sum_exp + b.sum_exp;
    r.sum_shifted = a.sum_shifted + b.sum_shifted;
    return r;
  }
  const float m = a.max > b.max ? a.max : b.max;
  const float da = a.max - m;
  const float db = b.max - m;
  const double ca = Exp(da);
  const double cb = Exp(db);
  r.sum_shifted = (a.sum_shifted + da * a.sum_exp) * ca + (b.sum_shifted + db * b.sum_exp) * cb;
  r.sum_exp = a.sum_exp * ca + b.sum_exp * cb;
  r.max = m;
  r.argmax = (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) ? b.argmax : a.argmax;
  return r;
}

// A whole tile's share as RowStats, its argmax as a vocabulary id (the tile starts at v0) and the
// label's logit, read from the tile, as `target`.
LOSSD_HD RowStats TileRowStats(const PartialRowStats& p, float target, int64_t v0) {
  RowStats stats = EmptyRowStats();
  stats.sum_z = static_cast<float>(p.sum_z);
  stats.target = target;
  if (p.argmax >= 0) {  // else a NaN row: sum_z carries the NaN
    stats.max = p.max;
    stats.sum_exp = static_cast<float>(p.sum_exp);
    stats.sum_exp_shifted = static_cast<float>(p.sum_shifted);
    stats.argmax = static_cast<int32_t>(v0 + p.argmax);
  }
  return stats;
}

// A share of a distribution's LseStats: m = max x, s = sum e^(x - m) (kept against a running
// max), min x, and whether a NaN was seen. Values at -inf (a sparse teacher's outside its top-k)
// add nothing.
struct PartialLse {
  float max;
  float min;
  double sum;
  int32_t nan;
};

LOSSD_HD PartialLse EmptyPartialLse() {
  PartialLse p;
  p.max = -INFINITY;
  p.min = INFINITY;
  p.sum = 0.0;
  p.nan = 0;
  return p;
}

LOSSD_HD void AddValue(PartialLse& p, float x) {
  p.nan |= x != x;
  p.min = MinStep(p.min, x);
  if (x > p.max) {
    if (p.max > -INFINITY) p.sum *= Exp(p.max - x);
    p.max = x;
  }
  if (p.max > -INFINITY) p.sum += Exp(x - p.max);
}

LOSSD_HD PartialLse CombinePartialLse(const PartialLse& a, const PartialLse& b) {
  PartialLse r;
  r.nan = a.nan | b.nan;
  r.min = MinStep(a.min, b.min);
  r.max = MaxStep(a.max, b.max);
  if (r.max == -INFINITY) {
    r.sum = a.sum + b.sum;
  } else {
    r.sum = a.sum * Exp(a.max - r.max) + b.sum * Exp(b.max - r.max);
  }
  return r;
}

// The share of a whole tile as LseStats; a NaN leaves the sum NaN.
LOSSD_HD LseStats LseStatsOf(const PartialLse& p) {
  LseStats s;
  s.max = p.max;
  s.sum_exp = p.nan != 0 ? NAN : static_cast<float>(p.sum);
  s.min = p.min;
  return s;
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_ONLINE_STATS_H_
