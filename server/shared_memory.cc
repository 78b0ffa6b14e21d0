#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {
namespace {

absl::Status CheckOffset(absl::string_view field, uint64_t offset, uint64_t bytes) {
  if (offset % SharedMemoryMaps::kAlignment != 0) {
    return InvalidField(field, absl::StrCat("a multiple of ", SharedMemoryMaps::kAlignment),
                        absl::StrCat(offset));
  }
  if (offset > std::numeric_limits<uint64_t>::max() - bytes) {
    return InvalidField(field, absl::StrCat("an offset at which ", bytes, " bytes fit in 64 bits"),
                        absl::StrCat(offset));
  }
  return absl::OkStatus();
}

std::string DescriptorPath(int64_t pid, int32_t fd) { return absl::StrCat("/proc/", pid, "/fd/", fd); }

}  // namespace

bool IsLocalPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:") ||
         absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]") ||
         absl::StartsWith(peer, "ipv6:[::ffff:127.");
}

SharedMapping::~SharedMapping() { munmap(data, bytes); }

SharedMemoryMaps::SharedMemoryMaps(size_t max_idle, absl::Duration sweep_period)
    : max_idle_(max_idle), sweeper_([this, sweep_period] {
        while (!stop_sweeping_.WaitForNotificationWithTimeout(sweep_period)) Sweep();
      }) {}

SharedMemoryMaps::~SharedMemoryMaps() {
  stop_sweeping_.Notify();
  sweeper_.join();
}

absl::StatusOr<SharedCallMemory> SharedMemoryMaps::Map(const v1::SharedMemory& request,
                                                       uint64_t hidden_bytes, uint64_t grad_hidden_bytes) {
  if (request.pid() <= 0) {
    return InvalidField("shared_memory.pid", "the client's process id", absl::StrCat(request.pid()));
  }
  if (request.fd() < 0) {
    return InvalidField("shared_memory.fd", "the client's descriptor of its memfd", absl::StrCat(request.fd()));
  }
  RETURN_IF_ERROR(CheckOffset("shared_memory.hidden_offset", request.hidden_offset(), hidden_bytes));
  const uint64_t hidden_end = request.hidden_offset() + hidden_bytes;
  uint64_t end = hidden_end;
  if (grad_hidden_bytes > 0) {
    RETURN_IF_ERROR(
        CheckOffset("shared_memory.grad_hidden_offset", request.grad_hidden_offset(), grad_hidden_bytes));
    const uint64_t grad_end = request.grad_hidden_offset() + grad_hidden_bytes;
    if (hidden_bytes > 0 && request.hidden_offset() < grad_end && request.grad_hidden_offset() < hidden_end) {
      return InvalidField("shared_memory.grad_hidden_offset",
                          absl::StrCat("a region clear of the rows at [", request.hidden_offset(), ", ",
                                       hidden_end, ")"),
                          absl::StrCat("[", request.grad_hidden_offset(), ", ", grad_end, ")"));
    }
    end = std::max(end, grad_end);
  }
  SharedCallMemory memory;
  memory.hidden_offset_ = request.hidden_offset();
  memory.grad_hidden_offset_ = request.grad_hidden_offset();
  if (end == 0) return memory;  // no rows: nothing to map

  const std::string path = DescriptorPath(request.pid(), request.fd());
  const bool writable = grad_hidden_bytes > 0;
  const int fd = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    const int error_number = errno;
    if (error_number == ENOENT) {
      return InvalidField("shared_memory",
                          "the pid and fd of a memfd open in a process on the server's host",
                          absl::StrCat("pid ", request.pid(), ", fd ", request.fd(), ": no such descriptor"));
    }
    return ErrnoError(absl::StrCat("shared_memory: cannot open ", path,
                                   " (client and server must run as the same user, in one PID namespace)"),
                      error_number);
  }
  absl::Cleanup close_fd = [fd] { close(fd); };
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return InvalidField("shared_memory.fd",
                        "a memfd sealed against shrinking (memfd_create with MFD_ALLOW_SEALING, then "
                        "F_ADD_SEALS with F_SEAL_SHRINK)",
                        seals < 0 ? "a file that cannot be sealed" : "a memfd without F_SEAL_SHRINK");
  }
  struct stat info;
  if (fstat(fd, &info) != 0) return ErrnoError(absl::StrCat("shared_memory: cannot stat ", path), errno);
  if (static_cast<uint64_t>(info.st_size) < end) {
    return InvalidField("shared_memory.fd", absl::StrCat("a memfd of at least ", end, " bytes (the layout's end)"),
                        absl::StrCat(info.st_size, " bytes"));
  }

  auto fits = [&](const Entry& entry) {
    return entry.mapping->device == info.st_dev && entry.mapping->inode == info.st_ino &&
           entry.mapping->bytes >= end && (entry.mapping->writable || !writable);
  };
  {
    absl::MutexLock lock(&mu_);
    auto cached = std::find_if(entries_.begin(), entries_.end(), fits);
    if (cached != entries_.end()) {
      cached->pid = request.pid();
      cached->fd = request.fd();
      cached->last_used = ++use_clock_;
      memory.mapping_ = cached->mapping;
      return memory;
    }
  }

  // MAP_POPULATE fills the page table in one pass instead of a fault per page as the engine first
  // touches it. The whole memfd is mapped, so that a later call with a larger batch still fits.
  const uint64_t bytes = static_cast<uint64_t>(info.st_size);
  void* data = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                    MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    const int error_number = errno;
    if (writable && error_number == EPERM) {
      return InvalidField("shared_memory.fd", "a memfd the server may write dL/dh into",
                          "a memfd sealed against writes");
    }
    return ErrnoError(absl::StrCat("shared_memory: cannot map ", bytes, " bytes of ", path), error_number);
  }
  auto mapping = std::make_shared<SharedMapping>(static_cast<uint8_t*>(data), bytes, writable,
                                                 info.st_dev, info.st_ino);
  absl::MutexLock lock(&mu_);
  // An idle mapping of the same memfd is outgrown by this one.
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& entry) {
                                  return entry.idle() && entry.mapping->device == info.st_dev &&
                                         entry.mapping->inode == info.st_ino;
                                }),
                 entries_.end());
  entries_.push_back({mapping, request.pid(), request.fd(), ++use_clock_});
  ++mappings_created_;
  memory.mapping_ = std::move(mapping);
  DropIdleBeyondLimit();
  return memory;
}

void SharedMemoryMaps::DropIdleBeyondLimit() {
  while (true) {
    size_t idle = 0;
    auto oldest = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!it->idle()) continue;
      ++idle;
      if (oldest == entries_.end() || it->last_used < oldest->last_used) oldest = it;
    }
    if (idle <= max_idle_) return;
    entries_.erase(oldest);
  }
}

void SharedMemoryMaps::Sweep() {
  absl::MutexLock lock(&mu_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& entry) {
                                  if (!entry.idle()) return false;
                                  struct stat info;
                                  return stat(DescriptorPath(entry.pid, entry.fd).c_str(), &info) != 0 ||
                                         info.st_dev != entry.mapping->device ||
                                         info.st_ino != entry.mapping->inode;
                                }),
                 entries_.end());
}

size_t SharedMemoryMaps::mappings() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

uint64_t SharedMemoryMaps::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const Entry& entry : entries_) bytes += entry.mapping->bytes;
  return bytes;
}

int64_t SharedMemoryMaps::mappings_created() const {
  absl::MutexLock lock(&mu_);
  return mappings_created_;
}

}  // namespace lossd::server
