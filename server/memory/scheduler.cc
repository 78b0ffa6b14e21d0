#include "server/memory/scheduler.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {
namespace {

constexpr char kAdmissionRefusalUrl[] = "type.lossd/lossd.server.AdmissionRefusal";

}  // namespace

const char* AdmissionRefusalName(AdmissionRefusal refusal) {
  switch (refusal) {
    case AdmissionRefusal::kQueueFull: return "queue_full";
    case AdmissionRefusal::kOverBudget: return "over_budget";
    case AdmissionRefusal::kPendingMemory: return "pending_memory";
  }
  return "unknown";
}

absl::Status WithAdmissionRefusal(absl::Status status, AdmissionRefusal refusal) {
  status.SetPayload(kAdmissionRefusalUrl, absl::Cord(std::to_string(static_cast<int>(refusal))));
  return status;
}

std::optional<AdmissionRefusal> AdmissionRefusalOf(const absl::Status& status) {
  const absl::optional<absl::Cord> payload = status.GetPayload(kAdmissionRefusalUrl);
  if (!payload.has_value()) return std::nullopt;
  for (AdmissionRefusal refusal : {AdmissionRefusal::kQueueFull, AdmissionRefusal::kOverBudget,
                                   AdmissionRefusal::kPendingMemory}) {
    if (*payload == std::to_string(static_cast<int>(refusal))) return refusal;
  }
  return std::nullopt;
}

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    Release();
    scheduler_ = std::exchange(other.scheduler_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    paused_bytes_ = std::exchange(other.paused_bytes_, -1);
  }
  return *this;
}

void Admission::Release() {
  if (scheduler_ != nullptr) {
    // Paused, the slot and the paused bytes are back already; the kept bytes are not.
    if (paused()) {
      scheduler_->Release(bytes_ - paused_bytes_, /*running_slot=*/false);
    } else {
      scheduler_->Release(bytes_, /*running_slot=*/true);
    }
  }
  scheduler_ = nullptr;
  bytes_ = 0;
  paused_bytes_ = -1;
}

void Admission::Pause(int64_t keep_bytes) {
  if (scheduler_ == nullptr || paused()) return;
  paused_bytes_ = bytes_ - std::min(keep_bytes, bytes_);
  scheduler_->Release(paused_bytes_, /*running_slot=*/true);
}

absl::Status Admission::Resume(const std::function<bool()>& cancelled, absl::Duration max_wait) {
  if (scheduler_ == nullptr || !paused()) return absl::OkStatus();
  RETURN_IF_ERROR(scheduler_->Wait(paused_bytes_, cancelled, max_wait, /*queue_limited=*/false));
  paused_bytes_ = -1;
  return absl::OkStatus();
}

Scheduler::Scheduler(int64_t capacity_bytes, int max_running, int max_queued)
    : max_running_(max_running), max_queued_(max_queued), capacity_bytes_(capacity_bytes) {}

absl::Status Scheduler::OverBudget(int64_t bytes) const {
  return WithAdmissionRefusal(absl::ResourceExhaustedError(absl::StrCat(
                                  "call needs ", bytes,
                                  " bytes of device memory (workspace and staging gradient); the "
                                  "server's compute budget is ",
                                  capacity_bytes_, " bytes")),
                              AdmissionRefusal::kOverBudget);
}

absl::StatusOr<Admission> Scheduler::Admit(int64_t bytes, const std::function<bool()>& cancelled,
                                           absl::Duration max_wait) {
  RETURN_IF_ERROR(Wait(bytes, cancelled, max_wait, /*queue_limited=*/true));
  return Admission(this, bytes);
}

