// The CUDA backend: cuBLAS for the products, own kernels (cuda_kernels.cu) for everything else,
// with the CPU backend's semantics. Per token chunk: the rows go to the device, pass 1 computes
// every vocabulary tile's logits and merges their statistics, the host finishes the rows exactly as
// the CPU backend does, then pass 2 turns each tile into dL/da (recomputing its logits when the
// vocabulary is tiled) and accumulates dL/dh and dL/dW.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_status.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/optimizer_math.h"
#include "lossd/common/status_macros.h"

namespace lossd::cuda {
namespace {

constexpr TileLimits kCudaTileLimits = {
    /*max_token_chunk=*/16384,
    /*min_single_pass_rows=*/256,
    /*two_pass_token_chunk=*/4096,
    /*min_vocab_chunk=*/1024,
    /*vocab_chunk_multiple=*/256,
    /*token_chunk_multiple=*/128,
    /*forward_token_chunk=*/0,
};

// Rows of W converted to fp32 at a time when the products run in fp32 but W is stored in 16 bits.
constexpr int64_t kWeightSlabRows = 4096;
// Logit tiles' rows start on 64-byte boundaries (16 fp32), as cuBLAS's tensor-core kernels prefer.
constexpr int64_t kLeadingDimensionMultiple = 16;
// The split scale S keeps |S dL/da| below 2^kSplitMaxExponent, under fp16's largest value (~2^16).
constexpr int kSplitMaxExponent = 14;

// Both GEMM operands in one dtype: the shared one when hidden and W agree (tensor cores for
// 16-bit), else fp32 with the 16-bit side converted.
DType ProductDType(DType hidden_dtype, DType weight_dtype) {
  return hidden_dtype == weight_dtype ? hidden_dtype : DType::kFloat32;
}
DType ProductDType(const ProblemShape& s) { return ProductDType(s.hidden_dtype, s.weight_dtype); }
DType TeacherProductDType(const ProblemShape& s) {
  return ProductDType(s.teacher.hidden_dtype, s.teacher.weight_dtype);
}

// Elements of the fp32 slab of a head whose products run in fp32 from a 16-bit W; else 0.
int64_t SlabFloats(DType weight_dtype, DType product, int64_t cols, int64_t h) {
  return weight_dtype != product ? std::min(cols, kWeightSlabRows) * h : 0;
}

int64_t LeadingDimension(int64_t cols) {
  return (cols + kLeadingDimensionMultiple - 1) / kLeadingDimensionMultiple *
         kLeadingDimensionMultiple;
}

// The workspace of one call, carved from the caller's buffer; d_* are device addresses.
struct CudaWorkspace {
  void* d_hidden;             // [Nc, H] the chunk as sent, in hidden_dtype
  float* d_hidden32;          // [Nc, H] when the products run in fp32 but hidden is 16-bit
  float* d_weight32;          // [slab, H] when the products run in fp32 but W is 16-bit
  int64_t* d_labels;          // [Nc]
  float* d_logits;            // [Nc, ld]: a, then z, then dL/da (fp32 products)
  uint16_t* d_grad_hi;        // [Nc, ld] 16-bit products: S dL/da = hi + lo
  uint16_t* d_grad_lo;        // [Nc, ld]
  float* d_grad_hidden32;     // [Nc, H]
  uint16_t* d_grad_hidden16;  // [Nc, H] when dL/dh is wanted in 16 bits
  RowStats* d_stats;          // [Nc]
  RowGradient* d_row_grads;   // [Nc]
  float* d_top_values;        // [Nc, k], best first
  int32_t* d_top_tokens;      // [Nc, k]
  // A distill call's: the teacher's rows (dense) or top-k (sparse), its logits tile, and the
  // rows' distill state (distill_math.h).
  void* d_teacher_hidden;               // [Nc, H_t] as sent
  float* d_teacher_hidden32;            // [Nc, H_t] when its products run in fp32
  int32_t* d_teacher_tokens;            // [Nc, k_t]
  float* d_teacher_logprobs;            // [Nc, k_t]
  float* d_rest_logits;                 // [Nc]
  float* d_teacher_logits;              // [Nc, ld]
  DistillStats* d_distill_stats;        // [Nc]
  DistillRowConstants* d_constants;     // [Nc]
  DistillRowTerms* d_terms;             // [Nc]
  DistillRowGradient* d_distill_grads;  // [Nc]
};

CudaWorkspace CarveWorkspace(WorkspaceArena& arena, const ProblemShape& s, int64_t rows,
                             int64_t cols) {
  CudaWorkspace w{};
  const int64_t h = s.hidden_size;
  const DType product = ProductDType(s);
  const bool gradients = WantsGradients(s);
  const TeacherShape& t = s.teacher;
  const bool distill = t.kind != TeacherKind::kNone;
  const bool dense_teacher = t.kind == TeacherKind::kDense;
  w.d_hidden = arena.Take<char>(rows * h * static_cast<int64_t>(DTypeSize(s.hidden_dtype)));
  if (s.hidden_dtype != product) w.d_hidden32 = arena.Take<float>(rows * h);
  const int64_t slab =
      std::max(SlabFloats(s.weight_dtype, product, cols, h),
               dense_teacher ? SlabFloats(t.weight_dtype, TeacherProductDType(s), cols,
                                          t.hidden_size)
                             : 0);
  if (slab > 0) w.d_weight32 = arena.Take<float>(slab);
  w.d_labels = arena.Take<int64_t>(rows);
  w.d_logits = arena.Take<float>(rows * LeadingDimension(cols));
  if (gradients && product != DType::kFloat32) {
    w.d_grad_hi = arena.Take<uint16_t>(rows * LeadingDimension(cols));
    w.d_grad_lo = arena.Take<uint16_t>(rows * LeadingDimension(cols));
  }
  if (s.grad_hidden) {
    w.d_grad_hidden32 = arena.Take<float>(rows * h);
    if (s.grad_hidden_dtype != DType::kFloat32) w.d_grad_hidden16 = arena.Take<uint16_t>(rows * h);
  }
  w.d_stats = arena.Take<RowStats>(rows);
  if (gradients && !distill) w.d_row_grads = arena.Take<RowGradient>(rows);
  if (s.top_k > 0) {
    w.d_top_values = arena.Take<float>(rows * s.top_k);
    w.d_top_tokens = arena.Take<int32_t>(rows * s.top_k);
  }
  if (!distill) return w;
  if (dense_teacher) {
    w.d_teacher_hidden = arena.Take<char>(rows * t.hidden_size *
                                          static_cast<int64_t>(DTypeSize(t.hidden_dtype)));
    if (t.hidden_dtype != TeacherProductDType(s)) {
      w.d_teacher_hidden32 = arena.Take<float>(rows * t.hidden_size);
    }
  } else {
    w.d_teacher_tokens = arena.Take<int32_t>(rows * t.top_k);
    w.d_teacher_logprobs = arena.Take<float>(rows * t.top_k);
    w.d_rest_logits = arena.Take<float>(rows);
  }
  w.d_teacher_logits = arena.Take<float>(rows * LeadingDimension(cols));
  w.d_distill_stats = arena.Take<DistillStats>(rows);
  w.d_constants = arena.Take<DistillRowConstants>(rows);
  w.d_terms = arena.Take<DistillRowTerms>(rows);
  if (gradients) w.d_distill_grads = arena.Take<DistillRowGradient>(rows);
  return w;
}

// ---- Streams ----

// A stream with its own cuBLAS handle and scratch. One call holds one at a time, so handles are
// never shared between threads and each handle has one stream and one workspace, which keeps
// cuBLAS's choice of kernels, and so its results, the same from call to call. The scratch is the
// backend's fixed overhead (like OpenBLAS's buffers on the CPU), allocated once per stream and
// not part of any call's workspace budget; with it cuBLAS allocates nothing during a call, and
// neither does SumSquaresFloat32 (a cudaFree would wait for every stream of the device).
struct StreamContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* d_cublas_workspace = nullptr;
  double* d_sum_squares_partials = nullptr;  // [kSumSquaresBlocks]
};

class StreamPool {
 public:
  explicit StreamPool(size_t cublas_workspace_bytes) : cublas_workspace_bytes_(cublas_workspace_bytes) {}
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;
  ~StreamPool() {
    for (const StreamContext& context : idle_) Destroy(context);
  }

