#include "server/service.h"

#include <algorithm>
#include <memory>
#include <new>
#include <utility>

#include <cfloat>
#include <cmath>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/storage/checkpoint.h"
#include "server/call/compute_reactor.h"
#include "server/call/proto_convert.h"
#include "server/shm/shared_memory.h"
#include "server/status/exception_status.h"
#include "server/status/grpc_status.h"

namespace lossd::server {
namespace {

// Room for `bytes` in `buffer`, or RESOURCE_EXHAUSTED naming the upload it was for: the one
// allocation a client sizes (up to --max_head_bytes), which may well fail on a smaller host.
absl::Status ReserveHostMemory(std::vector<uint8_t>& buffer, size_t bytes,
                               const v1::UploadHeadStart& start, absl::string_view dtype) {
  try {
    buffer.reserve(bytes);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "weight: the server cannot allocate ", bytes, " bytes of host memory for head '",
        start.head(), "' [", start.vocab_size(), ", ", start.hidden_size(), "] in ", dtype));
  }
  return absl::OkStatus();
}

}  // namespace

LossService::LossService(Backend& backend, HeadStore& heads, StagingRoom& staging_room,
                         Scheduler& scheduler, PendingMemory& pending, Metrics& metrics,
                         MemoryLedger& ledger, BufferCache& buffers, BufferCache& host_buffers,
                         ServiceOptions options)
    : backend_(backend),
      heads_(heads),
      scheduler_(scheduler),
      pending_(pending),
      metrics_(metrics),
      ledger_(ledger),
      buffers_(buffers),
      host_buffers_(host_buffers),
      options_(std::move(options)),
      staging_room_(staging_room),
      rendezvous_(options_.rendezvous),
      start_watch_(options_.compute.stream_idle, options_.compute.max_unstarted_streams) {
  replica_observer_.waited = [this](double seconds) { metrics_.ObserveReplicaWait(seconds); };
  replica_observer_.all_reduced = [this](double seconds, int64_t bytes) {
    metrics_.ObserveAllReduce(seconds, bytes);
  };
}

absl::Status LossService::Authenticate(const grpc::ServerContextBase& context) const {
  return CheckBearerToken(context, options_.bearer_token);
}

void LossService::StopAccepting() {
  {
    absl::MutexLock lock(&calls_mu_);
    accepting_ = false;
  }
  // A stream that has not even sent its start is not a call in flight: nothing to drain.
  start_watch_.EndAll(absl::UnavailableError("the server is shutting down and takes no new calls"));
}

bool LossService::WaitForCallsInFlight(absl::Time deadline) {
  absl::MutexLock lock(&calls_mu_);
  auto none_left = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return calls_in_flight_ == 0; };
  return calls_mu_.AwaitWithDeadline(absl::Condition(&none_left), deadline);
}

absl::Status LossService::device_fault() const {
  absl::MutexLock lock(&calls_mu_);
  return fault_kind_ == FaultKind::kDevice ? fault_ : absl::OkStatus();
}

absl::Status LossService::replica_failure() const {
  absl::MutexLock lock(&calls_mu_);
  return fault_kind_ == FaultKind::kReplicaGroup ? fault_ : absl::OkStatus();
}

void LossService::RefuseAfterFault(FaultKind kind, const absl::Status& fault) {
  {
    absl::MutexLock lock(&calls_mu_);
    if (fault_kind_ != FaultKind::kNone) return;  // calls running at the time meet the same fault
    fault_kind_ = kind;
    fault_ = fault;
    accepting_ = false;
  }
  // Ranks waiting for others at a step would wait for ranks that will not come.
  rendezvous_.FailWaiting(absl::AbortedError(
      absl::StrCat(fault.message(), "; nothing was applied. The server exits to be restarted")));
  if (options_.on_fault) options_.on_fault(fault);
}

void LossService::EndAfterReplicaFailure(const absl::Status& failure) {
  RefuseAfterFault(FaultKind::kReplicaGroup, failure);
}

absl::Status LossService::Refusal() const {
  if (fault_kind_ == FaultKind::kNone) {
    return absl::UnavailableError("the server is shutting down and takes no new calls");
  }
  // The fault's type (a device fault, say) goes with every refusal it causes.
  return WithPayloadsOf(
      absl::UnavailableError(absl::StrCat(fault_.message(),
                                          "; the server takes no new calls and exits once the "
                                          "calls in flight have drained, to be restarted")),
      fault_);
}

