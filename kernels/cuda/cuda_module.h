// The C entry points of the CUDA backend module (liblossd_cuda.so), loaded with dlopen so that
// cuBLAS never shares an executable's static TLS with the metrics server's threads, and so that one
// server binary runs on machines with and without CUDA.
#ifndef LOSSD_KERNELS_CUDA_CUDA_MODULE_H_
#define LOSSD_KERNELS_CUDA_CUDA_MODULE_H_

#include <cstddef>

#include "lossd/kernels/backend.h"

// Bumped whenever Backend's layout or these signatures change; the loader refuses a mismatch.
#define LOSSD_CUDA_MODULE_ABI 2

extern "C" {
int lossd_cuda_module_abi(void);
// A new CUDA backend on `device_ordinal`, or null with the reason written to `error`.
lossd::Backend* lossd_cuda_create_backend(int device_ordinal, char* error, size_t error_capacity);
}

#endif  // LOSSD_KERNELS_CUDA_CUDA_MODULE_H_
