// The replicas of a training group (lossd_server --replicas=R --replica_rank=i): R servers that
// serve one training head together. Each takes a share of the trainer ranks and accumulates
// their gradients; every Step and GradWeightNorm is collective across the replicas, which sum
// their gradients (and token counts) over Gloo before every replica applies the same update, so
// that W stays bitwise the same on all of them.
//
// Rendezvous. Replica 0 serves lossd.internal.v1.ReplicaGroup on its gRPC port (beside
// LossService, behind the same bearer token): a store through which the replicas' Gloo
// transports exchange addresses, as torch's TCPStore serves Gloo, so that a Kubernetes
// StatefulSet needs no shared volume to meet. The others dial --replica_store (replica 0's
// address) until it answers.
//
// Membership and faults. Every other replica holds a Join stream to replica 0 for as long as it
// lives. A replica that goes (exits, is killed, stalls past gRPC's keepalive, or restarts) ends
// the stream, and replica 0 ends the group for all; a collective that fails or times out ends it
// too. A replica whose group ended refuses every call (health NOT_SERVING), fails the steps in
// flight with ABORTED, drains and exits with its own status, so that its supervisor restarts the
// whole group from the last checkpoint: the accumulated gradients are lost with the group, and
// the trainers resume from their checkpoint of the same step.
#ifndef LOSSD_SERVER_REPLICAS_REPLICA_GROUP_H_
#define LOSSD_SERVER_REPLICAS_REPLICA_GROUP_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/internal/v1/replica_group.grpc.pb.h"
#include "server/heads/head_store.h"
#include "server/replicas/collective.h"

namespace lossd::server {

struct ReplicaGroupOptions {
  int replicas = 1;
  int rank = 0;
  // HOST:PORT of replica 0's gRPC port (every replica, replica 0 too: the Gloo transport listens
  // on this host's address that reaches it).
  std::string store_address;
  std::string bearer_token;  // presented to replica 0, and asked of the others by it
  bool tls = false;          // replica 0 serves TLS (its --tls_cert_file)
  // Forming the group at startup, from the first try to reach replica 0 to every replica
  // connected.
  absl::Duration join_timeout = absl::Minutes(10);
  // Each collective operation once every replica has reached it (the exchange of a gradient).
  absl::Duration timeout = absl::Seconds(60);
  // Waiting for the other replicas' ranks to reach a step (--step_wait_seconds).
  absl::Duration step_wait = absl::Seconds(300);
};

// The ordinal at the end of a StatefulSet pod's hostname ("lossd-train-2" is 2).
absl::StatusOr<int> ReplicaRankFromHostname(const std::string& hostname);

// This host's address that reaches `address` (HOST:PORT): the interface the replicas' Gloo
// transport listens on.
absl::StatusOr<std::string> LocalAddressTowards(const std::string& address);

// Keys and values in memory, read with waiting: the group's rendezvous, served by replica 0.
class RendezvousStore {
 public:
  void Set(const std::string& key, std::string value);
  // The values of `keys` once all are set; DEADLINE_EXCEEDED at `deadline`, CANCELLED once
  // `cancelled()` (polled) says so.
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Time deadline,
                                               const std::function<bool()>& cancelled);

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

class ReplicaGroup {
 public:
  // Checks the options; nothing is dialed or served yet.
  static absl::StatusOr<std::unique_ptr<ReplicaGroup>> Create(ReplicaGroupOptions options);
  // Called once, from whichever thread saw it, when the group ends (not when this replica shuts
  // it down). Set before the gRPC server starts.
  void SetFailureHandler(std::function<void(const absl::Status&)> on_failure) {
    on_failure_ = std::move(on_failure);
  }
  ~ReplicaGroup();

  int rank() const { return options_.rank; }
  int replicas() const { return options_.replicas; }
  const ReplicaGroupOptions& options() const { return options_; }

  // Replica 0's service, to register on its gRPC server before it starts; null on the others.
  grpc::Service* service();

  // Meets the other replicas and connects the collective; blocks until all have, the group
  // fails, or join_timeout. Call once this replica's gRPC server listens.
  absl::Status Form();

  // The collective, once Form has succeeded (UNAVAILABLE before).
  absl::StatusOr<Collective*> collective();

  // Ends the group for every replica, naming why (the first reason stays).
  void Fail(const absl::Status& why);
  // OK while the group holds, else why it ended.
  absl::Status failure() const;
  // This replica leaves without failing the group itself: its streams end (the others then see
  // the group end). Before the gRPC server shuts down.
  void Shutdown();

