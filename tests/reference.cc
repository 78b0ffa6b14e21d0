#include "tests/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace lossd::testing {

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

  std::vector<double> raw(n * v);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < v; ++t) {
      double a = 0.0;
      for (int64_t j = 0; j < h; ++j) a += p.hidden[i * h + j] * p.weight[t * h + j];
      raw[i * v + t] = a;
      const double capped = cap > 0 ? cap * std::tanh(a / cap) : a;
      r.logits[i * v + t] = capped / temperature;
      r.max_abs_logit = std::max(r.max_abs_logit, std::abs(r.logits[i * v + t]));
    }
  }
  for (int64_t i = 0; i < n; ++i) r.counted_tokens += p.labels[i] != o.ignore_index;
  const double denominator = o.mean_denominator > 0 ? o.mean_denominator : r.counted_tokens;
  const double reduction_scale =
      o.reduction == Reduction::kMean ? (denominator > 0 ? 1.0 / denominator : 0.0) : 1.0;

  std::vector<double> dz(v);
  for (int64_t i = 0; i < n; ++i) {
    const double* z = &r.logits[i * v];
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
    r.lse[i] = lse;
    r.entropy[i] = lse - expected_z;
    r.argmax[i] = std::max_element(z, z + v) - z;  // first maximum: the lowest id

    std::vector<int64_t> order(p.top_k > 0 ? v : 0);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
    for (int j = 0; j < p.top_k; ++j) {
      r.top_k_token[i * p.top_k + j] = order[j];
      r.top_k_logprob[i * p.top_k + j] = z[order[j]] - lse;
    }

    const int64_t y = p.labels[i];
    if (y == o.ignore_index) continue;
    const double w = p.token_weights.empty() ? 1.0 : p.token_weights[i];
    r.logprob[i] = z[y] - lse;
    const double loss = (1 - eps) * (lse - z[y]) + eps * (lse - sum_z / v) +
                        o.z_loss_scale * lse * lse;
    r.token_loss[i] = w * loss;
    r.loss_sum += w * loss;

    // d loss_i / d z_t, then through z = cap(a) / T to the raw logit a.
    const double g = w * reduction_scale * o.grad_scale;
    for (int64_t t = 0; t < v; ++t) {
      const double prob = std::exp(z[t] - lse);
      double d = prob * (1 + 2 * o.z_loss_scale * lse) - eps / v - (t == y ? 1 - eps : 0.0);
      d /= temperature;
      if (cap > 0) {
        const double th = std::tanh(raw[i * v + t] / cap);
        d *= 1 - th * th;
      }
      dz[t] = g * d;
    }
    for (int64_t t = 0; t < v; ++t) {
      if (dz[t] == 0.0) continue;
      for (int64_t j = 0; j < h; ++j) {
        r.grad_hidden[i * h + j] += dz[t] * p.weight[t * h + j];
        r.grad_weight[t * h + j] += dz[t] * p.hidden[i * h + j];
      }
    }
  }
  r.loss = o.reduction == Reduction::kMean ? r.loss_sum * reduction_scale : r.loss_sum;
  return r;
}

double ReferenceLoss(const ReferenceProblem& problem) { return ComputeReference(problem).loss; }

}  // namespace lossd::testing
