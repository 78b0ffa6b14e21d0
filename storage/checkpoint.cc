#include "lossd/storage/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/storage/safetensors.h"

namespace lossd::storage {
namespace {

namespace fs = std::filesystem;

// Crc32c reads eight bytes at a time as one little-endian word.
static_assert(std::endian::native == std::endian::little, "Crc32c assumes a little-endian host");

constexpr char kFormatTag[] = "lossd-checkpoint-v1";
constexpr char kWeightTensor[] = "weight";
constexpr char kState1Tensor[] = "optimizer.state1";
constexpr char kState2Tensor[] = "optimizer.state2";
constexpr char kMasterWeightTensor[] = "master_weight";
constexpr char kChecksumPrefix[] = "crc32c.";
constexpr char kFileExtension[] = ".safetensors";
constexpr size_t kVersionDigits = 20;  // UINT64_MAX has 20 decimal digits
// Leaves room for "-v<20 digits>.safetensors.tmp-<pid>-<16 hex>" within a 255-byte file name.
constexpr size_t kMaxHeadNameLength = 128;

using Crc32cTables = std::array<std::array<uint32_t, 256>, 8>;

// Slicing-by-8 tables for the reflected Castagnoli polynomial: eight bytes per step, portable C++
// (about 1 GB/s on the development machine, a small part of writing or reading a checkpoint).
const Crc32cTables& Crc32cLookup() {
  static const Crc32cTables tables = [] {
    Crc32cTables t{};
    for (uint32_t byte = 0; byte < 256; ++byte) {
      uint32_t crc = byte;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
      t[0][byte] = crc;
    }
    for (size_t k = 1; k < t.size(); ++k) {
      for (uint32_t byte = 0; byte < 256; ++byte) {
        t[k][byte] = (t[k - 1][byte] >> 8) ^ t[0][t[k - 1][byte] & 0xff];
      }
    }
    return t;
  }();
  return tables;
}

std::string ChecksumText(uint32_t crc) { return absl::StrCat(absl::Hex(crc, absl::kZeroPad8)); }

bool ProductFits(int64_t vocab_size, int64_t hidden_size, size_t element_size, size_t* bytes) {
  int64_t total = 0;
  if (__builtin_mul_overflow(vocab_size, hidden_size, &total) ||
      __builtin_mul_overflow(total, static_cast<int64_t>(element_size), &total)) {
    return false;
  }
  *bytes = static_cast<size_t>(total);
  return true;
}

// Which optimizer tensors a kind carries; SGD's momentum buffer is there only once a step used
// momentum, so a kSgd state may go without state1.
std::pair<bool, bool> StatesOf(OptimizerKind kind) {
  return {kind != OptimizerKind::kNone, kind == OptimizerKind::kAdamW};
}
bool State1IsOptional(OptimizerKind kind) { return kind == OptimizerKind::kSgd; }

// What a resumed head would carry into every later call and step: W finite in its dtype, finite
// optimizer state, and an AdamW second moment that is a sum of squares (>= 0: a negative one
// makes sqrt(v) NaN at the next step).
absl::Status ValidateValues(const CheckpointState& state) {
  RETURN_IF_ERROR(ValidateFiniteMatrix("weight", state.weight.data(), state.weight_dtype,
                                       state.vocab_size, state.hidden_size));
  if (!state.master_weight.empty()) {
    RETURN_IF_ERROR(ValidateFiniteMatrix("master_weight", state.master_weight.data(),
                                         DType::kFloat32, state.vocab_size, state.hidden_size));
  }
  if (!state.state1.empty()) {
    RETURN_IF_ERROR(ValidateFiniteMatrix("optimizer.state1", state.state1.data(), DType::kFloat32,
                                         state.vocab_size, state.hidden_size));
  }
  if (!state.state2.empty()) {
    RETURN_IF_ERROR(ValidateFiniteMatrix("optimizer.state2", state.state2.data(), DType::kFloat32,
                                         state.vocab_size, state.hidden_size));
    const auto negative =
        std::find_if(state.state2.begin(), state.state2.end(), [](float v) { return v < 0.0f; });
    if (negative != state.state2.end()) {
      const int64_t i = negative - state.state2.begin();
      return InvalidField(absl::StrCat("optimizer.state2[", i / state.hidden_size, ", ",
                                       i % state.hidden_size, "]"),
                          "AdamW's second moment, >= 0", absl::StrCat(*negative));
    }
  }
  return absl::OkStatus();
}

std::optional<OptimizerKind> OptimizerFromName(absl::string_view name) {
  for (const OptimizerKind kind :
       {OptimizerKind::kNone, OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    if (name == OptimizerKindName(kind)) return kind;
  }
  return std::nullopt;
}

absl::Status ValidateState(const CheckpointState& state) {
  RETURN_IF_ERROR(ValidateCheckpointHeadName(state.head));
  const std::string where = absl::StrCat("checkpoint of head '", state.head, "'");
  if (state.vocab_size <= 0 || state.hidden_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape [", state.vocab_size, ", ",
                                                   state.hidden_size, "] must be positive"));
  }
  if (state.steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": steps ", state.steps, " is negative"));
  }
  if (const absl::Status cap = ValidateSoftcap("logit_softcap", state.logit_softcap); !cap.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", cap.message()));
  }
  RETURN_IF_ERROR(DTypeToSafetensors(state.weight_dtype).status());
  size_t weight_bytes = 0, state_bytes = 0;
  if (!ProductFits(state.vocab_size, state.hidden_size, DTypeSize(state.weight_dtype),
                   &weight_bytes) ||
      !ProductFits(state.vocab_size, state.hidden_size, sizeof(float), &state_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape [", state.vocab_size, ", ",
                                                   state.hidden_size, "] is too large"));
  }
  if (state.weight.size() != weight_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": weight has ", state.weight.size(), " bytes, expected ", weight_bytes, " for [",
        state.vocab_size, ", ", state.hidden_size, "] ", DTypeName(state.weight_dtype)));
  }
  if (!OptimizerFromName(OptimizerKindName(state.optimizer))) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unknown optimizer kind ", static_cast<int>(state.optimizer)));
  }
  const auto [has_state1, has_state2] = StatesOf(state.optimizer);
  const size_t state_floats = state_bytes / sizeof(float);
  const auto check = [&](const std::vector<float>& values, bool wanted,
                         const char* name) -> absl::Status {
    const size_t expected = wanted ? state_floats : 0;
    if (values.size() == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", name, " has ", values.size(), " values, expected ", expected,
                     " for optimizer ", OptimizerKindName(state.optimizer)));
  };
  RETURN_IF_ERROR(check(state.state1,
                        has_state1 && !(State1IsOptional(state.optimizer) && state.state1.empty()),
                        "state1"));
  RETURN_IF_ERROR(check(state.state2, has_state2, "state2"));
  if (!state.master_weight.empty()) {
    if (state.weight_dtype == DType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": master_weight given for a float32 weight, which is its own"));
    }
    if (state.master_weight.size() != state_floats) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": master_weight has ",
                                                     state.master_weight.size(),
                                                     " values, expected ", state_floats));
    }
  }
  return absl::OkStatus();
}

