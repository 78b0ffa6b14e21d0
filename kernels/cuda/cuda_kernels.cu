// The CUDA backend's own kernels. No floating-point atomics anywhere: every sum runs in a fixed
// order (shuffle trees inside a warp, then the warps in index order), so identical calls give
// identical bits. The scalar math comes from loss_math.h and optimizer_math.h.
#include "kernels/cuda/cuda_kernels.cuh"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_status.h"

namespace lossd::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride loops cover the rest
constexpr int kRowThreads = 512;
constexpr int kTopKThreads = 256;
constexpr int kTopKWarps = kTopKThreads / kWarpSize;
constexpr int kGradientColumnsPerThread = 4;
constexpr int64_t kMaxGridRows = 65535;  // gridDim.y limit, for the per-row grid of LogitGradients

static_assert(kMaxTopK <= 2 * kWarpSize, "a warp's top-k list holds two entries per lane");

static unsigned GridFor(int64_t count, int threads) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((count + threads - 1) / threads, 1, kMaxGridBlocks));
}

static absl::Status CheckLaunch(const char* kernel) {
  return CudaStatus(cudaGetLastError(), kernel);
}

static __device__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

static __device__ int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---- Block reductions in a fixed order ----

// The larger of two (value, column) pairs, the lower column on ties; column -1 means "none yet".
struct MaxAt {
  float value;
  int32_t column;
};

struct BetterOf {
  __device__ MaxAt operator()(MaxAt a, MaxAt b) const {
    if (b.column < 0) return a;
    if (a.column < 0) return b;
    return (b.value > a.value || (b.value == a.value && b.column < a.column)) ? b : a;
  }
};

struct Plus {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

struct MaxOf {
  __device__ float operator()(float a, float b) const { return MaxStep(a, b); }
};

struct MinOf {
  __device__ float operator()(float a, float b) const { return MinStep(a, b); }
};

// The smaller of two codes (NonFiniteUpdateCode); both are whole numbers or +inf, never NaN.
struct MinCode {
  __device__ double operator()(double a, double b) const { return b < a ? b : a; }
};

static __device__ double ShuffleDown(double x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}
static __device__ float ShuffleDown(float x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}
static __device__ int ShuffleDown(int x, int offset) {
  return __shfl_down_sync(kFullMask, x, offset);
}
static __device__ MaxAt ShuffleDown(MaxAt x, int offset) {
  return {__shfl_down_sync(kFullMask, x.value, offset),
          __shfl_down_sync(kFullMask, x.column, offset)};
}

// Reduces one value per thread over the block; every thread gets the result. `scratch` is shared
// memory of kWarpSize + 1 elements. Must be reached by all threads of the block.
template <typename T, typename Combine>
static __device__ T BlockReduce(T value, Combine combine, T* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = combine(value, ShuffleDown(value, offset));
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
  return scratch[kWarpSize];
}

// ---- Conversions and resets ----

static __global__ void ConvertToFloatKernel(const void* d_src, DType src_dtype, int64_t count,
                                            float* d_dst) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    d_dst[i] = LoadAsFloat(d_src, src_dtype, i);
  }
}

absl::Status LaunchConvertToFloat(const void* d_src, DType src_dtype, int64_t count, float* d_dst,
                                  cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  ConvertToFloatKernel<<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      d_src, src_dtype, count, d_dst);
  return CheckLaunch("ConvertToFloatKernel");
}

static __global__ void ConvertFromFloatKernel(const float* d_src, int64_t count, DType dst_dtype,
                                              void* d_dst) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    StoreFromFloat(d_dst, dst_dtype, i, d_src[i]);
  }
}

absl::Status LaunchConvertFromFloat(const float* d_src, int64_t count, DType dst_dtype, void* d_dst,
                                    cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  ConvertFromFloatKernel<<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      d_src, count, dst_dtype, d_dst);
  return CheckLaunch("ConvertFromFloatKernel");
}

