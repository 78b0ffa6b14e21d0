// The CUDA backend's host-side decisions, on the CPU: its default budget follows free device
// memory, its plans at the Llama 3 8B and Gemma 2 2B heads take one pass over the vocabulary in
// chunks of 2048 to 8192 rows (windows of up to 16384), windows of rows come where they make the
// products longer or the workspace smaller and only for calls whose rows are finished alone, the
// workspace it carves stays inside the budget and its pieces neither overlap nor leave it, and the
// exact gradient mode is the only one that pays for dL/da's second half. Also the shared math its
// kernels run: the scale that carries dL/da in 16 bits, and the online statistics its row kernels
// keep per thread and merge per block.
#include "kernels/cuda/cuda_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "kernels/backend_impl.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/online_stats.h"

namespace lossd::cuda {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

TEST(CudaBudgetTest, DefaultIsAQuarterOfFreeMemoryWithinBounds) {
  // An H100 with a Llama 3 8B head in bf16 (1 GiB), its fp32 gradient and AdamW state (6 GiB).
  EXPECT_EQ(CudaDefaultWorkspaceBudget(72 * kGiB), 8 * kGiB);
  EXPECT_EQ(CudaDefaultWorkspaceBudget(20 * kGiB), 5 * kGiB);
  EXPECT_EQ(CudaDefaultWorkspaceBudget(4 * kGiB), 1 * kGiB);
  // A nearly full device still gets the base budget: a call that cannot have it fails at its
  // allocation with RESOURCE_EXHAUSTED, naming the bytes.
  EXPECT_EQ(CudaDefaultWorkspaceBudget(100 * kMiB), Backend::kBaseWorkspaceBudget);
  EXPECT_EQ(CudaDefaultWorkspaceBudget(0), Backend::kBaseWorkspaceBudget);
  EXPECT_EQ(CudaDefaultWorkspaceBudget(size_t{1} << 50), kMaxDefaultWorkspaceBudget);
}

ProblemShape Training(int64_t n, int64_t h, int64_t v, DType dtype) {
  ProblemShape s;
  s.num_tokens = n;
  s.hidden_size = h;
  s.vocab_size = v;
  s.hidden_dtype = dtype;
  s.weight_dtype = dtype;
  s.grad_hidden = true;
  s.grad_weight = true;
  s.grad_hidden_dtype = dtype;
  return s;
}

struct HeadCase {
  const char* name;
  int64_t n, h, v;
};

class CudaPlanAtScaleTest : public ::testing::TestWithParam<HeadCase> {};

// The shapes the speed targets are read at, bf16, at the default budget of a GPU with room.
TEST_P(CudaPlanAtScaleTest, OnePassInChunksOf2048To16384Rows) {
  const HeadCase& c = GetParam();
  for (const bool exact : {false, true}) {
    for (const bool training : {true, false}) {
      SCOPED_TRACE(::testing::Message() << (exact ? "exact" : "default") << " gradients, "
                                        << (training ? "training" : "scoring"));
      ProblemShape shape = Training(c.n, c.h, c.v, DType::kBFloat16);
      shape.exact_gradients = exact;
      shape.grad_hidden = shape.grad_weight = training;
      const size_t budget = CudaDefaultWorkspaceBudget(64 * kGiB);
      auto plan = PlanCudaCall(shape, budget);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->vocab_chunk, c.v);
      EXPECT_GE(plan->token_chunk, 2048);
      // Longer where a window holds the rows (FinishesRowsInWindows).
      const int64_t longest = training && plan->logit_rows == 0 ? 8192 : 16384;
      EXPECT_LE(plan->token_chunk, std::min<int64_t>(c.n, longest));
      EXPECT_EQ(plan->token_chunk % 128, 0);
      EXPECT_LE(plan->workspace_bytes, budget);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, CudaPlanAtScaleTest,
                         ::testing::Values(HeadCase{"llama3_8b_n8192", 8192, 4096, 128256},
                                           HeadCase{"llama3_8b_n16384", 16384, 4096, 128256},
                                           HeadCase{"gemma2_2b_n8192", 8192, 2304, 256000}),
                         [](const auto& info) { return std::string(info.param.name); });

// At the old fixed default, 256 MiB, the Llama 3 8B head holds only a few hundred rows over the
// whole vocabulary (each chunk streams W through the products once more) and, with exact
// gradients, has to tile the vocabulary; the budget holds either way.
TEST(CudaPlanTest, SmallBudgetGivesShortChunksWithinIt) {
  ProblemShape shape = Training(16384, 4096, 128256, DType::kBFloat16);
  for (const bool exact : {false, true}) {
    shape.exact_gradients = exact;
    auto plan = PlanCudaCall(shape, 256 * kMiB);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LE(plan->workspace_bytes, 256 * kMiB);
    if (exact) {
      EXPECT_LT(plan->vocab_chunk, 128256);
    } else {
      EXPECT_EQ(plan->vocab_chunk, 128256);
      EXPECT_LT(plan->token_chunk, 512);
    }
  }
}

TEST(CudaPlanTest, OnlyExactGradientsOfSixteenBitProductsPayForTheLowHalf) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    ProblemShape shape = Training(1024, 512, 32000, dtype);
    EXPECT_EQ(GradientStoreOf(shape),
              dtype == DType::kFloat32 ? GradientStore::kFloat32 : GradientStore::kRounded);
    WorkspaceArena rounded(nullptr, 0);
    CarveCudaWorkspace(rounded, shape, 1024, 32000, 1024);
    shape.exact_gradients = true;
    EXPECT_EQ(GradientStoreOf(shape),
              dtype == DType::kFloat32 ? GradientStore::kFloat32 : GradientStore::kSplit);
    WorkspaceArena split(nullptr, 0);
    CarveCudaWorkspace(split, shape, 1024, 32000, 1024);
    const size_t low_half = 1024 * LeadingDimension(32000) * sizeof(uint16_t);
    EXPECT_EQ(split.used() - rounded.used(), dtype == DType::kFloat32 ? 0 : low_half);
  }
  // Rows and head in different dtypes: the products run in fp32.
  ProblemShape mixed = Training(64, 64, 1000, DType::kFloat32);
  mixed.weight_dtype = DType::kBFloat16;
  mixed.exact_gradients = true;
  EXPECT_EQ(GradientStoreOf(mixed), GradientStore::kFloat32);
}

