// Host launchers of the CUDA backend's own kernels (everything that is not a GEMM). Each checks its
// launch and returns the error; the stream is the last argument; d_* are device pointers.
#ifndef LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_
#define LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/optimizer_math.h"

namespace lossd::cuda {

// Blocks of SumSquaresPartials: fixed, so the order of the sum does not depend on the device.
inline constexpr int kSumSquaresBlocks = 1024;

// A tile of logits in the workspace: rows x cols, row-major with leading dimension ld, holding the
// vocabulary columns [v0, v0 + cols).
struct LogitTile {
  float* d_logits;
  int64_t rows;
  int64_t cols;
  int64_t ld;
  int64_t v0;
};

// How dL/da leaves LogitGradients: in place as fp32 (dtype kFloat32), or for 16-bit products as
// S dL/da = hi + lo with hi = round16(S dL/da) and lo = round16(S dL/da - hi), both [rows, ld].
struct GradientSplit {
  DType dtype = DType::kFloat32;
  float scale = 1.0f;  // S, a power of two
  uint16_t* d_hi = nullptr;
  uint16_t* d_lo = nullptr;
};

// OK when this module holds code that the current device can run: machine code for its
// architecture, or PTX that the driver can compile for it. Without it every launch would fail
// with cudaErrorNoKernelImageForDevice, so the backend checks once, at creation.
absl::Status CheckKernelImage();

// d_dst[i] = float(d_src[i]) for a 16-bit or fp32 source.
absl::Status LaunchConvertToFloat(const void* d_src, DType src_dtype, int64_t count, float* d_dst,
                                  cudaStream_t stream);
// d_dst[i] = round(d_src[i]) into dst_dtype.
absl::Status LaunchConvertFromFloat(const float* d_src, int64_t count, DType dst_dtype, void* d_dst,
                                    cudaStream_t stream);

// Empty statistics for `rows` rows, and top-k lists of (-inf, token 0) as the CPU backend starts.
absl::Status LaunchResetRows(int64_t rows, int top_k, RowStats* d_stats, float* d_top_values,
                             int32_t* d_top_tokens, cudaStream_t stream);

// One block per row: z = TransformLogit(a) written back in place when apply_transform, then the
// tile's RowStats merged into d_stats[row].
absl::Status LaunchMergeTileRowStats(const LogitTile& tile, const int64_t* d_labels,
                                     const LogitTransform& transform, bool apply_transform,
                                     RowStats* d_stats, cudaStream_t stream);

// One block per row: the tile's k best (value, token), merged into the running lists [rows, k]
// (best first; equal values rank the lower token first, as on the CPU).
absl::Status LaunchMergeTileTopK(const LogitTile& tile, int k, float* d_top_values,
                                 int32_t* d_top_tokens, cudaStream_t stream);

// dL/da = LogitGradient(z) (EntropyLogitGradient for rows with an entropy bonus) for every logit
// of the tile; the tile holds raw logits a when apply_transform, else z.
absl::Status LaunchLogitGradients(const LogitTile& tile, const RowGradient* d_row_grads,
                                  const LogitTransform& transform, bool apply_transform,
                                  const GradientSplit& split, cudaStream_t stream);

// ---- Distillation (distill_math.h): both logits tiles of a chunk, same rows and columns ----

// z = TransformLogit(a) in place over the tile.
absl::Status LaunchTransformLogits(const LogitTile& tile, const LogitTransform& transform,
                                   cudaStream_t stream);

// One block per row: a sparse teacher's logits tile, d_rest_logits[row] everywhere but at its top-k
// tokens (d_tokens, d_logprobs [rows, k]) that fall in the tile's columns.
absl::Status LaunchFillSparseTeacher(const LogitTile& tile, int k, const int32_t* d_tokens,
                                     const float* d_logprobs, const float* d_rest_logits,
                                     cudaStream_t stream);

// One block per row: LseStats of u = z * inv_tau over the student's tile and of t = z_t * inv_tau
// over the teacher's (both transformed), merged into d_stats[row].
absl::Status LaunchMergeTileDistillStats(const LogitTile& student, const LogitTile& teacher,
                                         float inv_tau, DistillStats* d_stats, cudaStream_t stream);

// One block per row: the tile's sums of D's and K's summands (DistillElementTerms), added to
// d_terms[row]; tiles are added in launch order.
absl::Status LaunchAddTileDistillTerms(const LogitTile& student, const LogitTile& teacher,
                                       const DistillRowConstants* d_constants,
                                       DistillRowTerms* d_terms, cudaStream_t stream);

// dL/da = DistillLogitGradient for every logit of the student's tile (in place, or split as
// LaunchLogitGradients does), both tiles holding transformed logits.
absl::Status LaunchDistillLogitGradients(const LogitTile& student, const LogitTile& teacher,
                                         const DistillRowGradient* d_row_grads,
                                         const LogitTransform& transform,
                                         const GradientSplit& split, cudaStream_t stream);

absl::Status LaunchAddFloat32(float* d_dst, const float* d_src, int64_t count, cudaStream_t stream);

// d_partials[b] = sum of x^2 in double over the b-th of kSumSquaresBlocks equal ranges.
absl::Status LaunchSumSquaresPartials(const float* d_x, int64_t count, double* d_partials,
                                      cudaStream_t stream);

// d_partials[b] = the smallest NonFiniteUpdateCode of an update of the b-th of kSumSquaresBlocks
// equal ranges of elements (+inf: none), computed without writing anything.
absl::Status LaunchOptimizerCheck(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                  const void* d_weight, DType weight_dtype, const float* d_grad,
                                  const float* d_state1, const float* d_state2, int64_t count,
                                  double* d_partials, cudaStream_t stream);

// SgdUpdate or AdamWUpdate on every element; d_state1/d_state2 as in OptimizerTensors.
absl::Status LaunchOptimizerStep(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                 void* d_weight, DType weight_dtype, const float* d_grad,
                                 float* d_state1, float* d_state2, int64_t count,
                                 cudaStream_t stream);

// For lossd_cuda_test_only_fault_device alone: one thread storing through the null pointer.
absl::Status LaunchTestOnlyIllegalAddress(cudaStream_t stream);

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_KERNELS_CUH_
