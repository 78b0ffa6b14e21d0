// Conversions between the wire contract (lossd.v1) and the engine's types, with validation that
// names the proto field and the value expected.
#ifndef LOSSD_SERVER_CALL_PROTO_CONVERT_H_
#define LOSSD_SERVER_CALL_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "lossd/kernels/backend.h"
#include "lossd/kernels/types.h"
#include "lossd/v1/lossd.pb.h"
#include "server/heads/head_store.h"

namespace lossd::server {

// DTYPE_UNSPECIFIED is refused unless `fallback` is given.
absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field,
                                std::optional<DType> fallback = std::nullopt);
v1::DType ToProto(DType dtype);

// Applies torch's defaults (ignore_index -100, temperature 1, grad_scale 1) and checks ranges.
absl::StatusOr<LossOptions> FromProto(const v1::LossOptions& options);

absl::StatusOr<OptimizerConfig> FromProto(const v1::StepRequest& request);

v1::HeadInfo ToProto(const HeadSummary& summary);

}  // namespace lossd::server

#endif  // LOSSD_SERVER_CALL_PROTO_CONVERT_H_
