// The heads of a replica group made the same on every replica when it forms: replica 0's.
#ifndef LOSSD_SERVER_REPLICAS_HEAD_SYNC_H_
#define LOSSD_SERVER_REPLICAS_HEAD_SYNC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "lossd/kernels/backend.h"
#include "server/heads/head_store.h"
#include "server/memory/memory_ledger.h"
#include "server/replicas/collective.h"

namespace lossd::server {

// Every replica calls it once the group has formed, before it serves. Replica 0 sends the list
// of its heads (name, shape, dtype, version, steps, optimizer, W's SHA-256, ...); a replica whose
// copy of a head differs in any of these, or lacks it, gets its W, master weights and optimizer
// state from replica 0, and a head replica 0 does not serve is dropped. So replicas need not
// start from the same files: replica 0's checkpoint (or --heads) is the group's, and a replica
// that resumed from an older checkpoint, or from none, catches up. `log` gets a line per head
// received or dropped.
absl::Status SyncHeadsFromReplicaZero(Collective& collective, HeadStore& heads, Backend& backend,
                                      MemoryLedger& ledger, absl::Duration timeout,
                                      std::vector<std::string>& log);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_REPLICAS_HEAD_SYNC_H_
