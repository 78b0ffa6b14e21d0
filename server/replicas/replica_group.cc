#include "server/replicas/replica_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>

#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "lossd/common/status_macros.h"
#include "lossd/common/unique_fd.h"
#include "server/replicas/gloo_collective.h"
#include "server/status/grpc_status.h"

namespace lossd::server {
namespace {

using internal::v1::JoinRequest;
using internal::v1::JoinResponse;

// How often a waiting handler looks at its call, and how often a replica dials replica 0 again.
constexpr absl::Duration kPoll = absl::Milliseconds(100);
constexpr absl::Duration kRedial = absl::Milliseconds(500);
// gRPC keepalive on the replicas' streams: a replica that answers no ping for this long (a
// stopped process, a host gone from the network) has left the group.
constexpr int kKeepaliveMilliseconds = 10000;

// HOST:PORT or [HOST]:PORT.
bool SplitAddress(absl::string_view address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == address.size()) return false;
  absl::string_view host_part = address.substr(0, colon);
  if (absl::ConsumePrefix(&host_part, "[") && !absl::ConsumeSuffix(&host_part, "]")) return false;
  int number = 0;
  if (host_part.empty() || !absl::SimpleAtoi(address.substr(colon + 1), &number) || number <= 0 ||
      number > 65535) {
    return false;
  }
  *host = std::string(host_part);
  *port = std::string(address.substr(colon + 1));
  return true;
}

[[noreturn]] void ThrowForGloo(const absl::Status& status) {
  // Gloo's rendezvous reports a store's failure by exception; GlooCollective::Connect turns it
  // back into a status.
  throw std::runtime_error(std::string(status.message()));
}

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

absl::Duration FromChrono(std::chrono::milliseconds d) { return absl::Milliseconds(d.count()); }

// A gloo::rendezvous::Store whose reads wait until their keys are set, up to a timeout.
class WaitingGlooStore : public gloo::rendezvous::Store {
 public:
  explicit WaitingGlooStore(absl::Duration timeout) : timeout_(timeout) {}
  std::vector<char> get(const std::string& key) override {
    const std::string value = Wait({key}, timeout_).front();
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { Wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    Wait(keys, FromChrono(timeout));
  }

 protected:
  // The values of `keys` once every one is set; throws (for Gloo) past `timeout`.
  virtual std::vector<std::string> Wait(const std::vector<std::string>& keys,
                                        absl::Duration timeout) = 0;
  const absl::Duration timeout_;
};

// Replica 0's own view of its store, for its Gloo transport.
class LocalGlooStore final : public WaitingGlooStore {
 public:
  LocalGlooStore(RendezvousStore& store, absl::Duration timeout)
      : WaitingGlooStore(timeout), store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.Set(key, std::string(data.begin(), data.end()));
  }

 private:
  std::vector<std::string> Wait(const std::vector<std::string>& keys,
                                absl::Duration timeout) override {
    absl::StatusOr<std::vector<std::string>> values =
        store_.Get(keys, absl::Now() + timeout, [] { return false; });
    if (!values.ok()) ThrowForGloo(values.status());
    return *std::move(values);
  }

  RendezvousStore& store_;
};

}  // namespace

