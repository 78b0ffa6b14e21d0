// Reading and writing Hugging Face safetensors files.
//
// Layout: an 8-byte little-endian header length L, L bytes of UTF-8 JSON, then the data buffer.
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data buffer) and may hold "__metadata__": {string: string}.
//
// The reader validates the whole header before handing out any tensor, so a TensorRef always points
// inside the file with exactly product(shape) * element size bytes. Like the reference
// implementation it also requires the tensors to tile the data buffer: no gaps, no overlaps, no
// trailing bytes. Truncated files are DATA_LOSS, any other malformation INVALID_ARGUMENT; messages
// name the file, the tensor and the field.
#ifndef LOSSD_STORAGE_SAFETENSORS_H_
#define LOSSD_STORAGE_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lossd/kernels/types.h"

namespace lossd::storage {

// Headers larger than this are refused before parsing, as the reference implementation does.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Bytes per element of a safetensors dtype name ("F32", "BF16", "I64", ...), or INVALID_ARGUMENT.
absl::StatusOr<size_t> SafetensorsDTypeSize(absl::string_view dtype);

// Text from untrusted files, for error messages and the log: at most `max_bytes` of it, with
// control characters and bytes above 0x7e (text that may not be UTF-8) escaped as \xNN.
std::string Printable(absl::string_view text, size_t max_bytes);

// lossd's DType <-> the safetensors dtype name: float32 <-> "F32", bfloat16 <-> "BF16",
// float16 <-> "F16". Other safetensors dtypes have no lossd DType and give INVALID_ARGUMENT.
absl::StatusOr<std::string> DTypeToSafetensors(DType dtype);
absl::StatusOr<DType> DTypeFromSafetensors(absl::string_view dtype);

// One tensor of an open file. `data` points into the file's memory: it stays valid while the
// SafetensorsFile (or the object it was moved into) lives, and may be unaligned.
struct TensorRef {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates its header. The mapping assumes the file is not truncated
  // by someone else while open (as for any mmap reader).
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  // Validates and takes ownership of a whole file's bytes; `source_name` stands for the path in
  // error messages.
  static absl::StatusOr<SafetensorsFile> FromBytes(std::string bytes,
                                                   std::string source_name = "<memory>");

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // The path, or the source name given to FromBytes.
  const std::string& source() const { return source_; }
  // Sorted by name.
  std::vector<std::string> TensorNames() const;
  // NOT_FOUND, listing some of the names the file has, when there is no such tensor.
  absl::StatusOr<TensorRef> Tensor(absl::string_view name) const;
  // The "__metadata__" object; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct TensorEntry {
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // relative to the data buffer
    uint64_t end = 0;
  };

  SafetensorsFile() = default;
  absl::Status ParseHeader();
  const uint8_t* file_bytes() const;
  size_t file_size() const;
  void Unmap();

  std::string source_;
  // Exactly one of the two holds the file: an mmap'ed region, or bytes given to FromBytes. The
  // entries keep offsets rather than pointers so that moving `owned_bytes_` cannot leave them
  // dangling.
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::string owned_bytes_;
  size_t data_start_ = 0;
  std::map<std::string, TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The tensor's elements converted to `target` (round to nearest even, as half.h does), as
// little-endian bytes. Only F32, BF16 and F16 tensors convert; other dtypes are INVALID_ARGUMENT.
absl::StatusOr<std::vector<uint8_t>> ReadAsDType(const TensorRef& tensor, DType target);

// A tensor to write. `data` holds `bytes` little-endian bytes, which must equal
// product(shape) * element size of `dtype` (a safetensors dtype name).
struct TensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};

// A whole safetensors file in memory. The output depends only on the set of tensors and the
// metadata, not on the order of `tensors`: the JSON keys are sorted, and the data is laid out by
// element size (largest first) and then by name, so every tensor starts at a multiple of its
// element size. The header is padded with spaces to a multiple of 8 bytes.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata);

// Writes the same bytes as SerializeSafetensors to `path` without ever exposing a partial file
// there: it writes `path`.tmp-<pid>-<random> in the same directory, fsyncs it, renames it over
// `path` and fsyncs the directory. On failure the temporary file is removed and `path` is left as
// it was (unless the failure is the final directory fsync, after which the new file is in place
// but not known to be durable).
absl::Status WriteSafetensorsAtomically(const std::string& path,
                                        const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata);

// fsyncs a directory, which makes the creation, rename or removal of its entries durable.
absl::Status FsyncDirectory(const std::string& dir);

}  // namespace lossd::storage

#endif  // LOSSD_STORAGE_SAFETENSORS_H_