  // Collective steps and norms run one at a time, in the order every replica sees them.
  absl::Mutex& operation_mutex() { return operation_mu_; }
  // Returns once every replica has reached its next collective operation (under
  // operation_mutex()), or DEADLINE_EXCEEDED naming those that did not within `wait`, or why the
  // group ended meanwhile. The wait goes through replica 0, which the group's end interrupts.
  absl::Status AwaitReplicas(absl::Duration wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(operation_mu_);

 private:
  class Service;
  class RemoteStore;
  explicit ReplicaGroup(ReplicaGroupOptions options);
  // Replica 0: the others' Join streams, from their first message to the end of the group.
  grpc::Status ServeJoin(grpc::ServerContext& context, const internal::v1::JoinRequest& request,
                         grpc::ServerWriter<internal::v1::JoinResponse>& writer);
  absl::Status CheckToken(const grpc::ServerContext& context) const;
  // Replica 0: `rank` has reached operation `sequence`; waits up to `deadline` for the others.
  absl::Status Arrive(int rank, uint64_t sequence, absl::Time deadline,
                      const std::function<bool()>& cancelled);
  // The other replicas: dial replica 0 until it takes this one in; then watch the stream.
  absl::Status JoinReplicaZero(absl::Time deadline);
  void WatchMembership();
  std::shared_ptr<grpc::Channel> ChannelToReplicaZero() const;
  // The bearer token on a call to replica 0.
  void Authorize(grpc::ClientContext& context) const;

  const ReplicaGroupOptions options_;
  std::function<void(const absl::Status&)> on_failure_;
  std::unique_ptr<Service> service_;
  RendezvousStore store_;  // replica 0's
  uint64_t session_ = 0;   // replica 0's random id of this group, the store's key prefix

  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<bool> joined_ ABSL_GUARDED_BY(mu_);       // replica 0: by rank
  std::vector<uint64_t> arrived_ ABSL_GUARDED_BY(mu_);  // replica 0: the last operation, by rank
  int joined_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool formed_ ABSL_GUARDED_BY(mu_) = false;

  // The other replicas: their Join stream and the thread that reads it.
  std::unique_ptr<grpc::ClientContext> join_context_;
  std::unique_ptr<grpc::ClientReader<internal::v1::JoinResponse>> join_reader_;
  std::unique_ptr<std::thread> watcher_;

  std::unique_ptr<Collective> collective_ ABSL_GUARDED_BY(mu_);
  absl::Mutex operation_mu_;
  uint64_t operations_ ABSL_GUARDED_BY(operation_mu_) = 0;
  // The other replicas: Arrive calls to replica 0.
  std::unique_ptr<internal::v1::ReplicaGroup::Stub> arrive_stub_;
};

// What the group's metrics record of its collectives.
struct ReplicaObserver {
  std::function<void(double seconds)> waited;  // for the other replicas to reach a step
  std::function<void(double seconds, int64_t bytes)> all_reduced;  // a gradient's all-reduce
};

// The GradientExchange of one collective step or norm over a formed group: Agree compares what
// every replica's head and request say (`request_fingerprint`: the request without its ranks),
// Reduce sums the gradient and its counts, SumSquares adds up a share of the sum of squares on
// each replica. Failures of the collective end the group.
class ReplicaExchange final : public GradientExchange {
 public:
  ReplicaExchange(ReplicaGroup& group, std::string what, uint64_t request_fingerprint,
                  const ReplicaObserver* observer)
      : group_(group),
        what_(std::move(what)),
        fingerprint_(request_fingerprint),
        observer_(observer) {}

  // Waits for every replica to reach this step (up to the group's step_wait), before W is
  // locked; fails the group when one does not.
  absl::Status AwaitReplicas();
  absl::StatusOr<bool> Agree(uint64_t version, std::optional<uint64_t> weight_digest,
                             const absl::Status& refusal, bool kept) override;
  absl::Status Reduce(absl::Span<float> gradient, absl::Span<double> counts) override;
  absl::StatusOr<double> SumSquares(absl::Span<const float> gradient) override;

  // Whether the replicas agreed to go on: from then on every replica must apply the same step,
  // and one that cannot has left the others (the caller ends the group).
  bool agreed() const { return agreed_; }

 private:
  // A failed collective: the group ends, and the call hears ABORTED.
  absl::Status Failed(const absl::Status& status);
  // The group's collective, or why there is none to use.
  absl::StatusOr<Collective*> Connected();

  ReplicaGroup& group_;
  const std::string what_;
  const uint64_t fingerprint_;
  const ReplicaObserver* observer_;
  bool agreed_ = false;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_REPLICAS_REPLICA_GROUP_H_
