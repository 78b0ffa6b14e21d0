// What the robustness suites (one file each in this folder, one robustness_test binary) share:
// the float64 bounds, call scripts, private channels and the server's resources held by calls.
// Figures are recorded as test properties (--gtest_output=xml) and summarized in
// tests/ROBUSTNESS.md; crash safety of checkpoints is checked against the real binary in
// tests/python/test_crash_safety.py.
#ifndef LOSSD_TESTS_ROBUSTNESS_ROBUSTNESS_COMMON_H_
#define LOSSD_TESTS_ROBUSTNESS_ROBUSTNESS_COMMON_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/status/grpc_status.h"
#include "tests/engine_harness.h"
#include "tests/reference.h"
#include "tests/server_harness.h"

namespace lossd::testing {

using grpc::StatusCode;
using server::MemoryPurpose;

// The engine's bounds against the float64 reference (engine_test.cc); the server adds no error.
inline constexpr double kLossBound = 1e-6;
inline constexpr double kGradBound = 2e-5;

// A whole training call for `batch` as messages: its start, then its rows `rows_per_message` at a
// time.
inline std::vector<v1::ComputeRequest> TrainingScript(const std::string& head, const Batch& batch,
                                                      int64_t hidden_size,
                                                      int64_t rows_per_message) {
  std::vector<v1::ComputeRequest> script(1);
  *script.front().mutable_start() = StartFor(head, batch, hidden_size, true);
  const std::string rows = FloatBytes(batch.hidden);
  const size_t message_bytes = rows_per_message * hidden_size * sizeof(float);
  for (size_t offset = 0; offset < rows.size(); offset += message_bytes) {
    script.emplace_back();
    script.back().mutable_chunk()->set_hidden(rows.substr(offset, message_bytes));
  }
  return script;
}

// The engine's loss bound relative to the loss or, where training made the loss small next to the
// logits, to the largest logit: fp32 logits carry an error that scales with their magnitude.
inline bool LossMatches(double actual, const ReferenceResult& ref) {
  return std::abs(actual - ref.loss) <=
         kLossBound * std::max(std::abs(ref.loss), 1.0 + ref.max_abs_logit);
}

inline std::chrono::system_clock::time_point In(absl::Duration duration) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(duration);
}

// A channel with its own connection (gRPC shares connections between channels to one address
// unless told otherwise), so that dropping it closes that connection.
inline std::shared_ptr<grpc::Channel> PrivateChannel(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// What calls hold on the server now: workspace, gradient memory (the heads' accumulators plus the
// staging gradients of running training calls), scheduler slots and admitted bytes, and the idle
// call buffers kept for reuse.
struct CallResources {
  int64_t workspace_bytes = 0;
  int64_t gradient_bytes = 0;
  int running = 0;
  int queued = 0;
  int64_t admitted_bytes = 0;
  int64_t cache_bytes = 0;
};

inline CallResources ReadCallResources(server::LossServer& server) {
  return {server.ledger().current(MemoryPurpose::kWorkspace),
          server.ledger().current(MemoryPurpose::kGradients),
          server.scheduler().running(),
          server.scheduler().queued(),
          server.scheduler().admitted_bytes(),
          server.ledger().current(MemoryPurpose::kCache)};
}

// Whether the server comes to hold nothing for calls beyond the heads' accumulators
// (`accumulator_bytes`) and idle buffers within the compute budget. A call's server side may still
// be unwinding when its client sees the status (a cancelled client sees it at once), so this polls
// for up to kEventually.
inline ::testing::AssertionResult SettlesToIdle(server::LossServer& server,
                                                int64_t accumulator_bytes) {
  const absl::Time deadline = absl::Now() + kEventually;
  CallResources state;
  while (true) {
    state = ReadCallResources(server);
    if (state.workspace_bytes == 0 && state.gradient_bytes == accumulator_bytes &&
        state.running == 0 && state.queued == 0 && state.admitted_bytes == 0 &&
        state.cache_bytes <= server.scheduler().capacity_bytes() &&
        state.cache_bytes == server.buffers().idle_bytes()) {
      return ::testing::AssertionSuccess();
    }
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return ::testing::AssertionFailure()
         << "after " << kEventually << " the server still holds workspace " << state.workspace_bytes
         << " B, gradients " << state.gradient_bytes << " B (accumulators: " << accumulator_bytes
         << " B), running " << state.running << ", queued " << state.queued << ", admitted "
         << state.admitted_bytes << " B, idle buffers " << state.cache_bytes << " B (capacity "
         << server.scheduler().capacity_bytes() << " B)";
}

inline int64_t Total(const std::map<std::string, int64_t>& counts) {
  int64_t total = 0;
  for (const auto& [unused, count] : counts) total += count;
  return total;
}

// Engine chunks computed so far, from the compute-seconds histogram.
inline int64_t EngineChunksComputed(server::LossServer& server) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name == "lossd_compute_seconds") {
      return static_cast<int64_t>(family.metric.at(0).histogram.sample_count);
    }
  }
  return 0;
}

