// Scoring over replicas of one head, with the C++ client against real servers on loopback: a
// target that lists three servers spreads calls over all of them (gRPC's round_robin) with the
// results one server gives, a replica killed mid-run costs no call, and a client pinned to W's
// SHA-256 is refused by a replica that serves another W. Training calls refuse such a target.
// The servers run in this process, each with its own metrics registry, whose request counter
// says which calls it served.
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "lossd/client/client.h"
#include "lossd/kernels/half.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

using client::ChannelOptions;
using client::Client;
using client::ComputeRequest;
using client::ComputeResult;

constexpr char kHead[] = "scoring";
constexpr int64_t kVocab = 2999;
constexpr int64_t kHidden = 48;
constexpr uint64_t kSeed = 7;        // the replicas' demo head
constexpr uint64_t kOtherSeed = 8;   // a replica with another W
constexpr double kLossBound = 1e-6;  // the engine's bound, as in client_test.cc

// SHA-256 of the text "lossd-head-v1 DTYPE V H\n" and then the bytes, as HeadInfo.weight_sha256
// documents it, computed here apart from the server's code.
std::string Sha256Of(const std::string& dtype, int64_t vocab, int64_t hidden, const void* bytes,
                     size_t size) {
  const std::string header = absl::StrCat("lossd-head-v1 ", dtype, " ", vocab, " ", hidden, "\n");
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_MD_CTX* context = EVP_MD_CTX_new();
  EVP_DigestInit_ex(context, EVP_sha256(), nullptr);
  EVP_DigestUpdate(context, header.data(), header.size());
  EVP_DigestUpdate(context, bytes, size);
  EVP_DigestFinal_ex(context, digest, &length);
  EVP_MD_CTX_free(context);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length));
}

ChannelOptions OptionsFor(const std::string& address) {
  ChannelOptions options;
  options.address = address;
  options.deadline = absl::Seconds(30);  // a hang is a failure, not a stuck test run
  options.compute_retry.initial_backoff = absl::Milliseconds(20);
  return options;
}

Client Connect(const std::string& address) {
  absl::StatusOr<Client> client = Client::Connect(OptionsFor(address));
  EXPECT_TRUE(client.ok()) << client.status();
  return std::move(client).value();
}

std::string Loopback(const server::LossServer& server) {
  return absl::StrCat("127.0.0.1:", server.port());
}

// gRPC's target for several servers: ipv4:ADDR:PORT,ADDR:PORT,...
std::string ListTarget(const std::vector<const server::LossServer*>& servers) {
  std::vector<std::string> addresses;
  for (const server::LossServer* server : servers) addresses.push_back(Loopback(*server));
  return absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
}

int64_t Served(server::LossServer& server, const std::string& method) {
  return CallsByCode(server, method)["OK"];
}

// The sum of a counter's or gauge's series, as the server exports it now.
double MetricSum(server::LossServer& server, absl::string_view name) {
  double sum = 0.0;
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      sum += family.type == prometheus::MetricType::Counter ? metric.counter.value
                                                            : metric.gauge.value;
    }
  }
  return sum;
}

// RPCs the server is serving now.
double InFlight(server::LossServer& server) { return MetricSum(server, "lossd_inflight_calls"); }

// Every output both results carry, bit for bit.
void ExpectSameBits(const ComputeResult& a, const ComputeResult& b, const std::string& what) {
  const double loss_a = a.summary.loss(), loss_b = b.summary.loss();
  EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof(double)), 0) << what;
  // The same values serialize to the same bytes: the per-token outputs bit for bit.
  EXPECT_EQ(a.per_token.SerializeAsString(), b.per_token.SerializeAsString()) << what;
  EXPECT_GT(a.per_token.logprob_size(), 0) << what;
}

class ReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(FreshSeed());
    for (int i = 0; i < 3; ++i) {
      replicas_.push_back(StartTestServer(MultiChunkDemoConfig(kHead, kVocab, kHidden, kSeed)));
      ASSERT_NE(replicas_.back(), nullptr);
    }
    other_ = StartTestServer(MultiChunkDemoConfig(kHead, kVocab, kHidden, kOtherSeed));
    ASSERT_NE(other_, nullptr);
    batch_ = RandomBatch(300, kVocab, kHidden, rng);  // several engine chunks per call
    request_.head = kHead;
    request_.hidden = {batch_.hidden.data(), client::DType::kFloat32, 300, kHidden};
    request_.labels = batch_.labels;
    request_.options.set_reduction(v1::REDUCTION_SUM);
    request_.outputs.set_logprob(true);
    request_.outputs.set_entropy(true);
    request_.outputs.set_top_k(3);
  }

  std::vector<const server::LossServer*> Replicas() const {
    return {replicas_[0].get(), replicas_[1].get(), replicas_[2].get()};
  }

  // What one replica alone answers, checked against the float64 reference on its W.
  ComputeResult OneServersResult() {
    const Client one = Connect(Loopback(*replicas_[0]));
    const absl::StatusOr<ComputeResult> result = one.Compute(request_);
    EXPECT_TRUE(result.ok()) << result.status();
    const absl::StatusOr<client::Tensor> weight = one.FetchWeight(kHead);
    EXPECT_TRUE(weight.ok()) << weight.status();
    const ReferenceResult ref = Reference(client::ToFloat32(*weight), kVocab, kHidden, batch_,
                                          {.reduction = Reduction::kSum});
    EXPECT_LE(std::abs(result->summary.loss() - ref.loss) / std::abs(ref.loss), kLossBound);
    return *result;
  }

  std::vector<std::unique_ptr<server::LossServer>> replicas_;
  std::unique_ptr<server::LossServer> other_;
  Batch batch_;
  ComputeRequest request_;
};

TEST_F(ReplicasTest, ReplicasOfOneHeadReportOneHashThatTheBytesGive) {
  const Client one = Connect(Loopback(*replicas_[0]));
  const absl::StatusOr<client::HeadInfo> info = one.GetHead(kHead);
  ASSERT_TRUE(info.ok()) << info.status();
  const absl::StatusOr<client::Tensor> weight = one.FetchWeight(kHead);
  ASSERT_TRUE(weight.ok()) << weight.status();
  EXPECT_EQ(info->weight_sha256,
            Sha256Of("float32", kVocab, kHidden, weight->bytes.data(), weight->bytes.size()));
  for (const auto& replica : replicas_) {
    EXPECT_EQ(Connect(Loopback(*replica)).GetHead(kHead)->weight_sha256, info->weight_sha256);
  }
  EXPECT_NE(Connect(Loopback(*other_)).GetHead(kHead)->weight_sha256, info->weight_sha256);
}

TEST_F(ReplicasTest, ScoringSpreadsOverEveryReplicaWithOneServersResults) {
  const ComputeResult expected = OneServersResult();
  const Client replicas = Connect(ListTarget(Replicas()));
  EXPECT_EQ(replicas.target().listed_addresses, 3);
  // Round robin connects to every address, and reads go round too: once each replica has answered
  // one, all three are in the rotation.
  ASSERT_TRUE(Eventually([&] {
    EXPECT_TRUE(replicas.GetHead(kHead).ok());
    for (const auto& replica : replicas_) {
      if (Served(*replica, "GetHead") == 0) return false;
    }
    return true;
  }));
  std::vector<int64_t> before;
  for (const auto& replica : replicas_) before.push_back(Served(*replica, "Compute"));

  constexpr int kCalls = 12;
  for (int call = 0; call < kCalls; ++call) {
    const absl::StatusOr<ComputeResult> result = replicas.Compute(request_);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectSameBits(*result, expected, absl::StrCat("call ", call));
    EXPECT_EQ(result->attempts, 1);
  }
  int64_t served = 0;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    const int64_t calls = Served(*replicas_[i], "Compute") - before[i];
    EXPECT_GE(calls, kCalls / 3 - 1) << "replica " << i << " served " << calls << " of " << kCalls;
    served += calls;
  }
  EXPECT_EQ(served, kCalls);
}

