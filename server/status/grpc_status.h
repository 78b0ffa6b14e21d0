// The one place where absl::Status becomes grpc::Status.
#ifndef LOSSD_SERVER_STATUS_GRPC_STATUS_H_
#define LOSSD_SERVER_STATUS_GRPC_STATUS_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd::server {

// Code and message as they are, and, when the status has a reason (ErrorReasonOf) or names a
// field (FieldOf), a v1::ErrorInfo in its details (an RpcStatus).
grpc::Status ToGrpcStatus(const absl::Status& status);
// The same as an RpcStatus (google.rpc.Status's wire format: code, message, the ErrorInfo if
// any), as the Compute socket's FRAME_STATUS carries it; empty for OK.
v1::RpcStatus ToRpcStatus(const absl::Status& status);
// The typed reason of a status, for ErrorInfo.reason.
v1::ErrorInfo::Reason ErrorReasonOf(const absl::Status& status);
// What a call this server made to another one (a replica) ended with.
absl::Status FromGrpcStatus(const grpc::Status& status);

// OK when `token` is empty or the call carries "authorization: Bearer <token>" (compared in
// constant time); UNAUTHENTICATED otherwise.
absl::Status CheckBearerToken(const grpc::ServerContextBase& context, absl::string_view token);
// Whether `presented` is `token`, compared in constant time.
bool TokenMatches(absl::string_view presented, absl::string_view token);

// The canonical code name ("OK", "INVALID_ARGUMENT", ...) used as a metrics label.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_STATUS_GRPC_STATUS_H_
