// Row loops compare floats in selects (Exp, Log, MixtureRatios); see cpu_backend.cc for why the
// whole file drops -ftrapping-math.
#pragma GCC optimize("no-trapping-math")

#include "kernels/cpu/cpu_distill.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_rows.h"
#include "lossd/kernels/distill_math.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::cpu {
namespace {

// The workspace of one distill call, carved from the caller's buffer.
struct DistillWorkspace {
  ChunkBuffers chunk;              // the student's; the weight slab fits either head
  float* teacher_logits;           // [Nc, Vc]: the teacher's z_t
  float* teacher_hidden32;         // [Nc, H_t] when a dense teacher's rows are not fp32
  DistillStats* distill;           // [Nc]
  DistillRowConstants* constants;  // [Nc]
  DistillRowTerms* terms;          // [Nc]
  DistillRowResult* results;       // [Nc]
  DistillRowGradient* row_grads;   // [Nc] with gradients
  SparseTeacherRow* sparse_rows;   // [Nc] what a sparse teacher gives outside its top-k
};

DistillWorkspace CarveDistillWorkspace(WorkspaceArena& arena, const ProblemShape& s, int64_t rows,
                                       int64_t cols) {
  DistillWorkspace w{};
  const TeacherShape& t = s.teacher;
  const bool dense = t.kind == TeacherKind::kDense;
  const int64_t slab = std::max(WeightSlabFloats(s.weight_dtype, cols, s.hidden_size),
                                dense ? WeightSlabFloats(t.weight_dtype, cols, t.hidden_size) : 0);
  w.chunk = CarveChunkBuffers(arena, s, rows, cols, slab);
  w.teacher_logits = arena.Take<float>(rows * cols);
  if (dense && t.hidden_dtype != DType::kFloat32) {
    w.teacher_hidden32 = arena.Take<float>(rows * t.hidden_size);
  }
  w.distill = arena.Take<DistillStats>(rows);
  w.constants = arena.Take<DistillRowConstants>(rows);
  w.terms = arena.Take<DistillRowTerms>(rows);
  w.results = arena.Take<DistillRowResult>(rows);
  if (WantsGradients(s)) w.row_grads = arena.Take<DistillRowGradient>(rows);
  if (t.kind == TeacherKind::kSparse) w.sparse_rows = arena.Take<SparseTeacherRow>(rows);
  return w;
}

// max, sum_v exp(x_v - max) and min of x_v = value(v) over v in [0, cols): blocks of kSumBlock
// columns summed in fp32 against a running max, the blocks in double, as in TileRowStats. The
// student's u and the teacher's t both come through here, so that equal logits give equal bits.
template <typename Value>
inline __attribute__((always_inline)) LseStats TileLseStatsOf(int64_t cols, Value value) {
  float m = -INFINITY;
  float low = INFINITY;
  bool saw_nan = false;
  double sum_exp = 0.0;
  for (int64_t b0 = 0; b0 < cols; b0 += kSumBlock) {
    const int64_t len = std::min(kSumBlock, cols - b0);
    float block_max = -INFINITY;
    float block_min = INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : block_max) reduction(min : block_min) reduction(| : nan)
    for (int64_t c = b0; c < b0 + len; ++c) {
      const float x = value(c);
      block_max = MaxStep(block_max, x);
      block_min = MinStep(block_min, x);
      nan |= x != x;
    }
    saw_nan = saw_nan || nan != 0;
    low = MinStep(low, block_min);
    if (block_max > m) {
      if (m > -INFINITY) sum_exp *= Exp(m - block_max);
      m = block_max;
    }
    if (m == -INFINITY) continue;  // -inf columns (and NaN ones, flagged) add nothing yet
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t c = b0; c < b0 + len; ++c) block_sum += Exp(value(c) - m);
    sum_exp += block_sum;
  }
  LseStats s;
  s.max = m;
  s.sum_exp = saw_nan ? NAN : static_cast<float>(sum_exp);
  s.min = low;
  return s;
}

// Of y_v * scale.
LOSSD_ROW_LOOP LseStats TileLseStats(const float* y, int64_t cols, float scale) {
  return TileLseStatsOf(cols, [=](int64_t c) { return RoundedProduct(y[c], scale); });
}

