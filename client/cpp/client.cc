#include "lossd/client/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cpp/shared_buffer.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {
namespace {

// Room beside a message's payload for its field tags, lengths and small fields.
constexpr int64_t kMessageOverheadBytes = 1024;
// Chunks of a few MiB let the server compute early rows while later ones are still in flight, and
// stream over loopback about as fast as much larger messages do.
constexpr int64_t kTargetMessageBytes = int64_t{4} << 20;
// Below this a start message with labels of any useful batch would not fit.
constexpr int64_t kMinMessageBytes = int64_t{64} << 10;
constexpr int kMaxTopK = 64;

// The server broke the wire contract; the call's data cannot be trusted.
absl::Status ServerViolation(absl::string_view what) {
  return absl::InternalError(absl::StrCat("server sent ", what));
}

int ClampToInt(int64_t value) { return static_cast<int>(std::min<int64_t>(value, INT_MAX)); }

// Failures after which the client cannot know whether the server committed the call.
bool IsRetryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

// 128 random bits as 32 hex digits: no two clients anywhere pick the same.
std::string NewCallId() {
  std::random_device device;  // the kernel's random source
  std::string id;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&id, absl::Hex(device(), absl::kZeroPad8));
  return id;
}

// A factor in [0.5, 1] for a retry's wait.
double RandomJitter() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return std::uniform_real_distribution<double>(0.5, 1.0)(generator);
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    default: return ServerViolation(absl::StrCat(field, " = ", static_cast<int>(dtype), ", not a dtype"));
  }
}

Optimizer FromProto(v1::OptimizerState::Kind kind) {
  switch (kind) {
    case v1::OptimizerState::KIND_SGD: return Optimizer::kSgd;
    case v1::OptimizerState::KIND_ADAMW: return Optimizer::kAdamW;
    default: return Optimizer::kNone;
  }
}

absl::StatusOr<HeadInfo> FromProto(const v1::HeadInfo& proto) {
  HeadInfo info;
  info.name = proto.name();
  info.vocab_size = proto.vocab_size();
  info.hidden_size = proto.hidden_size();
  ASSIGN_OR_RETURN(info.dtype, FromProto(proto.dtype(), "HeadInfo.dtype"));
  info.version = proto.version();
  info.source = proto.source();
  info.accumulated_tokens = proto.accumulated_tokens();
  info.accumulated_calls = proto.accumulated_calls();
  info.optimizer = FromProto(proto.optimizer());
  info.steps = proto.steps();
  info.weight_sha256 = proto.weight_sha256();
  info.tied_embeddings = proto.tied_embeddings();
  info.logit_softcap = proto.logit_softcap();
  return info;
}

v1::Reduction ToProto(Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean: return v1::REDUCTION_MEAN;
    case Reduction::kSum: return v1::REDUCTION_SUM;
    case Reduction::kNone: return v1::REDUCTION_NONE;
  }
  return v1::REDUCTION_MEAN;
}

void ToProto(const LossOptions& options, v1::LossOptions& proto) {
  proto.set_reduction(ToProto(options.reduction));
  proto.set_ignore_index(options.ignore_index);
  proto.set_label_smoothing(options.label_smoothing);
  proto.set_z_loss_scale(options.z_loss_scale);
  if (options.logit_softcap.has_value()) proto.set_logit_softcap(*options.logit_softcap);
  proto.set_temperature(options.temperature);
  proto.set_grad_scale(options.grad_scale);
  proto.set_mean_denominator(options.mean_denominator);
  proto.set_allow_tf32(options.allow_tf32);
}

void ToProto(const OutputSelection& outputs, v1::OutputSelection& proto) {
  proto.set_token_loss(outputs.token_loss);
  proto.set_logprob(outputs.logprob);
  proto.set_lse(outputs.lse);
  proto.set_entropy(outputs.entropy);
  proto.set_argmax(outputs.argmax);
  proto.set_top_k(outputs.top_k);
  proto.set_grad_hidden(outputs.grad_hidden);
  if (outputs.grad_hidden_dtype.has_value()) {
    proto.set_grad_hidden_dtype(ToProto(*outputs.grad_hidden_dtype));
  }
  proto.set_accumulate_grad_weight(outputs.accumulate_grad_weight);
}

