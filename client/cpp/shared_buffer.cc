#include "client/cpp/shared_buffer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::client {
namespace {

// A reply from a server that is up comes within microseconds; this bounds a hung one.
constexpr int kHandoverTimeoutSeconds = 30;
constexpr size_t kMaxReplyBytes = 4096;

}  // namespace

absl::StatusOr<std::shared_ptr<HandoverConnection>> HandoverConnection::Connect(
    absl::string_view abstract_name, bool rows_follow_pays) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (abstract_name.empty() || abstract_name.size() + 1 > sizeof address.sun_path) {
    return InvalidField("abstract_name", "the name of the server's handover socket",
                        absl::StrCat("\"", abstract_name, "\""));
  }
  std::memcpy(address.sun_path + 1, abstract_name.data(), abstract_name.size());  // abstract
  UniqueFd socket_fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!socket_fd.valid()) return ErrnoError("shared memory: handover socket", errno);
  const timeval timeout{kHandoverTimeoutSeconds, 0};
  setsockopt(socket_fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(socket_fd.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  const socklen_t length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + abstract_name.size());
  if (connect(socket_fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    // The server's socket lives in its network namespace: a client in another one cannot reach it.
    return ErrnoError(
        absl::StrCat("shared memory: connecting to the server's handover socket @", abstract_name,
                     " (client and server must share a network namespace)"),
        errno);
  }
  return std::shared_ptr<HandoverConnection>(
      new HandoverConnection(std::move(socket_fd), rows_follow_pays));
}

absl::StatusOr<std::string> HandoverConnection::Exchange(const std::string& request, int fd) {
  absl::MutexLock lock(&mu_);
  iovec data{const_cast<char*>(request.data()), request.size()};
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof control;
    cmsghdr* rights = CMSG_FIRSTHDR(&message);
    rights->cmsg_level = SOL_SOCKET;
    rights->cmsg_type = SCM_RIGHTS;
    rights->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(rights), &fd, sizeof fd);
  }
  // A request without its reply would pair the next request with this one's reply: after any
  // failure the connection is shut down, and the client opens a new one (IsOpen).
  auto broken = [this](absl::Status status) {
    shutdown(socket_.get(), SHUT_RDWR);
    return status;
  };
  if (sendmsg(socket_.get(), &message, MSG_NOSIGNAL) < 0) {
    return broken(ErrnoError("shared memory: sending to the server's handover socket", errno));
  }
  std::string reply_bytes(kMaxReplyBytes, '\0');
  const ssize_t received = recv(socket_.get(), reply_bytes.data(), reply_bytes.size(), 0);
  if (received < 0) {
    return broken(ErrnoError("shared memory: reading the server's handover reply", errno));
  }
  v1::HandoverReply reply;
  if (received == 0 || !reply.ParseFromArray(reply_bytes.data(), static_cast<int>(received))) {
    return broken(
        absl::UnavailableError("shared memory: the server closed its handover connection"));
  }
  if (reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  }
  return reply.handle();
}

absl::StatusOr<std::string> HandoverConnection::Register(int fd) {
  v1::HandoverRequest request;
  request.mutable_register_memfd();
  return Exchange(request.SerializeAsString(), fd);
}

absl::Status HandoverConnection::Release(absl::string_view handle) {
  v1::HandoverRequest request;
  request.mutable_release_handle()->set_handle(std::string(handle));
  return Exchange(request.SerializeAsString(), -1).status();
}

bool HandoverConnection::IsOpen() const {
  // The server never speaks first: anything to read is the end of the connection.
  pollfd polled{socket_.get(), POLLIN | POLLRDHUP, 0};
  return poll(&polled, 1, 0) == 0;
}

absl::StatusOr<std::shared_ptr<HandoverConnection>> Handover::Get(
    absl::FunctionRef<absl::StatusOr<HandoverSocket>()> socket) {
  absl::MutexLock lock(&mu_);
  if (connection_ == nullptr || !connection_->IsOpen()) {
    connection_ = nullptr;
    ASSIGN_OR_RETURN(const HandoverSocket named, socket());
    ASSIGN_OR_RETURN(connection_,
                     HandoverConnection::Connect(named.abstract_name, named.rows_follow_pays));
  }
  return connection_;
}

bool Handover::Offered(absl::FunctionRef<absl::StatusOr<HandoverSocket>()> socket) {
  absl::MutexLock lock(&offered_mu_);
  if (!offered_.has_value()) offered_ = Get(socket).ok();
  return *offered_;
}

absl::StatusOr<std::unique_ptr<SharedBuffer>> SharedBuffer::Create(uint64_t bytes,
                                                                   const char* name) {
  // A zero-length mapping is not allowed; a call without rows still names a memfd.
  const uint64_t size = std::max<uint64_t>(bytes, 1);
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoError("shared memory: memfd_create", errno);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    const int error_number = errno;
    close(fd);
    return ErrnoError(absl::StrCat("shared memory: sizing and sealing a memfd of ", size, " bytes"),
                      error_number);
  }
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error_number = errno;
    close(fd);
    return ErrnoError(absl::StrCat("shared memory: mapping a memfd of ", size, " bytes"),
                      error_number);
  }
  return std::unique_ptr<SharedBuffer>(new SharedBuffer(fd, static_cast<uint8_t*>(data), size));
}

