// What follows a device fault that no call in the process can get past (CUDA's sticky errors):
// the call that met it and every later one fail with UNAVAILABLE naming it, health checks report
// NOT_SERVING, a call in flight gets its status, and the server reports the fault so that its owner
// drains and exits for a restart. On the CPU a backend that fails on command stands in for the
// device; on a GPU the CUDA module's test-only entry point provokes a real fault (an illegal
// address), which leaves the device unusable for the rest of the test's process.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>

#include "absl/time/clock.h"
#include "kernels/cuda/cuda_module.h"
#include "lossd/kernels/backend.h"
#include "tests/server_harness.h"

namespace lossd::testing {
namespace {

constexpr int64_t kVocab = 3001;
constexpr int64_t kHidden = 64;
constexpr char kHead[] = "faulty";

// The CPU backend, whose Compute fails with a device fault once armed.
class FaultOnCommandBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  void Arm() { armed_ = true; }
  int computes_after_arming() const { return computes_after_arming_; }

  std::string Describe() const override {
    return "faults on command: " + ForwardingBackend::Describe();
  }
  absl::StatusOr<BatchSummary> Compute(const BatchInputs& in, const WeightView& weight,
                                       const LossOptions& options, const TokenOutputs& out,
                                       DeviceBuffer* grad_weight,
                                       DeviceBuffer& workspace) override {
    if (armed_) {
      ++computes_after_arming_;
      return DeviceFaultError("injected by the test backend");
    }
    return ForwardingBackend::Compute(in, weight, options, out, grad_weight, workspace);
  }

 private:
  std::atomic<bool> armed_{false};
  std::atomic<int> computes_after_arming_{0};
};

struct FaultCase {
  const char* name;
  const char* device;
  const char* fault_names;  // what the fault's message must contain
};

class DeviceFaultTest : public ::testing::TestWithParam<FaultCase> {
 protected:
  void SetUp() override {
    auto backend = CreateBackend(GetParam().device);
    if (!backend.ok()) GTEST_SKIP() << GetParam().device << ": " << backend.status();
    std::unique_ptr<Backend> served = std::move(backend).value();
    if (served->kind() == "cpu") {
      auto faulty = std::make_unique<FaultOnCommandBackend>(std::move(served));
      fake_ = faulty.get();
      served = std::move(faulty);
    }
    server::ServerConfig config = MultiChunkDemoConfig(kHead, kVocab, kHidden, /*seed=*/7);
    config.listen_address = "127.0.0.1:0";
    config.metrics_address = "";
    auto started = server::LossServer::Start(config, std::move(served));
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started).value();
    stub_ = ConnectTo(server_->port());
  }

  // Leaves the device faulted: the fake fails its next Compute; the real one is broken at once.
  void ProvokeFault() {
    if (fake_ != nullptr) {
      fake_->Arm();
      return;
    }
    auto fault_device = reinterpret_cast<int (*)(int, char*, size_t)>(
        CudaModuleSymbol("lossd_cuda_test_only_fault_device"));
    ASSERT_NE(fault_device, nullptr) << "the CUDA module has no lossd_cuda_test_only_fault_device";
    char error[128] = {};
    ASSERT_EQ(fault_device(0, error, sizeof error), 1)
        << "no sticky error after the kernel: " << error;
  }

  ComputeOutcome Train(int64_t rows) {
    const Batch batch = RandomBatch(rows, kVocab, kHidden, rng_);
    return CallCompute(*stub_, StartFor(kHead, batch, kHidden, /*training=*/true),
                       FloatBytes(batch.hidden), /*rows_per_message=*/64);
  }

  void ExpectRefusalNamingTheFault(const grpc::Status& status) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_NE(status.error_message().find("device fault: "), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find(GetParam().fault_names), std::string::npos)
        << status.error_message();
    // Typed too, so that clients move to another replica without reading the message.
    const std::optional<v1::ErrorInfo> info = ErrorInfoIn(status);
    ASSERT_TRUE(info.has_value()) << "no ErrorInfo in the status details";
    EXPECT_EQ(info->reason(), v1::ErrorInfo::DEVICE_FAULT);
  }

  std::mt19937_64 rng_{12345};
  FaultOnCommandBackend* fake_ = nullptr;
  std::unique_ptr<server::LossServer> server_;
  std::unique_ptr<v1::LossService::Stub> stub_;
};

