#include "server/call/result_writer.h"

#include <utility>

namespace lossd::server {

ResultWriter::ResultWriter(ComputeStream& stream, Metrics* metrics)
    : stream_(stream), metrics_(metrics), thread_([this] { WriteAll(); }) {}

ResultWriter::~ResultWriter() { Stop(absl::CancelledError("the call ended before its results")); }

std::unique_ptr<v1::ComputeResponse> ResultWriter::NewMessage() {
  {
    absl::MutexLock lock(&mu_);
    if (!spare_.empty()) {
      std::unique_ptr<v1::ComputeResponse> message = std::move(spare_.back());
      spare_.pop_back();
      return message;
    }
  }
  return std::make_unique<v1::ComputeResponse>();
}

int64_t ResultWriter::Queue(std::unique_ptr<v1::ComputeResponse> message,
                            absl::string_view grad_hidden) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({std::move(message), grad_hidden});
  return ++queued_;
}

int64_t ResultWriter::queued() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

bool ResultWriter::AwaitWritten(int64_t message, absl::Duration stall_grace,
                                absl::FunctionRef<void()> on_stall) {
  absl::MutexLock lock(&mu_);
  const auto done = [this, message]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return failed_ || written_ >= message;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), stall_grace)) {
    mu_.Unlock();
    on_stall();
    mu_.Lock();
    mu_.Await(absl::Condition(&done));
  }
  return !failed_;
}

void ResultWriter::Stop(const absl::Status& reason) {
  bool end_stream = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    queue_.clear();
    end_stream = writing_;
  }
  // The stream's first end is the one its client sees; a write in progress returns false now.
  if (end_stream) stream_.End(reason);
  if (thread_.joinable()) thread_.join();
}

void ResultWriter::WriteAll() {
  while (true) {
    Pending next;
    {
      absl::MutexLock lock(&mu_);
      const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || failed_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_ || failed_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
    }
    // The one copy dL/dh takes on its way out, where the stream holds it past the write (gRPC
    // sends this slice as it is); none where the write is done when it returns.
    const wire::BulkBytes grad_hidden = next.grad_hidden.empty() ? wire::BulkBytes()
                                        : stream_.WriteIsDoneOnReturn()
                                            ? wire::BulkBytes::Borrow(next.grad_hidden)
                                            : send_buffers_->Copy(next.grad_hidden);
    const bool written = stream_.Write(*next.message, grad_hidden);
    if (written && metrics_ != nullptr) {
      metrics_->AddBytesSent(static_cast<int64_t>(next.message->ByteSizeLong()) +
                             static_cast<int64_t>(grad_hidden.size()));
    }
    next.message->Clear();
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!written) {
      failed_ = true;
      queue_.clear();
      return;
    }
    ++written_;
    spare_.push_back(std::move(next.message));
  }
}

}  // namespace lossd::server
