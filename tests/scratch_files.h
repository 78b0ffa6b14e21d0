// Files and directories for the storage tests.
#ifndef LOSSD_TESTS_SCRATCH_FILES_H_
#define LOSSD_TESTS_SCRATCH_FILES_H_

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lossd/storage/checkpoint.h"
#include "lossd/storage/safetensors.h"

namespace lossd::testing {

namespace fs = std::filesystem;

// A fresh directory under the test's temp dir, removed with everything in it.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix = "lossd_storage") {
    std::string pattern = ::testing::TempDir() + prefix + "_XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return (fs::path(path_) / name).string(); }
  std::set<std::string> Names() const {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_))
      names.insert(entry.path().filename().string());
    return names;
  }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Writes `state` where SaveCheckpoint would, in its format, without checking its values: what a
// server that did not check them could have saved, or a disk could hand back. Returns the path.
inline std::string WriteUncheckedCheckpoint(const std::string& dir,
                                            const storage::CheckpointState& state) {
  const std::string path = storage::CheckpointPath(dir, state.head, state.version);
  fs::create_directories(fs::path(path).parent_path());
  const auto crc = [](const void* data, size_t bytes) {
    return absl::StrCat(absl::Hex(storage::Crc32c(data, bytes), absl::kZeroPad8));
  };
  std::vector<storage::TensorToWrite> tensors = {
      {"weight",
       storage::DTypeToSafetensors(state.weight_dtype).value(),
       {state.vocab_size, state.hidden_size},
       state.weight.data(),
       state.weight.size()}};
  std::map<std::string, std::string> metadata = {
      {"format", "lossd-checkpoint-v1"},
      {"head", state.head},
      {"version", absl::StrCat(state.version)},
      {"steps", absl::StrCat(state.steps)},
      {"optimizer", std::string(storage::OptimizerKindName(state.optimizer))},
      {"vocab_size", absl::StrCat(state.vocab_size)},
      {"hidden_size", absl::StrCat(state.hidden_size)},
      {"crc32c.weight", crc(state.weight.data(), state.weight.size())},
  };
  for (const auto& [name, values] : {std::pair{"optimizer.state1", &state.state1},
                                     std::pair{"optimizer.state2", &state.state2}}) {
    if (values->empty()) continue;
    const size_t bytes = values->size() * sizeof(float);
    tensors.push_back({name, "F32", {state.vocab_size, state.hidden_size}, values->data(), bytes});
    metadata[absl::StrCat("crc32c.", name)] = crc(values->data(), bytes);
  }
  const absl::Status written = storage::WriteSafetensorsAtomically(path, tensors, metadata);
  EXPECT_TRUE(written.ok()) << written;
  return path;
}

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_SCRATCH_FILES_H_
