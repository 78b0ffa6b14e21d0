// The CUDA backend's products: cuBLAS GEMMs on row-major operands with fp32 results, as the
// backend calls them, kept apart so that tests can measure them exactly as the engine runs them.
#ifndef LOSSD_KERNELS_CUDA_CUDA_GEMM_H_
#define LOSSD_KERNELS_CUDA_CUDA_GEMM_H_

#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_plan.h"
#include "lossd/kernels/types.h"

namespace lossd::cuda {

// A row-major GEMM operand.
struct Matrix {
  const void* data;
  DType dtype;
  int64_t ld;

  // The same matrix starting `offset` elements further on (a later row of W, a later column of dA).
  Matrix At(int64_t offset) const {
    return {static_cast<const char*>(data) + offset * static_cast<int64_t>(DTypeSize(dtype)), dtype,
            ld};
  }
};

// C[m, n] = alpha op(A) op(B) + beta C, row-major, C fp32, accumulated in fp32 (tensor cores for
// 16-bit operands; tf32 for fp32 ones when allow_tf32).
absl::Status RowMajorGemm(cublasHandle_t cublas, bool transpose_a, bool transpose_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const Matrix& a, const Matrix& b,
                          float beta, float* c, int64_t ldc, bool allow_tf32);

// RowMajorGemm with K split into blocks of at most kMaxProductDepth, in order: the first block
// with `beta`, the rest with beta = 1. The engine's products all go through it.
absl::Status RowMajorGemmBlocked(cublasHandle_t cublas, bool transpose_a, bool transpose_b,
                                 int64_t m, int64_t n, int64_t k, float alpha, const Matrix& a,
                                 const Matrix& b, float beta, float* c, int64_t ldc,
                                 bool allow_tf32);

// alpha and the two betas of a product read from device memory when the product runs (cuBLAS's
// device pointer mode), so that a scale the device computed (the 16-bit carriage of dL/da's
// LaunchSplitScale) reaches the GEMM without a trip to the host.
struct DeviceScalars {
  const float* d_alpha;
  const float* d_zero;
  const float* d_one;
};

// RowMajorGemmBlocked with alpha from the device, and beta 0 (store) or 1 (accumulate).
absl::Status RowMajorGemmBlocked(cublasHandle_t cublas, bool transpose_a, bool transpose_b,
                                 int64_t m, int64_t n, int64_t k, const DeviceScalars& scalars,
                                 const Matrix& a, const Matrix& b, bool accumulate, float* c,
                                 int64_t ldc, bool allow_tf32);

// cuBLAS's recommended workspace for a device of compute capability `major`.x: 32 MiB on Hopper
// and later, 4 MiB before. The backend gives each handle this much, so cuBLAS allocates nothing
// during a call and picks its kernels with it.
inline size_t CublasWorkspaceBytes(int major) {
  return (major >= 9 ? size_t{32} : size_t{4}) << 20;
}

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_GEMM_H_