// The pieces of a carved workspace, as [begin, end) offsets from its base.
std::vector<std::pair<size_t, size_t>> Pieces(const CudaWorkspace& w, const ProblemShape& s,
                                              int64_t rows, int64_t cols, int64_t logit_rows,
                                              const char* base) {
  std::vector<std::pair<size_t, size_t>> pieces;
  const auto add = [&](const void* p, int64_t bytes) {
    if (p == nullptr) return;
    const size_t begin = static_cast<const char*>(p) - base;
    pieces.emplace_back(begin, begin + static_cast<size_t>(bytes));
  };
  const int64_t h = s.hidden_size;
  const int64_t ld = LeadingDimension(cols);
  const int64_t hsize = static_cast<int64_t>(DTypeSize(s.hidden_dtype));
  for (const ChunkBuffers& in : w.d_inputs) {
    add(in.hidden, rows * h * hsize);
    add(in.labels, rows * 8);
    for (const float* f : {in.token_weights, in.sampling_logprobs, in.advantages,
                           in.reference_logprobs, in.logprob_grads}) {
      add(f, rows * 4);
    }
    add(in.reduction_scales, rows * 8);
    if (in.teacher_hidden != nullptr) {
      add(in.teacher_hidden,
          rows * s.teacher.hidden_size * static_cast<int64_t>(DTypeSize(s.teacher.hidden_dtype)));
    }
    add(in.teacher_tokens, rows * s.teacher.top_k * 4);
    add(in.teacher_logprobs, rows * s.teacher.top_k * 4);
    add(in.sparse_rows, rows * static_cast<int64_t>(sizeof(SparseTeacherRow)));
  }
  add(w.d_hidden32, rows * h * 4);
  add(w.d_logits, logit_rows * ld * 4);
  add(w.d_logits_next, logit_rows * ld * 4);
  add(w.d_grad_hi, rows * ld * 2);
  add(w.d_grad_lo, rows * ld * 2);
  add(w.d_teacher_logits, logit_rows * ld * 4);
  add(w.d_teacher_logits_next, logit_rows * ld * 4);
  add(w.d_grad_hidden32, rows * h * 4);
  for (void* out : w.d_grad_hidden_out) {
    add(out, rows * h * static_cast<int64_t>(DTypeSize(s.grad_hidden_dtype)));
  }
  add(w.d_stats, rows * static_cast<int64_t>(sizeof(RowStats)));
  add(w.d_top_values, rows * s.top_k * 4);
  add(w.d_top_tokens, rows * s.top_k * 4);
  add(w.d_results, rows * static_cast<int64_t>(sizeof(RowResult)));
  add(w.d_row_grads, rows * static_cast<int64_t>(sizeof(RowGradient)));
  add(w.d_bounds, rows * 8);
  add(w.d_split_scale, 16);
  add(w.d_distill_stats, rows * static_cast<int64_t>(sizeof(DistillStats)));
  add(w.d_constants, rows * static_cast<int64_t>(sizeof(DistillRowConstants)));
  add(w.d_terms, rows * static_cast<int64_t>(sizeof(DistillRowTerms)));
  add(w.d_distill_results, rows * static_cast<int64_t>(sizeof(DistillRowResult)));
  add(w.d_distill_grads, rows * static_cast<int64_t>(sizeof(DistillRowGradient)));
  return pieces;
}

