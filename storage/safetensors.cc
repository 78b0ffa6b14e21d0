#include "lossd/storage/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/half.h"
#include "nlohmann/json.hpp"

namespace lossd::storage {
namespace {

// The format, and the raw copies below, are little endian.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

constexpr char kMetadataKey[] = "__metadata__";
// How many names a NOT_FOUND error lists.
constexpr size_t kNamesListedWhenMissing = 10;

struct SafetensorsDType {
  const char* name;
  size_t size;
};
constexpr SafetensorsDType kSafetensorsDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8},
};

std::string Quote(absl::string_view text) { return absl::StrCat("'", Printable(text, 80), "'"); }

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A non-negative JSON integer that fits int64; nlohmann stores large or negative ones differently.
bool AsNonNegativeInt64(const nlohmann::json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
  } else if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
  } else {
    return false;
  }
  return *out <= static_cast<uint64_t>(INT64_MAX);
}

// Product of the dimensions times the element size, or false on overflow of size_t/int64.
bool ByteCount(const std::vector<int64_t>& shape, size_t element_size, uint64_t* bytes) {
  uint64_t total = element_size;
  for (const int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(total, static_cast<uint64_t>(dim), &total)) return false;
  }
  if (total > static_cast<uint64_t>(INT64_MAX) || total > SIZE_MAX) return false;
  *bytes = total;
  return true;
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  // Linux writes at most about 2 GiB per call; stay well below.
  constexpr size_t kMaxWrite = size_t{1} << 30;
  const char* cursor = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, cursor, std::min(size, kMaxWrite));
    if (written < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat(path, ": write failed"));
    }
    cursor += written;
    size -= static_cast<size_t>(written);
  }
  return absl::OkStatus();
}

// The validated header and the order in which the tensors' data follows it.
struct PreparedFile {
  std::string header;  // JSON padded with spaces to a multiple of 8
  std::vector<const TensorToWrite*> data_order;
  uint64_t data_bytes = 0;
};

absl::StatusOr<PreparedFile> PrepareFile(const std::vector<TensorToWrite>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  PreparedFile file;
  std::map<std::string, size_t> element_sizes;
  for (const TensorToWrite& tensor : tensors) {
    const std::string where = absl::StrCat("tensor ", Quote(tensor.name));
    if (tensor.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the name is reserved for metadata"));
    }
    auto size_or = SafetensorsDTypeSize(tensor.dtype);
    if (!size_or.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", size_or.status().message()));
    if (!element_sizes.emplace(tensor.name, *size_or).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the name appears twice"));
    }
    uint64_t expected_bytes = 0;
    if (!ByteCount(tensor.shape, *size_or, &expected_bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape ", ShapeText(tensor.shape),
                       " has a negative dimension or too many elements"));
    }
    if (expected_bytes != tensor.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", tensor.bytes, " bytes given for shape ", ShapeText(tensor.shape), " of ",
          tensor.dtype, " (", expected_bytes, " bytes)"));
    }
    if (tensor.bytes > 0 && tensor.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data is null"));
    }
    file.data_order.push_back(&tensor);
  }
  // Largest elements first keeps every tensor aligned to its element size, given the 8-byte
  // aligned start of the data buffer (the reference implementation orders them the same way).
  std::sort(file.data_order.begin(), file.data_order.end(),
            [&](const TensorToWrite* a, const TensorToWrite* b) {
              const size_t size_a = element_sizes[a->name], size_b = element_sizes[b->name];
              return size_a != size_b ? size_a > size_b : a->name < b->name;
            });

  nlohmann::json header = nlohmann::json::object();
  for (const TensorToWrite* tensor : file.data_order) {
    header[tensor->name] = {{"dtype", tensor->dtype},
                            {"shape", tensor->shape},
                            {"data_offsets", {file.data_bytes, file.data_bytes + tensor->bytes}}};
    file.data_bytes += tensor->bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  try {
    file.header = header.dump();  // nlohmann's objects are std::maps: keys come out sorted
  } catch (const nlohmann::json::exception& e) {
    // dump() throws on strings that are not valid UTF-8.
    return absl::InvalidArgumentError(absl::StrCat(
        "header: a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  file.header.append((8 - file.header.size() % 8) % 8, ' ');
  return file;
}

std::string LengthPrefix(const std::string& header) {
  const uint64_t length = header.size();
  std::string prefix(sizeof length, '\0');
  std::memcpy(prefix.data(), &length, sizeof length);
  return prefix;
}

std::string RandomHex() {
  std::random_device device;
  const uint64_t value = (static_cast<uint64_t>(device()) << 32) ^ device();
  return absl::StrCat(absl::Hex(value, absl::kZeroPad16));
}

}  // namespace

std::string Printable(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max_bytes)), "... (", text.size(), " bytes)");
}