std::string ZeroPaddedVersion(uint64_t version) {
  std::string digits = absl::StrCat(version);
  digits.insert(0, kVersionDigits - digits.size(), '0');
  return digits;
}

// The version in "<head>-v<20 digits>.safetensors", or nullopt for any other name.
std::optional<uint64_t> VersionFromFileName(absl::string_view head, absl::string_view file_name) {
  const std::string prefix = absl::StrCat(head, "-v");
  if (file_name.size() != prefix.size() + kVersionDigits + std::strlen(kFileExtension) ||
      !absl::StartsWith(file_name, prefix) || !absl::EndsWith(file_name, kFileExtension)) {
    return std::nullopt;
  }
  const absl::string_view digits = file_name.substr(prefix.size(), kVersionDigits);
  uint64_t version = 0;
  if (!std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(digits, &version)) {
    return std::nullopt;
  }
  return version;
}

// The process id in "<checkpoint file name>.tmp-<pid>-<16 hex digits>", the temporary file an
// atomic write of one of the head's checkpoints creates (WriteSafetensorsAtomically).
std::optional<pid_t> TemporaryFileWriter(absl::string_view head, absl::string_view file_name) {
  const size_t marker = file_name.rfind(".tmp-");
  if (marker == absl::string_view::npos ||
      !VersionFromFileName(head, file_name.substr(0, marker))) {
    return std::nullopt;
  }
  const std::vector<absl::string_view> parts =
      absl::StrSplit(file_name.substr(marker + std::strlen(".tmp-")), '-');
  int64_t pid = 0;
  if (parts.size() != 2 || parts[1].size() != 16 ||
      !std::all_of(parts[1].begin(), parts[1].end(), absl::ascii_isxdigit) ||
      !std::all_of(parts[0].begin(), parts[0].end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(parts[0], &pid) || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) {
    return std::nullopt;
  }
  return static_cast<pid_t>(pid);
}

// A temporary file whose writer is gone is what a crash mid-save leaves; one whose writer still
// runs may be another server's save in progress on a shared directory. This process has not
// started a save yet, so a file bearing its own (reused) id is stale too.
bool WriterIsGone(pid_t writer) {
  return writer == ::getpid() || (::kill(writer, 0) != 0 && errno == ESRCH);
}

absl::Status FilesystemError(const std::error_code& error, absl::string_view what) {
  return absl::ErrnoToStatus(error.value(), what);
}

// The head's checkpoint files as (version, path), newest first, plus the names that are not
// checkpoints.
struct HeadDirectoryListing {
  std::vector<std::pair<uint64_t, std::string>> checkpoints;
  std::vector<std::string> others;
};

absl::StatusOr<HeadDirectoryListing> ListHeadDirectory(const fs::path& head_dir,
                                                       absl::string_view head) {
  HeadDirectoryListing listing;
  std::error_code error;
  fs::directory_iterator it(head_dir, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    const std::optional<uint64_t> version = VersionFromFileName(head, name);
    std::error_code type_error;
    if (version && it->is_regular_file(type_error)) {
      listing.checkpoints.emplace_back(*version, it->path().string());
    } else {
      listing.others.push_back(it->path().string());
    }
  }
  if (error) return FilesystemError(error, absl::StrCat(head_dir.string(), ": cannot list"));
  std::sort(listing.checkpoints.begin(), listing.checkpoints.end(), std::greater<>());
  std::sort(listing.others.begin(), listing.others.end());
  return listing;
}

absl::Status PruneOldCheckpoints(const fs::path& head_dir, absl::string_view head,
                                 uint64_t written_version, const std::string& written,
                                 int keep_last) {
  if (keep_last <= 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(const HeadDirectoryListing listing, ListHeadDirectory(head_dir, head));
  bool removed_any = false;
  for (size_t i = static_cast<size_t>(keep_last); i < listing.checkpoints.size(); ++i) {
    const auto& [version, path] = listing.checkpoints[i];
    if (version == written_version) continue;
    std::error_code error;
    fs::remove(path, error);
    if (error) {
      return FilesystemError(
          error, absl::StrCat("saved ", written, ", but cannot remove the old checkpoint ", path));
    }
    removed_any = true;
  }
  return removed_any ? FsyncDirectory(head_dir.string()) : absl::OkStatus();
}

// The tensor `name` once its dtype, its shape (the metadata's [V, H]) and its checksum are right.
// Checking the shape first means nothing is allocated from the metadata's numbers alone.
absl::StatusOr<TensorRef> VerifiedTensor(const SafetensorsFile& file, const std::string& name,
                                         const std::string& expected_dtype, int64_t vocab_size,
                                         int64_t hidden_size) {
  const std::string where = absl::StrCat(file.source(), ": tensor '", name, "'");
  ASSIGN_OR_RETURN(const TensorRef tensor, file.Tensor(name));
  if (tensor.dtype != expected_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype ", tensor.dtype, ", expected ", expected_dtype));
  }
  if (tensor.shape != std::vector<int64_t>{vocab_size, hidden_size}) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape does not match the metadata's [",
                                                   vocab_size, ", ", hidden_size, "]"));
  }
  const auto stored = file.metadata().find(absl::StrCat(kChecksumPrefix, name));
  if (stored == file.metadata().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": metadata has no ", kChecksumPrefix, name));
  }
  const std::string actual = ChecksumText(Crc32c(tensor.data, tensor.bytes));
  if (stored->second != actual) {
    return absl::DataLossError(absl::StrCat(where, ": CRC-32C of the data is ", actual,
                                            ", the metadata says ", stored->second,
                                            " (corrupt file)"));
  }
  return tensor;
}