// One RPC from its start to its status, whatever ends it: counted in flight from construction
// (unless the service has stopped accepting calls), recorded by code and duration as it finishes,
// and no longer counted in flight on destruction.
class LossService::CallScope {
 public:
  CallScope(LossService& service, const char* method)
      : service_(service), method_(method), start_(absl::Now()) {
    absl::MutexLock lock(&service_.calls_mu_);
    if (!service_.accepting_) {
      status_ = service_.Refusal();
      return;
    }
    ++service_.calls_in_flight_;
    entered_ = true;
    service_.metrics_.AddInFlight(1);
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  ~CallScope() {
    Finishing(status_);
    if (!entered_) return;
    service_.metrics_.AddInFlight(-1);
    absl::MutexLock lock(&service_.calls_mu_);
    --service_.calls_in_flight_;
  }

  // False once the service stops accepting calls: status() then says so.
  bool entered() const { return entered_; }
  const absl::Status& status() const { return status_; }
  void set_status(absl::Status status) { status_ = std::move(status); }

  // Every status the call is ended with passes here before its client can hear it (a Compute call
  // may be ended more than once; its client hears the first): a device fault refuses every later
  // call first, so that no client learns of the fault from a server still taking calls.
  void Ending(const absl::Status& status) {
    if (IsDeviceFault(status)) service_.RefuseAfterFault(FaultKind::kDevice, status);
  }

  // Records the call by the status its client hears, once, before the client can hear it (a
  // synchronous call's scope closes first; a Compute call's thread goes on after, unwinding, and
  // stays counted in flight until it lets go of the scope).
  void Finishing(absl::Status status) {
    if (recorded_) return;
    recorded_ = true;
    status_ = std::move(status);
    service_.metrics_.RecordRequest(method_, GrpcCodeName(ToGrpcStatus(status_).error_code()),
                                    absl::ToDoubleSeconds(absl::Now() - start_));
  }

 private:
  LossService& service_;
  const char* const method_;
  const absl::Time start_;
  bool entered_ = false;
  bool recorded_ = false;
  absl::Status status_ = absl::InternalError("the call ended without a status");
};

template <typename Body>
grpc::Status LossService::Serve(const char* method, grpc::ServerContext* context, Body&& body) {
  CallScope call(*this, method);
  if (call.entered()) {
    absl::Status status = Authenticate(*context);
    if (status.ok()) status = CatchExceptions(method, body);
    call.Ending(status);
    call.set_status(std::move(status));
  }
  return ToGrpcStatus(call.status());
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* LossService::Compute(
    grpc::CallbackServerContext* context) {
  // Shared with the call's thread: whichever lets go last ends the call's scope.
  auto call = std::make_shared<CallScope>(*this, "Compute");
  absl::Status status = call->entered() ? Authenticate(*context) : call->status();
  if (status.ok()) {
    ComputeReactor* reactor = nullptr;
    status = CatchExceptions("Compute", [&]() -> absl::Status {
      ASSIGN_OR_RETURN(
          reactor,
          ComputeReactor::Start(
              context, options_.compute.stream_idle, call_threads_, start_watch_,
              [this](ComputeStream& stream) {
                return CatchExceptions("Compute", [&] { return RunCompute(stream); });
              },
              {.ending = [call](const absl::Status& status) { call->Ending(status); },
               .finishing = [call](const absl::Status& heard) { call->Finishing(heard); }}));
      return absl::OkStatus();
    });
    if (status.ok()) return reactor;
  }
  call->set_status(status);
  return ComputeReactor::Refuse(status);
}

void LossService::RunSocketCompute(SocketComputeStream& stream) {
  auto call = std::make_shared<CallScope>(*this, "Compute");
  if (!call->entered()) {
    stream.End(call->status());
    return;
  }
  stream.SetHooks({.ending = [call](const absl::Status& status) { call->Ending(status); },
                   .finishing = [call](const absl::Status& heard) { call->Finishing(heard); }});
  const absl::Status status = CatchExceptions("Compute", [&] { return RunCompute(stream); });
  stream.End(status);
  stream.SetHooks({});
}

absl::Status LossService::RunCompute(ComputeStream& stream) {
  const ComputeEnvironment env{&backend_, &heads_,        &scheduler_,     &metrics_,
                               &ledger_,  &buffers_,      &host_buffers_,  &shared_memory_maps_,
                               &pending_, &staging_room_, options_.compute};
  return RunComputeCall(env, stream);
}

grpc::Status LossService::ListHeads(grpc::ServerContext* context, const v1::ListHeadsRequest*,
                                    v1::ListHeadsResponse* response) {
  return Serve("ListHeads", context, [&] {
    for (const auto& head : heads_.List()) *response->add_heads() = ToProto(head->Summary());
    response->set_backend(backend_.Describe());
    return absl::OkStatus();
  });
}

grpc::Status LossService::GetHead(grpc::ServerContext* context, const v1::GetHeadRequest* request,
                                  v1::HeadInfo* response) {
  return Serve("GetHead", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    ASSIGN_OR_RETURN(const HeadSummary summary, head->SummaryWithDigest());
    *response = ToProto(summary);
    return absl::OkStatus();
  });
}

absl::StatusOr<v1::HeadInfo> LossService::ReceiveUpload(
    grpc::ServerReader<v1::UploadHeadRequest>* reader) {
  v1::UploadHeadRequest request;
  if (!reader->Read(&request) || !request.has_start()) {
    return InvalidField("start", "an UploadHeadStart as the first message", "none");
  }
  const v1::UploadHeadStart start = request.start();
  RETURN_IF_ERROR(storage::ValidateCheckpointHeadName(start.head()));
  if (start.vocab_size() <= 0 || start.hidden_size() <= 0) {
    return InvalidField("vocab_size/hidden_size", "positive sizes",
                        absl::StrCat(start.vocab_size(), " x ", start.hidden_size()));
  }
  ASSIGN_OR_RETURN(const DType wire_dtype, FromProto(start.dtype(), "dtype"));
  ASSIGN_OR_RETURN(const DType storage_dtype,
                   FromProto(start.storage_dtype(), "storage_dtype", DType::kFloat32));
  // Every call on the head that leaves its own cap unset takes this one.
  RETURN_IF_ERROR(ValidateSoftcap("logit_softcap", start.logit_softcap()));
  // Checked by division: the product of absurd declared sizes overflows int64 (2^32 x 2^32 is 0).
  const int64_t max_elements = options_.max_head_bytes / 4;
  if (start.vocab_size() > max_elements / start.hidden_size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("vocab_size x hidden_size: expected at most ", max_elements, " elements (",
                     options_.max_head_bytes, " bytes as float32), got ", start.vocab_size(), " x ",
                     start.hidden_size()));
  }
  auto existing = heads_.Get(start.head());
  if (existing.ok() && !start.replace()) {
    return absl::AlreadyExistsError(
        absl::StrCat("head: '", start.head(), "' exists; set replace to overwrite it"));
  }
  const size_t expected_bytes = start.vocab_size() * start.hidden_size() * DTypeSize(wire_dtype);
  std::vector<uint8_t> weight;
  RETURN_IF_ERROR(ReserveHostMemory(weight, expected_bytes, start, DTypeName(wire_dtype)));
  while (reader->Read(&request)) {
    if (request.has_start())
      return InvalidField("start", "exactly one UploadHeadStart, first", "a second one");
    const std::string& bytes = request.weight();
    if (weight.size() + bytes.size() > expected_bytes) {
      return InvalidField("weight",
                          absl::StrCat(expected_bytes, " bytes (vocab_size x hidden_size x ",
                                       DTypeSize(wire_dtype), ")"),
                          absl::StrCat("at least ", weight.size() + bytes.size()));
    }
    weight.insert(weight.end(), bytes.begin(), bytes.end());
    metrics_.AddBytesReceived(static_cast<int64_t>(bytes.size()));
  }
  if (weight.size() != expected_bytes) {
    return InvalidField("weight", absl::StrCat(expected_bytes, " bytes"),
                        absl::StrCat(weight.size(), " before the stream ended"));
  }
  // Head::Create and ReplaceWeight refuse a W that is not finite as stored.
  const std::string source = absl::StrCat("upload (", DTypeName(wire_dtype), ")");
  // The same kind of head is overwritten in place; another shape, dtype, tie or cap makes a new
  // one.
  if (existing.ok() && (*existing)->vocab_size() == start.vocab_size() &&
      (*existing)->hidden_size() == start.hidden_size() && (*existing)->dtype() == storage_dtype &&
      (*existing)->tied_embeddings() == start.tied_embeddings() &&
      (*existing)->logit_softcap() == start.logit_softcap()) {
    RETURN_IF_ERROR((*existing)->ReplaceWeight(weight, wire_dtype, source));
    return ToProto((*existing)->Summary());
  }
  HeadState state;
  state.head = start.head();
  state.vocab_size = start.vocab_size();
  state.hidden_size = start.hidden_size();
  state.weight_dtype = storage_dtype;
  state.version = existing.ok() ? (*existing)->version() + 1 : 1;
  state.weight = std::move(weight);
  state.tied_embeddings = start.tied_embeddings();
  state.logit_softcap = start.logit_softcap();
  if (wire_dtype != storage_dtype) {
    const size_t converted_bytes = state.vocab_size * state.hidden_size * DTypeSize(storage_dtype);
    std::vector<uint8_t> converted;
    RETURN_IF_ERROR(ReserveHostMemory(converted, converted_bytes, start, DTypeName(storage_dtype)));
    converted.resize(converted_bytes);  // within the reserved capacity
    for (int64_t i = 0; i < state.vocab_size * state.hidden_size; ++i) {
      StoreFromFloat(converted.data(), storage_dtype, i,
                     LoadAsFloat(state.weight.data(), wire_dtype, i));
    }
    state.weight = std::move(converted);
  }
  ASSIGN_OR_RETURN(auto head, Head::Create(backend_, ledger_, state, source));
  if (options_.resize_compute_budget) {
    options_.resize_compute_budget(state.vocab_size * state.hidden_size);
  }
  const absl::Status stored = heads_.Put(head, start.replace());
  if (options_.resize_compute_budget) options_.resize_compute_budget(0);
  RETURN_IF_ERROR(stored);
  return ToProto(head->Summary());
}