// The other replicas' view of replica 0's store, over gRPC.
class ReplicaGroup::RemoteStore final : public WaitingGlooStore {
 public:
  RemoteStore(const ReplicaGroup& group, absl::Duration timeout)
      : WaitingGlooStore(timeout),
        group_(group),
        stub_(internal::v1::ReplicaGroup::NewStub(group.ChannelToReplicaZero())) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    internal::v1::StoreSetRequest request;
    request.set_key(key);
    request.set_value(std::string(data.begin(), data.end()));
    internal::v1::StoreSetResponse response;
    grpc::ClientContext context;
    Prepare(context, timeout_);
    Check(stub_->StoreSet(&context, request, &response));
  }

 private:
  void Prepare(grpc::ClientContext& context, absl::Duration timeout) const {
    group_.Authorize(context);
    context.set_deadline(ToChrono(timeout + absl::Seconds(5)) + std::chrono::system_clock::now());
  }
  static void Check(const grpc::Status& status) {
    if (!status.ok()) {
      ThrowForGloo(
          absl::UnavailableError(absl::StrCat("the store of replica 0: ", status.error_message())));
    }
  }
  std::vector<std::string> Wait(const std::vector<std::string>& keys,
                                absl::Duration timeout) override {
    internal::v1::StoreGetRequest request;
    for (const std::string& key : keys) request.add_keys(key);
    request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    internal::v1::StoreGetResponse response;
    grpc::ClientContext context;
    Prepare(context, timeout);
    Check(stub_->StoreGet(&context, request, &response));
    return std::vector<std::string>(response.values().begin(), response.values().end());
  }

  const ReplicaGroup& group_;
  std::unique_ptr<internal::v1::ReplicaGroup::Stub> stub_;
};

class ReplicaGroup::Service final : public internal::v1::ReplicaGroup::Service {
 public:
  explicit Service(ReplicaGroup& group) : group_(group) {}

  grpc::Status StoreSet(grpc::ServerContext* context, const internal::v1::StoreSetRequest* request,
                        internal::v1::StoreSetResponse*) override {
    if (absl::Status token = group_.CheckToken(*context); !token.ok()) return ToGrpcStatus(token);
    group_.store_.Set(request->key(), request->value());
    return grpc::Status::OK;
  }

  grpc::Status StoreGet(grpc::ServerContext* context, const internal::v1::StoreGetRequest* request,
                        internal::v1::StoreGetResponse* response) override {
    if (absl::Status token = group_.CheckToken(*context); !token.ok()) return ToGrpcStatus(token);
    const absl::Duration timeout = std::clamp(absl::Milliseconds(request->timeout_ms()),
                                              absl::ZeroDuration(), group_.options_.join_timeout);
    absl::StatusOr<std::vector<std::string>> values =
        group_.store_.Get(std::vector<std::string>(request->keys().begin(), request->keys().end()),
                          absl::Now() + timeout, [context] { return context->IsCancelled(); });
    if (!values.ok()) return ToGrpcStatus(values.status());
    for (std::string& value : *values) response->add_values(std::move(value));
    return grpc::Status::OK;
  }

  grpc::Status Join(grpc::ServerContext* context, const JoinRequest* request,
                    grpc::ServerWriter<JoinResponse>* writer) override {
    return group_.ServeJoin(*context, *request, *writer);
  }

  grpc::Status Arrive(grpc::ServerContext* context, const internal::v1::ArriveRequest* request,
                      internal::v1::ArriveResponse*) override {
    if (absl::Status token = group_.CheckToken(*context); !token.ok()) return ToGrpcStatus(token);
    if (request->rank() < 1 || request->rank() >= group_.replicas()) {
      return ToGrpcStatus(InvalidField("rank", absl::StrCat("1 to ", group_.replicas() - 1),
                                       absl::StrCat(request->rank())));
    }
    const absl::Duration timeout = std::clamp(absl::Milliseconds(request->timeout_ms()),
                                              absl::ZeroDuration(), absl::Seconds(10));
    return ToGrpcStatus(group_.Arrive(request->rank(), request->sequence(), absl::Now() + timeout,
                                      [context] { return context->IsCancelled(); }));
  }

 private:
  ReplicaGroup& group_;
};

absl::StatusOr<int> ReplicaRankFromHostname(const std::string& hostname) {
  const size_t dash = hostname.rfind('-');
  int rank = -1;
  if (dash == std::string::npos || !absl::SimpleAtoi(hostname.substr(dash + 1), &rank) ||
      rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replica_rank: -1 takes the rank from the ordinal that ends the hostname (a "
                     "StatefulSet's pod NAME-N), but the hostname \"",
                     hostname, "\" does not end with -N; give the rank, 0 to --replicas - 1"));
  }
  return rank;
}

