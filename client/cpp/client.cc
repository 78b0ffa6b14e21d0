#include "lossd/client/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <netdb.h>
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
#include "absl/synchronization/mutex.h"
#include "client/cpp/compute_socket_client.h"
#include "client/cpp/result_assembler.h"
#include "client/cpp/shared_buffer.h"
#include "lossd/common/status_macros.h"
#include "proto/wire/compute_frames.h"

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
// Rows copied into shared memory after a call's start (SharedMemory.rows_follow) go in pieces of
// about this size unless the request says (ComputeRequest::shared_rows_per_piece): the Python
// client's size, whose reasons its _FOLLOWING_PIECE_BYTES gives.
constexpr uint64_t kFollowingPieceBytes = uint64_t{32} << 20;

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

absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    default:
      return ServerViolation(absl::StrCat(field, " = ", static_cast<int>(dtype), ", not a dtype"));
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
  info.master_weights = proto.master_weights();
  info.staged_gradients = proto.staged_gradients();
  return info;
}

// The dtype of a call's dL/dh: outputs.grad_hidden_dtype, or unspecified, the rows'.
absl::StatusOr<DType> GradHiddenDType(const ComputeRequest& request) {
  const v1::DType wanted = request.outputs.grad_hidden_dtype();
  if (wanted == v1::DTYPE_UNSPECIFIED) return request.hidden.dtype;
  absl::StatusOr<DType> dtype = FromProto(wanted, "outputs.grad_hidden_dtype");
  if (!dtype.ok()) {
    return InvalidField("outputs.grad_hidden_dtype", "a lossd.v1.DType",
                        absl::StrCat(static_cast<int>(wanted)));
  }
  return dtype;
}

// A matrix of `rows` rows the caller hands over: its columns positive and its data there.
absl::Status CheckMatrix(const TensorView& view, int64_t rows, absl::string_view field,
                         absl::string_view rows_are) {
  if (view.rows != rows) {
    return InvalidField(absl::StrCat(field, ".rows"), absl::StrCat(rows, " (", rows_are, ")"),
                        absl::StrCat(view.rows));
  }
  if (view.cols <= 0) {
    return InvalidField(absl::StrCat(field, ".cols"), "a positive hidden size",
                        absl::StrCat(view.cols));
  }
  if (rows > 0 && view.data == nullptr) {
    return InvalidField(absl::StrCat(field, ".data"), "a pointer to the rows", "null");
  }
  return absl::OkStatus();
}

// Whether the call names a teacher head (dense) or carries a teacher's top-k (sparse).
bool DenseTeacher(const ComputeRequest& request) { return !request.teacher_head.empty(); }
bool SparseTeacher(const ComputeRequest& request) {
  return request.teacher_top_k != 0 || !request.teacher_top_k_tokens.empty() ||
         !request.teacher_top_k_logprobs.empty();
}

absl::Status ValidateTeacher(const ComputeRequest& request) {
  const int64_t rows = request.hidden.rows;
  const bool dense = DenseTeacher(request);
  const bool sparse = SparseTeacher(request);
  if (dense && sparse) {
    return InvalidField("teacher_head/teacher_top_k", "one teacher", "both");
  }
  if (!dense && (request.teacher_hidden.rows != 0 || request.teacher_hidden.data != nullptr)) {
    return InvalidField("teacher_hidden", "no rows without a teacher_head",
                        absl::StrCat(request.teacher_hidden.rows, " rows"));
  }
  if (dense)
    RETURN_IF_ERROR(CheckMatrix(request.teacher_hidden, rows, "teacher_hidden", "hidden.rows"));
  if (sparse) {
    if (request.teacher_top_k <= 0) {
      return InvalidField("teacher_top_k", "k >= 1 beside teacher_top_k_tokens/logprobs",
                          absl::StrCat(request.teacher_top_k));
    }
    const int64_t values = rows * request.teacher_top_k;
    for (const auto& [name, size] :
         {std::pair<absl::string_view, size_t>{"teacher_top_k_tokens",
                                               request.teacher_top_k_tokens.size()},
          {"teacher_top_k_logprobs", request.teacher_top_k_logprobs.size()}}) {
      if (static_cast<int64_t>(size) != values) {
        return InvalidField(name,
                            absl::StrCat(values, " entries (hidden.rows x teacher_top_k, ", rows,
                                         " x ", request.teacher_top_k, ")"),
                            absl::StrCat(size));
      }
    }
  }
  if ((dense || sparse) && request.shared_memory.value_or(false)) {
    return InvalidField("shared_memory",
                        "false for a call with a teacher, whose rows travel in messages", "true");
  }
  return absl::OkStatus();
}

absl::Status ValidateComputeRequest(const ComputeRequest& request) {
  const TensorView& hidden = request.hidden;
  if (hidden.rows < 0)
    return InvalidField("hidden.rows", "a count >= 0", absl::StrCat(hidden.rows));
  if (hidden.cols <= 0)
    return InvalidField("hidden.cols", "the head's hidden size", absl::StrCat(hidden.cols));
  if (hidden.rows > 0 && hidden.data == nullptr) {
    return InvalidField("hidden.data", "a pointer to the rows", "null");
  }
  const bool may_go_without_labels = request.options.objective() == v1::OBJECTIVE_DISTILL &&
                                     request.options.distill().alpha() == 0.0;
  if (static_cast<int64_t>(request.labels.size()) != hidden.rows &&
      !(may_go_without_labels && request.labels.empty())) {
    return InvalidField("labels",
                        absl::StrCat(hidden.rows, " entries (hidden.rows)",
                                     may_go_without_labels ? ", or none" : ""),
                        absl::StrCat(request.labels.size()));
  }
  for (const auto& [name, size] :
       {std::pair<absl::string_view, size_t>{"token_weights", request.token_weights.size()},
        {"sampling_logprobs", request.sampling_logprobs.size()},
        {"advantages", request.advantages.size()},
        {"reference_logprobs", request.reference_logprobs.size()},
        {"logprob_grads", request.logprob_grads.size()},
        {"rollout_logprobs", request.rollout_logprobs.size()}}) {
    if (size != 0 && static_cast<int64_t>(size) != hidden.rows) {
      return InvalidField(name, absl::StrCat("0 or ", hidden.rows, " entries (hidden.rows)"),
                          absl::StrCat(size));
    }
  }
  RETURN_IF_ERROR(ValidateTeacher(request));
  // Checked here as well as on the server because the result buffers are sized by it.
  if (request.outputs.top_k() < 0 || request.outputs.top_k() > kMaxTopK) {
    return InvalidField("outputs.top_k", absl::StrCat("a value in [0, ", kMaxTopK, "]"),
                        absl::StrCat(request.outputs.top_k()));
  }
  RETURN_IF_ERROR(GradHiddenDType(request).status());
  if (request.rows_per_message < 0) {
    return InvalidField("rows_per_message", "0 (automatic) or a positive count",
                        absl::StrCat(request.rows_per_message));
  }
  if (request.shared_rows_per_piece < 0) {
    return InvalidField("shared_rows_per_piece", "0 (automatic) or a positive count",
                        absl::StrCat(request.shared_rows_per_piece));
  }
  return absl::OkStatus();
}

// The bytes one row of a call takes in chunk messages: its hidden row and the teacher's data for
// it.
int64_t ChunkRowBytes(const ComputeRequest& request) {
  const auto row_bytes = [](const TensorView& view) {
    return view.cols * static_cast<int64_t>(DTypeSize(view.dtype));
  };
  int64_t bytes = row_bytes(request.hidden);
  if (!request.teacher_head.empty()) bytes += row_bytes(request.teacher_hidden);
  bytes += int64_t{request.teacher_top_k} * (sizeof(int32_t) + sizeof(float));
  return bytes;
}

