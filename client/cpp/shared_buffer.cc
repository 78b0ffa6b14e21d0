#include "client/cpp/shared_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"

namespace lossd::client {

absl::StatusOr<std::unique_ptr<SharedBuffer>> SharedBuffer::Create(uint64_t bytes) {
  // A zero-length mapping is not allowed; a call without rows still names a memfd.
  const uint64_t size = std::max<uint64_t>(bytes, 1);
  const int fd = memfd_create("lossd-rows", MFD_CLOEXEC | MFD_ALLOW_SEALING);
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
    return ErrnoError(absl::StrCat("shared memory: mapping a memfd of ", size, " bytes"), error_number);
  }
  return std::unique_ptr<SharedBuffer>(new SharedBuffer(fd, static_cast<uint8_t*>(data), size));
}

SharedBuffer::~SharedBuffer() {
  munmap(data_, size_);
  close(fd_);
}

absl::StatusOr<std::unique_ptr<SharedBuffer>> SharedBufferPool::Acquire(uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    // The smallest that fits, so that large buffers stay for large calls.
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->size() >= bytes && (best == idle_.end() || (*it)->size() < (*best)->size())) best = it;
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
    auto smallest = std::min_element(idle_.begin(), idle_.end(),
                                     [](const auto& a, const auto& b) { return a->size() < b->size(); });
    idle_.erase(smallest);
  }
}

void CopyInParallel(void* dst, const void* src, size_t bytes) {
  // Below a few MiB a thread's start costs more than it saves.
  constexpr size_t kMinBytesPerThread = size_t{8} << 20;
  constexpr size_t kMaxThreads = 4;
  constexpr size_t kPieceAlignment = 4096;  // each piece starts a whole number of pages in
  const size_t threads = std::clamp<size_t>(
      std::min<size_t>(bytes / kMinBytesPerThread, std::thread::hardware_concurrency()), 1,
      kMaxThreads);
  if (threads == 1) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  const size_t piece = (bytes / threads + kPieceAlignment - 1) / kPieceAlignment * kPieceAlignment;
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) {
    const size_t begin = std::min(bytes, t * piece);
    const size_t end = std::min(bytes, begin + piece);
    const auto copy_piece = [out, in, begin, end] {
      std::memcpy(out + begin, in + begin, end - begin);
    };
    try {
      helpers.emplace_back(copy_piece);
    } catch (const std::system_error&) {  // no thread to be had: this one copies the piece
      copy_piece();
    }
  }
  std::memcpy(out, in, std::min(bytes, piece));
  for (std::thread& helper : helpers) helper.join();
}

}  // namespace lossd::client