// Random shapes and budgets: the plan's workspace fits the budget, and carving it from a buffer
// of exactly that size gives every piece the call needs, inside the buffer, with no overlaps.
TEST(CudaPlanTest, CarvedWorkspaceFitsTheBudgetAndItsPiecesAreDisjoint) {
  std::mt19937_64 rng(20261126);
  const auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int trial = 0; trial < 300; ++trial) {
    ProblemShape s;
    s.num_tokens = pick(1, 20000);
    s.hidden_size = pick(1, 4096);
    s.vocab_size = pick(1, 200000);
    s.hidden_dtype = dtypes[pick(0, 2)];
    s.weight_dtype = pick(0, 1) ? s.hidden_dtype : dtypes[pick(0, 2)];
    s.grad_hidden = pick(0, 1);
    s.grad_weight = pick(0, 1);
    s.grad_hidden_dtype = dtypes[pick(0, 2)];
    s.top_k = pick(0, 1) ? static_cast<int>(pick(1, kMaxTopK)) : 0;
    s.exact_gradients = pick(0, 1);
    switch (pick(0, 2)) {
      case 1:
        s.teacher.kind = TeacherKind::kDense;
        s.teacher.hidden_size = pick(1, 4096);
        s.teacher.hidden_dtype = dtypes[pick(0, 2)];
        s.teacher.weight_dtype = dtypes[pick(0, 2)];
        break;
      case 2:
        s.teacher.kind = TeacherKind::kSparse;
        s.teacher.top_k = static_cast<int>(pick(1, kMaxTeacherTopK));
        break;
      default: break;
    }
    const size_t budget = static_cast<size_t>(pick(1, 8192)) * kMiB;
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << ": N " << s.num_tokens << ", H " << s.hidden_size << ", V "
                 << s.vocab_size << ", budget " << budget / kMiB << " MiB");
    auto plan = PlanCudaCall(s, budget);
    if (!plan.ok()) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
      continue;
    }
    EXPECT_LE(plan->workspace_bytes, budget);
    EXPECT_LE(plan->token_chunk, std::max<int64_t>(s.num_tokens, 1));
    EXPECT_LE(plan->vocab_chunk, s.vocab_size);
    EXPECT_GE(plan->logit_rows, 0);
    EXPECT_LE(plan->logit_rows, plan->token_chunk);
    if (plan->logit_rows > 0) {
      EXPECT_TRUE(FinishesRowsInWindows(s));
      EXPECT_GE(plan->logit_rows, kMinWindowLogitRows);
      EXPECT_LE((plan->token_chunk + plan->logit_rows - 1) / plan->logit_rows, kMaxPiecesPerWindow);
    }
    // A fake base: the arena only adds offsets to it.
    const char* base = reinterpret_cast<const char*>(uintptr_t{1} << 40);
    WorkspaceArena arena(const_cast<char*>(base), plan->workspace_bytes);
    const CudaWorkspace w =
        CarveCudaWorkspace(arena, s, plan->token_chunk, plan->vocab_chunk, LogitRows(*plan));
    EXPECT_EQ(arena.used(), plan->workspace_bytes);
    ASSERT_TRUE(arena.fits());
    const bool distill = s.teacher.kind != TeacherKind::kNone;
    const bool gradients = s.grad_hidden || s.grad_weight;
    EXPECT_NE(w.d_logits, nullptr);
    EXPECT_EQ(w.d_logits_next == nullptr, plan->logit_rows == 0);
    EXPECT_EQ(w.d_teacher_logits_next == nullptr, plan->logit_rows == 0 || !distill);
    EXPECT_EQ(w.d_results == nullptr, distill);
    EXPECT_EQ(w.d_distill_results == nullptr, !distill);
    EXPECT_EQ(w.d_bounds == nullptr, !gradients);
    EXPECT_EQ(w.d_grad_hidden_out[1] == nullptr, !s.grad_hidden);
    EXPECT_EQ(w.d_grad_hi == nullptr, !gradients || GradientStoreOf(s) == GradientStore::kFloat32);
    EXPECT_EQ(w.d_grad_lo == nullptr, !gradients || GradientStoreOf(s) != GradientStore::kSplit);
    std::vector<std::pair<size_t, size_t>> pieces =
        Pieces(w, s, plan->token_chunk, plan->vocab_chunk, LogitRows(*plan), base);
    std::sort(pieces.begin(), pieces.end());
    for (size_t i = 0; i < pieces.size(); ++i) {
      EXPECT_EQ(pieces[i].first % WorkspaceArena::kAlignment, 0u);
      EXPECT_LE(pieces[i].second, plan->workspace_bytes);
      if (i > 0) {
        EXPECT_LE(pieces[i - 1].second, pieces[i].first) << "piece " << i << " overlaps";
      }
    }
  }
}

