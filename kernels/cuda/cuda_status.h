// CUDA runtime and cuBLAS errors as absl::Status: the module never aborts on a device error.
#ifndef LOSSD_KERNELS_CUDA_CUDA_STATUS_H_
#define LOSSD_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lossd::cuda {

// A failed runtime call also leaves its error as the thread's "last error", which launchers read
// after a kernel launch; it is cleared here so that a later launch is not blamed for it.
inline absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation: return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
  }
}

inline absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusName(status), " (",
                                           cublasGetStatusString(status), ")");
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED: return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: return absl::UnimplementedError(message);
    default: return absl::InternalError(message);
  }
}

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_STATUS_H_
