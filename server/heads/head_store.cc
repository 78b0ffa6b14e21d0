#include "server/heads/head_store.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lossd/common/counter_random.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend_common.h"
#include "lossd/kernels/loss_math.h"
#include "lossd/kernels/optimizer_math.h"

namespace lossd::server {
namespace {

std::vector<uint8_t> ConvertOnHost(std::vector<uint8_t> data, DType from, DType to) {
  if (from == to) return data;
  const int64_t count = static_cast<int64_t>(data.size() / DTypeSize(from));
  std::vector<uint8_t> out(count * DTypeSize(to));
  for (int64_t i = 0; i < count; ++i)
    StoreFromFloat(out.data(), to, i, LoadAsFloat(data.data(), from, i));
  return out;
}

absl::StatusOr<DeviceBuffer> UploadBuffer(Backend& backend, const void* data, size_t bytes) {
  ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(bytes));
  RETURN_IF_ERROR(backend.CopyToDevice(data, bytes, buffer, 0));
  return buffer;
}

absl::Status VersionMoved(const std::string& head, uint64_t expected, uint64_t now, bool retired) {
  if (retired) {
    return absl::AbortedError(absl::StrCat("head '", head,
                                           "' was replaced by an upload during the "
                                           "call; nothing was accumulated, retry"));
  }
  return absl::AbortedError(absl::StrCat("head '", head, "' moved from version ", expected, " to ",
                                         now, " during the call; nothing was accumulated, retry"));
}

// A non-finite W would fail every call on the head, each blamed on its hidden states, and
// non-finite optimizer state would carry into W at the next step: no head is built on either,
// whichever way it came (an upload, a --heads file, a checkpoint).
absl::Status CheckFinite(const std::string& head, const std::string& source,
                         absl::string_view field, const void* data, DType dtype, int64_t rows,
                         int64_t cols) {
  const absl::Status finite = ValidateFiniteMatrix(field, data, dtype, rows, cols);
  if (finite.ok()) return finite;
  return absl::InvalidArgumentError(
      absl::StrCat("head '", head, "' from ", source, ": ", finite.message()));
}

// Bounds on |entries| of fp32 sums, carried in double. Each fp32 product or addition rounds its
// exact result up by at most a factor 1 + 2^-24 in magnitude, so an entry summed from K products
// whose magnitudes add up to S is at most S (1 + 2^-24)^(K + 1) in any order of summation, and
// a + b is at most (|a| + |b|)(1 + 2^-24). Below kProvablyFinite, half of FLT_MAX, an entry is
// finite with room to spare for the few roundings inside each dL/da value that the engine's
// bound leaves out and for those of the double arithmetic of the bound itself.
constexpr double kFp32Rounding = 0x1p-24;
constexpr double kProvablyFinite = FLT_MAX / 2.0;

bool ProvablyFinite(double bound) { return bound < kProvablyFinite; }  // false for NaN

// A bound on max |x_i| from sum_i x_i^2 taken in double over `count` fp32 values: the squares are
// exact in double, the sum falls short of the exact one by at most a factor (1 - 2^-53)^count.
double BoundFromSumSquares(double sum_squares, int64_t count) {
  return std::sqrt(sum_squares) * (1.0 + static_cast<double>(count) * 0x1p-52);
}

constexpr char kNonFiniteGradientPayload[] = "type.lossd/NonFiniteGradient";

absl::Status NonFiniteGradient(absl::Status status) {
  status.SetPayload(kNonFiniteGradientPayload, absl::Cord());
  return status;
}

}  // namespace

bool IsNonFiniteGradient(const absl::Status& status) {
  return status.GetPayload(kNonFiniteGradientPayload).has_value();
}

constexpr char kHeadMovedPayload[] = "type.lossd/lossd.HeadMoved";

absl::Status HeadMovedError(absl::string_view field, absl::string_view message) {
  absl::Status status =
      WithField(absl::FailedPreconditionError(absl::StrCat(field, ": ", message)), field);
  status.SetPayload(kHeadMovedPayload, absl::Cord());
  return status;
}

bool IsHeadMoved(const absl::Status& status) {
  return status.GetPayload(kHeadMovedPayload).has_value();
}

const char* StagedDropName(StagedDrop reason) {
  switch (reason) {
    case StagedDrop::kDiscarded: return "discarded";
    case StagedDrop::kExpired: return "expired";
    case StagedDrop::kHeadMoved: return "head_moved";
    case StagedDrop::kEvicted: return "evicted";
  }
  return "unknown";
}

bool StagingRoom::TryReserve(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (used_bytes_ + bytes > capacity_bytes_) return false;
  used_bytes_ += bytes;
  return true;
}

void StagingRoom::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_bytes_ -= bytes;
}

int64_t StagingRoom::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

int64_t StagingRoom::capacity_bytes() const {
  absl::MutexLock lock(&mu_);
  return capacity_bytes_;
}

void StagingRoom::SetCapacity(int64_t capacity_bytes) {
  absl::MutexLock lock(&mu_);
  capacity_bytes_ = capacity_bytes;
}

Head::Head(Backend& backend, MemoryLedger& ledger, const HeadState& state, std::string source)
    : backend_(backend),
      ledger_(ledger),
      name_(state.head),
      vocab_size_(state.vocab_size),
      hidden_size_(state.hidden_size),
      dtype_(state.weight_dtype),
      tied_embeddings_(state.tied_embeddings),
      logit_softcap_(state.logit_softcap),
      version_(state.version),
      steps_(state.steps),
      source_(std::move(source)) {}