// Of u_v = z_v * scale over the columns where the teacher's logit z_t is -inf: a tail-bucket
// teacher's tail, where the student's statistics are its q_tail's.
LOSSD_ROW_LOOP LseStats TileTailLseStats(const float* z, const float* z_teacher, int64_t cols,
                                         float scale) {
  return TileLseStatsOf(cols, [=](int64_t c) {
    return z_teacher[c] == -INFINITY ? RoundedProduct(z[c], scale) : -INFINITY;
  });
}

template <DivergenceKind kKind, bool kTailBucket>
inline __attribute__((always_inline)) DistillRowTerms TileTermsOf(const float* z,
                                                                  const float* z_teacher,
                                                                  int64_t cols,
                                                                  const DistillRowConstants& c) {
  DistillRowTerms terms{0.0, 0.0};
  for (int64_t b0 = 0; b0 < cols; b0 += kSumBlock) {
    const int64_t len = std::min(kSumBlock, cols - b0);
    float divergence = 0.0f;
    float k = 0.0f;
#pragma omp simd reduction(+ : divergence, k)
    for (int64_t i = b0; i < b0 + len; ++i) {
      const DistillSummands s = DistillElementTerms<kKind, kTailBucket>(z[i], z_teacher[i], c);
      divergence += s.divergence;
      k += s.k;
    }
    terms.divergence += divergence;
    terms.k += k;
  }
  return terms;
}

template <bool kTailBucket>
inline __attribute__((always_inline)) DistillRowTerms TileTermsOfKind(
    const float* z, const float* z_teacher, int64_t cols, const DistillRowConstants& c) {
  switch (c.kind) {
    case DivergenceKind::kForwardKl:
      return TileTermsOf<DivergenceKind::kForwardKl, kTailBucket>(z, z_teacher, cols, c);
    case DivergenceKind::kReverseKl:
      return TileTermsOf<DivergenceKind::kReverseKl, kTailBucket>(z, z_teacher, cols, c);
    default: return TileTermsOf<DivergenceKind::kJsd, kTailBucket>(z, z_teacher, cols, c);
  }
}

// A row's sums of D's and K's summands over one tile (phase 2).
LOSSD_ROW_LOOP DistillRowTerms TileDistillTerms(const float* z, const float* z_teacher,
                                                int64_t cols, const DistillRowConstants& c) {
  return c.tail_bucket ? TileTermsOfKind<true>(z, z_teacher, cols, c)
                       : TileTermsOfKind<false>(z, z_teacher, cols, c);
}

template <DivergenceKind kKind, bool kTailBucket>
inline __attribute__((always_inline)) void RowGradientsOf(float* z, const float* z_teacher,
                                                          int64_t cols, const DistillRowGradient& g,
                                                          const LogitTransform& transform) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    z[c] = DistillLogitGradient<kKind, kTailBucket>(z[c], z_teacher[c], false, g, transform);
  }
}

template <bool kTailBucket>
inline __attribute__((always_inline)) void RowGradientsOfKind(float* z, const float* z_teacher,
                                                              int64_t cols,
                                                              const DistillRowGradient& g,
                                                              const LogitTransform& transform) {
  switch (g.c.kind) {
    case DivergenceKind::kForwardKl:
      RowGradientsOf<DivergenceKind::kForwardKl, kTailBucket>(z, z_teacher, cols, g, transform);
      break;
    case DivergenceKind::kReverseKl:
      RowGradientsOf<DivergenceKind::kReverseKl, kTailBucket>(z, z_teacher, cols, g, transform);
      break;
    default: RowGradientsOf<DivergenceKind::kJsd, kTailBucket>(z, z_teacher, cols, g, transform);
  }
}

// z[0:cols] <- dL/da in place, columns [v0, v0 + cols) (phase 3).
LOSSD_ROW_LOOP void RowDistillGradients(float* z, const float* z_teacher, int64_t cols, int64_t v0,
                                        const DistillRowGradient& g,
                                        const LogitTransform& transform) {
  const int64_t label = g.ce.label;
  const bool label_here = label >= v0 && label < v0 + cols;
  const float label_z = label_here ? z[label - v0] : 0.0f;
  if (g.c.tail_bucket) {
    RowGradientsOfKind<true>(z, z_teacher, cols, g, transform);
  } else {
    RowGradientsOfKind<false>(z, z_teacher, cols, g, transform);
  }
  if (label_here) {
    z[label - v0] = DistillLogitGradientOf(label_z, z_teacher[label - v0], true, g, transform);
  }
}

