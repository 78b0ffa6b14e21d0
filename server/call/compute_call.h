// One Compute stream: validate the start message, wait for the first chunk of rows (a client that
// is slow to send holds no place on the device), then for admission, compute fixed-size row
// chunks as rows arrive, stream results back, and commit dL/dW only when the whole call succeeded.
//
// The engine runs on chunks whose size depends only on the batch shape and the workspace budget,
// never on how the client split its messages, so results are bitwise identical for any split.
#ifndef LOSSD_SERVER_CALL_COMPUTE_CALL_H_
#define LOSSD_SERVER_CALL_COMPUTE_CALL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "lossd/kernels/backend.h"
#include "lossd/v1/lossd.pb.h"
#include "server/call/compute_stream.h"
#include "server/heads/head_store.h"
#include "server/memory/buffer_cache.h"
#include "server/memory/memory_ledger.h"
#include "server/memory/scheduler.h"
#include "server/metrics.h"
#include "server/shm/shared_memory.h"

namespace lossd::server {

struct ComputeLimits {
  size_t workspace_budget_bytes = 256u << 20;
  int64_t max_tokens_per_call = int64_t{1} << 24;
  int64_t max_result_message_bytes = 4 << 20;
  absl::Duration max_admission_wait = absl::Seconds(300);
  // How long the call waits for the client's next engine chunk of rows, the end of its stream,
  // or its reading of a result message before the call is ended (--stream_idle_seconds).
  absl::Duration stream_idle = absl::Seconds(60);
  bool allow_shared_memory = true;  // ComputeStart.shared_memory from clients on this host
  // Call ids a head keeps per accumulator epoch (ComputeStart.call_id); past them a new id is
  // refused, so that no id is ever forgotten within its epoch.
  int64_t max_call_ids = 65536;
  // How long a staged dL/dW (ComputeStart.stage_grad_weight) waits for its commit.
  absl::Duration staged_grad_ttl = absl::Seconds(300);
  // Compute streams that may wait for their start message at once (each costs a little memory,
  // no thread); more are refused with RESOURCE_EXHAUSTED.
  int64_t max_unstarted_streams = 1024;
};

// The longest ComputeStart.call_id accepted.
inline constexpr size_t kMaxCallIdBytes = 64;

struct ComputeEnvironment {
  Backend* backend;
  HeadStore* heads;
  Scheduler* scheduler;
  Metrics* metrics;  // may be null
  MemoryLedger* ledger;
  BufferCache* buffers;             // workspaces and staging gradients
  BufferCache* host_buffers;        // rows from messages and dL/dh for them, in host memory
  SharedMemoryMaps* shared_memory;  // clients' memfds (ComputeStart.shared_memory)
  PendingMemory* pending;           // host memory of calls not yet admitted
  StagingRoom* staging_room;        // staged dL/dW of every head
  ComputeLimits limits;
};

absl::Status RunComputeCall(const ComputeEnvironment& env, ComputeStream& stream);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_COMPUTE_CALL_H_