TEST(CudaPlanTest, HostStagingHoldsTwoSlotsAndEveryRowsResults) {
  ProblemShape s = Training(10000, 256, 5000, DType::kBFloat16);
  s.top_k = 5;
  WorkspaceArena one_slot(nullptr, 0);
  CarveChunkBuffers(one_slot, s, 4096);
  WorkspaceArena arena(nullptr, 0);
  const HostStaging staging = CarveHostStaging(arena, s, 4096);
  (void)staging;
  const size_t grad_slot = 4096 * 256 * sizeof(uint16_t);
  const size_t per_row = sizeof(RowStats) + sizeof(RowResult) + 5 * (sizeof(float) + 4);
  EXPECT_GE(arena.used(), 2 * one_slot.used() + 2 * grad_slot + 10000 * per_row);
  EXPECT_LE(arena.used(), 2 * one_slot.used() + 2 * grad_slot + 10000 * per_row +
                              16 * WorkspaceArena::kAlignment);
}

// The blocks of K the engine's products run in, on the CPU: for every transposition of both
// operands, summing each block's product from the offsets BlockOffsetA/B give (with the
// operands' own leading dimensions, wider than the matrices) adds up to the whole product, and
// no block is deeper than kMaxProductDepth.
TEST(CudaPlanTest, ProductBlocksAddUpToTheWholeProduct) {
  const int64_t m = 3, n = 2, k = 2 * kMaxProductDepth + 5;
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> small(-3, 3);
  for (const bool transpose_a : {false, true})
    for (const bool transpose_b : {false, true}) {
      // Stored row-major with a padded leading dimension; integers, so every sum is exact.
      const int64_t lda = (transpose_a ? m : k) + 3;
      const int64_t ldb = (transpose_b ? k : n) + 1;
      std::vector<double> a((transpose_a ? k : m) * lda), b((transpose_b ? n : k) * ldb);
      for (double& x : a) x = small(rng);
      for (double& x : b) x = small(rng);
      const auto a_at = [&](const double* base, int64_t i, int64_t l) {  // op(A)[i, l]
        return transpose_a ? base[l * lda + i] : base[i * lda + l];
      };
      const auto b_at = [&](const double* base, int64_t l, int64_t j) {  // op(B)[l, j]
        return transpose_b ? base[j * ldb + l] : base[l * ldb + j];
      };
      std::vector<double> whole(m * n, 0.0), blocked(m * n, 0.0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t l = 0; l < k; ++l)
            whole[i * n + j] += a_at(a.data(), i, l) * b_at(b.data(), l, j);
      int blocks = 0;
      for (int64_t k0 = 0; k0 < k; k0 += kMaxProductDepth, ++blocks) {
        const int64_t depth = std::min(kMaxProductDepth, k - k0);
        const double* a_block = a.data() + BlockOffsetA(transpose_a, k0, lda);
        const double* b_block = b.data() + BlockOffsetB(transpose_b, k0, ldb);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            for (int64_t l = 0; l < depth; ++l) {
              blocked[i * n + j] += a_at(a_block, i, l) * b_at(b_block, l, j);
            }
      }
      EXPECT_EQ(blocks, 3);
      EXPECT_EQ(blocked, whole) << "transpose_a " << transpose_a << ", transpose_b " << transpose_b;
    }
}

