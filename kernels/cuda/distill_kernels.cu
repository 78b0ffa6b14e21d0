// The distill objective's tiles (distill_math.h): the student's and the teacher's logits side by
// side, same rows and columns. The per-row sums of D's and K's summands with the divergence as a
// template argument, and the teacher's tile made from a sparse top-k; both distributions'
// statistics come with the student's RowStats from the same loads (row_stats.cu).
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"

namespace lossd::cuda {

static __global__ void ResetDistillStatsKernel(int64_t rows, const SparseTeacherRow* d_sparse_rows,
                                               DistillStats* d_stats) {
  for (int64_t i = GlobalThread(); i < rows; i += GridStride()) {
    d_stats[i] =
        d_sparse_rows != nullptr ? StartDistillStats(d_sparse_rows[i]) : EmptyDistillStats();
  }
}

absl::Status LaunchResetDistillStats(int64_t rows, const SparseTeacherRow* d_sparse_rows,
                                     DistillStats* d_stats, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  ResetDistillStatsKernel<<<GridFor(rows, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      rows, d_sparse_rows, d_stats);
  return CheckLaunch("ResetDistillStatsKernel");
}

static __global__ void TransformLogitsKernel(LogitTile tile, LogitTransform transform) {
  const int64_t row = blockIdx.y;
  float* d_z = tile.d_logits + row * tile.ld;
  for (int64_t c = GlobalThread(); c < tile.cols; c += GridStride()) {
    d_z[c] = TransformLogit(d_z[c], transform);
  }
}

absl::Status LaunchTransformLogits(const LogitTile& tile, const LogitTransform& transform,
                                   cudaStream_t stream) {
  if (tile.rows == 0 || transform.identity()) return absl::OkStatus();
  dim3 grid;
  RETURN_IF_ERROR(RowGrid("TransformLogits", tile.rows, tile.cols, grid));
  TransformLogitsKernel<<<grid, kElementwiseThreads, 0, stream>>>(tile, transform);
  return CheckLaunch("TransformLogitsKernel");
}

// The fill, then the top-k: a block's threads write the fill before any of them scatters.
static __global__ void FillSparseTeacherKernel(LogitTile tile, int k, const int32_t* d_tokens,
                                               const float* d_logprobs,
                                               const SparseTeacherRow* d_sparse_rows) {
  const int64_t row = blockIdx.x;
  float* d_z = tile.d_logits + row * tile.ld;
  const float rest = d_sparse_rows[row].rest_logit;
  for (int64_t c = threadIdx.x; c < tile.cols; c += blockDim.x) d_z[c] = rest;
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t token = d_tokens[row * k + j];
    if (token >= tile.v0 && token < tile.v0 + tile.cols) {
      d_z[token - tile.v0] = d_logprobs[row * k + j];
    }
  }
}

absl::Status LaunchFillSparseTeacher(const LogitTile& tile, int k, const int32_t* d_tokens,
                                     const float* d_logprobs, const SparseTeacherRow* d_sparse_rows,
                                     cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  FillSparseTeacherKernel<<<static_cast<unsigned>(tile.rows), kRowThreads, 0, stream>>>(
      tile, k, d_tokens, d_logprobs, d_sparse_rows);
  return CheckLaunch("FillSparseTeacherKernel");
}

// ---- Phase 2: the sums of D's and K's summands ----

template <DivergenceKind kKind, bool kTailBucket>
static __global__ void __launch_bounds__(kRowThreads)
    AddTileDistillTermsKernel(LogitTile student, LogitTile teacher,
                              const DistillRowConstants* d_constants, DistillRowTerms* d_terms) {
  __shared__ double scratch[kWarpSize + 1];
  const int64_t row = blockIdx.x;
  const DistillRowConstants c = d_constants[row];
  const float* d_z = student.d_logits + row * student.ld;
  const float* d_zt = teacher.d_logits + row * teacher.ld;
  double divergence = 0.0;
  double k = 0.0;
  for (int64_t col = threadIdx.x; col < student.cols; col += blockDim.x) {
    const DistillSummands s = DistillElementTerms<kKind, kTailBucket>(d_z[col], d_zt[col], c);
    divergence += s.divergence;
    k += s.k;
  }
  divergence = BlockReduce(divergence, Plus{}, scratch);
  k = BlockReduce(k, Plus{}, scratch);
  if (threadIdx.x == 0) {
    d_terms[row].divergence += divergence;
    d_terms[row].k += k;
  }
}

absl::Status LaunchAddTileDistillTerms(const LogitTile& student, const LogitTile& teacher,
                                       DivergenceKind kind, bool tail_bucket,
                                       const DistillRowConstants* d_constants,
                                       DistillRowTerms* d_terms, cudaStream_t stream) {
  if (student.rows == 0) return absl::OkStatus();
  const unsigned grid = static_cast<unsigned>(student.rows);
  BoolSwitch(tail_bucket, [&](auto tail) {
    constexpr bool kTail = decltype(tail)::value;
    switch (kind) {
      case DivergenceKind::kForwardKl:
        AddTileDistillTermsKernel<DivergenceKind::kForwardKl, kTail>
            <<<grid, kRowThreads, 0, stream>>>(student, teacher, d_constants, d_terms);
        break;
      case DivergenceKind::kReverseKl:
        AddTileDistillTermsKernel<DivergenceKind::kReverseKl, kTail>
            <<<grid, kRowThreads, 0, stream>>>(student, teacher, d_constants, d_terms);
        break;
      default:
        AddTileDistillTermsKernel<DivergenceKind::kJsd, kTail>
            <<<grid, kRowThreads, 0, stream>>>(student, teacher, d_constants, d_terms);
        break;
    }
  });
  return CheckLaunch("AddTileDistillTermsKernel");
}

}  // namespace lossd::cuda
