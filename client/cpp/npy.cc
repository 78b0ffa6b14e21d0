#include "client/cpp/npy.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicBytes = 6;
// Magic, two version bytes, and the header length field (2 bytes in 1.0, 4 in 2.0).
constexpr size_t kPreambleBytesV1 = kMagicBytes + 2 + 2;
constexpr size_t kPreambleBytesV2 = kMagicBytes + 2 + 4;
// NumPy pads headers so that the data is aligned for any dtype when the file is memory-mapped.
constexpr size_t kDataAlignment = 64;

struct DescrEntry {
  absl::string_view descr;
  NpyDType dtype;
};
constexpr DescrEntry kDescrs[] = {
    {"<f4", NpyDType::kFloat32}, {"<f2", NpyDType::kFloat16}, {"<u2", NpyDType::kUInt16},
    {"<i8", NpyDType::kInt64},   {"<i4", NpyDType::kInt32},
};

// The fields of an .npy header dictionary, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// parsed as the subset of Python literal syntax that NumPy writes: strings in single or double
// quotes without escapes, True/False, and tuples of decimal integers.
struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<NpyHeader> Parse() {
    NpyHeader header;
    bool has_descr = false, has_order = false, has_shape = false;
    SkipSpace();
    RETURN_IF_ERROR(Expect('{'));
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      ASSIGN_OR_RETURN(const std::string key, ParseString("a key"));
      SkipSpace();
      RETURN_IF_ERROR(Expect(':'));
      SkipSpace();
      if (key == "descr") {
        if (has_descr) return Error("the key 'descr' twice");
        has_descr = true;
        ASSIGN_OR_RETURN(header.descr, ParseString("the descr string"));
      } else if (key == "fortran_order") {
        if (has_order) return Error("the key 'fortran_order' twice");
        has_order = true;
        ASSIGN_OR_RETURN(header.fortran_order, ParseBool());
      } else if (key == "shape") {
        if (has_shape) return Error("the key 'shape' twice");
        has_shape = true;
        ASSIGN_OR_RETURN(header.shape, ParseShape());
      } else {
        return Error(absl::StrCat("the unknown key '", absl::CEscape(key),
                                  "' (expected descr, fortran_order and shape)"));
      }
      SkipSpace();
      if (Consume(',')) continue;
      SkipSpace();
      RETURN_IF_ERROR(Expect('}'));
      break;
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("text after the closing '}'");
    if (!has_descr || !has_order || !has_shape) {
      return Error("a dictionary without all of descr, fortran_order and shape");
    }
    return header;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("header: ", what, " at character ", pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  absl::Status Expect(char c) {
    if (Consume(c)) return absl::OkStatus();
    return Error(absl::StrCat("expected '", std::string(1, c), "'"));
  }

  absl::StatusOr<std::string> ParseString(absl::string_view what) {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return Error(absl::StrCat("expected ", what, " in quotes"));
    }
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == absl::string_view::npos) return Error("an unterminated string");
    const absl::string_view value = text_.substr(pos_, end - pos_);
    if (value.find('\\') != absl::string_view::npos ||
        value.find('\n') != absl::string_view::npos) {
      return Error("a string with escapes or line breaks");
    }
    pos_ = end + 1;
    return std::string(value);
  }

  absl::StatusOr<bool> ParseBool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    return Error("expected True or False for fortran_order");
  }

  absl::StatusOr<int64_t> ParseDimension() {
    const size_t begin = pos_;
    while (pos_ < text_.size() && absl::ascii_isdigit(static_cast<unsigned char>(text_[pos_])))
      ++pos_;
    const absl::string_view digits = text_.substr(begin, pos_ - begin);
    if (digits.empty()) return Error("expected a non-negative integer in shape");
    if (digits.size() > 1 && digits[0] == '0')
      return Error("an integer with a leading zero in shape");
    int64_t value = 0;
    for (char digit : digits) {
      if (value > (std::numeric_limits<int64_t>::max() - (digit - '0')) / 10) {
        return Error("a dimension beyond 2^63 - 1");
      }
      value = value * 10 + (digit - '0');
    }
    return value;
  }

  // "()", "(n,)", "(n, m)" or "(n, m,)": Python's tuple syntax, where "(n)" is not a tuple.
  absl::StatusOr<std::vector<int64_t>> ParseShape() {
    std::vector<int64_t> shape;
    RETURN_IF_ERROR(Expect('('));
    SkipSpace();
    bool trailing_comma = false;
    while (!Consume(')')) {
      if (!shape.empty() && !trailing_comma) return Error("expected ',' or ')' in shape");
      ASSIGN_OR_RETURN(const int64_t dimension, ParseDimension());
      shape.push_back(dimension);
      SkipSpace();
      trailing_comma = Consume(',');
      SkipSpace();
    }
    if (shape.size() == 1 && !trailing_comma) {
      return Error("a one-element shape without its trailing comma (\"(n)\" is not a tuple)");
    }
    return shape;
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

uint32_t ReadLittleEndian(const char* bytes, size_t count) {
  uint32_t value = 0;
  for (size_t i = 0; i < count; ++i)
    value |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return value;
}

std::string ShapeTuple(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// product(shape), or nullopt when it overflows int64.
std::optional<int64_t> ElementCount(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dimension : shape) {
    if (dimension < 0) return std::nullopt;
    if (dimension != 0 && count > std::numeric_limits<int64_t>::max() / dimension)
      return std::nullopt;
    count *= dimension;
  }
  return count;
}

absl::StatusOr<NpyDType> DTypeOfDescr(absl::string_view descr) {
  for (const DescrEntry& entry : kDescrs) {
    if (entry.descr == descr) return entry.dtype;
  }
  std::string hint;
  if (!descr.empty() && descr[0] == '>')
    hint = " (big-endian data: save with a.astype(a.dtype.newbyteorder('<')))";
  if (descr == "<f8") hint = " (float64: save with a.astype(np.float32))";
  return absl::InvalidArgumentError(absl::StrCat("header: descr '", absl::CEscape(descr),
                                                 "' is not supported; expected one of '<f4', "
                                                 "'<f2', '<u2' (bfloat16 bits), '<i8', '<i4'",
                                                 hint));
}

absl::Status WithSource(absl::Status status, absl::string_view source) {
  return absl::Status(status.code(), absl::StrCat(source, ": ", status.message()));
}

// Everything of a version 1.0 file before the data, as NumPy writes it: the header padded so that
// the data starts at a multiple of 64 bytes.
absl::StatusOr<std::string> NpyPreamble(NpyDType dtype, const std::vector<int64_t>& shape,
                                        size_t data_bytes) {
  const std::optional<int64_t> elements = ElementCount(shape);
  if (!elements.has_value() ||
      static_cast<uint64_t>(*elements) * NpyItemSize(dtype) != data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("npy: shape ", ShapeTuple(shape), " of ",
                                                   NpyDescr(dtype), " does not match ", data_bytes,
                                                   " data bytes"));
  }
  std::string header =
      absl::StrCat("{'descr': '", NpyDescr(dtype),
                   "', 'fortran_order': False, 'shape': ", ShapeTuple(shape), ", }");
  const size_t unpadded = kPreambleBytesV1 + header.size() + 1;  // + the closing newline
  header.append((kDataAlignment - unpadded % kDataAlignment) % kDataAlignment, ' ');
  header.push_back('\n');
  // Version 1.0 suffices: its 2-byte length field holds any header this reader accepts.
  if (static_cast<int64_t>(header.size()) > kMaxNpyHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("npy: shape ", ShapeTuple(shape),
                                                   " makes a header of ", header.size(),
                                                   " bytes, over ", kMaxNpyHeaderBytes));
  }
  std::string preamble(kMagic, kMagicBytes);
  preamble.push_back('\x01');
  preamble.push_back('\x00');
  preamble.push_back(static_cast<char>(header.size() & 0xff));
  preamble.push_back(static_cast<char>(header.size() >> 8));
  return preamble + header;
}

