// Collective on Gloo's TCP transport, the engine torch.distributed uses between CPUs: ring
// all-reduce (each element added up by one replica and copied to the others), broadcast, barrier.
#ifndef LOSSD_SERVER_REPLICAS_GLOO_COLLECTIVE_H_
#define LOSSD_SERVER_REPLICAS_GLOO_COLLECTIVE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/replicas/collective.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace lossd::server {

class GlooCollective final : public Collective {
 public:
  // Connects replica `rank` of `size` with the others: each one publishes the address it listens
  // on (a free TCP port on `local_host`, an address of this host the others can reach) in
  // `store`, which every replica shares, and connects to theirs. Waits up to `timeout` for all of
  // them. Gloo's failures come back as UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<GlooCollective>> Connect(gloo::rendezvous::Store& store,
                                                                 int rank, int size,
                                                                 const std::string& local_host,
                                                                 absl::Duration timeout);
  ~GlooCollective() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduceSum(absl::Span<float> values, absl::Duration timeout) override;
  absl::Status AllReduceSum(absl::Span<double> values, absl::Duration timeout) override;
  absl::Status AllReduceMax(absl::Span<double> values, absl::Duration timeout) override;
  absl::Status Broadcast(absl::Span<uint8_t> bytes, int root, absl::Duration timeout) override;
  absl::Status Barrier(absl::Duration timeout) override;
  absl::Status broken() const override;

 private:
  GlooCollective(int rank, int size) : rank_(rank), size_(size) {}
  // Runs `op(tag)`, one operation at a time, turning what Gloo throws into a status that breaks
  // the group; refuses at once once it is broken.
  template <typename Op>
  absl::Status Run(absl::string_view what, Op&& op);
  // An all-reduce of `values` with Gloo's element-wise `reduce`.
  template <typename T>
  absl::Status AllReduce(absl::string_view what, absl::Span<T> values,
                         void (*reduce)(void*, const void*, const void*, size_t),
                         absl::Duration timeout);

  const int rank_;
  const int size_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  mutable absl::Mutex mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_REPLICAS_GLOO_COLLECTIVE_H_