grpc::Status LossService::UploadHead(grpc::ServerContext* context,
                                     grpc::ServerReader<v1::UploadHeadRequest>* reader,
                                     v1::HeadInfo* response) {
  return Serve("UploadHead", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(*response, ReceiveUpload(reader));
    return absl::OkStatus();
  });
}

absl::StatusOr<int64_t> LossService::RowsPerChunk(int64_t max_chunk_bytes,
                                                  int64_t row_bytes) const {
  if (max_chunk_bytes < 0 || max_chunk_bytes > options_.max_fetch_chunk_bytes) {
    return InvalidField("max_chunk_bytes",
                        absl::StrCat("0 (default) to ", options_.max_fetch_chunk_bytes),
                        absl::StrCat(max_chunk_bytes));
  }
  const int64_t chunk_bytes =
      max_chunk_bytes > 0 ? max_chunk_bytes : options_.default_fetch_chunk_bytes;
  return std::max<int64_t>(1, chunk_bytes / row_bytes);
}

absl::Status LossService::StreamTensor(const v1::FetchTensorRequest& request, bool gradient,
                                       grpc::ServerWriter<v1::TensorChunk>* writer) {
  ASSIGN_OR_RETURN(auto head, heads_.Get(request.head()));
  ASSIGN_OR_RETURN(const DType dtype, FromProto(request.dtype(), "dtype", DType::kFloat32));
  const int64_t row_bytes = head->hidden_size() * static_cast<int64_t>(DTypeSize(dtype));
  ASSIGN_OR_RETURN(const int64_t rows_per_chunk,
                   RowsPerChunk(request.max_chunk_bytes(), row_bytes));
  if (gradient && request.master()) {
    return InvalidField("master", "false for FetchGradWeight (the gradient is fp32)", "true");
  }
  ASSIGN_OR_RETURN(const TensorSnapshot snapshot, gradient
                                                      ? head->ReadGradient(dtype)
                                                      : head->ReadWeight(dtype, request.master()));
  for (int64_t r0 = 0; r0 < head->vocab_size(); r0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, head->vocab_size() - r0);
    v1::TensorChunk chunk;
    chunk.set_row_offset(r0);
    chunk.set_num_rows(rows);
    chunk.set_vocab_size(head->vocab_size());
    chunk.set_hidden_size(head->hidden_size());
    chunk.set_dtype(ToProto(dtype));
    chunk.set_data(snapshot.data.data() + r0 * row_bytes, rows * row_bytes);
    chunk.set_head_version(snapshot.version);
    chunk.set_accumulated_tokens(snapshot.accumulated_tokens);
    if (!writer->Write(chunk)) return absl::CancelledError("client went away during the fetch");
    metrics_.AddBytesSent(rows * row_bytes);
  }
  return absl::OkStatus();
}