// A replica goes away while it computes a call: that call fails over to another replica (the
// client's retry, on UNAVAILABLE), and so does every later one.
TEST_F(ReplicasTest, AReplicaKilledMidRunCostsNoCall) {
  const ComputeResult expected = OneServersResult();
  // Larger calls, so that one is still running when its replica is killed.
  std::mt19937_64 rng(FreshSeed());
  const Batch large = RandomBatch(3000, kVocab, kHidden, rng);
  ComputeRequest request = request_;
  request.hidden = {large.hidden.data(), client::DType::kFloat32, 3000, kHidden};
  request.labels = large.labels;
  const absl::StatusOr<ComputeResult> large_expected =
      Connect(Loopback(*replicas_[0])).Compute(request);
  ASSERT_TRUE(large_expected.ok()) << large_expected.status();

  ChannelOptions options = OptionsFor(ListTarget(Replicas()));
  std::vector<absl::Status> failures;  // of attempts the client retried, on the caller's thread
  options.compute_retry.on_retry = [&](const absl::Status& failure, int, absl::Duration) {
    failures.push_back(failure);
  };
  const Client replicas = Client::Connect(options).value();
  std::atomic<bool> stop{false};
  std::atomic<int> completed{0};
  std::vector<absl::StatusOr<ComputeResult>> results;
  std::thread caller([&] {
    while (!stop.load()) {
      results.push_back(replicas.Compute(request));
      ++completed;
    }
  });
  // Killed while a Compute call of ours runs on it (the only calls this test makes there).
  const bool computing = Eventually([&] { return InFlight(*replicas_[2]) >= 1; });
  replicas_[2].reset();
  const int at_kill = completed.load();
  const bool went_on = Eventually([&] { return completed.load() >= at_kill + 4; });
  stop = true;
  caller.join();
  ASSERT_TRUE(computing) << "no call reached the third replica";
  ASSERT_TRUE(went_on) << "calls stopped after the kill";

  int retried = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << "call " << i << ": " << results[i].status();
    ExpectSameBits(*results[i], *large_expected, absl::StrCat("call ", i));
    if (results[i]->attempts > 1) ++retried;
  }
  EXPECT_GE(retried, 1) << "the call on the killed replica was retried elsewhere";
  for (const absl::Status& failure : failures) {
    EXPECT_EQ(failure.code(), absl::StatusCode::kUnavailable) << failure;
  }

  // The rest of the run on the two that are left.
  for (int call = 0; call < 6; ++call) {
    const absl::StatusOr<ComputeResult> result = replicas.Compute(request_);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectSameBits(*result, expected, absl::StrCat("call ", call, " after the kill"));
  }
}

// A scoring session pinned to the hash of the replicas' W, over a target that also lists a server
// with another W (an update rolled out half way): that server refuses every call it gets, naming
// both hashes, and no result from it reaches the caller.
TEST_F(ReplicasTest, APinnedClientIsRefusedByAReplicaWithAnotherW) {
  const ComputeResult expected = OneServersResult();
  const std::string pinned = Connect(Loopback(*replicas_[0])).GetHead(kHead)->weight_sha256;
  const std::string other = Connect(Loopback(*other_)).GetHead(kHead)->weight_sha256;
  ASSERT_NE(pinned, other);

  const Client mixed = Connect(ListTarget({replicas_[0].get(), other_.get()}));
  ComputeRequest request = request_;
  request.weight_sha256 = pinned;
  int served = 0, refused = 0;
  for (int call = 0; call < 8; ++call) {
    const absl::StatusOr<ComputeResult> result = mixed.Compute(request);
    if (result.ok()) {
      ++served;
      ExpectSameBits(*result, expected, absl::StrCat("call ", call));
      continue;
    }
    ++refused;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    EXPECT_NE(result.status().message().find(pinned), absl::string_view::npos) << result.status();
    EXPECT_NE(result.status().message().find(other), absl::string_view::npos) << result.status();
  }
  EXPECT_GT(served, 0);
  EXPECT_GT(refused, 0);
  EXPECT_EQ(Served(*other_, "Compute"), 0) << "the other W computed nothing";

  // Unpinned, the same target mixes the two heads' answers: what the pin is for.
  int differing = 0;
  for (int call = 0; call < 4; ++call) {
    const absl::StatusOr<ComputeResult> result = mixed.Compute(request_);
    ASSERT_TRUE(result.ok()) << result.status();
    if (result->per_token.SerializeAsString() != expected.per_token.SerializeAsString())
      ++differing;
  }
  EXPECT_GT(differing, 0);
}

