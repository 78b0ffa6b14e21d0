#include "lossd/storage/checkpoint.h"

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/kernels/half.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/storage/safetensors.h"
#include "tests/scratch_files.h"

namespace lossd::storage {
namespace {

using ::lossd::testing::ReadFile;
using ::lossd::testing::ScratchDir;
using ::lossd::testing::WriteFile;
using ::lossd::testing::WriteUncheckedCheckpoint;

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::set<std::string> FileNames(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    names.insert(entry.path().filename().string());
  return names;
}

// A head of random shape and values, finite as a checkpoint must hold them (random bits that are
// not NaN or Inf); optimizer state includes values whose bits only a bitwise copy preserves
// (negative zero, the smallest subnormal, the largest float). AdamW's second moment is >= 0.
CheckpointState RandomState(std::mt19937& rng, const std::string& head, uint64_t version,
                            DType dtype, OptimizerKind optimizer) {
  CheckpointState state;
  state.head = head;
  state.version = version;
  state.steps = std::uniform_int_distribution<int64_t>(0, 1000)(rng);
  state.vocab_size = std::uniform_int_distribution<int64_t>(1, 97)(rng);
  state.hidden_size = std::uniform_int_distribution<int64_t>(1, 24)(rng);
  state.weight_dtype = dtype;
  const size_t count = static_cast<size_t>(state.vocab_size * state.hidden_size);
  state.weight.resize(count * DTypeSize(dtype));
  for (size_t i = 0; i < count; ++i) {
    float value;
    do {
      for (size_t b = 0; b < DTypeSize(dtype); ++b) {
        state.weight[i * DTypeSize(dtype) + b] = static_cast<uint8_t>(rng());
      }
      value = LoadAsFloat(state.weight.data(), dtype, static_cast<int64_t>(i));
    } while (!std::isfinite(value));
  }
  state.optimizer = optimizer;
  std::normal_distribution<float> normal;
  const auto random_floats = [&](bool non_negative) {
    std::vector<float> values(count);
    for (float& value : values) value = non_negative ? std::fabs(normal(rng)) : normal(rng);
    values[0] = non_negative ? 0.0f : -0.0f;
    if (count > 1) values[1] = BitsToFloat(0x00000001u);
    if (count > 2) values[2] = std::numeric_limits<float>::max() * (non_negative ? 1.0f : -1.0f);
    return values;
  };
  if (optimizer != OptimizerKind::kNone) state.state1 = random_floats(false);
  if (optimizer == OptimizerKind::kAdamW) state.state2 = random_floats(true);
  state.tied_embeddings = rng() % 2 == 0;
  // Gemma 2's cap, none, or a value that needs every digit of a double to come back the same.
  const double caps[] = {30.0, 0.0, std::uniform_real_distribution<double>(0.1, 100.0)(rng)};
  state.logit_softcap = caps[rng() % 3];
  return state;
}

// Compares floats by their bits, so that NaN payloads and -0.0 count.
std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits;
  for (const float value : values) bits.push_back(FloatBits(value));
  return bits;
}

void ExpectSameState(const CheckpointState& actual, const CheckpointState& expected) {
  EXPECT_EQ(actual.head, expected.head);
  EXPECT_EQ(actual.version, expected.version);
  EXPECT_EQ(actual.steps, expected.steps);
  EXPECT_EQ(actual.vocab_size, expected.vocab_size);
  EXPECT_EQ(actual.hidden_size, expected.hidden_size);
  EXPECT_EQ(actual.weight_dtype, expected.weight_dtype);
  EXPECT_EQ(actual.weight, expected.weight);
  EXPECT_EQ(actual.optimizer, expected.optimizer);
  EXPECT_EQ(Bits(actual.state1), Bits(expected.state1));
  EXPECT_EQ(Bits(actual.state2), Bits(expected.state2));
  EXPECT_EQ(actual.tied_embeddings, expected.tied_embeddings);
  EXPECT_EQ(actual.logit_softcap, expected.logit_softcap);
}

uint32_t FreshSeed() { return std::random_device{}(); }

TEST(Crc32cTest, MatchesPublishedVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  const std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xff);
  std::vector<uint8_t> ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(ascending.data(), ascending.size()), 0x46dd794eu);
}