// The same TileLimits as cross-entropy's, but for calls without gradients: a distill call that
// tiles the vocabulary reads every tile twice (statistics, then terms), so longer token chunks
// over tiles would cost more products than they save.
constexpr TileLimits kDistillTileLimits = {
    /*max_token_chunk=*/4096,
    /*min_single_pass_rows=*/64,
    /*two_pass_token_chunk=*/256,
    /*min_vocab_chunk=*/256,
    /*vocab_chunk_multiple=*/256,
    /*token_chunk_multiple=*/64,
    /*forward_token_chunk=*/0,
};

// One distill call: per token chunk, LoadTeacher, RowStatistics (phase 1), RowTerms (phase 2),
// FinishRows and, with gradients, Gradients (phase 3). Where one tile holds the whole vocabulary,
// both logits tiles stay in the workspace from phase 1 on; else every phase recomputes them.
class CpuDistillCall : CpuChunkCall {
 public:
  CpuDistillCall(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
                 const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
                 const DistillWorkspace& ws)
      : CpuChunkCall(in, weight, options, out, grad_weight, call, ws.chunk),
        ws_(ws),
        transform_(finisher_.transform()),
        teacher_transform_(MakeTeacherTransform(options)),
        inv_tau_(static_cast<float>(1.0 / options.distill.temperature)) {}

  void Run(BatchSummary& summary) {
    RunChunks(summary, [&](int64_t r0, int64_t rows) {
      LoadTeacher(r0, rows);
      RowStatistics(r0, rows);
      RowTerms(r0, rows);
      FinishRows(r0, rows, summary);
      if (gradients_) Gradients(r0, rows);
    });
  }

 private:
  const TeacherInputs& teacher() const { return in_.teacher; }

  // A dense teacher's rows as fp32 (the caller's, or converted into the workspace); what a sparse
  // teacher gives the tokens outside each row's top-k.
  void LoadTeacher(int64_t r0, int64_t rows) {
    const TeacherInputs& t = teacher();
    if (t.dense()) {
      const int64_t ht = t.hidden_size;
      teacher_hidden32_ = static_cast<const float*>(t.hidden) + r0 * ht;
      if (t.hidden_dtype != DType::kFloat32) {
        ConvertToFloat(t.hidden, t.hidden_dtype, r0 * ht, rows * ht, ws_.teacher_hidden32);
        teacher_hidden32_ = ws_.teacher_hidden32;
      }
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      ws_.sparse_rows[r] = SparseTeacherRowOf(t.top_k_logprobs + (r0 + r) * t.top_k, t.top_k, v_,
                                              options_.distill.sparse_mass);
    }
  }