static __global__ void ResetRowsKernel(int64_t rows, int top_k, RowStats* d_stats,
                                       float* d_top_values, int32_t* d_top_tokens) {
  for (int64_t i = GlobalThread(); i < rows; i += GridStride()) d_stats[i] = EmptyRowStats();
  for (int64_t i = GlobalThread(); i < rows * top_k; i += GridStride()) {
    d_top_values[i] = -INFINITY;
    d_top_tokens[i] = 0;
  }
}

absl::Status LaunchResetRows(int64_t rows, int top_k, RowStats* d_stats, float* d_top_values,
                             int32_t* d_top_tokens, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  ResetRowsKernel<<<GridFor(rows * std::max(top_k, 1), kElementwiseThreads), kElementwiseThreads, 0,
                    stream>>>(rows, top_k, d_stats, d_top_values, d_top_tokens);
  return CheckLaunch("ResetRowsKernel");
}

// ---- Row statistics ----

// Pass one over the row: transform, max/argmax, sum z. Pass two: sum e^(z-m) and e^(z-m)(z-m)
// against the tile's own max, as the CPU's TileRowStats; then MergeRowStats. Sums run in double
// (each thread's terms, then the block), so their rounding does not grow with V.
static __global__ void MergeTileRowStatsKernel(LogitTile tile, const int64_t* d_labels,
                                               LogitTransform transform, bool apply_transform,
                                               RowStats* d_stats) {
  __shared__ MaxAt max_scratch[kWarpSize + 1];
  __shared__ double sum_scratch[kWarpSize + 1];
  const int64_t row = blockIdx.x;
  float* d_z = tile.d_logits + row * tile.ld;

  MaxAt best{-INFINITY, -1};
  double sum_z = 0.0;
  for (int64_t c = threadIdx.x; c < tile.cols; c += blockDim.x) {
    float z = d_z[c];
    if (apply_transform) {
      z = TransformLogit(z, transform);
      d_z[c] = z;
    }
    sum_z += z;
    // Columns arrive in increasing order, so the first maximum is kept; NaN never qualifies.
    if (z > best.value || (best.column < 0 && z == best.value)) best = {z, static_cast<int32_t>(c)};
  }
  best = BlockReduce(best, BetterOf{}, max_scratch);
  sum_z = BlockReduce(sum_z, Plus{}, sum_scratch);

  double sum_exp = 0.0;
  double sum_exp_shifted = 0.0;
  if (best.column >= 0) {  // the same for every thread of the block
    for (int64_t c = threadIdx.x; c < tile.cols; c += blockDim.x) {
      const float d = d_z[c] - best.value;
      const float e = Exp(d);
      sum_exp += e;
      sum_exp_shifted += e * d;
    }
    sum_exp = BlockReduce(sum_exp, Plus{}, sum_scratch);
    sum_exp_shifted = BlockReduce(sum_exp_shifted, Plus{}, sum_scratch);
  }

  if (threadIdx.x != 0) return;
  RowStats stats = EmptyRowStats();
  stats.sum_z = static_cast<float>(sum_z);
  const int64_t label = d_labels[row];
  if (label >= tile.v0 && label < tile.v0 + tile.cols) stats.target = d_z[label - tile.v0];
  if (best.column >= 0) {  // else a NaN row: sum_z carries the NaN
    stats.max = best.value;
    stats.sum_exp = static_cast<float>(sum_exp);
    stats.sum_exp_shifted = static_cast<float>(sum_exp_shifted);
    stats.argmax = static_cast<int32_t>(tile.v0 + best.column);
  }
  MergeRowStats(d_stats[row], stats);
}

absl::Status LaunchMergeTileRowStats(const LogitTile& tile, const int64_t* d_labels,
                                     const LogitTransform& transform, bool apply_transform,
                                     RowStats* d_stats, cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  MergeTileRowStatsKernel<<<static_cast<unsigned>(tile.rows), kRowThreads, 0, stream>>>(
      tile, d_labels, transform, apply_transform, d_stats);
  return CheckLaunch("MergeTileRowStatsKernel");
}

