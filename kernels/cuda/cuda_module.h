// The C entry points of the CUDA backend module (liblossd_cuda.so), loaded with dlopen so that
// cuBLAS never shares an executable's static TLS with the metrics server's threads, and so that one
// server binary runs on machines with and without CUDA.
#ifndef LOSSD_KERNELS_CUDA_CUDA_MODULE_H_
#define LOSSD_KERNELS_CUDA_CUDA_MODULE_H_

#include <cstddef>

#include "lossd/kernels/backend.h"

// Bumped whenever Backend's layout, the types it takes and gives (BatchInputs, TokenOutputs,
// BatchSummary), the statuses it returns (DeviceFaultError) or these signatures change; the loader
// refuses a mismatch.
#define LOSSD_CUDA_MODULE_ABI 12

extern "C" {
int lossd_cuda_module_abi(void);
// A new CUDA backend on `device_ordinal`, or null with the reason written to `error`.
lossd::Backend* lossd_cuda_create_backend(int device_ordinal, char* error, size_t error_capacity);
// For tests of what follows a device fault, never called by lossd itself: runs a kernel that
// stores through the null pointer on `device_ordinal` and waits for it, which leaves the device in
// CUDA's sticky cudaErrorIllegalAddress for the rest of the process. Returns 1 when the device is
// now in a sticky error state, else 0; the CUDA error's name goes to `error`.
int lossd_cuda_test_only_fault_device(int device_ordinal, char* error, size_t error_capacity);
}

namespace lossd {

// An entry point of the CUDA module that CreateBackend opened (such as
// lossd_cuda_test_only_fault_device), or null when no module was opened or it has no such symbol.
void* CudaModuleSymbol(const char* name);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CUDA_MODULE_H_