absl::StatusOr<std::string> LocalAddressTowards(const std::string& address) {
  std::string host, port;
  if (!SplitAddress(address, &host, &port)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--replica_store: expected HOST:PORT (replica 0's gRPC address), got \"", address, "\""));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::UnavailableError(
        absl::StrCat("--replica_store: cannot resolve ", host, ": ", gai_strerror(resolved)));
  }
  std::string local;
  int error = 0;
  for (const addrinfo* a = found; a != nullptr && local.empty(); a = a->ai_next) {
    // Connecting a UDP socket sends nothing: the kernel picks the route, and with it the
    // source address that reaches replica 0.
    UniqueFd fd(socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd.valid() || connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      error = errno;
      continue;
    }
    sockaddr_storage self{};
    socklen_t length = sizeof(self);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&self), &length) != 0) {
      error = errno;
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* where =
        self.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&self)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&self)->sin6_addr);
    if (inet_ntop(self.ss_family, where, text, sizeof(text)) != nullptr) local = text;
  }
  freeaddrinfo(found);
  if (local.empty()) {
    return absl::UnavailableError(absl::StrCat("--replica_store: no route from this host to ",
                                               address, ": ", std::strerror(error)));
  }
  return local;
}

void RendezvousStore::Set(const std::string& key, std::string value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::move(value);
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Get(
    const std::vector<std::string>& keys, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  auto all_set = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& key) { return values_.count(key) > 0; });
  };
  while (!all_set()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("replica group: the store has no value under ", keys.front(),
                       (keys.size() > 1 ? " (or another key asked with it)" : ""),
                       " in time: a replica did not come"));
    }
    if (cancelled()) return absl::CancelledError("replica group: the store's caller went away");
    mu_.AwaitWithDeadline(absl::Condition(&all_set), std::min(deadline, now + kPoll));
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) values.push_back(values_[key]);
  return values;
}

absl::StatusOr<std::unique_ptr<ReplicaGroup>> ReplicaGroup::Create(ReplicaGroupOptions options) {
  if (options.replicas < 2) {
    return InvalidField("--replicas", "2 or more for a replica group",
                        absl::StrCat(options.replicas));
  }
  if (options.rank < 0 || options.rank >= options.replicas) {
    return InvalidField(
        "--replica_rank",
        absl::StrCat("0 to ", options.replicas - 1, " (--replicas=", options.replicas, ")"),
        absl::StrCat(options.rank));
  }
  std::string host, port;
  if (!SplitAddress(options.store_address, &host, &port)) {
    return InvalidField("--replica_store", "HOST:PORT, replica 0's gRPC address (--replicas > 1)",
                        absl::StrCat("\"", options.store_address, "\""));
  }
  if (options.timeout <= absl::ZeroDuration() || options.join_timeout <= absl::ZeroDuration()) {
    return InvalidField("--replica_timeout_seconds", "a positive duration",
                        absl::FormatDuration(std::min(options.timeout, options.join_timeout)));
  }
  std::unique_ptr<ReplicaGroup> group(new ReplicaGroup(std::move(options)));
  if (group->rank() == 0) {
    group->service_ = std::make_unique<Service>(*group);
    group->session_ = std::random_device()() | (uint64_t{std::random_device()()} << 32);
    absl::MutexLock lock(&group->mu_);
    group->arrived_.assign(group->replicas(), 0);
    group->joined_.assign(group->replicas(), false);
    group->joined_[0] = true;
    group->joined_count_ = 1;
  }
  return group;
}

ReplicaGroup::ReplicaGroup(ReplicaGroupOptions options) : options_(std::move(options)) {}

ReplicaGroup::~ReplicaGroup() {
  Shutdown();
  if (watcher_ != nullptr) watcher_->join();
}

