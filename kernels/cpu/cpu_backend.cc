// The row loops call the shared scalar math (Exp, LogitGradient), whose clamps and selects are
// float comparisons. Under GCC's default -ftrapping-math they stay branches, which keeps every row
// loop scalar (about a fifth of a forward pass at H=1024); without it they become vector compares
// and blends. Nothing here reads floating-point exception flags. The pragma covers the whole file,
// headers included, because GCC does not inline a function compiled with other optimization flags
// into a row loop.
#pragma GCC optimize("no-trapping-math")

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_distill.h"
#include "kernels/cpu/cpu_rows.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend_impl.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/optimizer_math.h"

namespace lossd {
namespace cpu {

// Elements [offset, offset + count) of src as fp32, and back. One loop per dtype: with the dtype
// switched on per element (LoadAsFloat) the loop stayed scalar, about 1 ns an element, which was
// most of a bf16 call's time outside the GEMMs; bf16 is a shift each way, vectorized.
void ConvertToFloat(const void* src, DType dtype, int64_t offset, int64_t count, float* dst) {
  const uint16_t* bits = static_cast<const uint16_t*>(src) + offset;
  switch (dtype) {
    case DType::kBFloat16:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) dst[i] = BFloat16ToFloat(bits[i]);
      return;
    case DType::kFloat16:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) dst[i] = Float16ToFloat(bits[i]);
      return;
    default: std::memcpy(dst, static_cast<const float*>(src) + offset, count * sizeof(float));
  }
}

void ConvertFromFloat(const float* src, int64_t count, DType dtype, void* dst, int64_t offset) {
  uint16_t* bits = static_cast<uint16_t*>(dst) + offset;
  switch (dtype) {
    case DType::kBFloat16:
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) bits[i] = FloatToBFloat16(src[i]);
      return;
    case DType::kFloat16:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) bits[i] = FloatToFloat16(src[i]);
      return;
    default: std::memcpy(static_cast<float*>(dst) + offset, src, count * sizeof(float));
  }
}

// z[:, 0:cols] = transform(h W[v0:v0+cols]^T), leading dimension ld. With onto_zero the caller
// vouches that z[:, 0:cols] holds zeros: the product adds onto it (beta = 1), which spares
// OpenBLAS the pass that clears C for beta = 0, a write of the whole tile.
void ComputeLogits(const float* hidden32, int64_t rows, const WeightView& w, int64_t v0,
                   int64_t cols, float* weight32, const LogitTransform& transform, float* z,
                   int64_t ld, bool onto_zero) {
  const int64_t h = w.hidden_size;
  const float beta = onto_zero ? 1.0f : 0.0f;
  ForEachWeightSlab(w, v0, cols, weight32, [&](const float* slab, int64_t s0, int64_t slab_rows) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, slab_rows, h, 1.0f, hidden32, h,
                slab, h, beta, z + (s0 - v0), ld);
  });
  if (transform.identity()) return;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = z + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) row[c] = TransformLogit(row[c], transform);
  }
}

TileProducts::TileProducts(const TokenOutputs& out, const WeightView& weight, int64_t r0,
                           int64_t rows, const float* hidden32, float* grad_hidden_scratch,
                           float* weight32, float* grad_weight32, bool store_grad_weight)
    : out_(out),
      weight_(weight),
      r0_(r0),
      rows_(rows),
      h_(weight.hidden_size),
      hidden32_(hidden32),
      weight32_(weight32),
      grad_weight32_(grad_weight32),
      store_grad_weight_(store_grad_weight) {
  if (out.grad_hidden == nullptr) return;
  grad_hidden32_ = out.grad_hidden_dtype == DType::kFloat32
                       ? static_cast<float*>(out.grad_hidden) + r0 * h_
                       : grad_hidden_scratch;
  std::fill(grad_hidden32_, grad_hidden32_ + rows * h_, 0.0f);
}

