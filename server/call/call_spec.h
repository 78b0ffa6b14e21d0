// A call's first message, parsed and validated into a CallSpec before any row arrives or any
// memory is admitted: the head and its pinned version, the options, labels, per-token inputs and
// a teacher, each refused by field. Also what the call needs of its spec later: the retry
// fingerprint of a start, the pin check once the call is admitted, and the diagnosis of a
// non-finite result. Nothing here reads a stream, so all of it is testable on messages alone.
#ifndef LOSSD_SERVER_CALL_CALL_SPEC_H_
#define LOSSD_SERVER_CALL_CALL_SPEC_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lossd/kernels/types.h"
#include "lossd/v1/lossd.pb.h"
#include "server/call/compute_call.h"
#include "server/heads/head_store.h"

namespace lossd::server {

// The validated first message of a call.
struct CallSpec {
  std::shared_ptr<Head> head;
  std::optional<uint64_t> pinned_version;
  std::string pinned_sha256;  // empty: any W
  uint64_t version = 0;  // taken once the call is admitted, so time in the queue cannot stale it
  LossOptions options;   // mean_denominator already resolved to the whole batch's D
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  DType hidden_dtype = DType::kFloat32;
  // Empty only for a distill call without labels (every row counts).
  bool has_labels = true;
  std::vector<int64_t> labels;
  std::vector<float> token_weights;
  // The objective's per-token inputs (empty when it reads none) and, with a sequence reduction,
  // each row's factor in it.
  std::vector<float> sampling_logprobs, advantages, reference_logprobs, logprob_grads;
  std::vector<double> reduction_scales;
  // With a rollout correction (its weights already multiply `advantages`): rho_i's mean over the
  // counted rows and the share of them the cap truncated.
  double mean_rollout_is_weight = 0.0;
  double rollout_is_truncated_fraction = 0.0;
  // OBJECTIVE_GSPO: the sequences, by length, whose ratios a first pass measures before the call
  // is computed as ppo's (compute_call.cc); empty for every other call.
  std::vector<int64_t> ratio_sequences;
  int64_t counted_tokens = 0;
  v1::OutputSelection outputs;
  DType grad_hidden_dtype = DType::kFloat32;
  std::optional<v1::SharedMemory> shared_memory;  // set: rows and dL/dh in the client's memfd
  std::string call_id;                            // set only on calls that accumulate dL/dW
  uint64_t start_fingerprint = 0;  // with a call_id: what a repeat of the call must send again
  bool stage_grad_weight = false;  // keep dL/dW under call_id for CommitGradWeight
  // A distill call's teacher: a head (its rows in ComputeChunk.teacher_hidden), or a sparse top-k.
  std::shared_ptr<Head> teacher;
  std::optional<uint64_t> teacher_pinned_version;
  uint64_t teacher_version = 0;  // taken with version
  int64_t teacher_hidden_size = 0;
  DType teacher_hidden_dtype = DType::kFloat32;
  int teacher_top_k = 0;

  int64_t hidden_row_bytes() const {
    return hidden_size * static_cast<int64_t>(DTypeSize(hidden_dtype));
  }
  const int64_t* labels_or_null() const { return has_labels ? labels.data() : nullptr; }
  bool counted(int64_t row) const { return !has_labels || labels[row] != options.ignore_index; }
  int64_t grad_row_bytes() const {
    return hidden_size * static_cast<int64_t>(DTypeSize(grad_hidden_dtype));
  }
  // Host memory of the per-token values copied out of the start message.
  int64_t copied_bytes() const {
    const size_t floats = token_weights.size() + sampling_logprobs.size() + advantages.size() +
                          reference_logprobs.size() + logprob_grads.size();
    return static_cast<int64_t>((labels.size() + ratio_sequences.size()) * sizeof(int64_t) +
                                floats * sizeof(float) + reduction_scales.size() * sizeof(double));
  }
};

// At least the host memory ParseStart's copies of `start` take (CallSpec::copied_bytes), before
// it has run: given sequence lengths, it makes each row's factor in the reduction, kept or not,
// so one is counted per announced row (at most max_tokens).
int64_t StartCopiesBound(const v1::ComputeStart& start, int64_t max_tokens);

// What a repeat of `start` under its call_id must send again: a hash of its deterministic
// serialization without the fields a retry may change (call_id, shared_memory, the pins and the
// outputs). Clears those fields of `start` while it hashes and restores them.
uint64_t StartFingerprint(v1::ComputeStart& start);

// The validated spec of `start`; `start_fingerprint`: StartFingerprint(start) when it has a
// call_id.
absl::StatusOr<CallSpec> ParseStart(const ComputeEnvironment& env, const v1::ComputeStart& start,
                                    uint64_t start_fingerprint);

// Sets spec.version (and a teacher head's spec.teacher_version) to the head's current version,
// which a pinned call must match; with a pinned hash, to the version whose W has it, so that a
// step after the check fails the call (ABORTED) rather than letting it compute on another W.
absl::Status CheckPinnedWeights(CallSpec& spec);

// What in a call scales finite hidden states and a finite W past fp32's range, each named with
// its value, for the token rows [first, first + rows); with `gradients`, also what scales dL/dh
// and dL/dW.
std::vector<std::string> OverflowSuspects(const CallSpec& spec, int64_t first, int64_t rows,
                                          bool gradients);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_CALL_SPEC_H_