grpc::Service* ReplicaGroup::service() { return service_.get(); }

absl::Status ReplicaGroup::CheckToken(const grpc::ServerContext& context) const {
  return CheckBearerToken(context, options_.bearer_token);
}

void ReplicaGroup::Authorize(grpc::ClientContext& context) const {
  if (!options_.bearer_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
}

std::shared_ptr<grpc::Channel> ReplicaGroup::ChannelToReplicaZero() const {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMilliseconds);
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveMilliseconds);
  arguments.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Every try to join dials anew rather than waiting out gRPC's reconnection backoff.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      options_.tls ? grpc::SslCredentials(grpc::SslCredentialsOptions())
                   : grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(options_.store_address, credentials, arguments);
}

grpc::Status ReplicaGroup::ServeJoin(grpc::ServerContext& context, const JoinRequest& request,
                                     grpc::ServerWriter<JoinResponse>& writer) {
  if (absl::Status token = CheckToken(context); !token.ok()) return ToGrpcStatus(token);
  if (request.replicas() != options_.replicas) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "replicas: replica ", request.rank(), " was started with --replicas=", request.replicas(),
        ", replica 0 with --replicas=", options_.replicas, "; give every replica the same")));
  }
  const int rank = request.rank();
  if (rank < 1 || rank >= options_.replicas) {
    return ToGrpcStatus(
        InvalidField("rank", absl::StrCat("1 to ", options_.replicas - 1), absl::StrCat(rank)));
  }
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_ || !failure_.ok()) {
      return ToGrpcStatus(absl::UnavailableError(
          absl::StrCat("replica group: replica 0's group has ended (",
                       shutting_down_ ? "replica 0 is shutting down" : failure_.message(),
                       "); a new replica 0 forms the next")));
    }
  }
  bool taken = false;
  {
    absl::MutexLock lock(&mu_);
    if (!formed_ && !joined_[rank]) {
      joined_[rank] = true;
      ++joined_count_;
      taken = true;
    }
  }
  if (!taken) {
    // Its first process is gone (restarted) or another runs with its rank: either way the group
    // as it was cannot go on.
    const absl::Status why =
        absl::UnavailableError(absl::StrCat("replica group: replica ", rank,
                                            " joined again (it restarted, or two replicas run with "
                                            "--replica_rank=",
                                            rank, "): the group restarts"));
    Fail(why);
    return ToGrpcStatus(why);
  }
  JoinResponse welcome;
  welcome.set_session(session_);
  if (!writer.Write(welcome)) {
    Fail(absl::UnavailableError(
        absl::StrCat("replica group: replica ", rank, " went away while it joined")));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the replica went away");
  }
  absl::MutexLock lock(&mu_);
  auto ended = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutting_down_ || !failure_.ok(); };
  while (!ended() && !context.IsCancelled()) {
    mu_.AwaitWithTimeout(absl::Condition(&ended), kPoll);
  }
  if (!ended()) {
    mu_.Unlock();
    Fail(absl::UnavailableError(
        absl::StrCat("replica group: replica ", rank,
                     " left the group (its stream to replica 0 ended: it "
                     "exited, was killed or restarted, or stopped answering)")));
    mu_.Lock();
  }
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      shutting_down_ && failure_.ok() ? "replica group: replica 0 is shutting down"
                                                      : std::string(failure_.message()));
}