void TileProducts::Add(const float* grad_logits, int64_t ld, int64_t v0, int64_t cols) {
  if (grad_hidden32_ != nullptr) {
    ForEachWeightSlab(
        weight_, v0, cols, weight32_, [&](const float* slab, int64_t s0, int64_t slab_rows) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows_, h_, slab_rows, 1.0f,
                      grad_logits + (s0 - v0), ld, slab, h_, 1.0f, grad_hidden32_, h_);
        });
  }
  if (grad_weight32_ != nullptr) {
    const float beta = store_grad_weight_ ? 0.0f : 1.0f;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, h_, rows_, 1.0f, grad_logits, ld,
                hidden32_, h_, beta, grad_weight32_ + v0 * h_, h_);
  }
}

void TileProducts::Finish() {
  if (grad_hidden32_ != nullptr && out_.grad_hidden_dtype != DType::kFloat32) {
    ConvertFromFloat(grad_hidden32_, rows_ * h_, out_.grad_hidden_dtype, out_.grad_hidden,
                     r0_ * h_);
  }
}

namespace {

// The first column of z[0:cols] equal to m, or cols. A plain scan with an early exit stays scalar
// and would cost as much as the rest of TileRowStats; blocks are screened with a vectorizable
// any-equal first, and only the block holding m is scanned.
int64_t FirstEqual(const float* z, int64_t cols, float m) {
  constexpr int64_t kBlock = 64;
  int64_t b0 = 0;
  for (; b0 < cols; b0 += kBlock) {
    const int64_t b1 = std::min(cols, b0 + kBlock);
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int64_t c = b0; c < b1; ++c) found |= z[c] == m;
    if (found) break;
  }
  while (b0 < cols && !(z[b0] == m)) ++b0;
  return b0;
}

// Inserts the columns of z[0:cols] that beat the list's last entry, in column order; on equal
// values the lower token wins because only a strictly larger value displaces. Once the list is
// full few columns qualify (about k ln(V / k) of a random row), so blocks of 64 are screened with a
// vectorizable any-greater first and only those holding a candidate are scanned.
inline __attribute__((always_inline)) void UpdateTopK(const float* z, int64_t cols, int64_t v0,
                                                      const TopKList& top) {
  constexpr int64_t kBlock = 64;
  float* values = top.values;
  int32_t* tokens = top.tokens;
  const int last = top.k - 1;
  for (int64_t b0 = 0; b0 < cols; b0 += kBlock) {
    const int64_t b1 = std::min(cols, b0 + kBlock);
    const float threshold = values[last];
    int any_greater = 0;
#pragma omp simd reduction(| : any_greater)
    for (int64_t c = b0; c < b1; ++c) any_greater |= z[c] > threshold;
    if (!any_greater) continue;
    for (int64_t c = b0; c < b1; ++c) {
      const float x = z[c];
      if (!(x > values[last])) continue;
      int j = last;
      while (j > 0 && x > values[j - 1]) {
        values[j] = values[j - 1];
        tokens[j] = tokens[j - 1];
        --j;
      }
      values[j] = x;
      tokens[j] = static_cast<int32_t>(v0 + c);
    }
  }
}

// The sums over one block z[0:cols] against the running max m, added to the tile's; compiled once
// per kind of work so that each loop vectorizes without branches.
template <bool kExtraSums, bool kStoreExp>
inline __attribute__((always_inline)) void BlockSums(float* z, int64_t cols, float m,
                                                     double& sum_exp, double& sum_exp_shifted,
                                                     double& sum_z) {
  float block_z = 0.0f;
  float block_exp = 0.0f;
  float block_exp_shifted = 0.0f;
#pragma omp simd reduction(+ : block_z, block_exp, block_exp_shifted)
  for (int64_t c = 0; c < cols; ++c) {
    const float d = z[c] - m;
    const float e = Exp(d);
    block_exp += e;
    if constexpr (kExtraSums) {
      block_z += z[c];
      block_exp_shifted += e * d;
    }
    if constexpr (kStoreExp) z[c] = e;
  }
  sum_exp += block_exp;
  if constexpr (kExtraSums) {
    sum_z += block_z;
    sum_exp_shifted += block_exp_shifted;
  }
}

bool AnyNaN(const float* z, int64_t cols) {
  int found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t c = 0; c < cols; ++c) found |= z[c] != z[c];
  return found != 0;
}

LOSSD_ROW_LOOP float MaxAbsClones(const float* x, int64_t count) {
  float m = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < count; ++i) m = MaxStep(m, std::fabs(x[i]));
  return m;
}