std::vector<float> CopyFloats(const TensorRef& tensor) {
  std::vector<float> values(tensor.bytes / sizeof(float));
  if (!values.empty()) std::memcpy(values.data(), tensor.data, tensor.bytes);
  return values;
}

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kNone: return "none";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "unknown";
}

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const Crc32cTables& t = Crc32cLookup();
  const uint8_t* bytes = static_cast<const uint8_t*>(data);
  uint32_t state = ~crc;
  for (; size >= 8; bytes += 8, size -= 8) {
    uint64_t word;
    std::memcpy(&word, bytes, 8);  // little endian: the first byte is the lowest
    const uint32_t low = static_cast<uint32_t>(word) ^ state;
    const uint32_t high = static_cast<uint32_t>(word >> 32);
    state = t[7][low & 0xff] ^ t[6][(low >> 8) & 0xff] ^ t[5][(low >> 16) & 0xff] ^
            t[4][low >> 24] ^ t[3][high & 0xff] ^ t[2][(high >> 8) & 0xff] ^
            t[1][(high >> 16) & 0xff] ^ t[0][high >> 24];
  }
  for (; size > 0; ++bytes, --size) state = t[0][(state ^ *bytes) & 0xff] ^ (state >> 8);
  return ~state;
}

absl::Status ValidateCheckpointHeadName(absl::string_view head) {
  const bool safe_characters = std::all_of(head.begin(), head.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
  });
  if (head.empty() || head.size() > kMaxHeadNameLength || !safe_characters || head == "." ||
      head == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("head: \"", absl::CHexEscape(head.substr(0, kMaxHeadNameLength)),
                     "\" cannot name a checkpoint directory: expected 1 to ", kMaxHeadNameLength,
                     " characters of [A-Za-z0-9._-], not \".\" or \"..\""));
  }
  return absl::OkStatus();
}

