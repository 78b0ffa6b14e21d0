// Where a Compute socket call's lanes meet: lane 0 gets every other lane in order whichever
// comes first, a lane goes back to its thread when the call returns it, and every way a meeting
// can fail (a lane that never comes, a call that never claims, a lane joined twice or past the
// call's count, a key already in use, another host, a client that leaves, a server that stops)
// ends both sides' waits with an error that names the field, leaving no meeting behind.
#include "server/socket/lane_registry.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <array>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {
namespace {

using wire::SocketConnection;

constexpr absl::Duration kLong = absl::Seconds(60);         // never reached when the test passes
constexpr absl::Duration kShort = absl::Milliseconds(100);  // a wait meant to run out

v1::ComputeSocketLanes Lanes(const std::string& key, int lanes) {
  v1::ComputeSocketLanes message;
  message.set_call_key(key);
  message.set_lanes(lanes);
  return message;
}

v1::ComputeSocketJoin Join(const std::string& key, int lane) {
  v1::ComputeSocketJoin message;
  message.set_call_key(key);
  message.set_lane(lane);
  return message;
}

// A connection for the registry to hand over (it never reads or writes one), and its client's
// end, open until the client leaves.
struct Link {
  std::unique_ptr<SocketConnection> connection;
  std::unique_ptr<UniqueFd> client;
};

Link NewLink() {
  std::array<int, 2> fds{};
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds.data()), 0);
  return {std::make_unique<SocketConnection>(UniqueFd(fds[0]), std::vector<int>{}),
          std::make_unique<UniqueFd>(fds[1])};
}

// A connection whose client stays (for the test's life), from any of the test's threads.
std::unique_ptr<SocketConnection> Connection() {
  static absl::Mutex mu(absl::kConstInit);
  static auto* const clients = new std::vector<std::unique_ptr<UniqueFd>>();
  Link link = NewLink();
  absl::MutexLock lock(&mu);
  clients->push_back(std::move(link.client));
  return std::move(link.connection);
}

// Lane 0 of the tests' calls, whose client stays.
const SocketConnection& LaneZero() {
  static const SocketConnection* const lane_zero = Connection().release();
  return *lane_zero;
}

// A lane's thread: joins, then records what the wait ended with.
class JoiningLane {
 public:
  JoiningLane(LaneRegistry& registry, std::string host, v1::ComputeSocketJoin join,
              absl::Duration limit = kLong)
      : connection_(Connection()) {
    thread_ = std::thread([this, &registry, host = std::move(host), join, limit] {
      result_ = registry.Join(host, join, *connection_, absl::Now() + limit);
      done_.Notify();
    });
  }
  ~JoiningLane() { thread_.join(); }
  SocketConnection* connection() const { return connection_.get(); }
  bool Done() const { return done_.HasBeenNotified(); }
  const absl::StatusOr<bool>& Result() {
    done_.WaitForNotification();
    return result_;
  }

 private:
  std::unique_ptr<SocketConnection> connection_;
  absl::StatusOr<bool> result_;
  absl::Notification done_;
  std::thread thread_;
};

