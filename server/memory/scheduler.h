// Admission of Compute calls to one device: a bounded queue in front of a memory budget.
// A call waits (without reading from its stream, so gRPC flow control pushes back on the client)
// until its workspace and staging bytes fit; it is refused at once when it could never fit or
// the queue is full, rather than buffered without limit. Before it is admitted, the host memory
// it holds counts against a server-wide bound (PendingMemory).
#ifndef LOSSD_SERVER_MEMORY_SCHEDULER_H_
#define LOSSD_SERVER_MEMORY_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <optional>

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd::server {

// Why a Compute call was refused admission (RESOURCE_EXHAUSTED), carried as a payload of its
// status so that code can act on it without reading the message.
enum class AdmissionRefusal : int {
  kQueueFull = 0,      // --max_queued_calls calls already wait
  kOverBudget = 1,     // the call alone needs more device memory than the compute budget
  kPendingMemory = 2,  // calls not yet admitted hold --pending_memory_mib of host memory (or
                       // one connection's calls its --pending_memory_per_connection_mib)
};

// The metric label of a refusal: queue_full, over_budget, pending_memory.
const char* AdmissionRefusalName(AdmissionRefusal refusal);
// `status` with `refusal` attached.
absl::Status WithAdmissionRefusal(absl::Status status, AdmissionRefusal refusal);
// The refusal attached to `status`, if any.
std::optional<AdmissionRefusal> AdmissionRefusalOf(const absl::Status& status);

class Scheduler;

// Holds a running slot and admitted bytes until destroyed. A call that waits for its client gives
// the slot and part of its bytes back meanwhile (Pause), and queues again to go on (Resume).
class Admission {
 public:
  Admission() = default;
  Admission(Admission&& other) noexcept { *this = std::move(other); }
  Admission& operator=(Admission&& other) noexcept;
  ~Admission() { Release(); }
  void Release();
  bool held() const { return scheduler_ != nullptr; }
  bool paused() const { return paused_bytes_ >= 0; }

  // Gives the running slot and all but `keep_bytes` of the admitted bytes back; the call must
  // use the device no more until Resume.
  void Pause(int64_t keep_bytes);
  // Waits, as Scheduler::Admit does (but never refused for a full queue), for a running slot and
  // the bytes Pause gave back.
  absl::Status Resume(const std::function<bool()>& cancelled, absl::Duration max_wait);

 private:
  friend class Scheduler;
  Admission(Scheduler* scheduler, int64_t bytes) : scheduler_(scheduler), bytes_(bytes) {}
  Scheduler* scheduler_ = nullptr;
  int64_t bytes_ = 0;
  int64_t paused_bytes_ = -1;  // while paused, the bytes given back; else -1
};

class Scheduler {
 public:
  Scheduler(int64_t capacity_bytes, int max_running, int max_queued);

  // Waits for `bytes` of the budget and a running slot. RESOURCE_EXHAUSTED (with its
  // AdmissionRefusal) when `bytes` exceeds the whole budget or the queue is full; CANCELLED when
  // `cancelled()` turns true while waiting; DEADLINE_EXCEEDED after `max_wait`.
  absl::StatusOr<Admission> Admit(int64_t bytes, const std::function<bool()>& cancelled,
                                  absl::Duration max_wait);

  // Changes the budget (it follows the heads when --compute_memory_mib is 0). Admitted calls keep
  // their bytes; waiting calls that no longer fit are refused.
  void SetCapacity(int64_t capacity_bytes);

  int queued() const;
  int running() const;
  int64_t capacity_bytes() const;
  int64_t admitted_bytes() const;

 private:
  friend class Admission;
  void Release(int64_t bytes, bool running_slot);
  // Waits for `bytes` and a running slot as Admit does; `queue_limited`: refused when the queue
  // is full.
  absl::Status Wait(int64_t bytes, const std::function<bool()>& cancelled, absl::Duration max_wait,
                    bool queue_limited);
  absl::Status OverBudget(int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_running_;
  const int max_queued_;
  mutable absl::Mutex mu_;
  int64_t capacity_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t admitted_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
};

class PendingMemory;

// Bytes a call holds against the PendingMemory bounds until destroyed or released.
class PendingCharge {
 public:
  PendingCharge() = default;
  PendingCharge(PendingCharge&& other) noexcept { *this = std::move(other); }
  PendingCharge& operator=(PendingCharge&& other) noexcept;
  ~PendingCharge() { Release(); }

  // Changes the charge to `bytes`: shrinking always succeeds, growing only within the bounds
  // (RESOURCE_EXHAUSTED with AdmissionRefusal::kPendingMemory otherwise, the charge unchanged).
  absl::Status Resize(int64_t bytes);
  void Release();
  int64_t bytes() const { return bytes_; }

 private:
  friend class PendingMemory;
  PendingCharge(PendingMemory* pending, std::string connection, int64_t bytes)
      : pending_(pending), connection_(std::move(connection)), bytes_(bytes) {}
  PendingMemory* pending_ = nullptr;
  std::string connection_;
  int64_t bytes_ = 0;
};

// Host memory held by Compute calls not yet admitted to the device: the start message while it
// is parsed, the per-token values copied out of it, rows read ahead. Bounded server-wide
// (--pending_memory_mib) so that calls waiting for their rows or for admission, up to
// --max_queued_calls of them and any number still sending, cannot hold memory without limit; and
// per client connection (--pending_memory_per_connection_mib), so that one client opening calls
// it never feeds cannot take all of it and refuse everyone else.
class PendingMemory {
 public:
  PendingMemory(int64_t capacity_bytes, int64_t per_connection_bytes)
      : capacity_bytes_(capacity_bytes), per_connection_bytes_(per_connection_bytes) {}

  // A charge of `bytes` for a call of `connection` (gRPC's peer address of the client), or
  // RESOURCE_EXHAUSTED with AdmissionRefusal::kPendingMemory when it does not fit beside what
  // other calls, or that connection's other calls, hold.
  absl::StatusOr<PendingCharge> Reserve(absl::string_view connection, int64_t bytes);

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t per_connection_bytes() const { return per_connection_bytes_; }
  int64_t held_bytes() const;
  int64_t held_bytes(absl::string_view connection) const;

 private:
  friend class PendingCharge;
  // Moves a charge of `connection` from `from` to `to` bytes, if it fits.
  absl::Status Change(const std::string& connection, int64_t from, int64_t to);

  const int64_t capacity_bytes_;
  const int64_t per_connection_bytes_;
  mutable absl::Mutex mu_;
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Only connections that hold something.
  absl::flat_hash_map<std::string, int64_t> held_by_connection_ ABSL_GUARDED_BY(mu_);
};

// A client connection's account at PendingMemory, as a call's row reader charges it.
struct PendingAccount {
  PendingMemory* memory = nullptr;  // null: nothing is counted
  std::string connection;

  absl::StatusOr<PendingCharge> Reserve(int64_t bytes) const {
    return memory->Reserve(connection, bytes);
  }
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_MEMORY_SCHEDULER_H_