  // An idle context, or a new one on the current device.
  absl::StatusOr<StreamContext> Acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        const StreamContext context = idle_.back();
        idle_.pop_back();
        return context;
      }
    }
    StreamContext context;
    RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&context.stream, cudaStreamNonBlocking),
                               "cudaStreamCreateWithFlags"));
    absl::Status status = CublasStatus(cublasCreate(&context.cublas), "cublasCreate");
    if (status.ok()) {
      status = CublasStatus(cublasSetStream(context.cublas, context.stream), "cublasSetStream");
    }
    if (status.ok()) {
      status = CudaStatus(cudaMalloc(&context.d_cublas_workspace, cublas_workspace_bytes_),
                          "cudaMalloc (cuBLAS workspace)");
    }
    if (status.ok()) {
      status = CublasStatus(cublasSetWorkspace(context.cublas, context.d_cublas_workspace,
                                               cublas_workspace_bytes_),
                            "cublasSetWorkspace");
    }
    if (status.ok()) {
      status = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&context.d_sum_squares_partials),
                                     kSumSquaresBlocks * sizeof(double)),
                          "cudaMalloc (sum of squares partials)");
    }
    if (!status.ok()) {
      Destroy(context);
      return status;
    }
    return context;
  }

  void Release(const StreamContext& context) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(context);
  }

 private:
  static void Destroy(const StreamContext& context) {
    if (context.cublas != nullptr) cublasDestroy(context.cublas);
    if (context.d_cublas_workspace != nullptr) cudaFree(context.d_cublas_workspace);
    if (context.d_sum_squares_partials != nullptr) cudaFree(context.d_sum_squares_partials);
    if (context.stream != nullptr) cudaStreamDestroy(context.stream);
  }

  const size_t cublas_workspace_bytes_;
  std::mutex mutex_;
  std::vector<StreamContext> idle_;
};

// ---- One Compute call ----

