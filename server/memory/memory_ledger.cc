#include "server/memory/memory_ledger.h"

#include <utility>

namespace lossd::server {

const char* MemoryPurposeName(MemoryPurpose purpose) {
  switch (purpose) {
    case MemoryPurpose::kWeights: return "weights";
    case MemoryPurpose::kGradients: return "gradients";
    case MemoryPurpose::kOptimizerState: return "optimizer_state";
    case MemoryPurpose::kWorkspace: return "workspace";
    case MemoryPurpose::kCache: return "cache";
  }
  return "unknown";
}

void MemoryLedger::Add(MemoryPurpose purpose, int64_t bytes) {
  const int i = static_cast<int>(purpose);
  const int64_t now = current_[i].fetch_add(bytes) + bytes;
  int64_t peak = peak_[i].load();
  while (now > peak && !peak_[i].compare_exchange_weak(peak, now)) {
  }
}

void MemoryLedger::Release(MemoryPurpose purpose, int64_t bytes) {
  current_[static_cast<int>(purpose)].fetch_sub(bytes);
}

int64_t MemoryLedger::current(MemoryPurpose purpose) const {
  return current_[static_cast<int>(purpose)].load();
}

int64_t MemoryLedger::peak(MemoryPurpose purpose) const {
  return peak_[static_cast<int>(purpose)].load();
}

MemoryCharge::MemoryCharge(MemoryLedger* ledger, MemoryPurpose purpose, int64_t bytes)
    : ledger_(ledger), purpose_(purpose), bytes_(bytes) {
  ledger_->Add(purpose_, bytes_);
}

MemoryCharge& MemoryCharge::operator=(MemoryCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    ledger_ = std::exchange(other.ledger_, nullptr);
    purpose_ = other.purpose_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void MemoryCharge::Reset() {
  if (ledger_ != nullptr) ledger_->Release(purpose_, bytes_);
  ledger_ = nullptr;
  bytes_ = 0;
}

}  // namespace lossd::server
