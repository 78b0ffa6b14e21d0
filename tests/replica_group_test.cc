// Replica groups (--replicas): three real servers in one process, on loopback, meeting through
// replica 0's store and all-reducing over Gloo's TCP transport. A collective step leaves W bitwise
// the same on every replica and equal to one server's step on all the gradients; replicas that
// disagree fail the step alike and go on; a replica that leaves ends the group for all, and a
// step waiting for it fails at once.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "server/replicas/replica_group.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/scratch_files.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using grpc::StatusCode;
using server::LossServer;

constexpr int64_t kVocab = 150;
constexpr int64_t kHidden = 12;
constexpr int64_t kRows = 40;
constexpr int kReplicas = 3;

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

bool Eventually(const std::function<bool()>& condition, absl::Duration within = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + within;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// A port free now, for replica 0, whose address the others must know before it listens.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

server::ServerConfig ReplicaConfig(int rank, int port0, absl::Duration step_wait) {
  server::ServerConfig config = MultiChunkDemoConfig("head", kVocab, kHidden, 11);
  config.listen_address = rank == 0 ? absl::StrCat("127.0.0.1:", port0) : "127.0.0.1:0";
  config.metrics_address = "";
  config.replicas = kReplicas;
  config.replica_rank = rank;
  config.replica_store = absl::StrCat("127.0.0.1:", port0);
  config.replica_join = absl::Seconds(60);
  config.replica_timeout = absl::Seconds(30);
  config.step_wait = step_wait;
  return config;
}

// Three replicas, started at once: each Start returns once the whole group has met. `adjust`
// changes a replica's configuration.
std::vector<std::unique_ptr<LossServer>> StartReplicas(
    absl::Duration step_wait = absl::Seconds(120),
    const std::function<void(int, server::ServerConfig&)>& adjust = nullptr,
    std::vector<absl::Status>* failures = nullptr) {
  if (failures != nullptr) failures->assign(kReplicas, absl::OkStatus());
  const int port0 = FreePort();
  std::vector<std::unique_ptr<LossServer>> replicas(kReplicas);
  std::vector<std::thread> starting;
  for (int rank = 0; rank < kReplicas; ++rank) {
    starting.emplace_back([&, rank] {
      auto backend = CreateBackend("cpu");
      if (!backend.ok()) return;
      server::ServerConfig config = ReplicaConfig(rank, port0, step_wait);
      if (adjust) adjust(rank, config);
      auto started = LossServer::Start(config, *std::move(backend));
      if (started.ok()) {
        replicas[rank] = *std::move(started);
      } else if (failures != nullptr) {
        (*failures)[rank] = started.status();
      } else {
        ADD_FAILURE() << "replica " << rank << ": " << started.status();
      }
    });
  }
  for (std::thread& t : starting) t.join();
  return replicas;
}

double AllReducedBytes(LossServer& server) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name == "lossd_replica_allreduce_bytes_total" && !family.metric.empty()) {
      return family.metric[0].counter.value;
    }
  }
  return 0.0;
}

template <typename Request, typename Response, typename Call>
std::vector<grpc::Status> OnEveryReplica(const std::vector<std::unique_ptr<LossServer>>& replicas,
                                         const Request& request, std::vector<Response>& responses,
                                         Call call) {
  std::vector<grpc::Status> statuses(replicas.size());
  responses.assign(replicas.size(), Response());
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < replicas.size(); ++r) {
    ranks.emplace_back([&, r] {
      auto stub = ConnectTo(replicas[r]->port());
      grpc::ClientContext context;
      statuses[r] = call(*stub, &context, request, &responses[r]);
    });
  }
  for (std::thread& t : ranks) t.join();
  return statuses;
}

// Step on the replicas `which` at once, each with request_of(its rank); their statuses, and
// their responses in `responses` when given.
std::vector<grpc::Status> StepOn(const std::vector<std::unique_ptr<LossServer>>& replicas,
                                 const std::vector<int>& which,
                                 const std::function<v1::StepRequest(int)>& request_of,
                                 std::vector<v1::StepResponse>* responses = nullptr) {
  std::vector<grpc::Status> statuses(which.size());
  std::vector<v1::StepResponse> answers(which.size());
  std::vector<std::thread> ranks;
  for (size_t i = 0; i < which.size(); ++i) {
    ranks.emplace_back([&, i] {
      grpc::ClientContext context;
      statuses[i] =
          ConnectTo(replicas[which[i]]->port())->Step(&context, request_of(which[i]), &answers[i]);
    });
  }
  for (std::thread& t : ranks) t.join();
  if (responses != nullptr) *responses = std::move(answers);
  return statuses;
}