// ---- The row kernels' online statistics, as a block of 512 threads runs them ----

constexpr int kThreads = 512;
constexpr int kWarp = 32;

// What BlockReduce leaves in lane 0 of warp 0: each warp's shuffle-down tree (lane l takes lane
// l + offset for offsets 16 to 1), then the warps in order.
template <typename T, typename Combine>
T SimulatedBlockReduce(std::vector<T> values, Combine combine) {
  std::vector<T> warps;
  for (int w = 0; w < kThreads / kWarp; ++w) {
    T* lanes = values.data() + w * kWarp;
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      for (int l = 0; l + offset < kWarp; ++l) lanes[l] = combine(lanes[l], lanes[l + offset]);
    }
    warps.push_back(lanes[0]);
  }
  T total = warps[0];
  for (size_t w = 1; w < warps.size(); ++w) total = combine(total, warps[w]);
  return total;
}

// A row's RowStats as RowStatsKernel makes them: thread t reads columns t, t + 512, ...
RowStats KernelRowStats(const std::vector<float>& z, int label, int64_t v0) {
  std::vector<PartialRowStats> partial(kThreads, EmptyPartialRowStats());
  for (size_t c = 0; c < z.size(); ++c) {
    AddColumn(partial[c % kThreads], z[c], static_cast<int32_t>(c));
  }
  const PartialRowStats total = SimulatedBlockReduce(partial, CombinePartialRowStats);
  return TileRowStats(total, label >= 0 ? z[label] : 0.0f, v0);
}

TEST(SharedMathTest, OnlineRowStatsOfABlockMatchFloat64) {
  std::mt19937_64 rng(5);
  for (const int64_t cols : {1, 7, 511, 513, 5003, 128256}) {
    for (const double scale : {1.0, 30.0, 1e3}) {
      SCOPED_TRACE(::testing::Message() << cols << " columns, logits of scale " << scale);
      std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
      std::vector<float> z(cols);
      for (float& x : z) x = normal(rng);
      // Ties for the maximum, the later ones in lower-numbered threads' shares.
      const int64_t top = static_cast<int64_t>(std::max_element(z.begin(), z.end()) - z.begin());
      if (cols > 600) z[cols - 3] = z[top];
      if (cols > 600 && top > 0) z[top - 1] = z[top];
      const int label = static_cast<int>(cols / 2);
      const RowStats stats = KernelRowStats(z, label, 1000);
      double max = -INFINITY;
      int64_t argmax = -1;
      for (int64_t c = 0; c < cols; ++c) {
        if (z[c] > max) {
          max = z[c];
          argmax = c;
        }
      }
      double sum_exp = 0.0, sum_shifted = 0.0, sum_z = 0.0;
      for (const float x : z) {
        sum_exp += std::exp(x - max);
        sum_shifted += std::exp(x - max) * (x - max);
        sum_z += x;
      }
      EXPECT_EQ(stats.max, max);
      EXPECT_EQ(stats.argmax, 1000 + argmax);
      EXPECT_NEAR(stats.sum_exp, sum_exp, 1e-5 * sum_exp);
      EXPECT_NEAR(stats.sum_exp_shifted, sum_shifted, 1e-5 * std::abs(sum_shifted) + 1e-6);
      EXPECT_NEAR(stats.sum_z, sum_z, 1e-6 * std::sqrt(cols) * scale + 1e-4);
      EXPECT_EQ(stats.target, z[label]);
    }
  }
}

TEST(SharedMathTest, OnlineRowStatsCarryANaNAndAnAllNaNRowHasNoMaximum) {
  std::vector<float> z(2000, 1.0f);
  z[3] = NAN;  // the first column of thread 3's share
  const RowStats with_nan = KernelRowStats(z, -1, 0);
  EXPECT_TRUE(std::isnan(with_nan.sum_exp) || std::isnan(with_nan.sum_z));
  EXPECT_EQ(with_nan.argmax, 0);
  const RowStats all_nan = KernelRowStats(std::vector<float>(700, NAN), -1, 0);
  EXPECT_EQ(all_nan.argmax, -1);
  EXPECT_TRUE(std::isnan(all_nan.sum_z));
}

