// dL/da of a logits tile, in one read of each fp32 logit (16-byte loads) and one write: in place
// in fp32, or rounded once to the 16-bit dtype of the products (8-byte stores), or as two 16-bit
// halves with exact gradients. The target-class term is applied in fp32 before any rounding
// (loss_math.h's LogitGradient), so that p_y - 1 never cancels in 16 bits. The store, the dtype,
// the transform and the entropy bonus are template arguments, chosen once per launch.
#include "kernels/cuda/cuda_device.cuh"
#include "kernels/cuda/cuda_kernels.cuh"

namespace lossd::cuda {

template <DType kDType>
__device__ __forceinline__ uint16_t Round16(float x) {
  uint16_t bits;
  StoreFromFloat(&bits, kDType, 0, x);
  return bits;
}

// Stores the gradients of columns [i, i + n) (element i of the tile's storage, 4-aligned when
// n = 4): fp32 in place, or S dL/da in 16 bits (hi; lo as well when split).
template <GradientStore kStore, DType kDType, int kCount>
__device__ __forceinline__ void StoreGradients(const float (&grad)[kCount], int64_t i,
                                               float* d_logits, const GradientOut& out,
                                               float scale) {
  if constexpr (kStore == GradientStore::kFloat32) {
    if constexpr (kCount == 4) {
      reinterpret_cast<float4*>(d_logits + i)[0] = make_float4(grad[0], grad[1], grad[2], grad[3]);
    } else {
      d_logits[i] = grad[0];
    }
  } else {
    uint16_t hi[kCount];
    uint16_t lo[kCount];
    for (int j = 0; j < kCount; ++j) {
      const float scaled = grad[j] * scale;
      hi[j] = Round16<kDType>(scaled);
      if constexpr (kStore == GradientStore::kSplit) {
        lo[j] = Round16<kDType>(scaled - LoadAsFloat(&hi[j], kDType, 0));
      }
    }
    if constexpr (kCount == 4) {
      reinterpret_cast<ushort4*>(out.d_hi + i)[0] = make_ushort4(hi[0], hi[1], hi[2], hi[3]);
      if constexpr (kStore == GradientStore::kSplit) {
        reinterpret_cast<ushort4*>(out.d_lo + i)[0] = make_ushort4(lo[0], lo[1], lo[2], lo[3]);
      }
    } else {
      out.d_hi[i] = hi[0];
      if constexpr (kStore == GradientStore::kSplit) out.d_lo[i] = lo[0];
    }
  }
}

template <GradientStore kStore>
__device__ __forceinline__ float SplitScaleOf(const GradientOut& out) {
  if constexpr (kStore == GradientStore::kFloat32) {
    return 1.0f;
  } else {
    return *out.d_split_scale;
  }
}

// Calls fn(store, dtype) with both as compile-time constants.
template <typename Fn>
void StoreSwitch(const GradientOut& out, Fn&& fn) {
  using S = GradientStore;
  using std::integral_constant;
  if (out.store == S::kFloat32) {
    fn(integral_constant<S, S::kFloat32>{}, integral_constant<DType, DType::kFloat32>{});
  } else if (out.dtype == DType::kFloat16) {
    if (out.store == S::kSplit) {
      fn(integral_constant<S, S::kSplit>{}, integral_constant<DType, DType::kFloat16>{});
    } else {
      fn(integral_constant<S, S::kRounded>{}, integral_constant<DType, DType::kFloat16>{});
    }
  } else if (out.store == S::kSplit) {
    fn(integral_constant<S, S::kSplit>{}, integral_constant<DType, DType::kBFloat16>{});
  } else {
    fn(integral_constant<S, S::kRounded>{}, integral_constant<DType, DType::kBFloat16>{});
  }
}

// ---- Cross-entropy and the policy objectives ----

template <bool kTransform, bool kEntropy>
__device__ __forceinline__ float GradientOf(float z, bool is_label, const RowGradient& g,
                                            const LogitTransform& transform) {
  if constexpr (kTransform) z = TransformLogit(z, transform);
  if constexpr (kEntropy) {
    // Rows without the bonus (ignored ones) take the plain form, bit for bit.
    if (g.entropy_scale != 0.0f) return EntropyLogitGradient(z, is_label, g, transform);
  }
  return LogitGradient(z, is_label, g, transform);
}

template <GradientStore kStore, DType kDType, bool kTransform, bool kEntropy>
static __global__ void LogitGradientsKernel(LogitTile tile, const RowGradient* d_row_grads,
                                            LogitTransform transform, GradientOut out) {
  const int64_t row = blockIdx.y;
  const RowGradient g = d_row_grads[row];
  const float scale = SplitScaleOf<kStore>(out);
  const float* d_z = tile.d_logits + row * tile.ld;
  const int64_t offset = row * tile.ld;
  const int64_t label_column = g.label - tile.v0;  // outside [0, cols) when not in the tile
  const int64_t quads = tile.cols / 4;
  for (int64_t q = GlobalThread(); q < quads; q += GridStride()) {
    float z[4];
    Load4(d_z, q, z);
    float grad[4];
    for (int j = 0; j < 4; ++j) {
      grad[j] = GradientOf<kTransform, kEntropy>(z[j], 4 * q + j == label_column, g, transform);
    }
    StoreGradients<kStore, kDType, 4>(grad, offset + 4 * q, tile.d_logits, out, scale);
  }
  for (int64_t c = 4 * quads + GlobalThread(); c < tile.cols; c += GridStride()) {
    const float grad[1] = {
        GradientOf<kTransform, kEntropy>(d_z[c], c == label_column, g, transform)};
    StoreGradients<kStore, kDType, 1>(grad, offset + c, tile.d_logits, out, scale);
  }
}

absl::Status LaunchLogitGradients(const LogitTile& tile, const RowGradient* d_row_grads,
                                  const LogitTransform& transform, bool apply_transform,
                                  bool entropy, const GradientOut& out, cudaStream_t stream) {
  if (tile.rows == 0) return absl::OkStatus();
  dim3 grid;
  RETURN_IF_ERROR(RowGrid("LogitGradients", tile.rows, tile.cols, grid));
  StoreSwitch(out, [&](auto store, auto dtype) {
    BoolSwitch(apply_transform && !transform.identity(), [&](auto transformed) {
      BoolSwitch(entropy, [&](auto with_entropy) {
        LogitGradientsKernel<decltype(store)::value, decltype(dtype)::value,
                             decltype(transformed)::value, decltype(with_entropy)::value>
            <<<grid, kElementwiseThreads, 0, stream>>>(tile, d_row_grads, transform, out);
      });
    });
  });
  return CheckLaunch("LogitGradientsKernel");
}

// ---- Distillation ----

template <GradientStore kStore, DType kDType, DivergenceKind kKind, bool kTailBucket>
static __global__ void DistillLogitGradientsKernel(LogitTile student, LogitTile teacher,
                                                   const DistillRowGradient* d_row_grads,
                                                   LogitTransform transform, GradientOut out) {
  const int64_t row = blockIdx.y;
  const DistillRowGradient g = d_row_grads[row];
  const float scale = SplitScaleOf<kStore>(out);
  const float* d_z = student.d_logits + row * student.ld;
  const float* d_zt = teacher.d_logits + row * teacher.ld;
  const int64_t offset = row * student.ld;
  const int64_t label_column = g.ce.label - student.v0;
  const int64_t quads = student.cols / 4;
  for (int64_t q = GlobalThread(); q < quads; q += GridStride()) {
    float z[4];
    float zt[4];
    Load4(d_z, q, z);
    Load4(d_zt, q, zt);
    float grad[4];
    for (int j = 0; j < 4; ++j) {
      grad[j] = DistillLogitGradient<kKind, kTailBucket>(z[j], zt[j], 4 * q + j == label_column, g,
                                                         transform);
    }
    StoreGradients<kStore, kDType, 4>(grad, offset + 4 * q, student.d_logits, out, scale);
  }
  for (int64_t c = 4 * quads + GlobalThread(); c < student.cols; c += GridStride()) {
    const float grad[1] = {
        DistillLogitGradient<kKind, kTailBucket>(d_z[c], d_zt[c], c == label_column, g, transform)};
    StoreGradients<kStore, kDType, 1>(grad, offset + c, student.d_logits, out, scale);
  }
}

absl::Status LaunchDistillLogitGradients(const LogitTile& student, const LogitTile& teacher,
                                         const DistillRowGradient* d_row_grads, DivergenceKind kind,
                                         bool tail_bucket, const LogitTransform& transform,
                                         const GradientOut& out, cudaStream_t stream) {
  if (student.rows == 0) return absl::OkStatus();
  dim3 grid;
  RETURN_IF_ERROR(RowGrid("DistillLogitGradients", student.rows, student.cols, grid));
  StoreSwitch(out, [&](auto store, auto dtype) {
    constexpr GradientStore kStore = decltype(store)::value;
    constexpr DType kDType = decltype(dtype)::value;
    BoolSwitch(tail_bucket, [&](auto tail) {
      constexpr bool kTail = decltype(tail)::value;
      switch (kind) {
        case DivergenceKind::kForwardKl:
          DistillLogitGradientsKernel<kStore, kDType, DivergenceKind::kForwardKl, kTail>
              <<<grid, kElementwiseThreads, 0, stream>>>(student, teacher, d_row_grads, transform,
                                                         out);
          break;
        case DivergenceKind::kReverseKl:
          DistillLogitGradientsKernel<kStore, kDType, DivergenceKind::kReverseKl, kTail>
              <<<grid, kElementwiseThreads, 0, stream>>>(student, teacher, d_row_grads, transform,
                                                         out);
          break;
        default:
          DistillLogitGradientsKernel<kStore, kDType, DivergenceKind::kJsd, kTail>
              <<<grid, kElementwiseThreads, 0, stream>>>(student, teacher, d_row_grads, transform,
                                                         out);
          break;
      }
    });
  });
  return CheckLaunch("DistillLogitGradientsKernel");
}

}  // namespace lossd::cuda