grpc::Status LossService::FetchWeight(grpc::ServerContext* context,
                                      const v1::FetchTensorRequest* request,
                                      grpc::ServerWriter<v1::TensorChunk>* writer) {
  return Serve("FetchWeight", context, [&] { return StreamTensor(*request, false, writer); });
}

grpc::Status LossService::FetchGradWeight(grpc::ServerContext* context,
                                          const v1::FetchTensorRequest* request,
                                          grpc::ServerWriter<v1::TensorChunk>* writer) {
  return Serve("FetchGradWeight", context, [&] { return StreamTensor(*request, true, writer); });
}

grpc::Status LossService::ZeroGradWeight(grpc::ServerContext* context,
                                         const v1::ZeroGradWeightRequest* request,
                                         v1::ZeroGradWeightResponse* response) {
  return Serve("ZeroGradWeight", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    RETURN_IF_ERROR(head->ZeroGradient());
    response->set_head_version(head->version());
    return absl::OkStatus();
  });
}

namespace {

// FNV-1a, 64 bits: the same for the same request in every process, as replicas compare it
// (absl::Hash is seeded per process).
uint64_t StableFingerprint(absl::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

// A multiplier of the accumulated gradient (StepRequest.grad_multiplier) that float32, where the
// optimizer applies it, can carry.
absl::StatusOr<double> GradMultiplier(bool has, double value) {
  if (!has) return 1.0;
  if (!(value >= 0.0 && value <= FLT_MAX)) {
    return InvalidField("grad_multiplier", "a value in [0, 3.40282e+38]", absl::StrCat(value));
  }
  return value;
}

}  // namespace

template <typename Response>
absl::Status LossService::Collectively(
    grpc::ServerContext& context, absl::string_view method, const std::string& head,
    const std::optional<uint64_t>& version, const v1::RankGroup& group,
    const google::protobuf::Message& request,
    absl::FunctionRef<absl::StatusOr<Response>(GradientExchange*)> action, Response* response) {
  if (group.world_size() < 0 || (group.world_size() <= 1 && group.rank() != 0)) {
    return InvalidField("ranks", "world_size >= 2 with a rank in [0, world_size), or none",
                        absl::StrCat("world_size ", group.world_size(), ", rank ", group.rank()));
  }
  ReplicaGroup* const replicas = options_.replicas;
  if (group.world_size() <= 1 && replicas == nullptr) {
    ASSIGN_OR_RETURN(*response, action(nullptr));
    return absl::OkStatus();
  }
  if (!version.has_value()) {
    return InvalidField("head_version",
                        replicas != nullptr
                            ? "the version the ranks trained on (a server of a replica group)"
                            : "the version the ranks trained on (ranks.world_size > 1)",
                        "none");
  }
  // Every rank sends the same request but for its rank.
  std::unique_ptr<google::protobuf::Message> shared(request.New());
  shared->CopyFrom(request);
  auto* ranks = shared->GetReflection()->MutableMessage(
      shared.get(), shared->GetDescriptor()->FindFieldByName("ranks"));
  static_cast<v1::RankGroup*>(ranks)->set_rank(0);
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  shared->SerializeToCodedStream(&coded);
  coded.Trim();
  const uint64_t fingerprint = StableFingerprint(bytes);
  const std::string key = absl::StrCat(method, " of head '", head, "' at version ", *version);
  // With replicas, a step of one local rank meets too: its outcome is kept for a retry, which
  // must not make the group step twice.
  ASSIGN_OR_RETURN(const std::string serialized,
                   rendezvous_.Join(
                       key, std::max(1, group.world_size()), group.rank(), fingerprint,
                       [&] { return context.IsCancelled(); },
                       [&]() -> absl::StatusOr<std::string> {
                         const absl::Time start = absl::Now();
                         absl::StatusOr<Response> outcome =
                             ActOverReplicas<Response>(replicas, key, fingerprint, action);
                         metrics_.ObserveStepSeconds(absl::ToDoubleSeconds(absl::Now() - start));
                         RETURN_IF_ERROR(outcome.status());
                         return outcome->SerializeAsString();
                       }));
  if (!response->ParseFromString(serialized)) {
    return absl::InternalError(absl::StrCat(key, ": the shared outcome does not parse"));
  }
  return absl::OkStatus();
}

template <typename Response>
absl::StatusOr<Response> LossService::ActOverReplicas(
    ReplicaGroup* replicas, const std::string& key, uint64_t fingerprint,
    absl::FunctionRef<absl::StatusOr<Response>(GradientExchange*)> action) {
  if (replicas == nullptr) return action(nullptr);
  absl::MutexLock lock(&replicas->operation_mutex());
  ReplicaExchange exchange(*replicas, key, fingerprint, &replica_observer_);
  RETURN_IF_ERROR(exchange.AwaitReplicas());
  absl::StatusOr<Response> outcome = action(&exchange);
  // Past the agreement every replica applies the same step: a replica that could not (its
  // device failed, memory ran out) holds another W than the others now, and leaves the group.
  // A non-finite norm is the same on every replica, which all refuse alike.
  if (!outcome.ok() && exchange.agreed() && !IsNonFiniteGradient(outcome.status())) {
    const absl::Status failure = absl::InternalError(absl::StrCat(
        key, ": replica ", replicas->rank(), " could not apply what the group agreed on (",
        outcome.status().message(), ")"));
    replicas->Fail(failure);
    return absl::AbortedError(
        absl::StrCat(failure.message(),
                     "; the replica group has ended: every replica restarts from the last "
                     "checkpoint, and the trainers resume from theirs"));
  }
  return outcome;
}

grpc::Status LossService::Step(grpc::ServerContext* context, const v1::StepRequest* request,
                               v1::StepResponse* response) {
  return Serve("Step", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    ASSIGN_OR_RETURN(const OptimizerConfig config, FromProto(*request));
    StepSettings settings;
    settings.max_grad_norm = request->max_grad_norm();
    settings.keep_grad = request->keep_grad();
    if (request->has_head_version()) settings.expected_version = request->head_version();
    ASSIGN_OR_RETURN(settings.grad_multiplier,
                     GradMultiplier(request->has_grad_multiplier(), request->grad_multiplier()));
    settings.skip_nonfinite = request->skip_nonfinite();
    return Collectively<v1::StepResponse>(
        *context, "Step", head->name(), settings.expected_version, request->ranks(), *request,
        [&](GradientExchange* exchange) -> absl::StatusOr<v1::StepResponse> {
          ASSIGN_OR_RETURN(const StepOutcome outcome, head->Step(config, settings, exchange));
          v1::StepResponse r;
          r.set_head_version(outcome.version);
          r.set_grad_norm(outcome.grad_norm);
          r.set_clip_multiplier(outcome.clip_multiplier);
          r.set_accumulated_tokens(outcome.accumulated_tokens);
          r.set_skipped(outcome.skipped);
          if (!outcome.skipped) metrics_.CountStep(head->name());
          return r;
        },
        response);
  });
}

