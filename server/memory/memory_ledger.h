// The server's own memory on the compute device, by purpose, current and peak.
#ifndef LOSSD_SERVER_MEMORY_MEMORY_LEDGER_H_
#define LOSSD_SERVER_MEMORY_MEMORY_LEDGER_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace lossd::server {

enum class MemoryPurpose : int {
  kWeights = 0,
  kGradients = 1,  // heads' accumulators and the per-call staging gradients
  kOptimizerState = 2,
  kWorkspace = 3,
  kCache = 4,  // idle call buffers kept for the next call
};
inline constexpr int kMemoryPurposeCount = 5;
const char* MemoryPurposeName(MemoryPurpose purpose);

class MemoryLedger {
 public:
  void Add(MemoryPurpose purpose, int64_t bytes);
  void Release(MemoryPurpose purpose, int64_t bytes);
  int64_t current(MemoryPurpose purpose) const;
  int64_t peak(MemoryPurpose purpose) const;

 private:
  std::array<std::atomic<int64_t>, kMemoryPurposeCount> current_{};
  std::array<std::atomic<int64_t>, kMemoryPurposeCount> peak_{};
};

// Bytes held for one purpose for as long as the charge lives.
class MemoryCharge {
 public:
  MemoryCharge() = default;
  MemoryCharge(MemoryLedger* ledger, MemoryPurpose purpose, int64_t bytes);
  MemoryCharge(MemoryCharge&& other) noexcept { *this = std::move(other); }
  MemoryCharge& operator=(MemoryCharge&& other) noexcept;
  MemoryCharge(const MemoryCharge&) = delete;
  MemoryCharge& operator=(const MemoryCharge&) = delete;
  ~MemoryCharge() { Reset(); }
  void Reset();

 private:
  MemoryLedger* ledger_ = nullptr;
  MemoryPurpose purpose_ = MemoryPurpose::kWeights;
  int64_t bytes_ = 0;
};

}  // namespace lossd::server

#endif  // LOSSD_SERVER_MEMORY_MEMORY_LEDGER_H_