absl::StatusOr<std::shared_ptr<Head>> Head::Create(Backend& backend, MemoryLedger& ledger,
                                                   const HeadState& state, std::string source) {
  const int64_t elements = state.vocab_size * state.hidden_size;
  if (state.vocab_size <= 0 || state.hidden_size <= 0 ||
      state.weight.size() != static_cast<size_t>(elements) * DTypeSize(state.weight_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head '", state.head, "': expected ", elements * DTypeSize(state.weight_dtype),
                     " bytes of W [", state.vocab_size, ", ", state.hidden_size, "] in ",
                     DTypeName(state.weight_dtype), ", got ", state.weight.size()));
  }
  if (const absl::Status cap = ValidateSoftcap("logit_softcap", state.logit_softcap); !cap.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("head '", state.head, "' from ", source, ": ", cap.message()));
  }
  RETURN_IF_ERROR(CheckFinite(state.head, source, "weight", state.weight.data(), state.weight_dtype,
                              state.vocab_size, state.hidden_size));
  for (const auto& [field, values] : {std::pair{"optimizer.state1", &state.state1},
                                      std::pair{"optimizer.state2", &state.state2}}) {
    if (values->size() == static_cast<size_t>(elements)) {
      RETURN_IF_ERROR(CheckFinite(state.head, source, field, values->data(), DType::kFloat32,
                                  state.vocab_size, state.hidden_size));
    }
  }
  // Hashed while the bytes are on the host anyway: a replica knows its digest before it serves.
  ASSIGN_OR_RETURN(std::string sha256,
                   WeightSha256(state.weight_dtype, state.vocab_size, state.hidden_size,
                                state.weight.data(), state.weight.size()));
  std::shared_ptr<Head> head(new Head(backend, ledger, state, std::move(source)));
  {
    absl::MutexLock lock(&head->digest_mu_);
    head->digest_ = {state.version, std::move(sha256)};
  }
  ASSIGN_OR_RETURN(head->weight_, UploadBuffer(backend, state.weight.data(), state.weight.size()));
  head->weight_charge_ = MemoryCharge(&ledger, MemoryPurpose::kWeights, state.weight.size());
  if (!state.master_weight.empty()) {
    if (state.weight_dtype == DType::kFloat32 ||
        state.master_weight.size() != static_cast<size_t>(elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("head '", state.head, "' from ", head->source_, ": master_weight: expected ",
                       state.weight_dtype == DType::kFloat32 ? 0 : elements, " values for a ",
                       DTypeName(state.weight_dtype), " W, got ", state.master_weight.size()));
    }
    RETURN_IF_ERROR(CheckFinite(state.head, head->source_, "master_weight",
                                state.master_weight.data(), DType::kFloat32, state.vocab_size,
                                state.hidden_size));
    const size_t bytes = state.master_weight.size() * sizeof(float);
    absl::WriterMutexLock weight_lock(&head->weight_mu_);
    ASSIGN_OR_RETURN(head->master_, UploadBuffer(backend, state.master_weight.data(), bytes));
    head->master_charge_ = MemoryCharge(&ledger, MemoryPurpose::kWeights, bytes);
  }
  absl::MutexLock lock(&head->grad_mu_);
  head->optimizer_ = state.optimizer;
  // SGD without momentum has no state1; a checkpoint holds what the head had.
  if (!state.state1.empty()) {
    ASSIGN_OR_RETURN(head->state1_, UploadBuffer(backend, state.state1.data(),
                                                 state.state1.size() * sizeof(float)));
  }
  if (!state.state2.empty()) {
    ASSIGN_OR_RETURN(head->state2_, UploadBuffer(backend, state.state2.data(),
                                                 state.state2.size() * sizeof(float)));
  }
  head->state_charge_ = MemoryCharge(&ledger, MemoryPurpose::kOptimizerState,
                                     head->state1_.bytes() + head->state2_.bytes());
  return head;
}

uint64_t Head::version() const {
  absl::ReaderMutexLock lock(&weight_mu_);
  return version_;
}

HeadSummary Head::Summary() const {
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  return SummaryLocked();
}

HeadSummary Head::SummaryLocked() const {
  HeadSummary s;
  s.name = name_;
  s.vocab_size = vocab_size_;
  s.hidden_size = hidden_size_;
  s.dtype = dtype_;
  s.tied_embeddings = tied_embeddings_;
  s.logit_softcap = logit_softcap_;
  s.version = version_;
  s.steps = steps_;
  s.source = source_;
  s.master_weights = master_.data() != nullptr;
  {
    absl::MutexLock digest_lock(&digest_mu_);
    if (digest_.version == version_) s.weight_sha256 = digest_.sha256;
  }
  absl::MutexLock grad_lock(&grad_mu_);
  s.accumulated_tokens = accumulated_tokens_;
  s.accumulated_calls = accumulated_calls_;
  s.optimizer = optimizer_;
  s.staged_gradients = static_cast<int64_t>(staged_.size());
  return s;
}

absl::StatusOr<HeadSummary> Head::SummaryWithDigest() {
  absl::MutexLock pass_lock(&digest_pass_mu_);
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  RETURN_IF_ERROR(RefreshDigest());
  return SummaryLocked();
}

absl::StatusOr<WeightDigest> Head::Digest() {
  absl::MutexLock pass_lock(&digest_pass_mu_);
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  RETURN_IF_ERROR(RefreshDigest());
  absl::MutexLock digest_lock(&digest_mu_);
  return digest_;
}

absl::Status Head::RefreshDigest() {
  {
    absl::MutexLock digest_lock(&digest_mu_);
    if (digest_.version == version_ && !digest_.sha256.empty()) return absl::OkStatus();
  }
  // Slices bound the host memory a pass takes, whatever the size of W or where it lives.
  constexpr size_t kSliceBytes = size_t{16} << 20;
  ASSIGN_OR_RETURN(WeightHasher hasher, WeightHasher::Start(dtype_, vocab_size_, hidden_size_));
  const size_t total = weight_.bytes();
  std::vector<uint8_t> slice(std::min(total, kSliceBytes));
  for (size_t offset = 0; offset < total; offset += slice.size()) {
    const size_t bytes = std::min(slice.size(), total - offset);
    RETURN_IF_ERROR(backend_.CopyToHost(weight_, offset, bytes, slice.data()));
    RETURN_IF_ERROR(hasher.Add(slice.data(), bytes));
  }
  ASSIGN_OR_RETURN(std::string sha256, hasher.Finish());
  absl::MutexLock digest_lock(&digest_mu_);
  digest_ = {version_, std::move(sha256)};
  return absl::OkStatus();
}

absl::Status Head::WithWeights(uint64_t expected_version,
                               absl::FunctionRef<absl::Status(const WeightView&)> fn) {
  absl::ReaderMutexLock lock(&weight_mu_);
  if (retired_ || version_ != expected_version) {
    return VersionMoved(name_, expected_version, version_, retired_);
  }
  return fn(WeightView{&weight_, dtype_, vocab_size_, hidden_size_});
}

absl::StatusOr<CommitOutcome> Head::CommitGradient(StagedGradient& call, int64_t max_call_ids) {
  if (call.buffer == nullptr || call.buffer->bytes() != AccumulatorBytes()) {
    return absl::InternalError(absl::StrCat("head '", name_, "': a staged dL/dW of ",
                                            call.buffer == nullptr ? 0 : call.buffer->bytes(),
                                            " bytes, expected ", AccumulatorBytes()));
  }
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  if (retired_ || version_ != call.version) {
    return VersionMoved(name_, call.version, version_, retired_);
  }
  absl::MutexLock grad_lock(&grad_mu_);
  if (!call.call_id.empty()) {
    const auto first = committed_calls_.find(call.call_id);
    if (first != committed_calls_.end()) {
      RETURN_IF_ERROR(CheckRepeat(call.call_id, first->second, call.start_fingerprint));
      // The same start on the same W gives the same loss sum, bit for bit: another one means
      // other hidden rows.
      if (absl::bit_cast<uint64_t>(first->second.loss_sum) !=
          absl::bit_cast<uint64_t>(call.loss_sum)) {
        return InvalidField("call_id", "a fresh id for a different call",
                            absl::StrCat("'", call.call_id, "', which head '", name_,
                                         "' already accumulated for other hidden rows (loss sum ",
                                         first->second.loss_sum, ", now ", call.loss_sum,
                                         "); nothing was accumulated"));
      }
      return CommitOutcome::kReplayed;
    }
    RETURN_IF_ERROR(CheckRoomForCallId(max_call_ids));
  }
  RETURN_IF_ERROR(AddCommitted(call, 1.0, max_call_ids));
  return CommitOutcome::kCommitted;
}

