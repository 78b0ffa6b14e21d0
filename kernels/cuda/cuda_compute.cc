#include "kernels/cuda/cuda_compute.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_status.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::cuda {

// ---- The stream context ----

absl::Status CreateStreamContext(size_t cublas_workspace_bytes, StreamContext& c) {
  absl::Status status =
      CudaStatus(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  for (cudaStream_t* copies : {&c.input_stream, &c.output_stream}) {
    if (status.ok()) {
      status =
          CudaStatus(cudaStreamCreateWithFlags(copies, cudaStreamNonBlocking), "cudaStreamCreate");
    }
  }
  int least_priority = 0;
  int greatest_priority = 0;
  if (status.ok()) {
    status = CudaStatus(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
                        "cudaDeviceGetStreamPriorityRange");
  }
  if (status.ok()) {
    status = CudaStatus(
        cudaStreamCreateWithPriority(&c.row_stream, cudaStreamNonBlocking, greatest_priority),
        "cudaStreamCreateWithPriority");
  }
  if (status.ok()) status = CublasStatus(cublasCreate(&c.cublas), "cublasCreate");
  if (status.ok()) {
    status = CublasStatus(cublasSetStream(c.cublas, c.stream), "cublasSetStream");
  }
  if (status.ok()) {
    status = CudaStatus(cudaMalloc(&c.d_cublas_workspace, cublas_workspace_bytes),
                        "cudaMalloc (cuBLAS workspace)");
  }
  if (status.ok()) {
    status =
        CublasStatus(cublasSetWorkspace(c.cublas, c.d_cublas_workspace, cublas_workspace_bytes),
                     "cublasSetWorkspace");
  }
  if (status.ok()) {
    status = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&c.d_sum_squares_partials),
                                   kSumSquaresBlocks * sizeof(double)),
                        "cudaMalloc (sum of squares partials)");
  }
  for (cudaEvent_t* event : {&c.call_start, &c.call_end}) {
    if (status.ok()) status = CudaStatus(cudaEventCreate(event), "cudaEventCreate");
  }
  for (int slot = 0; slot < 2; ++slot) {
    for (cudaEvent_t* event : {&c.inputs_copied[slot], &c.inputs_consumed[slot],
                               &c.grad_ready[slot], &c.grad_copied[slot]}) {
      if (status.ok()) {
        status = CudaStatus(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
      }
    }
  }
  for (int slot = 0; slot < 2; ++slot) {
    for (cudaEvent_t& event : c.piece_copied[slot]) {
      if (status.ok()) {
        status = CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
      }
    }
    for (cudaEvent_t* event : {&c.logits_ready[slot], &c.rows_done[slot]}) {
      if (status.ok()) {
        status = CudaStatus(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
      }
    }
  }
  if (status.ok()) {
    status = CudaStatus(cudaEventCreateWithFlags(&c.outputs_done, cudaEventDisableTiming),
                        "cudaEventCreateWithFlags");
  }
  if (!status.ok()) DestroyStreamContext(c);
  return status;
}

void DestroyStreamContext(StreamContext& c) {
  if (c.cublas != nullptr) cublasDestroy(c.cublas);
  if (c.d_cublas_workspace != nullptr) cudaFree(c.d_cublas_workspace);
  if (c.d_sum_squares_partials != nullptr) cudaFree(c.d_sum_squares_partials);
  if (c.h_staging != nullptr) cudaFreeHost(c.h_staging);
  for (cudaEvent_t event : {c.call_start, c.call_end, c.outputs_done}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  for (int slot = 0; slot < 2; ++slot) {
    for (cudaEvent_t event : {c.inputs_copied[slot], c.inputs_consumed[slot], c.grad_ready[slot],
                              c.grad_copied[slot]}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    for (cudaEvent_t event : c.piece_copied[slot]) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    for (cudaEvent_t event : {c.logits_ready[slot], c.rows_done[slot]}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  for (cudaStream_t stream : {c.stream, c.input_stream, c.output_stream, c.row_stream}) {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  c = StreamContext{};
}

absl::Status EnsureStaging(size_t bytes, StreamContext& c) {
  if (bytes <= c.staging_bytes) return absl::OkStatus();
  if (c.h_staging != nullptr) {
    // No copy of an earlier call is pending: each call ends synchronized.
    RETURN_IF_ERROR(CudaStatus(cudaFreeHost(c.h_staging), "cudaFreeHost"));
    c.h_staging = nullptr;
    c.staging_bytes = 0;
  }
  RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&c.h_staging, bytes, cudaHostAllocDefault),
                             absl::StrCat("cudaHostAlloc of ", bytes, " bytes of staging")));
  c.staging_bytes = bytes;
  return absl::OkStatus();
}

// ---- One call ----

namespace {

absl::Status Cuda(cudaError_t error, const char* what) { return CudaStatus(error, what); }

// Whether `p` is page-locked host memory (the backend's HostBuffers, say), which the device can
// copy to and from directly.
bool IsPageLocked(const void* p) {
  cudaPointerAttributes attributes;
  if (p == nullptr || cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // see CudaStatus
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace

class ChunkedCompute::Impl {
 public:
  Impl(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
       const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
       const CudaWorkspace& ws, const HostStaging& staging, const StreamContext& context)
      : in_(in),
        weight_(weight),
        options_(options),
        out_(out),
        shape_(call.shape),
        ws_(ws),
        staging_(staging),
        context_(context),
        stream_(context.stream),
        input_(context.input_stream),
        output_(context.output_stream),
        cublas_(context.cublas),
        d_grad_weight_(grad_weight != nullptr ? static_cast<float*>(grad_weight->data()) : nullptr),
        h_(weight.hidden_size),
        v_(weight.vocab_size),
        chunk_rows_(call.plan.token_chunk),
        logit_rows_(LogitRows(call.plan)),
        windowed_(logit_rows_ < chunk_rows_),
        tile_cols_(call.plan.vocab_chunk),
        ld_(LeadingDimension(call.plan.vocab_chunk)),
        k_(out.top_k),
        product_dtype_(ProductDType(call.shape)),
        teacher_product_dtype_(TeacherProductDType(call.shape)),
        store_(GradientStoreOf(call.shape)),
        gradients_(WantsGradients(call.shape)),
        distill_(options.objective == Objective::kDistill),
        entropy_(options.policy.entropy_coef != 0.0),
        divergence_(DivergenceOf(options.distill.beta)),
        tail_bucket_(options.distill.sparse_mass == SparseTeacherMass::kTailBucket),
        finisher_(in, weight.vocab_size, options, out),
        transform_(finisher_.transform()),
        teacher_transform_(MakeTeacherTransform(options)),
        rows_page_locked_(IsPageLocked(in.hidden)),
        grad_hidden_page_locked_(IsPageLocked(out.grad_hidden)) {}

  absl::Status Run() {
    if (windowed_ && (chunk_rows_ + logit_rows_ - 1) / logit_rows_ > kMaxPiecesPerWindow) {
      return absl::InternalError(absl::StrCat("a window of ", chunk_rows_, " rows in pieces of ",
                                              logit_rows_, " has more than ", kMaxPiecesPerWindow,
                                              " pieces"));
    }
    // The call's copies count in its device time: they start after the call's start.
    RETURN_IF_ERROR(
        Cuda(cudaStreamWaitEvent(input_, context_.call_start, 0), "cudaStreamWaitEvent"));
    int64_t previous_r0 = -1;
    int64_t previous_rows = 0;
    int previous_slot = 0;
    int64_t chunk = 0;
    int64_t r0 = 0;
    const bool by_sequence = options_.policy.sequence_ratio;
    for (const int64_t end : TokenChunkEnds(in_.num_tokens, chunk_rows_,
                                            by_sequence ? in_.ratio_sequence_lengths : nullptr,
                                            by_sequence ? in_.num_ratio_sequences : 0)) {
      const int64_t rows = end - r0;
      const int slot = static_cast<int>(chunk % 2);
      RETURN_IF_ERROR(SendInputs(slot, r0, rows));
      RETURN_IF_ERROR(ComputeChunk(slot, r0, rows));
      // The previous chunk's dL/dh, while this one computes.
      if (previous_r0 >= 0)
        RETURN_IF_ERROR(ReceiveGradHidden(previous_slot, previous_r0, previous_rows));
      previous_r0 = r0;
      previous_rows = rows;
      previous_slot = slot;
      r0 = end;
      ++chunk;
    }
    if (previous_r0 >= 0)
      RETURN_IF_ERROR(ReceiveGradHidden(previous_slot, previous_r0, previous_rows));
    // The compute stream waits for the output stream's last copy (the input stream's were waited
    // for by the chunks), so that the call's end event and a synchronization of the compute stream
    // cover every copy.
    RETURN_IF_ERROR(Cuda(cudaEventRecord(context_.outputs_done, output_), "cudaEventRecord"));
    return Cuda(cudaStreamWaitEvent(stream_, context_.outputs_done, 0), "cudaStreamWaitEvent");
  }

  // Every row's results, in row order, from the pinned copies the chunks left.
  void Finish(BatchSummary& summary) const {
    for (int64_t r = 0; r < in_.num_tokens; ++r) {
      const float* top_values = k_ > 0 ? staging_.h_top_values + r * k_ : nullptr;
      const int32_t* top_tokens = k_ > 0 ? staging_.h_top_tokens + r * k_ : nullptr;
      if (distill_) {
        finisher_.EmitDistill(r, staging_.h_distill_results[r], staging_.h_stats[r], top_values,
                              top_tokens, summary);
      } else {
        finisher_.Emit(r, staging_.h_results[r], staging_.h_stats[r], top_values, top_tokens,
                       summary);
      }
    }
    finisher_.Close(summary);
  }

 private:
  // ---- Copies ----

  absl::Status ToDevice(void* d_dst, const void* h_src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return Cuda(cudaMemcpyAsync(d_dst, h_src, bytes, cudaMemcpyHostToDevice, input_),
                "cudaMemcpyAsync");
  }

  // The chunk's inputs into the slot's pinned memory, then on the input stream to its device slot.
  absl::Status SendInputs(int slot, int64_t r0, int64_t rows) {
    const ChunkBuffers& h = staging_.h_inputs[slot];
    const ChunkBuffers& d = ws_.d_inputs[slot];
    // The pinned slot was last read by the copy of the chunk before the previous one.
    RETURN_IF_ERROR(
        Cuda(cudaEventSynchronize(context_.inputs_copied[slot]), "cudaEventSynchronize"));
    if (in_.labels != nullptr) {
      std::memcpy(h.labels, in_.labels + r0, rows * sizeof(int64_t));
    } else {  // -1, which no column matches
      std::memset(h.labels, 0xff, rows * sizeof(int64_t));
    }
    std::vector<std::pair<void*, const void*>> present;  // (device, pinned) of the copied arrays
    const auto stage = [&](float* pinned, float* device, const float* values) {
      if (values == nullptr) return;
      std::memcpy(pinned, values + r0, rows * sizeof(float));
      present.emplace_back(device, pinned);
    };
    stage(h.token_weights, d.token_weights, in_.token_weights);
    stage(h.sampling_logprobs, d.sampling_logprobs, in_.sampling_logprobs);
    stage(h.advantages, d.advantages, in_.advantages);
    stage(h.reference_logprobs, d.reference_logprobs, in_.reference_logprobs);
    stage(h.logprob_grads, d.logprob_grads, in_.logprob_grads);
    if (in_.reduction_scales != nullptr) {
      std::memcpy(h.reduction_scales, in_.reduction_scales + r0, rows * sizeof(double));
    }
    // The chunk holds whole sequences (TokenChunkEnds): their ends, relative to its first row.
    slot_sequences_[slot] = 0;
    if (options_.policy.sequence_ratio) {
      int32_t end = 0;
      for (const int64_t length : sequences_.Take(rows)) {
        end += static_cast<int32_t>(length);
        h.sequence_ends[slot_sequences_[slot]++] = end;
      }
    }
    const TeacherInputs& t = in_.teacher;
    const size_t teacher_row_bytes = DTypeSize(t.hidden_dtype) * static_cast<size_t>(t.hidden_size);
    const size_t top_entries = static_cast<size_t>(rows) * t.top_k;
    if (t.dense()) {
      std::memcpy(h.teacher_hidden, static_cast<const char*>(t.hidden) + r0 * teacher_row_bytes,
                  rows * teacher_row_bytes);
    } else if (t.sparse()) {
      std::memcpy(h.teacher_tokens, t.top_k_tokens + r0 * t.top_k, top_entries * sizeof(int32_t));
      std::memcpy(h.teacher_logprobs, t.top_k_logprobs + r0 * t.top_k, top_entries * sizeof(float));
      for (int64_t r = 0; r < rows; ++r) {
        h.sparse_rows[r] = SparseTeacherRowOf(t.top_k_logprobs + (r0 + r) * t.top_k, t.top_k, v_,
                                              options_.distill.sparse_mass);
      }
    }

    // The device slot was last read by the compute of the chunk before the previous one.
    RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(input_, context_.inputs_consumed[slot], 0),
                         "cudaStreamWaitEvent"));
    RETURN_IF_ERROR(ToDevice(d.labels, h.labels, rows * sizeof(int64_t)));
    for (const auto& [device, pinned] : present) {
      RETURN_IF_ERROR(ToDevice(device, pinned, rows * sizeof(float)));
    }
    if (in_.reduction_scales != nullptr) {
      RETURN_IF_ERROR(ToDevice(d.reduction_scales, h.reduction_scales, rows * sizeof(double)));
    }
    RETURN_IF_ERROR(
        ToDevice(d.sequence_ends, h.sequence_ends, slot_sequences_[slot] * sizeof(int32_t)));
    if (t.dense()) {
      RETURN_IF_ERROR(ToDevice(d.teacher_hidden, h.teacher_hidden, rows * teacher_row_bytes));
    } else if (t.sparse()) {
      RETURN_IF_ERROR(ToDevice(d.teacher_tokens, h.teacher_tokens, top_entries * sizeof(int32_t)));
      RETURN_IF_ERROR(
          ToDevice(d.teacher_logprobs, h.teacher_logprobs, top_entries * sizeof(float)));
      RETURN_IF_ERROR(ToDevice(d.sparse_rows, h.sparse_rows, rows * sizeof(SparseTeacherRow)));
    }
    RETURN_IF_ERROR(SendRows(slot, r0, rows));
    return Cuda(cudaEventRecord(context_.inputs_copied[slot], input_), "cudaEventRecord");
  }

  // The chunk's rows, last of its inputs: a window's piece by piece, each piece's arrival recorded
  // (piece_copied), so that its first piece computes while the rest are on their way; rows from
  // pageable memory go through the pinned slot a piece at a time, each piece's copy into it
  // overlapping the previous one's to the device.
  absl::Status SendRows(int slot, int64_t r0, int64_t rows) {
    const ChunkBuffers& h = staging_.h_inputs[slot];
    const ChunkBuffers& d = ws_.d_inputs[slot];
    const size_t row_bytes = DTypeSize(in_.hidden_dtype) * static_cast<size_t>(h_);
    const int64_t piece_rows = windowed_ ? logit_rows_ : rows;
    for (int64_t p0 = 0, piece = 0; p0 < rows; p0 += piece_rows, ++piece) {
      const size_t offset = p0 * row_bytes;
      const size_t bytes = std::min(piece_rows, rows - p0) * row_bytes;
      const void* source = static_cast<const char*>(in_.hidden) + r0 * row_bytes + offset;
      if (!rows_page_locked_) {
        std::memcpy(static_cast<char*>(h.hidden) + offset, source, bytes);
        source = static_cast<const char*>(h.hidden) + offset;
      }
      RETURN_IF_ERROR(ToDevice(static_cast<char*>(d.hidden) + offset, source, bytes));
      if (windowed_) {
        RETURN_IF_ERROR(
            Cuda(cudaEventRecord(context_.piece_copied[slot][piece], input_), "cudaEventRecord"));
      }
    }
    return absl::OkStatus();
  }

  // The chunk's dL/dh from its pinned slot into the caller's rows, once the output stream put it
  // there.
  absl::Status ReceiveGradHidden(int slot, int64_t r0, int64_t rows) {
    // Page-locked dL/dh came back in place; the call's end waits for it.
    if (!shape_.grad_hidden || grad_hidden_page_locked_) return absl::OkStatus();
    RETURN_IF_ERROR(Cuda(cudaEventSynchronize(context_.grad_copied[slot]), "cudaEventSynchronize"));
    const size_t row_bytes = DTypeSize(out_.grad_hidden_dtype) * static_cast<size_t>(h_);
    std::memcpy(static_cast<char*>(out_.grad_hidden) + r0 * row_bytes, staging_.h_grad_hidden[slot],
                rows * row_bytes);
    return absl::OkStatus();
  }

  // The chunk's per-row results into the call's pinned arrays, on the compute stream.
  absl::Status CopyResults(int64_t r0, int64_t rows) {
    const auto to_host = [&](void* h_dst, const void* d_src, size_t bytes) {
      return Cuda(cudaMemcpyAsync(h_dst, d_src, bytes, cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync");
    };
    RETURN_IF_ERROR(to_host(staging_.h_stats + r0, ws_.d_stats, rows * sizeof(RowStats)));
    if (distill_) {
      RETURN_IF_ERROR(to_host(staging_.h_distill_results + r0, ws_.d_distill_results,
                              rows * sizeof(DistillRowResult)));
    } else {
      RETURN_IF_ERROR(to_host(staging_.h_results + r0, ws_.d_results, rows * sizeof(RowResult)));
    }
    if (k_ == 0) return absl::OkStatus();
    RETURN_IF_ERROR(
        to_host(staging_.h_top_values + r0 * k_, ws_.d_top_values, rows * k_ * sizeof(float)));
    return to_host(staging_.h_top_tokens + r0 * k_, ws_.d_top_tokens, rows * k_ * sizeof(int32_t));
  }

  // ---- Products ----

  // `rows` rows of a [rows, h] matrix in the device slot, in the product dtype: as sent, or
  // converted to fp32 into d_rows32.
  absl::StatusOr<Matrix> ProductRows(const void* d_rows, DType dtype, int64_t h, int64_t rows,
                                     DType product, float* d_rows32) {
    if (dtype == product) return Matrix{d_rows, dtype, h};
    RETURN_IF_ERROR(LaunchConvertToFloat(d_rows, dtype, rows * h, d_rows32, stream_));
    return Matrix{d_rows32, DType::kFloat32, h};
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
      RETURN_IF_ERROR(
          LaunchConvertToFloat(w.At(s0 * h).data, weight.dtype, rows * h, ws_.d_weight32, stream_));
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
    return ForEachWeightSlab(
        weight, product, v0, cols, [&](const Matrix& w, int64_t s0, int64_t slab_rows) {
          return RowMajorGemmBlocked(cublas_, false, true, rows, slab_rows, hidden.ld, 1.0f, hidden,
                                     w, 0.0f, d_tile + (s0 - v0), ld_, options_.allow_tf32);
        });
  }
  absl::Status ComputeLogits(int64_t rows, int64_t v0, int64_t cols) {
    return ComputeLogits(hidden_, weight_, product_dtype_, rows, v0, cols, ws_.d_logits);
  }

  // A distill call's two tiles of columns [v0, v0 + cols), transformed: the student's z and the
  // teacher's z_t (its head's, or a sparse teacher's completed log-probabilities).
  absl::Status ComputeDistillTiles(const ChunkBuffers& d, int64_t rows, int64_t v0, int64_t cols) {
    RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
    RETURN_IF_ERROR(LaunchTransformLogits(Tile(rows, v0, cols), transform_, stream_));
    const TeacherInputs& t = in_.teacher;
    if (t.sparse()) {
      return LaunchFillSparseTeacher(TeacherTile(rows, v0, cols), t.top_k, d.teacher_tokens,
                                     d.teacher_logprobs, d.sparse_rows, stream_);
    }
    RETURN_IF_ERROR(ComputeLogits(teacher_hidden_, *t.weight, teacher_product_dtype_, rows, v0,
                                  cols, ws_.d_teacher_logits));
    return LaunchTransformLogits(TeacherTile(rows, v0, cols), teacher_transform_, stream_);
  }

  // A gradient product C (+)= alpha op(A) op(B): alpha = 1 for fp32 dL/da, 1 / S read from the
  // device for dL/da carried in 16 bits.
  absl::Status GradientProduct(bool transpose_a, int64_t m, int64_t n, int64_t k, const Matrix& a,
                               const Matrix& b, bool accumulate, float* c) {
    if (store_ == GradientStore::kFloat32) {
      return RowMajorGemmBlocked(cublas_, transpose_a, false, m, n, k, 1.0f, a, b,
                                 accumulate ? 1.0f : 0.0f, c, h_, options_.allow_tf32);
    }
    const DeviceScalars scalars{ws_.d_split_scale + 1, ws_.d_split_scale + 2,
                                ws_.d_split_scale + 3};
    return RowMajorGemmBlocked(cublas_, transpose_a, false, m, n, k, scalars, a, b, accumulate, c,
                               h_, options_.allow_tf32);
  }

  // ---- One chunk ----

  absl::Status ComputeChunk(int slot, int64_t r0, int64_t rows) {
    const ChunkBuffers& d = ws_.d_inputs[slot];
    // A window waits for each piece's rows as it comes to them (FinishWindow); its other inputs
    // arrived before its first piece.
    RETURN_IF_ERROR(Cuda(
        cudaStreamWaitEvent(
            stream_, windowed_ ? context_.piece_copied[slot][0] : context_.inputs_copied[slot], 0),
        "cudaStreamWaitEvent"));
    ASSIGN_OR_RETURN(
        hidden_, ProductRows(d.hidden, in_.hidden_dtype, h_, rows, product_dtype_, ws_.d_hidden32));
    if (in_.teacher.dense()) {
      ASSIGN_OR_RETURN(
          teacher_hidden_,
          ProductRows(d.teacher_hidden, in_.teacher.hidden_dtype, in_.teacher.hidden_size, rows,
                      teacher_product_dtype_, ws_.d_teacher_hidden32));
    }
    if (windowed_) {
      RETURN_IF_ERROR(FinishWindow(d, slot, rows));
    } else {
      RETURN_IF_ERROR(RowStatistics(d, rows));
      if (distill_) {
        RETURN_IF_ERROR(LaunchDistillConstants(rows, ws_.d_distill_stats, options_.distill,
                                               ws_.d_constants, stream_));
        RETURN_IF_ERROR(RowTerms(d, rows));
      }
      RETURN_IF_ERROR(FinishRows(d, slot, rows));
    }
    if (gradients_) RETURN_IF_ERROR(Gradients(d, slot, r0, rows));
    RETURN_IF_ERROR(
        Cuda(cudaEventRecord(context_.inputs_consumed[slot], stream_), "cudaEventRecord"));
    return CopyResults(r0, rows);
  }

  // Phase 1: statistics and top-k of every row over every vocabulary tile; leaves z in the tile.
  absl::Status RowStatistics(const ChunkBuffers& d, int64_t rows) {
    RETURN_IF_ERROR(
        LaunchResetRows(rows, k_, ws_.d_stats, ws_.d_top_values, ws_.d_top_tokens, stream_));
    if (distill_) {
      RETURN_IF_ERROR(LaunchResetDistillStats(rows, in_.teacher.sparse() ? d.sparse_rows : nullptr,
                                              ws_.d_distill_stats, stream_));
    }
    const float inv_tau = static_cast<float>(1.0 / options_.distill.temperature);
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (distill_) {  // both tiles transformed already
        RETURN_IF_ERROR(ComputeDistillTiles(d, rows, v0, cols));
        RETURN_IF_ERROR(LaunchDistillRowStats(
            Tile(rows, v0, cols), TeacherTile(rows, v0, cols), d.labels, inv_tau, tail_bucket_, k_,
            ws_.d_stats, ws_.d_top_values, ws_.d_top_tokens, ws_.d_distill_stats, stream_));
        continue;
      }
      RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
      RETURN_IF_ERROR(LaunchRowStats(Tile(rows, v0, cols), d.labels, transform_, true, k_,
                                     ws_.d_stats, ws_.d_top_values, ws_.d_top_tokens, stream_));
    }
    return absl::OkStatus();
  }

  // Phase 2 of distill: each row's sums of D's and K's summands, tile after tile in order.
  absl::Status RowTerms(const ChunkBuffers& d, int64_t rows) {
    RETURN_IF_ERROR(Cuda(cudaMemsetAsync(ws_.d_terms, 0, rows * sizeof(DistillRowTerms), stream_),
                         "cudaMemsetAsync"));
    const bool resident = tile_cols_ >= v_;  // phase 1 left the only tiles in place
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (!resident) RETURN_IF_ERROR(ComputeDistillTiles(d, rows, v0, cols));
      RETURN_IF_ERROR(LaunchAddTileDistillTerms(Tile(rows, v0, cols), TeacherTile(rows, v0, cols),
                                                divergence_, tail_bucket_, ws_.d_constants,
                                                ws_.d_terms, stream_));
    }
    return absl::OkStatus();
  }

  // The rows' results, gradient constants and gradient bounds, on the device, from the chunk's
  // own copies of the per-row inputs (those the call has).
  absl::Status FinishRows(const ChunkBuffers& d, int slot, int64_t rows) {
    RowInputArrays arrays = RowArrays(d, 0);
    if (options_.policy.sequence_ratio) {
      RETURN_IF_ERROR(LaunchSequenceLogRatios(slot_sequences_[slot], d.sequence_ends, arrays,
                                              finisher_.constants(), ws_.d_stats,
                                              ws_.d_sequence_log_ratios, stream_));
      arrays.sequence_log_ratios = ws_.d_sequence_log_ratios;
    }
    if (distill_) {
      return LaunchFinishDistillRows(
          rows, arrays, finisher_.constants(), options_.distill, in_.teacher.dense(), ws_.d_stats,
          ws_.d_distill_stats, ws_.d_terms, ws_.d_constants, ws_.d_distill_results,
          gradients_ ? ws_.d_distill_grads : nullptr, ws_.d_bounds, stream_);
    }
    return LaunchFinishRows(rows, arrays, finisher_.constants(), ws_.d_stats, ws_.d_results,
                            gradients_ ? ws_.d_row_grads : nullptr, ws_.d_bounds, stream_);
  }

  // The chunk's copies of the per-row inputs the call has, from its row `first` on.
  RowInputArrays RowArrays(const ChunkBuffers& d, int64_t first) const {
    const auto from = [first](const auto* call_has, auto* chunk_copy) {
      return call_has != nullptr ? chunk_copy + first : nullptr;
    };
    RowInputArrays arrays;
    arrays.labels = from(in_.labels, d.labels);
    arrays.token_weights = from(in_.token_weights, d.token_weights);
    arrays.sampling_logprobs = from(in_.sampling_logprobs, d.sampling_logprobs);
    arrays.advantages = from(in_.advantages, d.advantages);
    arrays.reference_logprobs = from(in_.reference_logprobs, d.reference_logprobs);
    arrays.logprob_grads = from(in_.logprob_grads, d.logprob_grads);
    arrays.reduction_scales = from(in_.reduction_scales, d.reduction_scales);
    return arrays;
  }

  // Where dL/da of the chunk's rows from `first` on goes.
  GradientOut GradientCarriage(int64_t first) const {
    GradientOut out;
    out.store = store_;
    out.dtype = product_dtype_;
    out.d_hi = ws_.d_grad_hi != nullptr ? ws_.d_grad_hi + first * ld_ : nullptr;
    out.d_lo = ws_.d_grad_lo != nullptr ? ws_.d_grad_lo + first * ld_ : nullptr;
    out.d_split_scale = ws_.d_split_scale;
    return out;
  }

  // Phases 1 and 2 and dL/da of a window (FinishesRowsInWindows), piece by piece as each piece's
  // rows arrive: each piece's logits products (the student's, a dense teacher's) on the compute
  // stream, into one of two buffers, and its statistics, finished rows and, for gradients, dL/da
  // into the window's 16-bit carriage at the piece's rows on the row stream, while the next
  // piece's products fill the other buffers; so that Gradients' products contract over the whole
  // window while two pieces' fp32 logits are held. The carriage's scale is 1, set before any row
  // is seen: bf16 holds S dL/da at S = 1 as it holds it at any power of two.
  absl::Status FinishWindow(const ChunkBuffers& d, int slot, int64_t rows) {
    const cudaStream_t row_stream = context_.row_stream;
    RETURN_IF_ERROR(
        LaunchResetRows(rows, k_, ws_.d_stats, ws_.d_top_values, ws_.d_top_tokens, stream_));
    if (distill_) {
      RETURN_IF_ERROR(LaunchResetDistillStats(rows, in_.teacher.sparse() ? d.sparse_rows : nullptr,
                                              ws_.d_distill_stats, stream_));
    }
    if (gradients_) {
      RETURN_IF_ERROR(LaunchSplitScale(0, ws_.d_bounds, ws_.d_split_scale, stream_));
    }
    int64_t pieces = 0;
    for (int64_t p0 = 0; p0 < rows; p0 += logit_rows_, ++pieces) {
      const int64_t piece_rows = std::min(logit_rows_, rows - p0);
      const int buffer = static_cast<int>(pieces % 2);
      const LogitTile student{buffer == 0 ? ws_.d_logits : ws_.d_logits_next, piece_rows, v_, ld_,
                              0};
      const LogitTile teacher{buffer == 0 ? ws_.d_teacher_logits : ws_.d_teacher_logits_next,
                              piece_rows, v_, ld_, 0};
      RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream_, context_.piece_copied[slot][pieces], 0),
                           "cudaStreamWaitEvent"));
      // The buffers' last piece is done with them.
      if (pieces >= 2) {
        RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream_, context_.rows_done[buffer], 0),
                             "cudaStreamWaitEvent"));
      }
      RETURN_IF_ERROR(ComputeLogits(hidden_.At(p0 * hidden_.ld), weight_, product_dtype_,
                                    piece_rows, 0, v_, student.d_logits));
      if (in_.teacher.dense()) {
        RETURN_IF_ERROR(ComputeLogits(teacher_hidden_.At(p0 * teacher_hidden_.ld),
                                      *in_.teacher.weight, teacher_product_dtype_, piece_rows, 0,
                                      v_, teacher.d_logits));
      }
      RETURN_IF_ERROR(
          Cuda(cudaEventRecord(context_.logits_ready[buffer], stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(row_stream, context_.logits_ready[buffer], 0),
                           "cudaStreamWaitEvent"));
      if (distill_) {
        RETURN_IF_ERROR(FinishDistillPiece(d, p0, student, teacher, row_stream));
      } else {
        RETURN_IF_ERROR(FinishPiece(d, p0, student, row_stream));
      }
      RETURN_IF_ERROR(
          Cuda(cudaEventRecord(context_.rows_done[buffer], row_stream), "cudaEventRecord"));
    }
    // Every piece's rows are finished before anything reads them (Gradients, CopyResults).
    for (int buffer = 0; buffer < std::min<int64_t>(pieces, 2); ++buffer) {
      RETURN_IF_ERROR(
          Cuda(cudaStreamWaitEvent(stream_, context_.rows_done[buffer], 0), "cudaStreamWaitEvent"));
    }
    return absl::OkStatus();
  }

  // A window's piece of rows from its row `p0` on, its raw logits in `student`: statistics,
  // finished rows, and dL/da into the carriage.
  absl::Status FinishPiece(const ChunkBuffers& d, int64_t p0, const LogitTile& student,
                           cudaStream_t stream) {
    float* d_top_values = k_ > 0 ? ws_.d_top_values + p0 * k_ : nullptr;
    int32_t* d_top_tokens = k_ > 0 ? ws_.d_top_tokens + p0 * k_ : nullptr;
    RETURN_IF_ERROR(LaunchRowStats(student, d.labels + p0, transform_, true, k_, ws_.d_stats + p0,
                                   d_top_values, d_top_tokens, stream));
    RowGradient* d_row_grads = gradients_ ? ws_.d_row_grads + p0 : nullptr;
    RETURN_IF_ERROR(LaunchFinishRows(student.rows, RowArrays(d, p0), finisher_.constants(),
                                     ws_.d_stats + p0, ws_.d_results + p0, d_row_grads,
                                     gradients_ ? ws_.d_bounds + p0 : nullptr, stream));
    if (!gradients_) return absl::OkStatus();
    return LaunchLogitGradients(student, d_row_grads, transform_, /*apply_transform=*/false,
                                entropy_, GradientCarriage(p0), stream);
  }

  // FinishPiece of a distill call, the teacher's tile beside the student's (a dense teacher's raw
  // logits, or to be filled from a sparse teacher's top-k): the three phases of the resident path
  // on the piece's rows.
  absl::Status FinishDistillPiece(const ChunkBuffers& d, int64_t p0, const LogitTile& student,
                                  const LogitTile& teacher, cudaStream_t stream) {
    const TeacherInputs& t = in_.teacher;
    const int64_t rows = student.rows;
    RETURN_IF_ERROR(LaunchTransformLogits(student, transform_, stream));
    if (t.sparse()) {
      RETURN_IF_ERROR(LaunchFillSparseTeacher(teacher, t.top_k, d.teacher_tokens + p0 * t.top_k,
                                              d.teacher_logprobs + p0 * t.top_k, d.sparse_rows + p0,
                                              stream));
    } else {
      RETURN_IF_ERROR(LaunchTransformLogits(teacher, teacher_transform_, stream));
    }
    const float inv_tau = static_cast<float>(1.0 / options_.distill.temperature);
    float* d_top_values = k_ > 0 ? ws_.d_top_values + p0 * k_ : nullptr;
    int32_t* d_top_tokens = k_ > 0 ? ws_.d_top_tokens + p0 * k_ : nullptr;
    RETURN_IF_ERROR(LaunchDistillRowStats(student, teacher, d.labels + p0, inv_tau, tail_bucket_,
                                          k_, ws_.d_stats + p0, d_top_values, d_top_tokens,
                                          ws_.d_distill_stats + p0, stream));
    RETURN_IF_ERROR(LaunchDistillConstants(rows, ws_.d_distill_stats + p0, options_.distill,
                                           ws_.d_constants + p0, stream));
    RETURN_IF_ERROR(
        Cuda(cudaMemsetAsync(ws_.d_terms + p0, 0, rows * sizeof(DistillRowTerms), stream),
             "cudaMemsetAsync"));
    RETURN_IF_ERROR(LaunchAddTileDistillTerms(student, teacher, divergence_, tail_bucket_,
                                              ws_.d_constants + p0, ws_.d_terms + p0, stream));
    DistillRowGradient* d_grads = gradients_ ? ws_.d_distill_grads + p0 : nullptr;
    RETURN_IF_ERROR(LaunchFinishDistillRows(
        rows, RowArrays(d, p0), finisher_.constants(), options_.distill, t.dense(),
        ws_.d_stats + p0, ws_.d_distill_stats + p0, ws_.d_terms + p0, ws_.d_constants + p0,
        ws_.d_distill_results + p0, d_grads, gradients_ ? ws_.d_bounds + p0 : nullptr, stream));
    if (!gradients_) return absl::OkStatus();
    return LaunchDistillLogitGradients(student, teacher, d_grads, divergence_, tail_bucket_,
                                       transform_, GradientCarriage(p0), stream);
  }

  // dL/da of one tile into the logits tile (or its 16-bit carriage), recomputing the tile where
  // the vocabulary is tiled.
  absl::Status TileGradients(const ChunkBuffers& d, int64_t rows, int64_t v0, int64_t cols,
                             bool resident, const GradientOut& out) {
    if (distill_) {
      if (!resident) RETURN_IF_ERROR(ComputeDistillTiles(d, rows, v0, cols));
      return LaunchDistillLogitGradients(Tile(rows, v0, cols), TeacherTile(rows, v0, cols),
                                         ws_.d_distill_grads, divergence_, tail_bucket_, transform_,
                                         out, stream_);
    }
    if (!resident) RETURN_IF_ERROR(ComputeLogits(rows, v0, cols));
    return LaunchLogitGradients(Tile(rows, v0, cols), ws_.d_row_grads, transform_, !resident,
                                entropy_, out, stream_);
  }

  // Phase 3: dL/da per tile (a window's is carried already), then dh += dA W and dW += dA^T h, and
  // dL/dh on its way to the host.
  // For 16-bit products dA enters as S dA rounded to 16 bits once (one GEMM each), or with exact
  // gradients as hi + lo (two GEMMs each); the GEMMs divide by S.
  absl::Status Gradients(const ChunkBuffers& d, int slot, int64_t r0, int64_t rows) {
    const GradientOut out = GradientCarriage(0);
    std::vector<Matrix> parts;
    if (store_ == GradientStore::kFloat32) {
      parts = {{ws_.d_logits, DType::kFloat32, ld_}};
    } else {
      // A window's dL/da is carried already, at the scale FinishWindow set.
      if (!windowed_) {
        RETURN_IF_ERROR(LaunchSplitScale(rows, ws_.d_bounds, ws_.d_split_scale, stream_));
      }
      parts = {{ws_.d_grad_hi, product_dtype_, ld_}};
      if (store_ == GradientStore::kSplit) parts.push_back({ws_.d_grad_lo, product_dtype_, ld_});
    }
    const bool fp32_out = out_.grad_hidden_dtype == DType::kFloat32;
    float* d_grad_hidden = nullptr;
    if (shape_.grad_hidden) {
      // The slot's last dL/dh is on the host.
      RETURN_IF_ERROR(
          Cuda(cudaStreamWaitEvent(stream_, context_.grad_copied[slot], 0), "cudaStreamWaitEvent"));
      d_grad_hidden =
          fp32_out ? static_cast<float*>(ws_.d_grad_hidden_out[slot]) : ws_.d_grad_hidden32;
      RETURN_IF_ERROR(Cuda(cudaMemsetAsync(d_grad_hidden, 0, rows * h_ * sizeof(float), stream_),
                           "cudaMemsetAsync"));
    }
    const bool resident = tile_cols_ >= v_;  // phase 1 left z of the only tile in place
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (!windowed_) RETURN_IF_ERROR(TileGradients(d, rows, v0, cols, resident, out));
      if (shape_.grad_hidden) {
        RETURN_IF_ERROR(ForEachWeightSlab(
            weight_, product_dtype_, v0, cols, [&](const Matrix& w, int64_t s0, int64_t slab_rows) {
              for (const Matrix& part : parts) {
                RETURN_IF_ERROR(GradientProduct(false, rows, h_, slab_rows, part.At(s0 - v0), w,
                                                /*accumulate=*/true, d_grad_hidden));
              }
              return absl::OkStatus();
            }));
        // dL/dh is whole after the last tile's product: it leaves for the host while the tile's
        // dL/dW product runs (at the Llama 3 8B head, 128 MiB of fp32 dL/dh for 8192 rows take
        // about 5 ms to copy, under the 11 ms of that product).
        if (v0 + cols == v_) RETURN_IF_ERROR(SendGradHidden(slot, r0, rows, d_grad_hidden));
      }
      if (d_grad_weight_ != nullptr) {
        // The first product into dL/dW stores when the caller asked for dL/dW alone.
        bool accumulate = !(options_.overwrite_grad_weight && r0 == 0);
        for (const Matrix& part : parts) {
          RETURN_IF_ERROR(GradientProduct(true, cols, h_, rows, part, hidden_, accumulate,
                                          d_grad_weight_ + v0 * h_));
          accumulate = true;
        }
      }
    }
    return absl::OkStatus();
  }

  // The chunk's finished dL/dh (fp32 in d_grad_hidden) in the caller's dtype, copied on the output
  // stream to the caller's page-locked rows or the slot's pinned staging.
  absl::Status SendGradHidden(int slot, int64_t r0, int64_t rows, const float* d_grad_hidden) {
    if (out_.grad_hidden_dtype != DType::kFloat32) {
      RETURN_IF_ERROR(LaunchConvertFromFloat(d_grad_hidden, rows * h_, out_.grad_hidden_dtype,
                                             ws_.d_grad_hidden_out[slot], stream_));
    }
    RETURN_IF_ERROR(Cuda(cudaEventRecord(context_.grad_ready[slot], stream_), "cudaEventRecord"));
    RETURN_IF_ERROR(
        Cuda(cudaStreamWaitEvent(output_, context_.grad_ready[slot], 0), "cudaStreamWaitEvent"));
    const size_t row_bytes = DTypeSize(out_.grad_hidden_dtype) * static_cast<size_t>(h_);
    void* destination = grad_hidden_page_locked_
                            ? static_cast<char*>(out_.grad_hidden) + r0 * row_bytes
                            : staging_.h_grad_hidden[slot];
    RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(destination, ws_.d_grad_hidden_out[slot], rows * row_bytes,
                                         cudaMemcpyDeviceToHost, output_),
                         "cudaMemcpyAsync"));
    return Cuda(cudaEventRecord(context_.grad_copied[slot], output_), "cudaEventRecord");
  }

  const BatchInputs& in_;
  const WeightView& weight_;
  const LossOptions& options_;
  const TokenOutputs& out_;
  const ProblemShape& shape_;
  const CudaWorkspace& ws_;
  const HostStaging& staging_;
  const StreamContext& context_;
  cudaStream_t stream_;
  cudaStream_t input_;
  cudaStream_t output_;
  cublasHandle_t cublas_;
  float* d_grad_weight_;
  const int64_t h_;
  const int64_t v_;
  const int64_t chunk_rows_;
  const int64_t logit_rows_;  // rows of fp32 logits held at once
  const bool windowed_;       // chunks finished in pieces of logit_rows_ (FinishesRowsInWindows)
  const int64_t tile_cols_;
  const int64_t ld_;
  const int k_;
  const DType product_dtype_;
  const DType teacher_product_dtype_;
  const GradientStore store_;
  const bool gradients_;
  const bool distill_;
  const bool entropy_;
  const DivergenceKind divergence_;
  const bool tail_bucket_;  // a sparse teacher's tail bucket (distill_math.h)
  const RowFinisher finisher_;
  const LogitTransform transform_;
  const LogitTransform teacher_transform_;
  // The caller's rows, or its dL/dh, in page-locked memory: copied directly, not staged.
  const bool rows_page_locked_;
  const bool grad_hidden_page_locked_;
  // Under sequence_ratio: SendInputs' place in the sequences, and each slot's count of them.
  SequenceCursor sequences_{in_.ratio_sequence_lengths};
  int64_t slot_sequences_[2] = {};
  Matrix hidden_{};          // the chunk's hidden rows in the product dtype
  Matrix teacher_hidden_{};  // a dense teacher's, in its product dtype
};

ChunkedCompute::ChunkedCompute(const BatchInputs& in, const WeightView& weight,
                               const LossOptions& options, const TokenOutputs& out,
                               DeviceBuffer* grad_weight, const CallPlan& call,
                               const CudaWorkspace& ws, const HostStaging& staging,
                               const StreamContext& context)
    : impl_(std::make_unique<Impl>(in, weight, options, out, grad_weight, call, ws, staging,
                                   context)) {}

ChunkedCompute::~ChunkedCompute() = default;

absl::Status ChunkedCompute::Run() { return impl_->Run(); }

void ChunkedCompute::Finish(BatchSummary& summary) const { impl_->Finish(summary); }

}  // namespace lossd::cuda
