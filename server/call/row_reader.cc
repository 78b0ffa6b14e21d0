#include "server/call/row_reader.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {
namespace {

const wire::BulkBytes& SideBytes(const wire::ComputeRequestFrame& request, SideField field) {
  switch (field) {
    case SideField::kTeacherHidden: return request.rows[wire::kTeacherHiddenRows];
    case SideField::kTeacherTopKTokens: return request.rows[wire::kTeacherTopKTokenRows];
    case SideField::kTeacherTopKLogprobs: return request.rows[wire::kTeacherTopKLogprobRows];
  }
  return request.rows[wire::kTeacherHiddenRows];
}

constexpr SideField kSideFields[] = {SideField::kTeacherHidden, SideField::kTeacherTopKTokens,
                                     SideField::kTeacherTopKLogprobs};

}  // namespace

int64_t OverlappedChunkRowLimit(int64_t num_tokens) {
  const int64_t chunks =
      std::clamp<int64_t>(num_tokens / kMinOverlappedChunkRows, 1, kOverlappedChunksPerCall);
  return (num_tokens + chunks - 1) / chunks;
}

int64_t PlannedCallRows(int64_t num_tokens) {
  if (num_tokens < 16) return num_tokens;
  int64_t octave = 1;
  while (octave * 2 <= num_tokens) octave *= 2;
  const int64_t step = octave / 8;
  return (num_tokens + step - 1) / step * step;
}

absl::string_view SideFieldName(SideField field) {
  switch (field) {
    case SideField::kTeacherHidden: return "teacher_hidden";
    case SideField::kTeacherTopKTokens: return "teacher_top_k_tokens";
    case SideField::kTeacherTopKLogprobs: return "teacher_top_k_logprobs";
  }
  return "unknown";
}

namespace {

int64_t RowBytes(const RowLayout& layout) {
  return layout.hidden_size * static_cast<int64_t>(DTypeSize(layout.dtype));
}

// Row bytes of stream 0 (hidden) and the side streams.
int64_t StreamRowBytes(const RowLayout& layout, size_t stream) {
  return stream == 0 ? RowBytes(layout) : layout.side[stream - 1].row_bytes;
}

// One buffer is enough when a single chunk holds the call.
int BuffersFor(const RowLayout& layout) { return layout.num_tokens > layout.chunk_rows ? 2 : 1; }

int64_t ChunkRows(const RowLayout& layout) {
  return std::min(layout.chunk_rows, layout.num_tokens);
}

}  // namespace

int64_t RowReader::BufferBytes(const RowLayout& layout) {
  if (layout.shared_rows != nullptr) return 0;
  int64_t chunk_bytes = 0;
  for (size_t s = 0; s <= layout.side.size(); ++s) {
    chunk_bytes += ChunkRows(layout) * StreamRowBytes(layout, s);
  }
  return BuffersFor(layout) * chunk_bytes;
}

absl::StatusOr<std::unique_ptr<RowReader>> RowReader::Start(ComputeStream& stream, Metrics* metrics,
                                                            const RowLayout& layout,
                                                            BufferCache& host_buffers,
                                                            absl::Duration idle_limit,
                                                            PendingAccount pending) {
  if (layout.side.size() > static_cast<size_t>(kMaxSideStreams)) {
    return absl::InternalError(absl::StrCat("RowReader: at most ", kMaxSideStreams,
                                            " side streams, got ", layout.side.size()));
  }
  if (layout.shared_rows != nullptr && !layout.side.empty()) {
    return absl::InternalError("RowReader: rows in shared memory take no side streams");
  }
  std::array<ChunkBuffers, kBuffers> buffers;
  for (int b = 0; layout.shared_rows == nullptr && b < BuffersFor(layout); ++b) {
    for (size_t s = 0; s <= layout.side.size(); ++s) {
      ASSIGN_OR_RETURN(
          buffers[b][s],
          host_buffers.Acquire(static_cast<size_t>(ChunkRows(layout) * StreamRowBytes(layout, s)),
                               MemoryPurpose::kWorkspace));
    }
  }
  return std::unique_ptr<RowReader>(
      new RowReader(stream, metrics, layout, idle_limit, std::move(pending), std::move(buffers)));
}

RowReader::RowReader(ComputeStream& stream, Metrics* metrics, const RowLayout& layout,
                     absl::Duration idle_limit, PendingAccount pending,
                     std::array<ChunkBuffers, kBuffers> buffers)
    : stream_(stream),
      metrics_(metrics),
      layout_(layout),
      row_bytes_(RowBytes(layout)),
      idle_limit_(idle_limit),
      pending_(std::move(pending)),
      buffers_(std::move(buffers)) {
  thread_ = std::thread([this] { ReadAll(); });
}

RowReader::~RowReader() {
  Stop(absl::CancelledError("the call ended before its rows were all read"));
}

int64_t RowReader::ChunkFirstRow(int64_t chunk) const {
  if (layout_.chunk_ends.empty()) return chunk * layout_.chunk_rows;
  return chunk == 0 ? 0
                    : layout_.chunk_ends[std::min<size_t>(chunk, layout_.chunk_ends.size()) - 1];
}

