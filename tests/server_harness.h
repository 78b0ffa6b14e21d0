// A real lossd server on loopback and a raw client for the end-to-end tests.
#ifndef LOSSD_TESTS_SERVER_HARNESS_H_
#define LOSSD_TESTS_SERVER_HARNESS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "lossd/kernels/backend.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/reference.h"

namespace lossd::testing {

// Starts a CPU server on 127.0.0.1 with free ports; no metrics endpoint unless `metrics` (an
// Exposer takes seconds to destroy, so test binaries share one).
std::unique_ptr<server::LossServer> StartTestServer(server::ServerConfig config,
                                                    bool metrics = false);

// A demo head [vocab, hidden] behind a 1 MiB workspace budget, so that batches of a few hundred
// rows run as several engine chunks, and four calls at once.
server::ServerConfig MultiChunkDemoConfig(const std::string& head, int64_t vocab, int64_t hidden,
                                          uint64_t seed);

// A stub on 127.0.0.1:`port` that sends and takes messages of up to 256 MiB.
std::unique_ptr<v1::LossService::Stub> ConnectTo(int port);

// A backend that hands everything to `inner`, for a test to change one behaviour of a real one
// (an allocation that throws, a device fault) by overriding it. Buffers come from the inner
// backend, which frees them.
class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  absl::string_view kind() const override;
  std::string Describe() const override;
  absl::StatusOr<DeviceMemory> QueryMemory() const override;
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(const void* host, size_t bytes, DeviceBuffer& dst,
                            size_t dst_offset) override;
  absl::Status CopyToHost(const DeviceBuffer& src, size_t src_offset, size_t bytes,
                          void* host) override;
  absl::Status Zero(DeviceBuffer& buffer) override;
  absl::Status AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src, int64_t count) override;
  absl::StatusOr<double> SumSquaresFloat32(const DeviceBuffer& x, int64_t count) override;
  absl::Status ScaleFloat32(DeviceBuffer& x, int64_t count, float factor) override;
  absl::Status ConvertFloat32(const DeviceBuffer& src, DeviceBuffer& dst, DType dst_dtype,
                              int64_t count) override;
  absl::StatusOr<OptimizerStepResult> OptimizerStep(const OptimizerConfig& config,
                                                    const OptimizerTensors& tensors) override;
  size_t DefaultWorkspaceBudget() const override;
  absl::StatusOr<ChunkPlan> Plan(const ProblemShape& shape, size_t budget_bytes) const override;
  bool ReadsRowsOnce(DType hidden_dtype) const override;
  bool ComputesOnHostCores() const override;
  absl::StatusOr<BatchSummary> Compute(const BatchInputs& inputs, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& outputs,
                                       DeviceBuffer* grad_weight, DeviceBuffer& workspace) override;

 protected:
  void Free(void*, size_t) override {}  // every buffer belongs to the inner backend

 private:
  std::unique_ptr<Backend> inner_;
};

// Everything a Compute call streamed back, reassembled by row.
struct ComputeOutcome {
  grpc::Status status;
  v1::ComputeSummary summary;
  std::vector<float> token_loss, logprob, lse, entropy, top_k_logprob;
  std::vector<int32_t> argmax, top_k_token;
  std::vector<float> kd, ce;
  std::string grad_hidden;  // raw bytes, rows in order
  int64_t result_messages = 0;
};

// A distill call's teacher data for all its rows, each sent beside the same rows of `hidden`:
// ComputeChunk.teacher_hidden, or teacher_top_k_tokens and teacher_top_k_logprobs.
struct TeacherRows {
  std::string hidden;
  std::string top_k_tokens;
  std::string top_k_logprobs;
};

// Sends `start`, then `hidden` in messages of `rows_per_message` rows (and the same rows of
// `teacher`'s fields, when given). With `cancel_after` >= 0 the call is cancelled after that many
// chunk messages.
ComputeOutcome CallCompute(v1::LossService::Stub& stub, const v1::ComputeStart& start,
                           const std::string& hidden, int64_t rows_per_message,
                           int cancel_after = -1, const std::string& token = "",
                           const TeacherRows* teacher = nullptr);

