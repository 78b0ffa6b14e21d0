// Tensors as lossd's clients hand them to the server and get them back: raw little-endian,
// row-major bytes with an explicit dtype and a [rows, cols] shape, as on the wire.
#ifndef LOSSD_CLIENT_TENSOR_H_
#define LOSSD_CLIENT_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace lossd::client {

enum class DType { kFloat32, kBFloat16, kFloat16 };

size_t DTypeSize(DType dtype);
// "float32", "bfloat16", "float16".
absl::string_view DTypeName(DType dtype);
// Accepts the names above and the short forms fp32/f32, bf16, fp16/f16/half.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// A [rows, cols] matrix the caller owns; it must stay valid for the duration of the call it is
// passed to.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t num_bytes() const { return rows * cols * static_cast<int64_t>(DTypeSize(dtype)); }
};

// A [rows, cols] matrix that owns its bytes, such as one received from the server.
struct Tensor {
  std::string bytes;  // rows * cols * DTypeSize(dtype) bytes
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  uint64_t head_version = 0;       // the head's version the values belong to
  int64_t accumulated_tokens = 0;  // fetched gradients: tokens in the accumulator; 0 otherwise

  TensorView view() const { return {bytes.data(), dtype, rows, cols}; }
};

// The values of `data` (elements of `dtype`, little-endian) as float32; exact for every dtype.
std::vector<float> DecodeToFloat32(absl::string_view data, DType dtype);
std::vector<float> ToFloat32(const Tensor& tensor);

// `values` in `dtype`, little-endian, rounded to nearest even as the server rounds.
std::string EncodeFromFloat32(absl::Span<const float> values, DType dtype);

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_TENSOR_H_
