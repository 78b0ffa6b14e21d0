// Heads: W on the device with its version, gradient accumulator and optimizer state.
//
// Concurrency contract (what a client can rely on):
// - Compute reads W under a shared lock, one engine chunk at a time, and checks before every chunk
//   and at commit that the head is still at the version the call started on. A Step or upload in
//   between makes the call fail with ABORTED (nothing accumulated; retry on the new version); a
//   call pinned to a version the head has already left fails at once with FAILED_PRECONDITION.
// - Gradients from a call reach the accumulator in one locked add after the whole call succeeded,
//   so the accumulator always holds whole calls computed against the current W, and only finite
//   values: a call whose dL/dW, or whose sum with the accumulator, is not finite is refused.
// - A call with a call_id reaches the accumulator at most once: its id is kept, with the version
//   and accumulator epoch it was committed at, across the ends of epochs (ZeroGradWeight, a Step
//   without keep_grad, an upload of W), until max_call_ids newer ids push it out.
// - Step takes W exclusively: it waits for running engine chunks (not for idle streams).
#ifndef LOSSD_SERVER_HEAD_STORE_H_
#define LOSSD_SERVER_HEAD_STORE_H_

#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "lossd/kernels/backend.h"
#include "lossd/storage/checkpoint.h"
#include "server/memory_ledger.h"
#include "server/weight_digest.h"

namespace lossd::server {

using storage::OptimizerKind;
// Everything needed to rebuild a head; what checkpoints hold.
using HeadState = storage::CheckpointState;

struct HeadSummary {
  std::string name;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  DType dtype = DType::kFloat32;
  uint64_t version = 0;
  std::string source;
  int64_t accumulated_tokens = 0;
  int64_t accumulated_calls = 0;
  OptimizerKind optimizer = OptimizerKind::kNone;
  int64_t steps = 0;
  bool tied_embeddings = false;
  double logit_softcap = 0.0;
  std::string weight_sha256;  // of W at `version`; empty where not computed yet
};

// The SHA-256 of W (see WeightHasher) at the version it belongs to.
struct WeightDigest {
  uint64_t version = 0;
  std::string sha256;  // empty: not computed
};

struct StepOutcome {
  uint64_t version = 0;
  double grad_norm = 0.0;
  double clip_multiplier = 1.0;
  int64_t accumulated_tokens = 0;
};

// A host copy of W or of the gradient with the version it belongs to.
struct TensorSnapshot {
  std::vector<uint8_t> data;
  DType dtype = DType::kFloat32;
  uint64_t version = 0;
  int64_t accumulated_tokens = 0;
};

// What a Compute call brings to the accumulator.
struct StagedGradient {
  uint64_t version = 0;            // of W, which the head must still be at
  DeviceBuffer* buffer = nullptr;  // the call's dL/dW, [V, H] fp32; may trade places with the
                                   // accumulator (see Head::CommitGradient)
  int64_t tokens = 0;              // counted tokens, added to the head's count
  int64_t rows = 0;                // rows whose products were summed into each entry
  // The engine's bound on |entries| before fp32 rounding (BatchSummary::grad_weight_bound, summed
  // over the call's engine chunks); +inf when the engine gives none, NaN counts as none.
  double bound = HUGE_VAL;
  std::string call_id;             // empty: none
  // Of the call's start (labels, weights, loss options, shapes) and of its loss sum: a repeated
  // call_id must come with the same call.
  uint64_t start_fingerprint = 0;
  double loss_sum = 0.0;
};

enum class CommitOutcome {
  kCommitted,  // dL/dW was added
  kReplayed,   // the call_id was already accumulated at this version: nothing added again
};

// Whether a commit was refused because dL/dW, or the accumulator with it, would not be finite.
bool IsNonFiniteGradient(const absl::Status& status);

class Head {
 public:
  // Uploads `state` to the backend; fails (and holds nothing) when memory runs out.
  static absl::StatusOr<std::shared_ptr<Head>> Create(Backend& backend, MemoryLedger& ledger,
                                                      const HeadState& state, std::string source);