std::vector<grpc::Status> NormEverywhere(const std::vector<std::unique_ptr<LossServer>>& replicas,
                                         const v1::GradWeightNormRequest& request,
                                         std::vector<v1::GradWeightNormResponse>& responses) {
  return OnEveryReplica(
      replicas, request, responses,
      [](v1::LossService::Stub& stub, grpc::ClientContext* context,
         const v1::GradWeightNormRequest& r, v1::GradWeightNormResponse* response) {
        return stub.GradWeightNorm(context, r, response);
      });
}

v1::StepRequest AdamWRequest(uint64_t version, double learning_rate, bool keep_grad = false) {
  v1::StepRequest request;
  request.set_keep_grad(keep_grad);
  request.set_head("head");
  request.mutable_adamw()->set_learning_rate(learning_rate);
  request.mutable_adamw()->set_beta1(0.9);
  request.mutable_adamw()->set_beta2(0.999);
  request.mutable_adamw()->set_epsilon(1e-8);
  request.set_max_grad_norm(1.0);
  request.set_head_version(version);
  return request;
}

TEST(ReplicaRankTest, TheOrdinalEndsTheHostname) {
  EXPECT_EQ(*server::ReplicaRankFromHostname("lossd-train-2"), 2);
  EXPECT_EQ(*server::ReplicaRankFromHostname("a-0"), 0);
  const absl::Status none = server::ReplicaRankFromHostname("trainer").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(std::string(none.message()), "--replica_rank"));
}

TEST(RendezvousStoreTest, AGetWaitsForItsKeysAndTimesOut) {
  server::RendezvousStore store;
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store.Set("a", "1");
    store.Set("b", "2");
  });
  const auto values = store.Get({"a", "b"}, absl::Now() + absl::Seconds(60), [] { return false; });
  later.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{"1", "2"}));
  const auto missing = store.Get({"c"}, absl::Now() + absl::Milliseconds(50), [] { return false; });
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(ReplicaGroupTest, BadOptionsAreRefusedBeforeAnythingStarts) {
  server::ReplicaGroupOptions options;
  options.replicas = 3;
  options.rank = 3;
  options.store_address = "127.0.0.1:1";
  EXPECT_TRUE(Contains(std::string(server::ReplicaGroup::Create(options).status().message()),
                       "--replica_rank: expected 0 to 2"));
  options.rank = 1;
  options.store_address = "replica-0";
  EXPECT_TRUE(Contains(std::string(server::ReplicaGroup::Create(options).status().message()),
                       "--replica_store: expected HOST:PORT"));
}

TEST(ReplicaGroupTest, ReplicasStartWithReplicaZerosHeads) {
  // Replica 1 loads another W under the same name, replica 2 another head.
  std::vector<std::unique_ptr<LossServer>> replicas =
      StartReplicas(absl::Seconds(120), [](int rank, server::ServerConfig& config) {
        if (rank == 1) config.demo.seed = 12;
        if (rank == 2) config.demo.name = "other";
      });
  for (const auto& replica : replicas) ASSERT_NE(replica, nullptr);
  const FetchedTensor expected = Fetch(*ConnectTo(replicas[0]->port()), "head", false);
  for (int r = 0; r < kReplicas; ++r) {
    const FetchedTensor weight = Fetch(*ConnectTo(replicas[r]->port()), "head", false);
    ASSERT_TRUE(weight.status.ok()) << weight.status.error_message();
    EXPECT_TRUE(BitwiseEqual(weight.values, expected.values)) << "replica " << r;
    EXPECT_EQ(weight.version, expected.version);
    EXPECT_EQ(replicas[r]->heads().List().size(), 1u) << "replica " << r;
  }
  std::string log;
  for (const std::string& line : replicas[2]->startup_log()) log += line + "\n";
  EXPECT_TRUE(Contains(log, "head 'head' [150, 12] at version 1 from replica 0"));
  EXPECT_TRUE(Contains(log, "head 'other' dropped"));
}

TEST(ReplicaGroupTest, ReplicaZeroAsksTheOthersForTheServersToken) {
  ScratchDir dir("lossd_replicas");
  for (const char* name : {"token", "other"}) {
    std::ofstream(dir.File(name)) << name << "-secret\n";
  }
  std::vector<absl::Status> failures;
  std::vector<std::unique_ptr<LossServer>> replicas = StartReplicas(
      absl::Seconds(120),
      [&](int rank, server::ServerConfig& config) {
        config.token_file = dir.File(rank == 2 ? "other" : "token");
        config.replica_join = absl::Seconds(3);
      },
      &failures);
  EXPECT_EQ(replicas[2], nullptr);
  EXPECT_EQ(failures[2].code(), absl::StatusCode::kUnauthenticated) << failures[2];
  EXPECT_TRUE(Contains(std::string(failures[2].message()), "refused replica 2"));
  // Replica 0 waited for it in vain.
  EXPECT_EQ(replicas[0], nullptr);
  EXPECT_TRUE(Contains(std::string(failures[0].message()), "replica(s) 2 of 3 did not join"));
}