absl::Status Head::AddCommitted(StagedGradient& call, double scale, int64_t max_call_ids) {
  ASSIGN_OR_RETURN(const double staged_bound, StagedBound(call));
  RETURN_IF_ERROR(AddToAccumulator(*call.buffer, staged_bound));
  ++grad_generation_;
  accumulated_tokens_ += call.tokens;
  ++accumulated_calls_;
  if (!call.call_id.empty()) {
    RememberCallId(call.call_id, call.start_fingerprint, call.loss_sum, scale, max_call_ids);
  }
  return absl::OkStatus();
}

absl::StatusOr<CommitOutcome> Head::StageGradient(StagedGradient& call, DeviceBuffer& buffer,
                                                  StagingRoom& room, absl::Time deadline,
                                                  int64_t max_call_ids) {
  if (call.call_id.empty()) {
    return InvalidField("call_id", "an id for a call that stages its dL/dW", "none");
  }
  if (buffer.bytes() != AccumulatorBytes()) {
    return absl::InternalError(absl::StrCat("head '", name_, "': a staged dL/dW of ",
                                            buffer.bytes(), " bytes, expected ",
                                            AccumulatorBytes()));
  }
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  if (retired_ || version_ != call.version) {
    return VersionMoved(name_, call.version, version_, retired_);
  }
  absl::MutexLock grad_lock(&grad_mu_);
  const auto committed = committed_calls_.find(call.call_id);
  if (committed != committed_calls_.end()) {
    RETURN_IF_ERROR(CheckRepeat(call.call_id, committed->second, call.start_fingerprint));
    return CommitOutcome::kReplayed;
  }
  if (const auto staged = staged_.find(call.call_id); staged != staged_.end()) {
    if (staged->second->call.start_fingerprint != call.start_fingerprint ||
        absl::bit_cast<uint64_t>(staged->second->call.loss_sum) !=
            absl::bit_cast<uint64_t>(call.loss_sum)) {
      return InvalidField("call_id", "a fresh id for a different call",
                          absl::StrCat("'", call.call_id, "', under which head '", name_,
                                       "' holds the staged dL/dW of another call; nothing was "
                                       "staged"));
    }
    return CommitOutcome::kStaged;
  }
  RETURN_IF_ERROR(CheckRoomForCallId(max_call_ids));
  const int64_t bytes = static_cast<int64_t>(buffer.bytes());
  bool reserved = room.TryReserve(bytes);
  int evicted = 0;
  while (!reserved && !staged_.empty()) {
    const auto oldest = std::min_element(
        staged_.begin(), staged_.end(),
        [](const auto& a, const auto& b) { return a.second->deadline < b.second->deadline; });
    RememberDrop(oldest->first, StagedDrop::kEvicted);
    staged_.erase(oldest);
    ++evicted;
    reserved = room.TryReserve(bytes);
  }
  ObserveDrops(StagedDrop::kEvicted, evicted);
  if (!reserved) return CommitOutcome::kNoRoom;
  auto entry = std::make_unique<StagedCall>();
  entry->room = &room;
  entry->reserved = bytes;
  entry->buffer = std::move(buffer);
  entry->charge = MemoryCharge(&ledger_, MemoryPurpose::kGradients, bytes);
  entry->deadline = deadline;
  entry->call = call;
  entry->call.buffer = &entry->buffer;
  staged_[call.call_id] = std::move(entry);
  dropped_.erase(call.call_id);
  return CommitOutcome::kStaged;
}

absl::StatusOr<CommitOutcome> Head::CommitStaged(const std::string& call_id, double scale,
                                                 int64_t max_call_ids) {
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  if (retired_) return VersionMoved(name_, version_, version_, retired_);
  absl::MutexLock grad_lock(&grad_mu_);
  const auto staged = staged_.find(call_id);
  if (staged == staged_.end()) {
    if (const auto committed = committed_calls_.find(call_id);
        committed != committed_calls_.end()) {
      if (absl::bit_cast<uint64_t>(committed->second.scale) == absl::bit_cast<uint64_t>(scale)) {
        return CommitOutcome::kReplayed;
      }
      return absl::AlreadyExistsError(
          absl::StrCat("call_id: '", call_id, "' was already committed into head '", name_,
                       "' with scale ", committed->second.scale, "; a commit with scale ", scale,
                       " cannot take it back; nothing was added"));
    }
    std::string why =
        "no call staged it, or it was committed before the head's gradient was last "
        "zeroed";
    if (const auto dropped = dropped_.find(call_id); dropped != dropped_.end()) {
      switch (dropped->second) {
        case StagedDrop::kDiscarded: why = "it was discarded"; break;
        case StagedDrop::kExpired:
          why = "it expired (--staged_grad_seconds) before this commit";
          break;
        case StagedDrop::kEvicted:
          why = "newer staged gradients took its room (--staged_grad_mib); compute it again";
          break;
        case StagedDrop::kHeadMoved:
          why = "the head stepped, was replaced, or had its gradient zeroed since it was staged";
          break;
      }
    }
    return absl::NotFoundError(absl::StrCat("call_id: head '", name_,
                                            "' holds no gradient staged under '", call_id,
                                            "': ", why, "; nothing was added"));
  }
  std::unique_ptr<StagedCall> entry = std::move(staged->second);
  staged_.erase(staged);
  StagedGradient& call = entry->call;
  const int64_t count = vocab_size_ * hidden_size_;
  if (scale != 1.0) {
    RETURN_IF_ERROR(backend_.ScaleFloat32(entry->buffer, count, static_cast<float>(scale)));
    // The product rounds once more, and fp32(scale) may exceed |scale| by half an ulp.
    call.bound *= std::fabs(scale) * (1.0 + kFp32Rounding) * (1.0 + kFp32Rounding);
    if (!std::isfinite(call.bound)) call.bound = HUGE_VAL;
  }
  RETURN_IF_ERROR(CheckRoomForCallId(max_call_ids));
  RETURN_IF_ERROR(AddCommitted(call, scale, max_call_ids));
  return CommitOutcome::kCommitted;
}

