// A client's rows and dL/dh in a memfd of the client's, mapped into the server
// (ComputeStart.shared_memory in lossd.proto).
#ifndef LOSSD_SERVER_SHARED_MEMORY_H_
#define LOSSD_SERVER_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::server {

// Whether a gRPC peer, as ServerContext::peer() names it, is on this host: a loopback address or
// a Unix socket. Shared memory is only offered to those.
bool IsLocalPeer(absl::string_view peer);

// One memfd mapped into the server; unmapped when its last holder lets go.
struct SharedMapping {
  SharedMapping(uint8_t* data, uint64_t bytes, bool writable, dev_t device, ino_t inode)
      : data(data), bytes(bytes), writable(writable), device(device), inode(inode) {}
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping();

  uint8_t* const data;
  const uint64_t bytes;
  const bool writable;
  const dev_t device;  // with inode: which memfd, whichever process or descriptor names it
  const ino_t inode;
};

// One call's view of its client's memfd.
class SharedCallMemory {
 public:
  const uint8_t* hidden() const { return mapping_->data + hidden_offset_; }
  uint8_t* grad_hidden() const { return mapping_->data + grad_hidden_offset_; }

 private:
  friend class SharedMemoryMaps;
  std::shared_ptr<const SharedMapping> mapping_;  // null for a call without rows
  uint64_t hidden_offset_ = 0;
  uint64_t grad_hidden_offset_ = 0;
};

// Maps the memfds calls name, and keeps the mappings between calls: mapping 256 MiB and filling
// its page table costs about 30 ms here and unmapping it another 10, which a client that reuses
// its memfd (both of lossd's clients do) would otherwise pay on every call. A mapping keeps the
// client's pages alive, so an idle one is dropped once its memfd is no longer open in the process
// that named it (checked every sweep period), and beyond the `max_idle` most recently used.
class SharedMemoryMaps {
 public:
  // Offsets into a memfd are multiples of this, so that rows start on a cache line.
  static constexpr uint64_t kAlignment = 64;

  explicit SharedMemoryMaps(size_t max_idle = 8, absl::Duration sweep_period = absl::Seconds(5));
  SharedMemoryMaps(const SharedMemoryMaps&) = delete;
  SharedMemoryMaps& operator=(const SharedMemoryMaps&) = delete;
  ~SharedMemoryMaps();

  // Checks the layout of `request` for `hidden_bytes` of rows and `grad_hidden_bytes` of dL/dh
  // (0: none asked for) and maps the memfd: read-only without dL/dh, read-write with it. The memfd
  // must be sealed against shrinking, so that no mapped page can go away (touching it would kill
  // the server with SIGBUS), and must hold the whole layout.
  absl::StatusOr<SharedCallMemory> Map(const v1::SharedMemory& request, uint64_t hidden_bytes,
                                       uint64_t grad_hidden_bytes);

  // Drops the idle mappings whose memfd the process that named it no longer holds.
  void Sweep();

  size_t mappings() const;
  uint64_t mapped_bytes() const;
  int64_t mappings_created() const;

 private:
  struct Entry {
    std::shared_ptr<SharedMapping> mapping;
    int64_t pid = 0;  // the process and descriptor that last named it
    int32_t fd = 0;
    int64_t last_used = 0;  // a tick of use_clock_
    bool idle() const { return mapping.use_count() == 1; }
  };

  void DropIdleBeyondLimit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_idle_;
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t mappings_created_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Notification stop_sweeping_;
  std::thread sweeper_;  // last: started once everything above is set up
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SHARED_MEMORY_H_