TEST(SharedMathTest, OnlineLseOfABlockMatchesFloat64) {
  std::mt19937_64 rng(6);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (const int64_t cols : {1, 300, 5003, 152064}) {
    SCOPED_TRACE(::testing::Message() << cols << " columns");
    std::vector<float> x(cols);
    for (float& v : x) v = normal(rng);
    // A sparse teacher's columns outside its top-k, and whole shares of them.
    for (int64_t c = 0; c < cols; c += 3) x[c] = -INFINITY;
    if (cols > 1) x[1] = 2.5f;
    std::vector<PartialLse> partial(kThreads, EmptyPartialLse());
    for (int64_t c = 0; c < cols; ++c) AddValue(partial[c % kThreads], x[c]);
    const LseStats s = LseStatsOf(SimulatedBlockReduce(partial, CombinePartialLse));
    double max = -INFINITY, min = INFINITY;
    for (const float v : x) {
      max = std::max<double>(max, v);
      min = std::min<double>(min, v);
    }
    double sum = 0.0;
    for (const float v : x) sum += max > -INFINITY ? std::exp(v - max) : 0.0;
    EXPECT_EQ(s.max, max);
    EXPECT_EQ(s.min, min);
    if (max == -INFINITY) {
      EXPECT_EQ(s.sum_exp, 0.0f);
    } else {
      EXPECT_NEAR(s.sum_exp, sum, 1e-5 * sum);
    }
  }
  std::vector<PartialLse> with_nan(kThreads, EmptyPartialLse());
  AddValue(with_nan[7], 1.0f);
  AddValue(with_nan[9], NAN);
  EXPECT_TRUE(std::isnan(LseStatsOf(SimulatedBlockReduce(with_nan, CombinePartialLse)).sum_exp));
}

// GradientSplitScale: the power of two that keeps |S dL/da| under 2^14 for fp16's range.
TEST(SharedMathTest, GradientSplitScaleKeepsScaledGradientsInRange) {
  EXPECT_EQ(GradientSplitScale(0.0, kSplitMaxExponent), 1.0f);
  EXPECT_EQ(GradientSplitScale(NAN, kSplitMaxExponent), 1.0f);
  EXPECT_EQ(GradientSplitScale(INFINITY, kSplitMaxExponent), 1.0f);
  EXPECT_EQ(GradientSplitScale(1.0, kSplitMaxExponent), std::ldexp(1.0f, 13));
  EXPECT_EQ(GradientSplitScale(0.75, kSplitMaxExponent), std::ldexp(1.0f, 14));
  EXPECT_EQ(GradientSplitScale(1e-300, kSplitMaxExponent), std::ldexp(1.0f, 126));
  EXPECT_EQ(GradientSplitScale(1e300, kSplitMaxExponent), std::ldexp(1.0f, -126));
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> exponent(-110.0, 110.0);  // no clamp
  for (int i = 0; i < 1000; ++i) {
    const double bound = std::pow(2.0, exponent(rng));
    const double scaled = bound * GradientSplitScale(bound, kSplitMaxExponent);
    EXPECT_LT(scaled, std::ldexp(1.0, kSplitMaxExponent));
    EXPECT_GE(scaled, std::ldexp(1.0, kSplitMaxExponent - 1));
  }
}

// The plan the call would get without windows: ChooseChunkPlan with a chunk's logits all held.
ChunkPlan ChunksWithoutWindows(const ProblemShape& s, size_t budget) {
  auto plan = ChooseChunkPlan(s, budget, kCudaTileLimits, [&](int64_t rows, int64_t cols) {
    WorkspaceArena arena(nullptr, 0);
    CarveCudaWorkspace(arena, s, rows, cols, rows);
    return arena.used();
  });
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.value_or(ChunkPlan{});
}

struct WindowCase {
  const char* name;
  const char* why;
  ProblemShape shape;
  size_t budget;
  int64_t logit_rows;  // expected; 0: no windows
};

void PrintTo(const WindowCase& c, std::ostream* os) { *os << c.name; }

