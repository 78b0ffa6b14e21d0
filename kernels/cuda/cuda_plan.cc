#include "kernels/cuda/cuda_plan.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "lossd/common/status_macros.h"

namespace lossd::cuda {

size_t CudaDefaultWorkspaceBudget(size_t free_bytes) {
  return std::clamp(free_bytes / 4, Backend::kBaseWorkspaceBudget, kMaxDefaultWorkspaceBudget);
}

DType ProductDType(DType hidden_dtype, DType weight_dtype) {
  return hidden_dtype == weight_dtype ? hidden_dtype : DType::kFloat32;
}
DType ProductDType(const ProblemShape& s) { return ProductDType(s.hidden_dtype, s.weight_dtype); }
DType TeacherProductDType(const ProblemShape& s) {
  return ProductDType(s.teacher.hidden_dtype, s.teacher.weight_dtype);
}

int64_t LeadingDimension(int64_t cols) {
  return (cols + kLeadingDimensionMultiple - 1) / kLeadingDimensionMultiple *
         kLeadingDimensionMultiple;
}

GradientStore GradientStoreOf(const ProblemShape& shape) {
  if (ProductDType(shape) == DType::kFloat32) return GradientStore::kFloat32;
  return shape.exact_gradients ? GradientStore::kSplit : GradientStore::kRounded;
}

namespace {

// Elements of the fp32 slab of a head whose products run in fp32 from a 16-bit W; else 0.
int64_t SlabFloats(DType weight_dtype, DType product, int64_t cols, int64_t h) {
  return weight_dtype != product ? std::min(cols, kWeightSlabRows) * h : 0;
}

int64_t Bytes(int64_t count, DType dtype) { return count * static_cast<int64_t>(DTypeSize(dtype)); }

}  // namespace

ChunkBuffers CarveChunkBuffers(WorkspaceArena& arena, const ProblemShape& s, int64_t rows) {
  ChunkBuffers b{};
  b.hidden = arena.Take<char>(Bytes(rows * s.hidden_size, s.hidden_dtype));
  b.labels = arena.Take<int64_t>(rows);
  b.token_weights = arena.Take<float>(rows);
  b.sampling_logprobs = arena.Take<float>(rows);
  b.advantages = arena.Take<float>(rows);
  b.reference_logprobs = arena.Take<float>(rows);
  b.logprob_grads = arena.Take<float>(rows);
  b.reduction_scales = arena.Take<double>(rows);
  const TeacherShape& t = s.teacher;
  if (t.kind == TeacherKind::kDense) {
    b.teacher_hidden = arena.Take<char>(Bytes(rows * t.hidden_size, t.hidden_dtype));
  } else if (t.kind == TeacherKind::kSparse) {
    b.teacher_tokens = arena.Take<int32_t>(rows * t.top_k);
    b.teacher_logprobs = arena.Take<float>(rows * t.top_k);
    b.sparse_rows = arena.Take<SparseTeacherRow>(rows);
  }
  if (s.sequence_ratio) b.sequence_ends = arena.Take<int32_t>(rows);
  return b;
}

CudaWorkspace CarveCudaWorkspace(WorkspaceArena& arena, const ProblemShape& s, int64_t rows,
                                 int64_t cols, int64_t logit_rows) {
  CudaWorkspace w{};
  const int64_t h = s.hidden_size;
  const DType product = ProductDType(s);
  const bool gradients = WantsGradients(s);
  const TeacherShape& t = s.teacher;
  const bool distill = t.kind != TeacherKind::kNone;
  const bool dense_teacher = t.kind == TeacherKind::kDense;
  for (ChunkBuffers& in : w.d_inputs) in = CarveChunkBuffers(arena, s, rows);
  if (s.hidden_dtype != product) w.d_hidden32 = arena.Take<float>(rows * h);
  if (dense_teacher && t.hidden_dtype != TeacherProductDType(s)) {
    w.d_teacher_hidden32 = arena.Take<float>(rows * t.hidden_size);
  }
  const int64_t slab = std::max(
      SlabFloats(s.weight_dtype, product, cols, h),
      dense_teacher ? SlabFloats(t.weight_dtype, TeacherProductDType(s), cols, t.hidden_size) : 0);
  if (slab > 0) w.d_weight32 = arena.Take<float>(slab);
  const int64_t ld = LeadingDimension(cols);
  w.d_logits = arena.Take<float>(logit_rows * ld);
  if (logit_rows < rows) w.d_logits_next = arena.Take<float>(logit_rows * ld);
  const GradientStore store = GradientStoreOf(s);
  if (gradients && store != GradientStore::kFloat32) {
    w.d_grad_hi = arena.Take<uint16_t>(rows * ld);
    if (store == GradientStore::kSplit) w.d_grad_lo = arena.Take<uint16_t>(rows * ld);
  }
  if (distill) {
    w.d_teacher_logits = arena.Take<float>(logit_rows * ld);
    if (logit_rows < rows) w.d_teacher_logits_next = arena.Take<float>(logit_rows * ld);
  }
  if (s.grad_hidden) {
    if (s.grad_hidden_dtype != DType::kFloat32) w.d_grad_hidden32 = arena.Take<float>(rows * h);
    for (void*& out : w.d_grad_hidden_out) {
      out = arena.Take<char>(Bytes(rows * h, s.grad_hidden_dtype));
    }
  }
  w.d_stats = arena.Take<RowStats>(rows);
  if (s.sequence_ratio) w.d_sequence_log_ratios = arena.Take<float>(rows);
  if (s.top_k > 0) {
    w.d_top_values = arena.Take<float>(rows * s.top_k);
    w.d_top_tokens = arena.Take<int32_t>(rows * s.top_k);
  }
  w.d_split_scale = arena.Take<float>(4);
  if (!distill) {
    w.d_results = arena.Take<RowResult>(rows);
    if (gradients) {
      w.d_row_grads = arena.Take<RowGradient>(rows);
      w.d_bounds = arena.Take<double>(rows);
    }
    return w;
  }
  w.d_distill_stats = arena.Take<DistillStats>(rows);
  w.d_constants = arena.Take<DistillRowConstants>(rows);
  w.d_terms = arena.Take<DistillRowTerms>(rows);
  w.d_distill_results = arena.Take<DistillRowResult>(rows);
  if (gradients) {
    w.d_distill_grads = arena.Take<DistillRowGradient>(rows);
    w.d_bounds = arena.Take<double>(rows);
  }
  return w;
}

bool WindowsEnabled() {
  const char* setting = std::getenv("LOSSD_CUDA_WINDOWS");
  return setting == nullptr || std::string_view(setting) != "0";
}

bool FinishesRowsInWindows(const ProblemShape& s) {
  const TeacherShape& t = s.teacher;
  return !s.sequence_ratio && s.hidden_dtype == s.weight_dtype &&
         (t.kind != TeacherKind::kDense || t.hidden_dtype == t.weight_dtype) &&
         (!WantsGradients(s) || s.hidden_dtype == DType::kBFloat16);
}

absl::StatusOr<ChunkPlan> PlanCudaCall(const ProblemShape& shape, size_t budget_bytes) {
  const auto bytes_for = [&](int64_t rows, int64_t cols, int64_t logit_rows) {
    WorkspaceArena arena(nullptr, 0);
    CarveCudaWorkspace(arena, shape, rows, cols, logit_rows);
    return arena.used();
  };
  ASSIGN_OR_RETURN(ChunkPlan chunks, ChooseChunkPlan(shape, budget_bytes, kCudaTileLimits,
                                                     [&](int64_t rows, int64_t cols) {
                                                       return bytes_for(rows, cols, rows);
                                                     }));
  const int64_t v = shape.vocab_size;
  const int64_t n = std::max<int64_t>(shape.num_tokens, 1);
  const int64_t max_rows = std::min(n, kCudaTileLimits.max_token_chunk);
  if (!WindowsEnabled() || !FinishesRowsInWindows(shape) || chunks.vocab_chunk != v) {
    return chunks;
  }
  for (int64_t piece = kWindowLogitRows; piece >= kMinWindowLogitRows; piece /= 2) {
    const int64_t fitting = LargestFitting(
        piece, max_rows, [&](int64_t rows) { return bytes_for(rows, v, piece) <= budget_bytes; });
    if (fitting < 2 * piece) continue;  // a window is at least two whole pieces
    const int64_t rows = AlignedTokenChunk(n, fitting, kCudaTileLimits.token_chunk_multiple);
    if (rows < chunks.token_chunk) break;  // smaller pieces would only slow the logits product
    return ChunkPlan{rows, v, bytes_for(rows, v, piece), piece};
  }
  return chunks;
}

HostStaging CarveHostStaging(WorkspaceArena& arena, const ProblemShape& s, int64_t rows) {
  HostStaging staging{};
  for (ChunkBuffers& in : staging.h_inputs) in = CarveChunkBuffers(arena, s, rows);
  if (s.grad_hidden) {
    for (void*& out : staging.h_grad_hidden) {
      out = arena.Take<char>(Bytes(rows * s.hidden_size, s.grad_hidden_dtype));
    }
  }
  const int64_t n = s.num_tokens;
  staging.h_stats = arena.Take<RowStats>(n);
  if (s.teacher.kind == TeacherKind::kNone) {
    staging.h_results = arena.Take<RowResult>(n);
  } else {
    staging.h_distill_results = arena.Take<DistillRowResult>(n);
  }
  if (s.top_k > 0) {
    staging.h_top_values = arena.Take<float>(n * s.top_k);
    staging.h_top_tokens = arena.Take<int32_t>(n * s.top_k);
  }
  return staging;
}

}  // namespace lossd::cuda
