// The lm_head of a Hugging Face model checkpoint: a model directory, the index of a sharded
// checkpoint (model.safetensors.index.json and the model-0000k-of-0000n.safetensors it names) or
// a single safetensors file, read together with the model's config.json.
//
// Where things are looked for:
// - A directory holds model.safetensors.index.json (preferred) or model.safetensors, and
//   config.json. An index or a single file given by path has its config.json beside it.
// - An index's "weight_map" maps every tensor name to the shard holding it: a file name in the
//   index's directory. Only the shards that hold the tensors asked for are opened.
//
// What config.json says (transformers' PretrainedConfig fields; other fields are not read):
// - vocab_size, hidden_size: checked against the head's shape. final_logit_softcapping: the soft
//   cap of the head's logits (null or absent: none). A multimodal config keeps these in its
//   "text_config"; they are read there first, then at the top level.
// - tie_word_embeddings: read at the top level first (the model's own config, which transformers'
//   tying follows), then in "text_config". Absent from both, transformers takes the default of
//   the model type's config class, which differs by type: TiesEmbeddingsByDefault lists them.
//   transformers 5 always writes the field; older versions left it out when it equalled both
//   defaults, which can only mean true.
//
// Which tensor is the head:
// - Untied: lm_head.weight (language_model.lm_head.weight in older multimodal checkpoints); a
//   checkpoint without it is refused, naming the names looked for and where.
// - Tied: the input embedding, the first of kEmbeddingTensorNames present. A tied config whose
//   checkpoint also holds an lm_head.weight that differs from the embedding loads untied, as
//   transformers loads it (it warns and does not tie the two).
// - Without config.json: lm_head.weight, untied. Without lm_head.weight either the checkpoint is
//   refused: whether the embedding is the head cannot be known. Name the tensor instead.
// - An explicit tensor name (`--heads=NAME=PATH#TENSOR`) takes that tensor; tie and soft cap still
//   come from config.json (without one: untied, no cap).
#ifndef LOSSD_STORAGE_HF_CHECKPOINT_H_
#define LOSSD_STORAGE_HF_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lossd/kernels/types.h"
#include "lossd/storage/safetensors.h"

namespace lossd::storage {

inline constexpr char kConfigFileName[] = "config.json";
inline constexpr char kShardIndexFileName[] = "model.safetensors.index.json";
inline constexpr char kSingleFileName[] = "model.safetensors";
// The output projection, in the order looked for.
inline constexpr const char* kLmHeadTensorNames[] = {"lm_head.weight",
                                                     "language_model.lm_head.weight"};
// The input embedding, in the order looked for: decoder-only models, then the language model
// inside multimodal ones (transformers 5, then 4).
inline constexpr const char* kEmbeddingTensorNames[] = {"model.embed_tokens.weight",
                                                        "model.language_model.embed_tokens.weight",
                                                        "language_model.model.embed_tokens.weight"};

// What lossd reads of a transformers config.json.
struct ModelConfig {
  std::string model_type;  // empty when absent
  std::optional<int64_t> vocab_size;
  std::optional<int64_t> hidden_size;
  std::optional<bool> tie_word_embeddings;  // as written, top level first
  std::string tie_word_embeddings_field;    // where it was written: "tie_word_embeddings",
                                            // "text_config.tie_word_embeddings" or empty
  double final_logit_softcapping = 0.0;     // 0: none

  // tie_word_embeddings, or transformers' default for model_type when the config has none.
  bool TiesEmbeddings() const;
};

// Parses config.json text; `source` names it in errors. Fields of the wrong type (a string
// vocab_size, a negative soft cap) are INVALID_ARGUMENT naming the field.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source);

// transformers' default of tie_word_embeddings for a config of `model_type`: false for the model
// types whose config class sets it so (llama, mistral, qwen2, phi3, ...), true for all others,
// which is PretrainedConfig's own default.
bool TiesEmbeddingsByDefault(absl::string_view model_type);

// A sharded checkpoint's index: tensor name -> path of the shard file holding it.
struct ShardIndex {
  std::string path;
  std::map<std::string, std::string> shard_of_tensor;  // paths joined with the index's directory
};

// Parses an index's JSON text found at `path`. Shard names must be plain file names in the
// index's directory (no directories, no "." or ".."): an index cannot point outside it.
absl::StatusOr<ShardIndex> ParseShardIndex(absl::string_view json_text, const std::string& path);

// The weights of a model checkpoint: one safetensors file or the shards of an index, each opened
// (mapped, its header validated) the first time one of its tensors is asked for.
class ModelCheckpoint {
 public:
  // `path`: a model directory, an index (a name ending in .json) or a safetensors file. Reads
  // config.json where present, the index if any, and opens a single file at once.
  static absl::StatusOr<ModelCheckpoint> Open(const std::string& path);

  ModelCheckpoint(ModelCheckpoint&&) = default;
  ModelCheckpoint& operator=(ModelCheckpoint&&) = default;

  const std::optional<ModelConfig>& config() const { return config_; }
  const std::string& config_path() const { return config_path_; }
  bool sharded() const { return index_.has_value(); }
  // "index <path> (<n> shards)", or the path of the single file: what the tensors are read from.
  std::string Describe() const;
  bool Has(absl::string_view tensor) const;
  // The file that holds `tensor`; empty when an index does not list it.
  std::string FileOf(absl::string_view tensor) const;
  // NOT_FOUND when the checkpoint has no such tensor; DATA_LOSS when the index names a shard
  // that lacks it.
  absl::StatusOr<TensorRef> Tensor(absl::string_view tensor);

 private:
  ModelCheckpoint() = default;
  absl::StatusOr<const SafetensorsFile*> OpenFile(const std::string& file);

  std::optional<ModelConfig> config_;
  std::string config_path_;
  std::optional<ShardIndex> index_;
  std::string single_file_;  // set when there is no index
  // Opened files by path; unique_ptr keeps each file where TensorRefs into it point.
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

// A head as loaded from a model checkpoint.
struct CheckpointHead {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  DType weight_dtype = DType::kFloat32;
  std::vector<uint8_t> weight;   // [V, H] in weight_dtype, little endian
  bool tied_embeddings = false;  // W is also the model's input embedding
  double logit_softcap = 0.0;    // 0: none
  std::string source;            // "<file>#<tensor> (<dtype in the file>)"
  std::string file_dtype;        // the tensor's safetensors dtype in the file ("BF16", ...)
  std::string explanation;       // why this tensor, tie and cap, for the startup log
};

// The head of the checkpoint at `path` (see the top of this file), converted to `dtype`. An
// empty `tensor` chooses by the rules above.
absl::StatusOr<CheckpointHead> LoadCheckpointHead(const std::string& path, absl::string_view tensor,
                                                  DType dtype);
// What LoadCheckpointHead would load, without W (`weight` stays empty; only headers are read):
// its shape, tie, soft cap and source.
absl::StatusOr<CheckpointHead> ProbeCheckpointHead(const std::string& path,
                                                   absl::string_view tensor);

}  // namespace lossd::storage

#endif  // LOSSD_STORAGE_HF_CHECKPOINT_H_