// An array whose data starts at `data_offset` of the file; every byte of the file is checked.
struct NpyLayout {
  NpyDType dtype = NpyDType::kFloat32;
  std::vector<int64_t> shape;
  size_t data_offset = 0;
};

absl::StatusOr<NpyLayout> ParseLayout(absl::string_view file) {
  const absl::string_view magic(kMagic, kMagicBytes);
  if (!absl::StartsWith(file, magic)) {
    // A file cut inside the magic is a truncated .npy file; anything else is some other file.
    return absl::StartsWith(magic, file)
               ? absl::DataLossError("truncated inside the .npy magic")
               : absl::InvalidArgumentError("not an .npy file (no \\x93NUMPY magic)");
  }
  if (file.size() < kMagicBytes + 2)
    return absl::DataLossError("truncated before the format version");
  const int major = static_cast<unsigned char>(file[kMagicBytes]);
  const int minor = static_cast<unsigned char>(file[kMagicBytes + 1]);
  if ((major != 1 && major != 2) || minor != 0) {
    return absl::InvalidArgumentError(absl::StrCat("format version ", major, ".", minor,
                                                   " is not supported (expected 1.0 or 2.0)"));
  }
  const size_t preamble_bytes = major == 1 ? kPreambleBytesV1 : kPreambleBytesV2;
  if (file.size() < preamble_bytes)
    return absl::DataLossError("truncated before the end of the .npy preamble");
  const uint32_t header_bytes = ReadLittleEndian(file.data() + kMagicBytes + 2, major == 1 ? 2 : 4);
  if (header_bytes > kMaxNpyHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header length ", header_bytes, " exceeds the limit of ", kMaxNpyHeaderBytes, " bytes"));
  }
  if (file.size() - preamble_bytes < header_bytes) {
    return absl::DataLossError(absl::StrCat("truncated inside the ", header_bytes, "-byte header"));
  }
  ASSIGN_OR_RETURN(const NpyHeader header,
                   HeaderParser(file.substr(preamble_bytes, header_bytes)).Parse());
  if (header.fortran_order) {
    return absl::InvalidArgumentError(
        "header: fortran_order is True; only C order is supported (save np.ascontiguousarray(a))");
  }
  NpyLayout layout;
  ASSIGN_OR_RETURN(layout.dtype, DTypeOfDescr(header.descr));
  layout.shape = header.shape;
  const std::optional<int64_t> elements = ElementCount(layout.shape);
  const int64_t item_bytes = static_cast<int64_t>(NpyItemSize(layout.dtype));
  if (!elements.has_value() || *elements > std::numeric_limits<int64_t>::max() / item_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("header: shape ", ShapeTuple(layout.shape),
                                                   " has more bytes than a file can"));
  }
  const uint64_t expected_bytes = static_cast<uint64_t>(*elements * item_bytes);
  const uint64_t data_bytes = file.size() - preamble_bytes - header_bytes;
  if (data_bytes < expected_bytes) {
    return absl::DataLossError(absl::StrCat("truncated: shape ", ShapeTuple(layout.shape), " of ",
                                            header.descr, " needs ", expected_bytes,
                                            " data bytes, the file has ", data_bytes));
  }
  if (data_bytes > expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(data_bytes - expected_bytes, " bytes after the ",
                                                   expected_bytes, " data bytes of shape ",
                                                   ShapeTuple(layout.shape)));
  }
  layout.data_offset = preamble_bytes + header_bytes;
  return layout;
}

}  // namespace