absl::StatusOr<int64_t> RowsPerMessage(int64_t requested, int64_t row_bytes,
                                       int64_t max_message_bytes) {
  const int64_t payload_limit = max_message_bytes - kMessageOverheadBytes;
  if (row_bytes > payload_limit) {
    return InvalidField("hidden",
                        absl::StrCat("rows of at most ", payload_limit,
                                     " bytes (max_message_bytes ", max_message_bytes, ")"),
                        absl::StrCat(row_bytes, " bytes per row"));
  }
  if (requested == 0)
    return std::max<int64_t>(1, std::min(kTargetMessageBytes, payload_limit) / row_bytes);
  if (requested > payload_limit / row_bytes) {
    return InvalidField("rows_per_message",
                        absl::StrCat("at most ", payload_limit / row_bytes, " rows of ", row_bytes,
                                     " bytes (max_message_bytes ", max_message_bytes, ")"),
                        absl::StrCat(requested));
  }
  return requested;
}

// The start message of a call: everything but the rows.
v1::ComputeRequest StartMessage(const ComputeRequest& request) {
  const TensorView& hidden = request.hidden;
  v1::ComputeRequest message;
  v1::ComputeStart& start = *message.mutable_start();
  start.set_head(request.head);
  if (request.head_version.has_value()) start.set_head_version(*request.head_version);
  start.set_weight_sha256(request.weight_sha256);
  *start.mutable_options() = request.options;
  *start.mutable_outputs() = request.outputs;
  start.set_num_tokens(hidden.rows);
  start.set_hidden_size(hidden.cols);
  start.set_hidden_dtype(ToProto(hidden.dtype));
  start.mutable_labels()->Add(request.labels.begin(), request.labels.end());
  const auto add = [](absl::Span<const float> values,
                      google::protobuf::RepeatedField<float>* field) {
    field->Add(values.begin(), values.end());
  };
  add(request.token_weights, start.mutable_token_weights());
  add(request.sampling_logprobs, start.mutable_sampling_logprobs());
  add(request.advantages, start.mutable_advantages());
  add(request.reference_logprobs, start.mutable_reference_logprobs());
  add(request.logprob_grads, start.mutable_logprob_grads());
  add(request.rollout_logprobs, start.mutable_rollout_logprobs());
  start.set_call_id(!request.call_id.empty()                   ? request.call_id
                    : request.outputs.accumulate_grad_weight() ? NewCallId()
                                                               : std::string());
  start.set_shift_labels(request.shift_labels);
  start.mutable_sequence_lengths()->Add(request.sequence_lengths.begin(),
                                        request.sequence_lengths.end());
  if (!request.teacher_head.empty()) {
    start.set_teacher_head(request.teacher_head);
    if (request.teacher_head_version.has_value()) {
      start.set_teacher_head_version(*request.teacher_head_version);
    }
    start.set_teacher_hidden_size(request.teacher_hidden.cols);
    start.set_teacher_hidden_dtype(ToProto(request.teacher_hidden.dtype));
  }
  start.set_teacher_top_k(request.teacher_top_k);
  start.set_stage_grad_weight(request.stage_grad_weight);
  return message;
}

// Puts one Compute call's results together as they arrive: the per-token outputs by the
// contract's rule (PerTokenAssembler), dL/dh from the result messages into the result, into
// `grad_hidden_into` (a buffer of the client's, lent once the call has succeeded), or kept as
// received until the call has succeeded (`keep_grad_hidden`: the caller's buffer is written only
// then, by CopyKeptGradHidden), or (shared memory) not at all, and the summary.
class ResultAssembler {
 public:
  ResultAssembler(const ComputeRequest& request, DType grad_dtype, PerTokenAssembler per_token,
                  ComputeResult& result, bool grad_hidden_in_messages,
                  bool keep_grad_hidden = false, uint8_t* grad_hidden_into = nullptr)
      : on_progress_(request.on_progress),
        grad_hidden_wanted_(request.outputs.grad_hidden()),
        grad_hidden_in_messages_(grad_hidden_in_messages),
        rows_(request.hidden.rows),
        grad_dtype_(grad_dtype),
        grad_row_bytes_(request.hidden.cols * static_cast<int64_t>(DTypeSize(grad_dtype_))),
        keep_grad_hidden_(keep_grad_hidden),
        result_(result),
        per_token_(std::move(per_token)) {
    if (grad_hidden_wanted_) {
      if (grad_hidden_in_messages_ && !keep_grad_hidden_) {
        grad_hidden_ = grad_hidden_into;
        if (grad_hidden_ == nullptr) {
          result_.grad_hidden.bytes.resize(rows_ * grad_row_bytes_);
          grad_hidden_ = reinterpret_cast<uint8_t*>(result_.grad_hidden.bytes.data());
        }
      }
      result_.grad_hidden.dtype = grad_dtype_;
      result_.grad_hidden.rows = rows_;
      result_.grad_hidden.cols = request.hidden.cols;
    }
  }

  // Takes what it keeps out of `response` (its result's dL/dh in `grad_hidden`), which the stream
  // reads into again.
  absl::Status Add(v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) {
    if (summary_received_) return ServerViolation("a message after the summary");
    if (response.has_summary()) {
      summary_received_ = true;
      result_.summary.Swap(response.mutable_summary());
      return absl::OkStatus();
    }
    if (!response.has_result())
      return ServerViolation("a response with neither result nor summary");
    return Place(*response.mutable_result(), grad_hidden);
  }

  // dL/dh of a call that kept it: into `out`, the results shared out over as many threads as a
  // copy of their size takes (CopyThreads; the copy is the last thing the call does).
  void CopyKeptGradHidden(uint8_t* out) const {
    const size_t pieces = kept_grad_hidden_.size();
    const size_t threads = std::min(CopyThreads(static_cast<size_t>(rows_ * grad_row_bytes_)),
                                    std::max<size_t>(pieces, 1));
    RunShares(threads, [&](size_t t) {
      for (size_t i = t * pieces / threads; i < (t + 1) * pieces / threads; ++i) {
        const auto& [offset, bytes] = kept_grad_hidden_[i];
        bytes.CopyTo(0, bytes.size(), out + offset);
      }
    });
  }

  // Where a result's dL/dh of `bytes` bytes goes in the result, for a reader that receives it
  // straight there; null when it is kept as received instead, or where the result's rows or byte
  // count are not the call's (Add then says what is wrong). Add still checks the result whole.
  uint8_t* GradHiddenPlace(const v1::ComputeResult& piece, int64_t bytes) const {
    const int64_t first = piece.row_offset();
    const int64_t count = piece.num_rows();
    if (grad_hidden_ == nullptr || first < 0 || count < 0 || first > rows_ ||
        count > rows_ - first || bytes != count * grad_row_bytes_) {
      return nullptr;
    }
    return grad_hidden_ + first * grad_row_bytes_;
  }

  absl::Status Finish() {
    if (!summary_received_) return ServerViolation("no summary before ending the call");
    RETURN_IF_ERROR(per_token_.Finish());
    result_.grad_hidden.head_version = result_.summary.head_version();
    return absl::OkStatus();
  }