// Statistics of one row over one vocabulary tile, reading it once: block by block (a block stays
// in L1 between its max and its sums), against a running max m. When a block raises the max to
// m', the sums so far move to it as in MergeRowStats: s' = s e^(m - m'),
// t' = (t + (m - m') s) e^(m - m'). With work.store_exp, block b's exponentials are taken against
// the running max of that block, which is recorded in block_max[b] for the gradient pass. The
// block max also screens the block for the row's top-k list, which it updates while the block is
// in L1: a separate pass would read the row from memory once more.
LOSSD_ROW_LOOP RowStats TileRowStatsClones(float* z, int64_t cols, int64_t v0, int64_t label,
                                           TileStatsWork work, const TopKList& top,
                                           float* block_max) {
  RowStats s = EmptyRowStats();
  if (label >= v0 && label < v0 + cols) s.target = z[label - v0];
  float m = -INFINITY;
  int64_t argmax = -1;
  bool saw_non_finite = false;  // a NaN or -inf logit (+inf shows as a NaN statistic anyway)
  double sum_z = 0.0;
  double sum_exp = 0.0;
  double sum_exp_shifted = 0.0;
  for (int64_t b0 = 0; b0 < cols; b0 += kSumBlock) {
    const int64_t len = std::min(kSumBlock, cols - b0);
    float* block = z + b0;
    float bm = -INFINITY;
    float block_min = INFINITY;
#pragma omp simd reduction(max : bm) reduction(min : block_min)
    for (int64_t c = 0; c < len; ++c) {
      bm = MaxStep(bm, block[c]);
      block_min = MinStep(block_min, block[c]);
    }
    // Its exponential would be 0, but a -inf logit comes only from an overflow or an infinite
    // input: the row is flagged whether or not the call sums the logits (which would carry it).
    saw_non_finite = saw_non_finite || block_min == -INFINITY;
    if (top.k > 0 && bm > top.values[top.k - 1]) UpdateTopK(block, len, v0 + b0, top);
    if (bm > m) {  // equal maxima keep the earlier, lower id
      if (argmax >= 0) {
        const float shift = m - bm;
        const double scale = Exp(shift);
        sum_exp_shifted = (sum_exp_shifted + shift * sum_exp) * scale;
        sum_exp *= scale;
      }
      m = bm;
      argmax = b0 + FirstEqual(block, len, bm);
    }
    if (work.store_exp) block_max[b0 / kSumBlock] = m;
    if (argmax < 0) {
      // Nothing comparable yet: the block holds only -inf (exponentials 0) and NaN.
      saw_non_finite = saw_non_finite || AnyNaN(block, len);
      if (work.store_exp || work.zero_after) std::fill(block, block + len, 0.0f);
      continue;
    }
    if (work.extra_sums && work.store_exp) {
      BlockSums<true, true>(block, len, m, sum_exp, sum_exp_shifted, sum_z);
    } else if (work.extra_sums) {
      BlockSums<true, false>(block, len, m, sum_exp, sum_exp_shifted, sum_z);
    } else if (work.store_exp) {
      BlockSums<false, true>(block, len, m, sum_exp, sum_exp_shifted, sum_z);
    } else {
      BlockSums<false, false>(block, len, m, sum_exp, sum_exp_shifted, sum_z);
    }
    if (work.zero_after) std::fill(block, block + len, 0.0f);
  }
  // A NaN or -inf logit (or a row without a comparable one) marks the row non-finite through any
  // merge by its NaN sum_z.
  s.sum_z = saw_non_finite || argmax < 0 ? NAN : static_cast<float>(sum_z);
  if (argmax < 0) return s;
  s.max = m;
  s.sum_exp = static_cast<float>(sum_exp);
  s.sum_exp_shifted = static_cast<float>(sum_exp_shifted);
  s.argmax = static_cast<int32_t>(v0 + argmax);
  return s;
}

}  // namespace

float MaxAbs(const float* x, int64_t count) { return MaxAbsClones(x, count); }

int64_t WeightSlabFloats(DType dtype, int64_t cols, int64_t h) {
  return dtype == DType::kFloat32 ? 0 : std::min(cols, WeightSlabRows(h)) * h;
}