ProblemShape Adjusted(ProblemShape s, void (*change)(ProblemShape&)) {
  change(s);
  return s;
}

const ProblemShape kLlama16k = Training(16384, 4096, 128256, DType::kBFloat16);
const ProblemShape kLlama8k = Training(8192, 4096, 128256, DType::kBFloat16);
const ProblemShape kGemma8k = Training(8192, 2304, 256000, DType::kBFloat16);

const WindowCase kWindowCases[] = {
    {"llama16k_1gib", "1 GiB holds fewer, longer products in windows", kLlama16k, 1 * kGiB, 512},
    {"llama16k_8gib", "two chunks of 8192 become one window", kLlama16k, 8 * kGiB, 512},
    {"llama8k_1gib_exact", "hi and lo halves are both windowed, pieces of 256 rows to fit",
     Adjusted(kLlama8k, [](auto& s) { s.exact_gradients = true; }), 1 * kGiB, 256},
    {"gemma8k_1gib", "V = 256000: pieces halve to 256 rows to leave room", kGemma8k, 1 * kGiB, 256},
    {"dldw_only", "dL/dW alone is a gradient too",
     Adjusted(kLlama16k, [](auto& s) { s.grad_hidden = false; }), 1 * kGiB, 512},
    {"one_chunk", "one chunk holds the call; a window holds it in less memory", kLlama8k, 8 * kGiB,
     512},
    {"short_call", "fewer rows than two pieces: the chunk is the call",
     Adjusted(kLlama8k, [](auto& s) { s.num_tokens = 300; }), 8 * kGiB, 0},
    {"pieces_too_short", "pieces under 256 rows would leave the logits product waiting on W",
     kLlama16k, 256 * kMiB, 0},
    {"vocabulary_tiled", "the chunks tile the vocabulary: no window holds a row's logits", kGemma8k,
     256 * kMiB, 0},
    {"scoring", "no gradients: pieces of logits, nothing carried",
     Adjusted(kLlama16k, [](auto& s) { s.grad_hidden = s.grad_weight = false; }), 8 * kGiB, 512},
    {"scoring_fp32", "fp32 scoring carries nothing either",
     Adjusted(kLlama16k,
              [](auto& s) {
                s.grad_hidden = s.grad_weight = false;
                s.hidden_dtype = s.weight_dtype = DType::kFloat32;
              }),
     8 * kGiB, 512},
    {"scoring_small_budget", "pieces of 256 rows where two of 512 do not fit",
     Adjusted(kLlama16k, [](auto& s) { s.grad_hidden = s.grad_weight = false; }), 512 * kMiB, 256},
    {"scoring_smaller_budget", "two pieces of 256 rows of logits alone take 263 MB",
     Adjusted(kLlama16k, [](auto& s) { s.grad_hidden = s.grad_weight = false; }), 256 * kMiB, 0},
    {"fp16", "fp16 carries dL/da under a scale from every row's bound",
     Adjusted(kLlama16k, [](auto& s) { s.hidden_dtype = s.weight_dtype = DType::kFloat16; }),
     1 * kGiB, 0},
    {"fp32", "fp32 products keep dL/da in the logits themselves",
     Adjusted(kLlama16k, [](auto& s) { s.hidden_dtype = s.weight_dtype = DType::kFloat32; }),
     1 * kGiB, 0},
    {"mixed_dtypes", "bf16 rows on an fp32 head: fp32 products",
     Adjusted(kLlama16k, [](auto& s) { s.weight_dtype = DType::kFloat32; }), 1 * kGiB, 0},
    {"mixed_scoring", "a widened head would be widened again for every piece",
     Adjusted(kLlama16k,
              [](auto& s) {
                s.grad_hidden = s.grad_weight = false;
                s.hidden_dtype = DType::kFloat32;
              }),
     8 * kGiB, 0},
    {"dense_teacher", "a teacher's tile beside each piece's: two buffers each",
     Adjusted(kLlama16k,
              [](auto& s) {
                s.teacher.kind = TeacherKind::kDense;
                s.teacher.hidden_size = 4096;
                s.teacher.hidden_dtype = s.teacher.weight_dtype = DType::kBFloat16;
              }),
     1 * kGiB, 256},
    {"widened_teacher", "fp32 teacher rows on a bf16 teacher head: widened again per piece",
     Adjusted(kLlama16k,
              [](auto& s) {
                s.teacher.kind = TeacherKind::kDense;
                s.teacher.hidden_size = 4096;
                s.teacher.hidden_dtype = DType::kFloat32;
                s.teacher.weight_dtype = DType::kBFloat16;
              }),
     1 * kGiB, 0},
    {"sparse_teacher", "a sparse teacher's tile is filled per piece",
     Adjusted(kLlama16k,
              [](auto& s) {
                s.teacher.kind = TeacherKind::kSparse;
                s.teacher.top_k = 8;
              }),
     1 * kGiB, 256},
    {"sequence_ratio", "a sequence's ratio joins its rows before any is finished",
     Adjusted(kLlama16k, [](auto& s) { s.sequence_ratio = true; }), 1 * kGiB, 0},
};

