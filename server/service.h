// The gRPC face of lossd: lossd.v1.LossService over the head store, scheduler and engine.
#ifndef LOSSD_SERVER_SERVICE_H_
#define LOSSD_SERVER_SERVICE_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "lossd/v1/lossd.grpc.pb.h"
#include "server/call/compute_call.h"
#include "server/call/compute_reactor.h"
#include "server/heads/head_store.h"
#include "server/memory/buffer_cache.h"
#include "server/memory/memory_ledger.h"
#include "server/memory/scheduler.h"
#include "server/metrics.h"
#include "server/replicas/rank_rendezvous.h"
#include "server/replicas/replica_group.h"
#include "server/shm/handover_socket.h"
#include "server/socket/compute_socket.h"

namespace lossd::server {

struct ServiceOptions {
  ComputeLimits compute;
  int64_t max_head_bytes = int64_t{16} << 30;  // refuses uploads that declare more
  int64_t default_fetch_chunk_bytes = 4 << 20;
  int64_t max_fetch_chunk_bytes = 64 << 20;
  std::string bearer_token;               // empty: no authentication
  int64_t max_message_bytes = 256 << 20;  // gRPC's limit, which the Compute socket keeps too
  std::string checkpoint_dir;             // empty: SaveCheckpoint is refused
  int keep_checkpoints = 3;
  // Called once, with the first device fault a call meets (IsDeviceFault) or the end of the
  // replica group, after which the service refuses every call.
  std::function<void(const absl::Status&)> on_fault;
  // Called with the V x H of a head about to be stored by an upload, then with 0 once it is, so
  // that the compute budget can follow the heads (before: calls on the new head fit at once).
  std::function<void(int64_t incoming_head_elements)> resize_compute_budget;
  RendezvousOptions rendezvous;  // wait: --step_wait_seconds
  // The replicas this server trains its heads with (--replicas > 1): every Step and
  // GradWeightNorm is then collective across them. Null: this server alone.
  ReplicaGroup* replicas = nullptr;
};

// Compute runs on gRPC's callback API (see compute_reactor.h) with its messages' bytes as they
// arrive (proto/wire/compute_frames.h), the other methods on the synchronous one.
class LossService final
    : public v1::LossService::WithRawCallbackMethod_Compute<v1::LossService::Service> {
 public:
  // `staging_room` (staged dL/dW of every head) must outlive `heads`, whose staged gradients
  // give their room back to it when they go.
  LossService(Backend& backend, HeadStore& heads, StagingRoom& staging_room, Scheduler& scheduler,
              PendingMemory& pending, Metrics& metrics, MemoryLedger& ledger, BufferCache& buffers,
              BufferCache& host_buffers, ServiceOptions options);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Compute(
      grpc::CallbackServerContext* context) override;
  grpc::Status ListHeads(grpc::ServerContext* context, const v1::ListHeadsRequest* request,
                         v1::ListHeadsResponse* response) override;
  grpc::Status GetHead(grpc::ServerContext* context, const v1::GetHeadRequest* request,
                       v1::HeadInfo* response) override;
  grpc::Status UploadHead(grpc::ServerContext* context,
                          grpc::ServerReader<v1::UploadHeadRequest>* reader,
                          v1::HeadInfo* response) override;
  grpc::Status FetchWeight(grpc::ServerContext* context, const v1::FetchTensorRequest* request,
                           grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status FetchGradWeight(grpc::ServerContext* context, const v1::FetchTensorRequest* request,
                               grpc::ServerWriter<v1::TensorChunk>* writer) override;
  grpc::Status ZeroGradWeight(grpc::ServerContext* context,
                              const v1::ZeroGradWeightRequest* request,
                              v1::ZeroGradWeightResponse* response) override;
  grpc::Status Step(grpc::ServerContext* context, const v1::StepRequest* request,
                    v1::StepResponse* response) override;
  grpc::Status GradWeightNorm(grpc::ServerContext* context,
                              const v1::GradWeightNormRequest* request,
                              v1::GradWeightNormResponse* response) override;
  grpc::Status CommitGradWeight(grpc::ServerContext* context,
                                const v1::CommitGradWeightRequest* request,
                                v1::CommitGradWeightResponse* response) override;
  grpc::Status DiscardGradWeight(grpc::ServerContext* context,
                                 const v1::DiscardGradWeightRequest* request,
                                 v1::DiscardGradWeightResponse* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context,
                              const v1::SaveCheckpointRequest* request,
                              v1::SaveCheckpointResponse* response) override;
  grpc::Status GetSharedMemorySocket(grpc::ServerContext* context,
                                     const v1::GetSharedMemorySocketRequest* request,
                                     v1::SharedMemorySocket* response) override;

  // Shared memory's handover socket: opened before the service serves (when shared memory is
  // allowed), closed once no call runs any more, revoking every handle.
  absl::Status OpenSharedMemorySocket();
  void CloseSharedMemorySocket();
  grpc::Status GetComputeSocket(grpc::ServerContext* context,
                                const v1::GetComputeSocketRequest* request,
                                v1::ComputeSocket* response) override;
  // The Compute socket (ComputeSocket in lossd.proto): opened on `address` before the service
  // serves, when the server offers one; stopped once the calls have drained (its calls in flight
  // then end with UNAVAILABLE), and closed, its threads joined (it stays, closed, for the metrics
  // that read it until the service goes away).
  struct ComputeSocketLimits {
    absl::Duration idle;  // a connection's wait for its next call
    int max_connections = 256;
    int max_connections_per_host = 64;
    int64_t max_flow_bytes_per_second = 0;  // each connection's sending rate; 0: no limit
  };
  absl::Status OpenComputeSocket(const std::string& address, ComputeSocketLimits limits);
  void StopComputeSocket();
  void CloseComputeSocket();
  int compute_socket_port() const { return compute_socket_ ? compute_socket_->port() : 0; }
  int64_t compute_socket_connections() const {
    return compute_socket_ ? compute_socket_->connections() : 0;
  }
  grpc::Status LookupEmbedding(grpc::ServerContext* context,
                               const v1::LookupEmbeddingRequest* request,
                               grpc::ServerWriter<v1::EmbeddingRows>* writer) override;
  grpc::Status AccumulateEmbeddingGrad(
      grpc::ServerContext* context, grpc::ServerReader<v1::AccumulateEmbeddingGradRequest>* reader,
      v1::AccumulateEmbeddingGradResponse* response) override;

  // Shutdown, in two steps. StopAccepting: from now on every call is refused with UNAVAILABLE.
  // WaitForCallsInFlight: returns once the calls already running have ended (their status set,
  // their metrics recorded, nothing of the service in use any more), or at `deadline`; true when
  // none is left.
  void StopAccepting();
  bool WaitForCallsInFlight(absl::Time deadline);

  // OK, or the first device fault a call met; from then on every call is refused with UNAVAILABLE
  // naming it.
  absl::Status device_fault() const;
  // OK, or why the replica group ended (EndAfterReplicaFailure).
  absl::Status replica_failure() const;
  // The replica group has ended: from now on every call is refused with UNAVAILABLE naming why,
  // and the ranks waiting at a step hear ABORTED.
  void EndAfterReplicaFailure(const absl::Status& failure);

  SharedMemoryMaps& shared_memory_maps() { return shared_memory_maps_; }
  const RankRendezvous& rendezvous() const { return rendezvous_; }

 private:
  class CallScope;
  // Counts the call in flight, authenticates, runs `body`, and records its code and duration.
  template <typename Body>
  grpc::Status Serve(const char* method, grpc::ServerContext* context, Body&& body);
  absl::Status Authenticate(const grpc::ServerContextBase& context) const;
  // The Compute call on its own thread, once authenticated.
  absl::Status RunCompute(ComputeStream& stream);
  // A call from the Compute socket, whose connection was authenticated by its HELLO: counted,
  // run and recorded as a gRPC Compute call, on this thread.
  void RunSocketCompute(SocketComputeStream& stream);
  // Rows of row_bytes each per message of a streamed tensor: as many as max_chunk_bytes holds (0:
  // the server's default), at least one; INVALID_ARGUMENT past options.max_fetch_chunk_bytes.
  absl::StatusOr<int64_t> RowsPerChunk(int64_t max_chunk_bytes, int64_t row_bytes) const;
  absl::Status StreamTensor(const v1::FetchTensorRequest& request, bool gradient,
                            grpc::ServerWriter<v1::TensorChunk>* writer);
  absl::StatusOr<v1::HeadInfo> ReceiveUpload(grpc::ServerReader<v1::UploadHeadRequest>* reader);
  enum class FaultKind { kNone, kDevice, kReplicaGroup };
  void RefuseAfterFault(FaultKind kind, const absl::Status& fault);
  absl::Status Refusal() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_);
  absl::Status StreamEmbeddingRows(const v1::LookupEmbeddingRequest& request,
                                   grpc::ServerWriter<v1::EmbeddingRows>* writer);
  absl::Status ReceiveEmbeddingGrad(grpc::ServerContext& context,
                                    grpc::ServerReader<v1::AccumulateEmbeddingGradRequest>* reader,
                                    v1::AccumulateEmbeddingGradResponse* response);
  // A tied head named `head`, and token ids that index its rows.
  absl::StatusOr<std::shared_ptr<Head>> TiedHead(
      const std::string& head, const google::protobuf::RepeatedField<int64_t>& ids);
  // Runs `action` once for the ranks of `group` (RankRendezvous), or at once for a group of one
  // on a server alone; its result is the serialized response every rank returns. With replicas,
  // the action runs once the other replicas have reached the same step, with the exchange of
  // their gradients (null on a server alone).
  template <typename Response>
  absl::Status Collectively(grpc::ServerContext& context, absl::string_view method,
                            const std::string& head, const std::optional<uint64_t>& version,
                            const v1::RankGroup& group, const google::protobuf::Message& request,
                            absl::FunctionRef<absl::StatusOr<Response>(GradientExchange*)> action,
                            Response* response);
  // `action` over the replicas once all have reached it (see Collectively), or alone.
  template <typename Response>
  absl::StatusOr<Response> ActOverReplicas(
      ReplicaGroup* replicas, const std::string& key, uint64_t fingerprint,
      absl::FunctionRef<absl::StatusOr<Response>(GradientExchange*)> action);

  Backend& backend_;
  HeadStore& heads_;
  Scheduler& scheduler_;
  PendingMemory& pending_;
  Metrics& metrics_;
  MemoryLedger& ledger_;
  BufferCache& buffers_;
  BufferCache& host_buffers_;
  const ServiceOptions options_;
  SharedMemoryMaps shared_memory_maps_;
  StagingRoom& staging_room_;
  RankRendezvous rendezvous_;
  ReplicaObserver replica_observer_;                 // into metrics_
  std::unique_ptr<HandoverSocket> handover_socket_;  // registers into shared_memory_maps_

  mutable absl::Mutex calls_mu_;
  bool accepting_ ABSL_GUARDED_BY(calls_mu_) = true;
  FaultKind fault_kind_ ABSL_GUARDED_BY(calls_mu_) = FaultKind::kNone;
  absl::Status fault_ ABSL_GUARDED_BY(calls_mu_);
  int calls_in_flight_ ABSL_GUARDED_BY(calls_mu_) = 0;
  // Compute streams that have not sent their start message yet (no thread runs them).
  StartWatch start_watch_;
  // Its connections' threads run calls: joined before anything they use goes away.
  std::unique_ptr<ComputeSocketServer> compute_socket_;
  // Last: joined first, while what the calls' threads use is still there.
  CallThreads call_threads_;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SERVICE_H_
