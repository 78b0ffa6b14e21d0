// The CPU backend: OpenBLAS sgemm for the products, OpenMP over rows for everything else.
// Exact (fp32 products, fp32 statistics, double losses) and deterministic: every row is owned by
// one thread and every sum runs in a fixed order, so identical calls give identical bits.
#ifndef LOSSD_KERNELS_CPU_CPU_BACKEND_H_
#define LOSSD_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "lossd/kernels/backend.h"

namespace lossd {

std::unique_ptr<Backend> CreateCpuBackend();

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_BACKEND_H_