TEST_P(DeviceFaultTest, EveryCallAfterTheFaultIsRefusedAndHealthIsNotServing) {
  ASSERT_TRUE(Train(100).status.ok());
  ASSERT_EQ(CheckHealth(server_->port()).serving_status, kServing);
  EXPECT_TRUE(server_->device_fault().ok());

  ProvokeFault();
  const ComputeOutcome faulted = Train(100);
  ExpectRefusalNamingTheFault(faulted.status);
  const absl::Status fault = server_->device_fault();
  EXPECT_TRUE(IsDeviceFault(fault)) << fault;
  EXPECT_EQ(std::string(fault.message()), faulted.status.error_message());

  const HealthReply health = CheckHealth(server_->port());
  ASSERT_TRUE(health.status.ok()) << health.status.error_message();
  EXPECT_EQ(health.serving_status, kNotServing);

  // Refused before they reach the device, with what the operator needs to know.
  const ComputeOutcome after = Train(100);
  ExpectRefusalNamingTheFault(after.status);
  EXPECT_NE(after.status.error_message().find("to be restarted"), std::string::npos);
  grpc::ClientContext context;
  v1::ListHeadsResponse heads;
  ExpectRefusalNamingTheFault(stub_->ListHeads(&context, v1::ListHeadsRequest(), &heads));
  if (fake_ != nullptr) {
    EXPECT_EQ(fake_->computes_after_arming(), 1);
  }

  // A call left to drain would hold the shutdown for its whole limit.
  constexpr absl::Duration kDrain = absl::Seconds(300);
  const absl::Time start = absl::Now();
  server_->Shutdown(kDrain);
  EXPECT_LT(absl::Now() - start, kDrain) << "nothing left to drain";
}

// A call between its messages when another call meets the fault: its next chunk meets the fault
// too, it gets its own status, and the server has nothing left to wait for.
TEST_P(DeviceFaultTest, ACallInFlightGetsTheFaultAndTheServerDrains) {
  constexpr int64_t kRows = 600;  // several engine chunks under the 1 MiB workspace budget
  const Batch batch = RandomBatch(kRows, kVocab, kHidden, rng_);
  grpc::ClientContext context;
  auto in_flight = stub_->Compute(&context);
  v1::ComputeRequest request;
  *request.mutable_start() = StartFor(kHead, batch, kHidden, /*training=*/true);
  ASSERT_TRUE(in_flight->Write(request));
  const std::string rows = FloatBytes(batch.hidden);
  const size_t half = rows.size() / 2;
  request.mutable_chunk()->set_hidden(rows.substr(0, half));
  ASSERT_TRUE(in_flight->Write(request));

  ProvokeFault();
  ExpectRefusalNamingTheFault(Train(100).status);

  request.mutable_chunk()->set_hidden(rows.substr(half));
  in_flight->Write(request);  // may fail: the server can end the call as soon as it faults
  in_flight->WritesDone();
  v1::ComputeResponse response;
  while (in_flight->Read(&response)) {
  }
  ExpectRefusalNamingTheFault(in_flight->Finish());

  constexpr absl::Duration kDrain = absl::Seconds(300);
  const absl::Time start = absl::Now();
  server_->Shutdown(kDrain);
  EXPECT_LT(absl::Now() - start, kDrain) << "the call in flight must have ended";
}

INSTANTIATE_TEST_SUITE_P(
    Devices, DeviceFaultTest,
    ::testing::Values(FaultCase{"cpu_fake", "cpu", "injected by the test backend"},
                      FaultCase{"cuda_illegal_address", "cuda", "cudaErrorIllegalAddress"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::testing