// Per token chunk: LoadChunk, RowStatistics (phase 1), for distill RowConstants and RowTerms
// (phase 2), FinishRows on the host, and with gradients Gradients (phase 3). A distill call keeps
// the teacher's logits tile beside the student's; both tiles hold transformed logits from the
// moment they are computed.
class ChunkedCompute {
 public:
  ChunkedCompute(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
                 const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
                 const CudaWorkspace& ws, const StreamContext& context)
      : in_(in),
        weight_(weight),
        options_(options),
        out_(out),
        shape_(call.shape),
        ws_(ws),
        stream_(context.stream),
        cublas_(context.cublas),
        d_grad_weight_(grad_weight != nullptr ? static_cast<float*>(grad_weight->data()) : nullptr),
        h_(weight.hidden_size),
        v_(weight.vocab_size),
        chunk_rows_(call.plan.token_chunk),
        tile_cols_(call.plan.vocab_chunk),
        ld_(LeadingDimension(call.plan.vocab_chunk)),
        k_(out.top_k),
        product_dtype_(ProductDType(call.shape)),
        teacher_product_dtype_(TeacherProductDType(call.shape)),
        gradients_(WantsGradients(call.shape)),
        distill_(options.objective == Objective::kDistill),
        finisher_(in, weight.vocab_size, options, out),
        transform_(finisher_.transform()),
        teacher_transform_(MakeTeacherTransform(options)),
        stats_(chunk_rows_),
        results_(chunk_rows_),
        row_grads_(chunk_rows_),
        row_bounds_(chunk_rows_),
        top_values_(chunk_rows_ * k_),
        top_tokens_(chunk_rows_ * k_),
        distill_stats_(distill_ ? chunk_rows_ : 0),
        constants_(distill_ ? chunk_rows_ : 0),
        terms_(distill_ ? chunk_rows_ : 0),
        distill_results_(distill_ ? chunk_rows_ : 0),
        distill_grads_(distill_ ? chunk_rows_ : 0),
        rest_logits_(in.teacher.sparse() ? chunk_rows_ : 0) {}

  absl::Status Run(BatchSummary& summary) {
    for (int64_t r0 = 0; r0 < in_.num_tokens; r0 += chunk_rows_) {
      const int64_t rows = std::min(chunk_rows_, in_.num_tokens - r0);
      RETURN_IF_ERROR(LoadChunk(r0, rows));
      RETURN_IF_ERROR(RowStatistics(rows));
      if (distill_) {
        RETURN_IF_ERROR(RowConstants(rows));
        RETURN_IF_ERROR(RowTerms(rows));
      }
      RETURN_IF_ERROR(FinishRows(r0, rows, summary));
      if (gradients_) RETURN_IF_ERROR(Gradients(r0, rows));
    }
    finisher_.Close(summary);
    return absl::OkStatus();
  }