// ---- Top-k ----

// (value, token) ranks before (other_value, other_token): larger value, then lower token. A strict
// total order on distinct tokens, so the k best are one set whatever order candidates arrive in.
static __device__ bool Outranks(float value, int32_t token, float other_value,
                                int32_t other_token) {
  return value > other_value || (value == other_value && token < other_token);
}

// A warp's sorted top-k list, best first: lane l holds entries l and l + 32. Entries from k on are
// scratch. All functions below are called by the whole warp with warp-uniform arguments.
struct WarpTopK {
  float value0;
  float value1;
  int32_t token0;
  int32_t token1;
};

static __device__ void ReadEntry(const WarpTopK& list, int index, float& value, int32_t& token) {
  const bool first = index < kWarpSize;
  value = __shfl_sync(kFullMask, first ? list.value0 : list.value1, index % kWarpSize);
  token = __shfl_sync(kFullMask, first ? list.token0 : list.token1, index % kWarpSize);
}

static __device__ void PlaceEntry(int index, int position, float value, int32_t token,
                                  float previous_value, int32_t previous_token, float& entry_value,
                                  int32_t& entry_token) {
  if (index == position) {
    entry_value = value;
    entry_token = token;
  } else if (index > position) {
    entry_value = previous_value;
    entry_token = previous_token;
  }
}

// Inserts a candidate that outranks entry k - 1, shifting the worse entries down by one.
static __device__ void InsertEntry(WarpTopK& list, int k, float value, int32_t token) {
  const int lane = threadIdx.x % kWarpSize;
  // The entries the candidate does not outrank are a prefix of the sorted list; its length is the
  // candidate's position.
  const unsigned ahead0 =
      __ballot_sync(kFullMask, lane < k && !Outranks(value, token, list.value0, list.token0));
  const unsigned ahead1 = __ballot_sync(
      kFullMask, lane + kWarpSize < k && !Outranks(value, token, list.value1, list.token1));
  const int position = __popc(ahead0) + __popc(ahead1);
  const float previous_value0 = __shfl_up_sync(kFullMask, list.value0, 1);
  const int32_t previous_token0 = __shfl_up_sync(kFullMask, list.token0, 1);
  float previous_value1 = __shfl_up_sync(kFullMask, list.value1, 1);
  int32_t previous_token1 = __shfl_up_sync(kFullMask, list.token1, 1);
  const float last_value0 = __shfl_sync(kFullMask, list.value0, kWarpSize - 1);
  const int32_t last_token0 = __shfl_sync(kFullMask, list.token0, kWarpSize - 1);
  if (lane == 0) {  // entry 32 moves down from entry 31
    previous_value1 = last_value0;
    previous_token1 = last_token0;
  }
  PlaceEntry(lane, position, value, token, previous_value0, previous_token0, list.value0,
             list.token0);
  PlaceEntry(lane + kWarpSize, position, value, token, previous_value1, previous_token1,
             list.value1, list.token1);
}

