#include "server/shm/shared_memory.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::server {
namespace {

constexpr char kExpectedMemfd[] =
    "a memfd sealed against shrinking (memfd_create with MFD_ALLOW_SEALING, without MFD_HUGETLB, "
    "then fcntl F_ADD_SEALS with F_SEAL_SHRINK)";

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

// What /proc/self/fd shows for `fd` ("/memfd:lossd-rows (deleted)", "pipe:[1234]"), or "".
std::string DescriptorTarget(int fd) {
  std::string target(256, '\0');
  const ssize_t length =
      readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target.data(), target.size() - 1);
  target.resize(length > 0 ? static_cast<size_t>(length) : 0);
  return target;
}

// What a descriptor that is no memfd is, for the refusal. statx with AT_STATX_DONT_SYNC answers
// from the kernel's cached attributes, so that a file on a network or FUSE file system cannot
// make the handover thread wait on its server.
std::string DescribeDescriptor(int fd) {
  struct statx info;
  if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &info) == 0) {
    switch (info.stx_mode & S_IFMT) {
      case S_IFDIR: return "a directory";
      case S_IFIFO: return "a pipe";
      case S_IFSOCK: return "a socket";
      case S_IFCHR: return "a character device";
      case S_IFBLK: return "a block device";
      case S_IFREG: return "a regular file that is not a memfd";
      default: break;
    }
  }
  const std::string target = DescriptorTarget(fd);
  return target.empty() ? "a descriptor of unknown kind" : absl::StrCat("a descriptor of ", target);
}

// From the kernel's CSPRNG (getrandom).
absl::StatusOr<std::string> RandomHandle() {
  std::string handle(SharedMemoryMaps::kHandleBytes, '\0');
  if (getentropy(handle.data(), handle.size()) != 0) {
    return ErrnoError("register_memfd: random bytes for a handle", errno);
  }
  return handle;
}

int WriteSeals() {
  int seals = F_SEAL_WRITE;
#ifdef F_SEAL_FUTURE_WRITE
  seals |= F_SEAL_FUTURE_WRITE;
#endif
  return seals;
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

bool IsLocalPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:") ||
         absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]") ||
         absl::StartsWith(peer, "ipv6:[::ffff:127.");
}

absl::Status CheckSharedMemoryOffered(bool allowed, bool peer_is_local) {
  if (!allowed) {
    return absl::FailedPreconditionError(
        "shared_memory: this server takes rows only in ComputeChunk messages (it runs with "
        "--shared_memory=false)");
  }
  if (!peer_is_local) {
    return absl::FailedPreconditionError(
        "shared_memory: only a client on the server's host (loopback or Unix socket) may use it; "
        "send the rows in ComputeChunk messages");
  }
  return absl::OkStatus();
}

SharedMapping::SharedMapping(std::shared_ptr<SharedMappingTotals> totals, uint8_t* data,
                             uint64_t file_offset, uint64_t length, bool writable)
    : totals_(std::move(totals)),
      data_(data),
      file_offset_(file_offset),
      length_(length),
      writable_(writable) {
  totals_->mappings += 1;
  totals_->bytes += static_cast<int64_t>(length_);
}

SharedMapping::~SharedMapping() {
  munmap(data_, length_);
  totals_->mappings -= 1;
  totals_->bytes -= static_cast<int64_t>(length_);
}

// A memfd a client handed over: the server's own descriptor of it.
struct SharedMemoryMaps::Memfd {
  std::string handle;
  UniqueFd fd;
  uint64_t connection = 0;
  uint32_t user = 0;
  bool open_for_writing = false;
};

SharedMemoryMaps::SharedMemoryMaps(Limits limits) : limits_(limits) {}