SharedBuffer::~SharedBuffer() {
  absl::MutexLock lock(&mu_);
  // Without it the server would keep the memfd alive until the connection closes.
  if (registered_on_ != nullptr && registered_on_->IsOpen()) {
    registered_on_->Release(handle_).IgnoreError();
  }
  munmap(data_, size_);
  close(fd_);
}

absl::StatusOr<std::string> SharedBuffer::HandleOn(
    const std::shared_ptr<HandoverConnection>& connection) {
  absl::MutexLock lock(&mu_);
  if (registered_on_ != connection) {
    // A handle on an earlier connection died with it.
    registered_on_ = nullptr;
    ASSIGN_OR_RETURN(handle_, connection->Register(fd_));
    registered_on_ = connection;
  }
  return handle_;
}

absl::StatusOr<std::unique_ptr<SharedBuffer>> SharedBufferPool::Acquire(uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    // The smallest that fits, so that large buffers stay for large calls.
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->size() >= bytes && (best == idle_.end() || (*it)->size() < (*best)->size()))
        best = it;
    }
    if (best != idle_.end()) {
      std::unique_ptr<SharedBuffer> buffer = std::move(*best);
      idle_.erase(best);
      return buffer;
    }
  }
  return SharedBuffer::Create(bytes);
}

void SharedBufferPool::Release(std::unique_ptr<SharedBuffer> buffer) {
  absl::MutexLock lock(&mu_);
  idle_.push_back(std::move(buffer));
  if (idle_.size() > kMaxIdle) {
    // The smallest goes: the calls to come are likeliest to be as large as the largest seen.
    auto smallest = std::min_element(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
      return a->size() < b->size();
    });
    idle_.erase(smallest);
  }
}

std::shared_ptr<const uint8_t> SharedBufferPool::Lend(std::unique_ptr<SharedBuffer>& buffer,
                                                      uint64_t offset) {
  {
    absl::MutexLock lock(&mu_);
    if (lent_ >= kMaxLent) return nullptr;
    ++lent_;
  }
  std::weak_ptr<SharedBufferPool> pool = weak_from_this();
  std::shared_ptr<SharedBuffer> lent(buffer.release(), [pool](SharedBuffer* returned) {
    std::unique_ptr<SharedBuffer> owned(returned);
    if (std::shared_ptr<SharedBufferPool> alive = pool.lock()) {
      {
        absl::MutexLock lock(&alive->mu_);
        --alive->lent_;
      }
      alive->Release(std::move(owned));
    }
  });
  uint8_t* data = lent->data() + offset;
  return std::shared_ptr<const uint8_t>(std::move(lent), data);
}

void SharedBufferPool::AddRegion(const std::shared_ptr<SharedBuffer>& region) {
  absl::MutexLock lock(&mu_);
  regions_.erase(std::remove_if(regions_.begin(), regions_.end(),
                                [](const auto& kept) { return kept.expired(); }),
                 regions_.end());
  regions_.push_back(region);
}

std::shared_ptr<SharedBuffer> SharedBufferPool::FindRegion(const void* data, uint64_t bytes,
                                                           uint64_t& offset) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&mu_);
  for (const std::weak_ptr<SharedBuffer>& kept : regions_) {
    std::shared_ptr<SharedBuffer> region = kept.lock();
    if (region == nullptr) continue;
    const auto region_begin = reinterpret_cast<uintptr_t>(region->data());
    if (region_begin <= begin && begin - region_begin <= region->size() &&
        bytes <= region->size() - (begin - region_begin)) {
      offset = begin - region_begin;
      return region;
    }
  }
  return nullptr;
}

size_t CopyThreads(size_t bytes) {
  // Below a few MiB a thread's start costs more than it saves.
  constexpr size_t kMinBytesPerThread = size_t{8} << 20;
  constexpr size_t kMaxThreads = 4;
  return std::clamp<size_t>(
      std::min<size_t>(bytes / kMinBytesPerThread, std::thread::hardware_concurrency()), 1,
      kMaxThreads);
}

void RunShares(size_t shares, absl::FunctionRef<void(size_t)> share) {
  std::vector<std::thread> helpers;
  for (size_t s = 1; s < shares; ++s) {
    try {
      helpers.emplace_back([share, s] { share(s); });
    } catch (const std::system_error&) {  // no thread to be had: this one runs the share
      share(s);
    }
  }
  if (shares > 0) share(0);
  for (std::thread& helper : helpers) helper.join();
}

void CopyInParallel(void* dst, const void* src, size_t bytes) {
  constexpr size_t kPieceAlignment = 4096;  // each piece starts a whole number of pages in
  const size_t threads = CopyThreads(bytes);
  const size_t piece = (bytes / threads + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  RunShares(threads, [&](size_t t) {
    const size_t begin = std::min(bytes, t * piece);
    const size_t end = std::min(bytes, begin + piece);
    if (end > begin) std::memcpy(out + begin, in + begin, end - begin);
  });
}

}  // namespace lossd::client
