#include "server/metrics.h"

#include <iterator>
#include <map>
#include <mutex>
#include <utility>

namespace lossd::server {
namespace {

// Seconds from 1 ms to 2 minutes: a scoring call of a few tokens up to a long training batch.
const prometheus::Histogram::BucketBoundaries kSecondsBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};

// Name and help of each StateGauge, in the enum's order.
struct StateGaugeInfo {
  StateGauge gauge;
  const char* name;
  const char* help;
};
constexpr StateGaugeInfo kStateGauges[] = {
    {StateGauge::kDeviceMemoryTotal, "lossd_device_memory_total_bytes",
     "Memory of the compute device (host RAM for the CPU backend)."},
    {StateGauge::kDeviceMemoryUsed, "lossd_device_memory_used_bytes",
     "Memory in use by all processes: host RAM for the CPU backend, else device memory from the "
     "driver."},
    {StateGauge::kMemory, "lossd_memory_bytes", "Memory the server holds now, by purpose."},
    {StateGauge::kMemoryPeak, "lossd_memory_peak_bytes",
     "Most memory the server has held, by purpose."},
    {StateGauge::kHostBuffer, "lossd_host_buffer_bytes",
     "Host memory of calls' rows and dL/dh sent in messages: held by running calls, or kept idle "
     "for the next."},
    {StateGauge::kQueueDepth, "lossd_queue_depth", "Compute calls waiting for admission."},
    {StateGauge::kRunningCalls, "lossd_running_calls", "Compute calls admitted to the device."},
    {StateGauge::kComputeBudget, "lossd_compute_budget_bytes",
     "Device memory the scheduler admits calls against."},
    {StateGauge::kPendingMemory, "lossd_pending_memory_bytes",
     "Host memory held by Compute calls not yet admitted (start messages, per-token values, rows "
     "read ahead)."},
    {StateGauge::kComputeAdmitted, "lossd_compute_admitted_bytes",
     "Device memory admitted calls hold now."},
    {StateGauge::kStepRendezvousWaiting, "lossd_step_rendezvous_waiting",
     "Collective steps (and gradient norms) waiting for their last rank."},
    {StateGauge::kSharedMemoryHandles, "lossd_shared_memory_handles",
     "Clients' memfds handed over and not yet revoked."},
    {StateGauge::kSharedMemoryMappings, "lossd_shared_memory_mappings",
     "Ranges of clients' memfds mapped now (by running calls, or kept idle)."},
    {StateGauge::kSharedMemoryMappedBytes, "lossd_shared_memory_mapped_bytes",
     "Bytes of clients' memfds mapped now; client memory, outside lossd_memory_bytes."},
    {StateGauge::kComputeSocketConnections, "lossd_compute_socket_connections",
     "Connections open on the Compute socket, between calls or carrying one."},
    {StateGauge::kHeadVersion, "lossd_head_version",
     "Version of each head; grows with every step or upload."},
    {StateGauge::kHeadAccumulatedTokens, "lossd_head_accumulated_tokens",
     "Tokens in each head's gradient accumulator since it was last zeroed."},
    {StateGauge::kHeadStagedGradients, "lossd_head_staged_gradients",
     "dL/dW of calls staged on each head, waiting for their commit."},
    {StateGauge::kReplicaInfo, "lossd_replica_info",
     "Constant 1, labelled with this server's rank in its replica group and the group's size (0 of "
     "1 for a server alone)."},
    {StateGauge::kBuildInfo, "lossd_build_info",
     "Constant 1, labelled with the version and backend."},
};
constexpr bool InEnumOrder() {
  for (size_t i = 0; i < std::size(kStateGauges); ++i) {
    if (static_cast<size_t>(kStateGauges[i].gauge) != i) return false;
  }
  return std::size(kStateGauges) == static_cast<size_t>(StateGauge::kBuildInfo) + 1;
}
static_assert(InEnumOrder());

class StateCollector : public prometheus::Collectable {
 public:
  void SetReader(std::function<std::vector<GaugeSample>()> reader) {
    std::lock_guard<std::mutex> lock(mu_);
    reader_ = std::move(reader);
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<GaugeSample> samples;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reader_) samples = reader_();
    }
    // Samples of one name form one family, in first-seen order.
    std::vector<prometheus::MetricFamily> families;
    std::map<std::string, size_t> index;
    for (GaugeSample& s : samples) {
      const StateGaugeInfo& info = kStateGauges[static_cast<int>(s.gauge)];
      auto [it, inserted] = index.emplace(info.name, families.size());
      if (inserted) {
        prometheus::MetricFamily family;
        family.name = info.name;
        family.help = info.help;
        family.type = prometheus::MetricType::Gauge;
        families.push_back(std::move(family));
      }
      prometheus::ClientMetric metric;
      for (auto& [key, value] : s.labels) metric.label.push_back({key, value});
      metric.gauge.value = s.value;
      families[it->second].metric.push_back(std::move(metric));
    }
    return families;
  }

 private:
  mutable std::mutex mu_;
  std::function<std::vector<GaugeSample>()> reader_;
};

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      state_collector_(std::make_shared<StateCollector>()),
      requests_(prometheus::BuildCounter()
                    .Name("lossd_requests_total")
                    .Help("Finished RPCs by method and gRPC status code.")
                    .Register(*registry_)),
      request_seconds_(prometheus::BuildHistogram()
                           .Name("lossd_request_seconds")
                           .Help("Wall time of RPCs from first byte to status, by method.")
                           .Register(*registry_)),
      queue_seconds_(prometheus::BuildHistogram()
                         .Name("lossd_queue_seconds")
                         .Help("Time Compute calls waited for admission to the device.")
                         .Register(*registry_)
                         .Add({}, kSecondsBuckets)),
      compute_seconds_(prometheus::BuildHistogram()
                           .Name("lossd_compute_seconds")
                           .Help("Time Compute calls spent inside the engine.")
                           .Register(*registry_)
                           .Add({}, kSecondsBuckets)),
      tokens_(prometheus::BuildCounter()
                  .Name("lossd_tokens_total")
                  .Help("Tokens (rows of hidden states) processed, by kind of call.")
                  .Register(*registry_)),
      bytes_received_(prometheus::BuildCounter()
                          .Name("lossd_received_bytes_total")
                          .Help("Tensor payload bytes received from clients.")
                          .Register(*registry_)
                          .Add({})),
      bytes_sent_(prometheus::BuildCounter()
                      .Name("lossd_sent_bytes_total")
                      .Help("Tensor and result payload bytes sent to clients.")
                      .Register(*registry_)
                      .Add({})),
      logits_bytes_avoided_(prometheus::BuildCounter()
                                .Name("lossd_logits_bytes_avoided_total")
                                .Help("Bytes of fp32 [tokens x vocabulary] logits that clients did "
                                      "not have to materialize.")
                                .Register(*registry_)
                                .Add({})),
      nonfinite_calls_(prometheus::BuildCounter()
                           .Name("lossd_nonfinite_calls_total")
                           .Help("Compute calls refused for NaN or Inf: in the logits, in the "
                                 "call's dL/dW, or in its sum with the accumulated gradient.")
                           .Register(*registry_)
                           .Add({})),
      replayed_calls_(prometheus::BuildCounter()
                          .Name("lossd_replayed_calls_total")
                          .Help("Compute calls that repeated a call_id whose dL/dW was already "
                                "accumulated: computed again, nothing added (client retries).")
                          .Register(*registry_)
                          .Add({})),
      admission_rejected_(prometheus::BuildCounter()
                              .Name("lossd_admission_rejected_total")
                              .Help("Compute calls refused admission, by reason.")
                              .Register(*registry_)),
      steps_(prometheus::BuildCounter()
                 .Name("lossd_optimizer_steps_total")
                 .Help("Optimizer steps applied, by head.")
                 .Register(*registry_)),
      staged_dropped_(prometheus::BuildCounter()
                          .Name("lossd_staged_gradients_dropped_total")
                          .Help("Staged dL/dW dropped without a commit, by reason: discarded, "
                                "expired (a backward that never ran), head_moved.")
                          .Register(*registry_)),
      step_seconds_(prometheus::BuildHistogram()
                        .Name("lossd_step_seconds")
                        .Help("Time of collective steps and gradient norms from their last "
                              "rank's arrival: waiting for the other replicas, the all-reduce "
                              "of the gradient, the update.")
                        .Register(*registry_)
                        .Add({}, kSecondsBuckets)),
      replica_wait_seconds_(prometheus::BuildHistogram()
                                .Name("lossd_replica_wait_seconds")
                                .Help("Time a step or gradient norm waited for the other "
                                      "replicas of the group to reach it.")
                                .Register(*registry_)
                                .Add({}, kSecondsBuckets)),
      allreduce_seconds_(prometheus::BuildHistogram()
                             .Name("lossd_replica_allreduce_seconds")
                             .Help("Time of all-reduces of a head's gradient across the "
                                   "replicas.")
                             .Register(*registry_)
                             .Add({}, kSecondsBuckets)),
      allreduce_bytes_(prometheus::BuildCounter()
                           .Name("lossd_replica_allreduce_bytes_total")
                           .Help("Bytes of gradient all-reduced across the replicas.")
                           .Register(*registry_)
                           .Add({})),
      in_flight_(prometheus::BuildGauge()
                     .Name("lossd_inflight_calls")
                     .Help("RPCs being served now.")
                     .Register(*registry_)
                     .Add({})) {}

