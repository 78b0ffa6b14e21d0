// Counter-based pseudo-random numbers: value `index` of stream `stream` is a pure function of the
// two, so a tensor of billions of values fills in parallel, in any order, and comes out the same on
// any thread count. A few ns a value, where std::mt19937_64 with std::normal_distribution takes
// about 50 on one core.
#ifndef LOSSD_COMMON_COUNTER_RANDOM_H_
#define LOSSD_COMMON_COUNTER_RANDOM_H_

#include <cstdint>

namespace lossd {

// SplitMix64's output function (Steele, Lea and Flood, OOPSLA 2014): a bijective 64-bit mix.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Output `index` of SplitMix64 seeded with Mix64(stream). Two streams' sequences overlap within
// 2^40 values with probability about 2^-23, so any 64-bit value names a stream.
inline uint64_t CounterHash(uint64_t stream, uint64_t index) {
  constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;  // 2^64 / golden ratio, odd
  return Mix64(Mix64(stream) + (index + 1) * kGamma);
}

// Uniform on [-1, 1) in steps of 2^-23 (the hash's top 24 bits); its standard deviation is
// 1/sqrt(3).
inline float CounterUniform(uint64_t stream, uint64_t index) {
  const float unit = static_cast<float>(CounterHash(stream, index) >> 40) * (1.0f / 16777216.0f);
  return 2.0f * unit - 1.0f;
}

}  // namespace lossd

#endif  // LOSSD_COMMON_COUNTER_RANDOM_H_
