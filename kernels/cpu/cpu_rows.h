// Pieces of the CPU backend that its two calls share, the cross-entropy and policy call
// (cpu_backend.cc) and the distill call (cpu_distill.cc): conversions, the products of hidden rows
// with W, the statistics of a row over a tile, and the skeleton of a call (CpuChunkCall): its
// buffers per token chunk, the loop over the chunks and the steps each chunk takes the same way.
// Internal to the CPU backend.
#ifndef LOSSD_KERNELS_CPU_CPU_ROWS_H_
#define LOSSD_KERNELS_CPU_CPU_ROWS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/backend_impl.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::cpu {

// Rows of W converted to fp32 at a time when W is stored in 16 bits (OpenBLAS has no bf16 GEMM):
// about 16 MiB of them, and at least 1024 rows. Each slab is a GEMM of its own; at H = 1024,
// slabs of 4096 rows ran a forward+backward pass about 5% faster than slabs of 1024 (fewer
// repacks of the hidden states, fewer passes over dL/dh), and at H = 2048 no slower.
constexpr int64_t kWeightSlabBytes = int64_t{16} << 20;
constexpr int64_t kMinWeightSlabRows = 1024;
constexpr int64_t WeightSlabRows(int64_t hidden_size) {
  return std::max<int64_t>(kMinWeightSlabRows, kWeightSlabBytes / (hidden_size * 4));
}

// Rows are processed in blocks of kSumBlock columns: sums run in fp32 within a block (vectorized)
// and in double across blocks, so the rounding error stays near kSumBlock * 2^-24 whatever V is.
constexpr int64_t kSumBlock = 256;
constexpr int64_t BlocksPerRow(int64_t cols) { return (cols + kSumBlock - 1) / kSumBlock; }

// Row loops marked LOSSD_ROW_LOOP are compiled twice, for AVX2 + FMA (x86-64-v3) and for baseline
// x86-64, and the dynamic loader picks one per process. The two differ in the last bits (the AVX2
// copy fuses multiply-adds and sums 8 lanes at a time), but on one machine every call runs the same
// copy, so identical calls still give identical bits.
//
// Not under ThreadSanitizer: the loader runs a multiversioned function's resolver before TSan is
// initialized, and GCC and Clang (before 22, llvm-project#163369) instrument it, so the program
// crashes at load.
#if defined(__SANITIZE_THREAD__)
#define LOSSD_ROW_LOOP
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOSSD_ROW_LOOP
#endif
#endif
#ifndef LOSSD_ROW_LOOP
#define LOSSD_ROW_LOOP __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif

// Elements [offset, offset + count) of src as fp32, and back.
void ConvertToFloat(const void* src, DType dtype, int64_t offset, int64_t count, float* dst);
void ConvertFromFloat(const float* src, int64_t count, DType dtype, void* dst, int64_t offset);

// Calls fn(w_slab, slab_first_row, slab_rows) over rows [v0, v0 + cols) of W as fp32: W itself when
// it is fp32, else slabs converted into `scratch`.
template <typename Fn>
void ForEachWeightSlab(const WeightView& w, int64_t v0, int64_t cols, float* scratch, Fn fn) {
  const int64_t h = w.hidden_size;
  if (w.dtype == DType::kFloat32) {
    fn(static_cast<const float*>(w.data->data()) + v0 * h, v0, cols);
    return;
  }
  const int64_t slab_rows = WeightSlabRows(h);
  for (int64_t s0 = v0; s0 < v0 + cols; s0 += slab_rows) {
    const int64_t rows = std::min(slab_rows, v0 + cols - s0);
    ConvertToFloat(w.data->data(), w.dtype, s0 * h, rows * h, scratch);
    fn(scratch, s0, rows);
  }
}

// z[:, 0:cols] = transform(h W[v0:v0+cols]^T), leading dimension ld. With onto_zero the caller
// vouches that z[:, 0:cols] holds zeros: the product adds onto it (beta = 1).
void ComputeLogits(const float* hidden32, int64_t rows, const WeightView& w, int64_t v0,
                   int64_t cols, float* weight32, const LogitTransform& transform, float* z,
                   int64_t ld, bool onto_zero);

// The products of a token chunk's dL/da tiles: dh += dA W (in fp32: the caller's rows when it
// wants fp32, else `grad_hidden_scratch`, converted by Finish) and dW[v0 : v0 + cols] += dA^T h,
// stored instead of added when `store_grad_weight` (the first chunk of a call that asked for its
// dL/dW alone: every tile's dW rows are its own).
class TileProducts {
 public:
  TileProducts(const TokenOutputs& out, const WeightView& weight, int64_t r0, int64_t rows,
               const float* hidden32, float* grad_hidden_scratch, float* weight32,
               float* grad_weight32, bool store_grad_weight);
  // The products of dA = grad_logits[rows, 0:cols] (leading dimension ld), columns [v0, v0 + cols).
  void Add(const float* grad_logits, int64_t ld, int64_t v0, int64_t cols);
  // dL/dh into the caller's dtype.
  void Finish();