std::string CheckpointPath(const std::string& dir, absl::string_view head, uint64_t version) {
  return (fs::path(dir) / std::string(head) /
          absl::StrCat(head, "-v", ZeroPaddedVersion(version), kFileExtension))
      .string();
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& dir, const CheckpointState& state,
                                           int keep_last) {
  if (dir.empty()) return absl::InvalidArgumentError("checkpoint_dir: empty");
  RETURN_IF_ERROR(ValidateState(state));
  // A checkpoint that a resume would refuse is not written: it would only push a good one out.
  const absl::Status values = ValidateValues(state);
  if (!values.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint of head '", state.head,
                                                      "' at version ", state.version, ": ",
                                                      values.message(), "; nothing was saved"));
  }
  const fs::path head_dir = fs::path(dir) / state.head;
  std::error_code error;
  if (fs::create_directories(head_dir, error)) {
    // The new head directory's entry must be durable too, or a crash could lose it with the file.
    RETURN_IF_ERROR(FsyncDirectory(head_dir.parent_path().string()));
  }
  if (error) return FilesystemError(error, absl::StrCat(head_dir.string(), ": cannot create"));

  ASSIGN_OR_RETURN(const std::string weight_dtype, DTypeToSafetensors(state.weight_dtype));
  std::vector<TensorToWrite> tensors = {{kWeightTensor,
                                         weight_dtype,
                                         {state.vocab_size, state.hidden_size},
                                         state.weight.data(),
                                         state.weight.size()}};
  std::map<std::string, std::string> metadata = {
      {"format", kFormatTag},
      {"head", state.head},
      {"version", absl::StrCat(state.version)},
      {"steps", absl::StrCat(state.steps)},
      {"optimizer", std::string(OptimizerKindName(state.optimizer))},
      {"vocab_size", absl::StrCat(state.vocab_size)},
      {"hidden_size", absl::StrCat(state.hidden_size)},
      {"tied_embeddings", state.tied_embeddings ? "true" : "false"},
      // Enough digits to read back the same double.
      {"logit_softcap", absl::StrFormat("%.17g", state.logit_softcap)},
      {absl::StrCat(kChecksumPrefix, kWeightTensor),
       ChecksumText(Crc32c(state.weight.data(), state.weight.size()))},
  };
  const auto add_state = [&](const char* name, const std::vector<float>& values) {
    if (values.empty()) return;
    const size_t bytes = values.size() * sizeof(float);
    tensors.push_back({name, "F32", {state.vocab_size, state.hidden_size}, values.data(), bytes});
    metadata[absl::StrCat(kChecksumPrefix, name)] = ChecksumText(Crc32c(values.data(), bytes));
  };
  add_state(kState1Tensor, state.state1);
  add_state(kState2Tensor, state.state2);
  add_state(kMasterWeightTensor, state.master_weight);

  const std::string path = CheckpointPath(dir, state.head, state.version);
  RETURN_IF_ERROR(WriteSafetensorsAtomically(path, tensors, metadata));
  RETURN_IF_ERROR(PruneOldCheckpoints(head_dir, state.head, state.version, path, keep_last));
  return path;
}