int64_t RowReader::RowsInChunk(int64_t chunk) const {
  if (layout_.chunk_ends.empty()) {
    return std::min(layout_.chunk_rows, layout_.num_tokens - chunk * layout_.chunk_rows);
  }
  if (chunk >= static_cast<int64_t>(layout_.chunk_ends.size())) return 0;
  return layout_.chunk_ends[chunk] - ChunkFirstRow(chunk);
}

void RowReader::ReadAll() {
  absl::Status status = ReadRows();
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
  done_ = true;
}

absl::Status RowReader::ReadRows() {
  wire::ComputeRequestFrame request;
  // Once the last row is in, the call has everything it needs: what the client sends after it,
  // and whether it half-closes, no longer matters to it.
  while (received_rows_ < layout_.num_tokens &&
         stream_.ReadRowsInto(&request, FreeSpaceForRows())) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return absl::CancelledError("the call ended before its rows were all read");
    }
    RETURN_IF_ERROR(TakeMessage(request));
  }
  if (received_rows_ == layout_.num_tokens) return absl::OkStatus();
  if (stream_.IsCancelled()) {
    return absl::CancelledError("call cancelled mid-stream; nothing was accumulated");
  }
  return InvalidField(layout_.shared_rows != nullptr ? "chunk.shared_rows" : "chunk.hidden",
                      absl::StrCat(layout_.num_tokens, " rows (num_tokens)"),
                      absl::StrCat(received_rows_, " before the stream ended"));
}

absl::Span<uint8_t> RowReader::FreeSpaceForRows() {
  if (layout_.shared_rows != nullptr || received_rows_ == layout_.num_tokens) return {};
  if (rows_in_filling_ == 0) {
    absl::MutexLock lock(&mu_);
    if (released_ + kBuffers <= filling_chunk_) return {};  // the engine still reads it
  }
  return absl::MakeSpan(BufferOf(filling_chunk_) + rows_in_filling_ * row_bytes_,
                        (RowsInChunk(filling_chunk_) - rows_in_filling_) * row_bytes_);
}

