// Reads a Compute call's hidden rows on a thread of its own, into engine-chunk-sized buffers, so
// that the next chunk's rows arrive while the engine computes the current one and its results go
// out: the two directions of the stream overlap instead of taking turns. Two buffers: the one the
// engine reads and the one being filled; the reader waits for the engine before refilling.
//
// Chunk boundaries follow the engine's plan, never the client's messages, so the results do not
// depend on how the client split its rows.
//
// Every wait for the client (for a chunk's rows, for the end of the stream) is bounded by the
// stream idle limit (--stream_idle_seconds): a client that sends nothing, or a byte at a time,
// cannot keep the call waiting longer than that for any one chunk.
//
// The reader starts before the call is admitted to the device. Until then (Admitted), a message it
// must hold because both buffers wait for the engine counts as pending memory: a client cannot
// park a message of up to the gRPC limit in each queued call beyond --pending_memory_mib.
#ifndef LOSSD_SERVER_CALL_ROW_READER_H_
#define LOSSD_SERVER_CALL_ROW_READER_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "lossd/kernels/types.h"
#include "server/call/compute_stream.h"
#include "server/memory/buffer_cache.h"
#include "server/memory/scheduler.h"
#include "server/metrics.h"

namespace lossd::server {

// Per-row bytes that a call's ComputeChunk messages carry beside `hidden`, for the same rows: a
// distill call's teacher.
enum class SideField { kTeacherHidden, kTeacherTopKTokens, kTeacherTopKLogprobs };
inline constexpr int kMaxSideStreams = 2;

struct SideStream {
  SideField field;
  int64_t row_bytes = 0;
  std::string row_description;  // what a row holds, for errors ("24 bfloat16 values")
};

struct RowLayout {
  int64_t num_tokens = 0;   // rows the call announced
  int64_t hidden_size = 0;  // values per row
  DType dtype = DType::kFloat32;
  int64_t chunk_rows = 1;  // rows per buffer; the last chunk holds what is left
  // The chunks' end rows when they differ in size (each at most chunk_rows; the last num_tokens),
  // as TokenChunkEnds gives them for chunks that keep sequences whole; empty: every chunk_rows.
  std::vector<int64_t> chunk_ends;
  std::vector<SideStream> side;  // at most kMaxSideStreams; a message without them is refused
  // Where the rows lie already when the client writes them into shared memory as the call runs
  // (SharedMemory.rows_follow): its messages then announce them (ComputeChunk.shared_rows, the
  // count of leading rows in place) instead of carrying them, and chunks are read where they lie.
  // No side streams then.
  const uint8_t* shared_rows = nullptr;
};

// Rows [first_row, first_row + num_rows) of the call, contiguous, and the same rows of each side
// stream (layout.side[i] at side_rows[i]).
struct RowChunk {
  const void* rows = nullptr;
  int64_t first_row = 0;
  int64_t num_rows = 0;
  std::array<const void*, kMaxSideStreams> side_rows{};
};

// The most rows one engine chunk of a call of `num_tokens` rows holds: the call cut into up to
// kOverlappedChunksPerCall equal chunks of at least kMinOverlappedChunkRows rows each (one chunk
// when the call is shorter than two of them). A chunk's rows are read while the chunk before it
// computes, and its results leave while the next one computes, so a call computed as one chunk
// would receive, compute and send in turn; in four chunks those steps overlap for all but a
// quarter of the call at each end. Below 2048 rows a GPU's dL/dW product, which contracts over a
// chunk's rows, falls off its rate. Every call is chunked so, however its rows travel (messages
// or shared memory), so that its results do not depend on the transport.
inline constexpr int64_t kOverlappedChunksPerCall = 4;
inline constexpr int64_t kMinOverlappedChunkRows = 2048;
int64_t OverlappedChunkRowLimit(int64_t num_tokens);

// The row count a call of `num_tokens` rows is planned for: rounded up to one of eight sizes per
// power of two (at most 1/8 more; counts under 16 as they are). Calls whose lengths vary from step
// to step (packing, RL rollouts) then share a few plans, and with them their workspace and row
// buffers, which the server keeps by size: a buffer of a size not seen before is allocated and its
// pages faulted in afresh (on a GPU, cudaMalloc and cudaFree, which synchronize the device).
int64_t PlannedCallRows(int64_t num_tokens);

// The ComputeChunk field of a side stream, as it names it in errors ("teacher_hidden").
absl::string_view SideFieldName(SideField field);

class RowReader {
 public:
  // The host memory a reader of `layout` leases: one chunk buffer, two when the call spans more.
  static int64_t BufferBytes(const RowLayout& layout);

