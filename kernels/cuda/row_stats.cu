// Row statistics of a logits tile in one read of each logit: the soft cap and temperature applied
// in place where the tile holds raw logits, the online softmax's running max and sum-exp (and the
// shifted sum the entropy needs, and sum z for label smoothing), and, when asked, the top-k, all
// from the same load. Sums run in double per thread and in a fixed order across the block, so
// identical calls give identical bits and the rounding does not grow with V.
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"

namespace lossd::cuda {

constexpr int kTopKWarps = kRowThreads / kWarpSize;

static_assert(kMaxTopK <= 2 * kWarpSize, "a warp's top-k list holds two entries per lane");

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

// ---- The online statistics of one thread's columns, and their merge ----

// A thread's share of a row: m = max z, s = sum e^(z - m), t = sum e^(z - m)(z - m), sum z, and
// the first column holding m (-1 before the first non-NaN column; a NaN then goes into s).
struct PartialStats {
  float max;
  int32_t argmax;
  double sum_exp;
  double sum_shifted;
  double sum_z;
};

__device__ __forceinline__ PartialStats EmptyPartialStats() {
  return {-INFINITY, -1, 0.0, 0.0, 0.0};
}

// Adds column c's z; columns come in increasing order, so the first maximum is kept. A new
// maximum moves the sums to it as MergeRowStats does: t' = (t + (m - m') s) e^(m - m'),
// s' = s e^(m - m').
__device__ __forceinline__ void AddColumn(PartialStats& p, float z, int32_t c) {
  p.sum_z += z;
  if (z > p.max || (p.argmax < 0 && z == p.max)) {
    if (p.argmax >= 0) {
      const float d = p.max - z;
      const float scale = Exp(d);
      p.sum_shifted = (p.sum_shifted + static_cast<double>(d) * p.sum_exp) * scale;
      p.sum_exp *= scale;
    }
    p.max = z;
    p.argmax = c;
  }
  if (p.argmax >= 0) {
    const float d = z - p.max;
    const float e = Exp(d);
    p.sum_exp += e;
    p.sum_shifted += e * d;
  } else {
    p.sum_exp += z;  // a NaN before any number: the sums carry it
  }
}

// The statistics of two disjoint column sets; the lower column wins a tie for the maximum.
struct CombinePartialStats {
  __device__ PartialStats operator()(const PartialStats& a, const PartialStats& b) const {
    PartialStats r;
    r.sum_z = a.sum_z + b.sum_z;
    if (a.argmax < 0 || b.argmax < 0) {  // one side holds no column, or only NaN ones
      const bool keep_b = a.argmax < 0;
      r.max = keep_b ? b.max : a.max;
      r.argmax = keep_b ? b.argmax : a.argmax;
      r.sum_exp = a.sum_exp + b.sum_exp;
      r.sum_shifted = a.sum_shifted + b.sum_shifted;
      return r;
    }
    const float m = a.max > b.max ? a.max : b.max;
    const float da = a.max - m;
    const float db = b.max - m;
    const double ca = Exp(da);
    const double cb = Exp(db);
    r.sum_shifted = (a.sum_shifted + da * a.sum_exp) * ca + (b.sum_shifted + db * b.sum_exp) * cb;
    r.sum_exp = a.sum_exp * ca + b.sum_exp * cb;
    r.max = m;
    r.argmax = (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) ? b.argmax : a.argmax;
    return r;
  }
};

__device__ __forceinline__ PartialStats ShuffleDown(const PartialStats& x, int offset) {
  PartialStats r;
  r.max = __shfl_down_sync(kFullMask, x.max, offset);
  r.argmax = __shfl_down_sync(kFullMask, x.argmax, offset);
  r.sum_exp = __shfl_down_sync(kFullMask, x.sum_exp, offset);
  r.sum_shifted = __shfl_down_sync(kFullMask, x.sum_shifted, offset);
  r.sum_z = __shfl_down_sync(kFullMask, x.sum_z, offset);
  return r;
}

// ---- Top-k ----

// (value, token) ranks before (other_value, other_token): larger value, then lower token. A strict
// total order on distinct tokens, so the k best are one set whatever order candidates arrive in.
__device__ __forceinline__ bool Outranks(float value, int32_t token, float other_value,
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

__device__ void ReadEntry(const WarpTopK& list, int index, float& value, int32_t& token) {
  const bool first = index < kWarpSize;
  value = __shfl_sync(kFullMask, first ? list.value0 : list.value1, index % kWarpSize);
  token = __shfl_sync(kFullMask, first ? list.token0 : list.token1, index % kWarpSize);
}

__device__ void PlaceEntry(int index, int position, float value, int32_t token,
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
__device__ void InsertEntry(WarpTopK& list, int k, float value, int32_t token) {
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

// Offers the warp's 32 candidates (one per lane, `offered` where it is one) to its list, inserting
// only those that beat the current k-th entry, best candidates first.
__device__ __forceinline__ void OfferCandidates(WarpTopK& list, int k, bool offered, float value,
                                                int32_t token, float& kth_value,
                                                int32_t& kth_token) {
  const int lane = threadIdx.x % kWarpSize;
  bool pending = offered && Outranks(value, token, kth_value, kth_token);
  for (unsigned mask; (mask = __ballot_sync(kFullMask, pending)) != 0;) {
    const int source = __ffs(mask) - 1;
    InsertEntry(list, k, __shfl_sync(kFullMask, value, source),
                __shfl_sync(kFullMask, token, source));
    ReadEntry(list, k - 1, kth_value, kth_token);
    pending = pending && lane != source && Outranks(value, token, kth_value, kth_token);
  }
}

// ---- The kernel ----

// One block per row. Warp w reads columns w * 32 + lane, then on by the block's width: each warp
// reads 32 consecutive floats at a time (coalesced), and its lanes' candidates for the top-k come
// together in one ballot.
template <bool kTransform, bool kTopK>
static __global__ void __launch_bounds__(kRowThreads)
    RowStatsKernel(LogitTile tile, const int64_t* d_labels, LogitTransform transform, int k,
                   RowStats* d_stats, float* d_top_values, int32_t* d_top_tokens) {
  __shared__ PartialStats stats_scratch[kWarpSize + 1];
  __shared__ float warp_values[kTopK ? kTopKWarps : 1][kMaxTopK];
  __shared__ int32_t warp_tokens[kTopK ? kTopKWarps : 1][kMaxTopK];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row = blockIdx.x;
  float* d_z = tile.d_logits + row * tile.ld;

  PartialStats partial = EmptyPartialStats();
  WarpTopK list{-INFINITY, -INFINITY, 0, 0};
  float kth_value = -INFINITY;
  int32_t kth_token = 0;
  if constexpr (kTopK) ReadEntry(list, k - 1, kth_value, kth_token);
  for (int64_t base = static_cast<int64_t>(warp) * kWarpSize; base < tile.cols;
       base += blockDim.x) {
    const int64_t c = base + lane;
    const bool valid = c < tile.cols;
    float z = -INFINITY;
    if (valid) {
      z = d_z[c];
      if constexpr (kTransform) {
        z = TransformLogit(z, transform);
        d_z[c] = z;
      }
      AddColumn(partial, z, static_cast<int32_t>(c));
    }
    if constexpr (kTopK) {
      OfferCandidates(list, k, valid, z, static_cast<int32_t>(tile.v0 + c), kth_value, kth_token);
    }
  }
  partial = BlockReduce(partial, CombinePartialStats{}, stats_scratch);

  if (threadIdx.x == 0) {
    RowStats stats = EmptyRowStats();
    stats.sum_z = static_cast<float>(partial.sum_z);
    // Written by another thread when transformed; the reduction's barriers made it visible.
    const int64_t label = d_labels[row];
    if (label >= tile.v0 && label < tile.v0 + tile.cols) stats.target = d_z[label - tile.v0];
    if (partial.argmax >= 0) {  // else a NaN row: sum_z carries the NaN
      stats.max = partial.max;
      stats.sum_exp = static_cast<float>(partial.sum_exp);
      stats.sum_exp_shifted = static_cast<float>(partial.sum_shifted);
      stats.argmax = static_cast<int32_t>(tile.v0 + partial.argmax);
    }
    MergeRowStats(d_stats[row], stats);
  }
  if constexpr (!kTopK) return;

  // Warp 0 merges the running list with every warp's list.
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

absl::Status LaunchRowStats(const LogitTile& tile, const int64_t* d_labels,
                            const LogitTransform& transform, bool apply_transform, int top_k,
                            RowStats* d_stats, float* d_top_values, int32_t* d_top_tokens,
                            cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  if (top_k < 0 || top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("RowStats: top_k ", top_k, " outside [0, ", kMaxTopK, "]"));
  }
  const unsigned grid = static_cast<unsigned>(tile.rows);
  BoolSwitch(apply_transform && !transform.identity(), [&](auto transformed) {
    BoolSwitch(top_k > 0, [&](auto with_top_k) {
      RowStatsKernel<decltype(transformed)::value, decltype(with_top_k)::value>
          <<<grid, kRowThreads, 0, stream>>>(tile, d_labels, transform, top_k, d_stats,
                                             d_top_values, d_top_tokens);
    });
  });
  return CheckLaunch("RowStatsKernel");
}

}  // namespace lossd::cuda
