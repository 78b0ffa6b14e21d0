// A running lossd server: backend, heads, scheduler, gRPC service and metrics endpoint, wired
// from one configuration. main() and the end-to-end tests both start servers through this.
#ifndef LOSSD_SERVER_SERVER_H_
#define LOSSD_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server.h>
#include <prometheus/exposer.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "lossd/kernels/backend.h"
#include "server/heads/head_store.h"
#include "server/memory/buffer_cache.h"
#include "server/memory/memory_ledger.h"
#include "server/memory/scheduler.h"
#include "server/metrics.h"
#include "server/replicas/replica_group.h"
#include "server/service.h"

namespace lossd::server {

struct DemoHeadConfig {
  std::string name = "demo";
  int64_t vocab_size = 32000;
  int64_t hidden_size = 512;
  uint64_t seed = 0;
};

struct ServerConfig {
  std::string listen_address = "127.0.0.1:50051";  // port 0 picks a free port
  std::string metrics_address = "127.0.0.1:9464";  // empty: no /metrics endpoint
  std::string device = "auto";                     // auto, cpu, cuda, cuda:N
  int64_t workspace_budget_bytes = 0;              // per call; 0: Backend::DefaultWorkspaceBudget
  // 0: room for max_running_calls training calls on the largest head, following the heads served
  int64_t compute_memory_bytes = 0;
  int max_running_calls = 2;
  int max_queued_calls = 64;
  // Host memory that Compute calls not yet admitted may hold together.
  int64_t pending_memory_bytes = int64_t{2} << 30;
  // Of that, what the calls of one client connection may hold together; 0: half of it.
  int64_t pending_memory_per_connection_bytes = 0;
  // How long a call waits for its client's next chunk of rows (or end of stream, or reading of
  // results) before it is ended.
  absl::Duration stream_idle = absl::Seconds(60);
  // Compute streams that may wait for their start message at once; more are refused with
  // RESOURCE_EXHAUSTED. Each costs a little memory and no thread.
  int64_t max_unstarted_streams = 1024;
  bool cache_call_buffers = true;  // keep call buffers between calls
  // Host memory kept for the next call: rows from messages and the dL/dh going out in them.
  int64_t host_cache_bytes = int64_t{1} << 30;
  bool shared_memory = true;  // rows in memfds from clients on this host
  // HOST:PORT of the Compute socket (ComputeSocket in lossd.proto); empty: none. Not with TLS.
  std::string compute_socket_listen;
  // How long a Compute socket connection may wait for its next call before it is closed.
  absl::Duration compute_socket_idle = absl::Minutes(5);
  // Connections the Compute socket holds at once (each a thread), and of those from one host.
  int compute_socket_max_connections = 256;
  int compute_socket_max_connections_per_host = 64;
  // Bytes per second each connection sends at most (SO_MAX_PACING_RATE); 0: no limit.
  int64_t compute_socket_max_flow_bytes_per_second = 0;
  int64_t max_call_ids = 65536;  // per head and accumulator epoch
  // ComputeStart.stage_grad_weight: how long a staged dL/dW waits for its commit, and the device
  // memory all staged dL/dW may hold together (0: room for 8 of the largest head's).
  absl::Duration staged_grad_ttl = absl::Seconds(300);
  int64_t staged_grad_bytes = 0;
  // How long the ranks of a collective Step wait for the last of them (StepRequest.ranks).
  absl::Duration step_wait = absl::Seconds(300);
  int64_t max_message_bytes = 256 << 20;
  // Zero: unlimited. Else the server closes each client connection after about this long (gRPC
  // GOAWAY; calls in flight finish), so that clients balancing over replicas resolve the Service
  // again and spread onto replicas added since they connected.
  absl::Duration max_connection_age = absl::ZeroDuration();
  std::string token_file;  // bearer token, first line
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string checkpoint_dir;  // resume from and save to
  int keep_checkpoints = 3;
  // "NAME=PATH" or "NAME=PATH#TENSOR": a head from a Hugging Face checkpoint, PATH a model
  // directory, a sharded checkpoint's index or a safetensors file (lossd/storage/hf_checkpoint.h
  // says which tensor is taken and what config.json decides).
  std::vector<std::string> heads;
  DType head_dtype = DType::kFloat32;  // storage dtype of heads loaded from files
  DemoHeadConfig demo;                 // served when no other head is configured
  // A replica group (--replicas > 1) trains its heads together: see replica_group.h.
  int replicas = 1;
  int replica_rank = 0;                                // -1: the ordinal that ends the hostname
  std::string replica_store;                           // HOST:PORT of replica 0's gRPC port
  absl::Duration replica_join = absl::Minutes(10);     // forming the group at startup
  absl::Duration replica_timeout = absl::Seconds(60);  // a collective once all replicas are in

