// Per-element optimizer updates shared by the backends; they follow torch.optim.SGD (dampening 0,
// no Nesterov) and torch.optim.AdamW so that a trainer can switch to lossd without retuning.
#ifndef LOSSD_KERNELS_OPTIMIZER_MATH_H_
#define LOSSD_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>

#include "lossd/kernels/backend.h"
#include "lossd/kernels/host_device.h"

namespace lossd {

// OptimizerConfig reduced to the scalars one element's update needs.
struct OptimizerScalars {
  float learning_rate;
  float momentum;
  float beta1;
  float beta2;
  float epsilon;
  float weight_decay;
  float grad_multiplier;
  float step_size;           // AdamW: lr / (1 - beta1^t)
  float inv_sqrt_bias2;      // AdamW: 1 / sqrt(1 - beta2^t)
  // 1 - beta1, 1 - beta2 and 1 - lr wd, taken in double before rounding (as torch does): in fp32
  // from the rounded betas, 1 - 0.999f is off by 1.3e-5 relative, and v with it.
  float one_minus_beta1;
  float one_minus_beta2;
  float decay;
};

inline OptimizerScalars MakeOptimizerScalars(const OptimizerConfig& c) {
  OptimizerScalars s;
  s.learning_rate = static_cast<float>(c.learning_rate);
  s.momentum = static_cast<float>(c.momentum);
  s.beta1 = static_cast<float>(c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.epsilon = static_cast<float>(c.epsilon);
  s.weight_decay = static_cast<float>(c.weight_decay);
  s.grad_multiplier = static_cast<float>(c.grad_multiplier);
  const double t = static_cast<double>(c.step);
  s.step_size = static_cast<float>(c.learning_rate / (1.0 - std::pow(c.beta1, t)));
  s.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(c.beta2, t)));
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.decay = static_cast<float>(1.0 - c.learning_rate * c.weight_decay);
  return s;
}

// g += wd w;  b = momentum b + g;  w -= lr b.
LOSSD_HD void SgdUpdate(float& w, float g, float& momentum_buffer, const OptimizerScalars& s) {
  g = g * s.grad_multiplier + s.weight_decay * w;
  if (s.momentum != 0.0f) {
    momentum_buffer = s.momentum * momentum_buffer + g;
    g = momentum_buffer;
  }
  w -= s.learning_rate * g;
}

// w *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
// w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
LOSSD_HD void AdamWUpdate(float& w, float g, float& m, float& v, const OptimizerScalars& s) {
  g *= s.grad_multiplier;
  w *= s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  w -= s.step_size * m / (sqrtf(v) * s.inv_sqrt_bias2 + s.epsilon);
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_OPTIMIZER_MATH_H_
