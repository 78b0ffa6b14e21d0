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
// - A call may stage its dL/dW instead of committing it (StageGradient): it is kept, under its
//   call_id, until CommitStaged adds it times a scale, DiscardStaged or its deadline drops it, or
//   the head moves (Step, upload) or its accumulator is zeroed, which drop every staged gradient.
// - A 16-bit head that steps keeps fp32 master weights: the optimizer updates them and W, what
//   calls read, is their rounded copy, so that updates smaller than W's rounding add up.
#ifndef LOSSD_SERVER_HEADS_HEAD_STORE_H_
#define LOSSD_SERVER_HEADS_HEAD_STORE_H_

#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
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
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "lossd/kernels/backend.h"
#include "lossd/storage/checkpoint.h"
#include "server/heads/weight_digest.h"
#include "server/memory/memory_ledger.h"

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
  std::string weight_sha256;    // of W at `version`; empty where not computed yet
  bool master_weights = false;  // a 16-bit W stepped from fp32 master weights
  int64_t staged_gradients = 0;
};

// The SHA-256 of W (see WeightHasher) at the version it belongs to.
struct WeightDigest {
  uint64_t version = 0;
  std::string sha256;  // empty: not computed
};

// One optimizer step, beside its optimizer's configuration (StepRequest).
struct StepSettings {
  double max_grad_norm = 0.0;  // > 0: clip by the (multiplied) gradient's norm
  bool keep_grad = false;      // else the accumulator is zeroed after the step
  std::optional<uint64_t> expected_version;
  double grad_multiplier = 1.0;  // applied to the accumulated gradient first
  bool skip_nonfinite = false;   // a non-finite gradient skips the step instead of failing
};

struct StepOutcome {
  uint64_t version = 0;
  double grad_norm = 0.0;
  double clip_multiplier = 1.0;
  int64_t accumulated_tokens = 0;
  bool skipped = false;
};

// The accumulated gradient's norm before a step (GradWeightNorm).
struct GradNorm {
  uint64_t version = 0;
  double norm = 0.0;
  int64_t accumulated_tokens = 0;
  int64_t accumulated_calls = 0;
};

// Device memory that staged gradients may hold together, over every head of a server: a staged
// dL/dW is as large as an accumulator, and a client that never commits (or discards) would
// otherwise hold it until its deadline.
class StagingRoom {
 public:
  explicit StagingRoom(int64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}
  // Whether `bytes` more fit; they are then held until Release.
  bool TryReserve(int64_t bytes);
  void Release(int64_t bytes);
  int64_t used_bytes() const;
  int64_t capacity_bytes() const;
  void SetCapacity(int64_t capacity_bytes);

 private:
  mutable absl::Mutex mu_;
  int64_t capacity_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Why staged gradients were dropped without a commit (lossd_staged_gradients_dropped_total).
enum class StagedDrop : int {
  kDiscarded = 0,  // DiscardGradWeight
  kExpired = 1,    // --staged_grad_seconds without a commit
  kHeadMoved = 2,  // a Step or upload, or the accumulator zeroed
  kEvicted = 3,    // the oldest of the head's, for a newer one when the staging room was full
};
inline constexpr int kStagedDropCount = 4;
const char* StagedDropName(StagedDrop reason);

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
  std::string call_id;  // empty: none
  // Of the call's start (labels, weights, loss options, shapes) and of its loss sum: a repeated
  // call_id must come with the same call.
  uint64_t start_fingerprint = 0;
  double loss_sum = 0.0;
};

enum class CommitOutcome {
  kCommitted,  // dL/dW was added
  kReplayed,   // the call_id was already accumulated at this version: nothing added again
  kStaged,     // kept under the call_id for CommitStaged (StageGradient)
  kNoRoom,     // StageGradient only: the staging room is full; nothing kept, nothing added
};

// Whether a commit was refused because dL/dW, or the accumulator with it, would not be finite,
// or a step because the gradient's norm is not.
bool IsNonFiniteGradient(const absl::Status& status);

// FAILED_PRECONDITION "<field>: <message>" for a call pinned by `field` (head_version,
// teacher_head_version, weight_sha256) to a W the head is no longer at; clients act on it
// (ErrorInfo.HEAD_MOVED) by looking at the head anew.
absl::Status HeadMovedError(absl::string_view field, absl::string_view message);
bool IsHeadMoved(const absl::Status& status);