// Until the registry holds `count` meetings: a join or claim begun on another thread has arrived.
void AwaitMeetings(const LaneRegistry& registry, int64_t count) {
  const absl::Time deadline = absl::Now() + kLong;
  while (registry.meetings() != count && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(registry.meetings(), count);
}

const std::string kKey(32, 'k');
const std::string kHost = "ipv4:127.0.0.1";

TEST(LaneRegistryTest, LaneZeroGetsEveryLaneInOrderWhicheverComesFirst) {
  LaneRegistry registry;
  // Lane 2 joins before the claim, lane 1 after it.
  JoiningLane lane2(registry, kHost, Join(kKey, 2));
  AwaitMeetings(registry, 1);
  absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> loan;
  std::thread claim(
      [&] { loan = registry.Claim(kHost, Lanes(kKey, 3), LaneZero(), absl::Now() + kLong); });
  absl::SleepFor(kShort);
  JoiningLane lane1(registry, kHost, Join(kKey, 1));
  claim.join();
  ASSERT_TRUE(loan.ok()) << loan.status();
  EXPECT_EQ((*loan)->connections(),
            (std::vector<SocketConnection*>{lane1.connection(), lane2.connection()}));
  // Lent: neither lane's thread goes on until the call returns them.
  absl::SleepFor(kShort);
  EXPECT_FALSE(lane1.Done() || lane2.Done());
  (*loan)->Return(/*reusable=*/true);
  EXPECT_EQ(lane1.Result().value(), true);
  EXPECT_EQ(lane2.Result().value(), true);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, ALoanDroppedUnreturnedClosesItsLanes) {
  LaneRegistry registry;
  JoiningLane lane1(registry, kHost, Join(kKey, 1));
  {
    absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> loan =
        registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
    ASSERT_TRUE(loan.ok()) << loan.status();
  }
  EXPECT_EQ(lane1.Result().value(), false);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, AKeyServesCallAfterCall) {
  LaneRegistry registry;
  for (int call = 0; call < 3; ++call) {
    JoiningLane lane1(registry, kHost, Join(kKey, 1));
    absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> loan =
        registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
    ASSERT_TRUE(loan.ok()) << loan.status();
    (*loan)->Return(true);
    EXPECT_EQ(lane1.Result().value(), true);
  }
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, AClaimWhoseLanesDoNotComeNamesThemAndLetsTheOthersGo) {
  LaneRegistry registry;
  JoiningLane lane2(registry, kHost, Join(kKey, 2));
  const auto loan = registry.Claim(kHost, Lanes(kKey, 4), LaneZero(), absl::Now() + kShort);
  ASSERT_EQ(loan.status().code(), absl::StatusCode::kDeadlineExceeded) << loan.status();
  EXPECT_NE(loan.status().message().find("lane 1, 3 of 4 did not join"), std::string::npos)
      << loan.status();
  EXPECT_EQ(lane2.Result().value(), false);  // it had joined: it closes
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, ALaneNoCallClaimsEndsAtItsDeadline) {
  LaneRegistry registry;
  JoiningLane lane1(registry, kHost, Join(kKey, 1), kShort);
  EXPECT_EQ(lane1.Result().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, ALaneOfAnotherHostDoesNotMeetTheCall) {
  LaneRegistry registry;
  JoiningLane stranger(registry, "ipv4:10.0.0.9", Join(kKey, 1), kShort);
  const auto loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kShort);
  EXPECT_EQ(loan.status().code(), absl::StatusCode::kDeadlineExceeded) << loan.status();
  EXPECT_EQ(stranger.Result().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, ALaneJoinedTwiceIsRefused) {
  LaneRegistry registry;
  JoiningLane first(registry, kHost, Join(kKey, 1));
  AwaitMeetings(registry, 1);
  auto second = Connection();
  const absl::StatusOr<bool> refused =
      registry.Join(kHost, Join(kKey, 1), *second, absl::Now() + kLong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_EQ(FieldOf(refused.status()), "join.lane");
  // The first is the call's lane 1.
  auto loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
  ASSERT_TRUE(loan.ok()) << loan.status();
  EXPECT_EQ((*loan)->connections(), std::vector<SocketConnection*>{first.connection()});
  (*loan)->Return(true);
  EXPECT_EQ(first.Result().value(), true);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, ALanePastTheCallsCountIsRefusedBeforeOrAfterTheClaim) {
  {
    // After: the lane is refused at once; the claim goes on waiting for its own lane.
    LaneRegistry registry;
    absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> loan;
    std::thread claim(
        [&] { loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong); });
    AwaitMeetings(registry, 1);
    auto past = Connection();
    const absl::StatusOr<bool> refused =
        registry.Join(kHost, Join(kKey, 5), *past, absl::Now() + kLong);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_EQ(FieldOf(refused.status()), "join.lane");
    JoiningLane lane1(registry, kHost, Join(kKey, 1));
    claim.join();
    ASSERT_TRUE(loan.ok()) << loan.status();
    (*loan)->Return(true);
    EXPECT_EQ(lane1.Result().value(), true);
  }
  {
    // Before: the claim is refused, naming the lane, and the lane closes.
    LaneRegistry registry;
    JoiningLane past(registry, kHost, Join(kKey, 5));
    AwaitMeetings(registry, 1);
    const auto loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
    EXPECT_EQ(loan.status().code(), absl::StatusCode::kInvalidArgument) << loan.status();
    EXPECT_EQ(FieldOf(loan.status()), "join.lane");
    EXPECT_EQ(past.Result().value(), false);
    EXPECT_EQ(registry.meetings(), 0);
  }
}

TEST(LaneRegistryTest, AKeyInUseTakesNoSecondCallNorLateLane) {
  LaneRegistry registry;
  JoiningLane lane1(registry, kHost, Join(kKey, 1));
  auto loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
  ASSERT_TRUE(loan.ok()) << loan.status();
  const auto again = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  EXPECT_EQ(FieldOf(again.status()), "lanes.call_key");
  auto late = Connection();
  const absl::StatusOr<bool> refused =
      registry.Join(kHost, Join(kKey, 1), *late, absl::Now() + kLong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  (*loan)->Return(true);
  EXPECT_EQ(lane1.Result().value(), true);
  EXPECT_EQ(registry.meetings(), 0);
}

TEST(LaneRegistryTest, AClientThatLeavesEndsItsWaitBeforeTheDeadline) {
  {
    // Lane 0's client leaves while a lane is missing: the claim ends, and the lane that had
    // joined closes.
    LaneRegistry registry;
    JoiningLane lane1(registry, kHost, Join(kKey, 1));
    AwaitMeetings(registry, 1);
    Link lane0 = NewLink();
    absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> loan;
    std::thread claim([&] {
      loan = registry.Claim(kHost, Lanes(kKey, 3), *lane0.connection, absl::Now() + kLong);
    });
    absl::SleepFor(kShort);
    lane0.client.reset();
    claim.join();
    EXPECT_EQ(loan.status().code(), absl::StatusCode::kCancelled) << loan.status();
    EXPECT_EQ(lane1.Result().value(), false);
    EXPECT_EQ(registry.meetings(), 0);
  }
  {
    // A lane's client leaves before any call claims it: the lane leaves the meeting.
    LaneRegistry registry;
    Link lane = NewLink();
    absl::StatusOr<bool> joined;
    std::thread join([&] {
      joined = registry.Join(kHost, Join(kKey, 1), *lane.connection, absl::Now() + kLong);
    });
    AwaitMeetings(registry, 1);
    lane.client.reset();
    join.join();
    EXPECT_EQ(joined.status().code(), absl::StatusCode::kCancelled) << joined.status();
    EXPECT_EQ(registry.meetings(), 0);
  }
}

TEST(LaneRegistryTest, StopEndsWaitsButALentLaneWaitsForItsReturn) {
  LaneRegistry registry;
  JoiningLane lent(registry, kHost, Join(kKey, 1));
  auto loan = registry.Claim(kHost, Lanes(kKey, 2), LaneZero(), absl::Now() + kLong);
  ASSERT_TRUE(loan.ok()) << loan.status();
  const std::string other(16, 'o');
  JoiningLane waiting(registry, kHost, Join(other, 1));
  absl::StatusOr<std::unique_ptr<LaneRegistry::Loan>> claiming;
  std::thread claim([&] {
    claiming =
        registry.Claim(kHost, Lanes(std::string(16, 'c'), 2), LaneZero(), absl::Now() + kLong);
  });
  absl::SleepFor(kShort);
  registry.Stop();
  claim.join();
  EXPECT_EQ(claiming.status().code(), absl::StatusCode::kUnavailable) << claiming.status();
  EXPECT_EQ(waiting.Result().status().code(), absl::StatusCode::kUnavailable);
  absl::SleepFor(kShort);
  EXPECT_FALSE(lent.Done());  // the call still uses it
  (*loan)->Return(false);
  EXPECT_EQ(lent.Result().value(), false);
  EXPECT_EQ(registry.meetings(), 0);
}

struct BadFrame {
  const char* name;
  const char* why;
  bool lanes;  // a FRAME_LANES' message, else a FRAME_JOIN's
  std::string key;
  int count;  // lanes, or the lane
  const char* field;
};

// clang-format off
const BadFrame kBadFrames[] = {
    {"short_key", "guessable", true, std::string(15, 'k'), 2, "lanes.call_key"},
    {"long_key", "past what the server keeps per call", true, std::string(65, 'k'), 2,
     "lanes.call_key"},
    {"one_lane", "not spread at all", true, kKey, 1, "lanes.lanes"},
    {"nine_lanes", "past the server's 8", true, kKey, 9, "lanes.lanes"},
    {"join_short_key", "guessable", false, "", 1, "join.call_key"},
    {"join_lane_zero", "lane 0 runs the call itself", false, kKey, 0, "join.lane"},
    {"join_lane_eight", "no call has a ninth lane", false, kKey, 8, "join.lane"},
};
// clang-format on

class BadFrameTest : public ::testing::TestWithParam<BadFrame> {};

TEST_P(BadFrameTest, IsRefusedNamingItsField) {
  const BadFrame& bad = GetParam();
  const absl::Status status = bad.lanes ? LaneRegistry::CheckLanes(Lanes(bad.key, bad.count))
                                        : LaneRegistry::CheckJoin(Join(bad.key, bad.count));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad.why;
  EXPECT_EQ(FieldOf(status), bad.field) << status;
  // The registry refuses it the same way, at once, and keeps nothing.
  LaneRegistry registry;
  auto connection = Connection();
  const absl::Status refused =
      bad.lanes ? registry.Claim(kHost, Lanes(bad.key, bad.count), LaneZero(), absl::Now() + kLong)
                      .status()
                : registry.Join(kHost, Join(bad.key, bad.count), *connection, absl::Now() + kLong)
                      .status();
  EXPECT_EQ(refused, status);
  EXPECT_EQ(registry.meetings(), 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, BadFrameTest, ::testing::ValuesIn(kBadFrames),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lossd::server
