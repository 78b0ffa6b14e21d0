#include "kernels/cuda/cuda_gemm.h"

#include "kernels/cuda/cuda_status.h"

namespace lossd::cuda {
namespace {

cudaDataType_t CudaDataType(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

}  // namespace

// cuBLAS is column-major, where a stored row-major X reads as X^T, so it computes
// C^T = op(B)^T op(A)^T with the same transpose flags.
absl::Status RowMajorGemm(cublasHandle_t cublas, bool transpose_a, bool transpose_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const Matrix& a, const Matrix& b,
                          float beta, float* c, int64_t ldc, bool allow_tf32) {
  const cublasComputeType_t compute =
      a.dtype == DType::kFloat32 && allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  return CublasStatus(
      cublasGemmEx_64(cublas, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                      transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b.data,
                      CudaDataType(b.dtype), b.ld, a.data, CudaDataType(a.dtype), a.ld, &beta, c,
                      CUDA_R_32F, ldc, compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace lossd::cuda