TEST(Crc32cTest, ContinuesAcrossSplitsAtAnyOffset) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(1000);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
  const uint32_t whole = Crc32c(bytes.data(), bytes.size());
  for (size_t split = 0; split <= bytes.size(); split += 1 + split / 16) {
    const uint32_t first = Crc32c(bytes.data(), split);
    EXPECT_EQ(Crc32c(bytes.data() + split, bytes.size() - split, first), whole)
        << "split at " << split;
  }
}

class CheckpointRoundTripTest : public ::testing::TestWithParam<std::tuple<DType, OptimizerKind>> {
};

TEST_P(CheckpointRoundTripTest, LoadsBackBitForBit) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const auto [dtype, optimizer] = GetParam();
  const CheckpointState state = RandomState(rng, "lm_head", 42, dtype, optimizer);
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());

  absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), state);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, dir.File("lm_head/lm_head-v00000000000000000042.safetensors"));
  EXPECT_EQ(*path, CheckpointPath(dir.path(), "lm_head", 42));
  EXPECT_EQ(FileNames(dir.File("lm_head")),
            std::set<std::string>{"lm_head-v00000000000000000042.safetensors"});

  absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(*path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, state);

  // It is an ordinary safetensors file that other tools can read.
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(*path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<TensorRef> weight = file->Tensor("weight");
  ASSERT_TRUE(weight.ok());
  EXPECT_EQ(weight->dtype, *DTypeToSafetensors(dtype));
  EXPECT_EQ(weight->shape, (std::vector<int64_t>{state.vocab_size, state.hidden_size}));
  EXPECT_EQ(file->metadata().at("format"), "lossd-checkpoint-v1");
  EXPECT_EQ(file->metadata().at("head"), "lm_head");
  EXPECT_EQ(file->metadata().at("version"), "42");
  EXPECT_EQ(file->metadata().at("steps"), absl::StrCat(state.steps));
  EXPECT_EQ(file->metadata().at("optimizer"), OptimizerKindName(optimizer));
  EXPECT_EQ(file->TensorNames().size(),
            1u + (state.state1.empty() ? 0u : 1u) + (state.state2.empty() ? 0u : 1u));
}

INSTANTIATE_TEST_SUITE_P(DTypesAndOptimizers, CheckpointRoundTripTest,
                         ::testing::Values(std::tuple(DType::kFloat32, OptimizerKind::kNone),
                                           std::tuple(DType::kBFloat16, OptimizerKind::kSgd),
                                           std::tuple(DType::kFloat16, OptimizerKind::kAdamW),
                                           std::tuple(DType::kFloat32, OptimizerKind::kAdamW),
                                           std::tuple(DType::kBFloat16, OptimizerKind::kAdamW)),
                         [](const auto& param_info) {
                           return absl::StrCat(DTypeName(std::get<0>(param_info.param)), "_",
                                               OptimizerKindName(std::get<1>(param_info.param)));
                         });

TEST(CheckpointTest, SavingTheSameVersionAgainReplacesIt) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  ASSERT_TRUE(
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 3, DType::kFloat32, OptimizerKind::kSgd))
          .ok());
  const CheckpointState second = RandomState(rng, "h", 3, DType::kBFloat16, OptimizerKind::kAdamW);
  absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), second);
  ASSERT_TRUE(path.ok()) << path.status();
  absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(*path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, second);
  EXPECT_EQ(FileNames(dir.File("h")).size(), 1u);
}