absl::StatusOr<std::string> SharedMemoryMaps::Register(UniqueFd memfd, uint64_t connection,
                                                       uint32_t user) {
  // F_GET_SEALS answers only for tmpfs and hugetlbfs files and never reaches another file
  // system's driver; everything else is looked at only once it passed.
  const int seals = fcntl(memfd.get(), F_GET_SEALS);
  if (seals < 0) {
    return InvalidField("register_memfd", kExpectedMemfd, DescribeDescriptor(memfd.get()));
  }
  struct statfs file_system;
  if (fstatfs(memfd.get(), &file_system) != 0) {
    return ErrnoError("register_memfd: fstatfs of the memfd", errno);
  }
  if (file_system.f_type != TMPFS_MAGIC) {
    return InvalidField("register_memfd", kExpectedMemfd,
                        file_system.f_type == HUGETLBFS_MAGIC
                            ? "a memfd of huge pages (MFD_HUGETLB)"
                            : "a file that is not a memfd");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return InvalidField("register_memfd", kExpectedMemfd,
                        absl::StartsWith(DescriptorTarget(memfd.get()), "/memfd:")
                            ? "a memfd without F_SEAL_SHRINK"
                            : "a tmpfs file that is not a memfd (it cannot be sealed)");
  }
  const int flags = fcntl(memfd.get(), F_GETFL);
  if (flags < 0) return ErrnoError("register_memfd: F_GETFL of the memfd", errno);
  if ((flags & O_ACCMODE) == O_WRONLY) {
    return InvalidField("register_memfd", "a memfd open for reading", "one open for writing only");
  }

  auto registered = std::make_shared<Memfd>();
  ASSIGN_OR_RETURN(registered->handle, RandomHandle());
  registered->fd = std::move(memfd);
  registered->connection = connection;
  registered->user = user;
  registered->open_for_writing = (flags & O_ACCMODE) == O_RDWR;

  absl::MutexLock lock(&mu_);
  size_t of_connection = 0;
  size_t of_user = 0;
  for (const auto& [handle, held] : handles_) {
    of_connection += held->connection == connection ? 1 : 0;
    of_user += held->user == user ? 1 : 0;
  }
  if (of_connection >= limits_.max_handles_per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register_memfd: expected at most ", limits_.max_handles_per_connection,
        " handles per connection (release_handle the memfds no longer used), got one more"));
  }
  if (of_user >= limits_.max_handles_per_user) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register_memfd: expected at most ", limits_.max_handles_per_user,
        " handles per local user (uid ", user, " holds ", of_user,
        " on its connections; release_handle the memfds no longer used), got one more"));
  }
  if (handles_.size() >= limits_.max_handles) {
    return absl::ResourceExhaustedError(
        absl::StrCat("register_memfd: the server holds ", handles_.size(),
                     " handles, its limit; try again once other clients have released theirs"));
  }
  // 128 random bits do not collide; the check costs nothing.
  if (!handles_.emplace(registered->handle, registered).second) {
    return absl::InternalError("register_memfd: a fresh random handle is taken already");
  }
  return registered->handle;
}

absl::Status SharedMemoryMaps::Release(absl::string_view handle, uint64_t connection) {
  absl::MutexLock lock(&mu_);
  auto it = handles_.find(std::string(handle));
  if (it == handles_.end() || it->second->connection != connection) {
    return absl::NotFoundError(
        "release_handle.handle: expected a handle this connection registered and has not "
        "released, got an unknown one");
  }
  RevokeLocked(it->second);
  return absl::OkStatus();
}

void SharedMemoryMaps::RevokeConnection(uint64_t connection) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Memfd>> revoked;
  for (const auto& [handle, memfd] : handles_) {
    if (memfd->connection == connection) revoked.push_back(memfd);
  }
  for (const auto& memfd : revoked) RevokeLocked(memfd);
}

void SharedMemoryMaps::RevokeLocked(std::shared_ptr<const Memfd> memfd) {
  handles_.erase(memfd->handle);
  // Calls still running on a mapping keep it until they end.
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& entry) { return entry.memfd == memfd; }),
                 entries_.end());
}

absl::StatusOr<std::shared_ptr<const SharedMemoryMaps::Memfd>> SharedMemoryMaps::Find(
    absl::string_view field, absl::string_view handle, uint64_t end, bool for_writing,
    struct stat& info) const {
  if (handle.size() != kHandleBytes) {
    return InvalidField(
        field,
        absl::StrCat("the ", kHandleBytes, "-byte handle the server's handover socket returned"),
        absl::StrCat(handle.size(), " bytes"));
  }
  std::shared_ptr<const Memfd> memfd;
  {
    absl::MutexLock lock(&mu_);
    auto it = handles_.find(std::string(handle));
    if (it != handles_.end()) memfd = it->second;
  }
  if (memfd == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        field,
        ": expected a handle registered on this server's handover socket and not revoked (its "
        "connection still open), got an unknown or revoked handle"));
  }
  // No page can go away (F_SEAL_SHRINK), but the memfd may have grown since it was registered.
  if (fstat(memfd->fd.get(), &info) != 0) {
    return ErrnoError(absl::StrCat(field, ": fstat of the memfd"), errno);
  }
  if (static_cast<uint64_t>(info.st_size) < end) {
    return InvalidField(field,
                        absl::StrCat("a memfd of at least ", end, " bytes (the layout's end)"),
                        absl::StrCat("one of ", info.st_size, " bytes"));
  }
  if (for_writing) {
    if (!memfd->open_for_writing) {
      return InvalidField(field, "a memfd the server may write dL/dh into",
                          "one handed over open for reading only");
    }
    const int seals = fcntl(memfd->fd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & WriteSeals()) != 0) {
      return InvalidField(field, "a memfd the server may write dL/dh into",
                          "a memfd sealed against writes");
    }
  }
  return memfd;
}