absl::Status ReplicaGroup::JoinReplicaZero(absl::Time deadline) {
  auto stub = internal::v1::ReplicaGroup::NewStub(ChannelToReplicaZero());
  JoinRequest request;
  request.set_rank(options_.rank);
  request.set_replicas(options_.replicas);
  std::string last;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (shutting_down_) return absl::CancelledError("replica group: shut down while joining");
    }
    auto context = std::make_unique<grpc::ClientContext>();
    Authorize(*context);
    auto reader = stub->Join(context.get(), request);
    JoinResponse welcome;
    if (reader->Read(&welcome)) {
      session_ = welcome.session();
      absl::MutexLock lock(&mu_);
      join_context_ = std::move(context);
      join_reader_ = std::move(reader);
      return absl::OkStatus();
    }
    const grpc::Status status = reader->Finish();
    // Replica 0 not up yet, or an old replica 0 whose group ended: dial again. Anything else
    // (a token, another --replicas) will not change.
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return absl::Status(
          FromGrpcStatus(status).code(),
          absl::StrCat("replica group: replica 0 at ", options_.store_address, " refused replica ",
                       options_.rank, ": ", status.error_message()));
    }
    last = status.error_message();
    if (absl::Now() + kRedial >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "replica group: replica 0 at ", options_.store_address, " did not take replica ",
          options_.rank, " in within ", absl::FormatDuration(options_.join_timeout),
          " (--replica_join_seconds); last: ", last));
    }
    absl::SleepFor(kRedial);
  }
}

void ReplicaGroup::WatchMembership() {
  JoinResponse message;
  while (join_reader_->Read(&message)) {
  }
  const grpc::Status status = join_reader_->Finish();
  Fail(absl::UnavailableError(absl::StrCat("replica group: replica ", options_.rank,
                                           " lost the group: its stream to replica 0 ended (",
                                           status.error_message(), ")")));
}

absl::Status ReplicaGroup::Form() {
  const absl::Time deadline = absl::Now() + options_.join_timeout;
  if (options_.rank == 0) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return joined_count_ == options_.replicas || !failure_.ok() || shutting_down_;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
      std::string missing;
      for (int r = 1; r < options_.replicas; ++r) {
        if (!joined_[r]) absl::StrAppend(&missing, missing.empty() ? "" : ", ", r);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("replica group: replica(s) ", missing, " of ", options_.replicas,
                       " did not join replica 0 within ",
                       absl::FormatDuration(options_.join_timeout), " (--replica_join_seconds)"));
    }
    if (!failure_.ok()) return failure_;
    if (shutting_down_) return absl::CancelledError("replica group: shut down while forming");
    formed_ = true;
  } else {
    RETURN_IF_ERROR(JoinReplicaZero(deadline));
    watcher_ = std::make_unique<std::thread>([this] { WatchMembership(); });
    arrive_stub_ = internal::v1::ReplicaGroup::NewStub(ChannelToReplicaZero());
  }
  ASSIGN_OR_RETURN(const std::string local_host, LocalAddressTowards(options_.store_address));
  std::unique_ptr<gloo::rendezvous::Store> base;
  const absl::Duration remaining = std::max(absl::Seconds(1), deadline - absl::Now());
  if (options_.rank == 0) {
    base = std::make_unique<LocalGlooStore>(store_, remaining);
  } else {
    base = std::make_unique<RemoteStore>(*this, remaining);
  }
  gloo::rendezvous::PrefixStore store(absl::StrFormat("lossd-%016x", session_), *base);
  ASSIGN_OR_RETURN(
      std::unique_ptr<lossd::server::Collective> collective,
      GlooCollective::Connect(store, options_.rank, options_.replicas, local_host, remaining));
  // Every replica is connected to every other once each has passed this.
  RETURN_IF_ERROR(collective->Barrier(remaining));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(failure_);
  collective_ = std::move(collective);
  return absl::OkStatus();
}

absl::StatusOr<Collective*> ReplicaGroup::collective() {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(failure_);
  if (collective_ == nullptr) {
    return absl::UnavailableError("replica group: not formed yet (the replicas are still meeting)");
  }
  return collective_.get();
}

