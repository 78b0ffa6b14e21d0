#include "server/call/compute_reactor.h"

#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lossd/common/grpc_handover.h"
#include "server/shm/shared_memory.h"
#include "server/status/grpc_status.h"

namespace lossd::server {

ComputeReactor::ComputeReactor(grpc::CallbackServerContext* context,
                               absl::Duration write_stall_limit, int owners)
    : context_(context),
      peer_(context != nullptr ? context->peer() : ""),
      peer_is_local_(IsLocalPeer(peer_)),
      write_stall_limit_(write_stall_limit),
      owners_(owners) {
  HandOverToGrpc(this);
}

absl::Status CallThreads::Start(absl::AnyInvocable<void() &&> fn) {
  JoinFinished();
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  try {
    // Registered under mu_ before the thread can report itself finished.
    threads_.emplace(id, std::thread([this, id, fn = std::move(fn)]() mutable {
                       std::move(fn)();
                       absl::MutexLock lock(&mu_);
                       finished_.push_back(id);
                     }));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server could not start a thread for the call: ", e.what()));
  }
  return absl::OkStatus();
}

void CallThreads::JoinFinished() {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    for (const uint64_t id : finished_) {
      auto it = threads_.find(id);
      if (it == threads_.end()) continue;  // already joined by JoinAll
      done.push_back(std::move(it->second));
      threads_.erase(it);
    }
    finished_.clear();
  }
  for (std::thread& thread : done) thread.join();  // each is past its last use of mu_
}

void CallThreads::JoinAll() {
  std::map<uint64_t, std::thread> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(threads_);
    finished_.clear();
  }
  for (auto& [id, thread] : all) thread.join();
}

StartWatch::StartWatch(absl::Duration limit, int64_t max_streams)
    : limit_(limit), max_streams_(max_streams), thread_([this] { Run(); }) {}

StartWatch::~StartWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::Status StartWatch::Watch(ComputeReactor* reactor) {
  absl::MutexLock lock(&mu_);
  if (!refuse_all_.ok()) return refuse_all_;
  if (static_cast<int64_t>(deadline_of_.size()) >= max_streams_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Compute: ", deadline_of_.size(),
        " streams already wait for their start message, the "
        "most the server keeps; send the start message when opening a call, or retry later"));
  }
  const absl::Time deadline = absl::Now() + limit_;
  by_deadline_.emplace(deadline, reactor);
  deadline_of_[reactor] = deadline;
  return absl::OkStatus();
}

void StartWatch::Forget(ComputeReactor* reactor) {
  absl::MutexLock lock(&mu_);
  const auto found = deadline_of_.find(reactor);
  if (found == deadline_of_.end()) return;
  const auto [first, last] = by_deadline_.equal_range(found->second);
  for (auto it = first; it != last; ++it) {
    if (it->second == reactor) {
      by_deadline_.erase(it);
      break;
    }
  }
  deadline_of_.erase(found);
}

void StartWatch::EndAll(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  refuse_all_ = status;
  // Ended under mu_, so that no reactor goes away meanwhile: one that is done Forgets itself
  // first, and waits here.
  for (const auto& [deadline, reactor] : by_deadline_) reactor->End(status);
  by_deadline_.clear();
  deadline_of_.clear();
}

int64_t StartWatch::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(deadline_of_.size());
}

void StartWatch::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const absl::Time next =
        by_deadline_.empty() ? absl::Now() + absl::Seconds(1) : by_deadline_.begin()->first;
    const auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    mu_.AwaitWithDeadline(absl::Condition(&stopping), next);
    const absl::Time now = absl::Now();
    while (!by_deadline_.empty() && by_deadline_.begin()->first <= now) {
      ComputeReactor* reactor = by_deadline_.begin()->second;
      by_deadline_.erase(by_deadline_.begin());
      deadline_of_.erase(reactor);
      reactor->End(StreamIdleError("its start message (ComputeStart)", limit_));
    }
  }
}

absl::StatusOr<ComputeReactor*> ComputeReactor::Start(grpc::CallbackServerContext* context,
                                                      absl::Duration write_stall_limit,
                                                      CallThreads& threads, StartWatch& watch,
                                                      Body body, Hooks hooks) {
  // Owned by gRPC (until OnDone) and by the call's thread (or, until it starts, its first read).
  auto* reactor = new ComputeReactor(context, write_stall_limit, /*owners=*/2);
  reactor->hooks_ = std::move(hooks);
  reactor->body_ = std::move(body);
  reactor->threads_ = &threads;
  reactor->watch_ = &watch;
  if (const absl::Status watched = watch.Watch(reactor); !watched.ok()) {
    delete reactor;
    return watched;
  }
  // Again now that the fields above are set: every reaction (OnDone among them, which reads
  // watch_) sees them, as gRPC's own hand-over guarantees.
  HandOverToGrpc(reactor);
  absl::MutexLock lock(&reactor->mu_);
  reactor->reading_ = true;
  // Held by gRPC until the reactor is bound to the call; its completion starts the call.
  reactor->StartRead(&reactor->first_);
  return reactor;
}

