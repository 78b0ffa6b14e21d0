// Rows finished on the device, one thread per row, with the functions the CPU backend finishes
// them with on the host (loss_math.h's FinishRowAt and RowGradientAt, distill_math.h's), so that
// a chunk's gradients follow its statistics without a trip to the host; and the chunk's scale for
// carrying dL/da in 16 bits.
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"

namespace lossd::cuda {

constexpr int kFinishThreads = 128;

template <bool kGradients>
static __global__ void FinishRowsKernel(int64_t rows, RowInputArrays arrays,
                                        RowFinishConstants constants, const RowStats* d_stats,
                                        RowResult* d_results, RowGradient* d_row_grads,
                                        double* d_bounds) {
  for (int64_t row = GlobalThread(); row < rows; row += GridStride()) {
    const RowResult result = FinishRowAt(arrays, constants, row, d_stats[row]);
    d_results[row] = result;
    if constexpr (kGradients) {
      const RowGradient gradient = RowGradientAt(arrays, constants, row, result);
      d_row_grads[row] = gradient;
      d_bounds[row] = LogitGradientBound(gradient, constants.transform);
    }
  }
}

absl::Status LaunchFinishRows(int64_t rows, const RowInputArrays& d_arrays,
                              const RowFinishConstants& constants, const RowStats* d_stats,
                              RowResult* d_results, RowGradient* d_row_grads, double* d_bounds,
                              cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  BoolSwitch(d_row_grads != nullptr, [&](auto gradients) {
    FinishRowsKernel<decltype(gradients)::value>
        <<<GridFor(rows, kFinishThreads), kFinishThreads, 0, stream>>>(
            rows, d_arrays, constants, d_stats, d_results, d_row_grads, d_bounds);
  });
  return CheckLaunch("FinishRowsKernel");
}

// One thread per sequence: a sequence's log-ratio sums its rows in order, as the CPU's does, and
// sequences are short next to the chunk's GEMMs.
static __global__ void SequenceLogRatiosKernel(int64_t num_sequences,
                                               const int32_t* d_sequence_ends,
                                               RowInputArrays arrays, RowFinishConstants constants,
                                               const RowStats* d_stats, float* d_log_ratios) {
  for (int64_t s = GlobalThread(); s < num_sequences; s += GridStride()) {
    const int64_t first = s == 0 ? 0 : d_sequence_ends[s - 1];
    const int64_t end = d_sequence_ends[s];
    SequenceLogRatio ratio;
    for (int64_t row = first; row < end; ++row) {
      if (RowCounted(arrays, constants, row)) {
        ratio.Add(d_stats[row], arrays.sampling_logprobs[row]);
      }
    }
    const float value = ratio.Value();
    for (int64_t row = first; row < end; ++row) d_log_ratios[row] = value;
  }
}

absl::Status LaunchSequenceLogRatios(int64_t num_sequences, const int32_t* d_sequence_ends,
                                     const RowInputArrays& d_arrays,
                                     const RowFinishConstants& constants, const RowStats* d_stats,
                                     float* d_log_ratios, cudaStream_t stream) {
  if (num_sequences == 0) return absl::OkStatus();
  SequenceLogRatiosKernel<<<GridFor(num_sequences, kFinishThreads), kFinishThreads, 0, stream>>>(
      num_sequences, d_sequence_ends, d_arrays, constants, d_stats, d_log_ratios);
  return CheckLaunch("SequenceLogRatiosKernel");
}

static __global__ void DistillConstantsKernel(int64_t rows, const DistillStats* d_stats,
                                              DistillOptions options,
                                              DistillRowConstants* d_constants) {
  for (int64_t row = GlobalThread(); row < rows; row += GridStride()) {
    d_constants[row] = MakeDistillRowConstants(d_stats[row], options);
  }
}

absl::Status LaunchDistillConstants(int64_t rows, const DistillStats* d_stats,
                                    const DistillOptions& options, DistillRowConstants* d_constants,
                                    cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  DistillConstantsKernel<<<GridFor(rows, kFinishThreads), kFinishThreads, 0, stream>>>(
      rows, d_stats, options, d_constants);
  return CheckLaunch("DistillConstantsKernel");
}

template <bool kGradients>
static __global__ void FinishDistillRowsKernel(
    int64_t rows, RowInputArrays arrays, RowFinishConstants constants, DistillOptions options,
    bool dense_teacher, const RowStats* d_stats, const DistillStats* d_distill_stats,
    const DistillRowTerms* d_terms, const DistillRowConstants* d_constants,
    DistillRowResult* d_results, DistillRowGradient* d_row_grads, double* d_bounds) {
  for (int64_t row = GlobalThread(); row < rows; row += GridStride()) {
    const DistillRowResult result =
        FinishDistillRowAt(arrays, constants, options, dense_teacher, row, d_stats[row],
                           d_distill_stats[row], d_constants[row], d_terms[row]);
    d_results[row] = result;
    if constexpr (kGradients) {
      const DistillRowGradient gradient =
          DistillRowGradientAt(arrays, constants, options, row, result, d_constants[row]);
      d_row_grads[row] = gradient;
      d_bounds[row] =
          DistillLogitGradientBound(gradient, result.gradient_bound, constants.transform);
    }
  }
}

absl::Status LaunchFinishDistillRows(int64_t rows, const RowInputArrays& d_arrays,
                                     const RowFinishConstants& constants,
                                     const DistillOptions& options, bool dense_teacher,
                                     const RowStats* d_stats, const DistillStats* d_distill_stats,
                                     const DistillRowTerms* d_terms,
                                     const DistillRowConstants* d_constants,
                                     DistillRowResult* d_results, DistillRowGradient* d_row_grads,
                                     double* d_bounds, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  BoolSwitch(d_row_grads != nullptr, [&](auto gradients) {
    FinishDistillRowsKernel<decltype(gradients)::value>
        <<<GridFor(rows, kFinishThreads), kFinishThreads, 0, stream>>>(
            rows, d_arrays, constants, options, dense_teacher, d_stats, d_distill_stats, d_terms,
            d_constants, d_results, d_row_grads, d_bounds);
  });
  return CheckLaunch("FinishDistillRowsKernel");
}

struct MaxOfDouble {
  // MaxStep's rule: a NaN bound is passed over, as the host's std::max passed it over.
  __device__ double operator()(double a, double b) const { return b > a ? b : a; }
};

constexpr int kSplitScaleThreads = 256;

static __global__ void SplitScaleKernel(int64_t rows, const double* d_bounds,
                                        float* d_split_scale) {
  __shared__ double scratch[kWarpSize + 1];
  double bound = 0.0;
  for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) {
    bound = MaxOfDouble{}(bound, d_bounds[row]);
  }
  bound = BlockReduce(bound, MaxOfDouble{}, scratch);
  if (threadIdx.x != 0) return;
  const float scale = GradientSplitScale(bound, kSplitMaxExponent);
  d_split_scale[0] = scale;
  d_split_scale[1] = 1.0f / scale;  // exact: a power of two
  d_split_scale[2] = 0.0f;
  d_split_scale[3] = 1.0f;
}

absl::Status LaunchSplitScale(int64_t rows, const double* d_bounds, float* d_split_scale,
                              cudaStream_t stream) {
  SplitScaleKernel<<<1, kSplitScaleThreads, 0, stream>>>(rows, d_bounds, d_split_scale);
  return CheckLaunch("SplitScaleKernel");
}

}  // namespace lossd::cuda