 private:
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, kind, stream_), "cudaMemcpyAsync");
  }

  // Rows [r0, r0 + rows) of a host [N, h] matrix on the device in `product` dtype: copied as sent
  // to `d_rows`, converted to fp32 into `d_rows32` where the product needs it.
  absl::StatusOr<Matrix> LoadRows(const void* host, DType dtype, int64_t h, int64_t r0,
                                  int64_t rows, DType product, void* d_rows, float* d_rows32) {
    const size_t row_bytes = DTypeSize(dtype) * static_cast<size_t>(h);
    RETURN_IF_ERROR(Copy(d_rows, static_cast<const char*>(host) + r0 * row_bytes, rows * row_bytes,
                         cudaMemcpyHostToDevice));
    if (dtype == product) return Matrix{d_rows, dtype, h};
    RETURN_IF_ERROR(LaunchConvertToFloat(d_rows, dtype, rows * h, d_rows32, stream_));
    return Matrix{d_rows32, DType::kFloat32, h};
  }

  // The chunk's hidden rows and labels on the device, hidden in the product dtype; a distill
  // call's teacher rows, or its sparse top-k with each row's logit outside it.
  absl::Status LoadChunk(int64_t r0, int64_t rows) {
    ASSIGN_OR_RETURN(hidden_, LoadRows(in_.hidden, in_.hidden_dtype, h_, r0, rows, product_dtype_,
                                       ws_.d_hidden, ws_.d_hidden32));
    if (in_.labels != nullptr) {
      RETURN_IF_ERROR(
          Copy(ws_.d_labels, in_.labels + r0, rows * sizeof(int64_t), cudaMemcpyHostToDevice));
    } else {  // no label: -1, which no column matches
      RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(ws_.d_labels, 0xff, rows * sizeof(int64_t), stream_), "cudaMemsetAsync"));
    }
    const TeacherInputs& t = in_.teacher;
    if (t.dense()) {
      ASSIGN_OR_RETURN(teacher_hidden_,
                       LoadRows(t.hidden, t.hidden_dtype, t.hidden_size, r0, rows,
                                teacher_product_dtype_, ws_.d_teacher_hidden,
                                ws_.d_teacher_hidden32));
    } else if (t.sparse()) {
      const size_t entries = static_cast<size_t>(rows) * t.top_k;
      RETURN_IF_ERROR(Copy(ws_.d_teacher_tokens, t.top_k_tokens + r0 * t.top_k,
                           entries * sizeof(int32_t), cudaMemcpyHostToDevice));
      RETURN_IF_ERROR(Copy(ws_.d_teacher_logprobs, t.top_k_logprobs + r0 * t.top_k,
                           entries * sizeof(float), cudaMemcpyHostToDevice));
      for (int64_t r = 0; r < rows; ++r) {
        rest_logits_[r] = SparseTeacherRestLogit(t.top_k_logprobs + (r0 + r) * t.top_k, t.top_k,
                                                 v_, options_.distill.sparse_mass);
      }
      RETURN_IF_ERROR(Copy(ws_.d_rest_logits, rest_logits_.data(), rows * sizeof(float),
                           cudaMemcpyHostToDevice));
    }
    return absl::OkStatus();
  }

  // Calls fn(w, first_row, rows) over rows [v0, v0 + cols) of `weight` in `product` dtype: W
  // itself, or slabs of it converted to fp32.
  template <typename Fn>
  absl::Status ForEachWeightSlab(const WeightView& weight, DType product, int64_t v0, int64_t cols,
                                 Fn fn) {
    const int64_t h = weight.hidden_size;
    const Matrix w{weight.data->data(), weight.dtype, h};
    if (weight.dtype == product) return fn(w.At(v0 * h), v0, cols);
    for (int64_t s0 = v0; s0 < v0 + cols; s0 += kWeightSlabRows) {
      const int64_t rows = std::min(kWeightSlabRows, v0 + cols - s0);
      RETURN_IF_ERROR(LaunchConvertToFloat(w.At(s0 * h).data, weight.dtype, rows * h,
                                           ws_.d_weight32, stream_));
      RETURN_IF_ERROR(fn(Matrix{ws_.d_weight32, DType::kFloat32, h}, s0, rows));
    }
    return absl::OkStatus();
  }

  LogitTile Tile(int64_t rows, int64_t v0, int64_t cols) const {
    return {ws_.d_logits, rows, cols, ld_, v0};
  }
  LogitTile TeacherTile(int64_t rows, int64_t v0, int64_t cols) const {
    return {ws_.d_teacher_logits, rows, cols, ld_, v0};
  }

  // Raw logits a = h W[v0 : v0 + cols]^T into `d_tile`.
  absl::Status ComputeLogits(const Matrix& hidden, const WeightView& weight, DType product,
                             int64_t rows, int64_t v0, int64_t cols, float* d_tile) {
    return ForEachWeightSlab(weight, product, v0, cols,
                             [&](const Matrix& w, int64_t s0, int64_t slab_rows) {
      return RowMajorGemm(cublas_, false, true, rows, slab_rows, hidden.ld, 1.0f, hidden, w, 0.0f,
                          d_tile + (s0 - v0), ld_, options_.allow_tf32);
    });
  }
  absl::Status ComputeLogits(int64_t rows, int64_t v0, int64_t cols) {
    return ComputeLogits(hidden_, weight_, product_dtype_, rows, v0, cols, ws_.d_logits);
  }

  // A distill call's two tiles of columns [v0, v0 + cols), transformed: the student's z and the
  // teacher's z_t (its head's, or a sparse teacher's completed log-probabilities).
  absl::Status ComputeDistillTiles(int64_t rows, int64_t v0, int64_t cols) {
    RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
    RETURN_IF_ERROR(LaunchTransformLogits(Tile(rows, v0, cols), transform_, stream_));
    const TeacherInputs& t = in_.teacher;
    if (t.sparse()) {
      return LaunchFillSparseTeacher(TeacherTile(rows, v0, cols), t.top_k, ws_.d_teacher_tokens,
                                     ws_.d_teacher_logprobs, ws_.d_rest_logits, stream_);
    }
    RETURN_IF_ERROR(ComputeLogits(teacher_hidden_, *t.weight, teacher_product_dtype_, rows, v0,
                                  cols, ws_.d_teacher_logits));
    return LaunchTransformLogits(TeacherTile(rows, v0, cols), teacher_transform_, stream_);
  }

  // Pass 1: statistics and top-k of every row over every vocabulary tile; leaves z in the tile.
  absl::Status RowStatistics(int64_t rows) {
    RETURN_IF_ERROR(
        LaunchResetRows(rows, k_, ws_.d_stats, ws_.d_top_values, ws_.d_top_tokens, stream_));
    if (distill_) {
      std::fill(distill_stats_.begin(), distill_stats_.begin() + rows, EmptyDistillStats());
      RETURN_IF_ERROR(Copy(ws_.d_distill_stats, distill_stats_.data(),
                           rows * sizeof(DistillStats), cudaMemcpyHostToDevice));
    }
    const float inv_tau = static_cast<float>(1.0 / options_.distill.temperature);
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (distill_) {
        RETURN_IF_ERROR(ComputeDistillTiles(rows, v0, cols));
        RETURN_IF_ERROR(LaunchMergeTileDistillStats(Tile(rows, v0, cols),
                                                    TeacherTile(rows, v0, cols), inv_tau,
                                                    ws_.d_distill_stats, stream_));
      } else {
        RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
      }
      // A distill call's tile is transformed already.
      const bool apply_transform = !distill_ && !transform_.identity();
      RETURN_IF_ERROR(LaunchMergeTileRowStats(Tile(rows, v0, cols), ws_.d_labels, transform_,
                                              apply_transform, ws_.d_stats, stream_));
      RETURN_IF_ERROR(LaunchMergeTileTopK(Tile(rows, v0, cols), k_, ws_.d_top_values,
                                          ws_.d_top_tokens, stream_));
    }
    return absl::OkStatus();
  }

  // Each distill row's constants for phases 2 and 3, from its complete statistics, on the host as
  // the CPU backend computes them.
  absl::Status RowConstants(int64_t rows) {
    RETURN_IF_ERROR(Copy(distill_stats_.data(), ws_.d_distill_stats, rows * sizeof(DistillStats),
                         cudaMemcpyDeviceToHost));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
    for (int64_t r = 0; r < rows; ++r) {
      constants_[r] = MakeDistillRowConstants(distill_stats_[r], options_.distill);
    }
    return Copy(ws_.d_constants, constants_.data(), rows * sizeof(DistillRowConstants),
                cudaMemcpyHostToDevice);
  }

  // Phase 2: each distill row's sums of D's and K's summands, tile after tile in order.
  absl::Status RowTerms(int64_t rows) {
    RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(ws_.d_terms, 0, rows * sizeof(DistillRowTerms), stream_),
        "cudaMemsetAsync"));
    const bool resident = tile_cols_ >= v_;  // pass 1 left the only tiles in place
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (!resident) RETURN_IF_ERROR(ComputeDistillTiles(rows, v0, cols));
      RETURN_IF_ERROR(LaunchAddTileDistillTerms(Tile(rows, v0, cols), TeacherTile(rows, v0, cols),
                                                ws_.d_constants, ws_.d_terms, stream_));
    }
    return absl::OkStatus();
  }

  // Per-row results on the host, summed in row order in double, exactly as the CPU backend does.
  absl::Status FinishRows(int64_t r0, int64_t rows, BatchSummary& summary) {
    RETURN_IF_ERROR(
        Copy(stats_.data(), ws_.d_stats, rows * sizeof(RowStats), cudaMemcpyDeviceToHost));
    if (k_ > 0) {
      RETURN_IF_ERROR(Copy(top_values_.data(), ws_.d_top_values, rows * k_ * sizeof(float),
                           cudaMemcpyDeviceToHost));
      RETURN_IF_ERROR(Copy(top_tokens_.data(), ws_.d_top_tokens, rows * k_ * sizeof(int32_t),
                           cudaMemcpyDeviceToHost));
    }
    if (distill_) {
      RETURN_IF_ERROR(Copy(terms_.data(), ws_.d_terms, rows * sizeof(DistillRowTerms),
                           cudaMemcpyDeviceToHost));
    }
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
    for (int64_t r = 0; r < rows; ++r) {
      const float* top_values = top_values_.data() + r * k_;
      const int32_t* top_tokens = top_tokens_.data() + r * k_;
      if (distill_) {
        const DistillRowResult& result = distill_results_[r] =
            finisher_.FinishDistill(r0 + r, stats_[r], distill_stats_[r], terms_[r]);
        if (gradients_) {
          distill_grads_[r] = finisher_.DistillGradient(r0 + r, result, constants_[r]);
          row_bounds_[r] =
              DistillLogitGradientBound(distill_grads_[r], result.gradient_bound, transform_);
        }
        finisher_.EmitDistill(r0 + r, result, stats_[r], top_values, top_tokens, summary);
        continue;
      }
      results_[r] = finisher_.Finish(r0 + r, stats_[r]);
      if (gradients_) {
        row_grads_[r] = finisher_.Gradient(r0 + r, results_[r]);
        row_bounds_[r] = LogitGradientBound(row_grads_[r], transform_);
      }
      finisher_.Emit(r0 + r, results_[r], stats_[r], top_values, top_tokens, summary);
    }
    if (!gradients_) return absl::OkStatus();
    if (distill_) {
      return Copy(ws_.d_distill_grads, distill_grads_.data(), rows * sizeof(DistillRowGradient),
                  cudaMemcpyHostToDevice);
    }
    return Copy(ws_.d_row_grads, row_grads_.data(), rows * sizeof(RowGradient),
                cudaMemcpyHostToDevice);
  }

  // A power of two S with |S dL/da| < 2^kSplitMaxExponent for every logit of the chunk, from the
  // rows' gradient bounds. It keeps the hi/lo halves of fp16 splits inside fp16's range;
  // multiplying and dividing by a power of two is exact.
  float SplitScale(int64_t rows) const {
    float bound = 0.0f;
    for (int64_t r = 0; r < rows; ++r) bound = std::max(bound, static_cast<float>(row_bounds_[r]));
    if (!(bound > 0.0f) || !std::isfinite(bound)) return 1.0f;
    int exponent = 0;
    std::frexp(bound, &exponent);  // bound < 2^exponent
    // Every finite bound (< 2^128) gets its exact S; the clamp only keeps S and the GEMMs'
    // alpha = 1/S normal floats.
    return std::ldexp(1.0f, std::clamp(kSplitMaxExponent - exponent, -126, 126));
  }

  // dL/da of one tile into the logits tile (or its split), recomputing the tile where the
  // vocabulary is tiled.
  absl::Status TileGradients(int64_t rows, int64_t v0, int64_t cols, bool logits_resident,
                             const GradientSplit& split) {
    if (distill_) {
      if (!logits_resident) RETURN_IF_ERROR(ComputeDistillTiles(rows, v0, cols));
      return LaunchDistillLogitGradients(Tile(rows, v0, cols), TeacherTile(rows, v0, cols),
                                         ws_.d_distill_grads, transform_, split, stream_);
    }
    if (!logits_resident) RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
    return LaunchLogitGradients(Tile(rows, v0, cols), ws_.d_row_grads, transform_,
                                !logits_resident && !transform_.identity(), split, stream_);
  }

  // Pass 2: dL/da per tile, then dh += dA W and dW += dA^T h. For 16-bit products dA = (hi + lo) /
  // S runs as two tensor-core GEMMs each (rounding dA to 16 bits alone would lose about 8 bits).
  absl::Status Gradients(int64_t r0, int64_t rows) {
    GradientSplit split;
    if (product_dtype_ != DType::kFloat32) {
      split = {product_dtype_, SplitScale(rows), ws_.d_grad_hi, ws_.d_grad_lo};
    }
    std::vector<Matrix> parts;
    if (split.dtype == DType::kFloat32) {
      parts = {{ws_.d_logits, DType::kFloat32, ld_}};
    } else {
      parts = {{ws_.d_grad_hi, split.dtype, ld_}, {ws_.d_grad_lo, split.dtype, ld_}};
    }
    const float alpha = 1.0f / split.scale;
    if (shape_.grad_hidden) {
      RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(ws_.d_grad_hidden32, 0, rows * h_ * sizeof(float), stream_),
                     "cudaMemsetAsync"));
    }
    const bool logits_resident = tile_cols_ >= v_;  // pass 1 left z of the only tile in place
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      RETURN_IF_ERROR(TileGradients(rows, v0, cols, logits_resident, split));
      if (shape_.grad_hidden) {
        RETURN_IF_ERROR(ForEachWeightSlab(
            weight_, product_dtype_, v0, cols,
            [&](const Matrix& w, int64_t s0, int64_t slab_rows) {
              for (const Matrix& part : parts) {
                RETURN_IF_ERROR(RowMajorGemm(cublas_, false, false, rows, h_, slab_rows, alpha,
                                             part.At(s0 - v0), w, 1.0f, ws_.d_grad_hidden32, h_,
                                             options_.allow_tf32));
              }
              return absl::OkStatus();
            }));
      }
      if (d_grad_weight_ != nullptr) {
        // The first product into dL/dW stores when the caller asked for dL/dW alone.
        float beta = options_.overwrite_grad_weight && r0 == 0 ? 0.0f : 1.0f;
        for (const Matrix& part : parts) {
          RETURN_IF_ERROR(RowMajorGemm(cublas_, true, false, cols, h_, rows, alpha, part, hidden_,
                                       beta, d_grad_weight_ + v0 * h_, h_, options_.allow_tf32));
          beta = 1.0f;
        }
      }
    }
    if (!shape_.grad_hidden) return absl::OkStatus();
    const size_t out_size = DTypeSize(out_.grad_hidden_dtype);
    char* host = static_cast<char*>(out_.grad_hidden) + r0 * h_ * out_size;
    if (out_.grad_hidden_dtype == DType::kFloat32) {
      return Copy(host, ws_.d_grad_hidden32, rows * h_ * out_size, cudaMemcpyDeviceToHost);
    }
    RETURN_IF_ERROR(LaunchConvertFromFloat(ws_.d_grad_hidden32, rows * h_, out_.grad_hidden_dtype,
                                           ws_.d_grad_hidden16, stream_));
    return Copy(host, ws_.d_grad_hidden16, rows * h_ * out_size, cudaMemcpyDeviceToHost);
  }

  const BatchInputs& in_;
  const WeightView& weight_;
  const LossOptions& options_;
  const TokenOutputs& out_;
  const ProblemShape& shape_;
  const CudaWorkspace& ws_;
  cudaStream_t stream_;
  cublasHandle_t cublas_;
  float* d_grad_weight_;
  const int64_t h_;
  const int64_t v_;
  const int64_t chunk_rows_;
  const int64_t tile_cols_;
  const int64_t ld_;
  const int k_;
  const DType product_dtype_;
  const DType teacher_product_dtype_;
  const bool gradients_;
  const bool distill_;
  const RowFinisher finisher_;
  const LogitTransform transform_;
  const LogitTransform teacher_transform_;
  Matrix hidden_{};          // the chunk's hidden rows in the product dtype
  Matrix teacher_hidden_{};  // a dense teacher's, in its product dtype
  // Host copies of the chunk's per-row state.
  std::vector<RowStats> stats_;
  std::vector<RowResult> results_;
  std::vector<RowGradient> row_grads_;
  std::vector<double> row_bounds_;  // max_v |dL/da_v| of each row, for SplitScale
  std::vector<float> top_values_;
  std::vector<int32_t> top_tokens_;
  std::vector<DistillStats> distill_stats_;
  std::vector<DistillRowConstants> constants_;
  std::vector<DistillRowTerms> terms_;
  std::vector<DistillRowResult> distill_results_;
  std::vector<DistillRowGradient> distill_grads_;
  std::vector<float> rest_logits_;
};