TEST(CheckpointTest, KeepsOnlyTheNewestCheckpoints) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  const auto name = [](uint64_t version) {
    return fs::path(CheckpointPath("", "h", version)).filename().string();
  };
  ASSERT_TRUE(SaveCheckpoint(dir.path(),
                             RandomState(rng, "other", 1, DType::kFloat32, OptimizerKind::kNone))
                  .ok());
  for (uint64_t version = 1; version <= 6; ++version) {
    ASSERT_TRUE(
        SaveCheckpoint(dir.path(),
                       RandomState(rng, "h", version, DType::kFloat32, OptimizerKind::kNone), 3)
            .ok());
  }
  EXPECT_EQ(FileNames(dir.File("h")), (std::set<std::string>{name(4), name(5), name(6)}));

  // An older version saved later is beyond keep_last but is the file just written: it stays.
  ASSERT_TRUE(
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 2, DType::kFloat32, OptimizerKind::kNone), 3)
          .ok());
  EXPECT_EQ(FileNames(dir.File("h")), (std::set<std::string>{name(2), name(4), name(5), name(6)}));

  // Version order is numeric, not the order of saving; keep_last 1 keeps the newest and the new
  // one.
  ASSERT_TRUE(SaveCheckpoint(dir.path(),
                             RandomState(rng, "h", 10, DType::kFloat32, OptimizerKind::kNone), 1)
                  .ok());
  EXPECT_EQ(FileNames(dir.File("h")), std::set<std::string>{name(10)});

  // keep_last <= 0 keeps everything.
  ASSERT_TRUE(SaveCheckpoint(dir.path(),
                             RandomState(rng, "h", 11, DType::kFloat32, OptimizerKind::kNone), 0)
                  .ok());
  EXPECT_EQ(FileNames(dir.File("h")), (std::set<std::string>{name(10), name(11)}));

  // Other heads are never touched.
  EXPECT_EQ(FileNames(dir.File("other")).size(), 1u);
}

TEST(CheckpointTest, RejectsUnsafeHeadNames) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  for (const std::string& head :
       {std::string(""), std::string("."), std::string(".."), std::string("a/b"),
        std::string("../escape"), std::string("/abs"), std::string("with space"),
        std::string("na\xc3\xafve"), std::string("nul\0byte", 8), std::string("a\\b"),
        std::string(129, 'x')}) {
    SCOPED_TRACE(::testing::Message() << "head \"" << head << "\"");
    EXPECT_EQ(ValidateCheckpointHeadName(head).code(), absl::StatusCode::kInvalidArgument);
    CheckpointState state = RandomState(rng, "ok", 1, DType::kFloat32, OptimizerKind::kNone);
    state.head = head;
    const absl::Status status = SaveCheckpoint(dir.path(), state).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), StartsWith("head: "));
  }
  EXPECT_TRUE(FileNames(dir.path()).empty());
  EXPECT_FALSE(fs::exists(fs::path(dir.path()).parent_path() / "escape"));
  for (const std::string& head :
       {std::string("lm_head"), std::string("Qwen2.5-7B"), std::string("a..b"),
        std::string(".hidden"), std::string("x_1-2.3"), std::string(128, 'y')}) {
    EXPECT_TRUE(ValidateCheckpointHeadName(head).ok()) << head;
  }
}

TEST(CheckpointTest, RejectsInconsistentStatesWithoutWriting) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  // clang-format off
  const struct {
    const char* reason;
    std::function<void(CheckpointState&)> damage;
    const char* fragment;
  } cases[] = {
      {"weight one byte short", [](auto& s) { s.weight.pop_back(); }, "weight"},
      {"zero vocabulary", [](auto& s) { s.vocab_size = 0; }, "positive"},
      {"negative steps", [](auto& s) { s.steps = -1; }, "steps"},
      {"shape too large", [](auto& s) { s.vocab_size = s.hidden_size = int64_t{1} << 40; }, "too large"},
      {"SGD with a second moment", [](auto& s) { s.state2 = s.state1; }, "state2"},
      {"no optimizer but state", [](auto& s) { s.optimizer = OptimizerKind::kNone; }, "state1"},
      {"AdamW without second moment", [](auto& s) { s.optimizer = OptimizerKind::kAdamW; }, "state2"},
      {"state of the wrong length", [](auto& s) { s.state1.push_back(0.0f); }, "state1"},
      {"unknown optimizer", [](auto& s) { s.optimizer = static_cast<OptimizerKind>(7); }, "optimizer"},
      {"negative soft cap", [](auto& s) { s.logit_softcap = -1; }, "logit_softcap"},
      {"infinite soft cap", [](auto& s) { s.logit_softcap = HUGE_VAL; }, "logit_softcap"},
      {"soft cap 0 in fp32", [](auto& s) { s.logit_softcap = 1e-300; }, "logit_softcap"},
      {"soft cap Inf in fp32", [](auto& s) { s.logit_softcap = 1e39; }, "logit_softcap"},
  };
  // clang-format on

  for (const auto& c : cases) {
    SCOPED_TRACE(c.reason);
    CheckpointState state = RandomState(rng, "h", 1, DType::kFloat32, OptimizerKind::kSgd);
    c.damage(state);
    const absl::Status status = SaveCheckpoint(dir.path(), state).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.fragment));
  }
  EXPECT_TRUE(FileNames(dir.path()).empty());
}