 private:
  const TokenOutputs& out_;
  const WeightView& weight_;
  const int64_t r0_;
  const int64_t rows_;
  const int64_t h_;
  const float* hidden32_;
  float* weight32_;
  float* grad_weight32_;
  bool store_grad_weight_;
  float* grad_hidden32_ = nullptr;
};

// A row's k largest (value, token) so far, best first; k = 0 when no top-k is asked for.
struct TopKList {
  int k = 0;
  float* values = nullptr;
  int32_t* tokens = nullptr;
};

// What the statistics pass of one tile computes beyond the max, argmax and sum of exponentials.
struct TileStatsWork {
  bool extra_sums;  // sum_z and sum_exp_shifted: only label smoothing and entropy read them
  bool store_exp;   // z[c] <- exp(z[c] - m_b) with m_b the running max at z's block
  bool zero_after;  // z[c] <- 0 once read, while in L1, for the next product to add onto
};

// The two row loops other files call are plain functions that call their LOSSD_ROW_LOOP clones in
// cpu_backend.cc: Clang 14 compiles a call to a target_clones function that is declared, not
// defined, in the calling file as a call to its resolver, which returns a function pointer, so
// the caller would read garbage for its result.

// max_j |x_j|.
float MaxAbs(const float* x, int64_t count);

// A row's statistics over one vocabulary tile z[0:cols] holding columns [v0, v0 + cols), read
// once; see cpu_backend.cc.
RowStats TileRowStats(float* z, int64_t cols, int64_t v0, int64_t label, TileStatsWork work,
                      const TopKList& top, float* block_max);

// What a call of either kind keeps per token chunk of Nc rows and vocabulary tile of Vc columns,
// besides its own per-row results.
struct ChunkBuffers {
  float* logits;          // [Nc, Vc]: the student's z, then dL/da in place
  float* hidden32;        // [Nc, H] when the hidden states are not fp32
  float* grad_hidden32;   // [Nc, H] when dL/dh is wanted in 16 bits
  float* weight32;        // a slab of W (or of a teacher's head) as fp32, when 16-bit
  RowStats* stats;        // [Nc] the student's
  float* hidden_max_abs;  // [Nc] with dL/dW: max_j |h_ij|, for its bound
  float* top_values;      // [Nc, k], best first
  int32_t* top_tokens;    // [Nc, k]
};

// Rows of the slab buffer for a 16-bit head of hidden size h, tiles of `cols` columns; 0 for fp32.
int64_t WeightSlabFloats(DType dtype, int64_t cols, int64_t h);

// The ChunkBuffers of a call of `shape`, with room for `weight_slab_floats` of slab.
ChunkBuffers CarveChunkBuffers(WorkspaceArena& arena, const ProblemShape& shape, int64_t rows,
                               int64_t cols, int64_t weight_slab_floats);

// The skeleton both calls are built on: per token chunk, its rows loaded as fp32, then the
// call's own phases (statistics, finishing, gradients), which use the steps below; the summary
// closed once every row was emitted.
class CpuChunkCall {
 protected:
  CpuChunkCall(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
               const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
               const ChunkBuffers& buffers)
      : in_(in),
        weight_(weight),
        options_(options),
        out_(out),
        buffers_(buffers),
        sequence_log_ratios_(options.policy.sequence_ratio ? in.num_tokens : 0),
        sequences_(in.ratio_sequence_lengths),
        finisher_(in, weight.vocab_size, options, out,
                  sequence_log_ratios_.empty() ? nullptr : sequence_log_ratios_.data()),
        grad_weight32_(grad_weight != nullptr ? static_cast<float*>(grad_weight->data()) : nullptr),
        h_(weight.hidden_size),
        v_(weight.vocab_size),
        chunk_rows_(call.plan.token_chunk),
        tile_cols_(call.plan.vocab_chunk),
        k_(out.top_k),
        gradients_(WantsGradients(call.shape)),
        logits_resident_(call.plan.vocab_chunk >= weight.vocab_size) {}