// ---- The backend ----

absl::Status CheckFloat32Count(const DeviceBuffer& buffer, int64_t count, absl::string_view name) {
  if (count < 0 || static_cast<size_t>(count) * sizeof(float) > buffer.bytes()) {
    return absl::OutOfRangeError(absl::StrCat(name, ": expected at least ", count,
                                              " fp32 elements, got ", buffer.bytes(), " bytes"));
  }
  return absl::OkStatus();
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, std::string description, size_t cublas_workspace_bytes)
      : device_(device), description_(std::move(description)), streams_(cublas_workspace_bytes) {}

  ~CudaBackend() override { cudaSetDevice(device_); }  // the pool's streams and handles live there

  absl::string_view kind() const override { return "cuda"; }
  std::string Describe() const override { return description_; }

  absl::StatusOr<DeviceMemory> QueryMemory() const override {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
    return DeviceMemory{static_cast<int64_t>(total_bytes),
                        static_cast<int64_t>(total_bytes - free_bytes)};
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    void* data = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, std::max<size_t>(bytes, 1)),
                               absl::StrCat("cudaMalloc of ", bytes, " bytes")));
    return DeviceBuffer(this, data, bytes);
  }

  absl::Status CopyToDevice(const void* host, size_t bytes, DeviceBuffer& dst,
                            size_t dst_offset) override {
    if (dst_offset + bytes > dst.bytes()) {
      return absl::OutOfRangeError("copy past the buffer's end");
    }
    return RunOnStream([&](const StreamContext& c) {
      return CudaStatus(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_offset, host, bytes,
                                        cudaMemcpyHostToDevice, c.stream),
                        "cudaMemcpyAsync");
    });
  }

  absl::Status CopyToHost(const DeviceBuffer& src, size_t src_offset, size_t bytes,
                          void* host) override {
    if (src_offset + bytes > src.bytes()) {
      return absl::OutOfRangeError("copy past the buffer's end");
    }
    return RunOnStream([&](const StreamContext& c) {
      return CudaStatus(cudaMemcpyAsync(host, static_cast<const char*>(src.data()) + src_offset,
                                        bytes, cudaMemcpyDeviceToHost, c.stream),
                        "cudaMemcpyAsync");
    });
  }

  absl::Status Zero(DeviceBuffer& buffer) override {
    return RunOnStream([&](const StreamContext& c) {
      return CudaStatus(cudaMemsetAsync(buffer.data(), 0, buffer.bytes(), c.stream),
                        "cudaMemsetAsync");
    });
  }

  absl::Status AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src, int64_t count) override {
    RETURN_IF_ERROR(CheckFloat32Count(dst, count, "dst"));
    RETURN_IF_ERROR(CheckFloat32Count(src, count, "src"));
    return RunOnStream([&](const StreamContext& c) {
      return LaunchAddFloat32(static_cast<float*>(dst.data()),
                              static_cast<const float*>(src.data()), count, c.stream);
    });
  }

  absl::StatusOr<double> SumSquaresFloat32(const DeviceBuffer& x, int64_t count) override {
    RETURN_IF_ERROR(CheckFloat32Count(x, count, "x"));
    std::vector<double> partials(kSumSquaresBlocks);
    RETURN_IF_ERROR(RunOnStream([&](const StreamContext& c) {
      RETURN_IF_ERROR(LaunchSumSquaresPartials(static_cast<const float*>(x.data()), count,
                                               c.d_sum_squares_partials, c.stream));
      return CudaStatus(cudaMemcpyAsync(partials.data(), c.d_sum_squares_partials,
                                        partials.size() * sizeof(double), cudaMemcpyDeviceToHost,
                                        c.stream),
                        "cudaMemcpyAsync");
    }));
    double total = 0.0;
    for (double p : partials) total += p;
    return total;
  }

  absl::StatusOr<OptimizerStepResult> OptimizerStep(const OptimizerConfig& config,
                                                    const OptimizerTensors& t) override {
    const bool adamw = config.kind == OptimizerConfig::Kind::kAdamW;
    if (adamw && (t.state1 == nullptr || t.state2 == nullptr)) {
      return absl::FailedPreconditionError("AdamW: expected both moment buffers");
    }
    if (t.weight == nullptr || t.grad == nullptr ||
        t.weight->bytes() < static_cast<size_t>(t.count) * DTypeSize(t.weight_dtype)) {
      return absl::OutOfRangeError(absl::StrCat("weight: expected ", t.count, " elements"));
    }
    RETURN_IF_ERROR(CheckFloat32Count(*t.grad, t.count, "grad"));
    if (t.state1 != nullptr) RETURN_IF_ERROR(CheckFloat32Count(*t.state1, t.count, "state1"));
    if (t.state2 != nullptr) RETURN_IF_ERROR(CheckFloat32Count(*t.state2, t.count, "state2"));
    auto state = [](DeviceBuffer* b) {
      return b != nullptr ? static_cast<float*>(b->data()) : nullptr;
    };
    const OptimizerScalars scalars = MakeOptimizerScalars(config);
    // The check pass: per-block smallest codes of NonFiniteUpdateCode, read back; nothing is
    // written unless every updated value is finite as stored.
    std::vector<double> partials(kSumSquaresBlocks);
    RETURN_IF_ERROR(RunOnStream([&](const StreamContext& c) {
      RETURN_IF_ERROR(LaunchOptimizerCheck(config.kind, scalars, t.weight->data(), t.weight_dtype,
                                           static_cast<const float*>(t.grad->data()),
                                           state(t.state1), state(t.state2), t.count,
                                           c.d_sum_squares_partials, c.stream));
      return CudaStatus(cudaMemcpyAsync(partials.data(), c.d_sum_squares_partials,
                                        partials.size() * sizeof(double), cudaMemcpyDeviceToHost,
                                        c.stream),
                        "cudaMemcpyAsync");
    }));
    double first = HUGE_VAL;
    for (double p : partials) first = std::min(first, p);
    const OptimizerStepResult result = OptimizerResultFromCode(first);
    if (!result.applied()) return result;
    RETURN_IF_ERROR(RunOnStream([&](const StreamContext& c) {
      return LaunchOptimizerStep(config.kind, scalars, t.weight->data(), t.weight_dtype,
                                 static_cast<const float*>(t.grad->data()), state(t.state1),
                                 state(t.state2), t.count, c.stream);
    }));
    return result;
  }

  // Each chunk's rows are copied to the device once (LoadChunk) and read only there.
  bool ReadsRowsOnce(DType) const override { return true; }

  absl::StatusOr<ChunkPlan> Plan(const ProblemShape& shape, size_t budget_bytes) const override {
    return ChooseChunkPlan(shape, budget_bytes, kCudaTileLimits, [&](int64_t rows, int64_t cols) {
      WorkspaceArena arena(nullptr, 0);
      CarveWorkspace(arena, shape, rows, cols);
      return arena.used();
    });
  }

  absl::StatusOr<BatchSummary> Compute(const BatchInputs& in, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& out,
                                       DeviceBuffer* grad_weight,
                                       DeviceBuffer& workspace) override {
    ASSIGN_OR_RETURN(const CallPlan call,
                     PlanCall(*this, in, weight, options, out, grad_weight, workspace));
    WorkspaceArena arena(workspace.data(), workspace.bytes());
    const CudaWorkspace ws =
        CarveWorkspace(arena, call.shape, call.plan.token_chunk, call.plan.vocab_chunk);
    BatchSummary summary = PlannedSummary(call.plan, arena.used());
    RETURN_IF_ERROR(RunOnStream([&](const StreamContext& c) {
      return ChunkedCompute(in, weight, options, out, grad_weight, call, ws, c).Run(summary);
    }));
    return summary;
  }

  // Creates the first stream context, so that a cuBLAS that cannot start fails at creation.
  absl::Status Warm() {
    return RunOnStream([](const StreamContext&) { return absl::OkStatus(); });
  }

 protected:
  void Free(void* data, size_t) override {
    cudaSetDevice(device_);
    cudaFree(data);
  }

 private:
  // Runs fn(context) on a pooled stream of this device and waits for the stream, also when fn
  // failed, so that no work of a call outlives the buffers its caller may free next.
  template <typename Fn>
  absl::Status RunOnStream(Fn fn) const {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    ASSIGN_OR_RETURN(const StreamContext context, streams_.Acquire());
    const absl::Status status = fn(context);
    const absl::Status synced =
        CudaStatus(cudaStreamSynchronize(context.stream), "cudaStreamSynchronize");
    streams_.Release(context);
    // A device fault outranks the step's own error: a cuBLAS call on a faulted device reports
    // only CUBLAS_STATUS_EXECUTION_FAILED.
    return status.ok() || IsDeviceFault(synced) ? synced : status;
  }

  const int device_;
  const std::string description_;
  mutable StreamPool streams_;
};