// Rewrites a saved checkpoint with its tensors and metadata altered by `damage`.
using Damage =
    std::function<void(std::vector<TensorToWrite>&, std::map<std::string, std::string>&)>;

struct InvalidCheckpointCase {
  std::string id;
  std::string reason;
  Damage damage;
  absl::StatusCode code;
  std::string fragment;
};

std::vector<InvalidCheckpointCase> InvalidCheckpointCases() {
  const absl::StatusCode invalid = absl::StatusCode::kInvalidArgument;
  const auto set = [](std::string key, std::string value) -> Damage {
    return [=](auto&, auto& metadata) { metadata[key] = value; };
  };
  const auto erase = [](std::string key) -> Damage {
    return [=](auto&, auto& metadata) { metadata.erase(key); };
  };
  const auto find = [](std::vector<TensorToWrite>& tensors,
                       const std::string& name) -> TensorToWrite& {
    return *std::find_if(tensors.begin(), tensors.end(),
                         [&](const TensorToWrite& t) { return t.name == name; });
  };
  // clang-format off
  return {
      {"format_missing", "no format tag", erase("format"), invalid, "'format' is missing"},
      {"format_other", "a different format", set("format", "lossd-checkpoint-v2"), invalid, "format"},
      {"head_unsafe", "head is not a path component", set("head", "../x"), invalid, "head"},
      {"version_text", "version is not a number", set("version", "seven"), invalid, "version"},
      {"version_negative", "version is unsigned", set("version", "-1"), invalid, "version"},
      {"steps_negative", "steps below zero", set("steps", "-5"), invalid, "steps"},
      {"vocab_zero", "vocab_size must be positive", set("vocab_size", "0"), invalid, "vocab_size"},
      {"vocab_mismatch", "metadata shape differs from the weight",
       [](auto& tensors, auto& metadata) { metadata["vocab_size"] = absl::StrCat(tensors[0].shape[0] + 1); },
       invalid, "shape does not match"},
      {"vocab_enormous", "metadata claims a shape far beyond the file, which must not be allocated",
       set("vocab_size", "4000000000000"), invalid, "shape does not match"},
      {"hidden_mismatch", "metadata shape differs from the weight",
       [](auto& tensors, auto& metadata) { metadata["hidden_size"] = absl::StrCat(tensors[0].shape[1] + 1); },
       invalid, "shape does not match"},
      {"optimizer_unknown", "no such optimizer", set("optimizer", "adam"), invalid, "optimizer"},
      {"tied_text", "tied_embeddings is neither true nor false", set("tied_embeddings", "yes"), invalid,
       "tied_embeddings"},
      {"softcap_text", "logit_softcap is not a number", set("logit_softcap", "thirty"), invalid,
       "logit_softcap"},
      {"softcap_negative", "a negative cap", set("logit_softcap", "-30"), invalid, "logit_softcap"},
      {"softcap_nan", "a NaN cap", set("logit_softcap", "nan"), invalid, "logit_softcap"},
      {"optimizer_needs_more", "AdamW needs a second moment",
       set("optimizer", "adamw"), invalid, "optimizer.state2"},
      {"optimizer_none_with_state", "state tensors without an optimizer", set("optimizer", "none"), invalid,
       "do not match optimizer none"},
      {"extra_tensor", "a tensor the format does not have",
       [](auto& tensors, auto&) { tensors.push_back({"extra", "U8", {0}, nullptr, 0}); }, invalid, "'extra'"},
      {"weight_integer", "weight as I32",
       [find](auto& tensors, auto&) { find(tensors, "weight").dtype = "I32"; }, invalid, "I32"},
      {"state_bf16", "optimizer state must be F32",
       [find](auto& tensors, auto&) {
         TensorToWrite& state = find(tensors, "optimizer.state1");
         state.dtype = "BF16";
         state.shape[1] *= 2;
       },
       invalid, "expected F32"},
      {"checksum_missing", "no checksum for the weight", erase("crc32c.weight"), invalid, "crc32c.weight"},
      {"checksum_wrong", "checksum does not match the data", set("crc32c.optimizer.state1", "00000000"),
       absl::StatusCode::kDataLoss, "CRC-32C"},
  };
  // clang-format on
}