// Each warp scans a strided share of the row, 32 columns at a time, inserting only candidates that
// beat its current k-th entry; warp 0 then merges the running list with every warp's list.
static __global__ void MergeTileTopKKernel(LogitTile tile, int k, float* d_top_values,
                                           int32_t* d_top_tokens) {
  __shared__ float warp_values[kTopKWarps][kMaxTopK];
  __shared__ int32_t warp_tokens[kTopKWarps][kMaxTopK];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row = blockIdx.x;
  const float* d_z = tile.d_logits + row * tile.ld;

  WarpTopK list{-INFINITY, -INFINITY, 0, 0};
  float kth_value;
  int32_t kth_token;
  ReadEntry(list, k - 1, kth_value, kth_token);
  for (int64_t base = static_cast<int64_t>(warp) * kWarpSize; base < tile.cols;
       base += kTopKThreads) {
    const int64_t c = base + lane;
    const float value = c < tile.cols ? d_z[c] : -INFINITY;
    const int32_t token = static_cast<int32_t>(tile.v0 + c);
    bool pending = c < tile.cols && Outranks(value, token, kth_value, kth_token);
    for (unsigned mask; (mask = __ballot_sync(kFullMask, pending)) != 0;) {
      const int source = __ffs(mask) - 1;
      InsertEntry(list, k, __shfl_sync(kFullMask, value, source),
                  __shfl_sync(kFullMask, token, source));
      ReadEntry(list, k - 1, kth_value, kth_token);
      pending = pending && lane != source && Outranks(value, token, kth_value, kth_token);
    }
  }
  if (lane < k) {
    warp_values[warp][lane] = list.value0;
    warp_tokens[warp][lane] = list.token0;
  }
  if (lane + kWarpSize < k) {
    warp_values[warp][lane + kWarpSize] = list.value1;
    warp_tokens[warp][lane + kWarpSize] = list.token1;
  }
  __syncthreads();
  if (warp != 0) return;

  float* d_values = d_top_values + row * k;
  int32_t* d_tokens = d_top_tokens + row * k;
  list = {lane < k ? d_values[lane] : -INFINITY,
          lane + kWarpSize < k ? d_values[lane + kWarpSize] : -INFINITY,
          lane < k ? d_tokens[lane] : 0, lane + kWarpSize < k ? d_tokens[lane + kWarpSize] : 0};
  ReadEntry(list, k - 1, kth_value, kth_token);
  for (int w = 0; w < kTopKWarps; ++w) {
    for (int j = 0; j < k; ++j) {
      const float value = warp_values[w][j];
      const int32_t token = warp_tokens[w][j];
      if (!Outranks(value, token, kth_value, kth_token)) break;  // the rest of w's list ranks lower
      InsertEntry(list, k, value, token);
      ReadEntry(list, k - 1, kth_value, kth_token);
    }
  }
  if (lane < k) {
    d_values[lane] = list.value0;
    d_tokens[lane] = list.token0;
  }
  if (lane + kWarpSize < k) {
    d_values[lane + kWarpSize] = list.value1;
    d_tokens[lane + kWarpSize] = list.token1;
  }
}

absl::Status LaunchMergeTileTopK(const LogitTile& tile, int k, float* d_top_values,
                                 int32_t* d_top_tokens, cudaStream_t stream) {
  if (tile.rows == 0 || k == 0) return absl::OkStatus();
  MergeTileTopKKernel<<<static_cast<unsigned>(tile.rows), kTopKThreads, 0, stream>>>(
      tile, k, d_top_values, d_top_tokens);
  return CheckLaunch("MergeTileTopKKernel");
}

// ---- dL/da ----

// dL/da of logit i: into the fp32 tile, or split for 16-bit products as S dL/da = hi + lo.
static __device__ void StoreGradient(float grad, int64_t i, float* d_logits,
                                     const GradientSplit& split) {
  if (split.dtype == DType::kFloat32) {
    d_logits[i] = grad;
    return;
  }
  const float scaled = grad * split.scale;
  uint16_t hi;
  uint16_t lo;
  StoreFromFloat(&hi, split.dtype, 0, scaled);
  StoreFromFloat(&lo, split.dtype, 0, scaled - LoadAsFloat(&hi, split.dtype, 0));
  split.d_hi[i] = hi;
  split.d_lo[i] = lo;
}

