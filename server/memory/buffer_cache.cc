#include "server/memory/buffer_cache.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd::server {

BufferLease& BufferLease::operator=(BufferLease&& other) noexcept {
  if (this != &other) {
    Release();
    cache_ = std::exchange(other.cache_, nullptr);
    leased_bytes_ = std::exchange(other.leased_bytes_, 0);
    buffer_ = std::move(other.buffer_);
    charge_ = std::move(other.charge_);
  }
  return *this;
}

void BufferLease::Release() {
  if (cache_ == nullptr) return;
  charge_.Reset();
  std::exchange(cache_, nullptr)->Return(std::move(buffer_), std::exchange(leased_bytes_, 0));
}

BufferCache::BufferCache(BufferAllocator& allocator, MemoryLedger& ledger, int64_t capacity_bytes)
    : allocator_(allocator), ledger_(ledger), capacity_bytes_(capacity_bytes) {}

BufferCache::~BufferCache() { Clear(); }

absl::StatusOr<DeviceBuffer> BufferCache::AllocateOrStatus(size_t bytes) {
  try {
    return allocator_.Allocate(bytes);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("call buffers: could not allocate ", bytes, " bytes"));
  }
}

absl::StatusOr<BufferLease> BufferCache::Acquire(size_t bytes, MemoryPurpose purpose) {
  const int64_t size = static_cast<int64_t>(bytes);
  DeviceBuffer buffer;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->buffer.bytes() != bytes) continue;
      buffer = std::move(it->buffer);
      idle_.erase(it);
      idle_bytes_ -= size;
      break;
    }
    if (buffer.data() == nullptr) EvictFor(size);
    leased_bytes_ += size;
  }
  if (buffer.data() == nullptr) {
    absl::StatusOr<DeviceBuffer> fresh = AllocateOrStatus(bytes);
    if (!fresh.ok()) {
      // Idle buffers of other sizes may be what stands in the way on a full device.
      Clear();
      fresh = AllocateOrStatus(bytes);
    }
    if (!fresh.ok()) {
      absl::MutexLock lock(&mu_);
      leased_bytes_ -= size;
      return fresh.status();
    }
    buffer = *std::move(fresh);
  }
  return BufferLease(this, std::move(buffer), MemoryCharge(&ledger_, purpose, size));
}

void BufferCache::Return(DeviceBuffer buffer, size_t leased_bytes) {
  const int64_t size = static_cast<int64_t>(buffer.bytes());
  absl::MutexLock lock(&mu_);
  leased_bytes_ -= static_cast<int64_t>(leased_bytes);
  // Moved out and kept by the lease's holder, or too large to keep (freed here, outside the list).
  if (buffer.data() == nullptr || size > capacity_bytes_) return;
  EvictFor(size);
  try {
    idle_.push_front({std::move(buffer), MemoryCharge(&ledger_, MemoryPurpose::kCache, size)});
  } catch (const std::bad_alloc&) {
    return;  // no room for the list's node: the buffer is freed rather than kept
  }
  idle_bytes_ += size;
}

void BufferCache::EvictFor(int64_t incoming) {
  while (!idle_.empty() && leased_bytes_ + idle_bytes_ + incoming > capacity_bytes_) {
    idle_bytes_ -= static_cast<int64_t>(idle_.back().buffer.bytes());
    idle_.pop_back();
  }
}

int64_t BufferCache::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

void BufferCache::SetCapacity(int64_t capacity_bytes) {
  absl::MutexLock lock(&mu_);
  capacity_bytes_ = capacity_bytes;
  EvictFor(0);
}

void BufferCache::Clear() {
  std::list<Idle> freed;
  {
    absl::MutexLock lock(&mu_);
    freed.swap(idle_);
    idle_bytes_ = 0;
  }
}

}  // namespace lossd::server
