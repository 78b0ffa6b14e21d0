// Elementwise kernels on whole buffers: dtype conversions, fp32 addition, the sum of squares in
// double (fixed-size blocks, summed in order on the host), and the optimizer steps of
// optimizer_math.h. No floating-point atomics, so identical calls give identical bits.
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"

namespace lossd::cuda {

template <DType kDType>
static __global__ void ConvertToFloatKernel(const void* d_src, int64_t count, float* d_dst) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    d_dst[i] = LoadAsFloat(d_src, kDType, i);
  }
}

absl::Status LaunchConvertToFloat(const void* d_src, DType src_dtype, int64_t count, float* d_dst,
                                  cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  DTypeSwitch(src_dtype, [&](auto dtype) {
    ConvertToFloatKernel<decltype(dtype)::value>
        <<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(d_src, count,
                                                                                  d_dst);
  });
  return CheckLaunch("ConvertToFloatKernel");
}

template <DType kDType>
static __global__ void ConvertFromFloatKernel(const float* d_src, int64_t count, void* d_dst) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    StoreFromFloat(d_dst, kDType, i, d_src[i]);
  }
}

absl::Status LaunchConvertFromFloat(const float* d_src, int64_t count, DType dst_dtype, void* d_dst,
                                    cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  DTypeSwitch(dst_dtype, [&](auto dtype) {
    ConvertFromFloatKernel<decltype(dtype)::value>
        <<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(d_src, count,
                                                                                  d_dst);
  });
  return CheckLaunch("ConvertFromFloatKernel");
}

static __global__ void AddFloat32Kernel(float* d_dst, const float* d_src, int64_t count) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) d_dst[i] += d_src[i];
}

absl::Status LaunchAddFloat32(float* d_dst, const float* d_src, int64_t count,
                              cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  AddFloat32Kernel<<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      d_dst, d_src, count);
  return CheckLaunch("AddFloat32Kernel");
}

static __global__ void ScaleFloat32Kernel(float* d_x, int64_t count, float factor) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) d_x[i] *= factor;
}

absl::Status LaunchScaleFloat32(float* d_x, int64_t count, float factor, cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  ScaleFloat32Kernel<<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      d_x, count, factor);
  return CheckLaunch("ScaleFloat32Kernel");
}

absl::Status CheckKernelImage() {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, AddFloat32Kernel);
  switch (error) {
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidKernelImage:
    case cudaErrorInvalidDeviceFunction:
    case cudaErrorUnsupportedPtxVersion:
      cudaGetLastError();  // see CudaStatus
      return absl::FailedPreconditionError(
          absl::StrCat(cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
    default: return CudaStatus(error, "cudaFuncGetAttributes");
  }
}

static __global__ void SumSquaresPartialsKernel(const float* d_x, int64_t count,
                                                double* d_partials) {
  __shared__ double scratch[kWarpSize + 1];
  const int64_t begin = count * blockIdx.x / gridDim.x;
  const int64_t end = count * (blockIdx.x + 1) / gridDim.x;
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    sum += static_cast<double>(d_x[i]) * d_x[i];
  }
  sum = BlockReduce(sum, Plus{}, scratch);
  if (threadIdx.x == 0) d_partials[blockIdx.x] = sum;
}

absl::Status LaunchSumSquaresPartials(const float* d_x, int64_t count, double* d_partials,
                                      cudaStream_t stream) {
  SumSquaresPartialsKernel<<<kSumSquaresBlocks, kElementwiseThreads, 0, stream>>>(d_x, count,
                                                                                  d_partials);
  return CheckLaunch("SumSquaresPartialsKernel");
}

// The smaller of two codes (NonFiniteUpdateCode); both are whole numbers or +inf, never NaN.
struct MinCode {
  __device__ double operator()(double a, double b) const { return b < a ? b : a; }
};

static __global__ void OptimizerCheckKernel(bool adamw, OptimizerScalars scalars,
                                            const void* d_weight, DType weight_dtype,
                                            DType served_dtype, const float* d_grad,
                                            const float* d_state1, const float* d_state2,
                                            int64_t count, double* d_partials) {
  __shared__ double scratch[kWarpSize + 1];
  const int64_t begin = count * blockIdx.x / gridDim.x;
  const int64_t end = count * (blockIdx.x + 1) / gridDim.x;
  const bool has_state1 = d_state1 != nullptr;
  double first = HUGE_VAL;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const ElementUpdate u =
        UpdateElement(adamw, has_state1, LoadAsFloat(d_weight, weight_dtype, i), d_grad[i],
                      has_state1 ? d_state1[i] : 0.0f, adamw ? d_state2[i] : 0.0f, scalars);
    const double code = NonFiniteUpdateCode(u, i, served_dtype, has_state1, adamw);
    if (code != 0.0 && code < first) first = code;
  }
  first = BlockReduce(first, MinCode{}, scratch);
  if (threadIdx.x == 0) d_partials[blockIdx.x] = first;
}

absl::Status LaunchOptimizerCheck(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                  const void* d_weight, DType weight_dtype, DType served_dtype,
                                  const float* d_grad, const float* d_state1, const float* d_state2,
                                  int64_t count, double* d_partials, cudaStream_t stream) {
  OptimizerCheckKernel<<<kSumSquaresBlocks, kElementwiseThreads, 0, stream>>>(
      kind == OptimizerConfig::Kind::kAdamW, scalars, d_weight, weight_dtype, served_dtype, d_grad,
      d_state1, d_state2, count, d_partials);
  return CheckLaunch("OptimizerCheckKernel");
}

static __global__ void OptimizerStepKernel(bool adamw, OptimizerScalars scalars, void* d_weight,
                                           DType weight_dtype, const float* d_grad, float* d_state1,
                                           float* d_state2, int64_t count) {
  const bool has_state1 = d_state1 != nullptr;
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    const ElementUpdate u =
        UpdateElement(adamw, has_state1, LoadAsFloat(d_weight, weight_dtype, i), d_grad[i],
                      has_state1 ? d_state1[i] : 0.0f, adamw ? d_state2[i] : 0.0f, scalars);
    StoreFromFloat(d_weight, weight_dtype, i, u.weight);
    if (has_state1) d_state1[i] = u.state1;
    if (adamw) d_state2[i] = u.state2;
  }
}

absl::Status LaunchOptimizerStep(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                 void* d_weight, DType weight_dtype, const float* d_grad,
                                 float* d_state1, float* d_state2, int64_t count,
                                 cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  OptimizerStepKernel<<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      kind == OptimizerConfig::Kind::kAdamW, scalars, d_weight, weight_dtype, d_grad, d_state1,
      d_state2, count);
  return CheckLaunch("OptimizerStepKernel");
}

// `d_nowhere` is null at run time, which the compiler cannot see here: a plain store, not a trap.
static __global__ void TestOnlyIllegalAddressKernel(float* d_nowhere) { *d_nowhere = 1.0f; }

absl::Status LaunchTestOnlyIllegalAddress(cudaStream_t stream) {
  TestOnlyIllegalAddressKernel<<<1, 1, 0, stream>>>(nullptr);
  return CheckLaunch("TestOnlyIllegalAddressKernel");
}

}  // namespace lossd::cuda