grpc::Status LossService::GradWeightNorm(grpc::ServerContext* context,
                                         const v1::GradWeightNormRequest* request,
                                         v1::GradWeightNormResponse* response) {
  return Serve("GradWeightNorm", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    std::optional<uint64_t> version;
    if (request->has_head_version()) version = request->head_version();
    ASSIGN_OR_RETURN(const double multiplier,
                     GradMultiplier(request->has_grad_multiplier(), request->grad_multiplier()));
    return Collectively<v1::GradWeightNormResponse>(
        *context, "GradWeightNorm", head->name(), version, request->ranks(), *request,
        [&](GradientExchange* exchange) -> absl::StatusOr<v1::GradWeightNormResponse> {
          ASSIGN_OR_RETURN(const GradNorm norm, head->GradientNorm(version, multiplier, exchange));
          v1::GradWeightNormResponse r;
          r.set_head_version(norm.version);
          r.set_grad_norm(norm.norm);
          r.set_accumulated_tokens(norm.accumulated_tokens);
          r.set_accumulated_calls(norm.accumulated_calls);
          return r;
        },
        response);
  });
}

grpc::Status LossService::CommitGradWeight(grpc::ServerContext* context,
                                           const v1::CommitGradWeightRequest* request,
                                           v1::CommitGradWeightResponse* response) {
  return Serve("CommitGradWeight", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    const double scale = request->has_scale() ? request->scale() : 1.0;
    if (!std::isfinite(scale) || std::fabs(scale) > FLT_MAX) {
      return InvalidField("scale", "a finite value within float32's range", absl::StrCat(scale));
    }
    absl::StatusOr<CommitOutcome> outcome =
        head->CommitStaged(request->call_id(), scale, options_.compute.max_call_ids);
    if (!outcome.ok() && IsNonFiniteGradient(outcome.status())) metrics_.CountNonFiniteCall();
    RETURN_IF_ERROR(outcome.status());
    if (*outcome == CommitOutcome::kReplayed) metrics_.CountReplayedCall();
    const HeadSummary summary = head->Summary();
    response->set_head_version(summary.version);
    response->set_accumulated_tokens(summary.accumulated_tokens);
    response->set_replayed(*outcome == CommitOutcome::kReplayed);
    return absl::OkStatus();
  });
}