static __global__ void LogitGradientsKernel(LogitTile tile, const RowGradient* d_row_grads,
                                            LogitTransform transform, bool apply_transform,
                                            GradientSplit split) {
  const int64_t row = blockIdx.y;
  const RowGradient g = d_row_grads[row];
  for (int64_t c = GlobalThread(); c < tile.cols; c += GridStride()) {
    const int64_t i = row * tile.ld + c;
    float z = tile.d_logits[i];
    if (apply_transform) z = TransformLogit(z, transform);
    const bool is_label = tile.v0 + c == g.label;
    const float grad = g.entropy_scale != 0.0f ? EntropyLogitGradient(z, is_label, g, transform)
                                               : LogitGradient(z, is_label, g, transform);
    StoreGradient(grad, i, tile.d_logits, split);
  }
}

absl::Status LaunchLogitGradients(const LogitTile& tile, const RowGradient* d_row_grads,
                                  const LogitTransform& transform, bool apply_transform,
                                  const GradientSplit& split, cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  if (tile.rows > kMaxGridRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("LogitGradients: at most ", kMaxGridRows, " rows per tile, got ", tile.rows));
  }
  const dim3 grid(GridFor(tile.cols, kElementwiseThreads * kGradientColumnsPerThread),
                  static_cast<unsigned>(tile.rows));
  LogitGradientsKernel<<<grid, kElementwiseThreads, 0, stream>>>(tile, d_row_grads, transform,
                                                                 apply_transform, split);
  return CheckLaunch("LogitGradientsKernel");
}

// ---- Distillation ----

static __global__ void TransformLogitsKernel(LogitTile tile, LogitTransform transform) {
  const int64_t row = blockIdx.y;
  float* d_z = tile.d_logits + row * tile.ld;
  for (int64_t c = GlobalThread(); c < tile.cols; c += GridStride()) {
    d_z[c] = TransformLogit(d_z[c], transform);
  }
}

absl::Status LaunchTransformLogits(const LogitTile& tile, const LogitTransform& transform,
                                   cudaStream_t stream) {
  if (tile.rows == 0 || transform.identity()) return absl::OkStatus();
  if (tile.rows > kMaxGridRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("TransformLogits: at most ", kMaxGridRows, " rows per tile, got ", tile.rows));
  }
  const dim3 grid(GridFor(tile.cols, kElementwiseThreads * kGradientColumnsPerThread),
                  static_cast<unsigned>(tile.rows));
  TransformLogitsKernel<<<grid, kElementwiseThreads, 0, stream>>>(tile, transform);
  return CheckLaunch("TransformLogitsKernel");
}

// The fill, then the top-k: a block's threads write the fill before any of them scatters.
static __global__ void FillSparseTeacherKernel(LogitTile tile, int k, const int32_t* d_tokens,
                                               const float* d_logprobs,
                                               const float* d_rest_logits) {
  const int64_t row = blockIdx.x;
  float* d_z = tile.d_logits + row * tile.ld;
  const float rest = d_rest_logits[row];
  for (int64_t c = threadIdx.x; c < tile.cols; c += blockDim.x) d_z[c] = rest;
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t token = d_tokens[row * k + j];
    if (token >= tile.v0 && token < tile.v0 + tile.cols) {
      d_z[token - tile.v0] = d_logprobs[row * k + j];
    }
  }
}

absl::Status LaunchFillSparseTeacher(const LogitTile& tile, int k, const int32_t* d_tokens,
                                     const float* d_logprobs, const float* d_rest_logits,
                                     cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  FillSparseTeacherKernel<<<static_cast<unsigned>(tile.rows), kRowThreads, 0, stream>>>(
      tile, k, d_tokens, d_logprobs, d_rest_logits);
  return CheckLaunch("FillSparseTeacherKernel");
}

