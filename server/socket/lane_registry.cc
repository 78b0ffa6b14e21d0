#include "server/socket/lane_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {

LaneRegistry::Loan::Loan(LaneRegistry& registry, std::string id, std::shared_ptr<Meeting> meeting,
                         std::vector<wire::SocketConnection*> connections)
    : registry_(registry),
      id_(std::move(id)),
      meeting_(std::move(meeting)),
      connections_(std::move(connections)) {}

LaneRegistry::Loan::~Loan() { Return(false); }

void LaneRegistry::Loan::Return(bool reusable) {
  if (returned_) return;
  returned_ = true;
  absl::MutexLock lock(&registry_.mu_);
  registry_.Finish(id_, *meeting_, reusable);
}

namespace {

absl::Status CheckCallKey(absl::string_view field, absl::string_view key) {
  if (key.size() < wire::kComputeSocketMinCallKeyBytes ||
      key.size() > wire::kComputeSocketMaxCallKeyBytes) {
    return InvalidField(field,
                        absl::StrCat(wire::kComputeSocketMinCallKeyBytes, " to ",
                                     wire::kComputeSocketMaxCallKeyBytes, " random bytes"),
                        absl::StrCat(key.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaneRegistry::CheckLanes(const v1::ComputeSocketLanes& lanes) {
  RETURN_IF_ERROR(CheckCallKey("lanes.call_key", lanes.call_key()));
  if (lanes.lanes() < 2 || lanes.lanes() > wire::kComputeSocketMaxLanes) {
    return InvalidField(
        "lanes.lanes",
        absl::StrCat("2 to ", wire::kComputeSocketMaxLanes, " connections (lane 0 counted)"),
        absl::StrCat(lanes.lanes()));
  }
  return absl::OkStatus();
}

absl::Status LaneRegistry::CheckJoin(const v1::ComputeSocketJoin& join) {
  RETURN_IF_ERROR(CheckCallKey("join.call_key", join.call_key()));
  if (join.lane() < 1 || join.lane() >= wire::kComputeSocketMaxLanes) {
    return InvalidField("join.lane", absl::StrCat("1 to ", wire::kComputeSocketMaxLanes - 1),
                        absl::StrCat(join.lane()));
  }
  return absl::OkStatus();
}

std::string LaneRegistry::MeetingId(absl::string_view host, absl::string_view key) {
  // A host's name holds no newline: the id names one (host, key) pair.
  return absl::StrCat(host, "\n", key);
}

bool LaneRegistry::AwaitWatching(const absl::Condition& settled, absl::Time deadline,
                                 const wire::SocketConnection& connection) {
  // A client that gives up on a call closes its connections; noticed this soon, a wait for lanes
  // that will never come does not hold the connection's thread for the stream idle limit.
  constexpr absl::Duration kWatchEvery = absl::Milliseconds(50);
  while (!mu_.AwaitWithDeadline(settled, std::min(deadline, absl::Now() + kWatchEvery))) {
    if (absl::Now() >= deadline) return false;
    if (connection.PeerGone()) return true;
  }
  return false;
}

std::shared_ptr<LaneRegistry::Meeting> LaneRegistry::MeetingOf(const std::string& id) {
  std::shared_ptr<Meeting>& meeting = meetings_[id];
  if (meeting == nullptr) meeting = std::make_shared<Meeting>();
  return meeting;
}

void LaneRegistry::Finish(const std::string& id, Meeting& meeting, bool reusable) {
  meeting.state = Meeting::State::kOver;
  meeting.reusable = reusable;
  const auto found = meetings_.find(id);
  if (found != meetings_.end() && found->second.get() == &meeting) meetings_.erase(found);
}

absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> LaneRegistry::Claim(
    absl::string_view host, const v1::ComputeSocketLanes& lanes,
    const wire::SocketConnection& lane_zero, absl::Time deadline) {
  RETURN_IF_ERROR(CheckLanes(lanes));
  const std::string id = MeetingId(host, lanes.call_key());
  const int count = static_cast<int>(lanes.lanes());
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  const std::shared_ptr<Meeting> meeting = MeetingOf(id);
  if (meeting->lanes != 0) {
    return WithField(absl::AlreadyExistsError(
                         "lanes.call_key: names a call already under way; draw a fresh key for "
                         "every call"),
                     "lanes.call_key");
  }
  meeting->lanes = count;
  const auto joined_past = [&]() -> int {
    for (int lane = count; lane < wire::kComputeSocketMaxLanes; ++lane) {
      if (meeting->joined[lane] != nullptr) return lane;
    }
    return 0;
  };
  const auto missing = [&] {
    std::vector<int> lanes;
    for (int lane = 1; lane < count; ++lane) {
      if (meeting->joined[lane] == nullptr) lanes.push_back(lane);
    }
    return lanes;
  };
  const auto settled = [&] { return stopping_ || joined_past() != 0 || missing().empty(); };
  const bool abandoned = AwaitWatching(absl::Condition(&settled), deadline, lane_zero);
  absl::Status failure;
  if (abandoned) {
    failure = absl::CancelledError("lanes: the client closed lane 0 before its lanes joined");
  } else if (stopping_) {
    failure = absl::UnavailableError("the server is shutting down; the call was ended");
  } else if (const int past = joined_past(); past != 0) {
    failure = InvalidField("join.lane",
                           absl::StrCat("1 to ", count - 1, " for a call of ", count, " lanes"),
                           absl::StrCat(past));
  } else if (const std::vector<int> absent = missing(); !absent.empty()) {
    failure = absl::DeadlineExceededError(absl::StrCat(
        "lanes: lane ", absl::StrJoin(absent, ", "), " of ", count,
        " did not join within the stream idle limit (--stream_idle_seconds); the call was ended"));
  }
  if (!failure.ok()) {
    Finish(id, *meeting, /*reusable=*/false);
    return failure;
  }
  meeting->state = Meeting::State::kLent;
  std::vector<wire::SocketConnection*> connections(meeting->joined.begin() + 1,
                                                   meeting->joined.begin() + count);
  return std::unique_ptr<Loan>(new Loan(*this, id, meeting, std::move(connections)));
}

absl::StatusOr<bool> LaneRegistry::Join(absl::string_view host, const v1::ComputeSocketJoin& join,
                                        wire::SocketConnection& connection, absl::Time deadline) {
  RETURN_IF_ERROR(CheckJoin(join));
  const std::string id = MeetingId(host, join.call_key());
  const int lane = static_cast<int>(join.lane());
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  const std::shared_ptr<Meeting> meeting = MeetingOf(id);
  if (meeting->state != Meeting::State::kOpen) {
    return WithField(absl::FailedPreconditionError(
                         "join.call_key: names a call that has begun without this lane"),
                     "join.call_key");
  }
  if (meeting->lanes != 0 && lane >= meeting->lanes) {
    return InvalidField(
        "join.lane",
        absl::StrCat("1 to ", meeting->lanes - 1, " for a call of ", meeting->lanes, " lanes"),
        absl::StrCat(lane));
  }
  if (meeting->joined[lane] != nullptr) {
    return WithField(absl::AlreadyExistsError(absl::StrCat("join.lane: lane ", lane,
                                                           " of this call has joined already")),
                     "join.lane");
  }
  meeting->joined[lane] = &connection;
  const auto claimed = [&] { return stopping_ || meeting->state != Meeting::State::kOpen; };
  const bool abandoned = AwaitWatching(absl::Condition(&claimed), deadline, connection);
  if (meeting->state == Meeting::State::kOpen) {
    meeting->joined[lane] = nullptr;
    const bool empty = meeting->lanes == 0 &&
                       std::all_of(meeting->joined.begin(), meeting->joined.end(),
                                   [](const wire::SocketConnection* c) { return c == nullptr; });
    if (empty) meetings_.erase(id);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (abandoned) return absl::CancelledError("join: the client closed the lane before its call");
    return absl::DeadlineExceededError(absl::StrCat(
        "join: no call claimed lane ", lane,
        " within the stream idle limit (--stream_idle_seconds); send the call's FRAME_LANES on "
        "its first connection"));
  }
  // Lent (or refused): the call's thread uses the connection until it hands it back.
  mu_.Await(absl::Condition(
      +[](Meeting* m) { return m->state == Meeting::State::kOver; }, meeting.get()));
  return meeting->reusable;
}

void LaneRegistry::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

int64_t LaneRegistry::meetings() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(meetings_.size());
}

}  // namespace lossd::server
