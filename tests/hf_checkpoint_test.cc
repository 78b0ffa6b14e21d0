#include "lossd/storage/hf_checkpoint.h"

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/kernels/half.h"
#include "lossd/storage/safetensors.h"
#include "tests/scratch_files.h"

namespace lossd::storage {
namespace {

using ::lossd::testing::ScratchDir;
using ::lossd::testing::WriteFile;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 37;
constexpr int64_t kHidden = 6;

// A [kVocab, kHidden] matrix of distinct random values, in F32 or BF16 bytes.
struct Matrix {
  std::vector<float> values;  // as the file holds them (BF16 values rounded)
  std::vector<uint8_t> bytes;
  std::string dtype;

  static Matrix Random(std::mt19937& rng, const std::string& dtype = "F32") {
    std::normal_distribution<float> normal;
    Matrix m;
    m.dtype = dtype;
    for (int64_t i = 0; i < kVocab * kHidden; ++i) {
      float value = normal(rng);
      if (dtype == "BF16") {
        const uint16_t bits = FloatToBFloat16(value);
        value = BFloat16ToFloat(bits);
        m.bytes.insert(m.bytes.end(),
                       {static_cast<uint8_t>(bits), static_cast<uint8_t>(bits >> 8)});
      } else {
        uint8_t raw[4];
        std::memcpy(raw, &value, 4);
        m.bytes.insert(m.bytes.end(), raw, raw + 4);
      }
      m.values.push_back(value);
    }
    return m;
  }
};

std::vector<float> AsFloats(const std::vector<uint8_t>& bytes) {
  std::vector<float> values(bytes.size() / 4);
  std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

// Writes a safetensors file holding `tensors` (name -> matrix) plus a small unrelated tensor.
void WriteTensors(const std::string& path, const std::map<std::string, const Matrix*>& tensors) {
  static const float kNorm[kHidden] = {1, 1, 1, 1, 1, 1};
  std::vector<TensorToWrite> entries = {
      {"model.norm.weight", "F32", {kHidden}, kNorm, sizeof kNorm}};
  for (const auto& [name, matrix] : tensors) {
    entries.push_back(
        {name, matrix->dtype, {kVocab, kHidden}, matrix->bytes.data(), matrix->bytes.size()});
  }
  ASSERT_TRUE(WriteSafetensorsAtomically(path, entries, {{"format", "pt"}}).ok());
}

// config.json text of a decoder-only model; `extra` holds further "key": value pairs.
std::string Config(const std::string& model_type, const std::string& extra = "") {
  return absl::StrCat(R"({"model_type": ")", model_type, R"(", "vocab_size": )", kVocab,
                      R"(, "hidden_size": )", kHidden, R"(, "architectures": ["X"])",
                      extra.empty() ? "" : ", ", extra, "}");
}

// A sharded checkpoint in `dir`: the embedding in the first shard, lm_head (if any) in the second.
void WriteSharded(const ScratchDir& dir, const Matrix& embedding, const Matrix* lm_head) {
  WriteTensors(dir.File("model-00001-of-00002.safetensors"),
               {{"model.embed_tokens.weight", &embedding}});
  std::map<std::string, const Matrix*> second;
  if (lm_head != nullptr) second["lm_head.weight"] = lm_head;
  WriteTensors(dir.File("model-00002-of-00002.safetensors"), second);
  std::string map = R"("model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                       "model.norm.weight": "model-00002-of-00002.safetensors")";
  if (lm_head != nullptr) map += R"(, "lm_head.weight": "model-00002-of-00002.safetensors")";
  WriteFile(dir.File("model.safetensors.index.json"),
            absl::StrCat(R"({"metadata": {"total_size": 1234}, "weight_map": {)", map, "}}"));
}

class HfCheckpointTest : public ::testing::Test {
 protected:
  std::mt19937 rng_{std::random_device{}()};
  ScratchDir dir_{"lossd_hf"};
};

TEST(ModelConfigTest, ReadsTheFieldsLossdUses) {
  absl::StatusOr<ModelConfig> llama = ParseModelConfig(
      R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
          "tie_word_embeddings": false, "rope_theta": 500000.0})",
      "config.json");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->model_type, "llama");
  EXPECT_EQ(llama->vocab_size, 128256);
  EXPECT_EQ(llama->hidden_size, 2048);
  EXPECT_EQ(llama->tie_word_embeddings, false);
  EXPECT_FALSE(llama->TiesEmbeddings());
  EXPECT_EQ(llama->final_logit_softcapping, 0.0);

  absl::StatusOr<ModelConfig> gemma2 = ParseModelConfig(
      R"({"model_type": "gemma2", "final_logit_softcapping": 30.0})", "config.json");
  ASSERT_TRUE(gemma2.ok()) << gemma2.status();
  EXPECT_FALSE(gemma2->tie_word_embeddings.has_value());
  EXPECT_TRUE(gemma2->TiesEmbeddings());  // Gemma2Config's default
  EXPECT_EQ(gemma2->final_logit_softcapping, 30.0);
  EXPECT_FALSE(gemma2->vocab_size.has_value());

  // transformers reads null as false (`if not config.tie_word_embeddings`), and a null cap as none.
  absl::StatusOr<ModelConfig> nulls = ParseModelConfig(
      R"({"model_type": "gemma3_text", "tie_word_embeddings": null, "final_logit_softcapping": null})",
      "config.json");
  ASSERT_TRUE(nulls.ok()) << nulls.status();
  EXPECT_FALSE(nulls->TiesEmbeddings());
  EXPECT_EQ(nulls->final_logit_softcapping, 0.0);
}