// A head's gradient, optimizer state and version live in one process: a target that lists several
// servers is refused for everything that reaches them, before anything is sent.
TEST_F(ReplicasTest, TrainingRefusesATargetThatListsSeveralServers) {
  const Client replicas = Connect(ListTarget(Replicas()));
  ComputeRequest training = request_;
  training.outputs.set_grad_hidden(true);
  training.outputs.set_accumulate_grad_weight(true);
  ComputeRequest shared = request_;
  shared.shared_memory = true;
  std::vector<float> weight(kVocab * kHidden, 0.01f);
  const std::vector<std::pair<std::string, absl::Status>> refusals = {
      {"a call that accumulates dL/dW", replicas.Compute(training).status()},
      {"an optimizer step",
       replicas.Step({.head = kHead, .optimizer = client::SgdOptions{.learning_rate = 0.1}})
           .status()},
      {"zeroing the gradient", replicas.ZeroGrad(kHead).status()},
      {"the accumulated dL/dW", replicas.FetchGradWeight(kHead).status()},
      {"an upload",
       replicas.UploadHead("uploaded", {weight.data(), client::DType::kFloat32, kVocab, kHidden})
           .status()},
      {"a checkpoint", replicas.SaveCheckpoint().status()},
      {"shared memory", replicas.Compute(shared).status()},
  };
  for (const auto& [what, status] : refusals) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << status;
    EXPECT_NE(status.message().find(absl::StrCat("address: expected one server for ", what)),
              absl::string_view::npos)
        << status;
    EXPECT_NE(status.message().find("lists 3 addresses"), absl::string_view::npos) << status;
  }
  for (const auto& replica : replicas_) {
    EXPECT_TRUE(CallsByCode(*replica, "Compute").empty()) << "a refused call reached a server";
    EXPECT_EQ(replica->heads().Get(kHead).value()->Summary().version, 1u);
  }

  // One address in gRPC's URI forms trains as HOST:PORT does.
  for (const std::string& target : {absl::StrCat("ipv4:", Loopback(*replicas_[0])),
                                    absl::StrCat("dns:///", Loopback(*replicas_[0]))}) {
    const Client one = Connect(target);
    const absl::StatusOr<ComputeResult> trained = one.Compute(training);
    ASSERT_TRUE(trained.ok()) << target << ": " << trained.status();
    EXPECT_TRUE(trained->summary.grad_weight_accumulated()) << target;
  }
  EXPECT_EQ(replicas_[0]->heads().Get(kHead).value()->Summary().accumulated_calls, 2);
}