 private:
  absl::Status Place(v1::ComputeResult& piece, const wire::BulkBytes& grad_hidden) {
    // Checks the rows' place and every per-token field's count before dL/dh is copied by them.
    RETURN_IF_ERROR(per_token_.Add(piece));
    if (on_progress_) on_progress_(per_token_.covered(), rows_);
    const int64_t count = piece.num_rows();
    const int64_t grad_bytes =
        grad_hidden_wanted_ && grad_hidden_in_messages_ ? count * grad_row_bytes_ : 0;
    if (grad_hidden.size() != grad_bytes) {
      return ServerViolation(absl::StrCat(grad_hidden.size(), " bytes of grad_hidden for ", count,
                                          " rows, expected ", grad_bytes));
    }
    if (grad_bytes > 0) {
      if (piece.grad_hidden_dtype() != ToProto(grad_dtype_)) {
        return ServerViolation(absl::StrCat("grad_hidden_dtype ",
                                            static_cast<int>(piece.grad_hidden_dtype()),
                                            ", expected ", DTypeName(grad_dtype_)));
      }
      if (keep_grad_hidden_) {
        kept_grad_hidden_.push_back({piece.row_offset() * grad_row_bytes_, grad_hidden});
      } else {
        grad_hidden.CopyTo(0, grad_bytes, grad_hidden_ + piece.row_offset() * grad_row_bytes_);
      }
    }
    return absl::OkStatus();
  }

  const std::function<void(int64_t, int64_t)>& on_progress_;
  const bool grad_hidden_wanted_;
  const bool grad_hidden_in_messages_;
  const int64_t rows_;
  const DType grad_dtype_;
  const int64_t grad_row_bytes_;
  const bool keep_grad_hidden_;
  // With keep_grad_hidden: each result's dL/dh where gRPC received it, by its byte offset.
  std::vector<std::pair<int64_t, wire::BulkBytes>> kept_grad_hidden_;
  uint8_t* grad_hidden_ = nullptr;  // where dL/dh from messages goes, unless kept
  ComputeResult& result_;
  PerTokenAssembler per_token_;
  bool summary_received_ = false;
};

// The bytes of a call's dL/dh: 0 when not asked for.
uint64_t GradHiddenBytes(const ComputeRequest& request, DType grad_dtype) {
  return request.outputs.grad_hidden() ? static_cast<uint64_t>(request.hidden.rows) *
                                             request.hidden.cols * DTypeSize(grad_dtype)
                                       : 0;
}

// A buffer of the client's that a call through messages receives its dL/dh into, to lend it on
// success (ComputeRequest::lend_grad_hidden without grad_hidden_out): pooled, its pages already
// touched by earlier calls, so that dL/dh is neither copied nor received into fresh pages. Null
// when the call does not lend dL/dh.
absl::StatusOr<std::unique_ptr<SharedBuffer>> GradHiddenLendingBuffer(const ComputeRequest& request,
                                                                      DType grad_dtype,
                                                                      SharedBufferPool& pool) {
  const uint64_t grad_bytes = GradHiddenBytes(request, grad_dtype);
  if (!request.lend_grad_hidden || request.grad_hidden_out != nullptr || grad_bytes == 0) {
    return nullptr;
  }
  return pool.Acquire(grad_bytes);
}

// The end of a call that succeeded with its `grad_bytes` of dL/dh at `offset` in `buffer`, one of
// the client's: lent as result.grad_hidden_shared when the call asked for that and the pool lends
// more, else copied into the caller's grad_hidden_out or result.grad_hidden. The buffer, unless
// lent, goes back to the pool.
void DeliverGradHidden(const ComputeRequest& request, SharedBufferPool& pool,
                       std::unique_ptr<SharedBuffer> buffer, uint64_t offset, uint64_t grad_bytes,
                       ComputeResult& result) {
  if (buffer == nullptr) return;
  if (grad_bytes > 0 && request.lend_grad_hidden && request.grad_hidden_out == nullptr) {
    result.grad_hidden_shared = pool.Lend(buffer, offset);
  }
  if (grad_bytes > 0 && result.grad_hidden_shared == nullptr) {
    void* target = request.grad_hidden_out;
    if (target == nullptr) {
      result.grad_hidden.bytes.resize(grad_bytes);
      target = result.grad_hidden.bytes.data();
    }
    CopyInParallel(target, buffer->data() + offset, grad_bytes);
  }
  if (buffer != nullptr) pool.Release(std::move(buffer));
}

// Runs `attempt` (given its number, from 1) until it succeeds, fails with a code other than those
// after which the client cannot know whether the server acted (IsRetryable), or has had
// retry.max_attempts attempts; waits between attempts as `retry` says.
template <typename T>
absl::StatusOr<T> WithRetries(const RetryOptions& retry,
                              const std::function<absl::StatusOr<T>(int attempt)>& attempt) {
  absl::Duration backoff = retry.initial_backoff;
  for (int number = 1;; ++number) {
    absl::StatusOr<T> result = attempt(number);
    if (result.ok() || !IsRetryable(result.status()) || number >= retry.max_attempts) return result;
    const absl::Duration wait = std::min(backoff, retry.max_backoff) * RandomJitter();
    if (retry.on_retry) retry.on_retry(result.status(), number, wait);
    absl::SleepFor(wait);
    backoff = std::min(backoff * retry.backoff_multiplier, retry.max_backoff);
  }
}

}  // namespace

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

namespace {
constexpr char kErrorInfoPayload[] = "type.googleapis.com/lossd.v1.ErrorInfo";
}  // namespace

absl::Status FromRpcStatus(const v1::RpcStatus& status) {
  if (status.code() == 0) return absl::OkStatus();
  // gRPC and absl share the canonical code numbering (0..16).
  absl::Status converted(static_cast<absl::StatusCode>(status.code()), status.message());
  for (const google::protobuf::Any& detail : status.details()) {
    v1::ErrorInfo info;
    if (!detail.UnpackTo(&info)) continue;
    converted.SetPayload(kErrorInfoPayload, absl::Cord(info.SerializeAsString()));
    if (!info.field().empty()) converted = WithField(std::move(converted), info.field());
  }
  return converted;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  v1::RpcStatus details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    details.Clear();
  }
  details.set_code(static_cast<int32_t>(status.error_code()));
  details.set_message(status.error_message());
  return FromRpcStatus(details);
}

std::optional<v1::ErrorInfo> ErrorInfoOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorInfoPayload);
  v1::ErrorInfo info;
  if (!payload.has_value() || !info.ParseFromString(std::string(*payload))) return std::nullopt;
  return info;
}

