#include "lossd/client/tensor.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace lossd::client {
namespace {

// The wire carries little-endian bytes, and these conversions copy host words to and from them.
static_assert(std::endian::native == std::endian::little,
              "lossd's client assumes a little-endian host");

uint32_t BitsOf(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

float FloatOf(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

float BFloat16ToFloat32(uint16_t h) { return FloatOf(static_cast<uint32_t>(h) << 16); }

uint16_t Float32ToBFloat16(float x) {
  const uint32_t bits = BitsOf(x);
  // Truncating a NaN could clear every mantissa bit left and make it Inf; keep it a quiet NaN.
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is the right result.
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float Float16ToFloat32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return FloatOf(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return FloatOf(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float32.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign != 0 ? -magnitude : magnitude;
}

uint16_t Float32ToFloat16(float x) {
  const uint32_t bits = BitsOf(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN stays a (quiet) NaN
  // 65520 = the largest half (65504) plus half an ulp: from there on, rounding gives Inf.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14) the result is the subnormal mantissa round(|x| 2^24);
    // nearbyint rounds half to even in the default rounding mode.
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(FloatOf(magnitude), 24)));
  }
  // Normal: rebias the exponent from 127 to 15 and round the mantissa from 23 bits to 10, to
  // nearest even; a carry into the exponent is again the right result.
  const uint32_t rebiased = magnitude - ((127u - 15u) << 23);
  const uint32_t rounding_bias = 0xfffu + ((rebiased >> 13) & 1u);
  return sign | static_cast<uint16_t>((rebiased + rounding_bias) >> 13);
}

}  // namespace

size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "float32" || lower == "fp32" || lower == "f32") return DType::kFloat32;
  if (lower == "bfloat16" || lower == "bf16") return DType::kBFloat16;
  if (lower == "float16" || lower == "fp16" || lower == "f16" || lower == "half")
    return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: expected float32, bfloat16 or float16, got \"", name, "\""));
}

std::vector<float> DecodeToFloat32(absl::string_view data, DType dtype) {
  const size_t count = data.size() / DTypeSize(dtype);
  std::vector<float> values(count);
  if (dtype == DType::kFloat32) {
    // Empty vectors and spans may have no data pointer, which memcpy must not get even for 0 bytes.
    if (count > 0) std::memcpy(values.data(), data.data(), count * sizeof(float));
    return values;
  }
  for (size_t i = 0; i < count; ++i) {
    uint16_t half;
    std::memcpy(&half, data.data() + 2 * i, sizeof half);
    values[i] = dtype == DType::kBFloat16 ? BFloat16ToFloat32(half) : Float16ToFloat32(half);
  }
  return values;
}

std::vector<float> ToFloat32(const Tensor& tensor) {
  return DecodeToFloat32(tensor.bytes, tensor.dtype);
}

std::string EncodeFromFloat32(absl::Span<const float> values, DType dtype) {
  std::string bytes(values.size() * DTypeSize(dtype), '\0');
  if (dtype == DType::kFloat32) {
    if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
    return bytes;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t half =
        dtype == DType::kBFloat16 ? Float32ToBFloat16(values[i]) : Float32ToFloat16(values[i]);
    std::memcpy(bytes.data() + 2 * i, &half, sizeof half);
  }
  return bytes;
}

}  // namespace lossd::client
