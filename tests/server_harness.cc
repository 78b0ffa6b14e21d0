#include "tests/server_harness.h"

#include <grpcpp/generic/generic_stub.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/half.h"
#include "lossd/kernels/loss_math.h"

namespace lossd::testing {

std::unique_ptr<server::LossServer> StartTestServer(server::ServerConfig config, bool metrics) {
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = metrics ? "127.0.0.1:0" : "";
  auto backend = CreateBackend("cpu");
  if (!backend.ok()) return nullptr;
  auto server = server::LossServer::Start(config, std::move(backend).value());
  return server.ok() ? std::move(server).value() : nullptr;
}

server::ServerConfig MultiChunkDemoConfig(const std::string& head, int64_t vocab, int64_t hidden,
                                          uint64_t seed) {
  server::ServerConfig config;
  config.demo = {head, vocab, hidden, seed};
  config.workspace_budget_bytes = 1 << 20;
  config.max_running_calls = 4;
  return config;
}

absl::string_view ForwardingBackend::kind() const { return inner_->kind(); }
std::string ForwardingBackend::Describe() const { return inner_->Describe(); }
absl::StatusOr<DeviceMemory> ForwardingBackend::QueryMemory() const {
  return inner_->QueryMemory();
}
absl::StatusOr<DeviceBuffer> ForwardingBackend::Allocate(size_t bytes) {
  return inner_->Allocate(bytes);
}
absl::Status ForwardingBackend::CopyToDevice(const void* host, size_t bytes, DeviceBuffer& dst,
                                             size_t dst_offset) {
  return inner_->CopyToDevice(host, bytes, dst, dst_offset);
}
absl::Status ForwardingBackend::CopyToHost(const DeviceBuffer& src, size_t src_offset, size_t bytes,
                                           void* host) {
  return inner_->CopyToHost(src, src_offset, bytes, host);
}
absl::Status ForwardingBackend::Zero(DeviceBuffer& buffer) { return inner_->Zero(buffer); }
absl::Status ForwardingBackend::AddFloat32(DeviceBuffer& dst, const DeviceBuffer& src,
                                           int64_t count) {
  return inner_->AddFloat32(dst, src, count);
}

absl::Status ForwardingBackend::ScaleFloat32(DeviceBuffer& x, int64_t count, float factor) {
  return inner_->ScaleFloat32(x, count, factor);
}

absl::Status ForwardingBackend::ConvertFloat32(const DeviceBuffer& src, DeviceBuffer& dst,
                                               DType dst_dtype, int64_t count) {
  return inner_->ConvertFloat32(src, dst, dst_dtype, count);
}
absl::StatusOr<double> ForwardingBackend::SumSquaresFloat32(const DeviceBuffer& x, int64_t count) {
  return inner_->SumSquaresFloat32(x, count);
}
absl::StatusOr<OptimizerStepResult> ForwardingBackend::OptimizerStep(
    const OptimizerConfig& config, const OptimizerTensors& tensors) {
  return inner_->OptimizerStep(config, tensors);
}
size_t ForwardingBackend::DefaultWorkspaceBudget() const {
  return inner_->DefaultWorkspaceBudget();
}
absl::StatusOr<ChunkPlan> ForwardingBackend::Plan(const ProblemShape& shape,
                                                  size_t budget_bytes) const {
  return inner_->Plan(shape, budget_bytes);
}
bool ForwardingBackend::ReadsRowsOnce(DType hidden_dtype) const {
  return inner_->ReadsRowsOnce(hidden_dtype);
}
bool ForwardingBackend::ComputesOnHostCores() const { return inner_->ComputesOnHostCores(); }
absl::StatusOr<BatchSummary> ForwardingBackend::Compute(
    const BatchInputs& inputs, const WeightView& weight, const LossOptions& options,
    const TokenOutputs& outputs, DeviceBuffer* grad_weight, DeviceBuffer& workspace) {
  return inner_->Compute(inputs, weight, options, outputs, grad_weight, workspace);
}

std::optional<v1::ErrorInfo> ErrorInfoIn(const grpc::Status& status) {
  v1::RpcStatus details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return std::nullopt;
  }
  // Details that disagree with the status they came with are no details.
  if (details.code() != static_cast<int>(status.error_code()) ||
      details.message() != status.error_message()) {
    return std::nullopt;
  }
  for (const google::protobuf::Any& detail : details.details()) {
    v1::ErrorInfo info;
    if (detail.UnpackTo(&info)) return info;
  }
  return std::nullopt;
}

std::unique_ptr<v1::LossService::Stub> ConnectTo(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                           grpc::InsecureChannelCredentials(), args);
  return v1::LossService::NewStub(channel);
}

