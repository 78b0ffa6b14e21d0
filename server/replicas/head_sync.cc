#include "server/replicas/head_sync.h"

#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/internal/v1/replica_group.pb.h"

namespace lossd::server {
namespace {

using Manifest = internal::v1::HeadManifest;

absl::StatusOr<Manifest> LocalManifest(HeadStore& heads) {
  Manifest manifest;
  for (const auto& head : heads.List()) {
    // W's digest is known for a head just loaded; hashing it otherwise is one pass over W.
    ASSIGN_OR_RETURN(const HeadSummary s, head->SummaryWithDigest());
    Manifest::Head* entry = manifest.add_heads();
    entry->set_name(s.name);
    entry->set_version(s.version);
    entry->set_steps(s.steps);
    entry->set_vocab_size(s.vocab_size);
    entry->set_hidden_size(s.hidden_size);
    entry->set_dtype(static_cast<int>(s.dtype));
    entry->set_optimizer(static_cast<int>(s.optimizer));
    entry->set_master_weights(s.master_weights);
    entry->set_tied_embeddings(s.tied_embeddings);
    entry->set_logit_softcap(s.logit_softcap);
    entry->set_weight_sha256(s.weight_sha256);
    entry->set_source(s.source);
  }
  return manifest;
}

// Whether `mine` is replica 0's `theirs` (its source aside: the same bytes may come from other
// paths).
bool SameHead(const Manifest::Head& mine, const Manifest::Head& theirs) {
  Manifest::Head a = mine, b = theirs;
  a.clear_source();
  b.clear_source();
  return a.SerializeAsString() == b.SerializeAsString();
}

// `bytes` from replica 0 into every replica's, sized by its length first.
absl::Status BroadcastString(Collective& collective, std::string& bytes, absl::Duration timeout) {
  uint64_t size = bytes.size();
  RETURN_IF_ERROR(collective.Broadcast(
      absl::MakeSpan(reinterpret_cast<uint8_t*>(&size), sizeof(size)), 0, timeout));
  bytes.resize(size);
  return collective.Broadcast(absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), size), 0,
                              timeout);
}

template <typename T>
absl::Status BroadcastVector(Collective& collective, std::vector<T>& values, size_t count,
                             absl::Duration timeout) {
  values.resize(count);
  return collective.Broadcast(
      absl::MakeSpan(reinterpret_cast<uint8_t*>(values.data()), count * sizeof(T)), 0, timeout);
}

}  // namespace

absl::Status SyncHeadsFromReplicaZero(Collective& collective, HeadStore& heads, Backend& backend,
                                      MemoryLedger& ledger, absl::Duration timeout,
                                      std::vector<std::string>& log) {
  ASSIGN_OR_RETURN(const Manifest mine, LocalManifest(heads));
  std::string bytes = collective.rank() == 0 ? mine.SerializeAsString() : std::string();
  RETURN_IF_ERROR(BroadcastString(collective, bytes, timeout));
  Manifest group;
  if (!group.ParseFromString(bytes)) {
    return absl::InternalError("replica group: replica 0's list of heads does not parse");
  }
  std::map<std::string, const Manifest::Head*> held;
  for (const Manifest::Head& head : mine.heads()) held[head.name()] = &head;
  // Which of replica 0's heads some replica lacks: every replica takes part in sending those.
  std::vector<double> needed(group.heads_size(), 0.0);
  for (int i = 0; i < group.heads_size(); ++i) {
    const auto it = held.find(group.heads(i).name());
    needed[i] = it == held.end() || !SameHead(*it->second, group.heads(i)) ? 1.0 : 0.0;
  }
  std::vector<double> needed_here = needed;
  if (!needed.empty()) RETURN_IF_ERROR(collective.AllReduceMax(absl::MakeSpan(needed), timeout));
  for (int i = 0; i < group.heads_size(); ++i) {
    if (needed[i] == 0.0) continue;
    const Manifest::Head& entry = group.heads(i);
    HeadState state;
    if (collective.rank() == 0) {
      ASSIGN_OR_RETURN(std::shared_ptr<Head> head, heads.Get(entry.name()));
      ASSIGN_OR_RETURN(state, head->ExportState());
    }
    const size_t count = static_cast<size_t>(entry.vocab_size() * entry.hidden_size());
    const DType dtype = static_cast<DType>(entry.dtype());
    const auto optimizer = static_cast<OptimizerKind>(entry.optimizer());
    RETURN_IF_ERROR(BroadcastVector(collective, state.weight, count * DTypeSize(dtype), timeout));
    if (entry.master_weights()) {
      RETURN_IF_ERROR(BroadcastVector(collective, state.master_weight, count, timeout));
    }
    if (optimizer != OptimizerKind::kNone) {
      RETURN_IF_ERROR(BroadcastVector(collective, state.state1, count, timeout));
    }
    if (optimizer == OptimizerKind::kAdamW) {
      RETURN_IF_ERROR(BroadcastVector(collective, state.state2, count, timeout));
    }
    if (collective.rank() == 0 || needed_here[i] == 0.0) continue;
    state.head = entry.name();
    state.version = entry.version();
    state.steps = entry.steps();
    state.vocab_size = entry.vocab_size();
    state.hidden_size = entry.hidden_size();
    state.weight_dtype = dtype;
    state.optimizer = optimizer;
    state.tied_embeddings = entry.tied_embeddings();
    state.logit_softcap = entry.logit_softcap();
    const std::string source = absl::StrCat("replica 0 (", entry.source(), ")");
    ASSIGN_OR_RETURN(std::shared_ptr<Head> head, Head::Create(backend, ledger, state, source));
    RETURN_IF_ERROR(heads.Put(std::move(head), /*replace=*/true));
    const auto it = held.find(entry.name());
    log.push_back(absl::StrCat(
        "head '", entry.name(), "' [", entry.vocab_size(), ", ", entry.hidden_size(),
        "] at version ", entry.version(), " from replica 0 (",
        it == held.end() ? "this replica had none"
                         : absl::StrCat("this replica's was at version ", it->second->version()),
        ")"));
  }
  for (const Manifest::Head& head : mine.heads()) {
    bool served = false;
    for (const Manifest::Head& theirs : group.heads()) served |= theirs.name() == head.name();
    if (!served && heads.Remove(head.name())) {
      log.push_back(absl::StrCat("head '", head.name(), "' dropped: replica 0 does not serve it"));
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd::server