class InvalidCheckpointTest : public ::testing::TestWithParam<InvalidCheckpointCase> {};

TEST_P(InvalidCheckpointTest, IsRejectedWithTheReason) {
  const InvalidCheckpointCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  CheckpointState state = RandomState(rng, "h", 5, DType::kFloat32, OptimizerKind::kSgd);
  state.hidden_size = 2;  // even, so that state_bf16 can reinterpret the bytes
  state.weight.resize(state.vocab_size * 2 * 4);
  state.state1.resize(state.vocab_size * 2);
  absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), state);
  ASSERT_TRUE(path.ok()) << path.status();

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(*path);
  ASSERT_TRUE(file.ok());
  std::vector<TensorToWrite> tensors;
  for (const std::string& name : file->TensorNames()) {
    const TensorRef tensor = *file->Tensor(name);
    tensors.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.data, tensor.bytes});
  }
  std::map<std::string, std::string> metadata = file->metadata();
  c.damage(tensors, metadata);
  const std::string damaged = dir.File("damaged.safetensors");
  ASSERT_TRUE(WriteSafetensorsAtomically(damaged, tensors, metadata).ok());

  const absl::Status status = LoadCheckpoint(damaged).status();
  EXPECT_EQ(status.code(), c.code) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith(damaged + ": "));
  EXPECT_THAT(std::string(status.message()), HasSubstr(c.fragment));
}

INSTANTIATE_TEST_SUITE_P(Cases, InvalidCheckpointTest,
                         ::testing::ValuesIn(InvalidCheckpointCases()),
                         [](const ::testing::TestParamInfo<InvalidCheckpointCase>& param_info) {
                           return param_info.param.id;
                         });

// Checkpoints from before heads carried their tie and soft cap still resume, untied and uncapped.
TEST(CheckpointTest, CheckpointsWithoutTieOrCapLoadUntiedAndUncapped) {
  std::mt19937 rng(FreshSeed());
  ScratchDir dir;
  CheckpointState state = RandomState(rng, "h", 3, DType::kBFloat16, OptimizerKind::kNone);
  state.tied_embeddings = true;
  state.logit_softcap = 30.0;
  absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), state);
  ASSERT_TRUE(path.ok()) << path.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(*path);
  ASSERT_TRUE(file.ok());
  const TensorRef weight = *file->Tensor("weight");
  std::map<std::string, std::string> metadata = file->metadata();
  ASSERT_EQ(metadata.erase("tied_embeddings") + metadata.erase("logit_softcap"), 2u);
  const std::string older = dir.File("older.safetensors");
  ASSERT_TRUE(
      WriteSafetensorsAtomically(
          older, {{weight.name, weight.dtype, weight.shape, weight.data, weight.bytes}}, metadata)
          .ok());

  absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(older);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  state.tied_embeddings = false;
  state.logit_softcap = 0.0;
  ExpectSameState(*loaded, state);
}