absl::StatusOr<size_t> SafetensorsDTypeSize(absl::string_view dtype) {
  for (const SafetensorsDType& known : kSafetensorsDTypes) {
    if (dtype == known.name) return known.size;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", Quote(dtype),
                   " is not a safetensors dtype (F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, "
                   "I16, I8, U64, U32, U16, U8, BOOL)"));
}

absl::StatusOr<std::string> DTypeToSafetensors(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return std::string("F32");
    case DType::kBFloat16: return std::string("BF16");
    case DType::kFloat16: return std::string("F16");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: no safetensors name for lossd dtype ", static_cast<int>(dtype)));
}

absl::StatusOr<DType> DTypeFromSafetensors(absl::string_view dtype) {
  if (dtype == "F32") return DType::kFloat32;
  if (dtype == "BF16") return DType::kBFloat16;
  if (dtype == "F16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", Quote(dtype), ": expected F32, BF16 or F16"));
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : source_(std::move(other.source_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_size_(std::exchange(other.mapping_size_, 0)),
      owned_bytes_(std::move(other.owned_bytes_)),
      data_start_(other.data_start_),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    source_ = std::move(other.source_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_size_ = std::exchange(other.mapping_size_, 0);
    owned_bytes_ = std::move(other.owned_bytes_);
    data_start_ = other.data_start_;
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
  mapping_ = nullptr;
  mapping_size_ = 0;
}

const uint8_t* SafetensorsFile::file_bytes() const {
  return mapping_ != nullptr ? static_cast<const uint8_t*>(mapping_)
                             : reinterpret_cast<const uint8_t*>(owned_bytes_.data());
}

size_t SafetensorsFile::file_size() const {
  return mapping_ != nullptr ? mapping_size_ : owned_bytes_.size();
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // Non-blocking: opening a FIFO for reading would otherwise wait for a writer, for ever. A
  // regular file, the only kind taken, ignores the flag.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int stat_errno = errno;
    ::close(fd);
    return absl::ErrnoToStatus(stat_errno, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  SafetensorsFile file;
  file.source_ = path;
  const size_t size = static_cast<size_t>(info.st_size);
  // mmap refuses length 0; an empty file is simply too short, which ParseHeader reports.
  if (size > 0) {
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int mmap_errno = errno;
      ::close(fd);
      return absl::ErrnoToStatus(mmap_errno, absl::StrCat(path, ": cannot mmap"));
    }
    file.mapping_ = mapping;
    file.mapping_size_ = size;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  RETURN_IF_ERROR(file.ParseHeader());
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::string bytes,
                                                           std::string source_name) {
  SafetensorsFile file;
  file.source_ = std::move(source_name);
  file.owned_bytes_ = std::move(bytes);
  RETURN_IF_ERROR(file.ParseHeader());
  return file;
}

absl::Status SafetensorsFile::ParseHeader() {
  const uint8_t* bytes = file_bytes();
  const size_t size = file_size();
  uint64_t header_length = 0;
  if (size < sizeof header_length) {
    return absl::DataLossError(
        absl::StrCat(source_, ": file is ", size,
                     " bytes, too short for the 8-byte header length (truncated?)"));
  }
  std::memcpy(&header_length, bytes, sizeof header_length);
  if (header_length > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": header length ", header_length,
                                                   " bytes exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes));
  }
  const size_t after_length = size - sizeof header_length;
  if (header_length > after_length) {
    return absl::DataLossError(absl::StrCat(source_, ": header length ", header_length,
                                            " bytes exceeds the ", after_length,
                                            " bytes that follow it (truncated?)"));
  }
  const absl::string_view header_text(reinterpret_cast<const char*>(bytes) + sizeof header_length,
                                      static_cast<size_t>(header_length));
  data_start_ = sizeof header_length + static_cast<size_t>(header_length);
  const uint64_t data_size = size - data_start_;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_text.begin(), header_text.end());
  } catch (const nlohmann::json::exception& e) {
    // nlohmann quotes the input it last read, which may be long or binary.
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": header: not valid JSON: ", Printable(e.what(), 300)));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": header: expected a JSON object, got ", header.type_name()));
  }

  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (entry.is_null()) continue;  // the reference implementation writes no key, but reads null
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source_, ": __metadata__: expected an object, got ", entry.type_name()));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(source_, ": __metadata__: value of ",
                                                         Quote(key), " is a ", value.type_name(),
                                                         ", expected a string"));
        }
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }

    const std::string where = absl::StrCat(source_, ": tensor ", Quote(name));
    if (!entry.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected an object, got ", entry.type_name()));
    }
    TensorEntry tensor;

    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": dtype: missing or not a string"));
    }
    tensor.dtype = dtype->get<std::string>();
    auto element_size = SafetensorsDTypeSize(tensor.dtype);
    if (!element_size.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", element_size.status().message()));

    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape: missing or not a list"));
    }
    for (const nlohmann::json& dim : *shape) {
      uint64_t value = 0;
      if (!AsNonNegativeInt64(dim, &value)) {
        // dump() recurses into arrays and objects, which a crafted header nests deep enough to
        // overflow the stack; they are named by type instead.
        const std::string shown = dim.is_structured() ? std::string(dim.type_name()) : dim.dump();
        return absl::InvalidArgumentError(absl::StrCat(where, ": shape: ", Printable(shown, 80),
                                                       " is not a non-negative integer"));
      }
      tensor.shape.push_back(static_cast<int64_t>(value));
    }
    uint64_t expected_bytes = 0;
    if (!ByteCount(tensor.shape, *element_size, &expected_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape ", ShapeText(tensor.shape),
                                                     " of ", tensor.dtype,
                                                     " overflows the addressable size"));
    }

    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !AsNonNegativeInt64((*offsets)[0], &tensor.begin) ||
        !AsNonNegativeInt64((*offsets)[1], &tensor.end)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": data_offsets: missing or not a list of two non-negative integers"));
    }
    const std::string offsets_text =
        absl::StrCat("data_offsets [", tensor.begin, ", ", tensor.end, ")");
    if (tensor.begin > tensor.end) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", offsets_text, " end before they begin"));
    }
    if (tensor.end > data_size) {
      return absl::DataLossError(absl::StrCat(where, ": ", offsets_text,
                                              " exceed the data buffer of ", data_size,
                                              " bytes (truncated?)"));
    }
    if (tensor.end - tensor.begin != expected_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", offsets_text, " do not match shape ", ShapeText(tensor.shape),
                       " of ", tensor.dtype, " (", expected_bytes, " bytes)"));
    }
    tensors_.emplace(name, std::move(tensor));
  }

  // The tensors must tile the data buffer exactly, so no bytes hide between or after them.
  std::vector<std::pair<const std::string*, const TensorEntry*>> by_offset;
  for (const auto& [name, tensor] : tensors_) by_offset.emplace_back(&name, &tensor);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  uint64_t covered = 0;
  for (const auto& [name, tensor] : by_offset) {
    if (tensor->begin != covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": tensor ", Quote(*name), ": data_offsets [", tensor->begin, ", ",
                       tensor->end, ") ", tensor->begin > covered ? "leave a gap after" : "overlap",
                       " the tensors before them, which end at ", covered));
    }
    covered = tensor->end;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        source_, ": data buffer: ", data_size - covered,
        " bytes after the last tensor's data_offsets end at ", covered, " belong to no tensor"));
  }
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsFile::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, tensor] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<TensorRef> SafetensorsFile::Tensor(absl::string_view name) const {
  const auto found = tensors_.find(std::string(name));
  if (found == tensors_.end()) {
    std::vector<std::string> listed;
    for (const auto& [present, tensor] : tensors_) {
      if (listed.size() == kNamesListedWhenMissing) break;
      listed.push_back(Quote(present));
    }
    std::string message = absl::StrCat(source_, ": no tensor ", Quote(name), "; the file has ",
                                       tensors_.size(), " tensor", tensors_.size() == 1 ? "" : "s");
    if (!listed.empty()) absl::StrAppend(&message, ": ", absl::StrJoin(listed, ", "));
    if (tensors_.size() > listed.size())
      absl::StrAppend(&message, ", and ", tensors_.size() - listed.size(), " more");
    return absl::NotFoundError(message);
  }
  const TensorEntry& entry = found->second;
  return TensorRef{found->first, entry.dtype, entry.shape, file_bytes() + data_start_ + entry.begin,
                   static_cast<size_t>(entry.end - entry.begin)};
}

