// Compute messages with their row bytes apart from the rest (bulk_fields.h): what the server reads
// and writes on a Compute stream, and what the C++ client writes and reads.
#ifndef LOSSD_PROTO_WIRE_COMPUTE_FRAMES_H_
#define LOSSD_PROTO_WIRE_COMPUTE_FRAMES_H_

#include <array>
#include <cstdint>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "lossd/v1/lossd.pb.h"
#include "proto/wire/bulk_fields.h"

namespace lossd::wire {

// ComputeChunk's fields that carry rows, in the order of ComputeRequestFrame::rows.
enum ChunkRowField : int {
  kHiddenRows,
  kTeacherHiddenRows,
  kTeacherTopKTokenRows,
  kTeacherTopKLogprobRows,
  kChunkRowFields,
};
inline constexpr int kChunkRowFieldNumbers[kChunkRowFields] = {
    v1::ComputeChunk::kHiddenFieldNumber,
    v1::ComputeChunk::kTeacherHiddenFieldNumber,
    v1::ComputeChunk::kTeacherTopKTokensFieldNumber,
    v1::ComputeChunk::kTeacherTopKLogprobsFieldNumber,
};
inline constexpr int kResultRowFieldNumbers[] = {v1::ComputeResult::kGradHiddenFieldNumber};

// A ComputeRequest: `message` without its chunk's row fields, which are in `rows`.
struct ComputeRequestFrame {
  static constexpr BulkFieldSpec kSpec{v1::ComputeRequest::kChunkFieldNumber,
                                       kChunkRowFieldNumbers};

  // The frame of a whole message (its row fields copied out), as tests and scripts write them.
  static ComputeRequestFrame FromMessage(v1::ComputeRequest message);
  absl::Status Decode(const grpc::ByteBuffer& buffer) {
    return DecodeWithBulk(buffer, kSpec, message, absl::MakeSpan(rows));
  }
  // A chunk's frame: rows beside a chunk whose other fields are in `message` (a start has none).
  grpc::ByteBuffer Encode() const;
  // Bytes on the wire, as protobuf would count them.
  int64_t ByteSize() const;
  // Bytes held in memory (what a call not yet admitted is charged for).
  int64_t SpaceUsed() const;

  v1::ComputeRequest message;
  std::array<BulkBytes, kChunkRowFields> rows;
};

// A ComputeResponse: `message` without its result's dL/dh, which is in `grad_hidden`.
struct ComputeResponseFrame {
  static constexpr BulkFieldSpec kSpec{v1::ComputeResponse::kResultFieldNumber,
                                       kResultRowFieldNumbers};

  absl::Status Decode(const grpc::ByteBuffer& buffer) {
    return DecodeWithBulk(buffer, kSpec, message, absl::MakeSpan(&grad_hidden, 1));
  }
  int64_t ByteSize() const;

  v1::ComputeResponse message;
  BulkBytes grad_hidden;
};

// `response` with `grad_hidden` as its result's dL/dh (a summary takes none).
grpc::ByteBuffer EncodeComputeResponse(const v1::ComputeResponse& response,
                                       const BulkBytes& grad_hidden);

}  // namespace lossd::wire

#endif  // LOSSD_PROTO_WIRE_COMPUTE_FRAMES_H_