  // Leases its chunk buffers from `host_buffers` and starts reading; `stream`, `metrics` (may be
  // null), `host_buffers` and `pending.memory` (may be null: nothing is counted) must outlive the
  // reader.
  // Waits for the client end with StreamIdleError after `idle_limit`.
  static absl::StatusOr<std::unique_ptr<RowReader>> Start(ComputeStream& stream, Metrics* metrics,
                                                          const RowLayout& layout,
                                                          BufferCache& host_buffers,
                                                          absl::Duration idle_limit,
                                                          PendingAccount pending = {});
  RowReader(const RowReader&) = delete;
  RowReader& operator=(const RowReader&) = delete;
  ~RowReader();

  // Waits until the first chunk's rows are in or the stream has ended, whichever comes first:
  // the call has something to compute once admitted. The reader's error, if it met one.
  absl::Status AwaitFirstChunk();
  // The error the reader has met so far (the call has yet to take it from Next or Finish), or OK:
  // a call waiting for admission stops waiting once its stream has failed.
  absl::Status Error();
  // The call holds its place on the device: a message held from now on is the call's memory, no
  // longer pending memory.
  void Admitted();
  // Whether Next would return at once: the next chunk's rows are in, or the reader has ended.
  bool ChunkReady();
  // The next chunk, once all its rows are in; the previous chunk must have been released. An
  // error (a malformed message, a short or cancelled stream, a client idle for the limit) as soon
  // as the reader meets it.
  absl::StatusOr<RowChunk> Next();
  // Hands the chunk from Next back for refilling.
  void Release();
  // Once every chunk was taken: says whether the call's rows ended well (exactly num_tokens
  // rows). The rows a call announced are the whole call: nothing after its last row is read, and
  // the reader does not wait for the client to half-close.
  absl::Status Finish();
  // Ends reading early because the call failed with `reason`: unless the reader has finished,
  // the stream ends with `reason` at once, so a Read waiting on the client returns. Idempotent.
  void Stop(const absl::Status& reason);

 private:
  static constexpr int kBuffers = 2;

  // The buffers of one chunk: hidden rows, then each side stream's.
  using ChunkBuffers = std::array<BufferLease, 1 + kMaxSideStreams>;

  RowReader(ComputeStream& stream, Metrics* metrics, const RowLayout& layout,
            absl::Duration idle_limit, PendingAccount pending,
            std::array<ChunkBuffers, kBuffers> buffers);
  uint8_t* BufferOf(int64_t chunk, int stream = 0) {
    return static_cast<uint8_t*>(buffers_[chunk % kBuffers][stream].buffer().data());
  }
  void ReadAll();
  absl::Status ReadRows();
  // Where the next message's hidden rows would be copied, if that memory is free now: the rest
  // of the chunk being filled (none while the engine still reads that buffer).
  absl::Span<uint8_t> FreeSpaceForRows();
  absl::Status TakeMessage(const wire::ComputeRequestFrame& request);
  absl::Status TakeAnnouncement(const wire::ComputeRequestFrame& request);
  // Waits until the buffer for chunk filling_chunk_ is free again, holding `request` meanwhile
  // (counted as pending memory before admission); CANCELLED if told to stop.
  absl::Status WaitForFreeBuffer(const wire::ComputeRequestFrame& request);
  int64_t ChunkFirstRow(int64_t chunk) const;
  int64_t RowsInChunk(int64_t chunk) const;

  ComputeStream& stream_;
  Metrics* const metrics_;
  const RowLayout layout_;
  const int64_t row_bytes_;
  const absl::Duration idle_limit_;
  const PendingAccount pending_;
  std::array<ChunkBuffers, kBuffers> buffers_;  // the second only when the call spans two chunks

  // Only the reader thread touches these.
  int64_t received_rows_ = 0;
  int64_t filling_chunk_ = 0;
  int64_t rows_in_filling_ = 0;  // rows of chunk filling_chunk_ already in its buffer

  absl::Mutex mu_;
  int64_t filled_ ABSL_GUARDED_BY(mu_) = 0;    // chunks complete and handed over
  int64_t taken_ ABSL_GUARDED_BY(mu_) = 0;     // chunks returned by Next
  int64_t released_ ABSL_GUARDED_BY(mu_) = 0;  // chunks given back
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;    // the reader thread has finished
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // how it finished
  bool admitted_ ABSL_GUARDED_BY(mu_) = false;
  PendingCharge held_message_ ABSL_GUARDED_BY(mu_);  // while waiting for a buffer, unadmitted

  std::thread thread_;  // last: started once everything above is set up
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_ROW_READER_H_