absl::StatusOr<CheckpointState> LoadCheckpoint(const std::string& path) {
  ASSIGN_OR_RETURN(const SafetensorsFile file, SafetensorsFile::Open(path));
  const std::map<std::string, std::string>& metadata = file.metadata();
  const auto field = [&](const std::string& key) -> absl::StatusOr<std::string> {
    const auto found = metadata.find(key);
    if (found == metadata.end()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": metadata: '", key, "' is missing"));
    }
    return found->second;
  };
  const auto bad_field = [&](absl::string_view key, absl::string_view value,
                             absl::string_view expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": metadata: ", key, " is \"", absl::CHexEscape(value), "\", expected ", expected));
  };

  ASSIGN_OR_RETURN(const std::string format, field("format"));
  if (format != kFormatTag)
    return bad_field("format", format, absl::StrCat("\"", kFormatTag, "\""));
  CheckpointState state;
  ASSIGN_OR_RETURN(state.head, field("head"));
  if (!ValidateCheckpointHeadName(state.head).ok()) {
    return bad_field("head", state.head, "a name of [A-Za-z0-9._-] characters");
  }
  ASSIGN_OR_RETURN(const std::string version, field("version"));
  if (!absl::SimpleAtoi(version, &state.version))
    return bad_field("version", version, "an unsigned integer");
  ASSIGN_OR_RETURN(const std::string steps, field("steps"));
  if (!absl::SimpleAtoi(steps, &state.steps) || state.steps < 0) {
    return bad_field("steps", steps, "a non-negative integer");
  }
  ASSIGN_OR_RETURN(const std::string vocab_size, field("vocab_size"));
  if (!absl::SimpleAtoi(vocab_size, &state.vocab_size) || state.vocab_size <= 0) {
    return bad_field("vocab_size", vocab_size, "a positive integer");
  }
  ASSIGN_OR_RETURN(const std::string hidden_size, field("hidden_size"));
  if (!absl::SimpleAtoi(hidden_size, &state.hidden_size) || state.hidden_size <= 0) {
    return bad_field("hidden_size", hidden_size, "a positive integer");
  }
  ASSIGN_OR_RETURN(const std::string optimizer, field("optimizer"));
  const std::optional<OptimizerKind> kind = OptimizerFromName(optimizer);
  if (!kind) return bad_field("optimizer", optimizer, "\"none\", \"sgd\" or \"adamw\"");
  state.optimizer = *kind;
  // Optional: checkpoints written before heads knew their tie and soft cap lack them.
  if (const auto tied = metadata.find("tied_embeddings"); tied != metadata.end()) {
    if (tied->second != "true" && tied->second != "false") {
      return bad_field("tied_embeddings", tied->second, "\"true\" or \"false\"");
    }
    state.tied_embeddings = tied->second == "true";
  }
  if (const auto cap = metadata.find("logit_softcap"); cap != metadata.end()) {
    if (!absl::SimpleAtod(cap->second, &state.logit_softcap) ||
        !ValidateSoftcap("logit_softcap", state.logit_softcap).ok()) {
      return bad_field("logit_softcap", cap->second,
                       "0 or a positive normal fp32 number (1.17549e-38 to 3.40282e+38)");
    }
  }

  const auto [has_state1, has_state2] = StatesOf(state.optimizer);
  // Built in place: clang before 16 cannot capture structured bindings in a lambda.
  std::set<std::string> expected_tensors = {kWeightTensor};
  if (has_state1) expected_tensors.insert(kState1Tensor);
  if (has_state2) expected_tensors.insert(kState2Tensor);
  const std::vector<std::string> names = file.TensorNames();
  const std::set<std::string> present(names.begin(), names.end());
  // SGD without momentum saves no momentum buffer.
  const bool without_state1 =
      State1IsOptional(state.optimizer) && present.count(kState1Tensor) == 0;
  if (without_state1) expected_tensors.erase(kState1Tensor);
  // Optional: only 16-bit heads that trained have one.
  const bool has_master = present.count(kMasterWeightTensor) > 0;
  if (has_master) expected_tensors.insert(kMasterWeightTensor);
  if (present != expected_tensors) {
    std::vector<std::string> quoted;
    for (const std::string& name : names)
      quoted.push_back(absl::StrCat("'", absl::CHexEscape(name), "'"));
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensors [", absl::StrJoin(quoted, ", "), "] do not match optimizer ",
                     optimizer, ", which needs ", absl::StrJoin(expected_tensors, ", ")));
  }

  ASSIGN_OR_RETURN(const TensorRef weight_entry, file.Tensor(kWeightTensor));
  auto weight_dtype = DTypeFromSafetensors(weight_entry.dtype);
  if (!weight_dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor 'weight': ", weight_dtype.status().message()));
  }
  state.weight_dtype = *weight_dtype;
  ASSIGN_OR_RETURN(const TensorRef weight, VerifiedTensor(file, kWeightTensor, weight_entry.dtype,
                                                          state.vocab_size, state.hidden_size));
  state.weight.assign(weight.data, weight.data + weight.bytes);
  if (has_state1 && !without_state1) {
    ASSIGN_OR_RETURN(const TensorRef state1, VerifiedTensor(file, kState1Tensor, "F32",
                                                            state.vocab_size, state.hidden_size));
    state.state1 = CopyFloats(state1);
  }
  if (has_state2) {
    ASSIGN_OR_RETURN(const TensorRef state2, VerifiedTensor(file, kState2Tensor, "F32",
                                                            state.vocab_size, state.hidden_size));
    state.state2 = CopyFloats(state2);
  }
  if (has_master) {
    if (state.weight_dtype == DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor 'master_weight' beside a float32 'weight', which is its own master"));
    }
    ASSIGN_OR_RETURN(const TensorRef master, VerifiedTensor(file, kMasterWeightTensor, "F32",
                                                            state.vocab_size, state.hidden_size));
    state.master_weight = CopyFloats(master);
  }
  const absl::Status values = ValidateValues(state);
  if (!values.ok()) {
    return absl::Status(values.code(), absl::StrCat(path, ": ", values.message()));
  }
  return state;
}