// The hash follows W: a step changes it (computed when first asked for, cached with the version),
// a call pinned to the old one is refused, and one pinned to the new one runs.
TEST_F(ReplicasTest, TheHashFollowsWThroughAStep) {
  const Client one = Connect(Loopback(*replicas_[0]));
  const std::string before = one.GetHead(kHead)->weight_sha256;
  ComputeRequest training = request_;
  training.outputs.set_accumulate_grad_weight(true);
  ASSERT_TRUE(one.Compute(training).ok());
  const absl::StatusOr<client::StepResult> step =
      one.Step({.head = kHead, .optimizer = client::SgdOptions{.learning_rate = 0.5}});
  ASSERT_TRUE(step.ok()) << step.status();

  // Not hashed yet: a listing does not wait for it.
  const absl::StatusOr<client::HeadList> listed = one.ListHeads();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->heads.at(0).weight_sha256, "");
  const absl::StatusOr<client::HeadInfo> after = one.GetHead(kHead);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->version, step->head_version);
  const absl::StatusOr<client::Tensor> weight = one.FetchWeight(kHead);
  ASSERT_TRUE(weight.ok()) << weight.status();
  EXPECT_EQ(after->weight_sha256,
            Sha256Of("float32", kVocab, kHidden, weight->bytes.data(), weight->bytes.size()));
  EXPECT_NE(after->weight_sha256, before);
  EXPECT_EQ(one.ListHeads()->heads.at(0).weight_sha256, after->weight_sha256) << "cached";

  ComputeRequest pinned = request_;
  pinned.weight_sha256 = before;
  const absl::StatusOr<ComputeResult> stale = one.Compute(pinned);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_NE(stale.status().message().find(before), absl::string_view::npos) << stale.status();
  EXPECT_NE(stale.status().message().find(after->weight_sha256), absl::string_view::npos);
  pinned.weight_sha256 = after->weight_sha256;
  const absl::StatusOr<ComputeResult> current = one.Compute(pinned);
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_EQ(current->summary.head_version(), after->version);
}

// The hash is of the bytes as stored: a bfloat16 head hashes its bfloat16 bits.
TEST_F(ReplicasTest, AHeadHashesItsStoredDType) {
  const Client one = Connect(Loopback(*replicas_[0]));
  std::mt19937_64 rng(FreshSeed());
  const std::vector<float> weight = RandomWeight(300, kHidden, rng);
  const absl::StatusOr<client::HeadInfo> info = one.UploadHead(
      "bf16", {weight.data(), client::DType::kFloat32, 300, kHidden}, client::DType::kBFloat16);
  ASSERT_TRUE(info.ok()) << info.status();
  std::vector<uint16_t> stored(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) stored[i] = FloatToBFloat16(weight[i]);
  EXPECT_EQ(info->weight_sha256,
            Sha256Of("bfloat16", 300, kHidden, stored.data(), stored.size() * sizeof(uint16_t)));
  EXPECT_EQ(one.GetHead("bf16")->weight_sha256, info->weight_sha256);
}