TEST(CheckpointTest, TruncatedCheckpointsAreDataLoss) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  absl::StatusOr<std::string> path =
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 1, DType::kBFloat16, OptimizerKind::kAdamW));
  ASSERT_TRUE(path.ok()) << path.status();
  const std::string whole = ReadFile(*path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, whole.data(), 8);
  const size_t data_start = 8 + header_length;
  // Cuts all through the header (and its length field), then 64 spread over the data.
  std::vector<size_t> cuts;
  for (size_t cut = 0; cut < data_start; cut += (cut < 16 ? 1 : 3)) cuts.push_back(cut);
  for (size_t k = 0; k < 64; ++k) cuts.push_back(data_start + k * (whole.size() - data_start) / 64);
  cuts.push_back(whole.size() - 1);
  const std::string cut_path = dir.File("cut.safetensors");
  for (const size_t cut : cuts) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << whole.size());
    WriteFile(cut_path, whole.substr(0, cut));
    const absl::Status status = LoadCheckpoint(cut_path).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  }
}

TEST(CheckpointTest, FlippedDataBitIsDataLoss) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  absl::StatusOr<std::string> path =
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 1, DType::kFloat32, OptimizerKind::kAdamW));
  ASSERT_TRUE(path.ok()) << path.status();
  const std::string whole = ReadFile(*path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, whole.data(), 8);
  const size_t data_start = 8 + header_length;
  for (int trial = 0; trial < 20; ++trial) {
    std::string damaged = whole;
    const size_t at = std::uniform_int_distribution<size_t>(data_start, whole.size() - 1)(rng);
    damaged[at] ^= static_cast<char>(1 << (rng() % 8));
    WriteFile(*path, damaged);
    const absl::Status status = LoadCheckpoint(*path).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << "byte " << at << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("CRC-32C"));
  }
}

TEST(ResumeTest, MissingDirectoryIsEmpty) {
  ScratchDir dir;
  absl::StatusOr<ResumeResult> result = ResumeFromDirectory(dir.File("never-created"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->heads.empty());
  EXPECT_TRUE(result->skipped.empty());

  WriteFile(dir.File("a-file"), "x");
  EXPECT_EQ(ResumeFromDirectory(dir.File("a-file")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ResumeTest, PicksTheNewestCheckpointThatLoads) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  const auto save = [&](const std::string& head, uint64_t version, OptimizerKind optimizer) {
    const CheckpointState state = RandomState(rng, head, version, DType::kBFloat16, optimizer);
    absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), state, 10);
    EXPECT_TRUE(path.ok()) << path.status();
    return std::pair(state, path.value_or(""));
  };

  // alpha: v3 was cut short by a crash of something other than our writer.
  save("alpha", 1, OptimizerKind::kSgd);
  const auto [alpha_v2, alpha_v2_path] = save("alpha", 2, OptimizerKind::kSgd);
  const std::string alpha_v3_path = save("alpha", 3, OptimizerKind::kSgd).second;
  const std::string alpha_v3_bytes = ReadFile(alpha_v3_path);
  WriteFile(alpha_v3_path, alpha_v3_bytes.substr(0, alpha_v3_bytes.size() / 2));
  // ...and an interrupted save left its temporary file behind. Its writer's id is above Linux's
  // largest pid_max (2^22), so no process can hold it.
  const std::string stray = alpha_v3_path + ".tmp-4194305-0123456789abcdef";
  WriteFile(stray, alpha_v3_bytes.substr(0, 100));

  // beta: the newest has one flipped bit in the weight (the last tensor in the file).
  const CheckpointState beta_v5 = save("beta", 5, OptimizerKind::kAdamW).first;
  const std::string beta_v7_path = save("beta", 7, OptimizerKind::kAdamW).second;
  std::string beta_v7_bytes = ReadFile(beta_v7_path);
  beta_v7_bytes.back() ^= 0x10;
  WriteFile(beta_v7_path, beta_v7_bytes);

  // gamma: its only checkpoint is garbage, so gamma is not resumed at all.
  const std::string gamma_v1_path = save("gamma", 1, OptimizerKind::kNone).second;
  WriteFile(gamma_v1_path, "not a safetensors file at all");

  // delta: a file copied from another head's directory, with a name that claims to be delta's.
  fs::create_directory(dir.File("delta"));
  fs::copy_file(alpha_v2_path, CheckpointPath(dir.path(), "delta", 2));

  // epsilon: intact, no optimizer.
  const CheckpointState epsilon_v9 = save("epsilon", 9, OptimizerKind::kNone).first;

  absl::StatusOr<ResumeResult> result = ResumeFromDirectory(dir.path());
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->heads.size(), 3u);
  ExpectSameState(result->heads[0], alpha_v2);
  ExpectSameState(result->heads[1], beta_v5);
  ExpectSameState(result->heads[2], epsilon_v9);

  const std::vector<std::string>& skipped = result->skipped;
  ASSERT_EQ(skipped.size(), 5u) << ::testing::PrintToString(skipped);
  const auto skipped_for = [&](const std::string& path) {
    for (const std::string& line : skipped) {
      if (absl::StartsWith(line, path + ": ")) return line;
    }
    return std::string("(not skipped)");
  };
  EXPECT_THAT(skipped_for(alpha_v3_path), HasSubstr("truncated"));
  EXPECT_THAT(skipped_for(stray), HasSubstr("temporary file of an interrupted save, removed"));
  EXPECT_FALSE(fs::exists(stray));
  EXPECT_THAT(skipped_for(beta_v7_path), HasSubstr("CRC-32C"));
  EXPECT_THAT(skipped_for(gamma_v1_path), HasSubstr("header length"));
  EXPECT_THAT(skipped_for(CheckpointPath(dir.path(), "delta", 2)), HasSubstr("head 'alpha'"));
  // gamma and delta hold checkpoints, none of which loads: the caller must not start them afresh.
  ASSERT_EQ(result->damaged.size(), 2u);
  EXPECT_EQ(result->damaged[0].head, "delta");
  EXPECT_EQ(result->damaged[1].head, "gamma");
  EXPECT_EQ(result->damaged[1].directory, dir.File("gamma"));
  EXPECT_THAT(result->damaged[1].reasons, ElementsAre(StartsWith(gamma_v1_path + ": ")));
}