// The stream-level suites' server (stalls, pending memory, handler failures, the compute budget):
// one demo head, a 1 MiB workspace, two running slots.
inline constexpr char kStallHead[] = "stalled";
inline constexpr int64_t kStallVocab = 2000;
inline constexpr int64_t kStallHidden = 64;
// 128 rows per engine chunk of a training call under the 1 MiB workspace.
inline constexpr int64_t kStallRows = 480;
inline constexpr int64_t kStallRowsPerMessage = 20;

// A Compute stream on a connection of its own, written and read by the test.
class OpenStream {
 public:
  explicit OpenStream(int port, absl::Duration deadline = absl::Seconds(60))
      : OpenStream(PrivateChannel(port), deadline) {}
  // On `channel`'s connection, beside other streams.
  explicit OpenStream(std::shared_ptr<grpc::Channel> channel,
                      absl::Duration deadline = absl::Seconds(60))
      : channel_(std::move(channel)), stub_(v1::LossService::NewStub(channel_)) {
    context_.set_deadline(In(deadline));
    stream_ = stub_->Compute(&context_);
  }
  OpenStream(const OpenStream&) = delete;
  OpenStream& operator=(const OpenStream&) = delete;
  ~OpenStream() {
    if (finished_) return;
    context_.TryCancel();
    Finish();
  }

  bool Write(const v1::ComputeRequest& request) { return stream_->Write(request); }
  bool WritesDone() { return stream_->WritesDone(); }
  void Cancel() { context_.TryCancel(); }
  // Reads what is left, then the status.
  grpc::Status Finish() {
    v1::ComputeResponse response;
    while (stream_->Read(&response)) continue;
    finished_ = true;
    return stream_->Finish();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ComputeRequest, v1::ComputeResponse>> stream_;
  bool finished_ = false;
};

// A sample of one of the server's event metrics (counters, the in-flight gauge); 0 when absent.
inline double EventMetric(server::LossServer& server, const std::string& name,
                          const std::map<std::string, std::string>& labels = {}) {
  for (const prometheus::MetricFamily& family : server.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::map<std::string, std::string> have;
      for (const auto& label : metric.label) have[label.name] = label.value;
      bool match = true;
      for (const auto& [key, value] : labels) match = match && have[key] == value;
      if (match)
        return family.type == prometheus::MetricType::Gauge ? metric.gauge.value
                                                            : metric.counter.value;
    }
  }
  return 0.0;
}

inline server::ServerConfig StallConfig() {
  server::ServerConfig config;
  config.demo = {kStallHead, kStallVocab, kStallHidden, 11};
  config.workspace_budget_bytes = 1 << 20;
  config.max_running_calls = 2;
  return config;
}

}  // namespace lossd::testing

#endif  // LOSSD_TESTS_ROBUSTNESS_ROBUSTNESS_COMMON_H_