absl::StatusOr<std::vector<uint8_t>> ReadAsDType(const TensorRef& tensor, DType target) {
  const std::string where = absl::StrCat("tensor ", Quote(tensor.name));
  auto source = DTypeFromSafetensors(tensor.dtype);
  if (!source.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": has dtype ", Quote(tensor.dtype),
                                                   "; only F32, BF16 and F16 convert to ",
                                                   DTypeName(target)));
  }
  uint64_t expected_bytes = 0;
  if (!ByteCount(tensor.shape, DTypeSize(*source), &expected_bytes) ||
      expected_bytes != tensor.bytes || (tensor.bytes > 0 && tensor.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", tensor.bytes,
                                                   " bytes do not hold shape ",
                                                   ShapeText(tensor.shape), " of ", tensor.dtype));
  }
  const size_t count = tensor.bytes / DTypeSize(*source);
  std::vector<uint8_t> out(count * DTypeSize(target));
  if (*source == target) {
    if (count > 0) std::memcpy(out.data(), tensor.data, tensor.bytes);
    return out;
  }
  // The file's data may be unaligned: every element goes through memcpy.
  const auto load = [&](size_t i) -> float {
    if (*source == DType::kFloat32) {
      float value;
      std::memcpy(&value, tensor.data + 4 * i, 4);
      return value;
    }
    uint16_t bits;
    std::memcpy(&bits, tensor.data + 2 * i, 2);
    return *source == DType::kBFloat16 ? BFloat16ToFloat(bits) : Float16ToFloat(bits);
  };
  for (size_t i = 0; i < count; ++i) {
    const float value = load(i);
    if (target == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &value, 4);
    } else {
      const uint16_t bits =
          target == DType::kBFloat16 ? FloatToBFloat16(value) : FloatToFloat16(value);
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
  }
  return out;
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(const PreparedFile file, PrepareFile(tensors, metadata));
  std::string out = LengthPrefix(file.header);
  out.reserve(out.size() + file.header.size() + file.data_bytes);
  out += file.header;
  for (const TensorToWrite* tensor : file.data_order) {
    out.append(static_cast<const char*>(tensor->data), tensor->bytes);
  }
  return out;
}