grpc::Status LossService::DiscardGradWeight(grpc::ServerContext* context,
                                            const v1::DiscardGradWeightRequest* request,
                                            v1::DiscardGradWeightResponse* response) {
  return Serve("DiscardGradWeight", context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
    const std::vector<std::string> ids(request->call_ids().begin(), request->call_ids().end());
    response->set_discarded(head->DiscardStaged(ids));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<Head>> LossService::TiedHead(
    const std::string& name, const google::protobuf::RepeatedField<int64_t>& ids) {
  ASSIGN_OR_RETURN(auto head, heads_.Get(name));
  if (!head->tied_embeddings()) {
    return absl::FailedPreconditionError(
        absl::StrCat("head: '", name,
                     "' is not tied to the model's input embedding (HeadInfo.tied_embeddings "
                     "is false): its rows are the output projection's only"));
  }
  const int64_t max_ids = options_.compute.max_tokens_per_call;
  if (ids.size() > max_ids) {
    return InvalidField("token_ids", absl::StrCat("at most ", max_ids, " ids"),
                        absl::StrCat(ids.size()));
  }
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= head->vocab_size()) {
      return InvalidField(absl::StrCat("token_ids[", i, "]"),
                          absl::StrCat("an id in [0, ", head->vocab_size(), ")"),
                          absl::StrCat(ids[i]));
    }
  }
  return head;
}

