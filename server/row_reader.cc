#include "server/row_reader.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {

absl::StatusOr<std::unique_ptr<RowReader>> RowReader::Start(ComputeStream& stream,
                                                           Metrics* metrics,
                                                           const RowLayout& layout,
                                                           BufferCache& host_buffers,
                                                           absl::Duration stop_grace) {
  const int64_t row_bytes = layout.hidden_size * static_cast<int64_t>(DTypeSize(layout.dtype));
  const int64_t rows = std::min(layout.chunk_rows, layout.num_tokens);
  // One buffer is enough when a single chunk holds the call.
  const int needed = layout.num_tokens > layout.chunk_rows ? kBuffers : 1;
  std::array<BufferLease, kBuffers> buffers;
  for (int b = 0; b < needed; ++b) {
    ASSIGN_OR_RETURN(buffers[b], host_buffers.Acquire(static_cast<size_t>(rows * row_bytes),
                                                      MemoryPurpose::kWorkspace));
  }
  return std::unique_ptr<RowReader>(
      new RowReader(stream, metrics, layout, stop_grace, std::move(buffers)));
}

RowReader::RowReader(ComputeStream& stream, Metrics* metrics, const RowLayout& layout,
                     absl::Duration stop_grace, std::array<BufferLease, kBuffers> buffers)
    : stream_(stream),
      metrics_(metrics),
      layout_(layout),
      row_bytes_(layout.hidden_size * static_cast<int64_t>(DTypeSize(layout.dtype))),
      stop_grace_(stop_grace),
      buffers_(std::move(buffers)) {
  thread_ = std::thread([this] { ReadAll(); });
}

int64_t RowReader::RowsInChunk(int64_t chunk) const {
  return std::min(layout_.chunk_rows, layout_.num_tokens - chunk * layout_.chunk_rows);
}

void RowReader::ReadAll() {
  absl::Status status = ReadRows();
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
  done_ = true;
}

absl::Status RowReader::ReadRows() {
  v1::ComputeRequest request;
  while (stream_.Read(&request)) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return absl::CancelledError("the call ended before its rows were all read");
    }
    RETURN_IF_ERROR(TakeMessage(request));
  }
  if (stream_.IsCancelled()) {
    return absl::CancelledError("call cancelled mid-stream; nothing was accumulated");
  }
  if (received_rows_ != layout_.num_tokens) {
    return InvalidField("chunk.hidden", absl::StrCat(layout_.num_tokens, " rows (num_tokens)"),
                        absl::StrCat(received_rows_, " before the stream ended"));
  }
  return absl::OkStatus();
}

absl::Status RowReader::TakeMessage(const v1::ComputeRequest& request) {
  if (request.has_start()) {
    return InvalidField("start", "exactly one ComputeStart, first", "a second one");
  }
  const std::string& hidden = request.chunk().hidden();
  const int64_t bytes = static_cast<int64_t>(hidden.size());
  if (bytes % row_bytes_ != 0) {
    return InvalidField("chunk.hidden",
                        absl::StrCat("whole rows of ", layout_.hidden_size, " ",
                                     DTypeName(layout_.dtype), " values (", row_bytes_,
                                     " bytes each)"),
                        absl::StrCat(bytes, " bytes"));
  }
  const int64_t rows = bytes / row_bytes_;
  if (received_rows_ + rows > layout_.num_tokens) {
    return InvalidField("chunk.hidden", absl::StrCat(layout_.num_tokens, " rows in all (num_tokens)"),
                        absl::StrCat("at least ", received_rows_ + rows));
  }
  if (metrics_ != nullptr) metrics_->AddBytesReceived(bytes);
  for (int64_t taken = 0; taken < rows;) {
    if (rows_in_filling_ == 0 && !WaitForFreeBuffer()) {
      return absl::CancelledError("the call ended before its rows were all read");
    }
    const int64_t take = std::min(rows - taken, RowsInChunk(filling_chunk_) - rows_in_filling_);
    std::memcpy(BufferOf(filling_chunk_) + rows_in_filling_ * row_bytes_,
                hidden.data() + taken * row_bytes_, take * row_bytes_);
    rows_in_filling_ += take;
    taken += take;
    if (rows_in_filling_ == RowsInChunk(filling_chunk_)) {
      ++filling_chunk_;
      rows_in_filling_ = 0;
      absl::MutexLock lock(&mu_);
      filled_ = filling_chunk_;
    }
  }
  received_rows_ += rows;
  return absl::OkStatus();
}

bool RowReader::WaitForFreeBuffer() {
  const int64_t chunk = filling_chunk_;
  absl::MutexLock lock(&mu_);
  // Chunk c fills the buffer that chunk c - kBuffers used.
  const auto free_or_stopped = [this, chunk]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || released_ + kBuffers > chunk;
  };
  mu_.Await(absl::Condition(&free_or_stopped));
  return !stop_;
}

absl::StatusOr<RowChunk> RowReader::Next() {
  absl::MutexLock lock(&mu_);
  const auto ready_or_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return filled_ > taken_ || done_;
  };
  mu_.Await(absl::Condition(&ready_or_done));
  // A failed read ends the call even when rows before it are waiting.
  if (done_ && !status_.ok()) return status_;
  if (filled_ == taken_) {
    return absl::InternalError("RowReader::Next called after the call's last chunk");
  }
  const int64_t chunk = taken_++;
  return RowChunk{BufferOf(chunk), chunk * layout_.chunk_rows, RowsInChunk(chunk)};
}

void RowReader::Release() {
  absl::MutexLock lock(&mu_);
  released_ = taken_;
}

absl::Status RowReader::Finish() {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }
  thread_.join();
  absl::MutexLock lock(&mu_);
  return status_;
}

void RowReader::Stop() {
  if (!thread_.joinable()) return;
  bool done;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    done = mu_.AwaitWithTimeout(absl::Condition(&done_), stop_grace_);
  }
  if (!done) stream_.Cancel();
  thread_.join();
}

}  // namespace lossd::server