absl::Status RowReader::TakeMessage(const wire::ComputeRequestFrame& request) {
  if (request.message.has_start()) {
    return InvalidField("start", "exactly one ComputeStart, first", "a second one");
  }
  if (layout_.shared_rows != nullptr) return TakeAnnouncement(request);
  if (request.message.chunk().shared_rows() != 0) {
    return InvalidField("chunk.shared_rows",
                        "0 (a call announces rows only with shared_memory.rows_follow)",
                        absl::StrCat(request.message.chunk().shared_rows()));
  }
  const wire::BulkBytes& hidden = request.rows[wire::kHiddenRows];
  const int64_t bytes = hidden.size();
  if (bytes % row_bytes_ != 0) {
    return InvalidField(
        "chunk.hidden",
        absl::StrCat("whole rows of ", layout_.hidden_size, " ", DTypeName(layout_.dtype),
                     " values (", row_bytes_, " bytes each)"),
        absl::StrCat(bytes, " bytes"));
  }
  const int64_t rows = bytes / row_bytes_;
  if (received_rows_ + rows > layout_.num_tokens) {
    return InvalidField("chunk.hidden",
                        absl::StrCat(layout_.num_tokens, " rows in all (num_tokens)"),
                        absl::StrCat("at least ", received_rows_ + rows));
  }
  // The side streams: the same rows as `hidden`, and none the call does not take.
  std::array<const wire::BulkBytes*, 1 + kMaxSideStreams> sources{&hidden};
  int64_t message_bytes = bytes;
  for (const SideField field : kSideFields) {
    const wire::BulkBytes& side = SideBytes(request, field);
    const auto stream = std::find_if(layout_.side.begin(), layout_.side.end(),
                                     [field](const SideStream& s) { return s.field == field; });
    if (stream == layout_.side.end()) {
      if (!side.empty()) {
        return InvalidField(absl::StrCat("chunk.", SideFieldName(field)),
                            "none (only a call with a teacher that takes it sends it)",
                            absl::StrCat(side.size(), " bytes"));
      }
      continue;
    }
    if (side.size() != rows * stream->row_bytes) {
      return InvalidField(
          absl::StrCat("chunk.", SideFieldName(field)),
          absl::StrCat(rows, " rows of ", stream->row_description, " (", stream->row_bytes,
                       " bytes each): as many rows as chunk.hidden carries"),
          absl::StrCat(side.size(), " bytes"));
    }
    sources[1 + (stream - layout_.side.begin())] = &side;
    message_bytes += side.size();
  }
  if (metrics_ != nullptr) metrics_->AddBytesReceived(message_bytes);
  for (int64_t taken = 0; taken < rows;) {
    if (rows_in_filling_ == 0) RETURN_IF_ERROR(WaitForFreeBuffer(request));
    const int64_t take = std::min(rows - taken, RowsInChunk(filling_chunk_) - rows_in_filling_);
    for (size_t s = 0; s <= layout_.side.size(); ++s) {
      const int64_t stream_row_bytes = StreamRowBytes(layout_, s);
      uint8_t* into = BufferOf(filling_chunk_, static_cast<int>(s));
      sources[s]->CopyTo(taken * stream_row_bytes, take * stream_row_bytes,
                         into + rows_in_filling_ * stream_row_bytes);
    }
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

// The rows lie in shared memory: a message says how many leading rows are in place, a count that
// only grows, and carries nothing else.
absl::Status RowReader::TakeAnnouncement(const wire::ComputeRequestFrame& request) {
  const v1::ComputeChunk& chunk = request.message.chunk();
  if (std::any_of(request.rows.begin(), request.rows.end(),
                  [](const wire::BulkBytes& field) { return !field.empty(); })) {
    return InvalidField(
        "chunk", "only shared_rows (the rows are in shared memory: shared_memory.rows_follow)",
        "row bytes");
  }
  const int64_t rows = chunk.shared_rows();
  if (rows <= received_rows_ || rows > layout_.num_tokens) {
    return InvalidField(
        "chunk.shared_rows",
        absl::StrCat("a count of rows in place in (", received_rows_, ", ", layout_.num_tokens,
                     "]: more than the last one announced, at "
                     "most num_tokens"),
        absl::StrCat(rows));
  }
  received_rows_ = rows;
  while (RowsInChunk(filling_chunk_) > 0 &&
         ChunkFirstRow(filling_chunk_) + RowsInChunk(filling_chunk_) <= received_rows_) {
    ++filling_chunk_;
  }
  absl::MutexLock lock(&mu_);
  filled_ = filling_chunk_;
  return absl::OkStatus();
}

absl::Status RowReader::WaitForFreeBuffer(const wire::ComputeRequestFrame& request) {
  const int64_t chunk = filling_chunk_;
  absl::MutexLock lock(&mu_);
  // Chunk c fills the buffer that chunk c - kBuffers used.
  const auto free_or_stopped = [this, chunk]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || released_ + kBuffers > chunk;
  };
  // Only the engine frees a buffer, so an unadmitted call holds the message until admission.
  if (!free_or_stopped() && !admitted_ && pending_.memory != nullptr) {
    ASSIGN_OR_RETURN(held_message_, pending_.Reserve(request.SpaceUsed()));
  }
  mu_.Await(absl::Condition(&free_or_stopped));
  held_message_.Release();
  if (stop_) return absl::CancelledError("the call ended before its rows were all read");
  return absl::OkStatus();
}

absl::Status RowReader::Error() {
  absl::MutexLock lock(&mu_);
  return done_ ? status_ : absl::OkStatus();
}

void RowReader::Admitted() {
  absl::MutexLock lock(&mu_);
  admitted_ = true;
  held_message_.Release();
}

absl::Status RowReader::AwaitFirstChunk() {
  absl::MutexLock lock(&mu_);
  const auto ready_or_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return filled_ > 0 || done_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready_or_done), idle_limit_)) {
    return StreamIdleError(layout_.num_tokens == 0 ? std::string("the end of the stream")
                                                   : absl::StrCat("rows [0, ", RowsInChunk(0), ")"),
                           idle_limit_);
  }
  return status_;
}

bool RowReader::ChunkReady() {
  absl::MutexLock lock(&mu_);
  return filled_ > taken_ || done_;
}

absl::StatusOr<RowChunk> RowReader::Next() {
  absl::MutexLock lock(&mu_);
  const auto ready_or_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return filled_ > taken_ || done_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready_or_done), idle_limit_)) {
    const int64_t first = ChunkFirstRow(taken_);
    return StreamIdleError(absl::StrCat("rows [", first, ", ", first + RowsInChunk(taken_), ")"),
                           idle_limit_);
  }
  // A failed read ends the call even when rows before it are waiting.
  if (done_ && !status_.ok()) return status_;
  if (filled_ == taken_) {
    return absl::InternalError("RowReader::Next called after the call's last chunk");
  }
  const int64_t chunk = taken_++;
  const void* chunk_rows = layout_.shared_rows != nullptr
                               ? layout_.shared_rows + ChunkFirstRow(chunk) * row_bytes_
                               : BufferOf(chunk);
  RowChunk rows{chunk_rows, ChunkFirstRow(chunk), RowsInChunk(chunk), {}};
  for (size_t s = 0; s < layout_.side.size(); ++s) {
    rows.side_rows[s] = BufferOf(chunk, static_cast<int>(s) + 1);
  }
  return rows;
}

void RowReader::Release() {
  absl::MutexLock lock(&mu_);
  released_ = taken_;
}

absl::Status RowReader::Finish() {
  {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), idle_limit_)) {
      return StreamIdleError("the end of the stream after its last row", idle_limit_);
    }
  }
  thread_.join();
  absl::MutexLock lock(&mu_);
  return status_;
}

void RowReader::Stop(const absl::Status& reason) {
  if (!thread_.joinable()) return;
  bool done;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    done = done_;
  }
  if (!done) stream_.End(reason);
  thread_.join();
}

}  // namespace lossd::server
