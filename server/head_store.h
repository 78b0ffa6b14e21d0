// Heads: W on the device with its version, gradient accumulator and optimizer state.
//
// Concurrency contract (what a client can rely on):
// - Compute reads W under a shared lock, one engine chunk at a time, and checks before every chunk
//   and at commit that the head is still at the version the call started on. A Step or upload in
//   between makes the call fail with ABORTED (nothing accumulated; retry on the new version); a
//   call pinned to a version the head has already left fails at once with FAILED_PRECONDITION.
// - Gradients from a call reach the accumulator in one locked add after the whole call succeeded,
//   so the accumulator always holds whole calls computed against the current W.
// - Step takes W exclusively: it waits for running engine chunks (not for idle streams).
#ifndef LOSSD_SERVER_HEAD_STORE_H_
#define LOSSD_SERVER_HEAD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "lossd/kernels/backend.h"
#include "server/memory_ledger.h"
#include "server/storage/checkpoint.h"

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

class Head {
 public:
  // Uploads `state` to the backend; fails (and holds nothing) when memory runs out.
  static absl::StatusOr<std::shared_ptr<Head>> Create(Backend& backend, MemoryLedger& ledger,
                                                      const HeadState& state, std::string source);

  const std::string& name() const { return name_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t hidden_size() const { return hidden_size_; }
  DType dtype() const { return dtype_; }
  uint64_t version() const;
  HeadSummary Summary() const;

  // Runs fn with W under the shared lock if the head is still at `expected_version`.
  absl::Status WithWeights(uint64_t expected_version, absl::FunctionRef<absl::Status(const WeightView&)> fn);

  // Adds a call's staged dL/dW to the accumulator if the head is still at `expected_version`.
  // An accumulator that holds no call yet is all zeros, so there the two buffers trade places
  // instead: `staged` (same size, same backend) becomes the accumulator and gets the zeros. On the
  // CPU a V x H add is several percent of a short call (0.2 s of a 5.6 s call at V = 128256).
  // A head allocates no accumulator until its first commit, which keeps `staged` itself (leaving
  // it empty), or its first step: a head that only scores never holds V x H fp32 of gradient.
  absl::Status CommitGradient(uint64_t expected_version, DeviceBuffer& staged, int64_t tokens);
  absl::Status ZeroGradient();
  absl::StatusOr<TensorSnapshot> ReadGradient(DType dtype);
  absl::StatusOr<TensorSnapshot> ReadWeight(DType dtype);

  // One optimizer update from the accumulated gradient; increments the version.
  absl::StatusOr<StepOutcome> Step(const OptimizerConfig& config, double max_grad_norm,
                                   bool keep_grad, std::optional<uint64_t> expected_version);

  // Overwrites W (same shape), drops gradient and optimizer state, increments the version.
  absl::Status ReplaceWeight(const std::vector<uint8_t>& weight, DType dtype, std::string source);

  absl::StatusOr<HeadState> ExportState();

  // Marks a head that an upload of another shape replaced: its in-flight calls fail with ABORTED.
  void Retire();

 private:
  Head(Backend& backend, MemoryLedger& ledger, const HeadState& state, std::string source);
  absl::Status EnsureOptimizerState(OptimizerKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  size_t AccumulatorBytes() const;
  // Allocates the accumulator, zeroed, if the head has none yet.
  absl::Status EnsureAccumulator() ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);
  // Zeroes the accumulator (if allocated) and its token and call counts.
  absl::Status ResetAccumulator() ABSL_EXCLUSIVE_LOCKS_REQUIRED(grad_mu_);

  Backend& backend_;
  MemoryLedger& ledger_;
  const std::string name_;
  const int64_t vocab_size_;
  const int64_t hidden_size_;
  const DType dtype_;

  mutable absl::Mutex weight_mu_;  // shared: engine chunks; exclusive: Step and uploads
  uint64_t version_ ABSL_GUARDED_BY(weight_mu_);
  bool retired_ ABSL_GUARDED_BY(weight_mu_) = false;
  int64_t steps_ ABSL_GUARDED_BY(weight_mu_);
  std::string source_ ABSL_GUARDED_BY(weight_mu_);
  DeviceBuffer weight_;
  MemoryCharge weight_charge_;

  mutable absl::Mutex grad_mu_;  // taken after weight_mu_ when both are needed
  DeviceBuffer grad_ ABSL_GUARDED_BY(grad_mu_);  // empty until the head first trains or steps
  MemoryCharge grad_charge_ ABSL_GUARDED_BY(grad_mu_);
  int64_t accumulated_tokens_ ABSL_GUARDED_BY(grad_mu_) = 0;
  int64_t accumulated_calls_ ABSL_GUARDED_BY(grad_mu_) = 0;
  OptimizerKind optimizer_ ABSL_GUARDED_BY(grad_mu_) = OptimizerKind::kNone;
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
