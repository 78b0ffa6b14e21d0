// How far cuBLAS's bf16 products, called as the CUDA backend calls them (RowMajorGemmBlocked:
// bf16 operands, fp32 results, CUBLAS_COMPUTE_32F, the default algorithm, the backend's
// workspace, K split into blocks of at most kMaxProductDepth), land from float64 at the
// contraction lengths of the engine's products on Llama 3 heads: K = H = 2048 and 4096 for the
// logits h W^T, K = V = 128256 for dL/dh = dA W, K = a token chunk of 8192 rows for
// dL/dW = dA^T h; and dL/dh as one cuBLAS call over all of K, the product the blocks replace,
// for comparison. Products of bf16
// values are exact in fp32, so the error is the accumulation's, and tensor cores may truncate
// rather than round as they accumulate. With random signs the errors mostly cancel either way;
// with every term positive truncation's bias adds up, to about K 2^-24 relative, where rounding
// gives about sqrt(K) 2^-24. Each case prints and records (as a test property) its error. The
// signed cases, like the engine's data, must stay inside the engine's bf16 gradient bound (2e-5,
// tests/engine_test.cc); the positive ones inside K 2^-23, which any fp32 accumulation that loses
// at most an ulp per addition meets. GPU only: skipped without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_gemm.h"
#include "lossd/kernels/half.h"

namespace lossd::cuda {
namespace {

constexpr double kGradBound = 2e-5;  // the engine's bound on dL/dh and dL/dW, relative
constexpr double kUnitRoundoff = 1.0 / (1 << 24);
constexpr int64_t kRows = 128;  // M = N: 16384 outputs, enough for a stable norm

enum class Values { kSigned, kPositive };

struct ProbeCase {
  const char* name;
  int64_t k;
  bool transpose_a;  // true: C = A^T B, dL/dW (A stored [K, M])
  bool transpose_b;  // true: C = A B^T, the logits; false: C = A B, dL/dh
  Values values;
  bool one_call = false;  // RowMajorGemm over all of K in one call instead of the engine's blocks
};

// Device memory freed with its owner.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) {
    if (cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)) != cudaSuccess) {
      data_ = nullptr;
    }
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
};

class GemmProbeTest : public ::testing::TestWithParam<ProbeCase> {
 protected:
  void SetUp() override {
    int devices = 0;
    const cudaError_t counted = cudaGetDeviceCount(&devices);
    if (counted != cudaSuccess || devices == 0) {
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount gave " << cudaGetErrorName(counted)
                   << " (" << cudaGetErrorString(counted) << "), " << devices << " device(s)";
    }
    cudaDeviceProp props;
    ASSERT_EQ(cudaGetDeviceProperties(&props, 0), cudaSuccess);
    device_ = absl::StrFormat("%s (sm_%d%d)", props.name, props.major, props.minor);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cublasCreate(&cublas_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(cublas_, stream_), CUBLAS_STATUS_SUCCESS);
    workspace_bytes_ = CublasWorkspaceBytes(props.major);
    ASSERT_EQ(cudaMalloc(&workspace_, workspace_bytes_), cudaSuccess);
    ASSERT_EQ(cublasSetWorkspace(cublas_, workspace_, workspace_bytes_), CUBLAS_STATUS_SUCCESS);
  }

  void TearDown() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (workspace_ != nullptr) cudaFree(workspace_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string device_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// `count` random bf16 values, and the same values as doubles.
void RandomBf16(int64_t count, Values values, std::mt19937_64& rng, std::vector<uint16_t>& bits,
                std::vector<double>& exact) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  bits.resize(count);
  exact.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    bits[i] = FloatToBFloat16(values == Values::kSigned ? normal(rng) : unit(rng));
    exact[i] = BFloat16ToFloat(bits[i]);
  }
}

