#include "server/compute_reactor.h"

#include <system_error>
#include <thread>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/shared_memory.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
#endif

namespace lossd::server {
namespace {

// gRPC hands a reactor from the thread that made it to the threads that run its reactions through
// libgrpc's queues, which ThreadSanitizer cannot see into (Debian's libgrpc is not instrumented):
// it would take each reaction's first touch of the reactor (its lock) for a race with the
// construction. These two tell it of that hand-over; in other builds they are nothing.
void HandOverToGrpc(void* reactor) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_release(reactor);
#endif
}

void TakeOverFromGrpc(void* reactor) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_acquire(reactor);
#endif
}

}  // namespace

ComputeReactor::ComputeReactor(grpc::CallbackServerContext* context,
                               absl::Duration write_stall_limit, int owners)
    : context_(context),
      peer_is_local_(context != nullptr && IsLocalPeer(context->peer())),
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

absl::StatusOr<ComputeReactor*> ComputeReactor::Start(grpc::CallbackServerContext* context,
                                                      absl::Duration write_stall_limit,
                                                      CallThreads& threads, Body body,
                                                      Hooks hooks) {
  // Owned by gRPC (until OnDone) and by the call's thread.
  auto* reactor = new ComputeReactor(context, write_stall_limit, /*owners=*/2);
  reactor->hooks_ = std::move(hooks);
  const absl::Status started = threads.Start([reactor, body = std::move(body)]() mutable {
    reactor->RunCall(std::move(body));
  });
  if (!started.ok()) {
    delete reactor;
    return started;
  }
  return reactor;
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

bool ComputeReactor::Read(v1::ComputeRequest* request) {
  absl::MutexLock lock(&mu_);
  // One read at a time: gRPC allows no second StartRead before OnReadDone.
  mu_.Await(absl::Condition(
      +[](bool* reading) { return !*reading; }, &reading_));
  if (ended_ || reads_over_) return false;
  reading_ = true;
  // OnReadDone runs on a gRPC thread, never inside StartRead, so starting under mu_ is safe.
  StartRead(request);
  mu_.Await(absl::Condition(+[](bool* reading) { return !*reading; }, &reading_));
  if (!read_ok_) reads_over_ = true;
  return read_ok_;
}

bool ComputeReactor::Write(const v1::ComputeResponse& response) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](bool* writing) { return !*writing; }, &writing_));
  if (ended_ || writes_over_) return false;
  writing_ = true;
  StartWrite(&response);
  const auto written = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&written), write_stall_limit_)) {
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
  absl::MutexLock lock(&mu_);
  read_ok_ = ok;
  reading_ = false;
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
