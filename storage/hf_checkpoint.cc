#include "lossd/storage/hf_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "nlohmann/json.hpp"

namespace lossd::storage {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// config.json files are kilobytes (the largest, with label maps, well under a megabyte) and index
// files at most a few megabytes; anything this large is not one.
constexpr int64_t kMaxConfigFileBytes = 4 << 20;
constexpr int64_t kMaxIndexFileBytes = 64 << 20;

// Model types whose transformers config class sets tie_word_embeddings to false (transformers
// 5.23, every causal-LM and image-text-to-text type).
// clang-format off
constexpr absl::string_view kUntiedByDefault[] = {
    "afmoe", "apertus", "arcee", "aria", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba",
    "beam", "bitnet", "blt", "chameleon", "codegen", "cohere_compass", "cosmos3_edge",
    "cosmos3_omni", "cwm", "dbrx", "deepseek_ocr2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v4", "diffllama", "doge", "dots1", "dots3_note", "dots3_note_text", "emu3", "evolla",
    "exaone4", "exaone4_5", "exaone_moe", "falcon_h1", "fast_vlm", "flex_olmo", "flint", "fuyu",
    "git", "glm", "glm4", "glm46v", "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm5_next",
    "glm_moe_dsa", "glm_ocr", "glmga", "gpt_neox", "gpt_oss", "gptj", "granite", "granite4_vision",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium", "hrm_text",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "idefics", "idefics2",
    "idefics3", "internlm3", "iquestcoder", "jais2", "jamba", "kimi_linear", "kolibri1", "laguna",
    "llama", "llama4", "llama4_text", "llava", "llava_next", "llava_next_video", "llava_onevision",
    "longcat_flash", "mamba2", "mellum", "mimo_v2_flash", "minicpmv4_6", "minicpmv4_7", "minimax",
    "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
    "mistral4", "mistral_large4", "mixtral", "mllama", "molmo2", "moshi", "muse_glimmer",
    "muse_spark", "musicgen", "musicgen_melody", "nanochat", "nemotron", "nemotron_h",
    "nemotron_h_omni", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "perception_lm",
    "persimmon", "phi", "phi3", "phi4_multimodal", "phimoe", "pix2struct", "pp_formulanet",
    "qianfan_ocr", "qwen2", "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_moe", "qwen2_vl", "qwen3",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "qwen3_omni_moe_thinker", "qwen3_vl", "qwen3_vl_moe", "qwen4_exp", "qwen4_exp_text", "reformer",
    "rembert", "rwkv", "seed_oss", "smolvlm", "solar_open", "stablelm", "step3p7", "unlimited_ocr",
    "video_llama_3", "video_llava", "vipllava", "xlstm",
};
// clang-format on

// Names from files go into messages quoted and printable.
std::string Quote(absl::string_view text) { return absl::StrCat("'", Printable(text, 120), "'"); }

std::string TypeOf(const Json& value) { return value.type_name(); }

// A regular file's contents, at most `max_bytes`. Opened without blocking, so that a FIFO (or a
// link to one) is refused rather than waited on for a writer that never comes.
absl::StatusOr<std::string> ReadJsonFile(const std::string& path, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot read"));
  struct stat info;
  std::string contents;
  absl::Status status;
  if (::fstat(fd, &info) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot stat"));
  } else if (!S_ISREG(info.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  } else if (info.st_size > max_bytes) {
    status = absl::InvalidArgumentError(absl::StrCat(
        path, ": ", info.st_size, " bytes, more than the ", max_bytes, " such a file may have"));
  } else {
    contents.resize(static_cast<size_t>(info.st_size));
    size_t done = 0;
    while (done < contents.size()) {
      const ssize_t got = ::read(fd, contents.data() + done, contents.size() - done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        status = got < 0 ? absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot read"))
                         : absl::DataLossError(absl::StrCat(path, ": shorter than its size"));
        break;
      }
      done += static_cast<size_t>(got);
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  return contents;
}

// Thrown by the parser's callback to stop a document nested too deeply.
struct TooDeep {};

absl::StatusOr<Json> ParseJsonObject(absl::string_view text, absl::string_view source) {
  // lossd reads fields at depth 1 and 2 (text_config's, the weight map's entries): deeper values
  // are dropped as they are parsed, and a document nested past kMaxJsonDepth is refused, so that
  // its memory stays near the text's size however it nests.
  constexpr int kKeptDepth = 2;
  constexpr int kMaxJsonDepth = 64;
  const Json::parser_callback_t keep_shallow = [](int depth, Json::parse_event_t event, Json&) {
    if (depth > kMaxJsonDepth) throw TooDeep();
    const bool completes_a_value = event == Json::parse_event_t::value ||
                                   event == Json::parse_event_t::object_end ||
                                   event == Json::parse_event_t::array_end;
    return !(completes_a_value && depth > kKeptDepth);
  };
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), keep_shallow);
  } catch (const TooDeep&) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": nested deeper than ", kMaxJsonDepth, " levels"));
  } catch (const Json::exception& e) {
    // The parser quotes what it last read: bytes of the file, which may not be text.
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid JSON: ", Printable(e.what(), 300)));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object, got ", TypeOf(root)));
  }
  return root;
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