  // Both logits tiles of columns [v0, v0 + cols): the student's z, and the teacher's z_t from its
  // head, or a sparse teacher's log-probabilities with its rest logit around them.
  void ComputeTiles(int64_t r0, int64_t rows, int64_t v0, int64_t cols) {
    ComputeLogits(hidden32_, rows, weight_, v0, cols, buffers_.weight32, transform_,
                  buffers_.logits, tile_cols_, /*onto_zero=*/false);
    const TeacherInputs& t = teacher();
    if (t.dense()) {
      ComputeLogits(teacher_hidden32_, rows, *t.weight, v0, cols, buffers_.weight32,
                    teacher_transform_, ws_.teacher_logits, tile_cols_, /*onto_zero=*/false);
      return;
    }
    const int k = t.top_k;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* zt = ws_.teacher_logits + r * tile_cols_;
      std::fill(zt, zt + cols, ws_.sparse_rows[r].rest_logit);
      const int32_t* tokens = t.top_k_tokens + (r0 + r) * k;
      const float* logprobs = t.top_k_logprobs + (r0 + r) * k;
      for (int j = 0; j < k; ++j) {
        if (tokens[j] >= v0 && tokens[j] < v0 + cols) zt[tokens[j] - v0] = logprobs[j];
      }
    }
  }

  const float* TeacherRow(int64_t r) const { return ws_.teacher_logits + r * tile_cols_; }

  // Phase 1: the student's RowStats (and top-k) at its own temperature, and both distributions'
  // LseStats at tau, over every tile; then each row's constants for phases 2 and 3.
  void RowStatistics(int64_t r0, int64_t rows) {
    ClearRowStats(rows);
    for (int64_t r = 0; r < rows; ++r) {
      ws_.distill[r] =
          teacher().sparse() ? StartDistillStats(ws_.sparse_rows[r]) : EmptyDistillStats();
    }
    const bool tail_bucket = options_.distill.sparse_mass == SparseTeacherMass::kTailBucket;
    const TileStatsWork work{
        /*extra_sums=*/out_.entropy != nullptr || options_.label_smoothing != 0.0,
        /*store_exp=*/false, /*zero_after=*/false};
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      ComputeTiles(r0, rows, v0, cols);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t label = in_.labels != nullptr ? in_.labels[r0 + r] : -1;
        MergeRowStats(buffers_.stats[r], TileRowStats(LogitsRow(r), cols, v0, label, work,
                                                      TopKOf(r), /*block_max=*/nullptr));
        DistillStats tile = EmptyDistillStats();
        tile.student = TileLseStats(LogitsRow(r), cols, inv_tau_);
        tile.teacher = TileLseStats(TeacherRow(r), cols, inv_tau_);
        if (tail_bucket)
          tile.student_tail = TileTailLseStats(LogitsRow(r), TeacherRow(r), cols, inv_tau_);
        MergeDistillStats(ws_.distill[r], tile);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      ws_.constants[r] = MakeDistillRowConstants(ws_.distill[r], options_.distill);
    }
  }

  // Phase 2: each row's sums of D's and K's summands, tile after tile in order.
  void RowTerms(int64_t r0, int64_t rows) {
    std::fill(ws_.terms, ws_.terms + rows, DistillRowTerms{0.0, 0.0});
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      if (!logits_resident_) ComputeTiles(r0, rows, v0, cols);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const DistillRowTerms tile =
            TileDistillTerms(LogitsRow(r), TeacherRow(r), cols, ws_.constants[r]);
        ws_.terms[r].divergence += tile.divergence;
        ws_.terms[r].k += tile.k;
      }
    }
  }

  // Every row's results and gradient constants, then its outputs and the loss, summed in row order
  // in double.
  void FinishRows(int64_t r0, int64_t rows, BatchSummary& summary) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      ws_.results[r] = finisher_.FinishDistill(r0 + r, buffers_.stats[r], ws_.distill[r],
                                               ws_.constants[r], ws_.terms[r]);
      if (gradients_) {
        ws_.row_grads[r] = finisher_.DistillGradient(r0 + r, ws_.results[r], ws_.constants[r]);
      }
      NoteHiddenMaxAbs(r);
    }
    EmitRows(rows, summary, [&](int64_t r) {
      finisher_.EmitDistill(r0 + r, ws_.results[r], buffers_.stats[r], buffers_.top_values + r * k_,
                            buffers_.top_tokens + r * k_, summary);
      return grad_weight32_ != nullptr
                 ? DistillLogitGradientBound(ws_.row_grads[r], ws_.results[r].gradient_bound,
                                             transform_)
                 : 0.0;
    });
  }

  // Phase 3: dL/da tile by tile, then dh += dA W and dW += dA^T h. The teacher gets none.
  void Gradients(int64_t r0, int64_t rows) {
    GradientProducts(r0, rows, [&](int64_t v0, int64_t cols) {
      if (!logits_resident_) ComputeTiles(r0, rows, v0, cols);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        RowDistillGradients(LogitsRow(r), TeacherRow(r), cols, v0, ws_.row_grads[r], transform_);
      }
    });
  }

  const DistillWorkspace& ws_;
  const LogitTransform transform_;
  const LogitTransform teacher_transform_;
  const float inv_tau_;
  const float* teacher_hidden32_ = nullptr;  // a dense teacher's rows as fp32
};

}  // namespace

size_t DistillWorkspaceBytes(const ProblemShape& shape, int64_t rows, int64_t cols) {
  WorkspaceArena arena(nullptr, 0);
  CarveDistillWorkspace(arena, shape, rows, cols);
  return arena.used();
}

const TileLimits& DistillTileLimits() { return kDistillTileLimits; }

BatchSummary RunDistill(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
                        const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
                        DeviceBuffer& workspace) {
  WorkspaceArena arena(workspace.data(), workspace.bytes());
  const DistillWorkspace ws =
      CarveDistillWorkspace(arena, call.shape, call.plan.token_chunk, call.plan.vocab_chunk);
  BatchSummary summary = PlannedSummary(call.plan, arena.used());
  CpuDistillCall(in, weight, options, out, grad_weight, call, ws).Run(summary);
  return summary;
}

}  // namespace lossd::cpu