// How a head's accumulated gradient becomes its group's before a step or a norm, when several
// replicas serve the head (ReplicaGroup implements it over a Collective). Each replica's head
// calls it in the same order, holding W exclusively, with its own accumulator and counts.
class GradientExchange {
 public:
  virtual ~GradientExchange() = default;
  // Whether every replica goes on, the same answer on each. A replica says where its head
  // stands (its version, the first 8 bytes of W's SHA-256 as a number where it knows them),
  // why it cannot go on (`refusal`, OK when it can) and whether it kept the group's gradient of
  // what it accumulated (a GradWeightNorm before this step). OK with whether every replica kept
  // it; else this replica's refusal, or a refusal naming what differs.
  virtual absl::StatusOr<bool> Agree(uint64_t version, std::optional<uint64_t> weight_digest,
                                     const absl::Status& refusal, bool kept) = 0;
  // Sums over the replicas, in place: the gradient and the counts that go with it.
  virtual absl::Status Reduce(absl::Span<float> gradient, absl::Span<double> counts) = 0;
  // The sum of squares of the (reduced) gradient, in double, the same bits on every replica.
  virtual absl::StatusOr<double> SumSquares(absl::Span<const float> gradient) = 0;
};

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
  absl::Status WithWeights(uint64_t expected_version,
                           absl::FunctionRef<absl::Status(const WeightView&)> fn);

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

  // Keeps `call`'s dL/dW, moved out of `buffer`, under call.call_id (which must be set) until
  // CommitStaged adds it, DiscardStaged or ExpireStaged (past `deadline`) drops it, or the head
  // moves. kStaged; kReplayed when the id was already committed in this epoch (the same call,
  // checked as CommitGradient checks a repeat) or is already staged (the same call computed
  // again: the first stays). When `room` is full, the head's staged gradients closest to their
  // deadline make way (a later commit of one gets NOT_FOUND, and its client computes it again):
  // the newest forward is the likeliest to see its backward. kNoRoom, with `buffer` left as it
  // was, when even that cannot make room.
  absl::StatusOr<CommitOutcome> StageGradient(StagedGradient& call, DeviceBuffer& buffer,
                                              StagingRoom& room, absl::Time deadline,
                                              int64_t max_call_ids);
  // Adds the gradient staged under `call_id` times `scale` to the accumulator, as CommitGradient
  // adds a call's, and drops it whatever the outcome. kReplayed when the id was committed with
  // the same scale before (nothing added again); ALREADY_EXISTS with another scale; NOT_FOUND,
  // saying why where the head still knows, when nothing is staged under it.
  absl::StatusOr<CommitOutcome> CommitStaged(const std::string& call_id, double scale,
                                             int64_t max_call_ids);
  // Drops the gradients staged under `call_ids`; returns how many there were.
  int DiscardStaged(absl::Span<const std::string> call_ids);
  // Drops the staged gradients whose deadline is before `now`; returns how many.
  int ExpireStaged(absl::Time now);
  int64_t staged_count() const;
  // Called with each drop's reason and count (metrics).
  void SetStagedDropObserver(std::function<void(StagedDrop, int)> observer);

  // The norm of the accumulated gradient times `grad_multiplier`, if the head is at
  // `expected_version` (FAILED_PRECONDITION otherwise). With `exchange` (replicas), of the
  // group's gradient, the sum of every replica's, which the head keeps for the step that
  // follows (see Step); the counts are the group's too.
  absl::StatusOr<GradNorm> GradientNorm(std::optional<uint64_t> expected_version,
                                        double grad_multiplier,
                                        GradientExchange* exchange = nullptr);

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
  // W as served; with `master`, a 16-bit head's fp32 master weights (W itself where it has none).
  absl::StatusOr<TensorSnapshot> ReadWeight(DType dtype, bool master = false);

  // One optimizer update from the accumulated gradient; increments the version. All or nothing:
  // a step whose W (as served) or optimizer state would not be finite is refused with
  // FAILED_PRECONDITION naming the element and the value, and leaves W, the optimizer state (of
  // whichever optimizer), the accumulator and the version as they were. A 16-bit head
  // steps its fp32 master weights (made from W at its first step) and serves their rounded copy.
  // With settings.skip_nonfinite, a gradient whose multiplied norm is not finite leaves W, the
  // optimizer state and the version as they were (skipped) and only resets the accumulator.
  //
  // With `exchange` (replicas) the step is the group's: it takes the sum of every replica's
  // accumulated gradient, formed in a host copy (the accumulator itself only ever holds this
  // replica's own, so that a failed exchange leaves it as it was and keep_grad keeps it), or the
  // sum a GradWeightNorm kept when no replica's accumulator changed since. Every replica then
  // applies the same update to the same W.
  absl::StatusOr<StepOutcome> Step(const OptimizerConfig& config, const StepSettings& settings,
                                   GradientExchange* exchange = nullptr);

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
  // Adds a gradient that passed the call-id checks: its bound, the sum, the counts.
  absl::Status AddCommitted(StagedGradient& call, double scale, int64_t max_call_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_) ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);
  // Drops every staged gradient (the head moved or was zeroed).
  void DropAllStaged(StagedDrop reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  void RememberDrop(const std::string& call_id, StagedDrop reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  void ObserveDrops(StagedDrop reason, int count) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  // Makes fp32 master weights from W, for a 16-bit head's first step.
  absl::Status EnsureMasterWeights() ABSL_EXCLUSIVE_LOCKS_REQUIRED(weight_mu_);
  // The group's gradient (GradientExchange) of the accumulator as it is now, in reduced_: the one
  // kept since a GradWeightNorm when every replica kept its own, else reduced anew. `refusal`:
  // why this replica cannot go on (it still takes part, so that the others hear it).
  absl::Status ReduceGradient(GradientExchange& exchange, const absl::Status& refusal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(weight_mu_, grad_mu_);
  // Forgets the group's gradient (its host buffer stays for the next exchange).
  void DropReduced() ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  absl::StatusOr<GradNorm> GradientNormLocked(std::optional<uint64_t> expected_version,
                                              double grad_multiplier, GradientExchange* exchange)
      ABSL_SHARED_LOCKS_REQUIRED(weight_mu_);
  // Remembers `call_id` as committed now, forgetting the oldest ids of earlier epochs beyond
  // max_call_ids.
  void RememberCallId(const std::string& call_id, uint64_t start_fingerprint, double loss_sum,
                      double scale, int64_t max_call_ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_)
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
  // A 16-bit head's fp32 master weights, from its first step on; W is their rounded copy.
  DeviceBuffer master_ ABSL_GUARDED_BY(weight_mu_);
  MemoryCharge master_charge_ ABSL_GUARDED_BY(weight_mu_);

  absl::Mutex digest_pass_mu_ ABSL_ACQUIRED_BEFORE(weight_mu_);  // one pass over W at a time
  mutable absl::Mutex digest_mu_;  // taken last, held only to read or set digest_
  WeightDigest digest_ ABSL_GUARDED_BY(digest_mu_);

  mutable absl::Mutex grad_mu_;                  // taken after weight_mu_ when both are needed
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
    double scale = 1.0;  // the commit's scale (CommitStaged; 1 for a direct commit)
  };
  absl::flat_hash_map<std::string, CommittedCall> committed_calls_ ABSL_GUARDED_BY(grad_mu_);
  struct StagedCall {
    StagedGradient call;  // call.buffer points at `buffer`
    DeviceBuffer buffer;
    MemoryCharge charge;
    StagingRoom* room = nullptr;  // holds `reserved` bytes for it until it goes
    int64_t reserved = 0;
    absl::Time deadline;
    StagedCall() = default;
    StagedCall(const StagedCall&) = delete;
    StagedCall& operator=(const StagedCall&) = delete;
    ~StagedCall() {
      if (room != nullptr) room->Release(reserved);
    }
  };
  absl::flat_hash_map<std::string, std::unique_ptr<StagedCall>> staged_ ABSL_GUARDED_BY(grad_mu_);
  // Why recent staged gradients went, for the NOT_FOUND of a late commit (bounded, oldest out).
  std::map<std::string, StagedDrop> dropped_ ABSL_GUARDED_BY(grad_mu_);
  std::vector<std::string> dropped_order_ ABSL_GUARDED_BY(grad_mu_);
  std::function<void(StagedDrop, int)> drop_observer_ ABSL_GUARDED_BY(grad_mu_);
  // Grows with every change of grad_ (a commit, added rows, a reset): a reduced gradient is of
  // one generation.
  uint64_t grad_generation_ ABSL_GUARDED_BY(grad_mu_) = 0;
  // The group's gradient (replicas) of generation reduced_generation_ at version
  // reduced_version_, with its counts (tokens, calls) and sum of squares, when reduced_valid_.
  // V x H floats on the host, allocated at the head's first exchange and kept for the next ones
  // (fresh pages for every step would cost a fault each).
  std::unique_ptr<float[]> reduced_ ABSL_GUARDED_BY(grad_mu_);
  bool reduced_valid_ ABSL_GUARDED_BY(grad_mu_) = false;
  uint64_t reduced_generation_ ABSL_GUARDED_BY(grad_mu_) = 0;
  uint64_t reduced_version_ ABSL_GUARDED_BY(grad_mu_) = 0;
  int64_t reduced_tokens_ ABSL_GUARDED_BY(grad_mu_) = 0;
  int64_t reduced_calls_ ABSL_GUARDED_BY(grad_mu_) = 0;
  double reduced_sum_squares_ ABSL_GUARDED_BY(grad_mu_) = 0.0;
  MemoryCharge reduced_charge_ ABSL_GUARDED_BY(grad_mu_);
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
  // Stops serving the head `name` (its calls in flight fail with ABORTED); false if none.
  bool Remove(const std::string& name);
  // Set on every head stored, now and later (Head::SetStagedDropObserver).
  void SetStagedDropObserver(std::function<void(StagedDrop, int)> observer);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Head>> heads_ ABSL_GUARDED_BY(mu_);
  std::function<void(StagedDrop, int)> drop_observer_ ABSL_GUARDED_BY(mu_);
};

// A seeded random head, so that the server runs out of the box: W uniform on [-1/sqrt(H),
// 1/sqrt(H)) as torch.nn.Linear initializes it, the same for the same seed on any machine.
HeadState MakeDemoHead(const std::string& name, int64_t vocab_size, int64_t hidden_size,
                       DType dtype, uint64_t seed);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_HEADS_HEAD_STORE_H_
