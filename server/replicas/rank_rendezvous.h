// The ranks of a data-parallel training job meeting on the server for one collective action on a
// head (a Step, a gradient norm): every rank sends its request, the last to arrive performs the
// action once, and every rank gets its outcome (proto RankGroup).
//
// A meeting is named by a key (the method, the head, the version the ranks trained on). Its
// outcome is kept for a while after it completes, so that a rank retrying a request whose answer
// it lost gets the same outcome instead of starting a second meeting, which would act twice.
//
// Failures end a meeting for every rank with ABORTED, and nothing acts:
// - a rank that has not arrived `wait` after the first one did (it died before the step, or
//   hangs);
// - a rank whose call is cancelled while it waits (its process died, or it gave up): the others
//   wait `grace` for it to come back (a retry), then fail.
// A failed meeting is remembered for `wait` too, so that ranks arriving late hear why at once;
// after that the same key can meet again (a job restarted from a checkpoint).
#ifndef LOSSD_SERVER_REPLICAS_RANK_RENDEZVOUS_H_
#define LOSSD_SERVER_REPLICAS_RANK_RENDEZVOUS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lossd::server {

struct RendezvousOptions {
  absl::Duration wait = absl::Seconds(300);  // for the last rank, from the first arrival
  absl::Duration grace = absl::Seconds(10);  // for a rank whose call was cancelled to come back
  absl::Duration poll = absl::Milliseconds(100);  // how often a waiting rank checks its call
  int max_kept = 256;                             // completed meetings kept for retries
};

class RankRendezvous {
 public:
  explicit RankRendezvous(RendezvousOptions options = {}) : options_(options) {}

  // Joins the meeting `key` of `world_size` ranks (one or more) as `rank`. `fingerprint` stands for
  // the request without its rank: ranks whose requests differ are refused (INVALID_ARGUMENT), as is
  // a world size other than the meeting's. `cancelled` tells whether this rank's call went away.
  // The last rank to arrive runs `action`; every rank returns its result.
  absl::StatusOr<std::string> Join(const std::string& key, int world_size, int rank,
                                   uint64_t fingerprint, absl::FunctionRef<bool()> cancelled,
                                   absl::FunctionRef<absl::StatusOr<std::string>()> action);

  // Meetings waiting for ranks now (a gauge).
  int waiting_meetings() const;

  // Ends every meeting still waiting for ranks with `status` (the server is going away).
  void FailWaiting(const absl::Status& status);

 private:
  struct Meeting {
    int world_size = 0;
    uint64_t fingerprint = 0;
    std::vector<bool> present;  // by rank: arrived and not cancelled since
    std::vector<bool> left;     // by rank: its call was cancelled while it waited
    int present_count = 0;
    int left_count = 0;
    absl::Time first_arrival;
    absl::Time deadline;         // the wait, or sooner after a cancellation
    std::string missing_reason;  // why the deadline was brought forward
    bool done = false;
    absl::StatusOr<std::string> result = std::string();
    absl::Time done_at;
  };
  // Removes completed meetings past their keeping time, and the oldest beyond max_kept.
  void Forget(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::string Missing(const Meeting& meeting);

  const RendezvousOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Meeting>> meetings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_REPLICAS_RANK_RENDEZVOUS_H_