ChunkBuffers CarveChunkBuffers(WorkspaceArena& arena, const ProblemShape& s, int64_t rows,
                               int64_t cols, int64_t weight_slab_floats) {
  ChunkBuffers b{};
  const int64_t h = s.hidden_size;
  b.logits = arena.Take<float>(rows * cols);
  if (s.hidden_dtype != DType::kFloat32) b.hidden32 = arena.Take<float>(rows * h);
  if (s.grad_hidden && s.grad_hidden_dtype != DType::kFloat32) {
    b.grad_hidden32 = arena.Take<float>(rows * h);
  }
  if (weight_slab_floats > 0) b.weight32 = arena.Take<float>(weight_slab_floats);
  b.stats = arena.Take<RowStats>(rows);
  if (s.grad_weight) b.hidden_max_abs = arena.Take<float>(rows);
  if (s.top_k > 0) {
    b.top_values = arena.Take<float>(rows * s.top_k);
    b.top_tokens = arena.Take<int32_t>(rows * s.top_k);
  }
  return b;
}

RowStats TileRowStats(float* z, int64_t cols, int64_t v0, int64_t label, TileStatsWork work,
                      const TopKList& top, float* block_max) {
  return TileRowStatsClones(z, cols, v0, label, work, top, block_max);
}

}  // namespace cpu

namespace {

using cpu::BlocksPerRow;
using cpu::CarveChunkBuffers;
using cpu::ChunkBuffers;
using cpu::ComputeLogits;
using cpu::ConvertFromFloat;
using cpu::ConvertToFloat;
using cpu::CpuChunkCall;
using cpu::ForEachWeightSlab;
using cpu::kSumBlock;
using cpu::MaxAbs;
using cpu::TileRowStats;
using cpu::TileStatsWork;
using cpu::WeightSlabFloats;
using cpu::WeightSlabRows;

constexpr TileLimits kCpuTileLimits = {
    /*max_token_chunk=*/4096,
    /*min_single_pass_rows=*/64,
    /*two_pass_token_chunk=*/256,
    /*min_vocab_chunk=*/256,
    /*vocab_chunk_multiple=*/256,
    /*token_chunk_multiple=*/64,
    /*forward_token_chunk=*/4096,
};

// The workspace of one call, carved from the caller's buffer.
struct CpuWorkspace {
  ChunkBuffers chunk;
  RowResult* results;      // [Nc]
  RowGradient* row_grads;  // [Nc]
  float* block_max;        // [Nc, ceil(Vc / kSumBlock)]: running maxima of the exponentials kept
};

CpuWorkspace CarveWorkspace(WorkspaceArena& arena, const ProblemShape& s, int64_t rows,
                            int64_t cols) {
  CpuWorkspace w{};
  w.chunk = CarveChunkBuffers(arena, s, rows, cols,
                              WeightSlabFloats(s.weight_dtype, cols, s.hidden_size));
  w.results = arena.Take<RowResult>(rows);
  if (WantsGradients(s)) {
    w.row_grads = arena.Take<RowGradient>(rows);
    w.block_max = arena.Take<float>(rows * BlocksPerRow(cols));
  }
  return w;
}

// z[0:cols] <- dL/da in place; rows with an entropy bonus take its extra factor per logit.
LOSSD_ROW_LOOP void RowLogitGradients(float* z, int64_t cols, int64_t v0, const RowGradient& g,
                                      const LogitTransform& transform) {
  const bool label_here = g.label >= v0 && g.label < v0 + cols;
  const float label_z = label_here ? z[g.label - v0] : 0.0f;
  if (g.entropy_scale != 0.0f) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) z[c] = EntropyLogitGradient(z[c], false, g, transform);
    if (label_here) z[g.label - v0] = EntropyLogitGradient(label_z, true, g, transform);
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) z[c] = LogitGradient(z[c], false, g, transform);
  if (label_here) z[g.label - v0] = LogitGradient(label_z, true, g, transform);
}