TEST(ReplicaGroupTest, AStepOverReplicasIsOneServersStepOnAllTheGradients) {
  std::vector<std::unique_ptr<LossServer>> replicas = StartReplicas();
  for (const auto& replica : replicas) ASSERT_NE(replica, nullptr);
  // One server beside them, with the same head, takes every replica's call.
  server::ServerConfig alone = MultiChunkDemoConfig("head", kVocab, kHidden, 11);
  auto single = StartTestServer(alone);
  auto single_stub = ConnectTo(single->port());
  std::mt19937_64 rng(FreshSeed());
  for (int step = 0; step < 2; ++step) {
    const uint64_t version = Fetch(*single_stub, "head", false).version;
    for (const auto& replica : replicas) {
      const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng);
      const v1::ComputeStart start = StartFor("head", batch, kHidden, /*training=*/true);
      auto stub = ConnectTo(replica->port());
      ASSERT_TRUE(CallCompute(*stub, start, FloatBytes(batch.hidden), 16).status.ok());
      ASSERT_TRUE(CallCompute(*single_stub, start, FloatBytes(batch.hidden), 16).status.ok());
    }
    // The norm all-reduces the gradient once; the step takes the sum it kept.
    v1::GradWeightNormRequest norm_request;
    norm_request.set_head("head");
    norm_request.set_head_version(version);
    std::vector<v1::GradWeightNormResponse> norms;
    for (const grpc::Status& status : NormEverywhere(replicas, norm_request, norms)) {
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    const double bytes_before = AllReducedBytes(*replicas[0]);
    // The first step keeps the gradient: the next one adds to it, on every replica as on one
    // server.
    const v1::StepRequest step_request = AdamWRequest(version, 0.01, /*keep_grad=*/step == 0);
    std::vector<v1::StepResponse> steps;
    for (const grpc::Status& status : StepOn(
             replicas, {0, 1, 2}, [&](int) { return step_request; }, &steps)) {
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    EXPECT_EQ(AllReducedBytes(*replicas[0]), bytes_before) << "the step all-reduced again";
    v1::StepResponse single_step;
    {
      grpc::ClientContext context;
      ASSERT_TRUE(single_stub->Step(&context, step_request, &single_step).ok());
    }
    for (int r = 0; r < kReplicas; ++r) {
      EXPECT_EQ(steps[r].head_version(), version + 1);
      EXPECT_EQ(steps[r].accumulated_tokens(), single_step.accumulated_tokens());
      EXPECT_EQ(norms[r].accumulated_calls(), kReplicas * (step + 1));
      // Every replica computed the same norm, to the bit.
      EXPECT_EQ(steps[r].grad_norm(), steps[0].grad_norm());
      EXPECT_EQ(norms[r].grad_norm(), steps[0].grad_norm());
      EXPECT_NEAR(steps[r].grad_norm(), single_step.grad_norm(), 1e-6 * single_step.grad_norm());
    }
    const FetchedTensor expected = Fetch(*single_stub, "head", false);
    const FetchedTensor first = Fetch(*ConnectTo(replicas[0]->port()), "head", false);
    EXPECT_LE(RelativeError(first.values,
                            std::vector<double>(expected.values.begin(), expected.values.end())),
              1e-6);
    std::string digest;
    for (const auto& replica : replicas) {
      const FetchedTensor weight = Fetch(*ConnectTo(replica->port()), "head", false);
      EXPECT_TRUE(BitwiseEqual(weight.values, first.values));
      grpc::ClientContext context;
      v1::GetHeadRequest request;
      request.set_head("head");
      v1::HeadInfo info;
      ASSERT_TRUE(ConnectTo(replica->port())->GetHead(&context, request, &info).ok());
      if (digest.empty()) digest = info.weight_sha256();
      EXPECT_EQ(info.weight_sha256(), digest);
    }
  }
  EXPECT_GT(AllReducedBytes(*replicas[0]), 0);
}

TEST(ReplicaGroupTest, ReplicasWhoseRanksDisagreeFailTheStepAlikeAndGoOn) {
  // A failed step is remembered for --step_wait_seconds (late ranks hear why): short here, so
  // that the same step can be taken again.
  constexpr absl::Duration kWait = absl::Seconds(2);
  std::vector<std::unique_ptr<LossServer>> replicas = StartReplicas(kWait);
  for (const auto& replica : replicas) ASSERT_NE(replica, nullptr);
  const uint64_t version = Fetch(*ConnectTo(replicas[0]->port()), "head", false).version;
  // Replica 2's rank asks for another learning rate: every replica refuses the step alike.
  std::vector<grpc::Status> statuses;
  auto step_with = [&](const std::function<v1::StepRequest(int)>& request_of) {
    statuses = StepOn(replicas, {0, 1, 2}, request_of);
  };
  step_with([&](int r) { return AdamWRequest(version, r == 2 ? 0.5 : 0.01); });
  for (const grpc::Status& status : statuses) {
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(status.error_message(), "different requests"));
  }
  absl::SleepFor(kWait + absl::Milliseconds(500));
  // Replica 1's rank names a version its head is not at: it says why, the others that it refused.
  step_with([&](int r) { return AdamWRequest(r == 1 ? version + 5 : version, 0.01); });
  EXPECT_EQ(statuses[1].error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Contains(statuses[1].error_message(), "head_version"));
  for (int r : {0, 2}) {
    EXPECT_EQ(statuses[r].error_code(), StatusCode::ABORTED);
    EXPECT_TRUE(Contains(statuses[r].error_message(), "another replica of the group refused it"));
  }
  absl::SleepFor(kWait + absl::Milliseconds(500));
  // Nothing moved, and the group goes on.
  for (const auto& replica : replicas) {
    EXPECT_EQ(Fetch(*ConnectTo(replica->port()), "head", false).version, version);
  }
  step_with([&](int) { return AdamWRequest(version, 0.01); });
  for (int r = 0; r < kReplicas; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r].error_message();
    EXPECT_TRUE(replicas[r]->replica_failure().ok());
    EXPECT_EQ(Fetch(*ConnectTo(replicas[r]->port()), "head", false).version, version + 1);
  }
}

