// The one interface every compute backend (CPU, CUDA) implements. It carries no device types:
// memory on the backend's device is an opaque DeviceBuffer that only its backend dereferences.
#ifndef LOSSD_KERNELS_BACKEND_H_
#define LOSSD_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lossd/kernels/types.h"

namespace lossd {

class BufferAllocator;

// Memory from a BufferAllocator: a backend's device memory (host memory for the CPU backend), or
// host memory from a HostAllocator. Freed by its owner.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(BufferAllocator* owner, void* data, size_t bytes)
      : owner_(owner), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void Reset();
  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  BufferAllocator* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// What hands out DeviceBuffers and takes them back as they are destroyed.
class BufferAllocator {
 public:
  virtual ~BufferAllocator() = default;
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data, size_t bytes) = 0;
};

// Host memory, 256-byte aligned and not zeroed, whatever the compute device: rows staged on the
// host on their way to it, for one.
class HostAllocator final : public BufferAllocator {
 public:
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;

 protected:
  void Free(void* data, size_t bytes) override;
};

// W, [vocab_size, hidden_size] row-major, resident on the backend's device.
struct WeightView {
  const DeviceBuffer* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
};

enum class TeacherKind : int { kNone = 0, kDense = 1, kSparse = 2 };

// A distill call's teacher, as far as it shapes the workspace (TeacherInputs).
struct TeacherShape {
  TeacherKind kind = TeacherKind::kNone;
  int64_t hidden_size = 0;               // dense
  DType hidden_dtype = DType::kFloat32;  // dense
  DType weight_dtype = DType::kFloat32;  // dense
  int top_k = 0;                         // sparse
};

// What a call will compute; enough to plan its chunking and size its workspace.
struct ProblemShape {
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  DType hidden_dtype = DType::kFloat32;
  DType weight_dtype = DType::kFloat32;
  bool grad_hidden = false;
  bool grad_weight = false;
  DType grad_hidden_dtype = DType::kFloat32;
  int top_k = 0;
  // LossOptions::exact_gradients: a GPU backend's 16-bit products then hold dL/da in two halves.
  bool exact_gradients = false;
  // PolicyOptions::sequence_ratio: chunks end at sequence ends, and each keeps its rows'
  // log-ratios.
  bool sequence_ratio = false;
  // With a teacher every chunk holds two logits tiles, the student's and the teacher's, and the
  // workspace both of them.
  TeacherShape teacher;
};

// Tokens x vocabulary tiling. When vocab_chunk < vocab_size and gradients are wanted, the logits of
// each tile are computed twice (lse first, then the gradient): 8NHV flops instead of 6NHV.
struct ChunkPlan {
  int64_t token_chunk = 0;
  int64_t vocab_chunk = 0;
  size_t workspace_bytes = 0;
  // Rows whose fp32 logits a backend holds at once, when fewer than token_chunk: the chunk's rows
  // are finished in pieces of this many, and its gradient products still contract over the whole
  // chunk (a window of 16-bit dL/da). 0: token_chunk.
  int64_t logit_rows = 0;
};

struct DeviceMemory {
  int64_t total_bytes = 0;
  int64_t used_bytes = 0;
};

struct OptimizerConfig {
  enum class Kind : int { kSgd = 0, kAdamW = 1 };
  Kind kind = Kind::kSgd;
  double learning_rate = 1e-3;
  double momentum = 0.0;  // SGD
  double beta1 = 0.9;     // AdamW
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0.0;     // SGD: L2 added to the gradient; AdamW: decoupled
  int64_t step = 1;              // 1-based count of this update, for AdamW's bias correction
  double grad_multiplier = 1.0;  // applied to the gradient first (global-norm clipping)
};

// Buffers of one optimizer update; count elements each. Gradient and state are fp32.
// state1 is null for SGD without a momentum buffer.
struct OptimizerTensors {
  DeviceBuffer* weight = nullptr;
  DType weight_dtype = DType::kFloat32;
  const DeviceBuffer* grad = nullptr;
  DeviceBuffer* state1 = nullptr;  // SGD momentum buffer or AdamW first moment
  DeviceBuffer* state2 = nullptr;  // AdamW second moment
  int64_t count = 0;
  // The dtype the new weight is served in when that is narrower than weight_dtype (fp32 master
  // weights of a 16-bit W, which a caller rounds them to after the step): the update must be
  // finite as that dtype stores it too. Unset: weight_dtype.
  std::optional<DType> served_dtype;
};

// What an optimizer update did (Backend::OptimizerStep).
struct OptimizerStepResult {
  // Where the first value that would not have been finite was to go; kNone when the update was
  // written.
  enum class NonFinite : int { kNone = 0, kWeight = 1, kState1 = 2, kState2 = 3 };
  NonFinite non_finite = NonFinite::kNone;
  int64_t element = -1;  // its index, row-major over [V, H]; -1 with kNone
  bool applied() const { return non_finite == NonFinite::kNone; }
};

class Backend : public BufferAllocator {
 public:
  virtual absl::string_view kind() const = 0;  // "cpu" or "cuda"
  virtual std::string Describe() const = 0;    // human-readable device and library versions
  // Total and used memory of the device, as its driver (or the OS, for the CPU) reports them now.
  virtual absl::StatusOr<DeviceMemory> QueryMemory() const = 0;

