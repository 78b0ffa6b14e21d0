// Buffers for Compute calls (on the device: workspaces and staging gradients; on the host: rows in
// from messages and dL/dh out to them), kept for the next call instead of freed. A fresh buffer
// costs more than the work it holds at small batches: on the CPU the first touch of every page
// maps it (a 1 GiB staging dL/dW: 0.3 s on two cores, as long as a quarter of a 512-token call at
// V = 128256; 16384 rows of 2048 floats in and out through messages: 13% of the call), on a GPU
// cudaMalloc and cudaFree synchronize the device.
//
// Idle buffers are charged to MemoryPurpose::kCache. Before a new buffer is allocated, idle ones
// are freed, least recently used first, until the cache's buffers, in use and idle, fit its
// capacity with the new one: with the scheduler's budget as capacity, what admitted calls hold
// plus what is kept idle never exceeds that budget. Reuse is by exact size, so a buffer handed out
// is always the size the caller planned with.
#ifndef LOSSD_SERVER_MEMORY_BUFFER_CACHE_H_
#define LOSSD_SERVER_MEMORY_BUFFER_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <list>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "lossd/kernels/backend.h"
#include "server/memory/memory_ledger.h"

namespace lossd::server {

class BufferCache;

// A buffer lent to one call, charged to the purpose it was taken for; returned to the cache (its
// contents as the call left them) when the lease ends. A holder may move the buffer out to keep it
// (the first dL/dW a head accumulates becomes its accumulator): the cache then forgets it.
class BufferLease {
 public:
  BufferLease() = default;
  BufferLease(BufferLease&& other) noexcept { *this = std::move(other); }
  BufferLease& operator=(BufferLease&& other) noexcept;
  BufferLease(const BufferLease&) = delete;
  BufferLease& operator=(const BufferLease&) = delete;
  ~BufferLease() { Release(); }
  void Release();

  bool held() const { return cache_ != nullptr; }
  DeviceBuffer& buffer() { return buffer_; }

 private:
  friend class BufferCache;
  BufferLease(BufferCache* cache, DeviceBuffer buffer, MemoryCharge charge)
      : cache_(cache),
        leased_bytes_(buffer.bytes()),
        buffer_(std::move(buffer)),
        charge_(std::move(charge)) {}

  BufferCache* cache_ = nullptr;
  size_t leased_bytes_ = 0;  // what the cache counts as lent, even once the buffer was moved out
  DeviceBuffer buffer_;
  MemoryCharge charge_;
};

class BufferCache {
 public:
  // capacity_bytes 0 keeps nothing: every lease frees its buffer when it ends.
  BufferCache(BufferAllocator& allocator, MemoryLedger& ledger, int64_t capacity_bytes);
  ~BufferCache();

  // A buffer of exactly `bytes`, idle or new; its contents are undefined.
  absl::StatusOr<BufferLease> Acquire(size_t bytes, MemoryPurpose purpose);

  int64_t idle_bytes() const;
  // Frees every idle buffer.
  void Clear();
  // Changes the bound (it follows the compute budget), freeing idle buffers beyond it.
  void SetCapacity(int64_t capacity_bytes);

 private:
  friend class BufferLease;
  struct Idle {
    DeviceBuffer buffer;
    MemoryCharge charge;
  };
  // Ends a lease of `leased_bytes`; keeps `buffer` idle unless it was moved out (empty).
  void Return(DeviceBuffer buffer, size_t leased_bytes);
  // The allocator's buffer, or RESOURCE_EXHAUSTED also when it throws std::bad_alloc.
  absl::StatusOr<DeviceBuffer> AllocateOrStatus(size_t bytes);
  // Frees idle buffers, least recently used first, until `incoming` more bytes fit.
  void EvictFor(int64_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  BufferAllocator& allocator_;
  MemoryLedger& ledger_;
  mutable absl::Mutex mu_;
  int64_t capacity_bytes_ ABSL_GUARDED_BY(mu_);
  std::list<Idle> idle_ ABSL_GUARDED_BY(mu_);  // most recently returned first
  int64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t leased_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_MEMORY_BUFFER_CACHE_H_