void Metrics::SetStateReader(std::function<std::vector<GaugeSample>()> reader) {
  static_cast<StateCollector&>(*state_collector_).SetReader(std::move(reader));
}

void Metrics::RecordRequest(const std::string& method, const char* code, double seconds) {
  requests_.Add({{"method", method}, {"code", code}}).Increment();
  request_seconds_.Add({{"method", method}}, kSecondsBuckets).Observe(seconds);
}

void Metrics::ObserveQueueSeconds(double seconds) { queue_seconds_.Observe(seconds); }
void Metrics::ObserveComputeSeconds(double seconds) { compute_seconds_.Observe(seconds); }

void Metrics::AddTokens(const std::string& kind, int64_t tokens) {
  tokens_.Add({{"kind", kind}}).Increment(static_cast<double>(tokens));
}

void Metrics::AddBytesReceived(int64_t bytes) {
  bytes_received_.Increment(static_cast<double>(bytes));
}
void Metrics::AddBytesSent(int64_t bytes) { bytes_sent_.Increment(static_cast<double>(bytes)); }
void Metrics::AddLogitsBytesAvoided(int64_t bytes) {
  logits_bytes_avoided_.Increment(static_cast<double>(bytes));
}
void Metrics::CountNonFiniteCall() { nonfinite_calls_.Increment(); }
void Metrics::CountReplayedCall() { replayed_calls_.Increment(); }
void Metrics::CountAdmissionRejected(const std::string& reason) {
  admission_rejected_.Add({{"reason", reason}}).Increment();
}
void Metrics::CountStep(const std::string& head) { steps_.Add({{"head", head}}).Increment(); }
void Metrics::CountStagedDropped(const std::string& reason, int count) {
  staged_dropped_.Add({{"reason", reason}}).Increment(count);
}
void Metrics::ObserveStepSeconds(double seconds) { step_seconds_.Observe(seconds); }
void Metrics::ObserveReplicaWait(double seconds) { replica_wait_seconds_.Observe(seconds); }
void Metrics::ObserveAllReduce(double seconds, int64_t bytes) {
  allreduce_seconds_.Observe(seconds);
  allreduce_bytes_.Increment(static_cast<double>(bytes));
}
void Metrics::AddInFlight(int delta) { in_flight_.Increment(delta); }

}  // namespace lossd::server
