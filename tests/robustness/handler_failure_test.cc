// Handler failures: whatever a handler meets (here every allocation on the device throwing
// std::bad_alloc, as operator new does when memory runs out) ends the call with a status the
// client can act on, counted by code, with the in-flight count back down, so that a shutdown
// does not wait for calls that are gone.

#include "tests/robustness/robustness_common.h"

namespace lossd::testing {
namespace {

// The CPU backend, except that Allocate throws std::bad_alloc while `failing` is set.
class ThrowingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  std::atomic<bool> failing{false};

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (failing.load()) throw std::bad_alloc();
    return ForwardingBackend::Allocate(bytes);
  }
};

TEST(HandlerFailureTest, ThrownAllocationsEndCallsAccountedAndShutdownIsPrompt) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "LOSSD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto owned = std::make_unique<ThrowingBackend>(*std::move(cpu));
  ThrowingBackend& backend = *owned;
  server::ServerConfig config = StallConfig();
  config.listen_address = "127.0.0.1:0";
  config.metrics_address = "";
  config.cache_call_buffers = false;  // every call allocates
  absl::StatusOr<std::unique_ptr<server::LossServer>> started =
      server::LossServer::Start(config, std::move(owned));
  ASSERT_TRUE(started.ok()) << started.status();
  server::LossServer& server = **started;
  auto stub = ConnectTo(server.port());
  const Batch batch = RandomBatch(kStallRows, kStallVocab, kStallHidden, rng);

  backend.failing = true;
  const grpc::Status upload =
      Upload(*stub, "fresh", 64, kStallHidden, RandomWeight(64, kStallHidden, rng), false);
  const ComputeOutcome compute = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                             FloatBytes(batch.hidden), kStallRowsPerMessage);
  grpc::Status step;
  {
    grpc::ClientContext context;
    v1::StepRequest request;
    request.set_head(kStallHead);
    request.mutable_adamw()->set_learning_rate(1e-3);  // its moments are allocated now
    v1::StepResponse response;
    step = stub->Step(&context, request, &response);
  }
  backend.failing = false;

  for (const auto& [method, status] :
       {std::pair{"UploadHead", upload}, std::pair{"Compute", compute.status},
        std::pair{"Step", step}}) {
    SCOPED_TRACE(method);
    EXPECT_EQ(status.error_code(), StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_NE(status.error_message().find("alloc"), std::string::npos) << status.error_message();
    // Counted before the client could hear its status.
    EXPECT_EQ(EventMetric(server, "lossd_requests_total",
                          {{"method", method}, {"code", "RESOURCE_EXHAUSTED"}}),
              1);
  }
  EXPECT_TRUE(Eventually([&] { return EventMetric(server, "lossd_inflight_calls") == 0.0; }));
  EXPECT_TRUE(SettlesToIdle(server, 0));

  // The server still serves, and right.
  const FetchedTensor weight = Fetch(*stub, kStallHead, false);
  const ComputeOutcome out = CallCompute(*stub, StartFor(kStallHead, batch, kStallHidden, true),
                                         FloatBytes(batch.hidden), kStallRowsPerMessage);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_TRUE(
      LossMatches(out.summary.loss(), Reference(weight.values, kStallVocab, kStallHidden, batch)));

  // No call is left in flight, so a shutdown returns long before its drain limit, which it would
  // wait out for a call still running.
  constexpr absl::Duration kDrain = absl::Seconds(300);
  const absl::Time start = absl::Now();
  server.Shutdown(kDrain);
  const absl::Duration shutdown = absl::Now() - start;
  RecordProperty("shutdown_seconds", absl::StrCat(absl::ToDoubleSeconds(shutdown)));
  EXPECT_LT(shutdown, kDrain);
}

}  // namespace
}  // namespace lossd::testing