absl::Status ReplicaGroup::Arrive(int rank, uint64_t sequence, absl::Time deadline,
                                  const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  arrived_[rank] = std::max(arrived_[rank], sequence);
  auto all_in = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::all_of(arrived_.begin(), arrived_.end(),
                       [&](uint64_t reached) { return reached >= sequence; });
  };
  while (!all_in()) {
    if (!failure_.ok()) return failure_;
    if (shutting_down_) return absl::UnavailableError("replica group: replica 0 is shutting down");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      std::string missing;
      for (int r = 0; r < options_.replicas; ++r) {
        if (arrived_[r] < sequence) absl::StrAppend(&missing, missing.empty() ? "" : ", ", r);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("replica(s) ", missing, " of ", options_.replicas, " did not reach it"));
    }
    if (cancelled()) return absl::CancelledError("replica group: the caller went away");
    mu_.AwaitWithDeadline(absl::Condition(&all_in), std::min(deadline, now + kPoll));
  }
  return absl::OkStatus();
}

absl::Status ReplicaGroup::AwaitReplicas(absl::Duration wait) {
  const uint64_t sequence = ++operations_;
  const absl::Time deadline = absl::Now() + wait;
  // Asked in slices, so that the group's end (seen by the membership stream) interrupts it.
  constexpr absl::Duration kSlice = absl::Seconds(1);
  while (true) {
    RETURN_IF_ERROR(failure());
    const absl::Time slice_end = std::min(deadline, absl::Now() + kSlice);
    absl::Status arrived;
    if (options_.rank == 0) {
      arrived = Arrive(0, sequence, slice_end, [] { return false; });
    } else {
      internal::v1::ArriveRequest request;
      request.set_rank(options_.rank);
      request.set_sequence(sequence);
      request.set_timeout_ms(absl::ToInt64Milliseconds(slice_end - absl::Now()));
      internal::v1::ArriveResponse response;
      grpc::ClientContext context;
      Authorize(context);
      context.set_deadline(absl::ToChronoTime(slice_end + absl::Seconds(10)));
      arrived = FromGrpcStatus(arrive_stub_->Arrive(&context, request, &response));
    }
    if (arrived.ok()) return absl::OkStatus();
    if (arrived.code() != absl::StatusCode::kDeadlineExceeded) {
      return absl::UnavailableError(
          absl::StrCat("replica group: waiting for the other replicas: ", arrived.message()));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("replica group: ", arrived.message(),
                                                      " within ", absl::FormatDuration(wait),
                                                      " (--step_wait_seconds)"));
    }
  }
}

void ReplicaGroup::Fail(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok() || shutting_down_) return;
    failure_ = why;
  }
  if (on_failure_) on_failure_(why);
}

absl::Status ReplicaGroup::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

void ReplicaGroup::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  shutting_down_ = true;
  if (join_context_ != nullptr) join_context_->TryCancel();
}

// ReplicaExchange ---------------------------------------------------------------------------------

namespace {

// A 64-bit value as two doubles, each exact.
void PutUint64(std::vector<double>& values, uint64_t x) {
  values.push_back(static_cast<double>(x >> 32));
  values.push_back(static_cast<double>(x & 0xffffffffu));
}

}  // namespace

absl::Status ReplicaExchange::Failed(const absl::Status& status) {
  group_.Fail(status);
  return absl::AbortedError(
      absl::StrCat(what_, ": ", status.message(),
                   "; nothing was applied on this replica. The replica group has "
                   "ended: every replica restarts from the last checkpoint, and the trainers "
                   "resume from theirs"));
}

absl::StatusOr<Collective*> ReplicaExchange::Connected() {
  absl::StatusOr<lossd::server::Collective*> collective = group_.collective();
  if (!collective.ok()) {
    return absl::UnavailableError(absl::StrCat(what_, ": ", collective.status().message()));
  }
  return collective;
}

absl::Status ReplicaExchange::AwaitReplicas() {
  RETURN_IF_ERROR(Connected().status());
  const absl::Time start = absl::Now();
  const absl::Status status = group_.AwaitReplicas(group_.options().step_wait);
  if (observer_ != nullptr && observer_->waited) {
    observer_->waited(absl::ToDoubleSeconds(absl::Now() - start));
  }
  if (!status.ok()) return Failed(status);
  return absl::OkStatus();
}