absl::Status LossService::StreamEmbeddingRows(const v1::LookupEmbeddingRequest& request,
                                              grpc::ServerWriter<v1::EmbeddingRows>* writer) {
  ASSIGN_OR_RETURN(auto head, TiedHead(request.head(), request.token_ids()));
  ASSIGN_OR_RETURN(const DType dtype, FromProto(request.dtype(), "dtype", DType::kFloat32));
  const int64_t row_bytes = head->hidden_size() * static_cast<int64_t>(DTypeSize(dtype));
  ASSIGN_OR_RETURN(const int64_t rows_per_chunk,
                   RowsPerChunk(request.max_chunk_bytes(), row_bytes));
  const uint64_t version = head->version();
  if (request.has_head_version() && request.head_version() != version) {
    return HeadMovedError("head_version", absl::StrCat("expected the head's current ", version,
                                                       ", got ", request.head_version()));
  }
  const absl::Span<const int64_t> ids(request.token_ids().data(), request.token_ids().size());
  std::string data;
  for (int64_t r0 = 0; r0 < static_cast<int64_t>(ids.size()); r0 += rows_per_chunk) {
    const int64_t rows = std::min<int64_t>(rows_per_chunk, ids.size() - r0);
    data.resize(rows * row_bytes);
    RETURN_IF_ERROR(head->ReadRows(version, ids.subspan(r0, rows), dtype,
                                   reinterpret_cast<uint8_t*>(data.data())));
    v1::EmbeddingRows chunk;
    chunk.set_row_offset(r0);
    chunk.set_num_rows(rows);
    chunk.set_hidden_size(head->hidden_size());
    chunk.set_dtype(ToProto(dtype));
    chunk.set_data(std::move(data));
    chunk.set_head_version(version);
    if (!writer->Write(chunk)) return absl::CancelledError("client went away during the lookup");
    metrics_.AddBytesSent(rows * row_bytes);
    data = std::move(*chunk.mutable_data());  // its buffer serves the next chunk
  }
  return absl::OkStatus();
}

absl::Status LossService::ReceiveEmbeddingGrad(
    grpc::ServerContext& context, grpc::ServerReader<v1::AccumulateEmbeddingGradRequest>* reader,
    v1::AccumulateEmbeddingGradResponse* response) {
  v1::AccumulateEmbeddingGradRequest request;
  if (!reader->Read(&request) || !request.has_start()) {
    return InvalidField("start", "an EmbeddingGradStart as the first message", "none");
  }
  const v1::EmbeddingGradStart start = request.start();
  ASSIGN_OR_RETURN(auto head, TiedHead(start.head(), start.token_ids()));
  if (start.hidden_size() != head->hidden_size()) {
    return InvalidField("hidden_size",
                        absl::StrCat(head->hidden_size(), " (head '", head->name(), "')"),
                        absl::StrCat(start.hidden_size()));
  }
  ASSIGN_OR_RETURN(const DType dtype, FromProto(start.dtype(), "dtype"));
  // One fp32 row per distinct id: the positions' rows are summed there as they arrive, so memory
  // follows the distinct ids (at most V rows), not what the client declares.
  const int64_t hidden = head->hidden_size();
  std::vector<int64_t> distinct(start.token_ids().begin(), start.token_ids().end());
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  std::vector<float> sums(distinct.size() * hidden, 0.0f);
  const int64_t num_rows = start.token_ids_size();
  const size_t row_bytes = hidden * DTypeSize(dtype);
  const size_t expected_bytes = num_rows * row_bytes;
  std::string pending;  // bytes of a row not yet complete
  int64_t row = 0;
  while (reader->Read(&request)) {
    if (request.has_start()) {
      return InvalidField("start", "exactly one EmbeddingGradStart, first", "a second one");
    }
    const std::string& bytes = request.grad();
    metrics_.AddBytesReceived(static_cast<int64_t>(bytes.size()));
    if (row * row_bytes + pending.size() + bytes.size() > expected_bytes) {
      return InvalidField(
          "grad",
          absl::StrCat(expected_bytes, " bytes (", num_rows, " ids x hidden_size ", hidden, " x ",
                       DTypeSize(dtype), ")"),
          absl::StrCat("at least ", row * row_bytes + pending.size() + bytes.size()));
    }
    pending.append(bytes);
    size_t offset = 0;
    for (; pending.size() - offset >= row_bytes; offset += row_bytes, ++row) {
      const auto* values = reinterpret_cast<const uint8_t*>(pending.data() + offset);
      const int64_t slot =
          std::lower_bound(distinct.begin(), distinct.end(), start.token_ids(row)) -
          distinct.begin();
      float* sum = sums.data() + slot * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        const float value = LoadAsFloat(values, dtype, j);
        if (!std::isfinite(value)) {
          return InvalidField(absl::StrCat("grad[", row, ", ", j, "]"), "a finite value",
                              absl::StrCat(value));
        }
        sum[j] += value;
      }
    }
    pending.erase(0, offset);
  }
  if (row != num_rows || !pending.empty()) {
    return InvalidField("grad", absl::StrCat(expected_bytes, " bytes"),
                        absl::StrCat(row * row_bytes + pending.size(), " before the stream ended"));
  }
  // The last point at which a cancelled call can still leave the accumulator untouched.
  if (context.IsCancelled()) return absl::CancelledError("call cancelled; nothing was accumulated");
  std::optional<uint64_t> pinned;
  if (start.has_head_version()) pinned = start.head_version();
  ASSIGN_OR_RETURN(const uint64_t version, head->AddGradientRows(pinned, distinct, sums));
  response->set_head_version(version);
  response->set_accumulated_rows(static_cast<int64_t>(distinct.size()));
  return absl::OkStatus();
}