// Multimodal configs keep the language model's sizes and cap in text_config; the tie is read at
// the top level first, where transformers reads it, then in text_config.
TEST(ModelConfigTest, ReadsTheLanguageModelOfMultimodalConfigs) {
  absl::StatusOr<ModelConfig> top_tie = ParseModelConfig(
      R"({"model_type": "gemma3", "tie_word_embeddings": true, "hidden_size": 1,
          "text_config": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
                          "tie_word_embeddings": false, "final_logit_softcapping": 15.5},
          "vision_config": {"hidden_size": 1152}})",
      "config.json");
  ASSERT_TRUE(top_tie.ok()) << top_tie.status();
  EXPECT_EQ(top_tie->vocab_size, 262208);
  EXPECT_EQ(top_tie->hidden_size, 2560);
  EXPECT_TRUE(top_tie->TiesEmbeddings());
  EXPECT_EQ(top_tie->tie_word_embeddings_field, "tie_word_embeddings");
  EXPECT_EQ(top_tie->final_logit_softcapping, 15.5);

  absl::StatusOr<ModelConfig> text_tie = ParseModelConfig(
      R"({"model_type": "llava", "text_config": {"vocab_size": 32064, "hidden_size": 4096,
                                                   "tie_word_embeddings": true}})",
      "config.json");
  ASSERT_TRUE(text_tie.ok()) << text_tie.status();
  EXPECT_TRUE(text_tie->TiesEmbeddings());
  EXPECT_EQ(text_tie->tie_word_embeddings_field, "text_config.tie_word_embeddings");
}