absl::Status ValidateComputeRequest(const ComputeRequest& request) {
  const TensorView& hidden = request.hidden;
  if (hidden.rows < 0) return InvalidField("hidden.rows", "a count >= 0", absl::StrCat(hidden.rows));
  if (hidden.cols <= 0) return InvalidField("hidden.cols", "the head's hidden size", absl::StrCat(hidden.cols));
  if (hidden.rows > 0 && hidden.data == nullptr) {
    return InvalidField("hidden.data", "a pointer to the rows", "null");
  }
  if (static_cast<int64_t>(request.labels.size()) != hidden.rows) {
    return InvalidField("labels", absl::StrCat(hidden.rows, " entries (hidden.rows)"),
                        absl::StrCat(request.labels.size()));
  }
  if (!request.token_weights.empty() && static_cast<int64_t>(request.token_weights.size()) != hidden.rows) {
    return InvalidField("token_weights", absl::StrCat("0 or ", hidden.rows, " entries (hidden.rows)"),
                        absl::StrCat(request.token_weights.size()));
  }
  // Checked here as well as on the server because the result buffers are sized by it.
  if (request.outputs.top_k < 0 || request.outputs.top_k > kMaxTopK) {
    return InvalidField("outputs.top_k", absl::StrCat("a value in [0, ", kMaxTopK, "]"),
                        absl::StrCat(request.outputs.top_k));
  }
  if (request.rows_per_message < 0) {
    return InvalidField("rows_per_message", "0 (automatic) or a positive count",
                        absl::StrCat(request.rows_per_message));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RowsPerMessage(int64_t requested, int64_t row_bytes, int64_t max_message_bytes) {
  const int64_t payload_limit = max_message_bytes - kMessageOverheadBytes;
  if (row_bytes > payload_limit) {
    return InvalidField(
        "hidden",
        absl::StrCat("rows of at most ", payload_limit, " bytes (max_message_bytes ", max_message_bytes, ")"),
        absl::StrCat(row_bytes, " bytes per row"));
  }
  if (requested == 0) return std::max<int64_t>(1, std::min(kTargetMessageBytes, payload_limit) / row_bytes);
  if (requested > payload_limit / row_bytes) {
    return InvalidField("rows_per_message",
                        absl::StrCat("at most ", payload_limit / row_bytes, " rows of ", row_bytes,
                                     " bytes (max_message_bytes ", max_message_bytes, ")"),
                        absl::StrCat(requested));
  }
  return requested;
}

// Which rows of a result have arrived, so that results streamed in any order are each placed once
// and a missing or repeated row is an error rather than silently zero.
class RowCoverage {
 public:
  explicit RowCoverage(int64_t rows) : seen_(static_cast<size_t>(rows), false) {}

  absl::Status Mark(int64_t offset, int64_t count) {
    const int64_t rows = static_cast<int64_t>(seen_.size());
    if (offset < 0 || count < 0 || offset > rows || count > rows - offset) {
      return ServerViolation(
          absl::StrCat("rows [", offset, ", ", offset + count, ") of a ", rows, "-row result"));
    }
    for (int64_t row = offset; row < offset + count; ++row) {
      if (seen_[row]) return ServerViolation(absl::StrCat("row ", row, " twice"));
      seen_[row] = true;
    }
    covered_ += count;
    return absl::OkStatus();
  }

  bool complete() const { return covered_ == static_cast<int64_t>(seen_.size()); }
  int64_t covered() const { return covered_; }

 private:
  std::vector<bool> seen_;
  int64_t covered_ = 0;
};

// Places per-row results into the buffers of one Compute call as they arrive. dL/dh comes in the
// result messages, into `grad_hidden_target` if given, else into the result; or (shared memory)
// not at all.
class ResultAssembler {
 public:
  ResultAssembler(const ComputeRequest& request, ComputeResult& result, bool grad_hidden_in_messages,
                  uint8_t* grad_hidden_target = nullptr)
      : want_(request.outputs),
        on_progress_(request.on_progress),
        grad_hidden_in_messages_(grad_hidden_in_messages),
        rows_(request.hidden.rows),
        grad_dtype_(request.outputs.grad_hidden_dtype.value_or(request.hidden.dtype)),
        grad_row_bytes_(request.hidden.cols * static_cast<int64_t>(DTypeSize(grad_dtype_))),
        result_(result),
        coverage_(request.hidden.rows) {
    auto size = [this](bool wanted, auto& buffer, int64_t per_row) {
      if (wanted) buffer.resize(rows_ * per_row);
    };
    size(want_.token_loss, result_.token_loss, 1);
    size(want_.logprob, result_.logprob, 1);
    size(want_.lse, result_.lse, 1);
    size(want_.entropy, result_.entropy, 1);
    size(want_.argmax, result_.argmax, 1);
    size(want_.top_k > 0, result_.top_k_logprob, want_.top_k);
    size(want_.top_k > 0, result_.top_k_token, want_.top_k);
    result_.top_k = want_.top_k;
    if (want_.grad_hidden) {
      grad_hidden_ = grad_hidden_target;
      if (grad_hidden_in_messages_ && grad_hidden_ == nullptr) {
        result_.grad_hidden.bytes.resize(rows_ * grad_row_bytes_);
        grad_hidden_ = reinterpret_cast<uint8_t*>(result_.grad_hidden.bytes.data());
      }
      result_.grad_hidden.dtype = grad_dtype_;
      result_.grad_hidden.rows = rows_;
      result_.grad_hidden.cols = request.hidden.cols;
    }
  }

  absl::Status Add(const v1::ComputeResponse& response) {
    if (summary_received_) return ServerViolation("a message after the summary");
    if (response.has_summary()) {
      summary_received_ = true;
      StoreSummary(response.summary());
      return absl::OkStatus();
    }
    if (!response.has_result()) return ServerViolation("a response with neither result nor summary");
    return Place(response.result());
  }

  absl::Status Finish() {
    if (!summary_received_) return ServerViolation("no summary before ending the call");
    if (!coverage_.complete()) {
      return ServerViolation(absl::StrCat("results for ", coverage_.covered(), " of ", rows_, " rows"));
    }
    result_.grad_hidden.head_version = result_.summary.head_version;
    return absl::OkStatus();
  }

 private:
  absl::Status Place(const v1::ComputeResult& piece) {
    const int64_t offset = piece.row_offset();
    const int64_t count = piece.num_rows();
    RETURN_IF_ERROR(coverage_.Mark(offset, count));
    if (on_progress_) on_progress_(coverage_.covered(), rows_);
    RETURN_IF_ERROR(
        PlaceField("token_loss", piece.token_loss(), want_.token_loss, 1, offset, count, result_.token_loss));
    RETURN_IF_ERROR(PlaceField("logprob", piece.logprob(), want_.logprob, 1, offset, count, result_.logprob));
    RETURN_IF_ERROR(PlaceField("lse", piece.lse(), want_.lse, 1, offset, count, result_.lse));
    RETURN_IF_ERROR(PlaceField("entropy", piece.entropy(), want_.entropy, 1, offset, count, result_.entropy));
    RETURN_IF_ERROR(PlaceField("argmax", piece.argmax(), want_.argmax, 1, offset, count, result_.argmax));
    RETURN_IF_ERROR(PlaceField("top_k_logprob", piece.top_k_logprob(), want_.top_k > 0, want_.top_k, offset,
                               count, result_.top_k_logprob));
    RETURN_IF_ERROR(PlaceField("top_k_token", piece.top_k_token(), want_.top_k > 0, want_.top_k, offset,
                               count, result_.top_k_token));
    const int64_t grad_bytes = want_.grad_hidden && grad_hidden_in_messages_ ? count * grad_row_bytes_ : 0;
    if (static_cast<int64_t>(piece.grad_hidden().size()) != grad_bytes) {
      return ServerViolation(absl::StrCat(piece.grad_hidden().size(), " bytes of grad_hidden for ", count,
                                          " rows, expected ", grad_bytes));
    }
    if (grad_bytes > 0) {
      if (piece.grad_hidden_dtype() != ToProto(grad_dtype_)) {
        return ServerViolation(absl::StrCat("grad_hidden_dtype ", static_cast<int>(piece.grad_hidden_dtype()),
                                            ", expected ", DTypeName(grad_dtype_)));
      }
      std::memcpy(grad_hidden_ + offset * grad_row_bytes_, piece.grad_hidden().data(), grad_bytes);
    }
    return absl::OkStatus();
  }

  template <typename Field, typename Buffer>
  absl::Status PlaceField(absl::string_view name, const Field& field, bool wanted, int64_t per_row,
                          int64_t offset, int64_t count, Buffer& buffer) {
    const int64_t expected = wanted ? count * per_row : 0;
    if (field.size() != expected) {
      return ServerViolation(
          absl::StrCat(field.size(), " values of ", name, " for ", count, " rows, expected ", expected));
    }
    // An output not asked for has an empty buffer, where even a zero offset is undefined.
    if (expected > 0) std::copy(field.begin(), field.end(), buffer.begin() + offset * per_row);
    return absl::OkStatus();
  }

  void StoreSummary(const v1::ComputeSummary& proto) {
    ComputeSummary& s = result_.summary;
    s.loss = proto.loss();
    s.loss_sum = proto.loss_sum();
    s.counted_tokens = proto.counted_tokens();
    s.correct_tokens = proto.correct_tokens();
    s.head_version = proto.head_version();
    s.grad_weight_accumulated = proto.grad_weight_accumulated();
    s.replayed = proto.replayed();
    s.queue_seconds = proto.queue_seconds();
    s.compute_seconds = proto.compute_seconds();
    s.peak_workspace_bytes = proto.peak_workspace_bytes();
    s.backend = proto.backend();
  }

  const OutputSelection& want_;
  const std::function<void(int64_t, int64_t)>& on_progress_;
  const bool grad_hidden_in_messages_;
  const int64_t rows_;
  const DType grad_dtype_;
  const int64_t grad_row_bytes_;
  uint8_t* grad_hidden_ = nullptr;  // where dL/dh from messages goes
  ComputeResult& result_;
  RowCoverage coverage_;
  bool summary_received_ = false;
};

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // gRPC and absl share the canonical code numbering (0..16).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status ValidateChannelOptions(const ChannelOptions& options) {
  RETURN_IF_ERROR(ParseTarget(options.address).status());
  if (options.max_message_bytes < kMinMessageBytes || options.max_message_bytes > INT_MAX) {
    return InvalidField("max_message_bytes", absl::StrCat("a size in [", kMinMessageBytes, ", ", INT_MAX, "]"),
                        absl::StrCat(options.max_message_bytes));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return InvalidField("deadline", "a positive duration (infinite: none)",
                        absl::FormatDuration(options.deadline));
  }
  if (options.keepalive_time <= absl::ZeroDuration() || options.keepalive_timeout <= absl::ZeroDuration()) {
    return InvalidField("keepalive_time/keepalive_timeout", "positive durations",
                        absl::StrCat(absl::FormatDuration(options.keepalive_time), " / ",
                                     absl::FormatDuration(options.keepalive_timeout)));
  }
  const RetryOptions& retry = options.compute_retry;
  if (retry.max_attempts < 1) {
    return InvalidField("compute_retry.max_attempts", "at least 1",
                        absl::StrCat(retry.max_attempts));
  }
  if (retry.initial_backoff < absl::ZeroDuration() || retry.max_backoff < retry.initial_backoff ||
      retry.max_backoff == absl::InfiniteDuration()) {
    return InvalidField("compute_retry.initial_backoff/max_backoff",
                        "finite durations with 0 <= initial_backoff <= max_backoff",
                        absl::StrCat(absl::FormatDuration(retry.initial_backoff), " / ",
                                     absl::FormatDuration(retry.max_backoff)));
  }
  if (!(retry.backoff_multiplier >= 1.0 && std::isfinite(retry.backoff_multiplier))) {
    return InvalidField("compute_retry.backoff_multiplier", "a finite value >= 1",
                        absl::StrCat(retry.backoff_multiplier));
  }
  return absl::OkStatus();
}

namespace {

// A duration in the JSON form of the service config ("0.200000s"); gRPC wants backoffs above 0.
std::string ServiceConfigSeconds(absl::Duration duration) {
  return absl::StrFormat("\"%.6fs\"", std::max(absl::ToDoubleSeconds(duration), 1e-3));
}

// The channel's service config, in gRPC's JSON form. Round robin checks each server's health
// (grpc.health.v1), so that a replica draining after SIGTERM (NOT_SERVING) leaves the rotation at
// once. gRPC retries only the read-only calls that send one message (see RetryOptions).
std::string ServiceConfig(const RetryOptions& retry, Balancing balancing) {
  std::vector<std::string> parts;
  if (balancing == Balancing::kRoundRobin) {
    parts.push_back(R"("loadBalancingConfig": [{"round_robin": {}}])");
    parts.push_back(R"("healthCheckConfig": {"serviceName": ""})");
  }
  constexpr int kGrpcMaxAttempts = 5;  // gRPC clamps retryPolicy.maxAttempts to it
  const int attempts = std::min(retry.max_attempts, kGrpcMaxAttempts);
  if (attempts >= 2) {
    std::vector<std::string> names;
    for (const char* method :
         {"ListHeads", "GetHead", "FetchWeight", "FetchGradWeight", "GetSharedMemorySocket"}) {
      names.push_back(absl::StrFormat(R"({"service": "lossd.v1.LossService", "method": "%s"})",
                                      method));
    }
    parts.push_back(absl::StrFormat(
        R"("methodConfig": [{"name": [%s], "retryPolicy": {"maxAttempts": %d, )"
        R"("initialBackoff": %s, "maxBackoff": %s, "backoffMultiplier": %.6f, )"
        R"("retryableStatusCodes": ["UNAVAILABLE"]}}])",
        absl::StrJoin(names, ", "), attempts, ServiceConfigSeconds(retry.initial_backoff),
        ServiceConfigSeconds(retry.max_backoff), retry.backoff_multiplier));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options, Balancing balancing) {
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(ServiceConfig(options.compute_retry, balancing));
  // The balancing is the client's choice: a DNS TXT record cannot replace it.
  args.SetInt(GRPC_ARG_SERVICE_CONFIG_DISABLE_RESOLUTION, 1);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  args.SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  // An infinite keepalive time clamps to INT_MAX ms, which gRPC reads as "off".
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ClampToInt(absl::ToInt64Milliseconds(options.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              ClampToInt(absl::ToInt64Milliseconds(options.keepalive_timeout)));
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_root_cert_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_cert_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  const absl::StatusOr<Target> target = ParseTarget(options.address);
  return grpc::CreateCustomChannel(target.ok() ? target->uri : options.address, credentials, args);
}

absl::StatusOr<Client> Client::Connect(ChannelOptions options) {
  RETURN_IF_ERROR(ValidateChannelOptions(options));
  ASSIGN_OR_RETURN(Target target, ParseTarget(options.address));
  return Client(std::move(options), std::move(target));
}

Client::Client(ChannelOptions options, Target target)
    : options_(std::move(options)),
      target_(std::move(target)),
      balanced_stub_(v1::LossService::NewStub(MakeChannel(options_, Balancing::kRoundRobin))),
      one_server_stub_(v1::LossService::NewStub(MakeChannel(options_, Balancing::kOneServer))),
      handover_(std::make_shared<Handover>()),
      shared_buffers_(std::make_shared<SharedBufferPool>()) {}

absl::Status Client::RequireOneServer(absl::string_view what) const {
  if (target_.listed_addresses <= 1) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "address: expected one server for ", what, ", got '", target_.uri, "', which lists ",
      target_.listed_addresses,
      " addresses. A head's accumulated dL/dW, optimizer state, version and shared-memory "
      "handles live in one process, and each replica has its own: score over replicas, train "
      "against one server"));
}

Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

void Client::PrepareContext(grpc::ClientContext& context) const {
  // Metadata rather than call credentials: gRPC sends call credentials only over TLS, and a
  // loopback or in-cluster server may run plaintext with a token.
  if (!options_.bearer_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
  if (options_.deadline != absl::InfiniteDuration()) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
  }
}

absl::StatusOr<HeadList> Client::ListHeads() const {
  grpc::ClientContext context;
  PrepareContext(context);
  v1::ListHeadsResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(balanced_stub_->ListHeads(&context, v1::ListHeadsRequest(), &response)));
  HeadList list;
  list.backend = response.backend();
  for (const v1::HeadInfo& head : response.heads()) {
    ASSIGN_OR_RETURN(HeadInfo info, FromProto(head));
    list.heads.push_back(std::move(info));
  }
  return list;
}

absl::StatusOr<std::string> Client::SharedMemorySocketName() const {
  RETURN_IF_ERROR(RequireOneServer("shared memory"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::SharedMemorySocket response;
  RETURN_IF_ERROR(FromGrpcStatus(
      one_server_stub_->GetSharedMemorySocket(&context, v1::GetSharedMemorySocketRequest(),
                                              &response)));
  return response.abstract_name();
}

absl::StatusOr<HeadInfo> Client::GetHead(const std::string& head) const {
  grpc::ClientContext context;
  PrepareContext(context);
  v1::GetHeadRequest request;
  request.set_head(head);
  v1::HeadInfo response;
  RETURN_IF_ERROR(FromGrpcStatus(balanced_stub_->GetHead(&context, request, &response)));
  return FromProto(response);
}

absl::StatusOr<HeadInfo> Client::UploadHead(const std::string& head, const TensorView& weight,
                                            DType storage_dtype, bool replace,
                                            const ModelTraits& model) const {
  if (weight.rows <= 0 || weight.cols <= 0) {
    return InvalidField("weight", "a [vocab_size, hidden_size] matrix with both sizes positive",
                        absl::StrCat("[", weight.rows, ", ", weight.cols, "]"));
  }
  if (weight.data == nullptr) return InvalidField("weight.data", "a pointer to the values", "null");
  RETURN_IF_ERROR(RequireOneServer("an upload"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::HeadInfo response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadHeadRequest>> writer =
      one_server_stub_->UploadHead(&context, &response);
  v1::UploadHeadRequest start_message;
  v1::UploadHeadStart& start = *start_message.mutable_start();
  start.set_head(head);
  start.set_vocab_size(weight.rows);
  start.set_hidden_size(weight.cols);
  start.set_dtype(ToProto(weight.dtype));
  start.set_storage_dtype(ToProto(storage_dtype));
  start.set_replace(replace);
  start.set_tied_embeddings(model.tied_embeddings);
  start.set_logit_softcap(model.logit_softcap);
  bool open = writer->Write(start_message);
  // The server accepts W in pieces of any size, so pieces need not end on a row.
  const int64_t piece_bytes =
      std::min(kTargetMessageBytes, options_.max_message_bytes - kMessageOverheadBytes);
  const char* bytes = static_cast<const char*>(weight.data);
  const int64_t total_bytes = weight.num_bytes();
  for (int64_t offset = 0; open && offset < total_bytes; offset += piece_bytes) {
    v1::UploadHeadRequest piece;
    piece.set_weight(bytes + offset, std::min(piece_bytes, total_bytes - offset));
    open = writer->Write(piece);
  }
  // A failed Write means the server already ended the call; Finish returns its status.
  if (open) writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
  return FromProto(response);
}

absl::StatusOr<Tensor> Client::FetchWeight(const std::string& head, DType dtype) const {
  return FetchTensor(head, dtype, /*gradient=*/false);
}

absl::StatusOr<Tensor> Client::FetchGradWeight(const std::string& head, DType dtype) const {
  return FetchTensor(head, dtype, /*gradient=*/true);
}

absl::StatusOr<Tensor> Client::FetchTensor(const std::string& head, DType dtype, bool gradient) const {
  if (gradient) RETURN_IF_ERROR(RequireOneServer("the accumulated dL/dW"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::FetchTensorRequest request;
  request.set_head(head);
  request.set_dtype(ToProto(dtype));
  // Half the message limit: the server allows chunks up to half of its own limit, so with equal
  // limits on both ends the request is accepted and every chunk fits this channel.
  request.set_max_chunk_bytes(std::min(kTargetMessageBytes, options_.max_message_bytes / 2));
  std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader =
      gradient ? one_server_stub_->FetchGradWeight(&context, request)
               : balanced_stub_->FetchWeight(&context, request);

  Tensor tensor;
  tensor.dtype = dtype;
  std::optional<RowCoverage> coverage;
  absl::Status assembled = absl::OkStatus();
  v1::TensorChunk chunk;
  while (assembled.ok() && reader->Read(&chunk)) {
    assembled = [&]() -> absl::Status {
      if (!coverage.has_value()) {
        if (chunk.vocab_size() <= 0 || chunk.hidden_size() <= 0 ||
            chunk.vocab_size() > INT64_MAX / 4 / chunk.hidden_size()) {
          return ServerViolation(
              absl::StrCat("a [", chunk.vocab_size(), ", ", chunk.hidden_size(), "] tensor"));
        }
        tensor.rows = chunk.vocab_size();
        tensor.cols = chunk.hidden_size();
        tensor.head_version = chunk.head_version();
        tensor.accumulated_tokens = chunk.accumulated_tokens();
        tensor.bytes.resize(tensor.rows * tensor.cols * DTypeSize(dtype));
        coverage.emplace(tensor.rows);
      }
      if (chunk.vocab_size() != tensor.rows || chunk.hidden_size() != tensor.cols ||
          chunk.head_version() != tensor.head_version || chunk.dtype() != ToProto(dtype)) {
        return ServerViolation("chunks of different tensors, versions or dtypes in one fetch");
      }
      RETURN_IF_ERROR(coverage->Mark(chunk.row_offset(), chunk.num_rows()));
      const int64_t row_bytes = tensor.cols * static_cast<int64_t>(DTypeSize(dtype));
      if (static_cast<int64_t>(chunk.data().size()) != chunk.num_rows() * row_bytes) {
        return ServerViolation(absl::StrCat(chunk.data().size(), " bytes for ", chunk.num_rows(), " rows of ",
                                            row_bytes, " bytes"));
      }
      std::memcpy(tensor.bytes.data() + chunk.row_offset() * row_bytes, chunk.data().data(),
                  chunk.data().size());
      return absl::OkStatus();
    }();
  }
  if (!assembled.ok()) context.TryCancel();
  const grpc::Status status = reader->Finish();
  RETURN_IF_ERROR(assembled);
  RETURN_IF_ERROR(FromGrpcStatus(status));
  if (!coverage.has_value() || !coverage->complete()) {
    return ServerViolation(absl::StrCat("an incomplete tensor (", coverage ? coverage->covered() : 0,
                                        " rows) before ending the fetch"));
  }
  return tensor;
}

absl::StatusOr<uint64_t> Client::ZeroGrad(const std::string& head) const {
  RETURN_IF_ERROR(RequireOneServer("zeroing the gradient"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::ZeroGradWeightRequest request;
  request.set_head(head);
  v1::ZeroGradWeightResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(one_server_stub_->ZeroGradWeight(&context, request, &response)));
  return response.head_version();
}

absl::StatusOr<StepResult> Client::Step(const StepOptions& options) const {
  RETURN_IF_ERROR(RequireOneServer("an optimizer step"));
  v1::StepRequest request;
  request.set_head(options.head);
  if (const auto* sgd = std::get_if<SgdOptions>(&options.optimizer)) {
    v1::SgdConfig& config = *request.mutable_sgd();
    if (sgd->learning_rate.has_value()) config.set_learning_rate(*sgd->learning_rate);
    config.set_momentum(sgd->momentum);
    config.set_weight_decay(sgd->weight_decay);
  } else {
    const AdamWOptions& adamw = std::get<AdamWOptions>(options.optimizer);
    v1::AdamWConfig& config = *request.mutable_adamw();
    config.set_learning_rate(adamw.learning_rate);
    config.set_beta1(adamw.beta1);
    config.set_beta2(adamw.beta2);
    config.set_epsilon(adamw.epsilon);
    config.set_weight_decay(adamw.weight_decay);
  }
  request.set_max_grad_norm(options.max_grad_norm);
  request.set_keep_grad(options.keep_grad);
  if (options.head_version.has_value()) request.set_head_version(*options.head_version);

  grpc::ClientContext context;
  PrepareContext(context);
  v1::StepResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(one_server_stub_->Step(&context, request, &response)));
  StepResult result;
  result.head_version = response.head_version();
  result.grad_norm = response.grad_norm();
  result.clip_multiplier = response.clip_multiplier();
  result.accumulated_tokens = response.accumulated_tokens();
  return result;
}

absl::StatusOr<std::vector<std::string>> Client::SaveCheckpoint(const std::string& head) const {
  RETURN_IF_ERROR(RequireOneServer("a checkpoint"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::SaveCheckpointRequest request;
  request.set_head(head);
  v1::SaveCheckpointResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(one_server_stub_->SaveCheckpoint(&context, request, &response)));
  return std::vector<std::string>(response.paths().begin(), response.paths().end());
}

absl::StatusOr<ComputeResult> Client::Compute(const ComputeRequest& request) const {
  RETURN_IF_ERROR(ValidateComputeRequest(request));
  if (request.outputs.accumulate_grad_weight) {
    RETURN_IF_ERROR(RequireOneServer("a call that accumulates dL/dW"));
  }
  const TensorView& hidden = request.hidden;
  v1::ComputeRequest start_message;
  v1::ComputeStart& start = *start_message.mutable_start();
  start.set_head(request.head);
  if (request.head_version.has_value()) start.set_head_version(*request.head_version);
  start.set_weight_sha256(request.weight_sha256);
  ToProto(request.options, *start.mutable_options());
  ToProto(request.outputs, *start.mutable_outputs());
  start.set_num_tokens(hidden.rows);
  start.set_hidden_size(hidden.cols);
  start.set_hidden_dtype(ToProto(hidden.dtype));
  start.mutable_labels()->Add(request.labels.begin(), request.labels.end());
  start.mutable_token_weights()->Add(request.token_weights.begin(), request.token_weights.end());
  start.set_call_id(!request.call_id.empty()                 ? request.call_id
                    : request.outputs.accumulate_grad_weight ? NewCallId()
                                                             : std::string());
  start.set_shift_labels(request.shift_labels);
  start.mutable_sequence_lengths()->Add(request.sequence_lengths.begin(),
                                        request.sequence_lengths.end());
  const int64_t start_bytes = static_cast<int64_t>(start_message.ByteSizeLong());
  if (start_bytes > options_.max_message_bytes) {
    return InvalidField("labels",
                        absl::StrCat("a start message within max_message_bytes (", options_.max_message_bytes,
                                     " bytes); split the batch into several calls"),
                        absl::StrCat(hidden.rows, " tokens in ", start_bytes, " bytes"));
  }

  const RetryOptions& retry = options_.compute_retry;
  absl::Duration backoff = retry.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    ComputeResult result;
    const absl::Time call_start = absl::Now();
    // The shared-memory path names its memfd in the start message, anew for each attempt.
    const absl::Status status = request.shared_memory
                                    ? RunComputeShared(request, start_message, result)
                                    : RunCompute(request, start_message, result);
    if (status.ok()) {
      result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - call_start);
      result.call_id = start.call_id();
      result.attempts = attempt;
      return result;
    }
    if (!IsRetryable(status) || attempt >= retry.max_attempts) return status;
    const absl::Duration wait = std::min(backoff, retry.max_backoff) * RandomJitter();
    if (retry.on_retry) retry.on_retry(status, attempt, wait);
    absl::SleepFor(wait);
    backoff = std::min(backoff * retry.backoff_multiplier, retry.max_backoff);
  }
}

namespace {

using ComputeStream = grpc::ClientReaderWriter<v1::ComputeRequest, v1::ComputeResponse>;

// Reads the call's responses into the assembler until the server ends the stream; the status of
// the whole call.
absl::Status ReadResults(grpc::ClientContext& context, ComputeStream& stream, ResultAssembler& assembler,
                         ComputeResult& result) {
  absl::Status assembled = absl::OkStatus();
  v1::ComputeResponse response;
  while (stream.Read(&response)) {
    result.bytes_received += static_cast<int64_t>(response.ByteSizeLong());
    ++result.messages_received;
    assembled = assembler.Add(response);
    if (!assembled.ok()) {
      // Tells the server to stop, and unblocks a writer still sending: the results can no longer
      // be used.
      context.TryCancel();
      break;
    }
  }
  return assembled;
}

absl::Status FinishCall(ComputeStream& stream, const absl::Status& assembled, ResultAssembler& assembler) {
  const grpc::Status status = stream.Finish();
  RETURN_IF_ERROR(assembled);
  RETURN_IF_ERROR(FromGrpcStatus(status));
  return assembler.Finish();
}

}  // namespace

absl::Status Client::RunCompute(const ComputeRequest& request, v1::ComputeRequest& start_message,
                                ComputeResult& result) const {
  const TensorView& hidden = request.hidden;
  const int64_t row_bytes = hidden.cols * static_cast<int64_t>(DTypeSize(hidden.dtype));
  ASSIGN_OR_RETURN(const int64_t rows_per_message,
                   RowsPerMessage(request.rows_per_message, row_bytes, options_.max_message_bytes));
  // dL/dh bound for the caller's buffer is assembled apart, so that a failed call leaves that
  // buffer as it was, in memory kept between calls: fresh pages would fault in as they are written.
  std::unique_ptr<SharedBuffer> staging;
  const uint64_t staged_bytes =
      request.grad_hidden_out != nullptr && request.outputs.grad_hidden
          ? static_cast<uint64_t>(hidden.rows) * hidden.cols *
                DTypeSize(request.outputs.grad_hidden_dtype.value_or(hidden.dtype))
          : 0;
  if (staged_bytes > 0) {
    ASSIGN_OR_RETURN(staging, shared_buffers_->Acquire(staged_bytes));
  }
  ResultAssembler assembler(request, result, /*grad_hidden_in_messages=*/true,
                            staging ? staging->data() : nullptr);
  grpc::ClientContext context;
  PrepareContext(context);
  // A scoring call takes the next server in the rotation; a training call, the one server.
  v1::LossService::Stub& stub =
      request.outputs.accumulate_grad_weight ? *one_server_stub_ : *balanced_stub_;
  std::unique_ptr<ComputeStream> stream = stub.Compute(&context);

  // The writer thread owns the sending half of the stream: Write blocks under flow control, and the
  // server stops reading rows while its own results wait to be read, so sending and reading from
  // one thread could wait on each other forever for a large batch.
  std::thread writer([&] {
    if (!stream->Write(start_message)) return;
    result.bytes_sent += static_cast<int64_t>(start_message.ByteSizeLong());
    ++result.messages_sent;
    const char* rows = static_cast<const char*>(hidden.data);
    v1::ComputeRequest chunk;  // reused: setting its rows again keeps the string's buffer
    for (int64_t first = 0; first < hidden.rows; first += rows_per_message) {
      const int64_t count = std::min(rows_per_message, hidden.rows - first);
      chunk.mutable_chunk()->set_hidden(rows + first * row_bytes, count * row_bytes);
      // A failed Write means the call has ended (the server returned an error, or it was
      // cancelled); the reader learns why from Finish.
      if (!stream->Write(chunk)) return;
      result.bytes_sent += static_cast<int64_t>(chunk.ByteSizeLong());
      ++result.messages_sent;
    }
    stream->WritesDone();
  });
  const absl::Status assembled = ReadResults(context, *stream, assembler, result);
  writer.join();
  const absl::Status finished = FinishCall(*stream, assembled, assembler);
  if (staging != nullptr) {
    if (finished.ok()) CopyInParallel(request.grad_hidden_out, staging->data(), staged_bytes);
    shared_buffers_->Release(std::move(staging));
  }
  return finished;
}

absl::Status Client::RunComputeShared(const ComputeRequest& request, v1::ComputeRequest& start_message,
                                      ComputeResult& result) const {
  const TensorView& hidden = request.hidden;
  const uint64_t hidden_bytes =
      static_cast<uint64_t>(hidden.rows) * hidden.cols * DTypeSize(hidden.dtype);
  const DType grad_dtype = request.outputs.grad_hidden_dtype.value_or(hidden.dtype);
  const uint64_t grad_bytes =
      request.outputs.grad_hidden ? static_cast<uint64_t>(hidden.rows) * hidden.cols * DTypeSize(grad_dtype) : 0;
  constexpr uint64_t kAlignment = 64;  // the server's rule for both offsets
  const uint64_t grad_offset = (hidden_bytes + kAlignment - 1) / kAlignment * kAlignment;
  ASSIGN_OR_RETURN(const std::shared_ptr<HandoverConnection> handover,
                   handover_->Get([this] { return SharedMemorySocketName(); }));
  ASSIGN_OR_RETURN(std::unique_ptr<SharedBuffer> buffer, shared_buffers_->Acquire(grad_offset + grad_bytes));
  ASSIGN_OR_RETURN(const std::string handle, buffer->HandleOn(handover));
  CopyInParallel(buffer->data(), hidden.data, hidden_bytes);
  v1::SharedMemory& shared = *start_message.mutable_start()->mutable_shared_memory();
  shared.set_handle(handle);
  shared.set_hidden_offset(0);
  shared.set_grad_hidden_offset(grad_offset);

  ResultAssembler assembler(request, result, /*grad_hidden_in_messages=*/false);
  grpc::ClientContext context;
  PrepareContext(context);
  // On the server the memfd was handed over to.
  std::unique_ptr<ComputeStream> stream = one_server_stub_->Compute(&context);
  // The start message is the whole request, so one thread can send it and then read.
  if (stream->Write(start_message)) {
    result.bytes_sent += static_cast<int64_t>(start_message.ByteSizeLong());
    ++result.messages_sent;
    stream->WritesDone();
  }
  const absl::Status assembled = ReadResults(context, *stream, assembler, result);
  // A failed call drops the buffer instead of keeping it: a server still running a cancelled call
  // may yet write dL/dh into it, which must not land in the next call's.
  RETURN_IF_ERROR(FinishCall(*stream, assembled, assembler));
  if (grad_bytes > 0) {
    void* target = request.grad_hidden_out;
    if (target == nullptr) {
      result.grad_hidden.bytes.resize(grad_bytes);
      target = result.grad_hidden.bytes.data();
    }
    CopyInParallel(target, buffer->data() + grad_offset, grad_bytes);
  }
  shared_buffers_->Release(std::move(buffer));
  return absl::OkStatus();
}

}  // namespace lossd::client