class CudaWindowPlanTest : public ::testing::TestWithParam<WindowCase> {};

TEST_P(CudaWindowPlanTest, WindowsWhereTheyPay) {
  const WindowCase& c = GetParam();
  SCOPED_TRACE(c.why);
  auto plan = PlanCudaCall(c.shape, c.budget);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->workspace_bytes, c.budget);
  EXPECT_EQ(plan->logit_rows, c.logit_rows);
  const ChunkPlan chunks = ChunksWithoutWindows(c.shape, c.budget);
  if (c.logit_rows == 0) {
    EXPECT_EQ(plan->token_chunk, chunks.token_chunk);
    EXPECT_EQ(plan->vocab_chunk, chunks.vocab_chunk);
    EXPECT_EQ(plan->workspace_bytes, chunks.workspace_bytes);
    return;
  }
  EXPECT_TRUE(FinishesRowsInWindows(c.shape));
  EXPECT_EQ(plan->vocab_chunk, c.shape.vocab_size);
  EXPECT_EQ(plan->token_chunk % kCudaTileLimits.token_chunk_multiple, 0);
  EXPECT_GE(plan->token_chunk, 2 * plan->logit_rows);
  // No more passes over dL/dW than the chunks would make, and fewer or in less memory.
  const auto products = [&](int64_t rows) { return (c.shape.num_tokens + rows - 1) / rows; };
  EXPECT_LE(products(plan->token_chunk), products(chunks.token_chunk));
  EXPECT_TRUE(products(plan->token_chunk) < products(chunks.token_chunk) ||
              plan->workspace_bytes < chunks.workspace_bytes)
      << "windows of " << plan->token_chunk << " rows in " << plan->workspace_bytes
      << " bytes, chunks of " << chunks.token_chunk << " in " << chunks.workspace_bytes;
  WorkspaceArena arena(nullptr, 0);
  CarveCudaWorkspace(arena, c.shape, plan->token_chunk, plan->vocab_chunk, plan->logit_rows);
  EXPECT_EQ(arena.used(), plan->workspace_bytes);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaWindowPlanTest, ::testing::ValuesIn(kWindowCases),
                         [](const auto& info) { return std::string(info.param.name); });

// LOSSD_CUDA_WINDOWS=0 gives the chunks a call would take without windows, for benchmarks to
// time both; any other value, or none, leaves windows on.
TEST(CudaPlanTest, WindowsCanBeTurnedOffForMeasurement) {
  const ProblemShape shape = kLlama16k;
  const auto windows_of = [&]() {
    auto plan = PlanCudaCall(shape, 8 * kGiB);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? plan->logit_rows : -1;
  };
  ASSERT_EQ(std::getenv("LOSSD_CUDA_WINDOWS"), nullptr);
  EXPECT_EQ(windows_of(), kWindowLogitRows);
  ASSERT_EQ(setenv("LOSSD_CUDA_WINDOWS", "0", 1), 0);
  EXPECT_EQ(windows_of(), 0);
  const ChunkPlan chunks = ChunksWithoutWindows(shape, 8 * kGiB);
  EXPECT_EQ(PlanCudaCall(shape, 8 * kGiB)->token_chunk, chunks.token_chunk);
  ASSERT_EQ(setenv("LOSSD_CUDA_WINDOWS", "1", 1), 0);
  EXPECT_EQ(windows_of(), kWindowLogitRows);
  ASSERT_EQ(unsetenv("LOSSD_CUDA_WINDOWS"), 0);
}

}  // namespace
}  // namespace lossd::cuda