// A checkpoint is what the next start serves: values it would refuse (a NaN or Inf in W or the
// optimizer state, a negative AdamW second moment) are refused by a save, which writes nothing,
// and by a load, naming the element; a resume falls back past them to the newest good one.
TEST(CheckpointTest, ValuesAResumeWouldRefuseAreNeverSavedAndAreSkippedAtLoad) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  const CheckpointState good = RandomState(rng, "h", 3, DType::kFloat32, OptimizerKind::kAdamW);
  ASSERT_TRUE(SaveCheckpoint(dir.path(), good).ok());
  const int64_t count = good.vocab_size * good.hidden_size;
  const int64_t at = std::uniform_int_distribution<int64_t>(0, count - 1)(rng);
  const std::string element =
      absl::StrCat("[", at / good.hidden_size, ", ", at % good.hidden_size, "]");
  const struct {
    const char* reason;
    std::function<void(CheckpointState&)> damage;
    std::string fragment;
  } cases[] = {
      {"Inf in W",
       [&](CheckpointState& s) {
         const float inf = INFINITY;
         std::memcpy(s.weight.data() + at * sizeof(float), &inf, sizeof(float));
       },
       "weight" + element + ": expected a finite float32 value, got inf"},
      {"NaN in the first moment", [&](CheckpointState& s) { s.state1[at] = std::nanf(""); },
       "optimizer.state1" + element + ": expected a finite float32 value, got nan"},
      {"negative second moment", [&](CheckpointState& s) { s.state2[at] = -1e-3f; },
       "optimizer.state2" + element + ": expected AdamW's second moment, >= 0, got -0.001"},
  };
  uint64_t version = 4;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.reason);
    CheckpointState bad = good;
    bad.version = version++;
    c.damage(bad);
    const absl::Status saved = SaveCheckpoint(dir.path(), bad).status();
    EXPECT_EQ(saved.code(), absl::StatusCode::kFailedPrecondition) << saved;
    EXPECT_THAT(std::string(saved.message()), HasSubstr(c.fragment));
    EXPECT_FALSE(fs::exists(CheckpointPath(dir.path(), "h", bad.version)));

    const std::string path = WriteUncheckedCheckpoint(dir.path(), bad);
    const absl::Status loaded = LoadCheckpoint(path).status();
    EXPECT_EQ(loaded.code(), absl::StatusCode::kInvalidArgument) << loaded;
    EXPECT_THAT(std::string(loaded.message()), StartsWith(path + ": "));
    EXPECT_THAT(std::string(loaded.message()), HasSubstr(c.fragment));
  }
  // v4 to v6 are bad: the resume takes v3, and lists them.
  absl::StatusOr<ResumeResult> result = ResumeFromDirectory(dir.path());
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->heads.size(), 1u);
  ExpectSameState(result->heads[0], good);
  EXPECT_EQ(result->skipped.size(), 3u) << ::testing::PrintToString(result->skipped);
  EXPECT_TRUE(result->damaged.empty());
}