TEST(ModelConfigTest, DefaultTieFollowsTheConfigClassOfTheModelType) {
  for (const char* untied : {"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "llava"}) {
    EXPECT_FALSE(TiesEmbeddingsByDefault(untied)) << untied;
  }
  // PretrainedConfig's own default holds for every type not listed, and for configs without one.
  for (const char* tied : {"gemma", "gemma2", "gemma3_text", "gpt2", "smollm3", "", "unknown"}) {
    EXPECT_TRUE(TiesEmbeddingsByDefault(tied)) << tied;
  }
}

struct BadConfigCase {
  std::string id;
  std::string reason;
  std::string json;
  std::string fragment;
};

class BadConfigTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfigTest, IsRefusedNamingTheField) {
  const BadConfigCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  const absl::Status status = ParseModelConfig(c.json, "/m/config.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("/m/config.json"), HasSubstr(c.fragment)));
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Cases, BadConfigTest, ::testing::ValuesIn(std::vector<BadConfigCase>{
    {"not_json", "truncated text", R"({"vocab_size": 3)", "not valid JSON"},
    {"not_object", "a list at the top", "[1, 2]", "expected a JSON object, got array"},
    {"text_config_list", "text_config must be an object", R"({"text_config": [1]})", "text_config: expected an object"},
    {"model_type_number", "model_type is a name", R"({"model_type": 7})", "model_type: expected a string"},
    {"vocab_text", "a size as a string", R"({"vocab_size": "32000"})", "vocab_size: expected a positive integer, got \"32000\""},
    {"vocab_zero", "an empty vocabulary", R"({"vocab_size": 0})", "vocab_size: expected a positive integer, got 0"},
    {"vocab_fraction", "a fractional size", R"({"vocab_size": 3.5})", "vocab_size: expected a positive integer"},
    {"hidden_negative", "a negative width", R"({"text_config": {"hidden_size": -1}})", "text_config.hidden_size"},
    {"tie_text", "a tie given as text", R"({"tie_word_embeddings": "true"})", "tie_word_embeddings: expected true, false or null"},
    {"text_tie_number", "a tie given as a number", R"({"text_config": {"tie_word_embeddings": 1}})", "text_config.tie_word_embeddings"},
    {"cap_zero", "transformers would divide by a zero cap", R"({"final_logit_softcapping": 0})", "final_logit_softcapping: expected a positive number or null, got 0"},
    {"cap_negative", "a negative cap", R"({"text_config": {"final_logit_softcapping": -30.0}})", "text_config.final_logit_softcapping"},
    {"cap_text", "a cap given as text", R"({"final_logit_softcapping": "30"})", "final_logit_softcapping"},
}), [](const auto& info) { return info.param.id; });
// clang-format on

TEST(ShardIndexTest, MapsTensorsToShardsInTheIndexDirectory) {
  absl::StatusOr<ShardIndex> index = ParseShardIndex(
      R"({"metadata": {"total_size": 10}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
          "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})",
      "/models/llama/model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->shard_of_tensor,
            (std::map<std::string, std::string>{
                {"lm_head.weight", "/models/llama/model-00002-of-00002.safetensors"},
                {"model.embed_tokens.weight", "/models/llama/model-00001-of-00002.safetensors"}}));
}

class BadIndexTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadIndexTest, IsRefusedNamingTheEntry) {
  const BadConfigCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  const absl::Status status = ParseShardIndex(c.json, "/m/model.safetensors.index.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("/m/model.safetensors.index.json"), HasSubstr(c.fragment)));
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Cases, BadIndexTest, ::testing::ValuesIn(std::vector<BadConfigCase>{
    {"not_json", "a safetensors header is not an index", "\x10\0\0\0\0\0\0\0{}", "not valid JSON"},
    {"no_weight_map", "only metadata", R"({"metadata": {}})", "weight_map: expected an object mapping tensor names to shard files, got none"},
    {"weight_map_list", "a list of files", R"({"weight_map": ["a.safetensors"]})", "got array"},
    {"shard_number", "a shard that is not a name", R"({"weight_map": {"w": 3}})", "weight_map['w']: expected a shard file name"},
    {"shard_parent", "an index cannot point outside its directory", R"({"weight_map": {"w": "../x.safetensors"}})", "expected the name of a file in the index's directory, got '../x.safetensors'"},
    {"shard_absolute", "nor anywhere else", R"({"weight_map": {"w": "/etc/passwd"}})", "'/etc/passwd'"},
    {"shard_subdirectory", "shards sit beside the index", R"({"weight_map": {"w": "sub/x.safetensors"}})", "'sub/x.safetensors'"},
    {"shard_dot", "the directory itself", R"({"weight_map": {"w": "."}})", "got '.'"},
    {"shard_empty", "no name at all", R"({"weight_map": {"w": ""}})", "got ''"},
}), [](const auto& info) { return info.param.id; });
// clang-format on

// A sharded Llama-3-style checkpoint: untied, lm_head in the last shard. The directory and the
// index give the same head; the first shard alone is refused rather than served its embedding.
TEST_F(HfCheckpointTest, ShardedUntiedCheckpointServesLmHead) {
  const Matrix embedding = Matrix::Random(rng_, "BF16");
  const Matrix lm_head = Matrix::Random(rng_, "BF16");
  WriteSharded(dir_, embedding, &lm_head);
  WriteFile(dir_.File("config.json"), Config("llama", R"("tie_word_embeddings": false)"));
  for (const std::string& path : {dir_.path(), dir_.File("model.safetensors.index.json")}) {
    SCOPED_TRACE(path);
    absl::StatusOr<CheckpointHead> head = LoadCheckpointHead(path, "", DType::kFloat32);
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ(head->vocab_size, kVocab);
    EXPECT_EQ(head->hidden_size, kHidden);
    EXPECT_EQ(AsFloats(head->weight), lm_head.values);
    EXPECT_FALSE(head->tied_embeddings);
    EXPECT_EQ(head->logit_softcap, 0.0);
    EXPECT_EQ(head->source,
              dir_.File("model-00002-of-00002.safetensors") + "#lm_head.weight (BF16)");
    EXPECT_THAT(head->explanation, HasSubstr("tie_word_embeddings: false in"));
  }
  const std::string first_shard = dir_.File("model-00001-of-00002.safetensors");
  const absl::Status refused = LoadCheckpointHead(first_shard, "", DType::kFloat32).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr("does not tie lm_head"), HasSubstr("'lm_head.weight'"),
                    HasSubstr("'language_model.lm_head.weight'"),
                    HasSubstr(first_shard + " is one shard of " +
                              dir_.File("model.safetensors.index.json"))));
}

