// Admission of Compute calls to one device: a bounded queue in front of a memory budget.
// A call waits (without reading from its stream, so gRPC flow control pushes back on the client)
// until its workspace and staging bytes fit; it is refused at once when it could never fit or
// the queue is full, rather than buffered without limit.
#ifndef LOSSD_SERVER_SCHEDULER_H_
#define LOSSD_SERVER_SCHEDULER_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd::server {

class Scheduler;

// Holds admitted bytes until destroyed.
class Admission {
 public:
  Admission() = default;
  Admission(Admission&& other) noexcept { *this = std::move(other); }
  Admission& operator=(Admission&& other) noexcept;
  ~Admission() { Release(); }
  void Release();

 private:
  friend class Scheduler;
  Admission(Scheduler* scheduler, int64_t bytes) : scheduler_(scheduler), bytes_(bytes) {}
  Scheduler* scheduler_ = nullptr;
  int64_t bytes_ = 0;
};

class Scheduler {
 public:
  Scheduler(int64_t capacity_bytes, int max_running, int max_queued);

  // Waits for `bytes` of the budget and a running slot. RESOURCE_EXHAUSTED when `bytes` exceeds
  // the whole budget or the queue is full; CANCELLED when `cancelled()` turns true while waiting;
  // DEADLINE_EXCEEDED after `max_wait`.
  absl::StatusOr<Admission> Admit(int64_t bytes, const std::function<bool()>& cancelled,
                                  absl::Duration max_wait);

  int queued() const;
  int running() const;
  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t admitted_bytes() const;

 private:
  friend class Admission;
  void Release(int64_t bytes);

  const int64_t capacity_bytes_;
  const int max_running_;
  const int max_queued_;
  mutable absl::Mutex mu_;
  int64_t admitted_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SCHEDULER_H_
