#include "server/status/grpc_status.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "lossd/common/status_macros.h"
#include "lossd/kernels/backend.h"
#include "server/heads/head_store.h"
#include "server/memory/scheduler.h"

namespace lossd::server {
namespace {

// Compares every byte whatever the first difference, so the time taken says nothing about the
// token.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= x ^ y;
  }
  return difference == 0;
}

}  // namespace

v1::ErrorInfo::Reason ErrorReasonOf(const absl::Status& status) {
  if (const std::optional<AdmissionRefusal> refusal = AdmissionRefusalOf(status)) {
    switch (*refusal) {
      case AdmissionRefusal::kQueueFull: return v1::ErrorInfo::QUEUE_FULL;
      case AdmissionRefusal::kOverBudget: return v1::ErrorInfo::OVER_BUDGET;
      case AdmissionRefusal::kPendingMemory: return v1::ErrorInfo::PENDING_MEMORY;
    }
  }
  if (IsDeviceFault(status)) return v1::ErrorInfo::DEVICE_FAULT;
  if (IsNonFiniteGradient(status)) return v1::ErrorInfo::NON_FINITE_GRADIENT;
  if (IsHeadMoved(status)) return v1::ErrorInfo::HEAD_MOVED;
  return v1::ErrorInfo::REASON_UNSPECIFIED;
}

v1::RpcStatus ToRpcStatus(const absl::Status& status) {
  v1::RpcStatus rpc_status;
  if (status.ok()) return rpc_status;
  // absl::StatusCode and grpc::StatusCode share the canonical numbering (0..16).
  rpc_status.set_code(static_cast<int32_t>(status.code()));
  rpc_status.set_message(std::string(status.message()));
  v1::ErrorInfo info;
  info.set_reason(ErrorReasonOf(status));
  info.set_field(FieldOf(status));
  if (info.reason() != v1::ErrorInfo::REASON_UNSPECIFIED || !info.field().empty()) {
    rpc_status.add_details()->PackFrom(info);
  }
  return rpc_status;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  v1::RpcStatus details = ToRpcStatus(status);
  const auto code = static_cast<grpc::StatusCode>(details.code());
  std::string message = details.message();
  if (details.details().empty()) return grpc::Status(code, std::move(message));
  return grpc::Status(code, std::move(message), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

bool TokenMatches(absl::string_view presented, absl::string_view token) {
  return ConstantTimeEquals(presented, token);
}

absl::Status CheckBearerToken(const grpc::ServerContextBase& context, absl::string_view token) {
  if (token.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  const absl::string_view presented = it == metadata.end()
                                          ? absl::string_view()
                                          : absl::string_view(it->second.data(), it->second.size());
  if (!ConstantTimeEquals(presented, absl::StrCat("Bearer ", token))) {
    return absl::UnauthenticatedError(
        "authorization: expected metadata \"authorization: Bearer <token>\" with the server's "
        "token");
  }
  return absl::OkStatus();
}

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

}  // namespace lossd::server
