// Clients' memfds that carry a call's rows and dL/dh (SharedMemory in lossd.proto): the handles
// that name the memfds clients handed over, and the server's mappings of the ranges calls use.
#ifndef LOSSD_SERVER_SHM_SHARED_MEMORY_H_
#define LOSSD_SERVER_SHM_SHARED_MEMORY_H_

#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "lossd/common/unique_fd.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::server {

// Whether a gRPC peer, as ServerContext::peer() names it, is on this host: a loopback address or
// a Unix socket. Shared memory is only offered to those.
bool IsLocalPeer(absl::string_view peer);

// OK when shared memory is offered to a peer: the server allows it (--shared_memory) and the peer
// is on its host; else FAILED_PRECONDITION saying which.
absl::Status CheckSharedMemoryOffered(bool allowed, bool peer_is_local);

// Live mappings and their bytes, kept by the mappings themselves, so that a mapping a running call
// still holds counts until it is unmapped.
struct SharedMappingTotals {
  std::atomic<int64_t> mappings{0};
  std::atomic<int64_t> bytes{0};
};

// Pages [file_offset, file_offset + length) of a client's memfd mapped into the server; unmapped
// when the last holder lets go.
class SharedMapping {
 public:
  SharedMapping(std::shared_ptr<SharedMappingTotals> totals, uint8_t* data, uint64_t file_offset,
                uint64_t length, bool writable);
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping();

  // Byte `offset` of the memfd, which the mapping must cover.
  uint8_t* At(uint64_t offset) const { return data_ + (offset - file_offset_); }
  bool Covers(uint64_t begin, uint64_t end) const {
    return file_offset_ <= begin && end <= file_offset_ + length_;
  }
  uint64_t file_offset() const { return file_offset_; }
  uint64_t length() const { return length_; }
  bool writable() const { return writable_; }

 private:
  const std::shared_ptr<SharedMappingTotals> totals_;
  uint8_t* const data_;
  const uint64_t file_offset_;
  const uint64_t length_;
  const bool writable_;
};

// One call's view of its client's memfd: the rows' range mapped read-only (or within a writable
// mapping), dL/dh's range writable.
class SharedCallMemory {
 public:
  const uint8_t* hidden() const { return hidden_ ? hidden_->At(hidden_offset_) : nullptr; }
  uint8_t* grad_hidden() const {
    return grad_hidden_ ? grad_hidden_->At(grad_hidden_offset_) : nullptr;
  }

 private:
  friend class SharedMemoryMaps;
  std::shared_ptr<const SharedMapping> hidden_;       // null without rows
  std::shared_ptr<const SharedMapping> grad_hidden_;  // null without dL/dh
  uint64_t hidden_offset_ = 0;
  uint64_t grad_hidden_offset_ = 0;
};

// The memfds clients handed over on the handover socket (server/shm/handover_socket.h), by handle,
// and the mappings calls made of them.
//
// A handle is 16 bytes from the kernel's CSPRNG, so it cannot be guessed; it is revoked with the
// socket connection that registered it, so a client that exits frees everything it handed over.
// Mappings cover only the pages a call uses: mapping a whole memfd would let a one-row call on a
// sparse 1 GiB memfd make the server fault in (and hold) a GiB. They are kept between calls, since
// mapping 256 MiB and filling its page table costs about 30 ms here and unmapping it another 10,
// which a client reusing its memfd (both of lossd's clients do) would otherwise pay on every
// call; a mapping a newer one of the same memfd covers, those of revoked handles, and idle ones
// beyond the `max_idle_mappings` most recently used are dropped.
class SharedMemoryMaps {
 public:
  // Offsets into a memfd are multiples of this, so that rows start on a cache line.
  static constexpr uint64_t kAlignment = 64;
  static constexpr size_t kHandleBytes = 16;

  struct Limits {
    size_t max_idle_mappings = 16;
    size_t max_handles_per_connection = 64;
    // So that one local user cannot take every handle and lock the others out.
    size_t max_handles_per_user = 128;
    size_t max_handles = 256;  // each holds a descriptor open in the server
  };

  explicit SharedMemoryMaps(Limits limits);
  SharedMemoryMaps() : SharedMemoryMaps(Limits()) {}
  SharedMemoryMaps(const SharedMemoryMaps&) = delete;
  SharedMemoryMaps& operator=(const SharedMemoryMaps&) = delete;

  // Registers `memfd`, which handover connection `connection` of local user `user` (its peer's
  // uid) passed, and returns its handle. INVALID_ARGUMENT unless it is a memfd sealed against
  // shrinking (F_SEAL_SHRINK: no mapped page can go away, which would kill the server with
  // SIGBUS) and open for reading; RESOURCE_EXHAUSTED beyond the limits on handles.
  absl::StatusOr<std::string> Register(UniqueFd memfd, uint64_t connection, uint32_t user);
  // Revokes one handle `connection` registered (NOT_FOUND otherwise).
  absl::Status Release(absl::string_view handle, uint64_t connection);
  // Revokes every handle `connection` registered: it has closed.
  void RevokeConnection(uint64_t connection);

  // Checks the layout of `request` for `hidden_bytes` of rows and `grad_hidden_bytes` of dL/dh
  // (0: none asked for) against the memfds its handles name (dL/dh's own, or the rows'), and maps
  // the two ranges: the rows read-only, dL/dh read-write. Each memfd must hold its range.
  absl::StatusOr<SharedCallMemory> Map(const v1::SharedMemory& request, uint64_t hidden_bytes,
                                       uint64_t grad_hidden_bytes);

  size_t handles() const;
  size_t mappings() const { return static_cast<size_t>(totals_->mappings.load()); }
  uint64_t mapped_bytes() const { return static_cast<uint64_t>(totals_->bytes.load()); }
  int64_t mappings_created() const;

 private:
  struct Memfd;
  struct Entry {
    std::shared_ptr<const Memfd> memfd;
    std::shared_ptr<SharedMapping> mapping;
    int64_t last_used = 0;  // a tick of use_clock_
    bool idle() const { return mapping.use_count() == 1; }
  };

  // The memfd `handle` names, holding at least `end` bytes and, `for_writing`, writable by the
  // server; `info` its fstat. Errors name `field`.
  absl::StatusOr<std::shared_ptr<const Memfd>> Find(absl::string_view field,
                                                    absl::string_view handle, uint64_t end,
                                                    bool for_writing, struct stat& info) const;
  // A mapping of the memfd covering [begin, end), kept or new.
  absl::StatusOr<std::shared_ptr<const SharedMapping>> MapRange(
      const std::shared_ptr<const Memfd>& memfd, uint64_t begin, uint64_t end, bool writable);
  // By value: the entry it is called with is among those it erases.
  void RevokeLocked(std::shared_ptr<const Memfd> memfd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropIdleBeyondLimit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  const std::shared_ptr<SharedMappingTotals> totals_ = std::make_shared<SharedMappingTotals>();
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Memfd>> handles_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t mappings_created_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_SHM_SHARED_MEMORY_H_