// A Qwen2-style tied checkpoint has no lm_head.weight: the embedding is the head.
TEST_F(HfCheckpointTest, TiedCheckpointServesTheEmbedding) {
  const Matrix embedding = Matrix::Random(rng_);
  WriteSharded(dir_, embedding, nullptr);
  WriteFile(dir_.File("config.json"), Config("qwen2", R"("tie_word_embeddings": true)"));
  absl::StatusOr<CheckpointHead> head = LoadCheckpointHead(dir_.path(), "", DType::kFloat32);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(AsFloats(head->weight), embedding.values);
  EXPECT_TRUE(head->tied_embeddings);
  EXPECT_EQ(head->source,
            dir_.File("model-00001-of-00002.safetensors") + "#model.embed_tokens.weight (F32)");
}

// Gemma 2 writes no tie (its class default is true) and caps its logits at 30.
TEST_F(HfCheckpointTest, GemmaTwoTiesByDefaultAndCarriesItsSoftCap) {
  const Matrix embedding = Matrix::Random(rng_);
  WriteTensors(dir_.File("model.safetensors"), {{"model.embed_tokens.weight", &embedding}});
  WriteFile(dir_.File("config.json"), Config("gemma2", R"("final_logit_softcapping": 30.0)"));
  absl::StatusOr<CheckpointHead> head = LoadCheckpointHead(dir_.path(), "", DType::kBFloat16);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_TRUE(head->tied_embeddings);
  EXPECT_EQ(head->logit_softcap, 30.0);
  EXPECT_EQ(head->weight_dtype, DType::kBFloat16);
  ASSERT_EQ(head->weight.size(), static_cast<size_t>(kVocab * kHidden * 2));
  uint16_t first;
  std::memcpy(&first, head->weight.data(), 2);
  EXPECT_EQ(first, FloatToBFloat16(embedding.values[0]));
  EXPECT_THAT(head->explanation, AllOf(HasSubstr("default for model_type 'gemma2' is true"),
                                       HasSubstr("final_logit_softcapping 30")));
}

// A tied config whose checkpoint also holds lm_head.weight: equal, they stay tied; different,
// transformers loads them untied, and so does lossd.
TEST_F(HfCheckpointTest, TiedConfigWithItsOwnLmHeadFollowsTransformers) {
  const Matrix embedding = Matrix::Random(rng_);
  const Matrix other = Matrix::Random(rng_);
  WriteFile(dir_.File("config.json"), Config("qwen2", R"("tie_word_embeddings": true)"));

  WriteTensors(dir_.File("model.safetensors"),
               {{"model.embed_tokens.weight", &embedding}, {"lm_head.weight", &embedding}});
  absl::StatusOr<CheckpointHead> same = LoadCheckpointHead(dir_.path(), "", DType::kFloat32);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->tied_embeddings);
  EXPECT_EQ(AsFloats(same->weight), embedding.values);

  WriteTensors(dir_.File("model.safetensors"),
               {{"model.embed_tokens.weight", &embedding}, {"lm_head.weight", &other}});
  absl::StatusOr<CheckpointHead> differs = LoadCheckpointHead(dir_.path(), "", DType::kFloat32);
  ASSERT_TRUE(differs.ok()) << differs.status();
  EXPECT_FALSE(differs->tied_embeddings);
  EXPECT_EQ(AsFloats(differs->weight), other.values);
  EXPECT_THAT(differs->explanation, HasSubstr("differs from model.embed_tokens.weight"));
}

// A multimodal checkpoint (transformers 5 names): sizes from text_config, the language model's
// embedding.
TEST_F(HfCheckpointTest, MultimodalCheckpointServesTheLanguageModelsEmbedding) {
  const Matrix embedding = Matrix::Random(rng_);
  WriteTensors(dir_.File("model.safetensors"),
               {{"model.language_model.embed_tokens.weight", &embedding}});
  WriteFile(
      dir_.File("config.json"),
      absl::StrCat(R"({"model_type": "gemma3", "tie_word_embeddings": true, "text_config": {)",
                   R"("vocab_size": )", kVocab, R"(, "hidden_size": )", kHidden, "}}"));
  absl::StatusOr<CheckpointHead> head = LoadCheckpointHead(dir_.path(), "", DType::kFloat32);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_TRUE(head->tied_embeddings);
  EXPECT_EQ(AsFloats(head->weight), embedding.values);
}