// Why cudaGetDeviceCount failed, in plain words, with CUDA's own error in parentheses. Without a
// driver the runtime reports cudaErrorInsufficientDriver, as it does for a driver too old for it;
// the driver's version, 0 when there is none, tells them apart.
std::string NoDeviceReason(cudaError_t error) {
  const std::string raw = absl::StrCat(cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  int driver_version = 0;
  if (error == cudaErrorInsufficientDriver &&
      (cudaDriverGetVersion(&driver_version) != cudaSuccess || driver_version == 0)) {
    return absl::StrCat("no GPU found (no NVIDIA driver; ", raw, ")");
  }
  if (error == cudaErrorInsufficientDriver) {
    return absl::StrFormat(
        "the NVIDIA driver supports CUDA up to %d.%d, older than this module's CUDA runtime %d.%d: "
        "update the driver (%s)",
        driver_version / 1000, driver_version % 1000 / 10, CUDART_VERSION / 1000,
        CUDART_VERSION % 1000 / 10, raw);
  }
  if (error == cudaErrorNoDevice) {
    return absl::StrCat("no GPU found (the NVIDIA driver sees none: check CUDA_VISIBLE_DEVICES "
                        "and the container's access to the GPUs; ",
                        raw, ")");
  }
  return absl::StrCat("cannot count the GPUs (", raw, ")");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    const std::string reason = NoDeviceReason(error);
    cudaGetLastError();  // see CudaStatus
    return absl::UnavailableError(reason);
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device ", ordinal, ": ", count, " device(s) present"));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  cudaDeviceProp props;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&props, ordinal), "cudaGetDeviceProperties"));
  if (const absl::Status image = CheckKernelImage(); !image.ok()) {
    return absl::UnavailableError(absl::StrFormat(
        "%s (sm_%d%d) cannot run this CUDA module, built for architectures %s (%s); rebuild it "
        "with -DLOSSD_CUDA_ARCHITECTURES=%d%d",
        props.name, props.major, props.minor, LOSSD_CUDA_ARCHITECTURES_BUILT, image.message(),
        props.major, props.minor));
  }
  int runtime_version = 0;
  int driver_version = 0;
  RETURN_IF_ERROR(CudaStatus(cudaRuntimeGetVersion(&runtime_version), "cudaRuntimeGetVersion"));
  RETURN_IF_ERROR(CudaStatus(cudaDriverGetVersion(&driver_version), "cudaDriverGetVersion"));
  int cublas_version[3] = {0, 0, 0};
  const libraryPropertyType parts[3] = {MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL};
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(
        CublasStatus(cublasGetProperty(parts[i], &cublas_version[i]), "cublasGetProperty"));
  }
  const std::string description = absl::StrFormat(
      "cuda:%d %s (sm_%d%d, %d SMs, %.1f GiB); CUDA runtime %d.%d, driver %d.%d; cuBLAS %d.%d.%d",
      ordinal, props.name, props.major, props.minor, props.multiProcessorCount,
      static_cast<double>(props.totalGlobalMem) / (1u << 30), runtime_version / 1000,
      runtime_version % 1000 / 10, driver_version / 1000, driver_version % 1000 / 10,
      cublas_version[0], cublas_version[1], cublas_version[2]);
  auto backend =
      std::make_unique<CudaBackend>(ordinal, description, CublasWorkspaceBytes(props.major));
  RETURN_IF_ERROR(backend->Warm());
  return backend;
}

}  // namespace
}  // namespace lossd::cuda

extern "C" {

int lossd_cuda_module_abi(void) { return LOSSD_CUDA_MODULE_ABI; }

lossd::Backend* lossd_cuda_create_backend(int device_ordinal, char* error, size_t error_capacity) {
  absl::StatusOr<std::unique_ptr<lossd::Backend>> backend =
      lossd::cuda::CreateCudaBackend(device_ordinal);
  if (backend.ok()) return backend->release();
  if (error != nullptr && error_capacity > 0) {
    std::snprintf(error, error_capacity, "%s", std::string(backend.status().message()).c_str());
  }
  return nullptr;
}

int lossd_cuda_test_only_fault_device(int device_ordinal, char* error, size_t error_capacity) {
  cudaError_t result = cudaSetDevice(device_ordinal);
  if (result == cudaSuccess) {
    const absl::Status launched = lossd::cuda::LaunchTestOnlyIllegalAddress(nullptr);
    result = launched.ok() ? cudaDeviceSynchronize() : cudaGetLastError();
  }
  if (error != nullptr && error_capacity > 0) {
    std::snprintf(error, error_capacity, "%s", cudaGetErrorName(result));
  }
  return lossd::cuda::IsStickyError(result) ? 1 : 0;
}

}  // extern "C"