void ComputeReactor::StartCall() {
  // After this no watch can end the stream any more: it waited for an End in progress.
  watch_->Forget(this);
  bool ended;
  {
    absl::MutexLock lock(&mu_);
    ended = ended_;
  }
  if (!ended) {
    const absl::Status started = threads_->Start([this] { RunCall(std::move(body_)); });
    if (started.ok()) return;
    End(started);
  }
  // No call to run: the stream was ended while silent (the start's idle limit, a shutdown), or
  // no thread could start. What the thread would have let go of goes here.
  body_ = nullptr;
  hooks_ = Hooks();
  Unref();
}

ComputeReactor* ComputeReactor::Refuse(const absl::Status& status) {
  auto* reactor = new ComputeReactor(nullptr, absl::ZeroDuration(), /*owners=*/1);
  reactor->End(status);
  return reactor;
}

void ComputeReactor::RunCall(Body body) {
  // Each callable is destroyed here, on this thread, while what it captured may still be used.
  absl::Status status = std::move(body)(*this);
  body = nullptr;
  End(status);
  hooks_ = Hooks();
  Unref();
}

bool ComputeReactor::Read(wire::ComputeRequestFrame* request) {
  grpc::ByteBuffer message;
  {
    absl::MutexLock lock(&mu_);
    // One read at a time: gRPC allows no second StartRead before OnReadDone.
    mu_.Await(absl::Condition(
        +[](bool* reading) { return !*reading; }, &reading_));
    if (!first_taken_) {
      // The first read was the reactor's own, done before the call's thread started.
      first_taken_ = true;
      if (!read_ok_) {
        reads_over_ = true;
        return false;
      }
      message.Swap(&first_);
      if (ended_) return false;
    } else {
      if (ended_ || reads_over_) return false;
      reading_ = true;
      // OnReadDone runs on a gRPC thread, never inside StartRead, so starting under mu_ is safe.
      StartRead(&received_);
      mu_.Await(absl::Condition(
          +[](bool* reading) { return !*reading; }, &reading_));
      if (!read_ok_) {
        reads_over_ = true;
        return false;
      }
      message.Swap(&received_);
    }
  }
  const absl::Status decoded = request->Decode(message);
  if (decoded.ok()) return true;
  {
    absl::MutexLock lock(&mu_);
    reads_over_ = true;
  }
  End(decoded);
  return false;
}

bool ComputeReactor::Write(const v1::ComputeResponse& response,
                           const wire::BulkBytes& grad_hidden) {
  return WriteOrStall(response, grad_hidden, [] {});
}

bool ComputeReactor::WriteOrStall(const v1::ComputeResponse& response,
                                  const wire::BulkBytes& grad_hidden,
                                  absl::FunctionRef<void()> on_stall) {
  // How long a message may take to leave before its call counts as stalled on the client. Only
  // what the call does meanwhile depends on it (whether it gives its slot back), never a result.
  constexpr absl::Duration kStallGrace = absl::Milliseconds(20);
  grpc::ByteBuffer message = wire::EncodeComputeResponse(response, grad_hidden);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* writing) { return !*writing; }, &writing_));
  if (ended_ || writes_over_) return false;
  writing_ = true;
  sending_.Swap(&message);
  StartWrite(&sending_);
  const auto written = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; };
  const absl::Time started = absl::Now();
  if (!mu_.AwaitWithTimeout(absl::Condition(&written), kStallGrace)) {
    mu_.Unlock();
    on_stall();
    mu_.Lock();
  }
  const absl::Duration left = write_stall_limit_ - (absl::Now() - started);
  if (!mu_.AwaitWithTimeout(absl::Condition(&written), left)) {
    // The client reads nothing while the call holds the device. Its status cannot pass the
    // message that flow control holds back, so the call is cancelled as well.
    FinishOnce(StreamIdleError("the client to read its results", write_stall_limit_));
    context_->TryCancel();
    mu_.Await(absl::Condition(&written));
  }
  if (!write_ok_) writes_over_ = true;
  return write_ok_;
}

bool ComputeReactor::IsCancelled() const {
  if (cancelled_.load(std::memory_order_acquire)) return true;
  absl::MutexLock lock(&mu_);
  // A failed read marks the context cancelled before OnReadDone, OnCancel may come later.
  return context_ != nullptr && !done_ && context_->IsCancelled();
}

void ComputeReactor::End(const absl::Status& status) {
  if (hooks_.ending) hooks_.ending(status);
  absl::MutexLock lock(&mu_);
  FinishOnce(status);
}

void ComputeReactor::FinishOnce(const absl::Status& status) {
  if (ended_) return;
  ended_ = true;
  if (hooks_.finishing) hooks_.finishing(status);
  Finish(ToGrpcStatus(status));
}

void ComputeReactor::OnReadDone(bool ok) {
  TakeOverFromGrpc(this);
  bool first;
  {
    absl::MutexLock lock(&mu_);
    read_ok_ = ok;
    reading_ = false;
    first = std::exchange(first_read_, false);
  }
  if (first) StartCall();
}

void ComputeReactor::OnWriteDone(bool ok) {
  TakeOverFromGrpc(this);
  absl::MutexLock lock(&mu_);
  write_ok_ = ok;
  writing_ = false;
}

void ComputeReactor::OnCancel() {
  TakeOverFromGrpc(this);
  cancelled_.store(true, std::memory_order_release);
}

void ComputeReactor::OnDone() {
  TakeOverFromGrpc(this);
  if (watch_ != nullptr) watch_->Forget(this);
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
  Unref();
}

void ComputeReactor::Unref() {
  if (owners_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
}

}  // namespace lossd::server
