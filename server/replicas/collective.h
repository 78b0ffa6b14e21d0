// Collective operations across the replicas of a training group (--replicas): what a step over
// several servers needs, behind an interface so that another engine (NCCL between GPUs) can
// replace Gloo's TCP transport without the step's code changing.
//
// Every replica must call the same operations in the same order: each operation carries the
// group's sequence number as its tag, so that replicas out of step wait for each other (and time
// out) instead of mixing data. Operations run one at a time per replica.
//
// A failed operation (a replica gone, a timeout) leaves the group broken: its buffers hold
// nothing to rely on, and every later operation fails at once, naming the first failure. The
// replica then has to leave the group (ReplicaGroup ends it for all).
#ifndef LOSSD_SERVER_REPLICAS_COLLECTIVE_H_
#define LOSSD_SERVER_REPLICAS_COLLECTIVE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace lossd::server {

class Collective {
 public:
  virtual ~Collective() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Element-wise sums over the replicas, left in `values` on every replica with the same bits on
  // each (every element is added up by one replica and copied to the others).
  virtual absl::Status AllReduceSum(absl::Span<float> values, absl::Duration timeout) = 0;
  virtual absl::Status AllReduceSum(absl::Span<double> values, absl::Duration timeout) = 0;
  // Element-wise maxima over the replicas (max of -x gives the minimum).
  virtual absl::Status AllReduceMax(absl::Span<double> values, absl::Duration timeout) = 0;
  // Replica `root`'s bytes into every replica's `bytes` (the same size everywhere).
  virtual absl::Status Broadcast(absl::Span<uint8_t> bytes, int root, absl::Duration timeout) = 0;
  // Returns once every replica has called it.
  virtual absl::Status Barrier(absl::Duration timeout) = 0;

  // OK, or the failure that broke the group.
  virtual absl::Status broken() const = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_REPLICAS_COLLECTIVE_H_