// LseStats of x_c = d_y[c] * scale over one row, as the CPU's TileLseStats: max and min first, then
// the sum of exp(x - max) in double; a NaN leaves the sum NaN. Reached by every thread of the
// block; the student's and the teacher's rows come through the same code.
static __device__ LseStats BlockLseStats(const float* d_y, int64_t cols, float scale,
                                         float* float_scratch, int* int_scratch,
                                         double* sum_scratch) {
  float high = -INFINITY;
  float low = INFINITY;
  int nan = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float x = d_y[c] * scale;
    high = MaxStep(high, x);
    low = MinStep(low, x);
    nan |= x != x;
  }
  high = BlockReduce(high, MaxOf{}, float_scratch);
  low = BlockReduce(low, MinOf{}, float_scratch);
  nan = BlockReduce(nan, Plus{}, int_scratch);
  double sum = 0.0;
  if (high > -INFINITY) {  // the same for every thread of the block
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += Exp(d_y[c] * scale - high);
    sum = BlockReduce(sum, Plus{}, sum_scratch);
  }
  LseStats s;
  s.max = high;
  s.sum_exp = nan != 0 ? NAN : static_cast<float>(sum);
  s.min = low;
  return s;
}

static __global__ void MergeTileDistillStatsKernel(LogitTile student, LogitTile teacher,
                                                   float inv_tau, DistillStats* d_stats) {
  __shared__ float float_scratch[kWarpSize + 1];
  __shared__ int int_scratch[kWarpSize + 1];
  __shared__ double sum_scratch[kWarpSize + 1];
  const int64_t row = blockIdx.x;
  DistillStats tile;
  tile.student = BlockLseStats(student.d_logits + row * student.ld, student.cols, inv_tau,
                               float_scratch, int_scratch, sum_scratch);
  tile.teacher = BlockLseStats(teacher.d_logits + row * teacher.ld, teacher.cols, inv_tau,
                               float_scratch, int_scratch, sum_scratch);
  if (threadIdx.x == 0) MergeDistillStats(d_stats[row], tile);
}

absl::Status LaunchMergeTileDistillStats(const LogitTile& student, const LogitTile& teacher,
                                         float inv_tau, DistillStats* d_stats,
                                         cudaStream_t stream) {
  if (student.rows == 0) return absl::OkStatus();
  MergeTileDistillStatsKernel<<<static_cast<unsigned>(student.rows), kRowThreads, 0, stream>>>(
      student, teacher, inv_tau, d_stats);
  return CheckLaunch("MergeTileDistillStatsKernel");
}

static __global__ void AddTileDistillTermsKernel(LogitTile student, LogitTile teacher,
                                                 const DistillRowConstants* d_constants,
                                                 DistillRowTerms* d_terms) {
  __shared__ double scratch[kWarpSize + 1];
  const int64_t row = blockIdx.x;
  const DistillRowConstants c = d_constants[row];
  const float* d_z = student.d_logits + row * student.ld;
  const float* d_zt = teacher.d_logits + row * teacher.ld;
  double divergence = 0.0;
  double k = 0.0;
  for (int64_t col = threadIdx.x; col < student.cols; col += blockDim.x) {
    const DistillSummands s = DistillElementTermsOf(d_z[col], d_zt[col], c);
    divergence += s.divergence;
    k += s.k;
  }
  divergence = BlockReduce(divergence, Plus{}, scratch);
  k = BlockReduce(k, Plus{}, scratch);
  if (threadIdx.x == 0) {
    d_terms[row].divergence += divergence;
    d_terms[row].k += k;
  }
}

absl::Status LaunchAddTileDistillTerms(const LogitTile& student, const LogitTile& teacher,
                                       const DistillRowConstants* d_constants,
                                       DistillRowTerms* d_terms, cudaStream_t stream) {
  if (student.rows == 0) return absl::OkStatus();
  AddTileDistillTermsKernel<<<static_cast<unsigned>(student.rows), kRowThreads, 0, stream>>>(
      student, teacher, d_constants, d_terms);
  return CheckLaunch("AddTileDistillTermsKernel");
}