// e[0:cols], a whole row left by TileRowStats with store_exp (block b against block_max[b]),
// <- dL/da in place. e_v exp(m_b - m) = exp(z_v - m), so block b's factor is
// ExpGradientScale * exp(m_b - m).
LOSSD_ROW_LOOP void RowLogitGradientsFromExp(float* e, int64_t cols, const float* block_max,
                                             const RowStats& stats, const RowGradient& g,
                                             const LogitTransform& transform) {
  const float row_scale = ExpGradientScale(g, stats.sum_exp);
  const auto block_scale = [&](int64_t b) { return row_scale * Exp(block_max[b] - stats.max); };
  const float label_e = g.label >= 0 ? e[g.label] : 0.0f;
  for (int64_t b0 = 0; b0 < cols; b0 += kSumBlock) {
    const int64_t len = std::min(kSumBlock, cols - b0);
    const float scale = block_scale(b0 / kSumBlock);
    float* block = e + b0;
#pragma omp simd
    for (int64_t c = 0; c < len; ++c)
      block[c] = LogitGradientFromExp(block[c], false, g, scale, transform);
  }
  if (g.label >= 0) {
    e[g.label] =
        LogitGradientFromExp(label_e, true, g, block_scale(g.label / kSumBlock), transform);
  }
}

class CpuBackend final : public Backend {
 public:
  absl::string_view kind() const override { return "cpu"; }

  std::string Describe() const override {
    return absl::StrCat("cpu: ", openblas_get_num_threads(), " BLAS threads, ",
                        omp_get_max_threads(), " OpenMP threads, ", openblas_get_config());
  }

  absl::StatusOr<DeviceMemory> QueryMemory() const override {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t value_kib = 0;
    std::string unit;
    int64_t total = -1;
    int64_t available = -1;
    while (meminfo >> key >> value_kib >> unit) {
      if (key == "MemTotal:") total = value_kib * 1024;
      if (key == "MemAvailable:") available = value_kib * 1024;
    }
    if (total < 0 || available < 0) return absl::UnavailableError("/proc/meminfo: unreadable");
    return DeviceMemory{total, total - available};
  }

  // 1/16 of the host's memory, within [256 MiB, 1 GiB]. OpenBLAS packs W for every product, so
  // each token chunk costs a pass over the head: at N = 4096, H = 2048, V = 128256 a call of eight
  // 512-row chunks (256 MiB) ran 1.03 to 1.04x the GEMM floor, one of two 2048-row chunks (1 GiB)
  // 0.99 to 1.00x, and 4096 rows (2 GiB) no faster (bench/RESULTS.md). Past 1 GiB only memory
  // grows.
  size_t DefaultWorkspaceBudget() const override {
    constexpr size_t kMostPaying = size_t{1} << 30;
    const absl::StatusOr<DeviceMemory> memory = QueryMemory();
    if (!memory.ok()) return kBaseWorkspaceBudget;
    return std::clamp(static_cast<size_t>(memory->total_bytes) / 16, kBaseWorkspaceBudget,
                      kMostPaying);
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    return AllocateHostBuffer(this, bytes);
  }