absl::Status WriteSafetensorsAtomically(const std::string& path,
                                        const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  auto prepared = PrepareFile(tensors, metadata);
  if (!prepared.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", prepared.status().message()));
  const PreparedFile& file = *prepared;

  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const std::string temp_path = absl::StrCat(path, ".tmp-", ::getpid(), "-", RandomHex());
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(temp_path, ": cannot create"));

  absl::Status status = WriteAll(fd, LengthPrefix(file.header).data(), 8, temp_path);
  if (status.ok()) status = WriteAll(fd, file.header.data(), file.header.size(), temp_path);
  for (const TensorToWrite* tensor : file.data_order) {
    if (!status.ok()) break;
    status = WriteAll(fd, tensor->data, tensor->bytes, temp_path);
  }
  // The data must be on disk before the rename makes it visible, or a crash could expose a file
  // whose name is new but whose blocks were never written.
  if (status.ok() && ::fsync(fd) != 0)
    status = absl::ErrnoToStatus(errno, absl::StrCat(temp_path, ": fsync failed"));
  if (::close(fd) != 0 && status.ok())
    status = absl::ErrnoToStatus(errno, absl::StrCat(temp_path, ": close failed"));
  if (status.ok() && ::rename(temp_path.c_str(), path.c_str()) != 0) {
    status =
        absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot rename ", temp_path, " over it"));
  }
  if (!status.ok()) {
    ::unlink(temp_path.c_str());
    return status;
  }
  // Makes the rename itself durable.
  return FsyncDirectory(dir);
}

absl::Status FsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return absl::ErrnoToStatus(errno, absl::StrCat(dir, ": cannot open directory to fsync it"));
  const int result = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (result != 0)
    return absl::ErrnoToStatus(fsync_errno, absl::StrCat(dir, ": fsync of the directory failed"));
  return absl::OkStatus();
}

}  // namespace lossd::storage
