// Untrusted bytes through the safetensors reader: parsing must fail cleanly or hand out tensors
// that lie inside the file with exactly product(shape) * element size bytes, tiling its data
// buffer (the contract in lossd/storage/safetensors.h), and every F32/BF16/F16 tensor must
// convert to each of the three dtypes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "lossd/storage/safetensors.h"

namespace lossd::storage {
namespace {

// A violated contract: libFuzzer reports the abort with the input that caused it.
void Require(bool holds, const char* contract) {
  if (holds) return;
  std::fprintf(stderr, "fuzz_safetensors: violated: %s\n", contract);
  std::abort();
}

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

bool Converts(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16";
}

void CheckTensor(const TensorRef& tensor) {
  const auto element_size = SafetensorsDTypeSize(tensor.dtype);
  Require(element_size.ok(), "a parsed tensor has a known dtype");
  size_t expected_bytes = *element_size;
  for (const int64_t dim : tensor.shape) {
    Require(dim >= 0, "dimensions are non-negative");
    expected_bytes *= static_cast<size_t>(dim);  // the reader refused shapes that overflow
  }
  Require(tensor.bytes == expected_bytes, "bytes == product(shape) * element size");

  for (const DType target : kAllDTypes) {
    const auto converted = ReadAsDType(tensor, target);
    Require(converted.ok() == Converts(tensor.dtype), "exactly F32, BF16 and F16 tensors convert");
    if (converted.ok()) {
      Require(converted->size() == tensor.bytes / *element_size * DTypeSize(target),
              "a conversion keeps the element count");
    }
  }
}

}  // namespace
}  // namespace lossd::storage

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossd::storage;
  const std::string input(reinterpret_cast<const char*>(data), size);
  auto parsed = SafetensorsFile::FromBytes(input, "fuzz");
  if (!parsed.ok()) return 0;
  // Tensors are found by offset, so they must survive the file being moved.
  SafetensorsFile file = std::move(*parsed);

  struct Placed {
    const uint8_t* begin;
    size_t bytes;
  };
  std::vector<Placed> placed;
  size_t data_bytes = 0;
  for (const std::string& name : file.TensorNames()) {
    const auto tensor = file.Tensor(name);
    Require(tensor.ok(), "every listed name is found");
    Require(tensor->name == name, "a tensor carries its own name");
    CheckTensor(*tensor);
    data_bytes += tensor->bytes;
    if (tensor->bytes > 0) placed.push_back({tensor->data, tensor->bytes});
  }
  Require(!file.Tensor("\x01 no such tensor").ok(), "a name that is not in the file is not found");

  // Tiling: the non-empty tensors follow one another with no gap or overlap and end the file, so
  // each one's bytes are the input's bytes at its place in the data buffer.
  Require(data_bytes <= size, "the data buffer fits in the file");
  std::sort(placed.begin(), placed.end(),
            [](const Placed& a, const Placed& b) { return a.begin < b.begin; });
  const uint8_t* const data_start = data + (size - data_bytes);
  size_t offset = 0;
  for (const Placed& tensor : placed) {
    if (offset > 0)
      Require(tensor.begin == placed.front().begin + offset, "tensors tile the data buffer");
    Require(std::memcmp(tensor.begin, data_start + offset, tensor.bytes) == 0,
            "a tensor's bytes are the file's bytes at its offsets");
    offset += tensor.bytes;
  }
  Require(offset == data_bytes, "the non-empty tensors hold the whole data buffer");
  return 0;
}