  absl::Status CopyToDevice(const void* host, size_t bytes, DeviceBuffer& dst,
                            size_t dst_offset) override {
    if (dst_offset + bytes > dst.bytes())
      return absl::OutOfRangeError("copy past the buffer's end");
    std::memcpy(static_cast<char*>(dst.data()) + dst_offset, host, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyToHost(const DeviceBuffer& src, size_t src_offset, size_t bytes,
                          void* host) override {
    if (src_offset + bytes > src.bytes())
      return absl::OutOfRangeError("copy past the buffer's end");
    std::memcpy(host, static_cast<const char*>(src.data()) + src_offset, bytes);
    return absl::OkStatus();
  }

  // In parallel: a fresh buffer's first touch is the page faults that map it, which cost more
  // than the zeroing itself (a 1 GiB dL/dW staging buffer: 0.6 s on one core, 0.3 s on two).
  absl::Status Zero(DeviceBuffer& buffer) override {
    constexpr size_t kBlock = size_t{1} << 20;
    char* data = static_cast<char*>(buffer.data());
    const size_t bytes = buffer.bytes();
    const int64_t blocks = static_cast<int64_t>((bytes + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const size_t begin = static_cast<size_t>(b) * kBlock;
      std::memset(data + begin, 0, std::min(kBlock, bytes - begin));
    }
    return absl::OkStatus();
  }

  absl::Status AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src, int64_t count) override {
    float* d = static_cast<float*>(dst.data());
    const float* s = static_cast<const float*>(src.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) d[i] += s[i];
    return absl::OkStatus();
  }

  absl::Status ScaleFloat32(DeviceBuffer& x, int64_t count, float factor) override {
    float* data = static_cast<float*>(x.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) data[i] *= factor;
    return absl::OkStatus();
  }

  absl::Status ConvertFloat32(const DeviceBuffer& src, DeviceBuffer& dst, DType dst_dtype,
                              int64_t count) override {
    const float* from = static_cast<const float*>(src.data());
    void* to = dst.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) StoreFromFloat(to, dst_dtype, i, from[i]);
    return absl::OkStatus();
  }

  absl::StatusOr<double> SumSquaresFloat32(const DeviceBuffer& x, int64_t count) override {
    // Fixed blocks summed in order, so the result does not depend on the thread count.
    constexpr int64_t kBlocks = 256;
    const float* data = static_cast<const float*>(x.data());
    std::vector<double> partial(kBlocks, 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < kBlocks; ++b) {
      const int64_t begin = count * b / kBlocks;
      const int64_t end = count * (b + 1) / kBlocks;
      double sum = 0.0;
      for (int64_t i = begin; i < end; ++i) sum += static_cast<double>(data[i]) * data[i];
      partial[b] = sum;
    }
    double total = 0.0;
    for (double p : partial) total += p;
    return total;
  }

  absl::StatusOr<OptimizerStepResult> OptimizerStep(const OptimizerConfig& config,
                                                    const OptimizerTensors& t) override {
    const OptimizerScalars s = MakeOptimizerScalars(config);
    const float* grad = static_cast<const float*>(t.grad->data());
    float* state1 = t.state1 != nullptr ? static_cast<float*>(t.state1->data()) : nullptr;
    float* state2 = t.state2 != nullptr ? static_cast<float*>(t.state2->data()) : nullptr;
    const bool adamw = config.kind == OptimizerConfig::Kind::kAdamW;
    if (adamw && (state1 == nullptr || state2 == nullptr)) {
      return absl::FailedPreconditionError("AdamW: expected both moment buffers");
    }
    void* weight = t.weight->data();
    const bool has_state1 = state1 != nullptr;
    const bool has_state2 = adamw;
    const auto update = [&](int64_t i) {
      return UpdateElement(adamw, has_state1, LoadAsFloat(weight, t.weight_dtype, i), grad[i],
                           has_state1 ? state1[i] : 0.0f, has_state2 ? state2[i] : 0.0f, s);
    };
    // The check: nothing is written unless every updated value is finite as stored.
    double first = HUGE_VAL;
#pragma omp parallel for schedule(static) reduction(min : first)
    for (int64_t i = 0; i < t.count; ++i) {
      const double code = NonFiniteUpdateCode(update(i), i, t.served_dtype.value_or(t.weight_dtype),
                                              has_state1, has_state2);
      if (code != 0.0 && code < first) first = code;
    }
    const OptimizerStepResult result = OptimizerResultFromCode(first);
    if (!result.applied()) return result;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t.count; ++i) {
      const ElementUpdate u = update(i);
      StoreFromFloat(weight, t.weight_dtype, i, u.weight);
      if (has_state1) state1[i] = u.state1;
      if (has_state2) state2[i] = u.state2;
    }
    return result;
  }

  // 16-bit rows are widened into the workspace once per chunk and read only there; fp32 rows are
  // read in place, by the logits' product and again by dL/dW's.
  bool ReadsRowsOnce(DType hidden_dtype) const override { return hidden_dtype != DType::kFloat32; }
  bool ComputesOnHostCores() const override { return true; }

  absl::StatusOr<ChunkPlan> Plan(const ProblemShape& shape, size_t budget_bytes) const override {
    if (shape.teacher.kind != TeacherKind::kNone) {
      return ChooseChunkPlan(shape, budget_bytes, cpu::DistillTileLimits(),
                             [&](int64_t rows, int64_t cols) {
                               return cpu::DistillWorkspaceBytes(shape, rows, cols);
                             });
    }
    return ChooseChunkPlan(shape, budget_bytes, kCpuTileLimits, [&](int64_t rows, int64_t cols) {
      WorkspaceArena arena(nullptr, 0);
      CarveWorkspace(arena, shape, rows, cols);
      return arena.used();
    });
  }

