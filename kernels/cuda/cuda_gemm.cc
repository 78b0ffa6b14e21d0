#include "kernels/cuda/cuda_gemm.h"

#include <algorithm>

#include "kernels/cuda/cuda_status.h"
#include "lossd/common/status_macros.h"

namespace lossd::cuda {
namespace {

cudaDataType_t CudaDataType(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// cuBLAS is column-major, where a stored row-major X reads as X^T, so it computes
// C^T = op(B)^T op(A)^T with the same transpose flags. alpha and beta point to host or device
// memory as the handle's pointer mode says.
absl::Status Gemm(cublasHandle_t cublas, bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                  int64_t k, const float* alpha, const Matrix& a, const Matrix& b,
                  const float* beta, float* c, int64_t ldc, bool allow_tf32) {
  const cublasComputeType_t compute =
      a.dtype == DType::kFloat32 && allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  return CublasStatus(
      cublasGemmEx_64(cublas, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                      transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, alpha, b.data,
                      CudaDataType(b.dtype), b.ld, a.data, CudaDataType(a.dtype), a.ld, beta, c,
                      CUDA_R_32F, ldc, compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// C = alpha op(A) op(B) + beta C over blocks of K of at most kMaxProductDepth (cuda_plan.h says
// where each starts in A and B). `beta_of(first)` gives the beta of the first block and of the
// rest.
template <typename BetaOf>
absl::Status Blocked(cublasHandle_t cublas, bool transpose_a, bool transpose_b, int64_t m,
                     int64_t n, int64_t k, const float* alpha, const Matrix& a, const Matrix& b,
                     BetaOf beta_of, float* c, int64_t ldc, bool allow_tf32) {
  for (int64_t k0 = 0; k0 < k; k0 += kMaxProductDepth) {
    const int64_t depth = std::min(kMaxProductDepth, k - k0);
    const Matrix a_block = a.At(BlockOffsetA(transpose_a, k0, a.ld));
    const Matrix b_block = b.At(BlockOffsetB(transpose_b, k0, b.ld));
    RETURN_IF_ERROR(Gemm(cublas, transpose_a, transpose_b, m, n, depth, alpha, a_block, b_block,
                         beta_of(k0 == 0), c, ldc, allow_tf32));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RowMajorGemm(cublasHandle_t cublas, bool transpose_a, bool transpose_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const Matrix& a, const Matrix& b,
                          float beta, float* c, int64_t ldc, bool allow_tf32) {
  return Gemm(cublas, transpose_a, transpose_b, m, n, k, &alpha, a, b, &beta, c, ldc, allow_tf32);
}

absl::Status RowMajorGemmBlocked(cublasHandle_t cublas, bool transpose_a, bool transpose_b,
                                 int64_t m, int64_t n, int64_t k, float alpha, const Matrix& a,
                                 const Matrix& b, float beta, float* c, int64_t ldc,
                                 bool allow_tf32) {
  const float one = 1.0f;
  return Blocked(
      cublas, transpose_a, transpose_b, m, n, k, &alpha, a, b,
      [&](bool first) { return first ? &beta : &one; }, c, ldc, allow_tf32);
}

absl::Status RowMajorGemmBlocked(cublasHandle_t cublas, bool transpose_a, bool transpose_b,
                                 int64_t m, int64_t n, int64_t k, const DeviceScalars& scalars,
                                 const Matrix& a, const Matrix& b, bool accumulate, float* c,
                                 int64_t ldc, bool allow_tf32) {
  RETURN_IF_ERROR(CublasStatus(cublasSetPointerMode(cublas, CUBLAS_POINTER_MODE_DEVICE),
                               "cublasSetPointerMode"));
  const absl::Status product = Blocked(
      cublas, transpose_a, transpose_b, m, n, k, scalars.d_alpha, a, b,
      [&](bool first) { return first && !accumulate ? scalars.d_zero : scalars.d_one; }, c, ldc,
      allow_tf32);
  const absl::Status restored =
      CublasStatus(cublasSetPointerMode(cublas, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
  return product.ok() ? restored : product;
}

}  // namespace lossd::cuda
