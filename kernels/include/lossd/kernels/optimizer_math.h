// Per-element optimizer updates shared by the backends; they follow torch.optim.SGD (dampening 0,
// no Nesterov) and torch.optim.AdamW so that a trainer can switch to lossd without retuning.
#ifndef LOSSD_KERNELS_OPTIMIZER_MATH_H_
#define LOSSD_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>

#include "lossd/kernels/backend.h"
#include "lossd/kernels/host_device.h"
#include "lossd/kernels/loss_math.h"

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
  float step_size;       // AdamW: lr / (1 - beta1^t)
  float inv_sqrt_bias2;  // AdamW: 1 / sqrt(1 - beta2^t)
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

// One element's update, in registers: the new weight and state from the old, whatever the
// optimizer. `state1`/`state2` are ignored where the optimizer keeps none (SGD without a momentum
// buffer has no state1, SGD no state2).
struct ElementUpdate {
  float weight;
  float state1;
  float state2;
};

LOSSD_HD ElementUpdate UpdateElement(bool adamw, bool has_state1, float w, float g, float state1,
                                     float state2, const OptimizerScalars& s) {
  ElementUpdate u{w, state1, state2};
  if (adamw) {
    AdamWUpdate(u.weight, g, u.state1, u.state2, s);
  } else if (has_state1) {
    SgdUpdate(u.weight, g, u.state1, s);
  } else {
    float no_buffer = 0.0f;  // momentum 0 neither reads nor keeps it
    SgdUpdate(u.weight, g, no_buffer, s);
  }
  return u;
}

// The weight as `dtype` stores it: an fp32 value past a 16-bit dtype's range is Inf there.
LOSSD_HD float AsStored(float value, DType dtype) {
  uint32_t slot = 0;  // room for one element of any dtype
  StoreFromFloat(&slot, dtype, 0, value);
  return LoadAsFloat(&slot, dtype, 0);
}

// 0 when one element's update stays finite as stored, else a code that orders elements first and
// buffers second, so that the smallest code over all elements names the first value at fault:
// element * 4 + OptimizerStepResult::NonFinite (1 weight, 2 state1, 3 state2). Exact in double up
// to 2^51 elements.
LOSSD_HD double NonFiniteUpdateCode(const ElementUpdate& u, int64_t element, DType weight_dtype,
                                    bool has_state1, bool has_state2) {
  int field = 0;
  if (!IsFinite(AsStored(u.weight, weight_dtype))) {
    field = 1;
  } else if (has_state1 && !IsFinite(u.state1)) {
    field = 2;
  } else if (has_state2 && !IsFinite(u.state2)) {
    field = 3;
  }
  return field == 0 ? 0.0 : static_cast<double>(element) * 4.0 + field;
}

// The result for the smallest code of NonFiniteUpdateCode over all elements. Codes are integers
// below 2^53; anything above stands for none (the sums start at +inf, an OpenMP min reduction's
// private copies at the largest double).
inline OptimizerStepResult OptimizerResultFromCode(double smallest_code) {
  OptimizerStepResult result;
  if (!(smallest_code < 0x1p53)) return result;
  const int64_t code = static_cast<int64_t>(smallest_code);
  result.non_finite = static_cast<OptimizerStepResult::NonFinite>(code % 4);
  result.element = code / 4;
  return result;
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_OPTIMIZER_MATH_H_