// A field of the language model's config: in text_config first (multimodal configs), then at the
// top level; `where` receives its dotted name.
const Json* TextField(const Json& root, const Json* text_config, const char* name,
                      std::string* where) {
  if (text_config != nullptr && text_config->contains(name)) {
    *where = absl::StrCat("text_config.", name);
    return &(*text_config)[name];
  }
  if (root.contains(name)) {
    *where = name;
    return &root[name];
  }
  return nullptr;
}

absl::StatusOr<std::optional<int64_t>> PositiveSize(const Json& root, const Json* text_config,
                                                    const char* name, absl::string_view source) {
  std::string where;
  const Json* value = TextField(root, text_config, name, &where);
  if (value == nullptr || value->is_null()) return std::optional<int64_t>();
  if (!value->is_number_integer() || value->get<int64_t>() <= 0) {
    return InvalidField(absl::StrCat(source, ": ", where), "a positive integer",
                        value->is_structured() ? TypeOf(*value) : value->dump());
  }
  return std::optional<int64_t>(value->get<int64_t>());
}

// How the tie was decided, for messages: "tie_word_embeddings: false in <config>", or the default.
std::string TieText(const ModelConfig& config, absl::string_view config_path) {
  if (config.tie_word_embeddings.has_value()) {
    return absl::StrCat(config.tie_word_embeddings_field, ": ",
                        *config.tie_word_embeddings ? "true" : "false", " in ", config_path);
  }
  return absl::StrCat(config_path,
                      " has no tie_word_embeddings; transformers' default for model_type ",
                      Quote(config.model_type), " is ", config.TiesEmbeddings() ? "true" : "false");
}

std::string NameList(absl::Span<const char* const> names) {
  std::vector<std::string> quoted;
  for (const char* name : names) quoted.push_back(Quote(name));
  return absl::StrJoin(quoted, ", ");
}

// The first of `names` the checkpoint holds, or empty.
std::string FirstPresent(const ModelCheckpoint& checkpoint, absl::Span<const char* const> names) {
  for (const char* name : names) {
    if (checkpoint.Has(name)) return name;
  }
  return {};
}

bool SameTensorData(const TensorRef& a, const TensorRef& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes &&
         (a.bytes == 0 || std::memcmp(a.data, b.data, a.bytes) == 0);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// When a single file is one shard of the sharded checkpoint beside it, says so: a shard alone
// rarely holds the head.
std::string ShardHint(const ModelCheckpoint& checkpoint) {
  if (checkpoint.sharded()) return {};
  const std::string file = checkpoint.Describe();
  const fs::path index_path = fs::path(file).parent_path() / kShardIndexFileName;
  if (!IsRegularFile(index_path.string())) return {};
  absl::StatusOr<std::string> text = ReadJsonFile(index_path.string(), kMaxIndexFileBytes);
  if (!text.ok()) return {};
  absl::StatusOr<ShardIndex> index = ParseShardIndex(*text, index_path.string());
  if (!index.ok()) return {};
  for (const auto& [tensor, shard] : index->shard_of_tensor) {
    if (fs::path(shard).filename() == fs::path(file).filename()) {
      return absl::StrCat("; ", file, " is one shard of ", index_path.string(),
                          ": give the model directory or the index");
    }
  }
  return {};
}

}  // namespace

bool TiesEmbeddingsByDefault(absl::string_view model_type) {
  return std::find(std::begin(kUntiedByDefault), std::end(kUntiedByDefault), model_type) ==
         std::end(kUntiedByDefault);
}