absl::string_view NpyDescr(NpyDType dtype) {
  for (const DescrEntry& entry : kDescrs) {
    if (entry.dtype == dtype) return entry.descr;
  }
  return "";
}

size_t NpyItemSize(NpyDType dtype) {
  switch (dtype) {
    case NpyDType::kFloat32: return 4;
    case NpyDType::kFloat16: return 2;
    case NpyDType::kUInt16: return 2;
    case NpyDType::kInt64: return 8;
    case NpyDType::kInt32: return 4;
  }
  return 0;
}

int64_t NpyArray::num_elements() const { return ElementCount(shape).value_or(-1); }

absl::StatusOr<NpyArray> ParseNpy(absl::string_view file_bytes, absl::string_view source) {
  absl::StatusOr<NpyLayout> layout = ParseLayout(file_bytes);
  if (!layout.ok()) return WithSource(layout.status(), source);
  return NpyArray{layout->dtype, std::move(layout->shape),
                  std::string(file_bytes.substr(layout->data_offset))};
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (error) return absl::ErrnoToStatus(error.value(), absl::StrCat(path, ": cannot open"));
  if (!std::filesystem::is_regular_file(status)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uintmax_t size = std::filesystem::file_size(path, error);
  if (error)
    return absl::ErrnoToStatus(error.value(), absl::StrCat(path, ": cannot read its size"));
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  std::string contents(static_cast<size_t>(size), '\0');
  file.read(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!file) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  absl::StatusOr<NpyLayout> layout = ParseLayout(contents);
  if (!layout.ok()) return WithSource(layout.status(), path);
  // Dropping the header in place keeps a large file's data from being copied.
  contents.erase(0, layout->data_offset);
  return NpyArray{layout->dtype, std::move(layout->shape), std::move(contents)};
}

absl::StatusOr<std::string> SerializeNpy(NpyDType dtype, const std::vector<int64_t>& shape,
                                         absl::string_view data) {
  ASSIGN_OR_RETURN(std::string file, NpyPreamble(dtype, shape, data.size()));
  file.append(data.data(), data.size());
  return file;
}

absl::Status WriteNpyFile(const std::string& path, NpyDType dtype,
                          const std::vector<int64_t>& shape, absl::string_view data) {
  ASSIGN_OR_RETURN(const std::string preamble, NpyPreamble(dtype, shape, data.size()));
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot create"));
  // Header and data written separately, so that a large array is never copied.
  file.write(preamble.data(), static_cast<std::streamsize>(preamble.size()));
  file.write(data.data(), static_cast<std::streamsize>(data.size()));
  file.close();
  if (!file) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace lossd::client