  virtual absl::Status CopyToDevice(const void* host, size_t bytes, DeviceBuffer& dst,
                                    size_t dst_offset) = 0;
  virtual absl::Status CopyToHost(const DeviceBuffer& src, size_t src_offset, size_t bytes,
                                  void* host) = 0;
  virtual absl::Status Zero(DeviceBuffer& buffer) = 0;
  // dst[i] += src[i] for count fp32 elements, in a fixed order.
  virtual absl::Status AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src, int64_t count) = 0;
  // sum_i x[i]^2 over count fp32 elements, accumulated in double in a fixed order.
  virtual absl::StatusOr<double> SumSquaresFloat32(const DeviceBuffer& x, int64_t count) = 0;
  // x[i] *= factor for count fp32 elements (a staged dL/dW times its upstream gradient).
  virtual absl::Status ScaleFloat32(DeviceBuffer& x, int64_t count, float factor) = 0;
  // dst[i] = src[i] rounded to dst_dtype (to nearest even), count elements: a 16-bit head's W
  // from its fp32 master weights.
  virtual absl::Status ConvertFloat32(const DeviceBuffer& src, DeviceBuffer& dst, DType dst_dtype,
                                      int64_t count) = 0;
  // One optimizer update, all or nothing: a first pass computes every element's new weight (as
  // stored, in weight_dtype) and state without writing them, and only when all are finite does
  // a second pass write them. Otherwise nothing is written and the result names the first
  // element at fault, so that a caller can refuse the step and leave W and the state as they
  // were. (A trainer whose step overflows, a learning rate of 1e38 say, would otherwise leave a
  // W on which every later call fails, and checkpoint it.)
  virtual absl::StatusOr<OptimizerStepResult> OptimizerStep(const OptimizerConfig& config,
                                                            const OptimizerTensors& tensors) = 0;

  // Host memory that this backend's device copies to and from fastest (page-locked memory for a
  // GPU; plain memory for the CPU), as ggml's backends offer their host buffer type: for buffers
  // a caller fills with rows or reads dL/dh from, which Compute then copies without staging them.
  virtual BufferAllocator& HostBuffers() { return host_buffers_; }

  // The per-call workspace budget a server uses when none is configured. Larger budgets mean fewer
  // token chunks, each of which streams W through the products once more, so the default grows
  // with the device's memory where measurements showed that it pays (see the CPU backend's).
  virtual size_t DefaultWorkspaceBudget() const { return kBaseWorkspaceBudget; }
  static constexpr size_t kBaseWorkspaceBudget = size_t{256} << 20;

  // The chunking for `shape` whose workspace fits `budget_bytes`, or RESOURCE_EXHAUSTED when even
  // the smallest tile does not fit. Peak extra memory of Compute is plan.workspace_bytes.
  virtual absl::StatusOr<ChunkPlan> Plan(const ProblemShape& shape, size_t budget_bytes) const = 0;

  // Whether Compute reads every element of inputs.hidden exactly once, copying or converting each
  // chunk of rows into memory of its own before it computes anything from them. Rows that another
  // process can rewrite during the call (a client's shared memory) must otherwise be copied out
  // first: a backend that reads them again, say for dL/dW after the finiteness check of the
  // logits, could commit a gradient of values that check never saw.
  virtual bool ReadsRowsOnce(DType hidden_dtype) const = 0;

  // Whether Compute runs on the host's own cores, which a client on the same host that copies its
  // next rows while the engine computes would share (SharedMemorySocket.rows_follow_pays).
  virtual bool ComputesOnHostCores() const = 0;

  // Computes one batch. The workspace's size is the budget: Compute plans against it exactly as
  // Plan(shape, workspace.bytes()) does and uses no other scratch memory on the device.
  // dL/dW is accumulated (+=) into grad_weight ([V, H] fp32) when it is not null, or stored there
  // with options.overwrite_grad_weight.
  virtual absl::StatusOr<BatchSummary> Compute(const BatchInputs& inputs, const WeightView& weight,
                                               const LossOptions& options,
                                               const TokenOutputs& outputs,
                                               DeviceBuffer* grad_weight,
                                               DeviceBuffer& workspace) = 0;

 private:
  HostAllocator host_buffers_;
};

// A fault that leaves the backend's device unusable for the rest of the process (CUDA's sticky
// errors: an illegal address, a trap in a kernel, an uncorrectable ECC error): every later call on
// the device fails the same way, and only a new process gets a working device again. A backend
// reports it as an UNAVAILABLE status carrying a payload that IsDeviceFault recognizes, so that
// callers act on the condition itself, never on the message's text.
absl::Status DeviceFaultError(absl::string_view message);
bool IsDeviceFault(const absl::Status& status);

// "cpu", "cuda", "cuda:N" or "auto" (CUDA when a device is present, else CPU). The CUDA backend is
// a module loaded at run time; `cuda_module_path` overrides where it is looked for. When "auto"
// falls back to the CPU, `cuda_unavailable` (if given) receives why CUDA was not taken.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device,
                                                       absl::string_view cuda_module_path = {},
                                                       std::string* cuda_unavailable = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_BACKEND_H_