// SGD without momentum keeps no momentum buffer, and its checkpoint holds none.
TEST(CheckpointTest, SgdWithoutAMomentumBufferRoundTrips) {
  std::mt19937 rng(FreshSeed());
  ScratchDir dir;
  CheckpointState state = RandomState(rng, "h", 2, DType::kFloat32, OptimizerKind::kSgd);
  state.state1.clear();
  absl::StatusOr<std::string> path = SaveCheckpoint(dir.path(), state);
  ASSERT_TRUE(path.ok()) << path.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(*path);
  ASSERT_TRUE(file.ok());
  EXPECT_THAT(file->TensorNames(), ElementsAre("weight"));
  absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(*path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(*loaded, state);
}

// A --checkpoint_dir that is a link to nothing would take saves nowhere: refused.
TEST(ResumeTest, ADanglingLinkIsRefused) {
  ScratchDir dir;
  fs::create_symlink(dir.File("gone"), dir.File("link"));
  const absl::Status status = ResumeFromDirectory(dir.File("link")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("symbolic link to " + dir.File("gone")));
}

TEST(ResumeTest, ListsEntriesThatAreNotCheckpoints) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  ASSERT_TRUE(
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 1, DType::kFloat32, OptimizerKind::kNone))
          .ok());
  WriteFile(dir.File("README"), "notes");
  fs::create_directory(dir.File("bad name"));
  WriteFile(dir.File("h/h-v1.safetensors"), "short version field");

  absl::StatusOr<ResumeResult> result = ResumeFromDirectory(dir.path());
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->heads.size(), 1u);
  EXPECT_EQ(result->heads[0].head, "h");
  EXPECT_THAT(result->skipped,
              ElementsAre(dir.File("README") + ": not a head directory",
                          dir.File("bad name") + ": not a valid head name",
                          dir.File("h/h-v1.safetensors") + ": not a checkpoint file name"));
}

TEST(ResumeTest, RemovesTemporaryFilesOfGoneWritersOnly) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  ScratchDir dir;
  const absl::StatusOr<std::string> saved =
      SaveCheckpoint(dir.path(), RandomState(rng, "h", 4, DType::kFloat32, OptimizerKind::kNone));
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string v5 = CheckpointPath(dir.path(), "h", 5);
  // Above any pid_max: its writer is gone, so a crash cut its save short.
  const std::string gone = v5 + ".tmp-4194305-00112233aabbccdd";
  // pid 1 always runs: possibly another server saving into a shared directory right now.
  const std::string running = v5 + ".tmp-1-00112233aabbccdd";
  // Looks like a temporary file but the random part is not 16 hex digits: not one of ours.
  const std::string foreign = v5 + ".tmp-4194305-xyz";
  for (const std::string& path : {gone, running, foreign}) WriteFile(path, "partial");

  absl::StatusOr<ResumeResult> result = ResumeFromDirectory(dir.path());
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->heads.size(), 1u);
  EXPECT_EQ(result->heads[0].version, 4u);
  // In the order of the file names.
  EXPECT_THAT(
      result->skipped,
      ElementsAre(running + ": temporary file of a save by process 1, which is running; kept",
                  gone + ": temporary file of an interrupted save, removed",
                  foreign + ": not a checkpoint file name"));
  EXPECT_FALSE(fs::exists(gone));
  EXPECT_TRUE(fs::exists(running));
  EXPECT_TRUE(fs::exists(foreign));
}

}  // namespace
}  // namespace lossd::storage