  absl::StatusOr<BatchSummary> Compute(const BatchInputs& in, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& out,
                                       DeviceBuffer* grad_weight, DeviceBuffer& workspace) override;

 protected:
  void Free(void* data, size_t) override { std::free(data); }

 private:
  // One engine chunk at a time: OpenMP and OpenBLAS spread each over every core, and two at once
  // oversubscribe them (threads spin waiting for threads the other call preempted): two concurrent
  // training calls took 1.6x as long in all as the same calls one after the other. Calls take
  // turns chunk by chunk; their rows' reading and results' sending still overlap the engine.
  absl::Mutex cores_;
};

// One Compute call on the CPU, in the same phases as the CUDA backend's: per token chunk,
// RowStatistics (pass 1 over the vocabulary tiles), FinishRows and, with gradients, Gradients
// (pass 2). Where one tile holds the whole vocabulary, pass 1 also finishes each row and turns its
// logits into dL/da while the row is in cache, so FinishRows only writes outputs.
class CpuCall : CpuChunkCall {
 public:
  CpuCall(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
          const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
          const CpuWorkspace& ws)
      : CpuChunkCall(in, weight, options, out, grad_weight, call, ws.chunk), ws_(ws) {}

  void Run(BatchSummary& summary) {
    RunChunks(summary, [&](int64_t r0, int64_t rows) {
      RowStatistics(r0, rows);
      FinishRows(r0, rows, summary);
      if (gradients_) Gradients(r0, rows);
    });
  }

 private:
  // The rows x columns at the start of the logits tile known to hold zeros: a tile that nothing
  // reads after its statistics is cleared by that pass while in L1, and the next product adds onto
  // it. Nothing is assumed of the workspace a call is given.
  bool ProductOntoZero(int64_t rows, int64_t cols) const {
    return rows <= zero_rows_ && cols <= zero_cols_;
  }

  // FinishRow and the gradient constants of chunk row r (call row r0 + r).
  void FinishChunkRow(int64_t r0, int64_t r) {
    ws_.results[r] = finisher_.Finish(r0 + r, buffers_.stats[r]);
    if (gradients_) ws_.row_grads[r] = finisher_.Gradient(r0 + r, ws_.results[r]);
    NoteHiddenMaxAbs(r);
  }