absl::StatusOr<bool> ReplicaExchange::Agree(uint64_t version, std::optional<uint64_t> weight_digest,
                                            const absl::Status& refusal, bool kept) {
  // Every value goes in as x and -x: one all-reduce of maxima gives each one's maximum and minimum.
  std::vector<double> mine;
  PutUint64(mine, version);
  PutUint64(mine, fingerprint_);
  PutUint64(mine, weight_digest.value_or(0));
  const size_t compared = mine.size();
  for (size_t i = 0; i < compared; ++i) mine.push_back(-mine[i]);
  mine.push_back(weight_digest.has_value() ? 0.0 : 1.0);  // any replica without the digest
  mine.push_back(refusal.ok() ? 0.0 : 1.0);               // any replica refusing
  mine.push_back(kept ? 0.0 : 1.0);                       // any replica without the kept sum
  ASSIGN_OR_RETURN(lossd::server::Collective * collective, Connected());
  const absl::Status reduced =
      collective->AllReduceMax(absl::MakeSpan(mine), group_.options().timeout);
  if (!reduced.ok()) return Failed(reduced);
  auto same = [&](size_t first) {
    return mine[first] == -mine[compared + first] && mine[first + 1] == -mine[compared + first + 1];
  };
  const double* any = &mine[2 * compared];  // without the digest, refusing, without the sum
  if (any[1] > 0) {
    if (!refusal.ok()) return refusal;
    return absl::AbortedError(
        absl::StrCat(what_,
                     ": another replica of the group refused it (its ranks heard why); nothing was "
                     "applied"));
  }
  if (!same(0)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what_,
                     ": the replicas' heads are at different versions: they did not start from the "
                     "same checkpoint; restart every replica from one"));
  }
  if (!same(2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what_,
        ": the ranks of the replicas sent different requests (optimizer, learning rate, "
        "options or version); every rank of every replica must send the same"));
  }
  if (any[0] == 0 && !same(4)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what_,
        ": the replicas hold different W at this version (weight_sha256 differs): they "
        "were loaded or uploaded from different weights; nothing was applied"));
  }
  agreed_ = true;
  return any[2] == 0;
}

absl::Status ReplicaExchange::Reduce(absl::Span<float> gradient, absl::Span<double> counts) {
  ASSIGN_OR_RETURN(lossd::server::Collective * collective, Connected());
  const absl::Time start = absl::Now();
  absl::Status status = collective->AllReduceSum(gradient, group_.options().timeout);
  if (status.ok()) status = collective->AllReduceSum(counts, group_.options().timeout);
  if (!status.ok()) return Failed(status);
  if (observer_ != nullptr && observer_->all_reduced) {
    observer_->all_reduced(absl::ToDoubleSeconds(absl::Now() - start),
                           static_cast<int64_t>(gradient.size() * sizeof(float)));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ReplicaExchange::SumSquares(absl::Span<const float> gradient) {
  // Replica r adds up the squares of its share in double, in order; the shares are then summed
  // in rank order on every replica, so that the norm has the same bits everywhere whatever the
  // replicas' thread counts.
  ASSIGN_OR_RETURN(lossd::server::Collective * collective, Connected());
  const int size = collective->size();
  const int rank = collective->rank();
  const size_t begin = gradient.size() * rank / size;
  const size_t end = gradient.size() * (rank + 1) / size;
  std::vector<double> shares(size, 0.0);
  double sum = 0.0;
  for (size_t i = begin; i < end; ++i) sum += static_cast<double>(gradient[i]) * gradient[i];
  shares[rank] = sum;
  const absl::Status status =
      collective->AllReduceSum(absl::MakeSpan(shares), group_.options().timeout);
  if (!status.ok()) return Failed(status);
  double total = 0.0;
  for (double share : shares) total += share;
  return total;
}

}  // namespace lossd::server