grpc::Status LossService::LookupEmbedding(grpc::ServerContext* context,
                                          const v1::LookupEmbeddingRequest* request,
                                          grpc::ServerWriter<v1::EmbeddingRows>* writer) {
  return Serve("LookupEmbedding", context, [&] { return StreamEmbeddingRows(*request, writer); });
}

grpc::Status LossService::AccumulateEmbeddingGrad(
    grpc::ServerContext* context, grpc::ServerReader<v1::AccumulateEmbeddingGradRequest>* reader,
    v1::AccumulateEmbeddingGradResponse* response) {
  return Serve("AccumulateEmbeddingGrad", context,
               [&] { return ReceiveEmbeddingGrad(*context, reader, response); });
}

grpc::Status LossService::SaveCheckpoint(grpc::ServerContext* context,
                                         const v1::SaveCheckpointRequest* request,
                                         v1::SaveCheckpointResponse* response) {
  return Serve("SaveCheckpoint", context, [&]() -> absl::Status {
    if (options_.replicas != nullptr && options_.replicas->rank() != 0) {
      // The replicas hold the same heads; one writer keeps the directory they resume from whole.
      return absl::FailedPreconditionError(
          absl::StrCat("SaveCheckpoint: this server is replica ", options_.replicas->rank(), " of ",
                       options_.replicas->replicas(),
                       "; replica 0 (the server of trainer rank 0) saves the "
                       "group's checkpoints"));
    }
    if (options_.checkpoint_dir.empty()) {
      return absl::FailedPreconditionError(
          "checkpoint_dir: the server was started without --checkpoint_dir");
    }
    std::vector<std::shared_ptr<Head>> targets;
    if (request->head().empty()) {
      targets = heads_.List();
    } else {
      ASSIGN_OR_RETURN(auto head, heads_.Get(request->head()));
      targets.push_back(std::move(head));
    }
    for (const auto& head : targets) {
      ASSIGN_OR_RETURN(const HeadState state, head->ExportState());
      ASSIGN_OR_RETURN(std::string path, storage::SaveCheckpoint(options_.checkpoint_dir, state,
                                                                 options_.keep_checkpoints));
      response->add_paths(std::move(path));
    }
    return absl::OkStatus();
  });
}

absl::Status LossService::OpenSharedMemorySocket() {
  ASSIGN_OR_RETURN(handover_socket_, HandoverSocket::Open(shared_memory_maps_));
  return absl::OkStatus();
}

void LossService::CloseSharedMemorySocket() { handover_socket_.reset(); }

absl::Status LossService::OpenComputeSocket(const std::string& address,
                                            ComputeSocketLimits limits) {
  ComputeSocketServer::Options socket_options{
      .bearer_token = options_.bearer_token,
      .max_message_bytes = options_.max_message_bytes,
      .stream_idle = options_.compute.stream_idle,
      .connection_idle = limits.idle,
      .max_connections = limits.max_connections,
      .max_connections_per_host = limits.max_connections_per_host,
      .max_flow_bytes_per_second = limits.max_flow_bytes_per_second,
  };
  ASSIGN_OR_RETURN(compute_socket_, ComputeSocketServer::Start(address, std::move(socket_options),
                                                               [this](SocketComputeStream& stream) {
                                                                 RunSocketCompute(stream);
                                                               }));
  return absl::OkStatus();
}

void LossService::StopComputeSocket() {
  if (compute_socket_ != nullptr) compute_socket_->Stop();
}

void LossService::CloseComputeSocket() {
  if (compute_socket_ != nullptr) compute_socket_->Close();
}

grpc::Status LossService::GetComputeSocket(grpc::ServerContext* context,
                                           const v1::GetComputeSocketRequest*,
                                           v1::ComputeSocket* response) {
  return Serve("GetComputeSocket", context, [&]() -> absl::Status {
    if (compute_socket_ == nullptr) {
      return absl::FailedPreconditionError(
          "compute_socket: this server offers none (lossd_server --compute_socket_listen); send "
          "Compute calls over gRPC");
    }
    response->set_port(compute_socket_->port());
    return absl::OkStatus();
  });
}

grpc::Status LossService::GetSharedMemorySocket(grpc::ServerContext* context,
                                                const v1::GetSharedMemorySocketRequest*,
                                                v1::SharedMemorySocket* response) {
  return Serve("GetSharedMemorySocket", context, [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckSharedMemoryOffered(
        options_.compute.allow_shared_memory && handover_socket_ != nullptr,
        IsLocalPeer(context->peer())));
    response->set_abstract_name(handover_socket_->abstract_name());
    response->set_rows_follow_pays(!backend_.ComputesOnHostCores());
    return absl::OkStatus();
  });
}

}  // namespace lossd::server