absl::Status ValidateChannelOptions(const ChannelOptions& options) {
  RETURN_IF_ERROR(ParseTarget(options.address).status());
  if (options.max_message_bytes < kMinMessageBytes || options.max_message_bytes > INT_MAX) {
    return InvalidField("max_message_bytes",
                        absl::StrCat("a size in [", kMinMessageBytes, ", ", INT_MAX, "]"),
                        absl::StrCat(options.max_message_bytes));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return InvalidField("deadline", "a positive duration (infinite: none)",
                        absl::FormatDuration(options.deadline));
  }
  if (options.compute_socket == true && !options.tls_root_cert_pem.empty()) {
    return InvalidField("compute_socket",
                        "unset or false with TLS (tls_root_cert_pem): the Compute socket carries "
                        "rows and the token in the clear, and servers with TLS offer none",
                        "true");
  }
  if (options.compute_connections < 1) {
    return InvalidField("compute_connections", "at least 1",
                        absl::StrCat(options.compute_connections));
  }
  if (options.compute_socket_lanes < 1 ||
      options.compute_socket_lanes > wire::kComputeSocketMaxLanes) {
    return InvalidField("compute_socket_lanes",
                        absl::StrCat("1 to ", wire::kComputeSocketMaxLanes, " connections"),
                        absl::StrCat(options.compute_socket_lanes));
  }
  if (options.keepalive_time <= absl::ZeroDuration() ||
      options.keepalive_timeout <= absl::ZeroDuration()) {
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
      names.push_back(
          absl::StrFormat(R"({"service": "lossd.v1.LossService", "method": "%s"})", method));
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

std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options, Balancing balancing,
                                           bool own_connection) {
  grpc::ChannelArguments args;
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetServiceConfigJSON(ServiceConfig(options.compute_retry, balancing));
  // The balancing is the client's choice: a DNS TXT record cannot replace it.
  args.SetInt(GRPC_ARG_SERVICE_CONFIG_DISABLE_RESOLUTION, 1);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  args.SetMaxSendMessageSize(ClampToInt(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(ClampToInt(options.max_message_bytes));
  // An infinite keepalive time clamps to INT_MAX ms, which gRPC reads as "off".
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              ClampToInt(absl::ToInt64Milliseconds(options.keepalive_time)));
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

// Scoring Compute calls' channels: the client's own round-robin channel and compute_connections - 1
// more, each its own connection, made when first needed. A call takes the channel with the fewest
// calls in flight (the first of those), counted until its lease is dropped. Calls that belong to
// one server keep to one connection: a second one to the same name or virtual IP may reach another
// replica.
class ComputeConnections {
 public:
  ComputeConnections(const ChannelOptions& options, std::shared_ptr<grpc::Channel> own)
      : options_(options), slots_(std::max(1, options.compute_connections)) {
    slots_[0].channel = std::move(own);
  }

  // Holds a call's place on its channel; the channel outlives it.
  class Lease {
   public:
    Lease(ComputeConnections* owner, size_t index, std::shared_ptr<grpc::Channel> channel)
        : owner_(owner), index_(index), channel_(std::move(channel)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      absl::MutexLock lock(&owner_->mutex_);
      --owner_->slots_[index_].in_flight;
    }
    grpc::Channel& channel() const { return *channel_; }

   private:
    ComputeConnections* owner_;
    size_t index_;
    std::shared_ptr<grpc::Channel> channel_;
  };

  std::unique_ptr<Lease> Acquire() {
    absl::MutexLock lock(&mutex_);
    size_t best = 0;
    for (size_t i = 1; i < slots_.size(); ++i) {
      if (slots_[i].in_flight < slots_[best].in_flight) best = i;
    }
    Slot& slot = slots_[best];
    if (slot.channel == nullptr) {
      slot.channel = MakeChannel(options_, Balancing::kRoundRobin, /*own_connection=*/true);
    }
    ++slot.in_flight;
    return std::make_unique<Lease>(this, best, slot.channel);
  }

 private:
  struct Slot {
    std::shared_ptr<grpc::Channel> channel;
    int in_flight = 0;
  };
  const ChannelOptions options_;
  absl::Mutex mutex_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mutex_);
};

absl::StatusOr<Client> Client::Connect(ChannelOptions options) {
  RETURN_IF_ERROR(ValidateChannelOptions(options));
  ASSIGN_OR_RETURN(Target target, ParseTarget(options.address));
  return Client(std::move(options), std::move(target));
}

Client::Client(ChannelOptions options, Target target)
    : options_(std::move(options)),
      target_(std::move(target)),
      balanced_channel_(MakeChannel(options_, Balancing::kRoundRobin)),
      balanced_stub_(v1::LossService::NewStub(balanced_channel_)),
      one_server_channel_(MakeChannel(options_, Balancing::kOneServer)),
      one_server_stub_(v1::LossService::NewStub(one_server_channel_)),
      scoring_connections_(std::make_shared<ComputeConnections>(options_, balanced_channel_)),
      handover_(std::make_shared<Handover>()),
      shared_buffers_(std::make_shared<SharedBufferPool>()),
      send_buffers_(wire::MessageBufferPool::Create()),
      compute_socket_(std::make_shared<ComputeSocketChoice>()) {}

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

namespace {

// The server's answer as the shared-memory plumbing takes it.
absl::StatusOr<HandoverSocket> AsHandoverSocket(absl::StatusOr<v1::SharedMemorySocket> socket) {
  if (!socket.ok()) return socket.status();
  return HandoverSocket{socket->abstract_name(), socket->rows_follow_pays()};
}

}  // namespace

absl::StatusOr<v1::SharedMemorySocket> Client::SharedMemorySocket(absl::Duration deadline) const {
  RETURN_IF_ERROR(RequireOneServer("shared memory"));
  grpc::ClientContext context;
  PrepareContext(context);
  if (deadline < options_.deadline)
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::SharedMemorySocket response;
  RETURN_IF_ERROR(FromGrpcStatus(one_server_stub_->GetSharedMemorySocket(
      &context, v1::GetSharedMemorySocketRequest(), &response)));
  return response;
}

// What the client found of the server's Compute socket: nothing yet, none to use, or one.
struct ComputeSocketChoice {
  absl::Mutex mu;
  bool asked ABSL_GUARDED_BY(mu) = false;  // the server answered (or there is nothing to ask)
  std::unique_ptr<ComputeSocketPool> pool ABSL_GUARDED_BY(mu);  // null: none to use
  bool probing ABSL_GUARDED_BY(mu) = false;                     // a call is asking the server now
  // The server could not be asked: calls go over gRPC until then without asking again.
  absl::Time probe_again ABSL_GUARDED_BY(mu) = absl::InfinitePast();
};

namespace {

// How long a call that chose the socket by itself waits for the server to name it before it goes
// over gRPC (a server that is up answers within milliseconds), and how long the question then
// rests. One asked for waits as long as the shared-memory probe.
constexpr absl::Duration kComputeSocketProbe = absl::Seconds(5);
constexpr absl::Duration kRequiredProbe = absl::Seconds(10);
constexpr absl::Duration kProbeAgainAfter = absl::Seconds(60);

// How many distinct addresses `host` resolves to (0: none).
int AddressesOf(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return 0;
  std::vector<std::string> seen;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    std::string bytes(reinterpret_cast<const char*>(a->ai_addr), a->ai_addrlen);
    if (std::find(seen.begin(), seen.end(), bytes) == seen.end()) seen.push_back(bytes);
  }
  freeaddrinfo(found);
  return static_cast<int>(seen.size());
}

}  // namespace

absl::StatusOr<ComputeSocketPool*> Client::ComputeSocketFor(const ComputeRequest& request) const {
  const std::optional<bool> asked =
      request.compute_socket.has_value() ? request.compute_socket : options_.compute_socket;
  if (asked == false || (!asked.has_value() && !options_.tls_root_cert_pem.empty())) {
    return nullptr;
  }
  const bool required = asked == true;
  ComputeSocketChoice& choice = *compute_socket_;
  {
    absl::MutexLock lock(&choice.mu);
    if (choice.asked && (choice.pool != nullptr || !required)) return choice.pool.get();
    // Another call is asking, or the server could not be asked lately: this one goes over gRPC
    // rather than wait.
    if (!required && (choice.probing || absl::Now() < choice.probe_again)) return nullptr;
    choice.probing = true;
  }
  // Outside the lock: a server slow to answer holds up this call only.
  absl::StatusOr<std::unique_ptr<ComputeSocketPool>> found = FindComputeSocket(required);
  absl::MutexLock lock(&choice.mu);
  choice.probing = false;
  if (!found.ok()) {
    if (required) return found.status();
    choice.probe_again = absl::Now() + kProbeAgainAfter;
    return nullptr;
  }
  if (!choice.asked) {
    choice.asked = true;
    choice.pool = *std::move(found);
  } else if (choice.pool == nullptr && *found != nullptr) {
    choice.pool = *std::move(found);
  }
  return choice.pool.get();
}

absl::StatusOr<std::unique_ptr<ComputeSocketPool>> Client::FindComputeSocket(bool required) const {
  // No socket to use: an error when asked for, else none (nullptr), for good.
  const auto none = [&](absl::Status why) -> absl::StatusOr<std::unique_ptr<ComputeSocketPool>> {
    if (required) return why;
    return nullptr;
  };
  const std::optional<std::string> host = TcpHost(target_);
  if (!host.has_value()) {
    return none(InvalidField("compute_socket", "an address that names one TCP server",
                             absl::StrCat("\"", target_.uri, "\"")));
  }
  grpc::ClientContext context;
  PrepareContext(context);
  const absl::Duration probe_deadline = required ? kRequiredProbe : kComputeSocketProbe;
  if (probe_deadline < options_.deadline) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + probe_deadline));
  }
  // Asked of the one server (pick_first), which the socket then reaches: the address names one.
  v1::ComputeSocket socket;
  const absl::Status answered = FromGrpcStatus(
      one_server_stub_->GetComputeSocket(&context, v1::GetComputeSocketRequest(), &socket));
  if (!answered.ok()) {
    // A server that offers none answers so for good; another failure (the server is down, slow)
    // leaves the question open, and the call goes over gRPC, which reports what is wrong.
    if (!required && (absl::IsFailedPrecondition(answered) || absl::IsUnimplemented(answered))) {
      return nullptr;
    }
    return answered;
  }
  // A name that resolves to several addresses may reach several servers: the call could land on
  // another one than the client's other calls.
  const int addresses = AddressesOf(*host);
  if (addresses == 0) {
    return absl::UnavailableError(absl::StrCat("compute_socket: cannot resolve \"", *host, "\""));
  }
  if (addresses > 1 && !required) {
    return none(absl::FailedPreconditionError(
        absl::StrCat("compute_socket: \"", *host, "\" resolves to ", addresses,
                     " addresses, which may be several servers")));
  }
  return std::make_unique<ComputeSocketPool>(*host, socket.port(), options_.bearer_token,
                                             options_.max_message_bytes);
}