int Head::DiscardStaged(absl::Span<const std::string> call_ids) {
  absl::MutexLock grad_lock(&grad_mu_);
  int dropped = 0;
  for (const std::string& id : call_ids) {
    const auto staged = staged_.find(id);
    if (staged == staged_.end()) continue;
    staged_.erase(staged);
    RememberDrop(id, StagedDrop::kDiscarded);
    ++dropped;
  }
  ObserveDrops(StagedDrop::kDiscarded, dropped);
  return dropped;
}

int Head::ExpireStaged(absl::Time now) {
  absl::MutexLock grad_lock(&grad_mu_);
  std::vector<std::string> expired;
  for (const auto& [id, entry] : staged_) {
    if (entry->deadline < now) expired.push_back(id);
  }
  for (const std::string& id : expired) {
    staged_.erase(id);
    RememberDrop(id, StagedDrop::kExpired);
  }
  ObserveDrops(StagedDrop::kExpired, static_cast<int>(expired.size()));
  return static_cast<int>(expired.size());
}

int64_t Head::staged_count() const {
  absl::MutexLock grad_lock(&grad_mu_);
  return static_cast<int64_t>(staged_.size());
}

void Head::SetStagedDropObserver(std::function<void(StagedDrop, int)> observer) {
  absl::MutexLock grad_lock(&grad_mu_);
  drop_observer_ = std::move(observer);
}

void Head::DropAllStaged(StagedDrop reason) {
  const int count = static_cast<int>(staged_.size());
  for (const auto& [id, unused] : staged_) RememberDrop(id, reason);
  staged_.clear();
  ObserveDrops(reason, count);
}

void Head::RememberDrop(const std::string& call_id, StagedDrop reason) {
  constexpr size_t kRemembered = 4096;
  if (dropped_.emplace(call_id, reason).second) dropped_order_.push_back(call_id);
  if (dropped_order_.size() > 2 * kRemembered) {
    const size_t forget = dropped_order_.size() - kRemembered;
    for (size_t i = 0; i < forget; ++i) dropped_.erase(dropped_order_[i]);
    dropped_order_.erase(dropped_order_.begin(), dropped_order_.begin() + forget);
  }
}

void Head::ObserveDrops(StagedDrop reason, int count) const {
  if (count > 0 && drop_observer_) drop_observer_(reason, count);
}

absl::StatusOr<GradNorm> Head::GradientNorm(std::optional<uint64_t> expected_version,
                                            double grad_multiplier, GradientExchange* exchange) {
  if (exchange != nullptr) {
    // The group's gradient is kept for the step: W must not move in between.
    absl::WriterMutexLock weight_lock(&weight_mu_);
    return GradientNormLocked(expected_version, grad_multiplier, exchange);
  }
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  return GradientNormLocked(expected_version, grad_multiplier, nullptr);
}

absl::StatusOr<GradNorm> Head::GradientNormLocked(std::optional<uint64_t> expected_version,
                                                  double grad_multiplier,
                                                  GradientExchange* exchange) {
  absl::Status refusal;
  if (expected_version.has_value() && *expected_version != version_) {
    refusal = HeadMovedError("head_version", absl::StrCat("expected the head's current ", version_,
                                                          ", got ", *expected_version));
  }
  absl::MutexLock grad_lock(&grad_mu_);
  GradNorm norm;
  norm.version = version_;
  if (exchange != nullptr) {
    RETURN_IF_ERROR(ReduceGradient(*exchange, refusal));
    norm.accumulated_tokens = reduced_tokens_;
    norm.accumulated_calls = reduced_calls_;
    norm.norm = std::sqrt(reduced_sum_squares_) * grad_multiplier;
    return norm;
  }
  RETURN_IF_ERROR(refusal);
  norm.accumulated_tokens = accumulated_tokens_;
  norm.accumulated_calls = accumulated_calls_;
  if (grad_.data() != nullptr) {
    ASSIGN_OR_RETURN(const double sum_squares,
                     backend_.SumSquaresFloat32(grad_, vocab_size_ * hidden_size_));
    norm.norm = std::sqrt(sum_squares) * grad_multiplier;
  }
  return norm;
}

void Head::DropReduced() { reduced_valid_ = false; }

absl::Status Head::ReduceGradient(GradientExchange& exchange, const absl::Status& refusal) {
  const bool kept =
      reduced_valid_ && reduced_generation_ == grad_generation_ && reduced_version_ == version_;
  std::optional<uint64_t> digest;
  {
    absl::MutexLock digest_lock(&digest_mu_);
    if (digest_.version == version_ && digest_.sha256.size() >= 16) {
      uint64_t prefix = 0;
      if (absl::SimpleHexAtoi(absl::string_view(digest_.sha256).substr(0, 16), &prefix)) {
        digest = prefix;
      }
    }
  }
  ASSIGN_OR_RETURN(const bool all_kept, exchange.Agree(version_, digest, refusal, kept));
  if (all_kept) return absl::OkStatus();
  // A host copy of this replica's accumulator (zeros before it first trained) becomes the sum.
  const int64_t count = vocab_size_ * hidden_size_;
  DropReduced();
  if (reduced_ == nullptr) {
    reduced_.reset(new float[count]);
    reduced_charge_ =
        MemoryCharge(&ledger_, MemoryPurpose::kGradients, count * int64_t{sizeof(float)});
  }
  if (grad_.data() != nullptr) {
    RETURN_IF_ERROR(backend_.CopyToHost(grad_, 0, count * sizeof(float), reduced_.get()));
  } else {
    std::fill_n(reduced_.get(), count, 0.0f);  // what a head yet to train holds
  }
  double counts[2] = {static_cast<double>(accumulated_tokens_),
                      static_cast<double>(accumulated_calls_)};
  const absl::Span<float> sum(reduced_.get(), count);
  RETURN_IF_ERROR(exchange.Reduce(sum, absl::MakeSpan(counts)));
  ASSIGN_OR_RETURN(const double sum_squares, exchange.SumSquares(sum));
  reduced_valid_ = true;
  reduced_generation_ = grad_generation_;
  reduced_version_ = version_;
  reduced_tokens_ = static_cast<int64_t>(counts[0]);
  reduced_calls_ = static_cast<int64_t>(counts[1]);
  reduced_sum_squares_ = sum_squares;
  return absl::OkStatus();
}

absl::StatusOr<double> Head::StagedBound(const StagedGradient& call) const {
  const double bound =
      call.bound * std::pow(1.0 + kFp32Rounding, static_cast<double>(call.rows + 1));
  if (ProvablyFinite(bound)) return bound;
  const int64_t count = vocab_size_ * hidden_size_;
  ASSIGN_OR_RETURN(const double sum_squares, backend_.SumSquaresFloat32(*call.buffer, count));
  if (!std::isfinite(sum_squares)) {
    return NonFiniteGradient(absl::InvalidArgumentError(
        "chunk.hidden: this call's dL/dW has non-finite values (Inf in the hidden states under "
        "options.logit_softcap, or an overflow from options.grad_scale); nothing was accumulated"));
  }
  return BoundFromSumSquares(sum_squares, count);
}