TEST_P(GemmProbeTest, Bf16ProductErrorAgainstFloat64) {
  const ProbeCase& c = GetParam();
  const int64_t m = kRows, n = kRows, k = c.k;
  std::mt19937_64 rng(20261124 + k);
  std::vector<uint16_t> a_bits, b_bits;
  std::vector<double> a, b;
  RandomBf16(m * k, c.values, rng, a_bits, a);  // A [m, k], or [k, m] when transposed
  RandomBf16(k * n, c.values, rng, b_bits, b);  // B [n, k] when transposed, else [k, n]

  DeviceArray<uint16_t> d_a(a_bits.size()), d_b(b_bits.size());
  DeviceArray<float> d_c(m * n);
  ASSERT_NE(d_a.get(), nullptr);
  ASSERT_NE(d_b.get(), nullptr);
  ASSERT_NE(d_c.get(), nullptr);
  ASSERT_EQ(cudaMemcpy(d_a.get(), a_bits.data(), a_bits.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_b.get(), b_bits.data(), b_bits.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  const Matrix a_matrix{d_a.get(), DType::kBFloat16, c.transpose_a ? m : k};
  const Matrix b_matrix{d_b.get(), DType::kBFloat16, c.transpose_b ? k : n};
  using Product = absl::Status (*)(cublasHandle_t, bool, bool, int64_t, int64_t, int64_t, float,
                                   const Matrix&, const Matrix&, float, float*, int64_t, bool);
  const Product product_of = c.one_call ? Product{RowMajorGemm} : Product{RowMajorGemmBlocked};
  const absl::Status product =
      product_of(cublas_, c.transpose_a, c.transpose_b, m, n, k, 1.0f, a_matrix, b_matrix, 0.0f,
                 d_c.get(), n, /*allow_tf32=*/false);
  ASSERT_TRUE(product.ok()) << product;
  std::vector<float> result(m * n);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(result.data(), d_c.get(), result.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);

  std::vector<double> reference(m * n);
#pragma omp parallel for schedule(static)
  for (int64_t ij = 0; ij < m * n; ++ij) {
    const int64_t i = ij / n, j = ij % n;
    double sum = 0.0;
    for (int64_t l = 0; l < k; ++l) {
      sum += (c.transpose_a ? a[l * m + i] : a[i * k + l]) *
             (c.transpose_b ? b[j * k + l] : b[l * n + j]);
    }
    reference[ij] = sum;
  }
  double difference = 0.0, norm = 0.0, worst = 0.0;
  for (int64_t ij = 0; ij < m * n; ++ij) {
    const double d = result[ij] - reference[ij];
    difference += d * d;
    norm += reference[ij] * reference[ij];
    worst = std::max(worst, std::abs(d) / std::max(std::abs(reference[ij]), 1e-30));
  }
  const double relative = std::sqrt(difference / norm);
  const double rounding = kUnitRoundoff * std::sqrt(static_cast<double>(k));
  const double truncation = kUnitRoundoff * static_cast<double>(k);
  const char* product_name = c.transpose_a ? "dA^T h" : (c.transpose_b ? "h W^T" : "dA W");
  std::printf(
      "bf16 GEMM %s%s on %s: K = %ld, %s: relative error %.2e (max element %.2e); "
      "accumulation scale: rounding ~%.1e, truncating ~%.1e\n",
      product_name, c.one_call ? " in one call" : " (blocks of 16k)", device_.c_str(),
      static_cast<long>(k), c.values == Values::kSigned ? "random signs" : "all terms positive",
      relative, worst, rounding, truncation);
  RecordProperty("relative_error", absl::StrFormat("%.3e", relative));
  RecordProperty("max_element_relative_error", absl::StrFormat("%.3e", worst));
  EXPECT_TRUE(std::isfinite(relative));
  if (c.values == Values::kSigned) {
    EXPECT_LE(relative, kGradBound) << "the engine's bf16 bounds cannot hold at K = " << k;
  } else {
    EXPECT_LE(relative, 2 * truncation) << "worse than an fp32 accumulation losing an ulp per term";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Llama3, GemmProbeTest,
    ::testing::Values(
        ProbeCase{"logits_k2048_signed", 2048, false, true, Values::kSigned},
        ProbeCase{"logits_k2048_positive", 2048, false, true, Values::kPositive},
        ProbeCase{"logits_k4096_signed", 4096, false, true, Values::kSigned},
        ProbeCase{"logits_k4096_positive", 4096, false, true, Values::kPositive},
        ProbeCase{"grad_hidden_k128256_signed", 128256, false, false, Values::kSigned},
        ProbeCase{"grad_hidden_k128256_positive", 128256, false, false, Values::kPositive},
        ProbeCase{"grad_hidden_k128256_positive_one_call", 128256, false, false, Values::kPositive,
                  /*one_call=*/true},
        ProbeCase{"grad_weight_k8192_signed", 8192, true, false, Values::kSigned},
        ProbeCase{"grad_weight_k8192_positive", 8192, true, false, Values::kPositive}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::cuda
