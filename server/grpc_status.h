// The one place where absl::Status becomes grpc::Status.
#ifndef LOSSD_SERVER_GRPC_STATUS_H_
#define LOSSD_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace lossd::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The canonical code name ("OK", "INVALID_ARGUMENT", ...) used as a metrics label.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_GRPC_STATUS_H_