absl::Status Head::AddToAccumulator(DeviceBuffer& staged, double staged_bound) {
  const int64_t count = vocab_size_ * hidden_size_;
  // Every reset of accumulated_calls_ to 0 zeroes grad_ with it.
  if (accumulated_calls_ == 0) {
    if (grad_.data() == nullptr) {
      grad_ = std::move(staged);
      grad_charge_ = MemoryCharge(&ledger_, MemoryPurpose::kGradients, AccumulatorBytes());
    } else {
      std::swap(grad_, staged);
    }
    grad_bound_ = staged_bound;
    return absl::OkStatus();
  }
  const double sum_bound = (grad_bound_ + staged_bound) * (1.0 + kFp32Rounding);
  if (ProvablyFinite(sum_bound)) {
    RETURN_IF_ERROR(backend_.AddFloat32(grad_, staged, count));
    grad_bound_ = sum_bound;
    return absl::OkStatus();
  }
  // The sum is formed where a refusal loses nothing; fp32 addition commutes, so staged + grad_
  // has the bits grad_ + staged would have had.
  RETURN_IF_ERROR(backend_.AddFloat32(staged, grad_, count));
  ASSIGN_OR_RETURN(const double sum_squares, backend_.SumSquaresFloat32(staged, count));
  if (!std::isfinite(sum_squares)) {
    // FAILED_PRECONDITION, not INVALID_ARGUMENT: the call is valid (it would commit into a
    // zeroed accumulator); the accumulator must be stepped or zeroed first, and until then the
    // same call fails the same way, which is gRPC's rule for this code. Clients do not retry it.
    return NonFiniteGradient(absl::FailedPreconditionError(absl::StrCat(
        "head '", name_, "': adding this call's dL/dW to the accumulated gradient (",
        accumulated_calls_,
        " calls since it was zeroed) would overflow float32, an entry "
        "beyond +-3.4e38; nothing was accumulated and the accumulated gradient is unchanged. Step "
        "or zero the gradient (ZeroGradWeight) before more calls, or lower options.grad_scale")));
  }
  std::swap(grad_, staged);
  grad_bound_ = BoundFromSumSquares(sum_squares, count);
  return absl::OkStatus();
}

absl::Status Head::CheckRepeat(const std::string& call_id, const CommittedCall& first,
                               uint64_t start_fingerprint) const {
  if (first.start_fingerprint != start_fingerprint) {
    return InvalidField("call_id", "a fresh id for a different call",
                        absl::StrCat("'", call_id, "', which head '", name_,
                                     "' already accumulated for another start message (other "
                                     "labels, token weights, options, shapes or per-token "
                                     "inputs); nothing was accumulated"));
  }
  if (first.epoch != epoch_ || first.version != version_) {
    const char* since = first.epoch == epoch_       ? " (a step with keep_grad)"
                        : first.version == version_ ? ", and its gradient was zeroed since"
                                                    : " (a step or an upload of W since)";
    return absl::AlreadyExistsError(absl::StrCat(
        "call_id: '", call_id, "' was already accumulated into head '", name_, "' at version ",
        first.version, ", and the head is now at version ", version_, since,
        ": a repeat can neither reproduce that call's results nor add its dL/dW again; nothing "
        "was accumulated"));
  }
  return absl::OkStatus();
}

void Head::RememberCallId(const std::string& call_id, uint64_t start_fingerprint, double loss_sum,
                          double scale, int64_t max_call_ids) {
  committed_calls_[call_id] = CommittedCall{epoch_, version_, start_fingerprint, loss_sum, scale};
  call_id_order_.push_back(call_id);
  ++epoch_call_ids_;
  // This epoch holds at most max_call_ids ids (CheckRoomForCallId), all after the earlier epochs'
  // in the order, so only ids of earlier epochs are forgotten here.
  while (static_cast<int64_t>(call_id_order_.size()) > max_call_ids) {
    committed_calls_.erase(call_id_order_.front());
    call_id_order_.pop_front();
  }
}

absl::Status Head::CheckRoomForCallId(int64_t max_call_ids) const {
  if (epoch_call_ids_ < max_call_ids) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "call_id: head '", name_, "' has accumulated ", epoch_call_ids_,
      " calls with a call_id since its gradient was last zeroed, the most whose ids it keeps "
      "(--max_call_ids); nothing was accumulated. Step or zero the gradient, or send the call "
      "without a call_id"));
}

absl::Status Head::CheckCallId(const std::string& call_id, uint64_t start_fingerprint,
                               int64_t max_call_ids) const {
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  absl::MutexLock grad_lock(&grad_mu_);
  const auto first = committed_calls_.find(call_id);
  if (first != committed_calls_.end()) {
    return CheckRepeat(call_id, first->second, start_fingerprint);
  }
  return CheckRoomForCallId(max_call_ids);
}

absl::Status Head::ZeroGradient() {
  absl::MutexLock lock(&grad_mu_);
  return ResetAccumulator();
}