  // Every setting checked against what it may be, naming its flag, before anything is opened or
  // loaded: addresses, sizes, counts, durations, the --heads specs, the demo head's shape and the
  // flags that go together. Files (token, certificate, heads) are read, and checked, by Start.
  absl::Status Validate() const;
};

class LossServer {
 public:
  // Loads heads, binds the ports and starts serving. `backend` overrides config.device.
  static absl::StatusOr<std::unique_ptr<LossServer>> Start(
      const ServerConfig& config, std::unique_ptr<Backend> backend = nullptr);
  ~LossServer();

  int port() const { return port_; }
  int metrics_port() const;
  // Stops accepting calls, lets in-flight calls finish up to `drain`, then cancels the rest.
  void Shutdown(absl::Duration drain);

  // OK, or the device fault a call met (IsDeviceFault). From the fault on, health checks report
  // NOT_SERVING and every call is refused with UNAVAILABLE naming it: the owner should then
  // Shutdown() and end the process with a failure status, so that its supervisor restarts it on
  // a working device.
  absl::Status device_fault() const;
  // OK, or why this server's replica group ended (see replica_group.h): from then on health
  // reports NOT_SERVING and every call is refused with UNAVAILABLE naming it; the owner should
  // Shutdown() and exit with a status of its own, so that the group restarts from its last
  // checkpoint.
  absl::Status replica_failure() const;
  // The rank of this server in its replica group and the group's size (0 of 1 alone).
  int replica_rank() const { return replicas_ == nullptr ? 0 : replicas_->rank(); }
  int replicas() const { return replicas_ == nullptr ? 1 : replicas_->replicas(); }

  Backend& backend() { return *backend_; }
  HeadStore& heads() { return heads_; }
  MemoryLedger& ledger() { return ledger_; }
  Metrics& metrics() { return metrics_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  const PendingMemory& pending_memory() const { return *pending_; }
  BufferCache& buffers() { return *buffers_; }
  SharedMemoryMaps& shared_memory_maps() { return service_->shared_memory_maps(); }
  const std::vector<std::string>& startup_log() const { return startup_log_; }

 private:
  explicit LossServer(const ServerConfig& config) : config_(config) {}
  absl::Status LoadHeads(const ServerConfig& config);
  // Device memory admitted calls may hold together: --compute_memory_mib, or with 0 room for
  // max_running_calls training calls (workspace budget + V x H fp32 staging dL/dW) on the largest
  // of the heads served and of a head of `incoming_head_elements` about to be.
  int64_t ComputeBudget(int64_t incoming_head_elements) const;
  // The fp32 gradient of the largest of the heads served and of one of `incoming_head_elements`.
  int64_t LargestGradientBytes(int64_t incoming_head_elements) const;
  // --staged_grad_mib, or with 0 room for 8 staged dL/dW of the largest head.
  int64_t StagedGradBudget(int64_t incoming_head_elements) const;
  void ResizeComputeBudget(int64_t incoming_head_elements);
  std::vector<GaugeSample> ReadState() const;

  ServerConfig config_;  // workspace_budget_bytes resolved against the backend
  std::unique_ptr<Backend> backend_;
  MemoryLedger ledger_;
  // Before heads_, which it outlives: staged dL/dW give their room back to it as they go.
  StagingRoom staging_room_{0};
  HeadStore heads_;
  Metrics metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<PendingMemory> pending_;
  std::unique_ptr<BufferCache> buffers_;
  // Host memory of calls' rows and dL/dh in messages, the backend's host buffers (page-locked on
  // a GPU, so that dL/dh comes back into them without staging): kWorkspace while a call holds
  // it, kCache idle.
  MemoryLedger host_ledger_;
  std::unique_ptr<BufferCache> host_buffers_;
  std::unique_ptr<ReplicaGroup> replicas_;  // null alone; outlives the service, which uses it
  std::unique_ptr<LossService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  bool shut_down_ = false;
  // Drops staged gradients past their deadline, about once a second, until Shutdown.
  std::unique_ptr<std::thread> staged_sweeper_;
  absl::Notification stop_sweeping_;
  std::vector<std::string> startup_log_;
};

absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SERVER_H_
