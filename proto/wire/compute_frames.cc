#include "proto/wire/compute_frames.h"

#include <string>
#include <utility>

#include <grpcpp/impl/codegen/proto_utils.h>

namespace lossd::wire {
namespace {

// A message without bulk fields, as gRPC itself would serialize it.
template <typename Message>
grpc::ByteBuffer EncodeWhole(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  (void)grpc::SerializationTraits<Message>::Serialize(message, &buffer, &own_buffer);
  return buffer;
}

std::string* MutableRowField(v1::ComputeChunk& chunk, int field) {
  switch (field) {
    case kHiddenRows: return chunk.mutable_hidden();
    case kTeacherHiddenRows: return chunk.mutable_teacher_hidden();
    case kTeacherTopKTokenRows: return chunk.mutable_teacher_top_k_tokens();
    case kTeacherTopKLogprobRows: return chunk.mutable_teacher_top_k_logprobs();
  }
  return chunk.mutable_hidden();
}

}  // namespace

ComputeRequestFrame ComputeRequestFrame::FromMessage(v1::ComputeRequest message) {
  ComputeRequestFrame frame;
  if (message.has_chunk()) {
    for (int field = 0; field < kChunkRowFields; ++field) {
      std::string* bytes = MutableRowField(*message.mutable_chunk(), field);
      frame.rows[field] = BulkBytes::Copy(*bytes);
      bytes->clear();
    }
  }
  frame.message = std::move(message);
  return frame;
}

grpc::ByteBuffer ComputeRequestFrame::Encode() const {
  if (!message.has_chunk()) return EncodeWhole(message);
  return EncodeWithBulk(kSpec, message.chunk(), rows);
}

int64_t ComputeRequestFrame::ByteSize() const {
  if (!message.has_chunk()) return static_cast<int64_t>(message.ByteSizeLong());
  return EncodedSizeWithBulk(kSpec, message.chunk(), rows);
}

int64_t ComputeRequestFrame::SpaceUsed() const {
  int64_t bytes = static_cast<int64_t>(message.SpaceUsedLong());
  for (const BulkBytes& field : rows) bytes += field.size();
  return bytes;
}

int64_t ComputeResponseFrame::ByteSize() const {
  if (!message.has_result()) return static_cast<int64_t>(message.ByteSizeLong());
  return EncodedSizeWithBulk(kSpec, message.result(), absl::MakeConstSpan(&grad_hidden, 1));
}

grpc::ByteBuffer EncodeComputeResponse(const v1::ComputeResponse& response,
                                       const BulkBytes& grad_hidden) {
  if (!response.has_result()) return EncodeWhole(response);
  return EncodeWithBulk(ComputeResponseFrame::kSpec, response.result(),
                        absl::MakeConstSpan(&grad_hidden, 1));
}

}  // namespace lossd::wire
