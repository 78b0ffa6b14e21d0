// The client's side of shared memory (SharedMemory in lossd.proto): memfds that carry a call's
// rows to a server on this host and its dL/dh back, handed over on the server's handover socket
// and kept, registered, for the next call.
#ifndef LOSSD_CLIENT_SHARED_BUFFER_H_
#define LOSSD_CLIENT_SHARED_BUFFER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "lossd/common/unique_fd.h"

namespace lossd::client {

// What GetSharedMemorySocket says of a server's handover socket (SharedMemorySocket).
struct HandoverSocket {
  std::string abstract_name;
  bool rows_follow_pays = false;
};

// One connection to a server's handover socket (HandoverRequest in lossd.proto). The handles it
// registers live as long as it does: the server revokes them when it closes.
class HandoverConnection {
 public:
  // Connects to the abstract socket SharedMemorySocket.abstract_name names; rows_follow_pays is
  // what the server said of copying rows while it computes (SharedMemorySocket.rows_follow_pays).
  static absl::StatusOr<std::shared_ptr<HandoverConnection>> Connect(
      absl::string_view abstract_name, bool rows_follow_pays = false);

  // Hands the memfd `fd` over and returns its handle; the server's code and message otherwise.
  absl::StatusOr<std::string> Register(int fd);
  // Revokes `handle`, so that the server lets go of its memfd.
  absl::Status Release(absl::string_view handle);
  // False once the server has closed the connection (it shut down or restarted): the handles
  // registered on it are gone.
  bool IsOpen() const;
  bool rows_follow_pays() const { return rows_follow_pays_; }

 private:
  HandoverConnection(UniqueFd socket, bool rows_follow_pays)
      : socket_(std::move(socket)), rows_follow_pays_(rows_follow_pays) {}
  // Sends `request` (with descriptor `fd`, unless -1) and returns the reply's handle.
  absl::StatusOr<std::string> Exchange(const std::string& request, int fd);

  const UniqueFd socket_;
  const bool rows_follow_pays_;
  absl::Mutex mu_;  // one request and its reply at a time
};

// A memfd sealed against shrinking (the server maps it; a shrunk mapping would kill it) and
// mapped read-write here.
class SharedBuffer {
 public:
  // `name` is what /proc/<pid>/maps and fd links show ("memfd:<name>").
  static absl::StatusOr<std::unique_ptr<SharedBuffer>> Create(uint64_t bytes,
                                                              const char* name = "lossd-rows");
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  // Releases its handle, if any, before the memfd is closed.
  ~SharedBuffer();

  int fd() const { return fd_; }
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Its handle on `connection`, registering it there first unless it is already. A shared
  // region's buffer may serve several calls at once.
  absl::StatusOr<std::string> HandleOn(const std::shared_ptr<HandoverConnection>& connection);

 private:
  SharedBuffer(int fd, uint8_t* data, uint64_t size) : fd_(fd), data_(data), size_(size) {}

  const int fd_;
  uint8_t* const data_;
  const uint64_t size_;
  absl::Mutex mu_;
  std::shared_ptr<HandoverConnection> registered_on_ ABSL_GUARDED_BY(mu_);
  std::string handle_ ABSL_GUARDED_BY(mu_);
};

// A client's handover connection, opened on first use and again once the server has closed it.
class Handover {
 public:
  // The open connection. `socket` asks the server for its socket (GetSharedMemorySocket); it is
  // called only when a connection must be opened.
  absl::StatusOr<std::shared_ptr<HandoverConnection>> Get(
      absl::FunctionRef<absl::StatusOr<HandoverSocket>()> socket);
  // Whether a connection could be opened, tried on the first ask only: the client's default
  // for calls that do not say how their rows travel.
  bool Offered(absl::FunctionRef<absl::StatusOr<HandoverSocket>()> socket);

 private:
  absl::Mutex mu_;
  std::shared_ptr<HandoverConnection> connection_ ABSL_GUARDED_BY(mu_);
  absl::Mutex offered_mu_;  // held while the first ask runs, so that it runs once
  std::optional<bool> offered_ ABSL_GUARDED_BY(offered_mu_);
};

// Buffers between calls: a call takes one at least as large as it needs (or a new one) and gives
// it back, so that the pages of a batch's size are allocated once, not on every call. Calls
// through messages that lend their dL/dh (ComputeRequest::lend_grad_hidden) receive it in them.
//
// It also knows the client's shared regions (Client::NewSharedRegion), so that a call finds the
// one its rows lie in.
class SharedBufferPool : public std::enable_shared_from_this<SharedBufferPool> {
 public:
  absl::StatusOr<std::unique_ptr<SharedBuffer>> Acquire(uint64_t bytes);
  void Release(std::unique_ptr<SharedBuffer> buffer);

  // `buffer`'s bytes from `offset` on, lent: it comes back to the pool when the last copy of the
  // pointer goes (or is freed, the pool gone). Null, `buffer` untouched, when kMaxLent are out.
  std::shared_ptr<const uint8_t> Lend(std::unique_ptr<SharedBuffer>& buffer, uint64_t offset);

  void AddRegion(const std::shared_ptr<SharedBuffer>& region);
  // The live region holding all of [data, data + bytes), and the offset of `data` in it; null
  // when none does.
  std::shared_ptr<SharedBuffer> FindRegion(const void* data, uint64_t bytes, uint64_t& offset);

 private:
  // As many as calls a client typically runs at once; more are freed on release.
  static constexpr size_t kMaxIdle = 4;
  // Lent out at once: beyond them dL/dh is copied, so that a caller keeping many results does not
  // hold a memfd (and a server handle) for each.
  static constexpr int kMaxLent = 4;

  absl::Mutex mu_;
  int lent_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<SharedBuffer>> idle_ ABSL_GUARDED_BY(mu_);
  std::vector<std::weak_ptr<SharedBuffer>> regions_ ABSL_GUARDED_BY(mu_);
};

// Threads worth copying `bytes` with: one per 8 MiB, at most four and no more than the host's.
// A call's rows go into its memfd and its dL/dh comes out of it while the server waits; one thread
// alone moved 128 MiB in 20 to 28 ms on a 2-core host, two in 13 to 19 ms.
size_t CopyThreads(size_t bytes);

// share(0) on this thread and share(1) ... share(shares - 1) on threads of their own (on this one
// where no thread can be started); returns once all have.
void RunShares(size_t shares, absl::FunctionRef<void(size_t)> share);

// memcpy split over CopyThreads(bytes) threads.
void CopyInParallel(void* dst, const void* src, size_t bytes);

}  // namespace lossd::client

#endif  // LOSSD_CLIENT_SHARED_BUFFER_H_
