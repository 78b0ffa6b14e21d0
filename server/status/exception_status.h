// Exceptions as statuses, at the edges where the server's code meets a call: whatever a handler
// throws ends the call with a status (and its accounting), never with gRPC's bare UNKNOWN.
#ifndef LOSSD_SERVER_STATUS_EXCEPTION_STATUS_H_
#define LOSSD_SERVER_STATUS_EXCEPTION_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd::server {

// The exception being handled, as a status naming `where` it was thrown: std::bad_alloc is
// RESOURCE_EXHAUSTED, anything else INTERNAL. Only inside a catch block.
absl::Status CurrentExceptionStatus(absl::string_view where);

// `body()`, or the status of what it throws.
template <typename Body>
absl::Status CatchExceptions(absl::string_view where, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (...) {
    return CurrentExceptionStatus(where);
  }
}

}  // namespace lossd::server

#endif  // LOSSD_SERVER_STATUS_EXCEPTION_STATUS_H_
