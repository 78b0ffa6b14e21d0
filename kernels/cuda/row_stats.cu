// Row statistics of a logits tile in one read of each logit: the soft cap and temperature applied
// in place where the tile holds raw logits, the online softmax's running max and sum-exp (and the
// shifted sum the entropy needs, and sum z for label smoothing), and, when asked, the top-k and a
// distill call's statistics of both distributions, all from the same load. Sums run in double per
// thread and in a fixed order across the block, so identical calls give identical bits and the
// rounding does not grow with V.
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"
#include "lossd/kernels/online_stats.h"

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

// ---- The online statistics of one thread's columns, and their merge (online_stats.h) ----

struct CombinePartialStats {
  __device__ PartialRowStats operator()(const PartialRowStats& a, const PartialRowStats& b) const {
    return CombinePartialRowStats(a, b);
  }
};

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

struct CombineLse {
  __device__ PartialLse operator()(const PartialLse& a, const PartialLse& b) const {
    return CombinePartialLse(a, b);
  }
};

// A distill call's tiles beside the student's: the teacher's, and where both distributions'
// statistics at tau go.
struct DistillTiles {
  LogitTile teacher;
  float inv_tau;
  bool tail_bucket;  // also u's statistics over the columns where z_t is -inf
  DistillStats* d_stats;
};