TEST(ReplicaGroupTest, AReplicaThatLeavesEndsTheGroupAndAStepWaitingForItFailsAtOnce) {
  std::vector<std::unique_ptr<LossServer>> replicas = StartReplicas(absl::Seconds(300));
  for (const auto& replica : replicas) ASSERT_NE(replica, nullptr);
  const uint64_t version = Fetch(*ConnectTo(replicas[0]->port()), "head", false).version;
  const FetchedTensor before = Fetch(*ConnectTo(replicas[0]->port()), "head", false);
  // Replicas 0 and 1 reach the step; replica 2's ranks never do.
  const absl::Time start = absl::Now();
  std::thread leaving([&] {
    absl::SleepFor(absl::Milliseconds(500));
    replicas[2]->Shutdown(absl::ZeroDuration());
  });
  const std::vector<grpc::Status> statuses =
      StepOn(replicas, {0, 1}, [&](int) { return AdamWRequest(version, 0.01); });
  leaving.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60)) << "the step waited out --step_wait_seconds";
  for (const grpc::Status& status : statuses) {
    EXPECT_EQ(status.error_code(), StatusCode::ABORTED) << status.error_message();
    EXPECT_TRUE(Contains(status.error_message(), "nothing was applied"));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(Eventually([&] { return !replicas[r]->replica_failure().ok(); }));
    EXPECT_TRUE(Contains(std::string(replicas[r]->replica_failure().message()), "replica group"));
    // Every call is refused from now on, and W is as it was.
    grpc::ClientContext context;
    v1::GetHeadRequest request;
    request.set_head("head");
    v1::HeadInfo info;
    EXPECT_EQ(ConnectTo(replicas[r]->port())->GetHead(&context, request, &info).error_code(),
              StatusCode::UNAVAILABLE);
  }
  EXPECT_EQ(replicas[0]->heads().Get("head").value()->version(), before.version);
}

TEST(ReplicaGroupTest, AReplicaWhoseRanksNeverComeEndsTheGroupAfterTheStepWait) {
  // Replica 2 stays up but its ranks never reach the step (its trainers hang): the others give
  // up after --step_wait_seconds, fail the step and end the group.
  std::vector<std::unique_ptr<LossServer>> replicas = StartReplicas(absl::Seconds(2));
  for (const auto& replica : replicas) ASSERT_NE(replica, nullptr);
  const uint64_t version = Fetch(*ConnectTo(replicas[0]->port()), "head", false).version;
  for (const grpc::Status& status :
       StepOn(replicas, {0, 1}, [&](int) { return AdamWRequest(version, 0.01); })) {
    EXPECT_EQ(status.error_code(), StatusCode::ABORTED) << status.error_message();
    EXPECT_TRUE(Contains(status.error_message(), "replica(s) 2 of 3 did not reach it"));
  }
  for (const auto& replica : replicas) {
    ASSERT_TRUE(Eventually([&] { return !replica->replica_failure().ok(); }));
    EXPECT_EQ(replica->heads().Get("head").value()->version(), version);
  }
}

}  // namespace
}  // namespace lossd::testing
