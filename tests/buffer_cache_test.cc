// The cache of call buffers: reuse by exact size, the ledger's view of idle and lent buffers, and
// the capacity that lent plus idle buffers never exceed.
#include "server/memory/buffer_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "lossd/kernels/backend.h"

namespace lossd::server {
namespace {

constexpr size_t kSmall = 1 << 12;
constexpr size_t kLarge = 1 << 16;

class BufferCacheTest : public ::testing::Test {
 protected:
  BufferCacheTest() : backend_(CreateBackend("cpu").value()) {}

  BufferLease Lease(BufferCache& cache, size_t bytes, MemoryPurpose purpose) {
    absl::StatusOr<BufferLease> lease = cache.Acquire(bytes, purpose);
    EXPECT_TRUE(lease.ok()) << lease.status();
    return lease.ok() ? *std::move(lease) : BufferLease();
  }

  std::unique_ptr<Backend> backend_;
  MemoryLedger ledger_;
};

TEST_F(BufferCacheTest, ReturnedBufferIsLentAgainForTheSameSize) {
  BufferCache cache(*backend_, ledger_, 4 * kLarge);
  BufferLease first = Lease(cache, kLarge, MemoryPurpose::kGradients);
  const void* data = first.buffer().data();
  EXPECT_EQ(first.buffer().bytes(), kLarge);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kGradients), static_cast<int64_t>(kLarge));
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), 0);

  first.Release();
  EXPECT_FALSE(first.held());
  EXPECT_EQ(ledger_.current(MemoryPurpose::kGradients), 0);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), static_cast<int64_t>(kLarge));
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(kLarge));

  // Lent for another purpose now: the charge follows the lease, not the buffer's history.
  BufferLease second = Lease(cache, kLarge, MemoryPurpose::kWorkspace);
  EXPECT_EQ(second.buffer().data(), data);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kWorkspace), static_cast<int64_t>(kLarge));
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), 0);
}

TEST_F(BufferCacheTest, OtherSizeGetsAFreshBufferOfExactlyThatSize) {
  BufferCache cache(*backend_, ledger_, 4 * kLarge);
  Lease(cache, kLarge, MemoryPurpose::kWorkspace).Release();
  BufferLease small = Lease(cache, kSmall, MemoryPurpose::kWorkspace);
  EXPECT_EQ(small.buffer().bytes(), kSmall);
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(kLarge)) << "the large buffer stays idle";
}

TEST_F(BufferCacheTest, LentAndIdleBuffersStayWithinCapacity) {
  BufferCache cache(*backend_, ledger_, 2 * kLarge);
  Lease(cache, kLarge, MemoryPurpose::kWorkspace).Release();
  Lease(cache, kSmall, MemoryPurpose::kWorkspace).Release();
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(kLarge + kSmall));
  // Two large buffers lent at once leave no room for anything idle; the least recently returned
  // (the large one, reused) and then the small one go.
  BufferLease a = Lease(cache, kLarge, MemoryPurpose::kGradients);
  BufferLease b = Lease(cache, kLarge, MemoryPurpose::kGradients);
  EXPECT_EQ(cache.idle_bytes(), 0);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), 0);
  a.Release();
  b.Release();
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(2 * kLarge));
}

TEST_F(BufferCacheTest, ZeroCapacityKeepsNothing) {
  BufferCache cache(*backend_, ledger_, 0);
  Lease(cache, kSmall, MemoryPurpose::kWorkspace).Release();
  EXPECT_EQ(cache.idle_bytes(), 0);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), 0);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kWorkspace), 0);
}

TEST_F(BufferCacheTest, ClearFreesIdleBuffers) {
  BufferCache cache(*backend_, ledger_, 4 * kLarge);
  Lease(cache, kLarge, MemoryPurpose::kWorkspace).Release();
  cache.Clear();
  EXPECT_EQ(cache.idle_bytes(), 0);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kCache), 0);
}

TEST_F(BufferCacheTest, FailedAllocationHoldsNothing) {
  BufferCache cache(*backend_, ledger_, 2 * kLarge);
  const absl::StatusOr<BufferLease> impossible =
      cache.Acquire(size_t{1} << 62, MemoryPurpose::kGradients);
  EXPECT_EQ(impossible.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger_.current(MemoryPurpose::kGradients), 0);
  // Nothing of the failed request is counted as lent: two large buffers still fit and stay idle.
  BufferLease a = Lease(cache, kLarge, MemoryPurpose::kWorkspace);
  BufferLease b = Lease(cache, kLarge, MemoryPurpose::kWorkspace);
  a.Release();
  b.Release();
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(2 * kLarge));
}

TEST_F(BufferCacheTest, BufferMovedOutOfALeaseIsForgotten) {
  BufferCache cache(*backend_, ledger_, 2 * kLarge);
  BufferLease lease = Lease(cache, kLarge, MemoryPurpose::kGradients);
  const DeviceBuffer kept = std::move(lease.buffer());
  lease.Release();
  EXPECT_EQ(kept.bytes(), kLarge);
  EXPECT_EQ(cache.idle_bytes(), 0) << "the kept buffer is not idle in the cache";
  EXPECT_EQ(ledger_.current(MemoryPurpose::kGradients), 0) << "its holder charges it now";
  // Nothing of the ended lease is counted as lent: two large buffers still fit and stay idle.
  BufferLease a = Lease(cache, kLarge, MemoryPurpose::kWorkspace);
  BufferLease b = Lease(cache, kLarge, MemoryPurpose::kWorkspace);
  a.Release();
  b.Release();
  EXPECT_EQ(cache.idle_bytes(), static_cast<int64_t>(2 * kLarge));
}

}  // namespace
}  // namespace lossd::server