  // Pass 1: row statistics over every vocabulary tile. When one tile holds the whole vocabulary,
  // each row is finished while it is still in cache: statistics, results, and for training dL/da
  // in place, from the exponentials the statistics pass leaves when there is no soft cap. Under
  // sequence_ratio a row is finished only once every row of its sequence has its statistics: after
  // the pass, from the tile as it left it.
  void RowStatistics(int64_t r0, int64_t rows) {
    const LogitTransform& transform = finisher_.transform();
    const int64_t* labels = in_.labels + r0;
    ClearRowStats(rows);
    const bool rows_finished_in_tile = logits_resident_ && gradients_;  // dL/da stays in the tile
    const bool finish_in_pass = logits_resident_ && !sequence_ratio();
    // The entropy bonus needs each row's entropy, and its gradient reads z (not e^(z - m)).
    const bool entropy_bonus = options_.policy.entropy_coef != 0.0;
    const bool store_exp = rows_finished_in_tile && transform.softcap == 0.0f && !entropy_bonus;
    for (int64_t v0 = 0; v0 < v_; v0 += tile_cols_) {
      const int64_t cols = std::min(tile_cols_, v_ - v0);
      const bool onto_zero = ProductOntoZero(rows, cols);
      ComputeLogits(hidden32_, rows, weight_, v0, cols, buffers_.weight32, transform,
                    buffers_.logits, tile_cols_, onto_zero);
      const bool another_product = gradients_ || r0 + rows < in_.num_tokens || v0 + cols < v_;
      const TileStatsWork work{/*extra_sums=*/out_.entropy != nullptr ||
                                   options_.label_smoothing != 0.0 || entropy_bonus,
                               store_exp,
                               /*zero_after=*/!rows_finished_in_tile && another_product};
      if (!work.zero_after) {
        zero_rows_ = zero_cols_ = 0;
      } else if (!onto_zero) {
        zero_rows_ = rows;
        zero_cols_ = cols;
      }
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        MergeRowStats(buffers_.stats[r], TileRowStats(LogitsRow(r), cols, v0, labels[r], work,
                                                      TopKOf(r), BlockMaxOf(r, store_exp)));
        if (finish_in_pass) FinishResidentRow(r0, r, store_exp);
      }
    }
    if (logits_resident_ && !finish_in_pass) {
      MeasureSequenceRatios(r0, rows);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) FinishResidentRow(r0, r, store_exp);
    }
  }

  float* BlockMaxOf(int64_t r, bool store_exp) const {
    return store_exp ? ws_.block_max + r * BlocksPerRow(tile_cols_) : nullptr;
  }

  // Chunk row r finished from its statistics, and with gradients its logits, which the only tile
  // holds, turned into dL/da in place.
  void FinishResidentRow(int64_t r0, int64_t r, bool store_exp) {
    FinishChunkRow(r0, r);
    if (!gradients_) return;
    float* z = LogitsRow(r);
    if (store_exp) {
      RowLogitGradientsFromExp(z, v_, BlockMaxOf(r, store_exp), buffers_.stats[r], ws_.row_grads[r],
                               finisher_.transform());
    } else {
      RowLogitGradients(z, v_, 0, ws_.row_grads[r], finisher_.transform());
    }
  }

  // The rows pass 1 left unfinished, then every row's outputs and the loss, summed in row order
  // in double.
  void FinishRows(int64_t r0, int64_t rows, BatchSummary& summary) {
    if (!logits_resident_) {
      MeasureSequenceRatios(r0, rows);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) FinishChunkRow(r0, r);
    }
    EmitRows(rows, summary, [&](int64_t r) {
      finisher_.Emit(r0 + r, ws_.results[r], buffers_.stats[r], buffers_.top_values + r * k_,
                     buffers_.top_tokens + r * k_, summary);
      return grad_weight32_ != nullptr ? LogitGradientBound(ws_.row_grads[r], finisher_.transform())
                                       : 0.0;
    });
  }

  // Pass 2: dL/da tile by tile where the vocabulary is tiled (recomputing the logits), then
  // dh += dA W and dW += dA^T h.
  void Gradients(int64_t r0, int64_t rows) {
    const LogitTransform& transform = finisher_.transform();
    GradientProducts(r0, rows, [&](int64_t v0, int64_t cols) {
      if (logits_resident_) return;  // pass 1 left dL/da in the tile
      ComputeLogits(hidden32_, rows, weight_, v0, cols, buffers_.weight32, transform,
                    buffers_.logits, tile_cols_, ProductOntoZero(rows, cols));
      zero_rows_ = zero_cols_ = 0;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        RowLogitGradients(LogitsRow(r), cols, v0, ws_.row_grads[r], transform);
      }
    });
  }

  const CpuWorkspace& ws_;
  int64_t zero_rows_ = 0;
  int64_t zero_cols_ = 0;
};

absl::StatusOr<BatchSummary> CpuBackend::Compute(const BatchInputs& in, const WeightView& weight,
                                                 const LossOptions& options,
                                                 const TokenOutputs& out, DeviceBuffer* grad_weight,
                                                 DeviceBuffer& workspace) {
  ASSIGN_OR_RETURN(const CallPlan call,
                   PlanCall(*this, in, weight, options, out, grad_weight, workspace));
  absl::MutexLock cores(&cores_);
  if (options.objective == Objective::kDistill) {
    return cpu::RunDistill(in, weight, options, out, grad_weight, call, workspace);
  }
  WorkspaceArena arena(workspace.data(), workspace.bytes());
  const CpuWorkspace ws =
      CarveWorkspace(arena, call.shape, call.plan.token_chunk, call.plan.vocab_chunk);
  BatchSummary summary = PlannedSummary(call.plan, arena.used());
  CpuCall(in, weight, options, out, grad_weight, call, ws).Run(summary);
  return summary;
}

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace lossd