absl::Status Scheduler::Wait(int64_t bytes, const std::function<bool()>& cancelled,
                             absl::Duration max_wait, bool queue_limited) {
  absl::MutexLock lock(&mu_);
  if (bytes > capacity_bytes_) return OverBudget(bytes);
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ < max_running_ && admitted_bytes_ + bytes <= capacity_bytes_;
  };
  if (!fits()) {
    if (queue_limited && queued_ >= max_queued_) {
      return WithAdmissionRefusal(
          absl::ResourceExhaustedError(absl::StrCat("admission queue is full (", max_queued_,
                                                    " calls waiting); retry later")),
          AdmissionRefusal::kQueueFull);
    }
    ++queued_;
    const absl::Time deadline = absl::Now() + max_wait;
    // Wake up periodically to notice a cancelled call: it must leave the queue promptly.
    while (!fits()) {
      mu_.AwaitWithTimeout(absl::Condition(&fits), absl::Milliseconds(50));
      if (fits()) break;
      if (bytes > capacity_bytes_) {
        --queued_;
        return OverBudget(bytes);
      }
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
  return absl::OkStatus();
}

void Scheduler::SetCapacity(int64_t capacity_bytes) {
  absl::MutexLock lock(&mu_);
  capacity_bytes_ = capacity_bytes;
}

void Scheduler::Release(int64_t bytes, bool running_slot) {
  absl::MutexLock lock(&mu_);
  if (running_slot) --running_;
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

int64_t Scheduler::capacity_bytes() const {
  absl::MutexLock lock(&mu_);
  return capacity_bytes_;
}

int64_t Scheduler::admitted_bytes() const {
  absl::MutexLock lock(&mu_);
  return admitted_bytes_;
}

PendingCharge& PendingCharge::operator=(PendingCharge&& other) noexcept {
  if (this != &other) {
    Release();
    pending_ = std::exchange(other.pending_, nullptr);
    connection_ = std::move(other.connection_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status PendingCharge::Resize(int64_t bytes) {
  if (pending_ == nullptr) return absl::FailedPreconditionError("resizing a released charge");
  RETURN_IF_ERROR(pending_->Change(connection_, bytes_, bytes));
  bytes_ = bytes;
  return absl::OkStatus();
}

void PendingCharge::Release() {
  // Shrinking cannot fail.
  if (pending_ != nullptr) pending_->Change(connection_, bytes_, 0).IgnoreError();
  pending_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<PendingCharge> PendingMemory::Reserve(absl::string_view connection, int64_t bytes) {
  std::string key(connection);
  RETURN_IF_ERROR(Change(key, 0, bytes));
  return PendingCharge(this, std::move(key), bytes);
}

absl::Status PendingMemory::Change(const std::string& connection, int64_t from, int64_t to) {
  absl::MutexLock lock(&mu_);
  const int64_t others = held_bytes_ - from;
  const auto held = held_by_connection_.find(connection);
  const int64_t connection_others = (held == held_by_connection_.end() ? 0 : held->second) - from;
  if (to > from) {
    const auto refuse = [to](absl::string_view whose, int64_t capacity, absl::string_view flag,
                             int64_t held_now) {
      const std::string now =
          held_now > 0 ? absl::StrCat("; they hold ", held_now, " bytes now, retry later") : "";
      return WithAdmissionRefusal(
          absl::ResourceExhaustedError(
              absl::StrCat("pending memory: the call needs ", to,
                           " bytes of host memory until it is admitted "
                           "(start message, per-token values, rows read ahead); ",
                           whose, " may hold ", capacity, " bytes together (", flag, ")", now)),
          AdmissionRefusal::kPendingMemory);
    };
    if (others + to > capacity_bytes_) {
      return refuse("calls not yet admitted", capacity_bytes_, "--pending_memory_mib", others);
    }
    if (connection_others + to > per_connection_bytes_) {
      return refuse("one client connection's calls not yet admitted", per_connection_bytes_,
                    "--pending_memory_per_connection_mib", connection_others);
    }
  }
  held_bytes_ = others + to;
  if (connection_others + to > 0) {
    held_by_connection_[connection] = connection_others + to;
  } else if (held != held_by_connection_.end()) {
    held_by_connection_.erase(held);
  }
  return absl::OkStatus();
}

int64_t PendingMemory::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

int64_t PendingMemory::held_bytes(absl::string_view connection) const {
  absl::MutexLock lock(&mu_);
  const auto held = held_by_connection_.find(connection);
  return held == held_by_connection_.end() ? 0 : held->second;
}

}  // namespace lossd::server
