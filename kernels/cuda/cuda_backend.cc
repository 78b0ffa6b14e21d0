// The CUDA backend: cuBLAS for the products, own kernels for everything else (one .cu file per
// family), with the CPU backend's semantics; a Compute call runs as cuda_compute.h describes it,
// on a pair of pooled streams, planned as cuda_plan.h lays it out.
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
#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_compute.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_plan.h"
#include "kernels/cuda/cuda_status.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/optimizer_math.h"

namespace lossd::cuda {
namespace {

// ---- Streams ----

// Idle stream contexts (cuda_compute.h) of one device, made on first need. A context's cuBLAS
// scratch lets cuBLAS allocate nothing during a call, and neither does SumSquaresFloat32 (a
// cudaFree would wait for every stream of the device).
class StreamPool {
 public:
  explicit StreamPool(size_t cublas_workspace_bytes)
      : cublas_workspace_bytes_(cublas_workspace_bytes) {}
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;
  ~StreamPool() {
    for (StreamContext& context : idle_) DestroyStreamContext(context);
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
    RETURN_IF_ERROR(CreateStreamContext(cublas_workspace_bytes_, context));
    return context;
  }

  void Release(const StreamContext& context) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(context);
  }

 private:
  const size_t cublas_workspace_bytes_;
  std::mutex mutex_;
  std::vector<StreamContext> idle_;
};

// ---- The backend ----

// Page-locked host memory (cudaHostAlloc), which the device reads and writes by DMA at full
// speed: Compute copies rows from it and dL/dh into it without staging them.
class PinnedHostAllocator final : public BufferAllocator {
 public:
  explicit PinnedHostAllocator(int device) : device_(device) {}

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    void* data = nullptr;
    RETURN_IF_ERROR(
        CudaStatus(cudaHostAlloc(&data, std::max<size_t>(bytes, 1), cudaHostAllocPortable),
                   absl::StrCat("cudaHostAlloc of ", bytes, " bytes")));
    return DeviceBuffer(this, data, bytes);
  }

 protected:
  void Free(void* data, size_t) override { cudaFreeHost(data); }