TEST_F(ReplicasTest, AMalformedPinIsRefusedNamingTheField) {
  const Client one = Connect(Loopback(*replicas_[0]));
  const std::string valid = one.GetHead(kHead)->weight_sha256;
  for (const std::string& bad :
       {valid.substr(1), std::string(64, 'A'), std::string(64, 'g'), std::string(200, 'a')}) {
    ComputeRequest request = request_;
    request.weight_sha256 = bad;
    const absl::Status status = one.Compute(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << status;
    EXPECT_TRUE(absl::StartsWith(status.message(), "weight_sha256: expected 64 lowercase hex"))
        << status;
  }
}

// The channels' retryPolicy: a draining server refuses every call with UNAVAILABLE, counting each
// attempt. gRPC sends a read of one message (FetchGradWeight) the policy's 4 times; a step, which a
// lost answer could have applied, once.
TEST(RetryPolicyTest, GrpcRetriesTheReadOnlyCallsAndMakesStepsOnce) {
  constexpr int64_t kLargeVocab = 32000, kLargeHidden = 256, kRows = 8192;
  std::unique_ptr<server::LossServer> server =
      StartTestServer(MultiChunkDemoConfig(kHead, kLargeVocab, kLargeHidden, kSeed));
  ASSERT_NE(server, nullptr);
  std::mt19937_64 rng(FreshSeed());
  const Batch batch = RandomBatch(kRows, kLargeVocab, kLargeHidden, rng);
  ComputeRequest long_call;  // seconds on the CPU: it keeps the server draining
  long_call.head = kHead;
  long_call.hidden = {batch.hidden.data(), client::DType::kFloat32, kRows, kLargeHidden};
  long_call.labels = batch.labels;
  long_call.shared_memory = false;  // its rows in messages, which the server counts as they come
  ChannelOptions options = OptionsFor(Loopback(*server));
  options.compute_retry.max_attempts = 4;
  options.compute_retry.initial_backoff = absl::Milliseconds(10);
  const Client busy = Client::Connect(options).value();
  const Client idle = Client::Connect(options).value();
  ASSERT_TRUE(idle.ZeroGrad(kHead).ok());  // connected before the drain

  std::thread caller([&] {
    const absl::StatusOr<ComputeResult> result = busy.Compute(long_call);
    EXPECT_TRUE(result.ok()) << result.status();
  });
  // Draining from when the server has read the call's first rows: a stream whose start it has
  // not read yet is no call to drain, and a shutdown ends it at once.
  ASSERT_TRUE(Eventually([&] { return MetricSum(*server, "lossd_received_bytes_total") > 0; }));
  std::thread drain([&] { server->Shutdown(absl::Seconds(60)); });
  ASSERT_TRUE(Eventually([&] {
    return absl::IsUnavailable(idle.SaveCheckpoint().status());  // refused once draining
  }));
  const int64_t checkpoints_refused = CallsByCode(*server, "SaveCheckpoint")["UNAVAILABLE"];
  const absl::Status fetched = idle.FetchGradWeight(kHead).status();
  const absl::Status stepped =
      idle.Step({.head = kHead, .optimizer = client::SgdOptions{.learning_rate = 0.1}}).status();
  const int64_t fetches = CallsByCode(*server, "FetchGradWeight")["UNAVAILABLE"];
  const int64_t steps = CallsByCode(*server, "Step")["UNAVAILABLE"];
  caller.join();
  drain.join();
  EXPECT_TRUE(absl::IsUnavailable(fetched)) << fetched;
  EXPECT_TRUE(absl::IsUnavailable(stepped)) << stepped;
  EXPECT_EQ(fetches, 4) << "gRPC's retryPolicy sends a read again";
  EXPECT_EQ(steps, 1) << "a step is made once";
  EXPECT_GE(checkpoints_refused, 1);
}

struct TargetCase {
  const char* reason;
  const char* address;
  int listed_addresses;  // 0: refused
};

class ParseTargetTest : public ::testing::TestWithParam<TargetCase> {};

TEST_P(ParseTargetTest, ListsWhatTheTargetNamesAndKeepsItAsWritten) {
  const TargetCase& c = GetParam();
  const absl::StatusOr<client::Target> target = client::ParseTarget(c.address);
  if (c.listed_addresses == 0) {
    EXPECT_EQ(target.status().code(), absl::StatusCode::kInvalidArgument) << target.status();
    EXPECT_TRUE(absl::StartsWith(target.status().message(), "address: expected"))
        << target.status();
    return;
  }
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->uri, c.address);
  EXPECT_EQ(target->listed_addresses, c.listed_addresses);
}

INSTANTIATE_TEST_SUITE_P(
    Targets, ParseTargetTest,
    ::testing::Values(
        TargetCase{"HOST:PORT, gRPC's default DNS resolution", "lossd:50051", 1},
        TargetCase{"a DNS name may resolve to several, but lists one", "dns:///lossd-scoring:50051",
                   1},
        TargetCase{"DNS with an authority (the DNS server)", "dns://10.0.0.10:53/lossd:50051", 1},
        TargetCase{"three IPv4 replicas", "ipv4:127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003", 3},
        TargetCase{"one IPv4 address", "ipv4:10.1.2.3:50051", 1},
        TargetCase{"ipv4 as a URI with an empty authority", "ipv4:///127.0.0.1:1,127.0.0.1:2", 2},
        TargetCase{"two IPv6 replicas", "ipv6:[::1]:5001,[::1]:5002", 2},
        TargetCase{"a Unix socket", "unix:/run/lossd/lossd.sock", 1},
        TargetCase{"an abstract Unix socket", "unix-abstract:lossd", 1},
        TargetCase{"nothing", "", 0},
        TargetCase{"an empty entry in a list", "ipv4:127.0.0.1:5001,,127.0.0.1:5002", 0},
        TargetCase{"a list of nothing", "ipv4:", 0}),
    [](const ::testing::TestParamInfo<TargetCase>& info) {
      return absl::StrCat("Case", info.index);
    });

}  // namespace
}  // namespace lossd::testing
