// A Compute RPC on gRPC's callback API, seen by the call as a blocking ComputeStream.
//
// The reactor reads the call's first message itself, and only once it is in (or the stream ended)
// starts the call's thread: a stream that sends nothing costs no thread, and one that does not
// send its start within the idle limit is ended by a StartWatch (DEADLINE_EXCEEDED).
//
// The call runs on a thread of its own; its Read and Write start the reactor's read or write and
// block that thread until gRPC reports it done (OnReadDone, OnWriteDone), so no read is started
// before the call wants rows and gRPC's flow control pushes back on a client that sends faster
// than the engine computes. The RPC ends with the first status given to End: the call's own once
// it returns, or an earlier one (a stalled client, a failed call whose reader still waits), which a
// pending Read then sees as ok = false. That is what the synchronous API cannot do: there the
// only way to unblock a Read is to cancel the call, and the client sees a bare CANCELLED.
//
// Lifetime: gRPC owns the reactor until OnDone, the call's thread until it has finished with it;
// whichever comes last deletes it. The thread stops using the server (it destroys its Hooks)
// before it lets go of the reactor, and is itself joined by the CallThreads that started it.
#ifndef LOSSD_SERVER_CALL_COMPUTE_REACTOR_H_
#define LOSSD_SERVER_CALL_COMPUTE_REACTOR_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/v1/lossd.pb.h"
#include "server/call/compute_stream.h"

namespace lossd::server {

// The threads Compute calls run on. Each is joined once its function has returned (when the next
// call starts a thread) or when this goes away, so that no call's thread outlives the server:
// neither its own epilogue nor what a library does when a thread ends (libomp's goodbye to a thread
// that ran parallel regions) runs while the process exits.
class CallThreads {
 public:
  CallThreads() = default;
  CallThreads(const CallThreads&) = delete;
  CallThreads& operator=(const CallThreads&) = delete;
  ~CallThreads() { JoinAll(); }

  // Runs `fn` on a new thread; RESOURCE_EXHAUSTED when none can be started (nothing runs then).
  absl::Status Start(absl::AnyInvocable<void() &&> fn);
  // Waits for every thread started so far.
  void JoinAll();

 private:
  // Joins the threads whose functions have returned.
  void JoinFinished();

  absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);  // their functions have returned
};

class ComputeReactor;

// The Compute streams whose start message has not come yet, each with the time by which it must:
// one thread ends those that pass it (StreamIdleError), and StopAccepting ends them all. Bounds
// how many there may be, so that header-only streams cannot pile up without limit.
class StartWatch {
 public:
  StartWatch(absl::Duration limit, int64_t max_streams);
  StartWatch(const StartWatch&) = delete;
  StartWatch& operator=(const StartWatch&) = delete;
  ~StartWatch();

  // Watches `reactor` from now; RESOURCE_EXHAUSTED when max_streams streams wait already.
  absl::Status Watch(ComputeReactor* reactor);
  // Stops watching it (its start came, or it is done); waits for an End in progress on it.
  void Forget(ComputeReactor* reactor);
  // Ends every stream watched now and any watched later with `status`.
  void EndAll(const absl::Status& status);
  int64_t waiting() const;

 private:
  void Run();

  const absl::Duration limit_;
  const int64_t max_streams_;
  mutable absl::Mutex mu_;
  std::multimap<absl::Time, ComputeReactor*> by_deadline_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ComputeReactor*, absl::Time> deadline_of_ ABSL_GUARDED_BY(mu_);
  absl::Status refuse_all_ ABSL_GUARDED_BY(mu_);  // set by EndAll
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last
};

class ComputeReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                             public ComputeStream {
 public:
  // The call: runs on the reactor's thread with the reactor as its stream.
  using Body = absl::AnyInvocable<absl::Status(ComputeStream&) &&>;
  // What the server learns of the call's end, on the call's thread; destroyed there, last, once
  // the call has run.
  struct Hooks {
    // Each status the call is ended with (End), before its client can hear any of them.
    absl::AnyInvocable<void(const absl::Status&)> ending;
    // Once: the status the client hears, just before it can hear it.
    absl::AnyInvocable<void(const absl::Status&)> finishing;
  };

  // Reads the first message, then starts `body` on a new thread of `threads`; until then `watch`
  // ends the stream if it stays silent. A Write that waits `write_stall_limit` for the client to
  // take the message ends the call (StreamIdleError). An error when the watch is full: then
  // nothing runs and the caller refuses the call.
  static absl::StatusOr<ComputeReactor*> Start(grpc::CallbackServerContext* context,
                                               absl::Duration write_stall_limit,
                                               CallThreads& threads, StartWatch& watch, Body body,
                                               Hooks hooks);
  // A reactor that ends the RPC at once with `status`, running nothing.
  static ComputeReactor* Refuse(const absl::Status& status);

  ComputeReactor(const ComputeReactor&) = delete;
  ComputeReactor& operator=(const ComputeReactor&) = delete;

  // ComputeStream, for the call's threads.
  // A message that is not a ComputeRequest ends the call (INVALID_ARGUMENT, saying why).
  bool Read(wire::ComputeRequestFrame* request) override;
  bool Write(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden) override;
  bool WriteOrStall(const v1::ComputeResponse& response, const wire::BulkBytes& grad_hidden,
                    absl::FunctionRef<void()> on_stall) override;
  bool IsCancelled() const override;
  void End(const absl::Status& status) override;
  bool PeerIsLocal() const override { return peer_is_local_; }
  std::string Peer() const override { return peer_; }

  // Reactions, from gRPC.
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  ComputeReactor(grpc::CallbackServerContext* context, absl::Duration write_stall_limit,
                 int owners);
  void RunCall(Body body);
  // On the first message (or the stream's end): starts the call's thread, unless ended already.
  void StartCall();
  // Ends the RPC with `status`: the first status given is the one the client hears.
  void FinishOnce(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops one owner (gRPC or the call's thread); the last one deletes the reactor.
  void Unref();

  grpc::CallbackServerContext* const context_;  // null for a refused call
  const std::string peer_;
  const bool peer_is_local_;
  const absl::Duration write_stall_limit_;
  Hooks hooks_;  // set before the call's thread starts, used and reset on it
  // Until the call's thread starts: what runs it, and where.
  Body body_;
  CallThreads* threads_ = nullptr;
  StartWatch* watch_ = nullptr;
  grpc::ByteBuffer first_;     // the first message, read by the reactor itself
  grpc::ByteBuffer received_;  // each later message, until the call's Read takes it
  grpc::ByteBuffer sending_;   // the message being written, until OnWriteDone
  std::atomic<int> owners_;
  std::atomic<bool> cancelled_{false};

  mutable absl::Mutex mu_;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;      // a StartRead awaits OnReadDone
  bool first_read_ ABSL_GUARDED_BY(mu_) = true;    // the pending read is of first_
  bool first_taken_ ABSL_GUARDED_BY(mu_) = false;  // Read has handed first_ to the call
  bool writing_ ABSL_GUARDED_BY(mu_) = false;      // a StartWrite awaits OnWriteDone
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_over_ ABSL_GUARDED_BY(mu_) = false;   // a read failed: no later one can succeed
  bool writes_over_ ABSL_GUARDED_BY(mu_) = false;  // likewise for writes
  bool ended_ ABSL_GUARDED_BY(mu_) = false;        // Finish was called
  bool done_ ABSL_GUARDED_BY(mu_) = false;         // OnDone ran: context_ is gone
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_COMPUTE_REACTOR_H_