  // phases(r0, rows) for each token chunk in order (under sequence_ratio, whole sequences), its
  // rows loaded as fp32 first.
  template <typename PhasesFn>
  void RunChunks(BatchSummary& summary, PhasesFn phases) {
    summary.grad_weight_bound = 0.0;
    const bool by_sequence = sequence_ratio();
    int64_t r0 = 0;
    for (const int64_t end : TokenChunkEnds(in_.num_tokens, chunk_rows_,
                                            by_sequence ? in_.ratio_sequence_lengths : nullptr,
                                            by_sequence ? in_.num_ratio_sequences : 0)) {
      const int64_t rows = end - r0;
      hidden32_ = static_cast<const float*>(in_.hidden) + r0 * h_;
      if (in_.hidden_dtype != DType::kFloat32) {
        ConvertToFloat(in_.hidden, in_.hidden_dtype, r0 * h_, rows * h_, buffers_.hidden32);
        hidden32_ = buffers_.hidden32;
      }
      phases(r0, rows);
      r0 = end;
    }
    finisher_.Close(summary);
  }

  // Under sequence_ratio, log s of each sequence of the chunk's rows [r0, r0 + rows), which holds
  // whole sequences, from the rows' complete statistics, into every row of the sequence.
  void MeasureSequenceRatios(int64_t r0, int64_t rows) {
    if (!sequence_ratio()) return;
    const RowInputArrays& a = finisher_.arrays();
    int64_t first = r0;
    for (const int64_t length : sequences_.Take(rows)) {
      SequenceLogRatio ratio;
      for (int64_t row = first; row < first + length; ++row) {
        if (RowCounted(a, finisher_.constants(), row)) {
          ratio.Add(buffers_.stats[row - r0], a.sampling_logprobs[row]);
        }
      }
      std::fill_n(sequence_log_ratios_.begin() + first, length, ratio.Value());
      first += length;
    }
  }

  // The chunk's student statistics and top-k lists emptied before the first tile.
  void ClearRowStats(int64_t rows) const {
    std::fill(buffers_.stats, buffers_.stats + rows, EmptyRowStats());
    if (k_ > 0) {
      std::fill(buffers_.top_values, buffers_.top_values + rows * k_, -INFINITY);
      std::fill(buffers_.top_tokens, buffers_.top_tokens + rows * k_, 0);
    }
  }

  TopKList TopKOf(int64_t r) const {
    return TopKList{k_, k_ > 0 ? buffers_.top_values + r * k_ : nullptr,
                    k_ > 0 ? buffers_.top_tokens + r * k_ : nullptr};
  }

  float* LogitsRow(int64_t r) const { return buffers_.logits + r * tile_cols_; }

  bool sequence_ratio() const { return !sequence_log_ratios_.empty(); }

  // What dL/dW's bound needs of chunk row r once its hidden row is loaded.
  void NoteHiddenMaxAbs(int64_t r) const {
    if (grad_weight32_ != nullptr) buffers_.hidden_max_abs[r] = MaxAbs(hidden32_ + r * h_, h_);
  }

  // Emits the chunk's rows in row order (emit(r) writes chunk row r's outputs into `summary` and
  // returns the bound on |dL/da| of its row, read only with dL/dW), and adds each row's share of
  // dL/dW's bound.
  template <typename EmitFn>
  void EmitRows(int64_t rows, BatchSummary& summary, EmitFn emit) const {
    for (int64_t r = 0; r < rows; ++r) {
      const double logit_gradient_bound = emit(r);
      if (grad_weight32_ != nullptr) {
        summary.grad_weight_bound += logit_gradient_bound * buffers_.hidden_max_abs[r];
      }
    }
  }

  // dh += dA W and dW += dA^T h over every vocabulary tile, where tile(v0, cols) leaves the tile's
  // dA in the logits buffer.
  template <typename TileFn>
  void GradientProducts(int64_t r0, int64_t rows, TileFn tile) const {
    TileProducts products(out_, weight_, r0, rows, hidden32_, buffers_.grad_hidden32,
                          buffers_.weight32, grad_weight32_,
                          options_.overwrite_grad_weight && r0 == 0);
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      tile(v0, cols);
      products.Add(buffers_.logits, tile_cols_, v0, cols);
    }
    products.Finish();
  }

  const BatchInputs& in_;
  const WeightView& weight_;
  const LossOptions& options_;
  const TokenOutputs& out_;
  const ChunkBuffers buffers_;
  std::vector<float> sequence_log_ratios_;  // [num_tokens] under sequence_ratio, else empty
  SequenceCursor sequences_;                // MeasureSequenceRatios' place in the sequences
  const RowFinisher finisher_;
  float* const grad_weight32_;
  const int64_t h_;
  const int64_t v_;
  const int64_t chunk_rows_;
  const int64_t tile_cols_;
  const int k_;
  const bool gradients_;
  const bool logits_resident_;       // one tile holds the whole vocabulary
  const float* hidden32_ = nullptr;  // the chunk's hidden rows as fp32
};

}  // namespace lossd::cpu

#endif  // LOSSD_KERNELS_CPU_CPU_ROWS_H_