bool ModelConfig::TiesEmbeddings() const {
  return tie_word_embeddings.has_value() ? *tie_word_embeddings
                                         : TiesEmbeddingsByDefault(model_type);
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text,
                                             absl::string_view source) {
  ASSIGN_OR_RETURN(const Json root, ParseJsonObject(json_text, source));
  ModelConfig config;
  const Json* text_config = nullptr;
  if (const auto found = root.find("text_config"); found != root.end() && !found->is_null()) {
    if (!found->is_object()) {
      return InvalidField(absl::StrCat(source, ": text_config"), "an object", TypeOf(*found));
    }
    text_config = &*found;
  }
  if (const auto found = root.find("model_type"); found != root.end()) {
    if (!found->is_string()) {
      return InvalidField(absl::StrCat(source, ": model_type"), "a string", TypeOf(*found));
    }
    config.model_type = found->get<std::string>();
  }
  ASSIGN_OR_RETURN(config.vocab_size, PositiveSize(root, text_config, "vocab_size", source));
  ASSIGN_OR_RETURN(config.hidden_size, PositiveSize(root, text_config, "hidden_size", source));

  // The top level first: it is the config of the model whose weights transformers ties.
  for (const auto& [object, prefix] :
       {std::pair<const Json*, const char*>{&root, ""},
        std::pair<const Json*, const char*>{text_config, "text_config."}}) {
    if (object == nullptr || !object->contains("tie_word_embeddings")) continue;
    const Json& value = (*object)["tie_word_embeddings"];
    config.tie_word_embeddings_field = absl::StrCat(prefix, "tie_word_embeddings");
    // null is false to transformers (`if not config.tie_word_embeddings`).
    if (!value.is_boolean() && !value.is_null()) {
      return InvalidField(absl::StrCat(source, ": ", config.tie_word_embeddings_field),
                          "true, false or null", TypeOf(value));
    }
    config.tie_word_embeddings = value.is_boolean() && value.get<bool>();
    break;
  }

  std::string where;
  if (const Json* cap = TextField(root, text_config, "final_logit_softcapping", &where);
      cap != nullptr && !cap->is_null()) {
    if (!cap->is_number() || !std::isfinite(cap->get<double>()) || cap->get<double>() <= 0) {
      return InvalidField(absl::StrCat(source, ": ", where), "a positive number or null",
                          cap->is_structured() ? TypeOf(*cap) : cap->dump());
    }
    // Every call on the head that leaves its own cap unset takes this one, so one that fp32
    // cannot hold would make the head refuse its own default calls.
    RETURN_IF_ERROR(ValidateSoftcap(absl::StrCat(source, ": ", where), cap->get<double>()));
    config.final_logit_softcapping = cap->get<double>();
  }
  return config;
}

absl::StatusOr<ShardIndex> ParseShardIndex(absl::string_view json_text, const std::string& path) {
  ASSIGN_OR_RETURN(const Json root, ParseJsonObject(json_text, path));
  const auto map = root.find("weight_map");
  if (map == root.end() || !map->is_object()) {
    return InvalidField(absl::StrCat(path, ": weight_map"),
                        "an object mapping tensor names to shard files",
                        map == root.end() ? "none" : TypeOf(*map));
  }
  ShardIndex index;
  index.path = path;
  const fs::path dir = fs::path(path).parent_path();
  for (const auto& [tensor, shard] : map->items()) {
    const std::string field = absl::StrCat(path, ": weight_map[", Quote(tensor), "]");
    if (!shard.is_string()) return InvalidField(field, "a shard file name", TypeOf(shard));
    const std::string name = shard.get<std::string>();
    if (name.empty() || name == "." || name == ".." || absl::StrContains(name, '/') ||
        name.find('\0') != std::string::npos) {
      return InvalidField(field, "the name of a file in the index's directory", Quote(name));
    }
    index.shard_of_tensor.emplace(tensor, (dir / name).string());
  }
  return index;
}

