// Crash-safe checkpoints of heads: W, optimizer state and version in one safetensors file.
//
// Layout: <dir>/<head>/<head>-v<version, 20 digits>.safetensors, so names sort by version. A file
// holds the tensors "weight" ([V, H] in the head's dtype) and, when the optimizer has them,
// "optimizer.state1" and "optimizer.state2" (F32 [V, H]); its __metadata__ holds
//   format       "lossd-checkpoint-v1"
//   head, version, steps, optimizer ("none", "sgd", "adamw"), vocab_size, hidden_size
// ("sgd" without an optimizer.state1 tensor: no momentum buffer, as momentum 0 keeps none)
//   tied_embeddings ("true"/"false"), logit_softcap (decimal, 0: none); files written before
//                 these two existed lack them and load untied without a cap
//   crc32c.<tensor>  CRC-32C of each tensor's bytes, 8 hex digits
// A 16-bit head that trains also holds "master_weight" (F32 [V, H]): the fp32 weights its
// optimizer steps, of which "weight" is the rounded copy it serves.
// The checksums let a resume tell a damaged newest checkpoint from a good one, which the
// structure alone cannot (flipped bits in the data keep every offset valid).
//
// Each file is written to a temporary name, fsynced and renamed into place, so a crash leaves
// either the previous checkpoints or the new one, never a half-written file under a checkpoint
// name.
#ifndef LOSSD_STORAGE_CHECKPOINT_H_
#define LOSSD_STORAGE_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "lossd/kernels/types.h"

namespace lossd::storage {

enum class OptimizerKind { kNone = 0, kSgd = 1, kAdamW = 2 };
absl::string_view OptimizerKindName(OptimizerKind kind);  // "none", "sgd", "adamw"

// Everything needed to rebuild a head.
struct CheckpointState {
  std::string head;
  uint64_t version = 0;
  int64_t steps = 0;
  int64_t vocab_size = 0, hidden_size = 0;
  DType weight_dtype = DType::kFloat32;
  std::vector<uint8_t> weight;  // [V, H] in weight_dtype, little endian
  OptimizerKind optimizer = OptimizerKind::kNone;
  // fp32 [V * H] each. kNone has neither, kSgd has state1 (momentum), kAdamW both moments.
  std::vector<float> state1, state2;
  // Empty, or a 16-bit head's fp32 master weights [V * H] (weight is their rounded copy).
  std::vector<float> master_weight;
  bool tied_embeddings = false;  // W is also the model's input embedding
  double logit_softcap = 0.0;    // the model's final logit soft cap; 0: none
};

// OK when `head` can be a path component: [A-Za-z0-9._-]+, neither "." nor "..".
absl::Status ValidateCheckpointHeadName(absl::string_view head);

// <dir>/<head>/<head>-v<version zero-padded to 20 digits>.safetensors
std::string CheckpointPath(const std::string& dir, absl::string_view head, uint64_t version);

// Writes `state` atomically to CheckpointPath(dir, state.head, state.version), creating the
// directories as needed, and returns that path. Then removes the head's older checkpoints so that
// the newest `keep_last` remain (keep_last <= 0 keeps all); the file just written is never removed.
// A state whose sizes disagree with its shape or optimizer is INVALID_ARGUMENT, one whose values a
// load would refuse (see LoadCheckpoint) FAILED_PRECONDITION; neither writes anything.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& dir, const CheckpointState& state,
                                           int keep_last = 3);

// Reads and fully validates one checkpoint file: format tag, metadata, shapes, dtypes, checksums
// and values (W and the optimizer state finite, AdamW's second moment >= 0). A truncated or
// corrupt file is an error (DATA_LOSS or INVALID_ARGUMENT), never a partial state.
absl::StatusOr<CheckpointState> LoadCheckpoint(const std::string& path);

// A head directory that holds checkpoints, none of which loads.
struct DamagedHead {
  std::string head;
  std::string directory;
  std::vector<std::string> reasons;  // "<path>: <reason>", newest first
};

struct ResumeResult {
  std::vector<CheckpointState> heads;  // sorted by head name
  std::vector<std::string> skipped;    // "<path>: <reason>" for each file passed over
  std::vector<DamagedHead> damaged;    // heads with checkpoints, none of them good
};

// For every head subdirectory of `dir`, loads the newest checkpoint that loads cleanly (and whose
// metadata names the same head and version as its file name). Newer ones that fail, temporary
// files of saves and unrecognized entries are listed in `skipped`; a head none of whose
// checkpoints loads is listed in `damaged`, for the caller to refuse rather than start it afresh.
// Temporary files whose writing process is gone (a save cut short by a crash) are removed; those
// of a running process are kept. A missing `dir` gives an empty result; an unreadable one, or a
// symbolic link to nothing, is an error.
absl::StatusOr<ResumeResult> ResumeFromDirectory(const std::string& dir);

// CRC-32C (Castagnoli), the checksum stored in checkpoint metadata. `crc` continues a previous
// call's result; the checksum of "123456789" is 0xe3069283.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace lossd::storage

#endif  // LOSSD_STORAGE_CHECKPOINT_H_