  const std::string& name() const { return name_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t hidden_size() const { return hidden_size_; }
  DType dtype() const { return dtype_; }
  // What the model does with W besides the head, fixed for the head's life: an upload that changes
  // either makes a new head.
  bool tied_embeddings() const { return tied_embeddings_; }
  double logit_softcap() const { return logit_softcap_; }
  uint64_t version() const;
  // weight_sha256 only where it is known for the current version: a summary never waits for W to
  // be hashed.
  HeadSummary Summary() const;
  // The summary with weight_sha256, hashing W first if it changed since it was last hashed.
  absl::StatusOr<HeadSummary> SummaryWithDigest();
  // The SHA-256 of W and the version it is of. Computed when W comes in (Create, ReplaceWeight:
  // the bytes are on the host then) and, after a step, lazily: the first caller reads W back in
  // slices under the shared lock, one pass at about 1.2 GB/s, during which a Step or upload waits
  // (and engine chunks queue behind it); later callers at that version get the cached digest.
  absl::StatusOr<WeightDigest> Digest();

  // Runs fn with W under the shared lock if the head is still at `expected_version`.
  absl::Status WithWeights(uint64_t expected_version, absl::FunctionRef<absl::Status(const WeightView&)> fn);

  // Adds a call's staged dL/dW to the accumulator if the head is still at `call.version`, all or
  // nothing: whatever it refuses, the accumulator is left bitwise as it was.
  //
  // Finite, cheaply. The head keeps a bound on |accumulated entries|. Where the call's bound and
  // the accumulator's, grown by fp32 rounding, stay below FLT_MAX / 2, both are finite and so is
  // their sum: it is added in place, with nothing read back. Otherwise the call's dL/dW is checked
  // alone (INVALID_ARGUMENT when it is not finite: Inf hidden values under a soft cap, a huge
  // grad_scale), and where the sum is still not provably finite it is formed in `call.buffer`
  // (staged += accumulator) and checked before the two buffers trade places (FAILED_PRECONDITION
  // when it overflows). A check sums squares in double, which finite fp32 values cannot overflow,
  // so the sum is non-finite exactly when an entry is; its square root then bounds every entry.
  //
  // An accumulator that holds no call yet is all zeros, so there the two buffers trade places
  // instead of adding: `call.buffer` (same size, same backend) becomes the accumulator and gets
  // the zeros. On the CPU a V x H add is several percent of a short call (0.2 s of a 5.6 s call at
  // V = 128256). A head allocates no accumulator until its first commit, which keeps the call's
  // buffer itself (leaving it empty), or its first step: a head that only scores never holds
  // V x H fp32 of gradient.
  //
  // A call_id already accumulated is not added again: kReplayed when it was in this epoch at this
  // same version with the same call, ALREADY_EXISTS when the head has moved since (a Step, with or
  // without keep_grad) or its accumulator was zeroed, INVALID_ARGUMENT when it came with another
  // call. The head keeps at most `max_call_ids` ids: those of the current epoch, all of them (a new
  // one past them is refused with FAILED_PRECONDITION, never forgotten), and of earlier epochs the
  // most recent that fit beside them, so an id is recognized until max_call_ids later calls with
  // an id have been committed.
  absl::StatusOr<CommitOutcome> CommitGradient(StagedGradient& call, int64_t max_call_ids);
  // What CommitGradient would refuse of `call_id` now, checked before a call is computed in vain:
  // an id accumulated in another epoch, at another version or with another start, or a new id in
  // a full epoch.
  absl::Status CheckCallId(const std::string& call_id, uint64_t start_fingerprint,
                           int64_t max_call_ids) const;
  absl::Status ZeroGradient();

  // The input embedding of a tied head. ReadRows copies W's rows `ids` (each in [0, V), checked
  // by the caller) into `out`, [ids.size(), H] in `dtype`, if the head is still at
  // `expected_version` (ABORTED otherwise). AddGradientRows adds `rows` ([ids.size(), H] fp32,
  // `ids` distinct and in range) into the accumulator's rows `ids`, all or nothing: nothing is
  // added when a sum is not finite, or when the head is not at `expected_version`
  // (FAILED_PRECONDITION). It counts as a call in the accumulator, grows the accumulator's bound
  // to cover the sums, and leaves the sums in `rows`.
  // On the CUDA backend both copy row by row.
  absl::Status ReadRows(uint64_t expected_version, absl::Span<const int64_t> ids, DType dtype,
                        uint8_t* out);
  absl::StatusOr<uint64_t> AddGradientRows(std::optional<uint64_t> expected_version,
                                           absl::Span<const int64_t> ids, std::vector<float>& rows);
  absl::StatusOr<TensorSnapshot> ReadGradient(DType dtype);
  absl::StatusOr<TensorSnapshot> ReadWeight(DType dtype);

  // One optimizer update from the accumulated gradient; increments the version. All or nothing:
  // a step whose W (as stored) or optimizer state would not be finite is refused with
  // FAILED_PRECONDITION naming the element and the value, and leaves W, the optimizer state (of
  // whichever optimizer), the accumulator and the version as they were.
  absl::StatusOr<StepOutcome> Step(const OptimizerConfig& config, double max_grad_norm,
                                   bool keep_grad, std::optional<uint64_t> expected_version);

  // Overwrites W (same shape), drops gradient and optimizer state, increments the version.
  absl::Status ReplaceWeight(const std::vector<uint8_t>& weight, DType dtype, std::string source);

  absl::StatusOr<HeadState> ExportState();

  // Marks a head that an upload of another shape replaced: its in-flight calls fail with ABORTED.
  void Retire();

 private:
  Head(Backend& backend, MemoryLedger& ledger, const HeadState& state, std::string source);
  HeadSummary SummaryLocked() const ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);
  // Hashes W unless digest_ is of the current version.
  absl::Status RefreshDigest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(digest_pass_mu_)
      ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);
  // A V x H fp32 buffer of zeros, for optimizer state.
  absl::StatusOr<DeviceBuffer> ZeroedStateBuffer();
  // Why the step on `tensors` was refused (`result` names the element), with the value the
  // element would have taken.
  absl::Status NonFiniteStep(const OptimizerConfig& config, const OptimizerTensors& tensors,
                             const OptimizerStepResult& result, const StepOutcome& outcome) const
      ABSL_SHARED_LOCKS_REQUIRED(weight_mu_) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  size_t AccumulatorBytes() const;
  // Allocates the accumulator, zeroed, if the head has none yet.
  absl::Status EnsureAccumulator() ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  // Zeroes the accumulator (if allocated) and its token and call counts, and starts a new epoch;
  // the ids of the epoch that ends stay known (see CommitGradient).
  absl::Status ResetAccumulator() ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  // A bound on |entries| of the call's dL/dW after fp32 rounding, reading it back where the
  // engine's bound does not prove it finite; INVALID_ARGUMENT when it is not.
  absl::StatusOr<double> StagedBound(const StagedGradient& call) const;
  // grad_ += staged, or staged becomes grad_; refuses a sum that overflows (see CommitGradient).
  absl::Status AddToAccumulator(DeviceBuffer& staged, double staged_bound)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  struct CommittedCall;
  // Why a repeat of `first`, a call accumulated earlier, cannot replay it; OK when it can.
  absl::Status CheckRepeat(const std::string& call_id, const CommittedCall& first,
                           uint64_t start_fingerprint) const ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);
  absl::Status CheckRoomForCallId(int64_t max_call_ids) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  // Remembers `call_id` as committed now, forgetting the oldest ids of earlier epochs beyond
  // max_call_ids.
  void RememberCallId(const std::string& call_id, uint64_t start_fingerprint, double loss_sum,
                      int64_t max_call_ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_)
      ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);

  Backend& backend_;
  MemoryLedger& ledger_;
  const std::string name_;
  const int64_t vocab_size_;
  const int64_t hidden_size_;
  const DType dtype_;
  const bool tied_embeddings_;
  const double logit_softcap_;

  mutable absl::Mutex weight_mu_;  // shared: engine chunks; exclusive: Step and uploads
  uint64_t version_ ABSL_GUARDED_BY(weight_mu_);
  bool retired_ ABSL_GUARDED_BY(weight_mu_) = false;
  int64_t steps_ ABSL_GUARDED_BY(weight_mu_);
  std::string source_ ABSL_GUARDED_BY(weight_mu_);
  DeviceBuffer weight_;
  MemoryCharge weight_charge_;

  absl::Mutex digest_pass_mu_ ABSL_ACQUIRED_BEFORE(weight_mu_);  // one pass over W at a time
  mutable absl::Mutex digest_mu_;  // taken last, held only to read or set digest_
  WeightDigest digest_ ABSL_GUARDED_BY(digest_mu_);

  mutable absl::Mutex grad_mu_;  // taken after weight_mu_ when both are needed
  DeviceBuffer grad_ ABSL_GUARDED_BY(grad_mu_);  // empty until the head first trains or steps
  MemoryCharge grad_charge_ ABSL_GUARDED_BY(grad_mu_);
  int64_t accumulated_tokens_ ABSL_GUARDED_BY(grad_mu_) = 0;
  int64_t accumulated_calls_ ABSL_GUARDED_BY(grad_mu_) = 0;
  // A bound on |entries| of grad_, fp32 rounding included: 0 while grad_ holds zeros (a new or
  // resumed head, after every reset), the call's own when its buffer takes grad_'s place, grown
  // by every add, taken from the sum of squares where a commit read the sum back. A Step leaves
  // grad_, and so its bound, as they are.
  double grad_bound_ ABSL_GUARDED_BY(grad_mu_) = 0.0;
  // Accumulator epochs: one ends whenever the accumulator is zeroed.
  uint64_t epoch_ ABSL_GUARDED_BY(grad_mu_) = 0;
  // The calls with a call_id accumulated in this epoch and, within max_call_ids in all, in the
  // epochs before it; call_id_order_ holds their ids oldest first.
  struct CommittedCall {
    uint64_t epoch = 0;
    uint64_t version = 0;
    uint64_t start_fingerprint = 0;
    double loss_sum = 0.0;
  };
  absl::flat_hash_map<std::string, CommittedCall> committed_calls_ ABSL_GUARDED_BY(grad_mu_);
  std::deque<std::string> call_id_order_ ABSL_GUARDED_BY(grad_mu_);
  int64_t epoch_call_ids_ ABSL_GUARDED_BY(grad_mu_) = 0;  // of committed_calls_, this epoch's
  OptimizerKind optimizer_ ABSL_GUARDED_BY(grad_mu_) = OptimizerKind::kNone;
  // SGD's momentum buffer (empty until a step with momentum) or AdamW's first moment; AdamW's
  // second moment.
  DeviceBuffer state1_ ABSL_GUARDED_BY(grad_mu_);
  DeviceBuffer state2_ ABSL_GUARDED_BY(grad_mu_);
  MemoryCharge state_charge_ ABSL_GUARDED_BY(grad_mu_);
};

class HeadStore {
 public:
  absl::StatusOr<std::shared_ptr<Head>> Get(const std::string& name) const;
  std::vector<std::shared_ptr<Head>> List() const;
  // ALREADY_EXISTS unless `replace`.
  absl::Status Put(std::shared_ptr<Head> head, bool replace);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Head>> heads_ ABSL_GUARDED_BY(mu_);
};

// A seeded random head, so that the server runs out of the box: W uniform on [-1/sqrt(H), 1/sqrt(H))
// as torch.nn.Linear initializes it, the same for the same seed on any machine.
HeadState MakeDemoHead(const std::string& name, int64_t vocab_size, int64_t hidden_size,
                       DType dtype, uint64_t seed);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_HEAD_STORE_H_