namespace {

template <typename T, typename Field>
void Append(std::vector<T>& into, const Field& field) {
  into.insert(into.end(), field.begin(), field.end());
}

void AddToken(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

// Reads a Compute call's responses into `outcome` until the stream ends, then its status.
void ReadOutcome(grpc::ClientReaderWriter<v1::ComputeRequest, v1::ComputeResponse>& stream,
                 ComputeOutcome& outcome) {
  v1::ComputeResponse response;
  while (stream.Read(&response)) {
    if (response.has_summary()) {
      outcome.summary = response.summary();
      continue;
    }
    const v1::ComputeResult& r = response.result();
    ++outcome.result_messages;
    Append(outcome.token_loss, r.token_loss());
    Append(outcome.logprob, r.logprob());
    Append(outcome.lse, r.lse());
    Append(outcome.entropy, r.entropy());
    Append(outcome.argmax, r.argmax());
    Append(outcome.top_k_logprob, r.top_k_logprob());
    Append(outcome.top_k_token, r.top_k_token());
    Append(outcome.kd, r.kd());
    Append(outcome.ce, r.ce());
    outcome.grad_hidden += r.grad_hidden();
  }
  outcome.status = stream.Finish();
}

}  // namespace

ComputeOutcome CallCompute(v1::LossService::Stub& stub, const v1::ComputeStart& start,
                           const std::string& hidden, int64_t rows_per_message, int cancel_after,
                           const std::string& token, const TeacherRows* teacher) {
  ComputeOutcome outcome;
  grpc::ClientContext context;
  AddToken(context, token);
  auto stream = stub.Compute(&context);
  v1::ComputeRequest request;
  *request.mutable_start() = start;
  bool open = stream->Write(request);
  const int64_t row_bytes =
      start.num_tokens() > 0 ? static_cast<int64_t>(hidden.size()) / start.num_tokens() : 1;
  const int64_t rows_per = std::max<int64_t>(1, rows_per_message);
  const int64_t message_bytes = rows_per * row_bytes;
  // The same rows of a teacher's field: its bytes per row times the message's rows.
  const auto rows_of = [&](const std::string& field, int64_t first_row) {
    if (field.empty() || start.num_tokens() == 0) return std::string();
    const int64_t bytes = static_cast<int64_t>(field.size()) / start.num_tokens();
    return field.substr(first_row * bytes, rows_per * bytes);
  };
  int sent = 0;
  for (size_t offset = 0; open && offset < hidden.size(); offset += message_bytes, ++sent) {
    if (sent == cancel_after) break;
    v1::ComputeRequest chunk;
    chunk.mutable_chunk()->set_hidden(hidden.substr(offset, message_bytes));
    if (teacher != nullptr) {
      const int64_t first_row = static_cast<int64_t>(offset) / row_bytes;
      chunk.mutable_chunk()->set_teacher_hidden(rows_of(teacher->hidden, first_row));
      chunk.mutable_chunk()->set_teacher_top_k_tokens(rows_of(teacher->top_k_tokens, first_row));
      chunk.mutable_chunk()->set_teacher_top_k_logprobs(
          rows_of(teacher->top_k_logprobs, first_row));
    }
    open = stream->Write(chunk);
  }
  if (sent == cancel_after) {
    context.TryCancel();
  } else {
    stream->WritesDone();
  }
  ReadOutcome(*stream, outcome);
  return outcome;
}

ComputeOutcome CallComputeWithMessages(v1::LossService::Stub& stub, const v1::ComputeStart& start,
                                       const std::vector<v1::ComputeRequest>& messages,
                                       const std::function<void(size_t)>& before_each) {
  ComputeOutcome outcome;
  grpc::ClientContext context;
  auto stream = stub.Compute(&context);
  v1::ComputeRequest request;
  *request.mutable_start() = start;
  bool open = stream->Write(request);
  for (size_t i = 0; open && i < messages.size(); ++i) {
    before_each(i);
    open = stream->Write(messages[i]);
  }
  stream->WritesDone();
  ReadOutcome(*stream, outcome);
  return outcome;
}

FetchedTensor Fetch(v1::LossService::Stub& stub, const std::string& head, bool gradient,
                    const std::string& token) {
  FetchedTensor fetched;
  grpc::ClientContext context;
  AddToken(context, token);
  v1::FetchTensorRequest request;
  request.set_head(head);
  request.set_max_chunk_bytes(1 << 16);  // many chunks, so reassembly is exercised
  auto reader =
      gradient ? stub.FetchGradWeight(&context, request) : stub.FetchWeight(&context, request);
  v1::TensorChunk chunk;
  while (reader->Read(&chunk)) {
    const size_t old_size = fetched.values.size();
    fetched.values.resize(old_size + chunk.data().size() / sizeof(float));
    std::memcpy(fetched.values.data() + old_size, chunk.data().data(), chunk.data().size());
    fetched.version = chunk.head_version();
  }
  fetched.status = reader->Finish();
  return fetched;
}

grpc::Status Upload(v1::LossService::Stub& stub, const std::string& head, int64_t vocab_size,
                    int64_t hidden_size, const std::vector<float>& weight, bool replace,
                    const std::string& token) {
  v1::UploadHeadStart start;
  start.set_head(head);
  start.set_vocab_size(vocab_size);
  start.set_hidden_size(hidden_size);
  start.set_replace(replace);
  return UploadWithStart(stub, start, weight, token);
}

grpc::Status UploadWithStart(v1::LossService::Stub& stub, v1::UploadHeadStart start,
                             const std::vector<float>& weight, const std::string& token) {
  grpc::ClientContext context;
  AddToken(context, token);
  v1::HeadInfo info;
  auto writer = stub.UploadHead(&context, &info);
  start.set_dtype(v1::DTYPE_FLOAT32);
  v1::UploadHeadRequest first;
  *first.mutable_start() = std::move(start);
  writer->Write(first);
  const std::string bytes = FloatBytes(weight);
  for (size_t offset = 0; offset < bytes.size(); offset += 1 << 16) {
    v1::UploadHeadRequest piece;
    piece.set_weight(bytes.substr(offset, 1 << 16));
    if (!writer->Write(piece)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

Certificate MakeCertificate(const std::string& dir, const std::string& name) {
  std::filesystem::create_directories(dir);
  Certificate certificate{dir + "/" + name + ".crt", dir + "/" + name + ".key", ""};
  const std::string command =
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
      " -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
      certificate.key_file + " -out " + certificate.cert_file + " >/dev/null 2>&1";
  if (std::system(command.c_str()) != 0) return {};
  std::ifstream file(certificate.cert_file);
  certificate.pem.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  return certificate;
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

std::vector<float> AsFloats(const std::string& bytes) {
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

Batch RandomBatch(int64_t rows, int64_t vocab, int64_t hidden_size, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  Batch batch;
  batch.hidden.resize(rows * hidden_size);
  for (float& x : batch.hidden) x = normal(rng);
  batch.labels.resize(rows);
  for (int64_t& y : batch.labels) y = token(rng);
  return batch;
}

std::vector<float> RandomWeight(int64_t vocab, int64_t hidden_size, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(hidden_size)));
  std::vector<float> weight(vocab * hidden_size);
  for (float& x : weight) x = normal(rng);
  return weight;
}

v1::ComputeStart StartFor(const std::string& head, const Batch& batch, int64_t hidden_size,
                          bool training) {
  v1::ComputeStart start;
  start.set_head(head);
  start.set_num_tokens(static_cast<int64_t>(batch.labels.size()));
  start.set_hidden_size(hidden_size);
  start.set_hidden_dtype(v1::DTYPE_FLOAT32);
  for (int64_t y : batch.labels) start.add_labels(y);
  v1::OutputSelection& out = *start.mutable_outputs();
  out.set_token_loss(true);
  out.set_top_k(3);
  out.set_grad_hidden(training);
  out.set_accumulate_grad_weight(training);
  return start;
}

ReferenceResult Reference(const std::vector<float>& weight, int64_t vocab, int64_t hidden_size,
                          const Batch& batch, const LossOptions& options) {
  ReferenceProblem problem;
  problem.num_tokens = static_cast<int64_t>(batch.labels.size());
  problem.hidden_size = hidden_size;
  problem.vocab_size = vocab;
  problem.hidden.assign(batch.hidden.begin(), batch.hidden.end());
  problem.weight.assign(weight.begin(), weight.end());
  problem.labels = batch.labels;
  problem.options = options;
  problem.top_k = 3;
  return ComputeReference(problem);
}

std::map<std::string, int64_t> CallsByCode(server::LossServer& server, const std::string& method) {
  std::map<std::string, int64_t> calls;
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name != "lossd_requests_total") continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::map<std::string, std::string> labels;
      for (const auto& label : metric.label) labels[label.name] = label.value;
      if (labels["method"] == method) {
        calls[labels["code"]] += std::llround(metric.counter.value);
      }
    }
  }
  return calls;
}

bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + kEventually;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

HealthReply CheckHealth(int port) {
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  // An empty HealthCheckRequest, and HealthCheckResponse{status = 1} read by hand: a varint
  // field 1 (tag 0x08). Through a completion queue, not the callback API: that one hands its tag
  // between threads inside gRPC, out of ThreadSanitizer's sight, which then reports the hand-over
  // as a race.
  grpc::GenericStub generic(channel);
  grpc::Slice empty;
  const grpc::ByteBuffer request(&empty, 1);
  grpc::CompletionQueue queue;
  const auto call =
      generic.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &queue);
  call->StartCall();
  grpc::ByteBuffer reply;
  HealthReply result;
  call->Finish(&reply, &result.status, call.get());
  void* tag = nullptr;
  bool ok = false;
  const bool event = queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  if (!event || !result.status.ok()) return result;
  std::vector<grpc::Slice> slices;
  if (!reply.Dump(&slices).ok()) return result;
  std::string bytes;
  for (auto& s : slices) bytes += std::string(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.size() == 2 && bytes[0] == '\x08') result.serving_status = bytes[1];
  return result;
}

}  // namespace lossd::testing
