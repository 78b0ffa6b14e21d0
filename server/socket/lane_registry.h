// Where the lanes of a Compute socket call meet (ComputeSocketLanes in lossd.proto): the
// connection that runs the call (lane 0) claims the others by the call's key, each of which has
// joined under that key from the same host, and lends them back once the call has ended.
//
// Each connection has a thread of its own (ComputeSocketServer), so both sides wait here: lane 0
// until every lane has joined, a lane until lane 0 claims it and then until the call lends it
// back. Every wait before the call begins is bounded by a deadline and by Stop; a lent lane waits
// for its return, which the call makes however it ends (the call's own waits are bounded).
#ifndef LOSSD_SERVER_SOCKET_LANE_REGISTRY_H_
#define LOSSD_SERVER_SOCKET_LANE_REGISTRY_H_

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/compute_socket_io.h"

namespace lossd::server {

class LaneRegistry {
  struct Meeting;

 public:
  // Lanes 1 .. lanes - 1 of a claimed call, lent to lane 0's thread.
  class Loan {
   public:
    Loan(const Loan&) = delete;
    Loan& operator=(const Loan&) = delete;
    // Return(false), unless returned.
    ~Loan();
    // In lane order, lane 1 first.
    const std::vector<wire::SocketConnection*>& connections() const { return connections_; }
    // Hands the lanes back to their threads: each takes its client's next FRAME_JOIN if
    // `reusable` (the call ended with code 0 and every lane is clean), else closes.
    void Return(bool reusable);

   private:
    friend class LaneRegistry;
    Loan(LaneRegistry& registry, std::string id, std::shared_ptr<Meeting> meeting,
         std::vector<wire::SocketConnection*> connections);
    LaneRegistry& registry_;
    const std::string id_;
    const std::shared_ptr<Meeting> meeting_;
    const std::vector<wire::SocketConnection*> connections_;
    bool returned_ = false;
  };

  // Checks a FRAME_LANES' message and a FRAME_JOIN's, naming the field at fault.
  static absl::Status CheckLanes(const v1::ComputeSocketLanes& lanes);
  static absl::Status CheckJoin(const v1::ComputeSocketJoin& join);

  // Lane 0 (`lane_zero`) of the call `lanes` names, from `host`: waits until `deadline` for every
  // other lane to join. DEADLINE_EXCEEDED if some did not (saying which), ALREADY_EXISTS for a key
  // that names a call already claimed, INVALID_ARGUMENT for a lane that joined past the call's
  // count, CANCELLED once lane 0's client has closed it, UNAVAILABLE once the server stops. On
  // failure the lanes that had joined are returned as not reusable (they close).
  absl::StatusOr<std::unique_ptr<Loan>> Claim(absl::string_view host,
                                              const v1::ComputeSocketLanes& lanes,
                                              const wire::SocketConnection& lane_zero,
                                              absl::Time deadline);
  // A lane: offers `connection` to the call `join` names, from `host`, and waits until the call
  // claims it (by `deadline`) and then until the call returns it: whether the connection takes
  // its client's next frame. An error (nothing was lent) for a lane that was not claimed in time
  // or whose client closed it first, a lane already joined, a lane past the claimed call's count,
  // or a server that stops.
  absl::StatusOr<bool> Join(absl::string_view host, const v1::ComputeSocketJoin& join,
                            wire::SocketConnection& connection, absl::Time deadline);
  // Ends every wait for a claim or a join (UNAVAILABLE); lent lanes still wait for their return.
  void Stop();
  // Calls met or meeting now (for tests: nothing is left behind).
  int64_t meetings() const;

 private:
  struct Meeting {
    enum class State { kOpen, kLent, kOver };
    int lanes = 0;  // 0 until lane 0 claims
    std::array<wire::SocketConnection*, wire::kComputeSocketMaxLanes> joined{};
    State state = State::kOpen;
    bool reusable = false;
  };
  static std::string MeetingId(absl::string_view host, absl::string_view key);
  // Waits until `settled` holds or `deadline` passes; every kWatchEvery meanwhile, whether the
  // client has closed `connection` (nothing else would end the wait until the deadline). True if
  // it has, and `settled` does not hold.
  bool AwaitWatching(const absl::Condition& settled, absl::Time deadline,
                     const wire::SocketConnection& connection) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The meeting `id` names, begun now if none is.
  std::shared_ptr<Meeting> MeetingOf(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a meeting: its lanes go back to their threads.
  void Finish(const std::string& id, Meeting& meeting, bool reusable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Meeting>> meetings_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SOCKET_LANE_REGISTRY_H_