// A Compute call of `start` and then `messages` as given, with before_each(i) run before message i
// is sent (writing rows into shared memory, say); the results read as CallCompute reads them.
ComputeOutcome CallComputeWithMessages(
    v1::LossService::Stub& stub, const v1::ComputeStart& start,
    const std::vector<v1::ComputeRequest>& messages,
    const std::function<void(size_t)>& before_each = [](size_t) {});

// The head's W or accumulated gradient as float32, and its version.
struct FetchedTensor {
  grpc::Status status;
  std::vector<float> values;
  uint64_t version = 0;
};
FetchedTensor Fetch(v1::LossService::Stub& stub, const std::string& head, bool gradient,
                    const std::string& token = "");

grpc::Status Upload(v1::LossService::Stub& stub, const std::string& head, int64_t vocab_size,
                    int64_t hidden_size, const std::vector<float>& weight, bool replace,
                    const std::string& token = "");

// A self-signed P-256 certificate for 127.0.0.1 and localhost, made in `dir` with the openssl CLI;
// empty paths when that failed.
struct Certificate {
  std::string cert_file;
  std::string key_file;
  std::string pem;
};
Certificate MakeCertificate(const std::string& dir, const std::string& name);

// Uploads W as float32 under `start` (head, sizes, replace, tie, soft cap; its dtype is set here).
grpc::Status UploadWithStart(v1::LossService::Stub& stub, v1::UploadHeadStart start,
                             const std::vector<float>& weight, const std::string& token = "");

// Exactly the bytes' float32 values.
std::string FloatBytes(const std::vector<float>& values);
// The float32 values of the bytes.
std::vector<float> AsFloats(const std::string& bytes);
bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b);

// Hidden rows of standard normal values and labels uniform over the vocabulary.
struct Batch {
  std::vector<float> hidden;  // [rows, hidden_size]
  std::vector<int64_t> labels;
};
Batch RandomBatch(int64_t rows, int64_t vocab, int64_t hidden_size, std::mt19937_64& rng);
// W [vocab, hidden_size] of normal values with standard deviation 1 / sqrt(hidden_size).
std::vector<float> RandomWeight(int64_t vocab, int64_t hidden_size, std::mt19937_64& rng);

// A start for `batch` in float32: scoring asks for the per-token loss and top 3 only; training
// also asks for dL/dh and adds dL/dW to the head's accumulator.
v1::ComputeStart StartFor(const std::string& head, const Batch& batch, int64_t hidden_size,
                          bool training);
// The float64 reference of `batch` under W [vocab, hidden_size], with top 3.
ReferenceResult Reference(const std::vector<float>& weight, int64_t vocab, int64_t hidden_size,
                          const Batch& batch, const LossOptions& options = {});

// Calls of `method` ("Compute", "GetHead", ...) the server has ended, by status code, from its
// request counter.
std::map<std::string, int64_t> CallsByCode(server::LossServer& server, const std::string& method);

// True once `done` holds, polling for up to kEventually: for what the server does on a thread of
// its own a moment after the client acted (revoking a closed connection's shared-memory handles).
// The bound only keeps a broken server from hanging the test: a loaded machine can delay such a
// moment by seconds, so it is far beyond any delay a working server shows.
inline constexpr absl::Duration kEventually = absl::Seconds(60);
bool Eventually(const std::function<bool()>& done);

// The ErrorInfo a failed call's status details carry (an RpcStatus), or none.
std::optional<v1::ErrorInfo> ErrorInfoIn(const grpc::Status& status);

// grpc.health.v1.Health/Check of the whole server: the reply's ServingStatus (kServing,
// kNotServing), or 0 with the failed call's status.
inline constexpr int kServing = 1;
inline constexpr int kNotServing = 2;
struct HealthReply {
  grpc::Status status;
  int serving_status = 0;
};
HealthReply CheckHealth(int port);

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_SERVER_HARNESS_H_
