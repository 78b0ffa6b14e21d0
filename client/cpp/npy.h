// Reading and writing NumPy .npy files (format versions 1.0 and 2.0), as lossctl exchanges them.
//
// Only what lossd needs: little-endian float32 (<f4), float16 (<f2), uint16 (<u2), int64 (<i8)
// and int32 (<i4) arrays in C order. NumPy has no bfloat16, so bfloat16 arrays travel as their raw
// 16-bit patterns in <u2; in Python, `np.load(f).view(ml_dtypes.bfloat16)` reads them back, or
// `(a.astype(np.uint32) << 16).view(np.float32)` widens them exactly.
//
// The files come from users, so the reader checks all of the header (magic, version, a header
// length inside the file, the dictionary's exact keys and syntax, dtype, order, shape) and that the
// data is exactly product(shape) elements. Truncated files are DATA_LOSS, any other malformation
// INVALID_ARGUMENT; messages name the file and what was expected.
#ifndef LOSSD_CLIENT_NPY_H_
#define LOSSD_CLIENT_NPY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lossd::client {

enum class NpyDType { kFloat32, kFloat16, kUInt16, kInt64, kInt32 };

// The NumPy descr, e.g. "<f4".
absl::string_view NpyDescr(NpyDType dtype);
size_t NpyItemSize(NpyDType dtype);

struct NpyArray {
  NpyDType dtype = NpyDType::kFloat32;
  std::vector<int64_t> shape;  // empty: a 0-d array (one element)
  std::string data;            // product(shape) * item size bytes, little-endian, C order

  int64_t num_elements() const;
};

// Headers longer than this are refused before parsing, as NumPy's own reader does by default.
inline constexpr int64_t kMaxNpyHeaderBytes = 10000;

// Parses a whole file's bytes; `source` names the file in error messages.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view file_bytes, absl::string_view source);
absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path);

// Format version 1.0, the header padded so that the data starts at a multiple of 64 bytes as NumPy
// writes it. `data` is product(shape) elements, else INVALID_ARGUMENT.
absl::StatusOr<std::string> SerializeNpy(NpyDType dtype, const std::vector<int64_t>& shape,
                                         absl::string_view data);
absl::Status WriteNpyFile(const std::string& path, NpyDType dtype,
                          const std::vector<int64_t>& shape, absl::string_view data);

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_NPY_H_
