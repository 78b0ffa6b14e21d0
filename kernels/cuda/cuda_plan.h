// The CUDA backend's host-side decisions, kept free of CUDA types so that the CPU test suites
// cover them: the dtype its products run in, the default workspace budget, the layout of a call's
// workspace (which the planner measures and Compute carves) and of its pinned host staging, and
// the chunking.
#ifndef LOSSD_KERNELS_CUDA_CUDA_PLAN_H_
#define LOSSD_KERNELS_CUDA_CUDA_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend_impl.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::cuda {

// Token chunks of up to 16384 rows over the whole vocabulary when they fit: every chunk streams W
// through three products, so fewer, longer chunks amortize it; at the Llama 3 8B head and the
// default budget a chunk holds 8192 rows (the dL/dW product's K).
inline constexpr TileLimits kCudaTileLimits = {
    /*max_token_chunk=*/16384,
    /*min_single_pass_rows=*/256,
    /*two_pass_token_chunk=*/4096,
    /*min_vocab_chunk=*/1024,
    /*vocab_chunk_multiple=*/256,
    /*token_chunk_multiple=*/128,
    /*forward_token_chunk=*/0,
};

// Rows of W converted to fp32 at a time when the products run in fp32 but W is stored in 16 bits.
inline constexpr int64_t kWeightSlabRows = 4096;
// Logit tiles' rows start on 64-byte boundaries (16 fp32), as cuBLAS's tensor-core kernels prefer
// and the row kernels' 16-byte loads need.
inline constexpr int64_t kLeadingDimensionMultiple = 16;
// The split scale S keeps |S dL/da| below 2^kSplitMaxExponent, under fp16's largest value (~2^16).
inline constexpr int kSplitMaxExponent = 14;

// The longest contraction one cuBLAS call runs in the engine. Tensor cores accumulate in fp32 but
// may truncate rather than round as they add; a product over K = V = 128256 terms (dL/dh at a
// Llama 3 head) would let that bias grow with K. Longer products are split into blocks of at most
// this many terms, each added onto C in fp32 (beta = 1): one more pass over C per block.
inline constexpr int64_t kMaxProductDepth = 16384;

// Where the block of K starting at k0 begins in a row-major operand of C = op(A) op(B), in
// elements: op(A) is [m, k], stored [m, k] (its columns: k0) or, transposed, [k, m] (its rows:
// k0 * ld); op(B) is [k, n], stored [k, n] (rows) or, transposed, [n, k] (columns).
inline int64_t BlockOffsetA(bool transpose_a, int64_t k0, int64_t ld) {
  return transpose_a ? k0 * ld : k0;
}
inline int64_t BlockOffsetB(bool transpose_b, int64_t k0, int64_t ld) {
  return transpose_b ? k0 : k0 * ld;
}

// The default workspace budget: a quarter of the device memory free when asked (W, its gradient
// and optimizer state are allocated by then on a serving GPU, or are yet to come on an empty one),
// at least Backend::kBaseWorkspaceBudget and at most 8 GiB, past which longer chunks buy nothing:
// at the Llama 3 8B head 8 GiB holds a chunk of about 11000 rows over the whole vocabulary.
inline constexpr size_t kMaxDefaultWorkspaceBudget = size_t{8} << 30;
size_t CudaDefaultWorkspaceBudget(size_t free_bytes);

// Both GEMM operands in one dtype: the shared one when hidden and W agree (tensor cores for
// 16-bit), else fp32 with the 16-bit side converted.
DType ProductDType(DType hidden_dtype, DType weight_dtype);
DType ProductDType(const ProblemShape& shape);
DType TeacherProductDType(const ProblemShape& shape);

int64_t LeadingDimension(int64_t cols);

// How dL/da enters the gradient products.
enum class GradientStore : int {
  kFloat32 = 0,  // fp32 products: in place in the logits tile
  kRounded = 1,  // 16-bit products: rounded once to 16 bits (the default)
  kSplit = 2,    // 16-bit products with exact gradients: two 16-bit halves, hi + lo
};
GradientStore GradientStoreOf(const ProblemShape& shape);

// A chunk's inputs as they were sent, in one of two slots of pinned host memory (h_inputs) that
// they pass through, and of device memory (d_inputs) that they are computed from, so that the next
// chunk's rows can arrive while this one computes. Laid out the same way in both.
struct ChunkBuffers {
  void* hidden;          // [Nc, H] in hidden_dtype
  int64_t* labels;       // [Nc], -1 where the call has no labels
  float* token_weights;  // [Nc] each, filled where the call has them
  float* sampling_logprobs;
  float* advantages;
  float* reference_logprobs;
  float* logprob_grads;
  double* reduction_scales;
  void* teacher_hidden;           // dense teacher: [Nc, H_t] in its dtype
  int32_t* teacher_tokens;        // sparse teacher: [Nc, k_t]
  float* teacher_logprobs;        // [Nc, k_t]
  SparseTeacherRow* sparse_rows;  // [Nc] what the sparse teacher gives outside its top-k
  int32_t* sequence_ends;  // sequence_ratio: [Nc] the end row of each of the chunk's sequences
};
ChunkBuffers CarveChunkBuffers(WorkspaceArena& arena, const ProblemShape& shape, int64_t rows);

