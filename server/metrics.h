// Prometheus metrics of the service: one `lossd_` prefix, base units, `_total` counters.
// Event metrics are updated as requests run; state metrics (memory, queue, heads) are read at
// scrape time through a callback so that they are never stale.
#ifndef LOSSD_SERVER_METRICS_H_
#define LOSSD_SERVER_METRICS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

namespace lossd::server {

// The state gauges, read at scrape time; each one's name and help are written once, in
// metrics.cc, beside the event metrics'.
enum class StateGauge : int {
  kDeviceMemoryTotal,
  kDeviceMemoryUsed,
  kMemory,
  kMemoryPeak,
  kHostBuffer,
  kQueueDepth,
  kRunningCalls,
  kComputeBudget,
  kPendingMemory,
  kComputeAdmitted,
  kStepRendezvousWaiting,
  kSharedMemoryHandles,
  kSharedMemoryMappings,
  kSharedMemoryMappedBytes,
  kComputeSocketConnections,
  kHeadVersion,
  kHeadAccumulatedTokens,
  kHeadStagedGradients,
  kReplicaInfo,
  kBuildInfo,
};

// One gauge sample read at scrape time.
struct GaugeSample {
  StateGauge gauge;
  std::vector<std::pair<std::string, std::string>> labels;
  double value;
};

class Metrics {
 public:
  Metrics();

  // Called on every scrape; returns the current state gauges.
  void SetStateReader(std::function<std::vector<GaugeSample>()> reader);

  void RecordRequest(const std::string& method, const char* code, double seconds);
  void ObserveQueueSeconds(double seconds);
  void ObserveComputeSeconds(double seconds);
  void AddTokens(const std::string& kind, int64_t tokens);
  void AddBytesReceived(int64_t bytes);
  void AddBytesSent(int64_t bytes);
  // Bytes of fp32 logits ([tokens, vocabulary]) that the caller did not have to materialize.
  void AddLogitsBytesAvoided(int64_t bytes);
  void CountNonFiniteCall();
  void CountReplayedCall();
  void CountAdmissionRejected(const std::string& reason);
  void CountStep(const std::string& head);
  // Staged gradients dropped without a commit, by reason (StagedDropName).
  void CountStagedDropped(const std::string& reason, int count);
  // A collective step or norm, from its last rank's arrival to its outcome.
  void ObserveStepSeconds(double seconds);
  // Replicas: the wait for the others at a step, and an all-reduce of a gradient.
  void ObserveReplicaWait(double seconds);
  void ObserveAllReduce(double seconds, int64_t bytes);
  void AddInFlight(int delta);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  std::shared_ptr<prometheus::Collectable> state_collector() const { return state_collector_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> state_collector_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_seconds_;
  prometheus::Histogram& queue_seconds_;
  prometheus::Histogram& compute_seconds_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Counter& bytes_received_;
  prometheus::Counter& bytes_sent_;
  prometheus::Counter& logits_bytes_avoided_;
  prometheus::Counter& nonfinite_calls_;
  prometheus::Counter& replayed_calls_;
  prometheus::Family<prometheus::Counter>& admission_rejected_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Counter>& staged_dropped_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& replica_wait_seconds_;
  prometheus::Histogram& allreduce_seconds_;
  prometheus::Counter& allreduce_bytes_;
  prometheus::Gauge& in_flight_;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_METRICS_H_