// One block per row. Warp w reads quads (4 columns, one 16-byte load) w * 32 + lane, then on by
// the block's width: a warp reads 512 consecutive bytes at a time, and its lanes' candidates for
// the top-k come together in ballots; the last cols % 4 columns are warp 0's, after its quads, so
// that each thread still meets its columns in increasing order. A distill call's tiles
// (transformed already) also give both distributions' LseStats at tau from the same loads of the
// student's logits.
template <bool kTransform, bool kTopK, bool kDistill>
static __global__ void __launch_bounds__(kRowThreads)
    RowStatsKernel(LogitTile tile, const int64_t* d_labels, LogitTransform transform, int k,
                   RowStats* d_stats, float* d_top_values, int32_t* d_top_tokens,
                   DistillTiles distill) {
  __shared__ PartialRowStats stats_scratch[kWarpSize + 1];
  __shared__ PartialLse lse_scratch[kDistill ? kWarpSize + 1 : 1];
  __shared__ float warp_values[kTopK ? kTopKWarps : 1][kMaxTopK];
  __shared__ int32_t warp_tokens[kTopK ? kTopKWarps : 1][kMaxTopK];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row = blockIdx.x;
  float* d_z = tile.d_logits + row * tile.ld;

  PartialRowStats partial = EmptyPartialRowStats();
  PartialLse student = EmptyPartialLse();
  PartialLse teacher = EmptyPartialLse();
  PartialLse student_tail = EmptyPartialLse();
  const float* d_zt = kDistill ? distill.teacher.d_logits + row * distill.teacher.ld : nullptr;
  WarpTopK list{-INFINITY, -INFINITY, 0, 0};
  float kth_value = -INFINITY;
  int32_t kth_token = 0;
  if constexpr (kTopK) ReadEntry(list, k - 1, kth_value, kth_token);
  // Column c's statistics; its top-k offer is the caller's, made by the whole warp.
  const auto add = [&](float& z, float zt, int64_t c) {
    if constexpr (kTransform) z = TransformLogit(z, transform);
    AddColumn(partial, z, static_cast<int32_t>(c));
    if constexpr (kDistill) {
      AddValue(student, RoundedProduct(z, distill.inv_tau));
      AddValue(teacher, RoundedProduct(zt, distill.inv_tau));
      if (distill.tail_bucket) {
        AddValue(student_tail, zt == -INFINITY ? RoundedProduct(z, distill.inv_tau) : -INFINITY);
      }
    }
  };
  const int64_t quads = tile.cols / 4;
  for (int64_t base = static_cast<int64_t>(warp) * kWarpSize; base < quads; base += blockDim.x) {
    const int64_t q = base + lane;
    const bool valid = q < quads;
    float z[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    if (valid) {
      float zt[4] = {};
      Load4(d_z, q, z);
      if constexpr (kDistill) Load4(d_zt, q, zt);
      for (int j = 0; j < 4; ++j) add(z[j], zt[j], 4 * q + j);
      if constexpr (kTransform) Store4(d_z, q, z);
    }
    if constexpr (kTopK) {
      for (int j = 0; j < 4; ++j) {
        OfferCandidates(list, k, valid, z[j], static_cast<int32_t>(tile.v0 + 4 * q + j), kth_value,
                        kth_token);
      }
    }
  }
  if (warp == 0) {
    const int64_t c = 4 * quads + lane;
    const bool valid = c < tile.cols;
    float z = -INFINITY;
    if (valid) {
      z = d_z[c];
      add(z, kDistill ? d_zt[c] : 0.0f, c);
      if constexpr (kTransform) d_z[c] = z;
    }
    if constexpr (kTopK) {
      OfferCandidates(list, k, valid, z, static_cast<int32_t>(tile.v0 + c), kth_value, kth_token);
    }
  }
  partial = BlockReduce(partial, CombinePartialStats{}, stats_scratch);
  if constexpr (kDistill) {
    DistillStats tile_stats = EmptyDistillStats();
    tile_stats.student = LseStatsOf(BlockReduce(student, CombineLse{}, lse_scratch));
    tile_stats.teacher = LseStatsOf(BlockReduce(teacher, CombineLse{}, lse_scratch));
    if (distill.tail_bucket) {  // uniform over the block
      tile_stats.student_tail = LseStatsOf(BlockReduce(student_tail, CombineLse{}, lse_scratch));
    }
    if (threadIdx.x == 0) MergeDistillStats(distill.d_stats[row], tile_stats);
  }

  if (threadIdx.x == 0) {
    // The label's logit, written by another thread when transformed; the reduction's barriers
    // made it visible.
    const int64_t label = d_labels[row];
    const bool in_tile = label >= tile.v0 && label < tile.v0 + tile.cols;
    MergeRowStats(d_stats[row],
                  TileRowStats(partial, in_tile ? d_z[label - tile.v0] : 0.0f, tile.v0));
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

// Launches RowStatsKernel with its options as template arguments.
static absl::Status LaunchRowStatsKernel(const LogitTile& tile, const int64_t* d_labels,
                                         const LogitTransform& transform, bool apply_transform,
                                         int top_k, RowStats* d_stats, float* d_top_values,
                                         int32_t* d_top_tokens, const DistillTiles* distill,
                                         cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  if (top_k < 0 || top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("RowStats: top_k ", top_k, " outside [0, ", kMaxTopK, "]"));
  }
  const unsigned grid = static_cast<unsigned>(tile.rows);
  const DistillTiles tiles = distill != nullptr ? *distill : DistillTiles{};
  BoolSwitch(apply_transform && !transform.identity(), [&](auto transformed) {
    BoolSwitch(top_k > 0, [&](auto with_top_k) {
      BoolSwitch(distill != nullptr, [&](auto with_distill) {
        RowStatsKernel<decltype(transformed)::value, decltype(with_top_k)::value,
                       decltype(with_distill)::value><<<grid, kRowThreads, 0, stream>>>(
            tile, d_labels, transform, top_k, d_stats, d_top_values, d_top_tokens, tiles);
      });
    });
  });
  return CheckLaunch("RowStatsKernel");
}

absl::Status LaunchRowStats(const LogitTile& tile, const int64_t* d_labels,
                            const LogitTransform& transform, bool apply_transform, int top_k,
                            RowStats* d_stats, float* d_top_values, int32_t* d_top_tokens,
                            cudaStream_t stream) {
  return LaunchRowStatsKernel(tile, d_labels, transform, apply_transform, top_k, d_stats,
                              d_top_values, d_top_tokens, nullptr, stream);
}

absl::Status LaunchDistillRowStats(const LogitTile& student, const LogitTile& teacher,
                                   const int64_t* d_labels, float inv_tau, bool tail_bucket,
                                   int top_k, RowStats* d_stats, float* d_top_values,
                                   int32_t* d_top_tokens, DistillStats* d_distill_stats,
                                   cudaStream_t stream) {
  const DistillTiles distill{teacher, inv_tau, tail_bucket, d_distill_stats};
  return LaunchRowStatsKernel(student, d_labels, LogitTransform{}, false, top_k, d_stats,
                              d_top_values, d_top_tokens, &distill, stream);
}

}  // namespace lossd::cuda