absl::StatusOr<ResumeResult> ResumeFromDirectory(const std::string& dir) {
  ResumeResult result;
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (status.type() == fs::file_type::not_found) {
    // A link to nowhere is not a directory yet to be made: saves would fail, or go elsewhere
    // once something appears there.
    std::error_code link_error;
    if (fs::is_symlink(fs::symlink_status(dir, link_error))) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": a symbolic link to ", fs::read_symlink(dir, link_error).string(),
                       ", which does not exist; expected a directory, or nothing there yet"));
    }
    return result;
  }
  if (error) return FilesystemError(error, absl::StrCat(dir, ": cannot stat"));
  if (!fs::is_directory(status))
    return absl::FailedPreconditionError(absl::StrCat(dir, ": not a directory"));

  std::vector<fs::path> entries;
  fs::directory_iterator it(dir, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error))
    entries.push_back(it->path());
  if (error) return FilesystemError(error, absl::StrCat(dir, ": cannot list"));
  std::sort(entries.begin(), entries.end());

  for (const fs::path& entry : entries) {
    const std::string head = entry.filename().string();
    std::error_code type_error;
    if (!fs::is_directory(entry, type_error)) {
      result.skipped.push_back(absl::StrCat(entry.string(), ": not a head directory"));
      continue;
    }
    if (!ValidateCheckpointHeadName(head).ok()) {
      result.skipped.push_back(absl::StrCat(entry.string(), ": not a valid head name"));
      continue;
    }
    ASSIGN_OR_RETURN(const HeadDirectoryListing listing, ListHeadDirectory(entry, head));
    for (const std::string& other : listing.others) {
      const std::optional<pid_t> writer =
          TemporaryFileWriter(head, fs::path(other).filename().string());
      if (!writer) {
        result.skipped.push_back(absl::StrCat(other, ": not a checkpoint file name"));
      } else if (!WriterIsGone(*writer)) {
        result.skipped.push_back(absl::StrCat(other, ": temporary file of a save by process ",
                                              *writer, ", which is running; kept"));
      } else {
        std::error_code remove_error;
        fs::remove(other, remove_error);
        result.skipped.push_back(absl::StrCat(
            other, ": temporary file of an interrupted save, ",
            remove_error ? "cannot remove it: " + remove_error.message() : std::string("removed")));
      }
    }
    std::vector<std::string> reasons;
    bool resumed = false;
    for (const auto& [version, path] : listing.checkpoints) {
      absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(path);
      if (!loaded.ok()) {
        reasons.push_back(std::string(loaded.status().message()));
      } else if (loaded->head != head || loaded->version != version) {
        reasons.push_back(absl::StrCat(path, ": metadata names head '", loaded->head, "' version ",
                                       loaded->version, ", not the file name's"));
      } else {
        result.heads.push_back(*std::move(loaded));
        resumed = true;
        break;
      }
    }
    result.skipped.insert(result.skipped.end(), reasons.begin(), reasons.end());
    if (!resumed && !reasons.empty()) {
      result.damaged.push_back({head, entry.string(), std::move(reasons)});
    }
  }
  return result;
}

}  // namespace lossd::storage