bool Client::UsesSharedMemory(const ComputeRequest& request) const {
  if (request.shared_memory.has_value()) return *request.shared_memory;
  // A server that is up names its socket within milliseconds; one that does not answer soon is
  // not worth holding the first call for.
  const absl::Duration probe_deadline = absl::Seconds(10);
  // A teacher's rows travel in messages only.
  const bool teacher = DenseTeacher(request) || SparseTeacher(request);
  return target_.local && target_.listed_addresses == 1 && !teacher &&
         handover_->Offered([this, probe_deadline] {
           return AsHandoverSocket(SharedMemorySocket(probe_deadline));
         });
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

absl::StatusOr<Tensor> Client::FetchWeight(const std::string& head, DType dtype,
                                           bool master) const {
  return FetchTensor(head, dtype, /*gradient=*/false, master);
}

absl::StatusOr<Tensor> Client::FetchGradWeight(const std::string& head, DType dtype) const {
  return FetchTensor(head, dtype, /*gradient=*/true, /*master=*/false);
}

absl::StatusOr<Tensor> Client::FetchTensor(const std::string& head, DType dtype, bool gradient,
                                           bool master) const {
  if (gradient) RETURN_IF_ERROR(RequireOneServer("the accumulated dL/dW"));
  grpc::ClientContext context;
  PrepareContext(context);
  v1::FetchTensorRequest request;
  request.set_head(head);
  request.set_dtype(ToProto(dtype));
  request.set_master(master);
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
        return ServerViolation(absl::StrCat(chunk.data().size(), " bytes for ", chunk.num_rows(),
                                            " rows of ", row_bytes, " bytes"));
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
    return ServerViolation(absl::StrCat("an incomplete tensor (",
                                        coverage ? coverage->covered() : 0,
                                        " rows) before ending the fetch"));
  }
  return tensor;
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallOneServer(
    grpc::Status (v1::LossService::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request) const {
  grpc::ClientContext context;
  PrepareContext(context);
  Response response;
  RETURN_IF_ERROR(FromGrpcStatus((one_server_stub_.get()->*method)(&context, request, &response)));
  return response;
}

template <typename Request, typename Response>
absl::StatusOr<Response> Client::CallOneServerRetried(
    grpc::Status (v1::LossService::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, bool repeatable) const {
  if (!repeatable) return CallOneServer(method, request);
  return WithRetries<Response>(options_.compute_retry,
                               [&](int) { return CallOneServer(method, request); });
}

absl::StatusOr<uint64_t> Client::ZeroGrad(const std::string& head) const {
  RETURN_IF_ERROR(RequireOneServer("zeroing the gradient"));
  v1::ZeroGradWeightRequest request;
  request.set_head(head);
  ASSIGN_OR_RETURN(const v1::ZeroGradWeightResponse response,
                   CallOneServer(&v1::LossService::Stub::ZeroGradWeight, request));
  return response.head_version();
}

namespace {

// A collective call's ranks, checked before any rank waits on the server for the others.
absl::Status SetRanks(const RankGroup& ranks, const std::optional<uint64_t>& head_version,
                      v1::RankGroup& proto) {
  if (ranks.world_size < 1) {
    return InvalidField("ranks.world_size", "a count >= 1", absl::StrCat(ranks.world_size));
  }
  if (ranks.rank < 0 || ranks.rank >= ranks.world_size) {
    return InvalidField("ranks.rank", absl::StrCat("a rank in [0, ", ranks.world_size, ")"),
                        absl::StrCat(ranks.rank));
  }
  if (ranks.world_size > 1 && !head_version.has_value()) {
    return InvalidField("head_version", "the version the ranks trained on (ranks.world_size > 1)",
                        "none");
  }
  if (ranks.world_size > 1) {
    proto.set_world_size(ranks.world_size);
    proto.set_rank(ranks.rank);
  }
  return absl::OkStatus();
}

// What Step and GradWeightNorm requests share: the head, the step's version, the ranks and the
// multiplier.
template <typename Options, typename Request>
absl::Status SetCollective(const Options& options, Request& request) {
  request.set_head(options.head);
  if (options.head_version.has_value()) request.set_head_version(*options.head_version);
  RETURN_IF_ERROR(SetRanks(options.ranks, options.head_version, *request.mutable_ranks()));
  if (options.grad_multiplier.has_value()) request.set_grad_multiplier(*options.grad_multiplier);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepResult> Client::Step(const StepOptions& options) const {
  RETURN_IF_ERROR(RequireOneServer("an optimizer step"));
  v1::StepRequest request;
  RETURN_IF_ERROR(SetCollective(options, request));
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
  request.set_skip_nonfinite(options.skip_nonfinite);

  // A single process's step is made once: a repeat of it would be a second step.
  ASSIGN_OR_RETURN(const v1::StepResponse response,
                   CallOneServerRetried(&v1::LossService::Stub::Step, request,
                                        /*repeatable=*/options.ranks.world_size > 1));
  return StepResult{.head_version = response.head_version(),
                    .grad_norm = response.grad_norm(),
                    .clip_multiplier = response.clip_multiplier(),
                    .accumulated_tokens = response.accumulated_tokens(),
                    .skipped = response.skipped()};
}

absl::StatusOr<GradNormResult> Client::GradWeightNorm(const GradNormOptions& options) const {
  RETURN_IF_ERROR(RequireOneServer("the accumulated dL/dW"));
  v1::GradWeightNormRequest request;
  RETURN_IF_ERROR(SetCollective(options, request));
  // It changes nothing, so a repeat is always safe; a collective one is answered as the first.
  ASSIGN_OR_RETURN(const v1::GradWeightNormResponse response,
                   CallOneServerRetried(&v1::LossService::Stub::GradWeightNorm, request,
                                        /*repeatable=*/true));
  return GradNormResult{.head_version = response.head_version(),
                        .grad_norm = response.grad_norm(),
                        .accumulated_tokens = response.accumulated_tokens(),
                        .accumulated_calls = response.accumulated_calls()};
}

absl::StatusOr<CommitResult> Client::CommitGradWeight(const std::string& head,
                                                      const std::string& call_id,
                                                      double scale) const {
  RETURN_IF_ERROR(RequireOneServer("committing a staged dL/dW"));
  if (call_id.empty())
    return InvalidField("call_id", "the id of a call that staged its dL/dW", "none");
  v1::CommitGradWeightRequest request;
  request.set_head(head);
  request.set_call_id(call_id);
  request.set_scale(scale);
  ASSIGN_OR_RETURN(const v1::CommitGradWeightResponse response,
                   CallOneServerRetried(&v1::LossService::Stub::CommitGradWeight, request,
                                        /*repeatable=*/true));
  return CommitResult{.head_version = response.head_version(),
                      .accumulated_tokens = response.accumulated_tokens(),
                      .replayed = response.replayed()};
}

absl::StatusOr<int> Client::DiscardGradWeight(const std::string& head,
                                              absl::Span<const std::string> call_ids) const {
  RETURN_IF_ERROR(RequireOneServer("discarding a staged dL/dW"));
  v1::DiscardGradWeightRequest request;
  request.set_head(head);
  for (const std::string& id : call_ids) request.add_call_ids(id);
  ASSIGN_OR_RETURN(const v1::DiscardGradWeightResponse response,
                   CallOneServer(&v1::LossService::Stub::DiscardGradWeight, request));
  return response.discarded();
}

absl::StatusOr<std::vector<std::string>> Client::SaveCheckpoint(const std::string& head) const {
  RETURN_IF_ERROR(RequireOneServer("a checkpoint"));
  v1::SaveCheckpointRequest request;
  request.set_head(head);
  ASSIGN_OR_RETURN(const v1::SaveCheckpointResponse response,
                   CallOneServer(&v1::LossService::Stub::SaveCheckpoint, request));
  return std::vector<std::string>(response.paths().begin(), response.paths().end());
}

absl::StatusOr<ComputeResult> Client::Compute(const ComputeRequest& request) const {
  RETURN_IF_ERROR(ValidateComputeRequest(request));
  if (request.outputs.accumulate_grad_weight()) {
    RETURN_IF_ERROR(RequireOneServer("a call that accumulates dL/dW"));
  }
  v1::ComputeRequest start_message = StartMessage(request);
  const int64_t start_bytes = static_cast<int64_t>(start_message.ByteSizeLong());
  if (start_bytes > options_.max_message_bytes) {
    return InvalidField(
        "labels",
        absl::StrCat("a start message within max_message_bytes (", options_.max_message_bytes,
                     " bytes); split the batch into several calls"),
        absl::StrCat(request.hidden.rows, " tokens in ", start_bytes, " bytes"));
  }
  const bool shared_memory = UsesSharedMemory(request);
  ComputeSocketPool* socket = nullptr;
  if (!shared_memory) {
    ASSIGN_OR_RETURN(socket, ComputeSocketFor(request));
  }
  return WithRetries<ComputeResult>(
      options_.compute_retry, [&](int attempt) -> absl::StatusOr<ComputeResult> {
        ComputeResult result;
        const absl::Time call_start = absl::Now();
        // The shared-memory path names its memfd in the start message, anew for each attempt.
        RETURN_IF_ERROR(shared_memory ? RunComputeShared(request, start_message, result)
                        : socket != nullptr
                            ? RunComputeOverSocket(request, start_message, result, *socket)
                            : RunCompute(request, start_message, result));
        result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - call_start);
        if (shared_memory) result.transport = ComputeResult::Transport::kSharedMemory;
        result.call_id = start_message.start().call_id();
        result.attempts = attempt;
        return result;
      });
}

namespace {

// Compute with its messages' bytes as they travel (proto/wire/compute_frames.h): rows are sent
// from one copy of the caller's, dL/dh read from where gRPC received it into its final place.
using ComputeStream = grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

std::unique_ptr<ComputeStream> OpenCompute(grpc::Channel& channel, grpc::ClientContext& context) {
  static const std::string* const method =
      new std::string(absl::StrCat("/", v1::LossService::service_full_name(), "/Compute"));
  // What the generated stub does for its typed stream, with gRPC's raw bytes as the messages.
  return std::unique_ptr<ComputeStream>(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          &channel,
          grpc::internal::RpcMethod(method->c_str(), grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
}

// Sends one request; false once the call has ended (Finish says why).
bool WriteFrame(ComputeStream& stream, const wire::ComputeRequestFrame& frame,
                ComputeResult& result) {
  grpc::ByteBuffer message = frame.Encode();
  const int64_t bytes = static_cast<int64_t>(message.Length());
  if (!stream.Write(message)) return false;
  result.bytes_sent += bytes;
  ++result.messages_sent;
  return true;
}

// Reads the call's responses into the assembler until the server ends the stream; the status of
// the whole call.
absl::Status ReadResults(grpc::ClientContext& context, ComputeStream& stream,
                         ResultAssembler& assembler, ComputeResult& result) {
  absl::Status assembled = absl::OkStatus();
  grpc::ByteBuffer message;
  wire::ComputeResponseFrame response;
  while (stream.Read(&message)) {
    result.bytes_received += static_cast<int64_t>(message.Length());
    ++result.messages_received;
    assembled = response.Decode(message);
    if (assembled.ok()) assembled = assembler.Add(response.message, response.grad_hidden);
    if (!assembled.ok()) {
      // Tells the server to stop, and unblocks a writer still sending: the results can no longer
      // be used.
      context.TryCancel();
      break;
    }
  }
  return assembled;
}

absl::Status FinishCall(ComputeStream& stream, const absl::Status& assembled,
                        ResultAssembler& assembler) {
  const grpc::Status status = stream.Finish();
  RETURN_IF_ERROR(assembled);
  RETURN_IF_ERROR(FromGrpcStatus(status));
  return assembler.Finish();
}

// One field of the chunk messages that carries rows: each message's bytes for its rows.
struct RowStream {
  wire::ChunkRowField field;
  const char* data;
  int64_t row_bytes;
};

// The hidden rows, and beside them the teacher's data for the same rows.
std::vector<RowStream> RowStreams(const ComputeRequest& request) {
  const auto matrix = [](wire::ChunkRowField field, const TensorView& view) {
    return RowStream{field, static_cast<const char*>(view.data),
                     view.cols * static_cast<int64_t>(DTypeSize(view.dtype))};
  };
  std::vector<RowStream> streams = {matrix(wire::kHiddenRows, request.hidden)};
  if (!request.teacher_head.empty()) {
    streams.push_back(matrix(wire::kTeacherHiddenRows, request.teacher_hidden));
  }
  if (request.teacher_top_k > 0) {
    const int64_t k = request.teacher_top_k;
    streams.push_back({wire::kTeacherTopKTokenRows,
                       reinterpret_cast<const char*>(request.teacher_top_k_tokens.data()),
                       k * static_cast<int64_t>(sizeof(int32_t))});
    streams.push_back({wire::kTeacherTopKLogprobRows,
                       reinterpret_cast<const char*>(request.teacher_top_k_logprobs.data()),
                       k * static_cast<int64_t>(sizeof(float))});
  }
  return streams;
}

// Hands the call's request frames to `send` in order, the start and then chunks of
// rows_per_message rows, until `send` returns false; true when every frame went. Rows are copied
// into `copy_into` (gRPC keeps them past its Write), or lent where they lie when it is null (the
// socket's write is done with them when it returns).
bool SendRequestFrames(const ComputeRequest& request, const v1::ComputeRequest& start_message,
                       int64_t rows_per_message, wire::MessageBufferPool* copy_into,
                       absl::FunctionRef<bool(const wire::ComputeRequestFrame&)> send) {
  wire::ComputeRequestFrame start;
  start.message = start_message;
  if (!send(start)) return false;
  const std::vector<RowStream> streams = RowStreams(request);
  wire::ComputeRequestFrame chunk;
  chunk.message.mutable_chunk();
  for (int64_t first = 0; first < request.hidden.rows; first += rows_per_message) {
    const int64_t count = std::min(rows_per_message, request.hidden.rows - first);
    for (const RowStream& part : streams) {
      const absl::string_view rows(part.data + first * part.row_bytes,
                                   static_cast<size_t>(count * part.row_bytes));
      chunk.rows[part.field] =
          copy_into != nullptr ? copy_into->Copy(rows) : wire::BulkBytes::Borrow(rows);
    }
    if (!send(chunk)) return false;
  }
  return true;
}

}  // namespace

absl::Status Client::RunCompute(const ComputeRequest& request, v1::ComputeRequest& start_message,
                                ComputeResult& result) const {
  const TensorView& hidden = request.hidden;
  ASSIGN_OR_RETURN(
      const int64_t rows_per_message,
      RowsPerMessage(request.rows_per_message, ChunkRowBytes(request), options_.max_message_bytes));
  ASSIGN_OR_RETURN(const DType grad_dtype, GradHiddenDType(request));
  ASSIGN_OR_RETURN(PerTokenAssembler per_token,
                   PerTokenAssembler::Create(request.outputs, hidden.rows, &result.per_token));
  // dL/dh bound for the caller's buffer stays where gRPC received it until the call has succeeded,
  // so that a failed call leaves that buffer as it was.
  const bool into_caller = request.grad_hidden_out != nullptr && request.outputs.grad_hidden();
  ASSIGN_OR_RETURN(std::unique_ptr<SharedBuffer> lending,
                   GradHiddenLendingBuffer(request, grad_dtype, *shared_buffers_));
  ResultAssembler assembler(request, grad_dtype, std::move(per_token), result,
                            /*grad_hidden_in_messages=*/true, /*keep_grad_hidden=*/into_caller,
                            lending != nullptr ? lending->data() : nullptr);
  grpc::ClientContext context;
  PrepareContext(context);
  // A scoring call takes the next server in the rotation, on a connection of its own when others
  // are in flight; a training call, the one server.
  const std::unique_ptr<ComputeConnections::Lease> lease =
      request.outputs.accumulate_grad_weight() ? nullptr : scoring_connections_->Acquire();
  std::unique_ptr<ComputeStream> stream =
      OpenCompute(lease != nullptr ? lease->channel() : *one_server_channel_, context);

  // The writer thread owns the sending half of the stream: Write blocks under flow control, and the
  // server stops reading rows while its own results wait to be read, so sending and reading from
  // one thread could wait on each other forever for a large batch.
  std::thread writer([&] {
    // A failed Write means the call has ended (the server returned an error, or it was
    // cancelled); the reader learns why from Finish. The rows' one copy on this side goes to gRPC,
    // which sends the slice as it is and frees it once sent.
    if (SendRequestFrames(request, start_message, rows_per_message, send_buffers_.get(),
                          [&](const wire::ComputeRequestFrame& frame) {
                            return WriteFrame(*stream, frame, result);
                          })) {
      stream->WritesDone();
    }
  });
  const absl::Status assembled = ReadResults(context, *stream, assembler, result);
  writer.join();
  const absl::Status finished = FinishCall(*stream, assembled, assembler);
  if (lending != nullptr && !finished.ok()) {
    // A failed call's dL/dh, never seen by the caller, is overwritten by the buffer's next call.
    shared_buffers_->Release(std::move(lending));
  }
  RETURN_IF_ERROR(finished);
  if (into_caller) assembler.CopyKeptGradHidden(static_cast<uint8_t*>(request.grad_hidden_out));
  DeliverGradHidden(request, *shared_buffers_, std::move(lending), 0,
                    GradHiddenBytes(request, grad_dtype), result);
  return absl::OkStatus();
}

absl::Status Client::RunComputeOverSocket(const ComputeRequest& request,
                                          v1::ComputeRequest& start_message, ComputeResult& result,
                                          ComputeSocketPool& socket) const {
  ASSIGN_OR_RETURN(
      int64_t rows_per_message,
      RowsPerMessage(request.rows_per_message, ChunkRowBytes(request), options_.max_message_bytes));
  // No more lanes than messages of rows: a lane with none to carry only waits.
  const int lanes = static_cast<int>(
      std::clamp<int64_t>((request.hidden.rows + rows_per_message - 1) / rows_per_message, 1,
                          options_.compute_socket_lanes));
  if (lanes > 1 && request.rows_per_message == 0) {
    // A round of messages, one on each lane, holds what one message would, so that each fits in
    // its socket's buffers and every lane keeps moving while the server reads the others in turn.
    rows_per_message = (rows_per_message + lanes - 1) / lanes;
  }
  ASSIGN_OR_RETURN(const DType grad_dtype, GradHiddenDType(request));
  const absl::Time deadline = options_.deadline == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + options_.deadline;
  const bool into_caller = request.grad_hidden_out != nullptr && request.outputs.grad_hidden();
  ASSIGN_OR_RETURN(std::unique_ptr<SharedBuffer> lending,
                   GradHiddenLendingBuffer(request, grad_dtype, *shared_buffers_));
  // Made afresh for each try: a call repeated on a fresh connection starts from nothing.
  std::unique_ptr<ResultAssembler> assembler;
  absl::Status made = absl::OkStatus();
  const auto fresh_assembler = [&]() {
    result = ComputeResult();
    absl::StatusOr<PerTokenAssembler> per_token =
        PerTokenAssembler::Create(request.outputs, request.hidden.rows, &result.per_token);
    if (!per_token.ok()) {
      made = per_token.status();
      return;
    }
    assembler = std::make_unique<ResultAssembler>(
        request, grad_dtype, *std::move(per_token), result, /*grad_hidden_in_messages=*/true,
        /*keep_grad_hidden=*/into_caller, lending != nullptr ? lending->data() : nullptr);
  };
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  bool unusable = false;
  const absl::Status called = socket.Call(
      [&] {
        fresh_assembler();
        bytes_sent = 0;
        bytes_received = 0;
      },
      [&](RequestSink& sink) {
        if (!made.ok()) return;
        SendRequestFrames(request, start_message, rows_per_message, /*copy_into=*/nullptr,
                          [&](const wire::ComputeRequestFrame& frame) {
                            ++result.messages_sent;
                            return sink.Send(frame);
                          });
      },
      [&](wire::ComputeResponseFrame& response) -> absl::Status {
        RETURN_IF_ERROR(made);
        ++result.messages_received;
        return assembler->Add(response.message, response.grad_hidden);
      },
      [&](const v1::ComputeResult& piece, int64_t bytes) {
        return made.ok() ? assembler->GradHiddenPlace(piece, bytes) : nullptr;
      },
      deadline, &bytes_sent, &bytes_received, &unusable, lanes);
  // A socket the client chose by itself that cannot take the call (full, or out of reach): the
  // call, which never began there, goes over gRPC.
  const bool chosen_by_client =
      !request.compute_socket.has_value() && !options_.compute_socket.has_value();
  absl::Status finished = called;
  if (finished.ok()) finished = made;
  if (finished.ok()) finished = assembler->Finish();
  if (lending != nullptr && !finished.ok()) {
    // The reader is done with it: a failed call's dL/dh, never seen by the caller, is
    // overwritten by the buffer's next call.
    shared_buffers_->Release(std::move(lending));
  }
  if (unusable && chosen_by_client) {
    result = ComputeResult();
    return RunCompute(request, start_message, result);
  }
  RETURN_IF_ERROR(finished);
  result.transport = ComputeResult::Transport::kComputeSocket;
  result.bytes_sent = bytes_sent;
  result.bytes_received = bytes_received;
  if (into_caller) assembler->CopyKeptGradHidden(static_cast<uint8_t*>(request.grad_hidden_out));
  DeliverGradHidden(request, *shared_buffers_, std::move(lending), 0,
                    GradHiddenBytes(request, grad_dtype), result);
  return absl::OkStatus();
}

absl::Status Client::RunComputeShared(const ComputeRequest& request,
                                      v1::ComputeRequest& start_message,
                                      ComputeResult& result) const {
  const TensorView& hidden = request.hidden;
  const uint64_t hidden_bytes =
      static_cast<uint64_t>(hidden.rows) * hidden.cols * DTypeSize(hidden.dtype);
  ASSIGN_OR_RETURN(const DType grad_dtype, GradHiddenDType(request));
  ASSIGN_OR_RETURN(PerTokenAssembler per_token,
                   PerTokenAssembler::Create(request.outputs, hidden.rows, &result.per_token));
  const uint64_t grad_bytes = GradHiddenBytes(request, grad_dtype);
  constexpr uint64_t kAlignment = 64;  // the server's rule for both offsets
  ASSIGN_OR_RETURN(const std::shared_ptr<HandoverConnection> handover,
                   handover_->Get([this] { return AsHandoverSocket(SharedMemorySocket()); }));
  v1::SharedMemory& shared = *start_message.mutable_start()->mutable_shared_memory();
  // Rows in a shared region are read where they lie; others are copied into a pooled memfd,
  // which dL/dh shares. Held for the call, even if the caller's region goes meanwhile.
  uint64_t rows_offset = 0;
  std::shared_ptr<SharedBuffer> rows_region =
      shared_buffers_->FindRegion(hidden.data, hidden_bytes, rows_offset);
  if (rows_region != nullptr && rows_offset % kAlignment != 0) rows_region = nullptr;
  const uint64_t row_bytes = static_cast<uint64_t>(hidden.cols) * DTypeSize(hidden.dtype);
  // Rows that follow the start only where the server says the overlap pays, unless the call says.
  int64_t piece_rows = request.shared_rows_per_piece;
  if (piece_rows == 0) {
    piece_rows = handover->rows_follow_pays()
                     ? std::max<int64_t>(1, static_cast<int64_t>(kFollowingPieceBytes /
                                                                 std::max<uint64_t>(row_bytes, 1)))
                     : hidden.rows;
  }
  const uint64_t grad_offset =
      rows_region != nullptr ? 0 : (hidden_bytes + kAlignment - 1) / kAlignment * kAlignment;
  std::unique_ptr<SharedBuffer> buffer;  // pooled: the copied rows, dL/dh, or both
  if (rows_region == nullptr || grad_bytes > 0) {
    ASSIGN_OR_RETURN(buffer, shared_buffers_->Acquire(grad_offset + grad_bytes));
  }
  if (rows_region != nullptr) {
    ASSIGN_OR_RETURN(const std::string rows_handle, rows_region->HandleOn(handover));
    shared.set_handle(rows_handle);
    shared.set_hidden_offset(rows_offset);
    if (buffer != nullptr) {
      ASSIGN_OR_RETURN(const std::string grad_handle, buffer->HandleOn(handover));
      shared.set_grad_hidden_handle(grad_handle);
    }
  } else {
    ASSIGN_OR_RETURN(const std::string handle, buffer->HandleOn(handover));
    shared.set_handle(handle);
    shared.set_hidden_offset(0);
    // Rows of more than one piece are copied after the start, each piece announced once in
    // place, so that the server computes while the rest are copied.
    shared.set_rows_follow(piece_rows < hidden.rows);
    if (!shared.rows_follow()) CopyInParallel(buffer->data(), hidden.data, hidden_bytes);
  }
  shared.set_grad_hidden_offset(grad_offset);

  ResultAssembler assembler(request, grad_dtype, std::move(per_token), result,
                            /*grad_hidden_in_messages=*/false);
  grpc::ClientContext context;
  PrepareContext(context);
  // On the server the memfd was handed over to; the rows do not travel in messages, so the call
  // keeps to the client's own connection.
  std::unique_ptr<ComputeStream> stream = OpenCompute(*one_server_channel_, context);
  // The start message, then with rows_follow each piece of rows copied and announced; on a thread
  // of its own, so that results are read meanwhile. A failed call cancels the stream, which ends
  // the writer at its next Write, and is joined before the buffer is dropped.
  std::thread writer([&] {
    wire::ComputeRequestFrame start;
    start.message = start_message;
    if (!WriteFrame(*stream, start, result)) return;
    if (shared.rows_follow()) {
      wire::ComputeRequestFrame announcement;
      for (int64_t first = 0; first < hidden.rows; first += piece_rows) {
        const int64_t end = std::min(hidden.rows, first + piece_rows);
        CopyInParallel(buffer->data() + first * row_bytes,
                       static_cast<const uint8_t*>(hidden.data) + first * row_bytes,
                       (end - first) * row_bytes);
        announcement.message.mutable_chunk()->set_shared_rows(end);
        if (!WriteFrame(*stream, announcement, result)) return;
      }
    }
    stream->WritesDone();
  });
  const absl::Status assembled = ReadResults(context, *stream, assembler, result);
  writer.join();
  // A failed call drops the buffer instead of keeping it: a server still running a cancelled call
  // may yet write dL/dh into it, which must not land in the next call's.
  RETURN_IF_ERROR(FinishCall(*stream, assembled, assembler));
  DeliverGradHidden(request, *shared_buffers_, std::move(buffer), grad_offset, grad_bytes, result);
  return absl::OkStatus();
}

SharedRegion::SharedRegion(std::shared_ptr<SharedBuffer> buffer) : buffer_(std::move(buffer)) {}
uint8_t* SharedRegion::data() const { return buffer_->data(); }
uint64_t SharedRegion::size() const { return buffer_->size(); }

absl::StatusOr<SharedRegion> Client::NewSharedRegion(uint64_t bytes) const {
  ASSIGN_OR_RETURN(std::unique_ptr<SharedBuffer> created,
                   SharedBuffer::Create(bytes, "lossd-region"));
  std::shared_ptr<SharedBuffer> buffer = std::move(created);
  shared_buffers_->AddRegion(buffer);
  return SharedRegion(std::move(buffer));
}

}  // namespace lossd::client
