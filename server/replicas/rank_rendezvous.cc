#include "server/replicas/rank_rendezvous.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {

std::string RankRendezvous::Missing(const Meeting& meeting) {
  std::vector<int> missing;
  for (int r = 0; r < meeting.world_size; ++r) {
    if (!meeting.present[r]) missing.push_back(r);
  }
  return absl::StrJoin(missing, ", ");
}

void RankRendezvous::Forget(absl::Time now) {
  std::vector<std::pair<absl::Time, std::string>> done;
  for (auto it = meetings_.begin(); it != meetings_.end();) {
    const Meeting& m = *it->second;
    // A failure is kept as long as a late rank could still arrive for it; an outcome longer, for
    // retries, within max_kept.
    if (m.done && !m.result.ok() && now - m.done_at > options_.wait) {
      it = meetings_.erase(it);
      continue;
    }
    if (m.done) done.emplace_back(m.done_at, it->first);
    ++it;
  }
  if (static_cast<int>(done.size()) <= options_.max_kept) return;
  std::sort(done.begin(), done.end());
  for (size_t i = 0; i + options_.max_kept < done.size(); ++i) meetings_.erase(done[i].second);
}

absl::StatusOr<std::string> RankRendezvous::Join(
    const std::string& key, int world_size, int rank, uint64_t fingerprint,
    absl::FunctionRef<bool()> cancelled, absl::FunctionRef<absl::StatusOr<std::string>()> action) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("ranks.rank: expected 0 to ", world_size - 1,
                                                   " of ranks.world_size ", world_size, ", got ",
                                                   rank));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  Forget(now);
  std::shared_ptr<Meeting>& slot = meetings_[key];
  if (slot == nullptr) {
    slot = std::make_shared<Meeting>();
    slot->world_size = world_size;
    slot->fingerprint = fingerprint;
    slot->present.assign(world_size, false);
    slot->left.assign(world_size, false);
    slot->first_arrival = now;
    slot->deadline = now + options_.wait;
  }
  std::shared_ptr<Meeting> meeting = slot;
  if (meeting->world_size != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("ranks.world_size: ", world_size,
                                                   ", where the other ranks of this step (", key,
                                                   ") sent ", meeting->world_size));
  }
  if (meeting->fingerprint != fingerprint) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request of rank ", rank, " differs from the other ranks' of this step (",
                     key, "): every rank must send the same optimizer, options and version"));
  }
  if (meeting->done) return meeting->result;  // a retry, or a late rank of a failed meeting
  if (!meeting->present[rank]) {
    meeting->present[rank] = true;
    ++meeting->present_count;
    if (meeting->left[rank]) {
      meeting->left[rank] = false;
      if (--meeting->left_count == 0) {
        // Every rank that left came back (their clients retried): the meeting waits as long as
        // it would have.
        meeting->missing_reason.clear();
        meeting->deadline = meeting->first_arrival + options_.wait;
      }
    }
  }
  if (meeting->present_count == world_size) {
    // The last rank acts, outside the lock: a step takes as long as a pass over W.
    mu_.Unlock();
    absl::StatusOr<std::string> result = action();
    mu_.Lock();
    meeting->result = std::move(result);
    meeting->done = true;
    meeting->done_at = absl::Now();
    return meeting->result;
  }
  while (!meeting->done) {
    const absl::Time now_waiting = absl::Now();
    if (now_waiting >= meeting->deadline) {
      const std::string reason =
          meeting->missing_reason.empty()
              ? absl::StrCat("did not arrive within ", absl::FormatDuration(options_.wait),
                             " (--step_wait_seconds) of the first")
              : meeting->missing_reason;
      meeting->result = absl::AbortedError(absl::StrCat(
          key, ": rank(s) ", Missing(*meeting), " of ", world_size, " ", reason,
          "; nothing was applied. Restart the job's ranks (from the last checkpoint)"));
      meeting->done = true;
      meeting->done_at = now_waiting;
      break;
    }
    if (cancelled()) {
      meeting->present[rank] = false;
      --meeting->present_count;
      meeting->left[rank] = true;
      ++meeting->left_count;
      meeting->missing_reason =
          absl::StrCat("left (its call was cancelled) and did not come back within ",
                       absl::FormatDuration(options_.grace));
      meeting->deadline = std::min(meeting->deadline, now_waiting + options_.grace);
      return absl::CancelledError(absl::StrCat(key, ": rank ", rank, "'s call was cancelled"));
    }
    mu_.AwaitWithDeadline(absl::Condition(&meeting->done),
                          std::min(meeting->deadline, now_waiting + options_.poll));
  }
  return meeting->result;
}

void RankRendezvous::FailWaiting(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto& [unused, meeting] : meetings_) {
    if (meeting->done || meeting->present_count == meeting->world_size) continue;
    meeting->result = status;
    meeting->done = true;
    meeting->done_at = now;
  }
}

int RankRendezvous::waiting_meetings() const {
  absl::MutexLock lock(&mu_);
  int waiting = 0;
  for (const auto& [unused, meeting] : meetings_) waiting += meeting->done ? 0 : 1;
  return waiting;
}

}  // namespace lossd::server