// Without config.json an lm_head.weight is the head; without one either nothing is guessed.
TEST_F(HfCheckpointTest, WithoutConfigOnlyLmHeadIsTaken) {
  const Matrix embedding = Matrix::Random(rng_);
  const Matrix lm_head = Matrix::Random(rng_);
  const std::string untied = dir_.File("untied.safetensors");
  const std::string embedding_only = dir_.File("embedding_only.safetensors");
  WriteTensors(untied, {{"model.embed_tokens.weight", &embedding}, {"lm_head.weight", &lm_head}});
  WriteTensors(embedding_only, {{"model.embed_tokens.weight", &embedding}});

  absl::StatusOr<CheckpointHead> head = LoadCheckpointHead(untied, "", DType::kFloat32);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(AsFloats(head->weight), lm_head.values);
  EXPECT_FALSE(head->tied_embeddings);

  const absl::Status refused = LoadCheckpointHead(embedding_only, "", DType::kFloat32).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr(embedding_only), HasSubstr("'lm_head.weight'"),
                    HasSubstr("config.json"), HasSubstr("#model.embed_tokens.weight")));

  // Named explicitly, the embedding is served, untied and uncapped.
  absl::StatusOr<CheckpointHead> chosen =
      LoadCheckpointHead(embedding_only, "model.embed_tokens.weight", DType::kFloat32);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(AsFloats(chosen->weight), embedding.values);
  EXPECT_FALSE(chosen->tied_embeddings);
}

// A named tensor still takes its tie and cap from config.json.
TEST_F(HfCheckpointTest, NamedTensorKeepsTheConfigsTieAndCap) {
  const Matrix embedding = Matrix::Random(rng_);
  WriteSharded(dir_, embedding, nullptr);
  WriteFile(dir_.File("config.json"), Config("gemma2", R"("final_logit_softcapping": 50.0)"));
  absl::StatusOr<CheckpointHead> head =
      LoadCheckpointHead(dir_.path(), "model.embed_tokens.weight", DType::kFloat32);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_TRUE(head->tied_embeddings);
  EXPECT_EQ(head->logit_softcap, 50.0);
  EXPECT_EQ(AsFloats(head->weight), embedding.values);
}

// Every way a checkpoint can fail to give a head, and the message that says why.
struct RefusalCase {
  std::string id;
  std::string reason;
  // Writes the files into the directory; returns the path to load and the tensor to name.
  std::function<std::pair<std::string, std::string>(const ScratchDir&, const Matrix&)> write;
  absl::StatusCode code;
  std::vector<std::string> fragments;  // "$D" stands for the directory, wherever it appears
};

class RefusalTest : public ::testing::TestWithParam<RefusalCase> {};

TEST_P(RefusalTest, SaysWhatWasLookedForAndWhere) {
  const RefusalCase& c = GetParam();
  SCOPED_TRACE(c.reason);
  std::mt19937 rng(std::random_device{}());
  ScratchDir dir("lossd_hf");
  const Matrix matrix = Matrix::Random(rng);
  const auto [path, tensor] = c.write(dir, matrix);
  const absl::Status status = LoadCheckpointHead(path, tensor, DType::kFloat32).status();
  EXPECT_EQ(status.code(), c.code) << status;
  for (std::string fragment : c.fragments) {
    for (size_t at = fragment.find("$D"); at != std::string::npos; at = fragment.find("$D", at)) {
      fragment.replace(at, 2, dir.path());
    }
    EXPECT_THAT(std::string(status.message()), HasSubstr(fragment));
  }
}

