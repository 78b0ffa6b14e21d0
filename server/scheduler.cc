#include "server/scheduler.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd::server {

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    Release();
    scheduler_ = std::exchange(other.scheduler_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Admission::Release() {
  if (scheduler_ != nullptr) scheduler_->Release(bytes_);
  scheduler_ = nullptr;
  bytes_ = 0;
}

Scheduler::Scheduler(int64_t capacity_bytes, int max_running, int max_queued)
    : capacity_bytes_(capacity_bytes), max_running_(max_running), max_queued_(max_queued) {}

absl::StatusOr<Admission> Scheduler::Admit(int64_t bytes, const std::function<bool()>& cancelled,
                                           absl::Duration max_wait) {
  if (bytes > capacity_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("call needs ", bytes, " bytes of device memory (workspace and staging "
                     "gradient); the server's compute budget is ", capacity_bytes_, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ < max_running_ && admitted_bytes_ + bytes <= capacity_bytes_;
  };
  if (!fits()) {
    if (queued_ >= max_queued_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("admission queue is full (", max_queued_, " calls waiting); retry later"));
    }
    ++queued_;
    const absl::Time deadline = absl::Now() + max_wait;
    // Wake up periodically to notice a cancelled call: it must leave the queue promptly.
    while (!fits()) {
      mu_.AwaitWithTimeout(absl::Condition(&fits), absl::Milliseconds(50));
      if (fits()) break;
      if (cancelled()) {
        --queued_;
        return absl::CancelledError("call cancelled while waiting for admission");
      }
      if (absl::Now() >= deadline) {
        --queued_;
        return absl::DeadlineExceededError(
            absl::StrCat("waited ", absl::FormatDuration(max_wait), " for admission"));
      }
    }
    --queued_;
  }
  ++running_;
  admitted_bytes_ += bytes;
  return Admission(this, bytes);
}

void Scheduler::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  --running_;
  admitted_bytes_ -= bytes;
}

int Scheduler::queued() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

int Scheduler::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int64_t Scheduler::admitted_bytes() const {
  absl::MutexLock lock(&mu_);
  return admitted_bytes_;
}

}  // namespace lossd::server