absl::StatusOr<SharedCallMemory> SharedMemoryMaps::Map(const v1::SharedMemory& request,
                                                       uint64_t hidden_bytes,
                                                       uint64_t grad_hidden_bytes) {
  const bool separate = !request.grad_hidden_handle().empty();
  const uint64_t hidden_begin = request.hidden_offset();
  const uint64_t grad_begin = request.grad_hidden_offset();
  RETURN_IF_ERROR(CheckOffset("shared_memory.hidden_offset", hidden_begin, hidden_bytes));
  if (grad_hidden_bytes > 0) {
    RETURN_IF_ERROR(CheckOffset("shared_memory.grad_hidden_offset", grad_begin, grad_hidden_bytes));
  }
  const uint64_t hidden_end = hidden_begin + hidden_bytes;
  const uint64_t grad_end = grad_begin + grad_hidden_bytes;
  const bool with_grad = grad_hidden_bytes > 0;

  struct stat rows_info {};
  ASSIGN_OR_RETURN(std::shared_ptr<const Memfd> rows_memfd,
                   Find("shared_memory.handle", request.handle(),
                        separate || !with_grad ? hidden_end : std::max(hidden_end, grad_end),
                        with_grad && !separate, rows_info));
  std::shared_ptr<const Memfd> grad_memfd = rows_memfd;
  bool same_file = true;
  if (separate && with_grad) {
    struct stat grad_info {};
    ASSIGN_OR_RETURN(grad_memfd, Find("shared_memory.grad_hidden_handle",
                                      request.grad_hidden_handle(), grad_end, true, grad_info));
    // Two handles may name one memfd (it was handed over twice).
    same_file = rows_info.st_dev == grad_info.st_dev && rows_info.st_ino == grad_info.st_ino;
  }
  if (with_grad && hidden_bytes > 0 && same_file && hidden_begin < grad_end &&
      grad_begin < hidden_end) {
    return InvalidField(
        "shared_memory.grad_hidden_offset",
        absl::StrCat("a region clear of the rows at [", hidden_begin, ", ", hidden_end, ")"),
        absl::StrCat("[", grad_begin, ", ", grad_end, ")"));
  }

  SharedCallMemory memory;
  memory.hidden_offset_ = hidden_begin;
  memory.grad_hidden_offset_ = grad_begin;
  if (hidden_bytes > 0) {
    ASSIGN_OR_RETURN(memory.hidden_, MapRange(rows_memfd, hidden_begin, hidden_end, false));
  }
  if (with_grad) {
    ASSIGN_OR_RETURN(memory.grad_hidden_, MapRange(grad_memfd, grad_begin, grad_end, true));
  }
  return memory;
}

absl::StatusOr<std::shared_ptr<const SharedMapping>> SharedMemoryMaps::MapRange(
    const std::shared_ptr<const Memfd>& memfd, uint64_t begin, uint64_t end, bool writable) {
  auto fits = [&](const Entry& entry) {
    return entry.memfd == memfd && entry.mapping->Covers(begin, end) &&
           (entry.mapping->writable() || !writable);
  };
  {
    absl::MutexLock lock(&mu_);
    auto cached = std::find_if(entries_.begin(), entries_.end(), fits);
    if (cached != entries_.end()) {
      cached->last_used = ++use_clock_;
      return std::shared_ptr<const SharedMapping>(cached->mapping);
    }
  }

  // Whole pages around the range; the memfd holds `end`, so no page mapped lies wholly past its
  // end. MAP_POPULATE fills the page table in one pass instead of a fault per page as the engine
  // first touches it.
  const uint64_t page = PageSize();
  const uint64_t first = begin / page * page;
  const uint64_t length = (end + page - 1) / page * page - first;
  void* data = mmap(nullptr, length, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                    MAP_SHARED | MAP_POPULATE, memfd->fd.get(), static_cast<off_t>(first));
  if (data == MAP_FAILED) {
    const int error_number = errno;
    if (writable && error_number == EPERM) {
      return InvalidField("shared_memory.handle", "a memfd the server may write dL/dh into",
                          "a memfd sealed against writes");
    }
    return ErrnoError(absl::StrCat("shared_memory: cannot map bytes [", first, ", ", first + length,
                                   ") of the memfd"),
                      error_number);
  }
  auto mapping = std::make_shared<SharedMapping>(totals_, static_cast<uint8_t*>(data), first,
                                                 length, writable);
  absl::MutexLock lock(&mu_);
  ++mappings_created_;
  // A handle revoked meanwhile: this call may finish on the mapping, nothing keeps it after.
  auto registered = handles_.find(memfd->handle);
  if (registered == handles_.end() || registered->second != memfd) return mapping;
  // Idle mappings of the memfd that this one covers are outgrown.
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& entry) {
                                  const SharedMapping& kept = *entry.mapping;
                                  return entry.idle() && entry.memfd == memfd &&
                                         (mapping->writable() || !kept.writable()) &&
                                         mapping->Covers(kept.file_offset(),
                                                         kept.file_offset() + kept.length());
                                }),
                 entries_.end());
  entries_.push_back({memfd, mapping, ++use_clock_});
  DropIdleBeyondLimit();
  return std::shared_ptr<const SharedMapping>(std::move(mapping));
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
    if (idle <= limits_.max_idle_mappings) return;
    entries_.erase(oldest);
  }
}

size_t SharedMemoryMaps::handles() const {
  absl::MutexLock lock(&mu_);
  return handles_.size();
}

int64_t SharedMemoryMaps::mappings_created() const {
  absl::MutexLock lock(&mu_);
  return mappings_created_;
}

}  // namespace lossd::server
