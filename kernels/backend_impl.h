// What every backend does the same way around its own math, and the server never sees: the call's
// shape and plan, the chunk plan within a workspace budget, the workspace carved in aligned
// pieces, and the rows finished and emitted from their statistics (loss_math.h, distill_math.h).
// Host code only; pointers carved here may be device addresses. The checks a call goes through
// first are public, in lossd/kernels/backend_common.h.
#ifndef LOSSD_KERNELS_BACKEND_IMPL_H_
#define LOSSD_KERNELS_BACKEND_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/types.h"

namespace lossd {

ProblemShape ShapeOfCall(const BatchInputs& inputs, const WeightView& weight,
                         const TokenOutputs& outputs, bool grad_weight);

inline bool WantsGradients(const ProblemShape& shape) {
  return shape.grad_hidden || shape.grad_weight;
}

// `bytes` of host memory, 256-byte aligned and not zeroed, owned by `owner`, whose Free must hand
// it to std::free: the CPU backend's memory and HostAllocator's.
absl::StatusOr<DeviceBuffer> AllocateHostBuffer(BufferAllocator* owner, size_t bytes);

// How a backend likes its tiles.
struct TileLimits {
  int64_t max_token_chunk;       // rows per chunk never exceed this
  int64_t min_single_pass_rows;  // fewer full-vocabulary rows than this: tile the vocabulary
  int64_t two_pass_token_chunk;  // rows per chunk once the vocabulary is tiled
  int64_t min_vocab_chunk;       // the narrowest vocabulary tile worth a GEMM
  int64_t vocab_chunk_multiple;  // vocabulary tiles are multiples of this (unless V itself)
  int64_t token_chunk_multiple;  // partial-batch token chunks are multiples of this when larger
  // Rows per chunk for calls without gradients, the vocabulary tiled to fit, for a backend whose
  // cost per token chunk grows with W (widening a 16-bit W, the BLAS packing it); 0: such calls
  // are planned like the others.
  int64_t forward_token_chunk;
};

// The largest x in [lo, hi] with fits(x), assuming fits is monotone (true below, false above);
// lo - 1 when even lo does not fit.
template <typename Fits>
int64_t LargestFitting(int64_t lo, int64_t hi, Fits fits) {
  if (lo > hi || !fits(lo)) return lo - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Rows per chunk for a batch of n rows when at most `fitting` fit: as few chunks as chunks of
// `fitting` rows rounded down to a multiple of `multiple` allow, evened out and still multiples
// (the last chunk takes the rest). OpenBLAS's sgemm, for one, runs about 15% slower at 523 rows
// than at 512 on a 2-core AVX2 machine.
int64_t AlignedTokenChunk(int64_t n, int64_t fitting, int64_t multiple);

// Bytes of workspace for `token_chunk` rows and `vocab_chunk` columns, as the backend carves it.
using WorkspaceBytesFn = absl::FunctionRef<size_t(int64_t token_chunk, int64_t vocab_chunk)>;

// The largest tiles whose workspace fits `budget_bytes`: full-vocabulary token chunks when at least
// min_single_pass_rows of them fit (one pass, 6NHV flops with gradients), else vocabulary tiles.
// A call without gradients visits every tile once whatever the tiling, so where the backend asks
// for it (forward_token_chunk) W is tiled for fewer, longer token chunks.
// Token chunks that split the batch are aligned to token_chunk_multiple and balanced, so that the
// GEMMs see row counts their kernels divide evenly and the last chunk is not a sliver.
absl::StatusOr<ChunkPlan> ChooseChunkPlan(const ProblemShape& shape, size_t budget_bytes,
                                          const TileLimits& limits, WorkspaceBytesFn bytes_for);

// What every Compute starts with: the call checked, its shape, and its chunking planned against the
// workspace it was given (Plan(shape, workspace.bytes()), so that the plan is the one the caller
// sized the workspace for).
struct CallPlan {
  ProblemShape shape;
  ChunkPlan plan;
};
absl::StatusOr<CallPlan> PlanCall(const Backend& backend, const BatchInputs& inputs,
                                  const WeightView& weight, const LossOptions& options,
                                  const TokenOutputs& outputs, const DeviceBuffer* grad_weight,
                                  const DeviceBuffer& workspace);
// A call's summary before any row: its plan and the workspace bytes it carved.
BatchSummary PlannedSummary(const ChunkPlan& plan, size_t workspace_bytes);

// The rows of one Compute call from their complete statistics on, the same on every backend:
// each row's results (FinishRow), its gradient constants (MakeRowGradient) and its outputs. Row
// indices are the call's, in [0, num_tokens). Finish and Gradient may run on many threads at once;
// Emit runs on one, in row order, so that the sums in the summary do not depend on threads.
class RowFinisher {
 public:
  // Under sequence_ratio, `sequence_log_ratios` [num_tokens] holds log s of each row's sequence,
  // written by the backend (SequenceLogRatio) before the row is finished.
  RowFinisher(const BatchInputs& inputs, int64_t vocab_size, const LossOptions& options,
              const TokenOutputs& outputs, const float* sequence_log_ratios = nullptr);

  const LogitTransform& transform() const { return constants_.transform; }
  int64_t counted_rows() const { return counted_rows_; }
  // What the rows are finished from (loss_math.h): a backend that finishes rows elsewhere (on its
  // device) passes the same constants with its own copies of the arrays.
  const RowFinishConstants& constants() const { return constants_; }
  const RowInputArrays& arrays() const { return arrays_; }

  RowResult Finish(int64_t row, const RowStats& stats) const;
  RowGradient Gradient(int64_t row, const RowResult& result) const;

  // The distill objective's Finish and Gradient, from the student's RowStats, both distributions'
  // statistics, the row's constants and its phase-2 terms.
  DistillRowResult FinishDistill(int64_t row, const RowStats& stats, const DistillStats& distill,
                                 const DistillRowConstants& constants,
                                 const DistillRowTerms& terms) const;
  DistillRowGradient DistillGradient(int64_t row, const DistillRowResult& result,
                                     const DistillRowConstants& constants) const;

  // Writes row `row`'s outputs (top-k from the row's k best raw values, when asked for) and adds
  // the row to `summary`.
  void Emit(int64_t row, const RowResult& result, const RowStats& stats, const float* top_values,
            const int32_t* top_tokens, BatchSummary& summary) const;
  // Emit of a distill row: also its KD and CE terms.
  void EmitDistill(int64_t row, const DistillRowResult& result, const RowStats& stats,
                   const float* top_values, const int32_t* top_tokens, BatchSummary& summary) const;

  // The row's one-value outputs (LOSSD_TOKEN_OUTPUTS) from its results; kd and ce are a distill
  // row's, 0 here.
  TokenValues ValuesOf(int64_t row, const RowResult& result, const RowStats& stats) const;

  // The summary's counts and reduced loss once every row was emitted.
  void Close(BatchSummary& summary) const;

 private:
  bool counted(int64_t row) const { return RowCounted(arrays_, constants_, row); }
  void Write(int64_t row, const TokenValues& values, bool finite, const float* top_values,
             const int32_t* top_tokens, BatchSummary& summary) const;

  const BatchInputs& inputs_;
  const LossOptions& options_;
  const TokenOutputs& outputs_;
  const int64_t counted_rows_;
  const RowFinishConstants constants_;
  const RowInputArrays arrays_;
};

// The per-row arrays of a call's inputs (host memory).
RowInputArrays RowInputArraysOf(const BatchInputs& inputs);

// Hands out aligned pieces of one workspace allocation. With a null base it only measures, so that
// a backend computes its workspace size with the same code that carves it.
class WorkspaceArena {
 public:
  static constexpr size_t kAlignment = 256;

  WorkspaceArena(void* base, size_t capacity)
      : base_(static_cast<char*>(base)), capacity_(capacity) {}

  template <typename T>
  T* Take(int64_t count) {
    const size_t start = (used_ + kAlignment - 1) / kAlignment * kAlignment;
    used_ = start + static_cast<size_t>(count) * sizeof(T);
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + start);
  }
  size_t used() const { return used_; }
  bool fits() const { return used_ <= capacity_; }

 private:
  char* base_;
  size_t capacity_;
  size_t used_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_BACKEND_IMPL_H_
