// Device helpers shared by the CUDA backend's kernel files: launch geometry, launch checks,
// fixed-order block reductions, and the switches that turn run-time options into template
// arguments once per launch (as flash-attention's BOOL_SWITCH does), so that no kernel branches on
// an option per element. Included by .cu files only.
#ifndef LOSSD_KERNELS_CUDA_CUDA_DEVICE_CUH_
#define LOSSD_KERNELS_CUDA_CUDA_DEVICE_CUH_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/types.h"

namespace lossd::cuda {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kElementwiseThreads = 256;
inline constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride loops cover the rest
inline constexpr int kRowThreads = 512;
inline constexpr int kGradientColumnsPerThread = 4;
inline constexpr int64_t kMaxGridRows = 65535;  // gridDim.y limit, for per-row grids

inline unsigned GridFor(int64_t count, int threads) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((count + threads - 1) / threads, 1, kMaxGridBlocks));
}

inline absl::Status CheckLaunch(const char* kernel) {
  return CudaStatus(cudaGetLastError(), kernel);
}

// A per-row grid (blockIdx.y = row) of `columns_per_block`-wide blocks over the columns.
inline absl::Status RowGrid(const char* kernel, int64_t rows, int64_t cols, dim3& grid) {
  if (rows > kMaxGridRows) {
    return absl::InvalidArgumentError(
        absl::StrCat(kernel, ": at most ", kMaxGridRows, " rows per tile, got ", rows));
  }
  grid = dim3(GridFor(cols, kElementwiseThreads * kGradientColumnsPerThread),
              static_cast<unsigned>(rows));
  return absl::OkStatus();
}

// Calls fn(std::integral_constant<bool, value>{}) so that `value` becomes a template argument.
template <typename Fn>
void BoolSwitch(bool value, Fn&& fn) {
  if (value) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Calls fn(std::integral_constant<DType, dtype>{}) so that a buffer's dtype becomes a template
// argument.
template <typename Fn>
void DTypeSwitch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBFloat16: fn(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: fn(std::integral_constant<DType, DType::kFloat16>{}); break;
    default: fn(std::integral_constant<DType, DType::kFloat32>{}); break;
  }
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Columns [4q, 4q + 4) of a row of a logits tile (16-byte aligned: its leading dimension is a
// multiple of kLeadingDimensionMultiple), as one 16-byte load, and back as one store.
__device__ __forceinline__ void Load4(const float* d_row, int64_t q, float (&z)[4]) {
  const float4 v = reinterpret_cast<const float4*>(d_row)[q];
  z[0] = v.x;
  z[1] = v.y;
  z[2] = v.z;
  z[3] = v.w;
}
__device__ __forceinline__ void Store4(float* d_row, int64_t q, const float (&z)[4]) {
  reinterpret_cast<float4*>(d_row)[q] = make_float4(z[0], z[1], z[2], z[3]);
}

// ---- Block reductions in a fixed order: a shuffle tree in each warp, then the warps in order ----

__device__ __forceinline__ double ShuffleDown(double x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}
__device__ __forceinline__ float ShuffleDown(float x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}
__device__ __forceinline__ int ShuffleDown(int x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}

// __shfl_down_sync of a trivially copyable struct (a partial statistic), word by word.
template <typename T>
__device__ __forceinline__ T ShuffleDownWords(const T& x, int offset) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % sizeof(unsigned) == 0);
  unsigned words[sizeof(T) / sizeof(unsigned)];
  memcpy(words, &x, sizeof(T));
  for (unsigned& word : words) word = __shfl_down_sync(kFullMask, word, offset);
  T r;
  memcpy(&r, words, sizeof(T));
  return r;
}

struct Plus {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// Reduces one value per thread over the block; every thread gets the result. `scratch` is shared
// memory of kWarpSize + 1 elements. Must be reached by all threads of the block.
template <typename T, typename Combine>
__device__ T BlockReduce(T value, Combine combine, T* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    if constexpr (std::is_class_v<T>) {
      value = combine(value, ShuffleDownWords(value, offset));
    } else {
      value = combine(value, ShuffleDown(value, offset));
    }
  }
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    T total = scratch[0];
    for (int w = 1; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) {
      total = combine(total, scratch[w]);
    }
    scratch[kWarpSize] = total;
  }
  __syncthreads();
  // A next reduction on the same scratch writes scratch[warp] only, and scratch[kWarpSize] after
  // its first barrier, which every thread reaches after this read.
  return scratch[kWarpSize];
}

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_DEVICE_CUH_