absl::StatusOr<ModelCheckpoint> ModelCheckpoint::Open(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open the model checkpoint"));
  }
  ModelCheckpoint checkpoint;
  fs::path dir;
  std::string index_path;
  if (S_ISDIR(info.st_mode)) {
    dir = path;
    const std::string index_candidate = (dir / kShardIndexFileName).string();
    const std::string file_candidate = (dir / kSingleFileName).string();
    struct stat candidate;
    if (IsRegularFile(index_candidate)) {
      index_path = index_candidate;
    } else if (IsRegularFile(file_candidate)) {
      checkpoint.single_file_ = file_candidate;
    } else if (::stat(file_candidate.c_str(), &candidate) == 0) {
      // A FIFO or a device there would be waited on or read without end.
      return absl::InvalidArgumentError(absl::StrCat(file_candidate, ": not a regular file"));
    } else {
      return absl::NotFoundError(absl::StrCat(path, ": a model directory holds ",
                                              kShardIndexFileName, " or ", kSingleFileName,
                                              "; found neither"));
    }
  } else if (S_ISREG(info.st_mode)) {
    dir = fs::path(path).parent_path();
    if (absl::EndsWith(path, ".json")) {
      index_path = path;
    } else {
      checkpoint.single_file_ = path;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a model directory, an index (.json) or a safetensors file"));
  }
  if (dir.empty()) dir = ".";

  const std::string config_path = (dir / kConfigFileName).string();
  // Anything under the name but a missing file is read, and a FIFO or a directory refused: the
  // config decides the tie and the soft cap, so it must not be passed over silently.
  struct stat config_info;
  if (::lstat(config_path.c_str(), &config_info) == 0) {
    ASSIGN_OR_RETURN(const std::string text, ReadJsonFile(config_path, kMaxConfigFileBytes));
    ASSIGN_OR_RETURN(checkpoint.config_, ParseModelConfig(text, config_path));
    checkpoint.config_path_ = config_path;
  }
  if (!index_path.empty()) {
    ASSIGN_OR_RETURN(const std::string text, ReadJsonFile(index_path, kMaxIndexFileBytes));
    ASSIGN_OR_RETURN(checkpoint.index_, ParseShardIndex(text, index_path));
  } else {
    RETURN_IF_ERROR(checkpoint.OpenFile(checkpoint.single_file_).status());
  }
  return checkpoint;
}

std::string ModelCheckpoint::Describe() const {
  if (!index_.has_value()) return single_file_;
  std::vector<std::string> shards;
  for (const auto& [tensor, shard] : index_->shard_of_tensor) shards.push_back(shard);
  std::sort(shards.begin(), shards.end());
  shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
  return absl::StrCat("index ", index_->path, " (", shards.size(), " shard",
                      shards.size() == 1 ? "" : "s", ")");
}

bool ModelCheckpoint::Has(absl::string_view tensor) const {
  if (index_.has_value()) return index_->shard_of_tensor.count(std::string(tensor)) > 0;
  return files_.at(single_file_)->Tensor(tensor).ok();
}

std::string ModelCheckpoint::FileOf(absl::string_view tensor) const {
  if (!index_.has_value()) return single_file_;
  const auto found = index_->shard_of_tensor.find(std::string(tensor));
  return found == index_->shard_of_tensor.end() ? std::string() : found->second;
}

absl::StatusOr<const SafetensorsFile*> ModelCheckpoint::OpenFile(const std::string& file) {
  auto found = files_.find(file);
  if (found == files_.end()) {
    ASSIGN_OR_RETURN(SafetensorsFile opened, SafetensorsFile::Open(file));
    found = files_.emplace(file, std::make_unique<SafetensorsFile>(std::move(opened))).first;
  }
  return found->second.get();
}

absl::StatusOr<TensorRef> ModelCheckpoint::Tensor(absl::string_view tensor) {
  if (!index_.has_value()) {
    ASSIGN_OR_RETURN(const SafetensorsFile* file, OpenFile(single_file_));
    return file->Tensor(tensor);
  }
  const std::string shard = FileOf(tensor);
  if (shard.empty()) {
    return absl::NotFoundError(
        absl::StrCat(index_->path, ": weight_map has no tensor ", Quote(tensor)));
  }
  ASSIGN_OR_RETURN(const SafetensorsFile* file, OpenFile(shard));
  absl::StatusOr<TensorRef> ref = file->Tensor(tensor);
  if (!ref.ok() && absl::IsNotFound(ref.status())) {
    return absl::DataLossError(absl::StrCat(index_->path, ": weight_map puts tensor ",
                                            Quote(tensor), " in ", shard,
                                            ", which does not hold it"));
  }
  return ref;
}

