#include "proto/wire/compute_frames.h"

#include <string>
#include <utility>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
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

std::optional<RowsInMessage> LeadingHiddenRows(absl::Span<const uint8_t> head, uint64_t length) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(head.data(), static_cast<int>(head.size()));
  const auto expect_length_delimited = [&](int field, uint64_t* value_length) {
    return in.ReadTag() ==
               WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED) &&
           in.ReadVarint64(value_length);
  };
  uint64_t chunk_length = 0;
  uint64_t hidden_length = 0;
  if (!expect_length_delimited(v1::ComputeRequest::kChunkFieldNumber, &chunk_length) ||
      chunk_length != length - static_cast<uint64_t>(in.CurrentPosition()) ||
      !expect_length_delimited(v1::ComputeChunk::kHiddenFieldNumber, &hidden_length)) {
    return std::nullopt;
  }
  const auto offset = static_cast<uint64_t>(in.CurrentPosition());
  if (hidden_length > length - offset || offset + hidden_length < head.size()) return std::nullopt;
  return RowsInMessage{offset, hidden_length};
}

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