static __global__ void DistillLogitGradientsKernel(LogitTile student, LogitTile teacher,
                                                   const DistillRowGradient* d_row_grads,
                                                   LogitTransform transform, GradientSplit split) {
  const int64_t row = blockIdx.y;
  const DistillRowGradient g = d_row_grads[row];
  const float* d_zt = teacher.d_logits + row * teacher.ld;
  for (int64_t c = GlobalThread(); c < student.cols; c += GridStride()) {
    const int64_t i = row * student.ld + c;
    const bool is_label = student.v0 + c == g.ce.label;
    const float grad =
        DistillLogitGradientOf(student.d_logits[i], d_zt[c], is_label, g, transform);
    StoreGradient(grad, i, student.d_logits, split);
  }
}

absl::Status LaunchDistillLogitGradients(const LogitTile& student, const LogitTile& teacher,
                                         const DistillRowGradient* d_row_grads,
                                         const LogitTransform& transform,
                                         const GradientSplit& split, cudaStream_t stream) {
  if (student.rows == 0) return absl::OkStatus();
  if (student.rows > kMaxGridRows) {
    return absl::InvalidArgumentError(absl::StrCat("DistillLogitGradients: at most ", kMaxGridRows,
                                                   " rows per tile, got ", student.rows));
  }
  const dim3 grid(GridFor(student.cols, kElementwiseThreads * kGradientColumnsPerThread),
                  static_cast<unsigned>(student.rows));
  DistillLogitGradientsKernel<<<grid, kElementwiseThreads, 0, stream>>>(
      student, teacher, d_row_grads, transform, split);
  return CheckLaunch("DistillLogitGradientsKernel");
}

// ---- Buffers and the optimizer ----

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

absl::Status CheckKernelImage() {
  cudaFuncAttributes attributes;
  return CudaStatus(cudaFuncGetAttributes(&attributes, AddFloat32Kernel), "cudaFuncGetAttributes");
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

static __global__ void OptimizerCheckKernel(bool adamw, OptimizerScalars scalars,
                                            const void* d_weight, DType weight_dtype,
                                            const float* d_grad, const float* d_state1,
                                            const float* d_state2, int64_t count,
                                            double* d_partials) {
  __shared__ double scratch[kWarpSize + 1];
  const int64_t begin = count * blockIdx.x / gridDim.x;
  const int64_t end = count * (blockIdx.x + 1) / gridDim.x;
  const bool has_state1 = d_state1 != nullptr;
  double first = HUGE_VAL;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const ElementUpdate u =
        UpdateElement(adamw, has_state1, LoadAsFloat(d_weight, weight_dtype, i), d_grad[i],
                      has_state1 ? d_state1[i] : 0.0f, adamw ? d_state2[i] : 0.0f, scalars);
    const double code = NonFiniteUpdateCode(u, i, weight_dtype, has_state1, adamw);
    if (code != 0.0 && code < first) first = code;
  }
  first = BlockReduce(first, MinCode{}, scratch);
  if (threadIdx.x == 0) d_partials[blockIdx.x] = first;
}

absl::Status LaunchOptimizerCheck(OptimizerConfig::Kind kind, const OptimizerScalars& scalars,
                                  const void* d_weight, DType weight_dtype, const float* d_grad,
                                  const float* d_state1, const float* d_state2, int64_t count,
                                  double* d_partials, cudaStream_t stream) {
  OptimizerCheckKernel<<<kSumSquaresBlocks, kElementwiseThreads, 0, stream>>>(
      kind == OptimizerConfig::Kind::kAdamW, scalars, d_weight, weight_dtype, d_grad, d_state1,
      d_state2, count, d_partials);
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

// ---- Tests only ----

// `d_nowhere` is null at run time, which the compiler cannot see here: a plain store, not a trap.
static __global__ void TestOnlyIllegalAddressKernel(float* d_nowhere) { *d_nowhere = 1.0f; }

absl::Status LaunchTestOnlyIllegalAddress(cudaStream_t stream) {
  TestOnlyIllegalAddressKernel<<<1, 1, 0, stream>>>(nullptr);
  return CheckLaunch("TestOnlyIllegalAddressKernel");
}

}  // namespace lossd::cuda