namespace {

// LoadCheckpointHead, reading W only `with_weight`.
absl::StatusOr<CheckpointHead> FindCheckpointHead(const std::string& path, absl::string_view tensor,
                                                  DType dtype, bool with_weight) {
  ASSIGN_OR_RETURN(ModelCheckpoint checkpoint, ModelCheckpoint::Open(path));
  const std::optional<ModelConfig>& config = checkpoint.config();
  CheckpointHead head;
  head.logit_softcap = config.has_value() ? config->final_logit_softcapping : 0.0;
  std::string chosen(tensor);
  if (!chosen.empty()) {
    head.tied_embeddings = config.has_value() && config->TiesEmbeddings();
    head.explanation = absl::StrCat(
        "tensor named in the head's spec; ",
        config.has_value() ? TieText(*config, checkpoint.config_path()) : "no config.json: untied");
  } else if (!config.has_value()) {
    chosen = FirstPresent(checkpoint, kLmHeadTensorNames);
    if (chosen.empty()) {
      return absl::NotFoundError(absl::StrCat(
          checkpoint.Describe(), ": holds none of ", NameList(kLmHeadTensorNames),
          ", and without a config.json beside it whether the model ties lm_head to its input "
          "embedding cannot be known; add the model's config.json, or name the tensor "
          "(NAME=PATH#model.embed_tokens.weight)",
          ShardHint(checkpoint)));
    }
    head.explanation = "no config.json: untied, the checkpoint's lm_head";
  } else if (config->TiesEmbeddings()) {
    const std::string embedding = FirstPresent(checkpoint, kEmbeddingTensorNames);
    if (embedding.empty()) {
      return absl::NotFoundError(
          absl::StrCat(checkpoint.Describe(), ": the model ties lm_head to its input embedding (",
                       TieText(*config, checkpoint.config_path()), "), but holds none of ",
                       NameList(kEmbeddingTensorNames), ShardHint(checkpoint)));
    }
    chosen = embedding;
    head.tied_embeddings = true;
    head.explanation = absl::StrCat("tied: ", TieText(*config, checkpoint.config_path()));
    // transformers leaves the two apart when the checkpoint holds both and they differ.
    const std::string lm_head = FirstPresent(checkpoint, kLmHeadTensorNames);
    if (!lm_head.empty()) {
      ASSIGN_OR_RETURN(const TensorRef embedding_ref, checkpoint.Tensor(embedding));
      ASSIGN_OR_RETURN(const TensorRef lm_head_ref, checkpoint.Tensor(lm_head));
      if (!SameTensorData(embedding_ref, lm_head_ref)) {
        chosen = lm_head;
        head.tied_embeddings = false;
        head.explanation = absl::StrCat("untied: ", TieText(*config, checkpoint.config_path()),
                                        ", but the checkpoint's ", lm_head, " differs from ",
                                        embedding, ", which transformers then loads untied");
      }
    }
  } else {
    chosen = FirstPresent(checkpoint, kLmHeadTensorNames);
    if (chosen.empty()) {
      return absl::NotFoundError(absl::StrCat(
          checkpoint.Describe(), ": the model does not tie lm_head to its input embedding (",
          TieText(*config, checkpoint.config_path()), "), so its head is one of ",
          NameList(kLmHeadTensorNames), "; none is there", ShardHint(checkpoint)));
    }
    head.explanation = absl::StrCat("untied: ", TieText(*config, checkpoint.config_path()));
  }

  ASSIGN_OR_RETURN(const TensorRef ref, checkpoint.Tensor(chosen));
  const std::string file = checkpoint.FileOf(chosen);
  if (ref.shape.size() != 2 || ref.shape[0] <= 0 || ref.shape[1] <= 0) {
    return InvalidField(absl::StrCat(file, ": tensor ", Quote(chosen)),
                        "a 2-D [vocab, hidden] shape", ShapeText(ref.shape));
  }
  if (config.has_value()) {
    for (const auto& [size, name, dim] :
         {std::tuple{config->vocab_size, "vocab_size", ref.shape[0]},
          std::tuple{config->hidden_size, "hidden_size", ref.shape[1]}}) {
      if (size.has_value() && *size != dim) {
        return absl::InvalidArgumentError(absl::StrCat(checkpoint.config_path(), ": ", name, " is ",
                                                       *size, ", but ", file, "#", chosen,
                                                       " has shape ", ShapeText(ref.shape)));
      }
    }
  }
  head.vocab_size = ref.shape[0];
  head.hidden_size = ref.shape[1];
  head.weight_dtype = dtype;
  if (with_weight) {
    absl::StatusOr<std::vector<uint8_t>> weight = ReadAsDType(ref, dtype);
    if (!weight.ok()) {
      return absl::Status(weight.status().code(),
                          absl::StrCat(file, ": ", weight.status().message()));
    }
    head.weight = *std::move(weight);
  }
  head.source = absl::StrCat(file, "#", chosen, " (", ref.dtype, ")");
  head.file_dtype = ref.dtype;
  if (head.logit_softcap > 0) {
    absl::StrAppend(&head.explanation, "; final_logit_softcapping ", head.logit_softcap);
  }
  return head;
}

}  // namespace

absl::StatusOr<CheckpointHead> LoadCheckpointHead(const std::string& path, absl::string_view tensor,
                                                  DType dtype) {
  return FindCheckpointHead(path, tensor, dtype, /*with_weight=*/true);
}

absl::StatusOr<CheckpointHead> ProbeCheckpointHead(const std::string& path,
                                                   absl::string_view tensor) {
  return FindCheckpointHead(path, tensor, DType::kFloat32, /*with_weight=*/false);
}

}  // namespace lossd::storage
