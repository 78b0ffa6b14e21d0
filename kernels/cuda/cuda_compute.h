// One Compute call of the CUDA backend, and the stream context it runs in.
//
// Per token chunk, with no wait of the device for the host: the rows (and labels, per-row inputs,
// a teacher's rows or top-k) pass through one of two pinned host slots and go to one of two device
// slots on the input stream while the previous chunk computes; the compute stream then runs the
// statistics over the vocabulary tiles, finishes the rows on the device (row_finish.cu, with the
// CPU backend's formulas), computes dL/da tile by tile (in a window, piece by piece as each
// piece's rows arrive, each piece's row kernels on a stream of their own beside the next piece's
// logits product: FinishesRowsInWindows) and the dL/dh and dL/dW products, and hands
// dL/dh to the output stream, which brings it back into one of two pinned slots that the host
// copies out while the next chunk computes. Inputs and outputs travel on streams of their own, so
// that neither waits behind the other (a GPU copies both ways at once). Every row's results come
// back into pinned memory chunk by chunk and are read once, after the call's one synchronization,
// in row order, as the CPU backend emits them.
#ifndef LOSSD_KERNELS_CUDA_CUDA_COMPUTE_H_
#define LOSSD_KERNELS_CUDA_CUDA_COMPUTE_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_plan.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/backend_common.h"

namespace lossd::cuda {

// Two streams with a cuBLAS handle and scratch, the events that order a call's copies against its
// compute, and the pinned host memory its copies go through. One call holds one at a time, so
// handles are never shared between threads and each handle has one stream and one workspace, which
// keeps cuBLAS's choice of kernels, and so its results, the same from call to call. The scratch
// and the pinned staging are the backend's fixed overhead (like OpenBLAS's buffers on the CPU),
// kept from call to call and not part of any call's workspace budget, which counts device memory.
struct StreamContext {
  cudaStream_t stream = nullptr;         // the compute
  cudaStream_t input_stream = nullptr;   // a Compute call's copies to the device
  cudaStream_t output_stream = nullptr;  // and back
  // A window's row kernels, beside the compute stream's next logits product; of the device's
  // greatest priority, so that its blocks take SMs as the product's blocks retire.
  cudaStream_t row_stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* d_cublas_workspace = nullptr;
  double* d_sum_squares_partials = nullptr;  // [kSumSquaresBlocks]
  // Around each Compute call, for BatchSummary::device_seconds.
  cudaEvent_t call_start = nullptr;
  cudaEvent_t call_end = nullptr;
  // Per slot: its inputs are on the device and its pinned slot is free again (input stream); the
  // compute stream's last read of its device inputs (compute); its dL/dh complete on the device
  // (compute); its dL/dh in its pinned slot (output stream).
  cudaEvent_t inputs_copied[2] = {};
  cudaEvent_t inputs_consumed[2] = {};
  cudaEvent_t grad_ready[2] = {};
  cudaEvent_t grad_copied[2] = {};
  // Per slot, in a window (FinishesRowsInWindows): each piece's rows on the device (input stream),
  // after the slot's other inputs.
  cudaEvent_t piece_copied[2][kMaxPiecesPerWindow] = {};
  // Per logits buffer of a window: a piece's logits computed (compute stream), and its row kernels
  // done with them (row stream).
  cudaEvent_t logits_ready[2] = {};
  cudaEvent_t rows_done[2] = {};
  cudaEvent_t outputs_done = nullptr;  // the output stream's last work of a call
  void* h_staging = nullptr;           // pinned (cudaHostAlloc)
  size_t staging_bytes = 0;
};

// Creates everything in `context` on the current device; on failure destroys what was made.
absl::Status CreateStreamContext(size_t cublas_workspace_bytes, StreamContext& context);
void DestroyStreamContext(StreamContext& context);
// Pinned staging of at least `bytes`, replacing a smaller one.
absl::Status EnsureStaging(size_t bytes, StreamContext& context);

// Runs one planned Compute call on `context`'s streams: Run enqueues everything and waits only for
// chunks' dL/dh on their way back; the caller then synchronizes the compute stream once and calls
// Finish, which emits every row's results into `out` and the summary.
class ChunkedCompute {
 public:
  ChunkedCompute(const BatchInputs& in, const WeightView& weight, const LossOptions& options,
                 const TokenOutputs& out, DeviceBuffer* grad_weight, const CallPlan& call,
                 const CudaWorkspace& ws, const HostStaging& staging, const StreamContext& context);
  ~ChunkedCompute();
  ChunkedCompute(const ChunkedCompute&) = delete;
  ChunkedCompute& operator=(const ChunkedCompute&) = delete;

  absl::Status Run();
  void Finish(BatchSummary& summary) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lossd::cuda

#endif  // LOSSD_KERNELS_CUDA_CUDA_COMPUTE_H_