 private:
  const int device_;
};

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
      : device_(device),
        description_(std::move(description)),
        pinned_(device),
        streams_(cublas_workspace_bytes) {}

  ~CudaBackend() override { cudaSetDevice(device_); }  // the pool's streams and handles live there

  absl::string_view kind() const override { return "cuda"; }
  BufferAllocator& HostBuffers() override { return pinned_; }
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
    return RunOnStream([&](StreamContext& c) {
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
    return RunOnStream([&](StreamContext& c) {
      return CudaStatus(cudaMemcpyAsync(host, static_cast<const char*>(src.data()) + src_offset,
                                        bytes, cudaMemcpyDeviceToHost, c.stream),
                        "cudaMemcpyAsync");
    });
  }

  absl::Status Zero(DeviceBuffer& buffer) override {
    return RunOnStream([&](StreamContext& c) {
      return CudaStatus(cudaMemsetAsync(buffer.data(), 0, buffer.bytes(), c.stream),
                        "cudaMemsetAsync");
    });
  }

  absl::Status AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src, int64_t count) override {
    RETURN_IF_ERROR(CheckFloat32Count(dst, count, "dst"));
    RETURN_IF_ERROR(CheckFloat32Count(src, count, "src"));
    return RunOnStream([&](StreamContext& c) {
      return LaunchAddFloat32(static_cast<float*>(dst.data()),
                              static_cast<const float*>(src.data()), count, c.stream);
    });
  }

  absl::Status ScaleFloat32(DeviceBuffer& x, int64_t count, float factor) override {
    RETURN_IF_ERROR(CheckFloat32Count(x, count, "x"));
    return RunOnStream([&](const StreamContext& c) {
      return LaunchScaleFloat32(static_cast<float*>(x.data()), count, factor, c.stream);
    });
  }

  absl::Status ConvertFloat32(const DeviceBuffer& src, DeviceBuffer& dst, DType dst_dtype,
                              int64_t count) override {
    RETURN_IF_ERROR(CheckFloat32Count(src, count, "src"));
    if (dst.bytes() < static_cast<size_t>(count) * DTypeSize(dst_dtype)) {
      return absl::OutOfRangeError(absl::StrCat("dst: expected ", count, " elements"));
    }
    return RunOnStream([&](const StreamContext& c) {
      return LaunchConvertFromFloat(static_cast<const float*>(src.data()), count, dst_dtype,
                                    dst.data(), c.stream);
    });
  }

  absl::StatusOr<double> SumSquaresFloat32(const DeviceBuffer& x, int64_t count) override {
    RETURN_IF_ERROR(CheckFloat32Count(x, count, "x"));
    std::vector<double> partials(kSumSquaresBlocks);
    RETURN_IF_ERROR(RunOnStream([&](StreamContext& c) {
      RETURN_IF_ERROR(LaunchSumSquaresPartials(static_cast<const float*>(x.data()), count,
                                               c.d_sum_squares_partials, c.stream));
      return CudaStatus(
          cudaMemcpyAsync(partials.data(), c.d_sum_squares_partials,
                          partials.size() * sizeof(double), cudaMemcpyDeviceToHost, c.stream),
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
    RETURN_IF_ERROR(RunOnStream([&](StreamContext& c) {
      RETURN_IF_ERROR(LaunchOptimizerCheck(
          config.kind, scalars, t.weight->data(), t.weight_dtype,
          t.served_dtype.value_or(t.weight_dtype), static_cast<const float*>(t.grad->data()),
          state(t.state1), state(t.state2), t.count, c.d_sum_squares_partials, c.stream));
      return CudaStatus(
          cudaMemcpyAsync(partials.data(), c.d_sum_squares_partials,
                          partials.size() * sizeof(double), cudaMemcpyDeviceToHost, c.stream),
          "cudaMemcpyAsync");
    }));
    double first = HUGE_VAL;
    for (double p : partials) first = std::min(first, p);
    const OptimizerStepResult result = OptimizerResultFromCode(first);
    if (!result.applied()) return result;
    RETURN_IF_ERROR(RunOnStream([&](StreamContext& c) {
      return LaunchOptimizerStep(config.kind, scalars, t.weight->data(), t.weight_dtype,
                                 static_cast<const float*>(t.grad->data()), state(t.state1),
                                 state(t.state2), t.count, c.stream);
    }));
    return result;
  }

  // Each chunk's rows are copied to the device once (LoadChunk) and read only there.
  bool ReadsRowsOnce(DType) const override { return true; }
  bool ComputesOnHostCores() const override { return false; }

  absl::StatusOr<ChunkPlan> Plan(const ProblemShape& shape, size_t budget_bytes) const override {
    return PlanCudaCall(shape, budget_bytes);
  }

  // A quarter of the device's free memory within [256 MiB, 8 GiB] (CudaDefaultWorkspaceBudget).
  size_t DefaultWorkspaceBudget() const override {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();  // see CudaStatus
      return kBaseWorkspaceBudget;
    }
    return CudaDefaultWorkspaceBudget(free_bytes);
  }

  absl::StatusOr<BatchSummary> Compute(const BatchInputs& in, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& out,
                                       DeviceBuffer* grad_weight,
                                       DeviceBuffer& workspace) override {
    ASSIGN_OR_RETURN(const CallPlan call,
                     PlanCall(*this, in, weight, options, out, grad_weight, workspace));
    WorkspaceArena arena(workspace.data(), workspace.bytes());
    const CudaWorkspace ws = CarveCudaWorkspace(arena, call.shape, call.plan.token_chunk,
                                                call.plan.vocab_chunk, LogitRows(call.plan));
    BatchSummary summary = PlannedSummary(call.plan, arena.used());
    WorkspaceArena measure(nullptr, 0);
    CarveHostStaging(measure, call.shape, call.plan.token_chunk);
    RETURN_IF_ERROR(RunOnStream([&](StreamContext& c) {
      RETURN_IF_ERROR(EnsureStaging(measure.used(), c));
      WorkspaceArena pinned(c.h_staging, c.staging_bytes);
      const HostStaging staging = CarveHostStaging(pinned, call.shape, call.plan.token_chunk);
      ChunkedCompute compute(in, weight, options, out, grad_weight, call, ws, staging, c);
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(c.call_start, c.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(compute.Run());
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(c.call_end, c.stream), "cudaEventRecord"));
      // The call's one wait for the device.
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(c.call_end), "cudaEventSynchronize"));
      float milliseconds = 0.0f;
      RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&milliseconds, c.call_start, c.call_end),
                                 "cudaEventElapsedTime"));
      compute.Finish(summary);
      summary.device_seconds = milliseconds * 1e-3;
      return absl::OkStatus();
    }));
    return summary;
  }

  // Creates the first stream context, so that a cuBLAS that cannot start fails at creation.
  absl::Status Warm() {
    return RunOnStream([](StreamContext&) { return absl::OkStatus(); });
  }

 protected:
  void Free(void* data, size_t) override {
    cudaSetDevice(device_);
    cudaFree(data);
  }

 private:
  // Runs fn(context) on a pooled stream context of this device and waits for both its streams,
  // also when fn failed, so that no work of a call outlives the buffers its caller may free next.
  template <typename Fn>
  absl::Status RunOnStream(Fn fn) const {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    ASSIGN_OR_RETURN(StreamContext context, streams_.Acquire());
    const absl::Status status = fn(context);
    absl::Status synced = absl::OkStatus();
    // Every stream, the row stream too: a call that failed midway may have left work on any of
    // them, and the next call reuses the buffers it touches.
    for (cudaStream_t stream :
         {context.input_stream, context.output_stream, context.row_stream, context.stream}) {
      const absl::Status stream_synced =
          CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (synced.ok() || IsDeviceFault(stream_synced)) synced = stream_synced;
    }
    streams_.Release(context);
    // A device fault outranks the step's own error: a cuBLAS call on a faulted device reports
    // only CUBLAS_STATUS_EXECUTION_FAILED.
    return status.ok() || IsDeviceFault(synced) ? synced : status;
  }

  const int device_;
  const std::string description_;
  PinnedHostAllocator pinned_;
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
    return absl::StrCat(
        "no GPU found (the NVIDIA driver sees none: check CUDA_VISIBLE_DEVICES "
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
  if (const absl::Status image = CheckKernelImage(); absl::IsFailedPrecondition(image)) {
    return absl::UnavailableError(absl::StrFormat(
        "%s (sm_%d%d) cannot run this CUDA module, built for architectures %s (%s); rebuild it "
        "with -DLOSSD_CUDA_ARCHITECTURES=%d%d",
        props.name, props.major, props.minor, LOSSD_CUDA_ARCHITECTURES_BUILT, image.message(),
        props.major, props.minor));
  } else if (!image.ok()) {
    // After a device fault CUDA refuses every call of the process, this one included.
    return WithPayloadsOf(absl::Status(image.code(), absl::StrCat("cuda:", ordinal, " ", props.name,
                                                                  ": ", image.message())),
                          image);
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