// The workspace of one call, carved from the caller's buffer.
struct CudaWorkspace {
  ChunkBuffers d_inputs[2];
  float* d_hidden32;          // [Nc, H] when the products run in fp32 but hidden is 16-bit
  float* d_teacher_hidden32;  // [Nc, H_t] likewise for a dense teacher
  float* d_weight32;          // [slab, H] when the products run in fp32 but W is 16-bit
  float* d_logits;            // [logit rows, ld]: a, then z, then dL/da (fp32 products)
  float* d_logits_next;       // [logit rows, ld] in a window: the next piece's, computed meanwhile
  uint16_t* d_grad_hi;        // [Nc, ld] 16-bit products: S dL/da rounded, or its high half
  uint16_t* d_grad_lo;        // [Nc, ld] exact gradients: S dL/da - hi
  float* d_teacher_logits;    // [logit rows, ld] a distill call's teacher tile
  float* d_teacher_logits_next;  // [logit rows, ld] in a window: the next piece's
  // dL/dh accumulates in fp32 into d_grad_hidden32, or, wanted in fp32, straight into the slot
  // d_grad_hidden_out[c % 2] that it leaves the device from.
  float* d_grad_hidden32;               // [Nc, H] dL/dh wanted in 16 bits
  void* d_grad_hidden_out[2];           // [Nc, H] in grad_hidden_dtype
  RowStats* d_stats;                    // [Nc]
  float* d_sequence_log_ratios;         // [Nc] sequence_ratio: log s of each row's sequence
  float* d_top_values;                  // [Nc, k], best first
  int32_t* d_top_tokens;                // [Nc, k]
  RowResult* d_results;                 // [Nc]
  RowGradient* d_row_grads;             // [Nc]
  double* d_bounds;                     // [Nc] max_v |dL/da_v| of each row
  float* d_split_scale;                 // [4]: S, 1 / S, 0 and 1 (LaunchSplitScale)
  DistillStats* d_distill_stats;        // [Nc]
  DistillRowConstants* d_constants;     // [Nc]
  DistillRowTerms* d_terms;             // [Nc]
  DistillRowResult* d_distill_results;  // [Nc]
  DistillRowGradient* d_distill_grads;  // [Nc]
};

// Carves the workspace of chunks of `rows` x `cols` whose fp32 logits are held `logit_rows` at a
// time (`rows` but in windows, ChunkPlan::logit_rows) for `shape`; with a null arena base it only
// measures (arena.used() is then the workspace's size).
CudaWorkspace CarveCudaWorkspace(WorkspaceArena& arena, const ProblemShape& shape, int64_t rows,
                                 int64_t cols, int64_t logit_rows);

// Windows of rows (ChunkPlan::logit_rows < token_chunk). A chunk holds the fp32 logits of all of
// its rows (4 GiB for 8192 rows at the Llama 3 8B head), and each chunk's dL/dW product streams
// the fp32 [V, H] dL/dW through HBM once more, so under a small budget short chunks are bound by
// that traffic. A window holds the fp32 logits of a piece of its rows at a time, finishes them,
// and for a training call carries their dL/da in 16 bits for all of its rows, whose dL/dh and
// dL/dW products then contract over the whole window: at 1 GiB and that head, 1664 rows a product
// instead of 1280, and at the default budget the same products in 2.8 GiB instead of 6.25. Each
// piece's rows are copied to the device on their own, so the first piece computes while the rest
// arrive, and a window holds two pieces' logits, so that one piece's row kernels (reading HBM)
// run beside the next piece's logits product (computing) instead of after it. A call qualifies
// when nothing joins its rows but the products (no sequence ratio), when its rows and head share
// a dtype and so do a dense teacher's (nothing is widened again per piece), and for gradients when
// that dtype is bf16, whose carriage of dL/da needs no scale (bf16 has fp32's exponent range, so
// the window's one scale of 1 serves rows it has not seen yet; fp16 needs a scale from every
// row's bound first, and fp32 keeps dL/da in the logits themselves).
bool FinishesRowsInWindows(const ProblemShape& shape);
// False when the environment sets LOSSD_CUDA_WINDOWS=0: every call then takes chunks, so that a
// benchmark can time windows against them in one run.
bool WindowsEnabled();
// Pieces of 512 rows keep the logits product compute-bound (1024 flops per byte of W it reads,
// against about 300 per byte of HBM on an H100) while the window's 16-bit dL/da takes most of the
// budget; halved where the budget holds no window of twice the piece, but not below 256 rows,
// under which the product would wait on W.
inline constexpr int64_t kWindowLogitRows = 512;
inline constexpr int64_t kMinWindowLogitRows = 256;
inline constexpr int64_t kMaxPiecesPerWindow =
    kCudaTileLimits.max_token_chunk / kMinWindowLogitRows;

// The rows of fp32 logits a plan holds at once.
inline int64_t LogitRows(const ChunkPlan& plan) {
  return plan.logit_rows > 0 ? plan.logit_rows : plan.token_chunk;
}

// The chunking of a call whose workspace fits `budget_bytes`: ChooseChunkPlan with the layout
// above, then, where the call qualifies and its chunks take one pass over the vocabulary, windows
// of at least as many rows as those chunks.
absl::StatusOr<ChunkPlan> PlanCudaCall(const ProblemShape& shape, size_t budget_bytes);

// The pinned host memory of a call: two input slots and two dL/dh slots of `rows` rows each, and
// every row's results for `num_tokens` rows (copied back chunk by chunk, read once at the end).
struct HostStaging {
  ChunkBuffers h_inputs[2];
  void* h_grad_hidden[2];               // [Nc, H] in grad_hidden_dtype
  RowStats* h_stats;                    // [N]
  RowResult* h_results;                 // [N]
  DistillRowResult* h_distill_results;  // [N] distill
  float* h_top_values;                  // [N, k]
  int32_t* h_top_tokens;                // [N, k]
};
HostStaging CarveHostStaging(WorkspaceArena& arena, const ProblemShape& shape, int64_t rows);

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_PLAN_H_
