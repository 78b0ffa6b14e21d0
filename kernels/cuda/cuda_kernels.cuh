// Host launchers of the CUDA backend's own kernels (everything that is not a GEMM), one .cu file
// per family: row_stats.cu, row_finish.cu, logit_gradients.cu, distill_kernels.cu,
// buffer_kernels.cu. Each launcher checks its launch and returns the error; the stream is the last
// argument; d_* are device pointers. Options that a kernel would otherwise test per element
// become template arguments inside the launcher.
#ifndef LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_
#define LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_plan.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/optimizer_math.h"

namespace lossd::cuda {

// Blocks of SumSquaresPartials: fixed, so the order of the sum does not depend on the device.
inline constexpr int kSumSquaresBlocks = 1024;

// A tile of logits in the workspace: rows x cols, row-major with leading dimension ld (a multiple
// of kLeadingDimensionMultiple), holding the vocabulary columns [v0, v0 + cols).
struct LogitTile {
  float* d_logits;
  int64_t rows;
  int64_t cols;
  int64_t ld;
  int64_t v0;
};

// Where dL/da goes (GradientStore): in place in the fp32 tile, or for 16-bit products
// hi = round16(S dL/da) and, split, lo = round16(S dL/da - hi), both [rows, ld] in `dtype`, with
// S read from d_split_scale[0] (LaunchSplitScale).
struct GradientOut {
  GradientStore store = GradientStore::kFloat32;
  DType dtype = DType::kFloat32;
  uint16_t* d_hi = nullptr;
  uint16_t* d_lo = nullptr;
  const float* d_split_scale = nullptr;
};

// OK when this module holds code that the current device can run: machine code for its
// architecture, or PTX that the driver can compile for it. Without it every launch would fail
// with cudaErrorNoKernelImageForDevice, so the backend checks once, at creation. A missing or
// unusable image is FAILED_PRECONDITION; any other error (a device already faulted in this
// process, say) is the runtime's own, as CudaStatus maps it.
absl::Status CheckKernelImage();

// ---- buffer_kernels.cu ----

// d_dst[i] = float(d_src[i]) for a 16-bit or fp32 source.
absl::Status LaunchConvertToFloat(const void* d_src, DType src_dtype, int64_t count, float* d_dst,
                                  cudaStream_t stream);
// d_dst[i] = round(d_src[i]) into dst_dtype.
absl::Status LaunchConvertFromFloat(const float* d_src, int64_t count, DType dst_dtype, void* d_dst,
                                    cudaStream_t stream);
absl::Status LaunchAddFloat32(float* d_dst, const float* d_src, int64_t count, cudaStream_t stream);
// d_x[i] *= factor.
absl::Status LaunchScaleFloat32(float* d_x, int64_t count, float factor, cudaStream_t stream);
// d_partials[b] = sum of x^2 in double over the b-th of kSumSquaresBlocks equal ranges.
absl::Status LaunchSumSquaresPartials(const float* d_x, int64_t count, double* d_partials,
                                      cudaStream_t stream);
// d_partials[b] = the smallest NonFiniteUpdateCode of an update of the b-th of kSumSquaresBlocks
// equal ranges of elements (+inf: none), the weight as served_dtype stores it, computed without
// writing anything.
absl::Status LaunchOptimizerCheck(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                  const void* d_weight, DType weight_dtype, DType served_dtype,
                                  const float* d_grad, const float* d_state1, const float* d_state2,
                                  int64_t count, double* d_partials, cudaStream_t stream);
// SgdUpdate or AdamWUpdate on every element; d_state1/d_state2 as in OptimizerTensors.
absl::Status LaunchOptimizerStep(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                 void* d_weight, DType weight_dtype, const float* d_grad,
                                 float* d_state1, float* d_state2, int64_t count,
                                 cudaStream_t stream);
// For lossd_cuda_test_only_fault_device alone: one thread storing through the null pointer.
absl::Status LaunchTestOnlyIllegalAddress(cudaStream_t stream);

// ---- row_stats.cu ----

// Empty statistics for `rows` rows, and top-k lists of (-inf, token 0) as the CPU backend starts.
absl::Status LaunchResetRows(int64_t rows, int top_k, RowStats* d_stats, float* d_top_values,
                             int32_t* d_top_tokens, cudaStream_t stream);

// One block per row, one read of each logit: z = TransformLogit(a) written back in place when
// apply_transform; the tile's RowStats (max, argmax, sum-exp and its shifted sum against a running
// max, as the online softmax keeps them, and sum z) merged into d_stats[row]; with top_k > 0 the
// tile's k best (value, token) merged into the running lists [rows, k] (best first; equal values
// rank the lower token first, as on the CPU).
absl::Status LaunchRowStats(const LogitTile& tile, const int64_t* d_labels,
                            const LogitTransform& transform, bool apply_transform, int top_k,
                            RowStats* d_stats, float* d_top_values, int32_t* d_top_tokens,
                            cudaStream_t stream);

// LaunchRowStats of a distill call's student tile (transformed already), and from the same loads
// both distributions' LseStats at tau (u = z * inv_tau, t = z_t * inv_tau, the teacher's tile
// transformed as well), with tail_bucket also u's over the columns where z_t is -inf, merged into
// d_distill_stats[row].
absl::Status LaunchDistillRowStats(const LogitTile& student, const LogitTile& teacher,
                                   const int64_t* d_labels, float inv_tau, bool tail_bucket,
                                   int top_k, RowStats* d_stats, float* d_top_values,
                                   int32_t* d_top_tokens, DistillStats* d_distill_stats,
                                   cudaStream_t stream);

// ---- row_finish.cu: rows finished on the device with loss_math.h's and distill_math.h's
// FinishRowAt / RowGradientAt, as the CPU backend finishes them on the host ----

// d_results[r] = FinishRowAt(arrays, constants, r, d_stats[r]); with d_row_grads also their
// gradient constants and d_bounds[r] = LogitGradientBound.
absl::Status LaunchFinishRows(int64_t rows, const RowInputArrays& d_arrays,
                              const RowFinishConstants& constants, const RowStats* d_stats,
                              RowResult* d_results, RowGradient* d_row_grads, double* d_bounds,
                              cudaStream_t stream);

// Under sequence_ratio, for each sequence s of a chunk (rows [d_sequence_ends[s - 1],
// d_sequence_ends[s]), the first from 0) log s of its counted rows (SequenceLogRatio, in row order
// as on the CPU) into d_log_ratios of every row of it.
absl::Status LaunchSequenceLogRatios(int64_t num_sequences, const int32_t* d_sequence_ends,
                                     const RowInputArrays& d_arrays,
                                     const RowFinishConstants& constants, const RowStats* d_stats,
                                     float* d_log_ratios, cudaStream_t stream);

// d_constants[r] = MakeDistillRowConstants(d_stats[r], options).
absl::Status LaunchDistillConstants(int64_t rows, const DistillStats* d_stats,
                                    const DistillOptions& options, DistillRowConstants* d_constants,
                                    cudaStream_t stream);

// The distill rows' FinishDistillRowAt, and with d_row_grads DistillRowGradientAt and
// d_bounds[r] = DistillLogitGradientBound.
absl::Status LaunchFinishDistillRows(int64_t rows, const RowInputArrays& d_arrays,
                                     const RowFinishConstants& constants,
                                     const DistillOptions& options, bool dense_teacher,
                                     const RowStats* d_stats, const DistillStats* d_distill_stats,
                                     const DistillRowTerms* d_terms,
                                     const DistillRowConstants* d_constants,
                                     DistillRowResult* d_results, DistillRowGradient* d_row_grads,
                                     double* d_bounds, cudaStream_t stream);

// One block: d_split_scale = {S, 1 / S, 0, 1} with S = GradientSplitScale(max_r d_bounds[r],
// kSplitMaxExponent); the last two are the GEMMs' beta values when they read their scalars from
// the device.
absl::Status LaunchSplitScale(int64_t rows, const double* d_bounds, float* d_split_scale,
                              cudaStream_t stream);

// ---- logit_gradients.cu ----

// dL/da = LogitGradient(z) (EntropyLogitGradient for rows with an entropy bonus, when the call
// has one) for every logit of the tile, read once and written once to `out`; the tile holds raw
// logits a when apply_transform, else z.
absl::Status LaunchLogitGradients(const LogitTile& tile, const RowGradient* d_row_grads,
                                  const LogitTransform& transform, bool apply_transform,
                                  bool entropy, const GradientOut& out, cudaStream_t stream);

// dL/da = DistillLogitGradient of the call's divergence for every logit of the student's tile,
// both tiles holding transformed logits.
absl::Status LaunchDistillLogitGradients(const LogitTile& student, const LogitTile& teacher,
                                         const DistillRowGradient* d_row_grads, DivergenceKind kind,
                                         bool tail_bucket, const LogitTransform& transform,
                                         const GradientOut& out, cudaStream_t stream);

// ---- distill_kernels.cu: both logits tiles of a chunk, same rows and columns ----

// Each row's statistics before its first tile: StartDistillStats of a sparse teacher's
// d_sparse_rows, else EmptyDistillStats.
absl::Status LaunchResetDistillStats(int64_t rows, const SparseTeacherRow* d_sparse_rows,
                                     DistillStats* d_stats, cudaStream_t stream);

// z = TransformLogit(a) in place over the tile.
absl::Status LaunchTransformLogits(const LogitTile& tile, const LogitTransform& transform,
                                   cudaStream_t stream);

// One block per row: a sparse teacher's logits tile, d_sparse_rows[row].rest_logit everywhere but
// at its top-k tokens (d_tokens, d_logprobs [rows, k]) that fall in the tile's columns.
absl::Status LaunchFillSparseTeacher(const LogitTile& tile, int k, const int32_t* d_tokens,
                                     const float* d_logprobs, const SparseTeacherRow* d_sparse_rows,
                                     cudaStream_t stream);

// One block per row: the tile's sums of D's and K's summands (DistillElementTerms of the call's
// divergence), added to d_terms[row]; tiles are added in launch order.
absl::Status LaunchAddTileDistillTerms(const LogitTile& student, const LogitTile& teacher,
                                       DivergenceKind kind, bool tail_bucket,
                                       const DistillRowConstants* d_constants,
                                       DistillRowTerms* d_terms, cudaStream_t stream);

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_
