// half.h against the two formats' definitions, computed here in double without its code: every
// bf16 and fp16 bit pattern to fp32, and fp32 to both by round to nearest even, on the values where
// rounding is decided (ties, the edge of overflow, subnormals, infinities, NaN) and on random bit
// patterns. The engine tests' bf16 and fp16 cases round their references with these functions, so
// they must be right on their own.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lossd/kernels/half.h"

namespace lossd {
namespace {

// A 16-bit float format: 1 sign bit, `exponent_bits`, the rest mantissa.
struct Format {
  std::string name;
  int exponent_bits;
  float (*to_float)(uint16_t);
  uint16_t (*from_float)(float);

  int mantissa_bits() const { return 15 - exponent_bits; }
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  uint16_t infinity() const {
    return static_cast<uint16_t>(((1 << exponent_bits) - 1) << mantissa_bits());
  }

  bool IsNaN(uint16_t bits) const { return (bits & 0x7fff) > infinity(); }

  // |value| of a non-NaN pattern, from the definition; the infinity pattern stands for the next
  // power of two above the largest finite value, where rounding overflows to it.
  double Magnitude(uint16_t bits) const {
    const int exponent = (bits & 0x7fff) >> mantissa_bits();
    const int mantissa = bits & ((1 << mantissa_bits()) - 1);
    if (exponent == 0) return std::ldexp(mantissa, 1 - bias() - mantissa_bits());
    return std::ldexp((1 << mantissa_bits()) + mantissa, exponent - bias() - mantissa_bits());
  }

  // The nearest pattern to `x` (not NaN), ties to the even mantissa: non-negative patterns up to
  // the infinity pattern increase with their value, so a binary search finds the two neighbours.
  uint16_t RoundNearestEven(double x) const {
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double magnitude = std::fabs(x);
    if (magnitude >= Magnitude(infinity())) return sign | infinity();
    uint16_t below = 0, above = infinity();  // Magnitude(below) <= magnitude < Magnitude(above)
    while (above - below > 1) {
      const uint16_t middle = static_cast<uint16_t>((below + above) / 2);
      (Magnitude(middle) <= magnitude ? below : above) = middle;
    }
    const double to_below = magnitude - Magnitude(below);
    const double to_above = Magnitude(above) - magnitude;
    const bool up = to_above < to_below || (to_above == to_below && (below & 1));
    return sign | (up ? above : below);
  }
};

float BitsAsFloat(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

class HalfTest : public ::testing::TestWithParam<Format> {};

TEST_P(HalfTest, EveryPatternWidensExactly) {
  const Format& f = GetParam();
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float x = f.to_float(bits);
    if (f.IsNaN(bits)) {
      EXPECT_TRUE(std::isnan(x)) << f.name << " pattern " << b;
      continue;
    }
    const double magnitude = (bits & 0x7fff) == f.infinity() ? INFINITY : f.Magnitude(bits);
    const double expected = (bits & 0x8000) ? -magnitude : magnitude;
    ASSERT_EQ(static_cast<double>(x), expected) << f.name << " pattern " << b;
    ASSERT_EQ(std::signbit(x), (bits & 0x8000) != 0) << f.name << " pattern " << b;
  }
}

TEST_P(HalfTest, NarrowsToNearestEven) {
  const Format& f = GetParam();
  std::vector<float> values = {0.0f,
                               -0.0f,
                               INFINITY,
                               -INFINITY,
                               1.0f,
                               -1.0f,
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min()};
  // Every finite pattern, and halfway between neighbours (a tie, exact in fp32 since both formats
  // have fewer mantissa bits) and a quarter of the way either side of it.
  for (uint32_t b = 0; b < f.infinity(); ++b) {
    const double low = f.Magnitude(static_cast<uint16_t>(b));
    const double high = f.Magnitude(static_cast<uint16_t>(b + 1));
    for (double t : {0.0, 0.25, 0.5, 0.75}) {
      const float x = static_cast<float>(low + t * (high - low));
      values.push_back(x);
      values.push_back(-x);
    }
  }
  std::mt19937 rng(GTEST_FLAG_GET(random_seed));
  for (int i = 0; i < 1000000; ++i) values.push_back(BitsAsFloat(rng()));
  for (const float x : values) {
    const uint16_t got = f.from_float(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(f.IsNaN(got)) << f.name << " from NaN gave " << got;
      EXPECT_EQ(got & 0x8000, std::signbit(x) ? 0x8000 : 0) << f.name << ": the sign of NaN";
      continue;
    }
    ASSERT_EQ(got, f.RoundNearestEven(x)) << f.name << " from " << x;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, HalfTest,
                         ::testing::Values(Format{"bfloat16", 8, BFloat16ToFloat, FloatToBFloat16},
                                           Format{"float16", 5, Float16ToFloat, FloatToFloat16}),
                         [](const ::testing::TestParamInfo<Format>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace lossd