std::vector<RefusalCase> RefusalCases() {
  using Files = std::pair<std::string, std::string>;
  const absl::StatusCode not_found = absl::StatusCode::kNotFound;
  const absl::StatusCode invalid = absl::StatusCode::kInvalidArgument;
  // clang-format off
  return {
      {"untied_without_lm_head", "an untied model must bring its lm_head",
       [](const ScratchDir& d, const Matrix& m) {
         WriteSharded(d, m, nullptr);
         WriteFile(d.File("config.json"), Config("mistral"));
         return Files{d.path(), ""};
       },
       not_found, {"index $D/model.safetensors.index.json (2 shards)", "does not tie lm_head",
                   "$D/config.json has no tie_word_embeddings; transformers' default for model_type 'mistral' is false",
                   "'lm_head.weight', 'language_model.lm_head.weight'; none is there"}},
      {"tied_without_embedding", "a tied model must bring its embedding",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         WriteFile(d.File("config.json"), Config("qwen2", R"("tie_word_embeddings": true)"));
         return Files{d.path(), ""};
       },
       not_found, {"$D/model.safetensors: the model ties lm_head", "'model.embed_tokens.weight'",
                   "'language_model.model.embed_tokens.weight'"}},
      {"empty_directory", "no weights at all",
       [](const ScratchDir& d, const Matrix&) { return Files{d.path(), ""}; },
       not_found, {"$D: a model directory holds model.safetensors.index.json or model.safetensors; found neither"}},
      {"missing_path", "a path that does not exist",
       [](const ScratchDir& d, const Matrix&) { return Files{d.File("nothing"), ""}; },
       not_found, {"$D/nothing: cannot open the model checkpoint"}},
      {"missing_shard", "the index names a shard that is not there",
       [](const ScratchDir& d, const Matrix& m) {
         WriteSharded(d, m, &m);
         std::filesystem::remove(d.File("model-00002-of-00002.safetensors"));
         WriteFile(d.File("config.json"), Config("llama"));
         return Files{d.path(), ""};
       },
       not_found, {"$D/model-00002-of-00002.safetensors: cannot open"}},
      {"shard_lacks_tensor", "the index puts a tensor in a shard that does not hold it",
       [](const ScratchDir& d, const Matrix& m) {
         WriteSharded(d, m, &m);
         WriteTensors(d.File("model-00002-of-00002.safetensors"), {});
         WriteFile(d.File("config.json"), Config("llama"));
         return Files{d.path(), ""};
       },
       absl::StatusCode::kDataLoss,
       {"weight_map puts tensor 'lm_head.weight' in $D/model-00002-of-00002.safetensors, which does not hold it"}},
      {"index_is_a_safetensors_file", "an index path that holds a safetensors header",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors.index.json"), {{"lm_head.weight", &m}});
         return Files{d.path(), ""};
       },
       invalid, {"$D/model.safetensors.index.json: not valid JSON"}},
      {"vocab_mismatch", "config.json and the tensor disagree on the vocabulary",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         WriteFile(d.File("config.json"), R"({"model_type": "llama", "vocab_size": 38})");
         return Files{d.path(), ""};
       },
       invalid, {"$D/config.json: vocab_size is 38, but $D/model.safetensors#lm_head.weight has shape [37, 6]"}},
      {"hidden_mismatch", "config.json and the tensor disagree on the width",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         WriteFile(d.File("config.json"), R"({"model_type": "llama", "hidden_size": 7})");
         return Files{d.path(), ""};
       },
       invalid, {"hidden_size is 7"}},
      {"bad_config", "a config that is not JSON is not skipped",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         WriteFile(d.File("config.json"), "{model_type: llama}");
         return Files{d.path(), ""};
       },
       invalid, {"$D/config.json: not valid JSON"}},
      {"named_missing", "a named tensor the checkpoint does not have",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         return Files{d.File("model.safetensors"), "no.such.tensor"};
       },
       not_found, {"no tensor 'no.such.tensor'"}},
      {"named_vector", "a head must be a matrix",
       [](const ScratchDir& d, const Matrix& m) {
         WriteTensors(d.File("model.safetensors"), {{"lm_head.weight", &m}});
         return Files{d.File("model.safetensors"), "model.norm.weight"};
       },
       invalid, {"tensor 'model.norm.weight': expected a 2-D [vocab, hidden] shape, got [6]"}},
      {"integer_tensor", "only float tensors convert",
       [](const ScratchDir& d, const Matrix& m) {
         EXPECT_TRUE(WriteSafetensorsAtomically(d.File("model.safetensors"),
                                                {{"lm_head.weight", "I32", {kVocab, kHidden}, m.bytes.data(),
                                                  m.bytes.size()}}, {}).ok());
         return Files{d.path(), ""};
       },
       invalid, {"'lm_head.weight': has dtype 'I32'"}},
  };
  // clang-format on
}

INSTANTIATE_TEST_SUITE_P(Cases, RefusalTest, ::testing::ValuesIn(RefusalCases()),
                         [](const auto& info) { return info.param.id; });

}  // namespace
}  // namespace lossd::storage
