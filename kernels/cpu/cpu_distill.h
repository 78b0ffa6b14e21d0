// The CPU backend's distill call (types.h, DistillOptions; distill_math.h): the student's and the
// teacher's logits tiles side by side per token chunk, in the three phases of distill_math.h.
// Internal to the CPU backend.
#ifndef LOSSD_KERNELS_CPU_CPU_DISTILL_H_
#define LOSSD_KERNELS_CPU_CPU_DISTILL_H_

#include <cstddef>
#include <cstdint>

#include "kernels/backend_impl.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/backend_common.h"

namespace lossd::cpu {

// Bytes of a distill call's workspace for `rows` token rows and `cols` vocabulary columns.
size_t DistillWorkspaceBytes(const ProblemShape& shape, int64_t rows, int64_t cols);
// How a distill call likes its tiles.
const TileLimits& DistillTileLimits();

// Computes a distill call that PlanCall checked and planned, in `workspace`.
BatchSummary RunDistill(const BatchInputs& inputs, const WeightView& weight,
                        const LossOptions& options, const TokenOutputs& outputs,
                        DeviceBuffer* grad_weight, const CallPlan& call, DeviceBuffer& workspace);

}  // namespace lossd::cpu

#endif  // LOSSD_KERNELS_CPU_CPU_DISTILL_H_
