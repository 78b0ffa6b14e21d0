// CUDA runtime and cuBLAS errors as absl::Status: the module never aborts on a device error.
#ifndef LOSSD_KERNELS_CUDA_CUDA_STATUS_H_
#define LOSSD_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lossd/kernels/backend.h"

namespace lossd::cuda {

// The errors after which, in CUDA's words, "any further CUDA work will return the same error" and
// "the process must be terminated and relaunched" (driver_types.h), and the uncorrectable memory
// errors, after which the device's contents cannot be trusted.
inline bool IsStickyError(cudaError_t error) {
  switch (error) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice: return true;
    default: return false;
  }
}

// A failed runtime call also leaves its error as the thread's "last error", which launchers read
// after a kernel launch; it is cleared here so that a later launch is not blamed for it (a sticky
// error stays whatever is cleared). Sticky errors become DeviceFaultError, which the server acts
// on.
inline absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (IsStickyError(error)) return DeviceFaultError(message);
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