absl::Status Head::ReadRows(uint64_t expected_version, absl::Span<const int64_t> ids, DType dtype,
                            uint8_t* out) {
  const size_t row_bytes = hidden_size_ * DTypeSize(dtype_);
  std::vector<uint8_t> row(row_bytes);
  absl::ReaderMutexLock lock(&weight_mu_);
  if (retired_ || version_ != expected_version) {
    return absl::AbortedError(absl::StrCat("head '", name_, "' moved from version ",
                                           expected_version,
                                           " during the lookup; look the rows up again"));
  }
  for (size_t r = 0; r < ids.size(); ++r) {
    uint8_t* target = out + r * hidden_size_ * DTypeSize(dtype);
    if (dtype == dtype_) {
      RETURN_IF_ERROR(backend_.CopyToHost(weight_, ids[r] * row_bytes, row_bytes, target));
      continue;
    }
    RETURN_IF_ERROR(backend_.CopyToHost(weight_, ids[r] * row_bytes, row_bytes, row.data()));
    for (int64_t j = 0; j < hidden_size_; ++j) {
      StoreFromFloat(target, dtype, j, LoadAsFloat(row.data(), dtype_, j));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Head::AddGradientRows(std::optional<uint64_t> expected_version,
                                               absl::Span<const int64_t> ids,
                                               std::vector<float>& rows) {
  const size_t row_bytes = hidden_size_ * sizeof(float);
  std::vector<float> accumulated(hidden_size_);
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  if (retired_) {
    return absl::AbortedError(
        absl::StrCat("head '", name_, "' was replaced by an upload; nothing was accumulated"));
  }
  if (expected_version.has_value() && *expected_version != version_) {
    return HeadMovedError(
        "head_version",
        absl::StrCat("the rows were looked up at version ", *expected_version, " of head '", name_,
                     "', which is now at version ", version_, "; nothing was accumulated"));
  }
  absl::MutexLock grad_lock(&grad_mu_);
  RETURN_IF_ERROR(EnsureAccumulator());
  // Every sum first, so that a non-finite one leaves the accumulator untouched.
  double largest = 0.0;
  for (size_t u = 0; u < ids.size(); ++u) {
    RETURN_IF_ERROR(backend_.CopyToHost(grad_, ids[u] * row_bytes, row_bytes, accumulated.data()));
    float* sums = rows.data() + u * hidden_size_;
    for (int64_t j = 0; j < hidden_size_; ++j) {
      sums[j] += accumulated[j];
      if (!std::isfinite(sums[j])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "grad: the accumulated gradient of token id ", ids[u], " would not be finite (",
            sums[j], " at column ", j, "); nothing was accumulated"));
      }
      largest = std::max(largest, static_cast<double>(std::fabs(sums[j])));
    }
  }
  for (size_t u = 0; u < ids.size(); ++u) {
    RETURN_IF_ERROR(backend_.CopyToDevice(rows.data() + u * hidden_size_, row_bytes, grad_,
                                          ids[u] * row_bytes));
  }
  // The rows written hold exactly these sums; the others kept their entries, and their bound.
  grad_bound_ = std::max(grad_bound_, largest);
  ++grad_generation_;
  // The accumulator now holds more than zeros: the next Compute commit must add to it.
  ++accumulated_calls_;
  return version_;
}

size_t Head::AccumulatorBytes() const { return vocab_size_ * hidden_size_ * sizeof(float); }

absl::Status Head::EnsureAccumulator() {
  if (grad_.data() != nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(DeviceBuffer zeros, backend_.Allocate(AccumulatorBytes()));
  RETURN_IF_ERROR(backend_.Zero(zeros));
  grad_ = std::move(zeros);
  grad_charge_ = MemoryCharge(&ledger_, MemoryPurpose::kGradients, AccumulatorBytes());
  return absl::OkStatus();
}

absl::Status Head::ResetAccumulator() {
  DropAllStaged(StagedDrop::kHeadMoved);
  ++grad_generation_;
  DropReduced();
  if (grad_.data() != nullptr) RETURN_IF_ERROR(backend_.Zero(grad_));
  accumulated_tokens_ = 0;
  accumulated_calls_ = 0;
  grad_bound_ = 0.0;
  // The ids stay: a retry of a call committed before the reset must not count again after it.
  ++epoch_;
  epoch_call_ids_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<TensorSnapshot> Head::ReadGradient(DType dtype) {
  TensorSnapshot snapshot;
  std::vector<uint8_t> grad(AccumulatorBytes());  // zeros, what a head yet to train holds
  {
    absl::ReaderMutexLock weight_lock(&weight_mu_);
    absl::MutexLock grad_lock(&grad_mu_);
    if (grad_.data() != nullptr) {
      RETURN_IF_ERROR(backend_.CopyToHost(grad_, 0, grad.size(), grad.data()));
    }
    snapshot.version = version_;
    snapshot.accumulated_tokens = accumulated_tokens_;
  }
  snapshot.data = ConvertOnHost(std::move(grad), DType::kFloat32, dtype);
  snapshot.dtype = dtype;
  return snapshot;
}

absl::StatusOr<TensorSnapshot> Head::ReadWeight(DType dtype, bool master) {
  TensorSnapshot snapshot;
  std::vector<uint8_t> weight;
  DType stored = dtype_;
  {
    absl::ReaderMutexLock lock(&weight_mu_);
    const DeviceBuffer& source = master && master_.data() != nullptr ? master_ : weight_;
    if (&source == &master_) stored = DType::kFloat32;
    weight.resize(source.bytes());
    RETURN_IF_ERROR(backend_.CopyToHost(source, 0, weight.size(), weight.data()));
    snapshot.version = version_;
  }
  snapshot.data = ConvertOnHost(std::move(weight), stored, dtype);
  snapshot.dtype = dtype;
  return snapshot;
}

absl::StatusOr<DeviceBuffer> Head::ZeroedStateBuffer() {
  ASSIGN_OR_RETURN(DeviceBuffer buffer, backend_.Allocate(AccumulatorBytes()));
  RETURN_IF_ERROR(backend_.Zero(buffer));
  return buffer;
}

absl::Status Head::EnsureMasterWeights() {
  if (dtype_ == DType::kFloat32 || master_.data() != nullptr) return absl::OkStatus();
  const int64_t count = vocab_size_ * hidden_size_;
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  // Widened on the host in slices: exact, and no device memory beyond the master itself.
  constexpr int64_t kSliceElements = int64_t{4} << 20;
  ASSIGN_OR_RETURN(DeviceBuffer master, backend_.Allocate(bytes));
  std::vector<uint8_t> stored(static_cast<size_t>(std::min(count, kSliceElements)) *
                              DTypeSize(dtype_));
  std::vector<float> widened(std::min(count, kSliceElements));
  for (int64_t first = 0; first < count; first += kSliceElements) {
    const int64_t n = std::min(kSliceElements, count - first);
    RETURN_IF_ERROR(backend_.CopyToHost(weight_, first * DTypeSize(dtype_), n * DTypeSize(dtype_),
                                        stored.data()));
    for (int64_t i = 0; i < n; ++i) widened[i] = LoadAsFloat(stored.data(), dtype_, i);
    RETURN_IF_ERROR(
        backend_.CopyToDevice(widened.data(), n * sizeof(float), master, first * sizeof(float)));
  }
  master_ = std::move(master);
  master_charge_ = MemoryCharge(&ledger_, MemoryPurpose::kWeights, static_cast<int64_t>(bytes));
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> Head::Step(const OptimizerConfig& config, const StepSettings& settings,
                                       GradientExchange* exchange) {
  absl::WriterMutexLock weight_lock(&weight_mu_);
  absl::Status refusal;
  if (settings.expected_version.has_value() && *settings.expected_version != version_) {
    refusal = HeadMovedError("head_version", absl::StrCat("expected the head's current ", version_,
                                                          ", got ", *settings.expected_version));
  }
  absl::MutexLock grad_lock(&grad_mu_);
  const int64_t count = vocab_size_ * hidden_size_;
  // The gradient the step takes: the accumulator, or with replicas the group's, on the device.
  DeviceBuffer* gradient = &grad_;
  DeviceBuffer reduced;
  MemoryCharge reduced_charge;
  double sum_squares = 0.0;
  StepOutcome outcome;
  if (exchange != nullptr) {
    RETURN_IF_ERROR(ReduceGradient(*exchange, refusal));
    sum_squares = reduced_sum_squares_;
    outcome.accumulated_tokens = reduced_tokens_;
  } else {
    RETURN_IF_ERROR(refusal);
    // A step with nothing accumulated still moves W (momentum, AdamW's decay): it steps on zeros.
    RETURN_IF_ERROR(EnsureAccumulator());
    ASSIGN_OR_RETURN(sum_squares, backend_.SumSquaresFloat32(grad_, count));
    outcome.accumulated_tokens = accumulated_tokens_;
  }
  outcome.grad_norm = std::sqrt(sum_squares) * settings.grad_multiplier;
  // The optimizer multiplies in float32: past FLT_MAX the norm's largest entries would overflow.
  if (!(outcome.grad_norm <= FLT_MAX)) {
    if (!settings.skip_nonfinite) {
      return NonFiniteGradient(absl::FailedPreconditionError(
          absl::StrCat("gradient of head '", name_, "' has a non-finite norm (", outcome.grad_norm,
                       " after grad_multiplier ", settings.grad_multiplier,
                       "); step refused, nothing changed")));
    }
    // As torch.amp.GradScaler after an overflow: this step's gradient is dropped, nothing moves.
    outcome.skipped = true;
    outcome.version = version_;
    if (!settings.keep_grad) RETURN_IF_ERROR(ResetAccumulator());
    return outcome;
  }
  // As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
  if (settings.max_grad_norm > 0) {
    outcome.clip_multiplier = std::min(1.0, settings.max_grad_norm / (outcome.grad_norm + 1e-6));
  }
  if (exchange != nullptr) {
    // The group's sum onto the device: into the accumulator, which the step resets anyway,
    // unless it keeps this replica's own gradient (keep_grad).
    if (settings.keep_grad) {
      ASSIGN_OR_RETURN(reduced, backend_.Allocate(count * sizeof(float)));
      reduced_charge = MemoryCharge(&ledger_, MemoryPurpose::kGradients, count * sizeof(float));
      gradient = &reduced;
    } else {
      RETURN_IF_ERROR(EnsureAccumulator());
    }
    RETURN_IF_ERROR(backend_.CopyToDevice(reduced_.get(), count * sizeof(float), *gradient, 0));
  }
  const OptimizerKind kind =
      config.kind == OptimizerConfig::Kind::kAdamW ? OptimizerKind::kAdamW : OptimizerKind::kSgd;
  const bool fresh_state = optimizer_ != kind;
  // The state this step reads and writes. Another optimizer's starts from zeros, and SGD's
  // momentum buffer is made by the first step with momentum (torch.optim.SGD's first buffer is
  // that step's gradient, which momentum * 0 + g gives too), so momentum 0 keeps no V x H state.
  // New buffers become the head's only once the step applied: a refused step leaves the state
  // as it was, whichever optimizer it belonged to.
  DeviceBuffer new_state1, new_state2;
  DeviceBuffer* state1 = nullptr;
  DeviceBuffer* state2 = nullptr;
  if (!fresh_state && state1_.data() != nullptr) {
    state1 = &state1_;
  } else if (kind == OptimizerKind::kAdamW || config.momentum != 0.0) {
    ASSIGN_OR_RETURN(new_state1, ZeroedStateBuffer());
    state1 = &new_state1;
  }
  if (kind == OptimizerKind::kAdamW) {
    if (fresh_state) {
      ASSIGN_OR_RETURN(new_state2, ZeroedStateBuffer());
      state2 = &new_state2;
    } else {
      state2 = &state2_;
    }
  }
  RETURN_IF_ERROR(EnsureMasterWeights());
  OptimizerConfig effective = config;
  effective.step = (fresh_state ? 0 : steps_) + 1;
  effective.grad_multiplier = outcome.clip_multiplier * settings.grad_multiplier;
  OptimizerTensors tensors;
  const bool master = master_.data() != nullptr;
  tensors.weight = master ? &master_ : &weight_;
  tensors.weight_dtype = master ? DType::kFloat32 : dtype_;
  tensors.served_dtype = dtype_;
  tensors.grad = gradient;
  tensors.state1 = state1;
  tensors.state2 = state2;
  tensors.count = count;
  ASSIGN_OR_RETURN(const OptimizerStepResult result, backend_.OptimizerStep(effective, tensors));
  if (!result.applied()) return NonFiniteStep(effective, tensors, result, outcome);
  if (fresh_state || state1 == &new_state1) {
    state1_ = std::move(new_state1);  // of the fresh optimizer (maybe none), or a new buffer
    if (fresh_state) state2_ = std::move(new_state2);
    optimizer_ = kind;
    state_charge_ =
        MemoryCharge(&ledger_, MemoryPurpose::kOptimizerState, state1_.bytes() + state2_.bytes());
  }
  if (fresh_state) steps_ = 0;
  if (master) RETURN_IF_ERROR(backend_.ConvertFloat32(master_, weight_, dtype_, count));
  // The staged gradients are of the W that just went.
  DropAllStaged(StagedDrop::kHeadMoved);
  DropReduced();
  if (!settings.keep_grad) RETURN_IF_ERROR(ResetAccumulator());
  ++steps_;
  outcome.version = ++version_;
  return outcome;
}

absl::Status Head::NonFiniteStep(const OptimizerConfig& config, const OptimizerTensors& tensors,
                                 const OptimizerStepResult& result,
                                 const StepOutcome& outcome) const {
  // The element at fault, read back and updated once more on the host, so that the refusal says
  // what the step would have written.
  const int64_t i = result.element;
  uint32_t weight = 0;
  float grad = 0.0f, state1 = 0.0f, state2 = 0.0f;
  // The step's own operands: fp32 master weights when the head keeps them, the group's gradient
  // when it has replicas.
  const size_t weight_bytes = DTypeSize(tensors.weight_dtype);
  RETURN_IF_ERROR(backend_.CopyToHost(*tensors.weight, i * weight_bytes, weight_bytes, &weight));
  RETURN_IF_ERROR(backend_.CopyToHost(*tensors.grad, i * sizeof(float), sizeof(float), &grad));
  if (tensors.state1 != nullptr) {
    RETURN_IF_ERROR(
        backend_.CopyToHost(*tensors.state1, i * sizeof(float), sizeof(float), &state1));
  }
  if (tensors.state2 != nullptr) {
    RETURN_IF_ERROR(
        backend_.CopyToHost(*tensors.state2, i * sizeof(float), sizeof(float), &state2));
  }
  const bool adamw = config.kind == OptimizerConfig::Kind::kAdamW;
  const float old_weight = LoadAsFloat(&weight, tensors.weight_dtype, 0);
  const ElementUpdate u = UpdateElement(adamw, tensors.state1 != nullptr, old_weight, grad, state1,
                                        state2, MakeOptimizerScalars(config));
  std::string field = "weight";
  float value = AsStored(u.weight, dtype_);
  if (result.non_finite == OptimizerStepResult::NonFinite::kState1) {
    field = adamw ? "optimizer.state1 (AdamW's first moment)" : "optimizer.state1 (momentum)";
    value = u.state1;
  } else if (result.non_finite == OptimizerStepResult::NonFinite::kState2) {
    field = "optimizer.state2 (AdamW's second moment)";
    value = u.state2;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "head '", name_, "': the step would make ", field, "[", i / hidden_size_, ", ",
      i % hidden_size_, "] ", value, ", not a finite ",
      result.non_finite == OptimizerStepResult::NonFinite::kWeight ? DTypeName(dtype_) : "float32",
      " value (learning_rate ", config.learning_rate, ", gradient entry ", grad, ", gradient norm ",
      outcome.grad_norm, ", weight ", old_weight,
      "); step refused: W, the optimizer state and the version are unchanged. Lower the learning "
      "rate, or clip the gradient (max_grad_norm)"));
}

absl::Status Head::ReplaceWeight(const std::vector<uint8_t>& weight, DType dtype,
                                 std::string source) {
  std::vector<uint8_t> stored = ConvertOnHost(weight, dtype, dtype_);
  if (stored.size() != weight_.bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: expected ", weight_.bytes(), " bytes, got ", stored.size()));
  }
  // Checked as stored: a finite fp32 value past 65504 is Inf in a float16 head.
  RETURN_IF_ERROR(
      CheckFinite(name_, source, "weight", stored.data(), dtype_, vocab_size_, hidden_size_));
  ASSIGN_OR_RETURN(std::string sha256,
                   WeightSha256(dtype_, vocab_size_, hidden_size_, stored.data(), stored.size()));
  absl::WriterMutexLock weight_lock(&weight_mu_);
  absl::MutexLock grad_lock(&grad_mu_);
  RETURN_IF_ERROR(backend_.CopyToDevice(stored.data(), stored.size(), weight_, 0));
  RETURN_IF_ERROR(ResetAccumulator());
  master_charge_.Reset();
  master_.Reset();
  state_charge_.Reset();
  state1_.Reset();
  state2_.Reset();
  optimizer_ = OptimizerKind::kNone;
  steps_ = 0;
  source_ = std::move(source);
  ++version_;
  absl::MutexLock digest_lock(&digest_mu_);
  digest_ = {version_, std::move(sha256)};
  return absl::OkStatus();
}

absl::StatusOr<HeadState> Head::ExportState() {
  HeadState state;
  state.head = name_;
  state.vocab_size = vocab_size_;
  state.hidden_size = hidden_size_;
  state.weight_dtype = dtype_;
  state.tied_embeddings = tied_embeddings_;
  state.logit_softcap = logit_softcap_;
  state.weight.resize(weight_.bytes());
  absl::ReaderMutexLock weight_lock(&weight_mu_);
  absl::MutexLock grad_lock(&grad_mu_);
  state.version = version_;
  state.steps = steps_;
  RETURN_IF_ERROR(backend_.CopyToHost(weight_, 0, state.weight.size(), state.weight.data()));
  state.optimizer = optimizer_;
  const int64_t count = vocab_size_ * hidden_size_;
  if (master_.data() != nullptr) {
    state.master_weight.resize(count);
    RETURN_IF_ERROR(
        backend_.CopyToHost(master_, 0, count * sizeof(float), state.master_weight.data()));
  }
  if (state1_.data() != nullptr) {
    state.state1.resize(count);
    RETURN_IF_ERROR(backend_.CopyToHost(state1_, 0, count * sizeof(float), state.state1.data()));
  }
  if (state2_.data() != nullptr) {
    state.state2.resize(count);
    RETURN_IF_ERROR(backend_.CopyToHost(state2_, 0, count * sizeof(float), state.state2.data()));
  }
  return state;
}

void Head::Retire() {
  absl::WriterMutexLock lock(&weight_mu_);
  retired_ = true;
  absl::MutexLock grad_lock(&grad_mu_);
  DropAllStaged(StagedDrop::kHeadMoved);
}

absl::StatusOr<std::shared_ptr<Head>> HeadStore::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it != heads_.end()) return it->second;
  std::vector<std::string> names;
  for (const auto& [key, unused] : heads_) names.push_back(key);
  return absl::NotFoundError(
      absl::StrCat("head: no head named '", name,
                   "' (serving: ", names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
}

std::vector<std::shared_ptr<Head>> HeadStore::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Head>> heads;
  for (const auto& [unused, head] : heads_) heads.push_back(head);
  return heads;
}

void HeadStore::SetStagedDropObserver(std::function<void(StagedDrop, int)> observer) {
  absl::MutexLock lock(&mu_);
  drop_observer_ = std::move(observer);
  for (const auto& [unused, head] : heads_) head->SetStagedDropObserver(drop_observer_);
}

absl::Status HeadStore::Put(std::shared_ptr<Head> head, bool replace) {
  absl::MutexLock lock(&mu_);
  if (drop_observer_) head->SetStagedDropObserver(drop_observer_);
  auto [it, inserted] = heads_.try_emplace(head->name(), head);
  if (!inserted) {
    if (!replace) {
      return absl::AlreadyExistsError(
          absl::StrCat("head: '", head->name(), "' exists; set replace to overwrite it"));
    }
    it->second->Retire();
    it->second = std::move(head);
  }
  return absl::OkStatus();
}

bool HeadStore::Remove(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return false;
  it->second->Retire();
  heads_.erase(it);
  return true;
}

HeadState MakeDemoHead(const std::string& name, int64_t vocab_size, int64_t hidden_size,
                       DType dtype, uint64_t seed) {
  HeadState state;
  state.head = name;
  state.vocab_size = vocab_size;
  state.hidden_size = hidden_size;
  state.weight_dtype = dtype;
  state.version = 1;
  state.weight.resize(vocab_size * hidden_size * DTypeSize(dtype));
  // Uniform on [-1/sqrt(H), 1/sqrt(H)), torch.nn.Linear's default init, from a counter-based
  // generator: W fills in parallel and does not depend on the thread count.
  constexpr uint64_t kDemoHeadStream = 0x6c6f737364656d6fULL;  // "lossdemo"
  const uint64_t stream = seed ^ kDemoHeadStream;
  const float bound = 1.0f / std::sqrt(static_cast<float>(hidden_size));
  const int64_t count = vocab_size * hidden_size;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    StoreFromFloat(state.weight.data(), dtype, i, bound * CounterUniform(stream, i));
  }
  return state;
}

}  // namespace lossd::server
